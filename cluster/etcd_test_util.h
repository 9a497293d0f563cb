// Starts a private etcd server (Debian's etcd-server) on free loopback ports
// in a temp directory, for tests, plaintext or with TLS (and client
// certificate authentication); stops it (SIGKILL) and removes its data when
// destroyed. Fails loudly, not silently, when etcd is missing.
#ifndef KVTIER_CLUSTER_ETCD_TEST_UTIL_H_
#define KVTIER_CLUSTER_ETCD_TEST_UTIL_H_

#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "cluster/etcd_client.h"
#include "common/testing/temp_dir.h"

namespace kvtier::cluster::testing {

// A loopback TCP port that was free a moment ago.
inline int FreePort() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  socklen_t len = sizeof(a);
  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  int port = ntohs(a.sin_port);
  close(fd);
  return port;
}

inline bool PortOpen(int port) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(static_cast<uint16_t>(port));
  bool ok = connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0;
  close(fd);
  return ok;
}

inline std::string FindEtcd() {
  for (const char* p : {"/usr/bin/etcd", "/usr/local/bin/etcd"}) {
    if (access(p, X_OK) == 0) return p;
  }
  return "";
}

// TLS of a test etcd's client port (PEM file paths).
struct EtcdServerTls {
  // Server certificate and key; CA of client certificates ("" for none:
  // etcd then asks for no client certificate).
  std::string cert, key, ca;
  bool client_cert_auth = false;  // etcd's --client-cert-auth
  // What the readiness check presents (a client certificate when required).
  EtcdClientOptions client;
  // More etcd flags (e.g. "--auth-token-ttl", "1").
  std::vector<std::string> extra_args;
};

class EtcdServer {
 public:
  // Starts etcd and waits (up to 20 s) until it answers. ok() tells. With
  // `tls`, the client port speaks TLS (endpoint() is https://).
  explicit EtcdServer(const EtcdServerTls* tls = nullptr) {
    std::string etcd = FindEtcd();
    if (etcd.empty()) {
      error_ = "etcd not found: run scripts/install-deps (package etcd-server)";
      return;
    }
    int client = FreePort(), peer = FreePort();
    endpoint_ = (tls ? "https" : "http") + std::string("://127.0.0.1:") + std::to_string(client);
    std::string peer_url = "http://127.0.0.1:" + std::to_string(peer);
    pid_ = fork();
    if (pid_ == 0) {
      std::string log = dir_.path() + "/etcd.log";
      FILE* f = freopen(log.c_str(), "w", stderr);
      (void)f;
      std::vector<std::string> args = {etcd, "--name", "kvtier-test", "--data-dir", dir_.path() + "/data",
                                       "--listen-client-urls", endpoint_, "--advertise-client-urls",
                                       endpoint_, "--listen-peer-urls", peer_url,
                                       "--initial-advertise-peer-urls", peer_url, "--initial-cluster",
                                       "kvtier-test=" + peer_url, "--log-level", "error"};
      if (tls) {
        for (std::string a : {"--cert-file", tls->cert.c_str(), "--key-file", tls->key.c_str()}) {
          args.push_back(a);
        }
        // etcd requires a client certificate whenever it has a client CA.
        if (!tls->ca.empty()) {
          args.push_back("--trusted-ca-file");
          args.push_back(tls->ca);
        }
        if (tls->client_cert_auth) args.push_back("--client-cert-auth");
        args.insert(args.end(), tls->extra_args.begin(), tls->extra_args.end());
      }
      std::vector<char*> argv;
      for (std::string& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      execv(etcd.c_str(), argv.data());
      _exit(127);
    }
    // Wait for the port first: a gRPC channel that finds nothing listening
    // backs off for seconds before it tries again.
    for (int i = 0; i < 400 && !PortOpen(client); ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(25));
    }
    EtcdClientOptions co = tls ? tls->client : EtcdClientOptions{};
    co.timeout = absl::Seconds(1);
    auto client_or = EtcdClient::Connect({endpoint_}, co);
    for (int i = 0; i < 100 && client_or.ok(); ++i) {
      if ((*client_or)->GetPrefix("/").ok()) {
        ok_ = true;
        return;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    error_ = "etcd did not start; see " + dir_.path() + "/etcd.log";
  }
  ~EtcdServer() {
    if (pid_ > 0) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
  }
  bool ok() const { return ok_; }
  const std::string& error() const { return error_; }
  const std::string& endpoint() const { return endpoint_; }

 private:
  pid_t pid_ = -1;
  bool ok_ = false;
  ::kvtier::testing::TempDir dir_{"kvtier-etcd"};  // outlives the etcd process
  std::string endpoint_, error_;
};

}  // namespace kvtier::cluster::testing

#endif  // KVTIER_CLUSTER_ETCD_TEST_UTIL_H_
