// Internal to the attention kernels (paged_attention.cu and the two kernel
// headers): launch parameters, the CTA geometry, the conversions and
// reductions both kernels use, the partition walk and the tile loader
// (LoadKvTile). Not a public header: include paged_attention.h.
#ifndef KVTIER_KERNELS_PAGED_ATTENTION_DEVICE_CUH_
#define KVTIER_KERNELS_PAGED_ATTENTION_DEVICE_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "kernels/device_copy.cuh"
#include "kernels/paged_attention.h"

namespace kvtier::kernels::attention_internal {

using codec::DType;

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int kTile = 32;  // tokens per pipeline stage
// Bytes of K/V rows a CTA keeps in flight: the pipeline depth is chosen per
// format so that FP8 rows (half the bytes) get as much in flight as BF16.
constexpr int kInFlightBytes = 32 * 1024;
constexpr int kVec = 8;     // elements of a row per lane
constexpr int kMaxPart = static_cast<int>(kAttentionMaxPartitionTokens);
constexpr int kMinPart = static_cast<int>(kAttentionMinPartitionTokens);
constexpr int kTargetParts = 2048;           // CUDA-core kernel's partition rule
constexpr uint32_t kCudaCoreMaxPart = 1024;  // ... measured up to here
constexpr float kLog2e = 1.4426950408889634f;
// kAuto runs the tensor-core kernel from this many q heads per kv head up
// (FlashInfer's choice too; smaller groups waste most of the 16 mma rows), at
// every batch size: with its own partition rule it is faster than the
// CUDA-core kernel from batch 1 up (H100: b1 ctx 16K K16/V8 1.66 vs
// 0.85 TB/s; within 3% either way only at ctx 1K, batch 2-4).
constexpr uint32_t kTensorCoreMinGroup = 4;
static_assert(kMinPart % kTile == 0 && kMaxPart % kTile == 0,
              "partitions are whole pipeline tiles");

struct AttnParams {
  PagedKvLayout cache;
  const void* q;
  void* out;
  const int32_t* block_table;
  const int32_t* seq_lens;
  float* ws_acc;  // [batch][q_heads][parts][head_dim]: unnormalized output
  float* ws_ml;   // [batch][q_heads][parts][2]: max (base 2), sum
  uint32_t max_blocks_per_seq, num_q_heads, group, parts, part_tokens, layer, bs_shift;
  float q_scale;  // sm_scale * log2(e)
  AttentionKernel kernel;  // host side only
};

// Threads of the tile loader (LoadKvTile) that share a token's K and V rows
// of kch and vch 16-byte chunks: 8, so that a warp's copy moves whole
// 128-byte lines, or all of a shorter row's chunks. (H200, tensor-core
// kernel, b32 ctx8K: with 4, i.e. half lines and half the address
// arithmetic, BF16 ran 1.24x and K16/V8 1.13x slower, FP8 1.02x;
// bench/results/kernels.md.)
constexpr int LoaderThreadsPerToken(int kch, int vch) {
  const int shorter = kch < vch ? kch : vch;
  return shorter < 8 ? shorter : 8;
}

// Compile-time geometry of one instantiation.
template <int HD, int GP, bool K8, bool V8>
struct Geometry {
  static constexpr int TILE = kTile;                   // tokens per pipeline stage
  static constexpr int TG = HD / kVec;                 // lanes per token row
  static constexpr int NG = 32 / TG;                   // token groups per warp
  static constexpr int U = kTile / (kWarps * NG);      // tokens per group per tile
  static constexpr int N = U * GP;                     // partial dots per lane per tile
  static constexpr int CF = N / TG;                    // full dots per lane after the reduce
  static constexpr int KB = K8 ? 1 : 2, VB = V8 ? 1 : 2;  // bytes per element
  static constexpr int KROW = HD * KB, VROW = HD * VB;    // bytes per row
  static constexpr int KCH = KROW / 16, VCH = VROW / 16;  // 16-byte chunks per row
  static constexpr int TPR = LoaderThreadsPerToken(KCH, VCH);
  static constexpr int STAGE_K = kTile * KROW;
  static constexpr int STAGE_V = kTile * VROW;
  static constexpr int STAGE = STAGE_K + STAGE_V + 2 * kTile * 4;  // rows + K, V scales
  // One stage being computed, the others in flight.
  static constexpr int STAGES = 1 + (kInFlightBytes + STAGE_K + STAGE_V - 1) / (STAGE_K + STAGE_V);
  static constexpr int PIPE = STAGES * STAGE;
  static constexpr int MERGE = kWarps * GP * (HD + 2) * 4;  // per-warp states at the end
  static constexpr int SMEM = PIPE > MERGE ? PIPE : MERGE;

  static_assert(32 % TG == 0 || TG == 32, "a token row is split over the lanes of one warp");
  static_assert(TG <= 32 && NG >= 1 && U >= 1, "tile must cover every token group");
  static_assert(N % TG == 0 && CF >= 1, "reduce-scatter leaves whole dots per lane");
  static_assert(TG / U == 4 && GP / CF == 4,
                "lanes l and l^4, l^8, l^16 hold the same q heads (see kernel)");
  static_assert((kTile * KCH) % kThreads == 0 && (kTile * VCH) % kThreads == 0,
                "every thread issues the same number of 16-byte copies per tile");
  static_assert(STAGE_K % 16 == 0 && STAGE % 16 == 0, "16-byte aligned stages");
};

template <bool BF16>
__device__ __forceinline__ float2 Unpack16x2(uint32_t w) {
  if constexpr (BF16) {
    return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xFFFF0000u));
  } else {
    return __half22float2(*reinterpret_cast<const __half2*>(&w));
  }
}

__device__ __forceinline__ float2 UnpackFp8x2(uint32_t two_codes) {
  __half2_raw h2 = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(two_codes),
                                              __NV_E4M3);
  return __half22float2(*reinterpret_cast<__half2*>(&h2));
}

// 8 elements of a row in shared memory (16 bytes of 16-bit elements or 8 FP8
// codes) as floats.
template <bool FP8, bool BF16>
__device__ __forceinline__ void LoadRow8(const uint8_t* p, float (&f)[kVec]) {
  if constexpr (FP8) {
    const uint2 w = *reinterpret_cast<const uint2*>(p);
    const uint32_t ws[2] = {w.x, w.y};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 v = UnpackFp8x2(ws[i / 2] >> (16 * (i % 2)));
      f[2 * i] = v.x;
      f[2 * i + 1] = v.y;
    }
  } else {
    const uint4 w = *reinterpret_cast<const uint4*>(p);
    const uint32_t ws[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 v = Unpack16x2<BF16>(ws[i]);
      f[2 * i] = v.x;
      f[2 * i + 1] = v.y;
    }
  }
}

// Reduce-scatter of N partial sums over the TG lanes of a token group: after
// it, v[j] (j < N / TG) holds the group-wide sum of entry (lane % TG) * (N /
// TG) + j. Each halving step sends the half the lane gives away and keeps the
// other; TG - 1 shuffles in all when N >= TG.
template <int C, int O, int N>
__device__ __forceinline__ void ReduceScatterStep(float (&v)[N], int lane) {
  if constexpr (O >= 1) {
    constexpr int kHalf = C / 2;
    const bool upper = (lane & O) != 0;
#pragma unroll
    for (int i = 0; i < kHalf; ++i) {
      const float send = upper ? v[i] : v[i + kHalf];
      const float keep = upper ? v[i + kHalf] : v[i];
      v[i] = keep + __shfl_xor_sync(0xffffffffu, send, O);
    }
    ReduceScatterStep<kHalf, O / 2>(v, lane);
  }
}
template <int N, int TG>
__device__ __forceinline__ void ReduceScatter(float (&v)[N], int lane) {
  static_assert((TG & (TG - 1)) == 0 && N % TG == 0, "TG a power of two dividing N");
  ReduceScatterStep<N, TG / 2>(v, lane);
}

// One output element in the output dtype (q's), round to nearest even.
template <bool BF16>
__device__ __forceinline__ uint16_t StoreOut(float o) {
  if constexpr (BF16) {
    return __bfloat16_as_ushort(__float2bfloat16_rn(o));
  } else {
    return __half_as_ushort(__float2half_rn(o));
  }
}

// The end of both partial kernels: merges the kWarps warps' states in shared
// memory (s_acc [kWarps][ROWS][HD] unnormalized outputs, s_ml [kWarps][ROWS][2]
// base-2 max and sum; rows >= G unused) into the workspace rows of the G q
// heads of kv head `kvh` in partition `part` of sequence `b`. With a single
// partition the combine would compute exactly o / sum (its weight is
// exp2(0) = 1), so the output is written here and the combine is skipped.
template <int HD, int ROWS, bool BF16>
__device__ __forceinline__ void MergeWarpsToWorkspace(const AttnParams& p, const float* s_acc,
                                                      const float* s_ml, int G, uint32_t b,
                                                      uint32_t kvh, uint32_t part, int tid) {
  const uint64_t row0 = (uint64_t{b} * p.num_q_heads + uint64_t{kvh} * G) * p.parts + part;
  for (int i = tid; i < G * HD; i += kThreads) {
    const int g = i / HD, d = i % HD;
    float mx = -INFINITY;
#pragma unroll
    for (int w2 = 0; w2 < kWarps; ++w2) mx = fmaxf(mx, s_ml[(w2 * ROWS + g) * 2]);
    const float m_use = mx == -INFINITY ? 0.0f : mx;
    float o = 0.0f, sum = 0.0f;
#pragma unroll
    for (int w2 = 0; w2 < kWarps; ++w2) {
      const float f = exp2f(s_ml[(w2 * ROWS + g) * 2] - m_use);
      o += f * s_acc[(w2 * ROWS + g) * HD + d];
      sum += f * s_ml[(w2 * ROWS + g) * 2 + 1];
    }
    if (p.parts == 1) {
      uint16_t* out = static_cast<uint16_t*>(p.out) + (row0 + static_cast<uint32_t>(g)) * HD + d;
      *out = StoreOut<BF16>(o / sum);
      continue;
    }
    const uint64_t r = row0 + uint64_t{static_cast<uint32_t>(g)} * p.parts;
    p.ws_acc[r * HD + d] = o;
    if (d == 0) {
      p.ws_ml[2 * r] = mx;
      p.ws_ml[2 * r + 1] = sum;
    }
  }
}

// The CTA's share of the work, the same in both partial kernels: kv head
// `kvh` of sequence `b`, partition `part`, n tokens from t_begin, and where a
// partition-local token's K and V rows and scales are. Block ids come
// straight from the sequence's row of the block table (__ldg, L1-resident):
// no shared-memory copy, so nothing waits on it before the first loads and
// the partition length is not bounded by it.
template <bool K8, bool V8>
struct CtaPartition {
  static constexpr int KB = K8 ? 1 : 2, VB = V8 ? 1 : 2;  // bytes per element
  uint32_t b, kvh, part;
  int t_begin, n, G;
  uint32_t shift, bs_mask, kv_heads;
  const int32_t* table;
  // Row (block, slot) starts at khead + KB * e and vhead + VB * e, with
  // e = block * stride_block + slot * stride_token (elements; K and V share
  // the strides, KVTIER_HD k_elem / v_elem).
  // Both strides fit 32 bits (PrepareAttention checks), so e is one 32x32->64
  // multiply-add.
  const uint8_t *khead, *vhead;
  uint32_t stride_block, stride_token;
  const float *kscale, *vscale;

  // kv head fastest in the grid: the CTAs of all kv heads of one (sequence,
  // partition) run side by side and read neighbouring rows of the same blocks.
  __device__ explicit CtaPartition(const AttnParams& p)
      : b(blockIdx.z), kvh(blockIdx.x), part(blockIdx.y) {
    const PagedKvLayout& c = p.cache;
    const int len = __ldg(p.seq_lens + b);
    t_begin = static_cast<int>(part * p.part_tokens);
    n = min(static_cast<int>(p.part_tokens), len - t_begin);
    G = static_cast<int>(p.group);
    shift = p.bs_shift;
    bs_mask = (1u << shift) - 1;
    kv_heads = c.num_kv_heads;
    table = p.block_table + uint64_t{b} * p.max_blocks_per_seq;
    khead = static_cast<const uint8_t*>(c.k_layers[p.layer]) + int64_t{KB} * c.k_elem(0, 0, kvh, 0);
    vhead = static_cast<const uint8_t*>(c.v_layers[p.layer]) + int64_t{VB} * c.v_elem(0, 0, kvh, 0);
    stride_block = static_cast<uint32_t>(c.stride_block);
    stride_token = static_cast<uint32_t>(c.stride_token);
    kscale = K8 ? c.k_scale_layers[p.layer] + kvh : nullptr;
    vscale = V8 ? c.v_scale_layers[p.layer] + kvh : nullptr;
  }
  // False when the partition starts past the sequence's end.
  __device__ bool has_work() const { return n > 0; }
  __device__ uint32_t Block(int t) const { return __ldg(table + ((t_begin + t) >> shift)); }
  // e of partition-local token t, which lies in block `block`.
  __device__ uint64_t RowElem(uint32_t block, int t) const {
    return uint64_t{block} * stride_block + ((t_begin + t) & bs_mask) * stride_token;
  }
  // Offset of block's scale from kscale / vscale (KVTIER_HD scale_index).
  __device__ int64_t ScaleOffset(uint32_t block) const { return int64_t{block} * kv_heads; }
};

// How a stage lays out its rows: logical 16-byte chunk c of tile row r is
// stored at chunk c ^ Swz::K(r) (K rows) / c ^ Swz::V(r) (V rows). The
// CUDA-core kernel keeps rows as they are; the tensor-core kernel swizzles
// them (TcSwizzle).
struct NoSwizzle {
  static __device__ __forceinline__ int K(int) { return 0; }
  static __device__ __forceinline__ int V(int) { return 0; }
};

// The tile loader of both partial kernels: issues (without committing) the
// cp.async copies of tile `tile` of the partition into the pipeline stage at
// `st`, laid out as Geo says (Geo::TILE rows, Geo::KROW / Geo::VROW bytes
// each, Geo::KCH / Geo::VCH 16-byte chunks): K rows at st, V rows at
// st + STAGE_K, then Geo::TILE K scales and Geo::TILE V scales (floats; FP8
// sections only). A thread serves whole tokens: Geo::TPR threads share a
// token's K and V rows (a warp's copy moves TPR x 16 contiguous bytes of
// 32 / TPR rows), and a token's block id and row offsets are computed once
// for both rows and its scales (the address arithmetic, not the copies, is
// what a tile costs in instructions). Rows past the partition's end are zero-filled
// (src-size 0, with row 0's address), so every thread issues the same
// number of 16-byte copies.
template <class Geo, class Swz, bool K8, bool V8>
__device__ __forceinline__ void LoadKvTile(uint8_t* st, const CtaPartition<K8, V8>& w, int tile,
                                           int tid) {
  constexpr int TILE = Geo::TILE;
  constexpr int TPR = Geo::TPR;  // threads per token
  constexpr int RPP = kThreads / TPR;                            // tokens per pass
  static_assert(kThreads % TPR == 0 && TILE % RPP == 0 && Geo::KCH % TPR == 0 &&
                    Geo::VCH % TPR == 0,
                "every thread issues the same copies");
  const int t0 = tile * TILE;
  const int c0 = tid % TPR;
#pragma unroll
  for (int k = 0; k < TILE / RPP; ++k) {
    const int r = tid / TPR + k * RPP;
    const bool ok = t0 + r < w.n;
    const int t = ok ? t0 + r : 0;
    const uint32_t block = w.Block(t);
    const uint64_t e = w.RowElem(block, t);
    const uint8_t* krow = w.khead + CtaPartition<K8, V8>::KB * e;
    const uint8_t* vrow = w.vhead + CtaPartition<K8, V8>::VB * e;
#pragma unroll
    for (int j = 0; j < Geo::KCH / TPR; ++j) {
      const int col = c0 + j * TPR;
      CpAsync16(st + r * Geo::KROW + (col ^ Swz::K(r)) * 16, krow + col * 16, ok);
    }
#pragma unroll
    for (int j = 0; j < Geo::VCH / TPR; ++j) {
      const int col = c0 + j * TPR;
      CpAsync16(st + Geo::STAGE_K + r * Geo::VROW + (col ^ Swz::V(r)) * 16, vrow + col * 16, ok);
    }
    if constexpr (K8 || V8) {
      if (c0 == 0) {
        const int64_t so = w.ScaleOffset(block);
        float* s = reinterpret_cast<float*>(st + Geo::STAGE_K + Geo::STAGE_V) + r;
        if constexpr (K8) CpAsync4(s, w.kscale + so, ok);
        if constexpr (V8) CpAsync4(s + TILE, w.vscale + so, ok);
      }
    }
  }
}

}  // namespace kvtier::kernels::attention_internal

#endif  // KVTIER_KERNELS_PAGED_ATTENTION_DEVICE_CUH_
