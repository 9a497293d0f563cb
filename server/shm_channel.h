// The shared-memory side channel: a Unix socket (owner-only, beside the gRPC
// socket) on which the daemon passes the DRAM pool's memfd to same-host
// clients with SCM_RIGHTS, and then, on the same connection, serves the data
// plane's control messages (allocate, streamed put, get, release) in a small
// binary protocol: a round trip of a few tens of microseconds instead of a
// gRPC call's hundred or more (docs/daemon.md "Shared-memory data plane").
//
// Wire format (little-endian):
//   1. server -> client, once: u64 pool size, with the memfd as SCM_RIGHTS
//      ancillary data. Peers whose uid (SO_PEERCRED) differs from the
//      daemon's are closed without an answer. A client that only wants the
//      pool closes here (protocol 0, what every client did before).
//   2. Then requests, each answered in order (except kPutBegin,
//      kPutProgress and kPutRange, which have no answer):
//        request:  u16 version | u16 op | u32 payload bytes | payload
//        response: u16 version | u16 op | u32 code | u32 payload bytes | payload
//      `code` is an absl::StatusCode; on an error the payload is the message
//      (at most kMaxErrorMessageBytes), otherwise the op's reply payload.
//      The first request of a client is kHello; a daemon that does not
//      speak the protocol (or has no room for another connection) closes
//      the connection instead, and the client uses gRPC for everything.
//
// Every frame is checked: a version other than kVersion, an unknown op, a
// payload length other than the op's, an incomplete frame or a put message
// outside a put (progress or commit without a begin, a begin inside a put)
// gets one error answer (InvalidArgument, or FailedPrecondition for the
// lifecycle) and the daemon closes the connection. Field values are checked
// by KvService as for gRPC (unknown slot or lease: NotFound, ...). Slot and
// lease ids are scoped to the connection that got them (kAllocate, kGet):
// kRelease, kAbortSlot and kPutBegin of an id that this connection does not
// hold get the NotFound of an unknown id (UnknownSlotError,
// UnknownLeaseError), whoever holds it. When a connection closes, the daemon
// frees the slots it allocated there and did not commit (one being streamed
// included) and releases the leases of its gets that were not released.
#ifndef KVTIER_SERVER_SHM_CHANNEL_H_
#define KVTIER_SERVER_SHM_CHANNEL_H_

#include <sys/socket.h>
#include <sys/uio.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <list>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace kvtier::server {

class KvService;
class ServerMetrics;

// The data-plane protocol's constants and byte layouts, shared by the daemon
// and libkvtier.
namespace shm_wire {

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
  Writer& U8(uint8_t v) { return Raw(&v, 1); }
  Writer& U16(uint16_t v) { return Raw(&v, 2); }
  Writer& U32(uint32_t v) { return Raw(&v, 4); }
  Writer& U64(uint64_t v) { return Raw(&v, 8); }
  Writer& Raw(const void* v, size_t n) {
    std::memcpy(p_ + n_, v, n);
    n_ += n;
    return *this;
  }
  size_t size() const { return n_; }

 private:
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
    T v;
    Raw(&v, sizeof(T));
    return v;
  }
  const uint8_t* p_;
  size_t n_ = 0;
};

}  // namespace shm_wire

struct ShmChannelOptions {
  // Most data-plane connections served at once (one daemon thread each); a
  // client beyond them gets the pool but no data plane (it uses gRPC).
  // Default: 64
  int max_connections = 64;
  // Most slots and leases one connection may hold open at once; beyond it
  // kAllocate and kGet get ResourceExhausted. Default: 1024
  size_t max_open_per_connection = 1024;
  // How long the rest of a frame may take once its first byte arrived, and
  // how long an answer may wait for room in the socket (a client that does
  // not read its answers); then the connection is closed. Default: 5000
  int frame_timeout_ms = 5000;
  // After answering a frame, a connection's thread polls for the next one
  // this long before it sleeps: a client's next request usually follows
  // within microseconds, and a sleeping thread's wakeup costs tens of them
  // (more on a VM). Default: 20
  int64_t spin_us = 20;
  // The same between the frames of a put, whose progress messages come one
  // piece's copy apart (1 MiB, about 100 us). Default: 300
  int64_t put_spin_us = 300;
  // Threads that check one put: 2 hashes its V section on a helper thread of
  // the connection while the connection's thread hashes K (the client copies
  // them interleaved, kPutRange), 1 hashes both on the connection's thread.
  // 0 picks 2 on hosts with at least 4 hardware threads, else 1: a put then
  // keeps three cores busy (the client's copy and two hashes). Default: 0
  int put_check_threads = 0;
};

// ShmChannelOptions::put_check_threads as the daemon applies it: 0 is 2 on
// hosts with at least 4 hardware threads, else 1.
int ResolvePutCheckThreads(int option);

// Thread-safe; one background thread accepts, and one thread per data-plane
// connection serves it.
class ShmChannel {
 public:
  // Listens on `path` (replacing a stale socket file) with mode 0600 and
  // passes `fd` (not owned; must outlive the channel) to each client. With
  // a `service` (not owned; must outlive the channel) it also serves the
  // data-plane protocol; without one it closes each connection after the
  // descriptor.
  static absl::StatusOr<std::unique_ptr<ShmChannel>> Start(const std::string& path, int fd,
                                                           uint64_t size, ServerMetrics* metrics,
                                                           KvService* service = nullptr,
                                                           ShmChannelOptions options = {});
  // Stops accepting, closes every data-plane connection (freeing what it
  // held), joins the threads, closes and unlinks the socket.
  ~ShmChannel();

  const std::string& path() const { return path_; }
  // Data-plane connections being served now.
  int connections();

 private:
  struct Conn;
  ShmChannel(std::string path, int listen_fd, int stop_fd[2], int fd, uint64_t size,
             ServerMetrics* metrics, KvService* service, ShmChannelOptions options);
  void Loop();
  // Registers `c` and serves it on a new thread, which first passes the pool;
  // false (and `c` untouched) at the connection limit or while stopping.
  bool Adopt(int c);
  // Passes the pool's size and memfd (SCM_RIGHTS) to `c`.
  bool SendPool(int c);
  void Serve(Conn* conn);
  void ReapFinished() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::string path_;
  const int listen_fd_;
  int stop_pipe_[2];
  const int fd_;
  const uint64_t size_;
  ServerMetrics* const metrics_;
  KvService* const service_;
  const ShmChannelOptions options_;
  const int put_check_threads_;  // options_.put_check_threads, resolved
  absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::list<std::unique_ptr<Conn>> conns_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;
};

// Binds and listens on a Unix socket at `path` with mode 0600 (an existing
// socket file is replaced). Returns the listening fd.
absl::StatusOr<int> ListenUnixOwnerOnly(const std::string& path);

}  // namespace kvtier::server

#endif  // KVTIER_SERVER_SHM_CHANNEL_H_
