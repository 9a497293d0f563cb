#include "server/service.h"

#include <chrono>
#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "codec/chunk.h"
#include "common/status.h"
#include "wire/chunk_check.h"
#include "wire/shm_frames.h"

namespace kvtier::server {

using tiering::Part;
using tiering::TierKind;

namespace {

// The service's check of a shared-memory read: a stored chunk handed out in
// place was verified at put, so its bytes are read only on request (a reader
// found a mismatch), while still pinned; a scratch copy is checked unless the
// tier checked it as it read it. OK when no check is due.
absl::Status CheckSharedRead(const tiering::SharedRead& sr, bool verify) {
  if ((sr.slot_id == 0 || sr.verified) && !verify) return absl::OkStatus();
  return wire::VerifyChunkParallel(sr.bytes).status();
}

// A shared-memory get's answer for `sr`, which CheckSharedRead passed.
GetResult SharedResult(const tiering::SharedRead& sr, bool verify) {
  GetResult r;
  r.tier = sr.tier;
  r.chunk_bytes = sr.chunk_bytes;
  r.extent = sr.extent;
  r.lease_id = sr.lease_id;
  r.scratch_slot_id = sr.slot_id;
  r.expires_at_us = sr.expires_at_us;
  r.checked = verify || (sr.slot_id != 0 && sr.verified);
  return r;
}

tiering::PutOptions PutOptionsOf(const PutArgs& args) {
  tiering::PutOptions po;
  po.durable = args.durable;
  po.tier = args.tier;
  po.tenant = args.tenant;
  po.holder = args.holder;
  return po;
}

}  // namespace

absl::Status UnknownSlotError(uint64_t slot_id) {
  return absl::NotFoundError(absl::StrCat("slot ", slot_id, " unknown or expired"));
}

absl::Status UnknownLeaseError(uint64_t lease_id) {
  return absl::NotFoundError(absl::StrCat("lease ", lease_id, " unknown or expired"));
}

KvService::KvService(tiering::PlacementEngine* engine, const ServiceLimits& limits,
                     const TenantRegistry* tenants)
    : engine_(engine), limits_(limits), tenants_(tenants) {}

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
                                                        const bandwidth::PrefillCost& prefill,
                                                        uint32_t tokens_per_chunk) {
  KVTIER_RETURN_IF_ERROR(CheckKeyCount(keys.size()));
  constexpr uint32_t kMaxTokensPerChunk = 1 << 20;
  if (!std::isfinite(prefill.tokens_per_s) || prefill.tokens_per_s < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("prefill_tokens_per_s ", prefill.tokens_per_s, " is not a rate >= 0"));
  }
  if (!std::isfinite(prefill.attention_doubling_tokens) || prefill.attention_doubling_tokens < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "attention_doubling_tokens ", prefill.attention_doubling_tokens,
        " is not a context length >= 0 (0: recompute cost linear in tokens)"));
  }
  if (prefill.tokens_per_s > 0 &&
      (tokens_per_chunk == 0 || tokens_per_chunk > kMaxTokensPerChunk)) {
    return absl::InvalidArgumentError(absl::StrCat("tokens_per_chunk ", tokens_per_chunk,
                                                   " outside 1..", kMaxTokensPerChunk));
  }
  LoadPlan plan;
  plan.estimate = engine_->EstimatePrefixLoad(keys);
  if (prefill.tokens_per_s > 0) {
    const std::vector<double> recompute_us =
        bandwidth::ChunkRecomputeMicros(plan.estimate.load_us.size(), tokens_per_chunk, prefill);
    plan.decision = bandwidth::BestLoadPrefix(plan.estimate.load_us, recompute_us);
  }
  return plan;
}

absl::StatusOr<KvService::HeldPlan> KvService::PlanAndHold(std::span<const Hash128> keys,
                                                           const bandwidth::PrefillCost& prefill,
                                                           uint32_t tokens_per_chunk,
                                                           uint32_t lease_ms,
                                                           const tiering::Holder& holder) {
  HeldPlan h;
  KVTIER_ASSIGN_OR_RETURN(h.plan, PlanLoad(keys, prefill, tokens_per_chunk));
  const size_t hits = h.plan.estimate.tiers.size();
  size_t n = prefill.tokens_per_s > 0 ? std::min<size_t>(h.plan.decision.chunks, hits) : hits;
  // A planned chunk on the remote tier only is not stored here: the hold
  // covers the local prefix of the plan (the rest is loaded from the
  // cluster, or recomputed).
  for (size_t i = 0; i < n; ++i) {
    if (h.plan.estimate.tiers[i] == TierKind::kRemote) {
      n = i;
      break;
    }
  }
  if (n == 0) return h;
  auto lease = engine_->Hold(keys.first(n), lease_ms, holder);
  if (absl::IsNotFound(lease.status())) {
    // Deleted or evicted between the plan and the hold: plan again once.
    KVTIER_ASSIGN_OR_RETURN(h.plan, PlanLoad(keys, prefill, tokens_per_chunk));
    n = std::min(n, h.plan.estimate.tiers.size());
    if (n == 0) return h;
    lease = engine_->Hold(keys.first(n), lease_ms, holder);
  }
  KVTIER_RETURN_IF_ERROR(lease.status());
  h.held_chunks = static_cast<uint32_t>(n);
  h.lease = *lease;
  return h;
}

absl::Status KvService::Put(const PutArgs& args, std::span<const uint8_t> chunk) {
  if (chunk.size() > limits_.max_chunk_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("chunk of ", chunk.size(),
                                                   " bytes; the limit is ", limits_.max_chunk_bytes));
  }
  KVTIER_ASSIGN_OR_RETURN(codec::VerifiedChunk verified, wire::VerifyChunkParallel(chunk));
  return engine_->Put(args.key, verified, PutOptionsOf(args));
}

absl::StatusOr<tiering::Slot> KvService::AllocateSlot(uint64_t bytes, uint32_t ttl_ms,
                                                      const tiering::Holder& holder) {
  if (bytes == 0 || bytes > limits_.max_chunk_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("slot of ", bytes, " bytes; must be 1..",
                                                   limits_.max_chunk_bytes));
  }
  return engine_->AllocateSlot(bytes, ttl_ms, holder.tenant, holder.id);
}

absl::StatusOr<std::span<uint8_t>> KvService::SlotSpan(uint64_t slot_id,
                                                       tiering::HolderId holder) {
  if (engine_->dram() == nullptr) {
    return absl::FailedPreconditionError("no DRAM tier: no shared-memory slots");
  }
  auto view = engine_->SlotView(slot_id, holder);
  if (!view.ok()) return UnknownSlotError(slot_id);
  return view->bytes;
}

absl::Status KvService::AbortSlot(uint64_t slot_id, tiering::HolderId holder) {
  absl::Status st = engine_->AbortSlot(slot_id, holder);
  return absl::IsNotFound(st) ? UnknownSlotError(slot_id) : st;
}

absl::Status KvService::CommitVerified(const PutArgs& args, uint64_t slot_id,
                                       const absl::StatusOr<codec::VerifiedChunk>& verified) {
  if (!verified.ok()) {
    if (absl::IsNotFound(engine_->AbortSlot(slot_id, args.holder))) return UnknownSlotError(slot_id);
    return verified.status();
  }
  absl::Status st = engine_->CommitSlot(slot_id, *verified, args.key, PutOptionsOf(args));
  return absl::IsNotFound(st) ? UnknownSlotError(slot_id) : st;
}

absl::Status KvService::CommitSlot(const PutArgs& args, uint64_t slot_id) {
  KVTIER_ASSIGN_OR_RETURN(std::span<uint8_t> bytes, SlotSpan(slot_id, args.holder));
  // The one pass over these bytes: on the pool, before the engine makes them
  // an object (with the header parsed here): the check of the client's
  // checksums, or their computation for a chunk the client left unsealed.
  // Later shared-memory gets do not read them again (the reader checks what
  // it copies).
  if (args.landing_layers != 0) {
    if (!args.seal) return absl::InvalidArgumentError("a landing commit is a sealed commit");
    auto sealed = wire::SealLandedChunkParallel(
        bytes, slot_id, args.landing_layers,
        absl::Now() + absl::Milliseconds(wire::shm::kLandingWaitMs));
    // Not aborted: the holder's device may still be writing the slot.
    if (!sealed.ok()) return sealed.status();
    return CommitVerified(args, slot_id, sealed);
  }
  return CommitVerified(args, slot_id,
                        args.seal ? wire::SealChunkParallel(bytes) : wire::VerifyChunkParallel(bytes));
}

absl::StatusOr<std::unique_ptr<wire::IncrementalChunkCheck>> KvService::BeginStreamedCommit(
    uint64_t slot_id, tiering::HolderId holder, wire::TrailingHasher* helper) {
  KVTIER_ASSIGN_OR_RETURN(std::span<uint8_t> bytes, SlotSpan(slot_id, holder));
  return std::make_unique<wire::IncrementalChunkCheck>(bytes, helper);
}

absl::Status KvService::FinishStreamedCommit(const PutArgs& args, uint64_t slot_id,
                                             wire::IncrementalChunkCheck& check) {
  if (!SlotSpan(slot_id, args.holder).ok()) return UnknownSlotError(slot_id);
  return CommitVerified(args, slot_id, check.Finish());
}

absl::Status KvService::VerifyStored(const Hash128& key, std::span<const uint8_t> bytes) {
  absl::Status st = wire::VerifyChunkParallel(bytes).status();
  if (st.ok()) return st;
  return DropCorrupt(key, st);
}

absl::Status KvService::DropCorrupt(const Hash128& key, const absl::Status& st) {
  (void)engine_->DropCorrupt(key);
  return absl::DataLossError(absl::StrCat("stored chunk ", key.ToHex(), " is corrupt (dropped): ",
                                          st.message()));
}

absl::StatusOr<GetResult> KvService::Get(const Hash128& key, GetMode mode,
                                         const tiering::Holder& holder, uint64_t slot_id,
                                         uint32_t lease_ms, bool verify) {
  GetResult r;
  tiering::DramTier* dram = engine_->dram();
  if (mode != GetMode::kCopy && dram == nullptr) {
    return absl::FailedPreconditionError("no DRAM tier: no shared-memory gets");
  }
  if (mode == GetMode::kShm) {
    tiering::GetOptions go;
    go.holder = holder;
    KVTIER_ASSIGN_OR_RETURN(tiering::SharedRead sr, engine_->GetShared(key, lease_ms, go));
    absl::Status st = CheckSharedRead(sr, verify);
    if (!st.ok()) {
      (void)(sr.lease_id != 0 ? engine_->Release(sr.lease_id, holder.id)
                              : engine_->AbortSlot(sr.slot_id, holder.id));
      return DropCorrupt(key, st);
    }
    return SharedResult(sr, verify);
  }
  std::span<uint8_t> out;
  if (mode == GetMode::kSlot) {
    auto view = engine_->SlotView(slot_id, holder.id);
    if (!view.ok()) return UnknownSlotError(slot_id);
    KVTIER_ASSIGN_OR_RETURN(r.chunk_bytes, engine_->ChunkBytes(key));
    if (view->extent.length < r.chunk_bytes) {
      return absl::InvalidArgumentError(absl::StrCat("slot ", slot_id, " holds ",
                                                     view->extent.length, " bytes; the chunk is ",
                                                     r.chunk_bytes));
    }
    r.extent = tiering::PoolExtent{view->extent.offset, r.chunk_bytes};
    out = view->bytes.first(r.chunk_bytes);
  } else {
    KVTIER_ASSIGN_OR_RETURN(r.chunk_bytes, engine_->ChunkBytes(key));
    r.bytes.resize(r.chunk_bytes);
    out = std::span<uint8_t>(r.bytes);
  }
  bool verified = false;  // by the tier, as it read the bytes (NVMe)
  auto tier = engine_->Get(key, out, {}, &verified);
  if (!tier.ok()) return tier.status();
  if (!verified) KVTIER_RETURN_IF_ERROR(VerifyStored(key, out));
  r.tier = *tier;
  return r;
}

absl::StatusOr<std::vector<absl::StatusOr<GetResult>>> KvService::GetBatchShared(
    std::span<const Hash128> keys, uint32_t lease_ms, bool verify, const tiering::Holder& holder) {
  KVTIER_RETURN_IF_ERROR(CheckKeyCount(keys.size()));
  if (engine_->dram() == nullptr) {
    return absl::FailedPreconditionError("no DRAM tier: no shared-memory gets");
  }
  absl::flat_hash_set<Hash128> seen;
  seen.reserve(keys.size());
  for (const Hash128& k : keys) {
    if (!seen.insert(k).second) {
      return absl::InvalidArgumentError(absl::StrCat("key ", k.ToHex(), " twice in one batch"));
    }
  }
  std::vector<absl::StatusOr<tiering::SharedRead>> reads =
      engine_->GetSharedBatch(keys, lease_ms, tiering::GetOptions{.holder = holder});
  std::vector<absl::StatusOr<GetResult>> out;
  out.reserve(keys.size());
  for (size_t i = 0; i < keys.size(); ++i) {
    if (!reads[i].ok()) {
      out.push_back(reads[i].status());
      continue;
    }
    const tiering::SharedRead& sr = *reads[i];
    absl::Status st = CheckSharedRead(sr, verify);
    if (!st.ok()) {
      (void)(sr.lease_id != 0 ? engine_->Release(sr.lease_id, holder.id)
                              : engine_->AbortSlot(sr.slot_id, holder.id));
      out.push_back(DropCorrupt(keys[i], st));
      continue;
    }
    out.push_back(SharedResult(sr, verify));
  }
  return out;
}

absl::Status KvService::Delete(const Hash128& key) { return engine_->Delete(key); }

absl::StatusOr<KvService::PrefetchReport> KvService::PrefetchWithin(std::span<const Hash128> keys,
                                                                    uint64_t byte_budget,
                                                                    uint32_t deadline_ms) {
  KVTIER_RETURN_IF_ERROR(CheckKeyCount(keys.size()));
  PrefetchReport rep;
  tiering::PrefixLoadEstimate est = engine_->EstimatePrefixLoad(keys);
  std::vector<Hash128> todo;
  for (size_t i = 0; i < est.tiers.size(); ++i) {
    if (est.tiers[i] == TierKind::kDram || est.tiers[i] == TierKind::kHbm) continue;
    if (byte_budget != 0 && rep.bytes + est.bytes[i] > byte_budget) break;
    rep.bytes += est.bytes[i];
    todo.push_back(keys[i]);
  }
  rep.keys = static_cast<uint32_t>(todo.size());
  if (todo.empty()) {
    rep.completed = true;
    return rep;
  }
  std::future<absl::Status> done = engine_->Prefetch(std::move(todo));
  const uint32_t wait = std::min(deadline_ms, limits_.max_prefetch_wait_ms);
  if (wait == 0 || done.wait_for(std::chrono::milliseconds(wait)) != std::future_status::ready) {
    return rep;
  }
  KVTIER_RETURN_IF_ERROR(done.get());
  rep.completed = true;
  return rep;
}

absl::StatusOr<bool> KvService::Prefetch(std::vector<Hash128> keys, uint32_t deadline_ms) {
  KVTIER_RETURN_IF_ERROR(CheckKeyCount(keys.size()));
  std::future<absl::Status> done = engine_->Prefetch(std::move(keys));
  uint32_t wait = std::min(deadline_ms, limits_.max_prefetch_wait_ms);
  if (wait == 0) return false;
  if (done.wait_for(std::chrono::milliseconds(wait)) != std::future_status::ready) return false;
  KVTIER_RETURN_IF_ERROR(done.get());
  return true;
}

absl::StatusOr<tiering::Lease> KvService::Pin(std::span<const Hash128> keys, uint32_t ttl_ms,
                                              const tiering::Holder& holder) {
  KVTIER_RETURN_IF_ERROR(CheckKeyCount(keys.size()));
  if (keys.empty()) return absl::InvalidArgumentError("pin of no keys");
  return engine_->Pin(keys, ttl_ms, /*allow_remote=*/true, holder);
}

absl::StatusOr<tiering::Lease> KvService::Renew(uint64_t lease_id, uint32_t ttl_ms,
                                                tiering::HolderId holder) {
  auto l = engine_->Renew(lease_id, ttl_ms, holder);
  if (absl::IsNotFound(l.status())) return UnknownLeaseError(lease_id);
  return l;
}

absl::Status KvService::Release(uint64_t lease_id, tiering::HolderId holder) {
  absl::Status st = engine_->Release(lease_id, holder);
  return absl::IsNotFound(st) ? UnknownLeaseError(lease_id) : st;
}

ServiceStats KvService::Stats() {
  ServiceStats s;
  s.tiers = engine_->Usage();
  for (int i = 0; i < static_cast<int>(tiering::EngineMetric::kCount); ++i) {
    auto m = static_cast<tiering::EngineMetric>(i);
    s.counters.emplace_back(tiering::EngineMetricName(m), engine_->metric(m));
  }
  if (tenants_ != nullptr && tenants_->configured()) {
    const std::vector<tiering::TenantUsage> usage = engine_->TenantUsages();
    for (const auto& t : tenants_->tenants()) {
      TenantStats ts;
      ts.name = t->name();
      if (t->id() < usage.size()) ts.usage = usage[t->id()];
      ts.hits = t->hits();
      ts.misses = t->misses();
      ts.puts = t->puts();
      ts.put_rejections = t->put_rejections();
      s.tenants.push_back(std::move(ts));
    }
  }
  return s;
}

KvService::FlushReport KvService::FlushDramToNvme() {
  FlushReport r;
  tiering::DramTier* dram = engine_->dram();
  tiering::NvmeTier* nvme = engine_->nvme();
  if (dram == nullptr || nvme == nullptr) return r;
  std::vector<uint8_t> buf;
  for (const auto& [id, len] : dram->List()) {
    if (id.part != Part::kWhole) continue;
    if (nvme->Size(id).ok()) continue;  // already durable
    // Leave room: a full NVMe tier would evict older chunks to take these.
    if (nvme->used_bytes() + len + 4096 > nvme->capacity_bytes()) {
      ++r.no_room;
      continue;
    }
    buf.resize(len);
    if (!dram->Read(id, buf).ok()) continue;  // deleted meanwhile
    auto verified = wire::VerifyChunkParallel(buf);
    if (!verified.ok()) {  // never persist corrupt bytes; counted in data_loss
      ++r.corrupt;
      (void)engine_->DropCorrupt(id.key);
      continue;
    }
    tiering::PutOptions po;
    po.durable = true;
    absl::Status st = engine_->Put(id.key, *verified, po);
    if (st.ok()) {
      ++r.written;
    } else {
      if (r.failed++ == 0) r.first_error = st;
    }
  }
  return r;
}

}  // namespace kvtier::server
