// Test helpers: a paged cache in host memory with seeded contents, described
// by a PagedKvLayout with host pointers. Used by the CPU tests and, mirrored
// to the device, by the GPU tests and benchmarks.
#ifndef KVTIER_KERNELS_TEST_UTIL_H_
#define KVTIER_KERNELS_TEST_UTIL_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "codec/numeric.h"
#include "kernels/paged_layout.h"

namespace kvtier::kernels::testing {

enum class Fill : uint8_t {
  kIntegers,  // integer values in [-64, 64] (exact in every 16-bit format)
  kNormal,    // N(0, 1) values, a few outlier channels x16
  kZero,
};

// A paged cache in host memory. `layout` points into this object: do not
// copy or move it after Fill (the pointer arrays would dangle).
struct HostCache {
  CacheLayout kind;
  PagedKvLayout layout;
  std::vector<std::vector<uint8_t>> k_tensors;  // per layer (combined layouts: K and V)
  std::vector<std::vector<uint8_t>> v_tensors;  // per layer (separate layouts only)
  std::vector<std::vector<float>> k_scales, v_scales;  // [num_blocks][kv_heads] per layer
  std::vector<void*> k_ptrs, v_ptrs;
  std::vector<float*> k_scale_ptrs, v_scale_ptrs;

  HostCache() = default;
  HostCache(const HostCache&) = delete;
  HostCache& operator=(const HostCache&) = delete;

  static size_t ElemBytes(codec::DType t) { return t == codec::DType::kFP8E4M3 ? 1 : 2; }

  void Init(CacheLayout k, const PagedKvLayout& d) {
    kind = k;
    layout = d;
    const size_t kb = LayerTensorElements(k, d) * ElemBytes(d.k_dtype);
    const size_t vb = LayerVTensorElements(k, d) * ElemBytes(d.v_dtype);
    k_tensors.assign(d.num_layers, std::vector<uint8_t>(kb));
    v_tensors.assign(IsSeparate(k) ? d.num_layers : 0, std::vector<uint8_t>(vb));
    const size_t ns = size_t{d.num_blocks} * d.num_kv_heads;
    k_scales.assign(d.k_dtype == codec::DType::kFP8E4M3 ? d.num_layers : 0, std::vector<float>(ns));
    v_scales.assign(d.v_dtype == codec::DType::kFP8E4M3 ? d.num_layers : 0, std::vector<float>(ns));
    k_ptrs.clear();
    v_ptrs.clear();
    k_scale_ptrs.clear();
    v_scale_ptrs.clear();
    for (uint32_t l = 0; l < d.num_layers; ++l) {
      k_ptrs.push_back(k_tensors[l].data());
      v_ptrs.push_back(IsSeparate(k) ? v_tensors[l].data() : k_tensors[l].data());
      k_scale_ptrs.push_back(k_scales.empty() ? nullptr : k_scales[l].data());
      v_scale_ptrs.push_back(v_scales.empty() ? nullptr : v_scales[l].data());
    }
    layout.k_layers = k_ptrs.data();
    layout.v_layers = v_ptrs.data();
    layout.k_scale_layers = k_scales.empty() ? nullptr : k_scale_ptrs.data();
    layout.v_scale_layers = v_scales.empty() ? nullptr : v_scale_ptrs.data();
  }

  // Fills every element (also the gaps of combined layouts) from `seed`.
  void FillValues(Fill fill, uint64_t seed) {
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::uniform_int_distribution<int> ints(-64, 64);
    auto value = [&](uint32_t i) {
      if (fill == Fill::kZero) return 0.0f;
      if (fill == Fill::kIntegers) return static_cast<float>(ints(rng));
      float x = normal(rng);
      return (i % 61 == 7) ? 16.0f * x : x;  // outlier channels
    };
    auto fill16 = [&](std::vector<uint8_t>& t, codec::DType dt) {
      uint16_t* p = reinterpret_cast<uint16_t*>(t.data());
      const size_t n = t.size() / 2;
      for (size_t i = 0; i < n; ++i) {
        float x = value(static_cast<uint32_t>(i % layout.head_dim));
        p[i] = dt == codec::DType::kBF16 ? codec::FloatToBf16(x) : codec::FloatToFp16(x);
      }
    };
    auto fill8 = [&](std::vector<uint8_t>& t) {
      std::uniform_int_distribution<int> codes(0, 255);
      for (auto& b : t) {
        int c = fill == Fill::kZero ? 0 : codes(rng);
        if ((c & 0x7F) == 0x7F) c &= 0xFE;  // no NaN codes
        b = static_cast<uint8_t>(c);
      }
    };
    auto fill_scales = [&](std::vector<std::vector<float>>& s) {
      std::uniform_real_distribution<float> u(0.001f, 0.05f);
      for (auto& layer : s)
        for (auto& x : layer) x = u(rng);
    };
    const bool sep = IsSeparate(kind);
    for (uint32_t l = 0; l < layout.num_layers; ++l) {
      if (layout.k_dtype == codec::DType::kFP8E4M3) {
        fill8(k_tensors[l]);
      } else {
        fill16(k_tensors[l], layout.k_dtype);
      }
      if (sep) {
        if (layout.v_dtype == codec::DType::kFP8E4M3) {
          fill8(v_tensors[l]);
        } else {
          fill16(v_tensors[l], layout.v_dtype);
        }
      }
    }
    fill_scales(k_scales);
    fill_scales(v_scales);
  }

  // Sets every byte (and scale) to a fixed poison pattern.
  void Poison(uint8_t byte) {
    for (auto& t : k_tensors) std::memset(t.data(), byte, t.size());
    for (auto& t : v_tensors) std::memset(t.data(), byte, t.size());
    for (auto& s : k_scales) std::fill(s.begin(), s.end(), -7.0f);
    for (auto& s : v_scales) std::fill(s.begin(), s.end(), -7.0f);
  }
};

// `count` distinct block ids in [0, num_blocks), shuffled (non-contiguous).
inline std::vector<int32_t> ShuffledBlocks(uint32_t num_blocks, uint32_t count, uint64_t seed) {
  std::vector<int32_t> ids(num_blocks);
  for (uint32_t i = 0; i < num_blocks; ++i) ids[i] = static_cast<int32_t>(i);
  std::mt19937_64 rng(seed);
  std::shuffle(ids.begin(), ids.end(), rng);
  ids.resize(count);
  return ids;
}

// Where `got` differs from `want` (caches of the same kind and layout): the
// first layer's tensor or scales that differ and the byte, e.g. "layer 3 V
// at entry 4096"; "" if they are equal. Tests assert it is "".
inline std::string CacheDifference(const HostCache& got, const HostCache& want) {
  auto differ = [](const auto& a, const auto& b, size_t l, const char* what) -> std::string {
    if (a == b) return "";
    if (a.size() != b.size()) {
      return "layer " + std::to_string(l) + " " + what + ": " + std::to_string(a.size()) +
             " entries, want " + std::to_string(b.size());
    }
    const size_t at = std::mismatch(a.begin(), a.end(), b.begin()).first - a.begin();
    return "layer " + std::to_string(l) + " " + what + " at entry " + std::to_string(at);
  };
  for (size_t l = 0; l < want.k_tensors.size(); ++l) {
    std::string d = differ(got.k_tensors[l], want.k_tensors[l], l,
                           want.v_tensors.empty() ? "K and V" : "K");
    if (d.empty() && !want.v_tensors.empty()) d = differ(got.v_tensors[l], want.v_tensors[l], l, "V");
    if (d.empty() && !want.k_scales.empty()) d = differ(got.k_scales[l], want.k_scales[l], l, "K scales");
    if (d.empty() && !want.v_scales.empty()) d = differ(got.v_scales[l], want.v_scales[l], l, "V scales");
    if (!d.empty()) return d;
  }
  return "";
}

}  // namespace kvtier::kernels::testing

#endif  // KVTIER_KERNELS_TEST_UTIL_H_
