// The one interface behind which libkvtier's transports sit: a DataPath
// carries the operations whose transport differs — lookups and plans, puts,
// gets, holds and their releases. Three implementations:
//
//   DataPlanePath   (client/data_plane_path.h) binary frames over a lent
//                   shared-memory data-plane connection; chunk bytes in the
//                   daemon's pool (wire/DATA_PLANE.md)
//   StreamGrpcPath  (client/grpc_paths.h) gRPC calls with chunk bytes in the
//                   daemon's pool: a put streamed into a slot, a get held in
//                   place (a Unix socket whose data plane is busy or absent)
//   InlineGrpcPath  (client/grpc_paths.h) gRPC calls with chunk bytes inline
//                   (TCP, or shared memory off)
//
// The client (kvtier_client.cc) picks one path per call, as Mooncake's
// MultiTransport picks a transport per request, and only there. Operations
// that never differ (Delete, Pin, Stats, slot commits) go straight to gRPC
// (client/rpc_client.h). Internal to client/.
#ifndef KVTIER_CLIENT_DATA_PATH_H_
#define KVTIER_CLIENT_DATA_PATH_H_

#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/kvtier_client.h"
#include "common/hash.h"

namespace kvtier::wire {
class PipelinedCopyVerifier;
}  // namespace kvtier::wire

namespace kvtier::client {

// A tier as kvtier.proto numbers it (the data plane's frames use the same
// numbers); kUnknown for a number this client does not know.
Tier TierFromWire(int t);

// InvalidArgument: a caller's buffer of `have` bytes for a chunk of `need`.
absl::Status BufferTooSmall(size_t have, size_t need);

// Where a get puts the chunk: `out` (a caller's buffer, InvalidArgument if
// too small) or `vec` (resized to the chunk). Exactly one is set.
struct ChunkSink {
  std::span<uint8_t>* out = nullptr;
  std::vector<uint8_t>* vec = nullptr;
};

// The transport of one call. An implementation is used by one call at a
// time unless it says otherwise; each method's contract is that of the
// KvtierClient method of the same name, with the differences noted.
class DataPath {
 public:
  virtual ~DataPath() = default;

  // REQUIRES (every method taking keys): keys.size() <= kMaxBatchKeys where
  // the path carries them in one frame (DataPlanePath).
  virtual absl::StatusOr<std::vector<Tier>> Lookup(std::span<const Hash128> keys) = 0;
  // PlanLoad; with `hold`, LookupAndHold under a lease of `lease_ms`.
  virtual absl::StatusOr<HeldPlan> Plan(std::span<const Hash128> keys, double prefill_tokens_per_s,
                                        double attention_doubling_tokens,
                                        uint32_t tokens_per_chunk, uint32_t lease_ms,
                                        bool hold) = 0;
  // Ends a plan's hold. REQUIRES: plan.lease_id != 0.
  virtual absl::Status ReleasePlan(const HeldPlan& plan) = 0;
  virtual absl::StatusOr<PrefetchResult> PrefetchWithin(std::span<const Hash128> keys,
                                                        uint64_t byte_budget,
                                                        uint32_t deadline_ms) = 0;

  virtual absl::Status Put(const Hash128& key, std::span<const uint8_t> chunk,
                           const PutOptions& options) = 0;
  // KvtierClient::PutBatchShared after the client's checks (REQUIRES: as
  // many chunks as keys, 1..kMaxBatchKeys, no key twice). FailedPrecondition,
  // nothing stored, on a path that cannot do it in one exchange.
  virtual absl::StatusOr<std::vector<absl::Status>> PutBatch(
      std::span<const Hash128> keys, std::span<const std::span<const uint8_t>> chunks,
      const PutOptions& options) = 0;

  // The chunk's bytes into `sink`, and their length and tier.
  virtual absl::StatusOr<std::pair<uint64_t, Tier>> Get(const Hash128& key, ChunkSink sink) = 0;

  // FailedPrecondition on a path without shared memory.
  virtual absl::StatusOr<HeldChunk> Hold(const Hash128& key, bool verify) = 0;
  // KvtierClient::HoldBatch after the client's checks (REQUIRES: at most
  // kMaxBatchKeys keys, no key twice).
  virtual absl::StatusOr<std::vector<absl::StatusOr<HeldChunk>>> HoldBatch(
      std::span<const Hash128> keys, bool verify) = 0;
  // Ends a hold this path took (a DataPlanePath: on its connection).
  // REQUIRES: the chunk holds a lease or a scratch slot.
  virtual absl::Status Unhold(const HeldChunk& chunk) = 0;
  // Unhold of each chunk; the first error, every hold still ended.
  virtual absl::Status UnholdBatch(std::span<const HeldChunk* const> chunks) = 0;
  // Unhold of a chunk whose bytes are no longer read, its answer not
  // awaited where the path can (ReleaseCopied).
  absl::Status UnholdNoWait(const HeldChunk& chunk) { return ReleaseCopied(chunk); }

 protected:
  // Ends the hold of a chunk whose bytes a get has copied out; the answer
  // need not be awaited (an error there means the lease had expired, which
  // frees the chunk just the same). REQUIRES: the hold came from this path.
  virtual absl::Status ReleaseCopied(const HeldChunk& chunk) = 0;

  // Get through the pool, for paths that hold chunks in place: hold, copy
  // out and check the copy in one pass (with `verifier` if set), then
  // ReleaseCopied. On a mismatch the daemon verifies the stored chunk (and
  // drops it if it is corrupt: DataLoss); if it finds it whole (the bytes
  // changed under the copy), one more try, then DataLoss.
  absl::StatusOr<std::pair<uint64_t, Tier>> GetThroughPool(
      const Hash128& key, ChunkSink sink, wire::PipelinedCopyVerifier* verifier);
};

}  // namespace kvtier::client

#endif  // KVTIER_CLIENT_DATA_PATH_H_
