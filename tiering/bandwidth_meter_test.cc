// BandwidthMeter counts the time during which moves are in flight once, and
// the NVMe tier's read probe (ProbeDiskRead) gives it the disk's rate before
// the tier's first read.
#include <chrono>
#include <filesystem>
#include <thread>

#include "common/testing/temp_dir.h"
#include "gtest/gtest.h"
#include "tiering/disk_probe.h"
#include "tiering/nvme_tier.h"
#include "tiering/odirect_test_util.h"
#include "tiering/tier.h"

namespace kvtier::tiering {
namespace {

using ::kvtier::testing::TempDir;
using Clock = std::chrono::steady_clock;

double SecondsSince(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

TEST(BandwidthMeter, ZeroUntilSomethingMoved) {
  BandwidthMeter m;
  EXPECT_EQ(m.Get().read_bytes_per_s, 0);
  EXPECT_EQ(m.Get().write_bytes_per_s, 0);
  { BandwidthMeter::Op failed = m.Start(/*write=*/false); }  // a failed read moves nothing
  EXPECT_EQ(m.Get().read_bytes_per_s, 0);
}

TEST(BandwidthMeter, OverlappingMovesCountTheirSharedTimeOnce) {
  // Two reads in flight together for the whole test: their busy time is at
  // most the test's wall time, so the rate is at least both reads' bytes
  // over it (summing each read's own time would give half of that).
  constexpr uint64_t kBytes = 1 << 20;
  BandwidthMeter m;
  const Clock::time_point t0 = Clock::now();
  BandwidthMeter::Op a = m.Start(false);
  BandwidthMeter::Op b = m.Start(false);
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  a.Done(kBytes);
  b.Done(kBytes);
  const double wall = SecondsSince(t0);
  const double rate = m.Get().read_bytes_per_s;
  EXPECT_GE(rate, 2 * kBytes / wall * 0.999);
  EXPECT_LE(rate, 2 * kBytes / 0.020 * 1.001);
  EXPECT_EQ(m.Get().write_bytes_per_s, 0);  // directions are apart
}

TEST(BandwidthMeter, IdleTimeBetweenMovesDoesNotCount) {
  constexpr uint64_t kBytes = 1 << 20;
  BandwidthMeter m;
  const Clock::time_point t0 = Clock::now();
  {
    BandwidthMeter::Op w = m.Start(true);
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    w.Done(kBytes);
  }
  const Clock::time_point idle = Clock::now();
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  const double idle_s = SecondsSince(idle);
  {
    BandwidthMeter::Op w = m.Start(true);
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    w.Done(kBytes);
  }
  const double wall = SecondsSince(t0);
  EXPECT_GE(m.Get().write_bytes_per_s, 2 * kBytes / (wall - idle_s) * 0.999);
}

TEST(BandwidthMeter, AddedMeasurementCountsLikeAMove) {
  BandwidthMeter m;
  m.Add(/*write=*/false, 3'000'000, /*micros=*/1000);
  EXPECT_DOUBLE_EQ(m.Get().read_bytes_per_s, 3e9);
  m.Add(false, 1'000'000, 1000);
  EXPECT_DOUBLE_EQ(m.Get().read_bytes_per_s, 2e9);
}

TEST(DiskProbe, RejectsBadArgumentsAndMissingDirectories) {
  TempDir dir;
  EXPECT_EQ(ProbeDiskRead(dir.path(), 0, 1).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ProbeDiskRead(dir.path(), 1 << 20, 0).status().code(),
            absl::StatusCode::kInvalidArgument);
  absl::Status missing = ProbeDiskRead(dir.path() + "/absent/deeper", 1 << 20, 1).status();
  EXPECT_EQ(missing.code(), absl::StatusCode::kNotFound);
  EXPECT_NE(missing.message().find("create a probe file in"), std::string::npos) << missing;
}

bool ProbeFileLeft(const std::string& dir) {
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    if (e.path().filename().string().starts_with("kvtier-probe-")) return true;
  }
  return false;
}

TEST(NvmeTierReadProbe, GivesTheDiskRateBeforeTheFirstReadAndRemovesItsFile) {
  TempDir dir;
  auto plain = NvmeTier::Open({.dir = dir.path() + "/plain", .capacity_bytes = 16 << 20});
  KVTIER_SKIP_WITHOUT_ODIRECT(plain.ok());
  EXPECT_EQ((*plain)->bandwidth().read_bytes_per_s, 0);
  EXPECT_EQ((*plain)->WaitForReadProbe().status().code(),
            absl::StatusCode::kFailedPrecondition);

  auto t = NvmeTier::Open({.dir = dir.path() + "/probed", .capacity_bytes = 16 << 20,
                           .read_probe_bytes = 8 << 20});
  ASSERT_TRUE(t.ok()) << t.status();
  absl::StatusOr<DiskReadProbe> probe = (*t)->WaitForReadProbe();
  ASSERT_TRUE(probe.ok()) << probe.status();
  EXPECT_EQ(probe->bytes, uint64_t{8} << 20);
  EXPECT_GT(probe->micros, 0);
  EXPECT_GT(probe->bytes_per_s(), 0);
  EXPECT_DOUBLE_EQ((*t)->bandwidth().read_bytes_per_s, probe->bytes * 1e6 / probe->micros);
  EXPECT_FALSE(ProbeFileLeft(dir.path() + "/probed"));
}

TEST(NvmeTierReadProbe, TierClosedWhileItsProbeRunsStopsCleanly) {
  TempDir dir;
  auto t = NvmeTier::Open({.dir = dir.path(), .capacity_bytes = 16 << 20,
                           .read_probe_bytes = 32 << 20});
  KVTIER_SKIP_WITHOUT_ODIRECT(t.ok());
  t->reset();  // joins the probe
  EXPECT_FALSE(ProbeFileLeft(dir.path()));
}

}  // namespace
}  // namespace kvtier::tiering
