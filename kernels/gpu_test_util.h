// GPU test and benchmark helpers: device mirrors of a HostCache, a skip
// check, and a CUDA-call assertion. Host-compiled (cuda_runtime_api only).
#ifndef KVTIER_KERNELS_GPU_TEST_UTIL_H_
#define KVTIER_KERNELS_GPU_TEST_UTIL_H_

#include <cuda_runtime_api.h>

#include <cstdint>
#include <vector>

#include "kernels/paged_layout.h"
#include "kernels/test_util.h"

namespace kvtier::kernels::testing {

inline bool HaveGpu() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

#define KVTIER_SKIP_WITHOUT_GPU()                                   \
  do {                                                              \
    if (!::kvtier::kernels::testing::HaveGpu()) GTEST_SKIP() << "no CUDA device"; \
  } while (0)

#define KVTIER_ASSERT_CUDA(expr)                                                   \
  do {                                                                             \
    cudaError_t e_ = (expr);                                                       \
    ASSERT_EQ(e_, cudaSuccess) << #expr << ": " << cudaGetErrorString(e_);         \
  } while (0)

// A device copy of a HostCache: same layout, device pointers and arrays.
struct DeviceCache {
  PagedKvLayout layout;
  std::vector<void*> k_bufs, v_bufs;  // per layer
  std::vector<float*> ks_bufs, vs_bufs;
  void** d_k = nullptr;
  void** d_v = nullptr;
  float** d_ks = nullptr;
  float** d_vs = nullptr;

  DeviceCache() = default;
  DeviceCache(const DeviceCache&) = delete;
  DeviceCache& operator=(const DeviceCache&) = delete;
  ~DeviceCache() {
    for (void* p : k_bufs) cudaFree(p);
    for (void* p : v_bufs) cudaFree(p);
    for (float* p : ks_bufs) cudaFree(p);
    for (float* p : vs_bufs) cudaFree(p);
    cudaFree(d_k);
    cudaFree(d_v);
    cudaFree(d_ks);
    cudaFree(d_vs);
  }

  cudaError_t Upload(const HostCache& h) {
    layout = h.layout;
    const uint32_t L = h.layout.num_layers;
    const bool sep = IsSeparate(h.kind);
    cudaError_t e;
    std::vector<void*> kp(L), vp(L);
    std::vector<float*> ksp(L, nullptr), vsp(L, nullptr);
    for (uint32_t l = 0; l < L; ++l) {
      void* p = nullptr;
      if ((e = cudaMalloc(&p, h.k_tensors[l].size())) != cudaSuccess) return e;
      k_bufs.push_back(p);
      kp[l] = p;
      vp[l] = p;
      if (sep) {
        if ((e = cudaMalloc(&p, h.v_tensors[l].size())) != cudaSuccess) return e;
        v_bufs.push_back(p);
        vp[l] = p;
      }
      if (!h.k_scales.empty()) {
        float* s = nullptr;
        if ((e = cudaMalloc(&s, h.k_scales[l].size() * 4)) != cudaSuccess) return e;
        ks_bufs.push_back(s);
        ksp[l] = s;
      }
      if (!h.v_scales.empty()) {
        float* s = nullptr;
        if ((e = cudaMalloc(&s, h.v_scales[l].size() * 4)) != cudaSuccess) return e;
        vs_bufs.push_back(s);
        vsp[l] = s;
      }
    }
    if ((e = cudaMalloc(&d_k, L * sizeof(void*))) != cudaSuccess) return e;
    if ((e = cudaMalloc(&d_v, L * sizeof(void*))) != cudaSuccess) return e;
    if ((e = cudaMalloc(&d_ks, L * sizeof(float*))) != cudaSuccess) return e;
    if ((e = cudaMalloc(&d_vs, L * sizeof(float*))) != cudaSuccess) return e;
    cudaMemcpy(d_k, kp.data(), L * sizeof(void*), cudaMemcpyHostToDevice);
    cudaMemcpy(d_v, vp.data(), L * sizeof(void*), cudaMemcpyHostToDevice);
    cudaMemcpy(d_ks, ksp.data(), L * sizeof(float*), cudaMemcpyHostToDevice);
    cudaMemcpy(d_vs, vsp.data(), L * sizeof(float*), cudaMemcpyHostToDevice);
    layout.k_layers = d_k;
    layout.v_layers = d_v;
    layout.k_scale_layers = h.k_scales.empty() ? nullptr : d_ks;
    layout.v_scale_layers = h.v_scales.empty() ? nullptr : d_vs;
    return CopyFrom(h);
  }

  cudaError_t CopyFrom(const HostCache& h) {
    cudaError_t e;
    for (size_t l = 0; l < k_bufs.size(); ++l) {
      if ((e = cudaMemcpy(k_bufs[l], h.k_tensors[l].data(), h.k_tensors[l].size(),
                          cudaMemcpyHostToDevice)) != cudaSuccess)
        return e;
    }
    for (size_t l = 0; l < v_bufs.size(); ++l) {
      if ((e = cudaMemcpy(v_bufs[l], h.v_tensors[l].data(), h.v_tensors[l].size(),
                          cudaMemcpyHostToDevice)) != cudaSuccess)
        return e;
    }
    for (size_t l = 0; l < ks_bufs.size(); ++l)
      cudaMemcpy(ks_bufs[l], h.k_scales[l].data(), h.k_scales[l].size() * 4, cudaMemcpyHostToDevice);
    for (size_t l = 0; l < vs_bufs.size(); ++l)
      cudaMemcpy(vs_bufs[l], h.v_scales[l].data(), h.v_scales[l].size() * 4, cudaMemcpyHostToDevice);
    return cudaGetLastError();
  }

  // Copies the device contents back into `h` (same shape).
  cudaError_t CopyTo(HostCache& h) const {
    cudaError_t e;
    for (size_t l = 0; l < k_bufs.size(); ++l) {
      if ((e = cudaMemcpy(h.k_tensors[l].data(), k_bufs[l], h.k_tensors[l].size(),
                          cudaMemcpyDeviceToHost)) != cudaSuccess)
        return e;
    }
    for (size_t l = 0; l < v_bufs.size(); ++l) {
      if ((e = cudaMemcpy(h.v_tensors[l].data(), v_bufs[l], h.v_tensors[l].size(),
                          cudaMemcpyDeviceToHost)) != cudaSuccess)
        return e;
    }
    for (size_t l = 0; l < ks_bufs.size(); ++l)
      cudaMemcpy(h.k_scales[l].data(), ks_bufs[l], h.k_scales[l].size() * 4, cudaMemcpyDeviceToHost);
    for (size_t l = 0; l < vs_bufs.size(); ++l)
      cudaMemcpy(h.v_scales[l].data(), vs_bufs[l], h.v_scales[l].size() * 4, cudaMemcpyDeviceToHost);
    return cudaGetLastError();
  }
};

// A decode test's caches: the expected and the device's result on the host,
// both of `layout` and poisoned with one byte, and the device cache uploaded
// from them.
struct PoisonedCaches {
  HostCache expect, got;
  DeviceCache dev;

  cudaError_t Init(CacheLayout kind, const PagedKvLayout& layout, uint8_t poison) {
    expect.Init(kind, layout);
    got.Init(kind, layout);
    expect.Poison(poison);
    got.Poison(poison);
    return dev.Upload(expect);
  }
};

}  // namespace kvtier::kernels::testing

#endif  // KVTIER_KERNELS_GPU_TEST_UTIL_H_
