// Placement engine: placement, admission, eviction/demotion/promotion,
// leases, slots, split K/V, prefetch, watermarks, concurrency, policies.
#include <fcntl.h>
#include <unistd.h>

#include <cstring>
#include <set>
#include <thread>

#include "common/testing/temp_dir.h"
#include "gmock/gmock.h"
#include "absl/container/flat_hash_set.h"
#include "gtest/gtest.h"
#include "tiering/placement_engine.h"
#include "tiering/test_util.h"

namespace kvtier::tiering {
namespace {

using ::kvtier::tiering::testing::FlipByteOnNvme;
using ::kvtier::tiering::testing::KeyOf;
using ::kvtier::tiering::testing::MakeChunk;
using ::kvtier::testing::TempDir;

constexpr uint64_t kChunkAlloc = 16384;  // MakeChunk(…,16) rounds to 4 pages

struct Setup {
  uint64_t dram = 8 * kChunkAlloc;
  uint64_t nvme = 4 << 20;
  uint64_t hbm = 0;
  bool with_nvme = true;
  // Admission after two uses, so that the tests below can tell admitted
  // chunks from dropped ones.
  PlacementEngineOptions options{.nvme_admit_after_uses = 2, .maintenance_interval_ms = 0};
};

std::unique_ptr<PlacementEngine> MakeEngine(const TempDir& dir, Setup s) {
  EngineTiers tiers;
  if (s.dram > 0) tiers.dram = DramTier::Open({.capacity_bytes = s.dram, .populate = false}).value();
  if (s.with_nvme) tiers.nvme = NvmeTier::Open({.dir = dir.path(), .capacity_bytes = s.nvme}).value();
  if (s.hbm > 0) {
    tiers.hbm = HbmTier::Open({.capacity_bytes = s.hbm}, NewFakeDeviceAllocator(s.hbm)).value();
  }
  auto e = PlacementEngine::Create(s.options, std::move(tiers));
  EXPECT_TRUE(e.ok()) << e.status();
  return std::move(*e);
}

absl::StatusOr<std::pair<std::vector<uint8_t>, TierKind>> GetAll(PlacementEngine& e, uint64_t seed) {
  auto n = e.ChunkBytes(KeyOf(seed));
  if (!n.ok()) return n.status();
  std::vector<uint8_t> out(*n);
  auto t = e.Get(KeyOf(seed), out);
  if (!t.ok()) return t.status();
  return std::make_pair(std::move(out), *t);
}

TEST(PlacementEngine, PutThenGetReturnsSameBytesFromDram) {
  TempDir dir;
  auto e = MakeEngine(dir, {});
  auto c = MakeChunk(1);
  ASSERT_TRUE(e->Put(KeyOf(1), c).ok());
  auto got = GetAll(*e, 1);
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(got->first, c);
  EXPECT_EQ(got->second, TierKind::kDram);
  EXPECT_EQ(e->metric(EngineMetric::kHitsDram), 1u);
  std::vector<uint8_t> out(c.size());
  EXPECT_EQ(e->Get(KeyOf(2), out).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(e->metric(EngineMetric::kMisses), 1u);
}

TEST(PlacementEngine, PutRejectsMalformedChunkWithInvalidArgument) {
  TempDir dir;
  auto e = MakeEngine(dir, {});
  std::vector<uint8_t> garbage(4096, 7);
  EXPECT_EQ(e->Put(KeyOf(1), garbage).code(), absl::StatusCode::kInvalidArgument);
  auto c = MakeChunk(1);
  c.push_back(0);  // one byte too long
  EXPECT_EQ(e->Put(KeyOf(1), c).code(), absl::StatusCode::kInvalidArgument);
  c.resize(c.size() - 2);  // one byte short
  EXPECT_EQ(e->Put(KeyOf(1), c).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(e->Contains(KeyOf(1)));
}

TEST(PlacementEngine, LookupPrefixStopsAtFirstMiss) {
  TempDir dir;
  auto e = MakeEngine(dir, {});
  for (int i : {0, 1, 2, 4}) ASSERT_TRUE(e->Put(KeyOf(i), MakeChunk(i)).ok());
  std::vector<Hash128> keys;
  for (int i = 0; i < 6; ++i) keys.push_back(KeyOf(i));
  auto hits = e->LookupPrefix(keys);
  EXPECT_THAT(hits, ::testing::ElementsAre(TierKind::kDram, TierKind::kDram, TierKind::kDram));
}

TEST(PlacementEngine, EvictionDemotesOnlyAdmittedChunksAndHitsPromote) {
  TempDir dir;
  auto e = MakeEngine(dir, {});
  // Chunks 0..11 are used twice (put + get): admitted to NVMe on eviction.
  // DRAM holds 8, so some of them must be demoted.
  for (int i = 0; i < 12; ++i) {
    ASSERT_TRUE(e->Put(KeyOf(i), MakeChunk(i)).ok());
    ASSERT_TRUE(GetAll(*e, i).ok());
  }
  for (int i = 12; i < 48; ++i) ASSERT_TRUE(e->Put(KeyOf(i), MakeChunk(i)).ok());
  EXPECT_LE(e->dram()->used_bytes(), e->dram()->capacity_bytes());
  EXPECT_GT(e->metric(EngineMetric::kEvictions), 0u);
  EXPECT_GT(e->metric(EngineMetric::kAdmissionRejects), 0u);
  EXPECT_GE(e->metric(EngineMetric::kDemotions), 4u);
  // Used-twice chunks survive (DRAM or NVMe); a get from NVMe promotes.
  for (int i = 0; i < 12; ++i) {
    auto got = GetAll(*e, i);
    ASSERT_TRUE(got.ok()) << i << got.status();
    EXPECT_EQ(got->first, MakeChunk(i));
  }
  EXPECT_GT(e->metric(EngineMetric::kHitsNvme), 0u);
  EXPECT_GT(e->metric(EngineMetric::kPromotions), 0u);
  // Most single-use chunks were dropped, not written to NVMe.
  EXPECT_LT(e->nvme()->List().size(), 24u);
}

TEST(PlacementEngine, UseBeforeADropCountsTowardsNvmeAdmission) {
  // Each chunk is put once, dropped from DRAM (one use: not admitted), then
  // put again: that is its second use, so its next eviction demotes it,
  // unless the engine forgets dropped chunks (admission_history = 0).
  for (uint32_t history : {0u, 1024u}) {
    TempDir dir;
    auto e = MakeEngine(
        dir, {.options = {.nvme_admit_after_uses = 2, .admission_history = history, .maintenance_interval_ms = 0}});
    for (int round = 0; round < 2; ++round) {
      for (int i = 0; i < 32; ++i) ASSERT_TRUE(e->Put(KeyOf(i), MakeChunk(i)).ok());
    }
    for (int i = 100; i < 116; ++i) ASSERT_TRUE(e->Put(KeyOf(i), MakeChunk(i)).ok());
    size_t on_nvme = 0;
    for (int i = 0; i < 32; ++i) on_nvme += e->nvme()->Size({KeyOf(i), Part::kWhole}).ok();
    if (history == 0) {
      EXPECT_EQ(on_nvme, 0u);
      EXPECT_EQ(e->metric(EngineMetric::kDemotions), 0u);
    } else {
      EXPECT_GE(on_nvme, 16u);  // at least every chunk of round 2 that DRAM evicted
      EXPECT_EQ(e->metric(EngineMetric::kDemotions), on_nvme);
    }
  }
}

TEST(PlacementEngine, FullTierWithNothingEvictableReturnsResourceExhausted) {
  TempDir dir;
  auto e = MakeEngine(dir, {.dram = 4 * kChunkAlloc, .with_nvme = false});
  std::vector<Hash128> keys;
  for (int i = 0; i < 4; ++i) {
    ASSERT_TRUE(e->Put(KeyOf(i), MakeChunk(i)).ok());
    keys.push_back(KeyOf(i));
  }
  auto lease = e->Pin(keys, 60'000);
  ASSERT_TRUE(lease.ok());
  auto t0 = std::chrono::steady_clock::now();
  absl::Status st = e->Put(KeyOf(9), MakeChunk(9));
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(2));
  // Releasing the lease makes room.
  ASSERT_TRUE(e->Release(lease->id).ok());
  EXPECT_TRUE(e->Put(KeyOf(9), MakeChunk(9)).ok());
  // A chunk larger than the whole tier fails at once.
  EXPECT_EQ(e->Put(KeyOf(10), MakeChunk(10, 512)).code(), absl::StatusCode::kResourceExhausted);
}

TEST(PlacementEngine, LeaseExpiresSoDeadClientNeverLeaksPin) {
  TempDir dir;
  FakeClock clock;
  auto e = MakeEngine(dir, {.options = {.maintenance_interval_ms = 0, .clock = &clock}});
  ASSERT_TRUE(e->Put(KeyOf(1), MakeChunk(1)).ok());
  std::vector<Hash128> keys{KeyOf(1)};
  auto lease = e->Pin(keys, 1000);
  ASSERT_TRUE(lease.ok());
  EXPECT_EQ(e->Delete(KeyOf(1)).code(), absl::StatusCode::kFailedPrecondition);
  clock.AdvanceMicros(900'000);
  ASSERT_TRUE(e->Renew(lease->id, 1000).ok());
  clock.AdvanceMicros(900'000);
  EXPECT_EQ(e->Delete(KeyOf(1)).code(), absl::StatusCode::kFailedPrecondition);
  clock.AdvanceMicros(200'000);  // the client died: no renew
  e->RunMaintenance();
  EXPECT_EQ(e->metric(EngineMetric::kLeasesExpired), 1u);
  EXPECT_EQ(e->Release(lease->id).code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(e->Delete(KeyOf(1)).ok());
  std::vector<Hash128> missing{KeyOf(2)};
  EXPECT_EQ(e->Pin(missing).status().code(), absl::StatusCode::kNotFound);
}

TEST(PlacementEngine, DurablePutIsCommittedOnNvmeAndSurvivesRestart) {
  TempDir dir;
  auto c = MakeChunk(3);
  {
    auto e = MakeEngine(dir, {});
    ASSERT_TRUE(e->Put(KeyOf(3), c, {.durable = true}).ok());
    ASSERT_TRUE(e->nvme()->Size({KeyOf(3), Part::kWhole}).ok());
    ASSERT_TRUE(e->Put(KeyOf(4), MakeChunk(4)).ok());  // DRAM only: volatile
  }
  auto e = MakeEngine(dir, {});
  auto got = GetAll(*e, 3);
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(got->first, c);
  EXPECT_EQ(got->second, TierKind::kNvme);
  EXPECT_EQ(GetAll(*e, 4).status().code(), absl::StatusCode::kNotFound);
  // Durable put without NVMe is a lifecycle error.
  TempDir dir2;
  auto dram_only = MakeEngine(dir2, {.with_nvme = false});
  EXPECT_EQ(dram_only->Put(KeyOf(1), c, {.durable = true}).code(),
            absl::StatusCode::kFailedPrecondition);
}

// Load estimates: each hit's size and latency + bytes / bandwidth of its
// tier, assumed until the tier has read something, then measured.
TEST(PlacementEngine, EstimatePrefixLoadUsesAssumedThenMeasuredBandwidth) {
  TempDir dir;
  PlacementEngineOptions o{.maintenance_interval_ms = 0};
  o.load_cost.assumed_read_bytes_per_s = {8e9, 4e9, 1e9, 2e9};
  o.load_cost.latency_us = {1, 2, 300, 4};
  auto c3 = MakeChunk(3), c4 = MakeChunk(4);
  {
    auto e = MakeEngine(dir, {.options = o});
    ASSERT_TRUE(e->Put(KeyOf(3), c3, {.durable = true}).ok());
  }
  auto e = MakeEngine(dir, {.options = o});  // KeyOf(3) now on NVMe only
  ASSERT_TRUE(e->Put(KeyOf(4), c4).ok());
  const Hash128 keys[] = {KeyOf(4), KeyOf(3), KeyOf(9), KeyOf(4)};
  PrefixLoadEstimate est = e->EstimatePrefixLoad(keys);
  ASSERT_EQ(est.tiers, (std::vector<TierKind>{TierKind::kDram, TierKind::kNvme}));
  EXPECT_EQ(est.bytes, (std::vector<uint64_t>{c4.size(), c3.size()}));
  ASSERT_EQ(est.load_us.size(), 2u);
  EXPECT_DOUBLE_EQ(est.load_us[0], 2 + c4.size() * 1e6 / 4e9);
  EXPECT_DOUBLE_EQ(est.load_us[1], 300 + c3.size() * 1e6 / 1e9);
  EXPECT_EQ(e->EstimatedReadBytesPerS(TierKind::kNvme), 1e9);
  // A read from NVMe gives the tier a measured bandwidth, used from then on.
  ASSERT_TRUE(GetAll(*e, 3).ok());
  const double measured = e->nvme()->bandwidth().read_bytes_per_s;
  ASSERT_GT(measured, 0);
  EXPECT_EQ(e->EstimatedReadBytesPerS(TierKind::kNvme), measured);
  EXPECT_TRUE(e->EstimatePrefixLoad(std::span<const Hash128>(keys).subspan(2)).tiers.empty());
}

TEST(PlacementEngine, SplitKvPutsKInDramAndVOnNvme) {
  TempDir dir;
  auto e = MakeEngine(dir, {.options = {.maintenance_interval_ms = 0, .split_kv = SplitKvPolicy::kAlways}});
  auto c = MakeChunk(8, 32);
  ASSERT_TRUE(e->Put(KeyOf(8), c).ok());
  auto loc = e->Locate(KeyOf(8));
  ASSERT_TRUE(loc.ok());
  ASSERT_EQ(loc->parts.size(), 2u);
  EXPECT_EQ(loc->parts[0].part, Part::kK);
  EXPECT_EQ(loc->parts[0].tier, TierKind::kDram);
  EXPECT_TRUE(loc->parts[0].dram_slot.has_value());
  EXPECT_EQ(loc->parts[1].part, Part::kV);
  EXPECT_EQ(loc->parts[1].tier, TierKind::kNvme);
  auto got = GetAll(*e, 8);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->first, c);
  EXPECT_EQ(got->second, TierKind::kNvme);
  // K came from DRAM, which does not verify on read: the copy is not verified.
  std::vector<uint8_t> out(c.size());
  bool verified = true;
  ASSERT_TRUE(e->Get(KeyOf(8), out, {.promote = false}, &verified).ok());
  EXPECT_FALSE(verified);
  // Split objects verify alone: the V object on NVMe is header + V section.
  auto h = codec::ParseHeader(c).value();
  EXPECT_EQ(e->nvme()->Size({KeyOf(8), Part::kV}).value(),
            codec::kHeaderSize + c.size() - h.layout.v_offset);
  // Per-call override stores whole.
  ASSERT_TRUE(e->Put(KeyOf(9), MakeChunk(9), {.split_kv = SplitKvPolicy::kNever}).ok());
  EXPECT_EQ(e->Locate(KeyOf(9))->parts.size(), 1u);
}

TEST(PlacementEngine, PrefetchPromotesNvmeChunksIntoDram) {
  TempDir dir;
  auto e = MakeEngine(dir, {});
  std::vector<Hash128> keys;
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(e->Put(KeyOf(i), MakeChunk(i), {.tier = TierKind::kNvme}).ok());
    EXPECT_EQ(e->LookupPrefix(std::vector<Hash128>{KeyOf(i)})[0], TierKind::kNvme);
    keys.push_back(KeyOf(i));
  }
  keys.push_back(KeyOf(99));  // missing keys are skipped
  ASSERT_TRUE(e->Prefetch(keys).get().ok());
  EXPECT_EQ(e->metric(EngineMetric::kPrefetched), 3u);
  for (int i = 0; i < 3; ++i) {
    auto got = GetAll(*e, i);
    ASSERT_TRUE(got.ok());
    EXPECT_EQ(got->second, TierKind::kDram);
    EXPECT_EQ(got->first, MakeChunk(i));
  }
}

TEST(PlacementEngine, SlotIsFilledInPlaceAndCommittedWithoutCopy) {
  TempDir dir;
  FakeClock clock;
  auto e = MakeEngine(dir, {.options = {.maintenance_interval_ms = 0, .clock = &clock}});
  auto c = MakeChunk(5);
  auto slot = e->AllocateSlot(c.size(), 1000);
  ASSERT_TRUE(slot.ok());
  // A client writes through its own mapping of the shared-memory fd.
  int fd = e->dram()->shm_fd();
  ASSERT_EQ(pwrite(fd, c.data(), c.size(), slot->extent.offset), static_cast<ssize_t>(c.size()));
  ASSERT_TRUE(e->CommitSlot(slot->id, KeyOf(5), {.durable = true}).ok());
  auto loc = e->Locate(KeyOf(5));
  ASSERT_TRUE(loc.ok());
  ASSERT_TRUE(loc->parts[0].dram_slot.has_value());
  EXPECT_EQ(loc->parts[0].dram_slot->offset, slot->extent.offset);
  EXPECT_TRUE(e->nvme()->Size({KeyOf(5), Part::kWhole}).ok());
  auto got = GetAll(*e, 5);
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(got->first, c);
  EXPECT_EQ(e->CommitSlot(slot->id, KeyOf(5)).code(), absl::StatusCode::kNotFound);
  // Garbage in a slot is refused and the slot freed.
  auto bad = e->AllocateSlot(c.size());
  ASSERT_TRUE(bad.ok());
  uint64_t used = e->dram()->used_bytes();
  EXPECT_EQ(e->CommitSlot(bad->id, KeyOf(6)).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_LT(e->dram()->used_bytes(), used);
  // An abandoned slot expires.
  auto lost = e->AllocateSlot(c.size(), 1000);
  ASSERT_TRUE(lost.ok());
  clock.AdvanceMicros(2'000'000);
  e->RunMaintenance();
  EXPECT_EQ(e->metric(EngineMetric::kSlotsExpired), 1u);
  EXPECT_EQ(e->CommitSlot(lost->id, KeyOf(7)).code(), absl::StatusCode::kNotFound);
}

TEST(PlacementEngine, MaintenanceEvictsDownToLowWatermark) {
  TempDir dir;
  auto e = MakeEngine(dir, {.dram = 10 * kChunkAlloc,
                            .options = {.high_watermark = 0.75, .low_watermark = 0.5,
                                        .maintenance_interval_ms = 0}});
  for (int i = 0; i < 9; ++i) ASSERT_TRUE(e->Put(KeyOf(i), MakeChunk(i)).ok());
  EXPECT_GT(e->dram()->used_bytes(), 0.75 * e->dram()->capacity_bytes());
  e->RunMaintenance();
  EXPECT_LE(e->dram()->used_bytes(), 0.5 * e->dram()->capacity_bytes());
}

TEST(PlacementEngine, BackgroundThreadEnforcesWatermarks) {
  TempDir dir;
  auto e = MakeEngine(dir, {.dram = 10 * kChunkAlloc,
                            .options = {.high_watermark = 0.75, .low_watermark = 0.5,
                                        .maintenance_interval_ms = 5}});
  for (int i = 0; i < 9; ++i) ASSERT_TRUE(e->Put(KeyOf(i), MakeChunk(i)).ok());
  for (int i = 0; i < 200 && e->dram()->used_bytes() > 0.5 * e->dram()->capacity_bytes(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_LE(e->dram()->used_bytes(), 0.5 * e->dram()->capacity_bytes());
}

TEST(PlacementEngine, CorruptNvmeCopyReturnsDataLossAndEngineKeepsServing) {
  TempDir dir;
  auto e = MakeEngine(dir, {});
  auto c = MakeChunk(1);
  ASSERT_TRUE(e->Put(KeyOf(1), c, {.tier = TierKind::kNvme}).ok());
  ASSERT_TRUE(e->Put(KeyOf(2), MakeChunk(2), {.tier = TierKind::kNvme}).ok());
  ASSERT_TRUE(FlipByteOnNvme(*e->nvme(), {KeyOf(1), Part::kWhole}, 200).ok());
  std::vector<uint8_t> out(c.size());
  EXPECT_EQ(e->Get(KeyOf(1), out).status().code(), absl::StatusCode::kDataLoss);
  EXPECT_FALSE(e->Contains(KeyOf(1)));
  EXPECT_EQ(e->metric(EngineMetric::kDataLoss), 1u);
  auto got = GetAll(*e, 2);
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(got->first, MakeChunk(2));
}

TEST(PlacementEngine, HbmEvictionDemotesToDram) {
  TempDir dir;
  auto e = MakeEngine(dir, {.dram = 16 * kChunkAlloc, .hbm = 2 * kChunkAlloc});
  for (int i = 0; i < 4; ++i) ASSERT_TRUE(e->Put(KeyOf(i), MakeChunk(i), {.tier = TierKind::kHbm}).ok());
  EXPECT_LE(e->hbm()->used_bytes(), 2 * kChunkAlloc);
  EXPECT_GE(e->metric(EngineMetric::kDemotions), 2u);
  for (int i = 0; i < 4; ++i) {
    auto got = GetAll(*e, i);
    ASSERT_TRUE(got.ok());
    EXPECT_EQ(got->first, MakeChunk(i));
  }
  EXPECT_GT(e->metric(EngineMetric::kHitsHbm), 0u);
  EXPECT_GT(e->metric(EngineMetric::kHitsDram), 0u);
}

TEST(PlacementEngine, ConcurrentPutsGetsAndEvictionsReturnExactBytesOrNotFound) {
  TempDir dir;
  auto e = MakeEngine(dir, {.dram = 12 * kChunkAlloc, .nvme = 24 * kChunkAlloc,
                            .options = {.nvme_admit_after_uses = 1, .maintenance_interval_ms = 2}});
  std::atomic<int> bad{0}, hits{0};
  std::vector<std::thread> threads;
  for (int th = 0; th < 4; ++th) {
    threads.emplace_back([&, th] {
      for (int i = 0; i < 60; ++i) {
        int id = (th * 13 + i * 7) % 48;
        auto c = MakeChunk(id);
        absl::Status st = e->Put(KeyOf(id), c, {.durable = (i % 10 == 0)});
        if (!st.ok() && !absl::IsResourceExhausted(st)) ++bad;
        std::vector<uint8_t> out(c.size());
        auto got = e->Get(KeyOf(id), out);
        if (got.ok()) {
          ++hits;
          if (out != c) ++bad;
        } else if (!absl::IsNotFound(got.status()) && !absl::IsUnavailable(got.status())) {
          ++bad;
        }
        if (i % 9 == 8) {
          absl::Status d = e->Delete(KeyOf(id));
          if (!d.ok() && !absl::IsNotFound(d) && !absl::IsUnavailable(d)) ++bad;
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(bad.load(), 0);
  EXPECT_GT(hits.load(), 100);
  EXPECT_LE(e->dram()->used_bytes(), e->dram()->capacity_bytes());
  EXPECT_LE(e->nvme()->used_bytes(), e->nvme()->capacity_bytes());
}

// GetShared (the daemon's shared-memory get) is a read like Get: a chunk read
// that way is used, so it stays in DRAM while four DRAM tiers' worth of
// chunks that are only put pass through, and each read counts one get and
// one hit (or miss). S3-FIFO: FLRU's miniature caches need a tier of more
// than 8 chunks to choose a bonus, and without one it is LRU.
TEST(PlacementEngine, SharedReadsKeepAChunkHotAndAreCounted) {
  TempDir dir;
  auto e = MakeEngine(dir, {.options = {.eviction = {.all = EvictionPolicyKind::kS3Fifo},
                                        .nvme_admit_after_uses = 2,
                                        .maintenance_interval_ms = 0}});
  const auto c = MakeChunk(1);
  ASSERT_TRUE(e->Put(KeyOf(1), c).ok());
  for (int i = 0; i < 3; ++i) {
    auto r = e->GetShared(KeyOf(1));
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->tier, TierKind::kDram);
    EXPECT_NE(r->lease_id, 0u);
    EXPECT_EQ(r->slot_id, 0u);
    ASSERT_EQ(r->extent.length, c.size());
    EXPECT_EQ(std::memcmp(e->dram()->base() + r->extent.offset, c.data(), c.size()), 0);
    EXPECT_EQ(e->Delete(KeyOf(1)).code(), absl::StatusCode::kFailedPrecondition);  // pinned
    ASSERT_TRUE(e->Release(r->lease_id).ok());
  }
  EXPECT_EQ(e->metric(EngineMetric::kGets), 3u);
  EXPECT_EQ(e->metric(EngineMetric::kHitsDram), 3u);
  EXPECT_EQ(e->metric(EngineMetric::kMisses), 0u);
  for (int i = 100; i < 132; ++i) ASSERT_TRUE(e->Put(KeyOf(i), MakeChunk(i)).ok());
  EXPECT_GT(e->metric(EngineMetric::kEvictions), 0u);
  std::vector<Hash128> keys{KeyOf(1)};
  EXPECT_THAT(e->LookupPrefix(keys), ::testing::ElementsAre(TierKind::kDram));
  EXPECT_EQ(e->GetShared(KeyOf(2)).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(e->metric(EngineMetric::kGets), 4u);
  EXPECT_EQ(e->metric(EngineMetric::kMisses), 1u);
}

// A chunk put and read once through GetShared has two uses: DRAM eviction
// writes it to NVMe (admission after two uses). Read again from NVMe it is
// copied into a scratch slot (and promoted), counted once: one get, one NVMe
// hit.
TEST(PlacementEngine, SharedReadCountsTowardsNvmeAdmissionAndScratchReadsCountOnce) {
  TempDir dir;
  auto e = MakeEngine(dir, {.options = {.eviction = {.all = EvictionPolicyKind::kLru},
                                        .nvme_admit_after_uses = 2,
                                        .maintenance_interval_ms = 0}});
  const auto c = MakeChunk(1);
  ASSERT_TRUE(e->Put(KeyOf(1), c).ok());
  auto r = e->GetShared(KeyOf(1));
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_TRUE(e->Release(r->lease_id).ok());
  for (int i = 100; i < 116; ++i) ASSERT_TRUE(e->Put(KeyOf(i), MakeChunk(i)).ok());
  std::vector<Hash128> keys{KeyOf(1)};
  EXPECT_THAT(e->LookupPrefix(keys), ::testing::ElementsAre(TierKind::kNvme));
  EXPECT_GT(e->metric(EngineMetric::kAdmissionRejects), 0u);
  EXPECT_EQ(e->metric(EngineMetric::kGets), 1u);
  r = e->GetShared(KeyOf(1));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->tier, TierKind::kNvme);
  EXPECT_EQ(r->lease_id, 0u);
  EXPECT_NE(r->slot_id, 0u);
  ASSERT_EQ(r->extent.length, c.size());
  EXPECT_EQ(std::memcmp(e->dram()->base() + r->extent.offset, c.data(), c.size()), 0);
  ASSERT_TRUE(e->AbortSlot(r->slot_id).ok());
  EXPECT_EQ(e->metric(EngineMetric::kGets), 2u);
  EXPECT_EQ(e->metric(EngineMetric::kHitsNvme), 1u);
  EXPECT_EQ(e->metric(EngineMetric::kHitsDram), 1u);
  EXPECT_EQ(e->metric(EngineMetric::kPromotions), 1u);
}

// Every accepted put counts once: a new key, a key already stored (which is
// not rewritten), through Put or a slot, durable or not. Refused puts and
// slots do not count.
TEST(PlacementEngine, PutsCounterCountsEveryAcceptedPut) {
  TempDir dir;
  auto e = MakeEngine(dir, {});
  auto c = MakeChunk(1);
  auto puts = [&] { return e->metric(EngineMetric::kPuts); };
  auto commit = [&](const Hash128& key, std::span<const uint8_t> bytes, PutOptions o = {}) {
    auto slot = e->AllocateSlot(bytes.size());
    EXPECT_TRUE(slot.ok()) << slot.status();
    if (!slot.ok()) return slot.status();
    std::memcpy(e->dram()->base() + slot->extent.offset, bytes.data(), bytes.size());
    return e->CommitSlot(slot->id, key, o);
  };
  ASSERT_TRUE(e->Put(KeyOf(1), c).ok());
  EXPECT_EQ(puts(), 1u);
  ASSERT_TRUE(e->Put(KeyOf(1), c).ok());
  EXPECT_EQ(puts(), 2u);
  ASSERT_TRUE(commit(KeyOf(1), c).ok());
  EXPECT_EQ(puts(), 3u);
  ASSERT_TRUE(commit(KeyOf(1), c, {.durable = true}).ok());
  EXPECT_EQ(puts(), 4u);
  ASSERT_TRUE(commit(KeyOf(2), MakeChunk(2)).ok());
  EXPECT_EQ(puts(), 5u);
  ASSERT_TRUE(e->Put(KeyOf(3), MakeChunk(3), {.durable = true}).ok());
  EXPECT_EQ(puts(), 6u);
  std::vector<uint8_t> garbage(c.size(), 7);
  EXPECT_EQ(e->Put(KeyOf(4), garbage).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(commit(KeyOf(4), garbage).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(e->CommitSlot(12345, KeyOf(4)).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(puts(), 6u);
}

// Lease and slot ids cannot be derived from one another: distinct, never 0,
// not consecutive, spread over 64 bits.
TEST(PlacementEngine, LeaseAndSlotIdsAreUnpredictable) {
  TempDir dir;
  auto e = MakeEngine(dir, {});
  ASSERT_TRUE(e->Put(KeyOf(1), MakeChunk(1)).ok());
  const std::vector<Hash128> keys{KeyOf(1)};
  std::vector<uint64_t> ids;
  for (int i = 0; i < 500; ++i) {
    auto lease = e->Pin(keys);
    ASSERT_TRUE(lease.ok()) << lease.status();
    ids.push_back(lease->id);
    auto slot = e->AllocateSlot(4096);
    ASSERT_TRUE(slot.ok()) << slot.status();
    ids.push_back(slot->id);
    ASSERT_TRUE(e->AbortSlot(slot->id).ok());
  }
  absl::flat_hash_set<uint64_t> distinct(ids.begin(), ids.end());
  EXPECT_EQ(distinct.size(), ids.size());
  EXPECT_FALSE(distinct.contains(0));
  int consecutive = 0, high = 0;
  for (size_t i = 0; i + 1 < ids.size(); ++i) consecutive += ids[i + 1] - ids[i] <= 16;
  for (uint64_t id : ids) high += id >> 48 != 0;
  EXPECT_EQ(consecutive, 0);
  EXPECT_GT(high, 900);  // uniform: about 1000 of 1000
  for (size_t i = 0; i < ids.size(); i += 2) EXPECT_TRUE(e->Release(ids[i]).ok());
}

TEST(EvictionPolicy, S3FifoKeepsHotSetThroughScanWhereLruLosesIt) {
  // 10 hot objects re-read between scans of one-hit objects; capacity 20.
  auto run = [](EvictionPolicyKind kind) {
    auto p = NewEvictionPolicy(kind, 20);
    std::set<int> resident;
    int hits = 0, next_cold = 1000;
    auto access = [&](int i) {
      ObjectKey id{KeyOf(i), Part::kWhole};
      if (resident.contains(i)) {
        ++hits;
        p->OnAccess(id);
        return;
      }
      while (resident.size() >= 20) {
        auto v = p->PickVictim([](const ObjectKey&) { return true; });
        EXPECT_TRUE(v.has_value());
        for (int r : resident) {
          if (KeyOf(r) == v->key) {
            resident.erase(r);
            break;
          }
        }
        p->OnErase(*v);
      }
      p->OnInsert(id, 1);
      resident.insert(i);
    };
    for (int round = 0; round < 50; ++round) {
      for (int h = 0; h < 10; ++h) access(h);
      for (int s = 0; s < 15; ++s) access(next_cold++);
    }
    return hits;
  };
  int lru = run(EvictionPolicyKind::kLru), s3 = run(EvictionPolicyKind::kS3Fifo);
  EXPECT_GT(s3, lru);
  EXPECT_GT(s3, 400);  // the hot set survives nearly every round
}

TEST(EvictionPolicy, ReusedObjectsSurviveALongScanUnderS3FifoAndArcNotLru) {
  // Capacity 20: 8 objects used twice, then a scan of 100 one-hit objects,
  // then the 8 again. (ARC, unlike S3-FIFO, keeps no ghosts of a recency
  // list that fills the whole capacity, so the reuse must happen in cache.)
  auto hot_hits_after_scan = [](EvictionPolicyKind kind) {
    auto p = NewEvictionPolicy(kind, 20);
    absl::flat_hash_set<ObjectKey> resident;
    auto access = [&](int i) {
      ObjectKey id{KeyOf(i), Part::kWhole};
      if (resident.contains(id)) {
        p->OnAccess(id);
        return true;
      }
      while (resident.size() >= 20) {
        auto v = p->PickVictim([](const ObjectKey&) { return true; });
        resident.erase(*v);
        p->OnErase(*v);
      }
      p->OnInsert(id, 1);
      resident.insert(id);
      return false;
    };
    for (int i = 0; i < 8; ++i) access(i);
    for (int i = 0; i < 8; ++i) access(i);
    for (int i = 1000; i < 1100; ++i) access(i);
    int hits = 0;
    for (int i = 0; i < 8; ++i) hits += access(i);
    return hits;
  };
  EXPECT_EQ(hot_hits_after_scan(EvictionPolicyKind::kLru), 0);
  EXPECT_EQ(hot_hits_after_scan(EvictionPolicyKind::kS3Fifo), 8);
  EXPECT_EQ(hot_hits_after_scan(EvictionPolicyKind::kArc), 8);
}

TEST(EvictionPolicy, S3FifoSmallQueueFractionSetsHowLongANewObjectWaitsForReuse) {
  // Capacity 100 unit objects; object 0 is inserted, then `gap` new objects,
  // then object 0 is accessed. It must still be resident when the gap fits
  // in the small queue (fraction * capacity), and gone (a ghost) when not.
  auto resident_after = [](double fraction, int gap) {
    auto p = NewEvictionPolicy(EvictionPolicyKind::kS3Fifo, 100, {.s3fifo_small_fraction = fraction});
    // Fill main with 100 reused objects so new ones go through the small queue.
    absl::flat_hash_set<ObjectKey> resident;
    auto insert = [&](int i) {
      ObjectKey id{KeyOf(i), Part::kWhole};
      while (resident.size() >= 100) {
        auto v = p->PickVictim([](const ObjectKey&) { return true; });
        resident.erase(*v);
        p->OnErase(*v);
      }
      p->OnInsert(id, 1);
      resident.insert(id);
    };
    for (int i = 1000; i < 1100; ++i) {
      insert(i);
      p->OnAccess({KeyOf(i), Part::kWhole});
    }
    insert(0);
    for (int i = 0; i < gap; ++i) insert(2000 + i);
    bool in = resident.contains({KeyOf(0), Part::kWhole});
    EXPECT_EQ(p->IsGhost({KeyOf(0), Part::kWhole}), !in);
    return in;
  };
  EXPECT_TRUE(resident_after(0.3, 25));
  EXPECT_FALSE(resident_after(0.1, 25));
  EXPECT_FALSE(resident_after(0.3, 40));
}

// A cache of `capacity` unit objects run by `policy`: Access returns
// whether `i` was resident, and stores it otherwise.
class UnitCache {
 public:
  UnitCache(std::unique_ptr<EvictionPolicy> policy, size_t capacity)
      : p_(std::move(policy)), capacity_(capacity) {}
  bool Access(int i) {
    ObjectKey id{KeyOf(i), Part::kWhole};
    if (resident_.contains(id)) {
      p_->OnAccess(id);
      return true;
    }
    while (resident_.size() >= capacity_) {
      auto v = p_->PickVictim([](const ObjectKey&) { return true; });
      resident_.erase(*v);
      p_->OnErase(*v);
    }
    p_->OnInsert(id, 1);
    resident_.insert(id);
    return false;
  }

 private:
  std::unique_ptr<EvictionPolicy> p_;
  size_t capacity_;
  absl::flat_hash_set<ObjectKey> resident_;
};

TEST(EvictionPolicy, FreqLruKeepsAReusedObjectOverNewerOnesReadOnce) {
  // Capacity 4: objects 1-3 are used once, object 0 twice, then 4-7 once
  // each. LRU evicts 0 with the fourth of them; FLRU with a bonus of one
  // tier's worth of uses (4) per extra use evicts 1-4 instead.
  auto survives = [](double bonus) {
    UnitCache c(NewEvictionPolicy(EvictionPolicyKind::kFreqLru, 4, {.flru_bonus = bonus}), 4);
    for (int i : {1, 2, 3, 0, 0, 4, 5, 6, 7}) c.Access(i);
    return c.Access(0);
  };
  EXPECT_TRUE(survives(1.0));
  EXPECT_FALSE(survives(0.0));  // a bonus of 0 is LRU
}

TEST(EvictionPolicy, FreqLruLearnsToKeepAHotSetThroughAScan) {
  // 2,000 hot objects, each used once per round between 4,000 objects used
  // once, in a cache of 3,200: LRU never hits (every reuse distance is 6,000
  // objects); FLRU starts as LRU, its miniature caches find that a bonus
  // keeps the hot set, and most of the hot uses of later rounds hit.
  auto hot_hit_ratio = [](EvictionPolicyKind kind) {
    UnitCache c(NewEvictionPolicy(kind, 3200), 3200);
    int hits = 0, uses = 0, next_scan = 1'000'000;
    for (int round = 0; round < 12; ++round) {
      for (int h = 0; h < 2000; ++h) {
        const bool hit = c.Access(h);
        if (round >= 8) {
          hits += hit;
          ++uses;
        }
        c.Access(next_scan++);
        c.Access(next_scan++);
      }
    }
    return double(hits) / uses;
  };
  EXPECT_EQ(hot_hit_ratio(EvictionPolicyKind::kLru), 0.0);
  EXPECT_GT(hot_hit_ratio(EvictionPolicyKind::kFreqLru), 0.5);
}

TEST(EvictionPolicy, FreqLruStaysLruWhenRecencyIsEnough) {
  // A loop over 100 objects in a cache of 150: every use after the first
  // round hits under LRU, and FLRU must not lose any of them.
  UnitCache c(NewEvictionPolicy(EvictionPolicyKind::kFreqLru, 150), 150);
  int misses = 0;
  for (int round = 0; round < 200; ++round) {
    for (int i = 0; i < 100; ++i) misses += !c.Access(i);
  }
  EXPECT_EQ(misses, 100);
}

TEST(EvictionPolicy, ParseNamesEveryKind) {
  for (auto kind : {EvictionPolicyKind::kLru, EvictionPolicyKind::kS3Fifo, EvictionPolicyKind::kArc,
                    EvictionPolicyKind::kFreqLru}) {
    EXPECT_EQ(ParseEvictionPolicy(EvictionPolicyName(kind)).value(), kind);
  }
  absl::Status st = ParseEvictionPolicy("lfu").status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(st.message()), ::testing::HasSubstr("flru"));
}

TEST(EvictionPolicy, PickVictimReturnsNulloptWhenEverythingIsPinned) {
  for (auto kind : {EvictionPolicyKind::kLru, EvictionPolicyKind::kS3Fifo, EvictionPolicyKind::kArc,
                    EvictionPolicyKind::kFreqLru}) {
    auto p = NewEvictionPolicy(kind, 100);
    for (int i = 0; i < 10; ++i) p->OnInsert({KeyOf(i), Part::kWhole}, 10);
    p->OnAccess({KeyOf(3), Part::kWhole});
    EXPECT_FALSE(p->PickVictim([](const ObjectKey&) { return false; }).has_value());
    auto v = p->PickVictim([](const ObjectKey& id) { return id.key == KeyOf(7); });
    ASSERT_TRUE(v.has_value());
    EXPECT_EQ(v->key, KeyOf(7));
  }
}

TEST(EngineMetric, NamesMatchEnum) {
  std::set<std::string> names;
  for (int i = 0; i < static_cast<int>(EngineMetric::kCount); ++i) {
    std::string n = EngineMetricName(static_cast<EngineMetric>(i));
    EXPECT_NE(n, "unknown");
    names.insert(n);
  }
  EXPECT_EQ(names.size(), static_cast<size_t>(EngineMetric::kCount));
  EXPECT_STREQ(EngineMetricName(EngineMetric::kHitsNvme), "hits_nvme");
}

}  // namespace
}  // namespace kvtier::tiering
