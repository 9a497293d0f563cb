// The gRPC adapter: translates kvtier.proto messages to KvService calls and
// back, checks the protocol version and (for TCP peers) the bearer token,
// maps absl::Status to grpc::Status in one function, counts metrics, bounds
// what calls hold (grpc_calls.h), and delegates. No request logic lives here.
#ifndef KVTIER_SERVER_GRPC_SERVICE_H_
#define KVTIER_SERVER_GRPC_SERVICE_H_

#include <chrono>
#include <string>

#include "absl/status/status.h"
#include "grpcpp/grpcpp.h"
#include "wire/kvtier.grpc.pb.h"
#include "server/grpc_calls.h"
#include "server/metrics.h"
#include "server/service.h"
#include "server/tenants.h"

namespace kvtier::server {

// The one mapping from absl::Status to grpc::Status (same numeric codes).
grpc::Status ToGrpcStatus(const absl::Status& status);

struct AdapterOptions {
  // Bearer token required from every peer that is not on a Unix socket
  // ("authorization: Bearer <token>"); empty: TCP peers are refused. The TCP
  // listener checks it before a call starts (grpc_auth.h); the adapter
  // checks it again. Default: ""
  std::string token;
  // The daemon's tenants (not owned; must outlive the adapter). With a
  // tenants file every call is a tenant's: on TCP the tenant of its bearer
  // token (which must agree with the TLS identity's tenant, if that has
  // one); on the Unix socket the tenant of its bearer token if it sends one,
  // else the tenant of the daemon's uid (the socket is owner-only). A call
  // of no tenant is UNAUTHENTICATED. Default: nullptr (one tenant, keys as
  // sent)
  const TenantRegistry* tenants = nullptr;
  // Path of the side-channel socket that passes the pool memfd, reported by
  // Health. Default: "" (no shared-memory data plane)
  std::string shm_socket;
  // The pool's identity (wire::shm::PoolIdOf its memfd), named in every
  // extent a reply hands out. Default: 0 (no shared-memory data plane)
  uint64_t shm_pool_id = 0;
  // Largest message accepted, reported by Health. Default: 0
  uint64_t max_message_bytes = 0;
  // Threads that run this listener's requests. Default: 8
  int threads = 8;
  // Requests that may wait for a thread; beyond them a call gets
  // RESOURCE_EXHAUSTED at once. Default: 1024
  size_t max_queued = 1024;
  // Bytes in flight and deadlines of this listener's calls.
  CallLimits limits;
  // Name of the worker threads (at most 15 characters). Default: "kvtierd-grpc"
  const char* thread_name = "kvtierd-grpc";
};

// The service with every method on gRPC's callback API over raw byte
// buffers: the adapter parses requests itself, so a malformed message is
// INVALID_ARGUMENT with a reason (gRPC's own parsing answers UNIMPLEMENTED).
using RawKvtierService = kvtier::proto::v1::Kvtier::WithRawCallbackMethod_Lookup<
    kvtier::proto::v1::Kvtier::WithRawCallbackMethod_AllocateSlot<
    kvtier::proto::v1::Kvtier::WithRawCallbackMethod_AbortSlot<
    kvtier::proto::v1::Kvtier::WithRawCallbackMethod_Put<
    kvtier::proto::v1::Kvtier::WithRawCallbackMethod_PutStream<
    kvtier::proto::v1::Kvtier::WithRawCallbackMethod_Get<
    kvtier::proto::v1::Kvtier::WithRawCallbackMethod_Prefetch<
    kvtier::proto::v1::Kvtier::WithRawCallbackMethod_Pin<
    kvtier::proto::v1::Kvtier::WithRawCallbackMethod_Renew<
    kvtier::proto::v1::Kvtier::WithRawCallbackMethod_Release<
    kvtier::proto::v1::Kvtier::WithRawCallbackMethod_Delete<
    kvtier::proto::v1::Kvtier::WithRawCallbackMethod_Stats<
    kvtier::proto::v1::Kvtier::WithRawCallbackMethod_Health<
    kvtier::proto::v1::Kvtier::Service>>>>>>>>>>>>>;

// One listener's gRPC service: a call's handler checks the peer, parses the
// request and checks its version, reserves the chunk bytes the call will
// hold, and queues the request logic on the adapter's worker pool; no gRPC
// thread waits on a tier, and no thread at all waits on a slow reader. Calls
// that only read or update the engine's memory (Health, Stats, Renew,
// Release, AbortSlot; Lookup and Pin on a node without a remote tier) run on
// the gRPC thread.
// Thread-safe; `service` and `metrics` are not owned.
class GrpcAdapter final : public RawKvtierService {
 public:
  GrpcAdapter(KvService* service, ServerMetrics* metrics, AdapterOptions options);
  // REQUIRES: the server this adapter is registered with has shut down.
  ~GrpcAdapter() override;

  // Chunk bytes held by this listener's calls, and calls cancelled at a
  // deadline (write or stream idle timeout).
  uint64_t inflight_bytes() { return tracker_.inflight_bytes(); }
  uint64_t cancelled_calls() { return tracker_.cancelled_calls(); }

  using Ctx = grpc::CallbackServerContext;
  using Bytes = grpc::ByteBuffer;
  grpc::ServerUnaryReactor* Lookup(Ctx* ctx, const Bytes* req, Bytes* resp) override;
  grpc::ServerUnaryReactor* AllocateSlot(Ctx* ctx, const Bytes* req, Bytes* resp) override;
  grpc::ServerUnaryReactor* AbortSlot(Ctx* ctx, const Bytes* req, Bytes* resp) override;
  grpc::ServerUnaryReactor* Put(Ctx* ctx, const Bytes* req, Bytes* resp) override;
  grpc::ServerReadReactor<Bytes>* PutStream(Ctx* ctx, Bytes* resp) override;
  grpc::ServerUnaryReactor* Get(Ctx* ctx, const Bytes* req, Bytes* resp) override;
  grpc::ServerUnaryReactor* Prefetch(Ctx* ctx, const Bytes* req, Bytes* resp) override;
  grpc::ServerUnaryReactor* Pin(Ctx* ctx, const Bytes* req, Bytes* resp) override;
  grpc::ServerUnaryReactor* Renew(Ctx* ctx, const Bytes* req, Bytes* resp) override;
  grpc::ServerUnaryReactor* Release(Ctx* ctx, const Bytes* req, Bytes* resp) override;
  grpc::ServerUnaryReactor* Delete(Ctx* ctx, const Bytes* req, Bytes* resp) override;
  grpc::ServerUnaryReactor* Stats(Ctx* ctx, const Bytes* req, Bytes* resp) override;
  grpc::ServerUnaryReactor* Health(Ctx* ctx, const Bytes* req, Bytes* resp) override;

 private:
  class UnaryCall;
  class PutStreamCall;
  // How Serve runs a call's body.
  struct ServeMode {
    bool check_version = true;  // Health answers any version
    bool run_inline = false;    // on the gRPC thread (never blocks)
  };
  // Starts a unary call: checks the peer, parses `in` as a `Req` and checks
  // its version; then runs `body` (absl::Status(UnaryCall&, const Req&,
  // Resp&)) on the worker pool and answers with the `Resp` it filled.
  template <typename Req, typename Resp, typename Body>
  grpc::ServerUnaryReactor* Serve(Method m, Ctx* ctx, const Bytes* in, Bytes* out, Body body,
                                  ServeMode mode = {});
  // The tenant of the call's client, or UNAUTHENTICATED.
  absl::StatusOr<const Tenant*> Authorize(Ctx* ctx);
  // Whether the call may name pool memory: with tenants, only Unix-socket
  // calls do. A TCP client cannot map the pool, and a slot it could commit
  // unwritten would hold the bytes of a chunk freed there (another
  // tenant's).
  bool PoolAccessOf(Ctx* ctx) const;
  absl::Status CheckVersion(uint32_t version) const;
  // A call's outcome: encodes `resp` into `out` on success, records the
  // method's metrics, gives the answer the write timeout; the status to
  // Finish the call with.
  grpc::Status Conclude(Method m, std::chrono::steady_clock::time_point t0,
                        CallTracker::Entry* entry, absl::Status st,
                        const google::protobuf::MessageLite* resp, Bytes* out);

  KvService* const service_;
  ServerMetrics* const metrics_;
  const AdapterOptions options_;
  const TenantRegistry default_tenants_;  // options_.tenants when it is null
  const TenantRegistry* const tenants_;
  // Without a remote tier, lookups and pins read only the engine's memory:
  // they run on the gRPC thread (a hop to the pool costs a round trip's worth
  // of wakeups). With one, they may ask peers, so they go to the pool.
  const bool memory_only_engine_;
  CallTracker tracker_;
  // Last member: destroyed (its queued requests run) before the tracker.
  WorkerPool pool_;
};

}  // namespace kvtier::server

#endif  // KVTIER_SERVER_GRPC_SERVICE_H_
