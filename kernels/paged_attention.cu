#include "kernels/paged_attention.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <atomic>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "kernels/cuda_status.h"
#include "kernels/device_copy.cuh"
#include "kernels/dispatch.h"

// Design (FlashDecoding / FlashInfer style; numbers for Llama-3.1-8B shapes):
// - CTA = (partition, kv head, sequence), 4 warps. It holds the q vectors of
//   the whole GQA group in registers, so K and V rows are read once per kv
//   head, not once per q head.
// - The partition is walked in tiles of kTile tokens. A kStages-deep
//   cp.async pipeline copies each tile's K and V rows (and FP8 scales) into
//   shared memory with 16-byte copies; the depth is chosen so that about
//   32 KB of rows per CTA are in flight (2 BF16 tiles, 3 K16/V8, 4 FP8) while
//   the oldest tile is computed.
// - Within a warp, a token row is split over TG = head_dim / 8 lanes (8
//   elements each). A lane computes partial q.k dots for its U tokens and GP
//   q heads; a reduce-scatter over the TG lanes (TG-1 shuffles for all U*GP
//   dots, instead of log2(TG) shuffles per dot) leaves each lane with the
//   full dot of one (token, head) pair, so the exponentials are computed
//   once per logit, not once per lane.
// - Online softmax per warp (base-2, sm_scale * log2 e folded into q); the
//   probabilities go to the warp through shared memory; V rows are
//   dequantized in registers (FP8 codes -> half2 -> float, the per-(block,
//   head) scale folded into the probability) and accumulated per lane over
//   its 8 dims. At the end the warps' states are merged in shared memory and
//   the partition's (max, sum, unnormalized output) goes to the workspace.
// - A combine kernel merges the partitions of each (sequence, q head).
// - The above is the CUDA-core kernel (AttentionKernel::kCudaCore). The
//   tensor-core kernel (kTensorCore, AttnPartialTcKernel below) keeps the
//   CTA, pipeline and combine and does q.K^T and P.V with mma.sync; kAuto
//   picks it for groups >= kTensorCoreMinGroup. (Per-warp cp.async and
//   bulk-copy pipelines measure no faster than the CTA pipeline on an H100:
//   bench/results/kernels-h100.md.)

namespace kvtier::kernels {
namespace {

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
constexpr uint32_t kCudaCoreMaxPart = 1024;  // ... measured up to here (runs 3a/3b)
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
// bench/results/h200-2026-11-24-kernels.md.)
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

template <int HD, int GP, bool K8, bool V8, bool BF16>
__global__ void __launch_bounds__(kThreads, GP <= 4 ? 4 : 2)
    AttnPartialKernel(const __grid_constant__ AttnParams p) {
  using G_ = Geometry<HD, GP, K8, V8>;
  constexpr int TG = G_::TG, NG = G_::NG, U = G_::U, N = G_::N, CF = G_::CF;
  extern __shared__ __align__(16) uint8_t smem[];
  __shared__ __align__(16) float s_p[kWarps][NG * N];  // probabilities (x V scale)
  __shared__ __align__(16) float s_alpha[kWarps][GP];  // per-head rescale of this tile

  const CtaPartition<K8, V8> w(p);
  if (!w.has_work()) return;
  const uint32_t b = w.b, kvh = w.kvh;
  const int n = w.n, G = w.G;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int grp = lane / TG, lt = lane % TG;

  float q[GP][kVec];
  {
    const uint16_t* qbase = static_cast<const uint16_t*>(p.q) +
                            (uint64_t{b} * p.num_q_heads + uint64_t{kvh} * G) * HD + lt * kVec;
#pragma unroll
    for (int g = 0; g < GP; ++g) {
      if (g < G) {
        const uint4 w = __ldg(reinterpret_cast<const uint4*>(qbase + g * HD));
        const uint32_t ws[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const float2 v = Unpack16x2<BF16>(ws[i]);
          q[g][2 * i] = v.x * p.q_scale;
          q[g][2 * i + 1] = v.y * p.q_scale;
        }
      } else {
#pragma unroll
        for (int e = 0; e < kVec; ++e) q[g][e] = 0.0f;
      }
    }
  }


  // This lane's share after the reduce-scatter: token u_l of its group and
  // q heads (lane % 4) * CF + j, j < CF (Geometry's static_assert).
  const int u_l = lt / 4;
  float m[CF], l[CF];
#pragma unroll
  for (int j = 0; j < CF; ++j) {
    m[j] = -INFINITY;
    l[j] = 0.0f;
  }
  float acc[GP][kVec];
#pragma unroll
  for (int g = 0; g < GP; ++g)
#pragma unroll
    for (int e = 0; e < kVec; ++e) acc[g][e] = 0.0f;

  // One tile of this warp: rows tok0 + u (u < U) of the K rows at `ks_rows`
  // and V rows at `vs_rows` in shared memory; `valid`: whether this lane's
  // token u_l exists; ks / vs: its FP8 scales (1 for 16-bit sections).
  auto compute = [&](const uint8_t* k_rows, const uint8_t* v_rows, int tok0, bool valid, float ks,
                     float vs) {
    // Logits of the group's U tokens for every q head.
    float dot[N];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float k[kVec];
      LoadRow8<K8, BF16>(k_rows + (tok0 + u) * G_::KROW + lt * kVec * G_::KB, k);
#pragma unroll
      for (int g = 0; g < GP; ++g) {
        float d = 0.0f;
#pragma unroll
        for (int e = 0; e < kVec; ++e) d = fmaf(q[g][e], k[e], d);
        dot[u * GP + g] = d;
      }
    }
    ReduceScatter<N, TG>(dot, lane);

    bool grew = false;
#pragma unroll
    for (int j = 0; j < CF; ++j) {
      const float s = valid ? dot[j] * ks : -INFINITY;
      float mt = s;
#pragma unroll
      for (int o = 4; o < 32; o <<= 1) mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, o));
      const float m_new = fmaxf(m[j], mt);
      grew |= m_new > m[j];
      const float m_use = m_new == -INFINITY ? 0.0f : m_new;
      const float alpha = exp2f(m[j] - m_use);
      const float pr = exp2f(s - m_use);
      l[j] = l[j] * alpha + pr;
      m[j] = m_new;
      s_p[warp][lane * CF + j] = pr * vs;
      if (lane < 4) s_alpha[warp][lane * CF + j] = alpha;
    }
    __syncwarp();
    if (__any_sync(0xffffffffu, grew)) {
#pragma unroll
      for (int g = 0; g < GP; ++g) {
        const float a = s_alpha[warp][g];
#pragma unroll
        for (int e = 0; e < kVec; ++e) acc[g][e] *= a;
      }
    }
    float w[N];
#pragma unroll
    for (int i = 0; i < N / 4; ++i) {
      const float4 x = *reinterpret_cast<const float4*>(&s_p[warp][grp * N + 4 * i]);
      w[4 * i] = x.x;
      w[4 * i + 1] = x.y;
      w[4 * i + 2] = x.z;
      w[4 * i + 3] = x.w;
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float v[kVec];
      LoadRow8<V8, BF16>(v_rows + (tok0 + u) * G_::VROW + lt * kVec * G_::VB, v);
#pragma unroll
      for (int g = 0; g < GP; ++g)
#pragma unroll
        for (int e = 0; e < kVec; ++e) acc[g][e] = fmaf(w[u * GP + g], v[e], acc[g][e]);
    }
    __syncwarp();  // s_p / s_alpha are rewritten next tile
  };

  {
    auto load_tile = [&](int tile, int stage) {
      LoadKvTile<G_, NoSwizzle>(smem + stage * G_::STAGE, w, tile, tid);
    };
    constexpr int kStages = G_::STAGES;
    const int ntiles = (n + kTile - 1) / kTile;
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
      if (s < ntiles) load_tile(s, s);
      CpAsyncCommit();
    }
    const int tok0 = (warp * NG + grp) * U;  // tile-local index of the group's first token
    for (int it = 0; it < ntiles; ++it) {
      CpAsyncWait<kStages - 2>();
      __syncthreads();  // tile `it` landed for all; tile it-1's stage is free
      if (it + kStages - 1 < ntiles) load_tile(it + kStages - 1, (it + kStages - 1) % kStages);
      CpAsyncCommit();
      const uint8_t* st = smem + (it % kStages) * G_::STAGE;
      const float* s_ks = reinterpret_cast<const float*>(st + G_::STAGE_K + G_::STAGE_V);
      const float* s_vs = s_ks + kTile;
      compute(st, st + G_::STAGE_K, tok0, it * kTile + tok0 + u_l < n,
              K8 ? s_ks[tok0 + u_l] : 1.0f, V8 ? s_vs[tok0 + u_l] : 1.0f);
    }
    CpAsyncWait<0>();
  }
  __syncthreads();  // the pipeline's shared memory is reused below

  // Warp state: sums over the lanes that hold the same heads, outputs over
  // the token groups.
#pragma unroll
  for (int j = 0; j < CF; ++j)
#pragma unroll
    for (int o = 4; o < 32; o <<= 1) l[j] += __shfl_xor_sync(0xffffffffu, l[j], o);
#pragma unroll
  for (int o = TG; o < 32; o <<= 1)
#pragma unroll
    for (int g = 0; g < GP; ++g)
#pragma unroll
      for (int e = 0; e < kVec; ++e) acc[g][e] += __shfl_xor_sync(0xffffffffu, acc[g][e], o);
  float* s_acc = reinterpret_cast<float*>(smem);  // [kWarps][GP][HD]
  float* s_ml = s_acc + kWarps * GP * HD;         // [kWarps][GP][2]
  if (grp == 0) {
#pragma unroll
    for (int g = 0; g < GP; ++g) {
      float4* d = reinterpret_cast<float4*>(s_acc + (warp * GP + g) * HD + lt * kVec);
      d[0] = make_float4(acc[g][0], acc[g][1], acc[g][2], acc[g][3]);
      d[1] = make_float4(acc[g][4], acc[g][5], acc[g][6], acc[g][7]);
    }
  }
  if (lane < 4) {
#pragma unroll
    for (int j = 0; j < CF; ++j) {
      s_ml[(warp * GP + lane * CF + j) * 2] = m[j];
      s_ml[(warp * GP + lane * CF + j) * 2 + 1] = l[j];
    }
  }
  __syncthreads();
  MergeWarpsToWorkspace<HD, GP, BF16>(p, s_acc, s_ml, G, b, kvh, w.part, tid);
}

// ---------------------------------------------------------------------------
// Tensor-core kernel (AttentionKernel::kTensorCore). Same CTA, pipeline, tile
// loader (LoadKvTile, here with swizzled rows), partitions and combine as
// above; per tile of kTcTile tokens each warp takes 16 tokens and computes,
// with mma.sync m16n8k16 (FP32 accumulate), the transposed products
//   S^T[16 tokens x 8 heads] = K[16 x HD] . Q^T        (HD/16 mmas)
//   O^T[HD x 8 heads]       += V^T[HD x 16 tokens] . P^T  (HD/16 mmas)
// Tokens and head dims are the 16 mma rows, the GQA group (up to 8 heads,
// zero q rows past the group) the 8 columns: no row is padding, and a
// token's K or V row is read by the lanes that need it, once.
// - q.k: lane (g, t) reads 16-byte chunk 4s + t of K rows g and g + 8 of its
//   16 tokens (span s); the head dim is permuted within the chunk so that the
//   chunk's words are directly A fragments (a0/a1 = dims 4j..4j+1 of rows g /
//   g + 8, a2/a3 = dims 4j+2..4j+3); q's B fragments use the same permutation
//   (q.k is a sum over dims, so any common order gives the same dot). The
//   k-steps alternate over kTcChains accumulators (independent mma chains),
//   summed once per tile. FP8 K codes become FP16 pairs in registers (cvt
//   e4m3x2 -> f16x2); q.k then runs in FP16 (q converted from BF16 when
//   needed; exact for |q| < 65504) and the K scale multiplies the logit.
// - Online softmax (base 2) on the S^T fragments: lane (g, t) holds tokens g
//   and g + 8 of heads 2t and 2t + 1; a head's max over the warp's 16 tokens
//   takes 3 shuffles (lanes xor 4, 8, 16), the sum is kept per lane and
//   reduced once at the end. The probabilities, packed to 16-bit pairs, are
//   an 8x8 [token][head] matrix in mma layout: movmatrix.trans turns each of
//   the two (tokens 0-7, 8-15) into the B fragment of P.V.
// - V 16-bit: ldmatrix.x4.trans of swizzled 16-byte chunks gives the A
//   fragments of V^T. FP8 V: lane (g, t) reads 4 codes (dims 4g..4g+3 of a
//   32-dim span) of tokens 2t, 2t+1, 2t+8, 2t+9 and byte-permutes them into
//   token pairs; rows g and g + 8 of the span's two m-tiles are dims 4g, 4g+1
//   and 4g+2, 4g+3 (un-permuted when the result is written). P.V for FP8 V
//   runs in FP16 with P' = p * v_scale / w, where w is the running max of
//   the V scales seen by the warp (rescaled like the softmax max), so
//   P' <= 1 keeps FP16's precision whatever the scales; O is multiplied by w
//   at the end.
// - Shared memory rows are XOR-swizzled by 16-byte chunk (SwzK / SwzV) so
//   that these reads are free of bank conflicts.
constexpr int kTcTile = 64;  // tokens per pipeline stage: 16 per warp
constexpr int kTcSmemPerSm = 220 * 1024;  // H100: 228 KB per SM, some kept for the runtime
constexpr int kTcStaticSmem = 1024;  // the runtime's per-CTA reserve
constexpr int kTcRows = 8;  // q-head columns of the mma (kAttentionMaxGroup)
constexpr int kTcChains = 4;  // independent q.k accumulators
static_assert(kMinPart % 32 == 0 && kTcRows >= static_cast<int>(kAttentionMaxGroup),
              "tensor-core rows cover every group");

template <int HD, bool K8, bool V8>
struct TcGeometry {
  static constexpr int TILE = kTcTile;  // tokens per pipeline stage
  static constexpr int KB = K8 ? 1 : 2, VB = V8 ? 1 : 2;
  static constexpr int KROW = HD * KB, VROW = HD * VB;
  static constexpr int KCH = KROW / 16, VCH = VROW / 16;
  static constexpr int KE = 16 / KB;       // dims per 16-byte K chunk
  static constexpr int TPR = LoaderThreadsPerToken(KCH, VCH);
  static constexpr int KSPANS = KCH / 4;   // chunk groups read by the 4 lanes of a quad
  static constexpr int KSTEPS = HD / 16;   // mma k-steps of q.k
  static constexpr int MT = HD / 16;       // mma m-tiles of O^T
  static constexpr int STAGE_K = kTcTile * KROW, STAGE_V = kTcTile * VROW;
  static constexpr int STAGE = STAGE_K + STAGE_V + 2 * kTcTile * 4;  // rows + K, V scales
  // head_dim 256: q's B fragments live in shared memory after the stages
  // ([KSTEPS][32 lanes] x 8 bytes), read per tile, instead of 2 x KSTEPS
  // registers: with the HD / 4 accumulators they would not fit in 255
  // registers without spills.
  static constexpr bool QSMEM = HD >= 256;
  static constexpr int QBYTES = QSMEM ? KSTEPS * 32 * 8 : 0;
  // CTAs per SM and pipeline depth from the shared memory of an SM: 3 CTAs
  // when 3 stages each fit (FP8, head_dim 64), else 2 CTAs with as many
  // stages as fit (at least 2); a fixed 48 KB in flight (3 stages) left
  // K16/V8 behind FP8 on the H100 (bench/results/kernels-h100.md).
  static constexpr int STAGES3 = (kTcSmemPerSm / 3 - kTcStaticSmem - QBYTES) / STAGE;
  // (H200: 3 CTAs of 2 stages for BF16 and K16/V8, which their registers
  // would allow, run 1.01x and 1.06x slower than 2 CTAs of 3 and 4 stages.)
  static constexpr int CTAS = STAGES3 >= 3 ? 3 : 2;
  static constexpr int STAGES2 = (kTcSmemPerSm / 2 - kTcStaticSmem - QBYTES) / STAGE;
  static constexpr int STAGES = CTAS == 3 ? STAGES3 : (STAGES2 >= 2 ? STAGES2 : 2);
  static constexpr int PIPE = STAGES * STAGE + QBYTES;
  static constexpr int MERGE = kWarps * kTcRows * (HD + 2) * 4;
  static constexpr int SMEM = PIPE > MERGE ? PIPE : MERGE;
  static_assert(KCH % 4 == 0 && KSPANS * KE * 4 == HD, "a quad covers whole K rows");
  static_assert((kTcTile * KCH) % kThreads == 0 && (kTcTile * VCH) % kThreads == 0,
                "every thread issues the same number of 16-byte copies per tile");
  static_assert(V8 || VCH >= 8, "ldmatrix swizzle needs 8 chunks per row");
  static_assert(STAGE % 16 == 0 && STAGE_K % 16 == 0, "16-byte aligned stages");
};

// Physical 16-byte chunk of logical chunk c of tile row r.
template <int KCH>
__device__ __forceinline__ int SwzK(int r, int c) {
  // A quarter-warp's 16-byte reads touch rows 2i, 2i+1 at the same 4 chunks.
  return KCH >= 8 ? c ^ ((r & 1) << 2) : c;
}
template <bool V8, int VCH>
__device__ __forceinline__ int SwzV(int r, int c) {
  if constexpr (!V8) return c ^ (r & 7);  // ldmatrix: 8 rows, same chunk
  // FP8: a warp reads 32 bytes of rows 2t (+1, +8, +9), t = 0..3.
  if constexpr (VCH >= 8) return c ^ (((r >> 1) & 3) << 1);
  return c ^ (((r >> 1) & 1) << 1);
}
// The tensor-core kernel's stage layout for LoadKvTile (SwzK / SwzV as XOR
// masks: both only flip bits of the chunk index).
template <int KCH, int VCH, bool V8>
struct TcSwizzle {
  static __device__ __forceinline__ int K(int r) { return SwzK<KCH>(r, 0); }
  static __device__ __forceinline__ int V(int r) { return SwzV<V8, VCH>(r, 0); }
};

// 2^x for x <= 0 (ex2.approx, subnormal results flushed to zero: they are
// below FP16's and BF16's resolution of the probabilities anyway).
__device__ __forceinline__ float Exp2Ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// d (rows g / g + 8, cols 2t, 2t + 1) += A . B, m16n8k16, FP32 accumulate.
template <bool BF16>
__device__ __forceinline__ void Mma16816(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                         uint32_t a3, uint32_t b0, uint32_t b1) {
  if constexpr (BF16) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  } else {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
}

__device__ __forceinline__ void LdsmX4T(uint32_t (&r)[4], const void* p) {
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(s));
}

// The transpose of an 8x8 16-bit matrix held in mma layout (lane (g, t):
// row g, cols 2t, 2t + 1).
__device__ __forceinline__ uint32_t MovTrans(uint32_t x) {
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}

// Four FP8 e4m3 codes [c3 c2 c1 c0] -> lo = f16x2(c0, c1), hi = f16x2(c2, c3)
// (cvt e4m3x2 -> f16x2; the high pair is read from the upper half-word).
__device__ __forceinline__ void Fp8x4ToH2x2(uint32_t w, uint32_t& lo, uint32_t& hi) {
  const __half2_raw l = __nv_cvt_fp8x2_to_halfraw2(
      static_cast<__nv_fp8x2_storage_t>(w & 0xFFFFu), __NV_E4M3);
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(
      static_cast<__nv_fp8x2_storage_t>(w >> 16), __NV_E4M3);
  lo = static_cast<uint32_t>(l.x) | (static_cast<uint32_t>(l.y) << 16);
  hi = static_cast<uint32_t>(h.x) | (static_cast<uint32_t>(h.y) << 16);
}

template <bool BF16>
__device__ __forceinline__ uint32_t Pack2(float lo, float hi) {
  if constexpr (BF16) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  } else {
    const __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  }
}

// Registers for as many CTAs per SM as shared memory allows (TcGeometry::CTAS).
template <int HD, bool K8, bool V8, bool BF16>
__global__ void __launch_bounds__(kThreads, (TcGeometry<HD, K8, V8>::CTAS))
    AttnPartialTcKernel(const __grid_constant__ AttnParams p) {
  using G_ = TcGeometry<HD, K8, V8>;
  constexpr bool kQkBf16 = BF16 && !K8;  // mma input type of q.k
  constexpr bool kPvBf16 = BF16 && !V8;  // and of p.v
  constexpr int kChains = G_::KSTEPS < kTcChains ? G_::KSTEPS : kTcChains;
  extern __shared__ __align__(16) uint8_t smem[];

  const CtaPartition<K8, V8> w(p);
  if (!w.has_work()) return;
  const uint32_t b = w.b, kvh = w.kvh;
  const int n = w.n, G = w.G;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane >> 2, t = lane & 3;  // mma fragment row / column pair

  auto load_tile = [&](int tile, int stage) {
    LoadKvTile<G_, TcSwizzle<G_::KCH, G_::VCH, V8>>(smem + stage * G_::STAGE, w, tile, tid);
  };

  // O^T m-tile i: o[i][0..1] = dim row g, heads 2t, 2t+1; o[i][2..3] = row g + 8.
  float o[G_::MT][4];
#pragma unroll
  for (int i = 0; i < G_::MT; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.0f, 0.0f};  // heads 2t, 2t+1
  float w_run = 0.0f, rw = 0.0f;  // FP8 V: running max of the V scales, its inverse

  constexpr int kStages = G_::STAGES;
  const int ntiles = (n + kTcTile - 1) / kTcTile;
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < ntiles) load_tile(s, s);
    CpAsyncCommit();
  }
  // The first tiles are on their way; q's loads overlap them.
  // q B fragments (column g = q head g < G), in the permuted dim order of the
  // K chunks: b0 pairs with a K chunk word's a0/a1 dims, b1 with a2/a3.
  uint32_t qb[G_::KSTEPS][2];
  {
    const uint16_t* qrow = static_cast<const uint16_t*>(p.q) +
                           (uint64_t{b} * p.num_q_heads + uint64_t{kvh} * G + g) * HD;
#pragma unroll
    for (int s = 0; s < G_::KSPANS; ++s) {
      const uint16_t* src = qrow + s * 4 * G_::KE + t * G_::KE;
      constexpr int kWords = G_::KE / 2;  // 4 (16-bit K) or 8 (FP8 K)
      uint32_t w[kWords];
#pragma unroll
      for (int i = 0; i < kWords / 4; ++i) {
        uint4 x = make_uint4(0, 0, 0, 0);
        if (g < G) x = __ldg(reinterpret_cast<const uint4*>(src) + i);
        w[4 * i] = x.x;
        w[4 * i + 1] = x.y;
        w[4 * i + 2] = x.z;
        w[4 * i + 3] = x.w;
      }
#pragma unroll
      for (int i = 0; i < kWords; ++i) {
        uint32_t v = w[i];
        if constexpr (K8 && BF16) {
          const float2 f = Unpack16x2<true>(v);
          v = Pack2<false>(f.x, f.y);
        }
        qb[s * (kWords / 2) + i / 2][i % 2] = v;
      }
    }
  }
  // head_dim 256: warp 0 parks the fragments (the same in every warp) in
  // shared memory; the first tile's barrier publishes them.
  uint2* s_q = reinterpret_cast<uint2*>(smem + G_::STAGES * G_::STAGE);
  if constexpr (G_::QSMEM) {
    if (warp == 0) {
#pragma unroll
      for (int k = 0; k < G_::KSTEPS; ++k) s_q[k * 32 + lane] = make_uint2(qb[k][0], qb[k][1]);
    }
  }
  // q's B fragment of k-step k (register or shared memory).
  auto q_frag = [&](int k) {
    if constexpr (G_::QSMEM) return s_q[k * 32 + lane];
    return make_uint2(qb[k][0], qb[k][1]);
  };
  const int wr = 16 * warp;  // the warp's first tile row
  for (int it = 0; it < ntiles; ++it) {
    CpAsyncWait<kStages - 2>();
    __syncthreads();
    if (it + kStages - 1 < ntiles) load_tile(it + kStages - 1, (it + kStages - 1) % kStages);
    CpAsyncCommit();
    const int tok0 = it * kTcTile + wr;  // partition-local token of tile row wr
    if (tok0 >= n) continue;             // warp-uniform: nothing of this warp's here
    const uint8_t* st = smem + (it % kStages) * G_::STAGE;
    const float* s_ks = reinterpret_cast<const float*>(st + G_::STAGE_K + G_::STAGE_V);
    const float* s_vs = s_ks + kTcTile;
    const int r0 = wr + g, r1 = wr + 8 + g;  // this lane's tile rows (tokens)

    // S^T = K . Q^T over kChains independent accumulators.
    float acc[kChains][4];
#pragma unroll
    for (int c = 0; c < kChains; ++c) acc[c][0] = acc[c][1] = acc[c][2] = acc[c][3] = 0.0f;
    const uint8_t* krow0 = st + r0 * G_::KROW;
    const uint8_t* krow1 = st + r1 * G_::KROW;
    // head_dim 256 (q from shared memory): two spans at a time, so that the
    // K chunk loads are not all hoisted into registers.
#pragma unroll(G_::QSMEM ? 2 : G_::KSPANS)
    for (int sp = 0; sp < G_::KSPANS; ++sp) {
      const uint4 x0 = *reinterpret_cast<const uint4*>(krow0 + SwzK<G_::KCH>(r0, 4 * sp + t) * 16);
      const uint4 x1 = *reinterpret_cast<const uint4*>(krow1 + SwzK<G_::KCH>(r1, 4 * sp + t) * 16);
      if constexpr (!K8) {
        const uint2 q0 = q_frag(2 * sp), q1 = q_frag(2 * sp + 1);
        Mma16816<kQkBf16>(acc[(2 * sp) % kChains], x0.x, x1.x, x0.y, x1.y, q0.x, q0.y);
        Mma16816<kQkBf16>(acc[(2 * sp + 1) % kChains], x0.z, x1.z, x0.w, x1.w, q1.x, q1.y);
      } else {
        const uint32_t w0[4] = {x0.x, x0.y, x0.z, x0.w}, w1[4] = {x1.x, x1.y, x1.z, x1.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          uint32_t lo0, hi0, lo1, hi1;
          Fp8x4ToH2x2(w0[j], lo0, hi0);
          Fp8x4ToH2x2(w1[j], lo1, hi1);
          const uint2 q = q_frag(4 * sp + j);
          Mma16816<false>(acc[(4 * sp + j) % kChains], lo0, lo1, hi0, hi1, q.x, q.y);
        }
      }
    }
    float s[4];  // tokens r0 (s[0], s[1]) and r1 (s[2], s[3]); heads 2t, 2t+1
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      s[i] = acc[0][i];
#pragma unroll
      for (int c = 1; c < kChains; ++c) s[i] += acc[c][i];
    }

    // Online softmax on the fragments.
    float sc0 = p.q_scale, sc1 = p.q_scale;
    if constexpr (K8) {
      sc0 *= s_ks[r0];
      sc1 *= s_ks[r1];
    }
    const bool in0 = tok0 + g < n, in1 = tok0 + 8 + g < n;
    float x[4] = {in0 ? s[0] * sc0 : -INFINITY, in0 ? s[1] * sc0 : -INFINITY,
                  in1 ? s[2] * sc1 : -INFINITY, in1 ? s[3] * sc1 : -INFINITY};
    float alpha[2], m_use[2];
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      float mt = fmaxf(x[e], x[e + 2]);
      mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, 4));
      mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, 8));
      mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, 16));
      const float m_new = fmaxf(m_run[e], mt);
      m_use[e] = m_new == -INFINITY ? 0.0f : m_new;
      alpha[e] = Exp2Ftz(m_run[e] - m_use[e]);
      m_run[e] = m_new;
    }
    float pr[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) pr[i] = Exp2Ftz(x[i] - m_use[i % 2]);
#pragma unroll
    for (int e = 0; e < 2; ++e) l_run[e] = l_run[e] * alpha[e] + (pr[e] + pr[e + 2]);
    if constexpr (V8) {
      const float vs0 = s_vs[r0], vs1 = s_vs[r1];  // 0 past the end (zero-filled)
      float vt = fmaxf(vs0, vs1);
      vt = fmaxf(vt, __shfl_xor_sync(0xffffffffu, vt, 4));
      vt = fmaxf(vt, __shfl_xor_sync(0xffffffffu, vt, 8));
      vt = fmaxf(vt, __shfl_xor_sync(0xffffffffu, vt, 16));
      const float w_new = fmaxf(w_run, vt);  // the same in every lane
      if (w_new > w_run) {  // then w_new > 0
        rw = __fdividef(1.0f, w_new);
        const float r = w_run * rw;  // O is kept in units of w
        alpha[0] *= r;
        alpha[1] *= r;
        w_run = w_new;
      }
      pr[0] *= vs0 * rw;
      pr[1] *= vs0 * rw;
      pr[2] *= vs1 * rw;
      pr[3] *= vs1 * rw;
    }
    if (__any_sync(0xffffffffu, alpha[0] != 1.0f || alpha[1] != 1.0f)) {
#pragma unroll
      for (int i = 0; i < G_::MT; ++i) {
        o[i][0] *= alpha[0];
        o[i][1] *= alpha[1];
        o[i][2] *= alpha[0];
        o[i][3] *= alpha[1];
      }
    }
    // P^T's B fragments: b0 = tokens 2t, 2t+1 of head g, b1 = tokens 2t+8, 2t+9.
    const uint32_t pb0 = MovTrans(Pack2<kPvBf16>(pr[0], pr[1]));
    const uint32_t pb1 = MovTrans(Pack2<kPvBf16>(pr[2], pr[3]));

    // O^T += V^T . P^T
    const uint8_t* vrows = st + G_::STAGE_K;
    if constexpr (!V8) {
      // Matrices: tokens 0-7 / 8-15 (mi & 1) x chunk 2i / 2i+1 (mi >> 1).
      const int mi = lane >> 3, ri = lane & 7;
      const int r = wr + (mi & 1) * 8 + ri;
#pragma unroll
      for (int i = 0; i < G_::MT; ++i) {
        uint32_t v[4];
        LdsmX4T(v, vrows + r * G_::VROW + SwzV<false, G_::VCH>(r, 2 * i + (mi >> 1)) * 16);
        Mma16816<kPvBf16>(o[i], v[0], v[2], v[1], v[3], pb0, pb1);
      }
    } else {
      const int rv = wr + 2 * t;
      const int rows[4] = {rv, rv + 1, rv + 8, rv + 9};
#pragma unroll
      for (int sp = 0; sp < HD / 32; ++sp) {
        uint32_t wv[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          wv[i] = *reinterpret_cast<const uint32_t*>(
              vrows + rows[i] * G_::VROW + SwzV<true, G_::VCH>(rows[i], 2 * sp + (g >> 2)) * 16 +
              (g & 3) * 4);
        }
        // Token pairs (2t, 2t+1) and (2t+8, 2t+9) of dims 4g, 4g+1 (first
        // m-tile) and 4g+2, 4g+3 (second).
        uint32_t a[2][4];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const uint32_t sel = h == 0 ? 0x5140 : 0x7362;
          Fp8x4ToH2x2(__byte_perm(wv[0], wv[1], sel), a[h][0], a[h][1]);
          Fp8x4ToH2x2(__byte_perm(wv[2], wv[3], sel), a[h][2], a[h][3]);
          Mma16816<false>(o[2 * sp + h], a[h][0], a[h][1], a[h][2], a[h][3], pb0, pb1);
        }
      }
    }
  }
  CpAsyncWait<0>();
  __syncthreads();  // the pipeline's shared memory is reused below

#pragma unroll
  for (int e = 0; e < 2; ++e) {
    l_run[e] += __shfl_xor_sync(0xffffffffu, l_run[e], 4);
    l_run[e] += __shfl_xor_sync(0xffffffffu, l_run[e], 8);
    l_run[e] += __shfl_xor_sync(0xffffffffu, l_run[e], 16);
  }
  float* s_acc = reinterpret_cast<float*>(smem);  // [kWarps][kTcRows][HD]
  float* s_ml = s_acc + kWarps * kTcRows * HD;    // [kWarps][kTcRows][2]
  const float wscale = V8 ? w_run : 1.0f;
#pragma unroll
  for (int i = 0; i < G_::MT; ++i) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int head = 2 * t + (e & 1), hi = e >> 1;  // hi: row g + 8
      const int d = V8 ? (i / 2) * 32 + 4 * g + 2 * (i % 2) + hi : 16 * i + 8 * hi + g;
      s_acc[(warp * kTcRows + head) * HD + d] = o[i][e] * wscale;
    }
  }
  if (g == 0) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      s_ml[(warp * kTcRows + 2 * t + e) * 2] = m_run[e];
      s_ml[(warp * kTcRows + 2 * t + e) * 2 + 1] = l_run[e];
    }
  }
  __syncthreads();
  MergeWarpsToWorkspace<HD, kTcRows, BF16>(p, s_acc, s_ml, G, b, kvh, w.part, tid);
}

template <int HD, bool BF16>
__global__ void __launch_bounds__(HD) AttnCombineKernel(const __grid_constant__ AttnParams p) {
  const uint32_t qh = blockIdx.x, b = blockIdx.y, d = threadIdx.x;
  const int len = __ldg(p.seq_lens + b);
  const int parts = (len + static_cast<int>(p.part_tokens) - 1) / static_cast<int>(p.part_tokens);
  const uint64_t row0 = (uint64_t{b} * p.num_q_heads + qh) * p.parts;
  float m = -INFINITY;
  for (int i = 0; i < parts; ++i) m = fmaxf(m, p.ws_ml[2 * (row0 + i)]);
  const float m_use = m == -INFINITY ? 0.0f : m;
  float l = 0.0f, acc = 0.0f;
  for (int i = 0; i < parts; ++i) {
    const float w = exp2f(p.ws_ml[2 * (row0 + i)] - m_use);
    l += w * p.ws_ml[2 * (row0 + i) + 1];
    acc += w * p.ws_acc[(row0 + i) * HD + d];
  }
  const float o = acc / l;
  static_cast<uint16_t*>(p.out)[(uint64_t{b} * p.num_q_heads + qh) * HD + d] = StoreOut<BF16>(o);
}

// Raises a kernel's dynamic shared-memory limit, once per device; `done` is
// the kernel's own bit set of devices already raised.
absl::Status AllowSharedMemory(const void* kernel, int bytes, std::atomic<uint64_t>& done) {
  int dev = 0;
  KVTIER_CUDA_RETURN_IF_ERROR(cudaGetDevice(&dev));
  const uint64_t bit = dev < 64 ? uint64_t{1} << dev : 0;
  if (bit != 0 && (done.load(std::memory_order_acquire) & bit) != 0) return absl::OkStatus();
  KVTIER_CUDA_RETURN_IF_ERROR(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  done.fetch_or(bit, std::memory_order_acq_rel);
  return absl::OkStatus();
}

template <typename Kernel>
absl::Status LaunchPartial(Kernel* kernel, int smem_bytes, std::atomic<uint64_t>& raised,
                           const AttnParams& a, uint32_t batch, cudaStream_t stream) {
  KVTIER_RETURN_IF_ERROR(
      AllowSharedMemory(reinterpret_cast<const void*>(kernel), smem_bytes, raised));
  const dim3 grid(a.cache.num_kv_heads, a.parts, batch);
  kernel<<<grid, kThreads, smem_bytes, stream>>>(a);
  KVTIER_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return absl::OkStatus();
}

// Groups of up to 4 q heads run the GP = 4 CUDA-core kernel (smaller groups
// compute padding heads with zero q, which costs arithmetic, not memory
// traffic). The tensor-core kernel serves every group (rows padded to 16).
template <int HD, bool K8, bool V8, bool BF16>
absl::Status LaunchTyped(const AttnParams& a, uint32_t batch, cudaStream_t stream) {
  const AttentionKernel k = a.kernel;  // resolved by PrepareAttention
  static std::atomic<uint64_t> raised_tc{0}, raised4{0}, raised8{0};  // per instantiation
  const absl::Status st =
      k == AttentionKernel::kTensorCore
          ? LaunchPartial(&AttnPartialTcKernel<HD, K8, V8, BF16>, TcGeometry<HD, K8, V8>::SMEM,
                          raised_tc, a, batch, stream)
      : a.group <= 4 ? LaunchPartial(&AttnPartialKernel<HD, 4, K8, V8, BF16>,
                                     Geometry<HD, 4, K8, V8>::SMEM, raised4, a, batch, stream)
                     : LaunchPartial(&AttnPartialKernel<HD, 8, K8, V8, BF16>,
                                     Geometry<HD, 8, K8, V8>::SMEM, raised8, a, batch, stream);
  KVTIER_RETURN_IF_ERROR(st);
  if (a.parts == 1) return absl::OkStatus();  // the partial kernel wrote the output
  AttnCombineKernel<HD, BF16><<<dim3(a.num_q_heads, batch), HD, 0, stream>>>(a);
  KVTIER_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return absl::OkStatus();
}

// The one dispatch point from runtime dtypes to template arguments (head_dim:
// KVTIER_DISPATCH_HEAD_DIM in PagedDecodeAttention).
template <int HD>
absl::Status LaunchHd(const AttnParams& a, uint32_t batch, bool k8, bool v8, bool bf16,
                      cudaStream_t stream) {
  if (!k8 && !v8) return bf16 ? LaunchTyped<HD, false, false, true>(a, batch, stream)
                              : LaunchTyped<HD, false, false, false>(a, batch, stream);
  if (!k8 && v8) return bf16 ? LaunchTyped<HD, false, true, true>(a, batch, stream)
                             : LaunchTyped<HD, false, true, false>(a, batch, stream);
  if (k8 && v8) return bf16 ? LaunchTyped<HD, true, true, true>(a, batch, stream)
                            : LaunchTyped<HD, true, true, false>(a, batch, stream);
  return absl::InvalidArgumentError("attention: fp8 K with 16-bit V is not supported");
}

// CTAs per SM of the tensor-core instantiation for these dtypes
// (TcGeometry::CTAS: shared memory and __launch_bounds__ allow that many).
absl::StatusOr<int> TcCtasPerSm(uint32_t head_dim, bool k8, bool v8) {
  int ctas = 0;
  KVTIER_RETURN_IF_ERROR(KVTIER_DISPATCH_HEAD_DIM(head_dim, HD, {
    ctas = k8 ? TcGeometry<HD, true, true>::CTAS
              : (v8 ? TcGeometry<HD, false, true>::CTAS : TcGeometry<HD, false, false>::CTAS);
  }));
  return ctas;
}

// SMs of the current device, looked up once per device. Without a device
// (CPU-only validation and workspace sizing) an H100's 132: nothing launches
// then, and DecodeAttentionWorkspaceBytes and PagedDecodeAttention still agree.
uint32_t CurrentDeviceSms() {
  constexpr uint32_t kNoDeviceSms = 132;
  static std::atomic<uint32_t> cached[64] = {};
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) {
    (void)cudaGetLastError();  // not left for a later launch check to find
    return kNoDeviceSms;
  }
  if (dev >= 0 && dev < 64) {
    if (const uint32_t n = cached[dev].load(std::memory_order_relaxed); n != 0) return n;
  }
  int sms = 0;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || sms <= 0) {
    (void)cudaGetLastError();
    return kNoDeviceSms;
  }
  if (dev >= 0 && dev < 64) cached[dev].store(static_cast<uint32_t>(sms), std::memory_order_relaxed);
  return static_cast<uint32_t>(sms);
}

// The CUDA-core kernel's rule (runs 3a/3b): the smallest power of two from
// kMinPart up to kCudaCoreMaxPart leaving at most kTargetParts partitions.
uint32_t CudaCorePartitionTokens(uint32_t batch, uint32_t num_kv_heads, uint64_t max_tokens) {
  const uint64_t work = uint64_t{batch} * num_kv_heads * max_tokens;
  uint32_t part = kMinPart;
  while (part < kCudaCoreMaxPart && work / part > kTargetParts) part *= 2;
  return part;
}

absl::StatusOr<AttnParams> PrepareAttention(const PagedKvLayout& cache,
                                            const DecodeAttentionParams& p) {
  KVTIER_RETURN_IF_ERROR(ValidateDecodeAttention(cache, p));
  KVTIER_RETURN_IF_ERROR(CheckHeadDim(cache.head_dim, "attention: "));
  const uint32_t bs = cache.block_size;
  KVTIER_RETURN_IF_ERROR(CheckAttentionBlockSize(bs, "attention: "));
  const uint32_t group = p.num_q_heads / cache.num_kv_heads;
  if (group > kAttentionMaxGroup) {
    return absl::InvalidArgumentError(absl::StrCat("attention: ", group,
                                                   " q heads per kv head; at most ",
                                                   kAttentionMaxGroup));
  }
  if (cache.k_dtype == DType::kFP8E4M3 && cache.v_dtype != DType::kFP8E4M3) {
    return absl::InvalidArgumentError("attention: fp8 K with 16-bit V is not supported");
  }
  if (p.batch > 65535) return absl::InvalidArgumentError("attention: batch > 65535");
  if (cache.num_kv_heads > 2147483647u) {
    return absl::InvalidArgumentError("attention: num_kv_heads too large");
  }
  // The kernels' row offsets are 32x32->64-bit products (CtaPartition).
  constexpr int64_t kMaxStride = int64_t{1} << 32;
  if (cache.stride_block < 0 || cache.stride_block >= kMaxStride || cache.stride_token < 0 ||
      cache.stride_token * (bs - 1) >= kMaxStride) {
    return absl::InvalidArgumentError(
        absl::StrCat("attention: stride_block = ", cache.stride_block, ", stride_token = ",
                     cache.stride_token, "; both must be below 2^32 elements within a block"));
  }
  AttnParams a{};
  a.cache = cache;
  a.q = p.q;
  a.out = p.out;
  a.block_table = p.block_table;
  a.seq_lens = p.seq_lens;
  a.max_blocks_per_seq = p.max_blocks_per_seq;
  a.num_q_heads = p.num_q_heads;
  a.group = group;
  const uint64_t max_tokens = uint64_t{p.max_blocks_per_seq} * bs;
  if (max_tokens > (uint64_t{1} << 30)) {
    return absl::InvalidArgumentError("attention: max_blocks_per_seq * block_size > 2^30");
  }
  if (p.partition_tokens != 0 &&
      (p.partition_tokens % kTile != 0 || p.partition_tokens > kAttentionMaxPartitionTokens)) {
    return absl::InvalidArgumentError(absl::StrCat("attention: partition_tokens = ",
                                                   p.partition_tokens, " is not 0 or a multiple of ",
                                                   kTile, " up to ", kAttentionMaxPartitionTokens));
  }
  if (p.kernel != AttentionKernel::kAuto && p.kernel != AttentionKernel::kCudaCore &&
      p.kernel != AttentionKernel::kTensorCore) {
    return absl::InvalidArgumentError("attention: unknown kernel choice");
  }
  a.kernel = p.kernel != AttentionKernel::kAuto ? p.kernel
             : group >= kTensorCoreMinGroup
                 ? AttentionKernel::kTensorCore
                 : AttentionKernel::kCudaCore;
  if (p.partition_tokens != 0) {
    a.part_tokens = p.partition_tokens;
  } else if (a.kernel == AttentionKernel::kTensorCore) {
    KVTIER_ASSIGN_OR_RETURN(const int ctas_per_sm,
                            TcCtasPerSm(cache.head_dim, cache.k_dtype == DType::kFP8E4M3,
                                        cache.v_dtype == DType::kFP8E4M3));
    a.part_tokens = DecodeAttentionPartitionTokens(p.batch, cache.num_kv_heads, max_tokens,
                                                   CurrentDeviceSms(),
                                                   static_cast<uint32_t>(ctas_per_sm));
  } else {
    a.part_tokens = CudaCorePartitionTokens(p.batch, cache.num_kv_heads, max_tokens);
  }
  a.parts = static_cast<uint32_t>((max_tokens + a.part_tokens - 1) / a.part_tokens);
  if (a.parts > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("attention: ", a.parts, " partitions of ",
                                                   a.part_tokens, " tokens; at most 65535"));
  }
  a.layer = p.layer;
  a.bs_shift = static_cast<uint32_t>(__builtin_ctz(bs));
  a.q_scale = p.sm_scale * kLog2e;
  return a;
}

size_t WorkspaceFor(const AttnParams& a, uint32_t batch) {
  const uint64_t rows = uint64_t{batch} * a.num_q_heads * a.parts;
  return rows * (a.cache.head_dim + 2) * sizeof(float);
}

// PrepareAttention for shape-only questions: any non-null placeholder is
// fine for the pointers.
absl::StatusOr<AttnParams> PrepareShape(const PagedKvLayout& cache, const DecodeAttentionParams& p) {
  DecodeAttentionParams q = p;
  static const int kDummy = 0;
  if (q.q == nullptr) q.q = &kDummy;
  if (q.out == nullptr) q.out = const_cast<int*>(&kDummy);
  if (q.block_table == nullptr) q.block_table = &kDummy;
  if (q.seq_lens == nullptr) q.seq_lens = &kDummy;
  return PrepareAttention(cache, q);
}

}  // namespace

uint32_t DecodeAttentionPartitionTokens(uint32_t batch, uint32_t num_kv_heads,
                                        uint64_t max_tokens, uint32_t sms, uint32_t ctas_per_sm) {
  const uint64_t slots = uint64_t{std::max(sms, 1u)} * std::max(ctas_per_sm, 1u);
  uint32_t best = kAttentionMinPartitionTokens;
  for (uint32_t part = kAttentionMinPartitionTokens; part <= kAttentionMaxPartitionTokens;
       part *= 2) {
    const uint64_t parts = (max_tokens + part - 1) / part;
    const uint64_t ctas = uint64_t{batch} * num_kv_heads * parts;
    if (ctas < sms) break;  // an idle SM; larger partitions leave more idle
    const uint64_t waves = (ctas + slots - 1) / slots;
    if (ctas <= slots || static_cast<double>(ctas) / static_cast<double>(waves * slots) >=
                             kAttentionMinLastWaveFill) {
      best = part;
    }
    if (parts == 1) break;  // larger partitions are the same partition
  }
  return best;
}

absl::StatusOr<uint32_t> DecodeAttentionPartitionTokensFor(const PagedKvLayout& cache,
                                                           const DecodeAttentionParams& p) {
  KVTIER_ASSIGN_OR_RETURN(AttnParams a, PrepareShape(cache, p));
  return a.part_tokens;
}

absl::StatusOr<size_t> DecodeAttentionWorkspaceBytes(const PagedKvLayout& cache,
                                                     const DecodeAttentionParams& p) {
  KVTIER_ASSIGN_OR_RETURN(AttnParams a, PrepareShape(cache, p));
  return WorkspaceFor(a, p.batch);
}

absl::Status PagedDecodeAttention(const PagedKvLayout& cache, const DecodeAttentionParams& p,
                                  void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  KVTIER_ASSIGN_OR_RETURN(AttnParams a, PrepareAttention(cache, p));
  const size_t need = WorkspaceFor(a, p.batch);
  if (workspace == nullptr || workspace_bytes < need) {
    return absl::InvalidArgumentError(absl::StrCat("attention: workspace of ", workspace_bytes,
                                                   " bytes, need ", need));
  }
  if (reinterpret_cast<uintptr_t>(workspace) % 16 != 0) {
    return absl::InvalidArgumentError("attention: workspace is not 16-byte aligned");
  }
  const uint64_t rows = uint64_t{p.batch} * a.num_q_heads * a.parts;
  a.ws_acc = static_cast<float*>(workspace);
  a.ws_ml = a.ws_acc + rows * cache.head_dim;
  const bool k8 = cache.k_dtype == DType::kFP8E4M3, v8 = cache.v_dtype == DType::kFP8E4M3;
  const bool bf16 = p.q_dtype == DType::kBF16;
  return KVTIER_DISPATCH_HEAD_DIM(cache.head_dim, HD,
                                  { return LaunchHd<HD>(a, p.batch, k8, v8, bf16, stream); });
}

}  // namespace kvtier::kernels
