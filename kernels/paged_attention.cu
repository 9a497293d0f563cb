#include "kernels/paged_attention.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "kernels/cuda_status.h"

namespace kvtier::kernels {
namespace {

using codec::DType;

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int kPart = static_cast<int>(kAttentionPartitionTokens);
constexpr int kMaxG = static_cast<int>(kAttentionMaxGroup);
constexpr int kUnroll = 4;  // tokens in flight per thread group
constexpr int kVec = 8;     // elements per lane per token

struct AttnParams {
  PagedKvLayout cache;
  const void* q;
  void* out;
  const int32_t* block_table;
  const int32_t* seq_lens;
  float* ws_acc;  // [batch][q_heads][parts][head_dim]
  float* ws_ml;   // [batch][q_heads][parts][2]: max, sum
  uint32_t max_blocks_per_seq, num_q_heads, group, parts, layer, bs_shift;
  float sm_scale;
};

template <bool BF16>
__device__ __forceinline__ float Half(uint32_t bits) {
  if constexpr (BF16) return __uint_as_float(bits << 16);
  return __half2float(__ushort_as_half(static_cast<unsigned short>(bits)));
}

// Loads 8 elements of a row (16 bytes of 16-bit elements or 8 FP8 codes).
template <bool FP8>
struct RowVec {
  using Raw = typename std::conditional<FP8, uint2, uint4>::type;
};

template <bool FP8, bool BF16>
__device__ __forceinline__ void ToFloat(const uint4& r, float (&f)[kVec]) {
  if constexpr (FP8) {
    const uint32_t w[2] = {r.x, r.y};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      __half2_raw h2 = __nv_cvt_fp8x2_to_halfraw2(
          static_cast<__nv_fp8x2_storage_t>(w[i / 2] >> (16 * (i % 2))), __NV_E4M3);
      float2 ff = __half22float2(*reinterpret_cast<__half2*>(&h2));
      f[2 * i] = ff.x;
      f[2 * i + 1] = ff.y;
    }
  } else {
    const uint32_t w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      f[2 * i] = Half<BF16>(w[i] & 0xFFFFu);
      f[2 * i + 1] = Half<BF16>(w[i] >> 16);
    }
  }
}

template <bool FP8>
__device__ __forceinline__ uint4 LoadRow(const void* p) {
  if constexpr (FP8) {
    const uint2 w = __ldg(static_cast<const uint2*>(p));
    return make_uint4(w.x, w.y, 0, 0);
  } else {
    return __ldg(static_cast<const uint4*>(p));
  }
}

template <int HD, bool K8, bool V8, bool BF16>
__global__ void __launch_bounds__(kThreads) AttnPartialKernel(const __grid_constant__ AttnParams p) {
  static_assert(HD % kVec == 0 && 32 % (HD / kVec) == 0 || HD / kVec == 32,
                "a token's row is split over HD/8 lanes of one warp");
  constexpr int TG = HD / kVec;       // lanes per token
  constexpr int NTG = kThreads / TG;  // tokens in parallel per CTA
  __shared__ float s_logit[kMaxG][kPart];
  __shared__ float s_red[kWarps][kMaxG * HD > 2048 ? 2048 : kMaxG * HD];
  __shared__ int32_t s_block[kPart];
  __shared__ float s_max[kMaxG], s_sum[kMaxG];
  static_assert(kMaxG * HD <= 2048, "reduction buffer sized for G*HD <= 2048");

  const PagedKvLayout& c = p.cache;
  const uint32_t b = blockIdx.z, kvh = blockIdx.y, part = blockIdx.x;
  const int len = __ldg(p.seq_lens + b);
  const int t_begin = part * kPart;
  if (t_begin >= len) return;
  const int n = min(kPart, len - t_begin);
  const int G = static_cast<int>(p.group);
  const int BS = 1 << p.bs_shift;
  const int lane_tg = threadIdx.x % TG, tg = threadIdx.x / TG;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

  const int nblk = (n + BS - 1) >> p.bs_shift;
  for (int i = threadIdx.x; i < nblk; i += kThreads) {
    s_block[i] = __ldg(p.block_table + uint64_t{b} * p.max_blocks_per_seq + (t_begin >> p.bs_shift) + i);
  }
  float q[kMaxG][kVec];
  const uint16_t* qbase = static_cast<const uint16_t*>(p.q) +
                          (uint64_t{b} * p.num_q_heads + uint64_t{kvh} * G) * HD + lane_tg * kVec;
#pragma unroll
  for (int g = 0; g < kMaxG; ++g) {
    if (g < G) {
      float f[kVec];
      ToFloat<false, BF16>(__ldg(reinterpret_cast<const uint4*>(qbase + g * HD)), f);
#pragma unroll
      for (int e = 0; e < kVec; ++e) q[g][e] = f[e] * p.sm_scale;
    }
  }
  __syncthreads();

  const uint8_t* kbase = static_cast<const uint8_t*>(c.k_layers[p.layer]);
  const uint8_t* vbase = static_cast<const uint8_t*>(c.v_layers[p.layer]);
  const float* kscale = K8 ? c.k_scale_layers[p.layer] : nullptr;
  const float* vscale = V8 ? c.v_scale_layers[p.layer] : nullptr;
  constexpr int KB = K8 ? 1 : 2, VB = V8 ? 1 : 2;

  // Phase 1: logits.
  // Loop bounds are uniform over the CTA (every lane reaches the shuffles);
  // a token past the end is computed on zeros and not stored.
  for (int base = 0; base < n; base += NTG * kUnroll) {
    const int t0 = base + tg;
    uint4 raw[kUnroll];
    float ks[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int t = t0 + u * NTG;
      raw[u] = make_uint4(0, 0, 0, 0);
      ks[u] = 0.0f;
      if (t < n) {
        const uint32_t blk = s_block[t >> p.bs_shift];
        const uint32_t slot = t & (BS - 1);
        raw[u] = LoadRow<K8>(kbase + KB * c.k_elem(blk, slot, kvh, lane_tg * kVec));
        ks[u] = K8 ? __ldg(kscale + c.scale_index(blk, kvh)) : 1.0f;
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int t = t0 + u * NTG;
      float k[kVec];
      ToFloat<K8, BF16>(raw[u], k);
#pragma unroll
      for (int g = 0; g < kMaxG; ++g) {
        if (g < G) {
          float dot = 0.0f;
#pragma unroll
          for (int e = 0; e < kVec; ++e) dot = fmaf(q[g][e], k[e], dot);
#pragma unroll
          for (int o = TG / 2; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o, TG);
          if (lane_tg == 0 && t < n) s_logit[g][t] = dot * ks[u];
        }
      }
    }
  }
  __syncthreads();

  // Softmax state of the partition, per q head.
  for (int g = warp; g < G; g += kWarps) {
    float m = -INFINITY;
    for (int i = lane; i < n; i += 32) m = fmaxf(m, s_logit[g][i]);
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    float s = 0.0f;
    for (int i = lane; i < n; i += 32) {
      const float e = __expf(s_logit[g][i] - m);
      s_logit[g][i] = e;
      s += e;
    }
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if (lane == 0) {
      s_max[g] = m;
      s_sum[g] = s;
    }
  }
  __syncthreads();

  // Phase 2: weighted V, dequantized in registers.
  float acc[kMaxG][kVec];
#pragma unroll
  for (int g = 0; g < kMaxG; ++g)
#pragma unroll
    for (int e = 0; e < kVec; ++e) acc[g][e] = 0.0f;
  for (int base = 0; base < n; base += NTG * kUnroll) {
    const int t0 = base + tg;
    uint4 raw[kUnroll];
    float vs[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int t = t0 + u * NTG;
      if (t < n) {
        const uint32_t blk = s_block[t >> p.bs_shift];
        const uint32_t slot = t & (BS - 1);
        raw[u] = LoadRow<V8>(vbase + VB * c.v_elem(blk, slot, kvh, lane_tg * kVec));
        vs[u] = V8 ? __ldg(vscale + c.scale_index(blk, kvh)) : 1.0f;
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int t = t0 + u * NTG;
      if (t >= n) continue;  // no shuffles in this loop
      float v[kVec];
      ToFloat<V8, BF16>(raw[u], v);
#pragma unroll
      for (int g = 0; g < kMaxG; ++g) {
        if (g < G) {
          const float w = s_logit[g][t] * vs[u];
#pragma unroll
          for (int e = 0; e < kVec; ++e) acc[g][e] = fmaf(w, v[e], acc[g][e]);
        }
      }
    }
  }
  // Reduce over the thread groups of a warp, then over warps.
#pragma unroll
  for (int g = 0; g < kMaxG; ++g) {
    if (g < G) {
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
#pragma unroll
        for (int o = TG; o < 32; o <<= 1) acc[g][e] += __shfl_xor_sync(0xffffffffu, acc[g][e], o);
      }
    }
  }
  if (lane < TG) {
#pragma unroll
    for (int g = 0; g < kMaxG; ++g) {
      if (g < G) {
#pragma unroll
        for (int e = 0; e < kVec; ++e) s_red[warp][g * HD + lane_tg * kVec + e] = acc[g][e];
      }
    }
  }
  __syncthreads();
  const uint64_t row0 = (uint64_t{b} * p.num_q_heads + uint64_t{kvh} * G) * p.parts + part;
  for (int i = threadIdx.x; i < G * HD; i += kThreads) {
    float s = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) s += s_red[w][i];
    const int g = i / HD, d = i % HD;
    p.ws_acc[(row0 + uint64_t{g} * p.parts) * HD + d] = s;
  }
  if (threadIdx.x < G) {
    const uint64_t r = row0 + uint64_t{threadIdx.x} * p.parts;
    p.ws_ml[2 * r] = s_max[threadIdx.x];
    p.ws_ml[2 * r + 1] = s_sum[threadIdx.x];
  }
}

template <int HD, bool BF16>
__global__ void __launch_bounds__(HD) AttnCombineKernel(const __grid_constant__ AttnParams p) {
  const uint32_t qh = blockIdx.x, b = blockIdx.y, d = threadIdx.x;
  const int len = __ldg(p.seq_lens + b);
  const int parts = (len + kPart - 1) / kPart;
  const uint64_t row0 = (uint64_t{b} * p.num_q_heads + qh) * p.parts;
  float m = -INFINITY;
  for (int i = 0; i < parts; ++i) m = fmaxf(m, p.ws_ml[2 * (row0 + i)]);
  float l = 0.0f, acc = 0.0f;
  for (int i = 0; i < parts; ++i) {
    const float w = __expf(p.ws_ml[2 * (row0 + i)] - m);
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

template <int HD, bool K8, bool V8, bool BF16>
absl::Status LaunchTyped(const AttnParams& a, uint32_t batch, cudaStream_t stream) {
  const dim3 grid(a.parts, a.cache.num_kv_heads, batch);
  AttnPartialKernel<HD, K8, V8, BF16><<<grid, kThreads, 0, stream>>>(a);
  KVTIER_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  AttnCombineKernel<HD, BF16><<<dim3(a.num_q_heads, batch), HD, 0, stream>>>(a);
  KVTIER_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return absl::OkStatus();
}

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

absl::StatusOr<AttnParams> PrepareAttention(const PagedKvLayout& cache,
                                            const DecodeAttentionParams& p) {
  KVTIER_RETURN_IF_ERROR(ValidateDecodeAttention(cache, p));
  if (cache.head_dim != 64 && cache.head_dim != 128 && cache.head_dim != 256) {
    return absl::InvalidArgumentError(
        absl::StrCat("attention: head_dim = ", cache.head_dim, " is not supported (64, 128, 256)"));
  }
  const uint32_t bs = cache.block_size;
  if ((bs & (bs - 1)) != 0 || bs > kAttentionPartitionTokens) {
    return absl::InvalidArgumentError(absl::StrCat(
        "attention: block_size = ", bs, " must be a power of two <= ", kAttentionPartitionTokens));
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
  a.parts = static_cast<uint32_t>((max_tokens + kPart - 1) / kPart);
  a.layer = p.layer;
  a.bs_shift = static_cast<uint32_t>(__builtin_ctz(bs));
  a.sm_scale = p.sm_scale;
  return a;
}

size_t WorkspaceFor(const AttnParams& a, uint32_t batch) {
  const uint64_t rows = uint64_t{batch} * a.num_q_heads * a.parts;
  return rows * (a.cache.head_dim + 2) * sizeof(float);
}

}  // namespace

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
