#include "common/fault_injection.h"

#include <vector>

#include "gtest/gtest.h"

namespace kvtier {
namespace {

std::vector<bool> Failures(FaultInjector& f, int n) {
  std::vector<bool> failed;
  for (int i = 0; i < n; ++i) failed.push_back(!f.MaybeFail("op", false).ok());
  return failed;
}

TEST(FaultInjector, DefaultPolicyInjectsNothing) {
  FaultInjector f;
  for (int i = 0; i < 100; ++i) {
    EXPECT_TRUE(f.MaybeFail("write", true).ok());
    EXPECT_FALSE(f.MaybeTear());
  }
  EXPECT_EQ(f.injected(), 0u);
}

TEST(FaultInjector, FailAfterNPassesTheFirstNThenFailsWithTheChosenCode) {
  FaultInjector f({.fail_after_n = 2});
  EXPECT_TRUE(f.MaybeFail("a", false).ok());
  EXPECT_TRUE(f.MaybeFail("b", true).ok());
  EXPECT_EQ(f.MaybeFail("c", false).code(), absl::StatusCode::kInternal);
  EXPECT_EQ(f.MaybeFail("d", true).code(), absl::StatusCode::kInternal);
  f.SetPolicy({.fail_after_n = 0, .retryable = true});
  EXPECT_EQ(f.MaybeFail("e", false).code(), absl::StatusCode::kUnavailable);
  f.SetPolicy({.fail_after_n = 0, .retryable = true, .enospc = true});
  EXPECT_EQ(f.MaybeFail("f", true).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(f.MaybeFail("g", false).code(), absl::StatusCode::kUnavailable);  // not a write
  EXPECT_EQ(f.injected(), 5u);
}

TEST(FaultInjector, OneInIsReproducibleFromTheSeedAndRestartsOnSetPolicy) {
  FaultInjector a({.one_in = 4, .seed = 7}), b({.one_in = 4, .seed = 7}), c({.one_in = 4, .seed = 8});
  auto fa = Failures(a, 200);
  int n = 0;
  for (bool x : fa) n += x;
  EXPECT_GT(n, 20);
  EXPECT_LT(n, 100);
  EXPECT_EQ(Failures(b, 200), fa);
  EXPECT_NE(Failures(c, 200), fa);
  a.SetPolicy({.one_in = 4, .seed = 7});
  EXPECT_EQ(Failures(a, 200), fa);
}

TEST(FaultInjector, TornWriteOneInOneTearsEveryWriteAndCountsIt) {
  FaultInjector f({.torn_write_one_in = 1});
  EXPECT_TRUE(f.MaybeFail("write", true).ok());
  EXPECT_TRUE(f.MaybeTear());
  EXPECT_TRUE(f.MaybeTear());
  EXPECT_EQ(f.injected(), 2u);
}

}  // namespace
}  // namespace kvtier
