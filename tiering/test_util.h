// Shared helpers of the tiering tests: deterministic chunks and keys.
#ifndef KVTIER_TIERING_TEST_UTIL_H_
#define KVTIER_TIERING_TEST_UTIL_H_

#include <fcntl.h>
#include <unistd.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "codec/codec.h"
#include "common/hash.h"
#include "tiering/nvme_tier.h"

namespace kvtier::tiering::testing {

// A valid chunk whose contents depend only on `seed` (and the geometry).
inline std::vector<uint8_t> MakeChunk(uint64_t seed, uint32_t tokens = 16, uint32_t layers = 2,
                                      uint32_t heads = 2, uint32_t head_dim = 64) {
  codec::ChunkSpec spec;
  spec.fingerprint = Hash128::Of("tiering-test-model", 7);
  spec.geometry = codec::Geometry{layers, heads, head_dim, tokens, 16};
  spec.dtype = codec::DType::kBF16;
  spec.k = {codec::DType::kBF16, codec::ScaleGranularity::kNone};
  spec.v = {codec::DType::kFP8E4M3, codec::ScaleGranularity::kPerBlockHead};
  const size_t n = size_t{layers} * tokens * heads * head_dim;
  std::vector<uint16_t> k(n), v(n);
  std::mt19937_64 rng(seed);
  for (size_t i = 0; i < n; ++i) {
    // Finite bf16 values in [-4, 4): sign, exponent 0x7c..0x80, random mantissa.
    uint64_t r = rng();
    k[i] = static_cast<uint16_t>(((r & 1) << 15) | ((0x7c + (r >> 1) % 4) << 7) | ((r >> 8) & 0x7f));
    r = rng();
    v[i] = static_cast<uint16_t>(((r & 1) << 15) | ((0x7c + (r >> 1) % 4) << 7) | ((r >> 8) & 0x7f));
  }
  return codec::EncodeChunk(spec, {k, v}).value();
}

inline Hash128 KeyOf(uint64_t seed) { return Hash128::Of(std::to_string(seed), 42); }

// Flips one bit of byte `at` of object `id` in the NVMe tier's data file, as a
// failing disk would, behind the tier's back.
inline absl::Status FlipByteOnNvme(NvmeTier& nvme, const ObjectKey& id, uint64_t at) {
  auto off = nvme.OffsetOf(id);
  if (!off.ok()) return off.status();
  const int fd = open(nvme.data_path().c_str(), O_RDWR);
  if (fd < 0) return absl::InternalError("cannot open the NVMe data file");
  uint8_t b = 0;
  bool ok = pread(fd, &b, 1, *off + at) == 1;
  if (ok) {
    b ^= 1;
    ok = pwrite(fd, &b, 1, *off + at) == 1;
  }
  close(fd);
  return ok ? absl::OkStatus() : absl::InternalError("cannot rewrite the byte");
}

}  // namespace kvtier::tiering::testing

#endif  // KVTIER_TIERING_TEST_UTIL_H_
