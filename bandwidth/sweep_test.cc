#include "bandwidth/sweep.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "bandwidth/presets.h"

namespace kvtier::bandwidth {
namespace {

std::vector<ModelSpec> Models(std::initializer_list<const char*> names) {
  std::vector<ModelSpec> out;
  for (const char* n : names) out.push_back(*FindModelPreset(n));
  return out;
}

SweepOptions WorkedExample() {
  SweepOptions o;
  o.contexts = {131072};
  o.batches = {32};
  o.latency_s = 0.010;
  o.codecs = {"k16v8", "k16v16"};
  o.links = *ParseLinkList("pcie5,hbm3,x=1e6");
  return o;
}

TEST(RunSweep, Llama70BWorkedExample) {
  absl::StatusOr<std::vector<SweepRow>> rows =
      RunSweep(Models({"Llama-3.1-70B"}), WorkedExample());
  ASSERT_TRUE(rows.ok()) << rows.status();
  ASSERT_EQ(rows->size(), 2u);
  const SweepRow& r = (*rows)[0];
  EXPECT_EQ(r.model, "Llama-3.1-70B");
  EXPECT_EQ(r.codec, "k16v8");
  EXPECT_EQ(r.bytes_per_token, 245920.0);
  EXPECT_EQ(r.native_bytes_per_token, 327680.0);
  EXPECT_EQ(r.kv_bytes, 1031463239680.0);
  EXPECT_DOUBLE_EQ(r.required_bytes_per_s, 103146323968000.0);
  EXPECT_EQ(r.weight_bytes, 141107412992.0);
  // f from the uncompressed traffic: 1374389534720 / (1374389534720 + 141107412992).
  EXPECT_DOUBLE_EQ(r.kv_fraction, 1374389534720.0 / (1374389534720.0 + 141107412992.0));
  EXPECT_DOUBLE_EQ(r.codec_ratio, 245920.0 / 327680.0);
  EXPECT_DOUBLE_EQ(r.speedup_bound,
                   1.0 / (r.kv_fraction * r.codec_ratio + (1.0 - r.kv_fraction)));
  EXPECT_NEAR(r.hill_saturation, 3.4449457704661364, 1e-12);
  ASSERT_EQ(r.shortfall.size(), 3u);
  EXPECT_EQ(r.shortfall[0].link, "pcie5");
  EXPECT_DOUBLE_EQ(r.shortfall[0].factor, 1611.661312);
  EXPECT_FALSE(r.shortfall[0].covered);
  EXPECT_DOUBLE_EQ(r.shortfall[1].factor, 103146323968000.0 / 3350e9);
  EXPECT_FALSE(r.shortfall[1].covered);
  EXPECT_DOUBLE_EQ(r.shortfall[2].factor, 0.103146323968);  // a 1 PB/s link
  EXPECT_TRUE(r.shortfall[2].covered);

  const SweepRow& native = (*rows)[1];
  EXPECT_EQ(native.codec, "k16v16");
  EXPECT_EQ(native.kv_bytes, 1374389534720.0);
  EXPECT_DOUBLE_EQ(native.shortfall[0].factor, 2147.483648);
  EXPECT_DOUBLE_EQ(native.speedup_bound, 1.0);
}

TEST(RunSweep, RowsAreModelContextBatchCodecOrder) {
  SweepOptions o;
  o.contexts = {1024, 2048};
  o.batches = {1, 8};
  o.codecs = {"k16v16", "k8v8"};
  absl::StatusOr<std::vector<SweepRow>> rows =
      RunSweep(Models({"Mistral-7B", "Qwen2.5-7B"}), o);
  ASSERT_TRUE(rows.ok()) << rows.status();
  ASSERT_EQ(rows->size(), 16u);
  EXPECT_EQ((*rows)[0].model, "Mistral-7B");
  EXPECT_EQ((*rows)[1].codec, "k8v8");
  EXPECT_EQ((*rows)[2].batch, 8u);
  EXPECT_EQ((*rows)[4].context, 2048u);
  EXPECT_EQ((*rows)[8].model, "Qwen2.5-7B");
  // Qwen2.5-7B k16v16: 2 x 28 x 4 x 128 x 2 = 57344 bytes/token.
  EXPECT_EQ((*rows)[8].bytes_per_token, 57344.0);
  EXPECT_EQ((*rows)[8].shortfall.size(), LinkPresets().size());
}

TEST(RunSweep, ExplicitCodecIsNamedCanonically) {
  SweepOptions o;
  o.codecs = {"k=16,v=int8/tensor"};
  absl::StatusOr<std::vector<SweepRow>> rows = RunSweep(Models({"Llama-3.1-8B"}), o);
  ASSERT_TRUE(rows.ok()) << rows.status();
  EXPECT_EQ((*rows)[0].codec, "k=16,v=int8/tensor");
  // K 524288 + V 262144 + align16(4) = 16 per layer, x 32 / 256.
  EXPECT_EQ((*rows)[0].bytes_per_token, (524288.0 + 262144.0 + 16.0) * 32 / 256);
}

TEST(RunSweep, BadInputIsInvalidArgument) {
  const std::vector<ModelSpec> m = Models({"Llama-3.1-8B"});
  SweepOptions o;
  o.codecs = {"k12v3"};
  EXPECT_EQ(RunSweep(m, o).status().code(), absl::StatusCode::kInvalidArgument);
  o = {};
  o.contexts = {0};
  EXPECT_EQ(RunSweep(m, o).status().code(), absl::StatusCode::kInvalidArgument);
  o = {};
  o.batches = {};
  EXPECT_EQ(RunSweep(m, o).status().code(), absl::StatusCode::kInvalidArgument);
  o = {};
  o.latency_s = 0;
  EXPECT_EQ(RunSweep(m, o).status().code(), absl::StatusCode::kInvalidArgument);
  o = {};
  o.latency_s = -1;
  EXPECT_EQ(RunSweep(m, o).status().code(), absl::StatusCode::kInvalidArgument);
  o = {};
  o.hill.g = 0;
  EXPECT_EQ(RunSweep(m, o).status().code(), absl::StatusCode::kInvalidArgument);
  o = {};
  EXPECT_EQ(RunSweep({}, o).status().code(), absl::StatusCode::kInvalidArgument);
  o.links.clear();
  EXPECT_EQ(RunSweep(m, o).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvtier::bandwidth
