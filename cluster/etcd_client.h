// A small etcd v3 client over etcd's gRPC API (our own code; gRPC is already
// a dependency): key-value, leases and watches, which is all cluster
// membership needs. Generated etcd types stay inside etcd_client.cc.
//
// Endpoints are "http://host:port" (or "host:port"), or "https://host:port"
// with TLS (EtcdClientOptions::ca). With a user and password, the client
// authenticates (etcd's Auth.Authenticate) and sends the token etcd gives
// on every call, authenticating again when etcd says it expired. Calls go
// to the first endpoint that answers; an endpoint that is down is skipped.
// Every call is bounded by the client's timeout. Thread-safe.
#ifndef KVTIER_CLUSTER_ETCD_CLIENT_H_
#define KVTIER_CLUSTER_ETCD_CLIENT_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace kvtier::cluster {

struct EtcdKeyValue {
  std::string key;
  std::string value;
  int64_t lease = 0;
  int64_t mod_revision = 0;
};

struct EtcdEvent {
  bool deleted = false;
  EtcdKeyValue kv;
};

// Ends a watch when destroyed or cancelled.
class EtcdWatch {
 public:
  virtual ~EtcdWatch() = default;
  virtual void Cancel() = 0;
};

// How the client reaches etcd: TLS and credentials.
struct EtcdClientOptions {
  // Bound on every call. Default: 3 s
  absl::Duration timeout = absl::Seconds(3);
  // PEM CA bundle etcd's server certificate must chain to; non-empty: TLS
  // (the endpoints must be https://). Default: "" (plaintext, http://)
  std::string ca;
  // PEM client certificate chain and key for an etcd with
  // --client-cert-auth. Need `ca`. Default: "" (none)
  std::string cert;
  std::string key;
  // etcd user and password (etcd auth enabled). Default: "" (none)
  std::string user;
  std::string password;
};

class EtcdClient {
 public:
  // Parses the endpoints (InvalidArgument for an empty list, a malformed
  // host:port, https without options.ca or http with it, a certificate
  // without its key, or a user without a password) and opens channels;
  // does not wait for etcd.
  static absl::StatusOr<std::unique_ptr<EtcdClient>> Connect(const std::vector<std::string>& endpoints,
                                                             const EtcdClientOptions& options);
  static absl::StatusOr<std::unique_ptr<EtcdClient>> Connect(
      const std::vector<std::string>& endpoints, absl::Duration timeout = absl::Seconds(3)) {
    EtcdClientOptions o;
    o.timeout = timeout;
    return Connect(endpoints, o);
  }
  virtual ~EtcdClient() = default;

  // Returns the store revision after the put.
  virtual absl::StatusOr<int64_t> Put(const std::string& key, const std::string& value,
                                      int64_t lease = 0) = 0;
  // Every key with `prefix`, and the store revision they were read at.
  virtual absl::StatusOr<std::pair<std::vector<EtcdKeyValue>, int64_t>> GetPrefix(
      const std::string& prefix) = 0;
  // Number of keys deleted.
  virtual absl::StatusOr<int64_t> Delete(const std::string& key) = 0;

  // A lease of `ttl_s` seconds; returns its id.
  virtual absl::StatusOr<int64_t> LeaseGrant(int64_t ttl_s) = 0;
  // Revokes a lease and deletes its keys. NotFound if it already expired.
  virtual absl::Status LeaseRevoke(int64_t id) = 0;
  // Renews a lease once; returns its new TTL. NotFound if it expired.
  virtual absl::StatusOr<int64_t> LeaseKeepAlive(int64_t id) = 0;
  // Seconds left on a lease. NotFound if it expired.
  virtual absl::StatusOr<int64_t> LeaseTimeToLive(int64_t id) = 0;

  // Watches every key with `prefix` from `start_revision` on a background
  // thread: `on_events` gets each batch; `on_end` gets the reason the watch
  // ended (Cancelled after Cancel()). Both run on the watch thread.
  virtual absl::StatusOr<std::unique_ptr<EtcdWatch>> WatchPrefix(
      const std::string& prefix, int64_t start_revision,
      std::function<void(const std::vector<EtcdEvent>&)> on_events,
      std::function<void(const absl::Status&)> on_end) = 0;
};

// "http://h:p,http://h2:p2" -> {"h:p", "h2:p2"}; an https endpoint keeps
// its scheme ("https://h:p"), so Connect knows it wants TLS. InvalidArgument
// for an empty list, a malformed host:port or a list that mixes http and
// https.
absl::StatusOr<std::vector<std::string>> ParseEtcdEndpoints(const std::string& list);

}  // namespace kvtier::cluster

#endif  // KVTIER_CLUSTER_ETCD_CLIENT_H_
