// Shared helpers of the kvtierd tests: small valid chunks, keys, and daemon
// options sized for a test (tens of MiB, temp data dir, no logging).
#ifndef KVTIER_SERVER_TEST_UTIL_H_
#define KVTIER_SERVER_TEST_UTIL_H_

#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include "codec/codec.h"
#include "codec/test_util.h"
#include "common/hash.h"
#include "server/options.h"

namespace kvtier::testing {

// A sealed K16/V8 chunk of `tokens` tokens whose values depend on `seed`.
inline std::vector<uint8_t> MakeChunk(uint32_t seed, uint32_t tokens = 16, uint32_t layers = 2,
                                      uint32_t heads = 2, uint32_t dim = 64) {
  codec::Geometry g{layers, heads, dim, tokens, 16};
  codec::ChunkSpec spec = codec::testing::MakeSpec(
      g, codec::DType::kBF16, codec::SectionFormat{codec::DType::kBF16, codec::ScaleGranularity::kNone},
      codec::SectionFormat{codec::DType::kFP8E4M3, codec::ScaleGranularity::kPerBlockHead});
  codec::testing::DataOptions o;
  o.seed = seed;
  auto k = codec::testing::MakeKv(g, codec::DType::kBF16, o);
  o.seed = seed + 1000003;
  auto v = codec::testing::MakeKv(g, codec::DType::kBF16, o);
  return codec::EncodeChunk(spec, codec::KvView{k, v}).value();
}

// The same records as `chunk` (a sealed version 2 chunk) in a sealed
// version 1 chunk: no record tables, whole-section checksums.
inline std::vector<uint8_t> AsVersionOne(const std::vector<uint8_t>& chunk) {
  const codec::ChunkHeader h = codec::ParseHeader(chunk).value();
  codec::ChunkSpec spec = h.spec;
  spec.version = 1;
  const codec::ChunkLayout l = codec::ValidateSpec(spec).value();
  std::vector<uint8_t> v1(l.total_bytes);
  std::memcpy(v1.data() + l.k_offset, chunk.data() + h.layout.k_offset, l.k.bytes);
  std::memcpy(v1.data() + l.v_offset, chunk.data() + h.layout.v_offset, l.v.bytes);
  codec::WriteHeader(spec, l, 0, 0, std::span<uint8_t>(v1).first(codec::kHeaderSize));
  (void)codec::SealChunk(v1);
  return v1;
}

inline Hash128 TestKey(uint32_t i) { return Hash128::Of("server-test-key-" + std::to_string(i), 7); }

inline server::DaemonOptions SmallDaemonOptions(const std::string& dir) {
  server::DaemonOptions o;
  o.data_dir = dir;
  o.dram_gib = 32.0 / 1024;  // 32 MiB
  o.nvme_gib = 64.0 / 1024;  // 64 MiB
  o.hbm_gib = 0;
  o.dram_populate = false;
  o.log_level = "off";
  o.shutdown_grace_s = 2;
  return o;
}

}  // namespace kvtier::testing

#endif  // KVTIER_SERVER_TEST_UTIL_H_
