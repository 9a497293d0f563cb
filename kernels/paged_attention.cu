#include "kernels/paged_attention.h"

#include <algorithm>
#include <atomic>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "kernels/cuda_status.h"
#include "kernels/dispatch.h"
#include "kernels/paged_attention_cuda_core.cuh"
#include "kernels/paged_attention_device.cuh"
#include "kernels/paged_attention_tensor_core.cuh"

// Design (FlashDecoding / FlashInfer style; numbers for Llama-3.1-8B shapes):
// - CTA = (partition, kv head, sequence), 4 warps. It holds the q vectors of
//   the whole GQA group in registers, so K and V rows are read once per kv
//   head, not once per q head.
// - The partition is walked in tiles of kTile tokens. A kStages-deep
//   cp.async pipeline copies each tile's K and V rows (and FP8 scales) into
//   shared memory with 16-byte copies; the depth is chosen so that about
//   32 KB of rows per CTA are in flight (2 BF16 tiles, 3 K16/V8, 4 FP8) while
//   the oldest tile is computed.
// - Within a warp, a token row is split over TG = head_dim / 8 lanes (8
//   elements each). A lane computes partial q.k dots for its U tokens and GP
//   q heads; a reduce-scatter over the TG lanes (TG-1 shuffles for all U*GP
//   dots, instead of log2(TG) shuffles per dot) leaves each lane with the
//   full dot of one (token, head) pair, so the exponentials are computed
//   once per logit, not once per lane.
// - Online softmax per warp (base-2, sm_scale * log2 e folded into q); the
//   probabilities go to the warp through shared memory; V rows are
//   dequantized in registers (FP8 codes -> half2 -> float, the per-(block,
//   head) scale folded into the probability) and accumulated per lane over
//   its 8 dims. At the end the warps' states are merged in shared memory and
//   the partition's (max, sum, unnormalized output) goes to the workspace.
// - A combine kernel merges the partitions of each (sequence, q head).
// - The above is the CUDA-core kernel (AttentionKernel::kCudaCore,
//   paged_attention_cuda_core.cuh). The tensor-core kernel (kTensorCore,
//   paged_attention_tensor_core.cuh) keeps the CTA, pipeline and combine and
//   does q.K^T and P.V with mma.sync; kAuto picks it for groups >=
//   kTensorCoreMinGroup. (Per-warp cp.async and
//   bulk-copy pipelines measure no faster than the CTA pipeline on an H100:
//   bench/results/kernels.md.)

namespace kvtier::kernels {
namespace attention_internal {
namespace {

template <int HD, bool BF16>
__global__ void __launch_bounds__(HD) AttnCombineKernel(const __grid_constant__ AttnParams p) {
  const uint32_t qh = blockIdx.x, b = blockIdx.y, d = threadIdx.x;
  const int len = __ldg(p.seq_lens + b);
  const int parts = (len + static_cast<int>(p.part_tokens) - 1) / static_cast<int>(p.part_tokens);
  const uint64_t row0 = (uint64_t{b} * p.num_q_heads + qh) * p.parts;
  float m = -INFINITY;
  for (int i = 0; i < parts; ++i) m = fmaxf(m, p.ws_ml[2 * (row0 + i)]);
  const float m_use = m == -INFINITY ? 0.0f : m;
  float l = 0.0f, acc = 0.0f;
  for (int i = 0; i < parts; ++i) {
    const float w = exp2f(p.ws_ml[2 * (row0 + i)] - m_use);
    l += w * p.ws_ml[2 * (row0 + i) + 1];
    acc += w * p.ws_acc[(row0 + i) * HD + d];
  }
  const float o = acc / l;
  static_cast<uint16_t*>(p.out)[(uint64_t{b} * p.num_q_heads + qh) * HD + d] = StoreOut<BF16>(o);
}

// Raises a kernel's dynamic shared-memory limit, once per device; `done` is
// the kernel's own bit set of devices already raised.
absl::Status AllowSharedMemory(const void* kernel, int bytes, std::atomic<uint64_t>& done) {
  int dev = 0;
  KVTIER_CUDA_RETURN_IF_ERROR(cudaGetDevice(&dev));
  const uint64_t bit = dev < 64 ? uint64_t{1} << dev : 0;
  if (bit != 0 && (done.load(std::memory_order_acquire) & bit) != 0) return absl::OkStatus();
  KVTIER_CUDA_RETURN_IF_ERROR(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  done.fetch_or(bit, std::memory_order_acq_rel);
  return absl::OkStatus();
}

template <typename Kernel>
absl::Status LaunchPartial(Kernel* kernel, int smem_bytes, std::atomic<uint64_t>& raised,
                           const AttnParams& a, uint32_t batch, cudaStream_t stream) {
  KVTIER_RETURN_IF_ERROR(
      AllowSharedMemory(reinterpret_cast<const void*>(kernel), smem_bytes, raised));
  const dim3 grid(a.cache.num_kv_heads, a.parts, batch);
  kernel<<<grid, kThreads, smem_bytes, stream>>>(a);
  KVTIER_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return absl::OkStatus();
}

// Groups of up to 4 q heads run the GP = 4 CUDA-core kernel (smaller groups
// compute padding heads with zero q, which costs arithmetic, not memory
// traffic). The tensor-core kernel serves every group (rows padded to 16).
template <int HD, bool K8, bool V8, bool BF16>
absl::Status LaunchTyped(const AttnParams& a, uint32_t batch, cudaStream_t stream) {
  const AttentionKernel k = a.kernel;  // resolved by PrepareAttention
  static std::atomic<uint64_t> raised_tc{0}, raised4{0}, raised8{0};  // per instantiation
  const absl::Status st =
      k == AttentionKernel::kTensorCore
          ? LaunchPartial(&AttnPartialTcKernel<HD, K8, V8, BF16>, TcGeometry<HD, K8, V8>::SMEM,
                          raised_tc, a, batch, stream)
      : a.group <= 4 ? LaunchPartial(&AttnPartialKernel<HD, 4, K8, V8, BF16>,
                                     Geometry<HD, 4, K8, V8>::SMEM, raised4, a, batch, stream)
                     : LaunchPartial(&AttnPartialKernel<HD, 8, K8, V8, BF16>,
                                     Geometry<HD, 8, K8, V8>::SMEM, raised8, a, batch, stream);
  KVTIER_RETURN_IF_ERROR(st);
  if (a.parts == 1) return absl::OkStatus();  // the partial kernel wrote the output
  AttnCombineKernel<HD, BF16><<<dim3(a.num_q_heads, batch), HD, 0, stream>>>(a);
  KVTIER_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return absl::OkStatus();
}

// The one dispatch point from runtime dtypes to template arguments (head_dim:
// KVTIER_DISPATCH_HEAD_DIM in PagedDecodeAttention).
template <int HD>
absl::Status LaunchHd(const AttnParams& a, uint32_t batch, bool k8, bool v8, bool bf16,
                      cudaStream_t stream) {
  if (!k8 && !v8) return bf16 ? LaunchTyped<HD, false, false, true>(a, batch, stream)
                              : LaunchTyped<HD, false, false, false>(a, batch, stream);
  if (!k8 && v8) return bf16 ? LaunchTyped<HD, false, true, true>(a, batch, stream)
                             : LaunchTyped<HD, false, true, false>(a, batch, stream);
  if (k8 && v8) return bf16 ? LaunchTyped<HD, true, true, true>(a, batch, stream)
                            : LaunchTyped<HD, true, true, false>(a, batch, stream);
  return absl::InvalidArgumentError("attention: fp8 K with 16-bit V is not supported");
}

// CTAs per SM of the tensor-core instantiation for these dtypes
// (TcGeometry::CTAS: shared memory and __launch_bounds__ allow that many).
absl::StatusOr<int> TcCtasPerSm(uint32_t head_dim, bool k8, bool v8) {
  int ctas = 0;
  KVTIER_RETURN_IF_ERROR(KVTIER_DISPATCH_HEAD_DIM(head_dim, HD, {
    ctas = k8 ? TcGeometry<HD, true, true>::CTAS
              : (v8 ? TcGeometry<HD, false, true>::CTAS : TcGeometry<HD, false, false>::CTAS);
  }));
  return ctas;
}

// SMs of the current device, looked up once per device. Without a device
// (CPU-only validation and workspace sizing) an H100's 132: nothing launches
// then, and DecodeAttentionWorkspaceBytes and PagedDecodeAttention still agree.
uint32_t CurrentDeviceSms() {
  constexpr uint32_t kNoDeviceSms = 132;
  static std::atomic<uint32_t> cached[64] = {};
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) {
    (void)cudaGetLastError();  // not left for a later launch check to find
    return kNoDeviceSms;
  }
  if (dev >= 0 && dev < 64) {
    if (const uint32_t n = cached[dev].load(std::memory_order_relaxed); n != 0) return n;
  }
  int sms = 0;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || sms <= 0) {
    (void)cudaGetLastError();
    return kNoDeviceSms;
  }
  if (dev >= 0 && dev < 64) cached[dev].store(static_cast<uint32_t>(sms), std::memory_order_relaxed);
  return static_cast<uint32_t>(sms);
}

// The CUDA-core kernel's rule (runs 3a/3b): the smallest power of two from
// kMinPart up to kCudaCoreMaxPart leaving at most kTargetParts partitions.
uint32_t CudaCorePartitionTokens(uint32_t batch, uint32_t num_kv_heads, uint64_t max_tokens) {
  const uint64_t work = uint64_t{batch} * num_kv_heads * max_tokens;
  uint32_t part = kMinPart;
  while (part < kCudaCoreMaxPart && work / part > kTargetParts) part *= 2;
  return part;
}

absl::StatusOr<AttnParams> PrepareAttention(const PagedKvLayout& cache,
                                            const DecodeAttentionParams& p) {
  KVTIER_RETURN_IF_ERROR(ValidateDecodeAttention(cache, p));
  KVTIER_RETURN_IF_ERROR(CheckHeadDim(cache.head_dim, "attention: "));
  const uint32_t bs = cache.block_size;
  KVTIER_RETURN_IF_ERROR(CheckAttentionBlockSize(bs, "attention: "));
  const uint32_t group = p.num_q_heads / cache.num_kv_heads;
  if (group > kAttentionMaxGroup) {
    return absl::InvalidArgumentError(absl::StrCat("attention: ", group,
                                                   " q heads per kv head; at most ",
                                                   kAttentionMaxGroup));
  }
  if (cache.k_dtype == DType::kFP8E4M3 && cache.v_dtype != DType::kFP8E4M3) {
    return absl::InvalidArgumentError("attention: fp8 K with 16-bit V is not supported");
  }
  if (p.batch > 65535) return absl::InvalidArgumentError("attention: batch > 65535");
  if (cache.num_kv_heads > 2147483647u) {
    return absl::InvalidArgumentError("attention: num_kv_heads too large");
  }
  // The kernels' row offsets are 32x32->64-bit products (CtaPartition).
  constexpr int64_t kMaxStride = int64_t{1} << 32;
  if (cache.stride_block < 0 || cache.stride_block >= kMaxStride || cache.stride_token < 0 ||
      cache.stride_token * (bs - 1) >= kMaxStride) {
    return absl::InvalidArgumentError(
        absl::StrCat("attention: stride_block = ", cache.stride_block, ", stride_token = ",
                     cache.stride_token, "; both must be below 2^32 elements within a block"));
  }
  AttnParams a{};
  a.cache = cache;
  a.q = p.q;
  a.out = p.out;
  a.block_table = p.block_table;
  a.seq_lens = p.seq_lens;
  a.max_blocks_per_seq = p.max_blocks_per_seq;
  a.num_q_heads = p.num_q_heads;
  a.group = group;
  const uint64_t max_tokens = uint64_t{p.max_blocks_per_seq} * bs;
  if (max_tokens > (uint64_t{1} << 30)) {
    return absl::InvalidArgumentError("attention: max_blocks_per_seq * block_size > 2^30");
  }
  if (p.partition_tokens != 0 &&
      (p.partition_tokens % kTile != 0 || p.partition_tokens > kAttentionMaxPartitionTokens)) {
    return absl::InvalidArgumentError(absl::StrCat("attention: partition_tokens = ",
                                                   p.partition_tokens, " is not 0 or a multiple of ",
                                                   kTile, " up to ", kAttentionMaxPartitionTokens));
  }
  if (p.kernel != AttentionKernel::kAuto && p.kernel != AttentionKernel::kCudaCore &&
      p.kernel != AttentionKernel::kTensorCore) {
    return absl::InvalidArgumentError("attention: unknown kernel choice");
  }
  a.kernel = p.kernel != AttentionKernel::kAuto ? p.kernel
             : group >= kTensorCoreMinGroup
                 ? AttentionKernel::kTensorCore
                 : AttentionKernel::kCudaCore;
  if (p.partition_tokens != 0) {
    a.part_tokens = p.partition_tokens;
  } else if (a.kernel == AttentionKernel::kTensorCore) {
    KVTIER_ASSIGN_OR_RETURN(const int ctas_per_sm,
                            TcCtasPerSm(cache.head_dim, cache.k_dtype == DType::kFP8E4M3,
                                        cache.v_dtype == DType::kFP8E4M3));
    a.part_tokens = DecodeAttentionPartitionTokens(p.batch, cache.num_kv_heads, max_tokens,
                                                   CurrentDeviceSms(),
                                                   static_cast<uint32_t>(ctas_per_sm));
  } else {
    a.part_tokens = CudaCorePartitionTokens(p.batch, cache.num_kv_heads, max_tokens);
  }
  a.parts = static_cast<uint32_t>((max_tokens + a.part_tokens - 1) / a.part_tokens);
  if (a.parts > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("attention: ", a.parts, " partitions of ",
                                                   a.part_tokens, " tokens; at most 65535"));
  }
  a.layer = p.layer;
  a.bs_shift = static_cast<uint32_t>(__builtin_ctz(bs));
  a.q_scale = p.sm_scale * kLog2e;
  return a;
}

size_t WorkspaceFor(const AttnParams& a, uint32_t batch) {
  const uint64_t rows = uint64_t{batch} * a.num_q_heads * a.parts;
  return rows * (a.cache.head_dim + 2) * sizeof(float);
}

// PrepareAttention for shape-only questions: any non-null placeholder is
// fine for the pointers.
absl::StatusOr<AttnParams> PrepareShape(const PagedKvLayout& cache, const DecodeAttentionParams& p) {
  DecodeAttentionParams q = p;
  static const int kDummy = 0;
  if (q.q == nullptr) q.q = &kDummy;
  if (q.out == nullptr) q.out = const_cast<int*>(&kDummy);
  if (q.block_table == nullptr) q.block_table = &kDummy;
  if (q.seq_lens == nullptr) q.seq_lens = &kDummy;
  return PrepareAttention(cache, q);
}

}  // namespace
}  // namespace attention_internal

using attention_internal::AttnParams;
using attention_internal::LaunchHd;
using attention_internal::PrepareAttention;
using attention_internal::PrepareShape;
using attention_internal::WorkspaceFor;
using codec::DType;

uint32_t DecodeAttentionPartitionTokens(uint32_t batch, uint32_t num_kv_heads,
                                        uint64_t max_tokens, uint32_t sms, uint32_t ctas_per_sm) {
  const uint64_t slots = uint64_t{std::max(sms, 1u)} * std::max(ctas_per_sm, 1u);
  uint32_t best = kAttentionMinPartitionTokens;
  for (uint32_t part = kAttentionMinPartitionTokens; part <= kAttentionMaxPartitionTokens;
       part *= 2) {
    const uint64_t parts = (max_tokens + part - 1) / part;
    const uint64_t ctas = uint64_t{batch} * num_kv_heads * parts;
    if (ctas < sms) break;  // an idle SM; larger partitions leave more idle
    const uint64_t waves = (ctas + slots - 1) / slots;
    if (ctas <= slots || static_cast<double>(ctas) / static_cast<double>(waves * slots) >=
                             kAttentionMinLastWaveFill) {
      best = part;
    }
    if (parts == 1) break;  // larger partitions are the same partition
  }
  return best;
}

absl::StatusOr<uint32_t> DecodeAttentionPartitionTokensFor(const PagedKvLayout& cache,
                                                           const DecodeAttentionParams& p) {
  KVTIER_ASSIGN_OR_RETURN(AttnParams a, PrepareShape(cache, p));
  return a.part_tokens;
}

absl::StatusOr<size_t> DecodeAttentionWorkspaceBytes(const PagedKvLayout& cache,
                                                     const DecodeAttentionParams& p) {
  KVTIER_ASSIGN_OR_RETURN(AttnParams a, PrepareShape(cache, p));
  return WorkspaceFor(a, p.batch);
}

absl::Status PagedDecodeAttention(const PagedKvLayout& cache, const DecodeAttentionParams& p,
                                  void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  KVTIER_ASSIGN_OR_RETURN(AttnParams a, PrepareAttention(cache, p));
  const size_t need = WorkspaceFor(a, p.batch);
  if (workspace == nullptr || workspace_bytes < need) {
    return absl::InvalidArgumentError(absl::StrCat("attention: workspace of ", workspace_bytes,
                                                   " bytes, need ", need));
  }
  if (reinterpret_cast<uintptr_t>(workspace) % 16 != 0) {
    return absl::InvalidArgumentError("attention: workspace is not 16-byte aligned");
  }
  const uint64_t rows = uint64_t{p.batch} * a.num_q_heads * a.parts;
  a.ws_acc = static_cast<float*>(workspace);
  a.ws_ml = a.ws_acc + rows * cache.head_dim;
  const bool k8 = cache.k_dtype == DType::kFP8E4M3, v8 = cache.v_dtype == DType::kFP8E4M3;
  const bool bf16 = p.q_dtype == DType::kBF16;
  return KVTIER_DISPATCH_HEAD_DIM(cache.head_dim, HD,
                                  { return LaunchHd<HD>(a, p.batch, k8, v8, bf16, stream); });
}

}  // namespace kvtier::kernels
