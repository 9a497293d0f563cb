// Membership and the etcd client against a real etcd (started by the test on
// loopback ports).
#include "cluster/membership.h"

#include <chrono>
#include <thread>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "cluster/etcd_test_util.h"
#include "common/testing/wait.h"

namespace kvtier::cluster {
namespace {

using ::testing::HasSubstr;

// One etcd for the whole suite; each test uses its own cluster name.
class EtcdTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { etcd_ = new testing::EtcdServer(); }
  static void TearDownTestSuite() {
    delete etcd_;
    etcd_ = nullptr;
  }
  void SetUp() override {
    ASSERT_TRUE(etcd_->ok()) << etcd_->error();
    cluster_ = ::testing::UnitTest::GetInstance()->current_test_info()->name();
  }
  std::unique_ptr<EtcdClient> Client() {
    auto c = EtcdClient::Connect({etcd_->endpoint()});
    EXPECT_TRUE(c.ok()) << c.status();
    return std::move(*c);
  }
  std::unique_ptr<Membership> Join(const std::string& id, int64_t ttl = 2) {
    MembershipOptions o;
    o.cluster = cluster_;
    o.node_id = id;
    o.advertise = "127.0.0.1:" + std::to_string(7000 + id.back());
    o.lease_ttl_s = ttl;
    o.capacity_bytes = 1000;
    o.used_bytes = [] { return uint64_t{42}; };
    auto m = Membership::Join(o, Client());
    EXPECT_TRUE(m.ok()) << m.status();
    return m.ok() ? std::move(*m) : nullptr;
  }
  // Waits up to 10 s for `pred`.
  template <typename F>
  bool Eventually(F pred) {
    return ::kvtier::testing::WaitUntil(pred, std::chrono::seconds(10), std::chrono::milliseconds(50));
  }
  static testing::EtcdServer* etcd_;
  std::string cluster_;
};

testing::EtcdServer* EtcdTest::etcd_ = nullptr;

TEST(EtcdEndpoints, ParsesListsAndRejectsBadOnes) {
  auto e = ParseEtcdEndpoints("http://127.0.0.1:2379, 10.0.0.2:2379/");
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_THAT(*e, ::testing::ElementsAre("127.0.0.1:2379", "10.0.0.2:2379"));
  for (const char* bad : {"", "http://h", "h:", "h:12x", "http://h:1/v3"}) {
    EXPECT_EQ(ParseEtcdEndpoints(bad).status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
}

TEST(MemberRecord, RoundTripsAndRejectsHostileValues) {
  MemberRecord r;
  r.member = {"node-1", "10.0.0.1:7000", "ucx:00ff", 123, 45};
  r.protocol = 1;
  auto back = DecodeMemberRecord(EncodeMemberRecord(r));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->member, r.member);
  EXPECT_EQ(back->protocol, 1u);
  for (const char* bad :
       {"", "null", "[]", "{", "{\"id\":\"a\"}", "{\"id\":1,\"address\":\"a:1\",\"capacity_bytes\":1,\"used_bytes\":1,\"protocol\":1}",
        "{\"id\":\"a\",\"address\":\"a:1\",\"capacity_bytes\":-1,\"used_bytes\":1,\"protocol\":1}",
        "{\"id\":\"\",\"address\":\"a:1\",\"capacity_bytes\":1,\"used_bytes\":1,\"protocol\":1}",
        "{\"id\":\"a\",\"address\":\"a:1\",\"capacity_bytes\":1.5,\"used_bytes\":1,\"protocol\":1}"}) {
    EXPECT_EQ(DecodeMemberRecord(bad).status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
}

TEST_F(EtcdTest, KeyValueAndLeases) {
  auto c = Client();
  ASSERT_TRUE(c->Put("/a/1", "x").ok());
  ASSERT_TRUE(c->Put("/a/2", "y").ok());
  ASSERT_TRUE(c->Put("/b/1", "z").ok());
  auto got = c->GetPrefix("/a/");
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_EQ(got->first.size(), 2u);
  EXPECT_EQ(got->first[1].value, "y");
  EXPECT_EQ(*c->Delete("/a/1"), 1);
  auto lease = c->LeaseGrant(30);
  ASSERT_TRUE(lease.ok()) << lease.status();
  ASSERT_TRUE(c->Put("/l/k", "v", *lease).ok());
  auto ttl = c->LeaseTimeToLive(*lease);
  ASSERT_TRUE(ttl.ok());
  EXPECT_GT(*ttl, 20);
  EXPECT_TRUE(c->LeaseKeepAlive(*lease).ok());
  ASSERT_TRUE(c->LeaseRevoke(*lease).ok());
  EXPECT_TRUE(c->GetPrefix("/l/")->first.empty());  // revoking deletes the key
  EXPECT_EQ(c->LeaseKeepAlive(*lease).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(c->LeaseTimeToLive(*lease).status().code(), absl::StatusCode::kNotFound);
}

TEST_F(EtcdTest, UnreachableEtcdIsUnavailable) {
  auto c = EtcdClient::Connect({"http://127.0.0.1:" + std::to_string(testing::FreePort())},
                               absl::Milliseconds(500));
  ASSERT_TRUE(c.ok());
  EXPECT_EQ((*c)->Put("/x", "y").status().code(), absl::StatusCode::kUnavailable);
  // A second, live endpoint is used when the first is down.
  auto both = EtcdClient::Connect({"http://127.0.0.1:" + std::to_string(testing::FreePort()),
                                   etcd_->endpoint()},
                                  absl::Milliseconds(500));
  ASSERT_TRUE(both.ok());
  EXPECT_TRUE((*both)->Put("/x", "y").ok());
}

TEST_F(EtcdTest, MembersSeeEachOtherJoinAndLeave) {
  auto a = Join("node-1");
  auto b = Join("node-2");
  auto c = Join("node-3");
  ASSERT_TRUE(a && b && c);
  EXPECT_TRUE(Eventually([&] { return a->LiveMembers().size() == 3; }));
  auto m = a->LiveMembers();
  EXPECT_EQ(m[1].id, "node-2");
  EXPECT_EQ(m[1].capacity_bytes, 1000u);
  EXPECT_EQ(m[1].used_bytes, 42u);
  c.reset();  // leaves cleanly: the lease is revoked
  EXPECT_TRUE(Eventually([&] { return a->LiveMembers().size() == 2 && b->LiveMembers().size() == 2; }));
  auto st = ListMembers(*Client(), cluster_);
  ASSERT_TRUE(st.ok()) << st.status();
  ASSERT_EQ(st->size(), 2u);
  EXPECT_GE((*st)[0].ttl_left_s, 0);
  EXPECT_LE((*st)[0].ttl_left_s, 2);
}

TEST_F(EtcdTest, AMemberWhoseLeaseExpiresIsDroppedAndCanRejoin) {
  auto a = Join("node-1");
  ASSERT_TRUE(a);
  // node-2 registers by hand with a short lease and never renews it, as a
  // kvtierd killed with SIGKILL would.
  auto c = Client();
  auto lease = c->LeaseGrant(2);
  ASSERT_TRUE(lease.ok());
  MemberRecord r;
  r.member = {"node-2", "127.0.0.1:7002", "", 1, 0};
  r.protocol = 1;
  ASSERT_TRUE(c->Put(MembersPrefix(cluster_) + "node-2", EncodeMemberRecord(r), *lease).ok());
  EXPECT_TRUE(Eventually([&] { return a->LiveMembers().size() == 2; }));
  EXPECT_TRUE(Eventually([&] { return a->LiveMembers().size() == 1; }));  // lease ran out
  auto b = Join("node-2");  // it restarts and rejoins
  ASSERT_TRUE(b);
  EXPECT_TRUE(Eventually([&] { return a->LiveMembers().size() == 2; }));
  // A's own lease keeps it listed well past its TTL. This sleep is the
  // condition under test: it lets the clock pass the 2 s TTL.
  std::this_thread::sleep_for(std::chrono::milliseconds(2500));
  EXPECT_EQ(b->LiveMembers().size(), 2u);
}

TEST_F(EtcdTest, MalformedRecordsInEtcdAreIgnored) {
  auto c = Client();
  ASSERT_TRUE(c->Put(MembersPrefix(cluster_) + "evil", "{not json").ok());
  ASSERT_TRUE(c->Put(MembersPrefix(cluster_) + "evil2", std::string(1000, '\xff')).ok());
  auto a = Join("node-1");
  ASSERT_TRUE(a);
  EXPECT_EQ(a->LiveMembers().size(), 1u);
  ASSERT_TRUE(c->Put(MembersPrefix(cluster_) + "evil3", "[1,2,3]").ok());
  // The watch delivers events in order: once a valid record put after evil3
  // has come and gone, evil3 has been seen too.
  auto lease = c->LeaseGrant(10);
  ASSERT_TRUE(lease.ok());
  MemberRecord r;
  r.member = {"node-9", "127.0.0.1:7009", "", 1, 0};
  r.protocol = 1;
  ASSERT_TRUE(c->Put(MembersPrefix(cluster_) + "node-9", EncodeMemberRecord(r), *lease).ok());
  auto listed = [&] {
    for (const auto& m : a->LiveMembers()) {
      if (m.id == "node-9") return true;
    }
    return false;
  };
  ASSERT_TRUE(Eventually(listed));
  ASSERT_TRUE(c->Delete(MembersPrefix(cluster_) + "node-9").ok());
  ASSERT_TRUE(Eventually([&] { return !listed(); }));
  EXPECT_EQ(a->LiveMembers().size(), 1u);
}

// A well-formed member record put without a lease (a forged or stale record:
// no kvtierd writes one) is never a member, whether it is in etcd before a
// node joins (read at Join) or written afterwards (seen through the watch).
TEST_F(EtcdTest, RecordsWithoutALeaseAreNotMembers) {
  auto c = Client();
  auto record = [](const std::string& id, int port) {
    MemberRecord r;
    r.member = {id, "127.0.0.1:" + std::to_string(port), "", 1000, 0};
    r.protocol = 1;
    return EncodeMemberRecord(r);
  };
  ASSERT_TRUE(c->Put(MembersPrefix(cluster_) + "forged-1", record("forged-1", 7101)).ok());
  auto a = Join("node-1");
  ASSERT_TRUE(a);
  EXPECT_EQ(a->LiveMembers().size(), 1u);
  ASSERT_TRUE(c->Put(MembersPrefix(cluster_) + "forged-2", record("forged-2", 7102)).ok());
  // A member with a lease written after the forged record: once the watch
  // has delivered it, it has delivered the forged record too.
  auto b = Join("node-2");
  ASSERT_TRUE(b);
  ASSERT_TRUE(Eventually([&] { return a->LiveMembers().size() >= 2; }));
  std::vector<std::string> ids;
  for (const auto& m : a->LiveMembers()) ids.push_back(m.id);
  EXPECT_THAT(ids, ::testing::ElementsAre("node-1", "node-2"));
  ids.clear();
  for (const auto& m : b->LiveMembers()) ids.push_back(m.id);
  EXPECT_THAT(ids, ::testing::ElementsAre("node-1", "node-2"));
  // `kvtier cluster status` lists the members only.
  auto st = ListMembers(*c, cluster_);
  ASSERT_TRUE(st.ok()) << st.status();
  ASSERT_EQ(st->size(), 2u);
  EXPECT_EQ((*st)[0].record.member.id, "node-1");
  EXPECT_EQ((*st)[1].record.member.id, "node-2");
}

TEST_F(EtcdTest, JoinRejectsBadOptions) {
  MembershipOptions o;
  o.cluster = "bad/name";
  o.advertise = "h:1";
  EXPECT_EQ(Membership::Join(o, Client()).status().code(), absl::StatusCode::kInvalidArgument);
  o.cluster = "ok";
  o.advertise = "";
  EXPECT_EQ(Membership::Join(o, Client()).status().code(), absl::StatusCode::kInvalidArgument);
  o.advertise = "h:1";
  o.lease_ttl_s = 0;
  EXPECT_EQ(Membership::Join(o, Client()).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvtier::cluster
