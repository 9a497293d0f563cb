// The tensor-core attention kernel (AttentionKernel::kTensorCore).
// Included by paged_attention.cu only.
#ifndef KVTIER_KERNELS_PAGED_ATTENTION_TENSOR_CORE_CUH_
#define KVTIER_KERNELS_PAGED_ATTENTION_TENSOR_CORE_CUH_

#include "kernels/paged_attention_device.cuh"

namespace kvtier::kernels::attention_internal {

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
  // K16/V8 behind FP8 on the H100 (bench/results/kernels.md).
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

}  // namespace kvtier::kernels::attention_internal

#endif  // KVTIER_KERNELS_PAGED_ATTENTION_TENSOR_CORE_CUH_
