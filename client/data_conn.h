// libkvtier's connections to the daemon's shared-memory data plane
// (wire/shm_frames.h; the protocol is specified in wire/DATA_PLANE.md): one
// connection's framing (DataConn) and the client's set of them, lent to one
// call at a time (DataConnPool, ConnLease). Internal to client/.
#ifndef KVTIER_CLIENT_DATA_CONN_H_
#define KVTIER_CLIENT_DATA_CONN_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "client/shm_pool.h"
#include "wire/shm_frames.h"

namespace kvtier::client {

// One data-plane connection: frames out, answers in.
// Not thread-safe; the client lends each to one call at a time. Once a
// transport error or a malformed answer marks it broken it is closed.
class DataConn {
 public:
  using Op = wire::shm::Op;

  // A slot allocated ahead of the next put (see DataPlanePath::Put).
  struct Spare {
    uint64_t id = 0, offset = 0, length = 0;
    std::chrono::steady_clock::time_point use_by;
  };
  // The daemon keeps a spare this long; the client uses it for half of it.
  static constexpr uint32_t kSpareTtlMs = 2000;

  // Says hello on `sock` (owned from here on): with a `token`, the
  // tenant hello that names the client's tenant (kHelloTenant). Null if the
  // daemon does not serve the data plane on it (an older daemon, no room, a
  // token it refuses or one too long for the frame).
  // `owed_releases` (not owned) counts the releases sent on any connection
  // whose answers are not read yet. `serial` (nonzero) names the connection
  // within its client (HeldChunk::connection).
  // `pool` is the mapping of the memfd that came on `sock`: every extent an
  // answer on this connection names is in it.
  static std::unique_ptr<DataConn> Open(int sock, std::shared_ptr<const PoolMapping> pool,
                                        int64_t timeout_ms, std::atomic<int>* owed_releases,
                                        uint64_t serial, const std::string& token);
  ~DataConn();  // closes the socket: the daemon releases what it held for it

  bool broken() const { return broken_; }
  uint64_t serial() const { return serial_; }
  const PoolMapping& pool() const { return *pool_; }

  // False once the daemon has closed its end (it exited or restarted): such
  // a connection is dropped before it is lent, so that the call it would
  // have served opens a fresh one (and maps the new daemon's pool).
  bool PeerOpen() const;

  // Sends one request. Unavailable if the connection failed.
  absl::Status Send(Op op, const uint8_t* payload, uint32_t n);
  // Reads the header of the answer to `op` and returns its payload length:
  // the daemon's error (read whole) as a status, or a malformed header as a
  // broken connection. The payload itself is left for the caller to read.
  absl::StatusOr<uint32_t> ReceiveHeader(Op op);
  // Reads the answer to `op`: the daemon's error, or its payload, which must
  // be exactly `n` bytes, into `out`.
  absl::Status Receive(Op op, uint8_t* out, uint32_t n);
  // Settle, Send and Receive.
  absl::Status Call(Op op, const uint8_t* payload, uint32_t n, uint8_t* out, uint32_t out_n);
  // Call of a batch op, whose answer has a variable length (at most
  // kMaxReplyPayloadBytes; the caller checks it against what it asked).
  absl::Status CallBatch(Op op, const uint8_t* payload, uint32_t n, std::vector<uint8_t>* out);
  // A malformed answer: the connection is closed (what it held is freed).
  // Always Unavailable.
  absl::Status BadAnswer(Op op);

  // Sends a request whose answer is read later, by Settle (every Call
  // settles first): the release after a get, a spare slot's allocation or
  // abort. REQUIRES: op is kRelease, kAllocate or kAbortSlot.
  absl::Status SendOwed(Op op, const uint8_t* payload, uint32_t n);
  // Reads every owed answer: an allocation becomes the spare; errors of a
  // release or an abort (an expired lease or slot) change nothing. Fails
  // only if the connection broke.
  absl::Status Settle();
  // The spare slot, if any (it is the caller's from here on).
  std::optional<Spare> TakeSpare() { return std::exchange(spare_, std::nullopt); }

 private:
  DataConn(int fd, std::shared_ptr<const PoolMapping> pool, std::atomic<int>* owed_releases,
           uint64_t serial)
      : fd_(fd), pool_(std::move(pool)), owed_releases_(owed_releases), serial_(serial) {}

  void DropOwed();
  absl::Status ReadFull(uint8_t* p, size_t n, int64_t spin_us = 0);
  absl::Status Broken(std::string what);

  const int fd_;
  const std::shared_ptr<const PoolMapping> pool_;
  std::atomic<int>* const owed_releases_;
  const uint64_t serial_;
  bool broken_ = false;
  std::deque<Op> owed_;  // answers to read, in order
  std::optional<Spare> spare_;
};

class DataConnPool;

// A data-plane connection lent to one call; it goes back to its pool's idle
// list when the lease ends (or is closed, if it broke). Empty when the
// daemon has no data plane or every connection is busy: the call uses gRPC.
class ConnLease {
 public:
  ConnLease(DataConnPool* owner, std::unique_ptr<DataConn> c) : owner_(owner), c_(std::move(c)) {}
  ConnLease(ConnLease&& o) noexcept : owner_(o.owner_), c_(std::move(o.c_)) {}
  ConnLease& operator=(ConnLease&&) = delete;
  ~ConnLease();
  explicit operator bool() const { return c_ != nullptr; }
  // REQUIRES: the lease is not empty.
  DataConn& operator*() const { return *c_; }

 private:
  DataConnPool* owner_;
  std::unique_ptr<DataConn> c_;
};

// The client's data-plane connections to one daemon: at most
// ClientOptions::max_data_connections open, idle ones lent to calls, new
// ones opened (and their pool adopted into `pool`) as calls need them.
// Thread-safe.
class DataConnPool {
 public:
  // `pool` (not owned) outlives this. Uses options' max_data_connections,
  // timeout_ms and token.
  DataConnPool(SharedPool* pool, const ClientOptions& options) : pool_(pool), options_(options) {}
  ~DataConnPool();

  // Opens the first connection on the side-channel socket of the client's
  // handshake (`sock`, owned from here on; closed if max_data_connections
  // is 0), whose pool is `mapping`. False if the daemon does not serve the
  // data plane there: then the pool lends nothing.
  bool Start(int sock, std::shared_ptr<const PoolMapping> mapping);

  // An idle connection, or a new one if fewer than max_data_connections are
  // open; empty otherwise (and always when Start returned false).
  ConnLease Acquire();
  // The connection `serial`, once no other call is using it. Empty if it has
  // closed, or is still lent out after timeout_ms.
  ConnLease AcquireBySerial(uint64_t serial);
  // Returns once every release sent owed on any connection has its answer
  // read: idle connections are settled here; a lent one is settled by its
  // borrower's first request, or here once it is back.
  void SettleOwedReleases();

 private:
  friend class ConnLease;
  void Return(std::unique_ptr<DataConn> c);

  SharedPool* const pool_;
  const ClientOptions options_;
  // Releases sent on data-plane connections whose answers are unread;
  // declared before the connections, which hold a pointer to it.
  std::unique_ptr<std::atomic<int>> owed_releases_ = std::make_unique<std::atomic<int>>(0);
  absl::Mutex mu_;
  bool serving_ ABSL_GUARDED_BY(mu_) = false;  // the daemon serves the data plane
  int open_ ABSL_GUARDED_BY(mu_) = 0;           // idle and lent
  std::vector<std::unique_ptr<DataConn>> idle_ ABSL_GUARDED_BY(mu_);
  // Serials of the open connections (idle and lent), and the next serial.
  absl::flat_hash_set<uint64_t> live_ ABSL_GUARDED_BY(mu_);
  std::atomic<uint64_t> next_serial_{1};
};

}  // namespace kvtier::client

#endif  // KVTIER_CLIENT_DATA_CONN_H_
