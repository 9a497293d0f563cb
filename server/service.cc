#include "server/service.h"

#include <chrono>
#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"
#include "codec/chunk.h"
#include "common/status.h"
#include "wire/chunk_check.h"

namespace kvtier::server {

using tiering::Part;
using tiering::TierKind;

namespace {

tiering::PutOptions PutOptionsOf(const PutArgs& args) {
  tiering::PutOptions po;
  po.durable = args.durable;
  po.tier = args.tier;
  return po;
}

}  // namespace

absl::Status UnknownSlotError(uint64_t slot_id) {
  return absl::NotFoundError(absl::StrCat("slot ", slot_id, " unknown or expired"));
}

absl::Status UnknownLeaseError(uint64_t lease_id) {
  return absl::NotFoundError(absl::StrCat("lease ", lease_id, " unknown or expired"));
}

KvService::KvService(tiering::PlacementEngine* engine, const ServiceLimits& limits)
    : engine_(engine), limits_(limits) {}

absl::Status KvService::CheckKeyCount(size_t n) const {
  if (n > limits_.max_keys_per_request) {
    return absl::InvalidArgumentError(absl::StrCat(n, " keys in one request; the limit is ",
                                                   limits_.max_keys_per_request));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<TierKind>> KvService::Lookup(std::span<const Hash128> keys) {
  KVTIER_RETURN_IF_ERROR(CheckKeyCount(keys.size()));
  return engine_->LookupPrefix(keys);
}

absl::StatusOr<KvService::LoadPlan> KvService::PlanLoad(std::span<const Hash128> keys,
                                                        double prefill_tokens_per_s,
                                                        uint32_t tokens_per_chunk) {
  KVTIER_RETURN_IF_ERROR(CheckKeyCount(keys.size()));
  constexpr uint32_t kMaxTokensPerChunk = 1 << 20;
  if (!std::isfinite(prefill_tokens_per_s) || prefill_tokens_per_s < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("prefill_tokens_per_s ", prefill_tokens_per_s, " is not a rate >= 0"));
  }
  if (prefill_tokens_per_s > 0 && (tokens_per_chunk == 0 || tokens_per_chunk > kMaxTokensPerChunk)) {
    return absl::InvalidArgumentError(absl::StrCat("tokens_per_chunk ", tokens_per_chunk,
                                                   " outside 1..", kMaxTokensPerChunk));
  }
  LoadPlan plan;
  plan.estimate = engine_->EstimatePrefixLoad(keys);
  if (prefill_tokens_per_s > 0) {
    plan.decision = bandwidth::BestLoadPrefix(
        plan.estimate.load_us, bandwidth::RecomputeMicros(tokens_per_chunk, prefill_tokens_per_s));
  }
  return plan;
}

absl::Status KvService::Put(const PutArgs& args, std::span<const uint8_t> chunk) {
  if (chunk.size() > limits_.max_chunk_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("chunk of ", chunk.size(),
                                                   " bytes; the limit is ", limits_.max_chunk_bytes));
  }
  KVTIER_RETURN_IF_ERROR(wire::VerifyChunkParallel(chunk).status());
  return engine_->Put(args.key, chunk, PutOptionsOf(args));
}

absl::StatusOr<tiering::Slot> KvService::AllocateSlot(uint64_t bytes, uint32_t ttl_ms) {
  if (bytes == 0 || bytes > limits_.max_chunk_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("slot of ", bytes, " bytes; must be 1..",
                                                   limits_.max_chunk_bytes));
  }
  KVTIER_ASSIGN_OR_RETURN(tiering::Slot slot, engine_->AllocateSlot(bytes, ttl_ms));
  int64_t now = tiering::SystemClock()->NowMicros();
  absl::MutexLock l(&mu_);
  // Forget slots the engine has expired (the engine never hands out the id
  // of a live slot or lease; an expired entry left here is never used, as
  // FindSlot checks the expiry).
  for (auto it = slots_.begin(); it != slots_.end();) {
    if (it->second.expires_at_us < now) {
      slots_.erase(it++);
    } else {
      ++it;
    }
  }
  slots_[slot.id] = SlotInfo{slot.extent, slot.expires_at_us};
  return slot;
}

absl::StatusOr<tiering::PoolExtent> KvService::FindSlot(uint64_t slot_id, bool remove) {
  absl::MutexLock l(&mu_);
  auto it = slots_.find(slot_id);
  // A slot about to expire counts as expired: the engine may free it while
  // bytes are being copied into it.
  constexpr int64_t kExpiryMarginUs = 100'000;
  if (it == slots_.end() ||
      it->second.expires_at_us < tiering::SystemClock()->NowMicros() + kExpiryMarginUs) {
    if (it != slots_.end()) slots_.erase(it);
    return UnknownSlotError(slot_id);
  }
  tiering::PoolExtent e = it->second.extent;
  if (remove) slots_.erase(it);
  return e;
}

absl::Status KvService::AbortSlot(uint64_t slot_id) {
  (void)FindSlot(slot_id, /*remove=*/true);
  absl::Status st = engine_->AbortSlot(slot_id);
  return absl::IsNotFound(st) ? UnknownSlotError(slot_id) : st;
}

absl::Status KvService::CommitSlot(const PutArgs& args, uint64_t slot_id) {
  tiering::DramTier* dram = engine_->dram();
  if (dram == nullptr) return absl::FailedPreconditionError("no DRAM tier: no shared-memory slots");
  auto ext = FindSlot(slot_id, /*remove=*/true);
  if (!ext.ok()) return UnknownSlotError(slot_id);
  // The one check of these bytes: on the pool, before the engine makes them
  // an object (it checks the header and the length). Later shared-memory gets
  // do not read them again (the reader checks what it copies).
  absl::Status st =
      wire::VerifyChunkParallel(std::span<const uint8_t>(dram->base() + ext->offset, ext->length)).status();
  if (!st.ok()) {
    absl::Status aborted = engine_->AbortSlot(slot_id);
    if (absl::IsNotFound(aborted)) {
      return UnknownSlotError(slot_id);
    }
    return st;
  }
  return engine_->CommitSlot(slot_id, args.key, PutOptionsOf(args));
}

absl::StatusOr<std::unique_ptr<wire::IncrementalChunkCheck>> KvService::BeginStreamedCommit(
    uint64_t slot_id, wire::TrailingHasher* helper) {
  tiering::DramTier* dram = engine_->dram();
  if (dram == nullptr) return absl::FailedPreconditionError("no DRAM tier: no shared-memory slots");
  KVTIER_ASSIGN_OR_RETURN(tiering::PoolExtent e, FindSlot(slot_id, /*remove=*/false));
  return std::make_unique<wire::IncrementalChunkCheck>(
      std::span<const uint8_t>(dram->base() + e.offset, e.length), helper);
}

absl::Status KvService::FinishStreamedCommit(const PutArgs& args, uint64_t slot_id,
                                             wire::IncrementalChunkCheck& check) {
  auto ext = FindSlot(slot_id, /*remove=*/true);
  if (!ext.ok()) return UnknownSlotError(slot_id);
  absl::Status st = check.Finish().status();
  if (!st.ok()) {
    if (absl::IsNotFound(engine_->AbortSlot(slot_id))) {
      return UnknownSlotError(slot_id);
    }
    return st;
  }
  return engine_->CommitSlot(slot_id, args.key, PutOptionsOf(args));
}

absl::Status KvService::VerifyStored(const Hash128& key, std::span<const uint8_t> bytes) {
  absl::Status st = wire::VerifyChunkParallel(bytes).status();
  if (st.ok()) return st;
  return DropCorrupt(key, st);
}

absl::Status KvService::DropCorrupt(const Hash128& key, const absl::Status& st) {
  (void)engine_->Delete(key);
  return absl::DataLossError(absl::StrCat("stored chunk ", key.ToHex(), " is corrupt (dropped): ",
                                          st.message()));
}

absl::StatusOr<GetResult> KvService::Get(const Hash128& key, GetMode mode, uint64_t slot_id,
                                         uint32_t lease_ms, bool verify) {
  GetResult r;
  tiering::DramTier* dram = engine_->dram();
  if (mode != GetMode::kCopy && dram == nullptr) {
    return absl::FailedPreconditionError("no DRAM tier: no shared-memory gets");
  }
  if (mode == GetMode::kShm) {
    KVTIER_ASSIGN_OR_RETURN(tiering::SharedRead sr, engine_->GetShared(key, lease_ms));
    std::span<const uint8_t> bytes(dram->base() + sr.extent.offset, sr.chunk_bytes);
    // A stored chunk handed out in place was verified at put: its bytes are
    // read only on request (a reader found a mismatch), while still pinned.
    // A scratch copy is always checked: the daemon made it.
    absl::Status st;
    if (sr.slot_id != 0 || verify) st = wire::VerifyChunkParallel(bytes).status();
    if (!st.ok()) {
      (void)(sr.lease_id != 0 ? engine_->Release(sr.lease_id) : engine_->AbortSlot(sr.slot_id));
      return DropCorrupt(key, st);
    }
    r.tier = sr.tier;
    r.chunk_bytes = sr.chunk_bytes;
    r.extent = sr.extent;
    r.lease_id = sr.lease_id;
    r.scratch_slot_id = sr.slot_id;
    r.expires_at_us = sr.expires_at_us;
    return r;
  }
  std::span<uint8_t> out;
  if (mode == GetMode::kSlot) {
    KVTIER_ASSIGN_OR_RETURN(tiering::PoolExtent e, FindSlot(slot_id, /*remove=*/false));
    KVTIER_ASSIGN_OR_RETURN(r.chunk_bytes, engine_->ChunkBytes(key));
    if (e.length < r.chunk_bytes) {
      return absl::InvalidArgumentError(absl::StrCat("slot ", slot_id, " holds ", e.length,
                                                     " bytes; the chunk is ", r.chunk_bytes));
    }
    r.extent = tiering::PoolExtent{e.offset, r.chunk_bytes};
    out = std::span<uint8_t>(dram->base() + e.offset, r.chunk_bytes);
  } else {
    KVTIER_ASSIGN_OR_RETURN(r.chunk_bytes, engine_->ChunkBytes(key));
    r.bytes.resize(r.chunk_bytes);
    out = std::span<uint8_t>(r.bytes);
  }
  auto tier = engine_->Get(key, out);
  if (!tier.ok()) return tier.status();
  KVTIER_RETURN_IF_ERROR(VerifyStored(key, out));
  r.tier = *tier;
  return r;
}

absl::Status KvService::Delete(const Hash128& key) { return engine_->Delete(key); }

absl::StatusOr<bool> KvService::Prefetch(std::vector<Hash128> keys, uint32_t deadline_ms) {
  KVTIER_RETURN_IF_ERROR(CheckKeyCount(keys.size()));
  std::future<absl::Status> done = engine_->Prefetch(std::move(keys));
  uint32_t wait = std::min(deadline_ms, limits_.max_prefetch_wait_ms);
  if (wait == 0) return false;
  if (done.wait_for(std::chrono::milliseconds(wait)) != std::future_status::ready) return false;
  KVTIER_RETURN_IF_ERROR(done.get());
  return true;
}

absl::StatusOr<tiering::Lease> KvService::Pin(std::span<const Hash128> keys, uint32_t ttl_ms) {
  KVTIER_RETURN_IF_ERROR(CheckKeyCount(keys.size()));
  if (keys.empty()) return absl::InvalidArgumentError("pin of no keys");
  return engine_->Pin(keys, ttl_ms);
}

absl::StatusOr<tiering::Lease> KvService::Renew(uint64_t lease_id, uint32_t ttl_ms) {
  auto l = engine_->Renew(lease_id, ttl_ms);
  if (absl::IsNotFound(l.status())) return UnknownLeaseError(lease_id);
  return l;
}

absl::Status KvService::Release(uint64_t lease_id) {
  absl::Status st = engine_->Release(lease_id);
  return absl::IsNotFound(st) ? UnknownLeaseError(lease_id) : st;
}

ServiceStats KvService::Stats() {
  ServiceStats s;
  s.tiers = engine_->Usage();
  for (int i = 0; i < static_cast<int>(tiering::EngineMetric::kCount); ++i) {
    auto m = static_cast<tiering::EngineMetric>(i);
    s.counters.emplace_back(tiering::EngineMetricName(m), engine_->metric(m));
  }
  return s;
}

absl::StatusOr<uint64_t> KvService::FlushDramToNvme() {
  tiering::DramTier* dram = engine_->dram();
  tiering::NvmeTier* nvme = engine_->nvme();
  if (dram == nullptr || nvme == nullptr) return 0;
  uint64_t written = 0;
  std::vector<uint8_t> buf;
  for (const auto& [id, len] : dram->List()) {
    if (id.part != Part::kWhole) continue;
    if (nvme->Size(id).ok()) continue;  // already durable
    // Leave room: a full NVMe tier would evict older chunks to take these.
    if (nvme->used_bytes() + len + 4096 > nvme->capacity_bytes()) continue;
    buf.resize(len);
    if (!dram->Read(id, buf).ok()) continue;  // deleted meanwhile
    if (!wire::VerifyChunkParallel(buf).ok()) continue;  // never persist corrupt bytes
    tiering::PutOptions po;
    po.durable = true;
    absl::Status st = engine_->Put(id.key, buf, po);
    if (st.ok()) ++written;
  }
  return written;
}

}  // namespace kvtier::server
