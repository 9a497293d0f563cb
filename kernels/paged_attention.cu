#include "kernels/paged_attention.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <atomic>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "kernels/cuda_status.h"

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
// - MODE (AttentionKernel) only changes how rows reach shared memory: the
//   CTA pipeline above, or per-warp pipelines (cp.async, or bulk copies on
//   mbarriers) with no CTA barrier in the loop. Measured equal or slower on
//   an H100 (kernels/README.md, run 4), so kAuto is the CTA pipeline.

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
constexpr int kTargetParts = 2048;
constexpr float kLog2e = 1.4426950408889634f;
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

// Compile-time geometry of one instantiation.
template <int HD, int GP, bool K8, bool V8>
struct Geometry {
  static constexpr int TG = HD / kVec;                 // lanes per token row
  static constexpr int NG = 32 / TG;                   // token groups per warp
  static constexpr int U = kTile / (kWarps * NG);      // tokens per group per tile
  static constexpr int N = U * GP;                     // partial dots per lane per tile
  static constexpr int CF = N / TG;                    // full dots per lane after the reduce
  static constexpr int KB = K8 ? 1 : 2, VB = V8 ? 1 : 2;  // bytes per element
  static constexpr int KROW = HD * KB, VROW = HD * VB;    // bytes per row
  static constexpr int KCH = KROW / 16, VCH = VROW / 16;  // 16-byte chunks per row
  static constexpr int STAGE_K = kTile * KROW;
  static constexpr int STAGE_V = kTile * VROW;
  static constexpr int STAGE = STAGE_K + STAGE_V + 2 * kTile * 4;  // rows + K, V scales
  // One stage being computed, the others in flight.
  static constexpr int STAGES = 1 + (kInFlightBytes + STAGE_K + STAGE_V - 1) / (STAGE_K + STAGE_V);
  static constexpr int PIPE = STAGES * STAGE;
  static constexpr int MERGE = kWarps * GP * (HD + 2) * 4;  // per-warp states at the end
  static constexpr int SMEM = PIPE > MERGE ? PIPE : MERGE;
  // Warp pipelines: a warp's tile is its WT rows of a CTA tile; each warp
  // keeps kInFlightBytes / kWarps of rows in flight in its own stages.
  static constexpr int WT = NG * U;
  static constexpr int WSTAGE = WT * (KROW + VROW);
  static constexpr int WSTAGES = 1 + (kInFlightBytes / kWarps + WSTAGE - 1) / WSTAGE;
  static constexpr int WPIPE = kWarps * WSTAGES * WSTAGE;
  static constexpr int WSMEM = WPIPE > MERGE ? WPIPE : MERGE;
  static_assert(WT * kWarps == kTile && 2 * WT <= 32, "a lane per K and V row of a warp tile");
  static_assert((WT * KCH) % 32 == 0 && (WT * VCH) % 32 == 0,
                "every lane issues the same number of 16-byte copies per warp tile");
  static_assert(WSTAGE % 16 == 0 && WSTAGES <= 32, "16-byte aligned warp stages");

  static_assert(32 % TG == 0 || TG == 32, "a token row is split over the lanes of one warp");
  static_assert(TG <= 32 && NG >= 1 && U >= 1, "tile must cover every token group");
  static_assert(N % TG == 0 && CF >= 1, "reduce-scatter leaves whole dots per lane");
  static_assert(TG / U == 4 && GP / CF == 4,
                "lanes l and l^4, l^8, l^16 hold the same q heads (see kernel)");
  static_assert((kTile * KCH) % kThreads == 0 && (kTile * VCH) % kThreads == 0,
                "every thread issues the same number of 16-byte copies per tile");
  static_assert(STAGE_K % 16 == 0 && STAGE % 16 == 0, "16-byte aligned stages");
};

__device__ __forceinline__ void CpAsync16(void* dst, const void* src, bool valid) {
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  // src-size 0 fills the 16 bytes with zeros (rows past the sequence end).
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(src),
               "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void CpAsync4(void* dst, const void* src, bool valid) {
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(s), "l"(src),
               "r"(valid ? 4 : 0));
}
__device__ __forceinline__ void CpAsyncCommit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

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

// How K/V rows reach shared memory (AttentionKernel minus kAuto).
enum Mode : int {
  kModeCta = 0,   // CTA tiles of kTile rows, cp.async by all threads, __syncthreads per tile
  kModeWarp = 1,  // warp tiles of WT rows, each warp its own cp.async pipeline
  kModeBulk = 2,  // warp tiles, cp.async.bulk per contiguous run of rows + one mbarrier per stage
};

__device__ __forceinline__ void MbarInit(uint64_t* bar, uint32_t count) {
#if __CUDA_ARCH__ >= 900
  const uint32_t b = static_cast<uint32_t>(__cvta_generic_to_shared(bar));
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(b), "r"(count) : "memory");
  // Makes the initialized barrier visible to the copy engine (async proxy).
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void MbarArriveExpectTx(uint64_t* bar, uint32_t bytes) {
#if __CUDA_ARCH__ >= 900
  const uint32_t b = static_cast<uint32_t>(__cvta_generic_to_shared(bar));
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(b), "r"(bytes)
               : "memory");
#endif
}
__device__ __forceinline__ void MbarWait(uint64_t* bar, uint32_t parity) {
#if __CUDA_ARCH__ >= 900
  const uint32_t b = static_cast<uint32_t>(__cvta_generic_to_shared(bar));
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        " selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(b), "r"(parity)
        : "memory");
  } while (!done);
#endif
}
// One bulk copy (the Hopper copy engine) of `bytes` (a multiple of 16, both
// addresses 16-byte aligned) that completes `bytes` of the mbarrier's
// transaction count.
__device__ __forceinline__ void BulkCopy(void* dst, const void* src, uint32_t bytes,
                                         uint64_t* bar) {
#if __CUDA_ARCH__ >= 900
  const uint32_t d = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  const uint32_t b = static_cast<uint32_t>(__cvta_generic_to_shared(bar));
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::
          "r"(d),
      "l"(src), "r"(bytes), "r"(b)
      : "memory");
#endif
}

template <int HD, int GP, bool K8, bool V8, bool BF16, int MODE>
__global__ void __launch_bounds__(kThreads, GP <= 4 ? 4 : 2)
    AttnPartialKernel(const __grid_constant__ AttnParams p) {
  using G_ = Geometry<HD, GP, K8, V8>;
  constexpr int TG = G_::TG, NG = G_::NG, U = G_::U, N = G_::N, CF = G_::CF;
  constexpr int WT = G_::WT, WS = G_::WSTAGES;
  extern __shared__ __align__(16) uint8_t smem[];
  __shared__ int32_t s_block[kMaxPart + 1];
  __shared__ __align__(16) float s_p[kWarps][NG * N];  // probabilities (x V scale)
  __shared__ __align__(16) float s_alpha[kWarps][GP];  // per-head rescale of this tile
  __shared__ __align__(8) uint64_t s_bar[MODE == kModeBulk ? kWarps * WS : 1];

#if __CUDA_ARCH__ < 900
  if constexpr (MODE == kModeBulk) {
    __trap();  // never launched: the launcher checks the code's architecture
  } else
#endif
  {
  const PagedKvLayout& c = p.cache;
  // kv head fastest: the CTAs of all kv heads of one (sequence, partition)
  // run side by side and read neighbouring rows of the same cache blocks.
  const uint32_t b = blockIdx.z, kvh = blockIdx.x, part = blockIdx.y;
  const int len = __ldg(p.seq_lens + b);
  const int t_begin = static_cast<int>(part * p.part_tokens);
  if (t_begin >= len) return;
  const int n = min(static_cast<int>(p.part_tokens), len - t_begin);
  const int G = static_cast<int>(p.group);
  const uint32_t shift = p.bs_shift;
  const uint32_t bs_mask = (1u << shift) - 1;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int grp = lane / TG, lt = lane % TG;

  const int first_blk = t_begin >> shift;
  const int nblk = ((t_begin + n - 1) >> shift) - first_blk + 1;
  const int32_t* table = p.block_table + uint64_t{b} * p.max_blocks_per_seq + first_blk;
  for (int i = tid; i < nblk; i += kThreads) s_block[i] = __ldg(table + i);
  uint64_t* bar = s_bar + (MODE == kModeBulk ? warp * WS : 0);
  if constexpr (MODE == kModeBulk) {
    if (lane < WS) MbarInit(bar + lane, 1);
  }

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
  __syncthreads();  // s_block, mbarrier initialization

  const uint8_t* kbase = static_cast<const uint8_t*>(c.k_layers[p.layer]);
  const uint8_t* vbase = static_cast<const uint8_t*>(c.v_layers[p.layer]);
  const float* kscale = K8 ? c.k_scale_layers[p.layer] : nullptr;
  const float* vscale = V8 ? c.v_scale_layers[p.layer] : nullptr;
  auto k_src = [&](int t) {  // partition-local token -> its K row
    const int abs_t = t_begin + t;
    const uint32_t blk = s_block[(abs_t >> shift) - first_blk];
    return kbase + int64_t{G_::KB} * c.k_elem(blk, abs_t & bs_mask, kvh, 0);
  };
  auto v_src = [&](int t) {
    const int abs_t = t_begin + t;
    const uint32_t blk = s_block[(abs_t >> shift) - first_blk];
    return vbase + int64_t{G_::VB} * c.v_elem(blk, abs_t & bs_mask, kvh, 0);
  };

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

  if constexpr (MODE == kModeCta) {
    // Producer: every thread issues the same number of 16-byte copies.
    auto load_tile = [&](int tile, int stage) {
      uint8_t* st = smem + stage * G_::STAGE;
      const int t0 = tile * kTile;
#pragma unroll
      for (int k = 0; k < kTile * G_::KCH / kThreads; ++k) {
        const int i = tid + k * kThreads;
        const int r = i / G_::KCH, col = i % G_::KCH;
        const bool ok = t0 + r < n;
        CpAsync16(st + r * G_::KROW + col * 16, k_src(ok ? t0 + r : 0) + col * 16, ok);
      }
#pragma unroll
      for (int k = 0; k < kTile * G_::VCH / kThreads; ++k) {
        const int i = tid + k * kThreads;
        const int r = i / G_::VCH, col = i % G_::VCH;
        const bool ok = t0 + r < n;
        CpAsync16(st + G_::STAGE_K + r * G_::VROW + col * 16, v_src(ok ? t0 + r : 0) + col * 16,
                  ok);
      }
      if constexpr (K8 || V8) {
        // Threads [0, kTile) copy K scales, [kTile, 2 kTile) V scales.
        const int r = tid % kTile;
        const bool is_v = tid >= kTile;
        if (tid < 2 * kTile && (is_v ? V8 : K8)) {
          const bool ok = t0 + r < n;
          const int abs_t = t_begin + (ok ? t0 + r : 0);
          const uint32_t blk = s_block[(abs_t >> shift) - first_blk];
          const float* src = (is_v ? vscale : kscale) + c.scale_index(blk, kvh);
          CpAsync4(st + G_::STAGE_K + G_::STAGE_V + (is_v ? kTile : 0) * 4 + r * 4, src, ok);
        }
      }
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
  } else {
    // Warp w owns rows [(j * kWarps + w) * WT, +WT) of the partition (its
    // tile j) and runs its own WS-deep pipeline in its slice of `smem`:
    // no barrier between warps until the merge.
    uint8_t* wst = smem + warp * WS * G_::WSTAGE;
    const int nrows = (n + WT - 1) / WT;
    const int ntw = nrows > warp ? (nrows - warp + kWarps - 1) / kWarps : 0;
    auto issue = [&](int j, int stage) {
      const int t0 = (j * kWarps + warp) * WT;
      uint8_t* st = wst + stage * G_::WSTAGE;
      if constexpr (MODE == kModeBulk) {
        // Lanes [0, WT) take K rows, [WT, 2 WT) V rows. A row that directly
        // follows the previous lane's row in device memory (HND blocks) joins
        // its run; the lane that starts a run copies all of it in one go.
        const int r = lane % WT;
        const bool is_v = lane >= WT;
        const bool ok = lane < 2 * WT && t0 + r < n;
        const int rowb = is_v ? G_::VROW : G_::KROW;
        const uint8_t* src = ok ? (is_v ? v_src(t0 + r) : k_src(t0 + r)) : nullptr;
        const uint8_t* prev = reinterpret_cast<const uint8_t*>(
            __shfl_up_sync(0xffffffffu, reinterpret_cast<uint64_t>(src), 1));
        const bool joins = ok && r > 0 && src == prev + rowb;
        const uint32_t okm = __ballot_sync(0xffffffffu, ok);
        const uint32_t jm = __ballot_sync(0xffffffffu, joins);
        if (lane == 0) {
          MbarArriveExpectTx(bar + stage, __popc(okm & ((1u << WT) - 1)) * G_::KROW +
                                              __popc(okm >> WT) * G_::VROW);
        }
        __syncwarp();
        if (ok && !joins) {
          const uint32_t rows = __ffs(~(jm >> (lane + 1)));  // 1 + rows that join
          BulkCopy(st + (is_v ? WT * G_::KROW + r * G_::VROW : r * G_::KROW), src, rows * rowb,
                   bar + stage);
        }
      } else {
#pragma unroll
        for (int k = 0; k < WT * G_::KCH / 32; ++k) {
          const int i = lane + k * 32;
          const int r = i / G_::KCH, col = i % G_::KCH;
          const bool ok = t0 + r < n;
          CpAsync16(st + r * G_::KROW + col * 16, k_src(ok ? t0 + r : 0) + col * 16, ok);
        }
#pragma unroll
        for (int k = 0; k < WT * G_::VCH / 32; ++k) {
          const int i = lane + k * 32;
          const int r = i / G_::VCH, col = i % G_::VCH;
          const bool ok = t0 + r < n;
          CpAsync16(st + WT * G_::KROW + r * G_::VROW + col * 16, v_src(ok ? t0 + r : 0) + col * 16,
                    ok);
        }
      }
    };
    // This lane's scales for tile j, loaded a tile ahead (they are not in the pipeline).
    auto load_scales = [&](int j, float& ks, float& vs) {
      ks = 1.0f;
      vs = 1.0f;
      if constexpr (K8 || V8) {
        const int t = (j * kWarps + warp) * WT + grp * U + u_l;
        if (t < n) {
          const int abs_t = t_begin + t;
          const int64_t idx = c.scale_index(s_block[(abs_t >> shift) - first_blk], kvh);
          if constexpr (K8) ks = __ldg(kscale + idx);
          if constexpr (V8) vs = __ldg(vscale + idx);
        }
      }
    };
#pragma unroll
    for (int s = 0; s < WS - 1; ++s) {
      if (s < ntw) issue(s, s);
      if constexpr (MODE == kModeWarp) CpAsyncCommit();
    }
    float ks_next, vs_next;
    load_scales(0, ks_next, vs_next);
    for (int j = 0; j < ntw; ++j) {
      // Stage (j - 1) % WS was read by tile j - 1, which ended with __syncwarp.
      if (j + WS - 1 < ntw) issue(j + WS - 1, (j + WS - 1) % WS);
      const float ks = ks_next, vs = vs_next;
      if (j + 1 < ntw) load_scales(j + 1, ks_next, vs_next);
      const int stage = j % WS;
      uint8_t* st = wst + stage * G_::WSTAGE;
      const int t0 = (j * kWarps + warp) * WT;
      if constexpr (MODE == kModeBulk) {
        MbarWait(bar + stage, (j / WS) & 1);
        if (t0 + WT > n) {
          // Rows past the end were not copied: zero them (0 x stale NaN would
          // poison the sum). Only the warp's last tile; its stage is not reused.
          constexpr int kChunks = WT * (G_::KCH + G_::VCH);
          for (int i = lane; i < kChunks; i += 32) {
            const bool is_v = i >= WT * G_::KCH;
            const int ii = is_v ? i - WT * G_::KCH : i;
            const int r = ii / (is_v ? G_::VCH : G_::KCH), col = ii % (is_v ? G_::VCH : G_::KCH);
            if (t0 + r >= n) {
              *reinterpret_cast<uint4*>(st + (is_v ? WT * G_::KROW + r * G_::VROW : r * G_::KROW) +
                                        col * 16) = make_uint4(0, 0, 0, 0);
            }
          }
          __syncwarp();
        }
      } else {
        CpAsyncCommit();
        CpAsyncWait<WS - 1>();
        __syncwarp();  // every lane's copies of tile j landed
      }
      compute(st, st + WT * G_::KROW, grp * U, t0 + grp * U + u_l < n, ks, vs);
    }
    if constexpr (MODE == kModeWarp) CpAsyncWait<0>();
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
  const uint64_t row0 = (uint64_t{b} * p.num_q_heads + uint64_t{kvh} * G) * p.parts + part;
  for (int i = tid; i < G * HD; i += kThreads) {
    const int g = i / HD, d = i % HD;
    float mx = -INFINITY;
#pragma unroll
    for (int w2 = 0; w2 < kWarps; ++w2) mx = fmaxf(mx, s_ml[(w2 * GP + g) * 2]);
    const float m_use = mx == -INFINITY ? 0.0f : mx;
    float o = 0.0f, sum = 0.0f;
#pragma unroll
    for (int w2 = 0; w2 < kWarps; ++w2) {
      const float f = exp2f(s_ml[(w2 * GP + g) * 2] - m_use);
      o += f * s_acc[(w2 * GP + g) * HD + d];
      sum += f * s_ml[(w2 * GP + g) * 2 + 1];
    }
    const uint64_t r = row0 + uint64_t{static_cast<uint32_t>(g)} * p.parts;
    p.ws_acc[r * HD + d] = o;
    if (d == 0) {
      p.ws_ml[2 * r] = mx;
      p.ws_ml[2 * r + 1] = sum;
    }
  }
  }
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
  uint16_t* out = static_cast<uint16_t*>(p.out) + (uint64_t{b} * p.num_q_heads + qh) * HD + d;
  if constexpr (BF16) {
    *out = __bfloat16_as_ushort(__float2bfloat16_rn(o));
  } else {
    *out = __half_as_ushort(__float2half_rn(o));
  }
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

template <int HD, int GP, bool K8, bool V8, bool BF16, int MODE>
absl::Status LaunchMode(const AttnParams& a, uint32_t batch, cudaStream_t stream) {
  using G_ = Geometry<HD, GP, K8, V8>;
  constexpr int kSmem = MODE == kModeCta ? G_::SMEM : G_::WSMEM;
  auto* kernel = &AttnPartialKernel<HD, GP, K8, V8, BF16, MODE>;
  static std::atomic<uint64_t> raised{0};  // one per instantiation
  KVTIER_RETURN_IF_ERROR(AllowSharedMemory(reinterpret_cast<const void*>(kernel), kSmem, raised));
  const dim3 grid(a.cache.num_kv_heads, a.parts, batch);
  kernel<<<grid, kThreads, kSmem, stream>>>(a);
  KVTIER_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  AttnCombineKernel<HD, BF16><<<dim3(a.num_q_heads, batch), HD, 0, stream>>>(a);
  KVTIER_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return absl::OkStatus();
}

// Whether the current device runs `kernel`'s sm_90 (or later) code, i.e. code
// with bulk copies, rather than the sm_80 code of the same template (a device
// without a matching cubin JIT-compiles the compute_80 PTX).
absl::StatusOr<bool> RunsBulkCode(const void* kernel, std::atomic<uint64_t>& checked,
                                  std::atomic<uint64_t>& yes) {
  int dev = 0;
  KVTIER_CUDA_RETURN_IF_ERROR(cudaGetDevice(&dev));
  const uint64_t bit = dev < 64 ? uint64_t{1} << dev : 0;
  if (bit != 0 && (checked.load(std::memory_order_acquire) & bit) != 0) {
    return (yes.load(std::memory_order_acquire) & bit) != 0;
  }
  cudaFuncAttributes attr{};
  KVTIER_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attr, kernel));
  const bool ok = attr.ptxVersion >= 90;
  if (ok) yes.fetch_or(bit, std::memory_order_acq_rel);
  checked.fetch_or(bit, std::memory_order_acq_rel);
  return ok;
}

// kAuto: the kernel measured fastest on an H100 (run 4a, kernels/README.md):
// the CTA pipeline. The warp pipelines (cp.async or bulk copies) removed the
// per-tile CTA barrier and the consumers' copy issue, and were no faster
// (bulk copies of single 128-256 B NHD rows were slower), so neither was the
// bottleneck.
constexpr AttentionKernel kAutoKernel = AttentionKernel::kCtaPipeline;

template <int HD, int GP, bool K8, bool V8, bool BF16>
absl::Status LaunchTyped(const AttnParams& a, uint32_t batch, cudaStream_t stream) {
  AttentionKernel k = a.kernel == AttentionKernel::kAuto ? kAutoKernel : a.kernel;
  if (k == AttentionKernel::kWarpBulk) {
    static std::atomic<uint64_t> checked{0}, yes{0};
    KVTIER_ASSIGN_OR_RETURN(
        const bool bulk,
        RunsBulkCode(reinterpret_cast<const void*>(&AttnPartialKernel<HD, GP, K8, V8, BF16, kModeBulk>),
                     checked, yes));
    if (bulk) return LaunchMode<HD, GP, K8, V8, BF16, kModeBulk>(a, batch, stream);
    if (a.kernel == AttentionKernel::kWarpBulk) {
      return absl::FailedPreconditionError(
          "attention: the bulk-copy kernel needs sm_90a code for this device");
    }
    k = AttentionKernel::kWarpPipeline;
  }
  if (k == AttentionKernel::kCtaPipeline) {
    return LaunchMode<HD, GP, K8, V8, BF16, kModeCta>(a, batch, stream);
  }
  return LaunchMode<HD, GP, K8, V8, BF16, kModeWarp>(a, batch, stream);
}

template <int HD, int GP>
absl::Status LaunchGp(const AttnParams& a, uint32_t batch, bool k8, bool v8, bool bf16,
                      cudaStream_t stream) {
  if (!k8 && !v8) return bf16 ? LaunchTyped<HD, GP, false, false, true>(a, batch, stream)
                              : LaunchTyped<HD, GP, false, false, false>(a, batch, stream);
  if (!k8 && v8) return bf16 ? LaunchTyped<HD, GP, false, true, true>(a, batch, stream)
                             : LaunchTyped<HD, GP, false, true, false>(a, batch, stream);
  if (k8 && v8) return bf16 ? LaunchTyped<HD, GP, true, true, true>(a, batch, stream)
                            : LaunchTyped<HD, GP, true, true, false>(a, batch, stream);
  return absl::InvalidArgumentError("attention: fp8 K with 16-bit V is not supported");
}

// Groups of up to 4 q heads run the GP = 4 kernel (smaller groups compute
// padding heads with zero q, which costs arithmetic, not memory traffic).
template <int HD>
absl::Status LaunchHd(const AttnParams& a, uint32_t batch, bool k8, bool v8, bool bf16,
                      cudaStream_t stream) {
  if (a.group <= 4) return LaunchGp<HD, 4>(a, batch, k8, v8, bf16, stream);
  return LaunchGp<HD, 8>(a, batch, k8, v8, bf16, stream);
}

absl::StatusOr<AttnParams> PrepareAttention(const PagedKvLayout& cache,
                                            const DecodeAttentionParams& p) {
  KVTIER_RETURN_IF_ERROR(ValidateDecodeAttention(cache, p));
  if (cache.head_dim != 64 && cache.head_dim != 128 && cache.head_dim != 256) {
    return absl::InvalidArgumentError(
        absl::StrCat("attention: head_dim = ", cache.head_dim, " is not supported (64, 128, 256)"));
  }
  const uint32_t bs = cache.block_size;
  if ((bs & (bs - 1)) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("attention: block_size = ", bs, " must be a power of two"));
  }
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
  a.part_tokens = p.partition_tokens != 0
                      ? p.partition_tokens
                      : DecodeAttentionPartitionTokens(p.batch, cache.num_kv_heads, max_tokens);
  a.parts = static_cast<uint32_t>((max_tokens + a.part_tokens - 1) / a.part_tokens);
  if (a.parts > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("attention: ", a.parts, " partitions of ",
                                                   a.part_tokens, " tokens; at most 65535"));
  }
  a.layer = p.layer;
  a.bs_shift = static_cast<uint32_t>(__builtin_ctz(bs));
  a.q_scale = p.sm_scale * kLog2e;
  if (p.kernel != AttentionKernel::kAuto && p.kernel != AttentionKernel::kCtaPipeline &&
      p.kernel != AttentionKernel::kWarpPipeline && p.kernel != AttentionKernel::kWarpBulk) {
    return absl::InvalidArgumentError("attention: unknown kernel choice");
  }
  a.kernel = p.kernel;
  return a;
}

size_t WorkspaceFor(const AttnParams& a, uint32_t batch) {
  const uint64_t rows = uint64_t{batch} * a.num_q_heads * a.parts;
  return rows * (a.cache.head_dim + 2) * sizeof(float);
}

}  // namespace

uint32_t DecodeAttentionPartitionTokens(uint32_t batch, uint32_t num_kv_heads,
                                        uint64_t max_tokens) {
  const uint64_t work = uint64_t{batch} * num_kv_heads * max_tokens;
  uint32_t part = kAttentionMinPartitionTokens;
  while (part < kAttentionMaxPartitionTokens && work / part > kTargetParts) part *= 2;
  return part;
}

absl::StatusOr<size_t> DecodeAttentionWorkspaceBytes(const PagedKvLayout& cache,
                                                     const DecodeAttentionParams& p) {
  DecodeAttentionParams q = p;
  // Shape-only check: any non-null placeholder is fine for the pointers.
  static const int kDummy = 0;
  if (q.q == nullptr) q.q = &kDummy;
  if (q.out == nullptr) q.out = const_cast<int*>(&kDummy);
  if (q.block_table == nullptr) q.block_table = &kDummy;
  if (q.seq_lens == nullptr) q.seq_lens = &kDummy;
  KVTIER_ASSIGN_OR_RETURN(AttnParams a, PrepareAttention(cache, q));
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
  switch (cache.head_dim) {
    case 64:
      return LaunchHd<64>(a, p.batch, k8, v8, bf16, stream);
    case 128:
      return LaunchHd<128>(a, p.batch, k8, v8, bf16, stream);
    case 256:
      return LaunchHd<256>(a, p.batch, k8, v8, bf16, stream);
  }
  return absl::InvalidArgumentError("attention: unsupported head_dim");
}

}  // namespace kvtier::kernels
