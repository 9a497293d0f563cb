// HoldTable: the leases or the slots of a LeaseTable (lease_table.h), by
// id. Each entry has an expiry and a holder (the connection or credential
// that took it): only its holder may end or renew it, and each holder's
// entries, keys and held bytes are tallied so that one holder's share can be
// capped. Expiries are indexed, so ending the due entries costs
// O(due x log n) and a lookup O(1), however many entries there are.
//
// Plain data: not thread-safe (its owner's lock guards it), no callbacks.
#ifndef KVTIER_TIERING_HOLD_TABLE_H_
#define KVTIER_TIERING_HOLD_TABLE_H_

#include <cstdint>
#include <utility>

#include "absl/container/btree_set.h"
#include "absl/container/flat_hash_map.h"

namespace kvtier::tiering {

// Who took a lease or slot: a data-plane connection, or a credential (a
// tenant over gRPC); 0 is the engine's own callers (tests, tools).
using HolderId = uint64_t;
inline constexpr HolderId kEngineHolder = 0;

// A holder and the tenant it acts for (PlacementEngineOptions::tenant_quotas).
struct Holder {
  HolderId id = kEngineHolder;
  uint16_t tenant = 0;
};

// What one holder has now.
struct HolderTally {
  uint64_t entries = 0;
  uint64_t keys = 0;        // keys pinned by its leases
  uint64_t held_bytes = 0;  // bytes it counts towards the held-bytes limit
};

template <typename State>
class HoldTable {
 public:
  struct Entry {
    State state;
    int64_t expires_at_us = 0;
    Holder holder;
    uint64_t keys = 0;        // tallied for the holder
    uint64_t held_bytes = 0;  // tallied for the holder
  };

  bool contains(uint64_t id) const { return entries_.contains(id); }
  size_t size() const { return entries_.size(); }

  // The entry `id` if `holder` took it and it is live at `now`
  // (expires_at_us > now); null otherwise, whoever holds it.
  const Entry* FindHeld(uint64_t id, HolderId holder, int64_t now) const {
    const Entry* e = Find(id);
    return e == nullptr || e->holder.id != holder || e->expires_at_us <= now ? nullptr : e;
  }
  Entry* FindHeld(uint64_t id, HolderId holder, int64_t now) {
    return const_cast<Entry*>(std::as_const(*this).FindHeld(id, holder, now));
  }
  // The entry `id` whoever holds it, or null.
  const Entry* Find(uint64_t id) const {
    auto it = entries_.find(id);
    return it == entries_.end() ? nullptr : &it->second;
  }
  Entry* Find(uint64_t id) { return const_cast<Entry*>(std::as_const(*this).Find(id)); }

  // REQUIRES: !contains(id).
  void Insert(uint64_t id, Entry e) {
    by_expiry_.insert({e.expires_at_us, id});
    HolderTally& t = tallies_[e.holder.id];
    ++t.entries;
    t.keys += e.keys;
    t.held_bytes += e.held_bytes;
    if (e.held_bytes != 0) tenant_held_[e.holder.tenant] += e.held_bytes;
    held_bytes_ += e.held_bytes;
    entries_.emplace(id, std::move(e));
  }

  // REQUIRES: contains(id).
  void SetExpiry(uint64_t id, int64_t expires_at_us) {
    Entry& e = entries_.at(id);
    by_expiry_.erase({e.expires_at_us, id});
    e.expires_at_us = expires_at_us;
    by_expiry_.insert({expires_at_us, id});
  }

  // Removes `id` and returns its entry. REQUIRES: contains(id).
  Entry Take(uint64_t id) {
    auto it = entries_.find(id);
    Entry e = std::move(it->second);
    entries_.erase(it);
    by_expiry_.erase({e.expires_at_us, id});
    auto t = tallies_.find(e.holder.id);
    if (--t->second.entries == 0) {
      tallies_.erase(t);
    } else {
      t->second.keys -= e.keys;
      t->second.held_bytes -= e.held_bytes;
    }
    held_bytes_ -= e.held_bytes;
    if (e.held_bytes != 0) {
      auto h = tenant_held_.find(e.holder.tenant);
      if ((h->second -= e.held_bytes) == 0) tenant_held_.erase(h);
    }
    return e;
  }

  // Takes every entry that has expired at `now` (expires_at_us <= now),
  // earliest first, and passes each to fn(id, Entry&&).
  template <typename Fn>
  void TakeExpired(int64_t now, Fn&& fn) {
    while (!by_expiry_.empty() && by_expiry_.begin()->first <= now) {
      const uint64_t id = by_expiry_.begin()->second;
      fn(id, Take(id));
    }
  }

  // Bytes held by every entry.
  uint64_t held_bytes() const { return held_bytes_; }
  // Bytes held by the holders of `tenant`.
  uint64_t TenantHeldBytes(uint16_t tenant) const {
    auto it = tenant_held_.find(tenant);
    return it == tenant_held_.end() ? 0 : it->second;
  }

  // What `holder` has now (zeros if nothing).
  HolderTally TallyOf(HolderId holder) const {
    auto it = tallies_.find(holder);
    return it == tallies_.end() ? HolderTally{} : it->second;
  }

 private:
  absl::flat_hash_map<uint64_t, Entry> entries_;
  absl::btree_set<std::pair<int64_t, uint64_t>> by_expiry_;  // (expires_at_us, id)
  absl::flat_hash_map<HolderId, HolderTally> tallies_;
  absl::flat_hash_map<uint16_t, uint64_t> tenant_held_;
  uint64_t held_bytes_ = 0;
};

}  // namespace kvtier::tiering

#endif  // KVTIER_TIERING_HOLD_TABLE_H_
