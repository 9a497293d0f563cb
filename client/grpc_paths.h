// The DataPaths over gRPC (client/rpc_client.h): StreamGrpcPath keeps chunk
// bytes in the daemon's shared-memory pool (a Unix socket whose data plane
// is busy or absent), InlineGrpcPath carries them in the messages (TCP, or
// shared memory off). Internal to client/.
#ifndef KVTIER_CLIENT_GRPC_PATHS_H_
#define KVTIER_CLIENT_GRPC_PATHS_H_

#include "client/data_path.h"
#include "client/rpc_client.h"
#include "client/shm_pool.h"

namespace kvtier::client {

// What both gRPC paths do alike: lookups, plans (a plan's hold is a Pin),
// prefetches (no byte budget), releases of holds one call each.
// Thread-safe: one path serves every call that takes it. `rpc` (not owned)
// outlives the path.
class GrpcPath : public DataPath {
 public:
  explicit GrpcPath(RpcClient* rpc) : rpc_(*rpc) {}

  absl::StatusOr<std::vector<Tier>> Lookup(std::span<const Hash128> keys) override {
    return rpc_.Lookup(keys);
  }
  // PlanLoad, then with `hold` a Pin of the chunks to load (every hit
  // without a rate); the plan names no connection.
  absl::StatusOr<HeldPlan> Plan(std::span<const Hash128> keys, double prefill_tokens_per_s,
                                double attention_doubling_tokens, uint32_t tokens_per_chunk,
                                uint32_t lease_ms, bool hold) override;
  absl::Status ReleasePlan(const HeldPlan& plan) override { return rpc_.Release(plan.lease_id); }
  // FailedPrecondition for a byte budget (it needs the data plane).
  absl::StatusOr<PrefetchResult> PrefetchWithin(std::span<const Hash128> keys,
                                                uint64_t byte_budget,
                                                uint32_t deadline_ms) override;
  // Always FailedPrecondition: a batch in one exchange needs the data plane.
  absl::StatusOr<std::vector<absl::Status>> PutBatch(
      std::span<const Hash128> keys, std::span<const std::span<const uint8_t>> chunks,
      const PutOptions& options) override;
  // Release of the lease, or abort of the scratch slot (a hold taken on a
  // data-plane connection that has since closed gets NotFound: the daemon
  // ended it with the connection).
  absl::Status Unhold(const HeldChunk& chunk) override;
  absl::Status UnholdBatch(std::span<const HeldChunk* const> chunks) override;

 protected:
  RpcClient& rpc_;
};

// Chunk bytes in the daemon's pool, moved by gRPC calls: a put streamed into
// a slot (PutStream), a get held in place (Get in shared-memory mode).
class StreamGrpcPath final : public GrpcPath {
 public:
  // `pool` (not owned) outlives the path; `verifier` (may be null; not
  // owned) hashes what a get copies on its helper thread.
  StreamGrpcPath(RpcClient* rpc, SharedPool* pool, wire::PipelinedCopyVerifier* verifier)
      : GrpcPath(rpc), pool_(*pool), verifier_(verifier) {}

  // KvtierClient::AllocateSlot over gRPC: Internal (the slot aborted) if the
  // daemon names a slot outside the pool or shorter than `bytes`.
  absl::StatusOr<WritableSlot> AllocateSlot(uint64_t bytes);

  // AllocateSlot, then RpcClient::PutStream.
  absl::Status Put(const Hash128& key, std::span<const uint8_t> chunk,
                   const PutOptions& options) override;
  absl::StatusOr<std::pair<uint64_t, Tier>> Get(const Hash128& key, ChunkSink sink) override {
    return GetThroughPool(key, sink, verifier_);
  }
  absl::StatusOr<HeldChunk> Hold(const Hash128& key, bool verify) override;
  // Hold of each key, one call each.
  absl::StatusOr<std::vector<absl::StatusOr<HeldChunk>>> HoldBatch(std::span<const Hash128> keys,
                                                                   bool verify) override;

 protected:
  // A lease goes back without waiting for the answer (ReleaseAsync).
  absl::Status ReleaseCopied(const HeldChunk& chunk) override;

 private:
  SharedPool& pool_;
  wire::PipelinedCopyVerifier* const verifier_;
};

// Chunk bytes inline in the gRPC messages; no holds (FailedPrecondition).
class InlineGrpcPath final : public GrpcPath {
 public:
  using GrpcPath::GrpcPath;

  absl::Status Put(const Hash128& key, std::span<const uint8_t> chunk,
                   const PutOptions& options) override {
    return rpc_.PutInline(key, chunk, options);
  }
  absl::StatusOr<std::pair<uint64_t, Tier>> Get(const Hash128& key, ChunkSink sink) override {
    return rpc_.GetInline(key, sink);
  }
  absl::StatusOr<HeldChunk> Hold(const Hash128& key, bool verify) override;
  absl::StatusOr<std::vector<absl::StatusOr<HeldChunk>>> HoldBatch(std::span<const Hash128> keys,
                                                                   bool verify) override;

 protected:
  absl::Status ReleaseCopied(const HeldChunk& chunk) override { return Unhold(chunk); }
};

}  // namespace kvtier::client

#endif  // KVTIER_CLIENT_GRPC_PATHS_H_
