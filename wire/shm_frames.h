// The shared-memory data plane's frames: constants, payload sizes and byte
// layouts of the binary protocol that libkvtier and kvtierd speak over the
// side-channel socket (its wire format is specified in server/shm_channel.h),
// and the handshake message that passes the pool's memfd.
#ifndef KVTIER_WIRE_SHM_FRAMES_H_
#define KVTIER_WIRE_SHM_FRAMES_H_

#include <sys/socket.h>
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
};

inline constexpr uint32_t kAllocateBytes = 8 + 4;
inline constexpr uint32_t kPutBeginBytes = 8 + kKeyBytes + 1 + 1 + 2;
inline constexpr uint32_t kU64Bytes = 8;  // kPutProgress, kPutCommit, kRelease, kAbortSlot
inline constexpr uint32_t kGetBytes = kKeyBytes + 4 + 1 + 3;
inline constexpr uint32_t kPutRangeBytes = 8 + 8;
// u64 slot id, u64 offset, u64 length, i64 expires_at_us
inline constexpr uint32_t kSlotReplyBytes = 8 + 8 + 8 + 8;
// u8 tier (proto Tier numbering), u8[7] zero, u64 chunk bytes, u64 offset,
// u64 length, u64 lease id, u64 scratch slot id
inline constexpr uint32_t kGetReplyBytes = 1 + 7 + 8 * 5;
// The largest request payload.
inline constexpr uint32_t kMaxRequestPayloadBytes = kPutBeginBytes;
static_assert(kPutRangeBytes <= kMaxRequestPayloadBytes);

// The request payload length of `op`; -1 for an unknown op.
inline int64_t RequestBytes(uint16_t op) {
  switch (static_cast<Op>(op)) {
    case Op::kHello: return 0;
    case Op::kAllocate: return kAllocateBytes;
    case Op::kPutBegin: return kPutBeginBytes;
    case Op::kPutProgress:
    case Op::kPutCommit:
    case Op::kRelease:
    case Op::kAbortSlot: return kU64Bytes;
    case Op::kGet: return kGetBytes;
    case Op::kPutRange: return kPutRangeBytes;
  }
  return -1;
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
