// Placement engine: holds (Hold, GetShared, GetSharedBatch) and the
// held-bytes limit that bounds them.
#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <thread>
#include <vector>

#include "common/testing/temp_dir.h"
#include "gtest/gtest.h"
#include "tiering/placement_engine.h"
#include "tiering/test_util.h"

namespace kvtier::tiering {
namespace {

using ::kvtier::testing::TempDir;
using ::kvtier::tiering::testing::KeyOf;
using ::kvtier::tiering::testing::MakeChunk;

std::unique_ptr<PlacementEngine> MakeEngine(const TempDir& dir, PlacementEngineOptions o) {
  o.maintenance_interval_ms = 0;
  EngineTiers tiers;
  tiers.dram = DramTier::Open({.capacity_bytes = 1 << 20, .populate = false}).value();
  tiers.nvme = NvmeTier::Open({.dir = dir.path(), .capacity_bytes = 4 << 20}).value();
  auto e = PlacementEngine::Create(o, std::move(tiers));
  EXPECT_TRUE(e.ok()) << e.status();
  return std::move(*e);
}

TEST(PlacementEngineHolds, BatchServesDramInPlaceNvmeThroughScratchAndNamesMisses) {
  TempDir dir;
  auto e = MakeEngine(dir, {});
  ASSERT_TRUE(e->Put(KeyOf(1), MakeChunk(1)).ok());
  ASSERT_TRUE(e->Put(KeyOf(2), MakeChunk(2), {.tier = TierKind::kNvme}).ok());
  ASSERT_TRUE(e->Put(KeyOf(3), MakeChunk(3), {.tier = TierKind::kNvme}).ok());
  std::vector<Hash128> keys = {KeyOf(1), KeyOf(9), KeyOf(2), KeyOf(3)};
  auto got = e->GetSharedBatch(keys);
  ASSERT_EQ(got.size(), 4u);
  EXPECT_EQ(got[1].status().code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(got[0].ok()) << got[0].status();
  EXPECT_EQ(got[0]->tier, TierKind::kDram);
  EXPECT_NE(got[0]->lease_id, 0u);
  for (size_t i : {size_t{2}, size_t{3}}) {
    ASSERT_TRUE(got[i].ok()) << got[i].status();
    EXPECT_EQ(got[i]->tier, TierKind::kNvme);
    EXPECT_NE(got[i]->slot_id, 0u);
    EXPECT_TRUE(got[i]->verified);
    const auto want = MakeChunk(i);
    EXPECT_TRUE(std::equal(want.begin(), want.end(), got[i]->bytes.begin(), got[i]->bytes.end()));
  }
  EXPECT_EQ(e->metric(EngineMetric::kHitsNvme), 2u);
  EXPECT_EQ(e->metric(EngineMetric::kMisses), 1u);
  EXPECT_EQ(e->held_bytes(), 3 * got[0]->chunk_bytes);  // the pin, two scratch slots
  // A scratch slot written through the (writable) pool is not promoted.
  const_cast<uint8_t*>(got[3]->bytes.data())[got[3]->bytes.size() - 5] ^= 1;
  ASSERT_TRUE(e->Release(got[0]->lease_id).ok());
  ASSERT_TRUE(e->AbortSlot(got[2]->slot_id).ok());
  ASSERT_TRUE(e->AbortSlot(got[3]->slot_id).ok());
  EXPECT_EQ(e->held_bytes(), 0u);
  // Promotion (promote_on_hit) makes the freed scratch slot the DRAM copy,
  // on the background thread.
  std::vector<Hash128> nvme_keys = {KeyOf(2), KeyOf(3)};
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (e->metric(EngineMetric::kPromotions) < 1 && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(50));  // the second is not promoted
  EXPECT_EQ(e->metric(EngineMetric::kPromotions), 1u);
  auto tiers = e->LookupPrefix(nvme_keys);
  ASSERT_EQ(tiers.size(), 2u);
  EXPECT_EQ(tiers[0], TierKind::kDram);
  EXPECT_EQ(tiers[1], TierKind::kNvme);
  std::vector<uint8_t> out(MakeChunk(2).size());
  auto t = e->Get(KeyOf(2), out);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(*t, TierKind::kDram);
  EXPECT_EQ(out, MakeChunk(2));
}

TEST(PlacementEngineHolds, CorruptNvmeChunkInABatchIsDataLossAndTheRestAreServed) {
  TempDir dir;
  auto e = MakeEngine(dir, {.promote_on_hit = false});
  ASSERT_TRUE(e->Put(KeyOf(1), MakeChunk(1), {.tier = TierKind::kNvme}).ok());
  ASSERT_TRUE(e->Put(KeyOf(2), MakeChunk(2), {.tier = TierKind::kNvme}).ok());
  const uint64_t off = e->nvme()->OffsetOf({KeyOf(1), Part::kWhole}).value();
  int fd = open(e->nvme()->data_path().c_str(), O_RDWR);
  ASSERT_GE(fd, 0);
  uint8_t b;
  ASSERT_EQ(pread(fd, &b, 1, off + 200), 1);
  b ^= 1;
  ASSERT_EQ(pwrite(fd, &b, 1, off + 200), 1);
  close(fd);
  std::vector<Hash128> keys = {KeyOf(1), KeyOf(2)};
  auto got = e->GetSharedBatch(keys);
  ASSERT_EQ(got.size(), 2u);
  EXPECT_EQ(got[0].status().code(), absl::StatusCode::kDataLoss);
  EXPECT_FALSE(e->Contains(KeyOf(1)));
  ASSERT_TRUE(got[1].ok()) << got[1].status();
  const auto want = MakeChunk(2);
  EXPECT_TRUE(std::equal(want.begin(), want.end(), got[1]->bytes.begin(), got[1]->bytes.end()));
  ASSERT_TRUE(e->AbortSlot(got[1]->slot_id).ok());
  EXPECT_EQ(e->held_bytes(), 0u);
}

TEST(PlacementEngineHolds, HeldBytesAreCappedAcrossHoldsPinsAndScratchSlots) {
  TempDir dir;
  const uint64_t chunk = MakeChunk(1).size();
  FakeClock clock;
  auto e = MakeEngine(dir, {.clock = &clock, .max_held_bytes = 2 * chunk + chunk / 2});
  for (uint64_t i = 1; i <= 3; ++i) ASSERT_TRUE(e->Put(KeyOf(i), MakeChunk(i)).ok());
  ASSERT_TRUE(e->Put(KeyOf(4), MakeChunk(4), {.tier = TierKind::kNvme}).ok());
  std::vector<Hash128> three = {KeyOf(1), KeyOf(2), KeyOf(3)};
  EXPECT_EQ(e->Hold(three).status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(e->held_bytes(), 0u);  // nothing held
  auto two = e->Hold(std::span<const Hash128>(three).first(2), /*ttl_ms=*/100);
  ASSERT_TRUE(two.ok()) << two.status();
  EXPECT_EQ(e->held_bytes(), 2 * chunk);
  EXPECT_EQ(e->GetShared(KeyOf(3)).status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(e->GetShared(KeyOf(4)).status().code(), absl::StatusCode::kResourceExhausted);  // scratch
  EXPECT_EQ(e->metric(EngineMetric::kHoldsRefused), 3u);
  // A hold pins: the chunks cannot be deleted until it ends.
  EXPECT_EQ(e->Delete(KeyOf(1)).code(), absl::StatusCode::kFailedPrecondition);
  // Expiry gives the bytes back and is counted.
  clock.AdvanceMicros(200'000);
  EXPECT_EQ(e->held_bytes(), 0u);
  EXPECT_EQ(e->metric(EngineMetric::kLeasesExpired), 1u);
  auto r = e->GetShared(KeyOf(3));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(e->held_bytes(), chunk);
  ASSERT_TRUE(e->Release(r->lease_id).ok());
  EXPECT_TRUE(e->Delete(KeyOf(1)).ok());
  // A missing key holds nothing.
  std::vector<Hash128> missing = {KeyOf(2), KeyOf(99)};
  EXPECT_EQ(e->Hold(missing).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(e->held_bytes(), 0u);
}

}  // namespace
}  // namespace kvtier::tiering
