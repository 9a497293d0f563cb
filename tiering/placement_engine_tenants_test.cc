// Placement engine: per-tenant byte quotas per tier (PlacementEngineOptions::
// tenant_quotas) and their accounting (TenantUsages) under bounded put storms.
#include <atomic>
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

using ::kvtier::tiering::testing::KeyOf;
using ::kvtier::tiering::testing::MakeChunk;
using ::testing::HasSubstr;

constexpr uint64_t kChunkAlloc = 16384;  // MakeChunk(…,16) rounds to 4 pages
constexpr int kDram = static_cast<int>(TierKind::kDram);
constexpr TenantId kA = 1, kB = 2, kFree = 3;  // kFree has no quota
constexpr uint64_t kQuota = 8 * kChunkAlloc;

// DRAM only, 32 chunks: tenants A and B have a quarter each, tenant kFree
// and tenant 0 share the rest.
std::unique_ptr<PlacementEngine> MakeEngine(
    std::vector<std::array<uint64_t, kNumTierKinds>> quotas = {}, uint64_t max_held_bytes = 0) {
  if (quotas.empty()) {
    quotas.resize(4);
    quotas[kA][kDram] = kQuota;
    quotas[kB][kDram] = kQuota;
  }
  EngineTiers tiers;
  tiers.dram = DramTier::Open({.capacity_bytes = 32 * kChunkAlloc, .populate = false}).value();
  PlacementEngineOptions o{.maintenance_interval_ms = 0};
  o.max_held_bytes = max_held_bytes;
  o.tenant_quotas = std::move(quotas);
  auto e = PlacementEngine::Create(o, std::move(tiers));
  EXPECT_TRUE(e.ok()) << e.status();
  return e.ok() ? std::move(*e) : nullptr;
}

absl::Status PutAs(PlacementEngine& e, TenantId t, uint64_t seed) {
  PutOptions po;
  po.tenant = t;
  return e.Put(KeyOf(seed), MakeChunk(seed), po);
}

// A put through a slot: allocate for the tenant, fill in place, commit.
absl::Status PutThroughSlotAs(PlacementEngine& e, TenantId t, uint64_t seed) {
  const std::vector<uint8_t> c = MakeChunk(seed);
  auto slot = e.AllocateSlot(c.size(), 0, t);
  if (!slot.ok()) return slot.status();
  std::memcpy(e.dram()->base() + slot->extent.offset, c.data(), c.size());
  PutOptions po;
  po.tenant = t;
  return e.CommitSlot(slot->id, KeyOf(seed), po);
}

TEST(PlacementEngineTenants, PutStormStaysInsideTheTenantsQuota) {
  auto e = MakeEngine();
  ASSERT_NE(e, nullptr);
  for (uint64_t s = 1000; s < 1006; ++s) ASSERT_TRUE(PutAs(*e, kB, s).ok());
  const uint64_t b_bytes = e->TenantUsages()[kB].bytes[kDram];
  ASSERT_GT(b_bytes, 0u);
  // A storm of A's puts, inline and through slots, ten times its quota.
  for (uint64_t s = 0; s < 100; ++s) {
    absl::Status st = s % 2 == 0 ? PutAs(*e, kA, s) : PutThroughSlotAs(*e, kA, s);
    ASSERT_TRUE(st.ok()) << s << ": " << st;
    ASSERT_LE(e->TenantUsages()[kA].bytes[kDram], kQuota) << "after put " << s;
  }
  for (uint64_t s = 1000; s < 1006; ++s) EXPECT_TRUE(e->Contains(KeyOf(s))) << s;
  const std::vector<TenantUsage> u = e->TenantUsages();
  EXPECT_EQ(u[kB].bytes[kDram], b_bytes);
  EXPECT_EQ(u[kB].evictions, 0u);
  EXPECT_GE(u[kA].evictions, 90u);
  EXPECT_EQ(u[kA].quota_rejections, 0u);
  // The newest of A's chunks are the ones kept.
  EXPECT_TRUE(e->Contains(KeyOf(99)));
  EXPECT_FALSE(e->Contains(KeyOf(0)));
}

TEST(PlacementEngineTenants, ConcurrentStormOvershootsByAtMostTheChunksInFlight) {
  auto e = MakeEngine();
  ASSERT_NE(e, nullptr);
  for (uint64_t s = 1000; s < 1006; ++s) ASSERT_TRUE(PutAs(*e, kB, s).ok());
  constexpr int kThreads = 4;
  const uint64_t chunk = MakeChunk(0).size();
  std::atomic<uint64_t> worst{0};
  std::atomic<int> failed{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (uint64_t i = 0; i < 50; ++i) {
        const uint64_t seed = 10000 + t * 1000 + i;
        if (!(i % 2 == 0 ? PutAs(*e, kA, seed) : PutThroughSlotAs(*e, kA, seed)).ok()) ++failed;
        const uint64_t now = e->TenantUsages()[kA].bytes[kDram];
        uint64_t w = worst.load();
        while (now > w && !worst.compare_exchange_weak(w, now)) {
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(failed.load(), 0);
  // Each put makes room before it stores; puts racing it may each add one
  // chunk beyond that room before the next put of the tenant trims it.
  EXPECT_LE(worst.load(), kQuota + (kThreads - 1) * chunk);
  for (uint64_t s = 1000; s < 1006; ++s) EXPECT_TRUE(e->Contains(KeyOf(s))) << s;
  EXPECT_EQ(e->TenantUsages()[kB].evictions, 0u);
}

TEST(PlacementEngineTenants, TenantWithoutQuotaNeverEvictsGuaranteedShares) {
  auto e = MakeEngine();
  ASSERT_NE(e, nullptr);
  for (uint64_t s = 0; s < 6; ++s) ASSERT_TRUE(PutAs(*e, kA, s).ok());
  for (uint64_t s = 1000; s < 1006; ++s) ASSERT_TRUE(PutAs(*e, kB, s).ok());
  // kFree fills the tier several times over: it may only evict chunks of
  // tenants without a quota (its own).
  for (uint64_t s = 2000; s < 2100; ++s) ASSERT_TRUE(PutAs(*e, kFree, s).ok()) << s;
  for (uint64_t s = 0; s < 6; ++s) EXPECT_TRUE(e->Contains(KeyOf(s))) << s;
  for (uint64_t s = 1000; s < 1006; ++s) EXPECT_TRUE(e->Contains(KeyOf(s))) << s;
  const std::vector<TenantUsage> u = e->TenantUsages();
  EXPECT_EQ(u[kA].evictions, 0u);
  EXPECT_EQ(u[kB].evictions, 0u);
  EXPECT_GT(u[kFree].evictions, 0u);
  // Watermark evictions keep away from the guaranteed shares too.
  e->RunMaintenance();
  for (uint64_t s = 0; s < 6; ++s) EXPECT_TRUE(e->Contains(KeyOf(s))) << s;
  for (uint64_t s = 1000; s < 1006; ++s) EXPECT_TRUE(e->Contains(KeyOf(s))) << s;
}

TEST(PlacementEngineTenants, PutBeyondQuotaWithOwnChunksPinnedIsResourceExhausted) {
  auto e = MakeEngine();
  ASSERT_NE(e, nullptr);
  std::vector<Hash128> mine;
  uint64_t s = 0;
  // Fill A's quota exactly as far as whole chunks go.
  const uint64_t chunk = MakeChunk(0).size();
  for (; (s + 1) * chunk <= kQuota; ++s) {
    ASSERT_TRUE(PutAs(*e, kA, s).ok());
    mine.push_back(KeyOf(s));
  }
  ASSERT_TRUE(e->Pin(mine, 60000).ok());
  absl::Status st = PutAs(*e, kA, s);
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted) << st;
  EXPECT_THAT(st.message(), HasSubstr("quota"));
  auto slot = e->AllocateSlot(chunk, 0, kA);
  EXPECT_EQ(slot.status().code(), absl::StatusCode::kResourceExhausted) << slot.status();
  const std::vector<TenantUsage> u = e->TenantUsages();
  EXPECT_EQ(u[kA].quota_rejections, 2u);
  EXPECT_LE(u[kA].bytes[kDram], kQuota);
  // B is unaffected.
  EXPECT_TRUE(PutAs(*e, kB, 1000).ok());
}

// A tenant without a quota that stores and pins the whole tier: its pins
// count as held bytes, and one tenant's holds keep out of the DRAM that
// the other tenants' quotas guarantee, so A and B still store their share.
TEST(PlacementEngineTenants, PinsLeaveOtherTenantsGuaranteesAndCountAsHeld) {
  auto e = MakeEngine({}, /*max_held_bytes=*/30 * kChunkAlloc);
  ASSERT_NE(e, nullptr);
  const Holder free_holder{7, kFree};
  int pinned = 0, refused = 0;
  for (uint64_t s = 2000; s < 2031; ++s) {
    ASSERT_TRUE(PutAs(*e, kFree, s).ok()) << s;
    const Hash128 k = KeyOf(s);
    auto pin = e->Pin(std::span<const Hash128>(&k, 1), 60000, true, free_holder);
    if (pin.ok()) {
      ++pinned;
    } else {
      EXPECT_EQ(pin.status().code(), absl::StatusCode::kResourceExhausted) << pin.status();
      EXPECT_THAT(pin.status().message(), HasSubstr("quotas leave"));
      ++refused;
    }
  }
  // The tier (32 allocation units) less the 16 units A's and B's quotas
  // guarantee, in whole chunks.
  const int room = static_cast<int>(16 * kChunkAlloc / MakeChunk(0).size());
  ASSERT_LT(room, 31);
  EXPECT_EQ(pinned, room);
  EXPECT_EQ(refused, 31 - room);
  EXPECT_EQ(e->metric(EngineMetric::kHoldsRefused), static_cast<uint64_t>(31 - room));
  EXPECT_EQ(e->held_bytes(), room * MakeChunk(0).size());
  uint64_t s = 0;
  for (; (s + 1) * MakeChunk(0).size() <= kQuota; ++s) {
    ASSERT_TRUE(PutAs(*e, kA, s).ok()) << s;
    ASSERT_TRUE(PutAs(*e, kB, 1000 + s).ok()) << s;
  }
  const std::vector<TenantUsage> u = e->TenantUsages();
  EXPECT_EQ(u[kA].quota_rejections, 0u);
  EXPECT_EQ(u[kB].quota_rejections, 0u);
}

TEST(PlacementEngineTenants, BytesFollowDeletes) {
  auto e = MakeEngine();
  ASSERT_NE(e, nullptr);
  ASSERT_TRUE(PutAs(*e, kA, 1).ok());
  ASSERT_TRUE(PutThroughSlotAs(*e, kA, 2).ok());
  EXPECT_EQ(e->TenantUsages()[kA].bytes[kDram], MakeChunk(1).size() + MakeChunk(2).size());
  ASSERT_TRUE(e->Delete(KeyOf(1)).ok());
  ASSERT_TRUE(e->Delete(KeyOf(2)).ok());
  EXPECT_EQ(e->TenantUsages()[kA].bytes[kDram], 0u);
}

TEST(PlacementEngineTenants, QuotasOverTheTierCapacityAreInvalidArgument) {
  std::vector<std::array<uint64_t, kNumTierKinds>> q(3);
  q[1][kDram] = 20 * kChunkAlloc;
  q[2][kDram] = 20 * kChunkAlloc;
  EngineTiers tiers;
  tiers.dram = DramTier::Open({.capacity_bytes = 32 * kChunkAlloc, .populate = false}).value();
  PlacementEngineOptions o{.maintenance_interval_ms = 0};
  o.tenant_quotas = q;
  auto e = PlacementEngine::Create(o, std::move(tiers));
  EXPECT_EQ(e.status().code(), absl::StatusCode::kInvalidArgument);
  // A quota of a tier the engine does not have is refused too.
  q[2][kDram] = 0;
  q[2][static_cast<int>(TierKind::kNvme)] = kChunkAlloc;
  EngineTiers tiers2;
  tiers2.dram = DramTier::Open({.capacity_bytes = 32 * kChunkAlloc, .populate = false}).value();
  o.tenant_quotas = q;
  EXPECT_EQ(PlacementEngine::Create(o, std::move(tiers2)).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(PlacementEngineTenants, WithoutQuotasThereIsNoAccounting) {
  EngineTiers tiers;
  tiers.dram = DramTier::Open({.capacity_bytes = 32 * kChunkAlloc, .populate = false}).value();
  auto e = PlacementEngine::Create({.maintenance_interval_ms = 0}, std::move(tiers));
  ASSERT_TRUE(e.ok());
  ASSERT_TRUE(PutAs(**e, kA, 1).ok());
  EXPECT_TRUE((*e)->TenantUsages().empty());
}

}  // namespace
}  // namespace kvtier::tiering
