#include "client/grpc_paths.h"

#include "common/status.h"

namespace kvtier::client {

namespace {

absl::Status NoPool() { return absl::FailedPreconditionError("no shared-memory pool mapped"); }

}  // namespace

absl::StatusOr<HeldPlan> GrpcPath::Plan(std::span<const Hash128> keys, double rate,
                                        double attention_doubling_tokens,
                                        uint32_t tokens_per_chunk, uint32_t lease_ms, bool hold) {
  HeldPlan h;
  KVTIER_ASSIGN_OR_RETURN(h.plan,
                          rpc_.PlanLoad(keys, rate, attention_doubling_tokens, tokens_per_chunk));
  if (!hold) return h;
  if (rate <= 0) h.plan.load_chunks = h.plan.tiers.size();
  if (h.plan.load_chunks == 0) return h;
  KVTIER_ASSIGN_OR_RETURN(h.lease_id, rpc_.Pin(keys.first(h.plan.load_chunks), lease_ms));
  return h;
}

absl::StatusOr<PrefetchResult> GrpcPath::PrefetchWithin(std::span<const Hash128> keys,
                                                        uint64_t byte_budget,
                                                        uint32_t deadline_ms) {
  if (byte_budget != 0) {
    return absl::FailedPreconditionError("a prefetch byte budget needs the shared-memory data plane");
  }
  PrefetchResult out;
  KVTIER_ASSIGN_OR_RETURN(out.completed, rpc_.Prefetch(keys, deadline_ms));
  return out;
}

absl::StatusOr<std::vector<absl::Status>> GrpcPath::PutBatch(
    std::span<const Hash128> keys, std::span<const std::span<const uint8_t>> chunks,
    const PutOptions& options) {
  return absl::FailedPreconditionError("no data-plane connection free");
}

absl::Status GrpcPath::Unhold(const HeldChunk& h) {
  if (h.lease_id != 0) return rpc_.Release(h.lease_id);
  if (h.scratch_slot_id != 0) return rpc_.AbortSlot(h.scratch_slot_id);
  return absl::OkStatus();
}

absl::Status GrpcPath::UnholdBatch(std::span<const HeldChunk* const> chunks) {
  absl::Status first;
  for (const HeldChunk* h : chunks) {
    absl::Status st = Unhold(*h);
    if (first.ok()) first = std::move(st);
  }
  return first;
}

absl::StatusOr<WritableSlot> StreamGrpcPath::AllocateSlot(uint64_t bytes) {
  KVTIER_ASSIGN_OR_RETURN(auto slot, rpc_.AllocateSlot(bytes));
  const auto& [id, e] = slot;
  auto r = pool_.ExtentRange(e.pool_id, e.offset, e.length);
  absl::Status st = r.status();
  if (st.ok() && r->size() < bytes) st = absl::InternalError("daemon returned a short slot");
  if (!st.ok()) {
    (void)rpc_.AbortSlot(id);
    return st;
  }
  return WritableSlot{id, r->first(bytes)};
}

absl::Status StreamGrpcPath::Put(const Hash128& key, std::span<const uint8_t> chunk,
                                 const PutOptions& options) {
  KVTIER_ASSIGN_OR_RETURN(WritableSlot slot, AllocateSlot(chunk.size()));
  return rpc_.PutStream(slot, key, chunk, options);
}

absl::StatusOr<HeldChunk> StreamGrpcPath::Hold(const Hash128& key, bool verify) {
  KVTIER_ASSIGN_OR_RETURN(auto held, rpc_.GetHeld(key, verify));
  auto& [h, e] = held;
  auto r = pool_.ExtentRange(e.pool_id, e.offset, e.length);
  if (!r.ok()) {
    (void)Unhold(h);
    return r.status();
  }
  h.data = *r;
  return h;
}

absl::StatusOr<std::vector<absl::StatusOr<HeldChunk>>> StreamGrpcPath::HoldBatch(
    std::span<const Hash128> keys, bool verify) {
  std::vector<absl::StatusOr<HeldChunk>> out;
  for (const Hash128& k : keys) out.push_back(Hold(k, verify));
  return out;
}

absl::Status StreamGrpcPath::ReleaseCopied(const HeldChunk& h) {
  return h.lease_id != 0 ? rpc_.ReleaseAsync(h.lease_id) : Unhold(h);
}

absl::StatusOr<HeldChunk> InlineGrpcPath::Hold(const Hash128& key, bool verify) {
  return NoPool();
}

absl::StatusOr<std::vector<absl::StatusOr<HeldChunk>>> InlineGrpcPath::HoldBatch(
    std::span<const Hash128> keys, bool verify) {
  return NoPool();
}

}  // namespace kvtier::client
