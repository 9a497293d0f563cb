// Prefetcher: the placement engine's background thread for prefetches
// (PlacementEngine::Prefetch) and for promoting freed scratch slots. It owns
// the queues, the thread and the grouping of a prefetch's chunks into
// batched reads; what a prefetch or promotion does to the tiers is its
// PrefetchTarget's (the engine's), which it calls on its thread.
//
// Thread-safe. Its lock is never held while it calls the target, so the
// target may call Enqueue* while holding its own locks (lock order: the
// target's, then the prefetcher's).
#ifndef KVTIER_TIERING_PREFETCHER_H_
#define KVTIER_TIERING_PREFETCHER_H_

#include <cstdint>
#include <deque>
#include <future>
#include <span>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "common/hash.h"
#include "tiering/pool_tier.h"

namespace kvtier::tiering {

// What a Prefetcher's thread asks of the engine it works for. Each call
// runs on the prefetcher's thread, one at a time.
class PrefetchTarget {
 public:
  // How a prefetch takes one key.
  enum class Route {
    kSkip,     // nothing to do now (another read is loading it)
    kGroup,    // whole on NVMe only: read in a batch (PrefetchGroup)
    kPromote,  // any other: PromoteOne
  };
  virtual ~PrefetchTarget() = default;
  // The route of `key`; for kGroup, `*bytes` is its chunk size.
  virtual Route RouteOf(const Hash128& key, uint64_t* bytes) = 0;
  // Copies `key` into a faster tier if it is not in one. OK if there was
  // nothing to do; the first error otherwise.
  virtual absl::Status PromoteOne(const Hash128& key) = 0;
  // Reads (key, chunk bytes) chunks whole on NVMe only into DRAM with one
  // submission. The first error.
  virtual absl::Status PrefetchGroup(std::span<const std::pair<Hash128, uint64_t>> chunks) = 0;
  // Makes the freed scratch slot `extent`, a copy of `key`, the chunk's
  // DRAM copy or frees it. Takes the extent.
  virtual void PromoteFromSlot(const Hash128& key, const PoolExtent& extent) = 0;
};

class Prefetcher {
 public:
  // A prefetch reads whole NVMe chunks in groups of at most this many
  // chunks or bytes, each group in one submission: enough requests to keep
  // the device queue full (32 of 1 MiB), few enough that chunks reach DRAM
  // (and a load that follows finds them there) a group at a time.
  static constexpr size_t kGroupChunks = 8;
  static constexpr uint64_t kGroupBytes = uint64_t{64} << 20;

  // `target` (not owned) must outlive the prefetcher's thread (Stop).
  explicit Prefetcher(PrefetchTarget* target) : target_(target) {}
  // Stops (Stop) if Stop was not called; promotions not made are dropped
  // without their extents being freed.
  ~Prefetcher();
  Prefetcher(const Prefetcher&) = delete;
  Prefetcher& operator=(const Prefetcher&) = delete;

  // Starts the thread. REQUIRES: called once, before Stop.
  void Start();
  // Stops the thread once the job or promotion it runs now is done, fails
  // the queued prefetches with Cancelled and returns the promotions not
  // made: their extents are the caller's to free. Later Enqueue calls are
  // refused. Idempotent (a second call returns nothing).
  std::vector<std::pair<Hash128, PoolExtent>> Stop();

  // Queues a prefetch of `keys`, taken in order: the chunks whole on NVMe
  // only in groups (PrefetchGroup), the others one at a time (PromoteOne).
  // The future holds OK when every one is done or skipped, or the first
  // error; Cancelled if the prefetcher is stopping or stops before it runs.
  std::future<absl::Status> Enqueue(std::vector<Hash128> keys);
  // Queues the promotion of a freed scratch slot, ahead of any queued
  // prefetch. False if the prefetcher is stopping: the extent stays the
  // caller's.
  bool EnqueuePromotion(const Hash128& key, const PoolExtent& extent);

 private:
  struct Job {
    std::vector<Hash128> keys;
    std::promise<absl::Status> done;
  };
  void Loop();
  // One prefetch job: the first error of its groups and promotions.
  absl::Status Run(const std::vector<Hash128>& keys);

  PrefetchTarget* const target_;
  absl::Mutex mu_;
  std::deque<Job> jobs_ ABSL_GUARDED_BY(mu_);
  std::deque<std::pair<Hash128, PoolExtent>> promotions_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace kvtier::tiering

#endif  // KVTIER_TIERING_PREFETCHER_H_
