#include "server/shm_channel.h"

#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <optional>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "wire/chunk_check.h"
#include "server/metrics.h"
#include "server/service.h"
#include "spdlog/spdlog.h"
#include "tiering/placement_engine.h"

namespace kvtier::server {

absl::StatusOr<int> ListenUnixOwnerOnly(const std::string& path) {
  sockaddr_un addr{};
  if (path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat("socket path too long: ", path));
  }
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::InternalError(absl::StrCat("socket: ", std::strerror(errno)));
  struct stat st;
  if (::lstat(path.c_str(), &st) == 0 && S_ISSOCK(st.st_mode)) ::unlink(path.c_str());
  mode_t old = ::umask(0077);
  int rc = ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  ::umask(old);
  if (rc != 0 || ::chmod(path.c_str(), 0600) != 0 || ::listen(fd, 64) != 0) {
    int e = errno;
    ::close(fd);
    return absl::FailedPreconditionError(absl::StrCat("listen on ", path, ": ", std::strerror(e)));
  }
  return fd;
}


namespace {

using wire::shm::Op;
using Clock = std::chrono::steady_clock;

// Buffered reads of one connection's frames: one recv takes whatever the
// client has sent (several progress messages of a put at once, say).
class FrameReader {
 public:
  FrameReader(int fd, int timeout_ms) : fd_(fd), timeout_ms_(timeout_ms) {}

  // Makes `n` bytes available at data(). An idle connection (nothing
  // buffered) may wait indefinitely for its next frame when `idle_ok`,
  // polling without sleeping for the first `spin_us`; the rest of a frame
  // must arrive within the timeout. False on EOF, an error or the timeout.
  // REQUIRES: n <= kBufferBytes.
  bool Fill(size_t n, bool idle_ok, int64_t spin_us = 0) {
    if (end_ - begin_ >= n) return true;
    if (begin_ > 0) {
      std::memmove(buf_, buf_ + begin_, end_ - begin_);
      end_ -= begin_;
      begin_ = 0;
    }
    // A client in the middle of a put or a get sends its next frame within
    // microseconds: polling for it costs less than a sleep and a wakeup,
    // which on a VM is an inter-processor interrupt and a VM exit.
    if (end_ == 0 && idle_ok && spin_us > 0) {
      const auto until = Clock::now() + std::chrono::microseconds(spin_us);
      do {
        ssize_t k = ::recv(fd_, buf_, sizeof(buf_), MSG_DONTWAIT);
        if (k > 0) {
          end_ = static_cast<size_t>(k);
          break;
        }
        if (k == 0) return false;
        if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) return false;
      } while (Clock::now() < until);
    }
    while (end_ < n) {
      const int flags = (end_ == 0 && idle_ok) ? 0 : MSG_DONTWAIT;
      ssize_t k = ::recv(fd_, buf_ + end_, sizeof(buf_) - end_, flags);
      if (k > 0) {
        end_ += static_cast<size_t>(k);
        continue;
      }
      if (k == 0) return false;
      if (errno == EINTR) continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK) return false;
      pollfd pf{fd_, POLLIN, 0};
      int r = ::poll(&pf, 1, timeout_ms_);
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0) return false;
    }
    return true;
  }
  const uint8_t* data() const { return buf_ + begin_; }
  void Consume(size_t n) {
    begin_ += n;
    if (begin_ == end_) begin_ = end_ = 0;
  }

  static constexpr size_t kBufferBytes = 4096;

 private:
  const int fd_;
  const int timeout_ms_;
  uint8_t buf_[kBufferBytes];
  size_t begin_ = 0, end_ = 0;
};

// One answer frame; false if it could not be sent (the peer is gone).
bool Answer(int fd, uint16_t op, const absl::Status& st, const uint8_t* payload, uint32_t n) {
  uint8_t buf[wire::shm::kResponseHeaderBytes + wire::shm::kMaxErrorMessageBytes];
  absl::string_view msg = st.message().substr(0, wire::shm::kMaxErrorMessageBytes);
  if (!st.ok()) {
    payload = reinterpret_cast<const uint8_t*>(msg.data());
    n = static_cast<uint32_t>(msg.size());
  }
  wire::shm::Writer w(buf);
  w.U16(wire::shm::kVersion).U16(op).U32(static_cast<uint32_t>(st.code())).U32(n).Raw(payload, n);
  // The socket has a send timeout, so a signal interrupts send() even under
  // SA_RESTART (socket(7)); tests saw EINTR on such sockets in this process.
  // Retry, and finish a partial write.
  for (size_t sent = 0; sent < w.size();) {
    const ssize_t k = ::send(fd, buf + sent, w.size() - sent, MSG_NOSIGNAL);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) return false;
    sent += static_cast<size_t>(k);
  }
  return true;
}

uint8_t TierNumber(tiering::TierKind k) {  // proto Tier numbering
  switch (k) {
    case tiering::TierKind::kHbm: return 1;
    case tiering::TierKind::kDram: return 2;
    case tiering::TierKind::kNvme: return 3;
    case tiering::TierKind::kRemote: return 4;
  }
  return 0;
}

absl::StatusOr<std::optional<tiering::TierKind>> TierOf(uint8_t t) {
  switch (t) {
    case 0: return std::optional<tiering::TierKind>();
    case 1: return std::optional<tiering::TierKind>(tiering::TierKind::kHbm);
    case 2: return std::optional<tiering::TierKind>(tiering::TierKind::kDram);
    case 3: return std::optional<tiering::TierKind>(tiering::TierKind::kNvme);
    case 4: return std::optional<tiering::TierKind>(tiering::TierKind::kRemote);
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown tier ", t));
}

double SecondsSince(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

}  // namespace

struct ShmChannel::Conn {
  int fd = -1;
  std::thread thread;
  std::atomic<bool> done{false};
};

absl::StatusOr<std::unique_ptr<ShmChannel>> ShmChannel::Start(const std::string& path, int fd,
                                                              uint64_t size,
                                                              ServerMetrics* metrics,
                                                              KvService* service,
                                                              ShmChannelOptions options) {
  auto lfd = ListenUnixOwnerOnly(path);
  if (!lfd.ok()) return lfd.status();
  int p[2];
  if (::pipe2(p, O_CLOEXEC) != 0) {
    ::close(*lfd);
    return absl::InternalError(absl::StrCat("pipe: ", std::strerror(errno)));
  }
  return std::unique_ptr<ShmChannel>(
      new ShmChannel(path, *lfd, p, fd, size, metrics, service, options));
}

int ResolvePutCheckThreads(int option) {
  if (option > 0) return option;
  return std::thread::hardware_concurrency() >= 4 ? 2 : 1;
}

ShmChannel::ShmChannel(std::string path, int listen_fd, int stop_fd[2], int fd, uint64_t size,
                       ServerMetrics* metrics, KvService* service, ShmChannelOptions options)
    : path_(std::move(path)), listen_fd_(listen_fd), stop_pipe_{stop_fd[0], stop_fd[1]}, fd_(fd),
      size_(size),
      metrics_(metrics),
      service_(service),
      options_(options),
      put_check_threads_(ResolvePutCheckThreads(options.put_check_threads)) {
  thread_ = std::thread([this] { Loop(); });
}

ShmChannel::~ShmChannel() {
  char c = 0;
  (void)!::write(stop_pipe_[1], &c, 1);
  thread_.join();
  std::list<std::unique_ptr<Conn>> conns;
  {
    absl::MutexLock l(&mu_);
    stopping_ = true;
    // Wakes each connection's thread (its recv returns 0); it frees what
    // the connection held and ends.
    for (auto& conn : conns_) ::shutdown(conn->fd, SHUT_RDWR);
    conns.swap(conns_);
  }
  for (auto& conn : conns) {
    conn->thread.join();
    ::close(conn->fd);
  }
  ::close(listen_fd_);
  ::close(stop_pipe_[0]);
  ::close(stop_pipe_[1]);
  ::unlink(path_.c_str());
}

int ShmChannel::connections() {
  absl::MutexLock l(&mu_);
  ReapFinished();
  return static_cast<int>(conns_.size());
}

void ShmChannel::ReapFinished() {
  for (auto it = conns_.begin(); it != conns_.end();) {
    if ((*it)->done.load()) {
      (*it)->thread.join();
      ::close((*it)->fd);
      it = conns_.erase(it);
    } else {
      ++it;
    }
  }
}

void ShmChannel::Loop() {
  for (;;) {
    pollfd fds[2] = {{listen_fd_, POLLIN, 0}, {stop_pipe_[0], POLLIN, 0}};
    if (::poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      return;
    }
    if (fds[1].revents != 0) return;
    if ((fds[0].revents & POLLIN) == 0) continue;
    int c = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (c < 0) continue;
    ucred cred{};
    socklen_t len = sizeof(cred);
    if (::getsockopt(c, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0 || cred.uid != ::geteuid()) {
      ::close(c);
    } else if (!Adopt(c)) {
      // At the limit (or stopping): the pool, but no data plane; the client
      // sees the end of the stream where it sent kHello.
      (void)SendPool(c);
      ::close(c);
    }
  }
}

bool ShmChannel::SendPool(int c) {
  wire::shm::PoolMessage m;
  m.size = size_;
  cmsghdr* cm = CMSG_FIRSTHDR(&m.msg);
  cm->cmsg_level = SOL_SOCKET;
  cm->cmsg_type = SCM_RIGHTS;
  cm->cmsg_len = CMSG_LEN(sizeof(int));
  std::memcpy(CMSG_DATA(cm), &fd_, sizeof(int));
  ssize_t n;
  do {
    n = ::sendmsg(c, &m.msg, MSG_NOSIGNAL);
  } while (n < 0 && errno == EINTR);
  if (n != static_cast<ssize_t>(sizeof(m.size))) {
    spdlog::warn("{}: passing the pool descriptor failed ({} bytes sent): {}", path_, n,
                 n < 0 ? std::strerror(errno) : "short write");
    return false;
  }
  metrics_->Add(ServerMetric::kShmMaps);
  return true;
}

bool ShmChannel::Adopt(int c) {
  absl::MutexLock l(&mu_);
  ReapFinished();
  if (service_ == nullptr || stopping_ ||
      conns_.size() >= static_cast<size_t>(std::max(0, options_.max_connections))) {
    return false;
  }
  // A client that stops reading its answers gets its connection closed
  // (the thread's send fails) instead of holding the thread.
  timeval tv{options_.frame_timeout_ms / 1000, (options_.frame_timeout_ms % 1000) * 1000};
  ::setsockopt(c, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  auto conn = std::make_unique<Conn>();
  conn->fd = c;
  Conn* p = conn.get();
  conns_.push_back(std::move(conn));
  // The connection is counted before its client has the pool, so a client
  // that has it and closes is never counted afterwards.
  p->thread = std::thread([this, p] {
    pthread_setname_np(pthread_self(), "kvtierd-shm");
    if (SendPool(p->fd)) {
      Serve(p);
    } else {
      ::shutdown(p->fd, SHUT_RDWR);
      p->done.store(true);
    }
  });
  return true;
}

void ShmChannel::Serve(Conn* conn) {
  using wire::shm::kRequestHeaderBytes;
  const int fd = conn->fd;
  FrameReader in(fd, options_.frame_timeout_ms);
  // What this connection holds (id -> expiry, engine clock), freed when it
  // closes. Ids are scoped to the connection: release, abort and put begin
  // take only ids from these maps; any other id gets the answer of an
  // unknown one.
  absl::flat_hash_map<uint64_t, int64_t> slots, leases;
  struct OpenPut {
    uint64_t slot_id = 0;
    PutArgs args;
    std::unique_ptr<wire::IncrementalChunkCheck> check;
    absl::Status error;  // the put's first error, answered at its commit
    Clock::time_point t0;
  };
  // The helper that hashes a put's V section (put_check_threads 2), made at
  // the connection's first put. Declared before `put`, so that a put still
  // open when the connection closes abandons its job before the helper ends.
  std::unique_ptr<wire::TrailingHasher> put_hasher;
  std::optional<OpenPut> put;
  auto room = [&] {
    if (slots.size() + leases.size() < options_.max_open_per_connection) return true;
    const int64_t now = tiering::SystemClock()->NowMicros();
    absl::erase_if(slots, [now](const auto& e) { return e.second < now; });
    absl::erase_if(leases, [now](const auto& e) { return e.second < now; });
    return slots.size() + leases.size() < options_.max_open_per_connection;
  };
  auto full = [&] {
    return absl::ResourceExhaustedError(absl::StrCat(
        "this connection holds ", slots.size() + leases.size(), " slots and leases; the limit is ",
        options_.max_open_per_connection));
  };
  // Records the open put's first error and frees its slot (if it is this
  // connection's: another connection's slot is never touched).
  auto fail_put = [&](absl::Status st) {
    put->error = std::move(st);
    put->check.reset();
    if (slots.erase(put->slot_id) > 0) (void)service_->AbortSlot(put->slot_id);
  };
  for (;;) {
    if (!in.Fill(kRequestHeaderBytes, /*idle_ok=*/true,
                 put ? options_.put_spin_us : options_.spin_us)) {
      break;
    }
    wire::shm::Reader h(in.data());
    const uint16_t version = h.U16(), op = h.U16();
    const uint32_t len = h.U32();
    const int64_t want = wire::shm::RequestBytes(op);
    absl::Status violation;
    if (version != wire::shm::kVersion) {
      violation = absl::InvalidArgumentError(absl::StrCat(
          "data-plane protocol version ", version, " not served; this daemon speaks ",
          wire::shm::kVersion));
    } else if (want < 0) {
      violation = absl::InvalidArgumentError(absl::StrCat("unknown data-plane op ", op));
    } else if (len != want) {
      violation = absl::InvalidArgumentError(
          absl::StrCat("data-plane op ", op, " with ", len, " payload bytes; it takes ", want));
    } else if ((op == static_cast<uint16_t>(Op::kPutProgress) ||
                op == static_cast<uint16_t>(Op::kPutRange) ||
                op == static_cast<uint16_t>(Op::kPutCommit)) &&
               !put) {
      violation = absl::FailedPreconditionError(absl::StrCat("data-plane op ", op, " outside a put"));
    } else if (op == static_cast<uint16_t>(Op::kPutBegin) && put) {
      violation = absl::FailedPreconditionError(
          absl::StrCat("put begun inside the put of slot ", put->slot_id));
    }
    if (!violation.ok()) {
      (void)Answer(fd, op, violation, nullptr, 0);
      break;
    }
    in.Consume(kRequestHeaderBytes);
    if (!in.Fill(len, /*idle_ok=*/false)) break;  // truncated frame
    uint8_t payload[wire::shm::kMaxRequestPayloadBytes];
    std::memcpy(payload, in.data(), len);
    in.Consume(len);
    wire::shm::Reader r(payload);
    uint8_t reply[std::max(wire::shm::kSlotReplyBytes, wire::shm::kGetReplyBytes)];
    wire::shm::Writer w(reply);
    absl::Status st;
    const auto t0 = Clock::now();
    switch (static_cast<Op>(op)) {
      case Op::kHello:
        break;
      case Op::kAllocate: {
        const uint64_t bytes = r.U64();
        const uint32_t ttl_ms = r.U32();
        if (!room()) {
          st = full();
        } else {
          auto slot = service_->AllocateSlot(bytes, ttl_ms);
          st = slot.status();
          if (slot.ok()) {
            slots[slot->id] = slot->expires_at_us;
            w.U64(slot->id).U64(slot->extent.offset).U64(slot->extent.length);
            w.U64(static_cast<uint64_t>(slot->expires_at_us));
          }
        }
        metrics_->Record(Method::kAllocateSlot, static_cast<int>(st.code()), SecondsSince(t0));
        break;
      }
      case Op::kPutBegin: {
        put.emplace();
        put->t0 = t0;
        put->slot_id = r.U64();
        r.Raw(put->args.key.bytes.data(), wire::shm::kKeyBytes);
        const uint8_t durable = r.U8(), tier = r.U8();
        const uint16_t zero = r.U16();
        put->args.durable = durable != 0;
        auto t = TierOf(tier);
        absl::Status bad = t.status();
        if (bad.ok() && (durable > 1 || zero != 0)) {
          bad = absl::InvalidArgumentError("put begin with nonzero reserved bytes");
        }
        if (!bad.ok()) {
          fail_put(std::move(bad));
          continue;  // no answer
        }
        put->args.tier = *t;
        if (!slots.contains(put->slot_id)) {
          fail_put(UnknownSlotError(put->slot_id));
          continue;  // no answer
        }
        if (put_check_threads_ >= 2 && !put_hasher) {
          put_hasher = std::make_unique<wire::TrailingHasher>();
        }
        auto check = service_->BeginStreamedCommit(put->slot_id, put_hasher.get());
        if (!check.ok()) {
          fail_put(check.status());
        } else {
          put->check = std::move(*check);
        }
        continue;  // no answer
      }
      case Op::kPutProgress: {
        const uint64_t n = r.U64();
        if (put->error.ok()) {
          absl::Status a = put->check->Advance(n);
          if (!a.ok()) fail_put(std::move(a));
        }
        continue;  // no answer
      }
      case Op::kPutRange: {
        const uint64_t offset = r.U64(), length = r.U64();
        if (put->error.ok()) {
          absl::Status a = put->check->AdvanceRange(offset, length);
          if (!a.ok()) fail_put(std::move(a));
        }
        continue;  // no answer
      }
      case Op::kPutCommit: {
        const uint64_t n = r.U64();
        if (put->error.ok()) {
          absl::Status a = put->check->Advance(n);
          if (!a.ok()) fail_put(std::move(a));
        }
        st = put->error;
        if (st.ok()) {
          st = service_->FinishStreamedCommit(put->args, put->slot_id, *put->check);
          slots.erase(put->slot_id);
          if (st.ok()) metrics_->Add(ServerMetric::kBytesPutShm, n);
        }
        metrics_->Record(Method::kPut, static_cast<int>(st.code()), SecondsSince(put->t0));
        put.reset();
        break;
      }
      case Op::kGet: {
        Hash128 key;
        r.Raw(key.bytes.data(), wire::shm::kKeyBytes);
        const uint32_t lease_ms = r.U32();
        const uint8_t verify = r.U8(), z0 = r.U8(), z1 = r.U8(), z2 = r.U8();
        if (verify > 1 || (z0 | z1 | z2) != 0) {
          st = absl::InvalidArgumentError("get with nonzero reserved bytes");
        } else if (!room()) {
          st = full();
        } else {
          auto g = service_->Get(key, GetMode::kShm, 0, lease_ms, verify != 0);
          st = g.status();
          if (g.ok()) {
            if (g->lease_id != 0) leases[g->lease_id] = g->expires_at_us;
            if (g->scratch_slot_id != 0) slots[g->scratch_slot_id] = g->expires_at_us;
            w.U8(TierNumber(g->tier)).U8(0).U16(0).U32(0).U64(g->chunk_bytes);
            w.U64(g->extent.offset).U64(g->extent.length).U64(g->lease_id).U64(g->scratch_slot_id);
            metrics_->Add(ServerMetric::kBytesGetShm, g->chunk_bytes);
          }
        }
        metrics_->Record(Method::kGet, static_cast<int>(st.code()), SecondsSince(t0));
        break;
      }
      case Op::kRelease: {
        const uint64_t id = r.U64();
        st = leases.erase(id) > 0 ? service_->Release(id) : UnknownLeaseError(id);
        metrics_->Record(Method::kRelease, static_cast<int>(st.code()), SecondsSince(t0));
        break;
      }
      case Op::kAbortSlot: {
        const uint64_t id = r.U64();
        st = slots.erase(id) > 0 ? service_->AbortSlot(id) : UnknownSlotError(id);
        metrics_->Record(Method::kAbortSlot, static_cast<int>(st.code()), SecondsSince(t0));
        break;
      }
    }
    if (!Answer(fd, op, st, reply, st.ok() ? static_cast<uint32_t>(w.size()) : 0)) break;
  }
  // The client is gone (or broke the protocol): free what it held (the slot
  // of a put still open included).
  for (const auto& [id, expiry] : slots) (void)service_->AbortSlot(id);
  for (const auto& [id, expiry] : leases) (void)service_->Release(id);
  ::shutdown(fd, SHUT_RDWR);  // the peer sees the end now; the fd is closed when reaped
  conn->done.store(true);
}

}  // namespace kvtier::server
