// Decode+scatter: the kernels, DecodeScatter and HostStaging (paged_codec.h).
#include "common/status.h"
#include "kernels/cuda_status.h"
#include "kernels/device_copy.cuh"
#include "kernels/device_numeric.cuh"
#include "kernels/paged_codec.h"
#include "kernels/paged_codec_internal.cuh"

namespace kvtier::kernels {
namespace codec_internal {
namespace {

// The 16-bit values of 8 FP8 codes, as DequantizeVec.
__device__ __forceinline__ uint4 DequantizeFp8Vec(const uint2& c, float scale, bool bf16) {
  return make_uint4(DequantizeFp8x2To16(static_cast<uint16_t>(c.x), scale, bf16),
                    DequantizeFp8x2To16(static_cast<uint16_t>(c.x >> 16), scale, bf16),
                    DequantizeFp8x2To16(static_cast<uint16_t>(c.y), scale, bf16),
                    DequantizeFp8x2To16(static_cast<uint16_t>(c.y >> 16), scale, bf16));
}

// The 16-bit values of 8 codes (QuantizeVec's packing): codec::Store16 of
// codec::DequantizeFp8 / DequantizeInt, one binary32 multiply each.
__device__ __forceinline__ uint4 DequantizeVec(const uint2& c, float scale, DType qt, bool bf16) {
  if (qt == DType::kFP8E4M3) return DequantizeFp8Vec(c, scale, bf16);
  if (qt == DType::kINT8) {
    return make_uint4(DequantizeIntx2To16<8>(c.x, scale, bf16),
                      DequantizeIntx2To16<8>(c.x >> 16, scale, bf16),
                      DequantizeIntx2To16<8>(c.y, scale, bf16),
                      DequantizeIntx2To16<8>(c.y >> 16, scale, bf16));
  }
  return make_uint4(DequantizeIntx2To16<4>(c.x, scale, bf16),  // kINT4: 8 nibbles of x
                    DequantizeIntx2To16<4>(c.x >> 8, scale, bf16),
                    DequantizeIntx2To16<4>(c.x >> 16, scale, bf16),
                    DequantizeIntx2To16<4>(c.x >> 24, scale, bf16));
}

// Writes one vector of section s, as the chunk holds it (`codes`: 16-bit
// elements, or 8 FP8 / INT8 codes in x and y, or 8 INT4 codes in x), to the
// cache at element `e` of `layer`, dequantized with `scale` where the section
// is quantized and the cache 16-bit.
template <bool kGeneral>
__device__ __forceinline__ void StoreToCache(const CodecParams& p, int s, uint32_t layer,
                                             int64_t e, const uint4& codes, float scale) {
  const PagedKvLayout& c = p.cache;
  void* base = s == 0 ? c.k_layers[layer] : c.v_layers[layer];
  const Mode mode = p.sec[s].mode;
  if (mode == Mode::kCopy16) {
    *reinterpret_cast<uint4*>(static_cast<uint16_t*>(base) + e) = codes;
  } else if (mode == Mode::kPass8) {
    *reinterpret_cast<uint2*>(static_cast<uint8_t*>(base) + e) = make_uint2(codes.x, codes.y);
  } else if (kGeneral && mode == Mode::kQuant) {
    *reinterpret_cast<uint4*>(static_cast<uint16_t*>(base) + e) =
        DequantizeVec(make_uint2(codes.x, codes.y), scale, p.sec[s].qdtype, p.bf16);
  } else {  // kFp8
    *reinterpret_cast<uint4*>(static_cast<uint16_t*>(base) + e) =
        DequantizeFp8Vec(make_uint2(codes.x, codes.y), scale, p.bf16);
  }
}

// Chunk block cb's per-(block, head) scale of a kPass8 section to the cache's
// scale of its block (first_slot == 0, so chunk block cb is cache block
// block_ids[cb]).
__device__ __forceinline__ void StorePass8Scale(const CodecParams& p, int s, uint32_t layer,
                                                uint32_t cb, uint32_t head, float scale) {
  const PagedKvLayout& c = p.cache;
  const uint32_t block = static_cast<uint32_t>(p.block_ids[cb]);
  float* scales = s == 0 ? c.k_scale_layers[layer] : c.v_scale_layers[layer];
  scales[c.scale_index(block, head)] = scale;
}

// Decode+scatter of a chunk in device memory: one CTA a tile of one kv head,
// every load issued before any store. As a programmatic dependent launch
// (PriorKernel::kLeavesChunk) it loads its tile before WaitForPriorGrids and
// reads the block ids and stores after it, as DecodeFromHostKernel.
template <int HD, int BS, bool kGeneral>
__global__ void __launch_bounds__(kThreads)
    DecodeScatterKernel(const __grid_constant__ CodecParams p) {
  using T = Tile<HD, BS>;
  AllowDependentLaunch();
  const auto [H, head, cb, layer, t0, nt] = T::Here(p);
  uint4 data[2][T::kPerThread];
  float scale[2][T::kPerThread];
#pragma unroll
  for (int s = 0; s < 2; ++s) {
    const SectionArgs& sa = p.sec[s];
    const uint8_t* layer_base = sa.LayerBase(p.chunk, layer);
    const float* scales = sa.LayerScales(p.chunk, layer);
    const bool token = kGeneral && sa.gran == ScaleGranularity::kPerTokenHead;
    const bool int4 = kGeneral && sa.mode == Mode::kQuant && sa.qdtype == DType::kINT4;
    float group = 1.0f;
    if (kGeneral && sa.gran == ScaleGranularity::kPerTensor) {
      group = __ldg(scales);
    } else if (sa.gran == ScaleGranularity::kPerBlockHead) {
      group = __ldg(scales + uint64_t{cb} * H + head);
    }
#pragma unroll
    for (int i = 0; i < T::kPerThread; ++i) {
      const int v = threadIdx.x + i * kThreads;
      const uint32_t t = v / T::kVecsPerRow;
      data[s][i] = make_uint4(0, 0, 0, 0);
      scale[s][i] = group;
      if (v < T::kVecs && t < nt) {
        const uint64_t idx = T::ChunkIndex(t0, v, H, head);
        if (sa.mode == Mode::kCopy16) {
          data[s][i] = __ldg(reinterpret_cast<const uint4*>(layer_base + idx * 2));
        } else if (int4) {
          data[s][i].x = __ldg(reinterpret_cast<const uint32_t*>(layer_base + idx / 2));
        } else {
          const uint2 w = __ldg(reinterpret_cast<const uint2*>(layer_base + idx));
          data[s][i] = make_uint4(w.x, w.y, 0, 0);
        }
        if (token) scale[s][i] = __ldg(scales + uint64_t{t0 + t} * H + head);
      }
    }
  }

  WaitForPriorGrids();
  const PagedKvLayout& c = p.cache;
#pragma unroll
  for (int i = 0; i < T::kPerThread; ++i) {
    const int v = threadIdx.x + i * kThreads;
    const uint32_t t = v / T::kVecsPerRow;
    if (!(v < T::kVecs && t < nt)) continue;
    const uint32_t d = (v % T::kVecsPerRow) * kVecElems;
    const uint2 bs = T::CacheSlot(p.block_ids, p.first_slot, t0 + t);
#pragma unroll
    for (int s = 0; s < 2; ++s) {
      const int64_t e = s == 0 ? c.k_elem(bs.x, bs.y, head, d) : c.v_elem(bs.x, bs.y, head, d);
      StoreToCache<kGeneral>(p, s, layer, e, data[s][i], scale[s][i]);
    }
  }
  if (threadIdx.x == 0) {
#pragma unroll
    for (int s = 0; s < 2; ++s) {
      if (p.sec[s].mode == Mode::kPass8) StorePass8Scale(p, s, layer, cb, head, scale[s][0]);
    }
  }
}

// ---- Decode+scatter of a chunk in host memory ----
//
// DecodeFromHostKernel: a CTA serves a tile (layer, chunk block,
// heads_per_cta kv heads). It loads the tile's codes and scales of both
// sections, runs of 16-byte vectors in the chunk, into registers with
// ordinary loads (all issued before any is used), stores them into a stage
// in shared memory (HostStage), and scatters from there: each thread then
// dequantizes whole vectors of one head's row. cp.async copies from host
// memory go over PCIe as partial-line requests (H200: 2.7 sectors a request
// instead of 4, 1.5x the requests), and persistent CTAs that load tile k + 1
// while they scatter tile k measure slower than one CTA a tile (the
// measurements: kernels/README.md and bench/results).

// Most 16-byte vectors of codes a thread loads for one tile: a tile is
// BS x heads_per_cta rows of HD codes per section, over kThreads x
// heads_per_cta threads. Counted as two 16-bit sections: a launch of this
// kernel has a kQuant section (at most 8 bits), and the other 8 bits a code
// cover the at most 2 x 7 slots HostCodeVec places before the runs.
template <int HD, int BS>
inline constexpr int kHostVecsPerThread = (BS * HD * 2 * 2 / 16 + kThreads - 1) / kThreads;

// One thread's share of a tile between its loads and the stage.
template <int HD, int BS>
struct HostTileRegs {
  uint4 codes[kHostVecsPerThread<HD, BS>];
  uint4 token[2];  // per-(token, head) scales: one 16-byte vector, or one float in x
  float group[2];
};

// Where this thread's j-th code vector of the tile at `at` lies: source in
// the chunk and destination offset in the stage; false for none (past the
// tile's end, or a slot before a section's run).
// With all kv heads in the CTA a section's tile is one run of nt * H rows;
// its slots start at the run's 128-byte line, `lead` slots before the run,
// so that every warp's 32 vectors are four whole lines even where the layer
// record is not line-aligned (per-tensor sections: a record is its codes and
// 16 bytes of scale), not five partial ones.
template <int HD, int BS>
__device__ __forceinline__ bool HostCodeVec(const CodecParams& p,
                                            const typename Tile<HD, BS>::Coords& at, int j,
                                            const uint8_t** src, uint32_t* dst) {
  const HostStage& hs = p.host_stage;
  const uint32_t g = p.heads_per_cta, h0 = at.head - threadIdx.y;
  uint32_t f = threadIdx.y * kThreads + threadIdx.x + j * kThreads * g;
#pragma unroll
  for (int s = 0; s < 2; ++s) {
    const uint32_t rb = hs.row_bytes[s], row = g * rb, row_vecs = row / 16;
    const uint8_t* run = p.sec[s].LayerBase(p.chunk, at.layer) + (uint64_t{at.t0} * at.H + h0) * rb;
    const uint32_t lead = g == at.H ? reinterpret_cast<uintptr_t>(run) % 128 / 16 : 0;
    if (f < lead + at.nt * row_vecs) {
      if (f < lead) return false;
      const uint32_t v = f - lead, t = v / row_vecs, o = v % row_vecs;
      *src = run + uint64_t{t} * at.H * rb + o * 16;
      *dst = hs.codes[s] + t * row + o * 16;
      return true;
    }
    f -= lead + at.nt * row_vecs;
  }
  return false;
}

// Whether section s's per-(token, head) scales of the tile move as one run
// of 16-byte vectors (all heads, a 16-byte aligned run of whole vectors)
// rather than one float each.
__device__ __forceinline__ bool TokenScaleVectors(const CodecParams& p, const float* run,
                                                  uint32_t nt) {
  const uint32_t g = p.heads_per_cta;
  return g == p.cache.num_kv_heads && (nt * g) % 4 == 0 &&
         reinterpret_cast<uintptr_t>(run) % 16 == 0;
}

// Issues this thread's loads of the tile at `at` (its first head h0 =
// at.head - threadIdx.y) into `r`. StageHostTile walks the same slots again
// rather than one function keeping them: merged, nvcc scheduled stage stores
// among the loads and INT4 decode from pinned memory measured 0.02-0.03 lower
// on the H200.
template <int HD, int BS>
__device__ __forceinline__ void LoadHostTile(const CodecParams& p,
                                             const typename Tile<HD, BS>::Coords& at,
                                             HostTileRegs<HD, BS>& r) {
  const uint32_t g = p.heads_per_cta, H = at.H, h0 = at.head - threadIdx.y;
  const uint32_t tid = threadIdx.y * kThreads + threadIdx.x;
#pragma unroll
  for (int j = 0; j < kHostVecsPerThread<HD, BS>; ++j) {
    const uint8_t* src;
    uint32_t dst;
    if (HostCodeVec<HD, BS>(p, at, j, &src, &dst)) {
      r.codes[j] = __ldg(reinterpret_cast<const uint4*>(src));
    }
  }
#pragma unroll
  for (int s = 0; s < 2; ++s) {
    const SectionArgs& sa = p.sec[s];
    const float* scales = sa.LayerScales(p.chunk, at.layer);
    const bool quant = sa.mode == Mode::kQuant;
    if (quant && sa.gran == ScaleGranularity::kPerTokenHead) {
      const float* run = scales + uint64_t{at.t0} * H;
      if (TokenScaleVectors(p, run, at.nt)) {
        if (tid < at.nt * g / 4) r.token[s] = __ldg(reinterpret_cast<const uint4*>(run) + tid);
      } else if (tid < at.nt * g) {
        const float* scale = scales + uint64_t{at.t0 + tid / g} * H + h0 + tid % g;
        r.token[s].x = __float_as_uint(__ldg(scale));
      }
    } else if (quant && sa.gran == ScaleGranularity::kPerTensor) {
      if (tid == 0) r.group[s] = __ldg(scales);
    } else if (sa.mode != Mode::kCopy16 && tid < g) {  // per-(block, head)
      r.group[s] = __ldg(scales + uint64_t{at.cb} * H + h0 + tid);
    }
  }
}

// Stores `r`, loaded by LoadHostTile for the tile at `at`, into the stage.
template <int HD, int BS>
__device__ __forceinline__ void StageHostTile(const CodecParams& p,
                                              const typename Tile<HD, BS>::Coords& at,
                                              const HostTileRegs<HD, BS>& r, uint8_t* buf) {
  const HostStage& hs = p.host_stage;
  const uint32_t g = p.heads_per_cta;
  const uint32_t tid = threadIdx.y * kThreads + threadIdx.x;
#pragma unroll
  for (int j = 0; j < kHostVecsPerThread<HD, BS>; ++j) {
    const uint8_t* src;
    uint32_t dst;
    if (HostCodeVec<HD, BS>(p, at, j, &src, &dst)) {
      *reinterpret_cast<uint4*>(buf + dst) = r.codes[j];
    }
  }
#pragma unroll
  for (int s = 0; s < 2; ++s) {
    const SectionArgs& sa = p.sec[s];
    const bool quant = sa.mode == Mode::kQuant;
    if (quant && sa.gran == ScaleGranularity::kPerTokenHead) {
      const float* run = sa.LayerScales(p.chunk, at.layer) + uint64_t{at.t0} * at.H;
      if (TokenScaleVectors(p, run, at.nt)) {
        if (tid < at.nt * g / 4) {
          reinterpret_cast<uint4*>(buf + hs.token_scales[s])[tid] = r.token[s];
        }
      } else if (tid < at.nt * g) {
        reinterpret_cast<uint32_t*>(buf + hs.token_scales[s])[tid] = r.token[s].x;
      }
    } else if (quant && sa.gran == ScaleGranularity::kPerTensor) {
      if (tid == 0) reinterpret_cast<float*>(buf + hs.group[s])[0] = r.group[s];
    } else if (sa.mode != Mode::kCopy16 && tid < g) {
      reinterpret_cast<float*>(buf + hs.group[s])[tid] = r.group[s];
    }
  }
}

// Dequantizes and scatters the tile at `at` from the stage buffer `buf`.
// REQUIRES: the buffer's copies are complete and visible (wait + barrier).
template <int HD, int BS>
__device__ __forceinline__ void ScatterHostTile(const CodecParams& p,
                                                const typename Tile<HD, BS>::Coords& at,
                                                const uint8_t* buf) {
  using T = Tile<HD, BS>;
  const HostStage& hs = p.host_stage;
  const PagedKvLayout& c = p.cache;
  const uint32_t g = p.heads_per_cta, y = threadIdx.y;
  float group[2];
  bool token[2];
#pragma unroll
  for (int s = 0; s < 2; ++s) {
    const ScaleGranularity gran = p.sec[s].gran;
    token[s] = gran == ScaleGranularity::kPerTokenHead;
    const float* gs = reinterpret_cast<const float*>(buf + hs.group[s]);
    group[s] = gran == ScaleGranularity::kPerTensor      ? gs[0]
               : gran == ScaleGranularity::kPerBlockHead ? gs[y]
                                                         : 1.0f;
  }
#pragma unroll
  for (int i = 0; i < T::kPerThread; ++i) {
    const int v = threadIdx.x + i * kThreads;
    const uint32_t t = v / T::kVecsPerRow;
    if (!(v < T::kVecs && t < at.nt)) continue;
    const uint32_t d = (v % T::kVecsPerRow) * kVecElems;
    const uint32_t elem = (t * g + y) * HD + d;  // element index in a section's codes
    const uint2 bs = T::CacheSlot(p.block_ids, p.first_slot, at.t0 + t);
#pragma unroll
    for (int s = 0; s < 2; ++s) {
      const SectionArgs& sa = p.sec[s];
      const uint8_t* codes = buf + hs.codes[s];
      uint4 w = make_uint4(0, 0, 0, 0);
      if (sa.mode == Mode::kCopy16) {
        w = *reinterpret_cast<const uint4*>(codes + elem * 2);
      } else if (sa.mode == Mode::kQuant && sa.qdtype == DType::kINT4) {
        w.x = *reinterpret_cast<const uint32_t*>(codes + elem / 2);
      } else {
        const uint2 b = *reinterpret_cast<const uint2*>(codes + elem);
        w = make_uint4(b.x, b.y, 0, 0);
      }
      const float scale =
          token[s] ? reinterpret_cast<const float*>(buf + hs.token_scales[s])[t * g + y] : group[s];
      const int64_t e =
          s == 0 ? c.k_elem(bs.x, bs.y, at.head, d) : c.v_elem(bs.x, bs.y, at.head, d);
      StoreToCache<true>(p, s, at.layer, e, w, scale);
    }
  }
  if (threadIdx.x == 0) {
#pragma unroll
    for (int s = 0; s < 2; ++s) {
      if (p.sec[s].mode == Mode::kPass8) StorePass8Scale(p, s, at.layer, at.cb, at.head, group[s]);
    }
  }
}

// kThreads x heads_per_cta threads a CTA, host_stage.bytes of dynamic shared
// memory; the grid of Tile::Here.
//
// Launched with PriorKernel::kLeavesChunk (LaunchDecodeFromHost), the grid
// may start while the kernel before it on the stream finishes: a CTA reads
// its tile of the chunk (which that kernel does not write) before
// WaitForPriorGrids, and reads the block ids and writes the cache only after
// it. Every CTA allows the next grid's launch at once, so that a chain of
// decodes keeps the link busy across launches: the next grid's CTAs take
// the SMs this grid's last CTAs leave and load their tiles while those finish.
template <int HD, int BS>
__global__ void __launch_bounds__(kThreads * kMaxHeadsPerCta<HD, BS>)
    DecodeFromHostKernel(const __grid_constant__ CodecParams p) {
  using T = Tile<HD, BS>;
  extern __shared__ __align__(16) uint8_t stage_smem[];
  AllowDependentLaunch();
  const typename T::Coords at = T::Here(p);
  HostTileRegs<HD, BS> r;
  LoadHostTile<HD, BS>(p, at, r);
  WaitForPriorGrids();
  StageHostTile<HD, BS>(p, at, r, stage_smem);
  __syncthreads();
  ScatterHostTile<HD, BS>(p, at, stage_smem);
}

template <int HD, int BS>
struct DecodeK {  // no kQuant section, or a chunk in device memory (else LaunchDecodeFromHost)
  static constexpr KernelFn fast = DecodeScatterKernel<HD, BS, false>;
  static constexpr KernelFn general = DecodeScatterKernel<HD, BS, true>;
};

// Codes of one element of a section that a kernel of `mode` reads or writes.
uint32_t SectionBits(const SectionArgs& a) {
  if (a.mode == Mode::kCopy16) return 16;
  return a.mode == Mode::kQuant && a.qdtype == DType::kINT4 ? 4 : 8;
}

// DecodeFromHostKernel's stage buffer for tiles of `g` heads.
HostStage MakeHostStage(const CodecParams& p, uint32_t head_dim, uint32_t block_size,
                        uint32_t g) {
  auto align16 = [](uint32_t n) { return (n + 15) / 16 * 16; };
  HostStage hs{};
  uint32_t at = 0;
  for (int s = 0; s < 2; ++s) {
    hs.row_bytes[s] = head_dim * SectionBits(p.sec[s]) / 8;
    hs.codes[s] = at;
    at = align16(at + block_size * g * hs.row_bytes[s]);
  }
  for (int s = 0; s < 2; ++s) {
    hs.token_scales[s] = at;
    const bool token = p.sec[s].gran == ScaleGranularity::kPerTokenHead;
    at = align16(at + (token ? block_size * g * 4 : 0));
  }
  for (int s = 0; s < 2; ++s) {
    hs.group[s] = at;
    at = align16(at + g * 4);
  }
  hs.bytes = at;
  return hs;
}

// Decode+scatter of a chunk in host memory with a kQuant section:
// DecodeFromHostKernel, the most kv heads a CTA that divide the kv heads;
// with `prior` kLeavesChunk a programmatic dependent launch where the device
// has them.
absl::Status LaunchDecodeFromHost(CodecParams p, PriorKernel prior, cudaStream_t stream) {
  const uint32_t H = p.cache.num_kv_heads;
  KernelFn fn = nullptr;
  uint32_t g = 1;
  KVTIER_RETURN_IF_ERROR(KVTIER_DISPATCH_HEAD_DIM(p.cache.head_dim, HD, {
    return KVTIER_DISPATCH_CODEC_BLOCK_SIZE(p.cache.block_size, BS, {
      g = HostHeadsPerCta<HD, BS>(H);
      p.host_stage = MakeHostStage(p, HD, BS, g);
      fn = DecodeFromHostKernel<HD, BS>;
    });
  }));
  p.heads_per_cta = g;
  const uint32_t smem = p.host_stage.bytes;
  if (smem > 48 * 1024) {  // a 16-bit and an 8-bit section of 8 heads x 16 tokens x 128 dims
    KVTIER_RETURN_IF_ERROR(OutsideCapture([&] {
      return cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  static_cast<int>(smem));
    }));
  }
  return LaunchKernel(fn, p, dim3(p.num_blocks_in_chunk * (H / g), p.layer_end - p.layer_begin),
                      dim3(kThreads, g), smem, prior, stream);
}

absl::StatusOr<CodecParams> PrepareDecode(const codec::ChunkHeader& header, const uint8_t* chunk,
                                          const PagedKvLayout& cache, const BlockSpan& blocks,
                                          LayerRange layers) {
  KVTIER_ASSIGN_OR_RETURN(codec::ChunkLayout layout, codec::ValidateSpec(header.spec));
  KVTIER_ASSIGN_OR_RETURN(CodecParams p,
                          Prepare(header.spec, layout, cache, blocks, layers, chunk));
  p.chunk = const_cast<uint8_t*>(chunk);  // read only by the decode kernel
  return p;
}

// The decode launch of a checked `p` whose chunk is (`in_host`) or is not in
// host memory: DecodeFromHostKernel for a chunk in host memory with a kQuant
// section, else DecodeScatterKernel (its direct loads reach 0.91-0.92 of a
// pinned memcpy from host memory without a kQuant section).
absl::Status LaunchDecode(const CodecParams& p, bool in_host, PriorKernel prior,
                          cudaStream_t stream) {
  if (in_host && NeedsGeneral(p)) return LaunchDecodeFromHost(p, prior, stream);
  return Launch<DecodeK>(p, false, stream, prior);
}

}  // namespace
}  // namespace codec_internal

using codec_internal::CodecParams;
using codec_internal::DecodeK;
using codec_internal::HostAddress;
using codec_internal::HostAddressOf;
using codec_internal::IsHostMemory;
using codec_internal::Launch;
using codec_internal::LaunchDecode;
using codec_internal::Mode;
using codec_internal::NeedsGeneral;
using codec_internal::PrepareDecode;
using codec_internal::SectionArgs;

absl::Status DecodeScatter(const codec::ChunkHeader& header, const uint8_t* chunk,
                           const PagedKvLayout& cache, const BlockSpan& blocks,
                           cudaStream_t stream, PriorKernel prior) {
  return DecodeScatter(header, chunk, cache, blocks, LayerRange{}, stream, prior);
}

absl::Status DecodeScatter(const codec::ChunkHeader& header, const uint8_t* chunk,
                           const PagedKvLayout& cache, const BlockSpan& blocks,
                           LayerRange layers, cudaStream_t stream, PriorKernel prior) {
  KVTIER_ASSIGN_OR_RETURN(CodecParams p, PrepareDecode(header, chunk, cache, blocks, layers));
  bool in_host = false;
  if (NeedsGeneral(p)) {  // only then does the answer change the kernel
    KVTIER_ASSIGN_OR_RETURN(in_host, IsHostMemory(p.chunk));
  }
  return LaunchDecode(p, in_host, prior, stream);
}

// ---- HostStaging ----

absl::StatusOr<std::unique_ptr<HostStaging>> HostStaging::Create(size_t bytes) {
  if (bytes == 0) return absl::InvalidArgumentError("a HostStaging of 0 bytes");
  std::unique_ptr<HostStaging> s(new HostStaging());
  KVTIER_RETURN_IF_ERROR(s->Reserve(bytes));
  return s;
}

HostStaging::~HostStaging() {
  if (data_ != nullptr) cudaFree(data_);
}

absl::Status HostStaging::Reserve(size_t bytes) {
  if (bytes <= capacity_) return absl::OkStatus();
  if (data_ != nullptr) KVTIER_CUDA_RETURN_IF_ERROR(cudaFree(data_));
  data_ = nullptr;
  capacity_ = 0;
  KVTIER_CUDA_RETURN_IF_ERROR(cudaMalloc(reinterpret_cast<void**>(&data_), bytes));
  capacity_ = bytes;
  return absl::OkStatus();
}

absl::Status DecodeScatter(const codec::ChunkHeader& header, const uint8_t* chunk,
                           const PagedKvLayout& cache, const BlockSpan& blocks,
                           LayerRange layers, HostStaging& staging, cudaStream_t stream,
                           PriorKernel prior, StagedRecords* staged) {
  if (staged != nullptr) *staged = StagedRecords{};
  KVTIER_ASSIGN_OR_RETURN(CodecParams p, PrepareDecode(header, chunk, cache, blocks, layers));
  KVTIER_ASSIGN_OR_RETURN(const HostAddress host, HostAddressOf(chunk));
  // The bytes from layer b's K record to layer e - 1's V record: the K
  // records of layers [b, L) and the V records of layers [0, e).
  const uint64_t k_at = p.sec[0].offset, ks = p.sec[0].layer_stride;
  const uint64_t v_at = p.sec[1].offset, vs = p.sec[1].layer_stride;
  const uint64_t b = p.layer_begin, e = p.layer_end;
  const uint64_t first = k_at + b * ks, end = v_at + e * vs, own = (e - b) * (ks + vs);
  // What the decode writes into the cache. Where the chunk is small next to
  // it (two 4-bit sections: 0.27 of it), the decode from device memory after
  // the copy costs more than the copy saves, and the kernel reads the chunk
  // itself (H200, 256 tokens: INT4 0.85 staged vs 0.88; 8-bit formats 0.92
  // staged vs 0.89).
  uint64_t written = 0;
  for (const SectionArgs& a : p.sec) {
    written += (e - b) * p.num_tokens * p.cache.num_kv_heads * p.cache.head_dim *
               (a.mode == Mode::kPass8 ? 1 : 2);
  }
  if (host.host == nullptr || end - first > staging.capacity() || 3 * (end - first) > 4 * own ||
      8 * own < 3 * written) {
    return LaunchDecode(p, host.in_host, prior, stream);
  }
  KVTIER_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(staging.data(), host.host + first, end - first,
                                              cudaMemcpyHostToDevice, stream));
  p.chunk = staging.data();
  p.sec[0].offset = k_at - first;  // mod 2^64 (SectionArgs::offset)
  p.sec[1].offset = v_at - first;
  KVTIER_RETURN_IF_ERROR(Launch<DecodeK>(p, false, stream));
  if (staged != nullptr) {
    *staged = StagedRecords{staging.data(), staging.data() + (v_at + b * vs - first),
                            LayerRange{static_cast<uint32_t>(b), static_cast<uint32_t>(e)}};
  }
  return absl::OkStatus();
}

absl::Status DecodeStagedScatter(const codec::ChunkHeader& header, const StagedRecords& records,
                                 const PagedKvLayout& cache, const BlockSpan& blocks,
                                 cudaStream_t stream) {
  if (records.k_records == nullptr || records.v_records == nullptr || records.chunks != 1) {
    return absl::InvalidArgumentError("staged records of one chunk, K and V, are needed");
  }
  KVTIER_ASSIGN_OR_RETURN(CodecParams p, PrepareDecode(header, records.k_records, cache, blocks,
                                                       records.layers));
  // Layer l's record at chunk + offset + l * stride (mod 2^64, SectionArgs::offset).
  const uint64_t b = p.layer_begin;
  p.sec[0].offset = 0 - b * p.sec[0].layer_stride;
  p.sec[1].offset = static_cast<uint64_t>(records.v_records - records.k_records) -
                    b * p.sec[1].layer_stride;
  return Launch<DecodeK>(p, false, stream);
}

absl::Status ValidateDecodeScatter(const codec::ChunkHeader& header, const uint8_t* chunk,
                                   const PagedKvLayout& cache, const BlockSpan& blocks,
                                   LayerRange layers) {
  return PrepareDecode(header, chunk, cache, blocks, layers).status();
}

}  // namespace kvtier::kernels
