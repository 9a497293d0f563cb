// LeaseTable alone: ids, expiry, holders, the hold limits.
#include "tiering/lease_table.h"

#include <string>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "gtest/gtest.h"

namespace kvtier::tiering {
namespace {

Hash128 Key(int i) { return Hash128::Of(std::to_string(i), 42); }

constexpr Holder kAlice{1, 0};
constexpr Holder kBob{2, 0};

TEST(LeaseTable, LeaseEndsOnlyForItsHolderAndOnlyOnce) {
  LeaseTable t(HoldLimits{});
  auto lease = t.AddLease({Key(1), Key(2)}, 200, 1000, 0, kAlice);
  ASSERT_TRUE(lease.ok()) << lease.status();
  EXPECT_NE(lease->id, 0u);
  EXPECT_EQ(lease->expires_at_us, 1'000'000);
  EXPECT_EQ(t.held_bytes(), 200u);
  EXPECT_EQ(t.TakeLease(lease->id, kBob.id, 0).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(t.Renew(lease->id, 0, kBob.id, 0).status().code(), absl::StatusCode::kNotFound);
  auto state = t.TakeLease(lease->id, kAlice.id, 0);
  ASSERT_TRUE(state.ok()) << state.status();
  EXPECT_EQ(state->keys, (std::vector<Hash128>{Key(1), Key(2)}));
  EXPECT_EQ(t.held_bytes(), 0u);
  EXPECT_EQ(t.TakeLease(lease->id, kAlice.id, 0).status().code(), absl::StatusCode::kNotFound);
}

TEST(LeaseTable, TtlDefaultsAndIsClamped) {
  LeaseTable t(HoldLimits{.default_lease_ms = 30, .max_lease_ms = 100});
  EXPECT_EQ(t.ExpiryAt(5, 0), 5 + 30'000);
  EXPECT_EQ(t.ExpiryAt(5, -1), 5 + 30'000);
  EXPECT_EQ(t.ExpiryAt(5, 50), 5 + 50'000);
  EXPECT_EQ(t.ExpiryAt(5, 1'000'000), 5 + 100'000);
  auto lease = t.AddLease({Key(1)}, 1, 10, 0, kAlice);
  ASSERT_TRUE(lease.ok());
  auto renewed = t.Renew(lease->id, 1'000'000, kAlice.id, 1'000);
  ASSERT_TRUE(renewed.ok()) << renewed.status();
  EXPECT_EQ(renewed->expires_at_us, 1'000 + 100'000);
}

TEST(LeaseTable, ExpiredHoldsAreNotFoundAndTakenWithTheirState) {
  LeaseTable t(HoldLimits{});
  auto lease = t.AddLease({Key(1)}, 10, 1, 0, kAlice);  // ends at 1000 us
  auto slot = t.AddSlot(SlotState{.extent = {4096, 512}, .scratch = true}, 512, 2, 0, kAlice);
  ASSERT_TRUE(lease.ok() && slot.ok());
  EXPECT_EQ(t.Renew(lease->id, 0, kAlice.id, 1'000).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(t.TakeSlot(slot->id, kAlice.id, 2'000).status().code(), absl::StatusCode::kNotFound);
  EndedHolds ended = t.TakeExpired(1'000);
  ASSERT_EQ(ended.leases.size(), 1u);
  EXPECT_EQ(ended.leases[0].keys, std::vector<Hash128>{Key(1)});
  EXPECT_TRUE(ended.slots.empty());
  ended = t.TakeExpired(2'000);
  ASSERT_EQ(ended.slots.size(), 1u);
  EXPECT_EQ(ended.slots[0].extent.offset, 4096u);
  EXPECT_EQ(t.leases() + t.slots(), 0u);
  EXPECT_EQ(t.held_bytes(), 0u);
}

TEST(LeaseTable, ScratchSlotIsNotAClientSlot) {
  LeaseTable t(HoldLimits{});
  auto scratch = t.AddSlot(SlotState{.extent = {0, 64}, .scratch = true}, 64, 0, 0, kAlice);
  auto client = t.AddSlot(SlotState{.extent = {64, 64}}, 0, 0, 0, kAlice);
  ASSERT_TRUE(scratch.ok() && client.ok());
  EXPECT_EQ(t.ClientSlotExtent(scratch->id, kAlice.id, 0).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(t.TakeClientSlot(scratch->id, kAlice.id, 0).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(t.slots(), 2u);  // the refused take leaves it
  EXPECT_EQ(t.ClientSlotExtent(client->id, kBob.id, 0).status().code(),
            absl::StatusCode::kNotFound);
  // Live at `live_at` only if it ends after it.
  EXPECT_EQ(t.ClientSlotExtent(client->id, kAlice.id, client->expires_at_us).status().code(),
            absl::StatusCode::kNotFound);
  auto view = t.ClientSlotExtent(client->id, kAlice.id, client->expires_at_us - 1);
  ASSERT_TRUE(view.ok()) << view.status();
  EXPECT_EQ(view->offset, 64u);
  auto taken = t.TakeClientSlot(client->id, kAlice.id, 0);
  ASSERT_TRUE(taken.ok()) << taken.status();
  EXPECT_EQ(taken->length, 64u);
  EXPECT_TRUE(t.MarkPromote(scratch->id, Key(9)));
  EXPECT_FALSE(t.MarkPromote(client->id, Key(9)));  // gone
  auto s = t.TakeSlot(scratch->id, kAlice.id, 0);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_TRUE(s->promote);
  EXPECT_EQ(s->key, Key(9));
}

TEST(LeaseTable, HoldsBeyondTheLimitsAreResourceExhausted) {
  LeaseTable t(HoldLimits{.max_held_bytes = 100,
                          .max_held_bytes_per_holder = 60,
                          .max_holds_per_holder = 3,
                          .max_held_keys_per_holder = 4});
  ASSERT_TRUE(t.AddLease({Key(1)}, 50, 0, 0, kAlice).ok());
  // The holder's share (60), then the keys (4), then the count (3).
  EXPECT_EQ(t.AddLease({Key(2)}, 11, 0, 0, kAlice).status().code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(t.AddLease({Key(2), Key(3), Key(4), Key(5)}, 1, 0, 0, kAlice).status().code(),
            absl::StatusCode::kResourceExhausted);
  ASSERT_TRUE(t.AddSlot(SlotState{}, 0, 0, 0, kAlice).ok());
  ASSERT_TRUE(t.AddSlot(SlotState{}, 0, 0, 0, kAlice).ok());
  EXPECT_EQ(t.AddSlot(SlotState{}, 0, 0, 0, kAlice).status().code(),
            absl::StatusCode::kResourceExhausted);
  // The total (100) across holders.
  ASSERT_TRUE(t.AddLease({Key(6)}, 50, 0, 0, kBob).ok());
  EXPECT_EQ(t.CheckHold(Holder{3, 0}, 1, 1).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(t.held_bytes(), 100u);
  EXPECT_EQ(t.leases(), 2u);
}

TEST(LeaseTable, TenantHoldsLeaveOtherTenantsDramQuotas) {
  // DRAM 100 bytes; tenant 1 is guaranteed 70 of it, so tenant 0's holders
  // hold at most 30.
  LeaseTable t(HoldLimits{.max_held_bytes = 100,
                          .dram_capacity = 100,
                          .tenant_dram_quotas = {0, 70}});
  ASSERT_TRUE(t.CheckHold(Holder{1, 0}, 1, 30).ok());
  EXPECT_EQ(t.CheckHold(Holder{1, 0}, 1, 31).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(t.CheckHold(Holder{2, 1}, 1, 100).ok());
  // Without a DRAM tier the quotas give no such share.
  LeaseTable no_dram(HoldLimits{.max_held_bytes = 100, .tenant_dram_quotas = {0, 70}});
  EXPECT_TRUE(no_dram.CheckHold(Holder{1, 0}, 1, 100).ok());
}

TEST(LeaseTable, ForgetEndedKeepsOnlyLiveIds) {
  LeaseTable t(HoldLimits{});
  auto lease = t.AddLease({Key(1)}, 1, 1, 0, kAlice);
  auto slot = t.AddSlot(SlotState{}, 0, 5, 0, kAlice);
  ASSERT_TRUE(lease.ok() && slot.ok());
  absl::flat_hash_set<uint64_t> slots{slot->id, 12345}, leases{lease->id, 678};
  t.ForgetEnded(1'000, slots, leases);  // the lease ends at 1000 us
  EXPECT_EQ(slots, (absl::flat_hash_set<uint64_t>{slot->id}));
  EXPECT_TRUE(leases.empty());
}

TEST(LeaseTable, IdsAreNonzeroAndDistinct) {
  LeaseTable t(HoldLimits{.max_holds_per_holder = 1000});
  absl::flat_hash_set<uint64_t> ids;
  for (int i = 0; i < 200; ++i) {
    auto id = i % 2 == 0 ? t.AddLease({}, 0, 0, 0, kAlice).value().id
                         : t.AddSlot(SlotState{}, 0, 0, 0, kAlice).value().id;
    EXPECT_NE(id, 0u);
    EXPECT_TRUE(ids.insert(id).second);
  }
}

}  // namespace
}  // namespace kvtier::tiering
