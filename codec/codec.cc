#include "codec/codec.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/strings.h"
#include "codec/quant.h"
#include "codec/quant_row.h"
#include "common/status.h"

namespace kvtier::codec {
namespace {

// DecodeSectionLayer decodes 8-bit codes through a table of each scale's 256
// values when a scale covers at least this many values on average.
constexpr uint32_t kTableMinValues = 1024;

// The bits of |x| for a finite x and 0 for an infinite or NaN one
// (AmaxTerm's value, as bits): for non-negative floats the order of the bits
// is the order of the values, so a row's amax reduces as integers.
inline uint32_t AmaxBits(uint16_t bits, DType t) {
  const uint32_t a = FloatBits(Load16(bits, t)) & 0x7FFFFFFFu;
  return a < 0x7F800000u ? a : 0u;
}

// True if any of the n elements is NaN or infinite.
bool AnyNonFinite16(const uint16_t* src, uint64_t n, DType t) {
  const uint16_t exp = t == DType::kBF16 ? 0x7F80u : 0x7C00u;
  uint32_t any = 0;
  for (uint64_t i = 0; i < n; ++i) any |= static_cast<uint32_t>((src[i] & exp) == exp);
  return any != 0;
}

// Computes the per-group scales of one layer into `scales`.
void ComputeScales(const SectionLayout& layout, const Geometry& geo, DType src_dtype,
                   const uint16_t* src, uint64_t token_stride, float* scales) {
  std::fill(scales, scales + layout.scale_count, 0.0f);
  const uint32_t dim = geo.head_dim;
  for (uint32_t t = 0; t < geo.num_tokens; ++t) {
    for (uint32_t h = 0; h < geo.num_kv_heads; ++h) {
      const uint16_t* row = src + t * token_stride + uint64_t{h} * dim;
      uint32_t bits = 0;
      for (uint32_t d = 0; d < dim; ++d) bits = std::max(bits, AmaxBits(row[d], src_dtype));
      float& amax = scales[layout.scale_index(t, h)];
      amax = std::max(amax, BitsToFloat(bits));
    }
  }
  for (uint64_t i = 0; i < layout.scale_count; ++i) scales[i] = ScaleFromAmax(layout.dtype, scales[i]);
}

}  // namespace

template <typename T>
absl::Status ValidateRows(const KvRows<T>& rows, const Geometry& geo) {
  if (rows.k == nullptr || rows.v == nullptr) return absl::InvalidArgumentError("K or V is null");
  const uint64_t row = uint64_t{geo.num_kv_heads} * geo.head_dim;
  const uint64_t tokens = geo.num_tokens;
  const uint64_t layers = geo.num_layers;
  // Layer-major: a layer's rows lie within layer_stride; token-major: a
  // token's layers lie within token_stride.
  const bool layer_major = rows.token_stride >= row && rows.layer_stride >= rows.token_stride * tokens;
  const bool token_major = rows.layer_stride >= row && rows.token_stride >= rows.layer_stride * layers;
  if ((tokens > 1 || layers > 1) && !layer_major && !token_major) {
    return absl::InvalidArgumentError(absl::StrCat(
        "strides (layer ", rows.layer_stride, ", token ", rows.token_stride,
        " elements) overlap rows of ", row, " elements over ", layers, " layers and ", tokens,
        " tokens"));
  }
  return absl::OkStatus();
}

template absl::Status ValidateRows(const KvRows<uint16_t>&, const Geometry&);
template absl::Status ValidateRows(const KvRows<const uint16_t>&, const Geometry&);

KVTIER_HOST_SIMD_CLONES
bool EncodeSectionLayer(const SectionLayout& layout, const Geometry& geo, DType src_dtype,
                        const uint16_t* src, uint64_t token_stride, uint8_t* dst) {
  std::memset(dst, 0, layout.layer_stride);
  const uint64_t row = uint64_t{geo.num_kv_heads} * geo.head_dim;
  bool non_finite = false;
  for (uint32_t t = 0; t < geo.num_tokens; ++t) {
    non_finite |= AnyNonFinite16(src + t * token_stride, row, src_dtype);
  }
  if (!IsQuantized(layout.dtype)) {
    for (uint32_t t = 0; t < geo.num_tokens; ++t) {
      std::memcpy(dst + layout.element_index(t, 0, 0) * sizeof(uint16_t), src + t * token_stride,
                  row * sizeof(uint16_t));
    }
    return non_finite;
  }
  std::vector<float> scales(layout.scale_count);
  ComputeScales(layout, geo, src_dtype, src, token_stride, scales.data());
  std::memcpy(dst + layout.data_bytes, scales.data(), scales.size() * sizeof(float));
  const uint32_t dim = geo.head_dim;
  for (uint32_t t = 0; t < geo.num_tokens; ++t) {
    for (uint32_t h = 0; h < geo.num_kv_heads; ++h) {
      const uint64_t base = layout.element_index(t, h, 0);
      const float scale = scales[layout.scale_index(t, h)];
      const uint16_t* row_in = src + t * token_stride + uint64_t{h} * dim;
      switch (layout.dtype) {
        case DType::kFP8E4M3:
          QuantizeFp8Row(row_in, src_dtype, scale, dst + base, dim);
          break;
        case DType::kINT8:
          for (uint32_t d = 0; d < dim; ++d) {
            dst[base + d] = static_cast<uint8_t>(
                static_cast<int8_t>(QuantizeInt(Load16(row_in[d], src_dtype), scale, 127)));
          }
          break;
        case DType::kINT4:
          // head_dim is even and base is a multiple of head_dim, so pairs never
          // straddle a row.
          for (uint32_t d = 0; d < dim; d += 2) {
            int32_t lo = QuantizeInt(Load16(row_in[d], src_dtype), scale, 7);
            int32_t hi = QuantizeInt(Load16(row_in[d + 1], src_dtype), scale, 7);
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

KVTIER_HOST_SIMD_CLONES
void DecodeSectionLayer(const SectionLayout& layout, const Geometry& geo, DType dst_dtype,
                        const uint8_t* src, uint16_t* dst, uint64_t token_stride) {
  const uint64_t row = uint64_t{geo.num_kv_heads} * geo.head_dim;
  if (!IsQuantized(layout.dtype)) {
    for (uint32_t t = 0; t < geo.num_tokens; ++t) {
      std::memcpy(dst + t * token_stride, src + layout.element_index(t, 0, 0) * sizeof(uint16_t),
                  row * sizeof(uint16_t));
    }
    return;
  }
  std::vector<float> scales(layout.scale_count);
  std::memcpy(scales.data(), src + layout.data_bytes, scales.size() * sizeof(float));
  const uint32_t dim = geo.head_dim;
  // An 8-bit code of a scale decodes to one 16-bit value: where a scale
  // covers many values, its 256 values are computed once and each code is
  // looked up (the same function, so the same bits; no float math per value).
  std::vector<uint16_t> table;
  const bool one_byte = layout.dtype == DType::kFP8E4M3 || layout.dtype == DType::kINT8;
  if (one_byte && geo.layer_elements() >= uint64_t{kTableMinValues} * layout.scale_count) {
    table.resize(layout.scale_count * 256);
    for (uint64_t s = 0; s < layout.scale_count; ++s) {
      for (uint32_t c = 0; c < 256; ++c) {
        const float x = layout.dtype == DType::kFP8E4M3
                            ? DequantizeFp8(static_cast<uint8_t>(c), scales[s])
                            : DequantizeInt(static_cast<int8_t>(c), scales[s]);
        table[s * 256 + c] = Store16(x, dst_dtype);
      }
    }
  }
  for (uint32_t t = 0; t < geo.num_tokens; ++t) {
    for (uint32_t h = 0; h < geo.num_kv_heads; ++h) {
      const uint64_t base = layout.element_index(t, h, 0);
      const uint64_t scale_index = layout.scale_index(t, h);
      const float scale = scales[scale_index];
      uint16_t* row_out = dst + t * token_stride + uint64_t{h} * dim;
      if (!table.empty()) {
        const uint16_t* values = table.data() + scale_index * 256;
        for (uint32_t d = 0; d < dim; ++d) row_out[d] = values[src[base + d]];
        continue;
      }
      switch (layout.dtype) {
        case DType::kFP8E4M3:
          for (uint32_t d = 0; d < dim; ++d) {
            row_out[d] = Store16(DequantizeFp8(src[base + d], scale), dst_dtype);
          }
          break;
        case DType::kINT8:
          for (uint32_t d = 0; d < dim; ++d) {
            row_out[d] = Store16(DequantizeInt(static_cast<int8_t>(src[base + d]), scale), dst_dtype);
          }
          break;
        case DType::kINT4:
          for (uint32_t d = 0; d < dim; ++d) {
            uint8_t byte = src[(base + d) / 2];
            row_out[d] = Store16(DequantizeInt(UnpackInt4(byte, (d & 1) != 0), scale), dst_dtype);
          }
          break;
        default:
          break;
      }
    }
  }
}

absl::Status EncodeChunkInto(const ChunkSpec& spec, KvView kv, std::span<uint8_t> out) {
  const Geometry& geo = spec.geometry;
  const uint64_t want = geo.layer_elements() * geo.num_layers;
  if (kv.k.size() != want || kv.v.size() != want) {
    return absl::InvalidArgumentError(absl::StrCat(
        "input: K has ", kv.k.size(), " and V has ", kv.v.size(),
        " elements; the geometry needs ", want, " each (layers x tokens x kv_heads x head_dim)"));
  }
  return EncodeChunkRows(spec, KvRows<const uint16_t>::Contiguous(kv.k.data(), kv.v.data(), geo),
                         out);
}

absl::Status EncodeChunkRows(const ChunkSpec& spec_in, KvRows<const uint16_t> kv,
                             std::span<uint8_t> out, bool seal) {
  KVTIER_ASSIGN_OR_RETURN(ChunkLayout layout, ValidateSpec(spec_in));
  const Geometry& geo = spec_in.geometry;
  KVTIER_RETURN_IF_ERROR(ValidateRows(kv, geo));
  if (out.size() != layout.total_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("output buffer is ", out.size(),
                                                   " bytes, the chunk needs ",
                                                   layout.total_bytes));
  }
  bool non_finite = false;
  uint8_t* k_base = out.data() + layout.k_offset;
  uint8_t* v_base = out.data() + layout.v_offset;
  for (uint32_t l = 0; l < geo.num_layers; ++l) {
    non_finite |= EncodeSectionLayer(layout.k, geo, spec_in.dtype, kv.k + l * kv.layer_stride,
                                     kv.token_stride, k_base + layout.k.data_offset(l));
    non_finite |= EncodeSectionLayer(layout.v, geo, spec_in.dtype, kv.v + l * kv.layer_stride,
                                     kv.token_stride, v_base + layout.v.data_offset(l));
  }
  ChunkSpec spec = spec_in;
  spec.flags = non_finite ? kFlagNonFinite : 0;
  WriteHeader(spec, layout, 0, 0, out.first(kHeaderSize));
  return seal ? SealChunk(out) : absl::OkStatus();
}

absl::StatusOr<std::vector<uint8_t>> EncodeChunk(const ChunkSpec& spec, KvView kv) {
  KVTIER_ASSIGN_OR_RETURN(ChunkLayout layout, ValidateSpec(spec));
  std::vector<uint8_t> out(layout.total_bytes);
  KVTIER_RETURN_IF_ERROR(EncodeChunkInto(spec, kv, out));
  return out;
}

absl::Status DecodeChunkRows(const ChunkHeader& header, std::span<const uint8_t> chunk,
                             uint32_t begin, uint32_t end, KvRows<uint16_t> out, bool verify) {
  const ChunkLayout& layout = header.layout;
  const Geometry& geo = header.spec.geometry;
  if (begin >= end || end > geo.num_layers) {
    return absl::InvalidArgumentError(absl::StrCat("layer range [", begin, ", ", end,
                                                   ") is not within the chunk's ",
                                                   geo.num_layers, " layers"));
  }
  Geometry range = geo;
  range.num_layers = end - begin;
  KVTIER_RETURN_IF_ERROR(ValidateRows(out, range));
  if (chunk.size() != layout.total_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("chunk is ", chunk.size(),
                                                   " bytes, its header says ", layout.total_bytes));
  }
  const std::span<const uint8_t> k = chunk.subspan(layout.k_offset, layout.k.bytes);
  const std::span<const uint8_t> v = chunk.subspan(layout.v_offset, layout.v.bytes);
  const bool per_record = verify && layout.version >= 2;
  if (verify && !per_record) {
    KVTIER_RETURN_IF_ERROR(VerifySection(header, Section::kK, k));
    KVTIER_RETURN_IF_ERROR(VerifySection(header, Section::kV, v));
  }
  if (per_record) {
    KVTIER_RETURN_IF_ERROR(CheckRecordTableHeader(Section::kK, layout.k, header.k_checksum,
                                                  k.subspan(layout.k.table_offset,
                                                            layout.k.table_bytes)));
    KVTIER_RETURN_IF_ERROR(CheckRecordTableHeader(Section::kV, layout.v, header.v_checksum,
                                                  v.subspan(layout.v.table_offset,
                                                            layout.v.table_bytes)));
  }
  for (uint32_t l = begin; l < end; ++l) {
    if (per_record) {
      // Checked just before it is decoded: the record is read from memory
      // once and decoded from the cache.
      KVTIER_RETURN_IF_ERROR(CheckRecord(Section::kK, layout.k, k, l,
                                         RecordChecksum(Section::kK, l, RecordBytes(layout.k, k, l))));
      KVTIER_RETURN_IF_ERROR(CheckRecord(Section::kV, layout.v, v, l,
                                         RecordChecksum(Section::kV, l, RecordBytes(layout.v, v, l))));
    }
    const uint64_t row = (l - begin) * out.layer_stride;
    DecodeSectionLayer(layout.k, geo, header.spec.dtype, k.data() + layout.k.data_offset(l),
                       out.k + row, out.token_stride);
    DecodeSectionLayer(layout.v, geo, header.spec.dtype, v.data() + layout.v.data_offset(l),
                       out.v + row, out.token_stride);
  }
  return absl::OkStatus();
}

absl::StatusOr<DecodedChunk> DecodeChunk(std::span<const uint8_t> chunk) {
  KVTIER_ASSIGN_OR_RETURN(ChunkHeader header, VerifyChunk(chunk));
  const Geometry& geo = header.spec.geometry;
  const uint64_t elements = geo.layer_elements() * geo.num_layers;
  DecodedChunk out;
  out.k.resize(elements);
  out.v.resize(elements);
  KVTIER_RETURN_IF_ERROR(DecodeChunkRows(
      header, chunk, 0, geo.num_layers,
      KvRows<uint16_t>::Contiguous(out.k.data(), out.v.data(), geo), /*verify=*/false));
  out.header = header;
  return out;
}

}  // namespace kvtier::codec
