// Placement engine: holds (Hold, GetShared, GetSharedBatch) and the
// held-bytes limit that bounds them.
#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

#include "common/testing/temp_dir.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tiering/placement_engine.h"
#include "tiering/test_util.h"

namespace kvtier::tiering {
namespace {

using ::kvtier::testing::TempDir;
using ::kvtier::tiering::testing::FlipByteOnNvme;
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
  ASSERT_TRUE(FlipByteOnNvme(*e->nvme(), {KeyOf(1), Part::kWhole}, 200).ok());
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

// The NVMe data file cut short at the last chunk of a batch: that chunk is
// DataLoss and dropped; the others are served from the same batch and kept.
TEST(PlacementEngineHolds, TruncatedNvmeFileFailsOnlyTheCutChunkOfABatch) {
  TempDir dir;
  auto e = MakeEngine(dir, {.promote_on_hit = false});
  for (uint64_t i = 1; i <= 3; ++i) {
    ASSERT_TRUE(e->Put(KeyOf(i), MakeChunk(i), {.tier = TierKind::kNvme}).ok());
  }
  uint64_t last = 1;
  for (uint64_t i = 2; i <= 3; ++i) {
    if (e->nvme()->OffsetOf({KeyOf(i), Part::kWhole}).value() >
        e->nvme()->OffsetOf({KeyOf(last), Part::kWhole}).value()) {
      last = i;
    }
  }
  const uint64_t cut = e->nvme()->OffsetOf({KeyOf(last), Part::kWhole}).value() + 100;
  ASSERT_EQ(::truncate(e->nvme()->data_path().c_str(), static_cast<off_t>(cut)), 0);
  std::vector<Hash128> keys = {KeyOf(1), KeyOf(2), KeyOf(3)};
  auto got = e->GetSharedBatch(keys);
  ASSERT_EQ(got.size(), 3u);
  for (uint64_t i = 1; i <= 3; ++i) {
    if (i == last) {
      EXPECT_EQ(got[i - 1].status().code(), absl::StatusCode::kDataLoss) << got[i - 1].status();
      EXPECT_FALSE(e->Contains(KeyOf(i)));
      continue;
    }
    ASSERT_TRUE(got[i - 1].ok()) << i << ": " << got[i - 1].status();
    const auto want = MakeChunk(i);
    EXPECT_TRUE(std::equal(want.begin(), want.end(), got[i - 1]->bytes.begin(), got[i - 1]->bytes.end()));
    EXPECT_TRUE(e->Contains(KeyOf(i)));
    ASSERT_TRUE(e->AbortSlot(got[i - 1]->slot_id).ok());
  }
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

// Every lease and slot is its holder's: another holder's Release, Renew,
// AbortSlot, SlotView or CommitSlot of its id is NotFound and changes nothing.
TEST(PlacementEngineHolds, LeasesAndSlotsBelongToTheirHolder) {
  TempDir dir;
  auto e = MakeEngine(dir, {});
  ASSERT_TRUE(e->Put(KeyOf(1), MakeChunk(1)).ok());
  ASSERT_TRUE(e->Put(KeyOf(2), MakeChunk(2), {.tier = TierKind::kNvme}).ok());
  GetOptions a;
  a.holder = Holder{1, 0};
  const HolderId b = 2;
  auto in_place = e->GetShared(KeyOf(1), 0, a);
  auto scratch = e->GetShared(KeyOf(2), 0, a);
  ASSERT_TRUE(in_place.ok() && scratch.ok());
  ASSERT_NE(in_place->lease_id, 0u);
  ASSERT_NE(scratch->slot_id, 0u);
  auto slot = e->AllocateSlot(MakeChunk(3).size(), 0, 0, a.holder.id);
  ASSERT_TRUE(slot.ok()) << slot.status();
  const std::vector<Hash128> one = {KeyOf(1)};
  auto pin = e->Pin(one, 0, true, a.holder);
  ASSERT_TRUE(pin.ok()) << pin.status();
  for (HolderId other : {b, kEngineHolder}) {
    EXPECT_EQ(e->Release(in_place->lease_id, other).code(), absl::StatusCode::kNotFound);
    EXPECT_EQ(e->Release(pin->id, other).code(), absl::StatusCode::kNotFound);
    EXPECT_EQ(e->Renew(pin->id, 0, other).status().code(), absl::StatusCode::kNotFound);
    EXPECT_EQ(e->AbortSlot(scratch->slot_id, other).code(), absl::StatusCode::kNotFound);
    EXPECT_EQ(e->AbortSlot(slot->id, other).code(), absl::StatusCode::kNotFound);
    EXPECT_EQ(e->SlotView(slot->id, other).status().code(), absl::StatusCode::kNotFound);
    std::memcpy(e->dram()->base() + slot->extent.offset, MakeChunk(3).data(), MakeChunk(3).size());
    EXPECT_EQ(e->CommitSlot(slot->id, KeyOf(3), {.holder = other}).code(),
              absl::StatusCode::kNotFound);
  }
  // Nothing ended: the chunk is still pinned, the copies still held.
  EXPECT_EQ(e->Delete(KeyOf(1)).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(e->held_bytes(), 3 * MakeChunk(1).size());
  EXPECT_TRUE(e->Renew(pin->id, 0, a.holder.id).ok());
  EXPECT_TRUE(e->Release(pin->id, a.holder.id).ok());
  EXPECT_TRUE(e->Release(in_place->lease_id, a.holder.id).ok());
  EXPECT_TRUE(e->AbortSlot(scratch->slot_id, a.holder.id).ok());
  EXPECT_TRUE(e->SlotView(slot->id, a.holder.id).ok());
  EXPECT_TRUE(e->CommitSlot(slot->id, KeyOf(3), {.holder = a.holder.id}).ok());
  EXPECT_EQ(e->held_bytes(), 0u);
  EXPECT_TRUE(e->Delete(KeyOf(1)).ok());
}

// One holder's leases and slots, the keys they pin and the bytes they hold
// are capped (the others keep theirs), and all of them expire on their own.
TEST(PlacementEngineHolds, EachHolderIsCappedAndIdleHoldsExpire) {
  TempDir dir;
  const uint64_t chunk = MakeChunk(1).size();
  FakeClock clock;
  PlacementEngineOptions o{.clock = &clock};
  o.max_holds_per_holder = 40;
  o.max_held_bytes_per_holder = 20 * chunk;
  auto e = MakeEngine(dir, o);
  std::vector<Hash128> keys;
  for (uint64_t i = 1; i <= 30; ++i) {
    ASSERT_TRUE(e->Put(KeyOf(i), MakeChunk(i)).ok());
    keys.push_back(KeyOf(i));
  }
  const Holder a{1, 0}, b{2, 0}, c{3, 0};
  GetOptions as_a;
  as_a.holder = a;
  // Bytes: 20 chunks held in place, then the 21st is refused.
  for (int i = 0; i < 20; ++i) ASSERT_TRUE(e->GetShared(keys[i], 0, as_a).ok()) << i;
  auto over = e->GetShared(keys[20], 0, as_a);
  EXPECT_EQ(over.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(over.status().message(), ::testing::HasSubstr("holder's share"));
  // Count: empty slots hold no bytes; 20 more reach the 40 holds.
  for (int i = 0; i < 20; ++i) ASSERT_TRUE(e->AllocateSlot(chunk, 0, 0, a.id).ok()) << i;
  EXPECT_EQ(e->AllocateSlot(chunk, 0, 0, a.id).status().code(), absl::StatusCode::kResourceExhausted);
  // C pins 10 keys: its own share.
  auto first = e->Pin(std::span<const Hash128>(keys).first(10), 0, true, c);
  ASSERT_TRUE(first.ok()) << first.status();
  // Another holder is not limited by A's use.
  GetOptions as_b;
  as_b.holder = b;
  auto r = e->GetShared(keys[25], 0, as_b);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(e->metric(EngineMetric::kHoldsRefused), 2u);
  // Nobody releases anything: the maintenance pass ends them at expiry.
  EXPECT_GT(e->held_bytes(), 0u);
  clock.AdvanceMicros(31'000'000);  // past the default lease
  e->RunMaintenance();
  EXPECT_EQ(e->held_bytes(), 0u);
  EXPECT_EQ(e->metric(EngineMetric::kLeasesExpired), 22u);
  EXPECT_EQ(e->metric(EngineMetric::kSlotsExpired), 20u);
  EXPECT_TRUE(e->Delete(keys[0]).ok());
  for (int i = 0; i < 20; ++i) EXPECT_TRUE(e->AllocateSlot(chunk, 0, 0, a.id).ok()) << i;
}

// The keys that one holder's leases pin are capped (a Pin of many keys
// holds little memory in the tier but much in the lease table).
TEST(PlacementEngineHolds, KeysPinnedByOneHolderAreCapped) {
  TempDir dir;
  PlacementEngineOptions o;
  o.max_held_keys_per_holder = 15;
  auto e = MakeEngine(dir, o);
  std::vector<Hash128> keys;
  for (uint64_t i = 1; i <= 10; ++i) {
    ASSERT_TRUE(e->Put(KeyOf(i), MakeChunk(i)).ok());
    keys.push_back(KeyOf(i));
  }
  const Holder c{3, 0};
  ASSERT_TRUE(e->Pin(keys, 0, true, c).ok());
  auto more = e->Pin(std::span<const Hash128>(keys).first(6), 0, true, c);
  EXPECT_EQ(more.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(more.status().message(), ::testing::HasSubstr("pinned keys"));
  EXPECT_TRUE(e->Pin(std::span<const Hash128>(keys).first(5), 0, true, c).ok());
  EXPECT_TRUE(e->Pin(keys, 0, true, Holder{4, 0}).ok());  // another holder
  EXPECT_EQ(e->metric(EngineMetric::kHoldsRefused), 1u);
}

}  // namespace
}  // namespace kvtier::tiering
