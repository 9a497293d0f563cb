// CPU reference encoder and decoder of the chunk format. These are the
// reference the GPU kernels must match byte for byte.
//
// Thread-safe: all functions are pure.
#ifndef KVTIER_CODEC_CODEC_H_
#define KVTIER_CODEC_CODEC_H_

#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "codec/chunk.h"

namespace kvtier::codec {

// K and V of one chunk as 16-bit elements (bits of spec.dtype) in
// [layers][tokens][kv_heads][head_dim] order.
struct KvView {
  std::span<const uint16_t> k;
  std::span<const uint16_t> v;
};

// Encodes one section layer: `src` holds tokens*kv_heads*head_dim 16-bit
// elements of `src_dtype`; writes data_bytes + scale_bytes at `dst` (the
// layer's data and scales, padding zeroed). Returns true if any input was
// non-finite. REQUIRES: dst has layout.layer_stride bytes.
bool EncodeSectionLayer(const SectionLayout& layout, const Geometry& geometry, DType src_dtype,
                        const uint16_t* src, uint8_t* dst);

// Decodes one section layer back to 16-bit elements of `dst_dtype`.
void DecodeSectionLayer(const SectionLayout& layout, const Geometry& geometry, DType dst_dtype,
                        const uint8_t* src, uint16_t* dst);

// Encodes K and V into a sealed chunk. spec.flags is computed (kFlagNonFinite
// set when any input value is NaN or infinite). InvalidArgument when the spec
// is invalid or the views do not hold layers*tokens*heads*dim elements each.
absl::StatusOr<std::vector<uint8_t>> EncodeChunk(const ChunkSpec& spec, KvView kv);

// As EncodeChunk, into a caller buffer of exactly layout.total_bytes bytes.
absl::Status EncodeChunkInto(const ChunkSpec& spec, KvView kv, std::span<uint8_t> out);

struct DecodedChunk {
  ChunkHeader header;
  std::vector<uint16_t> k;  // bits of header.spec.dtype, [layers][tokens][heads][dim]
  std::vector<uint16_t> v;
};

// Verifies (VerifyChunk) and decodes a chunk; quantized sections are
// dequantized to spec.dtype. InvalidArgument / DataLoss as VerifyChunk.
absl::StatusOr<DecodedChunk> DecodeChunk(std::span<const uint8_t> chunk);

}  // namespace kvtier::codec

#endif  // KVTIER_CODEC_CODEC_H_
