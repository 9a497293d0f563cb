// RpcClient: libkvtier's gRPC calls to kvtierd (wire/kvtier.proto). The one
// place in client/ that builds the protocol's requests and reads its replies;
// it hands back domain types (client/kvtier_client.h) and maps grpc::Status
// to absl::Status in one function (FromGrpcStatus). Internal to client/.
#ifndef KVTIER_CLIENT_RPC_CLIENT_H_
#define KVTIER_CLIENT_RPC_CLIENT_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "client/data_path.h"
#include "client/kvtier_client.h"
#include "client/kvtier_client_internal.h"

namespace kvtier::client {

// An extent of the daemon's pool named in a reply (ShmExtent).
struct PoolExtent {
  uint64_t pool_id = 0;
  uint64_t offset = 0;
  uint64_t length = 0;
};

// Thread-safe. Every call carries the protocol version, the bearer token (if
// any) and a deadline of ClientOptions::timeout_ms; errors are the daemon's
// statuses. The owner calls WaitForReleases before destroying it. The calls that could see a pin of this client's own gets
// (CommitSlot, AbortSlot, Delete, Prefetch, Pin, Release, Stats) first wait
// for the client's outstanding releases (WaitForReleases), so a client
// always sees its own gets released.
class RpcClient {
 public:
  // `stub` (not owned) outlives this. `settle_data_plane` (may be empty)
  // returns once the releases owed on the client's data-plane connections
  // are answered; WaitForReleases calls it.
  RpcClient(kvtier::proto::v1::Kvtier::StubInterface* stub, const ClientOptions& options,
            std::function<void()> settle_data_plane)
      : stub_(stub), options_(options), settle_data_plane_(std::move(settle_data_plane)) {}

  // Health: the daemon's side-channel socket ("" if it has no pool).
  // Unauthenticated if it refuses the token; Unavailable if it does not
  // answer.
  absl::StatusOr<std::string> Health();

  absl::StatusOr<std::vector<Tier>> Lookup(std::span<const Hash128> keys);
  // FailedPrecondition from a daemon that predates load estimates; Internal
  // for an estimate that does not match its hits.
  absl::StatusOr<LoadPlan> PlanLoad(std::span<const Hash128> keys, double prefill_tokens_per_s,
                                    double attention_doubling_tokens, uint32_t tokens_per_chunk);
  // Put with the chunk's bytes in the request.
  absl::Status PutInline(const Hash128& key, std::span<const uint8_t> chunk,
                         const PutOptions& options);
  // Copies `chunk` into `slot` piece by piece, telling the daemon after each
  // piece (PutStream), so that the daemon checks piece i while this thread
  // copies piece i + 1; the last message commits.
  // REQUIRES: slot.data.size() >= chunk.size().
  absl::Status PutStream(const WritableSlot& slot, const Hash128& key,
                         std::span<const uint8_t> chunk, const PutOptions& options);
  // Get with the chunk's bytes in the reply, into `sink`.
  absl::StatusOr<std::pair<uint64_t, Tier>> GetInline(const Hash128& key, ChunkSink sink);
  // Get that holds the chunk in the pool: the hold (without data) and where
  // the chunk is.
  absl::StatusOr<std::pair<HeldChunk, PoolExtent>> GetHeld(const Hash128& key, bool verify);
  // A slot of `bytes`: its id and extent.
  absl::StatusOr<std::pair<uint64_t, PoolExtent>> AllocateSlot(uint64_t bytes);
  absl::Status CommitSlot(uint64_t slot_id, const Hash128& key, const PutOptions& options);
  absl::Status AbortSlot(uint64_t slot_id);
  absl::Status Delete(const Hash128& key);
  absl::StatusOr<bool> Prefetch(std::span<const Hash128> keys, uint32_t deadline_ms);
  absl::StatusOr<uint64_t> Pin(std::span<const Hash128> keys, uint32_t ttl_ms);
  absl::Status Release(uint64_t lease_id);
  absl::StatusOr<DaemonStats> Stats();

  // Sends Release and returns; the answer is only counted (an error there
  // means the lease had expired, which frees the chunk just the same).
  // Release itself on a stub without an asynchronous interface.
  absl::Status ReleaseAsync(uint64_t lease_id);
  // Returns once every ReleaseAsync is answered and the data plane's owed
  // releases are settled.
  void WaitForReleases();

 private:
  template <typename Req, typename Resp>
  absl::Status Call(grpc::Status (kvtier::proto::v1::Kvtier::StubInterface::*method)(
                        grpc::ClientContext*, const Req&, Resp*),
                    const Req& req, Resp* resp);
  void Prepare(grpc::ClientContext& ctx, int64_t timeout_ms) const;
  std::string Target() const;

  kvtier::proto::v1::Kvtier::StubInterface* const stub_;
  const ClientOptions options_;
  const std::function<void()> settle_data_plane_;
  // Outstanding asynchronous Releases; shared with their callbacks.
  struct Releases {
    absl::Mutex mu;
    int pending ABSL_GUARDED_BY(mu) = 0;
  };
  std::shared_ptr<Releases> releases_ = std::make_shared<Releases>();
};

}  // namespace kvtier::client

#endif  // KVTIER_CLIENT_RPC_CLIENT_H_
