// End-to-end tests of `kvtier shortfall`, `kvtier models`, `kvtier links` and
// `kvtier probe`: the built binary, its table/JSON/CSV output, the SVG plot,
// the probe's links file, exit codes and one-line errors.
#include <algorithm>
#include <filesystem>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_split.h"
#include "codec/format.h"
#include "common/file.h"
#include "common/testing/temp_dir.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/cli_runner.h"

namespace kvtier {
namespace {

using ::testing::HasSubstr;
using testing::RunCommand;
using testing::TempDir;

const std::string kKvtier = KVTIER_CLI_PATH;
const std::string kTestData = KVTIER_BANDWIDTH_TESTDATA;

// Bytes per token of a 32-layer, 8-kv-head, 128-dim model (Llama-3.1-8B)
// under `codec`, from the codec's own layout code: 256-token chunks, block 16.
double LlamaBytesPerToken(const char* codec_name) {
  auto c = codec::ParseCodec(codec_name, codec::DType::kBF16);
  EXPECT_TRUE(c.ok());
  auto bpt = codec::BytesPerToken(codec::Geometry{32, 8, 128, 256, 16}, c->k, c->v);
  EXPECT_TRUE(bpt.ok());
  return *bpt;
}

class BandwidthCli : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_FALSE(dir_.path().empty()); }
  std::string P(const std::string& name) const { return dir_.path() + "/" + name; }
  // Writes `text` to <dir>/cfg/config.json (a model named "cfg").
  bool WriteCfg(const std::string& text) {
    std::filesystem::create_directories(P("cfg"));
    return WriteFileAtomic(P("cfg/config.json"),
                           std::span<const uint8_t>(
                               reinterpret_cast<const uint8_t*>(text.data()), text.size()))
        .ok();
  }
  testing::CliResult Run(const std::string& args) {
    return RunCommand(kKvtier + " " + args, dir_.path());
  }
  void ExpectOneLineError(const std::string& args, const std::string& what) {
    testing::CliResult r = Run(args);
    EXPECT_EQ(r.exit_code, 2) << args << "\n" << r.err;
    EXPECT_TRUE(r.out.empty()) << args << "\n" << r.out;
    EXPECT_THAT(r.err, HasSubstr(what)) << args;
    EXPECT_TRUE(r.err.starts_with("kvtier: ")) << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << args << "\n" << r.err;
  }
  // The data rows of a table: lines that are not comments, header excluded.
  static std::vector<std::vector<std::string>> TableRows(const std::string& out) {
    std::vector<std::vector<std::string>> rows;
    bool header = true;
    for (absl::string_view line : absl::StrSplit(out, '\n', absl::SkipEmpty())) {
      if (absl::StartsWith(line, "#")) continue;
      if (header) {
        header = false;
        continue;
      }
      rows.push_back(absl::StrSplit(line, ' ', absl::SkipEmpty()));
    }
    return rows;
  }

  TempDir dir_;
};

TEST_F(BandwidthCli, TableLlama70BWorkedExample) {
  testing::CliResult r = Run(
      "shortfall --model Llama-3.1-70B --context 131072 --batch 32 --latency-ms 10 "
      "--codec k16v8,k16v16 --links pcie5,hbm3");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("GB = 1e9 bytes"));
  EXPECT_THAT(r.out, HasSubstr("TB/s = 1e12 bytes/s"));
  EXPECT_THAT(r.out, HasSubstr("\"in-HBM\" = the link streams"));
  std::vector<std::vector<std::string>> rows = TableRows(r.out);
  ASSERT_EQ(rows.size(), 2u);
  // model context batch codec bytes/token GB/step TB/s f bound S(B) pcie5 hbm3
  EXPECT_EQ(rows[0], (std::vector<std::string>{"Llama-3.1-70B", "131072", "32", "k16v8",
                                               "245920", "1031.46", "103.146", "0.907", "1.292x",
                                               "3.445", "1612x", "30.8x"}));
  EXPECT_EQ(rows[1], (std::vector<std::string>{"Llama-3.1-70B", "131072", "32", "k16v16",
                                               "327680", "1374.39", "137.439", "0.907", "1.000x",
                                               "3.445", "2147x", "41.0x"}));
}

TEST_F(BandwidthCli, InHbmWhereTheLinkCoversTheStep) {
  // Llama-3.1-8B, 4096 tokens, batch 1, k16v16: 536870912 bytes in 10 ms = 53.69 GB/s.
  testing::CliResult r = Run(
      "shortfall --model Llama-3.1-8B --context 4K --batch 1 --codec k16v16 "
      "--links pcie5,pcie4,exact=53.6870912");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  std::vector<std::vector<std::string>> rows = TableRows(r.out);
  ASSERT_EQ(rows.size(), 1u);
  EXPECT_EQ(rows[0][1], "4096");
  EXPECT_EQ(rows[0][4], "131072");
  EXPECT_EQ(rows[0][10], "in-HBM");  // 64 GB/s >= 53.69
  EXPECT_EQ(rows[0][11], "1.68x");   // 53.69 / 32
  EXPECT_EQ(rows[0][12], "in-HBM");  // exactly equal: covered
}

TEST_F(BandwidthCli, JsonBytesPerTokenComeFromTheCodecLayout) {
  testing::CliResult r = Run(
      "shortfall --model Llama-3.1-8B --context 8192,128K --batch 1,32 "
      "--codec k16v16,k16v8,k8v8,k16v4,k=16,v=int8/tensor --links pcie5 --format json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  nlohmann::json j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["units"]["required_tb_per_s"], "decimal TB/s (1e12 bytes/s)");
  EXPECT_EQ(j["latency_ms"].get<double>(), 10.0);
  ASSERT_EQ(j["rows"].size(), 2u * 2u * 5u);
  const char* codecs[] = {"k16v16", "k16v8", "k8v8", "k16v4", "k=16,v=int8/tensor"};
  for (size_t i = 0; i < 5; ++i) {
    const auto& row = j["rows"][i];
    EXPECT_EQ(row["codec"], codecs[i]);
    EXPECT_EQ(row["bytes_per_token"].get<double>(), LlamaBytesPerToken(codecs[i])) << codecs[i];
  }
  EXPECT_EQ(j["rows"][0]["bytes_per_token"].get<double>(), 131072.0);
  EXPECT_EQ(j["rows"][1]["bytes_per_token"].get<double>(), 98368.0);
  // Last row: context 131072, batch 32, k=16,v=int8/tensor.
  const auto& last = j["rows"][19];
  EXPECT_EQ(last["context"].get<uint64_t>(), 131072u);
  EXPECT_EQ(last["batch"].get<uint64_t>(), 32u);
  const double bpt = LlamaBytesPerToken("k=16,v=int8/tensor");
  EXPECT_EQ(last["kv_bytes_per_step"].get<double>(), 32.0 * 131072 * bpt);
  EXPECT_DOUBLE_EQ(last["shortfall"][0]["factor"].get<double>(),
                   32.0 * 131072 * bpt / 0.010 / 64e9);
  EXPECT_FALSE(last["shortfall"][0]["covered"].get<bool>());
}

TEST_F(BandwidthCli, CsvHeaderAndValues) {
  testing::CliResult r = Run(
      "shortfall --model Qwen2.5-7B --context 32K --batch 8 --codec k16v8 "
      "--links hbm3e,nvme-gen4 --format csv");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  std::vector<std::string> lines = absl::StrSplit(r.out, '\n', absl::SkipEmpty());
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_EQ(lines[0],
            "model,context,batch,codec,bytes_per_token,kv_gb_per_step,weight_gb,kv_fraction,"
            "codec_ratio,speedup_bound,required_tb_per_s,hill_saturation,shortfall_hbm3e,"
            "shortfall_nvme-gen4");
  std::vector<std::string> cells = absl::StrSplit(lines[1], ',');
  ASSERT_EQ(cells.size(), 14u);
  EXPECT_EQ(cells[0], "Qwen2.5-7B");
  EXPECT_EQ(cells[1], "32768");
  // 28 layers x (K 262144 + V 131072 + 64 scales x 4 bytes) / 256 tokens.
  EXPECT_EQ(cells[4], "43036");
  // 8 x 32768 x 43036 bytes.
  EXPECT_EQ(cells[5], "11.281629184");
  // 7615616512 bf16 weights.
  EXPECT_EQ(cells[6], "15.231233024");
  EXPECT_EQ(cells[10], "1.1281629184");
  // 1128.1629184 GB/s / 7 GB/s.
  EXPECT_EQ(cells[13], "161.1661312");
}

TEST_F(BandwidthCli, HfConfigMatchesThePreset) {
  testing::CliResult cfg = Run("shortfall --hf-config " + kTestData +
                               "/Llama-3.1-8B/config.json --links pcie5 --format csv");
  testing::CliResult preset = Run("shortfall --model Llama-3.1-8B --links pcie5 --format csv");
  ASSERT_EQ(cfg.exit_code, 0) << cfg.err;
  ASSERT_EQ(preset.exit_code, 0) << preset.err;
  EXPECT_EQ(cfg.out, preset.out);
  EXPECT_THAT(cfg.out, HasSubstr("Llama-3.1-8B,131072,32,k16v8,98368,"));
}

TEST_F(BandwidthCli, HfConfigWithoutMlpSizeNeedsParams) {
  ASSERT_TRUE(WriteCfg(R"({"num_hidden_layers": 4, "num_attention_heads": 8,
      "num_key_value_heads": 2, "hidden_size": 1024, "torch_dtype": "float16"})"));
  ExpectOneLineError("shortfall --hf-config " + P("cfg/config.json"), "--params");
  testing::CliResult r = Run("shortfall --hf-config " + P("cfg/config.json") +
                             " --params 1000000000 --context 1K --batch 1 --codec k16v16 "
                             "--links pcie5 --format json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  nlohmann::json j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["rows"][0]["model"], "cfg");
  // 2 x 4 layers x 2 heads x 128 dims x 2 bytes.
  EXPECT_EQ(j["rows"][0]["bytes_per_token"].get<double>(), 4096.0);
  EXPECT_EQ(j["rows"][0]["weight_gb"].get<double>(), 2.0);
}

TEST_F(BandwidthCli, PlotWritesAnSvgWithOneLinePerLink) {
  testing::CliResult r = Run("shortfall --model Mistral-7B --context 8K,128K --batch 1,16 "
                             "--links hbm3,pcie5,nvme-gen5 --plot " + P("bw.svg"));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const std::string svg = testing::ReadAll(P("bw.svg"));
  EXPECT_TRUE(svg.starts_with("<svg xmlns=\"http://www.w3.org/2000/svg\""));
  auto count = [&](const std::string& what) {
    int n = 0;
    for (size_t p = svg.find(what); p != std::string::npos; p = svg.find(what, p + 1)) ++n;
    return n;
  };
  EXPECT_EQ(count("class=\"link\""), 3);
  EXPECT_EQ(count("class=\"series\""), 2);
  EXPECT_THAT(svg, HasSubstr("pcie5 64 GB/s"));
  EXPECT_THAT(svg, HasSubstr("Mistral-7B B=16 k16v8"));
}

TEST_F(BandwidthCli, ModelsAndLinksListThePresets) {
  testing::CliResult models = Run("models");
  ASSERT_EQ(models.exit_code, 0) << models.err;
  for (const char* name : {"Qwen2.5-7B", "Qwen2.5-72B", "Llama-3.1-8B", "Llama-3.1-70B",
                           "Mistral-7B", "Mistral-Small-24B", "Phi-4-14B"}) {
    EXPECT_THAT(models.out, HasSubstr(name));
  }
  testing::CliResult mj = Run("models --format json");
  ASSERT_EQ(mj.exit_code, 0) << mj.err;
  nlohmann::json m = nlohmann::json::parse(mj.out);
  ASSERT_EQ(m.size(), 7u);
  EXPECT_EQ(m[3]["name"], "Llama-3.1-70B");
  EXPECT_EQ(m[3]["param_count"].get<uint64_t>(), 70'553'706'496u);
  EXPECT_EQ(m[3]["k16v16_bytes_per_token"].get<double>(), 327680.0);

  testing::CliResult links = Run("links --format json");
  ASSERT_EQ(links.exit_code, 0) << links.err;
  nlohmann::json l = nlohmann::json::parse(links.out);
  ASSERT_EQ(l["links"].size(), 9u);
  EXPECT_EQ(l["links"][1]["name"], "hbm3e");
  EXPECT_EQ(l["links"][1]["gb_per_s"].get<double>(), 4800.0);
  testing::CliResult table = Run("links");
  ASSERT_EQ(table.exit_code, 0);
  EXPECT_THAT(table.out, HasSubstr("decimal GB/s"));
}

TEST_F(BandwidthCli, ProbeSavesLinksThatShortfallReads) {
  testing::CliResult probe =
      Run("probe --no-gpu --data-dir " + P("data") + " --size-mb 8 --repeats 2 --save " +
          P("links.json"));
  ASSERT_EQ(probe.exit_code, 0) << probe.err;
  EXPECT_THAT(probe.out, HasSubstr("dram-memcpy"));
  EXPECT_THAT(probe.out, HasSubstr("skipped gpu: disabled"));
  // The disk test either measured or says why the filesystem refused O_DIRECT.
  const bool disk = probe.out.find("disk-odirect ") != std::string::npos &&
                    probe.out.find("skipped disk-odirect") == std::string::npos;
  if (!disk) {
    EXPECT_THAT(probe.out, HasSubstr("O_DIRECT"));
  }
  // The data directory was created and the temp file removed.
  ASSERT_TRUE(std::filesystem::is_directory(P("data")));
  EXPECT_TRUE(std::filesystem::is_empty(P("data")));

  nlohmann::json saved = nlohmann::json::parse(testing::ReadAll(P("links.json")));
  EXPECT_EQ(saved["format"], "kvtier-links-v1");
  ASSERT_GE(saved["links"].size(), 1u);
  EXPECT_EQ(saved["links"][0]["name"], "dram-memcpy");
  const double dram = saved["links"][0]["gb_per_s"].get<double>();
  EXPECT_GT(dram, 0.0);

  testing::CliResult r = Run("shortfall --model Llama-3.1-8B --links-file " + P("links.json") +
                             " --format json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  nlohmann::json j = nlohmann::json::parse(r.out);
  ASSERT_EQ(j["links"].size(), saved["links"].size());
  const auto& s = j["rows"][0]["shortfall"][0];
  EXPECT_EQ(s["link"], "dram-memcpy");
  // 32 x 131072 x 98368 bytes in 10 ms over the measured memcpy bandwidth.
  EXPECT_DOUBLE_EQ(s["factor"].get<double>(), 32.0 * 131072 * 98368 / 0.010 / (dram * 1e9));
}

TEST_F(BandwidthCli, BadInputIsAOneLineErrorWithExitTwo) {
  ExpectOneLineError("shortfall --model GPT-5", "unknown model 'GPT-5'");
  ExpectOneLineError("shortfall", "--model");
  ExpectOneLineError("shortfall --model Llama-3.1-8B --batch -4", "--batch");
  ExpectOneLineError("shortfall --model Llama-3.1-8B --batch=0", "--batch");
  ExpectOneLineError("shortfall --model Llama-3.1-8B --context 0", "--context");
  ExpectOneLineError("shortfall --model Llama-3.1-8B --context 12abc", "--context");
  ExpectOneLineError("shortfall --model Llama-3.1-8B --latency-ms 0", "--latency-ms");
  ExpectOneLineError("shortfall --model Llama-3.1-8B --latency-ms=-10", "--latency-ms");
  ExpectOneLineError("shortfall --model Llama-3.1-8B --codec k12v3", "unknown codec 'k12v3'");
  ExpectOneLineError("shortfall --model Llama-3.1-8B --links pcie9", "unknown link 'pcie9'");
  ExpectOneLineError("shortfall --model Llama-3.1-8B --links x=-5", "positive");
  ExpectOneLineError("shortfall --model Llama-3.1-8B --format xml", "--format");
  ExpectOneLineError("shortfall --model Llama-3.1-8B --hill-g 0", "--hill-g");
  ExpectOneLineError("shortfall --hf-config " + P("missing.json"), "missing.json");
  ExpectOneLineError("shortfall --model Llama-3.1-8B --links-file " + P("missing.json"),
                     "missing.json");
  ExpectOneLineError("probe --size-mb 0 --no-gpu --no-disk", "--size-mb");
  ExpectOneLineError("shortfall --model Llama-3.1-8B --params 70B", "--params");
  ExpectOneLineError("shortfall --model Llama-3.1-8B --params -5", "--params");
}

TEST_F(BandwidthCli, MalformedConfigIsAOneLineError) {
  ASSERT_TRUE(WriteCfg(R"({"num_hidden_layers": 32, "num_attention_heads": )"));
  ExpectOneLineError("shortfall --hf-config " + P("cfg/config.json"), "not valid JSON");
  ASSERT_TRUE(WriteCfg(R"({"num_attention_heads": 32, "hidden_size": 4096})"));
  ExpectOneLineError("shortfall --hf-config " + P("cfg/config.json"), "num_hidden_layers");
  ASSERT_TRUE(WriteCfg(R"({"num_hidden_layers": -1, "num_attention_heads": 32,
      "hidden_size": 4096})"));
  ExpectOneLineError("shortfall --hf-config " + P("cfg/config.json"), "must be positive");
  ASSERT_TRUE(WriteCfg(""));
  ExpectOneLineError("shortfall --hf-config " + P("cfg/config.json"), "not valid JSON");
  // One byte over the 16 MiB limit: refused before it is read.
  ASSERT_TRUE(WriteCfg(std::string((16 << 20) + 1, ' ')));
  ExpectOneLineError("shortfall --hf-config " + P("cfg/config.json"), "more than the limit");
}

}  // namespace
}  // namespace kvtier
