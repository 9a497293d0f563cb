#include "cluster/rendezvous.h"

#include <algorithm>

#include "xxhash.h"

namespace kvtier::cluster {

uint64_t RendezvousWeight(const Hash128& key, const std::string& member_id) {
  std::string buf(reinterpret_cast<const char*>(key.bytes.data()), Hash128::kSize);
  buf += member_id;
  return XXH3_64bits_withSeed(buf.data(), buf.size(), kRendezvousSeed);
}

std::vector<Member> RendezvousOwners(const Hash128& key, std::span<const Member> members, size_t r) {
  std::vector<std::pair<uint64_t, const Member*>> scored;
  scored.reserve(members.size());
  for (const Member& m : members) {
    bool dup = false;
    for (auto& [w, other] : scored) dup |= other->id == m.id;
    if (!dup) scored.push_back({RendezvousWeight(key, m.id), &m});
  }
  std::sort(scored.begin(), scored.end(), [](const auto& a, const auto& b) {
    return a.first != b.first ? a.first > b.first : a.second->id < b.second->id;
  });
  std::vector<Member> out;
  for (size_t i = 0; i < scored.size() && i < r; ++i) out.push_back(*scored[i].second);
  return out;
}

std::vector<Member> StaticMemberView::LiveMembers() const {
  absl::MutexLock lock(&mu_);
  return members_;
}

void StaticMemberView::Set(std::vector<Member> members) {
  absl::MutexLock lock(&mu_);
  members_ = std::move(members);
}

}  // namespace kvtier::cluster
