// Paged decode attention (one query token per sequence, grouped-query heads)
// that reads the cache's blocks directly: BF16/FP16 K and V, K16/V8 (V in FP8
// e4m3 with per-(block, head) scales, dequantized in registers), or
// symmetric FP8 K and V. One CTA per (sequence, kv head, context partition)
// serves the whole group of q heads of its kv head, so every K/V row is read
// from device memory once; a multi-stage cp.async pipeline keeps several
// tiles of rows in flight. The partition length is chosen from the shape and
// the GPU (DecodeAttentionPartitionTokensFor) so that the CTAs fill the GPU,
// and a second kernel combines the partitions' softmax states (skipped when
// there is one partition: the partial kernel then writes the output).
//
// Tolerance against ReferenceDecodeAttention (FP32/FP64 CPU): see
// kernels/README.md.
#ifndef KVTIER_KERNELS_PAGED_ATTENTION_H_
#define KVTIER_KERNELS_PAGED_ATTENTION_H_

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "codec/format.h"
#include "kernels/paged_layout.h"

// The launcher takes the stream as the CUDA runtime's opaque handle, declared
// here exactly as the runtime declares it (a redeclaration of the same type is
// valid C++ in either include order), so this header needs no CUDA headers:
// the CPU reference includes it for DecodeAttentionParams and builds where
// CUDA is disabled.
struct CUstream_st;
using cudaStream_t = CUstream_st*;

namespace kvtier::kernels {

inline constexpr uint32_t kAttentionMinPartitionTokens = 64;
inline constexpr uint32_t kAttentionMaxPartitionTokens = 8192;
inline constexpr uint32_t kAttentionMaxGroup = 8;  // q heads per kv head

// Which partial-attention kernel PagedDecodeAttention runs. Both compute the
// same function within the documented tolerance (they differ in rounding: the
// tensor-core kernel rounds probabilities to 16 bits before P.V). For
// benchmarks and tests; the CPU reference ignores it.
enum class AttentionKernel : uint8_t {
  kAuto = 0,    // kTensorCore for >= 4 q heads per kv head, else kCudaCore
  kCudaCore,    // FP32 FMAs on CUDA cores (one cp.async CTA pipeline)
  kTensorCore,  // mma.sync m16n8k16 (16-bit inputs, FP32 accumulate), same pipeline
};

// One decode step of attention over a paged cache (one query token per
// sequence), for PagedDecodeAttention and ReferenceDecodeAttention
// (kernels/reference.h). Shapes: q [batch][num_q_heads][head_dim] (16-bit,
// q_dtype); block_table [batch][max_blocks_per_seq]; seq_lens [batch]; output
// the same shape as q. num_q_heads is a multiple of the cache's num_kv_heads
// (GQA: q head h reads kv head h / (num_q_heads / num_kv_heads)).
struct DecodeAttentionParams {
  const void* q = nullptr;               // device (kernel) / host (reference)
  codec::DType q_dtype = codec::DType::kBF16;  // also the output dtype
  uint32_t batch = 0;
  uint32_t num_q_heads = 0;
  const int32_t* block_table = nullptr;  // [batch][max_blocks_per_seq]
  uint32_t max_blocks_per_seq = 0;
  const int32_t* seq_lens = nullptr;     // [batch], each in [1, max_blocks_per_seq*block_size]
  // Optional host copies; when set the launcher checks every id and length
  // before launching, otherwise the caller guarantees them.
  const int32_t* host_block_table = nullptr;
  const int32_t* host_seq_lens = nullptr;
  uint32_t layer = 0;
  float sm_scale = 0.0f;  // softmax scale, usually 1/sqrt(head_dim)
  void* out = nullptr;    // [batch][num_q_heads][head_dim], q_dtype
  // GPU kernel only: tokens per context partition (a multiple of 32, at most
  // kAttentionMaxPartitionTokens), or 0 to let the launcher choose from the
  // shape and the GPU (DecodeAttentionPartitionTokensFor). The result does not depend on it
  // beyond rounding. Default: 0.
  uint32_t partition_tokens = 0;
  // GPU kernel only: see AttentionKernel. Default: kAuto.
  AttentionKernel kernel = AttentionKernel::kAuto;
};

// The host-side checks that the kernel launcher and the CPU reference share:
// a valid descriptor, non-null q / out / block_table / seq_lens, 16-bit q
// whose dtype matches every 16-bit cache section, batch and
// max_blocks_per_seq > 0, num_q_heads a positive multiple of num_kv_heads,
// layer in range, finite sm_scale > 0, and (when the host copies are given)
// every length and used block id in range. The kernel's own limits (the
// shapes of kernels/dispatch.h, group size, dtype pairs, partitions) are
// checked by PagedDecodeAttention on top. InvalidArgument naming the field.
// Built without CUDA (kvtier_kernels_ref).
absl::Status ValidateDecodeAttention(const PagedKvLayout& cache, const DecodeAttentionParams& p);

// Tokens per context partition of the tensor-core kernel for `batch`
// sequences of up to `max_tokens` tokens over `num_kv_heads` kv heads, on a
// GPU of `sms` SMs running `ctas_per_sm` CTAs each: the largest power of two
// in [kAttentionMinPartitionTokens, kAttentionMaxPartitionTokens] that keeps
// every SM busy (at least `sms` CTAs) and either fits in one wave of CTAs or
// fills its last wave to at least kAttentionMinLastWaveFill; the smallest if
// none does. Longer partitions cost fewer pipeline fills, epilogues and
// combine rows; a last wave of few CTAs leaves HBM idle (measured on the H100:
// bench/results/kernels.md). The CUDA-core kernel keeps its own
// rule (at most 2048 partitions, at most 1024 tokens each).
inline constexpr double kAttentionMinLastWaveFill = 0.9;
uint32_t DecodeAttentionPartitionTokens(uint32_t batch, uint32_t num_kv_heads,
                                        uint64_t max_tokens, uint32_t sms, uint32_t ctas_per_sm);

// The partition length PagedDecodeAttention will use for this call: the
// caller's `partition_tokens`, or the rule of the kernel it runs (the
// tensor-core rule with the current device's SM count; 132 SMs without a
// device). InvalidArgument as PagedDecodeAttention.
absl::StatusOr<uint32_t> DecodeAttentionPartitionTokensFor(const PagedKvLayout& cache,
                                                           const DecodeAttentionParams& p);

// Device workspace bytes PagedDecodeAttention needs for `p` (FP32 partial
// results of every partition). InvalidArgument as PagedDecodeAttention.
absl::StatusOr<size_t> DecodeAttentionWorkspaceBytes(const PagedKvLayout& cache,
                                                     const DecodeAttentionParams& p);

// out = softmax(q . K^T * sm_scale) . V for every sequence and q head, over
// seq_lens[b] tokens at block_table[b]. All pointers of `p` are device
// pointers. Supported: the head_dims and block sizes of kernels/dispatch.h
// (head_dim 64/128/256; block size a power of two); 1..8 q heads per kv head;
// cache dtypes (bf16|fp16, same), (bf16|fp16, fp8e4m3) or (fp8e4m3, fp8e4m3)
// with q in the cache's 16-bit dtype (bf16 for fp8/fp8 caches, or fp16).
// InvalidArgument before any launch for anything else, a null pointer, a
// workspace smaller than DecodeAttentionWorkspaceBytes, or out-of-range ids /
// lengths in the host copies when given (ValidateDecodeAttention's checks
// first). Asynchronous.
absl::Status PagedDecodeAttention(const PagedKvLayout& cache, const DecodeAttentionParams& p,
                                  void* workspace, size_t workspace_bytes, cudaStream_t stream);

}  // namespace kvtier::kernels

#endif  // KVTIER_KERNELS_PAGED_ATTENTION_H_
