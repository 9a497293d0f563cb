// Per-tenant byte accounting of one tier: an EvictionPolicy that forwards to
// the tier's policy and counts, per tenant, the bytes of the objects the tier
// holds. Every object enters and leaves a tier through its policy (OnInsert,
// OnErase), so the counts follow the tier's contents whichever path (put,
// commit, demotion, promotion, delete, eviction) moved the object.
//
// Not thread-safe: like every policy, called under the placement engine's
// mutex.
#ifndef KVTIER_TIERING_TENANT_ACCOUNTING_H_
#define KVTIER_TIERING_TENANT_ACCOUNTING_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "tiering/eviction.h"
#include "tiering/tier.h"

namespace kvtier::tiering {

// A tenant's id in the engine (PutOptions::tenant): an index into
// PlacementEngineOptions::tenant_quotas.
using TenantId = uint16_t;

class TenantAccountingPolicy final : public EvictionPolicy {
 public:
  // `tenant_of` names the tenant of an object that enters the tier (the
  // engine's record of its chunk); it is asked once per object.
  TenantAccountingPolicy(std::unique_ptr<EvictionPolicy> inner,
                         std::function<TenantId(const Hash128&)> tenant_of);

  void OnInsert(const ObjectKey& id, uint64_t bytes) override;
  void OnAccess(const ObjectKey& id) override { inner_->OnAccess(id); }
  void OnErase(const ObjectKey& id) override;
  std::optional<ObjectKey> PickVictim(
      const std::function<bool(const ObjectKey&)>& evictable) override {
    return inner_->PickVictim(evictable);
  }
  size_t size() const override { return inner_->size(); }
  bool IsGhost(const ObjectKey& id) const override { return inner_->IsGhost(id); }

  // Bytes of tenant `t`'s objects in the tier.
  uint64_t bytes(TenantId t) const { return t < bytes_.size() ? bytes_[t] : 0; }
  // The tenant of a tracked object; nullopt if the tier does not hold it.
  std::optional<TenantId> TenantOf(const ObjectKey& id) const;

 private:
  struct Entry {
    TenantId tenant;
    uint64_t bytes;
  };
  std::unique_ptr<EvictionPolicy> inner_;
  std::function<TenantId(const Hash128&)> tenant_of_;
  absl::flat_hash_map<ObjectKey, Entry> objects_;
  std::vector<uint64_t> bytes_;  // indexed by tenant
};

}  // namespace kvtier::tiering

#endif  // KVTIER_TIERING_TENANT_ACCOUNTING_H_
