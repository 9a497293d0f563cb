// libkvtier's GPU paged-cache path (built only with CUDA): stores a chunk
// from an engine's paged KV cache straight into a slot of kvtierd's
// shared-memory pool, and loads one from the pool into the paged cache,
// without staging copies on the host.
//
//   Store: AllocateSlot -> kernels::GatherEncode writes the chunk into the
//          slot through the client's pool mapping (registered with
//          cudaHostRegister, so the kernel writes host memory directly) ->
//          codec::SealChunk on the host -> CommitSlot (the daemon verifies).
//   Load:  Hold (the chunk's extent, pinned) -> the header and both section
//          checksums are checked on the host (the reader's check; the daemon
//          verified at put) -> kernels::DecodeScatter reads the extent over
//          the mapping -> the stream is synchronized -> Unhold.
//
// Thread-safe: Store calls are serialized (they share the GatherEncode
// workspace); Load calls run concurrently. The client must outlive this
// object and keep its pool mapping (it does for its lifetime).
#ifndef KVTIER_CLIENT_KVTIER_GPU_H_
#define KVTIER_CLIENT_KVTIER_GPU_H_

#include <cuda_runtime_api.h>

#include <memory>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "client/kvtier_client.h"
#include "codec/chunk.h"
#include "common/hash.h"
#include "kernels/paged_layout.h"

namespace kvtier::client {

class GpuPagedIo {
 public:
  // Registers `client`'s pool mapping with the current CUDA device (mapped,
  // portable) and allocates the GatherEncode workspace. FailedPrecondition if
  // the client moves bytes inline (no pool) or the device cannot map host
  // memory; CUDA errors as Internal with file and line.
  static absl::StatusOr<std::unique_ptr<GpuPagedIo>> Create(KvtierClient* client);
  // Unregisters the mapping and frees the workspace.
  ~GpuPagedIo();
  GpuPagedIo(const GpuPagedIo&) = delete;
  GpuPagedIo& operator=(const GpuPagedIo&) = delete;

  // Encodes the spec.geometry.num_tokens tokens at `blocks` of `cache` as a
  // chunk of `spec` and stores it as `key`. Returns once the daemon has
  // committed it (after the NVMe commit with options.durable).
  // InvalidArgument for a spec/cache/blocks mismatch (nothing is allocated);
  // the daemon's codes otherwise (ResourceExhausted when the pool is full,
  // DataLoss if the bytes in the slot do not verify). The slot is aborted on
  // any error after it was allocated.
  absl::Status Store(const Hash128& key, const codec::ChunkSpec& spec,
                     const kernels::PagedKvLayout& cache, const kernels::BlockSpan& blocks,
                     cudaStream_t stream, const PutOptions& options = {});

  // Decodes chunk `key` into the slots at `blocks` of `cache` (the chunk's
  // geometry must match the cache) and returns the tier it came from. Returns
  // after the kernel has finished (the extent is released then). NotFound on
  // a miss; DataLoss if the chunk is corrupt (the daemon drops it);
  // InvalidArgument for a geometry/cache/blocks mismatch.
  absl::StatusOr<Tier> Load(const Hash128& key, const kernels::PagedKvLayout& cache,
                            const kernels::BlockSpan& blocks, cudaStream_t stream);

 private:
  GpuPagedIo(KvtierClient* client, std::span<uint8_t> pool, uint8_t* device_pool,
             uint32_t* workspace)
      : client_(client), pool_(pool), device_pool_(device_pool), workspace_(workspace) {}
  // The device address of host bytes inside the registered pool.
  const uint8_t* Device(const uint8_t* host) const { return device_pool_ + (host - pool_.data()); }

  KvtierClient* const client_;
  const std::span<uint8_t> pool_;
  uint8_t* const device_pool_;
  absl::Mutex store_mu_;
  uint32_t* const workspace_ ABSL_GUARDED_BY(store_mu_);
};

}  // namespace kvtier::client

#endif  // KVTIER_CLIENT_KVTIER_GPU_H_
