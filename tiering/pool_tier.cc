#include "tiering/pool_tier.h"

#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace kvtier::tiering {
namespace {
class MetadataOnlyMemory : public PoolMemory {
 public:
  explicit MetadataOnlyMemory(uint64_t size) : size_(size) {}
  uint64_t size() const override { return size_; }
  absl::Status CopyIn(uint64_t, std::span<const uint8_t>) override { return absl::OkStatus(); }
  absl::Status CopyOut(uint64_t, std::span<uint8_t>) override { return absl::OkStatus(); }

 private:
  uint64_t size_;
};

class MetadataTier : public PoolTier {
 public:
  MetadataTier(TierKind kind, uint64_t capacity, uint64_t alignment)
      : PoolTier(kind, std::make_unique<MetadataOnlyMemory>(capacity), alignment) {}
  // Nothing it holds survives anything, and nothing is verified.
  TierCapabilities capabilities() const override { return TierCapabilities{}; }
};

}  // namespace

std::unique_ptr<PoolMemory> NewMetadataOnlyMemory(uint64_t size) {
  return std::make_unique<MetadataOnlyMemory>(size);
}

std::unique_ptr<PoolTier> NewMetadataTier(TierKind kind, uint64_t capacity_bytes,
                                          uint64_t alignment) {
  return std::make_unique<MetadataTier>(kind, capacity_bytes, alignment);
}

PoolTier::PoolTier(TierKind kind, std::unique_ptr<PoolMemory> memory, uint64_t alignment)
    : kind_(kind),
      memory_(std::move(memory)),
      alloc_size_(memory_->size() / alignment * alignment),
      ready_(alloc_size_),
      alloc_(memory_->size(), alignment) {}

PoolTier::PoolTier(TierKind kind, std::unique_ptr<PoolMemory> memory, uint64_t alignment,
                   Pieces pieces)
    : kind_(kind),
      memory_(std::move(memory)),
      alloc_size_(memory_->size() / alignment * alignment),
      ready_(0),
      alloc_(memory_->size(), alignment, /*all_free=*/false) {
  absl::MutexLock l(&mu_);
  if (pieces.fenced) alloc_.set_fence(pieces.piece_bytes);
}

void PoolTier::MakeReady(uint64_t offset, uint64_t length) {
  absl::MutexLock l(&mu_);
  alloc_.AddFree(offset, length);
  ready_.store(ready_.load(std::memory_order_relaxed) + alloc_.Rounded(length),
               std::memory_order_release);
}

uint64_t PoolTier::used_bytes() const {
  absl::MutexLock l(&mu_);
  return alloc_.used();
}

void PoolTier::Unref(uint64_t offset) {
  auto it = extents_.find(offset);
  if (it == extents_.end()) return;
  if (--it->second.refs == 0) {
    alloc_.Free(offset, it->second.length);
    extents_.erase(it);
  }
}

absl::Status PoolTier::Put(const ObjectKey& id, std::span<const uint8_t> bytes,
                           const TierPutOptions& /*options*/) {
  KVTIER_ASSIGN_OR_RETURN(PoolExtent slot, ReserveSlot(bytes.size()));
  BandwidthMeter::Op move = meter_.Start(/*write=*/true);
  absl::Status st = memory_->CopyIn(slot.offset, bytes);
  move.Done(st.ok() ? bytes.size() : 0);
  if (!st.ok()) {
    (void)AbortSlot(slot);
    return st;
  }
  return CommitSlot(id, slot);
}

absl::StatusOr<PoolExtent> PoolTier::ReserveSlot(uint64_t length) {
  absl::MutexLock l(&mu_);
  if (alloc_.fence() != 0 && alloc_.Rounded(length) > alloc_.fence()) {
    // Eviction cannot make room for it: not the tier-full error.
    return absl::ResourceExhaustedError(
        absl::StrCat(TierName(kind_), " tier: ", length, " bytes do not fit in a pool piece of ",
                     alloc_.fence(), " bytes"));
  }
  auto off = alloc_.Allocate(length);
  if (!off) {
    const uint64_t ready = ready_.load(std::memory_order_relaxed);
    return TierFullError(absl::StrCat(TierName(kind_), " tier full: ", length, " bytes requested, ",
                                      alloc_.used(), "/", ready, " used",
                                      ready < alloc_size_ ? absl::StrCat(" (", alloc_size_,
                                                                         " once populated)")
                                                          : ""));
  }
  extents_[*off] = Extent{length, 1, true};
  return PoolExtent{*off, length};
}

absl::Status PoolTier::CommitSlot(const ObjectKey& id, const PoolExtent& slot) {
  absl::MutexLock l(&mu_);
  auto it = extents_.find(slot.offset);
  if (it == extents_.end() || !it->second.reserved_slot || it->second.length != slot.length) {
    return absl::NotFoundError(absl::StrCat("no reserved slot at offset ", slot.offset));
  }
  it->second.reserved_slot = false;
  auto [oit, inserted] = objects_.try_emplace(id, Obj{slot.offset, slot.length});
  if (!inserted) {
    uint64_t old = oit->second.offset;
    oit->second = Obj{slot.offset, slot.length};
    Unref(old);
  }
  return absl::OkStatus();
}

absl::Status PoolTier::AbortSlot(const PoolExtent& slot) {
  absl::MutexLock l(&mu_);
  auto it = extents_.find(slot.offset);
  if (it == extents_.end() || !it->second.reserved_slot) {
    return absl::NotFoundError(absl::StrCat("no reserved slot at offset ", slot.offset));
  }
  it->second.reserved_slot = false;
  Unref(slot.offset);
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> PoolTier::Size(const ObjectKey& id) {
  absl::MutexLock l(&mu_);
  auto it = objects_.find(id);
  if (it == objects_.end()) return absl::NotFoundError("not in pool");
  return it->second.length;
}

absl::StatusOr<PoolExtent> PoolTier::AcquireRef(const ObjectKey& id) {
  absl::MutexLock l(&mu_);
  auto it = objects_.find(id);
  if (it == objects_.end()) return absl::NotFoundError("not in pool");
  ++extents_[it->second.offset].refs;
  return PoolExtent{it->second.offset, it->second.length};
}

void PoolTier::ReleaseRef(const PoolExtent& extent) {
  absl::MutexLock l(&mu_);
  Unref(extent.offset);
}

absl::Status PoolTier::Read(const ObjectKey& id, std::span<uint8_t> out) {
  KVTIER_ASSIGN_OR_RETURN(PoolExtent e, AcquireRef(id));
  if (out.size() != e.length) {
    ReleaseRef(e);
    return absl::InvalidArgumentError(
        absl::StrCat("buffer is ", out.size(), " bytes, object is ", e.length));
  }
  BandwidthMeter::Op move = meter_.Start(/*write=*/false);
  absl::Status st = memory_->CopyOut(e.offset, out);
  move.Done(st.ok() ? out.size() : 0);
  ReleaseRef(e);
  return st;
}

absl::Status PoolTier::Erase(const ObjectKey& id) {
  absl::MutexLock l(&mu_);
  auto it = objects_.find(id);
  if (it == objects_.end()) return absl::NotFoundError("not in pool");
  uint64_t off = it->second.offset;
  objects_.erase(it);
  Unref(off);
  return absl::OkStatus();
}

std::vector<std::pair<ObjectKey, uint64_t>> PoolTier::List() {
  absl::MutexLock l(&mu_);
  std::vector<std::pair<ObjectKey, uint64_t>> out;
  for (auto& [k, o] : objects_) out.emplace_back(k, o.length);
  return out;
}

}  // namespace kvtier::tiering
