// How a node names its peers' sockets: "host:port" addresses (IPv4, [IPv6]
// or a name) parsed, resolved and printed for the UCX transport's listener
// and endpoints. Thread-safe (no state).
#ifndef KVTIER_CLUSTER_PEER_ADDRESS_H_
#define KVTIER_CLUSTER_PEER_ADDRESS_H_

#include <sys/socket.h>

#include <cstdint>
#include <string>
#include <utility>

#include "absl/status/statusor.h"

namespace kvtier::cluster {

// Splits "host:port" (IPv4, [IPv6] or a name). InvalidArgument otherwise.
absl::StatusOr<std::pair<std::string, uint16_t>> ParseHostPort(const std::string& address);

// The first address "host:port" resolves to (getaddrinfo, any family).
// InvalidArgument for a malformed address; Unavailable if it does not resolve.
absl::StatusOr<sockaddr_storage> ResolveHostPort(const std::string& address);

// "a.b.c.d:port" or "[v6]:port". REQUIRES: an AF_INET or AF_INET6 address.
std::string SockaddrToString(const sockaddr_storage& ss);

// The length of the sockaddr an AF_INET or AF_INET6 storage holds.
socklen_t SockaddrLen(const sockaddr_storage& ss);

// A peer's name for messages: worker addresses ("ucx:<hex>", hundreds of
// digits) are cut short.
std::string PrintablePeer(const std::string& peer);

}  // namespace kvtier::cluster

#endif  // KVTIER_CLUSTER_PEER_ADDRESS_H_
