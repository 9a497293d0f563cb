// In-memory and fault-injecting IoEnvs, aligned buffers and clocks.
#include "tiering/io.h"

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "absl/strings/str_cat.h"

// A local variant of KVTIER_RETURN_IF_ERROR with its own variable name.
#define KVTIER_RETURN_IF_ERROR_IO(expr) \
  do {                                  \
    absl::Status io_status_ = (expr);   \
    if (!io_status_.ok()) return io_status_; \
  } while (0)

namespace kvtier::tiering {

AlignedBuffer::AlignedBuffer(uint64_t size, uint64_t alignment) {
  uint64_t rounded = (size + alignment - 1) / alignment * alignment;
  if (rounded == 0) rounded = alignment;
  data_ = static_cast<uint8_t*>(std::aligned_alloc(alignment, rounded));
  size_ = data_ ? size : 0;
}
AlignedBuffer& AlignedBuffer::operator=(AlignedBuffer&& o) noexcept {
  if (this != &o) {
    std::free(data_);
    data_ = o.data_;
    size_ = o.size_;
    o.data_ = nullptr;
    o.size_ = 0;
  }
  return *this;
}
AlignedBuffer::~AlignedBuffer() { std::free(data_); }

absl::Status BlockDevice::SubmitWithCompletions(std::span<const IoRequest> requests,
                                                CompletionFn on_complete) {
  KVTIER_RETURN_IF_ERROR_IO(Submit(requests));
  for (size_t i = 0; i < requests.size(); ++i) on_complete(i);
  return absl::OkStatus();
}

namespace {
absl::Status CheckRequest(const IoRequest& r, uint64_t block, uint64_t size) {
  if ((r.offset % block) || (r.len % block) || r.offset + r.len > size || r.buf == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("misaligned or out-of-range request at ", r.offset, "+", r.len));
  }
  return absl::OkStatus();
}
}  // namespace

// ---------------------------------------------------------------- MemIoEnv

struct MemIoEnv::File {
  absl::Mutex mu;
  std::vector<uint8_t> data ABSL_GUARDED_BY(mu);
  // Prior bytes of each write since the last Sync, oldest first.
  std::vector<std::pair<uint64_t, std::vector<uint8_t>>> unsynced ABSL_GUARDED_BY(mu);

  void Revert() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    for (auto it = unsynced.rbegin(); it != unsynced.rend(); ++it) {
      std::memcpy(data.data() + it->first, it->second.data(), it->second.size());
    }
    unsynced.clear();
  }
};

namespace {
class MemDevice : public BlockDevice {
 public:
  MemDevice(std::shared_ptr<MemIoEnv::File> f, uint64_t block, uint64_t size)
      : f_(std::move(f)), block_(block), size_(size) {}
  uint64_t block_size() const override { return block_; }
  uint64_t size() const override { return size_; }
  absl::Status Submit(std::span<const IoRequest> reqs) override {
    for (const IoRequest& r : reqs) KVTIER_RETURN_IF_ERROR_IO(CheckRequest(r, block_, size_));
    absl::MutexLock l(&f_->mu);
    for (const IoRequest& r : reqs) {
      uint8_t* dev = f_->data.data() + r.offset;
      if (r.op == IoRequest::Op::kRead) {
        std::memcpy(r.buf, dev, r.len);
      } else {
        f_->unsynced.emplace_back(r.offset, std::vector<uint8_t>(dev, dev + r.len));
        std::memcpy(dev, r.buf, r.len);
      }
    }
    return absl::OkStatus();
  }
  absl::Status Sync() override {
    absl::MutexLock l(&f_->mu);
    f_->unsynced.clear();
    return absl::OkStatus();
  }

 private:
  std::shared_ptr<MemIoEnv::File> f_;
  const uint64_t block_;
  const uint64_t size_;
};
}  // namespace

absl::StatusOr<std::unique_ptr<BlockDevice>> MemIoEnv::OpenDevice(const std::string& path,
                                                                  uint64_t size) {
  if (size % block_size_ != 0) return absl::InvalidArgumentError("device size not block-aligned");
  std::shared_ptr<File> f;
  {
    absl::MutexLock l(&mu_);
    auto& slot = files_[path];
    if (!slot) slot = std::make_shared<File>();
    f = slot;
  }
  {
    absl::MutexLock l(&f->mu);
    f->data.resize(size, 0);
  }
  return std::unique_ptr<BlockDevice>(new MemDevice(f, block_size_, size));
}

absl::Status MemIoEnv::RemoveFile(const std::string& path) {
  absl::MutexLock l(&mu_);
  files_.erase(path);
  return absl::OkStatus();
}

void MemIoEnv::SimulateCrash() {
  absl::MutexLock l(&mu_);
  for (auto& [path, f] : files_) {
    absl::MutexLock fl(&f->mu);
    f->Revert();
  }
}

absl::Status MemIoEnv::CorruptByte(const std::string& path, uint64_t offset, int bit) {
  absl::MutexLock l(&mu_);
  auto it = files_.find(path);
  if (it == files_.end()) return absl::NotFoundError(path);
  absl::MutexLock fl(&it->second->mu);
  if (offset >= it->second->data.size()) return absl::OutOfRangeError("offset past end");
  it->second->data[offset] ^= static_cast<uint8_t>(1u << bit);
  return absl::OkStatus();
}

// ------------------------------------------------------- FaultInjectionIoEnv

class FaultInjectionIoEnv::Device : public BlockDevice {
 public:
  Device(FaultInjectionIoEnv* env, std::unique_ptr<BlockDevice> base)
      : env_(env), base_(std::move(base)) {}
  ~Device() override {
    absl::MutexLock l(&env_->mu_);
    std::erase(env_->devices_, this);
  }
  uint64_t block_size() const override { return base_->block_size(); }
  uint64_t size() const override { return base_->size(); }

  absl::Status Submit(std::span<const IoRequest> reqs) override { return Forward(reqs, nullptr); }
  absl::Status SubmitWithCompletions(std::span<const IoRequest> reqs,
                                     CompletionFn on_complete) override {
    return Forward(reqs, &on_complete);
  }

  absl::Status Sync() override {
    KVTIER_RETURN_IF_ERROR_IO(env_->faults_.MaybeFail("sync", /*is_write=*/false));
    KVTIER_RETURN_IF_ERROR_IO(base_->Sync());
    absl::MutexLock l(&mu_);
    unsynced_.clear();
    return absl::OkStatus();
  }

  absl::Status DropUnsynced() {
    std::vector<std::pair<uint64_t, std::vector<uint8_t>>> writes;
    {
      absl::MutexLock l(&mu_);
      writes.swap(unsynced_);
    }
    for (auto it = writes.rbegin(); it != writes.rend(); ++it) {
      AlignedBuffer buf(it->second.size(), base_->block_size());
      std::memcpy(buf.data(), it->second.data(), it->second.size());
      IoRequest w{IoRequest::Op::kWrite, it->first, buf.data(), it->second.size()};
      KVTIER_RETURN_IF_ERROR_IO(base_->Submit({&w, 1}));
    }
    return base_->Sync();
  }

 private:
  // Submit with the policy's faults; reports completions to `on_complete`
  // if not null.
  absl::Status Forward(std::span<const IoRequest> reqs, const CompletionFn* on_complete) {
    bool any_write = false;
    for (const IoRequest& r : reqs) any_write |= r.op == IoRequest::Op::kWrite;
    const absl::Status injected = env_->faults_.MaybeFail(any_write ? "write" : "read", any_write);
    const FaultPolicy p = env_->faults_.policy();
    size_t run = reqs.size();
    if (!injected.ok()) {
      if (!p.fail_mid_submit || reqs.size() < 2) return injected;
      run = reqs.size() / 2;  // the device fails in the middle of the transfer
    }
    std::vector<IoRequest> out;
    std::vector<size_t> index;  // out[j] is reqs[index[j]]
    std::vector<size_t> vanished;  // torn to nothing, yet reported complete
    for (size_t i = 0; i < run; ++i) {
      IoRequest r = reqs[i];
      if (r.op == IoRequest::Op::kWrite) {
        if (p.drop_unflushed) {
          AlignedBuffer old(r.len, base_->block_size());
          IoRequest rd{IoRequest::Op::kRead, r.offset, old.data(), r.len};
          KVTIER_RETURN_IF_ERROR_IO(base_->Submit({&rd, 1}));
          absl::MutexLock l(&mu_);
          unsynced_.emplace_back(r.offset, std::vector<uint8_t>(old.data(), old.data() + r.len));
        }
        if (env_->faults_.MaybeTear()) {
          // Only the first half (block-rounded) reaches the device.
          uint64_t b = base_->block_size();
          r.len = (r.len / 2) / b * b;
        }
      }
      if (r.len == 0) {
        vanished.push_back(i);
        continue;
      }
      out.push_back(r);
      index.push_back(i);
    }
    absl::Status st;
    if (!out.empty()) {
      if (on_complete != nullptr) {
        st = base_->SubmitWithCompletions(out, [&](size_t j) { (*on_complete)(index[j]); });
      } else {
        st = base_->Submit(out);
      }
    }
    if (st.ok() && on_complete != nullptr) {
      for (size_t i : vanished) (*on_complete)(i);
    }
    if (!injected.ok()) return injected;
    return st;
  }

  FaultInjectionIoEnv* const env_;
  std::unique_ptr<BlockDevice> base_;
  absl::Mutex mu_;
  std::vector<std::pair<uint64_t, std::vector<uint8_t>>> unsynced_ ABSL_GUARDED_BY(mu_);
};

FaultInjectionIoEnv::FaultInjectionIoEnv(IoEnv* base, FaultPolicy policy)
    : base_(base), faults_(policy) {}

absl::StatusOr<std::unique_ptr<BlockDevice>> FaultInjectionIoEnv::OpenDevice(
    const std::string& path, uint64_t size) {
  KVTIER_RETURN_IF_ERROR_IO(faults_.MaybeFail("open", /*is_write=*/true));
  auto base = base_->OpenDevice(path, size);
  if (!base.ok()) return base.status();
  auto dev = std::make_unique<Device>(this, std::move(*base));
  absl::MutexLock l(&mu_);
  devices_.push_back(dev.get());
  return std::unique_ptr<BlockDevice>(std::move(dev));
}

absl::Status FaultInjectionIoEnv::RemoveFile(const std::string& path) {
  return base_->RemoveFile(path);
}

absl::Status FaultInjectionIoEnv::DropUnsyncedWrites() {
  std::vector<Device*> devs;
  {
    absl::MutexLock l(&mu_);
    devs = devices_;
  }
  for (Device* d : devs) KVTIER_RETURN_IF_ERROR_IO(d->DropUnsynced());
  return absl::OkStatus();
}

// ------------------------------------------------------------------ clocks

namespace {
class SteadyClock : public Clock {
 public:
  int64_t NowMicros() const override {
    return std::chrono::duration_cast<std::chrono::microseconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }
};
}  // namespace

Clock* SystemClock() {
  static SteadyClock clock;
  return &clock;
}

}  // namespace kvtier::tiering
