// ClusterTier: the remote tier of the placement engine, over the other
// kvtier nodes of a cluster.
//
// Each object has R owners, chosen by rendezvous hashing over the live
// members (this node included). Put stores the object on every owner (this
// node's copy goes to its local PeerService, the others through the
// Transport) and succeeds when at least one copy is stored; Read tries the
// owners in order (this node's own replica through its local PeerService),
// then the other live members (a node that rejoined may still hold what it
// owned before), skipping copies that fail verification. Every object read
// is verified with the chunk format's checksums before it is returned, so a
// transfer cut off or corrupted on the way is DataLoss for that replica,
// never returned.
//
// A chunk no live member can serve is a miss: a member that cannot be
// reached, does not answer in time or answers with an error counts as not
// having it (NotFound), and the failed request is counted (errors()). A peer
// that could not be reached is skipped by every operation for
// `down_backoff`, so the misses that follow do not pay the probe again while
// membership still lists it. Thread-safe.
#ifndef KVTIER_CLUSTER_CLUSTER_TIER_H_
#define KVTIER_CLUSTER_CLUSTER_TIER_H_

#include <atomic>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "cluster/rendezvous.h"
#include "cluster/transport.h"
#include "tiering/io.h"
#include "tiering/remote_tier.h"

namespace kvtier::cluster {

struct ClusterTierOptions {
  // Copies of each object (owners). Default: 2
  uint32_t replicas = 2;
  // Bound on each transfer to a peer. Default: 5 s
  absl::Duration timeout = absl::Seconds(5);
  // Bound on a Size request to a peer (every lookup past the local tiers and
  // every local miss asks the candidates; no object bytes move), so a peer
  // that stopped answering turns a miss into a short wait, not a timeout.
  // Default: 500 ms
  absl::Duration lookup_timeout = absl::Milliseconds(500);
  // How long a peer that could not be reached (Unavailable on every attempt
  // of a request) is skipped by every operation before it is asked again,
  // so misses do not pay the probe again while membership still lists it
  // (until its lease expires). Zero never skips. Default: 2 s
  absl::Duration down_backoff = absl::Seconds(2);
  // Time source of the back-off (not owned). Default: nullptr (SystemClock())
  tiering::Clock* clock = nullptr;
  // Tries per peer when it answers Unavailable. Default: 2
  uint32_t attempts_per_peer = 2;
  // Also look on live members that are not owners when no owner has the
  // object. Default: true
  bool search_non_owners = true;
};

enum class ClusterMetric : int {
  kPuts = 0,
  kPutReplicaFailures,
  kGets,
  kGetRetries,
  kCorruptReplicas,
  kMisses,
  kErrors,
  kPeersSkipped,
  kCount,
};
const char* ClusterMetricName(ClusterMetric m);

class ClusterTier : public tiering::RemoteTier {
 public:
  // `view`, `transport` and `local` (this node's own PeerService, used for
  // the replicas it owns; may be null) must outlive the tier.
  ClusterTier(const ClusterTierOptions& options, MemberView* view, Transport* transport,
              PeerService* local);

  tiering::TierCapabilities capabilities() const override;
  // Sum over the other live members of what they advertise.
  uint64_t capacity_bytes() const override;
  uint64_t used_bytes() const override;
  tiering::Bandwidth bandwidth() const override { return meter_.Get(); }

  // OK when at least one owner stored it; otherwise the last error
  // (Unavailable when no owner could be reached or every owner is skipped).
  // Each replica not stored is counted (kPutReplicaFailures).
  using tiering::Tier::Put;
  absl::Status Put(const tiering::ObjectKey& id, std::span<const uint8_t> bytes,
                   const tiering::TierPutOptions& options) override;
  // The size of the first copy found, asking each peer for at most
  // `lookup_timeout`. NotFound when no member that answered has it
  // (unreachable and failing members included).
  absl::StatusOr<uint64_t> Size(const tiering::ObjectKey& id) override;
  // OK with a verified copy in `out`. NotFound when no member that answered
  // has one (unreachable and failing members included); DataLoss when every
  // copy found failed verification.
  absl::Status Read(const tiering::ObjectKey& id, std::span<uint8_t> out) override;
  // Erases every reachable member's copy. OK if any was erased, else NotFound.
  absl::Status Erase(const tiering::ObjectKey& id) override;
  // Remote objects are not enumerated (the engine rebuilds its map from the
  // durable local tiers only): always empty.
  std::vector<std::pair<tiering::ObjectKey, uint64_t>> List() override { return {}; }
  std::vector<std::string> Peers() const override;
  uint64_t errors() const override { return metric(ClusterMetric::kErrors); }

  // The owners of a key among the live members, highest weight first.
  std::vector<Member> Owners(const Hash128& key) const;
  uint64_t metric(ClusterMetric m) const { return metrics_[static_cast<int>(m)].load(); }

 private:
  // Candidates for a read: owners first, then (optionally) the rest.
  std::vector<Member> ReadOrder(const Hash128& key) const;
  // True (and counted, kPeersSkipped) while `m` is within its back-off.
  bool SkipIfDown(const Member& m);
  // Counts one failed request to a peer (kErrors); NotFound is an answer.
  void CountIfFailed(const absl::Status& s);
  // After the last attempt of a request to `m`: Unavailable starts its
  // back-off, any other outcome (it answered) ends it.
  void Settle(const Member& m, const absl::Status& s);
  // The NotFound of a read or size no member answered with a copy.
  static absl::Status MissError(int unanswered);
  absl::Status ReadFrom(const Member& m, const tiering::ObjectKey& id, std::span<uint8_t> out);
  // This node's own replica, through its PeerService (the engine may have
  // evicted its cached copy while the replica stays).
  absl::Status ReadLocal(const tiering::ObjectKey& id, std::span<uint8_t> out);
  void Count(ClusterMetric m) { metrics_[static_cast<int>(m)].fetch_add(1); }

  const ClusterTierOptions options_;
  tiering::Clock* const clock_;
  MemberView* view_;
  Transport* transport_;
  PeerService* local_;
  tiering::BandwidthMeter meter_;
  std::atomic<uint64_t> metrics_[static_cast<int>(ClusterMetric::kCount)] = {};
  absl::Mutex down_mu_;
  // Peers in their back-off, by data path (a restarted node publishes a new
  // worker address), with the clock time it ends at.
  absl::flat_hash_map<std::string, int64_t> down_until_ ABSL_GUARDED_BY(down_mu_);
};

// Checks an object read from anywhere against the chunk format; shared
// with the NVMe tier (tiering/tier.h).
using ::kvtier::tiering::VerifyObject;

}  // namespace kvtier::cluster

#endif  // KVTIER_CLUSTER_CLUSTER_TIER_H_
