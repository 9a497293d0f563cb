// PlacementEngine's leases and slots, over its LeaseTable: Pin, Hold,
// Renew, Release, the slots a client fills and commits, and their expiry.
#include "tiering/placement_engine.h"

#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "codec/chunk.h"
#include "common/status.h"
#include "tiering/placement_engine_internal.h"

namespace kvtier::tiering {

void PlacementEngine::EndLeaseLocked(const LeaseState& lease) {
  for (const Hash128& k : lease.keys) {
    auto c = chunks_.find(k);
    if (c != chunks_.end()) --c->second.pins;
  }
}

void PlacementEngine::ExpireLocked(int64_t now) {
  const EndedHolds ended = holds_.TakeExpired(now);
  for (const LeaseState& lease : ended.leases) {
    EndLeaseLocked(lease);
    Count(EngineMetric::kLeasesExpired);
  }
  for (const SlotState& slot : ended.slots) {
    (void)dram_->AbortSlot(slot.extent);
    if (slot.promote) {
      if (auto ld = loading_.find(slot.key); ld != loading_.end() && --ld->second == 0) {
        loading_.erase(ld);
      }
    }
    Count(EngineMetric::kSlotsExpired);
  }
}

absl::Status PlacementEngine::CountRefusal(absl::Status st) {
  if (absl::IsResourceExhausted(st)) Count(EngineMetric::kHoldsRefused);
  return st;
}

uint64_t PlacementEngine::held_bytes() {
  absl::MutexLock l(&mu_);
  ExpireLocked(Now());
  return holds_.held_bytes();
}

absl::StatusOr<Lease> PlacementEngine::Pin(std::span<const Hash128> keys, int64_t ttl_ms,
                                           bool allow_remote, Holder holder) {
  for (const Hash128& k : keys) {
    KVTIER_RETURN_IF_ERROR(FetchIfMissing(k, allow_remote).status());
  }
  absl::MutexLock l(&mu_);
  const int64_t now = Now();
  ExpireLocked(now);
  return LeaseLocked(keys, ttl_ms, now, holder);
}

absl::StatusOr<Lease> PlacementEngine::Renew(uint64_t lease_id, int64_t ttl_ms, HolderId holder) {
  absl::MutexLock l(&mu_);
  const int64_t now = Now();
  ExpireLocked(now);
  return holds_.Renew(lease_id, ttl_ms, holder, now);
}

absl::Status PlacementEngine::Release(uint64_t lease_id, HolderId holder) {
  absl::MutexLock l(&mu_);
  const int64_t now = Now();
  ExpireLocked(now);
  KVTIER_ASSIGN_OR_RETURN(const LeaseState lease, holds_.TakeLease(lease_id, holder, now));
  EndLeaseLocked(lease);
  return absl::OkStatus();
}

absl::StatusOr<Lease> PlacementEngine::Hold(std::span<const Hash128> keys, int64_t ttl_ms,
                                            Holder holder) {
  absl::MutexLock l(&mu_);
  const int64_t now = Now();
  ExpireLocked(now);
  return LeaseLocked(keys, ttl_ms, now, holder);
}

absl::StatusOr<Lease> PlacementEngine::LeaseLocked(std::span<const Hash128> keys, int64_t ttl_ms,
                                                   int64_t now, const Holder& holder) {
  uint64_t bytes = 0;
  for (const Hash128& k : keys) {
    auto it = chunks_.find(k);
    if (it == chunks_.end()) return absl::NotFoundError(absl::StrCat("chunk ", k.ToHex(), " not stored"));
    bytes += it->second.bytes;
  }
  auto lease = holds_.AddLease(std::vector<Hash128>(keys.begin(), keys.end()), bytes, ttl_ms, now,
                               holder);
  KVTIER_RETURN_IF_ERROR(CountRefusal(lease.status()));
  for (const Hash128& k : keys) ++chunks_[k].pins;
  return lease;
}

absl::StatusOr<Slot> PlacementEngine::AllocateSlot(uint64_t bytes, int64_t ttl_ms,
                                                   TenantId tenant, HolderId holder) {
  return AllocateSlotOf(bytes, ttl_ms, /*scratch=*/false, tenant, Holder{holder, tenant});
}

absl::StatusOr<PoolExtent> PlacementEngine::ReserveDram(uint64_t bytes, TenantId tenant) {
  int idle = 0;
  for (int i = 0; i < kMaxEvictionsPerStore; ++i) {
    auto ext = dram_->ReserveSlot(bytes);
    if (ext.ok() || !IsTierFull(ext.status()) || bytes > dram_->capacity_bytes()) return ext;
    if (!EvictOne(TierKind::kDram, tenant) && ++idle > kMaxIdleRounds) return ext;
  }
  return TierFullError("dram: eviction did not make room for a slot");
}

absl::StatusOr<Slot> PlacementEngine::AllocateSlotOf(uint64_t bytes, int64_t ttl_ms, bool scratch,
                                                     TenantId tenant, const Holder& holder) {
  if (!dram_) return absl::FailedPreconditionError("no DRAM tier");
  if (bytes < codec::kHeaderSize) return absl::InvalidArgumentError("slot smaller than a chunk header");
  // A client slot becomes a stored chunk: its room is made inside the
  // tenant's quota now (and checked again at the commit).
  if (!scratch) KVTIER_RETURN_IF_ERROR(MakeQuotaRoom(TierKind::kDram, tenant, bytes));
  KVTIER_ASSIGN_OR_RETURN(PoolExtent ext, ReserveDram(bytes, tenant));
  absl::MutexLock l(&mu_);
  // A scratch slot counts the chunk's bytes, as a pin in place does.
  SlotState state;
  state.extent = ext;
  state.scratch = scratch;
  auto slot = holds_.AddSlot(std::move(state), scratch ? bytes : 0, ttl_ms, Now(), holder);
  if (!CountRefusal(slot.status()).ok()) (void)dram_->AbortSlot(ext);
  return slot;
}

absl::Status PlacementEngine::AbortSlot(uint64_t slot_id, HolderId holder) {
  absl::MutexLock l(&mu_);
  const int64_t now = Now();
  ExpireLocked(now);
  KVTIER_ASSIGN_OR_RETURN(const SlotState slot, holds_.TakeSlot(slot_id, holder, now));
  // Lock order: mu_, then the prefetcher's.
  if (slot.promote && prefetcher_.EnqueuePromotion(slot.key, slot.extent)) {
    return absl::OkStatus();
  }
  if (slot.promote) {  // stopping: not promoted
    if (auto ld = loading_.find(slot.key); ld != loading_.end() && --ld->second == 0) {
      loading_.erase(ld);
    }
  }
  return dram_->AbortSlot(slot.extent);
}

absl::StatusOr<SlotBytes> PlacementEngine::SlotView(uint64_t slot_id, HolderId holder,
                                                    int64_t margin_us) {
  absl::MutexLock l(&mu_);
  KVTIER_ASSIGN_OR_RETURN(const PoolExtent x,
                          holds_.ClientSlotExtent(slot_id, holder, Now() + margin_us));
  return SlotBytes{x, std::span<uint8_t>(dram_->base() + x.offset, x.length)};
}

void PlacementEngine::ForgetEnded(absl::flat_hash_set<uint64_t>& slot_ids,
                                  absl::flat_hash_set<uint64_t>& lease_ids) {
  absl::MutexLock l(&mu_);
  holds_.ForgetEnded(Now(), slot_ids, lease_ids);
}

absl::StatusOr<PoolExtent> PlacementEngine::TakeClientSlot(uint64_t slot_id, HolderId holder) {
  absl::MutexLock l(&mu_);
  const int64_t now = Now();
  ExpireLocked(now);
  return holds_.TakeClientSlot(slot_id, holder, now);
}

absl::Status PlacementEngine::CommitSlot(uint64_t slot_id, const Hash128& key,
                                         const PutOptions& opts) {
  KVTIER_ASSIGN_OR_RETURN(PoolExtent ext, TakeClientSlot(slot_id, opts.holder));
  std::span<const uint8_t> bytes(dram_->base() + ext.offset, ext.length);
  auto h = CheckPutChunk(bytes, "slot");
  if (!h.ok()) {
    (void)dram_->AbortSlot(ext);
    return h.status();
  }
  return CommitTakenSlot(ext, *h, key, opts);
}

absl::Status PlacementEngine::CommitSlot(uint64_t slot_id, const codec::VerifiedChunk& chunk,
                                         const Hash128& key, const PutOptions& opts) {
  KVTIER_ASSIGN_OR_RETURN(PoolExtent ext, TakeClientSlot(slot_id, opts.holder));
  if (chunk.bytes().data() != dram_->base() + ext.offset || chunk.bytes().size() != ext.length) {
    (void)dram_->AbortSlot(ext);
    return absl::InvalidArgumentError(
        absl::StrCat("the verified chunk is not the bytes of slot ", slot_id));
  }
  return CommitTakenSlot(ext, chunk.header(), key, opts);
}

absl::Status PlacementEngine::CommitTakenSlot(const PoolExtent& ext,
                                              const codec::ChunkHeader& header,
                                              const Hash128& key, const PutOptions& opts) {
  std::span<const uint8_t> bytes(dram_->base() + ext.offset, ext.length);
  if (Contains(key)) {
    // Keys name content: the stored chunk stays (the put is one more use
    // of it); a durable put makes sure it is on NVMe.
    absl::Status st = PutLocal(key, bytes, header, opts);
    (void)dram_->AbortSlot(ext);
    if (st.ok()) Count(EngineMetric::kPuts);
    return st;
  }
  ObjectKey w{key, Part::kWhole};
  if (opts.durable) {
    if (!nvme_) {
      (void)dram_->AbortSlot(ext);
      return absl::FailedPreconditionError("durable put without an NVMe tier");
    }
    absl::Status st = StoreWithEviction(TierKind::kNvme, w, bytes,
                                        TierPutOptions{.sync = true, .header = &header},
                                        opts.tenant);
    if (!st.ok()) {
      (void)dram_->AbortSlot(ext);
      return st;
    }
    NoteStored(TierKind::kNvme, w, ext.length, false, ext.length, opts.tenant);
  }
  // The quota holds for committed bytes: the tenant's older chunks make
  // room for this one.
  if (absl::Status q = MakeQuotaRoom(TierKind::kDram, opts.tenant, ext.length); !q.ok()) {
    (void)dram_->AbortSlot(ext);
    return q;
  }
  // Write-through while the slot is still ours (nothing can evict it yet).
  Replicate(key, bytes, opts);
  KVTIER_RETURN_IF_ERROR(dram_->CommitSlot(w, ext));
  NoteStored(TierKind::kDram, w, ext.length, false, ext.length, opts.tenant);
  Count(EngineMetric::kPuts);
  return absl::OkStatus();
}

}  // namespace kvtier::tiering
