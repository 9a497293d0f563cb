// Key ownership in a cluster: rendezvous (highest-random-weight) hashing over
// the live members, so every node computes the same owners from the same
// member list, and a member joining or leaving moves only the keys it owns.
#ifndef KVTIER_CLUSTER_RENDEZVOUS_H_
#define KVTIER_CLUSTER_RENDEZVOUS_H_

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "common/hash.h"

namespace kvtier::cluster {

// A cluster member as the remote tier sees it.
struct Member {
  std::string id;        // stable node id (unique in the cluster)
  std::string address;   // "host:port" of its data path (UcxTransport listener)
  std::string worker;    // "ucx:<hex>" UCX worker address; "" if not published
  uint64_t capacity_bytes = 0;
  uint64_t used_bytes = 0;
  friend bool operator==(const Member&, const Member&) = default;
};

// What the transport connects to: the worker address when published (all
// transports the hosts share), else the socket address.
inline const std::string& DataPath(const Member& m) { return m.worker.empty() ? m.address : m.worker; }

// Seed of the weight hash; part of the cluster protocol, never change it.
inline constexpr uint64_t kRendezvousSeed = 0x6b76746965725257ull;  // "kvtierRW"

// weight(member, key) = XXH3-64(seed, key bytes || member id).
uint64_t RendezvousWeight(const Hash128& key, const std::string& member_id);

// The min(r, members) members with the highest weights for `key`, highest
// first (ties broken by id). Members with equal ids count once.
std::vector<Member> RendezvousOwners(const Hash128& key, std::span<const Member> members, size_t r);

// Who is in the cluster right now. Thread-safe.
class MemberView {
 public:
  virtual ~MemberView() = default;
  // This node's id.
  virtual std::string self_id() const = 0;
  // Live members, this node included once it has registered.
  virtual std::vector<Member> LiveMembers() const = 0;
};

// A member list set by its owner: etcd membership (server/cluster) updates
// it from its watch; tests set it directly.
class StaticMemberView : public MemberView {
 public:
  explicit StaticMemberView(std::string self_id) : self_id_(std::move(self_id)) {}
  std::string self_id() const override { return self_id_; }
  std::vector<Member> LiveMembers() const override;
  void Set(std::vector<Member> members);

 private:
  const std::string self_id_;
  mutable absl::Mutex mu_;
  std::vector<Member> members_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvtier::cluster

#endif  // KVTIER_CLUSTER_RENDEZVOUS_H_
