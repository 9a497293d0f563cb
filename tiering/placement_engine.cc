// PlacementEngine: creation and shutdown, stores (Put), eviction and
// demotion, deletes, maintenance and usage. Reads, leases and slots, and the
// prefetcher's side are in placement_engine_{read,holds,prefetch}.cc.
#include "tiering/placement_engine.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "codec/chunk.h"
#include "common/status.h"
#include "tiering/placement_engine_internal.h"

namespace kvtier::tiering {
namespace {

constexpr const char* kMetricNames[] = {
    "puts",      "gets",       "hits_hbm",          "hits_dram",      "hits_nvme",
    "misses",    "evictions",  "demotions",         "promotions",     "admission_rejects",
    "data_loss", "leases_expired", "slots_expired", "prefetched", "hits_remote",
    "remote_errors", "holds_refused",
};
static_assert(sizeof(kMetricNames) / sizeof(kMetricNames[0]) ==
                  static_cast<size_t>(EngineMetric::kCount),
              "every EngineMetric needs a name");

}  // namespace

absl::StatusOr<codec::ChunkHeader> CheckPutChunk(std::span<const uint8_t> bytes, const char* what) {
  auto h = codec::ParseHeader(bytes);
  if (!h.ok()) return absl::InvalidArgumentError(absl::StrCat(what, ": ", h.status().message()));
  if (bytes.size() != h->layout.total_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(what, " is ", bytes.size(), " bytes, header says ",
                                                   h->layout.total_bytes));
  }
  return h;
}

const char* EngineMetricName(EngineMetric m) {
  int i = static_cast<int>(m);
  return i >= 0 && i < static_cast<int>(EngineMetric::kCount) ? kMetricNames[i] : "unknown";
}

absl::StatusOr<std::unique_ptr<PlacementEngine>> PlacementEngine::Create(
    const PlacementEngineOptions& options, EngineTiers tiers) {
  if (!tiers.dram && !tiers.nvme) return absl::InvalidArgumentError("need a DRAM or an NVMe tier");
  if (!(options.low_watermark > 0 && options.low_watermark <= options.high_watermark &&
        options.high_watermark <= 1.0)) {
    return absl::InvalidArgumentError("watermarks must satisfy 0 < low <= high <= 1");
  }
  if (options.nvme_admit_after_uses == 0) {
    return absl::InvalidArgumentError("nvme_admit_after_uses must be at least 1");
  }
  for (int k = 0; k < kNumTierKinds; ++k) {
    uint64_t sum = 0;
    for (const auto& q : options.tenant_quotas) sum += q[k];
    const Tier* t = k == static_cast<int>(TierKind::kHbm)    ? tiers.hbm.get()
                    : k == static_cast<int>(TierKind::kDram) ? tiers.dram.get()
                    : k == static_cast<int>(TierKind::kNvme) ? tiers.nvme.get()
                                                             : nullptr;
    if (sum > 0 && (t == nullptr || sum > t->capacity_bytes())) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tenant quotas of the ", TierName(static_cast<TierKind>(k)), " tier sum to ", sum,
          " bytes; the tier holds ", t == nullptr ? 0 : t->capacity_bytes()));
    }
  }
  std::unique_ptr<PlacementEngine> e(new PlacementEngine(options, std::move(tiers)));
  e->Bootstrap();
  e->prefetcher_.Start();
  if (options.maintenance_interval_ms > 0) {
    e->maintenance_thread_ = std::thread([p = e.get()] { p->MaintenanceLoop(); });
  }
  return e;
}

namespace {

// The lease table's limits: the options', and the DRAM tier's capacity and
// quotas for the tenants' shares.
HoldLimits HoldLimitsOf(const PlacementEngineOptions& o, const DramTier* dram) {
  HoldLimits l;
  l.max_held_bytes = o.max_held_bytes;
  l.max_held_bytes_per_holder = o.max_held_bytes_per_holder;
  l.max_holds_per_holder = o.max_holds_per_holder;
  l.max_held_keys_per_holder = o.max_held_keys_per_holder;
  l.default_lease_ms = o.default_lease_ms;
  l.max_lease_ms = o.max_lease_ms;
  if (dram != nullptr) l.dram_capacity = dram->capacity_bytes();
  for (const auto& q : o.tenant_quotas) {
    l.tenant_dram_quotas.push_back(q[static_cast<int>(TierKind::kDram)]);
  }
  return l;
}

}  // namespace

PlacementEngine::PlacementEngine(const PlacementEngineOptions& o, EngineTiers tiers)
    : options_(o),
      clock_(o.clock ? o.clock : SystemClock()),
      owned_(std::move(tiers)),
      holds_(HoldLimitsOf(o, owned_.dram.get())),
      prefetcher_(this) {
  hbm_ = owned_.hbm.get();
  dram_ = owned_.dram.get();
  nvme_ = owned_.nvme.get();
  nvme_file_ = dynamic_cast<NvmeTier*>(nvme_);
  tiers_[static_cast<int>(TierKind::kHbm)] = hbm_;
  tiers_[static_cast<int>(TierKind::kDram)] = dram_;
  tiers_[static_cast<int>(TierKind::kNvme)] = nvme_;
  remote_ = owned_.remote.get();
  tiers_[static_cast<int>(TierKind::kRemote)] = remote_;
  absl::MutexLock l(&mu_);
  for (int k = 0; k < kNumTierKinds; ++k) {
    if (!tiers_[k]) continue;
    // Where EvictOne demotes the tier's victims: HBM's to DRAM, DRAM's to
    // NVMe after nvme_admit_after_uses.
    TierBelow below;
    if (k == static_cast<int>(TierKind::kHbm) && dram_) below = {dram_->capacity_bytes(), 1};
    if (k == static_cast<int>(TierKind::kDram) && nvme_) {
      below = {nvme_->capacity_bytes(), o.nvme_admit_after_uses};
    }
    policies_[k] = NewEvictionPolicy(o.eviction.For(static_cast<TierKind>(k)),
                                     tiers_[k]->capacity_bytes(), o.eviction_options, below);
    if (!o.tenant_quotas.empty()) {
      // Called by the policy, under mu_.
      auto tenant_of = [this](const Hash128& key) ABSL_NO_THREAD_SAFETY_ANALYSIS {
        return TenantOfLocked(key);
      };
      auto acct = std::make_unique<TenantAccountingPolicy>(std::move(policies_[k]), tenant_of);
      accounting_[k] = acct.get();
      policies_[k] = std::move(acct);
    }
  }
  tenant_evictions_.assign(o.tenant_quotas.size(), 0);
  tenant_rejections_.assign(o.tenant_quotas.size(), 0);
}

PlacementEngine::~PlacementEngine() {
  {
    absl::MutexLock l(&bg_mu_);
    stopping_ = true;
  }
  const auto unpromoted = prefetcher_.Stop();
  if (maintenance_thread_.joinable()) maintenance_thread_.join();
  for (const auto& [key, extent] : unpromoted) (void)dram_->AbortSlot(extent);
}

void PlacementEngine::Bootstrap() {
  std::vector<std::pair<ObjectKey, TierKind>> orphans;
  {
    absl::MutexLock l(&mu_);
    absl::flat_hash_map<Hash128, std::array<uint64_t, 3>> sizes;
    for (int k = 0; k < kNumTierKinds; ++k) {
      if (!tiers_[k]) continue;
      for (auto& [id, len] : tiers_[k]->List()) {
        ChunkState& st = chunks_[id.key];
        st.where[PartIndex(id.part)] |= static_cast<uint8_t>(1u << k);
        st.split = id.part != Part::kWhole;
        st.uses = std::max<uint32_t>(st.uses, 1);
        sizes[id.key][PartIndex(id.part)] = len;
        policies_[k]->OnInsert(id, len);
      }
    }
    for (auto it = chunks_.begin(); it != chunks_.end();) {
      ChunkState& st = it->second;
      auto& sz = sizes[it->first];
      bool whole = st.where[0] != 0;
      bool split_ok = st.where[1] != 0 && st.where[2] != 0;
      if (whole) {
        st.split = false;
        st.bytes = sz[0];
      } else if (split_ok) {
        st.bytes = sz[1] + sz[2] - codec::kHeaderSize;
        st.k_object_bytes = sz[1];
      }
      // Split parts next to a whole copy, or one part of a split chunk alone,
      // are leftovers of an interrupted put or eviction.
      if (whole || !split_ok) {
        const int first = whole ? 1 : 0;
        TakeCopiesLocked(it->first, st, first, &orphans);
        for (int p = first; p < 3; ++p) st.where[p] = 0;
      }
      if (!whole && !split_ok) {
        chunks_.erase(it++);
      } else {
        ++it;
      }
    }
  }
  for (auto& [id, k] : orphans) (void)tiers_[static_cast<int>(k)]->Erase(id);
}

TierKind PlacementEngine::DefaultTier() const { return dram_ ? TierKind::kDram : TierKind::kNvme; }

TenantId PlacementEngine::TenantOfLocked(const Hash128& key) const {
  auto it = chunks_.find(key);
  return it == chunks_.end() ? 0 : it->second.tenant;
}

void PlacementEngine::NoteStored(TierKind kind, const ObjectKey& id, uint64_t chunk_bytes,
                                 bool split, uint64_t object_bytes, TenantId tenant) {
  absl::MutexLock l(&mu_);
  auto [it, inserted] = chunks_.try_emplace(id.key);
  ChunkState& st = it->second;
  if (inserted) {
    st.tenant = tenant;
    st.bytes = chunk_bytes;
    st.split = split;
    st.uses = 1 + RecallUsesLocked(id.key);
  }
  st.where[PartIndex(id.part)] |= Bit(kind);
  if (id.part == Part::kK) st.k_object_bytes = object_bytes;
  policies_[static_cast<int>(kind)]->OnInsert(id, object_bytes);
}

void PlacementEngine::RememberDroppedLocked(const Hash128& key, uint32_t uses) {
  if (options_.admission_history == 0) return;
  auto [it, inserted] = dropped_uses_.try_emplace(key, uses);
  if (!inserted) {
    it->second = std::max(it->second, uses);
    return;
  }
  dropped_order_.push_back(key);
  while (dropped_order_.size() > options_.admission_history) {
    dropped_uses_.erase(dropped_order_.front());
    dropped_order_.pop_front();
  }
}

uint32_t PlacementEngine::RecallUsesLocked(const Hash128& key) {
  auto it = dropped_uses_.find(key);
  if (it == dropped_uses_.end()) return 0;
  uint32_t uses = it->second;
  // The order entry stays behind; if the key is dropped again, the stale
  // entry makes it leave the history a little early (the history is a hint).
  dropped_uses_.erase(it);
  return uses;
}

void PlacementEngine::TakeCopiesLocked(const Hash128& key, const ChunkState& st, int first_part,
                                       std::vector<std::pair<ObjectKey, TierKind>>* out) {
  for (int p = first_part; p < 3; ++p) {
    for (int k = 0; k < kNumTierKinds; ++k) {
      if (st.where[p] & (1u << k)) {
        ObjectKey id{key, static_cast<Part>(p)};
        out->emplace_back(id, static_cast<TierKind>(k));
        policies_[k]->OnErase(id);
      }
    }
  }
}

void PlacementEngine::Forget(const ObjectKey& id, TierKind kind) {
  auto it = chunks_.find(id.key);
  if (it != chunks_.end()) it->second.where[PartIndex(id.part)] &= ~Bit(kind);
  policies_[static_cast<int>(kind)]->OnErase(id);
}

absl::Status PlacementEngine::StoreWithEviction(TierKind kind, const ObjectKey& id,
                                                std::span<const uint8_t> bytes,
                                                const TierPutOptions& topts, TenantId tenant) {
  Tier* t = tiers_[static_cast<int>(kind)];
  if (t == nullptr) return absl::FailedPreconditionError(absl::StrCat("no ", TierName(kind), " tier"));
  KVTIER_RETURN_IF_ERROR(MakeQuotaRoom(kind, tenant, bytes.size()));
  int idle = 0;
  for (int i = 0; i < kMaxEvictionsPerStore; ++i) {
    absl::Status st = t->Put(id, bytes, topts);
    if (!IsTierFull(st)) return st;
    if (bytes.size() > t->capacity_bytes()) return st;
    if (!EvictOne(kind, tenant)) {
      if (++idle > kMaxIdleRounds) return st;
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  }
  return TierFullError(absl::StrCat(TierName(kind), ": eviction did not make room"));
}

absl::Status PlacementEngine::MakeQuotaRoom(TierKind kind, TenantId tenant, uint64_t bytes) {
  const int ki = static_cast<int>(kind);
  const uint64_t quota = QuotaOf(tenant, ki);
  if (quota == 0) return absl::OkStatus();
  for (int i = 0; i < kMaxEvictionsPerStore; ++i) {
    {
      absl::MutexLock l(&mu_);
      if (accounting_[ki] == nullptr || accounting_[ki]->bytes(tenant) + bytes <= quota) {
        return absl::OkStatus();
      }
    }
    if (bytes > quota || !EvictOne(kind, tenant, /*own_only=*/true)) break;
  }
  absl::MutexLock l(&mu_);
  ++tenant_rejections_[tenant];
  return absl::ResourceExhaustedError(absl::StrCat(
      "tenant ", tenant, " is at its ", TierName(kind), " quota of ", quota, " bytes (",
      accounting_[ki]->bytes(tenant), " stored, none evictable; ", bytes, " more asked)"));
}

bool PlacementEngine::EvictOne(TierKind kind, int tenant, bool own_only) {
  const int ki = static_cast<int>(kind);
  ObjectKey victim;
  std::optional<TierKind> lower;
  TenantId victim_tenant = 0;
  {
    absl::MutexLock l(&mu_);
    ExpireLocked(Now());
    if (!policies_[ki]) return false;
    TenantAccountingPolicy* acct = accounting_[ki];
    auto v = policies_[ki]->PickVictim([&](const ObjectKey& id) ABSL_NO_THREAD_SAFETY_ANALYSIS {
      auto it = chunks_.find(id.key);
      if (it != chunks_.end() && (it->second.pins != 0 || it->second.busy != 0)) return false;
      if (acct == nullptr) return true;
      const TenantId owner = acct->TenantOf(id).value_or(0);
      if (owner == tenant) return true;
      if (own_only) return false;
      // Another tenant's object goes only beyond that tenant's guarantee.
      const uint64_t quota = QuotaOf(owner, ki);
      return quota == 0 || acct->bytes(owner) > quota;
    });
    if (!v) return false;
    victim = *v;
    if (acct != nullptr) victim_tenant = acct->TenantOf(victim).value_or(0);
    policies_[ki]->OnErase(victim);
    if (victim_tenant < tenant_evictions_.size()) ++tenant_evictions_[victim_tenant];
    auto it = chunks_.find(victim.key);
    if (it != chunks_.end()) {
      ChunkState& st = it->second;
      victim_tenant = st.tenant;
      ++st.busy;
      uint8_t where = st.where[PartIndex(victim.part)];
      if (kind == TierKind::kHbm && dram_ && !(where & Bit(TierKind::kDram))) {
        lower = TierKind::kDram;
      } else if (kind == TierKind::kDram && nvme_ && !(where & Bit(TierKind::kNvme))) {
        if (st.uses >= options_.nvme_admit_after_uses) {
          lower = TierKind::kNvme;
        } else {
          Count(EngineMetric::kAdmissionRejects);
        }
      }
    }
    Count(EngineMetric::kEvictions);
  }
  Tier* t = tiers_[ki];
  if (lower) {
    absl::Status st;
    if (kind == TierKind::kDram) {
      // Demote straight from the pool: aligned, so O_DIRECT needs no copy.
      auto ref = dram_->AcquireRef(victim);
      if (ref.ok()) {
        st = StoreWithEviction(*lower, victim, {dram_->base() + ref->offset, ref->length},
                               kBackground, victim_tenant);
        dram_->ReleaseRef(*ref);
        if (st.ok()) {
          NoteStored(*lower, victim, 0, victim.part != Part::kWhole, ref->length, victim_tenant);
        }
      } else {
        st = ref.status();
      }
    } else {
      auto size = t->Size(victim);
      st = size.status();
      if (st.ok()) {
        std::vector<uint8_t> buf(*size);
        st = t->Read(victim, buf);
        if (st.ok()) st = StoreWithEviction(*lower, victim, buf, kBackground, victim_tenant);
        if (st.ok()) {
          NoteStored(*lower, victim, 0, victim.part != Part::kWhole, buf.size(), victim_tenant);
        }
      }
    }
    if (st.ok()) Count(EngineMetric::kDemotions);
  }
  (void)t->Erase(victim);
  std::vector<std::pair<ObjectKey, TierKind>> dead;
  {
    absl::MutexLock l(&mu_);
    auto it = chunks_.find(victim.key);
    if (it != chunks_.end()) {
      ChunkState& st = it->second;
      st.where[PartIndex(victim.part)] &= ~Bit(kind);
      --st.busy;
      bool complete = st.split ? (st.where[1] && st.where[2]) : st.where[0] != 0;
      if (!complete && st.busy == 0) {
        TakeCopiesLocked(victim.key, st, 0, &dead);
        RememberDroppedLocked(victim.key, st.uses);
        chunks_.erase(it);
      }
    }
  }
  for (auto& [id, k] : dead) (void)tiers_[static_cast<int>(k)]->Erase(id);
  return true;
}

void PlacementEngine::Replicate(const Hash128& key, std::span<const uint8_t> chunk,
                                const PutOptions& opts) {
  if (remote_ == nullptr || !opts.replicate) return;
  // Replicas that cannot be stored are counted by the remote tier
  // (kRemoteErrors); the chunk is stored here.
  (void)remote_->Put({key, Part::kWhole}, chunk);
}

absl::Status PlacementEngine::Put(const Hash128& key, std::span<const uint8_t> chunk,
                                  const PutOptions& opts) {
  KVTIER_ASSIGN_OR_RETURN(codec::ChunkHeader h, CheckPutChunk(chunk, "chunk"));
  KVTIER_RETURN_IF_ERROR(PutLocal(key, chunk, h, opts));
  Count(EngineMetric::kPuts);
  Replicate(key, chunk, opts);
  return absl::OkStatus();
}

absl::Status PlacementEngine::Put(const Hash128& key, const codec::VerifiedChunk& chunk,
                                  const PutOptions& opts) {
  KVTIER_RETURN_IF_ERROR(PutLocal(key, chunk.bytes(), chunk.header(), opts));
  Count(EngineMetric::kPuts);
  Replicate(key, chunk.bytes(), opts);
  return absl::OkStatus();
}

absl::Status PlacementEngine::PutLocal(const Hash128& key, std::span<const uint8_t> chunk,
                                       const codec::ChunkHeader& h, const PutOptions& opts) {
  if (opts.durable && !nvme_) return absl::FailedPreconditionError("durable put without an NVMe tier");
  TierKind fast = opts.tier.value_or(DefaultTier());
  if (!tiers_[static_cast<int>(fast)]) {
    return absl::InvalidArgumentError(absl::StrCat("no ", TierName(fast), " tier"));
  }
  bool split = opts.split_kv.value_or(options_.split_kv) == SplitKvPolicy::kAlways && dram_ && nvme_;
  bool existed = false, already_on_nvme = false;
  {
    absl::MutexLock l(&mu_);
    auto it = chunks_.find(key);
    if (it != chunks_.end()) {
      ChunkState& st = it->second;
      ++st.uses;
      for (int p = 0; p < 3; ++p) {
        if (auto k = Fastest(st.where[p])) policies_[static_cast<int>(*k)]->OnAccess({key, static_cast<Part>(p)});
      }
      bool on_nvme = st.split ? (st.where[1] & st.where[2] & Bit(TierKind::kNvme))
                              : (st.where[0] & Bit(TierKind::kNvme));
      if (!opts.durable) return absl::OkStatus();
      existed = true;
      split = st.split;
      already_on_nvme = on_nvme;
    }
  }
  if (already_on_nvme) {
    // The NVMe copy may have been stored without waiting for its commit
    // (a demotion, a non-durable put): wait for it. If that commit failed
    // (Flush reports it), the tier dropped the copy: store it again below.
    (void)nvme_->Flush();
    bool complete = true;
    for (Part p : split ? std::vector<Part>{Part::kK, Part::kV} : std::vector<Part>{Part::kWhole}) {
      if (!nvme_->Size({key, p}).ok()) {
        complete = false;
        absl::MutexLock l(&mu_);
        Forget({key, p}, TierKind::kNvme);
      }
    }
    if (complete) return absl::OkStatus();
  }
  // Objects and the tiers each goes to; NVMe first so a durable put is
  // acknowledged by its commit, and faster copies follow.
  const uint64_t kobj = h.layout.v_offset;
  std::vector<uint8_t> vbuf;
  struct Target {
    ObjectKey id;
    std::span<const uint8_t> bytes;
    TierKind tier;
    bool required;
  };
  std::vector<Target> targets;
  if (split) {
    vbuf.resize(codec::kHeaderSize + (chunk.size() - kobj));
    std::memcpy(vbuf.data(), chunk.data(), codec::kHeaderSize);
    std::memcpy(vbuf.data() + codec::kHeaderSize, chunk.data() + kobj, chunk.size() - kobj);
    ObjectKey k{key, Part::kK}, v{key, Part::kV};
    targets.push_back({v, vbuf, TierKind::kNvme, true});
    if (opts.durable || fast == TierKind::kNvme) targets.push_back({k, chunk.first(kobj), TierKind::kNvme, true});
    if (fast != TierKind::kNvme) targets.push_back({k, chunk.first(kobj), fast, !opts.durable});
  } else {
    ObjectKey w{key, Part::kWhole};
    if (opts.durable) targets.push_back({w, chunk, TierKind::kNvme, true});
    if (fast != TierKind::kNvme || !opts.durable) {
      if (!(existed && fast == TierKind::kNvme)) targets.push_back({w, chunk, fast, !opts.durable});
    }
  }
  std::vector<Target> stored;
  for (const Target& t : targets) {
    if (existed && t.tier != TierKind::kNvme) continue;  // only the durable copy was missing
    // Every object starts with the chunk's header (split parts too).
    absl::Status st =
        StoreWithEviction(t.tier, t.id, t.bytes, TierPutOptions{.sync = opts.durable, .header = &h},
                          opts.tenant);
    if (st.ok()) {
      NoteStored(t.tier, t.id, chunk.size(), split, t.bytes.size(), opts.tenant);
      stored.push_back(t);
      continue;
    }
    if (!t.required) continue;  // a faster copy of a chunk already durable
    if (!existed) {
      // Roll back: a split chunk with one part stored is useless.
      absl::MutexLock l(&mu_);
      for (const Target& s : stored) Forget(s.id, s.tier);
      chunks_.erase(key);
    }
    for (const Target& s : stored) (void)tiers_[static_cast<int>(s.tier)]->Erase(s.id);
    return st;
  }
  return absl::OkStatus();
}

absl::Status PlacementEngine::Delete(const Hash128& key, const DeleteOptions& options) {
  absl::Status local = DeleteLocal(key);
  if (remote_ == nullptr || options.local_only) return local;
  if (!local.ok() && !absl::IsNotFound(local)) return local;
  absl::Status remote = remote_->Erase({key, Part::kWhole});
  if (local.ok() || remote.ok()) return absl::OkStatus();
  return local;
}

absl::Status PlacementEngine::DropCorrupt(const Hash128& key) {
  Count(EngineMetric::kDataLoss);
  return DeleteLocal(key);
}

absl::Status PlacementEngine::DeleteLocal(const Hash128& key) {
  std::vector<std::pair<ObjectKey, TierKind>> objs;
  {
    absl::MutexLock l(&mu_);
    ExpireLocked(Now());
    auto it = chunks_.find(key);
    if (it == chunks_.end()) return absl::NotFoundError("chunk not stored");
    if (it->second.pins > 0) return absl::FailedPreconditionError("chunk is pinned by a lease");
    if (it->second.busy > 0) return absl::UnavailableError("chunk is being moved; retry");
    TakeCopiesLocked(key, it->second, 0, &objs);
    chunks_.erase(it);
  }
  absl::Status first;
  for (auto& [id, k] : objs) {
    absl::Status st = tiers_[static_cast<int>(k)]->Erase(id);
    if (!st.ok() && !absl::IsNotFound(st) && first.ok()) first = st;
  }
  return first;
}

void PlacementEngine::RunMaintenance() {
  {
    absl::MutexLock l(&mu_);
    ExpireLocked(Now());
  }
  for (int k = 0; k < kNumTierKinds; ++k) {
    Tier* t = tiers_[k];
    if (!t) continue;
    const double cap = static_cast<double>(t->capacity_bytes());
    if (t->used_bytes() <= options_.high_watermark * cap) continue;
    while (t->used_bytes() > options_.low_watermark * cap) {
      if (!EvictOne(static_cast<TierKind>(k))) break;
    }
  }
}

void PlacementEngine::MaintenanceLoop() {
  for (;;) {
    {
      absl::MutexLock l(&bg_mu_);
      auto stop = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(bg_mu_) { return stopping_; };
      if (bg_mu_.AwaitWithTimeout(absl::Condition(&stop),
                                  absl::Milliseconds(options_.maintenance_interval_ms))) {
        return;
      }
    }
    RunMaintenance();
  }
}

bool PlacementEngine::WithinQuotaLocked(TierKind kind, TenantId tenant, uint64_t bytes) const {
  const int ki = static_cast<int>(kind);
  const uint64_t quota = QuotaOf(tenant, ki);
  return quota == 0 || accounting_[ki] == nullptr || accounting_[ki]->bytes(tenant) + bytes <= quota;
}

std::vector<TenantUsage> PlacementEngine::TenantUsages() {
  absl::MutexLock l(&mu_);
  std::vector<TenantUsage> out(options_.tenant_quotas.size());
  for (size_t t = 0; t < out.size(); ++t) {
    for (int k = 0; k < kNumTierKinds; ++k) {
      if (accounting_[k] != nullptr) out[t].bytes[k] = accounting_[k]->bytes(static_cast<TenantId>(t));
    }
    out[t].evictions = tenant_evictions_[t];
    out[t].quota_rejections = tenant_rejections_[t];
  }
  return out;
}

std::vector<TierUsage> PlacementEngine::Usage() {
  std::vector<TierUsage> out;
  std::array<uint64_t, kNumTierKinds> objects{};
  {
    absl::MutexLock l(&mu_);
    for (int k = 0; k < kNumTierKinds; ++k) objects[k] = policies_[k] ? policies_[k]->size() : 0;
  }
  for (int k = 0; k < kNumTierKinds; ++k) {
    if (!tiers_[k]) continue;
    out.push_back(TierUsage{static_cast<TierKind>(k), tiers_[k]->capacity_bytes(),
                            tiers_[k]->used_bytes(), objects[k], tiers_[k]->bandwidth(),
                            tiers_[k]->ready_bytes()});
  }
  return out;
}

}  // namespace kvtier::tiering
