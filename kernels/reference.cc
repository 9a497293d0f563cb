#include "kernels/reference.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "codec/codec.h"
#include "codec/quant.h"
#include "common/status.h"

namespace kvtier::kernels {
namespace {

using codec::DType;

bool Is16(DType t) { return t == DType::kBF16 || t == DType::kFP16; }

// Checks that a cache section can produce / receive a chunk section.
absl::Status CheckSectionPair(const char* name, DType cache_dtype, DType chunk_dtype,
                              codec::SectionFormat f, uint32_t first_slot) {
  if (Is16(cache_dtype)) {
    if (cache_dtype != chunk_dtype) {
      return absl::InvalidArgumentError(absl::StrCat(
          name, ": the cache holds ", codec::DTypeName(cache_dtype), " but the chunk dtype is ",
          codec::DTypeName(chunk_dtype)));
    }
    return absl::OkStatus();
  }
  if (f.dtype != DType::kFP8E4M3 || f.granularity != codec::ScaleGranularity::kPerBlockHead) {
    return absl::InvalidArgumentError(absl::StrCat(
        name, ": an fp8e4m3 cache section passes through only to fp8e4m3/block-head, not ",
        codec::DTypeName(f.dtype), "/", codec::GranularityName(f.granularity)));
  }
  if (first_slot != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        name, ": an fp8e4m3 cache section needs a chunk that starts on a block boundary "
              "(first_slot = ", first_slot, ")"));
  }
  return absl::OkStatus();
}

uint32_t BlockOf(const BlockSpan& span, uint32_t t, uint32_t bs) {
  const int32_t* ids = span.host_block_ids != nullptr ? span.host_block_ids : span.block_ids;
  return static_cast<uint32_t>(ids[span.list_index(t, bs)]);
}

absl::Status CheckGeometry(const codec::ChunkSpec& spec, const PagedKvLayout& cache) {
  const codec::Geometry& g = spec.geometry;
  if (g.num_layers != cache.num_layers || g.num_kv_heads != cache.num_kv_heads ||
      g.head_dim != cache.head_dim || g.block_size != cache.block_size) {
    return absl::InvalidArgumentError(absl::StrCat(
        "geometry: chunk (layers ", g.num_layers, ", kv_heads ", g.num_kv_heads, ", head_dim ",
        g.head_dim, ", block_size ", g.block_size, ") does not match the cache (", cache.num_layers,
        ", ", cache.num_kv_heads, ", ", cache.head_dim, ", ", cache.block_size, ")"));
  }
  return absl::OkStatus();
}

}  // namespace

float CacheElement(const PagedKvLayout& c, bool is_v, uint32_t layer, uint32_t block,
                   uint32_t slot, uint32_t head, uint32_t dim) {
  DType t = is_v ? c.v_dtype : c.k_dtype;
  const void* base = is_v ? c.v_layers[layer] : c.k_layers[layer];
  int64_t e = is_v ? c.v_elem(block, slot, head, dim) : c.k_elem(block, slot, head, dim);
  if (Is16(t)) return codec::Load16(static_cast<const uint16_t*>(base)[e], t);
  const float* scales = is_v ? c.v_scale_layers[layer] : c.k_scale_layers[layer];
  return codec::DequantizeFp8(static_cast<const uint8_t*>(base)[e],
                              scales[c.scale_index(block, head)]);
}

std::vector<uint16_t> GatherSection(const PagedKvLayout& c, bool is_v, const BlockSpan& span,
                                    uint32_t num_tokens) {
  const uint32_t H = c.num_kv_heads, D = c.head_dim;
  std::vector<uint16_t> out(uint64_t{c.num_layers} * num_tokens * H * D);
  uint16_t* o = out.data();
  for (uint32_t l = 0; l < c.num_layers; ++l) {
    for (uint32_t t = 0; t < num_tokens; ++t) {
      uint32_t block = BlockOf(span, t, c.block_size);
      uint32_t slot = span.slot(t, c.block_size);
      for (uint32_t h = 0; h < H; ++h) {
        const uint16_t* src = is_v ? c.v_ptr<uint16_t>(l, block, slot, h)
                                   : c.k_ptr<uint16_t>(l, block, slot, h);
        std::memcpy(o, src, D * sizeof(uint16_t));
        o += D;
      }
    }
  }
  return out;
}

absl::StatusOr<std::vector<uint8_t>> ReferenceGatherEncode(const codec::ChunkSpec& spec_in,
                                                           const PagedKvLayout& cache,
                                                           const BlockSpan& span) {
  KVTIER_ASSIGN_OR_RETURN(codec::ChunkLayout layout, codec::ValidateSpec(spec_in));
  KVTIER_RETURN_IF_ERROR(ValidatePagedKvLayout(cache));
  KVTIER_RETURN_IF_ERROR(CheckGeometry(spec_in, cache));
  const codec::Geometry& geo = spec_in.geometry;
  KVTIER_RETURN_IF_ERROR(ValidateBlockSpan(cache, span, geo.num_tokens));
  KVTIER_RETURN_IF_ERROR(
      CheckSectionPair("k", cache.k_dtype, spec_in.dtype, spec_in.k, span.first_slot));
  KVTIER_RETURN_IF_ERROR(
      CheckSectionPair("v", cache.v_dtype, spec_in.dtype, spec_in.v, span.first_slot));

  if (Is16(cache.k_dtype) && Is16(cache.v_dtype)) {
    std::vector<uint16_t> k = GatherSection(cache, false, span, geo.num_tokens);
    std::vector<uint16_t> v = GatherSection(cache, true, span, geo.num_tokens);
    return codec::EncodeChunk(spec_in, codec::KvView{k, v});
  }

  std::vector<uint8_t> out(layout.total_bytes, 0);
  bool non_finite = false;
  const uint64_t per_layer = geo.layer_elements();
  for (int s = 0; s < 2; ++s) {
    const bool is_v = s == 1;
    const codec::SectionLayout& sec = is_v ? layout.v : layout.k;
    uint8_t* base = out.data() + (is_v ? layout.v_offset : layout.k_offset);
    if (Is16(is_v ? cache.v_dtype : cache.k_dtype)) {
      std::vector<uint16_t> src = GatherSection(cache, is_v, span, geo.num_tokens);
      for (uint32_t l = 0; l < geo.num_layers; ++l) {
        non_finite |= codec::EncodeSectionLayer(sec, geo, spec_in.dtype,
                                                src.data() + l * per_layer,
                                                uint64_t{geo.num_kv_heads} * geo.head_dim,
                                                base + sec.data_offset(l));
      }
      continue;
    }
    for (uint32_t l = 0; l < geo.num_layers; ++l) {
      uint8_t* data = base + sec.data_offset(l);
      float* scales = reinterpret_cast<float*>(base + sec.scale_offset(l));
      const float* cache_scales = is_v ? cache.v_scale_layers[l] : cache.k_scale_layers[l];
      for (uint32_t t = 0; t < geo.num_tokens; ++t) {
        uint32_t block = BlockOf(span, t, cache.block_size);
        uint32_t slot = span.slot(t, cache.block_size);
        for (uint32_t h = 0; h < geo.num_kv_heads; ++h) {
          const uint8_t* src = is_v ? cache.v_ptr<uint8_t>(l, block, slot, h)
                                    : cache.k_ptr<uint8_t>(l, block, slot, h);
          uint8_t* dst = data + sec.element_index(t, h, 0);
          std::memcpy(dst, src, geo.head_dim);
          for (uint32_t d = 0; d < geo.head_dim; ++d) {
            non_finite |= (src[d] & 0x7Fu) == codec::kFp8NaNCode;
          }
          scales[sec.scale_index(t, h)] = cache_scales[cache.scale_index(block, h)];
        }
      }
    }
  }
  codec::ChunkSpec spec = spec_in;
  spec.flags = non_finite ? codec::kFlagNonFinite : 0;
  codec::WriteHeader(spec, layout, 0, 0, std::span<uint8_t>(out).first(codec::kHeaderSize));
  KVTIER_RETURN_IF_ERROR(codec::SealChunk(out));
  return out;
}

absl::Status ReferenceDecodeScatter(std::span<const uint8_t> chunk, const PagedKvLayout& cache,
                                    const BlockSpan& span, LayerRange layers) {
  KVTIER_ASSIGN_OR_RETURN(codec::DecodedChunk dec, codec::DecodeChunk(chunk));
  const codec::ChunkSpec& spec = dec.header.spec;
  const codec::ChunkLayout& layout = dec.header.layout;
  const codec::Geometry& geo = spec.geometry;
  KVTIER_RETURN_IF_ERROR(ValidatePagedKvLayout(cache));
  KVTIER_RETURN_IF_ERROR(CheckGeometry(spec, cache));
  KVTIER_RETURN_IF_ERROR(ValidateBlockSpan(cache, span, geo.num_tokens));
  KVTIER_RETURN_IF_ERROR(ValidateLayerRange(layers, geo.num_layers));
  KVTIER_RETURN_IF_ERROR(
      CheckSectionPair("k", cache.k_dtype, spec.dtype, spec.k, span.first_slot));
  KVTIER_RETURN_IF_ERROR(
      CheckSectionPair("v", cache.v_dtype, spec.dtype, spec.v, span.first_slot));
  const uint32_t H = geo.num_kv_heads, D = geo.head_dim;
  for (int s = 0; s < 2; ++s) {
    const bool is_v = s == 1;
    const codec::SectionLayout& sec = is_v ? layout.v : layout.k;
    const uint8_t* base = chunk.data() + (is_v ? layout.v_offset : layout.k_offset);
    const std::vector<uint16_t>& values = is_v ? dec.v : dec.k;
    const bool pass = !Is16(is_v ? cache.v_dtype : cache.k_dtype);
    for (uint32_t l = layers.begin; l < layers.End(geo.num_layers); ++l) {
      const uint8_t* data = base + sec.data_offset(l);
      const uint8_t* scale_bytes = base + sec.scale_offset(l);
      for (uint32_t t = 0; t < geo.num_tokens; ++t) {
        uint32_t block = BlockOf(span, t, cache.block_size);
        uint32_t slot = span.slot(t, cache.block_size);
        for (uint32_t h = 0; h < H; ++h) {
          if (!pass) {
            uint16_t* dst = is_v ? cache.v_ptr<uint16_t>(l, block, slot, h)
                                 : cache.k_ptr<uint16_t>(l, block, slot, h);
            std::memcpy(dst, values.data() + (uint64_t{l} * geo.num_tokens + t) * H * D +
                                 uint64_t{h} * D,
                        D * sizeof(uint16_t));
            continue;
          }
          uint8_t* dst = is_v ? cache.v_ptr<uint8_t>(l, block, slot, h)
                              : cache.k_ptr<uint8_t>(l, block, slot, h);
          std::memcpy(dst, data + sec.element_index(t, h, 0), D);
          float* cache_scales = is_v ? cache.v_scale_layers[l] : cache.k_scale_layers[l];
          std::memcpy(&cache_scales[cache.scale_index(block, h)],
                      scale_bytes + 4 * sec.scale_index(t, h), sizeof(float));
        }
      }
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<float>> ReferenceDecodeAttention(const PagedKvLayout& cache,
                                                            const DecodeAttentionParams& p_in) {
  DecodeAttentionParams p = p_in;
  p.host_block_table = p.block_table;
  p.host_seq_lens = p.seq_lens;
  KVTIER_RETURN_IF_ERROR(ValidateDecodeAttention(cache, p));
  const uint32_t D = cache.head_dim, Hq = p.num_q_heads;
  const uint32_t group = Hq / cache.num_kv_heads;
  std::vector<float> out(uint64_t{p.batch} * Hq * D, 0.0f);
  const uint16_t* q = static_cast<const uint16_t*>(p.q);
  for (uint32_t b = 0; b < p.batch; ++b) {
    const uint32_t len = static_cast<uint32_t>(p.seq_lens[b]);
    const int32_t* table = p.block_table + uint64_t{b} * p.max_blocks_per_seq;
    for (uint32_t qh = 0; qh < Hq; ++qh) {
      const uint32_t kvh = qh / group;
      const uint16_t* qv = q + (uint64_t{b} * Hq + qh) * D;
      std::vector<double> logits(len);
      double mx = -INFINITY;
      for (uint32_t t = 0; t < len; ++t) {
        uint32_t block = static_cast<uint32_t>(table[t / cache.block_size]);
        uint32_t slot = t % cache.block_size;
        double dot = 0.0;
        for (uint32_t d = 0; d < D; ++d) {
          dot += static_cast<double>(codec::Load16(qv[d], p.q_dtype)) *
                 CacheElement(cache, false, p.layer, block, slot, kvh, d);
        }
        logits[t] = dot * p.sm_scale;
        mx = std::max(mx, logits[t]);
      }
      double sum = 0.0;
      for (uint32_t t = 0; t < len; ++t) {
        logits[t] = std::exp(logits[t] - mx);
        sum += logits[t];
      }
      float* o = out.data() + (uint64_t{b} * Hq + qh) * D;
      for (uint32_t d = 0; d < D; ++d) {
        double acc = 0.0;
        for (uint32_t t = 0; t < len; ++t) {
          uint32_t block = static_cast<uint32_t>(table[t / cache.block_size]);
          acc += logits[t] * CacheElement(cache, true, p.layer, block, t % cache.block_size, kvh, d);
        }
        o[d] = static_cast<float>(acc / sum);
      }
    }
  }
  return out;
}

std::vector<std::pair<uint64_t, uint64_t>> LayerRecordBytes(const codec::ChunkLayout& layout,
                                                            LayerRange layers) {
  const uint32_t end = layers.End(layout.geometry.num_layers);
  return {{layout.k_offset + layout.k.layer_stride * layers.begin,
           layout.k_offset + layout.k.layer_stride * end},
          {layout.v_offset + layout.v.layer_stride * layers.begin,
           layout.v_offset + layout.v.layer_stride * end}};
}

}  // namespace kvtier::kernels
