// The launchers reject invalid input with a Status before touching the
// device, so these run (and must pass) on machines without a GPU.
#include <vector>

#include "gtest/gtest.h"
#include "kernels/paged_attention.h"
#include "kernels/paged_codec.h"
#include "kernels/test_util.h"

namespace kvtier::kernels {
namespace {

using codec::DType;

struct Fixture {
  testing::HostCache cache;  // host pointers: never dereferenced, nothing launches
  std::vector<int32_t> ids = {2, 0, 1};
  BlockSpan span;
  codec::ChunkSpec spec;
  alignas(16) uint8_t dst[16];
  uint32_t ws[2];

  explicit Fixture(uint32_t head_dim = 128, uint32_t block_size = 16) {
    auto d = MakePagedKvLayout(CacheLayout::kVllmFlashAttnNHD, 2, 3, block_size, 2, head_dim,
                               DType::kBF16, DType::kBF16);
    cache.Init(CacheLayout::kVllmFlashAttnNHD, *d);
    span = BlockSpan{ids.data(), ids.data(), 3, 0};
    spec.geometry = {2, 2, head_dim, 40, block_size};
    spec.dtype = DType::kBF16;
    spec.k = {DType::kBF16, codec::ScaleGranularity::kNone};
    spec.v = {DType::kFP8E4M3, codec::ScaleGranularity::kPerBlockHead};
  }
  absl::StatusCode Encode() {
    return GatherEncode(spec, cache.layout, span, dst, ws, nullptr).code();
  }
};

TEST(GatherEncodeLaunch, NullPointersAreInvalidArgument) {
  Fixture f;
  f.cache.layout.k_layers = nullptr;
  EXPECT_EQ(f.Encode(), absl::StatusCode::kInvalidArgument);
  Fixture g;
  EXPECT_EQ(GatherEncode(g.spec, g.cache.layout, g.span, nullptr, g.ws, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(GatherEncode(g.spec, g.cache.layout, g.span, g.dst, nullptr, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  g.span.block_ids = nullptr;
  EXPECT_EQ(g.Encode(), absl::StatusCode::kInvalidArgument);
}

TEST(GatherEncodeLaunch, OutOfRangeBlockIdIsInvalidArgument) {
  Fixture f;
  f.ids[1] = 3;  // the cache has 3 blocks
  EXPECT_EQ(f.Encode(), absl::StatusCode::kInvalidArgument);
  f.ids[1] = -2;
  EXPECT_EQ(f.Encode(), absl::StatusCode::kInvalidArgument);
  Fixture g;
  g.spec.geometry.num_tokens = 49;  // needs 4 blocks, the span lists 3
  EXPECT_EQ(g.Encode(), absl::StatusCode::kInvalidArgument);
}

TEST(GatherEncodeLaunch, UnsupportedSizesAndFormatsAreInvalidArgument) {
  Fixture f(96);  // head_dim 96: not 64/128/256
  EXPECT_EQ(f.Encode(), absl::StatusCode::kInvalidArgument);
  Fixture g(128, 24);  // block size 24
  EXPECT_EQ(g.Encode(), absl::StatusCode::kInvalidArgument);
  Fixture h;
  h.spec.v = {DType::kINT4, codec::ScaleGranularity::kPerTokenHead};  // CPU codec only
  EXPECT_EQ(h.Encode(), absl::StatusCode::kInvalidArgument);
  Fixture i;
  i.spec.geometry.num_kv_heads = 4;  // differs from the cache
  EXPECT_EQ(i.Encode(), absl::StatusCode::kInvalidArgument);
  Fixture j;
  j.spec.dtype = DType::kFP16;  // cache is bf16
  j.spec.k = {DType::kFP16, codec::ScaleGranularity::kNone};
  EXPECT_EQ(j.Encode(), absl::StatusCode::kInvalidArgument);
  Fixture k;
  EXPECT_EQ(GatherEncode(k.spec, k.cache.layout, k.span, k.dst + 8, k.ws, nullptr).code(),
            absl::StatusCode::kInvalidArgument);  // misaligned destination
}

TEST(DecodeScatterLaunch, InvalidInputIsInvalidArgument) {
  Fixture f;
  auto layout = codec::ValidateSpec(f.spec);
  ASSERT_TRUE(layout.ok());
  codec::ChunkHeader header;
  header.spec = f.spec;
  header.layout = *layout;
  f.ids[2] = 7;
  EXPECT_EQ(DecodeScatter(header, f.dst, f.cache.layout, f.span, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  Fixture g;
  EXPECT_EQ(DecodeScatter(header, nullptr, g.cache.layout, g.span, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  header.spec.geometry.head_dim = 64;
  EXPECT_EQ(DecodeScatter(header, g.dst, g.cache.layout, g.span, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
}

// The tensor-core partition rule on an H100 (132 SMs; 2 CTAs per SM for
// BF16 and K16/V8, 3 for FP8 at head_dim 128) picks the partition lengths
// that measured fastest in run 8 (bench/results/h100-2026-11-22-run8-*).
TEST(DecodeAttentionPartition, TensorCoreRuleFillsTheGpuAndItsLastWave) {
  // batch 32, ctx 8K: one partition, 256 CTAs in one wave.
  EXPECT_EQ(DecodeAttentionPartitionTokens(32, 8, 8192, 132, 2), 8192u);
  EXPECT_EQ(DecodeAttentionPartitionTokens(32, 8, 8192, 132, 3), 8192u);
  // batch 8: 8192 and 4096 leave SMs idle (64, 128 CTAs).
  EXPECT_EQ(DecodeAttentionPartitionTokens(8, 8, 8192, 132, 2), 2048u);
  // batch 64, FP8: 512 CTAs fill 1.29 waves of 396, 1024 2.59, 2048 5.17; 4096 is 10.3.
  EXPECT_EQ(DecodeAttentionPartitionTokens(64, 8, 8192, 132, 3), 1024u);
  EXPECT_EQ(DecodeAttentionPartitionTokens(64, 8, 8192, 132, 2), 8192u);
  EXPECT_EQ(DecodeAttentionPartitionTokens(32, 8, 32768, 132, 2), 8192u);
  EXPECT_EQ(DecodeAttentionPartitionTokens(32, 8, 32768, 132, 3), 2048u);
  EXPECT_EQ(DecodeAttentionPartitionTokens(32, 8, 2048, 132, 2), 2048u);
  // Too little work to fill the GPU at all: the most CTAs.
  EXPECT_EQ(DecodeAttentionPartitionTokens(1, 1, 100, 132, 2), kAttentionMinPartitionTokens);
  // Degenerate inputs stay in range.
  EXPECT_EQ(DecodeAttentionPartitionTokens(1, 1, 1, 0, 0), kAttentionMinPartitionTokens);
  EXPECT_LE(DecodeAttentionPartitionTokens(65535, 64, uint64_t{1} << 30, 132, 2),
            kAttentionMaxPartitionTokens);
}

}  // namespace
}  // namespace kvtier::kernels
