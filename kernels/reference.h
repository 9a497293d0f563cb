// CPU references of the paged kernels, fed the same descriptor as the
// kernels (with host pointers). Gather+encode and decode+scatter are built on
// the codec's reference (codec::EncodeChunk / DecodeChunk and the section
// functions), so a kernel that matches them byte for byte matches the codec.
//
// Thread-safe: all functions are pure apart from writing their outputs.
#ifndef KVTIER_KERNELS_REFERENCE_H_
#define KVTIER_KERNELS_REFERENCE_H_

#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "codec/chunk.h"
#include "kernels/paged_layout.h"

namespace kvtier::kernels {

// Value of cache element (layer, block, slot, head, dim) as float: 16-bit
// elements exactly, FP8 elements as float(code) * scale[block][head].
// REQUIRES: `cache` holds host pointers.
float CacheElement(const PagedKvLayout& cache, bool is_v, uint32_t layer, uint32_t block,
                   uint32_t slot, uint32_t head, uint32_t dim);

// Copies `num_tokens` tokens of a 16-bit section (K or V) of every layer out
// of the paged cache into [layers][tokens][kv_heads][head_dim] order.
// REQUIRES: host pointers; the section's dtype is 16-bit; span validated.
std::vector<uint16_t> GatherSection(const PagedKvLayout& cache, bool is_v,
                                    const BlockSpan& span, uint32_t num_tokens);

// The chunk that GatherEncode must produce (sealed). When both cache
// sections are 16-bit this is exactly codec::EncodeChunk of the gathered
// data. An FP8 cache section is passed through (codes and per-(block, head)
// scales copied), which needs an FP8 per-(block, head) chunk section and
// first_slot == 0; a passed-through code with all exponent and mantissa
// bits set (NaN) sets kFlagNonFinite. InvalidArgument for a bad spec,
// descriptor or span, or an unsupported cache/format pair.
absl::StatusOr<std::vector<uint8_t>> ReferenceGatherEncode(const codec::ChunkSpec& spec,
                                                           const PagedKvLayout& cache,
                                                           const BlockSpan& span);

// Verifies and decodes `chunk` into the paged cache at `span`: 16-bit cache
// sections receive codec::DecodeChunk's values; FP8 cache sections receive the
// chunk's FP8 codes and scales unchanged (first_slot must be 0). Slots not
// covered by the chunk are left untouched. Errors as ReferenceGatherEncode,
// plus VerifyChunk's.
absl::Status ReferenceDecodeScatter(std::span<const uint8_t> chunk, const PagedKvLayout& cache,
                                    const BlockSpan& span);

// One decode step of attention over a paged cache (one query token per
// sequence). Shapes: q [batch][num_q_heads][head_dim] (16-bit, q_dtype);
// block_table [batch][max_blocks_per_seq]; seq_lens [batch]; output the same
// shape as q. num_q_heads is a multiple of the cache's num_kv_heads (GQA:
// q head h reads kv head h / (num_q_heads / num_kv_heads)).
// GPU kernel only: which partial-attention kernel PagedDecodeAttention runs.
// Both compute the same function within the documented tolerance (they
// differ in rounding: the tensor-core kernel rounds probabilities to 16 bits
// before P.V). For benchmarks and tests.
enum class AttentionKernel : uint8_t {
  kAuto = 0,    // kTensorCore for >= 4 q heads per kv head, else kCudaCore
  kCudaCore,    // FP32 FMAs on CUDA cores (one cp.async CTA pipeline)
  kTensorCore,  // mma.sync m16n8k16 (16-bit inputs, FP32 accumulate), same pipeline
};

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

// Host-side validation shared by the kernel launcher and the reference.
absl::Status ValidateDecodeAttention(const PagedKvLayout& cache, const DecodeAttentionParams& p);

// FP32 reference: softmax(q . k * sm_scale) . v with K and V read through
// CacheElement. Returns [batch][num_q_heads][head_dim] floats. Reads q,
// block_table and seq_lens through the host pointers of `p`
// (p.q, p.block_table and p.seq_lens must be host memory here).
absl::StatusOr<std::vector<float>> ReferenceDecodeAttention(const PagedKvLayout& cache,
                                                            const DecodeAttentionParams& p);

}  // namespace kvtier::kernels

#endif  // KVTIER_KERNELS_REFERENCE_H_
