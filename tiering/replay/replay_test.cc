#include "tiering/replay/replay.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tiering/eviction.h"

namespace kvtier::tiering::replay {
namespace {

// A small chunk (1 layer, 1 KV head, head_dim 16, 512 tokens, K16/V8):
// 28,672 bytes once aligned to 4096.
codec::ChunkSpec SmallChunk() {
  bandwidth::ModelSpec m;
  m.name = "tiny";
  m.num_layers = 1;
  m.num_kv_heads = 1;
  m.head_dim = 16;
  return ReplayChunkSpec(m, "k16v8", 512).value();
}

uint64_t Aligned() {
  return codec::AlignUp(codec::ValidateSpec(SmallChunk())->total_bytes, 4096);
}

Trace MakeTrace(const std::string& text) { return ParseTrace(text, 512).value(); }

ReplayOptions Options(uint64_t dram_chunks, uint64_t nvme_chunks, EvictionPolicyKind kind) {
  ReplayOptions o;
  o.chunk = SmallChunk();
  o.dram_bytes = dram_chunks * Aligned();
  o.nvme_bytes = nvme_chunks * Aligned();
  o.engine.eviction = {.all = kind};
  return o;
}

// Four requests over three chunks of DRAM, LRU; worked out by hand:
//   [0,1,2] miss x3                         cache 0 1 2
//   [0,1,3] prefix 0,1; 3 evicts 2          cache 0 1 3
//   [0,2]   prefix 0; 2 evicts 1            cache 3 0 2
//   [0,1,3] prefix 0; 1 missing, 3 stored: a chunk hit after a miss
constexpr char kFourRequests[] =
    "{\"timestamp\": 0, \"input_length\": 1536, \"hash_ids\": [0, 1, 2]}\n"
    "{\"timestamp\": 1000, \"input_length\": 1536, \"hash_ids\": [0, 1, 3]}\n"
    "{\"timestamp\": 2000, \"input_length\": 600, \"hash_ids\": [0, 2]}\n"
    "{\"timestamp\": 3000, \"input_length\": 1300, \"hash_ids\": [0, 1, 3]}\n";

TEST(ReplayTrace, LruOnAHandWrittenTraceHasTheKnownHits) {
  auto r = ReplayTrace(MakeTrace(kFourRequests), Options(3, 0, EvictionPolicyKind::kLru));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->requests, 4u);
  EXPECT_EQ(r->block_reads, 11u);
  EXPECT_EQ(r->token_reads, 4972u);
  EXPECT_EQ(r->prefix_hits, 4u);
  EXPECT_EQ(r->chunk_hits, 5u);
  EXPECT_EQ(r->prefix_hit_tokens, 2048u);  // 1024 + 512 + 512
  EXPECT_EQ(r->tiers[static_cast<int>(TierKind::kDram)].hits, 4u);
  EXPECT_DOUBLE_EQ(r->prefix_hit_ratio(), 4.0 / 11.0);
  EXPECT_DOUBLE_EQ(r->trace_seconds, 3.0);
  EXPECT_GT(r->saved_prefill_seconds, 0);
  EXPECT_LT(r->saved_prefill_seconds, 2048.0 / 10000.0);  // loading costs something
}

TEST(ReplayTrace, NvmeHitsAreDemotedThenPromotedChunks) {
  // One chunk of DRAM: [1] demotes 0 to NVMe (admitted after one use), and
  // [0] reads it back from NVMe and promotes it.
  ReplayOptions o = Options(1, 4, EvictionPolicyKind::kLru);
  o.engine.nvme_admit_after_uses = 1;
  auto r = ReplayTrace(MakeTrace("{\"timestamp\": 0, \"hash_ids\": [0]}\n"
                                 "{\"timestamp\": 1, \"hash_ids\": [1]}\n"
                                 "{\"timestamp\": 2, \"hash_ids\": [0]}\n"),
                       o);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->prefix_hits, 1u);
  EXPECT_EQ(r->tiers[static_cast<int>(TierKind::kNvme)].hits, 1u);
  EXPECT_EQ(r->tiers[static_cast<int>(TierKind::kDram)].hits, 0u);
  EXPECT_EQ(r->promotions, 1u);
  EXPECT_EQ(r->demotions, 2u);  // 0, then 1 when 0 came back
  EXPECT_EQ(r->tiers[static_cast<int>(TierKind::kNvme)].bytes_written, 2 * r->chunk_bytes);
}

TEST(ReplayTrace, ATierSmallerThanAChunkIsResourceExhausted) {
  ReplayOptions o = Options(0, 0, EvictionPolicyKind::kLru);
  EXPECT_EQ(ReplayTrace(MakeTrace(kFourRequests), o).status().code(), absl::StatusCode::kInvalidArgument);
  o.dram_bytes = 4096;
  EXPECT_EQ(ReplayTrace(MakeTrace(kFourRequests), o).status().code(),
            absl::StatusCode::kResourceExhausted);
}

TEST(BeladyReplay, KeepsWhatIsReadSoonestAndBypassesTheRest) {
  // Two chunks, reads 1 2 3 1 2 3: MIN keeps 1 and 2 and never stores 3
  // (read later than both), so 1 and 2 hit once; LRU hits nothing.
  Trace t = MakeTrace(
      "{\"timestamp\": 0, \"hash_ids\": [1]}\n{\"timestamp\": 0, \"hash_ids\": [2]}\n"
      "{\"timestamp\": 0, \"hash_ids\": [3]}\n{\"timestamp\": 0, \"hash_ids\": [1]}\n"
      "{\"timestamp\": 0, \"hash_ids\": [2]}\n{\"timestamp\": 0, \"hash_ids\": [3]}\n");
  ReplayOptions o = Options(2, 0, EvictionPolicyKind::kLru);
  ReplayResult b = BeladyReplay(t, o);
  EXPECT_EQ(b.capacity_chunks, 2u);
  EXPECT_EQ(b.prefix_hits, 2u);
  EXPECT_EQ(b.chunk_hits, 2u);
  EXPECT_EQ(ReplayTrace(t, o)->prefix_hits, 0u);
}

TEST(BeladyReplay, IsAnUpperBoundOfEveryPolicy) {
  Trace t = MakeTrace(kFourRequests);
  for (uint64_t cap : {1, 2, 3, 5}) {
    const uint64_t best = BeladyReplay(t, Options(cap, 0, EvictionPolicyKind::kLru)).chunk_hits;
    for (auto kind : {EvictionPolicyKind::kLru, EvictionPolicyKind::kS3Fifo, EvictionPolicyKind::kArc,
                      EvictionPolicyKind::kFreqLru}) {
      EXPECT_LE(ReplayTrace(t, Options(cap, 0, kind))->chunk_hits, best) << cap;
    }
  }
}

TEST(ReplayTrace, ASharedRootChunkHitsEveryLaterRequest) {
  // Chunk 0 (a shared system prompt) is read by every request; each request
  // also brings two chunks never read again. Only the root is a prefix hit.
  std::string text;
  for (int i = 0; i < 20; ++i) {
    text += "{\"timestamp\": " + std::to_string(i) + ", \"hash_ids\": [0, " + std::to_string(100 + 2 * i) +
            ", " + std::to_string(101 + 2 * i) + "]}\n";
  }
  auto r = ReplayTrace(MakeTrace(text), Options(4, 0, EvictionPolicyKind::kFreqLru));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->prefix_hits, 19u);
  EXPECT_EQ(r->chunk_hits, 19u);
  EXPECT_EQ(r->block_reads, 60u);
}

TEST(ResultJson, HasTheRatiosAndTiers) {
  auto r = ReplayTrace(MakeTrace(kFourRequests), Options(3, 2, EvictionPolicyKind::kFreqLru));
  ASSERT_TRUE(r.ok()) << r.status();
  auto j = nlohmann::json::parse(ResultJson(*r));
  EXPECT_EQ(j["policy"], "flru");
  EXPECT_DOUBLE_EQ(j["prefix_hit_ratio"].get<double>(), r->prefix_hit_ratio());
  EXPECT_TRUE(j["tiers"].contains("dram"));
  EXPECT_TRUE(j["tiers"].contains("nvme"));
  EXPECT_DOUBLE_EQ(j["tiers"]["dram"]["prefix_token_hit_ratio"].get<double>() +
                       j["tiers"]["nvme"]["prefix_token_hit_ratio"].get<double>(),
                   r->prefix_token_hit_ratio());
}

TEST(PlanCapacity, SweepsTheGridAndDrawsIt) {
  Trace t = MakeTrace(kFourRequests);
  const uint64_t a = Aligned();
  auto plan = PlanCapacity(t, Options(1, 0, EvictionPolicyKind::kFreqLru), {a, 2 * a, 3 * a}, {0, 2 * a});
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_EQ(plan->size(), 6u);
  EXPECT_EQ((*plan)[2].dram_bytes, 3 * a);
  EXPECT_EQ((*plan)[2].nvme_bytes, 0u);
  for (const PlanPoint& p : *plan) EXPECT_LE(p.policy.prefix_hits, p.belady.chunk_hits);
  const std::string svg = RenderPlanSvg(*plan);
  EXPECT_THAT(svg, ::testing::StartsWith("<svg"));
  EXPECT_THAT(svg, ::testing::HasSubstr("belady"));
  // One line per NVMe size and Belady's.
  size_t lines = 0;
  for (size_t at = svg.find("<polyline"); at != std::string::npos; at = svg.find("<polyline", at + 1)) ++lines;
  EXPECT_EQ(lines, 3u);
}

// Hot blocks read by every other request, the others each reading new
// blocks (one-use scans longer than the cache): LRU loses the hot blocks to
// every scan; FLRU (with a bonus) keeps them.
std::string HotAndScans(int requests) {
  std::string text;
  uint64_t next = 4;
  for (int r = 0; r < requests; ++r) {
    std::string ids = r % 2 == 0 ? "0, 1, 2, 3" : "";
    if (r % 2 == 1) {
      for (int i = 0; i < 24; ++i) absl::StrAppend(&ids, i ? ", " : "", next++);
    }
    absl::StrAppend(&text, "{\"timestamp\": ", r, ", \"hash_ids\": [", ids, "]}\n");
  }
  return text;
}

TEST(ReplayTrace, EachTierRunsItsOwnPolicy) {
  const Trace t = MakeTrace(HotAndScans(2000));
  auto prefix_hits = [&](EvictionPolicySpec spec, uint64_t nvme_chunks) {
    ReplayOptions o = Options(20, nvme_chunks, EvictionPolicyKind::kLru);
    o.engine.eviction = spec;
    // FLRU's bonus from the start (its miniature caches need a larger tier).
    o.engine.eviction_options.flru_bonus = 1.0;
    auto r = ReplayTrace(t, o);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? r->prefix_hits : 0;
  };
  const uint64_t lru = prefix_hits({.all = EvictionPolicyKind::kLru}, 0);
  const uint64_t flru = prefix_hits({.all = EvictionPolicyKind::kFreqLru}, 0);
  ASSERT_GT(flru, lru);
  EvictionPolicySpec dram_flru{.all = EvictionPolicyKind::kLru};
  dram_flru.tier[static_cast<int>(TierKind::kDram)] = EvictionPolicyKind::kFreqLru;
  EvictionPolicySpec nvme_flru{.all = EvictionPolicyKind::kLru};
  nvme_flru.tier[static_cast<int>(TierKind::kNvme)] = EvictionPolicyKind::kFreqLru;
  EXPECT_EQ(prefix_hits(dram_flru, 0), flru);  // DRAM's override is DRAM's policy
  EXPECT_EQ(prefix_hits(nvme_flru, 0), lru);   // an override of a tier not there does nothing
}

// The engine's default placement (PlacementEngineOptions{}: eviction policy
// per tier and NVMe admission) beside LRU under the same admission, as
// `kvtier replay` prints them.
struct DefaultAndLru {
  double default_ratio = 0, lru_ratio = 0;
};
DefaultAndLru ReplayDefaultAndLru(const Trace& t, uint64_t dram_bytes, uint64_t nvme_bytes) {
  ReplayOptions o;
  o.chunk = SmallChunk();
  o.dram_bytes = dram_bytes;
  o.nvme_bytes = nvme_bytes;
  DefaultAndLru out;
  auto d = ReplayTrace(t, o);
  EXPECT_TRUE(d.ok()) << d.status();
  o.engine.eviction = {.all = EvictionPolicyKind::kLru};
  auto l = ReplayTrace(t, o);
  EXPECT_TRUE(l.ok()) << l.status();
  if (d.ok() && l.ok()) out = {d->prefix_hit_ratio(), l->prefix_hit_ratio()};
  return out;
}

TEST(DefaultPlacement, IsFlruInDramLruInNvmeAdmittingEveryEvictedChunk) {
  const PlacementEngineOptions o;
  EXPECT_EQ(EvictionPolicySpecName(o.eviction), "flru,nvme=lru");
  EXPECT_EQ(o.nvme_admit_after_uses, 1u);
  EXPECT_EQ(ReplayOptions{}.engine.nvme_admit_after_uses, 1u);
}

// The Mooncake FAST'25 conversation trace (12,031 requests, 288,500 block
// reads of 182,790 distinct blocks; about 0.4 s per replay). Tier sizes are
// shares of the distinct blocks, as `kvtier replay --dram-share` sizes them.
class MooncakeTrace : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto t = ReadTrace(KVTIER_MOONCAKE_TRACE, 512);
    ASSERT_TRUE(t.ok()) << t.status() << " (the trace ships in shared/traces beside the repository)";
    trace_ = new Trace(*std::move(t));
  }
  static void TearDownTestSuite() {
    delete trace_;
    trace_ = nullptr;
  }
  static uint64_t Bytes(double share) { return BytesForShare(*trace_, Aligned(), share); }
  static Trace* trace_;
};
Trace* MooncakeTrace::trace_ = nullptr;

TEST_F(MooncakeTrace, DefaultPlacementReaches030AtFivePercentDramAndTenNvme) {
  ASSERT_NE(trace_, nullptr);
  ASSERT_EQ(trace_->distinct_blocks, 182790u);
  const DefaultAndLru r = ReplayDefaultAndLru(*trace_, Bytes(0.05), Bytes(0.1));
  EXPECT_GE(r.default_ratio, 0.30);
  EXPECT_NEAR(r.default_ratio, 0.3155, 0.0005);
  EXPECT_GT(r.default_ratio, r.lru_ratio + 0.01);  // LRU: 0.3049
}

TEST_F(MooncakeTrace, DefaultPlacementIsAtLeastLruWithDramAloneAndWithALargeNvme) {
  ASSERT_NE(trace_, nullptr);
  // DRAM alone: FLRU's bonus keeps reused chunks at 2% (LRU 0.0787) and
  // falls to 0 at 20%, where recency alone keeps them.
  DefaultAndLru r = ReplayDefaultAndLru(*trace_, Bytes(0.02), 0);
  EXPECT_GT(r.default_ratio, r.lru_ratio + 0.05);
  r = ReplayDefaultAndLru(*trace_, Bytes(0.2), 0);
  EXPECT_GE(r.default_ratio, r.lru_ratio);
  // An NVMe tier ten times DRAM: a bonus chosen for DRAM's hits alone costs
  // NVMe more than it gains in DRAM; chosen for both tiers' hits it does not.
  r = ReplayDefaultAndLru(*trace_, Bytes(0.02), Bytes(0.2));
  EXPECT_GE(r.default_ratio, r.lru_ratio);  // both 0.3497
}

TEST_F(MooncakeTrace, BeladyIsTheOptimumOfDramPlusNvme) {
  ASSERT_NE(trace_, nullptr);
  ReplayOptions o;
  o.chunk = SmallChunk();
  o.dram_bytes = Bytes(0.02);
  const ReplayResult dram_only = BeladyReplay(*trace_, o);
  o.nvme_bytes = Bytes(0.02);
  const ReplayResult both = BeladyReplay(*trace_, o);
  EXPECT_EQ(both.capacity_chunks, 2 * dram_only.capacity_chunks);
  EXPECT_GT(both.prefix_hit_ratio(), dram_only.prefix_hit_ratio() + 0.04);  // 0.3635 vs 0.3143
  // From 5% of the distinct blocks on, the optimum keeps every block until
  // its last read: every read but a block's first hits, whatever the split.
  const double ceiling = 1.0 - double(trace_->distinct_blocks) / double(trace_->block_reads);
  o.dram_bytes = Bytes(0.05);
  o.nvme_bytes = 0;
  EXPECT_DOUBLE_EQ(BeladyReplay(*trace_, o).chunk_hit_ratio(), ceiling);
  o.nvme_bytes = Bytes(0.1);
  EXPECT_DOUBLE_EQ(BeladyReplay(*trace_, o).chunk_hit_ratio(), ceiling);
}

// Hot requests (4 blocks each, 100 of them: 400 blocks) read once per
// round, each followed by a scan request of 8 blocks never read again: every
// hot block is reused after 1,200 block reads, more than DRAM and NVMe hold
// together, so LRU never hits. The default keeps the hot set in DRAM once
// FLRU's miniature caches have chosen a bonus (their first epoch, about
// 14 rounds).
std::string HotSetBetweenScans(int rounds) {
  std::string text;
  uint64_t next = 1'000'000;
  int ts = 0;
  for (int round = 0; round < rounds; ++round) {
    for (int h = 0; h < 100; ++h) {
      absl::StrAppend(&text, "{\"timestamp\": ", ts++, ", \"hash_ids\": [", 4 * h, ", ", 4 * h + 1, ", ",
                      4 * h + 2, ", ", 4 * h + 3, "]}\n");
      std::string ids;
      for (int i = 0; i < 8; ++i) absl::StrAppend(&ids, i ? ", " : "", next++);
      absl::StrAppend(&text, "{\"timestamp\": ", ts++, ", \"hash_ids\": [", ids, "]}\n");
    }
  }
  return text;
}

TEST(DefaultPlacement, KeepsAHotSetThroughScansWhereLruLosesIt) {
  const Trace t = MakeTrace(HotSetBetweenScans(40));
  ASSERT_EQ(t.block_reads, 40u * 1200u);
  // 40 rounds x 400 hot reads; 16,000 at most.
  for (uint64_t nvme_chunks : {0, 320}) {
    const DefaultAndLru r = ReplayDefaultAndLru(t, 640 * Aligned(), nvme_chunks * Aligned());
    EXPECT_EQ(r.lru_ratio, 0.0) << nvme_chunks;
    EXPECT_GT(r.default_ratio * double(t.block_reads), 0.5 * 16000) << nvme_chunks;
  }
}

TEST(EvictionPolicySpec, ParsesOnePolicyOrOnePerTier) {
  auto all = ParseEvictionPolicySpec("flru");
  ASSERT_TRUE(all.ok()) << all.status();
  for (int k = 0; k < kNumTierKinds; ++k) {
    EXPECT_EQ(all->For(static_cast<TierKind>(k)), EvictionPolicyKind::kFreqLru);
  }
  auto mixed = ParseEvictionPolicySpec(" flru , nvme = lru ");
  ASSERT_TRUE(mixed.ok()) << mixed.status();
  EXPECT_EQ(mixed->For(TierKind::kDram), EvictionPolicyKind::kFreqLru);
  EXPECT_EQ(mixed->For(TierKind::kNvme), EvictionPolicyKind::kLru);
  EXPECT_EQ(EvictionPolicySpecName(*mixed), "flru,nvme=lru");
  auto tier_only = ParseEvictionPolicySpec("dram=arc", EvictionPolicyKind::kS3Fifo);
  ASSERT_TRUE(tier_only.ok()) << tier_only.status();
  EXPECT_EQ(tier_only->For(TierKind::kDram), EvictionPolicyKind::kArc);
  EXPECT_EQ(tier_only->For(TierKind::kNvme), EvictionPolicyKind::kS3Fifo);
  EXPECT_EQ(EvictionPolicySpecName(*tier_only), "s3fifo,dram=arc");
  // An override equal to the bare policy is left out of the name.
  EXPECT_EQ(EvictionPolicySpecName(*ParseEvictionPolicySpec("lru,hbm=lru")), "lru");

  for (const char* bad : {"", "flru,", ",flru", "nvme=lfu", "disk=lru", "flru,lru", "nvme=lru,nvme=arc",
                          "=lru", "nvme=", "flru;nvme=lru"}) {
    absl::Status st = ParseEvictionPolicySpec(bad).status();
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(std::string(st.message()), ::testing::HasSubstr("eviction")) << bad;
  }
  EXPECT_THAT(std::string(ParseEvictionPolicySpec("disk=lru").status().message()),
              ::testing::HasSubstr("unknown tier"));
}

}  // namespace
}  // namespace kvtier::tiering::replay
