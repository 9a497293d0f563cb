#include "tiering/placement_engine.h"

#include <sys/random.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "codec/chunk.h"
#include "common/status.h"
#include "bandwidth/model.h"

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

uint8_t Bit(TierKind k) { return static_cast<uint8_t>(1u << static_cast<int>(k)); }
int PartIndex(Part p) { return static_cast<int>(p); }

// The fastest tier in a bitmask (lowest TierKind).
std::optional<TierKind> Fastest(uint8_t mask) {
  for (int k = 0; k < kNumTierKinds; ++k) {
    if (mask & (1u << k)) return static_cast<TierKind>(k);
  }
  return std::nullopt;
}

// Bounds on the eviction loop of one store: evictions, and rounds without a
// victim (other threads may be freeing space) before giving up.
constexpr int kMaxEvictionsPerStore = 100000;
constexpr int kMaxIdleRounds = 3;
// How long a batched read waits for the chunks a prefetch is reading.
constexpr int64_t kPrefetchWaitMs = 10000;

// Stores that no caller waits on (demotion, promotion): not synced, and the
// tier checks the header itself (the bytes come from another tier).
constexpr TierPutOptions kBackground{.sync = false};

// Put-side check of a chunk (`what`: "chunk" or "slot"): a valid header whose
// total length is the chunk's. InvalidArgument otherwise.
absl::StatusOr<codec::ChunkHeader> CheckPutChunk(std::span<const uint8_t> bytes, const char* what) {
  auto h = codec::ParseHeader(bytes);
  if (!h.ok()) return absl::InvalidArgumentError(absl::StrCat(what, ": ", h.status().message()));
  if (bytes.size() != h->layout.total_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(what, " is ", bytes.size(), " bytes, header says ",
                                                   h->layout.total_bytes));
  }
  return h;
}

}  // namespace

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
                                                     const GetOptions& opts) {
  const uint64_t bytes = shape.bytes, kobj = shape.k_object_bytes;
  TierKind src;
  if (!shape.split) {
    KVTIER_ASSIGN_OR_RETURN(src, ReadObject({key, Part::kWhole}, out));
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
                                              const GetOptions& opts) {
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
  KVTIER_ASSIGN_OR_RETURN(TierKind src, FinishRead(key, shape, out, opts));
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
  auto src = FinishRead(key, shape, {dram_->base() + slot->extent.offset, shape.bytes}, opts);
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

absl::Status PlacementEngine::CountRefusal(absl::Status st) {
  if (absl::IsResourceExhausted(st)) Count(EngineMetric::kHoldsRefused);
  return st;
}

uint64_t PlacementEngine::held_bytes() {
  absl::MutexLock l(&mu_);
  ExpireLocked(Now());
  return holds_.held_bytes();
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

}  // namespace kvtier::tiering

namespace kvtier::tiering {

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
                            tiers_[k]->used_bytes(), objects[k], tiers_[k]->bandwidth()});
  }
  return out;
}

}  // namespace kvtier::tiering
