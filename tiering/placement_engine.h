// The placement engine: one object over every tier that decides where each
// chunk lives. See docs/tiering.md for the policy in prose.
//
// Thread-safe. One mutex guards the metadata (which chunk is where, pins,
// policies); it is never held while bytes are copied or I/O runs. Tiers
// keep freed space alive while a reader still copies from it.
#ifndef KVTIER_TIERING_PLACEMENT_ENGINE_H_
#define KVTIER_TIERING_PLACEMENT_ENGINE_H_

#include <array>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <future>
#include <memory>
#include <optional>
#include <span>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "codec/chunk.h"
#include "common/hash.h"
#include "tiering/dram_tier.h"
#include "tiering/eviction.h"
#include "tiering/hbm_tier.h"
#include "tiering/io.h"
#include "tiering/lease_table.h"
#include "tiering/nvme_tier.h"
#include "tiering/prefetcher.h"
#include "tiering/remote_tier.h"
#include "tiering/tenant_accounting.h"
#include "tiering/tier.h"

namespace kvtier::tiering {

// Where split K/V placement applies.
enum class SplitKvPolicy : uint8_t {
  kNever = 0,   // chunks are stored whole
  kAlways = 1,  // K (with the header) in DRAM, V (with the header) on NVMe
};

// Per-daemon options.
// How the engine estimates the time to load a chunk out of each tier
// (EstimatePrefixLoad): latency + bytes / read bandwidth, with the tier's
// measured read bandwidth once it has read anything, else the assumed one.
// Indexed by TierKind (hbm, dram, nvme, remote).
struct LoadCostModel {
  // Default: hbm 64e9 (PCIe 5.0 x16 to the host), dram 10e9 (one thread's
  // copy out of the pool), nvme 7e9 (a PCIe 4.0 x4 SSD), remote 50e9 (a
  // 400 Gb/s NIC): the `kvtier links` presets.
  std::array<double, kNumTierKinds> assumed_read_bytes_per_s = {64e9, 10e9, 7e9, 50e9};
  // Per chunk. Default: hbm 20, dram 20 (a data-plane round trip), nvme 100,
  // remote 200
  std::array<double, kNumTierKinds> latency_us = {20, 20, 100, 200};
};

// A cached prefix and what loading it would cost (EstimatePrefixLoad).
struct PrefixLoadEstimate {
  std::vector<TierKind> tiers;  // as LookupPrefix: the prefix's hits
  std::vector<uint64_t> bytes;  // each hit's chunk bytes
  std::vector<double> load_us;  // each hit's estimated load time
};

struct PlacementEngineOptions {
  // Eviction policy of each tier (one for all, per-tier overrides). FLRU in
  // DRAM keeps reused chunks through scans and chooses its frequency bonus
  // for the hits of DRAM and the NVMe tier below it; NVMe, which receives
  // what DRAM evicted, keeps it by recency (docs/tiering.md "Default
  // placement"). kvtierd's --eviction and `kvtier replay` default to this.
  // Default: "flru,nvme=lru"
  EvictionPolicySpec eviction =
      EvictionPolicySpec{.all = EvictionPolicyKind::kFreqLru}.With(TierKind::kNvme, EvictionPolicyKind::kLru);
  // Tuning of the eviction policies (e.g. S3-FIFO's small-queue share).
  // Default: EvictionOptions{}
  EvictionOptions eviction_options;
  // A chunk evicted from DRAM is written to NVMe only if it was used (put or
  // get) at least this many times; otherwise it is dropped. 1 admits every
  // chunk: most reuse of a KV chunk is its second read, one conversation
  // turn later, which 2 would give up; the cost is NVMe writes of every
  // chunk DRAM evicts. Default: 1
  uint32_t nvme_admit_after_uses = 1;
  // Uses of chunks that eviction dropped are remembered (the most recent
  // this many chunks), so a chunk put again after being dropped counts its
  // earlier uses towards nvme_admit_after_uses: its second use is a second
  // use even if the two fell into different DRAM residencies. 0 forgets.
  // Default: 65536 (about 3 MiB)
  uint32_t admission_history = 65536;
  // A get served from NVMe copies the chunk into DRAM (the NVMe copy stays,
  // so evicting the promoted copy later costs no write). Default: true
  bool promote_on_hit = true;
  // Background eviction starts when a tier's used bytes exceed this fraction
  // of its capacity. Default: 0.95
  double high_watermark = 0.95;
  // ... and evicts until used bytes are at or below this fraction.
  // Default: 0.85
  double low_watermark = 0.85;
  // Period of the background thread that expires leases and slots and
  // enforces watermarks; 0 disables it (call RunMaintenance yourself).
  // Default: 50
  int64_t maintenance_interval_ms = 50;
  // Lease duration when a Pin asks for 0. Default: 30000
  int64_t default_lease_ms = 30000;
  // Longest lease a Pin may ask for (longer requests are clamped).
  // Default: 600000
  int64_t max_lease_ms = 600000;
  // Split K/V placement. Default: kNever
  SplitKvPolicy split_kv = SplitKvPolicy::kNever;
  // Time source for leases (not owned). Default: nullptr (SystemClock())
  Clock* clock = nullptr;
  // Load-time estimates of EstimatePrefixLoad. Default: LoadCostModel{}
  LoadCostModel load_cost;
  // Most bytes that holds may keep in place at once: the chunks of Pin and
  // Hold leases, the chunks GetShared pins in DRAM and GetShared's scratch
  // slots. A hold beyond it is ResourceExhausted (counted in
  // kHoldsRefused), so that readers cannot pin the whole DRAM tier. With
  // tenant quotas, the holds of one tenant's holders also leave room for
  // every other tenant's DRAM quota (a guarantee): they keep at most the
  // DRAM capacity less the other tenants' quotas. 0: no limit. Default: 0
  uint64_t max_held_bytes = 0;
  // Most bytes one holder (a connection or a credential: Holder) may hold
  // at once, so that no one holder takes the whole of max_held_bytes.
  // 0: no limit of its own. Default: 0
  uint64_t max_held_bytes_per_holder = 0;
  // Most leases and slots one holder may have open at once; beyond it a
  // Pin, Hold, GetShared or AllocateSlot is ResourceExhausted. Default: 16384
  uint64_t max_holds_per_holder = 16384;
  // Most keys the leases of one holder may pin at once. Default: 262144
  uint64_t max_held_keys_per_holder = 262144;
  // Tenants' byte quotas per tier, indexed by tenant id (PutOptions::tenant)
  // and TierKind; 0 is no quota. A quota is a cap and a guarantee: a tenant's
  // chunks in a tier never exceed its quota there (to store more it evicts
  // its own chunks, and with none evictable the store is ResourceExhausted,
  // counted in TenantUsage::quota_rejections), and the stores and evictions
  // made for other tenants, and the watermark evictions, never evict a
  // tenant's chunks while the tenant is within its quota. Chunks of tenants
  // without a quota in a tier share what the quotas leave. Non-empty turns
  // on per-tenant accounting (TenantUsages); the quotas of a tier must sum
  // to at most its capacity (Create: InvalidArgument). Default: empty
  std::vector<std::array<uint64_t, kNumTierKinds>> tenant_quotas;
};

// Per-call options of Put.
struct PutOptions {
  // Tier to store the chunk in; unset lets the engine choose (DRAM, or NVMe
  // when there is no DRAM tier). Default: unset
  std::optional<TierKind> tier;
  // Acknowledge only after the chunk is committed on NVMe (data synced,
  // index committed), so it survives a crash. It gets no other protection:
  // it is evicted (from NVMe: dropped) and deleted like any chunk.
  // FailedPrecondition without an NVMe tier. Default: false
  bool durable = false;
  // Overrides PlacementEngineOptions::split_kv for this chunk. Default: unset
  std::optional<SplitKvPolicy> split_kv;
  // With a remote tier (a cluster), also store the chunk on its owners once
  // it is stored here (write-through), so other nodes find it. A replica
  // that cannot be stored is counted (kRemoteErrors), not an error of the
  // put: the chunk is stored locally. Default: true
  bool replicate = true;
  // The tenant the chunk is stored for: its bytes count towards that
  // tenant's quotas (PlacementEngineOptions::tenant_quotas). A key already
  // stored keeps its tenant. Default: 0
  TenantId tenant = 0;
  // CommitSlot: who commits; the slot must be its own. Default: kEngineHolder
  HolderId holder = kEngineHolder;
};

// Per-call options of Get.
struct GetOptions {
  // Overrides PlacementEngineOptions::promote_on_hit. Default: unset
  std::optional<bool> promote;
  // On a local miss, fetch the chunk from the remote tier (and keep a local
  // copy). Default: true
  bool allow_remote = true;
  // Who takes the lease or scratch slot of a GetShared: only it may end it.
  // Default: the engine's own (kEngineHolder)
  Holder holder;
};

// Per-call options of Delete.
struct DeleteOptions {
  // Remove only this node's copies, not the remote tier's. Default: false
  bool local_only = false;
};

// Where one stored part of a chunk is.
struct PartLocation {
  Part part = Part::kWhole;
  TierKind tier = TierKind::kDram;  // the fastest tier holding it
  // For DRAM: the slot in the shared-memory pool (DramTier::shm_fd()).
  // Stable while the chunk is pinned.
  std::optional<PoolExtent> dram_slot;
};
struct ChunkLocation {
  uint64_t chunk_bytes = 0;  // header + K + V
  std::vector<PartLocation> parts;  // one (whole) or two (K, V)
};

// The bytes of a client's slot in the DRAM pool (PlacementEngine::SlotView).
struct SlotBytes {
  PoolExtent extent;
  std::span<uint8_t> bytes;  // the extent's bytes in the pool
};

// A slot about to expire counts as expired for SlotView: the engine may free
// it while the caller still copies into it or hashes it.
inline constexpr int64_t kSlotViewMarginUs = 100'000;

// A chunk handed out in the DRAM pool by GetShared, for a reader that copies
// it out of the pool itself. Exactly one of lease_id and slot_id is set.
struct SharedRead {
  // The tier it was read from: kDram when the stored copy itself is handed
  // out; kRemote when it was fetched from the remote tier first.
  TierKind tier = TierKind::kDram;
  uint64_t chunk_bytes = 0;
  PoolExtent extent;  // the chunk's bytes; extent.length == chunk_bytes
  std::span<const uint8_t> bytes;  // the extent's bytes in the pool
  // The stored chunk, whole in DRAM, is pinned in place: Release(lease_id).
  uint64_t lease_id = 0;
  // Otherwise the chunk was copied into a scratch slot: AbortSlot(slot_id).
  uint64_t slot_id = 0;
  int64_t expires_at_us = 0;  // when the lease or the slot ends
  // The scratch copy's checksums were checked as it was read (every tier it
  // came from verifies on read, e.g. NVMe): a caller need not hash it again.
  bool verified = false;
};

// Counters; EngineMetricName() names them (a test checks the table).
// kPuts counts every accepted Put and CommitSlot (a key already stored
// included). kGets counts every read (Get, GetShared), and each read counts
// once more in kMisses or in the kHits* of the tier it was read from.
enum class EngineMetric : int {
  kPuts = 0,
  kGets,
  kHitsHbm,
  kHitsDram,
  kHitsNvme,
  kMisses,
  kEvictions,
  kDemotions,
  kPromotions,
  kAdmissionRejects,
  kDataLoss,
  kLeasesExpired,
  kSlotsExpired,
  kPrefetched,
  kHitsRemote,
  kRemoteErrors,
  kHoldsRefused,  // holds refused at PlacementEngineOptions::max_held_bytes
  kCount,
};
const char* EngineMetricName(EngineMetric m);

// One tenant's share of the engine (PlacementEngine::TenantUsages).
struct TenantUsage {
  std::array<uint64_t, kNumTierKinds> bytes{};  // bytes stored per tier (TierKind)
  uint64_t evictions = 0;         // its objects evicted from any tier
  uint64_t quota_rejections = 0;  // its stores refused at its quota
};

struct TierUsage {
  TierKind kind;
  uint64_t capacity_bytes;
  uint64_t used_bytes;
  uint64_t objects;
  Bandwidth bandwidth;
  uint64_t ready_bytes;  // Tier::ready_bytes(): below capacity while a DRAM pool is populated
};

// The tiers an engine runs over; any may be null (DRAM or NVMe required).
struct EngineTiers {
  std::unique_ptr<HbmTier> hbm;
  std::unique_ptr<DramTier> dram;
  // An NvmeTier, or a tier of kind kNvme that stores metadata only
  // (NewMetadataTier) for a trace replay.
  std::unique_ptr<Tier> nvme;
  std::unique_ptr<RemoteTier> remote;
};

// Ownership: the engine owns its tiers, its LeaseTable (leases and slots)
// and its Prefetcher (the prefetch thread), and runs the maintenance thread.
// It calls the lease table and the prefetcher; the lease table never calls
// back, and the prefetcher calls only the engine's PrefetchTarget methods,
// on its own thread, holding none of its locks.
class PlacementEngine : private PrefetchTarget {
 public:
  // Takes ownership of the tiers and learns what the durable tiers hold
  // (a split chunk missing a part is dropped). InvalidArgument without DRAM
  // and NVMe tiers.
  static absl::StatusOr<std::unique_ptr<PlacementEngine>> Create(
      const PlacementEngineOptions& options, EngineTiers tiers);
  ~PlacementEngine();

  // Stores a chunk. `chunk` must be a whole chunk whose header parses
  // (codec::ParseHeader) and whose length matches it: InvalidArgument
  // otherwise. A key already stored is not rewritten (keys name content);
  // a durable put of it still makes sure it is on NVMe. ResourceExhausted
  // if a target tier is full and nothing in it can be evicted.
  absl::Status Put(const Hash128& key, std::span<const uint8_t> chunk,
                   const PutOptions& options = {});
  // Put of a chunk already verified: its header is not parsed again.
  absl::Status Put(const Hash128& key, const codec::VerifiedChunk& chunk,
                   const PutOptions& options = {});

  // Reads: Get and GetShared are the engine's reads, and each is one use of
  // the chunk: it counts towards NVMe admission (nvme_admit_after_uses),
  // marks the chunk recently used in its tiers' eviction policies, and
  // counts kGets and a kHits* or kMisses. Pin, Locate, ChunkBytes, lookups
  // and Prefetch are not uses.

  // Copies the chunk into `out` (exactly ChunkBytes(key) bytes, else
  // InvalidArgument) and returns the tier it was read from (the slowest
  // one, for a split chunk). NotFound on a miss. DataLoss if every copy is
  // corrupt (the chunk is then dropped). `verified`, if given, is set to
  // whether every tier the bytes came from checked their checksums as it
  // read them (TierCapabilities::verifies_on_read): a caller need not hash
  // them again.
  absl::StatusOr<TierKind> Get(const Hash128& key, std::span<uint8_t> out,
                               const GetOptions& options = {}, bool* verified = nullptr);
  // Hands the chunk out in the DRAM pool for `ttl_ms` (0: the default
  // lease): a chunk whole in DRAM is pinned where it is (no copy); any other
  // (on NVMe or HBM only, split K/V) is copied into a scratch slot, as Get
  // copies (promotion included). The caller ends it with Release(lease_id)
  // or AbortSlot(slot_id); either also ends at expiry. NotFound on a miss,
  // DataLoss as Get, ResourceExhausted if no scratch slot can be made,
  // FailedPrecondition without a DRAM tier.
  absl::StatusOr<SharedRead> GetShared(const Hash128& key, int64_t ttl_ms = 0,
                                       const GetOptions& options = {});
  // GetShared of every key, one result per key in order. The chunks stored
  // whole on NVMe only are read into their scratch slots with one
  // submission to the NVMe tier (NvmeTier::ReadBatch), so the device queue
  // fills; the rest are read as GetShared reads them. A key that appears
  // twice gets two holds. A chunk that a prefetch is reading into DRAM is
  // waited for (at most 10 s), then handed out from DRAM.
  // Promotion (promote_on_hit) of a chunk read from
  // NVMe here costs the read no copy: when its scratch slot is freed
  // (AbortSlot), the background thread checks the slot's bytes again and
  // makes the slot the chunk's DRAM copy.
  std::vector<absl::StatusOr<SharedRead>> GetSharedBatch(std::span<const Hash128> keys,
                                                         int64_t ttl_ms = 0,
                                                         const GetOptions& options = {});
  // Chunk length. NotFound on a miss. With `allow_remote` and a remote
  // tier, a local miss fetches the chunk from the remote tier first (so the
  // Get or Locate that follows is local).
  absl::StatusOr<uint64_t> ChunkBytes(const Hash128& key, bool allow_remote = true);
  // Where the chunk's parts are. NotFound on a miss. A local miss fetches
  // from the remote tier as ChunkBytes does.
  absl::StatusOr<ChunkLocation> Locate(const Hash128& key, bool allow_remote = true);
  // Copies a chunk from the remote tier into this node's tiers (DRAM when
  // there is one). NotFound if no member has it; FailedPrecondition without
  // a remote tier; OK at once if it is stored here already.
  absl::Status FetchRemote(const Hash128& key);

  // Whether this node stores the chunk (the remote tier is not asked).
  bool Contains(const Hash128& key);
  // The fastest tier of each key of the longest stored prefix of `keys`
  // (its size is the prefix length). Past the locally stored prefix, keys
  // the remote tier has count as TierKind::kRemote (not fetched).
  std::vector<TierKind> LookupPrefix(std::span<const Hash128> keys);
  // LookupPrefix with each hit's size and estimated load time from its
  // fastest tier (the slower part's tier for a split chunk), by
  // options.load_cost: what a client weighs against recomputing the prefix
  // (bandwidth::BestLoadPrefix).
  PrefixLoadEstimate EstimatePrefixLoad(std::span<const Hash128> keys);
  // The read bandwidth (bytes/s) load estimates use for tier `k`: measured
  // once the tier has read anything, else assumed.
  double EstimatedReadBytesPerS(TierKind k) const;

  // Removes a chunk from every tier. NotFound on a miss, FailedPrecondition
  // if pinned, Unavailable if it is being moved (retry).
  // Also erases the remote tier's copies unless options.local_only; OK if
  // only the remote tier had it.
  absl::Status Delete(const Hash128& key, const DeleteOptions& options = {});

  // Drops a chunk whose bytes a reader found corrupt: counts kDataLoss and
  // removes the chunk from this node's tiers (Delete's codes).
  absl::Status DropCorrupt(const Hash128& key);

  // Pins every key for `ttl_ms` (0: the default): pinned chunks are neither
  // evicted nor moved nor deleted. NotFound (nothing pinned) if a key is
  // missing. A lease that is not released expires, so a dead client never
  // leaks a pin. With `allow_remote` and a remote tier, keys stored only in
  // the cluster are fetched here first.
  // The pinned bytes count as held (max_held_bytes): ResourceExhausted
  // (nothing pinned) beyond the limits.
  absl::StatusOr<Lease> Pin(std::span<const Hash128> keys, int64_t ttl_ms = 0,
                            bool allow_remote = true, Holder holder = {});
  // Extends a lease of `holder`. NotFound if unknown, expired or another's.
  absl::StatusOr<Lease> Renew(uint64_t lease_id, int64_t ttl_ms = 0,
                              HolderId holder = kEngineHolder);
  // Ends a lease of `holder`. NotFound if unknown, expired or another's.
  absl::Status Release(uint64_t lease_id, HolderId holder = kEngineHolder);
  // Pin of chunks stored here (the remote tier is not asked), counted as
  // held bytes (PlacementEngineOptions::max_held_bytes): what a client holds
  // between planning a load and loading it. NotFound (nothing held) if a
  // key is missing; ResourceExhausted (nothing held) beyond the limit.
  absl::StatusOr<Lease> Hold(std::span<const Hash128> keys, int64_t ttl_ms = 0,
                             Holder holder = {});
  // Bytes held now (see PlacementEngineOptions::max_held_bytes).
  uint64_t held_bytes();

  // Slots. The engine is the one table of slots: id, extent, expiry, and
  // whether a client may write and commit it (AllocateSlot) or only read it
  // (the scratch copies of GetShared). Callers keep ids, never extents.

  // Reserves a DRAM slot of `bytes` for `ttl_ms` (0: the default lease),
  // evicting if needed. ResourceExhausted if no room can be made,
  // FailedPrecondition without DRAM.
  // The slot's bytes count towards `tenant`'s DRAM quota when committed; a
  // tenant at its quota evicts its own chunks for the slot first
  // (ResourceExhausted if none is evictable).
  // The slot is `holder`'s: only it may view, commit or abort it.
  absl::StatusOr<Slot> AllocateSlot(uint64_t bytes, int64_t ttl_ms = 0, TenantId tenant = 0,
                                    HolderId holder = kEngineHolder);
  // The bytes of client slot `slot_id`, for a caller that fills or checks
  // them in place; valid until the slot is committed, aborted or expires.
  // NotFound for a slot that is unknown, a scratch slot, expired, or within
  // `margin_us` of its expiry (kSlotViewMarginUs).
  // NotFound too for another holder's slot.
  absl::StatusOr<SlotBytes> SlotView(uint64_t slot_id, HolderId holder = kEngineHolder,
                                     int64_t margin_us = kSlotViewMarginUs);
  // Removes from `slot_ids` and `lease_ids` the ids of slots and leases that
  // are unknown or expired (one pass under the engine's lock): a caller that
  // keeps the ids it got forgets the ones that ended.
  void ForgetEnded(absl::flat_hash_set<uint64_t>& slot_ids,
                   absl::flat_hash_set<uint64_t>& lease_ids);
  // Validates the chunk written into client slot `slot_id` (its header and
  // length) and stores it as `key` without copying (plus an NVMe copy if
  // durable). The slot is consumed on success and on InvalidArgument.
  // NotFound if the slot is unknown, a scratch slot, expired, or not
  // options.holder's.
  absl::Status CommitSlot(uint64_t slot_id, const Hash128& key, const PutOptions& options = {});
  // CommitSlot of a chunk verified in the slot: `chunk` must be the bytes of
  // SlotView(slot_id) (InvalidArgument otherwise; the slot is then freed),
  // and its header is not parsed again.
  absl::Status CommitSlot(uint64_t slot_id, const codec::VerifiedChunk& chunk, const Hash128& key,
                          const PutOptions& options = {});
  // Frees a slot of `holder` (a client's or a scratch one). NotFound if
  // unknown, expired or another holder's.
  absl::Status AbortSlot(uint64_t slot_id, HolderId holder = kEngineHolder);

  // Starts copying the keys that are on NVMe only into DRAM, in order, on a
  // background thread. The future holds OK when all present keys were
  // promoted (missing keys are skipped), or the first error. A prefetch is
  // a hint, not a use: it counts kPrefetched only.
  std::future<absl::Status> Prefetch(std::vector<Hash128> keys);

  // Expires leases and slots, then evicts every tier above its high
  // watermark down to its low watermark. The background thread calls it.
  void RunMaintenance();

  // kRemoteErrors is the remote tier's own count (RemoteTier::errors()).
  uint64_t metric(EngineMetric m) const {
    if (m == EngineMetric::kRemoteErrors) return remote_ != nullptr ? remote_->errors() : 0;
    return metrics_[static_cast<int>(m)].load();
  }
  std::vector<TierUsage> Usage();
  // Per tenant id (as many as options.tenant_quotas names); empty without
  // tenant quotas. Chunks found on NVMe at startup count to tenant 0.
  std::vector<TenantUsage> TenantUsages();
  DramTier* dram() const { return dram_; }
  HbmTier* hbm() const { return hbm_; }
  // The NVMe tier when it is an NvmeTier (nullptr without one, or when it
  // is a metadata-only tier: use tier(TierKind::kNvme) for either).
  NvmeTier* nvme() const { return nvme_file_; }
  Tier* tier(TierKind k) const { return tiers_[static_cast<int>(k)]; }

 private:
  struct ChunkState {
    uint64_t bytes = 0;
    uint64_t k_object_bytes = 0;  // split chunks: header + K section
    bool split = false;
    // Bitmask of TierKinds holding each part: [0] whole, [1] K, [2] V.
    std::array<uint8_t, 3> where{};
    uint32_t uses = 0;
    int pins = 0;
    int busy = 0;  // evictions/promotions in flight
    TenantId tenant = 0;
  };

  PlacementEngine(const PlacementEngineOptions& o, EngineTiers tiers);
  // Write-through of a stored chunk to the remote tier (which counts the
  // replicas it cannot store).
  void Replicate(const Hash128& key, std::span<const uint8_t> chunk, const PutOptions& opts);
  // The local halves of Put, LookupPrefix and Delete. PutLocal counts no
  // kPuts: its callers (Put, CommitSlot) count accepted puts, and a chunk
  // fetched from the remote tier (FetchRemote) is not a put.
  // `header` is the chunk's, parsed by the caller (CheckPutChunk or a
  // codec::VerifiedChunk).
  absl::Status PutLocal(const Hash128& key, std::span<const uint8_t> chunk,
                        const codec::ChunkHeader& header, const PutOptions& opts);
  // `tenant`: whose quota the slot's room is made in; `holder`: whose slot.
  absl::StatusOr<Slot> AllocateSlotOf(uint64_t bytes, int64_t ttl_ms, bool scratch,
                                      TenantId tenant, const Holder& holder);
  // Counts kHoldsRefused if `st` is the lease table refusing a hold
  // (ResourceExhausted), and returns it.
  absl::Status CountRefusal(absl::Status st);
  // A lease of `holder` on `keys` (NotFound if one is not stored), checked
  // against the hold limits (LeaseTable::AddLease).
  absl::StatusOr<Lease> LeaseLocked(std::span<const Hash128> keys, int64_t ttl_ms, int64_t now,
                                    const Holder& holder) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Ends a lease taken out of holds_: unpins its keys.
  void EndLeaseLocked(const LeaseState& lease) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // GetShared's in-place hand-out of a chunk whole in DRAM: pins it under a
  // new lease. False (nothing done) if the DRAM copy is not readable.
  absl::StatusOr<bool> PinInDramLocked(const Hash128& key, ChunkState* st, int64_t ttl_ms,
                                       int64_t now, bool fetched, const Holder& holder,
                                       SharedRead* r)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void UnpinOne(const Hash128& key) ABSL_LOCKS_EXCLUDED(mu_);
  // Removes client slot `slot_id` from the table and returns its extent, now
  // the caller's. NotFound for an unknown, expired or scratch slot.
  absl::StatusOr<PoolExtent> TakeClientSlot(uint64_t slot_id, HolderId holder)
      ABSL_LOCKS_EXCLUDED(mu_);
  // The rest of both CommitSlots: the slot is taken out of holds_, `header`
  // is the header of its bytes.
  absl::Status CommitTakenSlot(const PoolExtent& ext, const codec::ChunkHeader& header,
                               const Hash128& key, const PutOptions& opts);
  // The remote leg of a lookup: when `allow_remote`, a remote tier exists and
  // `key` is not stored here, fetches it (FetchRemote). True if it was
  // fetched; false if nothing was asked or the cluster lacks it too (the
  // local lookup that follows reports the miss); other fetch errors returned.
  // Holds no lock across the remote I/O.
  absl::StatusOr<bool> FetchIfMissing(const Hash128& key, bool allow_remote);
  // LookupPrefix and LookupLocalPrefix; with `bytes`, each hit's chunk
  // size is appended to it, from the same walk (and the same remote Size
  // call) that found the hit.
  std::vector<TierKind> LookupPrefixSized(std::span<const Hash128> keys,
                                          std::vector<uint64_t>* bytes);
  std::vector<TierKind> LookupLocalPrefix(std::span<const Hash128> keys,
                                          std::vector<uint64_t>* bytes);
  absl::Status DeleteLocal(const Hash128& key);
  void Bootstrap();
  void Count(EngineMetric m, uint64_t n = 1) {
    metrics_[static_cast<int>(m)].fetch_add(n, std::memory_order_relaxed);
  }
  int64_t Now() const { return clock_->NowMicros(); }
  TierKind DefaultTier() const;

  // Stores `bytes` as `id` in tier `kind`, evicting from it as needed.
  // `topts.sync` (durable puts) waits for NVMe's index commit; otherwise the
  // commit follows in the background (a crash before it loses the copy).
  // With tenant quotas, `tenant`'s quota in `kind` is made room for first
  // (MakeQuotaRoom).
  absl::Status StoreWithEviction(TierKind kind, const ObjectKey& id,
                                 std::span<const uint8_t> bytes, const TierPutOptions& topts,
                                 TenantId tenant);
  // Records that `id` now lives in `kind`; a new chunk is `tenant`'s.
  void NoteStored(TierKind kind, const ObjectKey& id, uint64_t chunk_bytes, bool split,
                  uint64_t object_bytes, TenantId tenant);
  // Evicts one object from tier `kind` (demoting it if admitted), for
  // `tenant` (kAnyTenant: the watermarks). With tenant quotas the victim is
  // `tenant`'s own object, or (unless `own_only`) one of a tenant without a
  // quota in the tier or over it. False if nothing such is evictable now.
  static constexpr int kAnyTenant = -1;
  bool EvictOne(TierKind kind, int tenant = kAnyTenant, bool own_only = false);
  // Evicts `tenant`'s own objects from `kind` until `bytes` more fit in its
  // quota there. OK at once without a quota; ResourceExhausted (counted in
  // quota_rejections) when they cannot be made to fit.
  absl::Status MakeQuotaRoom(TierKind kind, TenantId tenant, uint64_t bytes);
  uint64_t QuotaOf(TenantId t, int kind) const {
    return t < options_.tenant_quotas.size() ? options_.tenant_quotas[t][kind] : 0;
  }
  // Whether `bytes` more of `tenant` fit in its quota in `kind`.
  bool WithinQuotaLocked(TierKind kind, TenantId tenant, uint64_t bytes) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The tenant of a chunk stored here; 0 if unknown.
  TenantId TenantOfLocked(const Hash128& key) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ExpireLocked(int64_t now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Reads object `id` from the fastest tier holding it; drops corrupt copies.
  absl::StatusOr<TierKind> ReadObject(const ObjectKey& id, std::span<uint8_t> out);
  // A copy of `id` in tier `src` failed its checksums (the tier dropped it):
  // counts kDataLoss and forgets the copy. True if another copy of the part
  // remains (to be read instead); otherwise drops the whole chunk.
  bool DropCorruptCopy(const ObjectKey& id, TierKind src) ABSL_LOCKS_EXCLUDED(mu_);
  // The start of every read (Get, GetShared): counts kGets, and on a miss
  // kMisses (NotFound); on a hit records the use (uses, the eviction
  // policies' access) and returns the chunk's state.
  absl::StatusOr<ChunkState*> StartReadLocked(const Hash128& key)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The rest of a read StartReadLocked began: copies the chunk, whose
  // `shape` was taken from its state under mu_, into `out`, counts the hit
  // by the tier read, and promotes an NVMe hit to DRAM per `opts`.
  // *verified: whether every tier read verifies on read.
  struct ReadShape {
    uint64_t bytes;
    uint64_t k_object_bytes;
    bool split;
  };
  absl::StatusOr<TierKind> FinishRead(const Hash128& key, const ReadShape& shape,
                                      std::span<uint8_t> out, const GetOptions& opts,
                                      bool* verified);
  bool VerifiesOnRead(TierKind k) const { return tier(k)->capabilities().verifies_on_read; }
  void CountHit(TierKind src);
  void Forget(const ObjectKey& id, TierKind kind) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Appends every copy of parts `first_part`..2 of chunk `key` (per
  // st.where) to `out`, as (object, tier), and takes each out of its tier's
  // eviction policy. `st` is left as is; the caller erases the copies from
  // the tiers once mu_ is released.
  void TakeCopiesLocked(const Hash128& key, const ChunkState& st, int first_part,
                        std::vector<std::pair<ObjectKey, TierKind>>* out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // PrefetchTarget, called on the prefetcher's thread.
  // kGroup for a chunk whole on NVMe only (kSkip while a batched read
  // loads it), kPromote for any other key.
  Route RouteOf(const Hash128& key, uint64_t* bytes) override ABSL_LOCKS_EXCLUDED(mu_);
  // Copies a chunk that is on neither HBM nor DRAM into DRAM (fetching it
  // from the remote tier if only that has it); counts kPrefetched.
  absl::Status PromoteOne(const Hash128& key) override;
  // Makes the freed scratch slot `extent`, a copy of chunk `key`, the
  // chunk's DRAM copy if its bytes still verify and the chunk is still on
  // NVMe only; frees it otherwise.
  void PromoteFromSlot(const Hash128& key, const PoolExtent& extent) override;
  // Prefetch of (key, chunk bytes) chunks whole on NVMe only: one batched
  // read into reserved DRAM space that becomes each chunk's DRAM copy. The
  // first error (DRAM full, a corrupt copy, which is dropped); chunks
  // deleted or moved meanwhile are skipped.
  absl::Status PrefetchGroup(std::span<const std::pair<Hash128, uint64_t>> chunks) override;
  // Reserves `bytes` of DRAM, evicting as needed. ResourceExhausted if no
  // room can be made.
  absl::StatusOr<PoolExtent> ReserveDram(uint64_t bytes, TenantId tenant);
  void MaintenanceLoop();
  // Admission history: remembers the uses of a chunk that eviction dropped,
  // and takes them back when the chunk is stored again.
  void RememberDroppedLocked(const Hash128& key, uint32_t uses) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  uint32_t RecallUsesLocked(const Hash128& key) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const PlacementEngineOptions options_;
  Clock* const clock_;
  EngineTiers owned_;
  std::array<Tier*, kNumTierKinds> tiers_{};
  HbmTier* hbm_ = nullptr;
  DramTier* dram_ = nullptr;
  Tier* nvme_ = nullptr;
  NvmeTier* nvme_file_ = nullptr;  // nvme_ when it is an NvmeTier
  RemoteTier* remote_ = nullptr;
  std::array<std::atomic<uint64_t>, static_cast<int>(EngineMetric::kCount)> metrics_{};

  absl::Mutex mu_;
  absl::flat_hash_map<Hash128, ChunkState> chunks_ ABSL_GUARDED_BY(mu_);
  std::array<std::unique_ptr<EvictionPolicy>, kNumTierKinds> policies_ ABSL_GUARDED_BY(mu_);
  // With tenant quotas: policies_ themselves (the accounting wraps each
  // tier's policy), else null.
  std::array<TenantAccountingPolicy*, kNumTierKinds> accounting_ ABSL_GUARDED_BY(mu_){};
  std::vector<uint64_t> tenant_evictions_ ABSL_GUARDED_BY(mu_);
  std::vector<uint64_t> tenant_rejections_ ABSL_GUARDED_BY(mu_);
  // Leases and slots. A lease's keys are pinned (ChunkState::pins) while
  // it is in the table; a slot's extent is reserved in dram_.
  LeaseTable holds_ ABSL_GUARDED_BY(mu_);
  // Chunks a prefetch group is reading into DRAM now; a batched read waits
  // for them (prefetch_done_) instead of reading them a second time.
  absl::flat_hash_set<Hash128> prefetching_ ABSL_GUARDED_BY(mu_);
  absl::CondVar prefetch_done_;
  // Chunks a batched read is reading from NVMe, or whose scratch copy waits
  // to be promoted (a key may be in it more than once): a prefetch skips
  // them rather than read them a second time.
  absl::flat_hash_map<Hash128, int> loading_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<Hash128, uint32_t> dropped_uses_ ABSL_GUARDED_BY(mu_);
  std::deque<Hash128> dropped_order_ ABSL_GUARDED_BY(mu_);  // oldest first

  // Prefetches and the promotion of freed scratch slots, on its thread.
  // Lock order: mu_, then the prefetcher's (AbortSlot queues promotions).
  Prefetcher prefetcher_;
  // The maintenance thread and its stop flag.
  absl::Mutex bg_mu_;
  bool stopping_ ABSL_GUARDED_BY(bg_mu_) = false;
  std::thread maintenance_thread_;
};

}  // namespace kvtier::tiering

#endif  // KVTIER_TIERING_PLACEMENT_ENGINE_H_
