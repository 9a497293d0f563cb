// Seeded test data for the codec, its kernels and the tiers: KV shaped like a
// real model's (Gaussian values, a few large-magnitude outlier channels in K),
// as 16-bit element bits. Header-only so GPU tests can share it.
#ifndef KVTIER_CODEC_TEST_UTIL_H_
#define KVTIER_CODEC_TEST_UTIL_H_

#include <cstdint>
#include <random>
#include <vector>

#include "codec/chunk.h"
#include "codec/quant.h"

namespace kvtier::codec::testing {

struct DataOptions {
  uint32_t seed = 1;
  float stddev = 1.0f;
  // Every `outlier_every`-th channel (head_dim index) is scaled by
  // `outlier_scale`, as key outlier channels are in Llama/Qwen. 0 disables.
  uint32_t outlier_every = 0;
  float outlier_scale = 20.0f;
  // Integer values in [-int_range, int_range] instead of Gaussians (exact in
  // any 16-bit format and in FP32 sums; CUTLASS's habit for exact checks).
  int int_range = 0;
};

// [layers][tokens][kv_heads][head_dim] elements of `dtype` (kFP16 or kBF16).
inline std::vector<uint16_t> MakeKv(const Geometry& g, DType dtype, const DataOptions& o) {
  std::mt19937 rng(o.seed);
  std::normal_distribution<float> normal(0.0f, o.stddev);
  std::uniform_int_distribution<int> ints(-o.int_range, o.int_range);
  std::vector<uint16_t> out(g.layer_elements() * g.num_layers);
  for (size_t i = 0; i < out.size(); ++i) {
    uint32_t channel = static_cast<uint32_t>(i % g.head_dim);
    float x = o.int_range > 0 ? static_cast<float>(ints(rng)) : normal(rng);
    if (o.outlier_every > 0 && channel % o.outlier_every == 0) x *= o.outlier_scale;
    out[i] = Store16(x, dtype);
  }
  return out;
}

inline ChunkSpec MakeSpec(const Geometry& g, DType dtype, SectionFormat k, SectionFormat v) {
  ChunkSpec s;
  s.fingerprint = Hash128::Of(std::string_view("kvtier-test-model"), 0);
  s.geometry = g;
  s.dtype = dtype;
  s.k = k;
  s.v = v;
  return s;
}

}  // namespace kvtier::codec::testing

#endif  // KVTIER_CODEC_TEST_UTIL_H_
