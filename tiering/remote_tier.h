// Remote tier: the interface only. ClusterTier (cluster/cluster_tier.h)
// implements it over a transport (UCX); the placement engine treats it as the
// tier below NVMe.
#ifndef KVTIER_TIERING_REMOTE_TIER_H_
#define KVTIER_TIERING_REMOTE_TIER_H_

#include <string>
#include <vector>

#include "tiering/tier.h"

namespace kvtier::tiering {

// A Tier whose objects live on peer hosts. kind() is TierKind::kRemote.
// Put/Read/Erase map to transport operations; Unavailable means the peer is
// unreachable or busy and the call may be retried. Thread-safe.
class RemoteTier : public Tier {
 public:
  TierKind kind() const override { return TierKind::kRemote; }
  // Peers currently serving this tier (host:port), for stats and routing.
  virtual std::vector<std::string> Peers() const = 0;
  // Requests to peers that failed (unreachable, timed out, refused, or a
  // copy that failed verification), whether or not the operation as a whole
  // failed: a read that another replica served, or that ended as a miss,
  // counts its failed requests here. The placement engine reports it as
  // `remote_errors`.
  virtual uint64_t errors() const = 0;
};

}  // namespace kvtier::tiering

#endif  // KVTIER_TIERING_REMOTE_TIER_H_
