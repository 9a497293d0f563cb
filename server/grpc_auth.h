// Credentials of kvtierd's TCP listener: the bearer token is checked on a
// call's initial metadata, before the call reaches a handler and before any
// of its body is read, so a peer without the token holds no handler, no
// worker thread and at most the HTTP/2 flow-control window of its streams.
#ifndef KVTIER_SERVER_GRPC_AUTH_H_
#define KVTIER_SERVER_GRPC_AUTH_H_

#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "grpcpp/security/auth_context.h"
#include "grpcpp/security/server_credentials.h"

namespace kvtier::server {

class ServerMetrics;

// True if `value` (an "authorization" metadata value) is "Bearer <token>";
// the token is compared in constant time (kvtier::ConstantTimeEquals).
bool IsBearerToken(std::string_view value, std::string_view token);

// TLS of a TCP listener, as PEM text.
struct ServerTls {
  std::string cert_chain;  // the listener's certificate chain
  std::string private_key;
  // CA bundle client certificates must chain to; non-empty: a client must
  // present a certificate it signed (mutual TLS), else the handshake fails.
  std::string client_ca;
};

// Checks `tls` before a listener uses it, so a bad file is a clear startup
// error: InvalidArgument if the chain, the key or the client CA is not PEM
// OpenSSL can parse, or the key does not belong to the first certificate;
// FailedPrecondition if that certificate has expired or is not valid yet.
absl::Status CheckServerTls(const ServerTls& tls);

// HTTP/2 credentials, plaintext or (with `tls`) TLS through gRPC's SSL
// credentials, whose every call must carry "authorization: Bearer <token>";
// other calls end with UNAUTHENTICATED as soon as their headers arrive,
// counted in `metrics` (kAuthFailures; not owned, must outlive the server).
// REQUIRES: `token` is not empty; `tls`, if given, passed CheckServerTls.
std::shared_ptr<grpc::ServerCredentials> BearerTokenServerCredentials(std::string token,
                                                                      ServerMetrics* metrics,
                                                                      const ServerTls* tls = nullptr);
// The same with the check in `accepts`: true for an "authorization" value
// that opens a call (e.g. any tenant's token). Thread-safe, non-blocking.
std::shared_ptr<grpc::ServerCredentials> BearerTokenServerCredentials(
    std::function<bool(std::string_view authorization)> accepts, ServerMetrics* metrics,
    const ServerTls* tls = nullptr);

// The verified TLS client identity of a call: its certificate's first
// subject alternative name, else its subject CN; "" without a verified
// client certificate.
std::string PeerTlsIdentity(const grpc::AuthContext& context);

}  // namespace kvtier::server

#endif  // KVTIER_SERVER_GRPC_AUTH_H_
