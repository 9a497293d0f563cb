#include "bandwidth/presets.h"

#include <set>
#include <string>

#include "gtest/gtest.h"

namespace kvtier::bandwidth {
namespace {

TEST(ModelPresets, EstimateReproducesEveryPublishedParameterCount) {
  for (const ModelPreset& p : ModelPresets()) {
    absl::StatusOr<uint64_t> n = EstimateParamCount(p.spec);
    ASSERT_TRUE(n.ok()) << p.spec.name << ": " << n.status();
    EXPECT_EQ(*n, p.spec.param_count) << p.spec.name;
  }
}

TEST(ModelPresets, ShapesMatchTheirConfigs) {
  struct Want {
    const char* name;
    uint32_t layers, kv_heads, head_dim;
  };
  const Want want[] = {{"Qwen2.5-7B", 28, 4, 128},      {"Qwen2.5-72B", 80, 8, 128},
                       {"Llama-3.1-8B", 32, 8, 128},    {"Llama-3.1-70B", 80, 8, 128},
                       {"Mistral-7B", 32, 8, 128},      {"Mistral-Small-24B", 40, 8, 128},
                       {"Phi-4-14B", 40, 10, 128}};
  ASSERT_EQ(ModelPresets().size(), std::size(want));
  for (const Want& w : want) {
    absl::StatusOr<ModelSpec> m = FindModelPreset(w.name);
    ASSERT_TRUE(m.ok()) << w.name;
    EXPECT_EQ(m->num_layers, w.layers) << w.name;
    EXPECT_EQ(m->num_kv_heads, w.kv_heads) << w.name;
    EXPECT_EQ(m->head_dim, w.head_dim) << w.name;
    EXPECT_EQ(m->weight_dtype, "bfloat16") << w.name;
    EXPECT_EQ(m->weight_bytes_per_param, 2.0) << w.name;
    EXPECT_TRUE(ValidateModel(*m).ok()) << w.name;
  }
}

TEST(FindModelPreset, MatchesNameOrRepoIgnoringCase) {
  EXPECT_EQ(FindModelPreset("llama-3.1-70b")->name, "Llama-3.1-70B");
  EXPECT_EQ(FindModelPreset("meta-llama/Llama-3.1-70B")->name, "Llama-3.1-70B");
  EXPECT_EQ(FindModelPreset("MICROSOFT/PHI-4")->name, "Phi-4-14B");
}

TEST(FindModelPreset, UnknownNameIsNotFound) {
  EXPECT_EQ(FindModelPreset("GPT-5").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(FindModelPreset("").status().code(), absl::StatusCode::kNotFound);
}

TEST(ModelPresets, NamesAreUnique) {
  std::set<std::string> names;
  for (const ModelPreset& p : ModelPresets()) EXPECT_TRUE(names.insert(p.spec.name).second);
}

}  // namespace
}  // namespace kvtier::bandwidth
