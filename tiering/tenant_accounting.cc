#include "tiering/tenant_accounting.h"

#include <utility>

namespace kvtier::tiering {

TenantAccountingPolicy::TenantAccountingPolicy(std::unique_ptr<EvictionPolicy> inner,
                                               std::function<TenantId(const Hash128&)> tenant_of)
    : inner_(std::move(inner)), tenant_of_(std::move(tenant_of)) {}

void TenantAccountingPolicy::OnInsert(const ObjectKey& id, uint64_t bytes) {
  auto [it, inserted] = objects_.try_emplace(id, Entry{0, 0});
  if (inserted) it->second.tenant = tenant_of_(id.key);
  Entry& e = it->second;
  if (e.tenant >= bytes_.size()) bytes_.resize(e.tenant + 1, 0);
  // A re-insert of a tracked object (an access) may carry a new size.
  bytes_[e.tenant] = bytes_[e.tenant] - e.bytes + bytes;
  e.bytes = bytes;
  inner_->OnInsert(id, bytes);
}

void TenantAccountingPolicy::OnErase(const ObjectKey& id) {
  auto it = objects_.find(id);
  if (it != objects_.end()) {
    bytes_[it->second.tenant] -= it->second.bytes;
    objects_.erase(it);
  }
  inner_->OnErase(id);
}

std::optional<TenantId> TenantAccountingPolicy::TenantOf(const ObjectKey& id) const {
  auto it = objects_.find(id);
  if (it == objects_.end()) return std::nullopt;
  return it->second.tenant;
}

}  // namespace kvtier::tiering
