// HoldTable: entries by id, their expiry order and each holder's tallies.
#include "tiering/hold_table.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace kvtier::tiering {
namespace {

using Table = HoldTable<std::string>;

TEST(HoldTable, TakesExpiredEntriesEarliestFirstAndOnlyThose) {
  Table t;
  t.Insert(7, {"c", 300, Holder{1, 0}, 1, 10});
  t.Insert(8, {"a", 100, Holder{1, 0}, 2, 20});
  t.Insert(9, {"b", 200, Holder{2, 5}, 3, 30});
  t.SetExpiry(8, 250);  // renewed: now after b
  std::vector<std::string> order;
  t.TakeExpired(250, [&](uint64_t id, Table::Entry&& e) {
    order.push_back(e.state + std::to_string(id));
  });
  EXPECT_EQ(order, (std::vector<std::string>{"b9", "a8"}));
  EXPECT_EQ(t.size(), 1u);
  EXPECT_TRUE(t.contains(7));
  t.TakeExpired(299, [&](uint64_t, Table::Entry&&) { ADD_FAILURE() << "not due"; });
  EXPECT_EQ(t.size(), 1u);
}

TEST(HoldTable, OnlyTheHolderFindsItsLiveEntry) {
  Table t;
  t.Insert(7, {"x", 100, Holder{1, 0}, 0, 0});
  EXPECT_NE(t.FindHeld(7, 1, 99), nullptr);
  EXPECT_EQ(t.FindHeld(7, 2, 99), nullptr);   // another holder
  EXPECT_EQ(t.FindHeld(7, 1, 100), nullptr);  // expired
  EXPECT_EQ(t.FindHeld(8, 1, 0), nullptr);    // unknown
  EXPECT_NE(t.Find(7), nullptr);
}

TEST(HoldTable, TalliesFollowInsertsAndTakes) {
  Table t;
  t.Insert(1, {"", 10, Holder{1, 3}, 4, 100});
  t.Insert(2, {"", 20, Holder{1, 3}, 1, 50});
  t.Insert(3, {"", 30, Holder{2, 3}, 2, 7});
  EXPECT_EQ(t.TallyOf(1).entries, 2u);
  EXPECT_EQ(t.TallyOf(1).keys, 5u);
  EXPECT_EQ(t.TallyOf(1).held_bytes, 150u);
  EXPECT_EQ(t.TenantHeldBytes(3), 157u);
  EXPECT_EQ(t.held_bytes(), 157u);
  t.Take(2);
  EXPECT_EQ(t.TallyOf(1).entries, 1u);
  EXPECT_EQ(t.TallyOf(1).keys, 4u);
  EXPECT_EQ(t.TallyOf(1).held_bytes, 100u);
  t.TakeExpired(100, [](uint64_t, Table::Entry&&) {});
  EXPECT_EQ(t.TallyOf(1).entries, 0u);
  EXPECT_EQ(t.TallyOf(2).entries, 0u);
  EXPECT_EQ(t.TenantHeldBytes(3), 0u);
  EXPECT_EQ(t.held_bytes(), 0u);
  EXPECT_EQ(t.size(), 0u);
}

}  // namespace
}  // namespace kvtier::tiering
