#include "bandwidth/model.h"

#include <cmath>
#include <vector>

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
}

TEST(LoadOrRecompute, LinearRecomputeIgnoresThePosition) {
  EXPECT_DOUBLE_EQ(RecomputeMicros(0, 256, {.tokens_per_s = 10'000}), 25'600);
  EXPECT_DOUBLE_EQ(RecomputeMicros(1'000'000, 256, {.tokens_per_s = 10'000}), 25'600);
  // Without a rate the cost is unknown: 0, attention term or not.
  EXPECT_EQ(RecomputeMicros(0, 256, {.tokens_per_s = 0}), 0);
  EXPECT_EQ(RecomputeMicros(0, 256, {.tokens_per_s = -5}), 0);
  EXPECT_EQ(RecomputeMicros(512, 256, {.tokens_per_s = 0, .attention_doubling_tokens = 1024}), 0);
  // C2 == 0 is the linear model bit for bit: tokens * 1e6 / rate.
  for (double rate : {10'000.0, 12'345.678, 39'999.9, 1e15}) {
    for (uint32_t tokens : {1u, 16u, 256u, 1000u}) {
      const std::vector<double> chunks = ChunkRecomputeMicros(5, tokens, {.tokens_per_s = rate});
      for (double us : chunks) EXPECT_EQ(us, static_cast<double>(tokens) * 1e6 / rate) << rate;
    }
  }
}

TEST(LoadOrRecompute, AttentionTermMakesLaterTokensCostMore) {
  const PrefillCost p{.tokens_per_s = 10'000, .attention_doubling_tokens = 1024};
  // 256 tokens at 10K tokens/s: 25.6 ms linear, times 1 + (a + 128) / 1024.
  EXPECT_DOUBLE_EQ(RecomputeMicros(0, 256, p), 25'600 * 1.125);
  EXPECT_DOUBLE_EQ(RecomputeMicros(256, 256, p), 25'600 * 1.375);
  EXPECT_DOUBLE_EQ(RecomputeMicros(1024, 256, p), 25'600 * 2.125);
  // One token at context C2 costs twice its short-context cost (100 us).
  const PrefillCost doubling_at_1000_5{.tokens_per_s = 10'000, .attention_doubling_tokens = 1000.5};
  EXPECT_DOUBLE_EQ(RecomputeMicros(1000, 1, doubling_at_1000_5), 200);
  EXPECT_DOUBLE_EQ(RecomputeMicros(0, 1, doubling_at_1000_5), 100 * (1 + 0.5 / 1000.5));
  // The cost is linear in position, so a range costs what its chunks cost.
  EXPECT_DOUBLE_EQ(RecomputeMicros(0, 1024, p), 102'400 * 1.5);
  const std::vector<double> chunks = ChunkRecomputeMicros(4, 256, p);
  ASSERT_EQ(chunks.size(), 4u);
  EXPECT_DOUBLE_EQ(chunks[0] + chunks[1] + chunks[2] + chunks[3], RecomputeMicros(0, 1024, p));
  for (size_t i = 0; i < chunks.size(); ++i) {
    EXPECT_EQ(chunks[i], RecomputeMicros(i * 256, 256, p)) << i;
    if (i > 0) {
      EXPECT_GT(chunks[i], chunks[i - 1]) << i;
    }
  }
  EXPECT_TRUE(ChunkRecomputeMicros(0, 256, p).empty());
  // A prefix of N tokens: 1e6 * N / r * (1 + N / (2 * C2)). Qwen2.5-7B's
  // shape (C2 = 6,525,288,448 non-embedding params / (2 * 28 * 28 * 128))
  // at 40K tokens/s: 24,576 tokens cost 614.4 ms linear, 846.7 ms with it.
  const PrefillCost qwen{.tokens_per_s = 40'000,
                         .attention_doubling_tokens = 6'525'288'448.0 / (2.0 * 28 * 28 * 128)};
  double total = 0, linear = 0;
  for (double us : ChunkRecomputeMicros(96, 256, qwen)) total += us;
  for (double us : ChunkRecomputeMicros(96, 256, {.tokens_per_s = 40'000})) linear += us;
  EXPECT_NEAR(linear, 614'400, 1e-6);
  EXPECT_NEAR(total, 614'400 * (1 + 24'576 / (2 * qwen.attention_doubling_tokens)), 1e-6);
  EXPECT_NEAR(total, 846'650, 50);
}

TEST(LoadOrRecompute, BestPrefixMaximizesTheTimeSaved) {
  const auto flat = [](size_t n, double us) { return std::vector<double>(n, us); };
  // Every chunk loads faster than it recomputes: load them all.
  const double fast[] = {1000, 1000, 2000};
  LoadDecision d = BestLoadPrefix(fast, flat(3, 2500));
  EXPECT_EQ(d.chunks, 3u);
  EXPECT_DOUBLE_EQ(d.load_us, 4000);
  EXPECT_DOUBLE_EQ(d.recompute_us, 7500);
  EXPECT_DOUBLE_EQ(d.saved_us(), 3500);
  // A slow chunk in the middle (say, remote) is worth loading when the fast
  // ones after it make up for it...
  const double middle[] = {1000, 4000, 1000, 1000};
  EXPECT_EQ(BestLoadPrefix(middle, flat(4, 2500)).chunks, 4u);
  // ... and not when they do not: stop before it.
  const double tail[] = {1000, 9000, 1000};
  EXPECT_EQ(BestLoadPrefix(tail, flat(3, 2500)).chunks, 1u);
  // Nothing saves time: recompute everything.
  const double slow[] = {3000, 3000};
  LoadDecision none = BestLoadPrefix(slow, flat(2, 2500));
  EXPECT_EQ(none.chunks, 0u);
  EXPECT_EQ(none.saved_us(), 0);
  // A tie is resolved towards the shorter prefix.
  const double even[] = {1000, 2500};
  EXPECT_EQ(BestLoadPrefix(even, flat(2, 2500)).chunks, 1u);
  EXPECT_EQ(BestLoadPrefix({}, flat(2, 2500)).chunks, 0u);
  // Unknown recompute cost (0): loading never "saves" anything.
  EXPECT_EQ(BestLoadPrefix(fast, flat(3, 0)).chunks, 0u);
  // Only chunks with both times are candidates.
  EXPECT_EQ(BestLoadPrefix(fast, flat(2, 2500)).chunks, 2u);
  EXPECT_EQ(BestLoadPrefix(fast, {}).chunks, 0u);
}

TEST(LoadOrRecompute, BestPrefixLoadsEarlyLosersWhenLaterChunksCostMore) {
  // Chunks that recompute in more time the later they are (the attention
  // term): the first two lose to recompute, the last two win it back.
  const double load[] = {30, 30, 30, 30};
  const double recompute[] = {20, 25, 35, 45};
  LoadDecision d = BestLoadPrefix(load, recompute);
  EXPECT_EQ(d.chunks, 4u);
  EXPECT_DOUBLE_EQ(d.load_us, 120);
  EXPECT_DOUBLE_EQ(d.recompute_us, 125);
  // A flat cost below every load (a linear model's view) loads nothing.
  EXPECT_EQ(BestLoadPrefix(load, std::vector<double>(4, 29)).chunks, 0u);
}

}  // namespace
}  // namespace kvtier::bandwidth
