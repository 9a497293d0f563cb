// The paged KV-cache descriptor shared by the CUDA kernels, the CPU
// references and the tests (FlashInfer's paged_kv_t is the model). It is plain
// data: pointers, sizes and strides, with KVTIER_HD offset methods so every
// piece of code computes cache addresses with the same lines.
//
// One descriptor covers, per layer:
//   vLLM FlashAttention  [2, num_blocks, block_size, kv_heads, head_dim]   (NHD)
//                        [2, num_blocks, kv_heads, block_size, head_dim]   (HND)
//   vLLM FlashInfer      [num_blocks, 2, block_size, kv_heads, head_dim]   (NHD)
//                        [num_blocks, 2, kv_heads, block_size, head_dim]   (HND)
//   separate K and V     [num_blocks, block_size, kv_heads, head_dim] each (NHD or HND),
//                        K in BF16/FP16, V in BF16/FP16 or FP8 e4m3 with one float scale
//                        per (block, kv_head) in a [num_blocks, kv_heads] array
//                        (asymmetric K16/V8 caches; FP8 K likewise for symmetric FP8).
// MakePagedKvLayout fills the strides for each of these; the caller fills the
// per-layer pointer arrays.
#ifndef KVTIER_KERNELS_PAGED_LAYOUT_H_
#define KVTIER_KERNELS_PAGED_LAYOUT_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "codec/format.h"
#include "common/host_device.h"

namespace kvtier::kernels {

// Which engine layout a PagedKvLayout describes (only MakePagedKvLayout and
// the per-layer tensor size depend on it; the kernels read strides).
enum class CacheLayout : uint8_t {
  kVllmFlashAttnNHD = 0,   // [2, NB, BS, H, D]
  kVllmFlashAttnHND = 1,   // [2, NB, H, BS, D]
  kVllmFlashInferNHD = 2,  // [NB, 2, BS, H, D]
  kVllmFlashInferHND = 3,  // [NB, 2, H, BS, D]
  kSeparateNHD = 4,        // K and V tensors [NB, BS, H, D] each
  kSeparateHND = 5,        // K and V tensors [NB, H, BS, D] each
};

const char* CacheLayoutName(CacheLayout layout);
inline constexpr bool IsSeparate(CacheLayout l) {
  return l == CacheLayout::kSeparateNHD || l == CacheLayout::kSeparateHND;
}

struct PagedKvLayout {
  // Per-layer base addresses: arrays of num_layers pointers, readable by
  // whoever reads the descriptor (device memory for kernels, host memory for
  // the CPU references). Combined layouts (FlashAttention, FlashInfer) point
  // k_layers and v_layers at the same array and tell K from V by k_offset /
  // v_offset. Each entry must be 16-byte aligned.
  void* const* k_layers = nullptr;  // [num_layers] -> layer tensor
  void* const* v_layers = nullptr;  // [num_layers] -> layer tensor
  // FP8 sections only: per-layer arrays of float scales [num_blocks][num_kv_heads].
  float* const* k_scale_layers = nullptr;  // [num_layers]; only when k_dtype is FP8
  float* const* v_scale_layers = nullptr;  // [num_layers]; only when v_dtype is FP8

  uint32_t num_layers = 0;
  uint32_t num_blocks = 0;    // blocks in each layer's tensor
  uint32_t block_size = 0;    // tokens per block
  uint32_t num_kv_heads = 0;
  uint32_t head_dim = 0;
  codec::DType k_dtype = codec::DType::kBF16;  // kBF16, kFP16 or kFP8E4M3
  codec::DType v_dtype = codec::DType::kBF16;  // kBF16, kFP16 or kFP8E4M3

  // Offsets and strides in elements of the section's own dtype, so one set of
  // strides serves a BF16 K and an FP8 V of the same shape.
  int64_t k_offset = 0;  // from the layer base to K element (0, 0, 0, 0)
  int64_t v_offset = 0;  // from the layer base to V element (0, 0, 0, 0)
  int64_t stride_block = 0;
  int64_t stride_token = 0;  // between slots of one block
  int64_t stride_head = 0;   // dim stride is 1

  // Element index, relative to the layer base, of (block, slot, head, dim).
  KVTIER_HD int64_t k_elem(uint32_t block, uint32_t slot, uint32_t head, uint32_t dim) const {
    return k_offset + block * stride_block + slot * stride_token + head * stride_head + dim;
  }
  KVTIER_HD int64_t v_elem(uint32_t block, uint32_t slot, uint32_t head, uint32_t dim) const {
    return v_offset + block * stride_block + slot * stride_token + head * stride_head + dim;
  }
  // Index of the scale of (block, head) in a layer's scale array.
  KVTIER_HD int64_t scale_index(uint32_t block, uint32_t head) const {
    return int64_t{block} * num_kv_heads + head;
  }
  template <typename T>
  KVTIER_HD T* k_ptr(uint32_t layer, uint32_t block, uint32_t slot, uint32_t head) const {
    return static_cast<T*>(k_layers[layer]) + k_elem(block, slot, head, 0);
  }
  template <typename T>
  KVTIER_HD T* v_ptr(uint32_t layer, uint32_t block, uint32_t slot, uint32_t head) const {
    return static_cast<T*>(v_layers[layer]) + v_elem(block, slot, head, 0);
  }
};

// Strides, offsets and dtypes for one engine layout; pointers are left null.
// InvalidArgument when a size is 0, or when a combined layout is asked for
// with different K and V dtypes (combined tensors hold one dtype), or when a
// 16-bit dtype is not FP16/BF16.
absl::StatusOr<PagedKvLayout> MakePagedKvLayout(CacheLayout layout, uint32_t num_layers,
                                                uint32_t num_blocks, uint32_t block_size,
                                                uint32_t num_kv_heads, uint32_t head_dim,
                                                codec::DType k_dtype, codec::DType v_dtype);

// Elements of one layer's tensor that holds K (and V, for combined layouts),
// and of the V tensor of a separate layout (0 for combined ones).
uint64_t LayerTensorElements(CacheLayout layout, const PagedKvLayout& d);
uint64_t LayerVTensorElements(CacheLayout layout, const PagedKvLayout& d);

// Which cache slots hold a run of consecutive tokens of one sequence: token t
// of the run is in block block_ids[(first_slot + t) / block_size] at slot
// (first_slot + t) % block_size. A chunk that does not start on a block
// boundary has first_slot > 0; block lists need not be contiguous.
struct BlockSpan {
  const int32_t* block_ids = nullptr;  // [num_ids], readable by the kernel (device memory)
  // Optional host copy of block_ids. When set, launchers check every id
  // against the cache before launching; when null the ids cannot be checked on
  // the host and the caller guarantees 0 <= id < num_blocks.
  const int32_t* host_block_ids = nullptr;
  uint32_t num_ids = 0;
  uint32_t first_slot = 0;  // REQUIRES: < block_size

  // Position of token t of the run: list index and slot.
  KVTIER_HD uint32_t list_index(uint32_t token, uint32_t block_size) const {
    return (first_slot + token) / block_size;
  }
  KVTIER_HD uint32_t slot(uint32_t token, uint32_t block_size) const {
    return (first_slot + token) % block_size;
  }
};

// The layers [begin, end) of a chunk that one launch encodes or decodes, so
// that an engine can overlap moving layer l + 1 with computing layer l. The
// default covers every layer (end = kAllLayers stands for num_layers).
struct LayerRange {
  static constexpr uint32_t kAllLayers = 0xFFFFFFFFu;
  uint32_t begin = 0;
  uint32_t end = kAllLayers;

  // end with kAllLayers resolved against a chunk of `num_layers` layers.
  uint32_t End(uint32_t num_layers) const { return end == kAllLayers ? num_layers : end; }
  bool IsAll(uint32_t num_layers) const { return begin == 0 && End(num_layers) == num_layers; }
};

// InvalidArgument unless begin < End(num_layers) <= num_layers.
absl::Status ValidateLayerRange(const LayerRange& layers, uint32_t num_layers);

// Checks a descriptor on the host: non-null pointer arrays (and scale arrays
// for FP8 sections), supported dtypes, sizes > 0, head_dim a multiple of 8,
// strides and offsets multiples of 8 elements (16-byte vector loads). The
// per-layer entries themselves live in device memory and are not read.
// InvalidArgument naming the field.
absl::Status ValidatePagedKvLayout(const PagedKvLayout& d);

// Checks that `span` covers `num_tokens` tokens of a cache with `d`'s block
// size: first_slot < block_size, enough ids, non-null block_ids, and (when
// host_block_ids is set) every id used in [0, num_blocks). InvalidArgument.
absl::Status ValidateBlockSpan(const PagedKvLayout& d, const BlockSpan& span,
                               uint32_t num_tokens);

}  // namespace kvtier::kernels

#endif  // KVTIER_KERNELS_PAGED_LAYOUT_H_
