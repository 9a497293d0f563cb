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

// K and V of one chunk in caller memory, row by row: the kv_heads*head_dim
// 16-bit elements of (layer l, token t) start at k + l*layer_stride +
// t*token_stride (elements), likewise in v. An engine's host pool keeps a
// page this way (SGLang's page_first: token-major; layer_first: layer-major
// with the whole pool between two layers). Contiguous() is the chunk's own
// [layers][tokens][kv_heads][head_dim] order.
template <typename T>
struct KvRows {
  T* k = nullptr;
  T* v = nullptr;
  uint64_t layer_stride = 0;
  uint64_t token_stride = 0;

  static KvRows Contiguous(T* k, T* v, const Geometry& g) {
    return KvRows{k, v, g.layer_elements(), uint64_t{g.num_kv_heads} * g.head_dim};
  }
};

// InvalidArgument unless `rows` has both pointers and strides that keep each
// row (kv_heads*head_dim elements) apart within a layer and each layer's
// rows apart from the next layer's in one of the two orders (layer-major or
// token-major).
template <typename T>
absl::Status ValidateRows(const KvRows<T>& rows, const Geometry& geometry);

// Encodes one section layer: `src` holds the layer's tokens, row t (its
// kv_heads*head_dim 16-bit elements of `src_dtype`) at src + t*token_stride;
// writes data_bytes + scale_bytes at `dst` (the layer's data and scales,
// padding zeroed). Returns true if any input was non-finite. REQUIRES: dst
// has layout.layer_stride bytes.
bool EncodeSectionLayer(const SectionLayout& layout, const Geometry& geometry, DType src_dtype,
                        const uint16_t* src, uint64_t token_stride, uint8_t* dst);

// Decodes one section layer back to 16-bit elements of `dst_dtype`, row t at
// dst + t*token_stride.
void DecodeSectionLayer(const SectionLayout& layout, const Geometry& geometry, DType dst_dtype,
                        const uint8_t* src, uint16_t* dst, uint64_t token_stride);

// Encodes K and V into a sealed chunk. spec.flags is computed (kFlagNonFinite
// set when any input value is NaN or infinite). InvalidArgument when the spec
// is invalid or the views do not hold layers*tokens*heads*dim elements each.
absl::StatusOr<std::vector<uint8_t>> EncodeChunk(const ChunkSpec& spec, KvView kv);

// As EncodeChunk, into a caller buffer of exactly layout.total_bytes bytes.
absl::Status EncodeChunkInto(const ChunkSpec& spec, KvView kv, std::span<uint8_t> out);

// As EncodeChunkInto, from rows in caller memory (ValidateRows). With `seal`
// false the checksums are left zero for a sealer (SealChunk; the daemon's
// commit of a slot with PutOptions::daemon_seals), as the GPU encode leaves
// them.
absl::Status EncodeChunkRows(const ChunkSpec& spec, KvRows<const uint16_t> kv,
                             std::span<uint8_t> out, bool seal = true);

// Decodes layers [begin, end) of `chunk` (whose header ParseHeader parsed
// into `header`) into rows in caller memory (ValidateRows; layer `begin` is
// the rows' layer 0), converting to header.spec.dtype. With `verify`, each
// layer record is checked just before it is decoded (version 2: the record
// tables first, then each record; version 1, whose checksums cover whole
// sections: both sections first): DataLoss for a mismatch, after which the
// rows of the layers before the bad record hold their decoded values.
// InvalidArgument for a bad range or rows, or a chunk that is not the
// header's length.
absl::Status DecodeChunkRows(const ChunkHeader& header, std::span<const uint8_t> chunk,
                             uint32_t begin, uint32_t end, KvRows<uint16_t> out, bool verify);

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
