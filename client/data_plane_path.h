// DataPlanePath: the DataPath over one lent shared-memory data-plane
// connection (client/data_conn.h): every operation one binary frame each way
// (a put: a frame per piece copied), chunk bytes in the daemon's pool. The
// frames are specified in wire/DATA_PLANE.md. Internal to client/.
#ifndef KVTIER_CLIENT_DATA_PLANE_PATH_H_
#define KVTIER_CLIENT_DATA_PLANE_PATH_H_

#include "client/data_conn.h"
#include "client/data_path.h"

namespace kvtier::client {

// Lives for one call and holds its connection's lease for that long; not
// thread-safe. Holds taken here name the connection (HeldChunk::connection,
// HeldPlan::connection): the daemon takes their release only over it.
class DataPlanePath final : public DataPath {
 public:
  // REQUIRES: `lease` is not empty. `verifier` (may be null; not owned)
  // hashes what a get copies on its helper thread.
  DataPlanePath(ConnLease lease, wire::PipelinedCopyVerifier* verifier)
      : lease_(std::move(lease)), c_(*lease_), verifier_(verifier) {}

  absl::StatusOr<std::vector<Tier>> Lookup(std::span<const Hash128> keys) override;
  // A plan without attention_doubling_tokens goes as kPlanLoad /
  // kPlanAndHold, which every daemon of this protocol version serves; one
  // with it as their kPlan*Attention forms.
  absl::StatusOr<HeldPlan> Plan(std::span<const Hash128> keys, double prefill_tokens_per_s,
                                double attention_doubling_tokens, uint32_t tokens_per_chunk,
                                uint32_t lease_ms, bool hold) override;
  absl::Status ReleasePlan(const HeldPlan& plan) override;
  absl::StatusOr<PrefetchResult> PrefetchWithin(std::span<const Hash128> keys,
                                                uint64_t byte_budget,
                                                uint32_t deadline_ms) override;
  // The streamed put: allocate (or take the connection's spare slot), then
  // copy the chunk into the slot piece by piece with a progress frame after
  // each (no answer awaited), so that the daemon checks piece i while this
  // thread copies piece i + 1; the commit frame's answer says whether it is
  // stored. A connection that fails midway is closed, and the daemon frees
  // the slot.
  absl::Status Put(const Hash128& key, std::span<const uint8_t> chunk,
                   const PutOptions& options) override;
  absl::StatusOr<std::vector<absl::Status>> PutBatch(
      std::span<const Hash128> keys, std::span<const std::span<const uint8_t>> chunks,
      const PutOptions& options) override;
  // A slot on this connection for a caller that writes it in place (a GPU
  // store), committed or aborted on this connection (WritableSlot::connection).
  absl::StatusOr<WritableSlot> AllocateSlot(uint64_t bytes);
  absl::Status CommitSlot(uint64_t slot_id, const Hash128& key, const PutOptions& options);
  absl::Status AbortSlot(uint64_t slot_id);
  absl::StatusOr<std::pair<uint64_t, Tier>> Get(const Hash128& key, ChunkSink sink) override {
    return GetThroughPool(key, sink, verifier_);
  }
  absl::StatusOr<HeldChunk> Hold(const Hash128& key, bool verify) override;
  absl::StatusOr<std::vector<absl::StatusOr<HeldChunk>>> HoldBatch(std::span<const Hash128> keys,
                                                                   bool verify) override;
  absl::Status Unhold(const HeldChunk& chunk) override;
  // One kReleaseBatch frame per kMaxBatchItems chunks; stops at the first
  // frame that fails.
  absl::Status UnholdBatch(std::span<const HeldChunk* const> chunks) override;

 protected:
  // A lease's release is sent and its answer read at the connection's next
  // use; a scratch slot is aborted as Unhold does.
  absl::Status ReleaseCopied(const HeldChunk& chunk) override;

 private:
  // One kCommitBatch frame: a status per slot.
  absl::StatusOr<std::vector<absl::Status>> CommitSlots(std::span<const uint64_t> ids,
                                                        std::span<const Hash128> keys,
                                                        const PutOptions& options);

  ConnLease lease_;
  DataConn& c_;
  wire::PipelinedCopyVerifier* const verifier_;
};

}  // namespace kvtier::client

#endif  // KVTIER_CLIENT_DATA_PLANE_PATH_H_
