#include "codec/codec.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/strings.h"
#include "codec/quant.h"
#include "common/status.h"

namespace kvtier::codec {
namespace {

bool IsNonFinite16(uint16_t bits, DType t) {
  return t == DType::kBF16 ? (bits & 0x7F80u) == 0x7F80u : (bits & 0x7C00u) == 0x7C00u;
}

// Computes the per-group scales of one layer into `scales`.
void ComputeScales(const SectionLayout& layout, const Geometry& geo, DType src_dtype,
                   const uint16_t* src, float* scales) {
  std::fill(scales, scales + layout.scale_count, 0.0f);
  const uint32_t dim = geo.head_dim;
  for (uint32_t t = 0; t < geo.num_tokens; ++t) {
    for (uint32_t h = 0; h < geo.num_kv_heads; ++h) {
      const uint16_t* row = src + layout.element_index(t, h, 0);
      float& amax = scales[layout.scale_index(t, h)];
      for (uint32_t d = 0; d < dim; ++d) amax = std::max(amax, AmaxTerm(Load16(row[d], src_dtype)));
    }
  }
  for (uint64_t i = 0; i < layout.scale_count; ++i) scales[i] = ScaleFromAmax(layout.dtype, scales[i]);
}

}  // namespace

bool EncodeSectionLayer(const SectionLayout& layout, const Geometry& geo, DType src_dtype,
                        const uint16_t* src, uint8_t* dst) {
  std::memset(dst, 0, layout.layer_stride);
  const uint64_t n = geo.layer_elements();
  bool non_finite = false;
  for (uint64_t i = 0; i < n; ++i) non_finite |= IsNonFinite16(src[i], src_dtype);
  if (!IsQuantized(layout.dtype)) {
    std::memcpy(dst, src, n * sizeof(uint16_t));
    return non_finite;
  }
  std::vector<float> scales(layout.scale_count);
  ComputeScales(layout, geo, src_dtype, src, scales.data());
  std::memcpy(dst + layout.data_bytes, scales.data(), scales.size() * sizeof(float));
  const uint32_t dim = geo.head_dim;
  for (uint32_t t = 0; t < geo.num_tokens; ++t) {
    for (uint32_t h = 0; h < geo.num_kv_heads; ++h) {
      const uint64_t base = layout.element_index(t, h, 0);
      const float scale = scales[layout.scale_index(t, h)];
      const uint16_t* row = src + base;
      switch (layout.dtype) {
        case DType::kFP8E4M3:
          for (uint32_t d = 0; d < dim; ++d) {
            dst[base + d] = QuantizeFp8(Load16(row[d], src_dtype), scale);
          }
          break;
        case DType::kINT8:
          for (uint32_t d = 0; d < dim; ++d) {
            dst[base + d] = static_cast<uint8_t>(
                static_cast<int8_t>(QuantizeInt(Load16(row[d], src_dtype), scale, 127)));
          }
          break;
        case DType::kINT4:
          // head_dim is even and base is a multiple of head_dim, so pairs never
          // straddle a row.
          for (uint32_t d = 0; d < dim; d += 2) {
            int32_t lo = QuantizeInt(Load16(row[d], src_dtype), scale, 7);
            int32_t hi = QuantizeInt(Load16(row[d + 1], src_dtype), scale, 7);
            dst[(base + d) / 2] = PackInt4(lo, hi);
          }
          break;
        default:
          break;
      }
    }
  }
  return non_finite;
}

void DecodeSectionLayer(const SectionLayout& layout, const Geometry& geo, DType dst_dtype,
                        const uint8_t* src, uint16_t* dst) {
  const uint64_t n = geo.layer_elements();
  if (!IsQuantized(layout.dtype)) {
    std::memcpy(dst, src, n * sizeof(uint16_t));
    return;
  }
  std::vector<float> scales(layout.scale_count);
  std::memcpy(scales.data(), src + layout.data_bytes, scales.size() * sizeof(float));
  const uint32_t dim = geo.head_dim;
  for (uint32_t t = 0; t < geo.num_tokens; ++t) {
    for (uint32_t h = 0; h < geo.num_kv_heads; ++h) {
      const uint64_t base = layout.element_index(t, h, 0);
      const float scale = scales[layout.scale_index(t, h)];
      uint16_t* row = dst + base;
      switch (layout.dtype) {
        case DType::kFP8E4M3:
          for (uint32_t d = 0; d < dim; ++d) {
            row[d] = Store16(DequantizeFp8(src[base + d], scale), dst_dtype);
          }
          break;
        case DType::kINT8:
          for (uint32_t d = 0; d < dim; ++d) {
            row[d] = Store16(DequantizeInt(static_cast<int8_t>(src[base + d]), scale), dst_dtype);
          }
          break;
        case DType::kINT4:
          for (uint32_t d = 0; d < dim; ++d) {
            uint8_t byte = src[(base + d) / 2];
            row[d] = Store16(DequantizeInt(UnpackInt4(byte, (d & 1) != 0), scale), dst_dtype);
          }
          break;
        default:
          break;
      }
    }
  }
}

absl::Status EncodeChunkInto(const ChunkSpec& spec_in, KvView kv, std::span<uint8_t> out) {
  KVTIER_ASSIGN_OR_RETURN(ChunkLayout layout, ValidateSpec(spec_in));
  const Geometry& geo = spec_in.geometry;
  const uint64_t per_layer = geo.layer_elements();
  const uint64_t want = per_layer * geo.num_layers;
  if (kv.k.size() != want || kv.v.size() != want) {
    return absl::InvalidArgumentError(absl::StrCat(
        "input: K has ", kv.k.size(), " and V has ", kv.v.size(),
        " elements; the geometry needs ", want, " each (layers x tokens x kv_heads x head_dim)"));
  }
  if (out.size() != layout.total_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("output buffer is ", out.size(),
                                                   " bytes, the chunk needs ",
                                                   layout.total_bytes));
  }
  bool non_finite = false;
  uint8_t* k_base = out.data() + layout.k_offset;
  uint8_t* v_base = out.data() + layout.v_offset;
  for (uint32_t l = 0; l < geo.num_layers; ++l) {
    non_finite |= EncodeSectionLayer(layout.k, geo, spec_in.dtype, kv.k.data() + l * per_layer,
                                     k_base + layout.k.data_offset(l));
    non_finite |= EncodeSectionLayer(layout.v, geo, spec_in.dtype, kv.v.data() + l * per_layer,
                                     v_base + layout.v.data_offset(l));
  }
  ChunkSpec spec = spec_in;
  spec.flags = non_finite ? kFlagNonFinite : 0;
  WriteHeader(spec, layout, 0, 0, out.first(kHeaderSize));
  return SealChunk(out);
}

absl::StatusOr<std::vector<uint8_t>> EncodeChunk(const ChunkSpec& spec, KvView kv) {
  KVTIER_ASSIGN_OR_RETURN(ChunkLayout layout, ValidateSpec(spec));
  std::vector<uint8_t> out(layout.total_bytes);
  KVTIER_RETURN_IF_ERROR(EncodeChunkInto(spec, kv, out));
  return out;
}

absl::StatusOr<DecodedChunk> DecodeChunk(std::span<const uint8_t> chunk) {
  KVTIER_ASSIGN_OR_RETURN(ChunkHeader header, VerifyChunk(chunk));
  const ChunkLayout& layout = header.layout;
  const Geometry& geo = header.spec.geometry;
  const uint64_t per_layer = geo.layer_elements();
  DecodedChunk out;
  out.k.resize(per_layer * geo.num_layers);
  out.v.resize(per_layer * geo.num_layers);
  for (uint32_t l = 0; l < geo.num_layers; ++l) {
    DecodeSectionLayer(layout.k, geo, header.spec.dtype,
                       chunk.data() + layout.k_offset + layout.k.data_offset(l),
                       out.k.data() + l * per_layer);
    DecodeSectionLayer(layout.v, geo, header.spec.dtype,
                       chunk.data() + layout.v_offset + layout.v.data_offset(l),
                       out.v.data() + l * per_layer);
  }
  out.header = header;
  return out;
}

}  // namespace kvtier::codec
