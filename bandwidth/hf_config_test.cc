#include "bandwidth/hf_config.h"

#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "bandwidth/presets.h"

namespace kvtier::bandwidth {
namespace {

using ::testing::HasSubstr;

std::string TestData(const char* dir) {
  return std::string(KVTIER_BANDWIDTH_TESTDATA) + "/" + dir + "/config.json";
}

TEST(LoadHfConfig, Llama31_8BWithoutHeadDimDerivesItFromHiddenSize) {
  absl::StatusOr<ModelSpec> m = LoadHfConfig(TestData("Llama-3.1-8B"));
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->name, "Llama-3.1-8B");
  EXPECT_EQ(m->num_layers, 32u);
  EXPECT_EQ(m->num_kv_heads, 8u);
  EXPECT_EQ(m->head_dim, 128u);  // 4096 / 32
  EXPECT_EQ(m->param_count, 8'030'261'248u);
  EXPECT_EQ(m->weight_dtype, "bfloat16");
  EXPECT_EQ(m->kv_dtype, codec::DType::kBF16);
}

TEST(LoadHfConfig, EveryPresetConfigMatchesItsPreset) {
  const std::pair<const char*, const char*> pairs[] = {
      {"Llama-3.1-8B", "Llama-3.1-8B"},
      {"Qwen2.5-7B", "Qwen2.5-7B"},
      {"Mistral-Small-24B-Base-2501", "Mistral-Small-24B"},
      {"phi-4", "Phi-4-14B"}};
  for (const auto& [dir, preset] : pairs) {
    absl::StatusOr<ModelSpec> m = LoadHfConfig(TestData(dir));
    ASSERT_TRUE(m.ok()) << dir << ": " << m.status();
    ModelSpec p = *FindModelPreset(preset);
    EXPECT_EQ(m->num_layers, p.num_layers) << dir;
    EXPECT_EQ(m->num_kv_heads, p.num_kv_heads) << dir;
    EXPECT_EQ(m->head_dim, p.head_dim) << dir;
    EXPECT_EQ(m->param_count, p.param_count) << dir;
  }
}

TEST(LoadHfConfig, ExplicitHeadDimWinsOverHiddenSizeRatio) {
  // Mistral-Small-24B: hidden 5120 / 32 heads = 160, but head_dim is 128.
  absl::StatusOr<ModelSpec> m = LoadHfConfig(TestData("Mistral-Small-24B-Base-2501"));
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->head_dim, 128u);
}

TEST(LoadHfConfig, TiedEmbeddingsAreCountedOnce) {
  // Qwen2.5-0.5B publishes 494,032,768 parameters (q/k/v biases, tied lm_head).
  absl::StatusOr<ModelSpec> m = LoadHfConfig(TestData("Qwen2.5-0.5B"));
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_TRUE(m->arch.tie_word_embeddings);
  EXPECT_TRUE(m->arch.qkv_bias);
  EXPECT_EQ(m->param_count, 494'032'768u);
  EXPECT_EQ(m->num_kv_heads, 2u);
  EXPECT_EQ(m->head_dim, 64u);
}

TEST(LoadHfConfig, MissingKvHeadsMeansMultiHeadAttentionAndFloat16IsFp16) {
  // huggyllama/llama-7b predates grouped-query attention.
  absl::StatusOr<ModelSpec> m = LoadHfConfig(TestData("llama-7b"));
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->num_kv_heads, 32u);
  EXPECT_EQ(m->head_dim, 128u);
  EXPECT_EQ(m->param_count, 6'738'415'616u);
  EXPECT_EQ(m->kv_dtype, codec::DType::kFP16);
  EXPECT_EQ(m->weight_bytes_per_param, 2.0);
}

TEST(LoadHfConfig, MissingFileIsNotFound) {
  EXPECT_EQ(LoadHfConfig("/nonexistent/config.json").status().code(),
            absl::StatusCode::kNotFound);
}

constexpr char kMinimal[] = R"({
  "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
  "hidden_size": 256, "intermediate_size": 512, "vocab_size": 1000,
  "torch_dtype": "bfloat16"})";

TEST(ParseHfConfig, MinimalConfigEstimatesParams) {
  absl::StatusOr<ModelSpec> m = ParseHfConfig(kMinimal, "tiny");
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->head_dim, 64u);
  // embed 256000 + lm_head 256000 + final norm 256 + 2 layers x (q 65536 + k 32768 + v 32768
  // + o 65536 + mlp 3*256*512 + norms 512).
  EXPECT_EQ(m->param_count, 256000u + 256000u + 256u + 2u * (65536u + 32768u * 2 + 65536u +
                                                             393216u + 512u));
}

TEST(ParseHfConfig, NullHeadDimFallsBackToRatio) {
  absl::StatusOr<ModelSpec> m = ParseHfConfig(R"({"num_hidden_layers": 2,
      "num_attention_heads": 4, "head_dim": null, "hidden_size": 256,
      "num_parameters": 1000})", "t");
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->head_dim, 64u);
  EXPECT_EQ(m->param_count, 1000u);  // given, not estimated
}

TEST(ParseHfConfig, NewerDtypeKeyIsRead) {
  absl::StatusOr<ModelSpec> m = ParseHfConfig(R"({"num_hidden_layers": 2,
      "num_attention_heads": 4, "hidden_size": 256, "num_parameters": 10,
      "dtype": "float32"})", "t");
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->weight_bytes_per_param, 4.0);
  EXPECT_EQ(m->weight_dtype, "float32");
  EXPECT_EQ(m->kv_dtype, codec::DType::kBF16);
}

TEST(ParseHfConfig, MultimodalConfigReadsTextConfig) {
  // The shape of mistralai/Mistral-Small-3.1-24B-Instruct-2503.
  absl::StatusOr<ModelSpec> m = ParseHfConfig(R"({
      "architectures": ["Mistral3ForConditionalGeneration"], "torch_dtype": "bfloat16",
      "text_config": {"head_dim": 128, "hidden_size": 5120, "intermediate_size": 32768,
        "num_attention_heads": 32, "num_hidden_layers": 40, "num_key_value_heads": 8,
        "vocab_size": 131072, "model_type": "mistral"},
      "vision_config": {"hidden_size": 1024, "num_hidden_layers": 24}})", "m3");
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->num_layers, 40u);
  EXPECT_EQ(m->num_kv_heads, 8u);
  EXPECT_EQ(m->head_dim, 128u);
  EXPECT_EQ(m->param_count, 23'572'403'200u);  // the language model only
}

TEST(ParseHfConfig, MissingLayersIsInvalidArgumentNamingTheField) {
  absl::StatusOr<ModelSpec> m =
      ParseHfConfig(R"({"num_attention_heads": 4, "hidden_size": 256})", "t");
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(m.status().message(), HasSubstr("num_hidden_layers"));
}

TEST(ParseHfConfig, MissingHeadDimAndHiddenSizeIsInvalidArgument) {
  absl::StatusOr<ModelSpec> m =
      ParseHfConfig(R"({"num_hidden_layers": 2, "num_attention_heads": 4})", "t");
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(m.status().message(), HasSubstr("head_dim"));
}

TEST(ParseHfConfig, MalformedJsonIsInvalidArgument) {
  absl::StatusOr<ModelSpec> m = ParseHfConfig(R"({"num_hidden_layers": 2,)", "t");
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(m.status().message(), HasSubstr("not valid JSON"));
  EXPECT_EQ(ParseHfConfig("[1, 2]", "t").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseHfConfig("", "t").status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(ParseHfConfig, NegativeZeroOrNonIntegerNumbersAreInvalidArgument) {
  for (const char* text : {
           R"({"num_hidden_layers": -2, "num_attention_heads": 4, "hidden_size": 256})",
           R"({"num_hidden_layers": 0, "num_attention_heads": 4, "hidden_size": 256})",
           R"({"num_hidden_layers": 2.5, "num_attention_heads": 4, "hidden_size": 256})",
           R"({"num_hidden_layers": "32", "num_attention_heads": 4, "hidden_size": 256})"}) {
    absl::StatusOr<ModelSpec> m = ParseHfConfig(text, "t");
    EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument) << text;
    EXPECT_THAT(m.status().message(), HasSubstr("num_hidden_layers")) << text;
  }
}

TEST(ParseHfConfig, IndivisibleHeadsAreInvalidArgument) {
  EXPECT_EQ(ParseHfConfig(R"({"num_hidden_layers": 2, "num_attention_heads": 3,
      "hidden_size": 256, "num_parameters": 1})", "t").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseHfConfig(R"({"num_hidden_layers": 2, "num_attention_heads": 4,
      "num_key_value_heads": 3, "hidden_size": 256, "num_parameters": 1})", "t").status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(ParseHfConfig, UnknownDtypeIsInvalidArgument) {
  absl::StatusOr<ModelSpec> m = ParseHfConfig(R"({"num_hidden_layers": 2,
      "num_attention_heads": 4, "hidden_size": 256, "num_parameters": 1,
      "torch_dtype": "float64"})", "t");
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(m.status().message(), HasSubstr("float64"));
}

TEST(ParseHfConfig, UnestimableParamsAreInvalidArgumentUnlessAllowed) {
  constexpr char kNoMlp[] = R"({"num_hidden_layers": 2, "num_attention_heads": 4,
      "hidden_size": 256, "vocab_size": 1000})";
  absl::StatusOr<ModelSpec> m = ParseHfConfig(kNoMlp, "t");
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(m.status().message(), HasSubstr("intermediate_size"));
  absl::StatusOr<ModelSpec> allowed = ParseHfConfig(kNoMlp, "t", /*allow_unknown_params=*/true);
  ASSERT_TRUE(allowed.ok()) << allowed.status();
  EXPECT_EQ(allowed->param_count, 0u);
  EXPECT_EQ(allowed->num_layers, 2u);
}

TEST(ParseHfConfig, LayerCountAboveFormatLimitIsInvalidArgument) {
  EXPECT_EQ(ParseHfConfig(R"({"num_hidden_layers": 5000, "num_attention_heads": 4,
      "hidden_size": 256, "num_parameters": 1})", "t").status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvtier::bandwidth
