// Eviction policies, one instance per tier, keyed by ObjectKey with byte
// sizes. The placement engine owns them and calls them under its mutex, so
// they are not thread-safe themselves.
//
//   LruPolicy     the baseline: evicts the least recently used object.
//   S3FifoPolicy  S3-FIFO (Yang et al., SOSP'23): a small probationary FIFO
//                 (30% of capacity by default), a main FIFO with 2-bit frequencies and
//                 a ghost FIFO of recently evicted keys. One-hit wonders
//                 (scans) leave through the small queue without disturbing
//                 the main one.
//   ArcPolicy     ARC (Megiddo & Modha, FAST'03), weighted by bytes: a
//                 recency list T1 and a frequency list T2 with ghost lists
//                 B1/B2; a ghost hit moves the T1 target towards the list
//                 that would have kept the object, so the recency/frequency
//                 split adapts to the workload instead of being fixed.
//   FreqLruPolicy frequency-boosted LRU: each object's eviction priority is
//                 the logical time of its last use plus a bonus for every
//                 use beyond the first (up to a cap), counted by a
//                 count-min sketch that remembers objects after they leave
//                 (TinyLFU's sketch, Einziger et al., ToS'17). The bonus is a
//                 share of the tier's object count, so it scales with the
//                 tier: a chunk read again outlives chunks read once by that
//                 many uses of the tier.
#ifndef KVTIER_TIERING_EVICTION_H_
#define KVTIER_TIERING_EVICTION_H_

#include <array>
#include <cstdint>
#include <functional>
#include <list>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "tiering/tier.h"

namespace kvtier::tiering {

enum class EvictionPolicyKind : uint8_t { kLru = 0, kS3Fifo = 1, kArc = 2, kFreqLru = 3 };
// "lru", "s3fifo", "arc", "flru"
const char* EvictionPolicyName(EvictionPolicyKind k);
// The kind named `name` (EvictionPolicyName's names). InvalidArgument
// listing the names otherwise.
absl::StatusOr<EvictionPolicyKind> ParseEvictionPolicy(std::string_view name);

// The eviction policy of each tier: one for every tier and per-tier
// overrides. A tier's best policy depends on what reaches it: DRAM sees every
// put (most chunks are read once), NVMe only what DRAM evicted and admission
// let through.
// A spec names its policies; the engine's default is
// PlacementEngineOptions::eviction.
struct EvictionPolicySpec {
  EvictionPolicyKind all = EvictionPolicyKind::kFreqLru;
  std::array<std::optional<EvictionPolicyKind>, kNumTierKinds> tier{};

  EvictionPolicyKind For(TierKind k) const { return tier[static_cast<int>(k)].value_or(all); }
  // This spec with tier `k` overridden by `kind`.
  EvictionPolicySpec With(TierKind k, EvictionPolicyKind kind) const {
    EvictionPolicySpec s = *this;
    s.tier[static_cast<int>(k)] = kind;
    return s;
  }
};
// "POLICY", or a comma-separated list of POLICY and TIER=POLICY items
// ("flru,nvme=lru", "dram=flru"): a bare policy sets every tier (`fallback`
// where the list has none), TIER=POLICY one tier. InvalidArgument naming
// the bad item for an unknown policy or tier, an empty item, or a tier or
// bare policy given twice.
absl::StatusOr<EvictionPolicySpec> ParseEvictionPolicySpec(
    std::string_view spec, EvictionPolicyKind fallback = EvictionPolicyKind::kFreqLru);
// `s` in ParseEvictionPolicySpec's form: "flru", or "flru,nvme=lru" with
// the overrides that differ from the bare policy, in tier order.
std::string EvictionPolicySpecName(const EvictionPolicySpec& s);

struct EvictionOptions {
  // S3-FIFO: the small (probationary) queue's share of the capacity. A new
  // object must be reused before this many bytes of newer objects enter the
  // tier, or it leaves as a one-hit wonder. The paper's 10% is too short for
  // a KV cache: a conversation's new chunks are next read one turn later,
  // after the other active conversations' turns, and at 10% they leave DRAM
  // before that (bench/tiering_bench.cc trace; docs/tiering.md has numbers).
  // Ignored by other policies. Default: 0.3
  double s3fifo_small_fraction = 0.3;
  // FLRU: the bonus of each use beyond the first, as a multiple of the
  // number of objects in the tier (in units of uses of the tier), until the
  // policy's miniature caches choose one (0, 0.25, 0.5, 1, 2 or 4). Default: 0
  double flru_bonus = 0;
  // FLRU: uses beyond the first that earn a bonus. Default: 3
  uint32_t flru_max_bonus_uses = 3;
};

class EvictionPolicy {
 public:
  virtual ~EvictionPolicy() = default;
  // An object of `bytes` bytes now lives in the tier. Re-inserting a tracked
  // object counts as an access.
  virtual void OnInsert(const ObjectKey& id, uint64_t bytes) = 0;
  // A hit on a tracked object (ignored if untracked).
  virtual void OnAccess(const ObjectKey& id) = 0;
  // The object left the tier (deleted, evicted or moved).
  virtual void OnErase(const ObjectKey& id) = 0;
  // The next object to evict among those for which `evictable` is true, or
  // nullopt if none is. Does not remove it: the caller calls OnErase once it
  // is gone. Bounded: visits each tracked object at most a few times.
  virtual std::optional<ObjectKey> PickVictim(
      const std::function<bool(const ObjectKey&)>& evictable) = 0;
  virtual size_t size() const = 0;
  // True if `id` is untracked but was evicted recently (the policy keeps a
  // ghost of it): a re-insert would be a ghost hit.
  virtual bool IsGhost(const ObjectKey& id) const = 0;
};

// The tier that takes a tier's evicted objects (DRAM's is NVMe), as the
// engine runs it: FLRU chooses its bonus for the hits of both tiers.
struct TierBelow {
  // Its capacity; 0: no tier below (evicted objects are dropped).
  uint64_t capacity_bytes = 0;
  // An evicted object goes down only after this many uses (the engine's
  // nvme_admit_after_uses for DRAM); others are dropped.
  uint32_t admit_after_uses = 1;
};

// `capacity_bytes`: the tier's capacity (S3-FIFO sizes its queues and ARC
// its target and ghost lists from it). `below`: the tier under it (only
// FLRU uses it).
std::unique_ptr<EvictionPolicy> NewEvictionPolicy(EvictionPolicyKind kind,
                                                  uint64_t capacity_bytes,
                                                  const EvictionOptions& options = {},
                                                  const TierBelow& below = {});

}  // namespace kvtier::tiering

#endif  // KVTIER_TIERING_EVICTION_H_
