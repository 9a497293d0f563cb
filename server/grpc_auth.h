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

#include "grpcpp/security/server_credentials.h"

namespace kvtier::server {

class ServerMetrics;

// Constant-time comparison of two secrets: the time depends on the length of
// `expected` only, never on where the two differ or on `given`'s length.
bool ConstantTimeEquals(std::string_view given, std::string_view expected);

// True if `value` (an "authorization" metadata value) is "Bearer <token>".
bool IsBearerToken(std::string_view value, std::string_view token);

// Plaintext HTTP/2 credentials whose every call must carry
// "authorization: Bearer <token>"; other calls end with UNAUTHENTICATED as
// soon as their headers arrive, counted in `metrics` (kAuthFailures; not
// owned, must outlive the server). REQUIRES: `token` is not empty.
std::shared_ptr<grpc::ServerCredentials> BearerTokenServerCredentials(std::string token,
                                                                      ServerMetrics* metrics);
// The same with the check in `accepts`: true for an "authorization" value
// that opens a call (e.g. any tenant's token). Thread-safe, non-blocking.
std::shared_ptr<grpc::ServerCredentials> BearerTokenServerCredentials(
    std::function<bool(std::string_view authorization)> accepts, ServerMetrics* metrics);

}  // namespace kvtier::server

#endif  // KVTIER_SERVER_GRPC_AUTH_H_
