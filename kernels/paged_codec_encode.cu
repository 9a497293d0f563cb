// Gather+encode: the kernels and GatherEncode (paged_codec.h).
#include <cstring>

#include "common/status.h"
#include "kernels/cuda_status.h"
#include "kernels/device_numeric.cuh"
#include "kernels/paged_codec.h"
#include "kernels/paged_codec_internal.cuh"

namespace kvtier::kernels {
namespace codec_internal {
namespace {

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

// codec::QuantizeInt, with the division spelled as IEEE round-to-nearest.
__device__ __forceinline__ int32_t QuantizeIntDevice(float x, float scale, int32_t qmax) {
  const uint32_t a = __float_as_uint(x) & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return 0;
  if (a == 0x7F800000u) return (__float_as_uint(x) >> 31) ? -qmax : qmax;
  const float q = __fdiv_rn(x, scale);
  if (q >= static_cast<float>(qmax)) return qmax;
  if (q <= -static_cast<float>(qmax)) return -qmax;
  return __float2int_rn(q);
}

// Codes of the 8 16-bit elements of `v`, as the chunk stores them: FP8 and
// INT8 one byte each (x, y), INT4 packed two a byte, element 2i in the low
// nibble of byte i (x only).
template <DType QT>
__device__ __forceinline__ uint2 QuantizeVec(const uint4& v, float scale, bool bf16) {
  static_assert(QT == DType::kFP8E4M3 || QT == DType::kINT8 || QT == DType::kINT4,
                "a quantized chunk format");
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
  uint32_t out[2] = {0, 0};
#pragma unroll
  for (int e = 0; e < kVecElems; ++e) {
    const uint32_t bits = (w[e / 2] >> (16 * (e % 2))) & 0xFFFFu;
    const float x = codec::Load16(bits, bf16 ? DType::kBF16 : DType::kFP16);
    if constexpr (QT == DType::kFP8E4M3) {
      out[e / 4] |= uint32_t{QuantizeFp8Device(x, scale)} << (8 * (e % 4));
    } else if constexpr (QT == DType::kINT8) {
      out[e / 4] |= (static_cast<uint32_t>(QuantizeIntDevice(x, scale, 127)) & 0xFFu) << (8 * (e % 4));
    } else {
      out[0] |= (static_cast<uint32_t>(QuantizeIntDevice(x, scale, 7)) & 0xFu) << (4 * e);
    }
  }
  return make_uint2(out[0], out[1]);
}

// ---- Fast path of the general encode (kQuant sections) ----
//
// Per element, the exact path above costs an IEEE division (__fdiv_rn: MUFU
// reciprocal, Newton steps, a range check and a slow-path call) and four
// branches. The fast path divides with one correction step from the group's
// reciprocal r = __frcp_rn(s) (Markstein): q0 = x * r, q = fma(fma(-q0, s,
// x), r, q0), and rounds INT codes by adding 1.5 * 2^23 (nearest even for
// |q| < 2^22), without a clamp (|x| <= amax keeps RNE(q) within qmax). It
// runs only where it is proven to give the codec's bytes: vectors without
// NaN / inf, in groups whose amax >= FastMinAmax. The proof is exhaustive, on
// the host, over every 16-bit amax and every 16-bit x with |x| <= amax, for
// BF16 and FP16 and each quantized format (`kernel_codec_bench
// --check-division`, which repeats these formulas): every code equals
// codec::QuantizeInt / codec::QuantizeFp8 of x / scale (6.4e9 pairs, 0
// mismatches). Below the BF16 bound the residual underflows and codes do
// differ (largest such amax: BF16 0x0B2A, about 2^-104.6, for FP8; 0x04EF for
// INT8); FP16 needs no bound.
__device__ __forceinline__ float FastMinAmax(bool bf16) {
  return bf16 ? 0x1p-103f : 0.0f;  // BF16 bits 0x0C00
}

// |x| bits of a NaN or infinity of the 16-bit dtype and above.
__device__ __forceinline__ uint32_t InfAbsBits(bool bf16) { return bf16 ? 0x7F80u : 0x7C00u; }

__device__ __forceinline__ uint32_t MaxU16x2(uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  uint32_t r;
  asm("max.u16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
#else
  return __vmaxu2(a, b);
#endif
}

// Largest |x| of the 8 elements of `v` as 16-bit magnitude bits (for BF16
// and FP16 the unsigned order of those bits is the order of |x|), NaN and
// inf included: the result is >= InfAbsBits exactly when `v` holds one.
__device__ __forceinline__ uint32_t AbsBitsMax(const uint4& v) {
  constexpr uint32_t kAbs = 0x7FFF7FFFu;
  const uint32_t m = MaxU16x2(MaxU16x2(v.x & kAbs, v.y & kAbs), MaxU16x2(v.z & kAbs, v.w & kAbs));
  return max(m & 0xFFFFu, m >> 16);
}

// The same over the finite elements only: the bits of the max of
// codec::AmaxTerm (Load16 of these bits is that float, exactly).
__device__ __forceinline__ uint32_t FiniteAbsBitsMax(const uint4& v, uint32_t inf_bits) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
  uint32_t m = 0;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const uint32_t a = (w[i / 2] >> (16 * (i % 2))) & 0x7FFFu;
    if (a < inf_bits) m = max(m, a);
  }
  return m;
}

// Max over the CTA of two packed 16-bit values. REQUIRES: every thread calls it.
__device__ __forceinline__ uint32_t BlockMaxU16x2(uint32_t v, uint32_t* smem) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = MaxU16x2(v, __shfl_xor_sync(0xffffffffu, v, o));
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();  // smem may still be read by a previous call
  if (lane == 0) smem[warp] = v;
  __syncthreads();
  uint32_t m = smem[0];
#pragma unroll
  for (int w = 1; w < kThreads / 32; ++w) m = MaxU16x2(m, smem[w]);
  return m;
}

// One 8-byte store per lane. Left to itself, nvcc split the code stores of
// the three formats into 4-byte halves where their branches join: L2 merges
// those in device memory, but into mapped pinned memory every half went over
// PCIe as a partial write (encode to pinned fell to 0.05 of a memcpy).
__device__ __forceinline__ void StoreU2(uint8_t* p, uint2 v) {
  asm volatile("st.global.v2.u32 [%0], {%1, %2};" ::"l"(p), "r"(v.x), "r"(v.y) : "memory");
}

// x / scale as __fdiv_rn rounds it, where the fast-path rule above holds.
__device__ __forceinline__ float DivByScale(float x, float scale, float rcp) {
  const float q0 = __fmul_rn(x, rcp);
  return __fmaf_rn(__fmaf_rn(-q0, scale, x), rcp, q0);
}

// QuantizeVec of a vector without NaN / inf whose group passed FastMinAmax.
template <DType QT, bool kBf16>
__device__ __forceinline__ uint2 QuantizeVecFast(const uint4& v, float scale, float rcp) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
  float q[kVecElems];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float2 x;
    if constexpr (kBf16) {
      x = make_float2(__uint_as_float(w[i] << 16), __uint_as_float(w[i] & 0xFFFF0000u));
    } else {
      x = __half22float2(*reinterpret_cast<const __half2*>(&w[i]));
    }
    q[2 * i] = DivByScale(x.x, scale, rcp);
    q[2 * i + 1] = DivByScale(x.y, scale, rcp);
    if constexpr (QT == DType::kFP8E4M3) {
      // A zero quotient takes x's sign, as x / scale does (scale > 0).
      q[2 * i] = __uint_as_float(__float_as_uint(q[2 * i]) | (__float_as_uint(x.x) & 0x80000000u));
      q[2 * i + 1] =
          __uint_as_float(__float_as_uint(q[2 * i + 1]) | (__float_as_uint(x.y) & 0x80000000u));
    }
  }
  if constexpr (QT == DType::kFP8E4M3) {
    uint32_t h[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
      h[i] = __nv_cvt_float2_to_fp8x2(make_float2(q[2 * i], q[2 * i + 1]), __NV_SATFINITE, __NV_E4M3);
#else
      h[i] = uint32_t{codec::FloatToFp8E4M3(q[2 * i])} |
             uint32_t{codec::FloatToFp8E4M3(q[2 * i + 1])} << 8;
#endif
    }
    return make_uint2(h[0] | h[1] << 16, h[2] | h[3] << 16);
  } else {
    // RNE to an integer: 1.5 * 2^23 + k has the bits 0x4B400000 + k for
    // |k| < 2^22, so the low byte (nibble) is k's two's complement.
    uint32_t c[kVecElems];
#pragma unroll
    for (int e = 0; e < kVecElems; ++e) c[e] = __float_as_uint(__fadd_rn(q[e], 12582912.0f));
    if constexpr (QT == DType::kINT8) {
      return make_uint2(
          __byte_perm(__byte_perm(c[0], c[1], 0x0040), __byte_perm(c[2], c[3], 0x0040), 0x5410),
          __byte_perm(__byte_perm(c[4], c[5], 0x0040), __byte_perm(c[6], c[7], 0x0040), 0x5410));
    } else {
      uint32_t out = 0;
#pragma unroll
      for (int e = 0; e < kVecElems; ++e) out |= (c[e] & 0xFu) << (4 * e);
      return make_uint2(out, 0);
    }
  }
}

// Zeroes the padding of one layer record of one section.
__device__ void ZeroPadding(uint8_t* layer, const SectionArgs& s) {
  for (uint64_t i = s.payload + threadIdx.x; i < s.data_bytes; i += kThreads) layer[i] = 0;
  for (uint64_t i = s.scale_count * 4 + threadIdx.x; i < s.scale_bytes; i += kThreads) {
    layer[s.data_bytes + i] = 0;
  }
}

// Encodes the kQuant sections of the CTA's tile (general kernels): the
// scales by each section's granularity, the codes, and the scale slots the
// CTA owns. Group amaxes are taken on 16-bit magnitude bits, K in the low and
// V in the high half of one word, so one reduction serves both sections:
// per-(token, head) over the kVecsPerRow consecutive lanes of a row
// (shuffles), per-(block, head) over the CTA. A group holding NaN / inf is
// reduced again over its finite elements (the codec's amax). Vectors go
// through QuantizeVecFast where proven, else the exact QuantizeVec. Codes
// and per-(token, head) scales go to `stage` when p.staged (StoreStage stores
// them), else straight to the chunk, as the per-(block, head) and
// per-tensor scales.
// Returns whether a kQuant section of the tile holds a NaN or inf.
// REQUIRES: called by every thread of the CTA (block-wide reductions);
// `smem` is this head's (threadIdx.y's) reduction scratch.
template <int HD, int BS>
__device__ __forceinline__ bool EncodeQuantSections(
    const CodecParams& p, const uint4 (&data)[2][Tile<HD, BS>::kPerThread], uint32_t valid_mask,
    uint32_t t0, uint32_t H, uint32_t head, uint32_t cb, uint32_t layer, uint32_t* smem,
    const CodecStage<HD, BS>& stage) {
  using T = Tile<HD, BS>;
  static_assert(32 % T::kVecsPerRow == 0 && kThreads % T::kVecsPerRow == 0,
                "a token row must lie within one warp");
  const bool bf16 = p.bf16;
  const uint32_t inf_bits = InfAbsBits(bf16);
  bool quant[2], token[2], block[2];
#pragma unroll
  for (int s = 0; s < 2; ++s) {
    quant[s] = p.sec[s].mode == Mode::kQuant;
    token[s] = quant[s] && p.sec[s].gran == ScaleGranularity::kPerTokenHead;
    block[s] = quant[s] && p.sec[s].gran == ScaleGranularity::kPerBlockHead;
  }
  const uint32_t token_mask = (token[0] ? 0xFFFFu : 0u) | (token[1] ? 0xFFFF0000u : 0u);
  const uint32_t block_mask = (block[0] ? 0xFFFFu : 0u) | (block[1] ? 0xFFFF0000u : 0u);

  // Per vector, the magnitude bits of both sections (invalid vectors are 0).
  uint32_t vmax[T::kPerThread];
  bool non_finite = false;
#pragma unroll
  for (int i = 0; i < T::kPerThread; ++i) {
    const uint32_t k = quant[0] ? AbsBitsMax(data[0][i]) : 0u;
    const uint32_t v = quant[1] ? AbsBitsMax(data[1][i]) : 0u;
    non_finite |= max(k, v) >= inf_bits;
    vmax[i] = k | v << 16;
  }
  // Group amaxes exclude NaN / inf: if the reduction may see one, reduce the
  // finite values instead (uniform over the CTA, or the warp for rows).
  const bool any_block = block_mask != 0;
  const bool refine = any_block ? __syncthreads_or(non_finite) : __any_sync(0xffffffffu, non_finite);
  uint32_t gmax[T::kPerThread];
#pragma unroll
  for (int i = 0; i < T::kPerThread; ++i) {
    gmax[i] = vmax[i];
    if (refine) {
      gmax[i] = (quant[0] ? FiniteAbsBitsMax(data[0][i], inf_bits) : 0u) |
                (quant[1] ? FiniteAbsBitsMax(data[1][i], inf_bits) : 0u) << 16;
    }
  }
  uint32_t row[T::kPerThread];
  if (token_mask != 0) {
#pragma unroll
    for (int i = 0; i < T::kPerThread; ++i) {
      uint32_t a = gmax[i] & token_mask;
#pragma unroll
      for (int o = T::kVecsPerRow / 2; o > 0; o >>= 1) {
        a = MaxU16x2(a, __shfl_xor_sync(0xffffffffu, a, o));
      }
      row[i] = a;
    }
  }
  uint32_t blk = 0;
  if (any_block) {
#pragma unroll
    for (int i = 0; i < T::kPerThread; ++i) blk = MaxU16x2(blk, gmax[i] & block_mask);
    blk = BlockMaxU16x2(blk, smem);
  }

  const DType dt = bf16 ? DType::kBF16 : DType::kFP16;
  const float min_fast = FastMinAmax(bf16);
#pragma unroll
  for (int s = 0; s < 2; ++s) {
    if (!quant[s]) continue;
    const SectionArgs& sa = p.sec[s];
    uint8_t* layer_base = sa.LayerBase(p.chunk, layer);
    float* scales = reinterpret_cast<float*>(layer_base + sa.data_bytes);
    const float qmax = codec::QMax(sa.qdtype);
    // Written by LayerAmaxKernel earlier on the stream; cleared by this
    // kernel's last CTA, so read through L2, not the read-only path.
    float group_amax = 0.0f;
    if (sa.gran == ScaleGranularity::kPerTensor) {
      group_amax = __uint_as_float(__ldcg(p.workspace + kWsAmax + 2 * layer + s));
    } else if (block[s]) {
      group_amax = codec::Load16(static_cast<uint16_t>(blk >> (16 * s)), dt);
    }
    float group_scale = 1.0f, group_rcp = 1.0f;
    if (!token[s]) {
      group_scale = group_amax > 0.0f ? __fdiv_rn(group_amax, qmax) : 1.0f;
      group_rcp = __frcp_rn(group_scale);
    }
#pragma unroll
    for (int i = 0; i < T::kPerThread; ++i) {
      if (!(valid_mask >> i & 1u)) continue;
      float amax = group_amax, scale = group_scale, rcp = group_rcp;
      if (token[s]) {
        amax = codec::Load16(static_cast<uint16_t>(row[i] >> (16 * s)), dt);
        scale = amax > 0.0f ? __fdiv_rn(amax, qmax) : 1.0f;
        rcp = __frcp_rn(scale);
      }
      const bool fast = ((vmax[i] >> (16 * s)) & 0xFFFFu) < inf_bits && amax >= min_fast;
      const int v = threadIdx.x + i * kThreads;
      const uint32_t t = v / T::kVecsPerRow;
      // Element index in the stage ([token][head in the CTA][dim]) or chunk.
      uint8_t* const dst = p.staged ? stage.codes(s) : layer_base;
      const uint64_t idx =
          p.staged ? (t * p.heads_per_cta + threadIdx.y) * HD + (v % T::kVecsPerRow) * kVecElems
                   : T::ChunkIndex(t0, v, H, head);
      if (sa.qdtype == DType::kINT4) {
        static_assert(kVecElems % 8 == 0, "INT4 vectors are whole 4-byte words");
        const uint2 q = !fast ? QuantizeVec<DType::kINT4>(data[s][i], scale, bf16)
                        : bf16 ? QuantizeVecFast<DType::kINT4, true>(data[s][i], scale, rcp)
                               : QuantizeVecFast<DType::kINT4, false>(data[s][i], scale, rcp);
        *reinterpret_cast<uint32_t*>(dst + idx / 2) = q.x;
      } else {
        uint2 q;
        if (sa.qdtype == DType::kINT8) {
          q = !fast ? QuantizeVec<DType::kINT8>(data[s][i], scale, bf16)
              : bf16 ? QuantizeVecFast<DType::kINT8, true>(data[s][i], scale, rcp)
                     : QuantizeVecFast<DType::kINT8, false>(data[s][i], scale, rcp);
        } else {
          q = !fast ? QuantizeVec<DType::kFP8E4M3>(data[s][i], scale, bf16)
              : bf16 ? QuantizeVecFast<DType::kFP8E4M3, true>(data[s][i], scale, rcp)
                     : QuantizeVecFast<DType::kFP8E4M3, false>(data[s][i], scale, rcp);
        }
        if (p.staged) {
          *reinterpret_cast<uint2*>(dst + idx) = q;
        } else {
          StoreU2(dst + idx, q);
        }
      }
      if (token[s] && v % T::kVecsPerRow == 0) {
        if (p.staged) {
          stage.scales(s)[t * p.heads_per_cta + threadIdx.y] = scale;
        } else {
          scales[uint64_t{t0 + t} * H + head] = scale;
        }
      }
    }
    if (threadIdx.x == 0) {
      if (block[s]) {
        scales[uint64_t{cb} * H + head] = group_scale;
      } else if (sa.gran == ScaleGranularity::kPerTensor && blockIdx.x == 0 && threadIdx.y == 0) {
        scales[0] = group_scale;
      }
    }
  }
  return non_finite;
}

// Stores the kQuant sections' codes and per-(token, head) scales of tokens
// [t0, t0 + nt) and the CTA's heads [h0, h0 + heads_per_cta) from the stage
// to the chunk. Each token's codes are one run of 16-byte vectors
// (consecutive threads, consecutive addresses), its scales one run of floats.
// REQUIRES: the stage is complete (a barrier after EncodeQuantSections).
template <int HD, int BS>
__device__ __forceinline__ void StoreStage(const CodecParams& p, const CodecStage<HD, BS>& stage,
                                           uint32_t t0, uint32_t nt, uint32_t H, uint32_t h0,
                                           uint32_t layer) {
  const uint32_t g = p.heads_per_cta;
  const uint32_t tid = threadIdx.y * kThreads + threadIdx.x, stride = kThreads * g;
#pragma unroll
  for (int s = 0; s < 2; ++s) {
    const SectionArgs& sa = p.sec[s];
    if (sa.mode != Mode::kQuant) continue;
    uint8_t* layer_base = sa.LayerBase(p.chunk, layer);
    const uint32_t bits = sa.qdtype == DType::kINT4 ? 4 : 8;
    const uint32_t row_bytes = g * HD * bits / 8;  // a token's codes of the CTA's heads
    static_assert(HD * 4 / 8 % 16 == 0, "an INT4 row is whole 16-byte vectors");
    const uint32_t row_vecs = row_bytes / 16;
    for (uint32_t i = tid; i < nt * row_vecs; i += stride) {
      const uint32_t t = i / row_vecs, o = i % row_vecs;
      *reinterpret_cast<uint4*>(layer_base + (uint64_t{t0 + t} * H + h0) * HD * bits / 8 +
                                o * 16) =
          *reinterpret_cast<const uint4*>(stage.codes(s) + t * row_bytes + o * 16);
    }
    if (sa.gran == ScaleGranularity::kPerTokenHead) {
      float* scales = sa.LayerScales(p.chunk, layer);
      // All heads (g == H): the tokens' scales are one contiguous run, moved
      // in 16-byte vectors where it is 16-byte aligned (4-byte accesses make
      // four times the PCIe requests for a chunk in host memory).
      float* run = scales + uint64_t{t0} * H;
      if (g == H && (nt * g) % 4 == 0 && reinterpret_cast<uintptr_t>(run) % 16 == 0) {
        for (uint32_t i = tid; i < nt * g / 4; i += stride) {
          reinterpret_cast<uint4*>(run)[i] = reinterpret_cast<const uint4*>(stage.scales(s))[i];
        }
        continue;
      }
      for (uint32_t i = tid; i < nt * g; i += stride) {
        scales[uint64_t{t0 + i / g} * H + h0 + i % g] = stage.scales(s)[i];
      }
    }
  }
}

// Pre-pass of launches with a per-tensor section: each CTA reduces its tile
// of every such section and folds it into the layer's workspace word with
// atomicMax on the bits (an amax is >= +0, where the unsigned order of the
// bits is the float order). Same grid as GatherEncodeKernel.
template <int HD, int BS>
__global__ void __launch_bounds__(kThreads)
    LayerAmaxKernel(const __grid_constant__ CodecParams p) {
  using T = Tile<HD, BS>;
  __shared__ uint32_t smem[kThreads / 32];
  const PagedKvLayout& c = p.cache;
  const auto [H, head, cb, layer, t0, nt] = T::Here(p);
#pragma unroll
  for (int s = 0; s < 2; ++s) {
    if (p.sec[s].mode != Mode::kQuant || p.sec[s].gran != ScaleGranularity::kPerTensor) continue;
    const uint16_t* base = static_cast<const uint16_t*>(s == 0 ? c.k_layers[layer] : c.v_layers[layer]);
    uint4 data[T::kPerThread];
#pragma unroll
    for (int i = 0; i < T::kPerThread; ++i) {
      const int v = threadIdx.x + i * kThreads;
      const uint32_t t = v / T::kVecsPerRow;
      const uint32_t d = (v % T::kVecsPerRow) * kVecElems;
      data[i] = make_uint4(0, 0, 0, 0);
      if (v < T::kVecs && t < nt) {
        const uint2 bs = T::CacheSlot(p.block_ids, p.first_slot, t0 + t);
        const int64_t e = s == 0 ? c.k_elem(bs.x, bs.y, head, d) : c.v_elem(bs.x, bs.y, head, d);
        data[i] = __ldg(reinterpret_cast<const uint4*>(base + e));
      }
    }
    // Magnitude bits, as EncodeQuantSections; NaN / inf excluded.
    const uint32_t inf_bits = InfAbsBits(p.bf16);
    uint32_t m = 0;
#pragma unroll
    for (int i = 0; i < T::kPerThread; ++i) m = max(m, AbsBitsMax(data[i]));
    if (__syncthreads_or(m >= inf_bits)) {
      m = 0;
#pragma unroll
      for (int i = 0; i < T::kPerThread; ++i) m = max(m, FiniteAbsBitsMax(data[i], inf_bits));
    }
    m = BlockMaxU16x2(m, smem);
    const float a = codec::Load16(static_cast<uint16_t>(m), p.bf16 ? DType::kBF16 : DType::kFP16);
    if (threadIdx.x == 0 && a > 0.0f) {
      atomicMax(p.workspace + kWsAmax + 2 * layer + s, __float_as_uint(a));
    }
  }
}

// The general kernels run kThreads x heads_per_cta threads a CTA (at most
// kMaxHeadsPerCta heads); the fast ones kThreads (one head). The general ones
// take CodecStage::Bytes(heads_per_cta) of dynamic shared memory.
template <int HD, int BS, bool kGeneral>
__global__ void __launch_bounds__(kThreads * (kGeneral ? kMaxHeadsPerCta<HD, BS> : 1))
    GatherEncodeKernel(const __grid_constant__ CodecParams p) {
  using T = Tile<HD, BS>;
  __shared__ uint32_t smem_heads[kGeneral ? kMaxHeadsPerCta<HD, BS> : 1][kThreads / 32];
  extern __shared__ __align__(16) uint8_t stage_smem[];
  const CodecStage<HD, BS> stage{stage_smem, p.heads_per_cta};
  uint32_t* smem = smem_heads[threadIdx.y];
  const PagedKvLayout& c = p.cache;
  const auto [H, head, cb, layer, t0, nt] = T::Here(p);

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
  const uint32_t inf_bits = InfAbsBits(p.bf16);
  if constexpr (kGeneral) {
    if (p.sec[0].mode == Mode::kQuant || p.sec[1].mode == Mode::kQuant) {
      non_finite =
          EncodeQuantSections<HD, BS>(p, data, valid_mask, t0, H, head, cb, layer, smem, stage);
      if (p.staged) {
        __syncthreads();
        StoreStage<HD, BS>(p, stage, t0, nt, H, head - threadIdx.y, layer);
      }
    }
  }
#pragma unroll
  for (int s = 0; s < 2; ++s) {
    const SectionArgs& sa = p.sec[s];
    uint8_t* layer_base = sa.LayerBase(p.chunk, layer);
    if (sa.mode == Mode::kCopy16) {
#pragma unroll
      for (int i = 0; i < T::kPerThread; ++i) {
        if (!(valid_mask >> i & 1u)) continue;
        const int v = threadIdx.x + i * kThreads;
        const uint64_t idx = T::ChunkIndex(t0, v, H, head);
        non_finite |= AbsBitsMax(data[s][i]) >= inf_bits;
        *reinterpret_cast<uint4*>(layer_base + idx * 2) = data[s][i];
      }
    } else if (sa.mode == Mode::kFp8) {
      // The group amax on magnitude bits (EncodeQuantSections' way), over the
      // finite elements when the tile holds a NaN / inf; codes through the
      // proven fast division where it holds (QuantizeVecFast), else exact.
      uint32_t vmax[T::kPerThread];
      uint32_t m = 0;
      bool nf = false;
#pragma unroll
      for (int i = 0; i < T::kPerThread; ++i) {
        vmax[i] = (valid_mask >> i & 1u) ? AbsBitsMax(data[s][i]) : 0u;
        nf |= vmax[i] >= inf_bits;
        m = max(m, vmax[i]);
      }
      non_finite |= nf;
      if (__syncthreads_or(nf)) {
        m = 0;
#pragma unroll
        for (int i = 0; i < T::kPerThread; ++i) {
          if (valid_mask >> i & 1u) m = max(m, FiniteAbsBitsMax(data[s][i], inf_bits));
        }
      }
      m = BlockMaxU16x2(m, smem) & 0xFFFFu;
      const float amax = codec::Load16(static_cast<uint16_t>(m), p.bf16 ? DType::kBF16 : DType::kFP16);
      const float scale = amax > 0.0f ? __fdiv_rn(amax, codec::kFp8Max) : 1.0f;
      const float rcp = __frcp_rn(scale);
      const bool fast_group = amax >= FastMinAmax(p.bf16);
#pragma unroll
      for (int i = 0; i < T::kPerThread; ++i) {
        if (!(valid_mask >> i & 1u)) continue;
        const int v = threadIdx.x + i * kThreads;
        const uint64_t idx = T::ChunkIndex(t0, v, H, head);
        const uint2 q = !(fast_group && vmax[i] < inf_bits)
                            ? QuantizeVec<DType::kFP8E4M3>(data[s][i], scale, p.bf16)
                        : p.bf16 ? QuantizeVecFast<DType::kFP8E4M3, true>(data[s][i], scale, rcp)
                                 : QuantizeVecFast<DType::kFP8E4M3, false>(data[s][i], scale, rcp);
        StoreU2(layer_base + idx, q);
      }
      if (threadIdx.x == 0) {
        reinterpret_cast<float*>(layer_base + sa.data_bytes)[uint64_t{cb} * H + head] = scale;
      }
    } else if (kGeneral && sa.mode == Mode::kQuant) {
      // Encoded by EncodeQuantSections above.
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
    if (blockIdx.x == 0 && threadIdx.y == 0) ZeroPadding(layer_base, sa);
  }

  // The last CTA to finish writes the header with the OR of every CTA's
  // non-finite flag (and, for a launch after the one of layer 0, the flag
  // that earlier launches left in the header), and leaves the workspace zero
  // for the next launch.
  non_finite = __syncthreads_or(non_finite);
  bool last = false;
  if (threadIdx.x == 0 && threadIdx.y == 0) {
    if (non_finite) atomicOr(p.workspace + kWsFlags, 1u);
    __threadfence();
    const uint32_t total = gridDim.x * gridDim.y;
    last = atomicAdd(p.workspace + kWsCount, 1u) == total - 1;
    if (last) {
      const uint32_t flags = atomicExch(p.workspace + kWsFlags, 0u) != 0 ? codec::kFlagNonFinite : 0u;
      atomicExch(p.workspace + kWsCount, 0u);
      uint4* dst = reinterpret_cast<uint4*>(p.chunk);
      if (p.layer_begin == 0) {
        Header128 h = p.header;
        h.w[3].x |= flags << 16;
#pragma unroll
        for (int i = 0; i < 8; ++i) dst[i] = h.w[i];
      } else if (flags != 0) {
        volatile uint32_t* w = reinterpret_cast<volatile uint32_t*>(p.chunk) + codec::kOffFlags / 4;
        *w = *w | (flags << 16);
      }
    }
  }
  if constexpr (kGeneral) {
    // The last CTA also clears the per-layer amax words: every other CTA
    // read them before it counted itself.
    if (p.tensor_amax && __syncthreads_or(last) && threadIdx.y == 0) {
      __threadfence();
      for (uint32_t i = threadIdx.x; i < 2 * gridDim.y; i += kThreads) {
        p.workspace[kWsAmax + 2 * p.layer_begin + i] = 0;
      }
    }
  }
}

template <int HD, int BS>
struct EncodeK {
  static constexpr KernelFn fast = GatherEncodeKernel<HD, BS, false>;
  static constexpr KernelFn general = GatherEncodeKernel<HD, BS, true>;
};
template <int HD, int BS>
struct AmaxK {
  static constexpr KernelFn fast = LayerAmaxKernel<HD, BS>;
  static constexpr KernelFn general = LayerAmaxKernel<HD, BS>;
};

// GatherEncode's checks; fills the launch parameters.
absl::StatusOr<CodecParams> PrepareEncode(const codec::ChunkSpec& spec_in,
                                          const PagedKvLayout& cache, const BlockSpan& blocks,
                                          LayerRange layers, uint8_t* dst, uint32_t* workspace) {
  KVTIER_ASSIGN_OR_RETURN(codec::ChunkLayout layout, codec::ValidateSpec(spec_in));
  KVTIER_ASSIGN_OR_RETURN(CodecParams p, Prepare(spec_in, layout, cache, blocks, layers, dst));
  if (workspace == nullptr) return absl::InvalidArgumentError("workspace is null");
  codec::ChunkSpec spec = spec_in;
  spec.flags = 0;
  uint8_t header[codec::kHeaderSize];
  codec::WriteHeader(spec, layout, 0, 0, header);
  std::memset(header + codec::kOffHeaderChecksum, 0, 8);  // SealChunk computes it
  std::memcpy(&p.header, header, sizeof(header));
  p.chunk = dst;
  p.workspace = workspace;
  return p;
}

}  // namespace
}  // namespace codec_internal

using codec_internal::AmaxK;
using codec_internal::CodecParams;
using codec_internal::EncodeK;
using codec_internal::IsHostMemory;
using codec_internal::Launch;
using codec_internal::NeedsGeneral;
using codec_internal::PrepareEncode;

absl::Status GatherEncode(const codec::ChunkSpec& spec, const PagedKvLayout& cache,
                          const BlockSpan& blocks, uint8_t* dst, uint32_t* workspace,
                          cudaStream_t stream) {
  return GatherEncode(spec, cache, blocks, LayerRange{}, dst, workspace, stream);
}

absl::Status GatherEncode(const codec::ChunkSpec& spec, const PagedKvLayout& cache,
                          const BlockSpan& blocks, LayerRange layers, uint8_t* dst,
                          uint32_t* workspace, cudaStream_t stream) {
  KVTIER_ASSIGN_OR_RETURN(CodecParams p,
                          PrepareEncode(spec, cache, blocks, layers, dst, workspace));
  bool host_chunk = false;
  if (NeedsGeneral(p)) {
    KVTIER_ASSIGN_OR_RETURN(host_chunk, IsHostMemory(p.chunk));
  }
  if (p.tensor_amax) KVTIER_RETURN_IF_ERROR(Launch<AmaxK>(p, false, stream));
  return Launch<EncodeK>(p, host_chunk, stream);
}

absl::Status ValidateGatherEncode(const codec::ChunkSpec& spec, const PagedKvLayout& cache,
                                  const BlockSpan& blocks, const uint8_t* dst,
                                  const uint32_t* workspace, LayerRange layers) {
  // The kernels write through these pointers, but nothing is launched here.
  return PrepareEncode(spec, cache, blocks, layers, const_cast<uint8_t*>(dst),
                       const_cast<uint32_t*>(workspace))
      .status();
}

}  // namespace kvtier::kernels
