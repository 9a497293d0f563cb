// Placement engine: the engine as the one table of slots (SlotView and its
// expiry margin, client vs scratch slots, ForgetEnded) and commits of a
// codec::VerifiedChunk.
#include <cstring>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "codec/codec.h"
#include "common/hash.h"
#include "gtest/gtest.h"
#include "tiering/placement_engine.h"

namespace kvtier::tiering {
namespace {

std::vector<uint8_t> Chunk(uint16_t value) {
  codec::ChunkSpec spec;
  spec.fingerprint = Hash128::Of("slots-test-model", 3);
  spec.geometry = codec::Geometry{2, 2, 64, 16, 16};
  const size_t n = size_t{2} * 16 * 2 * 64;
  std::vector<uint16_t> k(n, value), v(n, value);  // bf16: finite for the values used
  return codec::EncodeChunk(spec, {k, v}).value();
}

// The chunk in `bytes`, verified as the daemon verifies (both sections).
absl::StatusOr<codec::VerifiedChunk> Verify(std::span<const uint8_t> bytes) {
  auto h = codec::ParseHeader(bytes);
  if (!h.ok()) return h.status();
  if (bytes.size() != h->layout.total_bytes) return absl::DataLossError("length");
  absl::Status sections = codec::VerifySection(
      *h, codec::Section::kK, bytes.subspan(h->layout.k_offset, h->layout.k.bytes));
  if (sections.ok()) {
    sections = codec::VerifySection(*h, codec::Section::kV,
                                    bytes.subspan(h->layout.v_offset, h->layout.v.bytes));
  }
  return codec::AcceptChunk(*h, bytes, sections);
}

struct Engine {
  FakeClock clock;
  std::unique_ptr<PlacementEngine> e;

  explicit Engine(uint64_t hbm_bytes = 0) {
    EngineTiers tiers;
    tiers.dram = DramTier::Open({.capacity_bytes = 1 << 20, .populate = false}).value();
    if (hbm_bytes > 0) {
      tiers.hbm =
          HbmTier::Open({.capacity_bytes = hbm_bytes}, NewFakeDeviceAllocator(hbm_bytes)).value();
    }
    e = PlacementEngine::Create({.maintenance_interval_ms = 0, .clock = &clock}, std::move(tiers))
            .value();
  }
};

TEST(PlacementEngineSlots, SlotViewIsTheSlotsExtentInThePool) {
  Engine t;
  auto slot = t.e->AllocateSlot(5000, /*ttl_ms=*/1000);
  ASSERT_TRUE(slot.ok()) << slot.status();
  auto view = t.e->SlotView(slot->id);
  ASSERT_TRUE(view.ok()) << view.status();
  EXPECT_EQ(view->extent.offset, slot->extent.offset);
  EXPECT_EQ(view->extent.length, slot->extent.length);
  EXPECT_EQ(view->bytes.data(), t.e->dram()->base() + slot->extent.offset);
  EXPECT_EQ(view->bytes.size(), slot->extent.length);
}

TEST(PlacementEngineSlots, SlotAboutToExpireHasNoView) {
  Engine t;
  auto slot = t.e->AllocateSlot(5000, /*ttl_ms=*/1000);
  ASSERT_TRUE(slot.ok());
  t.clock.AdvanceMicros(1'000'000 - kSlotViewMarginUs + 1);
  EXPECT_EQ(t.e->SlotView(slot->id).status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(t.e->SlotView(slot->id, kEngineHolder, /*margin_us=*/0).ok());
  EXPECT_EQ(t.e->SlotView(424242).status().code(), absl::StatusCode::kNotFound);
}

TEST(PlacementEngineSlots, CommitOfVerifiedChunkStoresTheSlot) {
  Engine t;
  const auto chunk = Chunk(0x3f80);
  auto slot = t.e->AllocateSlot(chunk.size());
  ASSERT_TRUE(slot.ok());
  auto view = t.e->SlotView(slot->id);
  ASSERT_TRUE(view.ok());
  std::memcpy(view->bytes.data(), chunk.data(), chunk.size());
  auto verified = Verify(view->bytes);
  ASSERT_TRUE(verified.ok()) << verified.status();
  const Hash128 key = Hash128::Of("k1", 1);
  ASSERT_TRUE(t.e->CommitSlot(slot->id, *verified, key).ok());
  std::vector<uint8_t> out(chunk.size());
  ASSERT_TRUE(t.e->Get(key, out).ok());
  EXPECT_EQ(out, chunk);
  EXPECT_EQ(t.e->SlotView(slot->id).status().code(), absl::StatusCode::kNotFound);
}

TEST(PlacementEngineSlots, CommitOfOtherBytesIsInvalidArgumentAndFreesTheSlot) {
  Engine t;
  const auto chunk = Chunk(0x3f80);
  auto verified = Verify(chunk);  // verified, but not the slot's bytes
  ASSERT_TRUE(verified.ok());
  auto slot = t.e->AllocateSlot(chunk.size());
  ASSERT_TRUE(slot.ok());
  EXPECT_EQ(t.e->CommitSlot(slot->id, *verified, Hash128::Of("k2", 1)).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(t.e->AbortSlot(slot->id).code(), absl::StatusCode::kNotFound);
  EXPECT_FALSE(t.e->Contains(Hash128::Of("k2", 1)));
}

TEST(PlacementEngineSlots, ScratchSlotIsReadOnly) {
  Engine t(/*hbm_bytes=*/1 << 20);
  const auto chunk = Chunk(0x4000);
  const Hash128 key = Hash128::Of("hbm", 1);
  ASSERT_TRUE(t.e->Put(key, chunk, {.tier = TierKind::kHbm}).ok());
  auto r = t.e->GetShared(key);  // not whole in DRAM: a scratch copy
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_NE(r->slot_id, 0u);
  EXPECT_EQ(std::vector<uint8_t>(r->bytes.begin(), r->bytes.end()), chunk);
  EXPECT_EQ(t.e->SlotView(r->slot_id).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(t.e->CommitSlot(r->slot_id, Hash128::Of("other", 1)).code(),
            absl::StatusCode::kNotFound);
  absl::flat_hash_set<uint64_t> slots = {r->slot_id}, leases;
  t.e->ForgetEnded(slots, leases);
  EXPECT_TRUE(slots.contains(r->slot_id));  // live, though read only
  EXPECT_TRUE(t.e->AbortSlot(r->slot_id).ok());
}

TEST(PlacementEngineSlots, ForgetEndedKeepsOnlyLiveIds) {
  Engine t;
  const auto chunk = Chunk(0x3f80);
  const Hash128 key = Hash128::Of("leased", 1);
  ASSERT_TRUE(t.e->Put(key, chunk).ok());
  auto live = t.e->AllocateSlot(5000, /*ttl_ms=*/10'000);
  auto aborted = t.e->AllocateSlot(5000);
  auto short_lived = t.e->AllocateSlot(5000, /*ttl_ms=*/1);
  auto lease = t.e->Pin({&key, 1}, /*ttl_ms=*/10'000);
  auto released = t.e->Pin({&key, 1});
  ASSERT_TRUE(live.ok() && aborted.ok() && short_lived.ok() && lease.ok() && released.ok());
  ASSERT_TRUE(t.e->AbortSlot(aborted->id).ok());
  ASSERT_TRUE(t.e->Release(released->id).ok());
  t.clock.AdvanceMicros(2'000);
  absl::flat_hash_set<uint64_t> slots = {live->id, aborted->id, short_lived->id, 77};
  absl::flat_hash_set<uint64_t> leases = {lease->id, released->id, 78};
  t.e->ForgetEnded(slots, leases);
  EXPECT_EQ(slots, absl::flat_hash_set<uint64_t>{live->id});
  EXPECT_EQ(leases, absl::flat_hash_set<uint64_t>{lease->id});
}

}  // namespace
}  // namespace kvtier::tiering
