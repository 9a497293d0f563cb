#include "kernels/reference.h"

#include <cstring>
#include <vector>

#include "codec/codec.h"
#include "gtest/gtest.h"
#include "kernels/test_util.h"

namespace kvtier::kernels {
namespace {

using codec::DType;
using testing::Fill;
using testing::HostCache;

codec::ChunkSpec Spec(const PagedKvLayout& d, uint32_t tokens, DType dtype, codec::SectionFormat k,
                      codec::SectionFormat v) {
  codec::ChunkSpec s;
  s.geometry = {d.num_layers, d.num_kv_heads, d.head_dim, tokens, d.block_size};
  s.dtype = dtype;
  s.k = k;
  s.v = v;
  return s;
}

constexpr codec::SectionFormat kFp8BH{DType::kFP8E4M3, codec::ScaleGranularity::kPerBlockHead};

TEST(ReferenceGatherEncode, K16V16RoundTripsThroughEveryLayoutAndLeavesOtherSlots) {
  for (CacheLayout kind :
       {CacheLayout::kVllmFlashAttnNHD, CacheLayout::kVllmFlashAttnHND,
        CacheLayout::kVllmFlashInferNHD, CacheLayout::kVllmFlashInferHND,
        CacheLayout::kSeparateNHD, CacheLayout::kSeparateHND}) {
    auto d = MakePagedKvLayout(kind, 3, 9, 16, 2, 64, DType::kFP16, DType::kFP16);
    ASSERT_TRUE(d.ok());
    HostCache src, dst, expect;
    src.Init(kind, *d);
    src.FillValues(Fill::kNormal, 11);
    std::vector<int32_t> ids = testing::ShuffledBlocks(9, 4, 5);
    BlockSpan span{ids.data(), ids.data(), 4, 7};  // 7 + 50 tokens over 4 blocks
    codec::ChunkSpec spec = Spec(*d, 50, DType::kFP16, {DType::kFP16, codec::ScaleGranularity::kNone},
                                 {DType::kFP16, codec::ScaleGranularity::kNone});
    auto chunk = ReferenceGatherEncode(spec, src.layout, span);
    ASSERT_TRUE(chunk.ok()) << chunk.status();
    ASSERT_TRUE(codec::VerifyChunk(*chunk).ok());
    dst.Init(kind, *d);
    dst.Poison(0xA5);
    ASSERT_TRUE(ReferenceDecodeScatter(*chunk, dst.layout, span).ok());
    for (uint32_t l = 0; l < 3; ++l)
      for (uint32_t b = 0; b < 9; ++b)
        for (uint32_t s = 0; s < 16; ++s)
          for (uint32_t h = 0; h < 2; ++h)
            for (uint32_t e = 0; e < 64; e += 7) {
              int list = -1;
              for (int i = 0; i < 4; ++i)
                if (ids[i] == static_cast<int32_t>(b)) list = i;
              const uint32_t pos = list * 16 + s;
              const bool covered = list >= 0 && pos >= 7 && pos < 57;
              for (bool is_v : {false, true}) {
                int64_t el = is_v ? d->v_elem(b, s, h, e) : d->k_elem(b, s, h, e);
                const uint16_t* sp = static_cast<const uint16_t*>(
                    is_v ? src.layout.v_layers[l] : src.layout.k_layers[l]);
                const uint16_t* dp = static_cast<const uint16_t*>(
                    is_v ? dst.layout.v_layers[l] : dst.layout.k_layers[l]);
                if (covered) {
                  ASSERT_EQ(dp[el], sp[el]) << CacheLayoutName(kind);
                } else {
                  ASSERT_EQ(dp[el], 0xA5A5) << CacheLayoutName(kind);
                }
              }
            }
  }
}

TEST(ReferenceDecodeScatter, LayerRangeWritesOnlyItsLayers) {
  auto d = MakePagedKvLayout(CacheLayout::kVllmFlashAttnNHD, 5, 6, 16, 2, 64, DType::kBF16,
                             DType::kBF16);
  ASSERT_TRUE(d.ok());
  HostCache src, full, ranged;
  src.Init(CacheLayout::kVllmFlashAttnNHD, *d);
  src.FillValues(Fill::kNormal, 21);
  std::vector<int32_t> ids = testing::ShuffledBlocks(6, 3, 8);
  BlockSpan span{ids.data(), ids.data(), 3, 2};
  codec::ChunkSpec spec = Spec(*d, 40, DType::kBF16, {DType::kBF16, codec::ScaleGranularity::kNone},
                               kFp8BH);
  auto chunk = ReferenceGatherEncode(spec, src.layout, span);
  ASSERT_TRUE(chunk.ok()) << chunk.status();
  full.Init(CacheLayout::kVllmFlashAttnNHD, *d);
  ranged.Init(CacheLayout::kVllmFlashAttnNHD, *d);
  full.Poison(0x11);
  ranged.Poison(0x11);
  ASSERT_TRUE(ReferenceDecodeScatter(*chunk, full.layout, span).ok());
  ASSERT_TRUE(ReferenceDecodeScatter(*chunk, ranged.layout, span, LayerRange{1, 3}).ok());
  HostCache untouched;
  untouched.Init(CacheLayout::kVllmFlashAttnNHD, *d);
  untouched.Poison(0x11);
  for (uint32_t l = 0; l < 5; ++l) {
    const bool in = l >= 1 && l < 3;
    EXPECT_EQ(ranged.k_tensors[l], in ? full.k_tensors[l] : untouched.k_tensors[l]) << l;
  }
  EXPECT_EQ(ReferenceDecodeScatter(*chunk, ranged.layout, span, LayerRange{3, 6}).code(),
            absl::StatusCode::kInvalidArgument);
}

// The tests' cache comparison names the first layer, tensor and entry that
// differ, and "" for equal caches.
TEST(CacheDifference, NamesTheFirstDifference) {
  auto d = MakePagedKvLayout(CacheLayout::kSeparateNHD, 3, 4, 16, 2, 64, DType::kBF16,
                             DType::kFP8E4M3);
  ASSERT_TRUE(d.ok());
  HostCache a, b;
  for (HostCache* c : {&a, &b}) {  // the same contents
    c->Init(CacheLayout::kSeparateNHD, *d);
    c->FillValues(Fill::kNormal, 5);
  }
  EXPECT_EQ(testing::CacheDifference(a, b), "");
  b.v_scales[2][3] += 1.0f;
  EXPECT_EQ(testing::CacheDifference(a, b), "layer 2 V scales at entry 3");
  b.v_tensors[1][100] ^= 1;
  EXPECT_EQ(testing::CacheDifference(a, b), "layer 1 V at entry 100");
  b.k_tensors[1][7] ^= 1;
  EXPECT_EQ(testing::CacheDifference(a, b), "layer 1 K at entry 7");
}

TEST(LayerRecordBytes, CoverEachSectionsRecordsOfTheRange) {
  codec::Geometry g{4, 2, 64, 32, 16};
  auto layout = codec::ComputeLayout(g, {DType::kBF16, codec::ScaleGranularity::kNone}, kFp8BH);
  ASSERT_TRUE(layout.ok());
  auto all = LayerRecordBytes(*layout, LayerRange{});
  ASSERT_EQ(all.size(), 2u);
  EXPECT_EQ(all[0].first, layout->k_offset);
  // The records, not the record table after them.
  EXPECT_EQ(all[0].second, layout->k_offset + layout->k.table_offset);
  EXPECT_EQ(all[1].first, layout->v_offset);
  EXPECT_EQ(all[1].second, layout->v_offset + layout->v.table_offset);
  auto one = LayerRecordBytes(*layout, LayerRange{2, 3});
  EXPECT_EQ(one[0].second - one[0].first, layout->k.layer_stride);
  EXPECT_EQ(one[1].first, layout->v_offset + 2 * layout->v.layer_stride);
}

TEST(ReferenceGatherEncode, Fp8CachePassesCodesAndScalesThrough) {
  auto d = MakePagedKvLayout(CacheLayout::kSeparateHND, 2, 6, 16, 2, 64, DType::kBF16,
                             DType::kFP8E4M3);
  ASSERT_TRUE(d.ok());
  HostCache src, dst;
  src.Init(CacheLayout::kSeparateHND, *d);
  src.FillValues(Fill::kIntegers, 3);
  std::vector<int32_t> ids = {4, 0, 5};
  BlockSpan span{ids.data(), ids.data(), 3, 0};
  codec::ChunkSpec spec =
      Spec(*d, 40, DType::kBF16, {DType::kBF16, codec::ScaleGranularity::kNone}, kFp8BH);
  auto chunk = ReferenceGatherEncode(spec, src.layout, span);
  ASSERT_TRUE(chunk.ok()) << chunk.status();
  dst.Init(CacheLayout::kSeparateHND, *d);
  dst.Poison(0);
  ASSERT_TRUE(ReferenceDecodeScatter(*chunk, dst.layout, span).ok());
  for (uint32_t l = 0; l < 2; ++l)
    for (uint32_t t = 0; t < 40; ++t)
      for (uint32_t h = 0; h < 2; ++h) {
        uint32_t b = ids[t / 16];
        EXPECT_EQ(0, std::memcmp(src.layout.v_ptr<uint8_t>(l, b, t % 16, h),
                                 dst.layout.v_ptr<uint8_t>(l, b, t % 16, h), 64));
        EXPECT_EQ(src.v_scales[l][d->scale_index(b, h)], dst.v_scales[l][d->scale_index(b, h)]);
      }
  // Unaligned chunks cannot pass FP8 through.
  span.first_slot = 3;
  EXPECT_EQ(ReferenceGatherEncode(spec, src.layout, span).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(ReferenceGatherEncode, DtypeMismatchIsInvalidArgument) {
  auto d = MakePagedKvLayout(CacheLayout::kSeparateNHD, 1, 2, 16, 1, 64, DType::kBF16,
                             DType::kBF16);
  HostCache src;
  src.Init(CacheLayout::kSeparateNHD, *d);
  std::vector<int32_t> ids = {0};
  BlockSpan span{ids.data(), ids.data(), 1, 0};
  codec::ChunkSpec spec = Spec(*d, 16, DType::kFP16, {DType::kFP16, codec::ScaleGranularity::kNone},
                               kFp8BH);
  EXPECT_EQ(ReferenceGatherEncode(spec, src.layout, span).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(ReferenceDecodeAttention, UniformValuesAndOneHotKeys) {
  auto d = MakePagedKvLayout(CacheLayout::kVllmFlashAttnNHD, 1, 4, 16, 1, 64, DType::kBF16,
                             DType::kBF16);
  HostCache c;
  c.Init(CacheLayout::kVllmFlashAttnNHD, *d);
  c.FillValues(Fill::kZero, 0);
  // Key of token 5 is 4 * e_0, V of token 5 is 1, other V are 0.
  uint16_t* base = static_cast<uint16_t*>(c.layout.k_layers[0]);
  std::vector<int32_t> table = {2, 0};
  base[d->k_elem(2, 5, 0, 0)] = codec::FloatToBf16(4.0f);
  for (uint32_t e = 0; e < 64; ++e) base[d->v_elem(2, 5, 0, e)] = codec::FloatToBf16(1.0f);
  std::vector<uint16_t> q(64, codec::FloatToBf16(0.0f));
  q[0] = codec::FloatToBf16(8.0f);  // logit of token 5: 32 * scale 1 -> dominates
  std::vector<int32_t> lens = {20};
  DecodeAttentionParams p;
  p.q = q.data();
  p.batch = 1;
  p.num_q_heads = 1;
  p.block_table = table.data();
  p.max_blocks_per_seq = 2;
  p.seq_lens = lens.data();
  p.sm_scale = 1.0f;
  p.out = q.data();
  auto out = ReferenceDecodeAttention(c.layout, p);
  ASSERT_TRUE(out.ok()) << out.status();
  // softmax weight of token 5: 1 / (1 + 19 e^-32)
  EXPECT_NEAR((*out)[0], 1.0f, 1e-6f);
  EXPECT_NEAR((*out)[63], 1.0f, 1e-6f);
  lens[0] = 33;  // beyond 2 blocks
  EXPECT_EQ(ReferenceDecodeAttention(c.layout, p).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvtier::kernels
