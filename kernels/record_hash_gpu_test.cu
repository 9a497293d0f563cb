// The device XXH3-64 against libxxhash (the CPU reference) on the same bytes.
#include <xxhash.h>

#include <cstring>
#include <random>
#include <vector>

#include "codec/codec.h"
#include "gtest/gtest.h"
#include "kernels/gpu_test_util.h"
#include "kernels/record_hash.h"

namespace kvtier::kernels {
namespace {

std::vector<uint8_t> RandomBytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint8_t> out(n);
  for (uint8_t& b : out) b = static_cast<uint8_t>(rng());
  return out;
}

// Every length class of XXH3's long path: one block and a few stripes, whole
// blocks, a partial block of 0 and of 15 stripes, the ring's rounds (8 KiB)
// and their edges, and a 32-layer chunk's record sizes.
TEST(RecordHashGpu, EqualsLibxxhashOnEveryLengthClass) {
  KVTIER_SKIP_WITHOUT_GPU();
  const std::vector<uint64_t> lengths = {256,    1024,   1040,   1088,   2048,    2064,
                                         8176,   8192,   8208,   9216,   16384,   65552,
                                         131088, 262144, 266240, 524288, 1048592};
  const std::vector<uint64_t> seeds = {0, 1, (uint64_t{1} << 32) | 31, 0x9E3779B185EBCA87ull};
  const std::vector<uint8_t> bytes = RandomBytes(lengths.back() + 64, 7);
  uint8_t* d = nullptr;
  uint64_t* out = nullptr;
  void* ws = nullptr;
  KVTIER_ASSERT_CUDA(cudaMalloc(&d, bytes.size()));
  KVTIER_ASSERT_CUDA(cudaMalloc(&out, sizeof(uint64_t)));
  KVTIER_ASSERT_CUDA(cudaMalloc(&ws, DeviceRangeWorkspaceBytes(lengths.back())));
  KVTIER_ASSERT_CUDA(cudaMemcpy(d, bytes.data(), bytes.size(), cudaMemcpyHostToDevice));
  for (uint64_t len : lengths) {
    for (uint64_t seed : seeds) {
      for (uint64_t at : {uint64_t{0}, uint64_t{48}}) {  // 16-byte aligned, not 64
        ASSERT_TRUE(HashDeviceRange(d + at, len, seed, ws, out, nullptr).ok());
        uint64_t got = 0;
        KVTIER_ASSERT_CUDA(cudaMemcpy(&got, out, sizeof(got), cudaMemcpyDeviceToHost));
        EXPECT_EQ(got, XXH3_64bits_withSeed(bytes.data() + at, len, seed))
            << "len " << len << " seed " << seed << " at " << at;
      }
    }
  }
  cudaFree(d);
  cudaFree(out);
  cudaFree(ws);
}

// A chunk's records staged in device memory hash to its record tables, for a
// layer range and for a slab of two chunks' ranges too; a flipped byte
// changes exactly its record's checksum.
TEST(RecordHashGpu, StagedRecordsMatchTheChunksTables) {
  KVTIER_SKIP_WITHOUT_GPU();
  codec::ChunkSpec spec;
  spec.geometry = {4, 2, 128, 32, 16};
  auto fmt = codec::ParseCodec("k16v8", codec::DType::kBF16);
  ASSERT_TRUE(fmt.ok());
  spec.k = fmt->k;
  spec.v = fmt->v;
  const codec::Geometry& g = spec.geometry;
  std::vector<uint16_t> k(size_t{g.num_layers} * g.num_tokens * g.num_kv_heads * g.head_dim);
  std::vector<uint16_t> v(k.size());
  std::mt19937 rng(3);
  for (uint16_t& x : k) x = 0x3C00 + (rng() & 0x3FF);
  for (uint16_t& x : v) x = 0x3800 + (rng() & 0x3FF);
  auto chunk = codec::EncodeChunk(spec, codec::KvView{k, v});
  ASSERT_TRUE(chunk.ok()) << chunk.status();
  auto header = codec::ParseHeader(*chunk);
  ASSERT_TRUE(header.ok());
  const codec::ChunkLayout& l = header->layout;
  uint8_t* d = nullptr;
  uint64_t* out = nullptr;
  void* ws = nullptr;
  KVTIER_ASSERT_CUDA(cudaMalloc(&ws, StagedRecordsWorkspaceBytes(*header, LayerRange{})));
  KVTIER_ASSERT_CUDA(cudaMalloc(&d, chunk->size()));
  KVTIER_ASSERT_CUDA(cudaMalloc(&out, 2 * g.num_layers * sizeof(uint64_t)));
  KVTIER_ASSERT_CUDA(cudaMemcpy(d, chunk->data(), chunk->size(), cudaMemcpyHostToDevice));
  std::span<const uint8_t> ks(chunk->data() + l.k_offset, l.k.bytes);
  std::span<const uint8_t> vs(chunk->data() + l.v_offset, l.v.bytes);
  for (LayerRange r : {LayerRange{}, LayerRange{1, 3}, LayerRange{3, 4}}) {
    const uint32_t b = r.begin, n = r.End(g.num_layers) - b;
    StagedRecords staged{d + l.k_offset + l.k.data_offset(b), d + l.v_offset + l.v.data_offset(b),
                         r};
    ASSERT_TRUE(CanHashOnDevice(*header, staged));
    ASSERT_TRUE(HashStagedRecords(*header, staged, ws, out, nullptr).ok());
    std::vector<uint64_t> got(2 * n);
    KVTIER_ASSERT_CUDA(cudaMemcpy(got.data(), out, got.size() * 8, cudaMemcpyDeviceToHost));
    for (uint32_t j = 0; j < n; ++j) {
      EXPECT_EQ(got[j], codec::StoredRecordChecksum(l.k, ks, b + j)) << "k " << b + j;
      EXPECT_EQ(got[n + j], codec::StoredRecordChecksum(l.v, vs, b + j)) << "v " << b + j;
    }
  }
  // One byte of V's layer 2 record flipped on the device.
  const uint64_t at = l.v_offset + l.v.data_offset(2) + 77;
  const uint8_t flipped = (*chunk)[at] ^ 0x10;
  KVTIER_ASSERT_CUDA(cudaMemcpy(d + at, &flipped, 1, cudaMemcpyHostToDevice));
  StagedRecords all{d + l.k_offset, d + l.v_offset, LayerRange{}};
  ASSERT_TRUE(HashStagedRecords(*header, all, ws, out, nullptr).ok());
  std::vector<uint64_t> got(2 * g.num_layers);
  KVTIER_ASSERT_CUDA(cudaMemcpy(got.data(), out, got.size() * 8, cudaMemcpyDeviceToHost));
  for (uint32_t layer = 0; layer < g.num_layers; ++layer) {
    EXPECT_EQ(got[layer], codec::StoredRecordChecksum(l.k, ks, layer));
    EXPECT_EQ(got[g.num_layers + layer] == codec::StoredRecordChecksum(l.v, vs, layer),
              layer != 2);
  }
  // A slab: layers [1, 3) of this chunk and of a copy of it, K records of
  // both, then V records of both, as a layer-wise reader stages them.
  {
    const LayerRange r{1, 3};
    const uint32_t n = 2;
    const uint64_t kb = n * l.k.layer_stride, vb = n * l.v.layer_stride;
    uint8_t* slab = nullptr;
    void* slab_ws = nullptr;
    KVTIER_ASSERT_CUDA(cudaMalloc(&slab, 2 * (kb + vb)));
    KVTIER_ASSERT_CUDA(cudaMalloc(&slab_ws, StagedRecordsWorkspaceBytes(*header, r, 2)));
    for (uint32_t c = 0; c < 2; ++c) {
      KVTIER_ASSERT_CUDA(cudaMemcpy(slab + c * kb, chunk->data() + l.k_offset + l.k.data_offset(1),
                                    kb, cudaMemcpyHostToDevice));
      KVTIER_ASSERT_CUDA(cudaMemcpy(slab + 2 * kb + c * vb,
                                    chunk->data() + l.v_offset + l.v.data_offset(1), vb,
                                    cudaMemcpyHostToDevice));
    }
    StagedRecords two{slab, slab + 2 * kb, r, 2};
    ASSERT_TRUE(HashStagedRecords(*header, two, slab_ws, out, nullptr).ok());
    std::vector<uint64_t> sums(4 * n);
    KVTIER_ASSERT_CUDA(cudaMemcpy(sums.data(), out, sums.size() * 8, cudaMemcpyDeviceToHost));
    for (uint32_t c = 0; c < 2; ++c) {
      for (uint32_t j = 0; j < n; ++j) {
        EXPECT_EQ(sums[c * n + j], codec::StoredRecordChecksum(l.k, ks, 1 + j)) << c << " " << j;
        EXPECT_EQ(sums[2 * n + c * n + j], codec::StoredRecordChecksum(l.v, vs, 1 + j))
            << c << " " << j;
      }
    }
    cudaFree(slab);
    cudaFree(slab_ws);
  }
  cudaFree(d);
  cudaFree(out);
  cudaFree(ws);
}

}  // namespace
}  // namespace kvtier::kernels
