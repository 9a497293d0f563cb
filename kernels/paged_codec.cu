#include "kernels/paged_codec.h"

#include <algorithm>
#include <atomic>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "kernels/cuda_status.h"
#include "kernels/device_copy.cuh"
#include "kernels/device_numeric.cuh"
#include "kernels/dispatch.h"

namespace kvtier::kernels {
namespace {

using codec::DType;
using codec::ScaleGranularity;

constexpr int kThreads = 128;
constexpr int kVecElems = 8;  // one 16-byte vector of 16-bit elements, 8 bytes of FP8 codes

// What a kernel does with one section (K or V).
enum class Mode : uint32_t {
  kCopy16 = 0,  // 16-bit cache <-> native chunk section, bit for bit
  kFp8 = 1,     // 16-bit cache <-> FP8 chunk section with per-(block, head) scales
  kPass8 = 2,   // FP8 cache <-> FP8 chunk section: codes and scales copied
  kQuant = 3,   // 16-bit cache <-> FP8 / INT8 / INT4 section, any granularity (general kernels)
};

// Launches with a kQuant section run the general instantiations of the
// kernels (kGeneral = true); the others run the fast ones, whose code is that
// of the three modes above only.
struct SectionArgs {
  Mode mode;
  DType qdtype;                 // kQuant: kFP8E4M3, kINT8 or kINT4
  ScaleGranularity gran;        // the section's scales (kNone: 16-bit; kFp8 / kPass8: block-head)
  // Layer 0's record, from `chunk` (mod 2^64: a HostStaging buffer holds
  // the bytes from layer_begin's K record on, so this may "precede" it).
  uint64_t offset;
  uint64_t layer_stride;  // bytes per layer record
  uint64_t data_bytes;    // per layer, padded
  uint64_t payload;       // per layer, unpadded data bytes
  uint64_t scale_count;   // per layer
  uint64_t scale_bytes;   // per layer, padded

  // Layer `layer`'s record of the section in `chunk`: codes, then scales.
  __device__ uint8_t* LayerBase(uint8_t* chunk, uint32_t layer) const {
    return chunk + (offset + layer_stride * layer);
  }
  __device__ float* LayerScales(uint8_t* chunk, uint32_t layer) const {
    return reinterpret_cast<float*>(LayerBase(chunk, layer) + data_bytes);
  }
};

// One buffer of DecodeFromHostKernel's stage, as byte offsets in it: for
// each section the codes ([token][head in the CTA][a head's row of codes],
// row_bytes per row), its per-(token, head) scales ([token][head in the
// CTA]) and its group scales (per-tensor: one; per-(block, head): one per
// head in the CTA). Every offset is a multiple of 16.
struct HostStage {
  uint32_t codes[2];
  uint32_t row_bytes[2];
  uint32_t token_scales[2];
  uint32_t group[2];
  uint32_t bytes;  // the buffer
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
  uint32_t layer_begin;          // first layer of the launch (grid y = layer - layer_begin)
  uint32_t heads_per_cta;        // kv heads of one CTA (blockDim.y; divides num_kv_heads)
  bool staged;                   // general encode: kQuant sections go through a CodecStage
  uint32_t layer_end;
  bool bf16;                     // the chunk dtype
  SectionArgs sec[2];            // K, V
  uint8_t* chunk;                // encode: destination; decode: source
  uint32_t* workspace;           // encode only
  bool tensor_amax;              // encode: a kQuant per-tensor section (amax pre-pass ran)
  Header128 header;              // encode only: the header with flags and checksums 0
  HostStage host_stage;          // DecodeFromHostKernel only
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
  // This thread's tile (grid x = chunk block * (kv heads / G) + head group,
  // y = layer - layer_begin; G = heads_per_cta kv heads per CTA, threadIdx.y
  // the head within the group):
  // kv heads H, kv head, chunk block, layer, first chunk token, tokens.
  struct Coords {
    uint32_t H, head, cb, layer, t0, nt;
  };
  static __device__ __forceinline__ Coords Here(const CodecParams& p) {
    return At(p, blockIdx.x, blockIdx.y);
  }
  // The same for the tile at grid position (x, y).
  static __device__ __forceinline__ Coords At(const CodecParams& p, uint32_t x, uint32_t y) {
    const uint32_t H = p.cache.num_kv_heads, groups = H / p.heads_per_cta;
    const uint32_t cb = x / groups, t0 = cb * BS;
    return {H, (x % groups) * p.heads_per_cta + threadIdx.y, cb, p.layer_begin + y, t0,
            min(static_cast<uint32_t>(BS), p.num_tokens - t0)};
  }
  // Cache block (x) and slot (y) of chunk token `token` (BlockSpan's map).
  static __device__ __forceinline__ uint2 CacheSlot(const int32_t* block_ids, uint32_t first_slot,
                                                    uint32_t token) {
    return make_uint2(static_cast<uint32_t>(__ldg(block_ids + (first_slot + token) / BS)),
                      (first_slot + token) % BS);
  }
};

// Workspace words (kGatherEncodeWorkspaceBytes): the OR of the non-finite
// flags, the count of finished CTAs, then the amax bits of layer l, section s
// at kWsAmax + 2 * l + s.
constexpr int kWsFlags = 0;
constexpr int kWsCount = 1;
constexpr int kWsAmax = 2;
static_assert(kGatherEncodeWorkspaceBytes == 4 * (kWsAmax + 2 * size_t{codec::kMaxLayers}),
              "the workspace holds the two counters and a K and a V amax per layer");

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

// Kernels with a chunk in host memory (mapped pinned): the general encode
// and every decode. A CTA serves up to kMaxHeadsPerCta kv heads of a chunk
// block (threadIdx.y = head), and the codes and per-(token, head) scales go
// through a stage in shared memory, moved between stage and chunk in 16-byte
// vectors by consecutive threads (StoreStage, LoadHostTile): they are runs
// of whole heads x tokens in the chunk ([token][kv_head] order), so full
// PCIe lines instead of a 4-byte access per scale and half-line INT4 rows.
// With a chunk in device memory a CTA serves one head and accesses the chunk
// directly (more, smaller CTAs without the stage's barrier hide HBM latency
// better). kMaxHeadsPerCta keeps a section's staged 8-bit codes within 16 KiB.
template <int HD, int BS>
inline constexpr int kMaxHeadsPerCta = 16384 / (BS * HD) >= 8 ? 8
                                       : 16384 / (BS * HD) >= 1 ? 16384 / (BS * HD) : 1;

// Kv heads of a CTA with a chunk in host memory: the most, up to
// kMaxHeadsPerCta, that divide the `kv_heads`.
template <int HD, int BS>
uint32_t HostHeadsPerCta(uint32_t kv_heads) {
  uint32_t g = std::min<uint32_t>(kMaxHeadsPerCta<HD, BS>, kv_heads);
  while (kv_heads % g != 0) --g;
  return g;
}

// The stage in dynamic shared memory of a CTA of `g` heads: codes
// [section][token][head in the CTA][code bytes of a row] (INT4 rows half as
// long), then scales [section][token][head in the CTA] (per-(token, head)).
template <int HD, int BS>
struct CodecStage {
  uint8_t* base;
  uint32_t g;
  static constexpr uint32_t Bytes(uint32_t heads) { return 2 * BS * heads * (HD + 4); }
  __device__ __forceinline__ uint8_t* codes(int s) const { return base + s * BS * g * HD; }
  __device__ __forceinline__ float* scales(int s) const {
    return reinterpret_cast<float*>(base + 2 * BS * g * HD) + s * BS * g;
  }
};

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
    if (fp8_bh) return Mode::kFp8;  // the fast kernels' FP8 path
    if (codec::IsQuantized(f.dtype) && f.granularity != codec::ScaleGranularity::kNone) {
      return Mode::kQuant;
    }
    // ValidateSpec refuses these already; kept so that no pair reaches a kernel unchecked.
    return absl::InvalidArgumentError(absl::StrCat(
        name, ": no GPU codec path for ", codec::DTypeName(f.dtype), "/",
        codec::GranularityName(f.granularity)));
  }
  if (cache_dtype != DType::kFP8E4M3 || !fp8_bh) {
    return absl::InvalidArgumentError(absl::StrCat(
        name, ": an ", codec::DTypeName(cache_dtype),
        " cache section passes through only to fp8e4m3/block-head, not ",
        codec::DTypeName(f.dtype), "/", codec::GranularityName(f.granularity),
        " (a quantized cache is never re-quantized on the GPU)"));
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
                                    LayerRange layers, const uint8_t* chunk) {
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
  KVTIER_RETURN_IF_ERROR(CheckHeadDim(cache.head_dim));
  KVTIER_RETURN_IF_ERROR(CheckCodecBlockSize(cache.block_size));
  KVTIER_RETURN_IF_ERROR(ValidateBlockSpan(cache, blocks, g.num_tokens));
  KVTIER_RETURN_IF_ERROR(ValidateLayerRange(layers, g.num_layers));
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
  p.layer_begin = layers.begin;
  p.layer_end = layers.End(g.num_layers);
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
    a.qdtype = formats[s].dtype;
    a.gran = formats[s].granularity;
    p.tensor_amax |= m == Mode::kQuant && a.gran == ScaleGranularity::kPerTensor;
    a.offset = offsets[s];
    a.layer_stride = secs[s]->layer_stride;
    a.data_bytes = secs[s]->data_bytes;
    a.payload = g.layer_elements() * codec::BitsPerElement(formats[s].dtype) / 8;
    a.scale_count = secs[s]->scale_count;
    a.scale_bytes = secs[s]->scale_bytes;
  }
  return p;
}

using KernelFn = void (*)(CodecParams);

template <int HD, int BS>
struct EncodeK {
  static constexpr KernelFn fast = GatherEncodeKernel<HD, BS, false>;
  static constexpr KernelFn general = GatherEncodeKernel<HD, BS, true>;
};
template <int HD, int BS>
struct DecodeK {  // no kQuant section, or a chunk in device memory (else LaunchDecodeFromHost)
  static constexpr KernelFn fast = DecodeScatterKernel<HD, BS, false>;
  static constexpr KernelFn general = DecodeScatterKernel<HD, BS, true>;
};
template <int HD, int BS>
struct AmaxK {
  static constexpr KernelFn fast = LayerAmaxKernel<HD, BS>;
  static constexpr KernelFn general = LayerAmaxKernel<HD, BS>;
};

// Runs `query` (CUDA calls that are not stream operations: pointer and
// function attributes, occupancy) with this thread in relaxed stream capture
// mode, so that a thread capturing a CUDA graph in global mode may make them.
template <typename Query>
absl::Status OutsideCapture(Query&& query) {
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  KVTIER_CUDA_RETURN_IF_ERROR(cudaThreadExchangeStreamCaptureMode(&mode));
  const cudaError_t e = query();
  KVTIER_CUDA_RETURN_IF_ERROR(cudaThreadExchangeStreamCaptureMode(&mode));
  KVTIER_CUDA_RETURN_IF_ERROR(e);
  return absl::OkStatus();
}

// Where `p` points: whether into host memory (pinned, mapped or registered,
// which a kernel reaches over PCIe), and then its host address.
struct HostAddress {
  bool in_host;
  const uint8_t* host;  // null when unknown
};
absl::StatusOr<HostAddress> HostAddressOf(const void* p) {
  cudaPointerAttributes a{};
  KVTIER_RETURN_IF_ERROR(OutsideCapture([&] { return cudaPointerGetAttributes(&a, p); }));
  if (a.type != cudaMemoryTypeHost) return HostAddress{false, nullptr};
  return HostAddress{true, static_cast<const uint8_t*>(a.hostPointer)};
}

absl::StatusOr<bool> IsHostMemory(const void* p) {
  KVTIER_ASSIGN_OR_RETURN(const HostAddress a, HostAddressOf(p));
  return a.in_host;
}

// Whether a launch needs the general kernels (some section is kQuant).
bool NeedsGeneral(const CodecParams& p) {
  return p.sec[0].mode == Mode::kQuant || p.sec[1].mode == Mode::kQuant;
}

// Whether the current device runs programmatic dependent launches (compute
// capability 9.0 or later). Asked once a device: every chained decode
// launch (hundreds in a layer-wise load) would otherwise repeat the query.
absl::StatusOr<bool> HasDependentLaunch() {
  constexpr int kKnownDevices = 64;
  static std::atomic<int8_t> known[kKnownDevices] = {};  // 0 not asked, 1 no, 2 yes
  int device = 0, major = 0;
  KVTIER_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  const bool cached = device >= 0 && device < kKnownDevices;
  if (cached) {
    const int8_t k = known[device].load(std::memory_order_relaxed);
    if (k != 0) return k == 2;
  }
  KVTIER_RETURN_IF_ERROR(OutsideCapture([&] {
    return cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  }));
  if (cached) known[device].store(major >= 9 ? 2 : 1, std::memory_order_relaxed);
  return major >= 9;
}

// Launches `fn(p)` on `stream`; with `prior` kLeavesChunk (decode kernels
// only: they wait for the prior grid before their first store) as a
// programmatic dependent launch where the device has them.
absl::Status LaunchKernel(KernelFn fn, const CodecParams& p, dim3 grid, dim3 block, uint32_t smem,
                          PriorKernel prior, cudaStream_t stream) {
  cudaLaunchAttribute overlap{};
  overlap.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  overlap.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  if (prior == PriorKernel::kLeavesChunk) {
    KVTIER_ASSIGN_OR_RETURN(const bool dependent, HasDependentLaunch());
    if (dependent) {
      config.attrs = &overlap;
      config.numAttrs = 1;
    }
  }
  KVTIER_CUDA_RETURN_IF_ERROR(cudaLaunchKernelEx(&config, fn, p));
  return absl::OkStatus();
}

// The one dispatch point: runtime head_dim and block size (kernels/dispatch.h)
// to an instantiation of Kernel (a struct template with `fast` and `general`
// kernels). `staged`: a general encode into host memory, whose CTAs serve
// HostHeadsPerCta kv heads (blockDim.y) and take a CodecStage in dynamic
// shared memory; else one head a CTA.
template <template <int, int> class Kernel>
absl::Status Launch(CodecParams p, bool staged, cudaStream_t stream,
                    PriorKernel prior = PriorKernel::kUnknown) {
  const bool general = NeedsGeneral(p);
  const uint32_t H = p.cache.num_kv_heads;
  KernelFn fn = nullptr;
  uint32_t g = 1, smem = 0;
  KVTIER_RETURN_IF_ERROR(KVTIER_DISPATCH_HEAD_DIM(p.cache.head_dim, HD, {
    return KVTIER_DISPATCH_CODEC_BLOCK_SIZE(p.cache.block_size, BS, {
      fn = general ? Kernel<HD, BS>::general : Kernel<HD, BS>::fast;
      if (general && staged) {
        g = HostHeadsPerCta<HD, BS>(H);
        smem = CodecStage<HD, BS>::Bytes(g);
      }
    });
  }));
  p.heads_per_cta = g;
  p.staged = smem != 0;
  return LaunchKernel(fn, p, dim3(p.num_blocks_in_chunk * (H / g), p.layer_end - p.layer_begin),
                      dim3(kThreads, g), smem, prior, stream);
}

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
                           PriorKernel prior) {
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
  return Launch<DecodeK>(p, false, stream);
}

absl::Status ValidateDecodeScatter(const codec::ChunkHeader& header, const uint8_t* chunk,
                                   const PagedKvLayout& cache, const BlockSpan& blocks,
                                   LayerRange layers) {
  return PrepareDecode(header, chunk, cache, blocks, layers).status();
}

}  // namespace kvtier::kernels
