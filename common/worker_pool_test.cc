#include "common/worker_pool.h"

#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

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

TEST(WorkerPool, SharedNiceFollowsTheEnvironmentWithinBounds) {
  EXPECT_EQ(WorkerPool::SharedNice(nullptr), 0);
  EXPECT_EQ(WorkerPool::SharedNice("10"), 10);
  EXPECT_EQ(WorkerPool::SharedNice("19"), 19);
  EXPECT_EQ(WorkerPool::SharedNice("0"), 0);
  for (const char* bad : {"", "-1", "20", "ten", "5x", " "}) {
    EXPECT_EQ(WorkerPool::SharedNice(bad), 0) << "'" << bad << "'";
  }
}

TEST(WorkerPool, ThreadsRunAtTheirNiceWhileTheCallerKeepsItsOwn) {
  const int mine = getpriority(PRIO_PROCESS, static_cast<id_t>(::syscall(SYS_gettid)));
  WorkerPool pool(2, /*nice=*/std::min(19, mine + 7));
  std::atomic<int> seen{-100};
  absl::Notification done;
  pool.Schedule([&] {
    seen = getpriority(PRIO_PROCESS, static_cast<id_t>(::syscall(SYS_gettid)));
    done.Notify();
  });
  done.WaitForNotification();
  // A nice value only rises without privilege: the pool's threads run at
  // the asked value, or stay at the process's if that was already higher.
  EXPECT_EQ(seen.load(), std::max(mine, std::min(19, mine + 7)));
  EXPECT_EQ(getpriority(PRIO_PROCESS, static_cast<id_t>(::syscall(SYS_gettid))), mine);
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
