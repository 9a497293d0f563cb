#include "bandwidth/model.h"

#include <cmath>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "bandwidth/presets.h"

namespace kvtier::bandwidth {
namespace {

ModelSpec Preset(const char* name) {
  absl::StatusOr<ModelSpec> m = FindModelPreset(name);
  EXPECT_TRUE(m.ok()) << m.status();
  return *m;
}

codec::CodecFormat Codec(const char* name) {
  absl::StatusOr<codec::CodecFormat> c = codec::ParseCodec(name, codec::DType::kBF16);
  EXPECT_TRUE(c.ok()) << c.status();
  return *c;
}

TEST(KvBytesPerToken, NativeIsTwoSectionsOfTwoBytesPerElement) {
  // 2 (K, V) x 32 layers x 8 kv heads x 128 dims x 2 bytes.
  EXPECT_EQ(*KvBytesPerToken(Preset("Llama-3.1-8B"), Codec("k16v16")), 131072.0);
  // 2 x 80 x 8 x 128 x 2.
  EXPECT_EQ(*KvBytesPerToken(Preset("Llama-3.1-70B"), Codec("k16v16")), 327680.0);
  // Phi-4: 2 x 40 x 10 x 128 x 2.
  EXPECT_EQ(*KvBytesPerToken(Preset("Phi-4-14B"), Codec("k16v16")), 204800.0);
}

TEST(KvBytesPerToken, QuantizedSectionsIncludeTheirScales) {
  // Per layer of a 256-token chunk, Llama-3.1-8B (8 kv heads x 128 dims):
  //   K bf16: 256*8*128*2 = 524288
  //   V fp8 per-(block,head): 256*8*128 = 262144 + 4 * (256/16 * 8) = 512 scale bytes
  // (524288 + 262656) * 32 layers / 256 tokens = 98368.
  EXPECT_EQ(*KvBytesPerToken(Preset("Llama-3.1-8B"), Codec("k16v8")), 98368.0);
  // k8v8: 2 * 262656 * 32 / 256.
  EXPECT_EQ(*KvBytesPerToken(Preset("Llama-3.1-8B"), Codec("k8v8")), 65664.0);
  // k16v4: V int4 per-(token,head): 131072 + 4 * 256*8 = 139264.
  EXPECT_EQ(*KvBytesPerToken(Preset("Llama-3.1-8B"), Codec("k16v4")), 82944.0);
  // Llama-3.1-70B k16v8: 786944 * 80 / 256.
  EXPECT_EQ(*KvBytesPerToken(Preset("Llama-3.1-70B"), Codec("k16v8")), 245920.0);
}

TEST(KvBytesPerToken, BlockSizeChangesOnlyTheScaleBytes) {
  ChunkingOptions chunking;
  chunking.block_size = 256;  // one scale per head per layer: 8 * 4 = 32 bytes
  // (524288 + 262144 + 32) * 32 / 256.
  EXPECT_EQ(*KvBytesPerToken(Preset("Llama-3.1-8B"), Codec("k16v8"), chunking), 98308.0);
}

TEST(KvBytesPerToken, GeometryOutsideFormatLimitsIsInvalidArgument) {
  ModelSpec m = Preset("Llama-3.1-8B");
  m.head_dim = 2048;
  EXPECT_EQ(KvBytesPerToken(m, Codec("k16v16")).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(StepKvBytes, IsBatchTimesContextTimesBytesPerToken) {
  EXPECT_EQ(StepKvBytes(131072, 131072, 32), 549755813888.0);
  EXPECT_EQ(StepKvBytes(245920, 131072, 32), 1031463239680.0);
  EXPECT_EQ(StepKvBytes(100, 1, 1), 100.0);
}

TEST(WeightBytes, IsParamsTimesBytesPerParam) {
  EXPECT_EQ(WeightBytes(Preset("Llama-3.1-70B")), 141107412992.0);
  ModelSpec fp32 = Preset("Llama-3.1-8B");
  fp32.weight_bytes_per_param = 4;
  EXPECT_EQ(WeightBytes(fp32), 32121044992.0);
}

TEST(RequiredBandwidth, IsBytesOverLatency) {
  EXPECT_DOUBLE_EQ(RequiredBandwidth(1e9, 0.010), 1e11);
  EXPECT_DOUBLE_EQ(RequiredBandwidth(1031463239680.0, 0.010), 103146323968000.0);
}

TEST(Shortfall, IsRequiredOverLink) {
  EXPECT_DOUBLE_EQ(Shortfall(1e12, 64e9), 15.625);
  EXPECT_DOUBLE_EQ(Shortfall(103146323968000.0, 64e9), 1611.661312);
  EXPECT_DOUBLE_EQ(Shortfall(1e9, 4e9), 0.25);
}

TEST(KvFraction, IsKvOverTotal) {
  EXPECT_DOUBLE_EQ(KvFraction(3, 1), 0.75);
  EXPECT_DOUBLE_EQ(KvFraction(0, 5), 0.0);
  EXPECT_DOUBLE_EQ(KvFraction(0, 0), 0.0);
}

TEST(CodecSpeedupBound, MatchesHandValues) {
  EXPECT_DOUBLE_EQ(CodecSpeedupBound(0.5, 0.5), 4.0 / 3.0);
  EXPECT_DOUBLE_EQ(CodecSpeedupBound(1.0, 0.75), 4.0 / 3.0);
  EXPECT_DOUBLE_EQ(CodecSpeedupBound(0.0, 0.25), 1.0);  // no KV traffic, no gain
  EXPECT_DOUBLE_EQ(CodecSpeedupBound(0.8, 1.0), 1.0);   // a codec that keeps every byte
}

TEST(HillSaturation, HalfSaturationAtBh) {
  HillCurve h;
  EXPECT_DOUBLE_EQ(HillSaturation(h, 5.1), 3.75 / 2);
  EXPECT_DOUBLE_EQ(HillSaturation(h, 0), 0.0);
  // 3.75 * 32^1.32 / (5.1^1.32 + 32^1.32)
  EXPECT_NEAR(HillSaturation(h, 32), 3.4449457704661364, 1e-12);
  EXPECT_LT(HillSaturation(h, 1e6), 3.75);
  EXPECT_NEAR(HillSaturation(h, 1e6), 3.75, 1e-6);
}

TEST(HillSaturation, OverriddenParameters) {
  HillCurve h{.s_max = 2, .b_half = 1, .g = 1};
  EXPECT_DOUBLE_EQ(HillSaturation(h, 1), 1.0);
  EXPECT_DOUBLE_EQ(HillSaturation(h, 3), 1.5);
}

TEST(ValidateHill, NonPositiveParameterIsInvalidArgument) {
  EXPECT_TRUE(ValidateHill(HillCurve{}).ok());
  EXPECT_EQ(ValidateHill(HillCurve{.s_max = 0}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ValidateHill(HillCurve{.b_half = -1}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ValidateHill(HillCurve{.g = NAN}).code(), absl::StatusCode::kInvalidArgument);
}

TEST(ValidateModel, ZeroOrOversizedFieldIsInvalidArgument) {
  ModelSpec m = Preset("Qwen2.5-7B");
  EXPECT_TRUE(ValidateModel(m).ok());
  ModelSpec zero_layers = m;
  zero_layers.num_layers = 0;
  EXPECT_THAT(ValidateModel(zero_layers).message(), testing::HasSubstr("num_layers"));
  EXPECT_EQ(ValidateModel(zero_layers).code(), absl::StatusCode::kInvalidArgument);
  ModelSpec no_params = m;
  no_params.param_count = 0;
  EXPECT_EQ(ValidateModel(no_params).code(), absl::StatusCode::kInvalidArgument);
  ModelSpec heads = m;
  heads.num_kv_heads = 5000;
  EXPECT_EQ(ValidateModel(heads).code(), absl::StatusCode::kInvalidArgument);
  ModelSpec bytes = m;
  bytes.weight_bytes_per_param = -2;
  EXPECT_EQ(ValidateModel(bytes).code(), absl::StatusCode::kInvalidArgument);
}

TEST(EstimateParamCount, MissingShapeFieldIsInvalidArgument) {
  ModelSpec m = Preset("Llama-3.1-8B");
  m.arch.intermediate_size = 0;
  absl::StatusOr<uint64_t> n = EstimateParamCount(m);
  EXPECT_EQ(n.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(n.status().message(), testing::HasSubstr("intermediate_size"));
}

TEST(EstimateParamCount, BiasesTiesAndExpertsAddTheirWeights) {
  ModelSpec m = Preset("Llama-3.1-8B");
  const uint64_t base = *EstimateParamCount(m);
  ModelSpec tied = m;
  tied.arch.tie_word_embeddings = true;
  EXPECT_EQ(*EstimateParamCount(tied), base - 128256ull * 4096);
  ModelSpec bias = m;
  bias.arch.qkv_bias = true;
  bias.arch.o_bias = true;
  // Per layer: q 4096 + k 1024 + v 1024 + o 4096.
  EXPECT_EQ(*EstimateParamCount(bias), base + 32ull * (4096 + 1024 + 1024 + 4096));
  ModelSpec moe = m;
  moe.arch.num_experts = 8;
  // Per layer: 7 more MLPs of 3 x 4096 x 14336 and a 4096 x 8 router.
  EXPECT_EQ(*EstimateParamCount(moe), base + 32ull * (7ull * 3 * 4096 * 14336 + 4096 * 8));
}

TEST(LoadOrRecompute, LoadTimeIsLatencyPlusBytesOverBandwidth) {
  EXPECT_DOUBLE_EQ(LoadMicros(25'182'336, 7e9, 100), 100 + 25'182'336 / 7e3);
  EXPECT_DOUBLE_EQ(LoadMicros(0, 1e9, 20), 20);
  EXPECT_DOUBLE_EQ(RecomputeMicros(256, 10'000), 25'600);
  EXPECT_EQ(RecomputeMicros(256, 0), 0);
  EXPECT_EQ(RecomputeMicros(256, -5), 0);
}

TEST(LoadOrRecompute, BestPrefixMaximizesTheTimeSaved) {
  // Every chunk loads faster than it recomputes: load them all.
  const double fast[] = {1000, 1000, 2000};
  LoadDecision d = BestLoadPrefix(fast, 2500);
  EXPECT_EQ(d.chunks, 3u);
  EXPECT_DOUBLE_EQ(d.load_us, 4000);
  EXPECT_DOUBLE_EQ(d.recompute_us, 7500);
  EXPECT_DOUBLE_EQ(d.saved_us(), 3500);
  // A slow chunk in the middle (say, remote) is worth loading when the fast
  // ones after it make up for it...
  const double middle[] = {1000, 4000, 1000, 1000};
  EXPECT_EQ(BestLoadPrefix(middle, 2500).chunks, 4u);
  // ... and not when they do not: stop before it.
  const double tail[] = {1000, 9000, 1000};
  EXPECT_EQ(BestLoadPrefix(tail, 2500).chunks, 1u);
  // Nothing saves time: recompute everything.
  const double slow[] = {3000, 3000};
  LoadDecision none = BestLoadPrefix(slow, 2500);
  EXPECT_EQ(none.chunks, 0u);
  EXPECT_EQ(none.saved_us(), 0);
  // A tie is resolved towards the shorter prefix.
  const double even[] = {1000, 2500};
  EXPECT_EQ(BestLoadPrefix(even, 2500).chunks, 1u);
  EXPECT_EQ(BestLoadPrefix({}, 2500).chunks, 0u);
  // Unknown recompute cost (0): loading never "saves" anything.
  EXPECT_EQ(BestLoadPrefix(fast, 0).chunks, 0u);
}

}  // namespace
}  // namespace kvtier::bandwidth
