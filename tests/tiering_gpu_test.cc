// HBM tier over the CUDA DeviceAllocator. Skips without a device.
#include "gtest/gtest.h"
#include "tiering/hbm_tier.h"
#include "tiering/test_util.h"

namespace kvtier::tiering {
namespace {

using ::kvtier::tiering::testing::KeyOf;
using ::kvtier::tiering::testing::MakeChunk;

TEST(HbmTierGpu, PutReadRoundTripThroughDeviceMemory) {
  auto alloc = NewCudaDeviceAllocator(0);
  if (!alloc.ok()) GTEST_SKIP() << "no CUDA device: " << alloc.status();
  auto tier = HbmTier::Open({.capacity_bytes = 1 << 20}, std::move(*alloc));
  ASSERT_TRUE(tier.ok()) << tier.status();
  std::vector<std::vector<uint8_t>> chunks;
  for (int i = 0; i < 8; ++i) {
    chunks.push_back(MakeChunk(i, 8 + i));
    ASSERT_TRUE((*tier)->Put({KeyOf(i), Part::kWhole}, chunks.back()).ok());
  }
  for (int i = 0; i < 8; ++i) {
    std::vector<uint8_t> out(chunks[i].size());
    ASSERT_TRUE((*tier)->Read({KeyOf(i), Part::kWhole}, out).ok());
    EXPECT_EQ(out, chunks[i]);
  }
  // Capacity is hard: a chunk larger than the pool is refused.
  auto big = MakeChunk(99, 2048);
  EXPECT_EQ((*tier)->Put({KeyOf(99), Part::kWhole}, big).code(), absl::StatusCode::kResourceExhausted);
}

}  // namespace
}  // namespace kvtier::tiering
