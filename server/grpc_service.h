// The gRPC adapter: translates kvtier.proto messages to KvService calls and
// back, checks the protocol version and (for TCP peers) the bearer token,
// maps absl::Status to grpc::Status in one function, counts metrics, and
// delegates. No request logic lives here.
#ifndef KVTIER_SERVER_GRPC_SERVICE_H_
#define KVTIER_SERVER_GRPC_SERVICE_H_

#include <string>

#include "absl/status/status.h"
#include "grpcpp/grpcpp.h"
#include "proto/kvtier.grpc.pb.h"
#include "server/metrics.h"
#include "server/service.h"

namespace kvtier::server {

// The one mapping from absl::Status to grpc::Status (same numeric codes).
grpc::Status ToGrpcStatus(const absl::Status& status);

// Constant-time comparison of two secrets (time depends on the lengths only).
bool ConstantTimeEquals(std::string_view a, std::string_view b);

struct AdapterOptions {
  // Bearer token required from every peer that is not on a Unix socket
  // ("authorization: Bearer <token>"); empty: TCP peers are refused.
  // Default: ""
  std::string token;
  // Path of the side-channel socket that passes the pool memfd, reported by
  // Health. Default: "" (no shared-memory data plane)
  std::string shm_socket;
  // Largest message accepted, reported by Health. Default: 0
  uint64_t max_message_bytes = 0;
};

// Thread-safe; `service` and `metrics` are not owned.
class GrpcAdapter final : public kvtier::proto::v1::Kvtier::Service {
 public:
  GrpcAdapter(KvService* service, ServerMetrics* metrics, AdapterOptions options);

  grpc::Status Lookup(grpc::ServerContext* ctx, const kvtier::proto::v1::LookupRequest* req,
                      kvtier::proto::v1::LookupResponse* resp) override;
  grpc::Status AllocateSlot(grpc::ServerContext* ctx, const kvtier::proto::v1::AllocateSlotRequest* req,
                      kvtier::proto::v1::AllocateSlotResponse* resp) override;
  grpc::Status AbortSlot(grpc::ServerContext* ctx, const kvtier::proto::v1::AbortSlotRequest* req,
                      kvtier::proto::v1::AbortSlotResponse* resp) override;
  grpc::Status Put(grpc::ServerContext* ctx, const kvtier::proto::v1::PutRequest* req,
                      kvtier::proto::v1::PutResponse* resp) override;
  grpc::Status PutStream(grpc::ServerContext* ctx,
                         grpc::ServerReader<kvtier::proto::v1::PutStreamRequest>* reader,
                         kvtier::proto::v1::PutResponse* resp) override;
  grpc::Status Get(grpc::ServerContext* ctx, const kvtier::proto::v1::GetRequest* req,
                      kvtier::proto::v1::GetResponse* resp) override;
  grpc::Status Prefetch(grpc::ServerContext* ctx, const kvtier::proto::v1::PrefetchRequest* req,
                      kvtier::proto::v1::PrefetchResponse* resp) override;
  grpc::Status Pin(grpc::ServerContext* ctx, const kvtier::proto::v1::PinRequest* req,
                      kvtier::proto::v1::PinResponse* resp) override;
  grpc::Status Renew(grpc::ServerContext* ctx, const kvtier::proto::v1::RenewRequest* req,
                      kvtier::proto::v1::PinResponse* resp) override;
  grpc::Status Release(grpc::ServerContext* ctx, const kvtier::proto::v1::ReleaseRequest* req,
                      kvtier::proto::v1::ReleaseResponse* resp) override;
  grpc::Status Delete(grpc::ServerContext* ctx, const kvtier::proto::v1::DeleteRequest* req,
                      kvtier::proto::v1::DeleteResponse* resp) override;
  grpc::Status Stats(grpc::ServerContext* ctx, const kvtier::proto::v1::StatsRequest* req,
                      kvtier::proto::v1::StatsResponse* resp) override;
  grpc::Status Health(grpc::ServerContext* ctx, const kvtier::proto::v1::HealthRequest* req,
                      kvtier::proto::v1::HealthResponse* resp) override;

 private:
  // Runs `body` if the peer may call (Unix socket, or TCP with the token) and
  // the request's version is served; records the metrics of the call.
  template <typename Body>
  grpc::Status Serve(Method m, grpc::ServerContext* ctx, uint32_t version, Body body);
  absl::Status Authorize(grpc::ServerContext* ctx);

  KvService* const service_;
  ServerMetrics* const metrics_;
  const AdapterOptions options_;
};

}  // namespace kvtier::server

#endif  // KVTIER_SERVER_GRPC_SERVICE_H_
