// Test seam of libkvtier: a client over a given gRPC stub (a mock stub in
// the client's unit tests). Not part of the public header set.
#ifndef KVTIER_CLIENT_KVTIER_CLIENT_INTERNAL_H_
#define KVTIER_CLIENT_KVTIER_CLIENT_INTERNAL_H_

#include <memory>

#include "client/kvtier_client.h"
#include "grpcpp/grpcpp.h"
#include "proto/kvtier.grpc.pb.h"

namespace kvtier::client {

// The one mapping from grpc::Status to absl::Status.
absl::Status FromGrpcStatus(const grpc::Status& status);

// A client without shared memory that calls `stub` (not owned).
std::unique_ptr<KvtierClient> NewClientForStub(kvtier::proto::v1::Kvtier::StubInterface* stub,
                                               const ClientOptions& options);

}  // namespace kvtier::client

#endif  // KVTIER_CLIENT_KVTIER_CLIENT_INTERNAL_H_
