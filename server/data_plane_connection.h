// One connection of the shared-memory data plane (ShmChannel; the wire
// format is in wire/DATA_PLANE.md): reads and checks its frames, runs each op
// against the KvService, answers, and when the client goes frees what the
// connection got.
//
// The connection keeps the ids it got (kAllocate, kGet, their batch forms,
// kPlanAndHold), and only those: the placement engine is the one table of
// slots and leases (extents, expiry). The ids scope kRelease, kAbortSlot,
// kPutBegin and the batch releases and commits to this connection, and are
// what it frees when it closes; an id the engine has ended (expired,
// committed) is forgotten when the connection is at its limit.
#ifndef KVTIER_SERVER_DATA_PLANE_CONNECTION_H_
#define KVTIER_SERVER_DATA_PLANE_CONNECTION_H_

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "server/service.h"
#include "server/shm_channel.h"
#include "wire/chunk_check.h"
#include "wire/shm_frames.h"

namespace kvtier::server {

class ServerMetrics;

// Buffered reads of one connection's frames: one recv takes whatever the
// client has sent (several progress messages of a put at once, say).
class FrameReader {
 public:
  FrameReader(int fd, int timeout_ms) : fd_(fd), timeout_ms_(timeout_ms) {}

  // Makes `n` bytes available at data(). An idle connection (nothing
  // buffered) may wait indefinitely for its next frame when `idle_ok`,
  // polling without sleeping for the first `spin_us`; the whole frame must
  // have arrived within the timeout of its first byte (however it trickles
  // in). False on EOF, an error or the timeout.
  // REQUIRES: n <= kBufferBytes.
  bool Fill(size_t n, bool idle_ok, int64_t spin_us = 0);
  // The frame being read is whole: the next one's timeout starts at its
  // first byte.
  void EndFrame() { frame_deadline_.reset(); }
  const uint8_t* data() const { return buf_ + begin_; }
  void Consume(size_t n) {
    begin_ += n;
    if (begin_ == end_) begin_ = end_ = 0;
  }

  // Room for the largest frame.
  static constexpr size_t kBufferBytes =
      wire::shm::kRequestHeaderBytes + wire::shm::kMaxRequestPayloadBytes;

 private:
  const int fd_;
  const int timeout_ms_;
  // When the frame being read must be whole (set at its first byte).
  std::optional<std::chrono::steady_clock::time_point> frame_deadline_;
  uint8_t buf_[kBufferBytes];
  size_t begin_ = 0, end_ = 0;
};

// Serves one connection on the calling thread. Not thread-safe: one thread
// runs it from construction to destruction.
class DataPlaneConnection {
 public:
  // `fd` (not owned) is the connected socket, past the pool handshake.
  // `service`, `tenants`, `tenant` (the peer uid's: its keys and quotas;
  // null when the uid is no tenant's, and then the first request must be
  // a kHelloTenant that names one) and `metrics` are not owned and must
  // outlive the connection.
  // `put_check_threads` is options.put_check_threads resolved
  // (ResolvePutCheckThreads).
  DataPlaneConnection(int fd, KvService* service, const TenantRegistry* tenants,
                      const Tenant* tenant, ServerMetrics* metrics,
                      const ShmChannelOptions& options, int put_check_threads);
  // Frees what the connection holds: the slots it allocated and did not
  // commit (one being streamed included), the leases of its gets.
  ~DataPlaneConnection();
  DataPlaneConnection(const DataPlaneConnection&) = delete;
  DataPlaneConnection& operator=(const DataPlaneConnection&) = delete;

  // Reads, checks and serves frames until the client closes, breaks the
  // protocol (one error answer, then the end) or stops reading its answers.
  void Run();

 private:
  using Clock = std::chrono::steady_clock;

  // The violation of a request header (version, op, length, put lifecycle)
  // that ends the connection; OK for a frame to serve.
  absl::Status CheckFrame(uint16_t version, uint16_t op, uint32_t len) const;

  // One method per op. Each reads its payload from `r`; those that are
  // answered write the reply payload into `w` and return the answer's code.
  // kHelloTenant: the connection is served as the tenant of the token;
  // Unauthenticated (the connection then ends) if no tenant has it.
  absl::Status OnHelloTenant(wire::shm::Reader& r, uint32_t n);
  absl::Status OnAllocate(wire::shm::Reader& r, wire::shm::Writer& w, Clock::time_point t0);
  void OnPutBegin(wire::shm::Reader& r, Clock::time_point t0);  // no answer
  void OnPutProgress(wire::shm::Reader& r);                     // no answer
  void OnPutRange(wire::shm::Reader& r);                        // no answer
  absl::Status OnPutCommit(wire::shm::Reader& r);
  absl::Status OnGet(wire::shm::Reader& r, wire::shm::Writer& w, Clock::time_point t0);
  absl::Status OnRelease(wire::shm::Reader& r, Clock::time_point t0);
  absl::Status OnAbortSlot(wire::shm::Reader& r, Clock::time_point t0);
  // Batch ops: `n` items follow the fixed part (already checked against the
  // payload length).
  absl::Status OnLookup(wire::shm::Reader& r, uint32_t n, wire::shm::Writer& w);
  // kPlanLoad, kPlanAndHold and their kPlan*Attention forms.
  absl::Status OnPlan(wire::shm::Reader& r, uint32_t n, wire::shm::Op op, wire::shm::Writer& w);
  absl::Status OnGetBatch(wire::shm::Reader& r, uint32_t n, wire::shm::Writer& w);
  absl::Status OnReleaseBatch(wire::shm::Reader& r, uint32_t n, wire::shm::Writer& w);
  absl::Status OnPrefetch(wire::shm::Reader& r, uint32_t n, wire::shm::Writer& w);
  absl::Status OnAllocateBatch(wire::shm::Reader& r, uint32_t n, wire::shm::Writer& w);
  absl::Status OnCommitBatch(wire::shm::Reader& r, uint32_t n, wire::shm::Writer& w);
  // Reads `n` keys of a read: the tenant's stored keys (Tenant::MapReadKeys).
  std::vector<Hash128> ReadKeys(wire::shm::Reader& r, uint32_t n);

  // A new connection's holder id: 1, 2, ... in this process.
  static tiering::HolderId NextHolderId();
  // The connection's holder: its slots and leases are its own.
  tiering::Holder Holder() const { return {holder_id_, tenant_->id()}; }

  // Whether the connection may take `n` more slots or leases; at the limit
  // it first forgets the ids the engine has ended.
  bool Room(size_t n = 1);
  absl::Status Full() const;
  // Records the open put's first error and frees its slot (if it is this
  // connection's: another connection's slot is never touched).
  void FailPut(absl::Status st);

  const int fd_;
  KvService* const service_;
  const TenantRegistry* const tenants_;
  const Tenant* tenant_;
  bool served_any_ = false;  // a request was accepted (the hello comes first)
  ServerMetrics* const metrics_;
  const ShmChannelOptions options_;
  const int put_check_threads_;
  const tiering::HolderId holder_id_;
  FrameReader in_;
  // A request's payload, and an answer (header room, then the payload).
  std::vector<uint8_t> payload_, answer_;
  // The ids this connection got and has not ended.
  absl::flat_hash_set<uint64_t> slots_, leases_;
  struct OpenPut {
    uint64_t slot_id = 0;
    PutArgs args;
    std::unique_ptr<wire::IncrementalChunkCheck> check;
    absl::Status error;  // the put's first error, answered at its commit
    Clock::time_point t0;
  };
  // The helper that hashes a put's V section (put_check_threads 2), made at
  // the connection's first put. Declared before `put_`, so that a put still
  // open when the connection closes abandons its job before the helper ends.
  std::unique_ptr<wire::TrailingHasher> put_hasher_;
  std::optional<OpenPut> put_;
};

}  // namespace kvtier::server

#endif  // KVTIER_SERVER_DATA_PLANE_CONNECTION_H_
