// Credentials of kvtierd's TCP listener: the bearer token is checked on a
// call's initial metadata, before the call reaches a handler and before any
// of its body is read, so a peer without the token holds no handler, no
// worker thread and at most the HTTP/2 flow-control window of its streams.
#ifndef KVTIER_SERVER_GRPC_AUTH_H_
#define KVTIER_SERVER_GRPC_AUTH_H_

#include <memory>
#include <string>
#include <string_view>

#include "grpcpp/security/server_credentials.h"

namespace kvtier::server {

class ServerMetrics;

// True if `value` (an "authorization" metadata value) is "Bearer <token>";
// the token is compared in constant time (kvtier::ConstantTimeEquals).
bool IsBearerToken(std::string_view value, std::string_view token);

// Plaintext HTTP/2 credentials whose every call must carry
// "authorization: Bearer <token>"; other calls end with UNAUTHENTICATED as
// soon as their headers arrive, counted in `metrics` (kAuthFailures; not
// owned, must outlive the server). REQUIRES: `token` is not empty.
std::shared_ptr<grpc::ServerCredentials> BearerTokenServerCredentials(std::string token,
                                                                      ServerMetrics* metrics);

}  // namespace kvtier::server

#endif  // KVTIER_SERVER_GRPC_AUTH_H_
