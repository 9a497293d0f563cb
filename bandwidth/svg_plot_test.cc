#include "bandwidth/svg_plot.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "bandwidth/presets.h"

namespace kvtier::bandwidth {
namespace {

using ::testing::HasSubstr;

int Count(const std::string& s, const std::string& what) {
  int n = 0;
  for (size_t p = s.find(what); p != std::string::npos; p = s.find(what, p + 1)) ++n;
  return n;
}

TEST(RenderBandwidthSvg, OneLinePerLinkAndPerSeries) {
  SweepOptions o;
  o.contexts = {8192, 131072};
  o.batches = {1, 32};
  o.codecs = {"k16v8"};
  o.links = *ParseLinkList("hbm3e,pcie5,nvme-gen5");
  std::vector<ModelSpec> models = {*FindModelPreset("Llama-3.1-70B")};
  absl::StatusOr<std::string> svg = RenderBandwidthSvg(models, o);
  ASSERT_TRUE(svg.ok()) << svg.status();
  EXPECT_TRUE(svg->starts_with("<svg xmlns=\"http://www.w3.org/2000/svg\""));
  EXPECT_TRUE(svg->ends_with("</svg>\n"));
  EXPECT_EQ(Count(*svg, "class=\"link\""), 3);
  EXPECT_EQ(Count(*svg, "class=\"series\""), 2);
  EXPECT_EQ(Count(*svg, "<circle"), 4);  // one dot per (series, requested context)
  EXPECT_THAT(*svg, HasSubstr("hbm3e 4.8 TB/s"));
  EXPECT_THAT(*svg, HasSubstr("nvme-gen5 14 GB/s"));
  EXPECT_THAT(*svg, HasSubstr("Llama-3.1-70B B=32 k16v8"));
  EXPECT_THAT(*svg, HasSubstr("decimal units"));
  EXPECT_THAT(*svg, HasSubstr("128K"));
}

TEST(RenderBandwidthSvg, EscapesNames) {
  SweepOptions o;
  o.links = *ParseLinkList("pcie5");
  ModelSpec m = *FindModelPreset("Mistral-7B");
  m.name = "a<b&c";
  std::vector<ModelSpec> models = {m};
  absl::StatusOr<std::string> svg = RenderBandwidthSvg(models, o);
  ASSERT_TRUE(svg.ok()) << svg.status();
  EXPECT_THAT(*svg, HasSubstr("a&lt;b&amp;c"));
  EXPECT_EQ(svg->find("a<b"), std::string::npos);
}

TEST(RenderBandwidthSvg, BadInputIsInvalidArgument) {
  SweepOptions o;
  o.contexts = {};
  std::vector<ModelSpec> models = {*FindModelPreset("Mistral-7B")};
  EXPECT_EQ(RenderBandwidthSvg(models, o).status().code(), absl::StatusCode::kInvalidArgument);
  o.contexts = {0};
  EXPECT_EQ(RenderBandwidthSvg(models, o).status().code(), absl::StatusCode::kInvalidArgument);
  o.contexts = {1024};
  o.codecs = {"nope"};
  EXPECT_EQ(RenderBandwidthSvg(models, o).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvtier::bandwidth
