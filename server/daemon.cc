#include "server/daemon.h"

#include <sys/stat.h>
#include <sys/socket.h>
#include <sys/statvfs.h>
#include <sys/un.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/file.h"
#include "common/hash.h"
#include "common/status.h"
#include "grpcpp/grpcpp.h"
#include "server/grpc_auth.h"
#include "server/grpc_service.h"
#include "server/http_metrics.h"
#include "server/metrics.h"
#include "server/service.h"
#include "server/shm_channel.h"
#include "server/tcp_acceptor.h"
#include "spdlog/spdlog.h"
#include "server/engine_peer_service.h"
#include "cluster/membership.h"
#include "tiering/placement_engine.h"
#include "cluster/cluster_tier.h"
#include "cluster/peer_auth.h"
#include "cluster/ucx_transport.h"

namespace kvtier::server {

namespace {

// Whether users other than the owner may create files in `dir` (a shared
// directory such as /tmp).
bool OthersMayWrite(const std::string& dir) {
  struct stat st {};
  return ::stat(dir.c_str(), &st) == 0 && (st.st_mode & (S_IWGRP | S_IWOTH)) != 0;
}

// Whether a process accepts connections on the Unix socket `path`.
bool AcceptsConnections(const std::string& path) {
  auto addr = UnixSocketAddress(path);
  if (!addr.ok()) return false;
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  const bool live = ::connect(fd, reinterpret_cast<const sockaddr*>(&*addr), sizeof(*addr)) == 0;
  ::close(fd);
  return live;
}

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

uint64_t MemAvailableBytes() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  uint64_t kb = 0;
  std::string unit;
  while (in >> key >> kb >> unit) {
    if (key == "MemAvailable:") return kb * 1024;
  }
  return 0;
}

uint64_t FreeDiskBytes(const std::string& dir) {
  struct statvfs s;
  if (::statvfs(dir.c_str(), &s) != 0) return 0;
  return static_cast<uint64_t>(s.f_bavail) * s.f_frsize;
}

uint64_t RoundDown(uint64_t v, uint64_t unit) { return v / unit * unit; }

// The TCP listener's connection limits: the options', lowered so that its
// connections leave the descriptor reserve and those open now free under
// RLIMIT_NOFILE. FailedPrecondition if no room is left.
absl::StatusOr<TcpAcceptorOptions> TcpConnectionLimits(const DaemonOptions& o) {
  const uint64_t limit = FdLimit();
  const uint64_t reserve = ResolveFdReserve(o.fd_reserve, limit);
  const uint64_t used = static_cast<uint64_t>(std::max(0, OpenFdCount())) + 2;  // + the listener, its pipe
  if (limit <= used + reserve) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "RLIMIT_NOFILE %d leaves no descriptors for TCP connections: %d are open and --fd-reserve "
        "keeps %d; raise the limit (ulimit -n) or lower --fd-reserve",
        limit, used, reserve));
  }
  TcpAcceptorOptions t;
  t.max_connections = static_cast<int>(std::min<uint64_t>(o.max_tcp_connections, limit - used - reserve));
  t.max_connections_per_peer = std::min<int>(static_cast<int>(o.max_tcp_connections_per_peer), t.max_connections);
  if (t.max_connections < static_cast<int>(o.max_tcp_connections)) {
    spdlog::warn("TCP listener: at most {} connections (--max-tcp-connections {}), so that {} of the {} "
                 "descriptors (RLIMIT_NOFILE) stay free for the rest of the daemon",
                 t.max_connections, o.max_tcp_connections, reserve, limit);
  }
  spdlog::info("TCP listener: at most {} connections, {} per peer address; descriptor limit {}, {} reserved",
               t.max_connections, t.max_connections_per_peer, limit, reserve);
  return t;
}


// The request adapters' options (both listeners), the bearer token included.
absl::StatusOr<AdapterOptions> AdapterOptionsOf(const DaemonOptions& options,
                                                TenantRegistry* tenants) {
  AdapterOptions ao;
  ao.tenants = tenants;
  ao.max_message_bytes = uint64_t{options.max_message_mib} << 20;
  ao.threads = options.request_threads > 0
                   ? static_cast<int>(options.request_threads)
                   : std::max(8, 2 * static_cast<int>(std::thread::hardware_concurrency()));
  ao.max_queued = options.max_queued_requests;
  ao.limits.max_inflight_bytes = uint64_t{options.max_inflight_mib} << 20;
  ao.limits.max_inflight_bytes_per_connection = uint64_t{options.max_inflight_mib_per_connection} << 20;
  ao.limits.write_timeout_ms = static_cast<int>(options.write_timeout_ms);
  ao.limits.stream_idle_timeout_ms = static_cast<int>(options.stream_idle_timeout_ms);
  if (!options.token_file.empty()) {
    KVTIER_ASSIGN_OR_RETURN(ao.token, ReadTokenFile(options.token_file));
  }
  return ao;
}

// A gRPC server for `service` with the daemon's message, stream and
// keepalive settings. The Unix socket and the TCP listener are separate
// servers, each with its own threads and limits: nothing a TCP peer does can
// take what the local clients need. With `handoff`, the server gets its
// connections from the daemon's own accept loop (tcp_acceptor.h) instead of
// listening on `addr`. Null if it cannot be started.
std::unique_ptr<grpc::Server> BuildServer(
    const DaemonOptions& options, const std::string& addr,
    std::shared_ptr<grpc::ServerCredentials> creds, grpc::Service* service,
    std::unique_ptr<grpc::experimental::ExternalConnectionAcceptor>* handoff = nullptr) {
  const uint64_t max_msg = uint64_t{options.max_message_mib} << 20;
  grpc::ServerBuilder b;
  if (handoff != nullptr) {
    *handoff = b.experimental().AddExternalConnectionAcceptor(
        grpc::ServerBuilder::experimental_type::ExternalConnectionType::FROM_FD, std::move(creds));
  } else {
    b.AddListeningPort(addr, std::move(creds), nullptr);
  }
  b.SetMaxReceiveMessageSize(static_cast<int>(max_msg));
  b.SetMaxSendMessageSize(static_cast<int>(max_msg));
  b.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS, static_cast<int>(options.max_concurrent_streams));
  b.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, static_cast<int>(options.keepalive_s * 1000));
  b.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 10000);
  // Clients may ping as often as every 10 s without being disconnected.
  b.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 10000);
  b.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  b.RegisterService(service);
  return b.BuildAndStart();
}

// The TCP listener's TLS material (--tls-cert, --tls-key, --tls-client-ca),
// checked; unset for a plaintext listener, which is warned about.
absl::StatusOr<std::optional<ServerTls>> TcpTls(const DaemonOptions& options) {
  if (options.tls_cert.empty()) {
    if (IsLoopbackListen(options.listen_tcp)) {
      spdlog::warn("TCP listener {} is plaintext (loopback only); the bearer token travels unencrypted",
                   options.listen_tcp);
    } else {
      spdlog::error("INSECURE: TCP listener {} is plaintext on a network address (--insecure-tcp): the "
                    "bearer token and every chunk cross the network unencrypted; use --tls-cert/--tls-key",
                    options.listen_tcp);
    }
    return std::nullopt;
  }
  ServerTls tls;
  KVTIER_ASSIGN_OR_RETURN(tls.cert_chain, ReadPemFile(options.tls_cert, "--tls-cert"));
  KVTIER_ASSIGN_OR_RETURN(tls.private_key, ReadSecretFile(options.tls_key, "TLS key", 1));
  if (!options.tls_client_ca.empty()) {
    KVTIER_ASSIGN_OR_RETURN(tls.client_ca, ReadPemFile(options.tls_client_ca, "--tls-client-ca"));
  }
  KVTIER_RETURN_IF_ERROR(CheckServerTls(tls));
  return tls;
}

}  // namespace

Daemon::Daemon() = default;

absl::Status Daemon::JoinCluster(tiering::EngineTiers& tiers) {
  const DaemonOptions& o = options_;
  peer_service_ = std::make_unique<EnginePeerService>();
  std::string secret;
  if (!o.cluster_secret_file.empty()) {
    KVTIER_ASSIGN_OR_RETURN(secret, ReadSecretFile(o.cluster_secret_file, "cluster secret",
                                                   cluster::kMinClusterSecretBytes));
  } else {
    spdlog::warn("cluster '{}' without --cluster-secret-file: any host that reaches {} can read and "
                 "write this node's chunks, and any writer to etcd can add members",
                 o.cluster, o.advertise);
  }
  cluster::UcxTransportOptions to;
  to.listen = o.advertise;
  to.max_object_bytes = uint64_t{o.max_message_mib} << 20;
  to.cluster_secret = secret;
  to.node_id = o.node_id.empty() ? o.advertise : o.node_id;
  KVTIER_ASSIGN_OR_RETURN(transport_, cluster::UcxTransport::Create(to, peer_service_.get()));
  if (tiers.dram != nullptr) {
    // The whole pool at once, before the daemon is ready, not per piece
    // behind it as CUDA's registration is: the transport looks a transfer's
    // memory handle up in one region, and its UCX context is not shared
    // between threads, so the pool's populating threads may not call it.
    KVTIER_RETURN_IF_ERROR(transport_->RegisterMemory(tiers.dram->base(), tiers.dram->shm_size()));
  }
  KVTIER_ASSIGN_OR_RETURN(auto endpoints, cluster::ParseEtcdEndpoints(o.etcd));
  cluster::EtcdClientOptions eo;
  if (!o.etcd_ca.empty()) {
    KVTIER_ASSIGN_OR_RETURN(eo.ca, ReadPemFile(o.etcd_ca, "--etcd-ca"));
  }
  if (!o.etcd_cert.empty()) {
    KVTIER_ASSIGN_OR_RETURN(eo.cert, ReadPemFile(o.etcd_cert, "--etcd-cert"));
    KVTIER_ASSIGN_OR_RETURN(eo.key, ReadSecretFile(o.etcd_key, "etcd key", 1));
  }
  if (!o.etcd_user.empty()) {
    eo.user = o.etcd_user;
    KVTIER_ASSIGN_OR_RETURN(eo.password, ReadSecretFile(o.etcd_password_file, "etcd password", 1));
  }
  KVTIER_ASSIGN_OR_RETURN(auto etcd, cluster::EtcdClient::Connect(endpoints, eo));
  cluster::MembershipOptions mo;
  mo.cluster = o.cluster;
  mo.node_id = o.node_id;
  // With port 0 the bound port is only known now.
  mo.advertise = transport_->listen_address();
  mo.worker_address = transport_->worker_address();
  mo.lease_ttl_s = o.cluster_lease_s;
  mo.cluster_secret = secret;
  uint64_t capacity = 0;
  if (tiers.dram) capacity += tiers.dram->capacity_bytes();
  if (tiers.nvme) capacity += tiers.nvme->capacity_bytes();
  mo.capacity_bytes = capacity;
  Daemon* self = this;
  mo.used_bytes = [self]() -> uint64_t {
    tiering::PlacementEngine* e = self->engine_.get();
    if (e == nullptr) return 0;
    uint64_t used = 0;
    for (const auto& u : e->Usage()) {
      if (u.kind == tiering::TierKind::kDram || u.kind == tiering::TierKind::kNvme) used += u.used_bytes;
    }
    return used;
  };
  KVTIER_ASSIGN_OR_RETURN(membership_, cluster::Membership::Join(mo, std::move(etcd)));
  cluster::ClusterTierOptions co;
  co.replicas = o.replicas;
  tiers.remote = std::make_unique<cluster::ClusterTier>(co, membership_.get(), transport_.get(),
                                                                peer_service_.get());
  spdlog::info("joined cluster '{}' as {} (data path {}), {} member(s) live", o.cluster,
               membership_->self_id(), mo.advertise, membership_->LiveMembers().size());
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Daemon>> Daemon::Start(const DaemonOptions& options) {
  KVTIER_RETURN_IF_ERROR(ValidateDaemonOptions(options));
  std::unique_ptr<Daemon> d(new Daemon());
  d->options_ = options;
  KVTIER_RETURN_IF_ERROR(d->LockPaths());
  tiering::EngineTiers tiers;
  KVTIER_RETURN_IF_ERROR(d->OpenTiers(tiers));
  if (!options.cluster.empty()) KVTIER_RETURN_IF_ERROR(d->JoinCluster(tiers));
  KVTIER_RETURN_IF_ERROR(d->OpenEngine(std::move(tiers)));
  KVTIER_RETURN_IF_ERROR(d->StartListeners());
  KVTIER_RETURN_IF_ERROR(d->SignalReady());
  return d;
}

absl::Status Daemon::LockPaths() {
  const DaemonOptions& options = options_;
  std::error_code ec;
  std::filesystem::create_directories(options.data_dir, ec);
  if (ec) {
    return absl::FailedPreconditionError(absl::StrCat("cannot create data dir ", options.data_dir,
                                                      ": ", ec.message()));
  }
  // One daemon per data dir and per socket path, decided before anything in
  // either is opened, replaced or removed. Locking the socket's own lock
  // file as well covers a --socket outside the data dir and a --socket that
  // is another daemon's default one.
  auto lock = [](const std::string& what, const std::string& path,
                 std::optional<ExclusiveFileLock>* held) -> absl::Status {
    auto l = ExclusiveFileLock::Acquire(path);
    if (l.ok()) {
      held->emplace(std::move(*l));
      return absl::OkStatus();
    }
    if (absl::IsFailedPrecondition(l.status())) {
      return absl::FailedPreconditionError(
          absl::StrCat(what, " is in use by another kvtierd (", l.status().message(), ")"));
    }
    return absl::FailedPreconditionError(absl::StrCat("cannot lock ", what, ": ", l.status().message()));
  };
  KVTIER_RETURN_IF_ERROR(lock(absl::StrCat("data dir ", options.data_dir),
                              options.data_dir + "/kvtierd.lock", &data_dir_lock_));
  ::chmod(options.data_dir.c_str(), 0700);
  socket_path_ = std::filesystem::absolute(options.SocketPath()).string();
  shm_socket_path_ = socket_path_ + ".shm";
  // The lock files sit beside the sockets, unless other users may create
  // files there (/tmp): one of them could make and hold `<socket>.lock`
  // first. Then they go to the data dir (owner-only), named by the socket's
  // path, and a socket at the path that accepts connections is never
  // replaced.
  const std::string socket_dir = std::filesystem::path(socket_path_).parent_path().string();
  std::string lock_base = socket_path_;
  if (OthersMayWrite(socket_dir)) {
    lock_base = absl::StrCat(options.data_dir, "/socket-",
                             Hash128::Of(socket_path_, 0).ToHex().substr(0, 16));
    for (const std::string& path : {socket_path_, shm_socket_path_}) {
      if (AcceptsConnections(path)) {
        return absl::FailedPreconditionError(absl::StrCat(
            "socket ", path, " is in use: a process accepts connections on it"));
      }
    }
  }
  KVTIER_RETURN_IF_ERROR(lock(absl::StrCat("socket ", socket_path_), lock_base + ".lock",
                              &socket_lock_));
  // The data-plane socket too: a daemon whose --socket is another's
  // `<socket>.shm` must not replace (or, stopping, remove) that socket.
  return lock(absl::StrCat("data-plane socket ", shm_socket_path_), lock_base + ".shm.lock",
              &shm_socket_lock_);
}

absl::Status Daemon::OpenTiers(tiering::EngineTiers& tiers) {
  const DaemonOptions& options = options_;
  std::error_code ec;
  const uint64_t kUnit = 1 << 20;
  if (options.dram_gib > 0) {
    uint64_t want = static_cast<uint64_t>(options.dram_gib * kGiB);
    uint64_t cap = MemAvailableBytes() / 2;
    if (cap > 0 && want > cap) {
      spdlog::warn("DRAM tier: {:.2f} GiB asked, capped at {:.2f} GiB (half the available memory)",
                   want / kGiB, cap / kGiB);
      want = cap;
    }
    tiering::DramTierOptions o;
    o.capacity_bytes = std::max<uint64_t>(RoundDown(want, kUnit), kUnit);
    o.populate = options.dram_populate;
    o.huge_pages = options.dram_huge_pages;
    // Pieces of 1 GiB in pools of 16 GiB and more: fewer registrations.
    if (o.capacity_bytes >= (uint64_t{16} << 30)) o.populate_piece_bytes = uint64_t{1} << 30;
#ifdef KVTIER_HAVE_CUDA
    if (options.hbm_gib > 0 && tiering::NewCudaDeviceAllocator(0).ok()) {
      o.register_memory = tiering::CudaHostRegister;
    }
#endif
    // The daemon serves while the pool is populated (and registered) in
    // pieces behind it; the tier hands out only the pieces that are ready.
    o.on_populated = [](const tiering::DramPopulateReport& r) {
      if (r.status.ok()) {
        spdlog::info("DRAM pool populated: {:.2f} GiB in {:.2f} s", r.pool_bytes / kGiB, r.seconds);
      } else {
        spdlog::error("DRAM pool population stopped after {:.2f} s with {:.2f} of {:.2f} GiB usable: {}",
                      r.seconds, r.ready_bytes / kGiB, r.pool_bytes / kGiB, r.status.ToString());
      }
    };
    KVTIER_ASSIGN_OR_RETURN(tiers.dram, tiering::DramTier::Open(o));
    if (tiers.dram->ready_bytes() < tiers.dram->capacity_bytes()) {
      spdlog::info("DRAM pool: {:.2f} of {:.2f} GiB usable, the rest populated in the background",
                   tiers.dram->ready_bytes() / kGiB, tiers.dram->capacity_bytes() / kGiB);
    }
  }
  if (options.nvme_gib > 0) {
    std::string dir = options.data_dir + "/nvme";
    std::filesystem::create_directories(dir, ec);
    uint64_t want = static_cast<uint64_t>(options.nvme_gib * kGiB);
    // The data file already on disk counts as free: it is reused.
    uint64_t existing = std::filesystem::exists(dir + "/data.kvt")
                            ? std::filesystem::file_size(dir + "/data.kvt", ec)
                            : 0;
    uint64_t cap = FreeDiskBytes(options.data_dir) / 2 + existing;
    if (want > cap) {
      spdlog::warn("NVMe tier: {:.2f} GiB asked, capped at {:.2f} GiB (half the free disk)",
                   want / kGiB, cap / kGiB);
      want = cap;
    }
    tiering::NvmeTierOptions o;
    o.dir = dir;
    o.capacity_bytes = std::max<uint64_t>(RoundDown(want, kUnit), kUnit);
    o.read_probe_bytes = uint64_t{options.nvme_read_probe_mib} << 20;
    KVTIER_ASSIGN_OR_RETURN(tiers.nvme, tiering::NvmeTier::Open(o));
  }
#ifdef KVTIER_HAVE_CUDA
  if (options.hbm_gib > 0) {
    auto alloc = tiering::NewCudaDeviceAllocator(0);
    if (alloc.ok()) {
      tiering::HbmTierOptions o;
      o.capacity_bytes = RoundDown(static_cast<uint64_t>(options.hbm_gib * kGiB), kUnit);
      auto hbm = tiering::HbmTier::Open(o, std::move(*alloc));
      if (hbm.ok()) {
        tiers.hbm = std::move(*hbm);
      } else {
        spdlog::warn("HBM tier not opened: {}", std::string(hbm.status().message()));
      }
    }
  }
#endif
  return absl::OkStatus();
}

absl::Status Daemon::OpenEngine(tiering::EngineTiers tiers) {
  const DaemonOptions& options = options_;
  if (options.tenants.empty()) {
    tenants_ = std::make_unique<TenantRegistry>();
  } else {
    KVTIER_ASSIGN_OR_RETURN(std::vector<TenantSpec> specs, LoadTenantsFile(options.tenants));
    tenants_ = std::make_unique<TenantRegistry>(std::move(specs));
    spdlog::info("{} tenants from {}; keys are namespaced per tenant", tenants_->tenants().size(),
                 options.tenants);
  }
  tiering::PlacementEngineOptions eo;
  eo.tenant_quotas = tenants_->EngineQuotas();
  eo.default_lease_ms = options.default_lease_ms;
  eo.nvme_admit_after_uses = options.nvme_admit_after_uses;
  KVTIER_ASSIGN_OR_RETURN(eo.eviction, tiering::ParseEvictionPolicySpec(options.eviction));
  if (tiers.dram != nullptr) {
    eo.max_held_bytes = std::max<uint64_t>(
        1, static_cast<uint64_t>(options.max_held_share *
                                 static_cast<double>(tiers.dram->capacity_bytes())));
    eo.max_held_bytes_per_holder = std::max<uint64_t>(
        1, static_cast<uint64_t>(options.max_holder_share *
                                 static_cast<double>(tiers.dram->capacity_bytes())));
  }
  eo.max_holds_per_holder = options.max_holds_per_holder;
  eo.max_held_keys_per_holder = options.max_held_keys_per_holder;
  KVTIER_ASSIGN_OR_RETURN(engine_, tiering::PlacementEngine::Create(eo, std::move(tiers)));
  if (peer_service_) peer_service_->set_engine(engine_.get());
  return absl::OkStatus();
}

absl::Status Daemon::StartListeners() {
  metrics_ = std::make_unique<ServerMetrics>();
  ServiceLimits limits;
  limits.max_keys_per_request = options_.max_keys_per_request;
  service_ = std::make_unique<KvService>(engine_.get(), limits, tenants_.get());
  KVTIER_ASSIGN_OR_RETURN(AdapterOptions ao, AdapterOptionsOf(options_, tenants_.get()));
  if (engine_->dram() != nullptr) {
    ShmChannelOptions so;
    so.put_check_threads = static_cast<int>(options_.put_check_threads);
    so.tenants = tenants_.get();
    KVTIER_ASSIGN_OR_RETURN(shm_, ShmChannel::Start(shm_socket_path_, engine_->dram()->shm_fd(),
                                                    engine_->dram()->shm_size(), metrics_.get(),
                                                    service_.get(), so));
    ao.shm_socket = shm_socket_path_;
    ao.shm_pool_id = wire::shm::PoolIdOf(engine_->dram()->shm_fd());
  }
  KVTIER_RETURN_IF_ERROR(StartUnixListener(ao));
  if (!options_.listen_tcp.empty()) KVTIER_RETURN_IF_ERROR(StartTcpListener(ao));
  if (!options_.metrics_addr.empty()) {
    KVTIER_ASSIGN_OR_RETURN(http_, MetricsHttpServer::Start(options_.metrics_addr, [this] {
      return metrics_->RenderPrometheus(service_->Stats()) + ClusterMetricsText();
    }));
  }
  return absl::OkStatus();
}

absl::Status Daemon::StartUnixListener(AdapterOptions ao) {
  ao.thread_name = "kvtierd-unix";
  unix_adapter_ = std::make_unique<GrpcAdapter>(service_.get(), metrics_.get(), ao);
  ::unlink(socket_path_.c_str());
  mode_t old = ::umask(0077);  // the socket file is created owner-only
  unix_server_ = BuildServer(options_, "unix:" + socket_path_, grpc::InsecureServerCredentials(),
                             unix_adapter_.get());
  ::umask(old);
  if (unix_server_ == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat("cannot listen on unix:", socket_path_));
  }
  socket_bound_ = true;
  ::chmod(socket_path_.c_str(), 0600);
  return absl::OkStatus();
}

absl::Status Daemon::StartTcpListener(AdapterOptions ao) {
  const DaemonOptions& options = options_;
  KVTIER_ASSIGN_OR_RETURN(std::optional<ServerTls> tls, TcpTls(options));
  ao.thread_name = "kvtierd-tcp";
  tcp_adapter_ = std::make_unique<GrpcAdapter>(service_.get(), metrics_.get(), ao);
  // With tenants, any tenant's token opens a call (the adapter finds its
  // tenant); without, the daemon's token.
  const ServerTls* tls_ptr = tls ? &*tls : nullptr;
  std::shared_ptr<grpc::ServerCredentials> creds =
      tenants_->configured()
          ? BearerTokenServerCredentials(
                [t = tenants_.get()](std::string_view v) { return t->ByBearer(v) != nullptr; },
                metrics_.get(), tls_ptr)
          : BearerTokenServerCredentials(ao.token, metrics_.get(), tls_ptr);
  KVTIER_ASSIGN_OR_RETURN(TcpAcceptorOptions to, TcpConnectionLimits(options));
  KVTIER_ASSIGN_OR_RETURN(tcp_acceptor_, TcpAcceptor::Listen(options.listen_tcp, to));
  tcp_port_ = tcp_acceptor_->port();
  tcp_server_ = BuildServer(options, options.listen_tcp, std::move(creds), tcp_adapter_.get(),
                            &tcp_handoff_);
  if (tcp_server_ == nullptr || tcp_handoff_ == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat("cannot serve ", options.listen_tcp));
  }
  tcp_acceptor_->Start([h = tcp_handoff_.get(), lfd = tcp_acceptor_->listen_fd()](int fd) {
    grpc::experimental::ExternalConnectionAcceptor::NewConnectionParameters p;
    p.listener_fd = lfd;
    p.fd = fd;
    h->HandleNewConnection(&p);
  });
  return absl::OkStatus();
}

absl::Status Daemon::SignalReady() {
  if (options_.ready_file.empty()) return absl::OkStatus();
  // Last, so that whoever waits for the file finds every listener serving.
  const std::string text = absl::StrCat(::getpid(), "\n", Describe(), "\n");
  KVTIER_RETURN_IF_ERROR(WriteFileAtomic(
      options_.ready_file, {reinterpret_cast<const uint8_t*>(text.data()), text.size()}));
  ready_file_written_ = true;
  return absl::OkStatus();
}

int Daemon::metrics_port() const { return http_ ? http_->port() : 0; }

std::string Daemon::ClusterMetricsText() const {
  if (!membership_) return "";
  std::string out;
  auto counter = [&](const char* name, const char* help, uint64_t v) {
    absl::StrAppend(&out, "# HELP ", name, " ", help, "\n# TYPE ", name, " counter\n", name, " ", v, "\n");
  };
  counter("kvtier_cluster_peer_auth_failures_total",
          "Peer handshakes that failed (wrong or missing cluster secret, hostile handshake messages).",
          transport_->auth_failures());
  counter("kvtier_cluster_peer_auth_successes_total", "Peer handshakes completed.",
          transport_->auth_successes());
  counter("kvtier_cluster_records_rejected_total",
          "Member records in etcd ignored: malformed, or not signed with the cluster secret.",
          membership_->rejected_records());
  return out;
}

uint64_t Daemon::grpc_inflight_bytes() const {
  uint64_t n = 0;
  for (GrpcAdapter* a : {unix_adapter_.get(), tcp_adapter_.get()}) {
    if (a != nullptr) n += a->inflight_bytes();
  }
  return n;
}

uint64_t Daemon::grpc_cancelled_calls() const {
  uint64_t n = 0;
  for (GrpcAdapter* a : {unix_adapter_.get(), tcp_adapter_.get()}) {
    if (a != nullptr) n += a->cancelled_calls();
  }
  return n;
}

int Daemon::data_plane_connections() const { return shm_ ? shm_->connections() : 0; }

std::string Daemon::Describe() const {
  std::string s = absl::StrCat("unix:", socket_path_);
  if (shm_) absl::StrAppend(&s, " (shared memory: ", shm_socket_path_, ")");
  if (!options_.listen_tcp.empty()) {
    absl::StrAppend(&s, ", tcp port ", tcp_port_,
                    options_.tls_cert.empty()       ? " (token)"
                    : options_.tls_client_ca.empty() ? " (TLS, token)"
                                                     : " (mutual TLS, token)");
  }
  if (http_) absl::StrAppend(&s, ", metrics http port ", http_->port(), "/metrics");
  if (membership_) {
    absl::StrAppend(&s, ", cluster '", options_.cluster, "' as ", membership_->self_id(), " (data path ",
                    transport_->listen_address(), ", ", options_.replicas, " replicas)");
  }
  for (const tiering::TierUsage& u : engine_->Usage()) {
    absl::StrAppend(&s, "; ", tiering::TierName(u.kind), " ",
                    absl::StrFormat("%.2f", u.capacity_bytes / kGiB), " GiB");
  }
  return s;
}

absl::Status Daemon::Shutdown() {
  if (shut_down_) return absl::OkStatus();
  shut_down_ = true;
  if (ready_file_written_) ::unlink(options_.ready_file.c_str());  // no longer ready
  auto deadline = std::chrono::system_clock::now() + std::chrono::seconds(options_.shutdown_grace_s);
  // Before the server stops: it would no longer take the sockets handed off.
  if (tcp_acceptor_) tcp_acceptor_->Stop();
  for (grpc::Server* server : {tcp_server_.get(), unix_server_.get()}) {
    if (server != nullptr) server->Shutdown(deadline);
  }
  for (grpc::Server* server : {tcp_server_.get(), unix_server_.get()}) {
    if (server != nullptr) server->Wait();
  }
  shm_.reset();
  http_.reset();
  absl::Status st;
  if (service_) {
    const KvService::FlushReport r = service_->FlushDramToNvme();
    flushed_chunks_ = r.written;
    if (r.no_room + r.corrupt + r.failed > 0) {
      spdlog::warn("shutdown: {} DRAM chunks not written to NVMe ({} without room, {} corrupt, {} failed)",
                   r.no_room + r.corrupt + r.failed, r.no_room, r.corrupt, r.failed);
    }
    st = r.first_error;
  }
  tcp_acceptor_.reset();
  tcp_server_.reset();
  tcp_handoff_.reset();
  unix_server_.reset();
  tcp_adapter_.reset();
  unix_adapter_.reset();
  service_.reset();
  if (peer_service_) peer_service_->set_engine(nullptr);  // peers now get Unavailable
  engine_.reset();  // closes the NVMe tier: the index is flushed
  membership_.reset();  // leaves the cluster: the lease is revoked
  transport_.reset();
  // Only a socket this daemon bound is its to remove (a Start that failed
  // before binding leaves the path alone).
  if (socket_bound_) ::unlink(socket_path_.c_str());
  // Last: a daemon starting on this data dir or socket once the locks are
  // released finds the tiers closed and the sockets gone.
  shm_socket_lock_.reset();
  socket_lock_.reset();
  data_dir_lock_.reset();
  return st;
}

Daemon::~Daemon() { (void)Shutdown(); }

}  // namespace kvtier::server
