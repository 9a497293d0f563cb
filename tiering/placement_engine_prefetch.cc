// PlacementEngine's side of the Prefetcher (PrefetchTarget): promotion of
// single chunks, batched reads of NVMe chunks into DRAM and the promotion of
// freed scratch slots.
#include "tiering/placement_engine.h"

#include <vector>

#include "codec/chunk.h"
#include "common/status.h"
#include "tiering/placement_engine_internal.h"

namespace kvtier::tiering {

absl::Status PlacementEngine::PromoteOne(const Hash128& key) {
  // A chunk only the remote tier has is fetched into DRAM.
  if (dram_ != nullptr) KVTIER_RETURN_IF_ERROR(FetchIfMissing(key, true).status());
  uint64_t bytes;
  {
    absl::MutexLock l(&mu_);
    auto it = chunks_.find(key);
    if (it == chunks_.end() || it->second.split) return absl::OkStatus();
    if (it->second.where[0] & (Bit(TierKind::kHbm) | Bit(TierKind::kDram))) return absl::OkStatus();
    bytes = it->second.bytes;
  }
  if (!dram_) return absl::OkStatus();
  std::vector<uint8_t> buf(bytes);
  ObjectKey w{key, Part::kWhole};
  auto src = ReadObject(w, buf);
  if (absl::IsNotFound(src.status())) return absl::OkStatus();
  if (!src.ok()) return src.status();
  TenantId tenant;
  {
    absl::MutexLock l(&mu_);
    tenant = TenantOfLocked(key);
  }
  KVTIER_RETURN_IF_ERROR(StoreWithEviction(TierKind::kDram, w, buf, kBackground, tenant));
  NoteStored(TierKind::kDram, w, bytes, false, bytes, tenant);
  Count(EngineMetric::kPrefetched);
  return absl::OkStatus();
}

std::future<absl::Status> PlacementEngine::Prefetch(std::vector<Hash128> keys) {
  return prefetcher_.Enqueue(std::move(keys));
}

void PlacementEngine::PromoteFromSlot(const Hash128& key, const PoolExtent& extent) {
  // The slot was the client's to read (through a writable mapping): its
  // bytes are checked before they become a stored copy.
  const bool whole =
      codec::VerifyChunk({dram_->base() + extent.offset, extent.length}).ok();
  const ObjectKey w{key, Part::kWhole};
  absl::MutexLock l(&mu_);
  if (auto ld = loading_.find(key); ld != loading_.end() && --ld->second == 0) loading_.erase(ld);
  auto it = chunks_.find(key);
  if (whole && it != chunks_.end() && !it->second.split && it->second.bytes == extent.length &&
      (it->second.where[0] & (Bit(TierKind::kHbm) | Bit(TierKind::kDram))) == 0 &&
      WithinQuotaLocked(TierKind::kDram, it->second.tenant, extent.length) &&
      dram_->CommitSlot(w, extent).ok()) {
    it->second.where[0] |= Bit(TierKind::kDram);
    policies_[static_cast<int>(TierKind::kDram)]->OnInsert(w, extent.length);
    Count(EngineMetric::kPromotions);
    return;
  }
  (void)dram_->AbortSlot(extent);
}

PrefetchTarget::Route PlacementEngine::RouteOf(const Hash128& key, uint64_t* bytes) {
  if (nvme_ == nullptr || dram_ == nullptr) return Route::kPromote;
  absl::MutexLock l(&mu_);
  auto it = chunks_.find(key);
  if (it == chunks_.end() || it->second.split || it->second.where[0] != Bit(TierKind::kNvme)) {
    return Route::kPromote;
  }
  if (loading_.contains(key)) return Route::kSkip;  // a batched read has it: promoted after it
  *bytes = it->second.bytes;
  return Route::kGroup;
}

absl::Status PlacementEngine::PrefetchGroup(std::span<const std::pair<Hash128, uint64_t>> chunks) {
  absl::Status first;
  std::vector<ObjectKey> ids;
  std::vector<PoolExtent> extents;
  std::vector<std::span<uint8_t>> dst;
  for (const auto& [key, bytes] : chunks) {
    TenantId tenant;
    {
      absl::MutexLock l(&mu_);
      tenant = TenantOfLocked(key);
    }
    // The copy becomes the chunk's DRAM copy: it is made room for inside
    // the tenant's quota (and checked again when it is committed below).
    const absl::Status quota = MakeQuotaRoom(TierKind::kDram, tenant, bytes);
    absl::StatusOr<PoolExtent> ext =
        quota.ok() ? ReserveDram(bytes, tenant) : absl::StatusOr<PoolExtent>(quota);
    if (!ext.ok()) {
      if (first.ok()) first = ext.status();
      continue;
    }
    ids.push_back({key, Part::kWhole});
    extents.push_back(*ext);
    dst.emplace_back(dram_->base() + ext->offset, bytes);
  }
  if (ids.empty()) return first;
  {
    absl::MutexLock l(&mu_);
    for (const ObjectKey& id : ids) prefetching_.insert(id.key);
  }
  // Each chunk's checksums are checked as it arrives (NvmeTier::ReadBatch).
  std::vector<absl::Status> read = nvme_->ReadBatch(ids, dst);
  auto done = [this](const Hash128& key) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    prefetching_.erase(key);
    prefetch_done_.SignalAll();
  };
  for (size_t i = 0; i < ids.size(); ++i) {
    if (!read[i].ok()) {
      (void)dram_->AbortSlot(extents[i]);
      if (absl::IsDataLoss(read[i])) {
        (void)DropCorruptCopy(ids[i], TierKind::kNvme);
        if (first.ok()) first = read[i];
      }
      absl::MutexLock l(&mu_);
      done(ids[i].key);
      continue;  // NotFound: deleted or moved meanwhile, nothing to prefetch
    }
    absl::MutexLock l(&mu_);
    done(ids[i].key);
    auto it = chunks_.find(ids[i].key);
    if (it != chunks_.end() && !it->second.split && it->second.bytes == extents[i].length &&
        (it->second.where[0] & (Bit(TierKind::kHbm) | Bit(TierKind::kDram))) == 0 &&
        WithinQuotaLocked(TierKind::kDram, it->second.tenant, extents[i].length) &&
        dram_->CommitSlot(ids[i], extents[i]).ok()) {
      it->second.where[0] |= Bit(TierKind::kDram);
      policies_[static_cast<int>(TierKind::kDram)]->OnInsert(ids[i], extents[i].length);
      Count(EngineMetric::kPrefetched);
      continue;
    }
    (void)dram_->AbortSlot(extents[i]);
  }
  return first;
}

}  // namespace kvtier::tiering
