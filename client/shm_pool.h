// libkvtier's view of the daemon's shared-memory pool: the mapping of one
// pool (PoolMapping) and the client's current mapping with those a restarted
// daemon replaced (SharedPool). Internal to client/.
#ifndef KVTIER_CLIENT_SHM_POOL_H_
#define KVTIER_CLIENT_SHM_POOL_H_

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "client/kvtier_client_internal.h"

namespace kvtier::client {

// A mapping of one daemon's pool. Its id is wire::shm::PoolIdOf the memfd
// it maps: extents that name another pool are never read through it.
// Immutable once mapped; unmapped when the last owner lets go.
class PoolMapping {
 public:
  // Maps the pool received in `h` (closes its memfd; the socket stays open).
  // FailedPrecondition if mmap fails.
  static absl::StatusOr<std::shared_ptr<const PoolMapping>> Map(const ShmHandshake& h,
                                                                bool populate);
  ~PoolMapping();
  PoolMapping(const PoolMapping&) = delete;
  PoolMapping& operator=(const PoolMapping&) = delete;

  uint64_t id() const { return id_; }
  std::span<uint8_t> all() const { return std::span<uint8_t>(base_, size_); }

  // The mapped range of an extent the daemon named; never trusted blindly:
  // Internal if it reaches outside the pool.
  absl::StatusOr<std::span<uint8_t>> Range(uint64_t offset, uint64_t length) const;

 private:
  PoolMapping(uint8_t* base, uint64_t size, uint64_t id) : base_(base), size_(size), id_(id) {}
  uint8_t* const base_;
  const uint64_t size_;
  const uint64_t id_;
};

// The pool behind one daemon's side channel (`<socket>.shm`) as the client
// knows it: the mapping as of the last handshake, and those of pools replaced
// since (a daemon restarted), which stay mapped while the SharedPool lives so
// that chunks held in them are still read. Thread-safe.
class SharedPool {
 public:
  // `shm_socket`: the daemon's side channel; `populate`: pre-fault each new
  // mapping (ClientOptions::populate_mapping).
  SharedPool(std::string shm_socket, bool populate)
      : socket_(std::move(shm_socket)), populate_(populate) {}

  const std::string& socket() const { return socket_; }

  // The mapping of the pool whose memfd came in `h` (the memfd is closed):
  // the current mapping if it is the same pool, else a new mapping that
  // becomes the current one. FailedPrecondition if mmap fails.
  absl::StatusOr<std::shared_ptr<const PoolMapping>> Adopt(const ShmHandshake& h);

  // The bytes of an extent that a gRPC reply named, read through a mapping
  // of the pool it names, never another's: a gRPC channel reconnects to a
  // restarted daemon by itself, whose offsets mean nothing in the old pool. A
  // pool not mapped yet is taken from the side channel first.
  // FailedPrecondition for pool id 0 (a daemon that predates pool ids);
  // Unavailable if the daemon there serves another pool; Internal for an
  // extent outside the pool.
  absl::StatusOr<std::span<uint8_t>> ExtentRange(uint64_t pool_id, uint64_t offset,
                                                 uint64_t length);

  // The current mapping, read-write (empty before the first Adopt).
  std::span<uint8_t> all() const;

 private:
  const std::string socket_;
  const bool populate_;
  mutable absl::Mutex mu_;
  std::shared_ptr<const PoolMapping> current_ ABSL_GUARDED_BY(mu_);
  std::vector<std::shared_ptr<const PoolMapping>> replaced_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvtier::client

#endif  // KVTIER_CLIENT_SHM_POOL_H_
