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
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "codec/chunk.h"
#include "kernels/paged_attention.h"
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
// covered by the chunk are left untouched; with `layers`, only those layers
// are written (DecodeScatter's layer ranges). Errors as
// ReferenceGatherEncode, plus VerifyChunk's and ValidateLayerRange's.
absl::Status ReferenceDecodeScatter(std::span<const uint8_t> chunk, const PagedKvLayout& cache,
                                    const BlockSpan& span, LayerRange layers = {});

// The byte ranges [first, second) of a chunk of `layout` that hold layers
// [layers.begin, layers.end): the K section's records, then the V section's
// (each layer's record is data, scales and padding). GatherEncode of a layer
// range writes exactly these bytes and the header.
// REQUIRES: `layers` is valid for layout.geometry.num_layers.
std::vector<std::pair<uint64_t, uint64_t>> LayerRecordBytes(const codec::ChunkLayout& layout,
                                                            LayerRange layers);

// FP32 reference of PagedDecodeAttention (kernels/paged_attention.h):
// softmax(q . k * sm_scale) . v with K and V read through CacheElement.
// Returns [batch][num_q_heads][head_dim] floats. Reads q, block_table and
// seq_lens through the host pointers of `p` (p.q, p.block_table and
// p.seq_lens must be host memory here); ignores partition_tokens and kernel.
// Any head_dim and block size ValidatePagedKvLayout accepts. InvalidArgument
// as ValidateDecodeAttention.
absl::StatusOr<std::vector<float>> ReferenceDecodeAttention(const PagedKvLayout& cache,
                                                            const DecodeAttentionParams& p);

}  // namespace kvtier::kernels

#endif  // KVTIER_KERNELS_REFERENCE_H_
