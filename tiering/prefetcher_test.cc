// Prefetcher alone, over a fake PrefetchTarget: routing, grouping, the
// first error, promotions, stopping.
#include "tiering/prefetcher.h"

#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "gtest/gtest.h"

namespace kvtier::tiering {
namespace {

Hash128 Key(int i) { return Hash128::Of(std::to_string(i), 42); }

// Routes keys as told and records each call, in order.
class FakeTarget : public PrefetchTarget {
 public:
  struct Route1 {
    Route route = Route::kPromote;
    uint64_t bytes = 0;
    absl::Status status;  // of PromoteOne, or of the group that holds it
  };
  absl::flat_hash_map<Hash128, Route1> routes;

  Route RouteOf(const Hash128& key, uint64_t* bytes) override {
    auto it = routes.find(key);
    if (it == routes.end()) return Route::kPromote;
    *bytes = it->second.bytes;
    return it->second.route;
  }
  absl::Status PromoteOne(const Hash128& key) override {
    absl::MutexLock l(&mu);
    calls.push_back({key});
    auto it = routes.find(key);
    return it == routes.end() ? absl::OkStatus() : it->second.status;
  }
  absl::Status PrefetchGroup(std::span<const std::pair<Hash128, uint64_t>> chunks) override {
    absl::MutexLock l(&mu);
    std::vector<Hash128> group;
    absl::Status st;
    for (const auto& [k, b] : chunks) {
      group.push_back(k);
      if (st.ok()) st = routes[k].status;
    }
    calls.push_back(group);
    ++groups;
    return st;
  }
  void PromoteFromSlot(const Hash128& key, const PoolExtent& extent) override {
    absl::MutexLock l(&mu);
    promoted.emplace_back(key, extent.offset);
  }

  absl::Mutex mu;
  std::vector<std::vector<Hash128>> calls;  // PromoteOne: one key; PrefetchGroup: its keys
  int groups = 0;
  std::vector<std::pair<Hash128, uint64_t>> promoted;
};

TEST(Prefetcher, GroupsNvmeChunksByCountAndBytesAndPromotesTheRest) {
  FakeTarget t;
  std::vector<Hash128> keys;
  for (int i = 0; i < 10; ++i) {
    keys.push_back(Key(i));
    t.routes[Key(i)] = {PrefetchTarget::Route::kGroup, 1 << 20, absl::OkStatus()};
  }
  keys.push_back(Key(100));  // promoted
  t.routes[Key(101)] = {PrefetchTarget::Route::kSkip, 0, absl::InternalError("never called")};
  keys.push_back(Key(101));
  keys.push_back(Key(200));  // one chunk of the group limit's bytes: a group alone
  t.routes[Key(200)] = {PrefetchTarget::Route::kGroup, Prefetcher::kGroupBytes, absl::OkStatus()};
  Prefetcher p(&t);
  p.Start();
  ASSERT_TRUE(p.Enqueue(keys).get().ok());
  absl::MutexLock l(&t.mu);
  ASSERT_EQ(t.calls.size(), 3u);
  EXPECT_EQ(t.calls[0], std::vector<Hash128>(keys.begin(), keys.begin() + 8));
  EXPECT_EQ(t.calls[1], std::vector<Hash128>{Key(100)});  // promoted as it comes
  EXPECT_EQ(t.calls[2], (std::vector<Hash128>{Key(8), Key(9), Key(200)}));
  EXPECT_EQ(t.groups, 2);
}

TEST(Prefetcher, ReturnsTheFirstErrorAndStillRunsTheRest) {
  FakeTarget t;
  t.routes[Key(1)] = {PrefetchTarget::Route::kPromote, 0, absl::UnavailableError("busy")};
  t.routes[Key(2)] = {PrefetchTarget::Route::kGroup, 10, absl::DataLossError("corrupt")};
  Prefetcher p(&t);
  p.Start();
  absl::Status st = p.Enqueue({Key(1), Key(2), Key(3)}).get();
  EXPECT_EQ(st.code(), absl::StatusCode::kUnavailable);
  absl::MutexLock l(&t.mu);
  ASSERT_EQ(t.calls.size(), 3u);  // K1, K3 promoted; the group of K2 read last
  EXPECT_EQ(t.calls[2], std::vector<Hash128>{Key(2)});
}

TEST(Prefetcher, PromotionsRunAheadOfQueuedPrefetches) {
  FakeTarget t;
  Prefetcher p(&t);
  ASSERT_TRUE(p.EnqueuePromotion(Key(5), PoolExtent{4096, 100}));
  std::future<absl::Status> job = p.Enqueue({Key(6)});
  p.Start();
  ASSERT_TRUE(job.get().ok());
  absl::MutexLock l(&t.mu);
  ASSERT_EQ(t.promoted.size(), 1u);
  EXPECT_EQ(t.promoted[0], std::make_pair(Key(5), uint64_t{4096}));
  ASSERT_EQ(t.calls.size(), 1u);
}

TEST(Prefetcher, StopCancelsQueuedPrefetchesAndReturnsPromotionsNotMade) {
  FakeTarget t;
  Prefetcher p(&t);  // not started: nothing runs
  std::future<absl::Status> job = p.Enqueue({Key(1)});
  ASSERT_TRUE(p.EnqueuePromotion(Key(2), PoolExtent{8192, 64}));
  auto left = p.Stop();
  EXPECT_EQ(job.get().code(), absl::StatusCode::kCancelled);
  ASSERT_EQ(left.size(), 1u);
  EXPECT_EQ(left[0].first, Key(2));
  EXPECT_EQ(left[0].second.offset, 8192u);
  // Stopped: new work is refused, and a second Stop has nothing left.
  EXPECT_EQ(p.Enqueue({Key(3)}).get().code(), absl::StatusCode::kCancelled);
  EXPECT_FALSE(p.EnqueuePromotion(Key(4), PoolExtent{0, 64}));
  EXPECT_TRUE(p.Stop().empty());
  absl::MutexLock l(&t.mu);
  EXPECT_TRUE(t.calls.empty());
  EXPECT_TRUE(t.promoted.empty());
}

}  // namespace
}  // namespace kvtier::tiering
