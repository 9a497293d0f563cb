#include "common/worker_pool.h"

#include <algorithm>
#include <atomic>
#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"

namespace kvtier {
namespace {

TEST(WorkerPool, ParallelForCallsEachItemOnce) {
  WorkerPool pool(3);
  for (size_t n : {0, 1, 2, 7, 1000}) {
    std::vector<std::atomic<int>> calls(n);
    pool.ParallelFor(n, [&](size_t i) { calls[i].fetch_add(1); });
    for (size_t i = 0; i < n; ++i) EXPECT_EQ(calls[i].load(), 1) << "n=" << n << " i=" << i;
  }
}

TEST(WorkerPool, ParallelForHonoursMaxThreadsOfOne) {
  WorkerPool pool(4);
  const std::thread::id me = std::this_thread::get_id();
  std::atomic<int> elsewhere{0};
  pool.ParallelFor(64, [&](size_t) { elsewhere += std::this_thread::get_id() != me; }, 1);
  EXPECT_EQ(elsewhere.load(), 0);
}

TEST(WorkerPool, ParallelForFinishesWhileEveryPoolThreadIsBusy) {
  // The caller does the items itself when no pool thread is free, and
  // returns; the helpers it scheduled find nothing left when they run.
  WorkerPool pool(2);
  absl::Notification release;
  for (int i = 0; i < 2; ++i) pool.Schedule([&] { release.WaitForNotification(); });
  std::atomic<int> sum{0};
  pool.ParallelFor(100, [&](size_t i) { sum += static_cast<int>(i); });
  EXPECT_EQ(sum.load(), 4950);
  release.Notify();
}

TEST(WorkerPool, ParallelForNestedInATask) {
  WorkerPool pool(2);
  absl::Notification done;
  std::atomic<int> sum{0};
  pool.Schedule([&] {
    pool.ParallelFor(10, [&](size_t i) { sum += static_cast<int>(i); });
    done.Notify();
  });
  done.WaitForNotification();
  EXPECT_EQ(sum.load(), 45);
}

TEST(WorkerPool, SharedThreadsFollowsTheEnvironmentWithinBounds) {
  const size_t cores = std::max<size_t>(2, std::thread::hardware_concurrency());
  const size_t fallback = std::min<size_t>(cores - 1, 15);
  EXPECT_EQ(WorkerPool::SharedThreads(nullptr), fallback);
  EXPECT_EQ(WorkerPool::SharedThreads("4"), 4u);
  EXPECT_EQ(WorkerPool::SharedThreads("1"), 1u);
  EXPECT_EQ(WorkerPool::SharedThreads("1000"), 64u);
  for (const char* bad : {"", "0", "-3", "four", "4x", " "}) {
    EXPECT_EQ(WorkerPool::SharedThreads(bad), fallback) << "'" << bad << "'";
  }
}

TEST(WorkerPool, DestructorRunsScheduledTasks) {
  std::atomic<int> ran{0};
  {
    WorkerPool pool(1);
    for (int i = 0; i < 50; ++i) pool.Schedule([&] { ++ran; });
  }
  EXPECT_EQ(ran.load(), 50);
}

}  // namespace
}  // namespace kvtier
