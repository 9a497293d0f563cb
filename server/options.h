// kvtierd's per-daemon options: defaults, the TOML config file (toml++) and
// the command-line flags (CLI11). Flags override the file, the file overrides
// the defaults. `kvtierd --help` lists every option with its default.
#ifndef KVTIER_SERVER_OPTIONS_H_
#define KVTIER_SERVER_OPTIONS_H_

#include <cstdint>
#include <string>

#include "CLI/CLI.hpp"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/file.h"
#include "tiering/placement_engine.h"

namespace kvtier::server {

// Largest NVMe read probe (DaemonOptions::nvme_read_probe_mib).
inline constexpr uint32_t kMaxNvmeReadProbeMib = 1024;

struct DaemonOptions {
  // TOML file read before the flags are applied (keys: the option names with
  // '_' for '-'). Default: "" (none)
  std::string config;
  // Directory of the NVMe tier and of the sockets; created (mode 0700) and
  // locked (<data-dir>/kvtierd.lock) for the daemon's life, so one daemon
  // uses it at a time. Default: "./kvtier-data"
  std::string data_dir = "./kvtier-data";
  // Unix socket of the gRPC service (mode 0600). The shared-memory side
  // channel listens at "<socket>.shm". Locked (<socket>.lock) for the
  // daemon's life, so two daemons never share it. Default: ""
  // (<data-dir>/kvtierd.sock)
  std::string socket;
  // DRAM tier (shared-memory pool) size in GiB, capped at half of the
  // available memory; 0 disables the tier. Default: 4
  double dram_gib = 4;
  // NVMe tier size in GiB (a preallocated file in <data-dir>/nvme), capped
  // at half of the free space of the data dir's file system; 0 disables it.
  // Default: 8
  double nvme_gib = 8;
  // HBM tier size in GiB, used only when a CUDA device is present; 0
  // disables it. Default: 2
  double hbm_gib = 2;
  // Touch every DRAM pool page at startup (no page faults on first puts).
  // Default: true
  bool dram_populate = true;
  // Back the DRAM pool with the kernel's huge pages (2 MiB on x86-64) from
  // the hugetlb pool the administrator reserved (vm.nr_hugepages); the pool
  // is rounded down to whole huge pages, and startup fails, saying how many
  // pages it needs and how many are free, when there are too few.
  // Default: false
  bool dram_huge_pages = false;
  // MiB the NVMe tier writes and reads back with O_DIRECT once it is open,
  // behind readiness, to learn the disk's read rate before it reads a chunk
  // of its own (the load-or-recompute plan prices NVMe hits at it); the
  // probe's file is removed after. 0: none (the plan assumes 7 GB/s until
  // the first read). Default: 64
  uint32_t nvme_read_probe_mib = 64;  // at most kMaxNvmeReadProbeMib
  // Optional TCP listener "HOST:PORT" (port 0 picks one); requires
  // token_file or tenants (whose tokens it accepts). Default: "" (none)
  std::string listen_tcp;
  // File holding the bearer token TCP clients must send; surrounding
  // whitespace is ignored. It must be mode 0600 or stricter and the token at
  // least kMinTokenBytes long (ReadTokenFile). Default: ""
  std::string token_file;
  // Tenants file (TOML, server/tenants.h and docs/tenancy.md): each
  // client is a tenant, with its own key namespace, quotas and metrics.
  // Default: "" (one tenant; keys stored as sent)
  std::string tenants;
  // PEM certificate chain and private key of the TCP listener: with both,
  // it speaks TLS (gRPC's SSL credentials) and the bearer token is still
  // required. Default: "" (plaintext)
  std::string tls_cert;
  std::string tls_key;
  // PEM CA bundle that TCP clients' certificates must chain to: with it, a
  // client must present a certificate the CA signed (mutual TLS). Needs
  // tls_cert. Default: "" (no client certificate asked for)
  std::string tls_client_ca;
  // Allow a plaintext TCP listener on an address other than loopback (the
  // token then crosses the network in clear text; logged as an error at
  // startup). Without it such a listener is refused. Default: false
  bool insecure_tcp = false;
  // Most connections the TCP listener serves at once; a connection beyond
  // them is closed as soon as it is accepted. The daemon lowers it (and logs
  // so) to what RLIMIT_NOFILE leaves after the descriptors open at startup
  // and fd_reserve. Default: 4096
  uint32_t max_tcp_connections = 4096;
  // Most TCP connections served at once from one peer IP address (at most
  // max_tcp_connections); beyond them a peer's new connection is closed as
  // soon as it is accepted. Default: 256
  uint32_t max_tcp_connections_per_peer = 256;
  // File descriptors the TCP listener's connections may never take: they
  // stay free for the Unix socket's clients, the shared-memory data plane,
  // metrics scrapes and the files the daemon opens. 0 picks a quarter of
  // RLIMIT_NOFILE, at least 128. Default: 0 (auto)
  uint32_t fd_reserve = 0;
  // Prometheus metrics over HTTP at "HOST:PORT/metrics". Default: "" (off)
  std::string metrics_addr;
  // Largest gRPC message in MiB, each way (an inline chunk must fit).
  // Default: 64
  uint32_t max_message_mib = 64;
  // Most keys in one Lookup, Pin or Prefetch. Default: 4096
  uint32_t max_keys_per_request = 4096;
  // Most concurrent streams (calls) per gRPC connection. Default: 64
  uint32_t max_concurrent_streams = 64;
  // Threads that run the requests of each gRPC listener (the Unix socket and
  // the TCP listener each have their own); 0 picks max(8, 2 x hardware
  // threads). Default: 0
  uint32_t request_threads = 0;
  // Requests of one listener that may wait for a thread; beyond them a call
  // gets RESOURCE_EXHAUSTED at once. Default: 1024
  uint32_t max_queued_requests = 1024;
  // MiB of chunk data that the gRPC calls of one listener may hold at once
  // (inline put bodies; inline get answers count twice, the message and its
  // encoding); a call beyond it gets RESOURCE_EXHAUSTED. Default: 1024
  uint32_t max_inflight_mib = 1024;
  // The same for the calls of one connection (every Unix-socket client
  // shares one budget). Default: 256
  uint32_t max_inflight_mib_per_connection = 256;
  // Milliseconds a gRPC answer may wait for its reader before the call is
  // cancelled and what it holds is freed. Default: 20000
  uint32_t write_timeout_ms = 20000;
  // Milliseconds a PutStream may wait for its next message before it is
  // cancelled and its slot freed. Default: 10000
  uint32_t stream_idle_timeout_ms = 10000;
  // Seconds between HTTP/2 keepalive pings on an idle gRPC connection; a
  // peer that does not answer one within 10 s is disconnected. Default: 30
  uint32_t keepalive_s = 30;
  // Lease of a Pin, a slot or a shared-memory get that asks for 0 ms.
  // Default: 30000
  uint32_t default_lease_ms = 30000;
  // Share of the DRAM tier that clients' holds may keep in place at once
  // (lookup-and-hold leases, shared-memory gets, scratch copies); a hold
  // beyond it gets RESOURCE_EXHAUSTED. 0 < share <= 1. Default: 0.5
  double max_held_share = 0.5;
  // Share of the DRAM tier that one holder (a data-plane connection, or the
  // gRPC calls of one credential) may hold, so that no one holder takes the
  // whole of max_held_share. 0 < share <= 1. Default: 0.25
  double max_holder_share = 0.25;
  // Most leases and slots one holder may have open at once; beyond it a
  // pin, hold, get or slot gets RESOURCE_EXHAUSTED. Default: 16384
  uint32_t max_holds_per_holder = 16384;
  // Most keys the leases of one holder may pin at once. Default: 262144
  uint32_t max_held_keys_per_holder = 262144;
  // A chunk evicted from DRAM goes to NVMe only after this many uses.
  // Default: 1 (the engine's, PlacementEngineOptions::nvme_admit_after_uses)
  uint32_t nvme_admit_after_uses = tiering::PlacementEngineOptions{}.nvme_admit_after_uses;
  // Eviction policy of every tier: lru, s3fifo, arc or flru, or one per
  // tier (tiering/eviction.h). Default: "flru,nvme=lru" (the engine's,
  // PlacementEngineOptions::eviction)
  std::string eviction = tiering::EvictionPolicySpecName(tiering::PlacementEngineOptions{}.eviction);
  // Seconds SIGTERM waits for in-flight requests before cancelling them.
  // Default: 10
  uint32_t shutdown_grace_s = 10;
  // Threads that check one shared-memory put (ShmChannelOptions): 0 picks 2
  // on hosts with at least 4 hardware threads, else 1. Default: 0 (auto)
  uint32_t put_check_threads = 0;
  // spdlog level: trace, debug, info, warn, error, off. Default: "info"
  std::string log_level = "info";
  // File the daemon writes (atomically: a temp file renamed into place) once
  // every listener is serving, and removes when it starts shutting down, so
  // that scripts and tests wait for it instead of polling the socket. It
  // holds the daemon's pid on the first line and what it serves (the
  // startup log line) on the second. Default: "" (none)
  std::string ready_file;

  // --- Cluster (docs/cluster.md). Without `cluster` the node runs alone.
  // Cluster to join: nodes of one cluster find each other in etcd and share
  // chunks through the remote tier. Default: "" (standalone)
  std::string cluster;
  // etcd endpoints, "http://HOST:PORT[,...]" or "https://HOST:PORT[,...]"
  // (TLS; needs etcd_ca). Required with `cluster`. Default: ""
  std::string etcd;
  // PEM CA bundle that etcd's server certificate must chain to; with it
  // the etcd connection uses TLS. Default: "" (plaintext)
  std::string etcd_ca;
  // PEM client certificate and key presented to etcd (its
  // --client-cert-auth). Need etcd_ca. Default: "" (none)
  std::string etcd_cert;
  std::string etcd_key;
  // etcd user (etcd's auth); its password is read from etcd_password_file
  // (owner-only, like token_file). Default: "" (no etcd auth)
  std::string etcd_user;
  std::string etcd_password_file;
  // File holding the cluster secret (owner-only, at least
  // kMinClusterSecretBytes after trimming): peers prove they hold it before
  // any chunk moves, and member records in etcd are signed with a key
  // derived from it (docs/security.md). Never sent, logged or stored in
  // etcd. Default: "" (no authentication; logged as a warning)
  std::string cluster_secret_file;
  // Address peers reach this node's data path (UCX) on, "HOST:PORT"; the
  // node listens there. Required with `cluster`. Default: ""
  std::string advertise;
  // Copies of each chunk in the cluster (rendezvous-hash owners). Default: 2
  uint32_t replicas = 2;
  // This node's id in the cluster, unique and stable across restarts.
  // Default: "" (the advertise address)
  std::string node_id;
  // Seconds the etcd lease lives without keep-alives: how long a dead node
  // stays listed. Default: 5
  uint32_t cluster_lease_s = 5;

  // Derived paths.
  std::string SocketPath() const;
  std::string ShmSocketPath() const { return SocketPath() + ".shm"; }
};

// Registers every option as a flag bound to `opts` (help text with the
// default). `--config` is read by ParseDaemonOptions before the rest.
void RegisterDaemonFlags(CLI::App& app, DaemonOptions* opts);

// Applies the TOML file at `path` to `opts`. InvalidArgument for a syntax
// error, an unknown key or a value of the wrong type.
absl::Status LoadConfigFile(const std::string& path, DaemonOptions* opts);

// Sanity checks (sizes >= 0, TCP needs a token file, ...).
absl::Status ValidateDaemonOptions(const DaemonOptions& opts);

// The smallest fd_reserve other than 0 (auto): room for the data plane's
// connections (ShmChannelOptions::max_connections) and a few more.
inline constexpr uint32_t kMinFdReserve = 96;
// fd_reserve as the daemon applies it under a soft RLIMIT_NOFILE of
// `fd_limit`: 0 is a quarter of the limit, at least 128.
uint64_t ResolveFdReserve(uint32_t option, uint64_t fd_limit);

// The shortest bearer token ReadTokenFile accepts, in bytes after trimming.
// A random one: `openssl rand -hex 32` writes 64 characters.
inline constexpr size_t kMinTokenBytes = 32;
// The largest token file ReadTokenFile reads.
inline constexpr uint64_t kMaxTokenFileBytes = kMaxSecretFileBytes;


// ReadSecretFile for the bearer token (at least kMinTokenBytes).
absl::StatusOr<std::string> ReadTokenFile(const std::string& path);

// True if `host_port`'s host is a loopback address (127.0.0.0/8, ::1 or
// "localhost"): a listener there is reachable from this host only.
bool IsLoopbackListen(const std::string& host_port);

}  // namespace kvtier::server

#endif  // KVTIER_SERVER_OPTIONS_H_
