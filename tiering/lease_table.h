// LeaseTable: the placement engine's leases and slots. A lease pins chunks
// (the table keeps its keys); a slot reserves an extent of the DRAM pool
// (the table keeps the extent). For each it keeps the id, the expiry, the
// holder and what the holder is charged, and it decides whether a holder
// may take one more (the hold limits).
//
// Plain data, no callbacks: what a lease or slot holds in the engine (the
// pins of its chunks, the pool space of its extent) is the caller's to
// release, with the state the table hands back when the lease or slot
// ends (TakeLease, TakeSlot, TakeExpired).
//
// Not thread-safe: the owner's lock guards it (PlacementEngine::mu_), since
// taking a lease must be atomic with pinning its chunks.
#ifndef KVTIER_TIERING_LEASE_TABLE_H_
#define KVTIER_TIERING_LEASE_TABLE_H_

#include <array>
#include <cstdint>
#include <optional>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/hash.h"
#include "tiering/hold_table.h"
#include "tiering/pool_tier.h"

namespace kvtier::tiering {

// Lease and slot ids are nonzero 64-bit values drawn from getrandom(2): one
// id tells nothing about any other, so a client cannot name another client's
// lease or slot by guessing. An id is never handed out while a lease or slot
// holds it. Each lease and slot belongs to the holder that took it (a
// data-plane connection or a gRPC credential): an id that another holder
// names is NotFound to it, as an unknown one is.
struct Lease {
  uint64_t id = 0;
  int64_t expires_at_us = 0;  // on the engine's clock
};

// A reserved DRAM slot that a client fills in place, then commits.
struct Slot {
  uint64_t id = 0;
  PoolExtent extent;  // in DramTier's shared-memory pool
  int64_t expires_at_us = 0;
};

// What a lease holds: the chunks it pins (a key may appear more than once).
struct LeaseState {
  std::vector<Hash128> keys;
};

// What a slot holds.
struct SlotState {
  PoolExtent extent;
  bool scratch = false;  // GetShared's copy: read only, never committed
  // A scratch copy of chunk `key` read from NVMe, promoted when freed.
  bool promote = false;
  Hash128 key{};
};

// The limits on what holders hold, and how long a lease lasts. The byte
// limits count a lease's chunk bytes and a scratch slot's bytes (a client
// slot counts none). The PlacementEngineOptions fields of the same names
// document each.
struct HoldLimits {
  // 0: no limit. Default: 0
  uint64_t max_held_bytes = 0;
  // 0: no limit of its own. Default: 0
  uint64_t max_held_bytes_per_holder = 0;
  // Leases and slots one holder may have open. Default: 16384
  uint64_t max_holds_per_holder = 16384;
  // Keys the leases of one holder may pin. Default: 262144
  uint64_t max_held_keys_per_holder = 262144;
  // Lease (and slot) duration when 0 ms is asked. Default: 30000
  int64_t default_lease_ms = 30000;
  // Longest duration; longer requests are clamped. Default: 600000
  int64_t max_lease_ms = 600000;
  // The DRAM tier's capacity; unset without a DRAM tier. With
  // max_held_bytes and tenant quotas, the holds of one tenant's holders
  // leave room for every other tenant's DRAM quota. Default: unset
  std::optional<uint64_t> dram_capacity;
  // Each tenant's DRAM quota, indexed by tenant id (0: none); empty
  // without tenant quotas. Default: empty
  std::vector<uint64_t> tenant_dram_quotas;
};

// The leases and slots that TakeExpired ended, earliest expiry first.
struct EndedHolds {
  std::vector<LeaseState> leases;
  std::vector<SlotState> slots;
};

class LeaseTable {
 public:
  explicit LeaseTable(HoldLimits limits);

  // When a lease or slot asked for `ttl_ms` at `now` ends: `ttl_ms` <= 0
  // is the default duration, and it is clamped to max_lease_ms.
  int64_t ExpiryAt(int64_t now, int64_t ttl_ms) const;

  // OK if `holder` may take one more lease or slot of `keys` keys and
  // `bytes` held bytes; ResourceExhausted (a refusal, the only code it
  // returns) beyond max_held_bytes, the share its tenant may hold or the
  // holder's own limits.
  absl::Status CheckHold(const Holder& holder, uint64_t keys, uint64_t bytes) const;

  // Adds a lease of `holder` on `keys`, whose chunks hold `bytes`, after
  // CheckHold. ResourceExhausted as CheckHold (nothing added); Internal if
  // no id can be drawn. The caller pins the keys.
  absl::StatusOr<Lease> AddLease(std::vector<Hash128> keys, uint64_t bytes, int64_t ttl_ms,
                                 int64_t now, const Holder& holder);
  // Adds a slot of `holder` over `extent`, charged `held_bytes`, after
  // CheckHold. Codes as AddLease; on error the extent stays the caller's.
  absl::StatusOr<Slot> AddSlot(SlotState slot, uint64_t held_bytes, int64_t ttl_ms, int64_t now,
                               const Holder& holder);

  // Extends lease `id` of `holder`. NotFound if unknown, expired at `now`
  // or another holder's.
  absl::StatusOr<Lease> Renew(uint64_t id, int64_t ttl_ms, HolderId holder, int64_t now);
  // Ends lease `id` of `holder` and returns what it held (the caller
  // unpins it). NotFound as Renew.
  absl::StatusOr<LeaseState> TakeLease(uint64_t id, HolderId holder, int64_t now);
  // Ends slot `id` of `holder`, a client's or a scratch one, and returns
  // it (the caller frees its extent). NotFound as Renew.
  absl::StatusOr<SlotState> TakeSlot(uint64_t id, HolderId holder, int64_t now);
  // TakeSlot of a client slot: a scratch slot is NotFound (and stays).
  absl::StatusOr<PoolExtent> TakeClientSlot(uint64_t id, HolderId holder, int64_t now);
  // The extent of client slot `id` of `holder` that is live at `live_at`.
  // NotFound for an unknown, scratch or another holder's slot, or one that
  // ends by `live_at`.
  absl::StatusOr<PoolExtent> ClientSlotExtent(uint64_t id, HolderId holder, int64_t live_at) const;
  // Marks slot `id` a scratch copy of `key` to promote when it is freed.
  // False if there is no such slot.
  bool MarkPromote(uint64_t id, const Hash128& key);

  // Ends every lease and slot that has expired at `now` and returns them.
  EndedHolds TakeExpired(int64_t now);
  // Removes from `slot_ids` and `lease_ids` the ids that are unknown or
  // expired at `now`.
  void ForgetEnded(int64_t now, absl::flat_hash_set<uint64_t>& slot_ids,
                   absl::flat_hash_set<uint64_t>& lease_ids) const;

  // Bytes held by every lease and slot.
  uint64_t held_bytes() const { return leases_.held_bytes() + slots_.held_bytes(); }
  size_t leases() const { return leases_.size(); }
  size_t slots() const { return slots_.size(); }

 private:
  // A fresh id (see Lease). Internal if getrandom fails.
  absl::StatusOr<uint64_t> NewId();
  uint64_t DramQuotaOf(uint16_t tenant) const {
    return tenant < limits_.tenant_dram_quotas.size() ? limits_.tenant_dram_quotas[tenant] : 0;
  }

  const HoldLimits limits_;
  uint64_t dram_quota_sum_ = 0;  // limits_.tenant_dram_quotas, summed
  HoldTable<LeaseState> leases_;
  HoldTable<SlotState> slots_;
  // Random bytes for ids, drawn 256 at a time (one getrandom call that is
  // never short or interrupted); id_pool_next_ is the next unused one.
  std::array<uint64_t, 32> id_pool_{};
  size_t id_pool_next_ = 32;
};

}  // namespace kvtier::tiering

#endif  // KVTIER_TIERING_LEASE_TABLE_H_
