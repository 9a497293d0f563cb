// Daemon: everything kvtierd runs, assembled from DaemonOptions: the tiers
// and the placement engine, KvService, the gRPC server (Unix socket, optional
// TCP), the shared-memory side channel and the metrics endpoint. main.cc
// wraps it with signal handling; tests run it in-process.
#ifndef KVTIER_SERVER_DAEMON_H_
#define KVTIER_SERVER_DAEMON_H_

#include <memory>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "common/file.h"
#include "server/options.h"
#include "server/tenants.h"
#include "tiering/placement_engine.h"

namespace grpc {
class Server;
namespace experimental {
class ExternalConnectionAcceptor;
}
}

namespace kvtier::tiering {
class PlacementEngine;
}

namespace kvtier::cluster {
class Membership;
class UcxTransport;
}

namespace kvtier::server {

struct AdapterOptions;
class EnginePeerService;
class GrpcAdapter;
class KvService;
class MetricsHttpServer;
class ServerMetrics;
class ShmChannel;
class TcpAcceptor;

class Daemon {
 public:
  // Opens the tiers and starts serving. First, before anything in the data
  // dir or at the socket path is opened, replaced or removed, it locks
  // `<data-dir>/kvtierd.lock` and `<socket>.lock` (flock, each holding the
  // daemon's pid) for the daemon's life. FailedPrecondition if the data dir
  // or the socket path is in use by another daemon (the message names it
  // and the holder's pid), a lock file cannot be created or a listener
  // cannot be bound; InvalidArgument for bad options.
  static absl::StatusOr<std::unique_ptr<Daemon>> Start(const DaemonOptions& options);
  // Shuts down if Shutdown was not called.
  ~Daemon();

  // Stops accepting, lets in-flight requests finish (up to the grace
  // period), writes DRAM-resident chunks to NVMe (within its capacity),
  // closes the tiers (flushing the NVMe index), removes the sockets it bound
  // and releases the data dir and socket locks. Idempotent.
  absl::Status Shutdown();

  const std::string& socket_path() const { return socket_path_; }
  const std::string& shm_socket_path() const { return shm_socket_path_; }
  int tcp_port() const { return tcp_port_; }
  int metrics_port() const;
  // The cluster's security counters in the Prometheus text format (peer
  // handshakes failed and completed, member records rejected); "" when the
  // node is not in a cluster. The metrics endpoint appends it.
  std::string ClusterMetricsText() const;
  uint64_t flushed_chunks() const { return flushed_chunks_; }
  // Shared-memory data-plane connections being served now (each has a
  // thread); 0 without a DRAM pool or after Shutdown.
  int data_plane_connections() const;
  KvService* service() const { return service_.get(); }
  // Chunk bytes held by the gRPC calls of both listeners now, and the calls
  // cancelled at a deadline so far (grpc_calls.h).
  uint64_t grpc_inflight_bytes() const;
  uint64_t grpc_cancelled_calls() const;
  ServerMetrics* metrics() const { return metrics_.get(); }
  tiering::PlacementEngine* engine() const { return engine_.get(); }
  // Cluster parts; null for a standalone node.
  cluster::Membership* membership() const { return membership_.get(); }
  cluster::UcxTransport* transport() const { return transport_.get(); }
  // The daemon as a one-line description of its listeners and tiers.
  std::string Describe() const;

 private:
  Daemon();
  // The steps of Start, in order. Each returns the first error; whatever a
  // step started is stopped by Shutdown (the destructor) when a later step
  // fails.

  // Creates the data dir and takes the data-dir and socket locks (see Start).
  absl::Status LockPaths();
  // Opens the DRAM, NVMe and (with a device) HBM tiers, each capped by what
  // the machine has free.
  absl::Status OpenTiers(tiering::EngineTiers& tiers);
  // Builds the cluster parts and the remote tier; called before the engine.
  absl::Status JoinCluster(tiering::EngineTiers& tiers);
  // Loads the tenants and creates the placement engine over `tiers`.
  absl::Status OpenEngine(tiering::EngineTiers tiers);
  // Creates the service, then serves it: the shared-memory data plane (with
  // a DRAM tier), the gRPC Unix socket, the TCP listener and the metrics
  // endpoint (when configured).
  absl::Status StartListeners();
  // REQUIRES: service_ and metrics_ exist (StartListeners).
  absl::Status StartUnixListener(AdapterOptions ao);
  absl::Status StartTcpListener(AdapterOptions ao);
  // Writes options_.ready_file, when set, once every listener serves.
  absl::Status SignalReady();

  DaemonOptions options_;
  std::string socket_path_;
  std::string shm_socket_path_;
  int tcp_port_ = 0;
  uint64_t flushed_chunks_ = 0;
  bool shut_down_ = false;
  bool ready_file_written_ = false;  // options_.ready_file is this daemon's to remove
  // Held from the start of Start to the end of Shutdown.
  bool socket_bound_ = false;  // the gRPC Unix socket is this daemon's to remove
  std::optional<ExclusiveFileLock> data_dir_lock_;
  std::optional<ExclusiveFileLock> socket_lock_;
  std::optional<ExclusiveFileLock> shm_socket_lock_;  // every path it binds is locked
  // Cluster parts outlive the engine, whose remote tier uses them.
  std::unique_ptr<EnginePeerService> peer_service_;
  std::unique_ptr<cluster::UcxTransport> transport_;
  std::unique_ptr<cluster::Membership> membership_;
  std::unique_ptr<TenantRegistry> tenants_;  // before the engine and the listeners
  std::unique_ptr<tiering::PlacementEngine> engine_;
  std::unique_ptr<ServerMetrics> metrics_;
  std::unique_ptr<KvService> service_;
  // One server per listener, each with its own adapter (threads, limits).
  std::unique_ptr<GrpcAdapter> unix_adapter_;
  std::unique_ptr<GrpcAdapter> tcp_adapter_;
  std::unique_ptr<grpc::Server> unix_server_;
  std::unique_ptr<grpc::Server> tcp_server_;
  // The TCP listener's accept loop, and where it hands each connection to
  // tcp_server_.
  std::unique_ptr<grpc::experimental::ExternalConnectionAcceptor> tcp_handoff_;
  std::unique_ptr<TcpAcceptor> tcp_acceptor_;
  std::unique_ptr<ShmChannel> shm_;
  std::unique_ptr<MetricsHttpServer> http_;
};

}  // namespace kvtier::server

#endif  // KVTIER_SERVER_DAEMON_H_
