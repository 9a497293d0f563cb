// Test seams of libkvtier: a client over a given gRPC stub (a mock stub in
// the client's unit tests), and the shared-memory handshake (for tests that
// speak the data-plane protocol themselves). Not part of the public header set.
#ifndef KVTIER_CLIENT_KVTIER_CLIENT_INTERNAL_H_
#define KVTIER_CLIENT_KVTIER_CLIENT_INTERNAL_H_

#include <cstdint>
#include <memory>
#include <string>

#include "client/kvtier_client.h"
#include "grpcpp/grpcpp.h"
#include "wire/kvtier.grpc.pb.h"

namespace kvtier::client {

// The one mapping from grpc::Status to absl::Status.
absl::Status FromGrpcStatus(const grpc::Status& status);

// A client without shared memory that calls `stub` (not owned).
std::unique_ptr<KvtierClient> NewClientForStub(kvtier::proto::v1::Kvtier::StubInterface* stub,
                                               const ClientOptions& options);

// A connection to the daemon's side channel (`<socket>.shm`) after its first
// message: the socket, the pool's memfd and the pool size. The caller owns
// both descriptors.
struct ShmHandshake {
  int sock = -1;
  int memfd = -1;
  uint64_t size = 0;
};

// Connects to `path` (5 s send/receive timeouts) and receives the pool size
// and memfd (SCM_RIGHTS). FailedPrecondition when the daemon is not there or
// sends no descriptor (it refuses other uids).
absl::StatusOr<ShmHandshake> ConnectShm(const std::string& path);

}  // namespace kvtier::client

#endif  // KVTIER_CLIENT_KVTIER_CLIENT_INTERNAL_H_
