// End-to-end tests of `kvtier replay` and `kvtier plan` on small traces
// written to a temp dir: hit counts worked out by hand for LRU and Belady,
// the JSON objects, the SVG plot, one-line errors with exit code 2, and
// `replay --live` against a real kvtierd on a temp Unix socket.
#include <string>

#include "common/testing/temp_dir.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/cli_runner.h"
#include "tests/daemon_process.h"

namespace kvtier {
namespace {

using ::testing::HasSubstr;
using testing::CliResult;
using testing::ReadAll;
using testing::RunCommand;
using testing::TempDir;

const std::string kKvtier = KVTIER_CLI_PATH;

// Four requests over four distinct blocks:
//   [0,1,2] [0,1,3] [0,2] [0,1,3]
// With three chunks, LRU finds prefixes of 0, 2, 1 and 1 blocks (4 of 11
// reads); in the last request block 3 is stored but 1 is not, a chunk hit
// that saves nothing (5 chunk hits). Belady never stores 3 (read later than
// everything it holds) and keeps 1 and 2: prefixes 0, 2, 2, 2 (6).
constexpr char kTrace[] =
    "{\"timestamp\": 0, \"input_length\": 1536, \"output_length\": 10, \"hash_ids\": [0, 1, 2]}\n"
    "{\"timestamp\": 1000, \"input_length\": 1536, \"output_length\": 10, \"hash_ids\": [0, 1, 3]}\n"
    "{\"timestamp\": 2000, \"input_length\": 600, \"output_length\": 10, \"hash_ids\": [0, 2]}\n"
    "{\"timestamp\": 3000, \"input_length\": 1300, \"output_length\": 10, \"hash_ids\": [0, 1, 3]}\n";

class ReplayCli : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_FALSE(dir_.path().empty());
    Write("trace.jsonl", kTrace);
  }
  std::string P(const std::string& name) const { return dir_.path() + "/" + name; }
  void Write(const std::string& name, const std::string& text) {
    FILE* f = std::fopen(P(name).c_str(), "wb");
    ASSERT_NE(f, nullptr);
    std::fwrite(text.data(), 1, text.size(), f);
    std::fclose(f);
  }
  CliResult Kvtier(const std::string& args) { return RunCommand(kKvtier + " " + args, dir_.path()); }

  TempDir dir_{"kvtier-replay-cli"};
};

TEST_F(ReplayCli, JsonHasPolicyLruAndBeladyWithTheKnownHits) {
  CliResult r = Kvtier("replay " + P("trace.jsonl") + " --dram-share 0.75 --policy lru --json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["trace"]["requests"], 4);
  EXPECT_EQ(j["trace"]["distinct_blocks"], 4);
  EXPECT_EQ(j["model"], "llama-3.1-8b");
  // Llama-3.1-8B, 512 tokens, K16/V8: 48 MiB and change per chunk.
  EXPECT_GT(j["chunk_bytes"].get<uint64_t>(), uint64_t{48} << 20);
  EXPECT_EQ(j["policy"]["policy"], "lru");
  EXPECT_EQ(j["policy"]["capacity_chunks"], 3);
  EXPECT_EQ(j["policy"]["block_reads"], 11);
  EXPECT_EQ(j["policy"]["prefix_hits"], 4);
  EXPECT_EQ(j["policy"]["chunk_hits"], 5);
  EXPECT_DOUBLE_EQ(j["policy"]["prefix_hit_ratio"].get<double>(), 4.0 / 11.0);
  EXPECT_EQ(j["policy"]["prefix_hit_tokens"], 2048);
  EXPECT_EQ(j["policy"]["tiers"]["dram"]["prefix_hits"], 4);
  EXPECT_EQ(j["lru"]["prefix_hits"], 4);
  EXPECT_EQ(j["belady"]["prefix_hits"], 6);
  EXPECT_DOUBLE_EQ(j["belady"]["prefix_hit_ratio"].get<double>(), 6.0 / 11.0);
}

TEST_F(ReplayCli, TableShowsThePolicyBesideLruAndBelady) {
  CliResult r = Kvtier("replay " + P("trace.jsonl") + " --dram-gib 200 --nvme-gib 500 --policy flru");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("4 requests, 11 block reads, 4 distinct blocks"));
  EXPECT_THAT(r.out, HasSubstr("\nflru "));
  EXPECT_THAT(r.out, HasSubstr("\nlru "));
  EXPECT_THAT(r.out, HasSubstr("\nbelady "));
}

TEST_F(ReplayCli, PlanSweepsSizesAndWritesJsonAndSvg) {
  CliResult r = Kvtier("plan " + P("trace.jsonl") + " --dram-share 0.25,0.5,0.75 --nvme-share 0,0.5 --json --plot " +
                       P("plan.svg"));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  auto j = nlohmann::json::parse(r.out);
  ASSERT_EQ(j["points"].size(), 6u);
  EXPECT_EQ(j["points"][2]["policy"]["capacity_chunks"], 3);
  EXPECT_EQ(j["points"][2]["belady"]["prefix_hits"], 6);
  for (const auto& p : j["points"]) {
    EXPECT_LE(p["policy"]["prefix_hits"].get<int>(), p["belady"]["chunk_hits"].get<int>());
    EXPECT_GE(p["policy"]["ttft_p99_s"].get<double>(), p["policy"]["ttft_p50_s"].get<double>());
  }
  EXPECT_THAT(ReadAll(P("plan.svg")), ::testing::StartsWith("<svg"));
  EXPECT_DOUBLE_EQ(j["load_gb_per_s"]["dram"].get<double>(), 10);  // the LoadCostModel default
  EXPECT_DOUBLE_EQ(j["load_gb_per_s"]["nvme"].get<double>(), 7);
  CliResult t = Kvtier("plan " + P("trace.jsonl") + " --dram-share 0.75");
  ASSERT_EQ(t.exit_code, 0) << t.err;
  EXPECT_THAT(t.out, HasSubstr("saved-GPU-s/h"));
}

TEST_F(ReplayCli, LinksFromProbeSetTheLoadRates) {
  Write("links.json",
        "{\"format\": \"kvtier-links-v1\", \"units\": \"decimal GB/s (1e9 bytes/s)\", \"links\": ["
        "{\"name\": \"dram-memcpy\", \"gb_per_s\": 20, \"description\": \"\"},"
        "{\"name\": \"disk-odirect\", \"gb_per_s\": 2.5, \"description\": \"\"}]}");
  CliResult r = Kvtier("replay " + P("trace.jsonl") + " --dram-share 0.75 --links-file " + P("links.json") + " --json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  auto j = nlohmann::json::parse(r.out);
  EXPECT_DOUBLE_EQ(j["load_gb_per_s"]["dram"].get<double>(), 20);
  EXPECT_DOUBLE_EQ(j["load_gb_per_s"]["nvme"].get<double>(), 2.5);
  // A preset given on the command line wins over the file.
  r = Kvtier("replay " + P("trace.jsonl") + " --dram-share 0.75 --links-file " + P("links.json") +
             " --nvme-link nvme-gen5 --json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_DOUBLE_EQ(nlohmann::json::parse(r.out)["load_gb_per_s"]["nvme"].get<double>(), 14);
}

TEST_F(ReplayCli, BadInputExitsTwoWithOneLine) {
  Write("bad.jsonl", std::string(kTrace) + "{\"timestamp\": 4000, \"hash_ids\": [0, 1\n");
  CliResult r = Kvtier("replay " + P("bad.jsonl") + " --dram-share 0.5");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, HasSubstr("line 5: not valid JSON"));
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1);

  r = Kvtier("replay " + P("missing.jsonl") + " --dram-share 0.5");
  EXPECT_EQ(r.exit_code, 2);
  r = Kvtier("replay " + P("trace.jsonl") + " --dram-share 0.5 --policy mru");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, HasSubstr("unknown eviction policy"));
  r = Kvtier("replay " + P("trace.jsonl"));
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, HasSubstr("needs a DRAM or an NVMe tier"));
  r = Kvtier("replay " + P("trace.jsonl") + " --dram-gib 0.01");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, HasSubstr("smaller than one chunk"));
}

TEST_F(ReplayCli, LiveReplayAgainstTheRealDaemonReportsLatencies) {
  testing::DaemonProcess d(dir_.path());
  ASSERT_TRUE(d.WaitReady()) << ReadAll(P("kvtierd.log"));
  // One request at a time, 1000x faster than the trace (3 s of trace take
  // 3 ms), 16-token chunks (1.5 MiB): all four blocks fit in the daemon's
  // 32 MiB of DRAM, so every block read before is a prefix hit:
  // 0 + 2 + 2 + 3 = 7 gets, and the other 4 of 11 block reads are puts.
  CliResult r = Kvtier("replay " + P("trace.jsonl") + " --live --socket " + d.socket() +
                       " --time-scale 1000 --duration-s 20 --concurrency 1 --live-chunk-tokens 16 --json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["requests"], 4);
  EXPECT_EQ(j["block_reads"], 11);
  EXPECT_EQ(j["prefix_hits"], 7);
  EXPECT_EQ(j["lookup"]["calls"], 4);
  EXPECT_EQ(j["get"]["calls"], 7);
  EXPECT_EQ(j["put"]["calls"], 4);
  for (const char* call : {"lookup", "get", "put"}) {
    EXPECT_EQ(j[call]["errors"], 0) << call << ": " << j["first_error"];
    EXPECT_GT(j[call]["p50_ms"].get<double>(), 0) << call;
    EXPECT_GE(j[call]["max_ms"].get<double>(), j[call]["p99_ms"].get<double>()) << call;
  }
  EXPECT_LT(j["wall_s"].get<double>(), 20);

  // The duration bounds the replay: at trace speed, the requests at 1 s and
  // later never start within half a second.
  r = Kvtier("replay " + P("trace.jsonl") + " --live --socket " + d.socket() +
             " --duration-s 0.5 --concurrency 1 --live-chunk-tokens 16 --json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(nlohmann::json::parse(r.out)["requests"], 1);

  r = Kvtier("replay " + P("trace.jsonl") + " --live --socket " + P("nope.sock") + " --duration-s 1");
  EXPECT_EQ(r.exit_code, 2);
}

}  // namespace
}  // namespace kvtier
