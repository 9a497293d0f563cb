#include "kernels/paged_layout.h"

#include "absl/strings/str_cat.h"

namespace kvtier::kernels {
namespace {

using codec::DType;

bool Is16(DType t) { return t == DType::kBF16 || t == DType::kFP16; }

}  // namespace

const char* CacheLayoutName(CacheLayout layout) {
  switch (layout) {
    case CacheLayout::kVllmFlashAttnNHD:
      return "vllm-flashattn-nhd";
    case CacheLayout::kVllmFlashAttnHND:
      return "vllm-flashattn-hnd";
    case CacheLayout::kVllmFlashInferNHD:
      return "vllm-flashinfer-nhd";
    case CacheLayout::kVllmFlashInferHND:
      return "vllm-flashinfer-hnd";
    case CacheLayout::kSeparateNHD:
      return "separate-nhd";
    case CacheLayout::kSeparateHND:
      return "separate-hnd";
  }
  return "unknown";
}

absl::StatusOr<PagedKvLayout> MakePagedKvLayout(CacheLayout layout, uint32_t num_layers,
                                                uint32_t num_blocks, uint32_t block_size,
                                                uint32_t num_kv_heads, uint32_t head_dim,
                                                DType k_dtype, DType v_dtype) {
  if (num_layers == 0 || num_blocks == 0 || block_size == 0 || num_kv_heads == 0 ||
      head_dim == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "paged layout sizes must be > 0: layers=", num_layers, " blocks=", num_blocks,
        " block_size=", block_size, " kv_heads=", num_kv_heads, " head_dim=", head_dim));
  }
  auto ok_dtype = [](DType t) { return Is16(t) || t == DType::kFP8E4M3; };
  if (!ok_dtype(k_dtype) || !ok_dtype(v_dtype)) {
    return absl::InvalidArgumentError("k_dtype/v_dtype: a cache holds fp16, bf16 or fp8e4m3");
  }
  if (!IsSeparate(layout) && k_dtype != v_dtype) {
    return absl::InvalidArgumentError(absl::StrCat(
        "k_dtype/v_dtype: the combined layout ", CacheLayoutName(layout),
        " holds one dtype; use a separate layout for asymmetric caches"));
  }
  PagedKvLayout d;
  d.num_layers = num_layers;
  d.num_blocks = num_blocks;
  d.block_size = block_size;
  d.num_kv_heads = num_kv_heads;
  d.head_dim = head_dim;
  d.k_dtype = k_dtype;
  d.v_dtype = v_dtype;
  const int64_t block_elems = int64_t{block_size} * num_kv_heads * head_dim;
  const bool hnd = layout == CacheLayout::kVllmFlashAttnHND ||
                   layout == CacheLayout::kVllmFlashInferHND ||
                   layout == CacheLayout::kSeparateHND;
  d.stride_token = hnd ? head_dim : int64_t{num_kv_heads} * head_dim;
  d.stride_head = hnd ? int64_t{block_size} * head_dim : head_dim;
  switch (layout) {
    case CacheLayout::kVllmFlashAttnNHD:
    case CacheLayout::kVllmFlashAttnHND:
      d.stride_block = block_elems;
      d.k_offset = 0;
      d.v_offset = block_elems * num_blocks;
      break;
    case CacheLayout::kVllmFlashInferNHD:
    case CacheLayout::kVllmFlashInferHND:
      d.stride_block = 2 * block_elems;
      d.k_offset = 0;
      d.v_offset = block_elems;
      break;
    case CacheLayout::kSeparateNHD:
    case CacheLayout::kSeparateHND:
      d.stride_block = block_elems;
      d.k_offset = 0;
      d.v_offset = 0;
      break;
    default:
      return absl::InvalidArgumentError("unknown cache layout");
  }
  return d;
}

uint64_t LayerTensorElements(CacheLayout layout, const PagedKvLayout& d) {
  uint64_t per = uint64_t{d.num_blocks} * d.block_size * d.num_kv_heads * d.head_dim;
  return IsSeparate(layout) ? per : 2 * per;
}

uint64_t LayerVTensorElements(CacheLayout layout, const PagedKvLayout& d) {
  return IsSeparate(layout)
             ? uint64_t{d.num_blocks} * d.block_size * d.num_kv_heads * d.head_dim
             : 0;
}

absl::Status ValidatePagedKvLayout(const PagedKvLayout& d) {
  if (d.k_layers == nullptr) return absl::InvalidArgumentError("cache.k_layers is null");
  if (d.v_layers == nullptr) return absl::InvalidArgumentError("cache.v_layers is null");
  if (d.num_layers == 0 || d.num_blocks == 0 || d.block_size == 0 || d.num_kv_heads == 0 ||
      d.head_dim == 0) {
    return absl::InvalidArgumentError("cache: layers, blocks, block_size, kv_heads and head_dim "
                                      "must be > 0");
  }
  auto check_dtype = [](const char* name, DType t) -> absl::Status {
    if (Is16(t) || t == DType::kFP8E4M3) return absl::OkStatus();
    return absl::InvalidArgumentError(
        absl::StrCat("cache.", name, " = ", codec::DTypeName(t), " (want fp16, bf16, fp8e4m3)"));
  };
  if (auto s = check_dtype("k_dtype", d.k_dtype); !s.ok()) return s;
  if (auto s = check_dtype("v_dtype", d.v_dtype); !s.ok()) return s;
  if (d.k_dtype == DType::kFP8E4M3 && d.k_scale_layers == nullptr) {
    return absl::InvalidArgumentError("cache.k_scale_layers is null but K is fp8e4m3");
  }
  if (d.v_dtype == DType::kFP8E4M3 && d.v_scale_layers == nullptr) {
    return absl::InvalidArgumentError("cache.v_scale_layers is null but V is fp8e4m3");
  }
  if (d.head_dim % 8 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("cache.head_dim = ", d.head_dim, " is not a multiple of 8"));
  }
  for (auto [name, v] : {std::pair{"k_offset", d.k_offset}, std::pair{"v_offset", d.v_offset},
                         std::pair{"stride_block", d.stride_block},
                         std::pair{"stride_token", d.stride_token},
                         std::pair{"stride_head", d.stride_head}}) {
    if (v < 0 || v % 8 != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "cache.", name, " = ", v, " must be a non-negative multiple of 8 elements"));
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateBlockSpan(const PagedKvLayout& d, const BlockSpan& span,
                               uint32_t num_tokens) {
  if (span.block_ids == nullptr) return absl::InvalidArgumentError("blocks.block_ids is null");
  if (d.block_size == 0) return absl::InvalidArgumentError("cache.block_size is 0");
  if (span.first_slot >= d.block_size) {
    return absl::InvalidArgumentError(absl::StrCat("blocks.first_slot = ", span.first_slot,
                                                   " must be < block_size ", d.block_size));
  }
  if (num_tokens == 0) return absl::InvalidArgumentError("num_tokens is 0");
  const uint64_t need = (uint64_t{span.first_slot} + num_tokens + d.block_size - 1) / d.block_size;
  if (span.num_ids < need) {
    return absl::InvalidArgumentError(absl::StrCat("blocks.num_ids = ", span.num_ids, " but ",
                                                   num_tokens, " tokens from slot ",
                                                   span.first_slot, " need ", need));
  }
  if (span.host_block_ids != nullptr) {
    for (uint64_t i = 0; i < need; ++i) {
      int32_t id = span.host_block_ids[i];
      if (id < 0 || static_cast<uint32_t>(id) >= d.num_blocks) {
        return absl::InvalidArgumentError(absl::StrCat("blocks.block_ids[", i, "] = ", id,
                                                       " is outside [0, ", d.num_blocks, ")"));
      }
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateLayerRange(const LayerRange& layers, uint32_t num_layers) {
  const uint32_t end = layers.End(num_layers);
  if (layers.begin >= end || end > num_layers) {
    return absl::InvalidArgumentError(absl::StrCat("layers [", layers.begin, ", ", end,
                                                   ") is not a non-empty range of [0, ",
                                                   num_layers, ")"));
  }
  return absl::OkStatus();
}

}  // namespace kvtier::kernels
