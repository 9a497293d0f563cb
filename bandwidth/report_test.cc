#include "bandwidth/report.h"

#include "absl/strings/str_split.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "bandwidth/presets.h"

namespace kvtier::bandwidth {
namespace {

using ::testing::HasSubstr;

struct Fixture {
  SweepOptions options;
  std::vector<SweepRow> rows;
};

Fixture WorkedExample() {
  Fixture f;
  f.options.codecs = {"k16v8"};
  f.options.links = *ParseLinkList("pcie5,fast=2e5");
  std::vector<ModelSpec> models = {*FindModelPreset("Llama-3.1-70B")};
  f.rows = *RunSweep(models, f.options);
  return f;
}

TEST(FormatShortfallCell, CoveredIsInHbmOtherwiseFactor) {
  EXPECT_EQ(FormatShortfallCell({"l", 1, 1.0, true}), "in-HBM");
  EXPECT_EQ(FormatShortfallCell({"l", 1, 0.2, true}), "in-HBM");
  EXPECT_EQ(FormatShortfallCell({"l", 1, 1.234, false}), "1.23x");
  EXPECT_EQ(FormatShortfallCell({"l", 1, 30.79, false}), "30.8x");
  EXPECT_EQ(FormatShortfallCell({"l", 1, 1611.66, false}), "1612x");
}

TEST(FormatTable, OneAlignedRowWithUnitsAndShortfalls) {
  Fixture f = WorkedExample();
  const std::string t = FormatTable(f.rows, f.options);
  EXPECT_THAT(t, HasSubstr("GB = 1e9 bytes"));
  EXPECT_THAT(t, HasSubstr("TB/s = 1e12 bytes/s"));
  EXPECT_THAT(t, HasSubstr("latency target 10 ms"));
  EXPECT_THAT(t, HasSubstr("pcie5 64, fast 200000"));
  std::vector<std::string> lines = absl::StrSplit(t, '\n', absl::SkipEmpty());
  ASSERT_EQ(lines.size(), 6u);  // 4 comment lines, header, one row
  EXPECT_THAT(lines[4], HasSubstr("bytes/token"));
  const std::vector<std::string> cells =
      absl::StrSplit(lines[5], ' ', absl::SkipEmpty());
  ASSERT_EQ(cells.size(), 12u);
  EXPECT_EQ(cells[0], "Llama-3.1-70B");
  EXPECT_EQ(cells[1], "131072");
  EXPECT_EQ(cells[2], "32");
  EXPECT_EQ(cells[3], "k16v8");
  EXPECT_EQ(cells[4], "245920");
  EXPECT_EQ(cells[5], "1031.46");
  EXPECT_EQ(cells[6], "103.146");
  EXPECT_EQ(cells[9], "3.445");
  EXPECT_EQ(cells[10], "1612x");
  EXPECT_EQ(cells[11], "in-HBM");  // 200 TB/s covers 103 TB/s
  EXPECT_EQ(lines[4].size(), lines[5].size());
}

TEST(FormatJson, CarriesExactValuesAndUnits) {
  Fixture f = WorkedExample();
  nlohmann::json j = nlohmann::json::parse(FormatJson(f.rows, f.options));
  EXPECT_EQ(j["latency_ms"].get<double>(), 10.0);
  EXPECT_EQ(j["units"]["required_tb_per_s"], "decimal TB/s (1e12 bytes/s)");
  ASSERT_EQ(j["rows"].size(), 1u);
  const auto& r = j["rows"][0];
  EXPECT_EQ(r["bytes_per_token"].get<double>(), 245920.0);
  EXPECT_EQ(r["kv_bytes_per_step"].get<double>(), 1031463239680.0);
  EXPECT_DOUBLE_EQ(r["required_tb_per_s"].get<double>(), 103.146323968);
  EXPECT_EQ(r["shortfall"][0]["link"], "pcie5");
  EXPECT_DOUBLE_EQ(r["shortfall"][0]["factor"].get<double>(), 1611.661312);
  EXPECT_FALSE(r["shortfall"][0]["covered"].get<bool>());
  EXPECT_TRUE(r["shortfall"][1]["covered"].get<bool>());
}

TEST(FormatCsv, HeaderAndRow) {
  Fixture f = WorkedExample();
  std::vector<std::string> lines =
      absl::StrSplit(FormatCsv(f.rows, f.options), '\n', absl::SkipEmpty());
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_EQ(lines[0],
            "model,context,batch,codec,bytes_per_token,kv_gb_per_step,weight_gb,kv_fraction,"
            "codec_ratio,speedup_bound,required_tb_per_s,hill_saturation,shortfall_pcie5,"
            "shortfall_fast");
  std::vector<std::string> cells = absl::StrSplit(lines[1], ',');
  ASSERT_EQ(cells.size(), 14u);
  EXPECT_EQ(cells[0], "Llama-3.1-70B");
  EXPECT_EQ(cells[4], "245920");
  EXPECT_EQ(cells[5], "1031.46323968");
  EXPECT_EQ(cells[6], "141.107412992");
  EXPECT_EQ(cells[10], "103.146323968");
  EXPECT_EQ(cells[12], "1611.661312");
  EXPECT_EQ(cells[13], "0.51573161984");
}

TEST(FormatCsv, QuotesFieldsWithCommas) {
  SweepOptions o;
  o.codecs = {"k=16,v=int8/tensor"};
  o.links = *ParseLinkList("pcie5");
  std::vector<ModelSpec> models = {*FindModelPreset("Llama-3.1-8B")};
  std::vector<SweepRow> rows = *RunSweep(models, o);
  EXPECT_THAT(FormatCsv(rows, o), HasSubstr(",\"k=16,v=int8/tensor\","));
}

}  // namespace
}  // namespace kvtier::bandwidth
