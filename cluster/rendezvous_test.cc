#include "cluster/rendezvous.h"

#include <map>

#include "gtest/gtest.h"

namespace kvtier::cluster {
namespace {

std::vector<Member> Members(int n) {
  std::vector<Member> m;
  for (int i = 0; i < n; ++i) m.push_back({"node-" + std::to_string(i), "127.0.0.1:" + std::to_string(7000 + i), "", 0, 0});
  return m;
}

Hash128 Key(int i) { return Hash128::Of(std::to_string(i), 0); }

TEST(Rendezvous, OwnersAreDeterministicAndIndependentOfOrder) {
  auto m = Members(5);
  auto reversed = m;
  std::reverse(reversed.begin(), reversed.end());
  for (int i = 0; i < 100; ++i) {
    auto a = RendezvousOwners(Key(i), m, 2);
    auto b = RendezvousOwners(Key(i), reversed, 2);
    ASSERT_EQ(a.size(), 2u);
    EXPECT_EQ(a, b);
    EXPECT_NE(a[0].id, a[1].id);
  }
}

TEST(Rendezvous, SpreadsKeysEvenly) {
  auto m = Members(4);
  std::map<std::string, int> first;
  for (int i = 0; i < 4000; ++i) first[RendezvousOwners(Key(i), m, 1)[0].id]++;
  for (auto& [id, n] : first) {
    EXPECT_GT(n, 800) << id;
    EXPECT_LT(n, 1200) << id;
  }
}

TEST(Rendezvous, RemovingAMemberMovesOnlyItsKeys) {
  auto m = Members(5);
  auto without = m;
  without.erase(without.begin() + 2);  // node-2 leaves
  int moved = 0;
  for (int i = 0; i < 1000; ++i) {
    auto before = RendezvousOwners(Key(i), m, 2);
    auto after = RendezvousOwners(Key(i), without, 2);
    bool had_node2 = before[0].id == "node-2" || before[1].id == "node-2";
    if (!had_node2) {
      EXPECT_EQ(before, after) << i;
    } else {
      ++moved;
      // The surviving owner stays an owner: reads fall back to it.
      const std::string& survivor = before[0].id == "node-2" ? before[1].id : before[0].id;
      EXPECT_TRUE(after[0].id == survivor || after[1].id == survivor) << i;
    }
  }
  EXPECT_GT(moved, 250);
  EXPECT_LT(moved, 550);
}

TEST(Rendezvous, FewerMembersThanReplicas) {
  auto m = Members(1);
  EXPECT_EQ(RendezvousOwners(Key(1), m, 3).size(), 1u);
  EXPECT_TRUE(RendezvousOwners(Key(1), {}, 3).empty());
  m.push_back(m[0]);  // duplicate id counts once
  EXPECT_EQ(RendezvousOwners(Key(1), m, 3).size(), 1u);
}

}  // namespace
}  // namespace kvtier::cluster
