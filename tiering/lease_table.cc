#include "tiering/lease_table.h"

#include <sys/random.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace kvtier::tiering {

LeaseTable::LeaseTable(HoldLimits limits) : limits_(std::move(limits)) {
  for (uint64_t q : limits_.tenant_dram_quotas) dram_quota_sum_ += q;
}

int64_t LeaseTable::ExpiryAt(int64_t now, int64_t ttl_ms) const {
  if (ttl_ms <= 0) ttl_ms = limits_.default_lease_ms;
  return now + std::min(ttl_ms, limits_.max_lease_ms) * 1000;
}

absl::Status LeaseTable::CheckHold(const Holder& holder, uint64_t keys, uint64_t bytes) const {
  // `bytes` more within `cap` given `held` (0: no cap).
  auto over = [bytes](uint64_t cap, uint64_t held) {
    return cap != 0 && (bytes > cap || held > cap - bytes);
  };
  const HolderTally lt = leases_.TallyOf(holder.id), st = slots_.TallyOf(holder.id);
  const HoldLimits& l = limits_;
  std::string why;
  const uint64_t held = held_bytes();
  if (over(l.max_held_bytes, held)) {
    why = absl::StrCat("the held-bytes limit (", held, " of ", l.max_held_bytes, " held)");
  } else if (over(l.max_held_bytes_per_holder, lt.held_bytes + st.held_bytes)) {
    why = absl::StrCat("this holder's share of the held bytes (", lt.held_bytes + st.held_bytes,
                       " of ", l.max_held_bytes_per_holder, " held)");
  } else if (lt.entries + st.entries >= l.max_holds_per_holder) {
    why = absl::StrCat("this holder's ", l.max_holds_per_holder, " open leases and slots");
  } else if (lt.keys + keys > l.max_held_keys_per_holder) {
    why = absl::StrCat("this holder's ", l.max_held_keys_per_holder, " pinned keys (", lt.keys,
                       " pinned)");
  } else if (l.dram_capacity && l.max_held_bytes != 0 && !l.tenant_dram_quotas.empty()) {
    // The holds of one tenant's holders leave room for the others' DRAM
    // quotas, which are guarantees.
    const uint64_t others = dram_quota_sum_ - DramQuotaOf(holder.tenant);
    const uint64_t cap = *l.dram_capacity > others ? *l.dram_capacity - others : 0;
    const uint64_t mine = leases_.TenantHeldBytes(holder.tenant) + slots_.TenantHeldBytes(holder.tenant);
    if (cap == 0 || over(cap, mine)) {
      why = absl::StrCat("tenant ", holder.tenant, "'s share of DRAM that other tenants' quotas leave (",
                         mine, " of ", cap, " held)");
    }
  }
  if (why.empty()) return absl::OkStatus();
  return absl::ResourceExhaustedError(
      absl::StrCat("holding ", bytes, " more bytes would exceed ", why));
}

absl::StatusOr<Lease> LeaseTable::AddLease(std::vector<Hash128> keys, uint64_t bytes,
                                           int64_t ttl_ms, int64_t now, const Holder& holder) {
  KVTIER_RETURN_IF_ERROR(CheckHold(holder, keys.size(), bytes));
  KVTIER_ASSIGN_OR_RETURN(const uint64_t id, NewId());
  const int64_t exp = ExpiryAt(now, ttl_ms);
  const uint64_t n = keys.size();
  leases_.Insert(id, {LeaseState{std::move(keys)}, exp, holder, n, bytes});
  return Lease{id, exp};
}

absl::StatusOr<Slot> LeaseTable::AddSlot(SlotState slot, uint64_t held_bytes, int64_t ttl_ms,
                                         int64_t now, const Holder& holder) {
  KVTIER_RETURN_IF_ERROR(CheckHold(holder, 0, held_bytes));
  KVTIER_ASSIGN_OR_RETURN(const uint64_t id, NewId());
  const int64_t exp = ExpiryAt(now, ttl_ms);
  const PoolExtent extent = slot.extent;
  slots_.Insert(id, {std::move(slot), exp, holder, 0, held_bytes});
  return Slot{id, extent, exp};
}

absl::StatusOr<Lease> LeaseTable::Renew(uint64_t id, int64_t ttl_ms, HolderId holder, int64_t now) {
  if (leases_.FindHeld(id, holder, now) == nullptr) {
    return absl::NotFoundError("lease unknown or expired");
  }
  const int64_t exp = ExpiryAt(now, ttl_ms);
  leases_.SetExpiry(id, exp);
  return Lease{id, exp};
}

absl::StatusOr<LeaseState> LeaseTable::TakeLease(uint64_t id, HolderId holder, int64_t now) {
  if (leases_.FindHeld(id, holder, now) == nullptr) {
    return absl::NotFoundError("lease unknown or expired");
  }
  return std::move(leases_.Take(id).state);
}

absl::StatusOr<SlotState> LeaseTable::TakeSlot(uint64_t id, HolderId holder, int64_t now) {
  if (slots_.FindHeld(id, holder, now) == nullptr) {
    return absl::NotFoundError("slot unknown or expired");
  }
  return std::move(slots_.Take(id).state);
}

absl::StatusOr<PoolExtent> LeaseTable::TakeClientSlot(uint64_t id, HolderId holder, int64_t now) {
  auto* e = slots_.FindHeld(id, holder, now);
  if (e == nullptr || e->state.scratch) return absl::NotFoundError("slot unknown or expired");
  return slots_.Take(id).state.extent;
}

absl::StatusOr<PoolExtent> LeaseTable::ClientSlotExtent(uint64_t id, HolderId holder,
                                                        int64_t live_at) const {
  const auto* e = slots_.FindHeld(id, holder, live_at);
  if (e == nullptr || e->state.scratch) return absl::NotFoundError("slot unknown or expired");
  return e->state.extent;
}

bool LeaseTable::MarkPromote(uint64_t id, const Hash128& key) {
  auto* e = slots_.Find(id);
  if (e == nullptr) return false;
  e->state.promote = true;
  e->state.key = key;
  return true;
}

EndedHolds LeaseTable::TakeExpired(int64_t now) {
  EndedHolds ended;
  leases_.TakeExpired(now, [&](uint64_t, HoldTable<LeaseState>::Entry&& e) {
    ended.leases.push_back(std::move(e.state));
  });
  slots_.TakeExpired(now, [&](uint64_t, HoldTable<SlotState>::Entry&& e) {
    ended.slots.push_back(std::move(e.state));
  });
  return ended;
}

void LeaseTable::ForgetEnded(int64_t now, absl::flat_hash_set<uint64_t>& slot_ids,
                             absl::flat_hash_set<uint64_t>& lease_ids) const {
  absl::erase_if(slot_ids, [&](uint64_t id) {
    const auto* e = slots_.Find(id);
    return e == nullptr || e->expires_at_us <= now;
  });
  absl::erase_if(lease_ids, [&](uint64_t id) {
    const auto* e = leases_.Find(id);
    return e == nullptr || e->expires_at_us <= now;
  });
}

absl::StatusOr<uint64_t> LeaseTable::NewId() {
  for (;;) {
    if (id_pool_next_ == id_pool_.size()) {
      // At most 256 bytes: once the kernel's pool is initialized such a
      // getrandom is never short and never interrupted (getrandom(2)).
      auto* p = reinterpret_cast<uint8_t*>(id_pool_.data());
      constexpr size_t kBytes = sizeof(id_pool_);
      static_assert(kBytes <= 256, "larger getrandom requests may be short or interrupted");
      for (size_t got = 0; got < kBytes;) {
        const ssize_t k = ::getrandom(p + got, kBytes - got, 0);
        if (k < 0 && errno == EINTR) continue;
        if (k < 0) return absl::InternalError(absl::StrCat("getrandom: ", std::strerror(errno)));
        got += static_cast<size_t>(k);
      }
      id_pool_next_ = 0;
    }
    const uint64_t id = id_pool_[id_pool_next_++];
    if (id != 0 && !leases_.contains(id) && !slots_.contains(id)) return id;
  }
}

}  // namespace kvtier::tiering
