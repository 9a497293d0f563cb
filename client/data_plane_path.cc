#include "client/data_plane_path.h"

#include <algorithm>
#include <chrono>
#include <optional>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "wire/chunk_check.h"

namespace kvtier::client {

namespace w = wire::shm;
using Op = DataConn::Op;

namespace {

// A per-item status code of a batch answer (0 = OK); kUnknown for a code
// abseil does not define.
absl::StatusCode CodeOf(uint32_t code) {
  return code <= 16 ? static_cast<absl::StatusCode>(code) : absl::StatusCode::kUnknown;
}

// The keys after a batch header (kLookup, kPlanLoad, kGetBatch, kPrefetch).
void WriteKeys(w::Writer& b, std::span<const Hash128> keys) {
  for (const Hash128& k : keys) b.Raw(k.bytes.data(), w::kKeyBytes);
}

// The end of a hold's answer (kGet's reply, a kGetBatch item), from the
// chunk's length on: the hold it names on connection `serial`, and where in
// the pool the chunk is (not yet checked against the pool).
HeldChunk ReadHold(w::Reader& r, Tier tier, uint64_t serial, uint64_t* offset, uint64_t* length) {
  HeldChunk h;
  h.tier = tier;
  (void)r.U64();  // chunk bytes: the extent's length
  *offset = r.U64();
  *length = r.U64();
  h.lease_id = r.U64();
  h.scratch_slot_id = r.U64();
  h.connection = serial;
  return h;
}

}  // namespace

absl::StatusOr<std::vector<Tier>> DataPlanePath::Lookup(std::span<const Hash128> keys) {
  std::vector<uint8_t> req(w::kBatchHeaderBytes + keys.size() * w::kKeyBytes), rep;
  w::Writer b(req.data());
  b.U32(static_cast<uint32_t>(keys.size())).U32(0);
  WriteKeys(b, keys);
  KVTIER_RETURN_IF_ERROR(c_.CallBatch(Op::kLookup, req.data(), b.size(), &rep));
  if (rep.size() < w::kBatchHeaderBytes) return c_.BadAnswer(Op::kLookup);
  w::Reader r(rep.data());
  const uint32_t hits = r.U32();
  if (hits > keys.size() || rep.size() != w::kBatchHeaderBytes + hits) {
    return c_.BadAnswer(Op::kLookup);
  }
  (void)r.U32();
  std::vector<Tier> out(hits);
  for (Tier& t : out) t = TierFromWire(r.U8());
  return out;
}

absl::StatusOr<HeldPlan> DataPlanePath::Plan(std::span<const Hash128> keys, double rate,
                                             double attention_doubling_tokens,
                                             uint32_t tokens_per_chunk, uint32_t lease_ms,
                                             bool hold) {
  // NaN is not 0 either: it goes to the daemon, which refuses it.
  const bool attention = !(attention_doubling_tokens == 0);
  const Op op = attention ? (hold ? Op::kPlanAndHoldAttention : Op::kPlanLoadAttention)
                          : (hold ? Op::kPlanAndHold : Op::kPlanLoad);
  const uint32_t fixed = attention ? w::kPlanAttentionBytes : w::kPlanBytes;
  std::vector<uint8_t> req(fixed + keys.size() * w::kKeyBytes), rep;
  w::Writer b(req.data());
  b.U32(static_cast<uint32_t>(keys.size())).U32(tokens_per_chunk).F64(rate);
  b.U32(hold ? lease_ms : 0).U32(0);
  if (attention) b.F64(attention_doubling_tokens);
  WriteKeys(b, keys);
  KVTIER_RETURN_IF_ERROR(c_.CallBatch(op, req.data(), b.size(), &rep));
  if (rep.size() < w::kPlanReplyBytes) return c_.BadAnswer(op);
  w::Reader r(rep.data());
  const uint32_t hits = r.U32(), load = r.U32();
  if (hits > keys.size() || load > hits ||
      rep.size() != w::kPlanReplyBytes + uint64_t{hits} * w::kPlanHitBytes) {
    return c_.BadAnswer(op);
  }
  HeldPlan h;
  h.plan.load_chunks = load;
  h.plan.load_chunks_us = r.F64();
  h.plan.saved_us = r.F64();
  h.lease_id = r.U64();
  h.expires_at_us = static_cast<int64_t>(r.U64());
  h.connection = h.lease_id != 0 ? c_.serial() : 0;
  for (uint32_t i = 0; i < hits; ++i) {
    h.plan.tiers.push_back(TierFromWire(r.U8()));
    (void)r.U8();
    (void)r.U16();
    (void)r.U32();
    h.plan.chunk_bytes.push_back(r.U64());
    h.plan.load_us.push_back(r.F64());
  }
  return h;
}

absl::Status DataPlanePath::ReleasePlan(const HeldPlan& plan) {
  uint8_t req[w::kU64Bytes];
  w::Writer(req).U64(plan.lease_id);
  return c_.Call(Op::kRelease, req, sizeof(req), nullptr, 0);
}

absl::StatusOr<PrefetchResult> DataPlanePath::PrefetchWithin(std::span<const Hash128> keys,
                                                             uint64_t byte_budget,
                                                             uint32_t deadline_ms) {
  std::vector<uint8_t> req(w::kPrefetchBytes + keys.size() * w::kKeyBytes), rep;
  w::Writer b(req.data());
  b.U32(static_cast<uint32_t>(keys.size())).U32(deadline_ms).U64(byte_budget);
  WriteKeys(b, keys);
  KVTIER_RETURN_IF_ERROR(c_.CallBatch(Op::kPrefetch, req.data(), b.size(), &rep));
  if (rep.size() != w::kPrefetchReplyBytes) return c_.BadAnswer(Op::kPrefetch);
  w::Reader r(rep.data());
  PrefetchResult out;
  out.completed = r.U8() != 0;
  (void)r.U8();
  (void)r.U16();
  out.keys = r.U32();
  out.bytes = r.U64();
  return out;
}

absl::Status DataPlanePath::Put(const Hash128& key, std::span<const uint8_t> chunk,
                                const PutOptions& options) {
  constexpr size_t kPieceBytes = size_t{1} << 20;
  uint8_t req[w::kMaxRequestPayloadBytes], rep[w::kSlotReplyBytes];
  KVTIER_RETURN_IF_ERROR(c_.Settle());
  uint64_t id, offset, length;
  std::optional<DataConn::Spare> spare = c_.TakeSpare();
  if (spare && spare->length == chunk.size() && std::chrono::steady_clock::now() < spare->use_by) {
    id = spare->id;
    offset = spare->offset;
    length = spare->length;
  } else {
    if (spare) {
      const uint32_t m = w::Writer(req).U64(spare->id).size();
      KVTIER_RETURN_IF_ERROR(c_.SendOwed(Op::kAbortSlot, req, m));
    }
    const uint32_t n = w::Writer(req).U64(chunk.size()).U32(0).size();
    KVTIER_RETURN_IF_ERROR(c_.Call(Op::kAllocate, req, n, rep, sizeof(rep)));
    w::Reader r(rep);
    id = r.U64();
    offset = r.U64();
    length = r.U64();
  }
  auto range = c_.pool().Range(offset, length);
  absl::Status st = range.status();
  if (st.ok() && range->size() != chunk.size()) {
    st = absl::InternalError("daemon returned a slot of another size");
  }
  if (!st.ok()) {
    const uint32_t m = w::Writer(req).U64(id).size();
    (void)c_.Call(Op::kAbortSlot, req, m, nullptr, 0);
    return st;
  }
  {
    w::Writer b(req);
    b.U64(id).Raw(key.bytes.data(), w::kKeyBytes).U8(options.durable ? 1 : 0).U8(0).U16(0);
    KVTIER_RETURN_IF_ERROR(c_.Send(Op::kPutBegin, req, b.size()));
  }
  // The header, then K and V pieces interleaved, so that a daemon that
  // hashes V on a second thread (ShmChannelOptions::put_check_threads)
  // sees both sections advance at once; each piece is copied with
  // non-temporal stores (fenced), so the daemon reads it from memory
  // instead of snooping it out of this core's cache.
  const std::vector<std::pair<uint64_t, uint64_t>> order = wire::PutCopyOrder(chunk, kPieceBytes);
  for (size_t i = 0; i < order.size(); ++i) {
    const auto [o, k] = order[i];
    wire::StreamCopy(range->subspan(o, k), chunk.subspan(o, k));
    const bool last = i + 1 == order.size();
    const uint32_t m = last ? w::Writer(req).U64(chunk.size()).size()
                            : w::Writer(req).U64(o).U64(k).size();
    KVTIER_RETURN_IF_ERROR(c_.Send(last ? Op::kPutCommit : Op::kPutRange, req, m));
  }
  if (order.empty()) {  // an empty chunk: the daemon answers the commit
    const uint32_t m = w::Writer(req).U64(0).size();
    KVTIER_RETURN_IF_ERROR(c_.Send(Op::kPutCommit, req, m));
  }
  // The next put's slot, allocated by the daemon right after this commit
  // (it is awake), so that the next put does not wait for an allocation;
  // its answer is read at the connection's next use. It costs the pool a
  // slot of this size for at most kSpareTtlMs, and the daemon frees it
  // when the connection closes.
  {
    const uint32_t m = w::Writer(req).U64(chunk.size()).U32(DataConn::kSpareTtlMs).size();
    KVTIER_RETURN_IF_ERROR(c_.SendOwed(Op::kAllocate, req, m));
  }
  return c_.Receive(Op::kPutCommit, nullptr, 0);
}

absl::StatusOr<std::vector<absl::Status>> DataPlanePath::PutBatch(
    std::span<const Hash128> keys, std::span<const std::span<const uint8_t>> chunks,
    const PutOptions& options) {
  const size_t n = keys.size();
  std::vector<uint8_t> req(w::kBatchHeaderBytes + n * w::kU64Bytes), rep;
  {
    w::Writer b(req.data());
    b.U32(static_cast<uint32_t>(n)).U32(0);
    for (const auto& ch : chunks) b.U64(ch.size());
    KVTIER_RETURN_IF_ERROR(c_.CallBatch(Op::kAllocateBatch, req.data(), b.size(), &rep));
  }
  if (rep.size() != w::kBatchHeaderBytes + n * w::kSlotReplyBytes) {
    return c_.BadAnswer(Op::kAllocateBatch);
  }
  std::vector<uint64_t> ids(n);
  std::vector<std::span<uint8_t>> dst(n);
  absl::Status bad;
  {
    w::Reader r(rep.data());
    (void)r.U32();
    (void)r.U32();
    for (size_t i = 0; i < n; ++i) {
      ids[i] = r.U64();
      const uint64_t offset = r.U64(), length = r.U64();
      (void)r.U64();
      auto range = c_.pool().Range(offset, length);
      if (!range.ok() || range->size() != chunks[i].size()) {
        bad = absl::InternalError("daemon returned a slot outside the pool or of another size");
      } else {
        dst[i] = *range;
      }
    }
  }
  if (!bad.ok()) {
    for (uint64_t id : ids) (void)AbortSlot(id);
    return bad;
  }
  // Non-temporal stores: the daemon's check reads the chunks from memory.
  for (size_t i = 0; i < n; ++i) wire::StreamCopy(dst[i], chunks[i]);
  return CommitSlots(ids, keys, options);
}

absl::StatusOr<std::vector<absl::Status>> DataPlanePath::CommitSlots(
    std::span<const uint64_t> ids, std::span<const Hash128> keys, const PutOptions& options) {
  const size_t n = ids.size();
  if (options.landing_layers != 0 &&
      (n != 1 || !options.daemon_seals || options.landing_layers > UINT8_MAX)) {
    return absl::InvalidArgumentError(
        "a landing commit seals one slot, in groups of 1..255 layers");
  }
  std::vector<uint8_t> req(w::kCommitBatchBytes + n * w::kCommitItemBytes), rep;
  w::Writer b(req.data());
  b.U32(static_cast<uint32_t>(n))
      .U8(options.durable ? 1 : 0)
      .U8((options.daemon_seals ? w::kCommitSeal : 0) |
          (options.landing_layers != 0 ? w::kCommitLanding : 0))
      .U8(static_cast<uint8_t>(options.landing_layers))
      .U8(0);
  for (size_t i = 0; i < n; ++i) b.U64(ids[i]).Raw(keys[i].bytes.data(), w::kKeyBytes);
  KVTIER_RETURN_IF_ERROR(c_.CallBatch(Op::kCommitBatch, req.data(), b.size(), &rep));
  if (rep.size() != w::kBatchHeaderBytes + n * 4) return c_.BadAnswer(Op::kCommitBatch);
  w::Reader r(rep.data());
  (void)r.U32();
  (void)r.U32();
  std::vector<absl::Status> out;
  for (size_t i = 0; i < n; ++i) {
    const uint32_t code = r.U32();
    if (code == 0) {
      out.push_back(absl::OkStatus());
      continue;
    }
    const absl::StatusCode sc = CodeOf(code);
    out.push_back(absl::Status(sc, absl::StrCat("put of chunk ", keys[i].ToHex(),
                                                " refused: ", absl::StatusCodeToString(sc))));
  }
  return out;
}

absl::StatusOr<WritableSlot> DataPlanePath::AllocateSlot(uint64_t bytes) {
  uint8_t req[w::kAllocateBytes], rep[w::kSlotReplyBytes];
  const uint32_t n = w::Writer(req).U64(bytes).U32(0).size();
  KVTIER_RETURN_IF_ERROR(c_.Call(Op::kAllocate, req, n, rep, sizeof(rep)));
  w::Reader r(rep);
  const uint64_t id = r.U64(), offset = r.U64(), length = r.U64();
  auto range = c_.pool().Range(offset, length);
  absl::Status st = range.status();
  if (st.ok() && range->size() < bytes) st = absl::InternalError("daemon returned a short slot");
  if (!st.ok()) {
    (void)AbortSlot(id);
    return st;
  }
  return WritableSlot{id, range->first(bytes), c_.serial()};
}

absl::Status DataPlanePath::CommitSlot(uint64_t slot_id, const Hash128& key,
                                       const PutOptions& options) {
  const uint64_t ids[] = {slot_id};
  const Hash128 keys[] = {key};
  KVTIER_ASSIGN_OR_RETURN(std::vector<absl::Status> st, CommitSlots(ids, keys, options));
  return st[0];
}

absl::Status DataPlanePath::AbortSlot(uint64_t slot_id) {
  uint8_t req[w::kU64Bytes];
  const uint32_t m = w::Writer(req).U64(slot_id).size();
  return c_.Call(Op::kAbortSlot, req, m, nullptr, 0);
}

absl::StatusOr<HeldChunk> DataPlanePath::Hold(const Hash128& key, bool verify) {
  uint8_t req[w::kMaxRequestPayloadBytes], rep[w::kGetReplyBytes];
  w::Writer b(req);
  b.Raw(key.bytes.data(), w::kKeyBytes).U32(0).U8(verify ? 1 : 0).U8(0).U16(0);
  KVTIER_RETURN_IF_ERROR(c_.Call(Op::kGet, req, b.size(), rep, sizeof(rep)));
  w::Reader r(rep);
  const Tier tier = TierFromWire(r.U8());
  const uint8_t flags = r.U8();
  (void)r.U16();
  (void)r.U32();
  uint64_t offset, length;
  HeldChunk h = ReadHold(r, tier, c_.serial(), &offset, &length);
  h.checked = (flags & w::kHoldChecked) != 0;
  auto range = c_.pool().Range(offset, length);
  if (!range.ok()) {
    (void)Unhold(h);
    return range.status();
  }
  h.data = *range;
  return h;
}

absl::StatusOr<std::vector<absl::StatusOr<HeldChunk>>> DataPlanePath::HoldBatch(
    std::span<const Hash128> keys, bool verify) {
  std::vector<absl::StatusOr<HeldChunk>> out;
  std::vector<uint8_t> req(w::kGetBatchBytes + keys.size() * w::kKeyBytes), rep;
  w::Writer b(req.data());
  b.U32(static_cast<uint32_t>(keys.size())).U32(0).U8(verify ? 1 : 0).U8(0).U16(0).U32(0);
  WriteKeys(b, keys);
  KVTIER_RETURN_IF_ERROR(c_.CallBatch(Op::kGetBatch, req.data(), b.size(), &rep));
  if (rep.size() != w::kBatchHeaderBytes + keys.size() * w::kGetBatchItemBytes) {
    return c_.BadAnswer(Op::kGetBatch);
  }
  w::Reader r(rep.data());
  if (r.U32() != keys.size()) return c_.BadAnswer(Op::kGetBatch);
  (void)r.U32();
  for (size_t i = 0; i < keys.size(); ++i) {
    const uint32_t code = r.U32();
    const Tier tier = TierFromWire(r.U8());
    const uint8_t flags = r.U8();
    (void)r.U16();
    uint64_t offset, length;
    HeldChunk h = ReadHold(r, tier, c_.serial(), &offset, &length);
    h.checked = (flags & w::kHoldChecked) != 0;
    if (code != 0) {
      const absl::StatusCode sc = CodeOf(code);
      out.push_back(absl::Status(sc, absl::StrCat("chunk ", keys[i].ToHex(), ": ",
                                                  absl::StatusCodeToString(sc))));
      continue;
    }
    auto range = c_.pool().Range(offset, length);
    if (!range.ok() || (h.lease_id == 0) == (h.scratch_slot_id == 0)) {
      (void)Unhold(h);
      out.push_back(absl::InternalError("daemon answered a hold outside the pool"));
      continue;
    }
    h.data = *range;
    out.push_back(h);
  }
  return out;
}

absl::Status DataPlanePath::Unhold(const HeldChunk& h) {
  uint8_t req[w::kU64Bytes];
  if (h.lease_id != 0) {
    w::Writer(req).U64(h.lease_id);
    return c_.Call(Op::kRelease, req, sizeof(req), nullptr, 0);
  }
  if (h.scratch_slot_id != 0) {
    w::Writer(req).U64(h.scratch_slot_id);
    return c_.Call(Op::kAbortSlot, req, sizeof(req), nullptr, 0);
  }
  return absl::OkStatus();
}

absl::Status DataPlanePath::UnholdBatch(std::span<const HeldChunk* const> hs) {
  absl::Status first;
  for (size_t at = 0; at < hs.size(); at += w::kMaxBatchItems) {
    const size_t n = std::min<size_t>(w::kMaxBatchItems, hs.size() - at);
    std::vector<uint8_t> req(w::kBatchHeaderBytes + n * w::kReleaseItemBytes), rep;
    w::Writer b(req.data());
    b.U32(static_cast<uint32_t>(n)).U32(0);
    for (size_t i = 0; i < n; ++i) {
      const HeldChunk& h = *hs[at + i];
      b.U64(h.lease_id).U64(h.lease_id != 0 ? 0 : h.scratch_slot_id);
    }
    absl::Status st = c_.CallBatch(Op::kReleaseBatch, req.data(), b.size(), &rep);
    if (!st.ok()) return first.ok() ? st : first;
    if (rep.size() != w::kBatchHeaderBytes + n * 4) {
      st = c_.BadAnswer(Op::kReleaseBatch);
      return first.ok() ? st : first;
    }
    w::Reader r(rep.data());
    (void)r.U32();
    (void)r.U32();
    for (size_t i = 0; i < n; ++i) {
      const uint32_t code = r.U32();
      if (code != 0 && first.ok()) {
        first = absl::Status(CodeOf(code),
                             "unhold of a chunk the daemon no longer held for this client");
      }
    }
  }
  return first;
}

absl::Status DataPlanePath::ReleaseCopied(const HeldChunk& h) {
  if (h.lease_id == 0) return Unhold(h);
  // The bytes are in the caller's buffer: the release is sent and its
  // answer read at the connection's next use.
  uint8_t req[w::kU64Bytes];
  w::Writer(req).U64(h.lease_id);
  return c_.SendOwed(Op::kRelease, req, sizeof(req));
}

}  // namespace kvtier::client
