// I/O interfaces of the tiering engine (leveldb Env style). The NVMe tier's
// data file goes through BlockDevice / IoEnv so that tests can substitute an
// in-memory implementation and a fault-injecting wrapper; its RocksDB index
// uses RocksDB's own (POSIX) environment.
//
// Implementations:
//   NewUringIoEnv()   production: O_DIRECT files driven through io_uring.
//   MemIoEnv          in-memory devices that remember which writes were not
//                     yet synced, so tests can simulate a power loss.
//   FaultInjectionIoEnv  forwards to another IoEnv and injects faults per
//                     FaultPolicy (common/fault_injection.h: errors, ENOSPC,
//                     latency, torn writes, dropped unflushed data), with a
//                     fixed seed.
#ifndef KVTIER_TIERING_IO_H_
#define KVTIER_TIERING_IO_H_

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/fault_injection.h"

namespace kvtier::tiering {

// One block-aligned read or write. For O_DIRECT devices `buf`, `offset` and
// `len` must be multiples of BlockDevice::block_size().
struct IoRequest {
  enum class Op : uint8_t { kRead, kWrite };
  Op op = Op::kRead;
  uint64_t offset = 0;
  uint8_t* buf = nullptr;
  uint64_t len = 0;
};

// A fixed-size file of blocks. Thread-safe: any number of threads may call
// Submit and Sync concurrently.
class BlockDevice {
 public:
  virtual ~BlockDevice() = default;

  // Alignment of offsets, lengths and buffers. Always a power of two.
  virtual uint64_t block_size() const = 0;
  // Size of the device in bytes (fixed at open).
  virtual uint64_t size() const = 0;

  // Executes every request, keeping up to the device's queue depth in flight.
  // OK only if every request completed in full. On failure some requests may
  // have completed: a write that failed leaves its range in an unknown state.
  // ResourceExhausted for ENOSPC, Unavailable for transient errors (EAGAIN,
  // EBUSY), Internal/DataLoss for media errors, InvalidArgument for
  // misaligned or out-of-range requests.
  virtual absl::Status Submit(std::span<const IoRequest> requests) = 0;

  // Called with the index (into `requests`) of a request that completed in
  // full, on the thread that called SubmitWithCompletions.
  using CompletionFn = absl::FunctionRef<void(size_t index)>;
  // Submit, reporting each request that completed in full to `on_complete`,
  // at most once, in completion order (not necessarily request order), while
  // later requests may still be in flight, so that the caller can work on
  // the completed bytes (e.g. hash them) meanwhile. Once a request has
  // failed, further completions are not reported. On OK every request was
  // reported. Devices that cannot report early use this default: Submit,
  // then report every request in order if it succeeded.
  virtual absl::Status SubmitWithCompletions(std::span<const IoRequest> requests,
                                             CompletionFn on_complete);

  // Makes every completed write durable (fdatasync).
  virtual absl::Status Sync() = 0;
};

struct IoEnvOptions {
  // Requests kept in flight per Submit call (io_uring submission depth).
  // Default: 32
  uint32_t queue_depth = 32;
  // Block size for O_DIRECT alignment. Default: 4096
  uint64_t block_size = 4096;
};

// Opens block devices by path. Thread-safe.
class IoEnv {
 public:
  virtual ~IoEnv() = default;
  // Opens (creating if needed) the file at `path` and sizes it to `size`
  // bytes (preallocated where the filesystem supports it, so the file never
  // grows past `size`). ResourceExhausted if the space cannot be reserved.
  virtual absl::StatusOr<std::unique_ptr<BlockDevice>> OpenDevice(const std::string& path,
                                                                  uint64_t size) = 0;
  // Removes the file at `path`; OK if it does not exist.
  virtual absl::Status RemoveFile(const std::string& path) = 0;
};

// io_uring + O_DIRECT. Falls back to no error: if O_DIRECT is refused by the
// filesystem (tmpfs), OpenDevice fails with FailedPrecondition.
std::unique_ptr<IoEnv> NewUringIoEnv(const IoEnvOptions& options = {});

// A heap buffer aligned to `alignment` (for O_DIRECT). Move-only.
class AlignedBuffer {
 public:
  AlignedBuffer() = default;
  AlignedBuffer(uint64_t size, uint64_t alignment);
  AlignedBuffer(AlignedBuffer&& o) noexcept : data_(o.data_), size_(o.size_) {
    o.data_ = nullptr;
    o.size_ = 0;
  }
  AlignedBuffer& operator=(AlignedBuffer&& o) noexcept;
  ~AlignedBuffer();
  uint8_t* data() const { return data_; }
  uint64_t size() const { return size_; }

 private:
  uint8_t* data_ = nullptr;
  uint64_t size_ = 0;
};

// In-memory devices. A device's bytes live as long as the env, so a tier can
// be closed and reopened over the same bytes ("restart"). SimulateCrash()
// reverts every write that was not followed by a Sync, as a power loss would.
class MemIoEnv : public IoEnv {
 public:
  explicit MemIoEnv(uint64_t block_size = 4096) : block_size_(block_size) {}
  absl::StatusOr<std::unique_ptr<BlockDevice>> OpenDevice(const std::string& path,
                                                          uint64_t size) override;
  absl::Status RemoveFile(const std::string& path) override;

  // Reverts all unsynced writes of every device.
  void SimulateCrash();
  // Flips bit `bit` of byte `offset` of the file at `path` (test helper).
  absl::Status CorruptByte(const std::string& path, uint64_t offset, int bit);

  struct File;  // shared between the env and open devices

 private:
  const uint64_t block_size_;
  absl::Mutex mu_;
  std::map<std::string, std::shared_ptr<File>> files_ ABSL_GUARDED_BY(mu_);
};

// Forwards to `base` (not owned; must outlive this env and its devices),
// injecting faults per the current policy (common/fault_injection.h: every
// field applies, torn_write_one_in and fail_mid_submit to Submit). Each
// open, Submit and Sync is one operation. The policy may be changed at any
// time; counters are shared across all devices of this env.
class FaultInjectionIoEnv : public IoEnv {
 public:
  explicit FaultInjectionIoEnv(IoEnv* base, FaultPolicy policy = {});
  absl::StatusOr<std::unique_ptr<BlockDevice>> OpenDevice(const std::string& path,
                                                          uint64_t size) override;
  absl::Status RemoveFile(const std::string& path) override;

  void SetPolicy(const FaultPolicy& policy) { faults_.SetPolicy(policy); }
  // Writes the remembered prior bytes of every unsynced write back to the
  // devices (only with policy.drop_unflushed). Devices stay usable.
  absl::Status DropUnsyncedWrites();
  // Number of injected faults so far.
  uint64_t injected_faults() const { return faults_.injected(); }

  class Device;

 private:
  friend class Device;
  IoEnv* const base_;
  FaultInjector faults_;
  absl::Mutex mu_;
  std::vector<Device*> devices_ ABSL_GUARDED_BY(mu_);
};

// Time source, so tests can drive lease expiry deterministically.
class Clock {
 public:
  virtual ~Clock() = default;
  // Monotonic microseconds.
  virtual int64_t NowMicros() const = 0;
};

// std::chrono::steady_clock.
Clock* SystemClock();

// A clock that moves only when told. Thread-safe.
class FakeClock : public Clock {
 public:
  int64_t NowMicros() const override { return now_.load(); }
  void AdvanceMicros(int64_t us) { now_.fetch_add(us); }

 private:
  std::atomic<int64_t> now_{1'000'000};
};

}  // namespace kvtier::tiering

#endif  // KVTIER_TIERING_IO_H_
