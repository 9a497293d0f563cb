// The data-plane benchmarks' common pieces: the chunk they move (one
// 256-token Llama-3.1-8B K16/V8 chunk, as the kvtierd issue names) and a way
// to put a buffer out of the cache between timed runs.
#ifndef KVTIER_BENCH_LLAMA_CHUNK_H_
#define KVTIER_BENCH_LLAMA_CHUNK_H_

#include <immintrin.h>

#include <cstdint>
#include <span>
#include <vector>

#include "codec/chunk.h"
#include "codec/codec.h"
#include "codec/test_util.h"

namespace kvtier::bench {

// Llama-3.1-8B: 32 layers, 8 KV heads, head_dim 128; 256 tokens; K in BF16,
// V in FP8 e4m3 with per-(block, head) scales: 25,182,336 bytes.
inline std::vector<uint8_t> LlamaK16V8Chunk() {
  codec::Geometry g{32, 8, 128, 256, 16};
  codec::ChunkSpec spec = codec::testing::MakeSpec(
      g, codec::DType::kBF16, {codec::DType::kBF16, codec::ScaleGranularity::kNone},
      {codec::DType::kFP8E4M3, codec::ScaleGranularity::kPerBlockHead});
  auto k = codec::testing::MakeKv(g, codec::DType::kBF16, {.seed = 1});
  auto v = codec::testing::MakeKv(g, codec::DType::kBF16, {.seed = 2});
  return codec::EncodeChunk(spec, codec::KvView{k, v}).value();
}

// Writes back and evicts `b` from every cache level (outside timed regions).
inline void FlushFromCache(std::span<const uint8_t> b) {
  for (size_t o = 0; o < b.size(); o += 64) _mm_clflush(b.data() + o);
  _mm_mfence();
}

}  // namespace kvtier::bench

#endif  // KVTIER_BENCH_LLAMA_CHUNK_H_
