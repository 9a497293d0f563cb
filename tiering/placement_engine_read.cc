// PlacementEngine's reads: Get, GetShared and GetSharedBatch, the lookups
// (LookupPrefix, EstimatePrefixLoad, Locate, ChunkBytes) and the fetches
// from the remote tier.
#include "tiering/placement_engine.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "bandwidth/model.h"
#include "codec/chunk.h"
#include "common/status.h"
#include "tiering/placement_engine_internal.h"

namespace kvtier::tiering {

namespace {

// How long a batched read waits for the chunks a prefetch is reading.
constexpr int64_t kPrefetchWaitMs = 10000;

}  // namespace

absl::StatusOr<TierKind> PlacementEngine::ReadObject(const ObjectKey& id, std::span<uint8_t> out) {
  for (int attempt = 0; attempt < 4; ++attempt) {
    TierKind src;
    {
      absl::MutexLock l(&mu_);
      auto it = chunks_.find(id.key);
      if (it == chunks_.end()) return absl::NotFoundError("chunk not stored");
      auto f = Fastest(it->second.where[PartIndex(id.part)]);
      if (!f) return absl::NotFoundError("chunk part not stored");
      src = *f;
    }
    absl::Status st = tiers_[static_cast<int>(src)]->Read(id, out);
    if (st.ok()) return src;
    if (absl::IsNotFound(st)) {  // moved or evicted meanwhile: look again
      absl::MutexLock l(&mu_);
      auto it = chunks_.find(id.key);
      if (it != chunks_.end() && it->second.busy == 0) Forget(id, src);
      continue;
    }
    if (absl::IsDataLoss(st)) {
      if (DropCorruptCopy(id, src)) continue;
      return st;
    }
    return st;
  }
  return absl::UnavailableError("chunk kept moving during the read; retry");
}

bool PlacementEngine::DropCorruptCopy(const ObjectKey& id, TierKind src) {
  Count(EngineMetric::kDataLoss);
  std::vector<std::pair<ObjectKey, TierKind>> dead;
  {
    absl::MutexLock l(&mu_);
    Forget(id, src);
    auto it = chunks_.find(id.key);
    if (it != chunks_.end() && it->second.where[PartIndex(id.part)] != 0) return true;
    if (it != chunks_.end()) {
      TakeCopiesLocked(id.key, it->second, 0, &dead);
      chunks_.erase(it);
    }
  }
  for (auto& [o, k] : dead) (void)tiers_[static_cast<int>(k)]->Erase(o);
  return false;
}

absl::StatusOr<PlacementEngine::ChunkState*> PlacementEngine::StartReadLocked(const Hash128& key) {
  Count(EngineMetric::kGets);
  auto it = chunks_.find(key);
  if (it == chunks_.end()) {
    Count(EngineMetric::kMisses);
    return absl::NotFoundError("chunk not stored");
  }
  ChunkState& st = it->second;
  ++st.uses;
  for (int p = 0; p < 3; ++p) {
    if (auto k = Fastest(st.where[p])) policies_[static_cast<int>(*k)]->OnAccess({key, static_cast<Part>(p)});
  }
  return &st;
}

void PlacementEngine::CountHit(TierKind src) {
  Count(src == TierKind::kHbm ? EngineMetric::kHitsHbm
        : src == TierKind::kDram ? EngineMetric::kHitsDram
                                 : EngineMetric::kHitsNvme);
}

absl::StatusOr<TierKind> PlacementEngine::FinishRead(const Hash128& key, const ReadShape& shape,
                                                     std::span<uint8_t> out,
                                                     const GetOptions& opts, bool* verified) {
  const uint64_t bytes = shape.bytes, kobj = shape.k_object_bytes;
  TierKind src;
  if (!shape.split) {
    KVTIER_ASSIGN_OR_RETURN(src, ReadObject({key, Part::kWhole}, out));
    *verified = VerifiesOnRead(src);
  } else {
    // K object = header + K section = the chunk's first kobj bytes.
    KVTIER_ASSIGN_OR_RETURN(TierKind ks, ReadObject({key, Part::kK}, out.first(kobj)));
    std::vector<uint8_t> vbuf(codec::kHeaderSize + bytes - kobj);
    KVTIER_ASSIGN_OR_RETURN(TierKind vs, ReadObject({key, Part::kV}, vbuf));
    if (std::memcmp(vbuf.data(), out.data(), codec::kHeaderSize) != 0) {
      return absl::DataLossError("K and V parts carry different headers");
    }
    std::memcpy(out.data() + kobj, vbuf.data() + codec::kHeaderSize, bytes - kobj);
    src = std::max(ks, vs);
    *verified = VerifiesOnRead(ks) && VerifiesOnRead(vs);
  }
  CountHit(src);
  if (src == TierKind::kNvme && dram_ && opts.promote.value_or(options_.promote_on_hit)) {
    ObjectKey w{key, Part::kWhole};
    TenantId tenant;
    {
      absl::MutexLock l(&mu_);
      tenant = TenantOfLocked(key);
    }
    if (StoreWithEviction(TierKind::kDram, w, out, kBackground, tenant).ok()) {
      NoteStored(TierKind::kDram, w, bytes, false, bytes, tenant);
      Count(EngineMetric::kPromotions);
    }
  }
  return src;
}

absl::StatusOr<TierKind> PlacementEngine::Get(const Hash128& key, std::span<uint8_t> out,
                                              const GetOptions& opts, bool* verified) {
  KVTIER_ASSIGN_OR_RETURN(bool fetched, FetchIfMissing(key, opts.allow_remote));
  ReadShape shape;
  {
    absl::MutexLock l(&mu_);
    KVTIER_ASSIGN_OR_RETURN(ChunkState * st, StartReadLocked(key));
    shape = {st->bytes, st->k_object_bytes, st->split};
  }
  if (out.size() != shape.bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("buffer is ", out.size(), " bytes, chunk is ", shape.bytes));
  }
  bool checked = false;
  KVTIER_ASSIGN_OR_RETURN(TierKind src, FinishRead(key, shape, out, opts, &checked));
  if (verified != nullptr) *verified = checked;
  return fetched ? TierKind::kRemote : src;
}

absl::StatusOr<SharedRead> PlacementEngine::GetShared(const Hash128& key, int64_t ttl_ms,
                                                      const GetOptions& opts) {
  if (!dram_) return absl::FailedPreconditionError("no DRAM tier");
  KVTIER_ASSIGN_OR_RETURN(bool fetched, FetchIfMissing(key, opts.allow_remote));
  SharedRead r;
  ReadShape shape;
  TenantId tenant;
  {
    absl::MutexLock l(&mu_);
    const int64_t now = Now();
    ExpireLocked(now);
    KVTIER_ASSIGN_OR_RETURN(ChunkState * st, StartReadLocked(key));
    shape = {st->bytes, st->k_object_bytes, st->split};
    r.chunk_bytes = st->bytes;
    KVTIER_ASSIGN_OR_RETURN(bool pinned,
                            PinInDramLocked(key, st, ttl_ms, now, fetched, opts.holder, &r));
    if (pinned) return r;
    // Pinned (without a lease) while a scratch slot is made and filled, so
    // that making room for the slot cannot evict it.
    ++st->pins;
    tenant = st->tenant;
  }
  auto unpin = [&] { UnpinOne(key); };
  auto slot = AllocateSlotOf(shape.bytes, ttl_ms, /*scratch=*/true, tenant, opts.holder);
  if (!slot.ok()) {
    unpin();
    return slot.status();
  }
  auto src = FinishRead(key, shape, {dram_->base() + slot->extent.offset, shape.bytes}, opts,
                        &r.verified);
  unpin();
  if (!src.ok()) {
    (void)AbortSlot(slot->id, opts.holder.id);
    return src.status();
  }
  r.tier = fetched ? TierKind::kRemote : *src;
  r.extent = PoolExtent{slot->extent.offset, shape.bytes};
  r.bytes = std::span<const uint8_t>(dram_->base() + slot->extent.offset, shape.bytes);
  r.slot_id = slot->id;
  r.expires_at_us = slot->expires_at_us;
  return r;
}

absl::StatusOr<bool> PlacementEngine::PinInDramLocked(const Hash128& key, ChunkState* st,
                                                      int64_t ttl_ms, int64_t now, bool fetched,
                                                      const Holder& holder, SharedRead* r) {
  if (st->split || (st->where[0] & Bit(TierKind::kDram)) == 0) return false;
  // Whole in DRAM: pinned where it is. The pin keeps the extent (no
  // eviction, move or delete), so the reference is only for the offset.
  auto ref = dram_->AcquireRef({key, Part::kWhole});
  if (!ref.ok()) return false;
  dram_->ReleaseRef(*ref);
  auto lease = holds_.AddLease({key}, st->bytes, ttl_ms, now, holder);
  KVTIER_RETURN_IF_ERROR(CountRefusal(lease.status()));
  r->chunk_bytes = st->bytes;
  r->lease_id = lease->id;
  ++st->pins;
  r->expires_at_us = lease->expires_at_us;
  r->extent = PoolExtent{ref->offset, st->bytes};
  r->bytes = std::span<const uint8_t>(dram_->base() + ref->offset, st->bytes);
  r->tier = fetched ? TierKind::kRemote : TierKind::kDram;
  CountHit(TierKind::kDram);
  return true;
}

void PlacementEngine::UnpinOne(const Hash128& key) {
  absl::MutexLock l(&mu_);
  auto it = chunks_.find(key);
  if (it != chunks_.end() && it->second.pins > 0) --it->second.pins;
}

std::vector<absl::StatusOr<SharedRead>> PlacementEngine::GetSharedBatch(
    std::span<const Hash128> keys, int64_t ttl_ms, const GetOptions& opts) {
  std::vector<absl::StatusOr<SharedRead>> out(keys.size(), absl::NotFoundError("chunk not stored"));
  if (!dram_) {
    for (auto& r : out) r = absl::FailedPreconditionError("no DRAM tier");
    return out;
  }
  // Chunks whole in DRAM are pinned in place; chunks whole on NVMe only are
  // pinned (no lease) for the batched read; the rest go through GetShared.
  std::vector<size_t> nvme, single;
  std::vector<uint64_t> nvme_bytes;
  {
    absl::MutexLock l(&mu_);
    const absl::Time until = absl::Now() + absl::Milliseconds(kPrefetchWaitMs);
    for (size_t i = 0; i < keys.size();) {
      if (!prefetching_.contains(keys[i])) {
        ++i;
      } else if (prefetch_done_.WaitWithDeadline(&mu_, until)) {
        break;  // waited long enough: read what is still being prefetched too
      }
    }
    const int64_t now = Now();
    ExpireLocked(now);
    for (size_t i = 0; i < keys.size(); ++i) {
      auto it = chunks_.find(keys[i]);
      if (it == chunks_.end()) {
        single.push_back(i);  // a miss here; GetShared asks the remote tier and counts it
        continue;
      }
      ChunkState& st = it->second;
      const uint8_t whole = st.where[0];
      if (!st.split && (whole & Bit(TierKind::kDram)) != 0) {
        auto started = StartReadLocked(keys[i]);
        if (!started.ok()) {
          out[i] = started.status();
          continue;
        }
        SharedRead r;
        auto pinned = PinInDramLocked(keys[i], *started, ttl_ms, now, false, opts.holder, &r);
        if (!pinned.ok()) {
          out[i] = pinned.status();
        } else if (*pinned) {
          out[i] = std::move(r);
        } else {
          single.push_back(i);
        }
      } else if (nvme_ != nullptr && !st.split && whole == Bit(TierKind::kNvme)) {
        (void)StartReadLocked(keys[i]);
        ++st.pins;
        ++loading_[keys[i]];
        nvme.push_back(i);
        nvme_bytes.push_back(st.bytes);
      } else {
        single.push_back(i);
      }
    }
  }
  // Ends a chunk's entry in loading_ (once read, or once its scratch copy
  // is promoted or dropped).
  auto loaded = [this](const Hash128& key) {
    absl::MutexLock l(&mu_);
    auto it = loading_.find(key);
    if (it != loading_.end() && --it->second == 0) loading_.erase(it);
  };
  // One scratch slot per NVMe chunk, then every read in one submission.
  std::vector<ObjectKey> ids;
  std::vector<std::span<uint8_t>> dst;
  std::vector<Slot> slots;
  std::vector<size_t> reading;
  for (size_t j = 0; j < nvme.size(); ++j) {
    const size_t i = nvme[j];
    TenantId tenant;
    {
      absl::MutexLock l(&mu_);
      tenant = TenantOfLocked(keys[i]);
    }
    auto slot = AllocateSlotOf(nvme_bytes[j], ttl_ms, /*scratch=*/true, tenant, opts.holder);
    if (!slot.ok()) {
      UnpinOne(keys[i]);
      loaded(keys[i]);
      out[i] = slot.status();
      continue;
    }
    ids.push_back({keys[i], Part::kWhole});
    dst.emplace_back(dram_->base() + slot->extent.offset, nvme_bytes[j]);
    slots.push_back(*slot);
    reading.push_back(i);
  }
  std::vector<absl::Status> read;
  if (!ids.empty()) read = nvme_->ReadBatch(ids, dst);
  for (size_t j = 0; j < reading.size(); ++j) {
    const size_t i = reading[j];
    if (!read[j].ok()) {
      (void)AbortSlot(slots[j].id, opts.holder.id);
      UnpinOne(keys[i]);
      loaded(keys[i]);
      // A corrupt copy (the tier dropped it) ends the chunk unless another
      // copy remains; that one, or a chunk moved or evicted meanwhile, is
      // read as GetShared reads it.
      if (absl::IsDataLoss(read[j]) && !DropCorruptCopy(ids[j], TierKind::kNvme)) {
        out[i] = read[j];
      } else {
        single.push_back(i);
      }
      continue;
    }
    CountHit(TierKind::kNvme);
    bool promote = false;
    if (opts.promote.value_or(options_.promote_on_hit)) {
      absl::MutexLock l(&mu_);
      // The loading_ entry then ends with the promotion (PromoteFromSlot,
      // or the slot's expiry).
      promote = holds_.MarkPromote(slots[j].id, keys[i]);
    }
    if (!promote) loaded(keys[i]);
    UnpinOne(keys[i]);
    SharedRead r;
    r.tier = TierKind::kNvme;
    r.chunk_bytes = dst[j].size();
    r.extent = PoolExtent{slots[j].extent.offset, dst[j].size()};
    r.bytes = dst[j];
    r.slot_id = slots[j].id;
    r.expires_at_us = slots[j].expires_at_us;
    r.verified = true;  // NvmeTier::ReadBatch checked every section as it arrived
    out[i] = std::move(r);
  }
  for (size_t i : single) out[i] = GetShared(keys[i], ttl_ms, opts);
  return out;
}

absl::StatusOr<uint64_t> PlacementEngine::ChunkBytes(const Hash128& key, bool allow_remote) {
  KVTIER_RETURN_IF_ERROR(FetchIfMissing(key, allow_remote).status());
  absl::MutexLock l(&mu_);
  auto it = chunks_.find(key);
  if (it == chunks_.end()) return absl::NotFoundError("chunk not stored");
  return it->second.bytes;
}

absl::StatusOr<bool> PlacementEngine::FetchIfMissing(const Hash128& key, bool allow_remote) {
  if (!allow_remote || remote_ == nullptr || Contains(key)) return false;
  absl::Status st = FetchRemote(key);
  if (absl::IsNotFound(st)) return false;
  KVTIER_RETURN_IF_ERROR(st);
  return true;
}

absl::Status PlacementEngine::FetchRemote(const Hash128& key) {
  if (remote_ == nullptr) return absl::FailedPreconditionError("no remote tier");
  if (Contains(key)) return absl::OkStatus();
  const ObjectKey w{key, Part::kWhole};
  KVTIER_ASSIGN_OR_RETURN(uint64_t bytes, remote_->Size(w));
  if (bytes > codec::kMaxChunkBytes) return absl::DataLossError("remote chunk size is impossible");
  std::vector<uint8_t> buf(bytes);
  // The remote tier verifies what it reads (chunk checksums) before it
  // returns it, so nothing corrupt is stored here.
  KVTIER_RETURN_IF_ERROR(remote_->Read(w, buf));
  PutOptions o;
  o.replicate = false;
  KVTIER_ASSIGN_OR_RETURN(codec::ChunkHeader h, CheckPutChunk(buf, "chunk"));
  absl::Status st = PutLocal(key, buf, h, o);
  if (st.ok()) Count(EngineMetric::kHitsRemote);
  return st;
}

absl::StatusOr<ChunkLocation> PlacementEngine::Locate(const Hash128& key, bool allow_remote) {
  KVTIER_RETURN_IF_ERROR(FetchIfMissing(key, allow_remote).status());
  ChunkLocation loc;
  {
    absl::MutexLock l(&mu_);
    auto it = chunks_.find(key);
    if (it == chunks_.end()) return absl::NotFoundError("chunk not stored");
    loc.chunk_bytes = it->second.bytes;
    for (int p = it->second.split ? 1 : 0; p < (it->second.split ? 3 : 1); ++p) {
      auto f = Fastest(it->second.where[p]);
      if (!f) return absl::NotFoundError("chunk part not stored");
      loc.parts.push_back(PartLocation{static_cast<Part>(p), *f, std::nullopt});
    }
  }
  for (PartLocation& pl : loc.parts) {
    if (pl.tier != TierKind::kDram) continue;
    auto ref = dram_->AcquireRef({key, pl.part});
    if (!ref.ok()) continue;
    pl.dram_slot = *ref;
    dram_->ReleaseRef(*ref);
  }
  return loc;
}

bool PlacementEngine::Contains(const Hash128& key) {
  absl::MutexLock l(&mu_);
  return chunks_.contains(key);
}

std::vector<TierKind> PlacementEngine::LookupPrefix(std::span<const Hash128> keys) {
  return LookupPrefixSized(keys, nullptr);
}

std::vector<TierKind> PlacementEngine::LookupPrefixSized(std::span<const Hash128> keys,
                                                         std::vector<uint64_t>* bytes) {
  std::vector<TierKind> out = LookupLocalPrefix(keys, bytes);
  // Past what is stored here, keys the cluster has still save a prefill.
  while (remote_ != nullptr && out.size() < keys.size()) {
    auto size = remote_->Size({keys[out.size()], Part::kWhole});
    if (!size.ok()) break;
    out.push_back(TierKind::kRemote);
    if (bytes != nullptr) bytes->push_back(*size);
  }
  return out;
}

double PlacementEngine::EstimatedReadBytesPerS(TierKind k) const {
  const Tier* t = tier(k);
  const double measured = t != nullptr ? t->bandwidth().read_bytes_per_s : 0;
  return measured > 0 ? measured
                      : options_.load_cost.assumed_read_bytes_per_s[static_cast<int>(k)];
}

PrefixLoadEstimate PlacementEngine::EstimatePrefixLoad(std::span<const Hash128> keys) {
  PrefixLoadEstimate e;
  e.tiers = LookupPrefixSized(keys, &e.bytes);
  for (size_t i = 0; i < e.tiers.size(); ++i) {
    const int k = static_cast<int>(e.tiers[i]);
    e.load_us.push_back(bandwidth::LoadMicros(e.bytes[i], EstimatedReadBytesPerS(e.tiers[i]),
                                              options_.load_cost.latency_us[k]));
  }
  return e;
}

std::vector<TierKind> PlacementEngine::LookupLocalPrefix(std::span<const Hash128> keys,
                                                         std::vector<uint64_t>* bytes) {
  std::vector<TierKind> out;
  absl::MutexLock l(&mu_);
  for (const Hash128& k : keys) {
    auto it = chunks_.find(k);
    if (it == chunks_.end()) break;
    TierKind slowest = TierKind::kHbm;
    bool ok = true;
    for (int p = it->second.split ? 1 : 0; p < (it->second.split ? 3 : 1); ++p) {
      auto f = Fastest(it->second.where[p]);
      if (!f) ok = false; else slowest = std::max(slowest, *f);
    }
    if (!ok) break;
    out.push_back(slowest);
    if (bytes != nullptr) bytes->push_back(it->second.bytes);
  }
  return out;
}

}  // namespace kvtier::tiering
