// UcxTransport: the remote tier's transport over UCX (ucp active messages).
//
// One object is both a client (requests to peers "host:port", or "ucx:<hex>"
// worker addresses, see worker_address()) and, when given
// a PeerService and a listen address, a server. A single progress thread owns
// the UCX worker; callers hand it commands and wait on their request with a
// timeout. Large objects go by UCX's rendezvous protocol straight from the
// sender's buffer into the receiver's buffer (the PeerService's PutSink, the
// caller's Get buffer): no intermediate copy. Messages below UCX's eager
// threshold (small objects, errors) are copied once.
//
// A peer that dies, closes its connection or does not answer within the call's
// timeout gives Unavailable, and the endpoint is dropped so the next call
// reconnects. The first request on a new connection is preceded by a ping
// bounded by UcxTransportOptions::connect_timeout, so a peer that takes the
// connection but never answers costs that long, not the call's timeout.
// Thread-safe.
#ifndef KVTIER_CLUSTER_UCX_TRANSPORT_H_
#define KVTIER_CLUSTER_UCX_TRANSPORT_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "cluster/node_protocol.h"
#include "cluster/transport.h"

namespace kvtier::cluster {

struct UcxTransportOptions {
  // Address peers reach this node on, "host:port" (port 0 picks a free one;
  // listen_address() tells which). Empty: client only. Default: ""
  std::string listen;
  // Threads that run PeerService calls (which may block on NVMe reads).
  // Default: 2
  int service_threads = 2;
  // After the last event, the progress thread keeps polling UCX this long
  // before it sleeps on the worker's event fd: transfers in flight progress
  // without a wake-up per step, an idle node costs no CPU. Default: 200
  int64_t spin_us = 200;
  // Largest object a peer may put or a get may return, in bytes; bigger
  // requests are refused with InvalidArgument. Default: 1 GiB
  uint64_t max_object_bytes = uint64_t{1} << 30;
  // How long a peer with no open connection from this node gets to answer
  // a first probe (a ping, sent before the first request on a new
  // connection): a host that takes the TCP connection but whose kvtierd
  // never answers (stopped, hung, or not kvtierd at all) costs a call this
  // long, not the call's whole timeout. Calls that pass a shorter timeout
  // keep theirs; zero sends no probe. Default: 500 ms
  absl::Duration connect_timeout = absl::Milliseconds(500);
  // The cluster secret (docs/security.md). When set, every connection runs
  // the mutual challenge-response of peer_auth.h before its first chunk
  // operation, both ways: this node answers chunk requests only on
  // connections whose peer proved it holds the secret, and talks only to
  // peers that prove the same; a peer that fails is refused
  // (Unauthenticated), its connection closed and the failure counted
  // (auth_failures()). At least kMinClusterSecretBytes. Empty: no
  // authentication (a node without a secret cannot talk to one that has
  // one). Default: ""
  std::string cluster_secret{};
  // This node's id in handshakes (bound into the MACs and named in errors).
  // Default: "" (listen, or "client" for a client-only transport)
  std::string node_id{};
};

class UcxTransport : public Transport {
 public:
  // Starts UCX, the progress thread and (with a listen address and a
  // service) the listener. Unavailable if UCX cannot start or the address
  // cannot be bound; InvalidArgument for a malformed address.
  static absl::StatusOr<std::unique_ptr<UcxTransport>> Create(const UcxTransportOptions& options,
                                                              PeerService* service);
  // Stops serving, fails calls in flight with Unavailable, closes every
  // connection and releases UCX.
  ~UcxTransport() override;

  // The bound "host:port" ("" for a client-only transport).
  std::string listen_address() const;
  // This node's UCX worker address as "ucx:<hex>". A peer named this way is
  // reached through the worker address rather than a socket connection, which
  // lets UCX pick every transport the two hosts share (shared memory and CMA
  // on one host, RDMA between hosts) instead of the socket's TCP path. Cluster
  // members publish it in etcd.
  std::string worker_address() const;

  // Registers [data, data + bytes) with UCX once, so transfers from or into
  // it skip per-transfer registration (the daemon registers its DRAM pool).
  absl::Status RegisterMemory(void* data, size_t bytes);

  absl::Status Put(const std::string& peer, const tiering::ObjectKey& id, std::span<const uint8_t> bytes,
                   absl::Duration timeout) override;
  absl::StatusOr<uint64_t> Size(const std::string& peer, const tiering::ObjectKey& id,
                                absl::Duration timeout) override;
  absl::Status Get(const std::string& peer, const tiering::ObjectKey& id, std::span<uint8_t> out,
                   absl::Duration timeout) override;
  absl::Status Erase(const std::string& peer, const tiering::ObjectKey& id,
                     absl::Duration timeout) override;
  absl::Status Ping(const std::string& peer, absl::Duration timeout) override;

  // Handshakes (client or server side) that failed: a wrong MAC, a replayed
  // or malformed message, or a chunk request on a connection that has not
  // authenticated. Each closed the connection.
  uint64_t auth_failures() const;
  // Handshakes this node completed as a client or a server.
  uint64_t auth_successes() const;

  // Sends a raw handshake message of `op` (kHello or kProof) with `payload`
  // and returns the reply's payload (tests of hostile handshakes).
  absl::StatusOr<std::vector<uint8_t>> SendAuthMessage(const std::string& peer, Op op,
                                                       std::span<const uint8_t> payload,
                                                       absl::Duration timeout);

  // Sends a request with an arbitrary wire version (tests of version refusal).
  absl::Status PingWithVersion(const std::string& peer, uint16_t version, absl::Duration timeout);

  // Closes the listener and every connection at once, as a node that dies
  // does: nothing in flight is sent on or answered, and peers' calls to this
  // node fail with Unavailable. Service calls still running finish; their
  // replies go nowhere. The node can no longer be reached; it still works as
  // a client. For tests of a peer that dies mid-transfer: the destructor lets
  // running service calls finish and send their replies before it closes
  // anything, so it cannot cut a transfer that a service call holds.
  void DropAllConnections();

  struct Impl;

 private:
  explicit UcxTransport(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvtier::cluster

#endif  // KVTIER_CLUSTER_UCX_TRANSPORT_H_
