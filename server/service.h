// KvService: the daemon's request logic over a PlacementEngine, in domain
// types only (no protobuf). The gRPC adapter (grpc_service.h) translates
// messages to these calls; tests call it directly.
//
// Every input is validated here: key counts against the limits, chunk bytes
// with VerifyChunkParallel (header, lengths, both sections' checksums) before
// anything is stored, or sealed by SealChunkParallel when a GPU store left
// the checksums to the daemon. A chunk is verified once, when it is stored, and goes
// to the engine as that verification's codec::VerifiedChunk, so no layer
// below parses its header again. Gets that copy bytes out of a tier (inline,
// into a slot, NVMe into a scratch slot) verify what they copied. A shared-memory get of a chunk whole in DRAM hands
// out the extent without reading it: the reader (libkvtier) checks the bytes
// as it copies them, and asks again with `verify` on a mismatch, which makes
// the daemon check the stored bytes and drop a corrupt chunk (DataLoss).
//
// Thread-safe: the service keeps no state of its own beyond its limits; the
// engine (thread-safe) is the one table of slots and leases, and the service
// reaches a slot's bytes through it (PlacementEngine::SlotView).
#ifndef KVTIER_SERVER_SERVICE_H_
#define KVTIER_SERVER_SERVICE_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/hash.h"
#include "wire/chunk_check.h"
#include "bandwidth/model.h"
#include "server/tenants.h"
#include "tiering/placement_engine.h"

namespace kvtier::server {

inline constexpr uint32_t kProtocolVersion = 1;

// Per-daemon request limits.
struct ServiceLimits {
  // Most keys one Lookup/Pin/Prefetch may carry; more is InvalidArgument.
  // Default: 4096
  uint32_t max_keys_per_request = 4096;
  // Largest chunk a Put or AllocateSlot accepts; larger is InvalidArgument.
  // Default: 1 GiB
  uint64_t max_chunk_bytes = uint64_t{1} << 30;
  // Longest prefetch deadline honoured (longer ones are clamped).
  // Default: 60000
  uint32_t max_prefetch_wait_ms = 60000;
};

struct PutArgs {
  Hash128 key;  // the stored key (Tenant::WriteKey of the client's)
  bool durable = false;
  std::optional<tiering::TierKind> tier;
  tiering::TenantId tenant = 0;  // whose quotas the chunk counts towards
  tiering::HolderId holder = tiering::kEngineHolder;  // a slot's commit: whose slot
  // A slot's commit: the chunk has no checksums yet; compute them
  // (wire::SealChunkParallel) instead of checking them.
  bool seal = false;
  // With seal, a slot's commit: its bytes are still landing, in groups of this
  // many layers (wire::SealLandedChunkParallel); 0: they are all there. Such
  // a commit leaves the slot to its holder when it fails before the seal.
  uint32_t landing_layers = 0;
};

// How a get hands the chunk out.
enum class GetMode : uint8_t {
  kCopy = 0,  // copied into a caller buffer (inline bytes)
  kShm = 1,   // extent in the pool, pinned by a lease or copied into a scratch slot
  kSlot = 2,  // copied into the caller's slot
};

struct GetResult {
  tiering::TierKind tier = tiering::TierKind::kDram;
  uint64_t chunk_bytes = 0;
  std::vector<uint8_t> bytes;       // kCopy
  tiering::PoolExtent extent;       // kShm, kSlot
  uint64_t lease_id = 0;            // kShm: the chunk is pinned; Release it
  uint64_t scratch_slot_id = 0;     // kShm: a copy in a slot; AbortSlot it
  int64_t expires_at_us = 0;        // kShm: when the lease or scratch slot ends
  // kShm: the bytes handed out were checked against their checksums as this
  // get read them (a scratch copy whose tier checked it as it read it, or a
  // get that asked for the check), so the reader need not hash them again.
  bool checked = false;
};

// Every slot and lease belongs to its holder (tiering::Holder): a data-plane
// connection (ShmChannel numbers them) or a gRPC credential (GrpcHolder: the
// tenant of the call). The answer to a slot or lease id that is not the
// caller's: one that never existed, one that ended or expired, and one that
// another holder holds all get this NotFound, so it tells nothing about
// other clients' ids.
absl::Status UnknownSlotError(uint64_t slot_id);
absl::Status UnknownLeaseError(uint64_t lease_id);

// The holder of the slots and leases that gRPC calls of `tenant` take: the
// credential. Data-plane connections are holders 1, 2, ... (below 2^63).
inline tiering::Holder GrpcHolder(tiering::TenantId tenant) {
  return tiering::Holder{(uint64_t{1} << 63) | tenant, tenant};
}

// One tenant's share and counters (with a tenants file).
struct TenantStats {
  std::string name;
  tiering::TenantUsage usage;  // bytes per tier, evictions, quota rejections
  uint64_t hits = 0, misses = 0, puts = 0, put_rejections = 0;  // Tenant's counters
};

struct ServiceStats {
  std::vector<tiering::TierUsage> tiers;
  std::vector<std::pair<std::string, uint64_t>> counters;  // engine counters
  std::vector<TenantStats> tenants;  // empty without a tenants file
};

class KvService {
 public:
  // `engine` and `tenants` (optional: its tenants' stats are reported) are
  // not owned and must outlive the service.
  KvService(tiering::PlacementEngine* engine, const ServiceLimits& limits,
            const TenantRegistry* tenants = nullptr);

  const ServiceLimits& limits() const { return limits_; }
  tiering::PlacementEngine* engine() const { return engine_; }

  // The fastest tier of each key of the longest stored prefix.
  // InvalidArgument if there are more keys than the limit.
  absl::StatusOr<std::vector<tiering::TierKind>> Lookup(std::span<const Hash128> keys);
  // Lookup with each hit's size and estimated load time and, given the
  // engine's prefill cost (`prefill.tokens_per_s` > 0, with
  // `tokens_per_chunk`), how many leading hits are worth loading rather than
  // recomputing (bandwidth::BestLoadPrefix): hit i recomputes in
  // bandwidth::RecomputeMicros of tokens [i*T, (i+1)*T), T =
  // tokens_per_chunk, so with prefill.attention_doubling_tokens the later
  // hits of a long prefix cost more. InvalidArgument for too many keys, a
  // rate or attention_doubling_tokens that is negative or not finite, or
  // tokens_per_chunk outside 1..1048576 with a rate.
  struct LoadPlan {
    tiering::PrefixLoadEstimate estimate;
    bandwidth::LoadDecision decision;  // chunks == 0 without a rate
  };
  absl::StatusOr<LoadPlan> PlanLoad(std::span<const Hash128> keys,
                                    const bandwidth::PrefillCost& prefill,
                                    uint32_t tokens_per_chunk);
  // PlanLoad, then a hold (PlacementEngine::Hold, under one lease of
  // `lease_ms`) of exactly the chunks the plan says to load: the leading
  // decision.chunks hits, or every hit without a rate. Nothing planned is
  // evicted, moved or deleted until the lease is released or expires. The
  // lease id is 0 when the plan loads nothing. PlanLoad's errors, and
  // ResourceExhausted (nothing held) beyond the held-bytes limit.
  struct HeldPlan {
    LoadPlan plan;
    uint32_t held_chunks = 0;
    tiering::Lease lease;
  };
  absl::StatusOr<HeldPlan> PlanAndHold(std::span<const Hash128> keys,
                                       const bandwidth::PrefillCost& prefill,
                                       uint32_t tokens_per_chunk, uint32_t lease_ms,
                                       const tiering::Holder& holder);

  // Verifies and stores `chunk`. InvalidArgument for malformed bytes or a
  // chunk over the size limit, DataLoss for a checksum mismatch, the
  // engine's codes otherwise.
  absl::Status Put(const PutArgs& args, std::span<const uint8_t> chunk);

  // The slot is `holder`'s and counts towards its tenant's DRAM quota
  // (PlacementEngine::AllocateSlot).
  absl::StatusOr<tiering::Slot> AllocateSlot(uint64_t bytes, uint32_t ttl_ms,
                                             const tiering::Holder& holder);
  // NotFound (UnknownSlotError) for a slot that is unknown, expired or
  // another holder's.
  absl::Status AbortSlot(uint64_t slot_id, tiering::HolderId holder);
  // Whether `holder` holds slot `slot_id` (allocated, neither committed,
  // aborted nor expired).
  bool HoldsSlot(uint64_t slot_id, tiering::HolderId holder) {
    return SlotSpan(slot_id, holder).ok();
  }
  // Removes the ids of slots and leases that ended (unknown or expired) from
  // the sets (PlacementEngine::ForgetEnded).
  void ForgetEnded(absl::flat_hash_set<uint64_t>& slot_ids,
                   absl::flat_hash_set<uint64_t>& lease_ids) {
    engine_->ForgetEnded(slot_ids, lease_ids);
  }
  // Verifies the bytes the client wrote into slot `slot_id` (args.holder's),
  // then stores them as `args.key` without a copy. NotFound for an unknown,
  // expired or another holder's slot,
  // DataLoss/InvalidArgument for bad bytes (the slot is then freed, but by a
  // landing commit, args.landing_layers, which leaves it to the holder when it
  // fails before the seal: DeadlineExceeded when the bytes did not land).
  absl::Status CommitSlot(const PutArgs& args, uint64_t slot_id);

  // A streamed commit of slot `slot_id`: the returned check is advanced as
  // the client reports bytes written (overlapping the check with the copy),
  // then FinishStreamedCommit stores the slot as `args.key` without a copy.
  // NotFound for an unknown or expired slot. On any error of the check the
  // caller aborts the slot (AbortSlot). With a `helper` (owned by the caller,
  // idle), the check hashes the V section on it.
  absl::StatusOr<std::unique_ptr<wire::IncrementalChunkCheck>> BeginStreamedCommit(
      uint64_t slot_id, tiering::HolderId holder, wire::TrailingHasher* helper = nullptr);
  // Finishes `check` (DataLoss/InvalidArgument: the slot is freed) and
  // commits. NotFound if the slot expired meanwhile.
  absl::Status FinishStreamedCommit(const PutArgs& args, uint64_t slot_id,
                                    wire::IncrementalChunkCheck& check);

  // kCopy: bytes in the result. kShm: the chunk's extent in the pool, valid
  // until the lease (lease_ms) is released or expires, or a scratch-slot
  // copy when the chunk is not whole in DRAM (PlacementEngine::GetShared).
  // kSlot: copied into `slot_id` (InvalidArgument if the slot is too small;
  // NotFound if unknown). Every mode is one engine read: one use of the
  // chunk and one count in the engine's gets and hits or misses.
  // NotFound on a miss; DataLoss if the stored bytes are corrupt (the chunk
  // is dropped). kShm of a chunk whole in DRAM reads no chunk bytes unless
  // `verify` is set. The lease or scratch slot of kShm is `holder`'s; so
  // must the slot of kSlot be.
  absl::StatusOr<GetResult> Get(const Hash128& key, GetMode mode, const tiering::Holder& holder,
                                uint64_t slot_id = 0, uint32_t lease_ms = 0, bool verify = false);

  // Get in kShm mode of every key (PlacementEngine::GetSharedBatch: the
  // NVMe-only chunks are read in one submission), one result per key in
  // order; a miss is that key's NotFound, the other keys are still served.
  // InvalidArgument for the whole batch (nothing held) for too many keys or
  // a key that appears twice.
  absl::StatusOr<std::vector<absl::StatusOr<GetResult>>> GetBatchShared(
      std::span<const Hash128> keys, uint32_t lease_ms, bool verify,
      const tiering::Holder& holder);

  absl::Status Delete(const Hash128& key);
  // Promotes NVMe-only keys to DRAM. Waits up to `deadline_ms` (clamped);
  // returns true if the prefetch finished within it.
  absl::StatusOr<bool> Prefetch(std::vector<Hash128> keys, uint32_t deadline_ms);
  // Prefetch of the leading keys of the stored prefix of `keys` that are
  // not in DRAM or HBM (on NVMe, or on the remote tier), as many as fit in
  // `byte_budget` bytes together (0: no limit). Waits up to `deadline_ms`
  // (clamped) as Prefetch does.
  struct PrefetchReport {
    bool completed = false;  // the queued keys reached DRAM within the wait
    uint32_t keys = 0;       // keys queued
    uint64_t bytes = 0;      // their chunk bytes
  };
  absl::StatusOr<PrefetchReport> PrefetchWithin(std::span<const Hash128> keys,
                                                uint64_t byte_budget, uint32_t deadline_ms);
  absl::StatusOr<tiering::Lease> Pin(std::span<const Hash128> keys, uint32_t ttl_ms,
                                     const tiering::Holder& holder);
  // NotFound (UnknownLeaseError) for a lease that is unknown, expired or
  // another holder's.
  absl::StatusOr<tiering::Lease> Renew(uint64_t lease_id, uint32_t ttl_ms,
                                       tiering::HolderId holder);
  absl::Status Release(uint64_t lease_id, tiering::HolderId holder);
  ServiceStats Stats();

  // What FlushDramToNvme did with the whole chunks held only in DRAM.
  struct FlushReport {
    uint64_t written = 0;  // made durable on NVMe
    uint64_t no_room = 0;  // left out: the NVMe tier had no room for them
    uint64_t corrupt = 0;  // failed their checksums: never persisted
    uint64_t failed = 0;   // their NVMe put failed (first_error)
    absl::Status first_error;
  };
  // Writes every whole chunk held only in DRAM to NVMe while it has room
  // (the SIGTERM path), and says what it left out and why.
  FlushReport FlushDramToNvme();

 private:
  absl::Status CheckKeyCount(size_t n) const;
  // The bytes of client slot `slot_id` (PlacementEngine::SlotView: one about
  // to expire counts as expired). NotFound (UnknownSlotError) for a slot
  // that is unknown, a scratch slot, or expired; FailedPrecondition without
  // a DRAM tier.
  absl::StatusOr<std::span<uint8_t>> SlotSpan(uint64_t slot_id, tiering::HolderId holder);
  // Commits slot `slot_id` whose bytes were verified into `verified`; on a
  // verification error frees the slot and returns the error.
  absl::Status CommitVerified(const PutArgs& args, uint64_t slot_id,
                              const absl::StatusOr<codec::VerifiedChunk>& verified);
  // Verifies chunk bytes held in the pool; on corruption drops the key.
  absl::Status VerifyStored(const Hash128& key, std::span<const uint8_t> bytes);
  // Drops `key`, whose bytes failed verification with `st`; DataLoss.
  absl::Status DropCorrupt(const Hash128& key, const absl::Status& st);

  tiering::PlacementEngine* const engine_;
  const ServiceLimits limits_;
  const TenantRegistry* const tenants_;
};

}  // namespace kvtier::server

#endif  // KVTIER_SERVER_SERVICE_H_
