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

#include <cuda_runtime_api.h>

#include <cstddef>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/paged_layout.h"
#include "kernels/reference.h"

namespace kvtier::kernels {

inline constexpr uint32_t kAttentionMinPartitionTokens = 64;
inline constexpr uint32_t kAttentionMaxPartitionTokens = 8192;
inline constexpr uint32_t kAttentionMaxGroup = 8;  // q heads per kv head

// Tokens per context partition of the tensor-core kernel for `batch`
// sequences of up to `max_tokens` tokens over `num_kv_heads` kv heads, on a
// GPU of `sms` SMs running `ctas_per_sm` CTAs each: the largest power of two
// in [kAttentionMinPartitionTokens, kAttentionMaxPartitionTokens] that keeps
// every SM busy (at least `sms` CTAs) and either fits in one wave of CTAs or
// fills its last wave to at least kAttentionMinLastWaveFill; the smallest if
// none does. Longer partitions cost fewer pipeline fills, epilogues and
// combine rows; a last wave of few CTAs leaves HBM idle (run 8 on the H100:
// bench/results/h100-2026-11-22-run8-*). The CUDA-core kernel keeps its own
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
// pointers. Supported: head_dim 64/128/256; block size a power of two;
// 1..8 q heads per kv head; cache dtypes (bf16|fp16, same), (bf16|fp16,
// fp8e4m3) or (fp8e4m3, fp8e4m3) with q in the cache's 16-bit dtype (bf16 for
// fp8/fp8 caches, or fp16). InvalidArgument before any launch for anything
// else, a null pointer, a workspace smaller than DecodeAttentionWorkspaceBytes,
// or out-of-range ids / lengths in the host copies when given. Asynchronous.
absl::Status PagedDecodeAttention(const PagedKvLayout& cache, const DecodeAttentionParams& p,
                                  void* workspace, size_t workspace_bytes, cudaStream_t stream);

}  // namespace kvtier::kernels

#endif  // KVTIER_KERNELS_PAGED_ATTENTION_H_
