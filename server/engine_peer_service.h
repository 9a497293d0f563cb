// EnginePeerService: what a kvtierd node serves to its cluster peers, over
// its own placement engine. Incoming replicas are received by UCX straight
// into a DRAM-pool slot (no copy) and committed to the engine, durably when
// the node has an NVMe tier, so a node that restarts still serves them. Gets
// are reads of the engine like a local client's (uses of the chunk, counted
// in gets and hits): a chunk whole in DRAM is sent from its pinned extent
// without a copy, any other is first copied into a scratch slot of the pool
// (into a heap buffer on a node without a DRAM tier).
// Only this node's tiers are consulted: a peer's request never travels on to
// a third node. Thread-safe.
#ifndef KVTIER_SERVER_ENGINE_PEER_SERVICE_H_
#define KVTIER_SERVER_ENGINE_PEER_SERVICE_H_

#include <atomic>

#include "cluster/transport.h"
#include "tiering/placement_engine.h"

namespace kvtier::server {

class EnginePeerService : public cluster::PeerService {
 public:
  // The engine is set after construction (the engine itself is built with
  // the remote tier that uses this service); until then requests get
  // Unavailable.
  EnginePeerService() = default;
  void set_engine(tiering::PlacementEngine* engine) { engine_.store(engine); }

  absl::StatusOr<std::unique_ptr<PutSink>> BeginPut(const tiering::ObjectKey& id,
                                                    uint64_t bytes) override;
  absl::StatusOr<std::unique_ptr<GetSource>> BeginGet(const tiering::ObjectKey& id) override;
  absl::StatusOr<uint64_t> Size(const tiering::ObjectKey& id) override;
  absl::Status Erase(const tiering::ObjectKey& id) override;

 private:
  absl::StatusOr<tiering::PlacementEngine*> Engine() const;
  std::atomic<tiering::PlacementEngine*> engine_{nullptr};
};

}  // namespace kvtier::server

#endif  // KVTIER_SERVER_ENGINE_PEER_SERVICE_H_
