// ExtentAllocator: first fit, alignment, coalescing, recovery marks, and a
// randomized check against a byte map.
#include "tiering/extent_allocator.h"

#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace kvtier::tiering {
namespace {

TEST(ExtentAllocator, AllocatesFirstFitRoundedToAlignment) {
  ExtentAllocator a(16 * 4096, 4096);
  EXPECT_EQ(a.size(), 16u * 4096);
  EXPECT_EQ(a.Allocate(1), 0u);             // 1 byte takes a whole unit
  EXPECT_EQ(a.Allocate(4097), 4096u);       // two units
  EXPECT_EQ(a.Allocate(4096), 3u * 4096);
  EXPECT_EQ(a.used(), 4u * 4096);
  EXPECT_EQ(a.Rounded(0), 0u);
  EXPECT_EQ(a.Rounded(4096), 4096u);
  EXPECT_EQ(a.Rounded(4097), 8192u);
}

TEST(ExtentAllocator, SizeIsRoundedDownToWholeUnits) {
  ExtentAllocator a(3 * 4096 + 100, 4096);
  EXPECT_EQ(a.size(), 3u * 4096);
  EXPECT_EQ(a.largest_free(), 3u * 4096);
  ExtentAllocator empty(100, 4096);
  EXPECT_EQ(empty.size(), 0u);
  EXPECT_FALSE(empty.Allocate(1).has_value());
}

TEST(ExtentAllocator, FullSpaceReturnsNulloptAndFreeingMakesRoom) {
  ExtentAllocator a(4 * 4096, 4096);
  for (int i = 0; i < 4; ++i) ASSERT_TRUE(a.Allocate(4096).has_value());
  EXPECT_FALSE(a.Allocate(1).has_value());
  a.Free(2 * 4096, 4096);
  EXPECT_EQ(a.Allocate(10), 2u * 4096);
  EXPECT_EQ(a.used(), a.size());
}

TEST(ExtentAllocator, FreedNeighboursCoalesceIntoOneRange) {
  ExtentAllocator a(8 * 4096, 4096);
  std::vector<uint64_t> off;
  for (int i = 0; i < 8; ++i) off.push_back(*a.Allocate(4096));
  // Free 1, 3, 2 (middle last: joins both sides), then 5 and 6.
  a.Free(off[1], 4096);
  a.Free(off[3], 4096);
  EXPECT_EQ(a.largest_free(), 4096u);
  a.Free(off[2], 4096);
  EXPECT_EQ(a.largest_free(), 3u * 4096);
  EXPECT_EQ(a.Allocate(3 * 4096), off[1]);  // fits only if coalesced
  a.Free(off[5], 4096);
  a.Free(off[6], 4096);
  EXPECT_EQ(a.largest_free(), 2u * 4096);
  EXPECT_FALSE(a.Allocate(3 * 4096).has_value());  // fragmented: no 3-unit hole
}

TEST(ExtentAllocator, FragmentedSpaceRefusesAnAllocationLargerThanAnyHole) {
  ExtentAllocator a(6 * 4096, 4096);
  std::vector<uint64_t> off;
  for (int i = 0; i < 6; ++i) off.push_back(*a.Allocate(4096));
  for (int i = 0; i < 6; i += 2) a.Free(off[i], 4096);
  EXPECT_EQ(a.used(), 3u * 4096);
  EXPECT_FALSE(a.Allocate(2 * 4096).has_value());
  EXPECT_TRUE(a.Allocate(4096).has_value());
}

TEST(ExtentAllocator, MarkUsedClaimsExactRangesAndRejectsOverlapOrOutOfRange) {
  ExtentAllocator a(8 * 4096, 4096);
  EXPECT_TRUE(a.MarkUsed(2 * 4096, 2 * 4096));
  EXPECT_FALSE(a.MarkUsed(3 * 4096, 4096));       // overlaps
  EXPECT_FALSE(a.MarkUsed(100, 4096));            // misaligned
  EXPECT_FALSE(a.MarkUsed(7 * 4096, 2 * 4096));   // past the end
  EXPECT_TRUE(a.MarkUsed(7 * 4096, 1));           // last unit
  EXPECT_EQ(a.used(), 3u * 4096);
  // First fit skips the marked ranges.
  EXPECT_EQ(a.Allocate(2 * 4096), 0u);
  EXPECT_EQ(a.Allocate(2 * 4096), 4u * 4096);
  EXPECT_FALSE(a.Allocate(2 * 4096).has_value());
  EXPECT_EQ(a.Allocate(4096), 6u * 4096);
  a.Free(2 * 4096, 2 * 4096);
  EXPECT_EQ(a.largest_free(), 2u * 4096);
}

TEST(ExtentAllocator, RandomAllocateFreeNeverOverlapsAndAccountsEveryByte) {
  constexpr uint64_t kUnit = 512, kUnits = 256;
  ExtentAllocator a(kUnits * kUnit, kUnit);
  std::vector<int> owner(kUnits, -1);
  std::vector<std::pair<uint64_t, uint64_t>> live;  // offset, length
  std::mt19937_64 rng(::testing::UnitTest::GetInstance()->random_seed());
  for (int step = 0; step < 20000; ++step) {
    if (live.empty() || rng() % 3 != 0) {
      uint64_t len = 1 + rng() % (8 * kUnit);
      auto off = a.Allocate(len);
      if (!off) {
        EXPECT_LT(a.largest_free(), a.Rounded(len));
        continue;
      }
      ASSERT_EQ(*off % kUnit, 0u);
      for (uint64_t u = *off / kUnit; u < (*off + a.Rounded(len)) / kUnit; ++u) {
        ASSERT_LT(u, kUnits);
        ASSERT_EQ(owner[u], -1) << "unit " << u << " handed out twice";
        owner[u] = step;
      }
      live.emplace_back(*off, len);
    } else {
      size_t i = rng() % live.size();
      auto [off, len] = live[i];
      for (uint64_t u = off / kUnit; u < (off + a.Rounded(len)) / kUnit; ++u) owner[u] = -1;
      a.Free(off, len);
      live.erase(live.begin() + static_cast<ptrdiff_t>(i));
    }
    uint64_t used_units = 0;
    for (int o : owner) used_units += o != -1;
    ASSERT_EQ(a.used(), used_units * kUnit);
  }
  for (auto [off, len] : live) a.Free(off, len);
  EXPECT_EQ(a.used(), 0u);
  EXPECT_EQ(a.largest_free(), a.size());  // everything coalesced back
}

TEST(ExtentAllocator, HeldBackSpaceIsHandedOutOnlyOnceAdded) {
  constexpr uint64_t kUnit = 4096;
  ExtentAllocator a(8 * kUnit, kUnit, /*all_free=*/false);
  EXPECT_EQ(a.size(), 8u * kUnit);
  EXPECT_FALSE(a.Allocate(1).has_value());
  EXPECT_EQ(a.used(), 0u);
  a.AddFree(4 * kUnit, 4 * kUnit);
  EXPECT_EQ(a.used(), 0u);
  EXPECT_EQ(a.Allocate(kUnit), 4u * kUnit);
  EXPECT_FALSE(a.Allocate(4 * kUnit).has_value());
  a.AddFree(0, 4 * kUnit);  // merges with the free tail of [4, 8)
  EXPECT_EQ(a.largest_free(), 4u * kUnit);
  EXPECT_EQ(a.Allocate(4 * kUnit), 0u);
  EXPECT_EQ(a.used(), 5u * kUnit);
}

TEST(ExtentAllocator, NoRangeSpansAFence) {
  constexpr uint64_t kUnit = 4096;
  ExtentAllocator a(8 * kUnit, kUnit, /*all_free=*/false);
  a.set_fence(4 * kUnit);
  a.AddFree(0, 4 * kUnit);
  a.AddFree(4 * kUnit, 4 * kUnit);
  EXPECT_EQ(a.largest_free(), 4u * kUnit);
  EXPECT_FALSE(a.Allocate(5 * kUnit).has_value());
  auto x = a.Allocate(3 * kUnit);
  auto y = a.Allocate(2 * kUnit);  // does not fit behind x: goes to the second piece
  ASSERT_TRUE(x.has_value() && y.has_value());
  EXPECT_EQ(*x, 0u);
  EXPECT_EQ(*y, 4u * kUnit);
  a.Free(*x, 3 * kUnit);
  a.Free(*y, 2 * kUnit);
  EXPECT_EQ(a.used(), 0u);
  EXPECT_EQ(a.largest_free(), 4u * kUnit);  // freed ranges merge up to the fence only
}

}  // namespace
}  // namespace kvtier::tiering
