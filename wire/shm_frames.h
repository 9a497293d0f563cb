// The shared-memory data plane's frames: constants, payload sizes and byte
// layouts of the binary protocol that libkvtier and kvtierd speak over the
// side-channel socket (its wire format is specified in wire/DATA_PLANE.md),
// and the handshake message that passes the pool's memfd.
#ifndef KVTIER_WIRE_SHM_FRAMES_H_
#define KVTIER_WIRE_SHM_FRAMES_H_

#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/uio.h>

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "common/coding.h"

namespace kvtier::wire::shm {

inline constexpr uint16_t kVersion = 1;
inline constexpr size_t kRequestHeaderBytes = 2 + 2 + 4;       // version, op, payload bytes
inline constexpr size_t kResponseHeaderBytes = 2 + 2 + 4 + 4;  // version, op, code, payload bytes
inline constexpr size_t kMaxErrorMessageBytes = 512;
inline constexpr size_t kKeyBytes = 16;

enum class Op : uint16_t {
  kHello = 1,        // -> (empty)
  kAllocate = 2,     // u64 bytes, u32 ttl_ms -> kSlotReplyBytes
  kPutBegin = 3,     // u64 slot id, key, u8 durable, u8 tier, u16 zero -> no answer
  kPutProgress = 4,  // u64 bytes written so far -> no answer
  kPutCommit = 5,    // u64 bytes written (the whole slot) -> (empty)
  kGet = 6,          // key, u32 lease_ms, u8 verify, u8[3] zero -> kGetReplyBytes
  kRelease = 7,      // u64 lease id -> (empty)
  kAbortSlot = 8,    // u64 slot id -> (empty)
  kPutRange = 9,     // u64 offset, u64 length: those bytes written -> no answer
  // Batch ops: a fixed part that starts with u32 n, then n items; their
  // answers are a fixed part, then one item per request item (or per hit).
  kLookup = 10,         // u32 n, u32 zero, n keys -> u32 hits, u32 zero, hits x u8 tier
  kPlanLoad = 11,       // kPlanBytes, n keys -> kPlanReplyBytes, hits x kPlanHitBytes
  kPlanAndHold = 12,    // as kPlanLoad; the reply names the lease that holds the plan
  kGetBatch = 13,       // u32 n, u32 lease_ms, u8 verify, u8[7] zero, n keys
                        //   -> u32 n, u32 zero, n x kGetBatchItemBytes
  kReleaseBatch = 14,   // u32 n, u32 zero, n x (u64 lease id, u64 scratch slot id)
                        //   -> u32 n, u32 zero, n x u32 code
  kPrefetch = 15,       // u32 n, u32 deadline_ms, u64 byte budget, n keys -> kPrefetchReplyBytes
  kAllocateBatch = 16,  // u32 n, u32 ttl_ms, n x u64 bytes -> u32 n, u32 zero, n x kSlotReplyBytes
  kCommitBatch = 17,    // u32 n, u8 durable, u8 flags, u8 landing layers, u8 zero,
                        //   n x (u64 slot id, key)
                        //   -> u32 n, u32 zero, n x u32 code
  kHelloTenant = 18,    // u32 n, u32 zero, n bytes of a tenant's bearer token -> (empty)
  // kPlanLoad and kPlanAndHold with the attention term of the recompute
  // cost (bandwidth::PrefillCost): kPlanAttentionBytes, n keys -> as theirs.
  kPlanLoadAttention = 19,
  kPlanAndHoldAttention = 20,
};

inline constexpr uint32_t kAllocateBytes = 8 + 4;
inline constexpr uint32_t kPutBeginBytes = 8 + kKeyBytes + 1 + 1 + 2;
inline constexpr uint32_t kU64Bytes = 8;  // kPutProgress, kPutCommit, kRelease, kAbortSlot
inline constexpr uint32_t kGetBytes = kKeyBytes + 4 + 1 + 3;
inline constexpr uint32_t kPutRangeBytes = 8 + 8;
// u64 slot id, u64 offset, u64 length, i64 expires_at_us
inline constexpr uint32_t kSlotReplyBytes = 8 + 8 + 8 + 8;
// u8 tier (proto Tier numbering), u8 hold flags, u8[6] zero, u64 chunk
// bytes, u64 offset, u64 length, u64 lease id, u64 scratch slot id
inline constexpr uint32_t kGetReplyBytes = 1 + 7 + 8 * 5;
// Hold flags of a get's reply: the bytes handed out were checked against
// their checksums as this get read them (a scratch copy its tier checked as
// it read it from disk or a peer, or a get that asked for the check): the
// reader need not hash them again. A daemon without it sends 0.
inline constexpr uint8_t kHoldChecked = 1;

// Batch ops carry at most this many items (keys, ids, slots) per frame; a
// daemon may allow fewer (ServiceLimits::max_keys_per_request).
inline constexpr uint32_t kMaxBatchItems = 1024;
// The fixed part of each batch request (u32 n first) and its item size.
inline constexpr uint32_t kBatchHeaderBytes = 4 + 4;  // u32 n, u32 (zero, lease_ms or ttl_ms)
inline constexpr uint32_t kGetBatchBytes = 4 + 4 + 1 + 7;
inline constexpr uint32_t kReleaseItemBytes = 8 + 8;
// u32 n, u32 tokens_per_chunk, f64 prefill_tokens_per_s, u32 lease_ms, u32 zero
inline constexpr uint32_t kPlanBytes = 4 + 4 + 8 + 4 + 4;
// kPlanBytes, then f64 attention_doubling_tokens
inline constexpr uint32_t kPlanAttentionBytes = kPlanBytes + 8;
inline constexpr uint32_t kPrefetchBytes = 4 + 4 + 8;  // u32 n, u32 deadline_ms, u64 budget
inline constexpr uint32_t kCommitBatchBytes = 4 + 1 + 3;
// kCommitBatch's flags: the slots' chunks have no checksums yet (a GPU
// store's kernel wrote the rest); the daemon computes them (Put.seal).
inline constexpr uint8_t kCommitSeal = 1;
// With kCommitSeal, for one slot (n == 1): its bytes are still landing, as
// wire::LandingMarker says, in groups of `landing layers` (1..255; zero
// without this flag) layers per section. The daemon hashes each record once
// its group has landed (wire::SealLandedChunkParallel). When the records do
// not all land within kLandingWaitMs the commit fails with DeadlineExceeded
// and the slot stays the client's, to commit again (or abort) once its
// writes are done; so does any other failure of such a commit before the
// chunk is sealed. A daemon that predates the flag refuses it
// (InvalidArgument, nonzero reserved bytes) and keeps the slot alike.
inline constexpr uint8_t kCommitLanding = 2;
inline constexpr uint32_t kLandingWaitMs = 2000;
inline constexpr uint32_t kCommitItemBytes = 8 + kKeyBytes;
// Replies. kPlanReplyBytes: u32 hits, u32 load_chunks, f64 load_chunks_us,
// f64 saved_us, u64 lease id (0: nothing held), i64 expires_at_us.
inline constexpr uint32_t kPlanReplyBytes = 4 + 4 + 8 + 8 + 8 + 8;
// u8 tier, u8[7] zero, u64 chunk bytes, f64 load_us
inline constexpr uint32_t kPlanHitBytes = 1 + 7 + 8 + 8;
// u32 code, u8 tier, u8 hold flags, u8[2] zero, u64 chunk bytes, u64 offset, u64 length,
// u64 lease id, u64 scratch slot id (all zero but the code on an error)
inline constexpr uint32_t kGetBatchItemBytes = 4 + 1 + 3 + 8 * 5;
// u8 completed, u8[3] zero, u32 keys queued, u64 bytes queued
inline constexpr uint32_t kPrefetchReplyBytes = 1 + 3 + 4 + 8;

// A request's payload length: `fixed` bytes, then u32 n (its first field)
// items of `item` bytes, n <= kMaxBatchItems; item 0 for fixed-size ops.
struct RequestShape {
  uint32_t fixed = 0;
  uint32_t item = 0;
};

// ShapeOf's answer for an op this version does not know.
inline constexpr RequestShape kUnknownOp{UINT32_MAX, 0};
inline RequestShape ShapeOf(uint16_t op) {
  switch (static_cast<Op>(op)) {
    case Op::kHello: return {0, 0};
    case Op::kAllocate: return {kAllocateBytes, 0};
    case Op::kPutBegin: return {kPutBeginBytes, 0};
    case Op::kPutProgress:
    case Op::kPutCommit:
    case Op::kRelease:
    case Op::kAbortSlot: return {kU64Bytes, 0};
    case Op::kGet: return {kGetBytes, 0};
    case Op::kPutRange: return {kPutRangeBytes, 0};
    case Op::kLookup: return {kBatchHeaderBytes, kKeyBytes};
    case Op::kPlanLoad:
    case Op::kPlanAndHold: return {kPlanBytes, kKeyBytes};
    case Op::kGetBatch: return {kGetBatchBytes, kKeyBytes};
    case Op::kReleaseBatch: return {kBatchHeaderBytes, kReleaseItemBytes};
    case Op::kPrefetch: return {kPrefetchBytes, kKeyBytes};
    case Op::kAllocateBatch: return {kBatchHeaderBytes, kU64Bytes};
    case Op::kCommitBatch: return {kCommitBatchBytes, kCommitItemBytes};
    case Op::kHelloTenant: return {kBatchHeaderBytes, 1};
    case Op::kPlanLoadAttention:
    case Op::kPlanAndHoldAttention: return {kPlanAttentionBytes, kKeyBytes};
  }
  return kUnknownOp;
}

// The largest request payload of any op.
inline constexpr uint32_t kMaxRequestPayloadBytes = kCommitBatchBytes + kMaxBatchItems * kCommitItemBytes;
static_assert(kPlanAttentionBytes + kMaxBatchItems * kKeyBytes <= kMaxRequestPayloadBytes);
static_assert(kPutBeginBytes <= kMaxRequestPayloadBytes);
// The largest reply payload of any op.
inline constexpr uint32_t kMaxReplyPayloadBytes = kBatchHeaderBytes + kMaxBatchItems * kGetBatchItemBytes;
static_assert(kPlanReplyBytes + kMaxBatchItems * kPlanHitBytes <= kMaxReplyPayloadBytes);
static_assert(kBatchHeaderBytes + kMaxBatchItems * kSlotReplyBytes <= kMaxReplyPayloadBytes);

// The request payload length of a fixed-size `op`; -1 for an unknown op or
// a batch op (whose length ShapeOf gives).
inline int64_t RequestBytes(uint16_t op) {
  const RequestShape s = ShapeOf(op);
  if (s.fixed == kUnknownOp.fixed || s.item != 0) return -1;
  return s.fixed;
}

// Whether `len` payload bytes may be a frame of `op` (the count field is
// checked against them once the payload is read: BatchCountMatches).
inline bool PayloadLengthFits(uint16_t op, uint32_t len) {
  const RequestShape s = ShapeOf(op);
  if (s.fixed == kUnknownOp.fixed) return false;
  if (s.item == 0) return len == s.fixed;
  return len >= s.fixed && (len - s.fixed) % s.item == 0 &&
         (len - s.fixed) / s.item <= kMaxBatchItems;
}

// Whether a batch payload's u32 n (its first field) names as many items as
// the payload holds.
inline bool BatchCountMatches(uint16_t op, const uint8_t* payload, uint32_t len) {
  const RequestShape s = ShapeOf(op);
  if (s.item == 0) return true;
  return LoadLE<uint32_t>(payload) == (len - s.fixed) / s.item;
}

// The handshake's one message (wire format step 1), set up alike by the
// daemon (sendmsg) and the client (recvmsg): the u64 pool size, and room for
// one descriptor as SCM_RIGHTS ancillary data. Not copyable (`msg` points
// into the object).
struct PoolMessage {
  uint64_t size = 0;  // little-endian hosts only (x86-64, aarch64)
  iovec iov{&size, sizeof(size)};
  alignas(cmsghdr) char ctrl[CMSG_SPACE(sizeof(int))] = {};
  msghdr msg{};

  PoolMessage() {
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = ctrl;
    msg.msg_controllen = sizeof(ctrl);
  }
  PoolMessage(const PoolMessage&) = delete;
  PoolMessage& operator=(const PoolMessage&) = delete;
};

// The identity of the pool behind a memfd: its inode (and device), the same
// in the daemon that made it and in every client it was passed to, and
// another for every other pool while either is open. gRPC replies name it
// (ShmExtent.pool_id); a data-plane connection is bound to the memfd of its
// own handshake. 0 if `fd` cannot be examined.
inline uint64_t PoolIdOf(int fd) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) return 0;
  const uint64_t id = static_cast<uint64_t>(st.st_ino) ^ (static_cast<uint64_t>(st.st_dev) << 40);
  return id != 0 ? id : 1;
}

// Little-endian field writer and reader over a caller's buffer (x86-64 and
// aarch64 are little-endian; the daemon and its clients share a host).
// REQUIRES: the buffer holds every field written or read.
class Writer {
 public:
  explicit Writer(uint8_t* p) : p_(p) {}
  Writer& U8(uint8_t v) { return Put(v); }
  Writer& U16(uint16_t v) { return Put(v); }
  Writer& U32(uint32_t v) { return Put(v); }
  Writer& U64(uint64_t v) { return Put(v); }
  Writer& F64(double v) {
    uint64_t b;
    std::memcpy(&b, &v, sizeof(b));
    return Put(b);
  }
  Writer& Raw(const void* v, size_t n) {
    std::memcpy(p_ + n_, v, n);
    n_ += n;
    return *this;
  }
  size_t size() const { return n_; }

 private:
  template <typename T>
  Writer& Put(T v) {
    StoreLE<T>(p_ + n_, v);
    n_ += sizeof(T);
    return *this;
  }
  uint8_t* p_;
  size_t n_ = 0;
};

class Reader {
 public:
  explicit Reader(const uint8_t* p) : p_(p) {}
  uint8_t U8() { return Get<uint8_t>(); }
  uint16_t U16() { return Get<uint16_t>(); }
  uint32_t U32() { return Get<uint32_t>(); }
  uint64_t U64() { return Get<uint64_t>(); }
  double F64() {
    const uint64_t b = Get<uint64_t>();
    double v;
    std::memcpy(&v, &b, sizeof(v));
    return v;
  }
  void Raw(void* out, size_t n) {
    std::memcpy(out, p_ + n_, n);
    n_ += n;
  }

 private:
  template <typename T>
  T Get() {
    const T v = LoadLE<T>(p_ + n_);
    n_ += sizeof(T);
    return v;
  }
  const uint8_t* p_;
  size_t n_ = 0;
};

}  // namespace kvtier::wire::shm

#endif  // KVTIER_WIRE_SHM_FRAMES_H_
