#include "client/kvtier_gpu.h"

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "kernels/cuda_status.h"
#include "kernels/paged_codec.h"
#include "wire/chunk_check.h"

namespace kvtier::client {

absl::StatusOr<std::unique_ptr<GpuPagedIo>> GpuPagedIo::Create(KvtierClient* client) {
  std::span<uint8_t> pool = client->mapped_pool();
  if (pool.empty()) {
    return absl::FailedPreconditionError(
        "the GPU path needs the daemon's shared-memory pool (Unix socket, shared_memory on)");
  }
  KVTIER_CUDA_RETURN_IF_ERROR(
      cudaHostRegister(pool.data(), pool.size(), cudaHostRegisterMapped | cudaHostRegisterPortable));
  void* dev = nullptr;
  cudaError_t e = cudaHostGetDevicePointer(&dev, pool.data(), 0);
  uint32_t* ws = nullptr;
  if (e == cudaSuccess) e = cudaMalloc(reinterpret_cast<void**>(&ws), kernels::kGatherEncodeWorkspaceBytes);
  if (e == cudaSuccess) e = cudaMemset(ws, 0, kernels::kGatherEncodeWorkspaceBytes);
  if (e != cudaSuccess) {
    if (ws != nullptr) cudaFree(ws);
    cudaHostUnregister(pool.data());
    return kernels::CudaStatus(e, "map the pool for the device", __FILE__, __LINE__);
  }
  return std::unique_ptr<GpuPagedIo>(new GpuPagedIo(client, pool, static_cast<uint8_t*>(dev), ws));
}

GpuPagedIo::~GpuPagedIo() {
  absl::MutexLock l(&store_mu_);
  cudaFree(workspace_);
  cudaHostUnregister(pool_.data());
}

absl::Status GpuPagedIo::Store(const Hash128& key, const codec::ChunkSpec& spec,
                               const kernels::PagedKvLayout& cache,
                               const kernels::BlockSpan& blocks, cudaStream_t stream,
                               const PutOptions& options) {
  KVTIER_ASSIGN_OR_RETURN(codec::ChunkLayout layout, codec::ValidateSpec(spec));
  absl::MutexLock l(&store_mu_);
  KVTIER_ASSIGN_OR_RETURN(WritableSlot slot, client_->AllocateSlot(layout.total_bytes));
  absl::Status st = kernels::GatherEncode(spec, cache, blocks,
                                          const_cast<uint8_t*>(Device(slot.data.data())),
                                          workspace_, stream);
  if (st.ok()) {
    st = kernels::CudaStatus(cudaStreamSynchronize(stream), "cudaStreamSynchronize", __FILE__,
                             __LINE__);
  }
  // The kernel wrote everything but the checksums, straight into the slot.
  if (st.ok()) st = codec::SealChunk(slot.data);
  if (!st.ok()) {
    (void)client_->AbortSlot(slot);
    return st;
  }
  return client_->CommitSlot(slot, key, options);
}

absl::StatusOr<Tier> GpuPagedIo::Load(const Hash128& key, const kernels::PagedKvLayout& cache,
                                      const kernels::BlockSpan& blocks, cudaStream_t stream) {
  bool verify = false;
  for (;;) {
    KVTIER_ASSIGN_OR_RETURN(HeldChunk held, client_->Hold(key, verify));
    // The reader's check of the bytes the kernel is about to read; on a
    // mismatch the daemon checks the stored chunk (and drops it if corrupt).
    auto header = wire::VerifyChunkParallel(held.data);
    if (!header.ok()) {
      (void)client_->Unhold(held);
      if (verify) {
        return absl::DataLossError(absl::StrCat("chunk ", key.ToHex(), " changed while read: ",
                                                header.status().message()));
      }
      verify = true;
      continue;
    }
    absl::Status st = kernels::DecodeScatter(header->header(), Device(held.data.data()), cache, blocks, stream);
    if (st.ok()) {
      st = kernels::CudaStatus(cudaStreamSynchronize(stream), "cudaStreamSynchronize", __FILE__,
                               __LINE__);
    }
    absl::Status u = client_->Unhold(held);
    if (!st.ok()) return st;
    if (!u.ok()) return u;
    return held.tier;
  }
}

}  // namespace kvtier::client
