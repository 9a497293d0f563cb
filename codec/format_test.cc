#include "codec/format.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvtier::codec {
namespace {

using ::testing::HasSubstr;

constexpr SectionFormat kNative16{DType::kBF16, ScaleGranularity::kNone};
constexpr SectionFormat kFp8BlockHead{DType::kFP8E4M3, ScaleGranularity::kPerBlockHead};

TEST(ComputeLayout, Llama8BChunkOf256TokensK16V8HasExactSize) {
  Geometry g{32, 8, 128, 256, 16};
  auto layout = ComputeLayout(g, kNative16, kFp8BlockHead);
  ASSERT_TRUE(layout.ok()) << layout.status();
  // K: 32 layers x 256 x 8 x 128 x 2 bytes, then 32 record checksums.
  EXPECT_EQ(layout->k.table_offset, 16777216u);
  EXPECT_EQ(layout->k.table_bytes, 256u);
  EXPECT_EQ(layout->k.bytes, 16777216u + 256u);
  EXPECT_EQ(layout->k.scale_count, 0u);
  // V: per layer 262144 data bytes + 16 blocks x 8 heads x 4 scale bytes.
  EXPECT_EQ(layout->v.data_bytes, 262144u);
  EXPECT_EQ(layout->v.scale_count, 128u);
  EXPECT_EQ(layout->v.scale_bytes, 512u);
  EXPECT_EQ(layout->v.bytes, 32u * 262656u + 256u);
  EXPECT_EQ(layout->k_offset, 128u);
  EXPECT_EQ(layout->v_offset, 128u + 16777472u);
  EXPECT_EQ(layout->total_bytes, 128u + 16777472u + 8405248u);
  // Version 1 has no tables.
  auto v1 = ComputeLayout(g, kNative16, kFp8BlockHead, 1);
  ASSERT_TRUE(v1.ok()) << v1.status();
  EXPECT_EQ(v1->version, 1);
  EXPECT_EQ(v1->k.bytes, 16777216u);
  EXPECT_EQ(v1->total_bytes, 128u + 16777216u + 8404992u);
  EXPECT_EQ(ComputeLayout(g, kNative16, kFp8BlockHead, 3).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ComputeLayout(g, kNative16, kFp8BlockHead, 0).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(ComputeLayout, PadsEverySubArrayTo16Bytes) {
  Geometry g{3, 1, 2, 3, 2};  // 6 elements a layer
  auto layout = ComputeLayout(g, {DType::kINT4, ScaleGranularity::kPerTokenHead},
                              {DType::kINT8, ScaleGranularity::kPerBlockHead});
  ASSERT_TRUE(layout.ok()) << layout.status();
  EXPECT_EQ(layout->k.data_bytes, 16u);  // 3 bytes -> 16
  EXPECT_EQ(layout->k.scale_count, 3u);
  EXPECT_EQ(layout->k.scale_bytes, 16u);  // 12 -> 16
  EXPECT_EQ(layout->v.scale_count, 2u);   // ceil(3 / 2) blocks
  EXPECT_EQ(layout->k.bytes % 16, 0u);
  EXPECT_EQ(layout->v_offset % 16, 0u);
}

TEST(ComputeLayout, ScaleIndexFollowsGranularity) {
  Geometry g{1, 4, 8, 40, 16};
  auto bh = ComputeLayout(g, kNative16, kFp8BlockHead);
  ASSERT_TRUE(bh.ok());
  EXPECT_EQ(bh->v.scale_index(0, 0), 0u);
  EXPECT_EQ(bh->v.scale_index(15, 3), 3u);
  EXPECT_EQ(bh->v.scale_index(16, 0), 4u);
  EXPECT_EQ(bh->v.scale_index(39, 2), 2u * 4 + 2);
  auto th = ComputeLayout(g, kNative16, {DType::kINT8, ScaleGranularity::kPerTokenHead});
  ASSERT_TRUE(th.ok());
  EXPECT_EQ(th->v.scale_index(39, 2), 39u * 4 + 2);
  auto pt = ComputeLayout(g, kNative16, {DType::kINT8, ScaleGranularity::kPerTensor});
  ASSERT_TRUE(pt.ok());
  EXPECT_EQ(pt->v.scale_count, 1u);
  EXPECT_EQ(pt->v.scale_index(39, 3), 0u);
}

TEST(ComputeLayout, RejectsOutOfRangeGeometryNamingTheField) {
  struct Case {
    Geometry g;
    const char* field;
  } cases[] = {
      {{0, 8, 128, 256, 16}, "num_layers"},      {{1025, 8, 128, 256, 16}, "num_layers"},
      {{32, 0, 128, 256, 16}, "num_kv_heads"},   {{32, 8, 0, 256, 16}, "head_dim"},
      {{32, 8, 2048, 256, 16}, "head_dim"},      {{32, 8, 128, 0, 16}, "num_tokens"},
      {{32, 8, 128, (1u << 20) + 1, 16}, "num_tokens"}, {{32, 8, 128, 256, 0}, "block_size"},
  };
  for (const Case& c : cases) {
    auto r = ComputeLayout(c.g, kNative16, kFp8BlockHead);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << c.field;
    EXPECT_THAT(r.status().message(), HasSubstr(c.field));
  }
}

TEST(ComputeLayout, RejectsChunksOverTheSizeLimit) {
  Geometry g{1024, 1024, 1024, 1024, 16};
  auto r = ComputeLayout(g, kNative16, kNative16);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr("exceeds the limit"));
}

TEST(ComputeLayout, RejectsBadFormatGranularityPairs) {
  Geometry g{2, 2, 64, 16, 16};
  EXPECT_THAT(ComputeLayout(g, {DType::kBF16, ScaleGranularity::kPerTensor}, kFp8BlockHead)
                  .status()
                  .message(),
              HasSubstr("k_granularity"));
  EXPECT_THAT(ComputeLayout(g, kNative16, {DType::kFP8E4M3, ScaleGranularity::kNone})
                  .status()
                  .message(),
              HasSubstr("v_granularity"));
  EXPECT_THAT(ComputeLayout(g, kNative16, {static_cast<DType>(9), ScaleGranularity::kNone})
                  .status()
                  .message(),
              HasSubstr("v_format"));
  EXPECT_THAT(ComputeLayout(g, kNative16, {DType::kFP8E4M3, static_cast<ScaleGranularity>(7)})
                  .status()
                  .message(),
              HasSubstr("v_granularity"));
  Geometry odd{2, 2, 63, 16, 16};
  EXPECT_THAT(ComputeLayout(odd, kNative16, {DType::kINT4, ScaleGranularity::kPerTokenHead})
                  .status()
                  .message(),
              HasSubstr("head_dim"));
}

TEST(ParseCodec, KnowsEveryPresetAndRoundTripsNames) {
  for (const char* name : {"k16v16", "k16v8", "k8v8", "k16v4", "k8v4", "k16vi8", "ki8vi8"}) {
    auto c = ParseCodec(name, DType::kFP16);
    ASSERT_TRUE(c.ok()) << name;
    EXPECT_EQ(CodecName(*c), name);
  }
  auto k16v8 = ParseCodec("k16v8", DType::kBF16);
  ASSERT_TRUE(k16v8.ok());
  EXPECT_EQ(k16v8->k.dtype, DType::kBF16);
  EXPECT_EQ(k16v8->v.dtype, DType::kFP8E4M3);
  EXPECT_EQ(k16v8->v.granularity, ScaleGranularity::kPerBlockHead);
}

TEST(ParseCodec, AcceptsTheExplicitForm) {
  auto c = ParseCodec("k=16,v=int8/tensor", DType::kFP16);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->k.dtype, DType::kFP16);
  EXPECT_EQ(c->v.dtype, DType::kINT8);
  EXPECT_EQ(c->v.granularity, ScaleGranularity::kPerTensor);
  EXPECT_EQ(CodecName(*c), "k=16,v=int8/tensor");
  auto d = ParseCodec("k=fp8e4m3,v=int4/token-head", DType::kBF16);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(CodecName(*d), "k8v4");
}

TEST(ParseCodec, RejectsUnknownNames) {
  for (const char* bad : {"", "k16", "k32v8", "k=16,v=fp32", "k=16,v=int8/row", "k=16/tensor,v=16",
                          "v=16,k=16", "k=bf16,v=16", "k=16,v=int8/none"}) {
    EXPECT_EQ(ParseCodec(bad, DType::kBF16).status().code(), absl::StatusCode::kInvalidArgument)
        << bad;
  }
  EXPECT_EQ(ParseCodec("k16v8", DType::kINT8).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(BytesPerToken, IncludesScales) {
  Geometry g{32, 8, 128, 256, 16};
  auto k16v16 = BytesPerToken(g, kNative16, kNative16);
  ASSERT_TRUE(k16v16.ok());
  EXPECT_DOUBLE_EQ(*k16v16, 131072.0);
  auto k16v8 = BytesPerToken(g, kNative16, kFp8BlockHead);
  ASSERT_TRUE(k16v8.ok());
  EXPECT_DOUBLE_EQ(*k16v8, (16777216.0 + 8404992.0) / 256.0);
}

}  // namespace
}  // namespace kvtier::codec
