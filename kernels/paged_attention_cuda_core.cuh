// The CUDA-core attention kernel (AttentionKernel::kCudaCore): the design
// notes at the top of paged_attention.cu. Included by paged_attention.cu only.
#ifndef KVTIER_KERNELS_PAGED_ATTENTION_CUDA_CORE_CUH_
#define KVTIER_KERNELS_PAGED_ATTENTION_CUDA_CORE_CUH_

#include "kernels/paged_attention_device.cuh"

namespace kvtier::kernels::attention_internal {

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

}  // namespace kvtier::kernels::attention_internal

#endif  // KVTIER_KERNELS_PAGED_ATTENTION_CUDA_CORE_CUH_
