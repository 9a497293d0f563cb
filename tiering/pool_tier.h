// A memory-pool tier: one contiguous region (host shared memory for DRAM,
// device memory for HBM) carved into objects by an ExtentAllocator. DramTier
// and HbmTier supply the region through PoolMemory.
#ifndef KVTIER_TIERING_POOL_TIER_H_
#define KVTIER_TIERING_POOL_TIER_H_

#include <atomic>
#include <memory>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "tiering/extent_allocator.h"
#include "tiering/tier.h"

namespace kvtier::tiering {

// The bytes behind a pool. Copies may run concurrently on disjoint ranges.
class PoolMemory {
 public:
  virtual ~PoolMemory() = default;
  virtual uint64_t size() const = 0;
  virtual absl::Status CopyIn(uint64_t offset, std::span<const uint8_t> src) = 0;
  virtual absl::Status CopyOut(uint64_t offset, std::span<uint8_t> dst) = 0;
};

// A PoolMemory with no bytes behind it, for tiers that account space and
// store nothing (DramTierOptions::metadata_only, NewMetadataTier): CopyIn
// discards, CopyOut leaves `dst` as it is.
std::unique_ptr<PoolMemory> NewMetadataOnlyMemory(uint64_t size);

// Where an object sits inside the pool.
struct PoolExtent {
  uint64_t offset = 0;
  uint64_t length = 0;
};

class PoolTier : public Tier {
 public:
  // `alignment`: allocation unit and alignment of every object. Takes
  // ownership of `memory`.
  PoolTier(TierKind kind, std::unique_ptr<PoolMemory> memory, uint64_t alignment);

  TierKind kind() const override { return kind_; }
  uint64_t capacity_bytes() const override { return alloc_size_; }
  uint64_t used_bytes() const override;
  uint64_t ready_bytes() const override { return ready_.load(std::memory_order_acquire); }
  Bandwidth bandwidth() const override { return meter_.Get(); }

  using Tier::Put;
  absl::Status Put(const ObjectKey& id, std::span<const uint8_t> bytes,
                   const TierPutOptions& options) override;
  absl::StatusOr<uint64_t> Size(const ObjectKey& id) override;
  absl::Status Read(const ObjectKey& id, std::span<uint8_t> out) override;
  absl::Status Erase(const ObjectKey& id) override;
  std::vector<std::pair<ObjectKey, uint64_t>> List() override;

  // --- Slots: space reserved first, filled in place by someone else (a
  // client through shared memory, a GPU kernel), then committed as an object
  // without a copy.

  // Reserves `length` bytes. ResourceExhausted if no contiguous room (the
  // tier-full error, IsTierFull), or, without the tier-full mark, if the
  // pool is made ready in fenced pieces (Pieces) and `length` exceeds one.
  absl::StatusOr<PoolExtent> ReserveSlot(uint64_t length);
  // Turns a reserved slot into object `id` (replacing an existing one).
  // NotFound if `slot` is not a reserved slot.
  absl::Status CommitSlot(const ObjectKey& id, const PoolExtent& slot);
  // Returns a reserved slot to the pool. NotFound if it is not reserved.
  absl::Status AbortSlot(const PoolExtent& slot);

  // Takes a read reference on object `id` and returns where it lives; the
  // bytes stay valid (even if the object is erased or replaced) until
  // ReleaseRef. NotFound if absent.
  absl::StatusOr<PoolExtent> AcquireRef(const ObjectKey& id);
  void ReleaseRef(const PoolExtent& extent);

 protected:
  // A pool whose space becomes allocatable piece by piece: none of it is
  // until MakeReady hands a piece over.
  struct Pieces {
    // Size of a piece (the last may be shorter); a multiple of the alignment.
    uint64_t piece_bytes = 0;
    // No object spans two pieces (each piece is registered alone with a
    // device, and a copy must lie inside one registration).
    bool fenced = false;
  };
  PoolTier(TierKind kind, std::unique_ptr<PoolMemory> memory, uint64_t alignment, Pieces pieces);

  // Makes the piece [offset, offset + length) allocatable. Thread-safe.
  // REQUIRES: a piece of this pool (Pieces), not made ready before.
  void MakeReady(uint64_t offset, uint64_t length);
  PoolMemory* memory() const { return memory_.get(); }

 private:
  struct Obj {
    uint64_t offset;
    uint64_t length;
  };
  void Unref(uint64_t offset) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const TierKind kind_;
  std::unique_ptr<PoolMemory> memory_;
  const uint64_t alloc_size_;
  // Bytes of the pool the allocator may hand out (alloc_size_ unless the
  // pool is made ready in pieces). Written under mu_, read without it.
  std::atomic<uint64_t> ready_;
  BandwidthMeter meter_;
  mutable absl::Mutex mu_;
  ExtentAllocator alloc_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<ObjectKey, Obj> objects_ ABSL_GUARDED_BY(mu_);
  // Per allocated extent (by offset): length and references (1 for being an
  // object or a reserved slot, +1 per reader). Freed at zero.
  struct Extent {
    uint64_t length;
    int refs;
    bool reserved_slot;
  };
  absl::flat_hash_map<uint64_t, Extent> extents_ ABSL_GUARDED_BY(mu_);
};

// A tier of kind `kind` that holds `capacity_bytes` of objects (rounded to
// `alignment`) by their lengths only: the extents, capacity and fullness of
// a real tier, no bytes. The placement engine runs over it unchanged, so a
// trace replay (tiering/replay.h) exercises the engine's own admission,
// eviction, demotion and promotion at capacities no machine could allocate.
// Reads succeed and leave the caller's buffer as it is.
std::unique_ptr<PoolTier> NewMetadataTier(TierKind kind, uint64_t capacity_bytes,
                                          uint64_t alignment = 4096);

}  // namespace kvtier::tiering

#endif  // KVTIER_TIERING_POOL_TIER_H_
