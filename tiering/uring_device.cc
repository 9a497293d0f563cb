// io_uring + O_DIRECT block devices (the production IoEnv).
//
// Each Submit call borrows an io_uring from a small per-device pool, so
// concurrent callers never share a submission queue and no lock is held while
// I/O is in flight.
#include <fcntl.h>
#include <liburing.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <deque>

#include "absl/strings/str_cat.h"
#include "common/file.h"
#include "common/status.h"
#include "tiering/io.h"

namespace kvtier::tiering {
namespace {

absl::Status IoErrno(int err, const char* what) {
  if (err == ENOSPC || err == EDQUOT) return absl::ResourceExhaustedError(absl::StrCat(what, ": ", strerror(err)));
  if (err == EAGAIN || err == EBUSY || err == EINTR) return absl::UnavailableError(absl::StrCat(what, ": ", strerror(err)));
  if (err == EINVAL) return absl::InvalidArgumentError(absl::StrCat(what, ": ", strerror(err)));
  return absl::InternalError(absl::StrCat(what, ": ", strerror(err)));
}

class UringDevice : public BlockDevice {
 public:
  UringDevice(int fd, uint64_t size, const IoEnvOptions& o) : fd_(fd), size_(size), opt_(o) {}
  ~UringDevice() override {
    absl::MutexLock l(&mu_);
    for (auto& r : rings_) io_uring_queue_exit(r.get());
    close(fd_);
  }
  uint64_t block_size() const override { return opt_.block_size; }
  uint64_t size() const override { return size_; }

  absl::Status Submit(std::span<const IoRequest> reqs) override { return SubmitOn(reqs, nullptr); }
  absl::Status SubmitWithCompletions(std::span<const IoRequest> reqs,
                                     CompletionFn on_complete) override {
    return SubmitOn(reqs, &on_complete);
  }

  absl::Status Sync() override {
    if (fdatasync(fd_) != 0) return IoErrno(errno, "fdatasync");
    return absl::OkStatus();
  }

 private:
  struct Pending {
    const IoRequest* req;
    uint64_t done;
  };

  absl::Status SubmitOn(std::span<const IoRequest> reqs, const CompletionFn* on_complete) {
    for (const IoRequest& r : reqs) {
      const uint64_t m = opt_.block_size - 1;
      if ((r.offset & m) || (r.len & m) || (reinterpret_cast<uintptr_t>(r.buf) & m) ||
          r.offset + r.len > size_) {
        return absl::InvalidArgumentError("misaligned or out-of-range block request");
      }
    }
    auto ring_or = GetRing();
    if (!ring_or.ok()) return ring_or.status();
    std::unique_ptr<io_uring> ring = std::move(*ring_or);
    absl::Status st = Run(ring.get(), reqs, on_complete);
    PutRing(std::move(ring));
    return st;
  }

  absl::StatusOr<std::unique_ptr<io_uring>> GetRing() {
    {
      absl::MutexLock l(&mu_);
      if (!rings_.empty()) {
        auto r = std::move(rings_.back());
        rings_.pop_back();
        return r;
      }
    }
    auto ring = std::make_unique<io_uring>();
    int rc = io_uring_queue_init(opt_.queue_depth, ring.get(), 0);
    if (rc < 0) return IoErrno(-rc, "io_uring_queue_init");
    return ring;
  }
  void PutRing(std::unique_ptr<io_uring> r) {
    absl::MutexLock l(&mu_);
    rings_.push_back(std::move(r));
  }

  // Runs `reqs` on `ring`, reporting full completions to `on_complete` if
  // not null.
  absl::Status Run(io_uring* ring, std::span<const IoRequest> reqs, const CompletionFn* on_complete) {
    std::deque<Pending> todo;
    for (const IoRequest& r : reqs) todo.push_back({&r, 0});
    std::vector<Pending> slots(opt_.queue_depth);
    std::vector<uint32_t> free_slots;
    for (uint32_t i = 0; i < opt_.queue_depth; ++i) free_slots.push_back(i);
    uint32_t inflight = 0;
    absl::Status first_error;
    std::vector<size_t> completed;  // reaped, not yet reported
    while (!todo.empty() || inflight > 0 || !completed.empty()) {
      uint32_t queued = 0;
      while (!todo.empty() && !free_slots.empty() && first_error.ok()) {
        io_uring_sqe* sqe = io_uring_get_sqe(ring);
        if (sqe == nullptr) break;
        uint32_t slot = free_slots.back();
        free_slots.pop_back();
        slots[slot] = todo.front();
        todo.pop_front();
        const IoRequest* r = slots[slot].req;
        uint64_t done = slots[slot].done;
        if (r->op == IoRequest::Op::kRead) {
          io_uring_prep_read(sqe, fd_, r->buf + done, r->len - done, r->offset + done);
        } else {
          io_uring_prep_write(sqe, fd_, r->buf + done, r->len - done, r->offset + done);
        }
        io_uring_sqe_set_data64(sqe, slot);
        ++queued;
      }
      if (!first_error.ok()) {
        todo.clear();
        completed.clear();
      }
      if (!completed.empty()) {
        // Refill the queue first, so that the caller's work on the completed
        // requests overlaps the I/O still in flight.
        if (queued > 0) {
          int rc = io_uring_submit(ring);
          if (rc < 0 && rc != -EINTR) {
            first_error = IoErrno(-rc, "io_uring_submit");
            completed.clear();
          } else {
            inflight += queued;
          }
          queued = 0;
        }
        for (size_t i : completed) (*on_complete)(i);
        completed.clear();
      }
      if (queued == 0 && inflight == 0) break;
      int rc = io_uring_submit_and_wait(ring, inflight + queued > 0 ? 1 : 0);
      if (rc < 0 && rc != -EINTR) {
        // Nothing was submitted; reap what is in flight and fail.
        first_error = IoErrno(-rc, "io_uring_submit");
        if (inflight == 0) break;
      } else {
        inflight += queued;
      }
      io_uring_cqe* cqe;
      unsigned head, seen = 0;
      io_uring_for_each_cqe(ring, head, cqe) {
        ++seen;
        uint32_t slot = static_cast<uint32_t>(io_uring_cqe_get_data64(cqe));
        Pending p = slots[slot];
        free_slots.push_back(slot);
        --inflight;
        if (cqe->res < 0) {
          if (first_error.ok()) first_error = IoErrno(-cqe->res, p.req->op == IoRequest::Op::kRead ? "read" : "write");
          continue;
        }
        if (cqe->res == 0) {
          if (first_error.ok()) first_error = absl::DataLossError("short I/O: end of file");
          continue;
        }
        p.done += static_cast<uint64_t>(cqe->res);
        if (p.done < p.req->len) {
          todo.push_front(p);  // resubmit the remainder
        } else if (on_complete != nullptr) {
          completed.push_back(static_cast<size_t>(p.req - reqs.data()));
        }
      }
      io_uring_cq_advance(ring, seen);
    }
    return first_error;
  }

  const int fd_;
  const uint64_t size_;
  const IoEnvOptions opt_;
  absl::Mutex mu_;
  std::vector<std::unique_ptr<io_uring>> rings_ ABSL_GUARDED_BY(mu_);
};

class UringIoEnv : public IoEnv {
 public:
  explicit UringIoEnv(const IoEnvOptions& o) : opt_(o) {}
  absl::StatusOr<std::unique_ptr<BlockDevice>> OpenDevice(const std::string& path,
                                                          uint64_t size) override {
    if (size % opt_.block_size != 0) return absl::InvalidArgumentError("device size not block-aligned");
    int fd = open(path.c_str(), O_RDWR | O_CREAT | O_DIRECT | O_CLOEXEC, 0600);
    if (fd < 0) {
      if (errno == EINVAL) return absl::FailedPreconditionError(absl::StrCat(path, ": O_DIRECT not supported"));
      return ErrnoToStatus(errno, path);
    }
    struct stat st;
    if (fstat(fd, &st) != 0) {
      int e = errno;
      close(fd);
      return ErrnoToStatus(e, path);
    }
    if (static_cast<uint64_t>(st.st_size) > size) {
      // A smaller capacity than before: the tier reclaims extents past the
      // end before it uses them, so shrinking the file is safe here.
      if (ftruncate(fd, static_cast<off_t>(size)) != 0) {
        int e = errno;
        close(fd);
        return IoErrno(e, "ftruncate");
      }
    }
    int rc = posix_fallocate(fd, 0, static_cast<off_t>(size));
    if (rc == EOPNOTSUPP || rc == EINVAL) {
      if (ftruncate(fd, static_cast<off_t>(size)) != 0) rc = errno; else rc = 0;
    }
    if (rc != 0) {
      close(fd);
      return IoErrno(rc, "fallocate");
    }
    return std::unique_ptr<BlockDevice>(new UringDevice(fd, size, opt_));
  }
  absl::Status RemoveFile(const std::string& path) override {
    if (unlink(path.c_str()) != 0 && errno != ENOENT) return ErrnoToStatus(errno, path);
    return absl::OkStatus();
  }

 private:
  const IoEnvOptions opt_;
};

}  // namespace

std::unique_ptr<IoEnv> NewUringIoEnv(const IoEnvOptions& options) {
  return std::make_unique<UringIoEnv>(options);
}

}  // namespace kvtier::tiering
