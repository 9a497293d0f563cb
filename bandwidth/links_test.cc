#include "bandwidth/links.h"

#include <string>

#include "common/testing/temp_dir.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvtier::bandwidth {
namespace {

using ::testing::HasSubstr;

TEST(LinkPresets, HoldTheDocumentedBandwidths) {
  const std::pair<const char*, double> want[] = {
      {"hbm3", 3350}, {"hbm3e", 4800}, {"nvlink4", 900},  {"pcie4", 32},    {"pcie5", 64},
      {"cxl2", 32},   {"400gbe", 50},  {"nvme-gen4", 7}, {"nvme-gen5", 14}};
  ASSERT_EQ(LinkPresets().size(), std::size(want));
  for (size_t i = 0; i < std::size(want); ++i) {
    EXPECT_EQ(LinkPresets()[i].name, want[i].first);
    EXPECT_EQ(LinkPresets()[i].gb_per_s, want[i].second);
  }
  EXPECT_EQ(LinkPresets()[4].bytes_per_s(), 64e9);
}

TEST(ParseLink, PresetIgnoresCase) {
  absl::StatusOr<Link> l = ParseLink("PCIe5");
  ASSERT_TRUE(l.ok()) << l.status();
  EXPECT_EQ(l->name, "pcie5");
  EXPECT_EQ(l->gb_per_s, 64.0);
}

TEST(ParseLink, CustomNameEqualsGbPerSecond) {
  absl::StatusOr<Link> l = ParseLink("my-nic=12.5");
  ASSERT_TRUE(l.ok()) << l.status();
  EXPECT_EQ(l->name, "my-nic");
  EXPECT_EQ(l->gb_per_s, 12.5);
}

TEST(ParseLink, BadSpecsAreInvalidArgument) {
  for (const char* spec : {"pcie9", "x=0", "x=-3", "x=abc", "=5", "x=", "a b=4", "x=inf",
                           "x=nan"}) {
    EXPECT_EQ(ParseLink(spec).status().code(), absl::StatusCode::kInvalidArgument) << spec;
  }
  EXPECT_THAT(ParseLink("pcie9").status().message(), HasSubstr("unknown link 'pcie9'"));
}

TEST(ParseLinkList, KeepsOrderAndRejectsDuplicatesAndEmpties) {
  absl::StatusOr<std::vector<Link>> ls = ParseLinkList("hbm3e, pcie5,disk=3.2");
  ASSERT_TRUE(ls.ok()) << ls.status();
  ASSERT_EQ(ls->size(), 3u);
  EXPECT_EQ((*ls)[0].name, "hbm3e");
  EXPECT_EQ((*ls)[2].gb_per_s, 3.2);
  EXPECT_EQ(ParseLinkList("pcie5,pcie5").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseLinkList("pcie5,,hbm3").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseLinkList("").status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(LinksFile, RoundTripsThroughJson) {
  std::vector<Link> links = {{"dram-memcpy", 21.25, "memcpy"}, {"nvme-odirect", 3.5, "disk"}};
  absl::StatusOr<std::vector<Link>> back = ParseLinksJson(LinksToJson(links));
  ASSERT_TRUE(back.ok()) << back.status();
  ASSERT_EQ(back->size(), 2u);
  EXPECT_EQ((*back)[0].name, "dram-memcpy");
  EXPECT_EQ((*back)[0].gb_per_s, 21.25);
  EXPECT_EQ((*back)[1].description, "disk");
  EXPECT_THAT(LinksToJson(links), HasSubstr("decimal GB/s"));
}

TEST(LinksFile, SaveThenLoad) {
  ::kvtier::testing::TempDir dir("kvtier-links");
  const std::string path = dir.path() + "/links.json";
  std::vector<Link> links = {{"h2d-pinned", 55.0, "cudaMemcpy"}};
  ASSERT_TRUE(SaveLinksFile(path, links).ok());
  absl::StatusOr<std::vector<Link>> back = LoadLinksFile(path);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ((*back)[0].gb_per_s, 55.0);
}

TEST(LinksFile, MissingFileIsNotFound) {
  EXPECT_EQ(LoadLinksFile("/nonexistent/links.json").status().code(),
            absl::StatusCode::kNotFound);
}

TEST(LinksFile, MalformedContentIsInvalidArgument) {
  for (const char* text :
       {"not json", "[]", R"({"format": "other", "links": []})",
        R"({"format": "kvtier-links-v1", "links": []})",
        R"({"format": "kvtier-links-v1", "links": [{"name": "x"}]})",
        R"({"format": "kvtier-links-v1", "links": [{"name": "x", "gb_per_s": 0}]})",
        R"({"format": "kvtier-links-v1", "links": [{"name": "a b", "gb_per_s": 1}]})"}) {
    EXPECT_EQ(ParseLinksJson(text).status().code(), absl::StatusCode::kInvalidArgument) << text;
  }
}

}  // namespace
}  // namespace kvtier::bandwidth
