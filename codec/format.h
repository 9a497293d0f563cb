// The kvtier chunk format: enums, geometry and the byte layout of a chunk.
// codec/FORMAT.md is the normative spec; this header is its executable form.
//
// Everything in ChunkLayout is plain data with KVTIER_HD offset methods, so
// the CUDA kernels, the CPU reference codec and the tests compute every
// address with the same code.
#ifndef KVTIER_CODEC_FORMAT_H_
#define KVTIER_CODEC_FORMAT_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "common/host_device.h"

namespace kvtier::codec {

// --- Constants that name their bytes (FORMAT.md "Header") ---
inline constexpr uint32_t kMagic = 0x4354564B;  // bytes 'K' 'V' 'T' 'C' little-endian
inline constexpr uint16_t kVersion = 2;     // the version writers write
inline constexpr uint16_t kMinVersion = 1;  // the oldest version readers read
inline constexpr uint32_t kHeaderSize = 128;
inline constexpr uint32_t kSectionAlign = 16;  // every sub-array starts 16-byte aligned

// Limits a reader enforces before trusting any length (FORMAT.md "Limits").
inline constexpr uint32_t kMaxLayers = 1024;
inline constexpr uint32_t kMaxKvHeads = 1024;
inline constexpr uint32_t kMaxHeadDim = 1024;
inline constexpr uint32_t kMaxTokens = 1u << 20;
inline constexpr uint32_t kMaxBlockSize = 1u << 16;
inline constexpr uint64_t kMaxChunkBytes = uint64_t{16} << 30;  // 16 GiB

// Element formats of a section. 16-bit formats are stored natively (bit-exact);
// the others are quantized with scales.
enum class DType : uint8_t {
  kFP16 = 1,
  kBF16 = 2,
  kFP8E4M3 = 3,
  kINT8 = 4,
  kINT4 = 5,  // two values a byte, even element in the low nibble
};

// How many scales a quantized section carries per layer.
enum class ScaleGranularity : uint8_t {
  kNone = 0,          // 16-bit sections only
  kPerTensor = 1,     // one per layer
  kPerBlockHead = 2,  // one per (engine block of the chunk, kv head)
  kPerTokenHead = 3,  // one per (token, kv head)
};

enum class ScaleDType : uint8_t {
  kFP32 = 1,  // IEEE-754 binary32, little-endian
};

KVTIER_HD constexpr uint32_t BitsPerElement(DType t) {
  switch (t) {
    case DType::kFP16:
    case DType::kBF16:
      return 16;
    case DType::kFP8E4M3:
    case DType::kINT8:
      return 8;
    case DType::kINT4:
      return 4;
  }
  return 0;
}

KVTIER_HD constexpr bool IsQuantized(DType t) {
  return t == DType::kFP8E4M3 || t == DType::kINT8 || t == DType::kINT4;
}

// Largest code magnitude of a quantized format: scale = amax / QMax.
KVTIER_HD constexpr float QMax(DType t) {
  switch (t) {
    case DType::kFP8E4M3:
      return 448.0f;
    case DType::kINT8:
      return 127.0f;
    case DType::kINT4:
      return 7.0f;
    default:
      return 1.0f;
  }
}

KVTIER_HD constexpr uint64_t AlignUp(uint64_t n, uint64_t a) { return (n + a - 1) / a * a; }

// Shape of the KV in one chunk, for one model shard.
struct Geometry {
  uint32_t num_layers = 0;
  uint32_t num_kv_heads = 0;
  uint32_t head_dim = 0;
  uint32_t num_tokens = 0;
  uint32_t block_size = 16;  // the engine's paged-cache block size, in tokens

  KVTIER_HD uint32_t num_blocks() const { return (num_tokens + block_size - 1) / block_size; }
  // Elements of one layer of K (or V): tokens x kv_heads x head_dim.
  KVTIER_HD uint64_t layer_elements() const {
    return uint64_t{num_tokens} * num_kv_heads * head_dim;
  }
  friend bool operator==(const Geometry&, const Geometry&) = default;
};

// How one section (K or V) is stored.
struct SectionFormat {
  DType dtype = DType::kBF16;
  ScaleGranularity granularity = ScaleGranularity::kNone;
  friend bool operator==(const SectionFormat&, const SectionFormat&) = default;
};

// Byte layout of one section, per FORMAT.md "Sections". Offsets are relative
// to the section start. For each layer l:
//   data   [layer_stride*l, +data_bytes): elements in [token][kv_head][dim] order
//   scales [layer_stride*l + data_bytes, +scale_bytes): float32 scales
// then, in version 2, the record checksum table:
//   table  [table_offset, +table_bytes): u64 checksum of each layer record
struct SectionLayout {
  DType dtype = DType::kBF16;
  ScaleGranularity granularity = ScaleGranularity::kNone;
  uint32_t num_kv_heads = 0;
  uint32_t head_dim = 0;
  uint32_t block_size = 0;
  uint64_t data_bytes = 0;    // per layer, padded to kSectionAlign
  uint64_t scale_count = 0;   // per layer
  uint64_t scale_bytes = 0;   // per layer, padded to kSectionAlign
  uint64_t layer_stride = 0;  // data_bytes + scale_bytes
  uint32_t num_layers = 0;
  uint64_t table_offset = 0;  // num_layers * layer_stride
  uint64_t table_bytes = 0;   // version 2: align16(8 * num_layers); version 1: 0
  uint64_t bytes = 0;         // whole section: table_offset + table_bytes

  KVTIER_HD uint64_t data_offset(uint32_t layer) const { return layer_stride * layer; }
  KVTIER_HD uint64_t scale_offset(uint32_t layer) const {
    return layer_stride * layer + data_bytes;
  }
  // Index of an element within its layer's data, in elements.
  KVTIER_HD uint64_t element_index(uint32_t token, uint32_t head, uint32_t dim) const {
    return (uint64_t{token} * num_kv_heads + head) * head_dim + dim;
  }
  // Index of the scale that covers (token, head) within its layer's scales.
  KVTIER_HD uint64_t scale_index(uint32_t token, uint32_t head) const {
    switch (granularity) {
      case ScaleGranularity::kPerTensor:
        return 0;
      case ScaleGranularity::kPerBlockHead:
        return uint64_t{token / block_size} * num_kv_heads + head;
      case ScaleGranularity::kPerTokenHead:
        return uint64_t{token} * num_kv_heads + head;
      case ScaleGranularity::kNone:
        break;
    }
    return 0;
  }
};

// Where everything of a chunk lives: header, then the K section, then the V
// section, each starting at an offset that is a multiple of kSectionAlign.
struct ChunkLayout {
  uint16_t version = kVersion;
  Geometry geometry;
  SectionLayout k;
  SectionLayout v;
  uint64_t k_offset = kHeaderSize;
  uint64_t v_offset = 0;
  uint64_t total_bytes = 0;
};

// Header flag bits (FORMAT.md "Flags"); every other bit must be zero.
inline constexpr uint16_t kFlagNonFinite = 1u << 0;  // the input held NaN or infinity
inline constexpr uint16_t kKnownFlags = kFlagNonFinite;

// Computes the layout of a chunk of format `version`. InvalidArgument (naming
// the field) when the version is unknown, the geometry is out of the limits
// above, a format/granularity pair is not allowed, or the chunk would exceed
// kMaxChunkBytes.
absl::StatusOr<ChunkLayout> ComputeLayout(const Geometry& geometry, SectionFormat k,
                                          SectionFormat v, uint16_t version = kVersion);

const char* DTypeName(DType t);  // "fp16", "bf16", "fp8e4m3", "int8", "int4"
const char* GranularityName(ScaleGranularity g);  // "none", "tensor", "block-head", ...
absl::StatusOr<DType> ParseDType(std::string_view name);
absl::StatusOr<ScaleGranularity> ParseGranularity(std::string_view name);

// A named K/V format pair ("codec"). `native` is the engine's 16-bit dtype,
// used for 16-bit sections.
struct CodecFormat {
  SectionFormat k;
  SectionFormat v;
};

// Parses a codec name: a preset (k16v16, k16v8, k8v8, k16v4, k8v4, k16vi8,
// ki8vi8) or the explicit form "k=FMT[/GRAN],v=FMT[/GRAN]" with FMT one of
// 16|fp8e4m3|int8|int4 and GRAN one of tensor|block-head|token-head.
// InvalidArgument for anything else.
absl::StatusOr<CodecFormat> ParseCodec(std::string_view name, DType native);

// The preset name of a format pair when it has one, else the explicit form.
std::string CodecName(const CodecFormat& c);

// Bytes one token occupies in a chunk of `tokens` tokens (payload only,
// scales and padding included, header excluded), for bandwidth planning.
absl::StatusOr<double> BytesPerToken(const Geometry& geometry, SectionFormat k, SectionFormat v);

}  // namespace kvtier::codec

#endif  // KVTIER_CODEC_FORMAT_H_
