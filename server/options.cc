#include "server/options.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <fstream>
#include <sstream>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/file.h"
#include "common/status.h"
#include "tiering/eviction.h"
#include "toml++/toml.h"

namespace kvtier::server {

std::string DaemonOptions::SocketPath() const {
  return socket.empty() ? data_dir + "/kvtierd.sock" : socket;
}

void RegisterDaemonFlags(CLI::App& app, DaemonOptions* o) {
  app.add_option("--config", o->config, "TOML config file; flags override it")->capture_default_str();
  app.add_option("--data-dir", o->data_dir, "NVMe tier and sockets live here")->capture_default_str();
  app.add_option("--socket", o->socket, "gRPC Unix socket (0600) [default: <data-dir>/kvtierd.sock]");
  app.add_option("--dram-gib", o->dram_gib, "DRAM shared-memory pool GiB (capped at half the available memory; 0: none)")
      ->capture_default_str();
  app.add_option("--nvme-gib", o->nvme_gib, "NVMe tier GiB (capped at half the free disk; 0: none)")
      ->capture_default_str();
  app.add_option("--hbm-gib", o->hbm_gib, "HBM tier GiB, only with a CUDA device (0: none)")
      ->capture_default_str();
  app.add_option("--dram-populate", o->dram_populate, "touch every DRAM pool page at startup")
      ->capture_default_str();
  app.add_option("--dram-huge-pages", o->dram_huge_pages,
                 "back the DRAM pool with reserved huge pages (vm.nr_hugepages)")
      ->capture_default_str();
  app.add_option("--nvme-read-probe-mib", o->nvme_read_probe_mib,
                 "MiB the NVMe tier reads back at startup to learn the disk's read rate (0: none)")
      ->capture_default_str();
  app.add_option("--listen-tcp", o->listen_tcp, "also listen on TCP HOST:PORT (needs --token-file)")
      ->capture_default_str();
  app.add_option("--token-file", o->token_file,
                 "bearer token TCP clients must send (file mode 0600, token >= 32 bytes)")
      ->capture_default_str();
  app.add_option("--tenants", o->tenants,
                 "tenants file (TOML [[tenant]] tables): per-tenant keys, quotas, metrics "
                 "[default: none, one tenant]");
  app.add_option("--tls-cert", o->tls_cert, "PEM certificate chain of the TCP listener (TLS; needs --tls-key)");
  app.add_option("--tls-key", o->tls_key, "PEM private key of the TCP listener");
  app.add_option("--tls-client-ca", o->tls_client_ca,
                 "PEM CA that TCP clients' certificates must chain to (mutual TLS)");
  app.add_flag("--insecure-tcp", o->insecure_tcp,
               "allow a plaintext TCP listener on a non-loopback address (logged as INSECURE)");
  app.add_option("--max-tcp-connections", o->max_tcp_connections,
                 "most connections the TCP listener serves at once (lowered to fit RLIMIT_NOFILE)")
      ->capture_default_str();
  app.add_option("--max-tcp-connections-per-peer", o->max_tcp_connections_per_peer,
                 "most TCP connections served at once from one peer address")
      ->capture_default_str();
  app.add_option("--fd-reserve", o->fd_reserve,
                 "descriptors TCP connections may never take (0: a quarter of RLIMIT_NOFILE, at least 128)")
      ->capture_default_str();
  app.add_option("--metrics-addr", o->metrics_addr, "Prometheus metrics at http://HOST:PORT/metrics")
      ->capture_default_str();
  app.add_option("--max-message-mib", o->max_message_mib, "largest gRPC message, MiB")->capture_default_str();
  app.add_option("--max-keys-per-request", o->max_keys_per_request, "most keys per Lookup/Pin/Prefetch")
      ->capture_default_str();
  app.add_option("--max-held-share", o->max_held_share,
                 "share of the DRAM tier that holds may keep in place (0 < share <= 1)")
      ->capture_default_str();
  app.add_option("--max-holder-share", o->max_holder_share,
                 "share of the DRAM tier that one connection or credential may hold (0 < share <= 1)")
      ->capture_default_str();
  app.add_option("--max-holds-per-holder", o->max_holds_per_holder,
                 "most leases and slots one connection or credential may have open")
      ->capture_default_str();
  app.add_option("--max-held-keys-per-holder", o->max_held_keys_per_holder,
                 "most keys the leases of one connection or credential may pin")
      ->capture_default_str();
  app.add_option("--max-concurrent-streams", o->max_concurrent_streams,
                 "most concurrent streams per connection")->capture_default_str();
  app.add_option("--request-threads", o->request_threads,
                 "threads per gRPC listener (0: max(8, 2 x hardware threads))")->capture_default_str();
  app.add_option("--max-queued-requests", o->max_queued_requests,
                 "requests per gRPC listener that may wait for a thread")->capture_default_str();
  app.add_option("--max-inflight-mib", o->max_inflight_mib,
                 "MiB of chunk data the gRPC calls of one listener may hold")->capture_default_str();
  app.add_option("--max-inflight-mib-per-connection", o->max_inflight_mib_per_connection,
                 "MiB of chunk data the gRPC calls of one connection may hold")->capture_default_str();
  app.add_option("--write-timeout-ms", o->write_timeout_ms,
                 "ms a gRPC answer may wait for its reader before the call is cancelled")
      ->capture_default_str();
  app.add_option("--stream-idle-timeout-ms", o->stream_idle_timeout_ms,
                 "ms a PutStream may wait for its next message")->capture_default_str();
  app.add_option("--keepalive-s", o->keepalive_s, "seconds between keepalive pings on idle gRPC connections")
      ->capture_default_str();
  app.add_option("--default-lease-ms", o->default_lease_ms, "lease of pins/slots that ask for 0")
      ->capture_default_str();
  app.add_option("--nvme-admit-after-uses", o->nvme_admit_after_uses,
                 "uses before a DRAM-evicted chunk is written to NVMe")->capture_default_str();
  app.add_option("--eviction", o->eviction, "eviction policy: lru, s3fifo, arc or flru for every tier, or per tier (\"flru,nvme=lru\")")
      ->capture_default_str();
  app.add_option("--shutdown-grace-s", o->shutdown_grace_s, "seconds SIGTERM waits for in-flight requests")
      ->capture_default_str();
  app.add_option("--put-check-threads", o->put_check_threads,
                 "threads that check one shared-memory put, 1 or 2 (0: 2 on hosts with 4+ "
                 "hardware threads, else 1)")
      ->capture_default_str();
  app.add_option("--log-level", o->log_level, "trace|debug|info|warn|error|off")->capture_default_str();
  app.add_option("--ready-file", o->ready_file,
                 "write this file (pid, then what is served) once every listener is serving [default: none]");
  app.add_option("--cluster", o->cluster, "join this cluster (needs --etcd and --advertise) [default: standalone]");
  app.add_option("--etcd", o->etcd, "etcd endpoints http://HOST:PORT[,...] or https://...");
  app.add_option("--etcd-ca", o->etcd_ca, "PEM CA of etcd's server certificate (TLS to etcd)");
  app.add_option("--etcd-cert", o->etcd_cert, "PEM client certificate presented to etcd");
  app.add_option("--etcd-key", o->etcd_key, "PEM private key of --etcd-cert");
  app.add_option("--etcd-user", o->etcd_user, "etcd user (etcd auth; password in --etcd-password-file)");
  app.add_option("--etcd-password-file", o->etcd_password_file, "file holding the etcd user's password (mode 0600)");
  app.add_option("--cluster-secret-file", o->cluster_secret_file,
                 "file holding the cluster secret (mode 0600, >= 32 bytes): authenticates peers, signs member records");
  app.add_option("--advertise", o->advertise, "HOST:PORT peers reach this node's UCX data path on");
  app.add_option("--replicas", o->replicas, "copies of each chunk in the cluster")->capture_default_str();
  app.add_option("--node-id", o->node_id, "node id in the cluster [default: the advertise address]");
  app.add_option("--cluster-lease-s", o->cluster_lease_s, "etcd lease TTL: how long a dead node stays listed")
      ->capture_default_str();
}

namespace {

template <typename T>
absl::Status Take(const toml::table& t, const char* key, T* out) {
  const toml::node* n = t.get(key);
  if (n == nullptr) return absl::OkStatus();
  if constexpr (std::is_same_v<T, std::string>) {
    if (auto v = n->value<std::string>()) {
      *out = *v;
      return absl::OkStatus();
    }
  } else if constexpr (std::is_same_v<T, bool>) {
    if (auto v = n->value<bool>()) {
      *out = *v;
      return absl::OkStatus();
    }
  } else if constexpr (std::is_same_v<T, double>) {
    if (auto v = n->value<double>()) {  // integers convert too
      *out = *v;
      return absl::OkStatus();
    }
  } else {
    if (auto v = n->value<int64_t>(); v && *v >= 0 && *v <= 0xffffffffLL) {
      *out = static_cast<T>(*v);
      return absl::OkStatus();
    }
  }
  return absl::InvalidArgumentError(absl::StrCat("config key '", key, "' has the wrong type"));
}

}  // namespace

absl::Status LoadConfigFile(const std::string& path, DaemonOptions* o) {
  toml::table t;
  try {
    t = toml::parse_file(path);
  } catch (const toml::parse_error& e) {
    return absl::InvalidArgumentError(absl::StrCat("config ", path, ": ", std::string(e.description())));
  }
  static const char* kKeys[] = {"data_dir", "socket", "dram_gib", "nvme_gib", "hbm_gib",
                                "dram_populate", "dram_huge_pages", "nvme_read_probe_mib", "listen_tcp", "token_file", "tenants", "tls_cert", "tls_key",
                                "tls_client_ca", "insecure_tcp", "max_tcp_connections",
                                "max_tcp_connections_per_peer", "fd_reserve", "metrics_addr",
                                "max_message_mib", "max_keys_per_request", "max_concurrent_streams",
                                "request_threads", "max_queued_requests", "max_inflight_mib",
                                "max_inflight_mib_per_connection", "write_timeout_ms",
                                "stream_idle_timeout_ms", "keepalive_s",
                                "default_lease_ms", "max_held_share", "max_holder_share", "max_holds_per_holder", "max_held_keys_per_holder", "nvme_admit_after_uses", "eviction", "shutdown_grace_s", "put_check_threads",
                                "log_level", "ready_file", "cluster", "etcd", "etcd_ca", "etcd_cert",
                                "etcd_key", "etcd_user", "etcd_password_file", "cluster_secret_file",
                                "advertise", "replicas", "node_id", "cluster_lease_s"};
  for (const auto& [k, v] : t) {
    bool known = false;
    for (const char* name : kKeys) known = known || k.str() == name;
    if (!known) {
      return absl::InvalidArgumentError(absl::StrCat("config ", path, ": unknown key '",
                                                     std::string(k.str()), "'"));
    }
  }
  absl::Status st;
  auto take = [&](auto key, auto* out) {
    if (st.ok()) st = Take(t, key, out);
  };
  take("data_dir", &o->data_dir);
  take("socket", &o->socket);
  take("dram_gib", &o->dram_gib);
  take("nvme_gib", &o->nvme_gib);
  take("hbm_gib", &o->hbm_gib);
  take("dram_populate", &o->dram_populate);
  take("dram_huge_pages", &o->dram_huge_pages);
  take("nvme_read_probe_mib", &o->nvme_read_probe_mib);
  take("listen_tcp", &o->listen_tcp);
  take("token_file", &o->token_file);
  take("tenants", &o->tenants);
  take("tls_cert", &o->tls_cert);
  take("tls_key", &o->tls_key);
  take("tls_client_ca", &o->tls_client_ca);
  take("insecure_tcp", &o->insecure_tcp);
  take("max_tcp_connections", &o->max_tcp_connections);
  take("max_tcp_connections_per_peer", &o->max_tcp_connections_per_peer);
  take("fd_reserve", &o->fd_reserve);
  take("metrics_addr", &o->metrics_addr);
  take("max_message_mib", &o->max_message_mib);
  take("max_keys_per_request", &o->max_keys_per_request);
  take("max_concurrent_streams", &o->max_concurrent_streams);
  take("request_threads", &o->request_threads);
  take("max_queued_requests", &o->max_queued_requests);
  take("max_inflight_mib", &o->max_inflight_mib);
  take("max_inflight_mib_per_connection", &o->max_inflight_mib_per_connection);
  take("write_timeout_ms", &o->write_timeout_ms);
  take("stream_idle_timeout_ms", &o->stream_idle_timeout_ms);
  take("keepalive_s", &o->keepalive_s);
  take("default_lease_ms", &o->default_lease_ms);
  take("max_held_share", &o->max_held_share);
  take("max_holder_share", &o->max_holder_share);
  take("max_holds_per_holder", &o->max_holds_per_holder);
  take("max_held_keys_per_holder", &o->max_held_keys_per_holder);
  take("nvme_admit_after_uses", &o->nvme_admit_after_uses);
  take("eviction", &o->eviction);
  take("shutdown_grace_s", &o->shutdown_grace_s);
  take("put_check_threads", &o->put_check_threads);
  take("log_level", &o->log_level);
  take("ready_file", &o->ready_file);
  take("cluster", &o->cluster);
  take("etcd", &o->etcd);
  take("etcd_ca", &o->etcd_ca);
  take("etcd_cert", &o->etcd_cert);
  take("etcd_key", &o->etcd_key);
  take("etcd_user", &o->etcd_user);
  take("etcd_password_file", &o->etcd_password_file);
  take("cluster_secret_file", &o->cluster_secret_file);
  take("advertise", &o->advertise);
  take("replicas", &o->replicas);
  take("node_id", &o->node_id);
  take("cluster_lease_s", &o->cluster_lease_s);
  if (!st.ok()) return absl::InvalidArgumentError(absl::StrCat("config ", path, ": ", st.message()));
  return absl::OkStatus();
}

absl::Status ValidateDaemonOptions(const DaemonOptions& o) {
  if (o.dram_gib < 0 || o.nvme_gib < 0 || o.hbm_gib < 0) {
    return absl::InvalidArgumentError("tier sizes must be >= 0");
  }
  if (o.dram_gib == 0 && o.nvme_gib == 0) {
    return absl::InvalidArgumentError("need a DRAM or an NVMe tier");
  }
  if (o.data_dir.empty()) return absl::InvalidArgumentError("--data-dir is empty");
  if (o.nvme_read_probe_mib > kMaxNvmeReadProbeMib) {
    return absl::InvalidArgumentError(absl::StrCat("--nvme-read-probe-mib ", o.nvme_read_probe_mib,
                                                   " is over ", kMaxNvmeReadProbeMib));
  }
  if (auto e = tiering::ParseEvictionPolicySpec(o.eviction); !e.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("--eviction: ", e.status().message()));
  }
  if (!o.listen_tcp.empty() && o.token_file.empty() && o.tenants.empty()) {
    return absl::InvalidArgumentError("--listen-tcp requires --token-file or --tenants");
  }
  if (o.tls_cert.empty() != o.tls_key.empty()) {
    return absl::InvalidArgumentError("--tls-cert and --tls-key go together");
  }
  if (!o.tls_client_ca.empty() && o.tls_cert.empty()) {
    return absl::InvalidArgumentError("--tls-client-ca requires --tls-cert and --tls-key");
  }
  if (!o.tls_cert.empty() && o.listen_tcp.empty()) {
    return absl::InvalidArgumentError("--tls-cert is for the TCP listener: give --listen-tcp");
  }
  if (!o.listen_tcp.empty() && o.tls_cert.empty() && !o.insecure_tcp && !IsLoopbackListen(o.listen_tcp)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--listen-tcp ", o.listen_tcp,
        " is not a loopback address and has no TLS: the bearer token would cross the network in "
        "clear text. Give --tls-cert/--tls-key, or --insecure-tcp to accept that"));
  }
  if (o.max_tcp_connections == 0 || o.max_tcp_connections > (1u << 20)) {
    return absl::InvalidArgumentError("--max-tcp-connections must be 1..1048576");
  }
  if (o.max_tcp_connections_per_peer == 0 || o.max_tcp_connections_per_peer > o.max_tcp_connections) {
    return absl::InvalidArgumentError("--max-tcp-connections-per-peer must be 1..--max-tcp-connections");
  }
  if (o.fd_reserve != 0 && (o.fd_reserve < kMinFdReserve || o.fd_reserve > (1u << 20))) {
    return absl::InvalidArgumentError(
        absl::StrCat("--fd-reserve must be 0 (auto) or ", kMinFdReserve, "..1048576"));
  }
  if (o.max_message_mib == 0 || o.max_message_mib > 2047) {
    return absl::InvalidArgumentError("--max-message-mib must be 1..2047");
  }
  if (o.max_keys_per_request == 0) return absl::InvalidArgumentError("--max-keys-per-request is 0");
  if (!(o.max_held_share > 0 && o.max_held_share <= 1)) {
    return absl::InvalidArgumentError("--max-held-share must be in (0, 1]");
  }
  if (!(o.max_holder_share > 0 && o.max_holder_share <= 1)) {
    return absl::InvalidArgumentError("--max-holder-share must be in (0, 1]");
  }
  if (o.max_holds_per_holder == 0 || o.max_held_keys_per_holder == 0) {
    return absl::InvalidArgumentError(
        "--max-holds-per-holder and --max-held-keys-per-holder must be at least 1");
  }
  if (o.put_check_threads > 2) {
    return absl::InvalidArgumentError("--put-check-threads must be 0 (auto), 1 or 2");
  }
  if (o.max_concurrent_streams == 0) return absl::InvalidArgumentError("--max-concurrent-streams is 0");
  if (o.request_threads > 1024) return absl::InvalidArgumentError("--request-threads must be 0..1024");
  if (o.max_queued_requests == 0) return absl::InvalidArgumentError("--max-queued-requests is 0");
  if (o.max_inflight_mib_per_connection == 0 || o.max_inflight_mib < o.max_inflight_mib_per_connection) {
    return absl::InvalidArgumentError(
        "--max-inflight-mib-per-connection must be 1..--max-inflight-mib");
  }
  if (o.write_timeout_ms < 100 || o.stream_idle_timeout_ms < 100) {
    return absl::InvalidArgumentError("--write-timeout-ms and --stream-idle-timeout-ms must be >= 100");
  }
  if (o.keepalive_s == 0) return absl::InvalidArgumentError("--keepalive-s is 0");
  if (!o.cluster.empty()) {
    if (o.etcd.empty()) return absl::InvalidArgumentError("--cluster requires --etcd");
    if (o.advertise.empty()) return absl::InvalidArgumentError("--cluster requires --advertise");
    if (o.replicas == 0 || o.replicas > 16) return absl::InvalidArgumentError("--replicas must be 1..16");
    if (o.cluster_lease_s < 2 || o.cluster_lease_s > 3600) {
      return absl::InvalidArgumentError("--cluster-lease-s must be 2..3600");
    }
    if (o.etcd_cert.empty() != o.etcd_key.empty()) {
      return absl::InvalidArgumentError("--etcd-cert and --etcd-key go together");
    }
    if (!o.etcd_cert.empty() && o.etcd_ca.empty()) {
      return absl::InvalidArgumentError("--etcd-cert needs --etcd-ca (a client certificate only travels over TLS)");
    }
    if (o.etcd_user.empty() != o.etcd_password_file.empty()) {
      return absl::InvalidArgumentError("--etcd-user and --etcd-password-file go together");
    }
  } else if (!o.etcd.empty() || !o.advertise.empty()) {
    return absl::InvalidArgumentError("--etcd and --advertise need --cluster");
  } else if (!o.cluster_secret_file.empty() || !o.etcd_ca.empty() || !o.etcd_user.empty()) {
    return absl::InvalidArgumentError("--cluster-secret-file and the --etcd-* options need --cluster");
  }
  return absl::OkStatus();
}

uint64_t ResolveFdReserve(uint32_t option, uint64_t fd_limit) {
  return option != 0 ? option : std::max<uint64_t>(128, fd_limit / 4);
}

absl::StatusOr<std::string> ReadTokenFile(const std::string& path) {
  return ReadSecretFile(path, "token", kMinTokenBytes);
}

bool IsLoopbackListen(const std::string& host_port) {
  std::string host = host_port.substr(0, host_port.rfind(':'));
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  if (host == "localhost" || host == "::1") return true;
  in_addr a{};
  return ::inet_pton(AF_INET, host.c_str(), &a) == 1 && (ntohl(a.s_addr) >> 24) == 127;
}


}  // namespace kvtier::server
