#include "kernels/paged_codec.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "kernels/cuda_status.h"
#include "kernels/device_numeric.cuh"

namespace kvtier::kernels {
namespace {

using codec::DType;

constexpr int kThreads = 128;
constexpr int kVecElems = 8;  // one 16-byte vector of 16-bit elements, 8 bytes of FP8 codes

// What a kernel does with one section (K or V).
enum class Mode : uint32_t {
  kCopy16 = 0,  // 16-bit cache <-> native chunk section, bit for bit
  kFp8 = 1,     // 16-bit cache <-> FP8 chunk section with per-(block, head) scales
  kPass8 = 2,   // FP8 cache <-> FP8 chunk section: codes and scales copied
};

struct SectionArgs {
  Mode mode;
  uint64_t offset;        // section start, from the chunk start
  uint64_t layer_stride;  // bytes per layer record
  uint64_t data_bytes;    // per layer, padded
  uint64_t payload;       // per layer, unpadded data bytes
  uint64_t scale_count;   // per layer
  uint64_t scale_bytes;   // per layer, padded
};

struct alignas(16) Header128 {
  uint4 w[codec::kHeaderSize / 16];
};
static_assert(sizeof(Header128) == codec::kHeaderSize, "the header is 8 16-byte vectors");
static_assert(codec::kOffFlags == 50, "flags live in the high half of header word 12");

struct CodecParams {
  PagedKvLayout cache;
  const int32_t* block_ids;
  uint32_t first_slot;
  uint32_t num_tokens;
  uint32_t num_blocks_in_chunk;  // ceil(num_tokens / block_size)
  bool bf16;                     // the chunk dtype
  SectionArgs sec[2];            // K, V
  uint8_t* chunk;                // encode: destination; decode: source
  uint32_t* workspace;           // encode only
  Header128 header;              // encode only: the header with flags and checksums 0
};

// Thread-to-element map of one CTA: (layer, chunk block, kv head) is a tile
// of BS tokens x HD dims, split into 8-element vectors.
template <int HD, int BS>
struct Tile {
  static_assert(HD % kVecElems == 0, "head_dim must be a multiple of the 8-element vector");
  static constexpr int kVecsPerRow = HD / kVecElems;
  static constexpr int kVecs = BS * kVecsPerRow;
  static constexpr int kPerThread = (kVecs + kThreads - 1) / kThreads;
  // Element index, within a layer of a chunk section ([token][kv_head][dim],
  // codec::SectionLayout::element_index), of vector v of the tile at t0.
  static __device__ __forceinline__ uint64_t ChunkIndex(uint32_t t0, int v, uint32_t H,
                                                        uint32_t head) {
    return (uint64_t{t0 + v / kVecsPerRow} * H + head) * HD + (v % kVecsPerRow) * kVecElems;
  }
  // Cache block (x) and slot (y) of chunk token `token` (BlockSpan's map).
  static __device__ __forceinline__ uint2 CacheSlot(const int32_t* block_ids, uint32_t first_slot,
                                                    uint32_t token) {
    return make_uint2(static_cast<uint32_t>(__ldg(block_ids + (first_slot + token) / BS)),
                      (first_slot + token) % BS);
  }
};

__device__ __forceinline__ float BlockMax(float v, float* smem) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();  // smem may still be read by a previous call
  if (lane == 0) smem[warp] = v;
  __syncthreads();
  float m = smem[0];
#pragma unroll
  for (int w = 1; w < kThreads / 32; ++w) m = fmaxf(m, smem[w]);
  return m;
}

__device__ __forceinline__ float AmaxOf(const uint4& v, bool bf16) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
  float m = 0.0f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    m = fmaxf(m, codec::AmaxTerm(codec::Load16(w[i] & 0xFFFFu, bf16 ? DType::kBF16 : DType::kFP16)));
    m = fmaxf(m, codec::AmaxTerm(codec::Load16(w[i] >> 16, bf16 ? DType::kBF16 : DType::kFP16)));
  }
  return m;
}

__device__ __forceinline__ bool AnyNonFinite(const uint4& v, bool bf16) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
  bool nf = false;
#pragma unroll
  for (int i = 0; i < 4; ++i) nf |= NonFinite16(w[i] & 0xFFFFu, bf16) | NonFinite16(w[i] >> 16, bf16);
  return nf;
}

__device__ __forceinline__ bool AnyNaN8(const uint2& v) {
  const uint32_t w[2] = {v.x, v.y};
  bool nf = false;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
#pragma unroll
    for (int b = 0; b < 4; ++b) nf |= ((w[i] >> (8 * b)) & 0x7Fu) == codec::kFp8NaNCode;
  }
  return nf;
}

// Zeroes the padding of one layer record of one section.
__device__ void ZeroPadding(uint8_t* layer, const SectionArgs& s) {
  for (uint64_t i = s.payload + threadIdx.x; i < s.data_bytes; i += kThreads) layer[i] = 0;
  for (uint64_t i = s.scale_count * 4 + threadIdx.x; i < s.scale_bytes; i += kThreads) {
    layer[s.data_bytes + i] = 0;
  }
}

template <int HD, int BS>
__global__ void __launch_bounds__(kThreads)
    GatherEncodeKernel(const __grid_constant__ CodecParams p) {
  using T = Tile<HD, BS>;
  __shared__ float smem[kThreads / 32];
  const PagedKvLayout& c = p.cache;
  const uint32_t H = c.num_kv_heads;
  const uint32_t head = blockIdx.x % H;
  const uint32_t cb = blockIdx.x / H;
  const uint32_t layer = blockIdx.y;
  const uint32_t t0 = cb * BS;
  const uint32_t nt = min(static_cast<uint32_t>(BS), p.num_tokens - t0);

  // Issue every load of both sections before using any.
  uint4 data[2][T::kPerThread];
  uint32_t valid_mask = 0;
#pragma unroll
  for (int i = 0; i < T::kPerThread; ++i) {
    const int v = threadIdx.x + i * kThreads;
    const uint32_t t = v / T::kVecsPerRow;
    const uint32_t d = (v % T::kVecsPerRow) * kVecElems;
    data[0][i] = data[1][i] = make_uint4(0, 0, 0, 0);
    if (v < T::kVecs && t < nt) {
      valid_mask |= 1u << i;
      const uint2 bs = T::CacheSlot(p.block_ids, p.first_slot, t0 + t);
      const uint32_t block = bs.x, slot = bs.y;
#pragma unroll
      for (int s = 0; s < 2; ++s) {
        const void* base = s == 0 ? c.k_layers[layer] : c.v_layers[layer];
        const int64_t e = s == 0 ? c.k_elem(block, slot, head, d) : c.v_elem(block, slot, head, d);
        if (p.sec[s].mode == Mode::kPass8) {
          const uint2 w = __ldg(reinterpret_cast<const uint2*>(static_cast<const uint8_t*>(base) + e));
          data[s][i] = make_uint4(w.x, w.y, 0, 0);
        } else {
          data[s][i] = __ldg(reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(base) + e));
        }
      }
    }
  }

  bool non_finite = false;
#pragma unroll
  for (int s = 0; s < 2; ++s) {
    const SectionArgs& sa = p.sec[s];
    uint8_t* layer_base = p.chunk + sa.offset + sa.layer_stride * layer;
    if (sa.mode == Mode::kCopy16) {
#pragma unroll
      for (int i = 0; i < T::kPerThread; ++i) {
        if (!(valid_mask >> i & 1u)) continue;
        const int v = threadIdx.x + i * kThreads;
        const uint64_t idx = T::ChunkIndex(t0, v, H, head);
        non_finite |= AnyNonFinite(data[s][i], p.bf16);
        *reinterpret_cast<uint4*>(layer_base + idx * 2) = data[s][i];
      }
    } else if (sa.mode == Mode::kFp8) {
      float amax = 0.0f;
#pragma unroll
      for (int i = 0; i < T::kPerThread; ++i) {
        if (valid_mask >> i & 1u) {
          amax = fmaxf(amax, AmaxOf(data[s][i], p.bf16));
          non_finite |= AnyNonFinite(data[s][i], p.bf16);
        }
      }
      amax = BlockMax(amax, smem);
      const float scale = amax > 0.0f ? __fdiv_rn(amax, codec::kFp8Max) : 1.0f;
#pragma unroll
      for (int i = 0; i < T::kPerThread; ++i) {
        if (!(valid_mask >> i & 1u)) continue;
        const int v = threadIdx.x + i * kThreads;
        const uint64_t idx = T::ChunkIndex(t0, v, H, head);
        const uint32_t w[4] = {data[s][i].x, data[s][i].y, data[s][i].z, data[s][i].w};
        uint32_t out[2] = {0, 0};
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          const uint32_t bits = (w[e / 2] >> (16 * (e % 2))) & 0xFFFFu;
          const float x = codec::Load16(bits, p.bf16 ? DType::kBF16 : DType::kFP16);
          out[e / 4] |= uint32_t{QuantizeFp8Device(x, scale)} << (8 * (e % 4));
        }
        *reinterpret_cast<uint2*>(layer_base + idx) = make_uint2(out[0], out[1]);
      }
      if (threadIdx.x == 0) {
        reinterpret_cast<float*>(layer_base + sa.data_bytes)[uint64_t{cb} * H + head] = scale;
      }
    } else {  // kPass8
#pragma unroll
      for (int i = 0; i < T::kPerThread; ++i) {
        if (!(valid_mask >> i & 1u)) continue;
        const int v = threadIdx.x + i * kThreads;
        const uint64_t idx = T::ChunkIndex(t0, v, H, head);
        const uint2 w = make_uint2(data[s][i].x, data[s][i].y);
        non_finite |= AnyNaN8(w);
        *reinterpret_cast<uint2*>(layer_base + idx) = w;
      }
      if (threadIdx.x == 0) {
        // first_slot == 0 here, so chunk block cb is cache block block_ids[cb].
        const uint32_t block = static_cast<uint32_t>(p.block_ids[cb]);
        const float* scales = s == 0 ? c.k_scale_layers[layer] : c.v_scale_layers[layer];
        reinterpret_cast<float*>(layer_base + sa.data_bytes)[uint64_t{cb} * H + head] =
            scales[c.scale_index(block, head)];
      }
    }
    if (blockIdx.x == 0) ZeroPadding(layer_base, sa);
  }

  // The last CTA to finish writes the header with the OR of every CTA's
  // non-finite flag, and leaves the workspace zero for the next launch.
  non_finite = __syncthreads_or(non_finite);
  if (threadIdx.x == 0) {
    if (non_finite) atomicOr(p.workspace, 1u);
    __threadfence();
    const uint32_t total = gridDim.x * gridDim.y;
    if (atomicAdd(p.workspace + 1, 1u) == total - 1) {
      const uint32_t flags = atomicExch(p.workspace, 0u) != 0 ? codec::kFlagNonFinite : 0u;
      atomicExch(p.workspace + 1, 0u);
      Header128 h = p.header;
      h.w[3].x |= flags << 16;
      uint4* dst = reinterpret_cast<uint4*>(p.chunk);
#pragma unroll
      for (int i = 0; i < 8; ++i) dst[i] = h.w[i];
    }
  }
}

template <int HD, int BS>
__global__ void __launch_bounds__(kThreads)
    DecodeScatterKernel(const __grid_constant__ CodecParams p) {
  using T = Tile<HD, BS>;
  const PagedKvLayout& c = p.cache;
  const uint32_t H = c.num_kv_heads;
  const uint32_t head = blockIdx.x % H;
  const uint32_t cb = blockIdx.x / H;
  const uint32_t layer = blockIdx.y;
  const uint32_t t0 = cb * BS;
  const uint32_t nt = min(static_cast<uint32_t>(BS), p.num_tokens - t0);

  uint4 data[2][T::kPerThread];
  float scale[2] = {1.0f, 1.0f};
#pragma unroll
  for (int s = 0; s < 2; ++s) {
    const SectionArgs& sa = p.sec[s];
    const uint8_t* layer_base = p.chunk + sa.offset + sa.layer_stride * layer;
    if (sa.mode != Mode::kCopy16) {
      scale[s] = __ldg(reinterpret_cast<const float*>(layer_base + sa.data_bytes) +
                       uint64_t{cb} * H + head);
    }
#pragma unroll
    for (int i = 0; i < T::kPerThread; ++i) {
      const int v = threadIdx.x + i * kThreads;
      const uint32_t t = v / T::kVecsPerRow;
      data[s][i] = make_uint4(0, 0, 0, 0);
      if (v < T::kVecs && t < nt) {
        const uint64_t idx = T::ChunkIndex(t0, v, H, head);
        if (sa.mode == Mode::kCopy16) {
          data[s][i] = __ldg(reinterpret_cast<const uint4*>(layer_base + idx * 2));
        } else {
          const uint2 w = __ldg(reinterpret_cast<const uint2*>(layer_base + idx));
          data[s][i] = make_uint4(w.x, w.y, 0, 0);
        }
      }
    }
  }

#pragma unroll
  for (int i = 0; i < T::kPerThread; ++i) {
    const int v = threadIdx.x + i * kThreads;
    const uint32_t t = v / T::kVecsPerRow;
    if (!(v < T::kVecs && t < nt)) continue;
    const uint32_t d = (v % T::kVecsPerRow) * kVecElems;
    const uint2 bs = T::CacheSlot(p.block_ids, p.first_slot, t0 + t);
    const uint32_t block = bs.x, slot = bs.y;
#pragma unroll
    for (int s = 0; s < 2; ++s) {
      void* base = s == 0 ? c.k_layers[layer] : c.v_layers[layer];
      const int64_t e = s == 0 ? c.k_elem(block, slot, head, d) : c.v_elem(block, slot, head, d);
      const Mode mode = p.sec[s].mode;
      if (mode == Mode::kCopy16) {
        *reinterpret_cast<uint4*>(static_cast<uint16_t*>(base) + e) = data[s][i];
      } else if (mode == Mode::kPass8) {
        *reinterpret_cast<uint2*>(static_cast<uint8_t*>(base) + e) =
            make_uint2(data[s][i].x, data[s][i].y);
      } else {
        const uint32_t w[2] = {data[s][i].x, data[s][i].y};
        uint32_t out[4];
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const uint8_t lo = static_cast<uint8_t>(w[q / 2] >> (16 * (q % 2)));
          const uint8_t hi = static_cast<uint8_t>(w[q / 2] >> (16 * (q % 2) + 8));
          out[q] = uint32_t{DequantizeFp8To16(lo, scale[s], p.bf16)} |
                   (uint32_t{DequantizeFp8To16(hi, scale[s], p.bf16)} << 16);
        }
        *reinterpret_cast<uint4*>(static_cast<uint16_t*>(base) + e) =
            make_uint4(out[0], out[1], out[2], out[3]);
      }
    }
  }
  if (threadIdx.x == 0) {
#pragma unroll
    for (int s = 0; s < 2; ++s) {
      if (p.sec[s].mode != Mode::kPass8) continue;
      const uint32_t block = static_cast<uint32_t>(p.block_ids[cb]);  // first_slot == 0
      float* scales = s == 0 ? c.k_scale_layers[layer] : c.v_scale_layers[layer];
      scales[c.scale_index(block, head)] = scale[s];
    }
  }
}

bool Is16(DType t) { return t == DType::kBF16 || t == DType::kFP16; }

absl::StatusOr<Mode> ResolveMode(const char* name, DType cache_dtype, DType chunk_dtype,
                                 codec::SectionFormat f, uint32_t first_slot) {
  const bool fp8_bh =
      f.dtype == DType::kFP8E4M3 && f.granularity == codec::ScaleGranularity::kPerBlockHead;
  if (Is16(cache_dtype)) {
    if (cache_dtype != chunk_dtype) {
      return absl::InvalidArgumentError(absl::StrCat(name, ": the cache holds ",
                                                     codec::DTypeName(cache_dtype),
                                                     " but the chunk dtype is ",
                                                     codec::DTypeName(chunk_dtype)));
    }
    if (Is16(f.dtype)) return Mode::kCopy16;
    if (fp8_bh) return Mode::kFp8;
    return absl::InvalidArgumentError(absl::StrCat(
        name, ": the GPU codec supports native and fp8e4m3/block-head sections, not ",
        codec::DTypeName(f.dtype), "/", codec::GranularityName(f.granularity),
        " (use the CPU codec)"));
  }
  if (cache_dtype != DType::kFP8E4M3 || !fp8_bh) {
    return absl::InvalidArgumentError(absl::StrCat(
        name, ": an fp8e4m3 cache section passes through only to fp8e4m3/block-head"));
  }
  if (first_slot != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        name, ": an fp8e4m3 cache section needs a chunk that starts on a block boundary "
              "(first_slot = ", first_slot, ")"));
  }
  return Mode::kPass8;
}

// Every check of both launchers, before anything touches the device.
absl::StatusOr<CodecParams> Prepare(const codec::ChunkSpec& spec, const codec::ChunkLayout& layout,
                                    const PagedKvLayout& cache, const BlockSpan& blocks,
                                    const uint8_t* chunk) {
  KVTIER_RETURN_IF_ERROR(ValidatePagedKvLayout(cache));
  const codec::Geometry& g = spec.geometry;
  if (g.num_layers != cache.num_layers || g.num_kv_heads != cache.num_kv_heads ||
      g.head_dim != cache.head_dim || g.block_size != cache.block_size) {
    return absl::InvalidArgumentError(absl::StrCat(
        "geometry: chunk (layers ", g.num_layers, ", kv_heads ", g.num_kv_heads, ", head_dim ",
        g.head_dim, ", block_size ", g.block_size, ") does not match the cache (",
        cache.num_layers, ", ", cache.num_kv_heads, ", ", cache.head_dim, ", ",
        cache.block_size, ")"));
  }
  if (cache.head_dim != 64 && cache.head_dim != 128 && cache.head_dim != 256) {
    return absl::InvalidArgumentError(
        absl::StrCat("head_dim = ", cache.head_dim, " is not supported (64, 128, 256)"));
  }
  if (cache.block_size != 8 && cache.block_size != 16 && cache.block_size != 32 &&
      cache.block_size != 64) {
    return absl::InvalidArgumentError(
        absl::StrCat("block_size = ", cache.block_size, " is not supported (8, 16, 32, 64)"));
  }
  KVTIER_RETURN_IF_ERROR(ValidateBlockSpan(cache, blocks, g.num_tokens));
  if (chunk == nullptr) return absl::InvalidArgumentError("chunk pointer is null");
  if (reinterpret_cast<uintptr_t>(chunk) % 16 != 0) {
    return absl::InvalidArgumentError("chunk pointer is not 16-byte aligned");
  }
  if (uint64_t{g.num_blocks()} * g.num_kv_heads > 0x7FFFFFFFull || g.num_layers > 65535) {
    return absl::InvalidArgumentError("geometry: too many blocks x heads for one launch");
  }
  CodecParams p{};
  p.cache = cache;
  p.block_ids = blocks.block_ids;
  p.first_slot = blocks.first_slot;
  p.num_tokens = g.num_tokens;
  p.num_blocks_in_chunk = g.num_blocks();
  p.bf16 = spec.dtype == DType::kBF16;
  const codec::SectionLayout* secs[2] = {&layout.k, &layout.v};
  const DType cache_dtypes[2] = {cache.k_dtype, cache.v_dtype};
  const codec::SectionFormat formats[2] = {spec.k, spec.v};
  const uint64_t offsets[2] = {layout.k_offset, layout.v_offset};
  for (int s = 0; s < 2; ++s) {
    KVTIER_ASSIGN_OR_RETURN(Mode m, ResolveMode(s == 0 ? "k" : "v", cache_dtypes[s], spec.dtype,
                                                formats[s], blocks.first_slot));
    SectionArgs& a = p.sec[s];
    a.mode = m;
    a.offset = offsets[s];
    a.layer_stride = secs[s]->layer_stride;
    a.data_bytes = secs[s]->data_bytes;
    a.payload = g.layer_elements() * codec::BitsPerElement(formats[s].dtype) / 8;
    a.scale_count = secs[s]->scale_count;
    a.scale_bytes = secs[s]->scale_bytes;
  }
  return p;
}

template <template <int, int> class Kernel>
absl::Status Launch(const CodecParams& p, uint32_t head_dim, uint32_t block_size,
                    cudaStream_t stream) {
  const dim3 grid(p.num_blocks_in_chunk * p.cache.num_kv_heads, p.cache.num_layers);
  void (*fn)(CodecParams) = nullptr;
#define KVTIER_CODEC_CASE(HD, BS) \
  if (head_dim == HD && block_size == BS) fn = Kernel<HD, BS>::fn;
  KVTIER_CODEC_CASE(64, 8) KVTIER_CODEC_CASE(64, 16) KVTIER_CODEC_CASE(64, 32)
  KVTIER_CODEC_CASE(64, 64) KVTIER_CODEC_CASE(128, 8) KVTIER_CODEC_CASE(128, 16)
  KVTIER_CODEC_CASE(128, 32) KVTIER_CODEC_CASE(128, 64) KVTIER_CODEC_CASE(256, 8)
  KVTIER_CODEC_CASE(256, 16) KVTIER_CODEC_CASE(256, 32) KVTIER_CODEC_CASE(256, 64)
#undef KVTIER_CODEC_CASE
  if (fn == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("no kernel for head_dim ", head_dim,
                                                   " and block_size ", block_size));
  }
  fn<<<grid, kThreads, 0, stream>>>(p);
  KVTIER_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return absl::OkStatus();
}

template <int HD, int BS>
struct EncodeK {
  static constexpr void (*fn)(CodecParams) = GatherEncodeKernel<HD, BS>;
};
template <int HD, int BS>
struct DecodeK {
  static constexpr void (*fn)(CodecParams) = DecodeScatterKernel<HD, BS>;
};

}  // namespace

absl::Status GatherEncode(const codec::ChunkSpec& spec_in, const PagedKvLayout& cache,
                          const BlockSpan& blocks, uint8_t* dst, uint32_t* workspace,
                          cudaStream_t stream) {
  KVTIER_ASSIGN_OR_RETURN(codec::ChunkLayout layout, codec::ValidateSpec(spec_in));
  KVTIER_ASSIGN_OR_RETURN(CodecParams p, Prepare(spec_in, layout, cache, blocks, dst));
  if (workspace == nullptr) return absl::InvalidArgumentError("workspace is null");
  codec::ChunkSpec spec = spec_in;
  spec.flags = 0;
  uint8_t header[codec::kHeaderSize];
  codec::WriteHeader(spec, layout, 0, 0, header);
  std::memset(header + codec::kOffHeaderChecksum, 0, 8);  // SealChunk computes it
  std::memcpy(&p.header, header, sizeof(header));
  p.chunk = dst;
  p.workspace = workspace;
  return Launch<EncodeK>(p, cache.head_dim, cache.block_size, stream);
}

absl::Status DecodeScatter(const codec::ChunkHeader& header, const uint8_t* chunk,
                           const PagedKvLayout& cache, const BlockSpan& blocks,
                           cudaStream_t stream) {
  KVTIER_ASSIGN_OR_RETURN(codec::ChunkLayout layout, codec::ValidateSpec(header.spec));
  KVTIER_ASSIGN_OR_RETURN(CodecParams p, Prepare(header.spec, layout, cache, blocks, chunk));
  p.chunk = const_cast<uint8_t*>(chunk);  // read only by the decode kernel
  return Launch<DecodeK>(p, cache.head_dim, cache.block_size, stream);
}

}  // namespace kvtier::kernels
