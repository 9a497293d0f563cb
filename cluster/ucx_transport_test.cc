// UcxTransport over real UCX on loopback (tcp/shared-memory transports):
// puts, gets, sizes, erases, large rendezvous transfers, errors from the
// peer, version refusal, timeouts and a peer that dies mid-transfer.
#include "cluster/peer_address.h"
#include "cluster/ucx_transport.h"

#include <future>
#include <numeric>
#include <thread>

#include "cluster/test_peer.h"
#include "common/testing/wait.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvtier::cluster {
namespace {

using ::testing::HasSubstr;

constexpr absl::Duration kTimeout = absl::Seconds(10);

std::vector<uint8_t> Bytes(size_t n, uint8_t seed) {
  std::vector<uint8_t> b(n);
  for (size_t i = 0; i < n; ++i) b[i] = static_cast<uint8_t>(i * 31 + seed + (i >> 12));
  return b;
}

tiering::ObjectKey Id(int i, tiering::Part p = tiering::Part::kWhole) { return {Hash128::Of(std::to_string(i), 0), p}; }

struct Node {
  testing::MapPeerService service;
  std::unique_ptr<UcxTransport> transport;
  std::string addr;
};

std::unique_ptr<Node> StartNode() {
  auto n = std::make_unique<Node>();
  auto t = UcxTransport::Create({.listen = "127.0.0.1:0"}, &n->service);
  EXPECT_TRUE(t.ok()) << t.status();
  if (!t.ok()) return nullptr;
  n->transport = std::move(*t);
  n->addr = n->transport->listen_address();
  return n;
}

TEST(ParseHostPort, AcceptsHostsAndRejectsGarbage) {
  auto a = ParseHostPort("127.0.0.1:7000");
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->first, "127.0.0.1");
  EXPECT_EQ(a->second, 7000);
  auto b = ParseHostPort("[::1]:0");
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->first, "::1");
  for (const char* bad : {"", "host", ":80", "h:", "h:99999", "h:12a", "[::1]80", "[::1"}) {
    EXPECT_EQ(ParseHostPort(bad).status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
}

TEST(UcxTransport, PutGetSizeEraseRoundTrip) {
  auto server = StartNode();
  ASSERT_TRUE(server);
  EXPECT_THAT(server->addr, HasSubstr("127.0.0.1:"));
  auto client = UcxTransport::Create({}, nullptr);
  ASSERT_TRUE(client.ok()) << client.status();
  auto& c = **client;
  ASSERT_TRUE(c.Ping(server->addr, kTimeout).ok());
  for (size_t n : {size_t{0}, size_t{1}, size_t{4000}, size_t{300000}, size_t{25182336}}) {
    auto data = Bytes(n, static_cast<uint8_t>(n));
    tiering::ObjectKey id = Id(static_cast<int>(n));
    ASSERT_TRUE(c.Put(server->addr, id, data, kTimeout).ok()) << n;
    auto size = c.Size(server->addr, id, kTimeout);
    ASSERT_TRUE(size.ok()) << size.status();
    EXPECT_EQ(*size, n);
    std::vector<uint8_t> out(n, 0);
    ASSERT_TRUE(c.Get(server->addr, id, out, kTimeout).ok()) << n;
    EXPECT_EQ(out, data) << n;
  }
  EXPECT_TRUE(c.Erase(server->addr, Id(4000), kTimeout).ok());
  EXPECT_EQ(c.Erase(server->addr, Id(4000), kTimeout).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(server->service.count(), 4u);
}

TEST(UcxTransport, PeersReachedByWorkerAddressWork) {
  auto server = StartNode();
  ASSERT_TRUE(server);
  std::string wa = server->transport->worker_address();
  ASSERT_EQ(wa.rfind("ucx:", 0), 0u);
  auto client = UcxTransport::Create({}, nullptr);
  ASSERT_TRUE(client.ok());
  auto data = Bytes(8 << 20, 5);
  ASSERT_TRUE((*client)->Put(wa, Id(1), data, kTimeout).ok());
  std::vector<uint8_t> out(data.size());
  ASSERT_TRUE((*client)->Get(wa, Id(1), out, kTimeout).ok());
  EXPECT_EQ(out, data);
  EXPECT_EQ((*client)->Ping("ucx:zz", kTimeout).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*client)->Ping("ucx:abc", kTimeout).code(), absl::StatusCode::kInvalidArgument);
}

// A peer reached by its worker address that goes away: its endpoint is
// dropped when it fails, and no later call uses it again.
TEST(UcxTransport, PeerReachedByWorkerAddressThatGoesAwayIsUnavailable) {
  auto server = StartNode();
  ASSERT_TRUE(server);
  const std::string worker = server->transport->worker_address();
  auto client = UcxTransport::Create({}, nullptr);
  ASSERT_TRUE(client.ok()) << client.status();
  ASSERT_EQ((*client)->Size(worker, Id(1), kTimeout).status().code(), absl::StatusCode::kNotFound);
  server.reset();  // its connections close; the client's endpoint fails
  for (int i = 0; i < 5; ++i) {
    auto s = (*client)->Size(worker, Id(1), absl::Milliseconds(500)).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << i << ": " << s;
  }
}

TEST(UcxTransport, PeerErrorsPassThroughWithTheirCode) {
  auto server = StartNode();
  ASSERT_TRUE(server);
  auto client = UcxTransport::Create({}, nullptr);
  ASSERT_TRUE(client.ok());
  std::vector<uint8_t> out(10);
  auto miss = (*client)->Get(server->addr, Id(77), out, kTimeout);
  EXPECT_EQ(miss.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(miss.message(), HasSubstr("no such object"));
  EXPECT_EQ((*client)->Size(server->addr, Id(77), kTimeout).status().code(),
            absl::StatusCode::kNotFound);
  server->service.set_capacity(100);
  auto full = (*client)->Put(server->addr, Id(1), Bytes(1000, 1), kTimeout);
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted);
  server->service.set_capacity(1 << 30);
  ASSERT_TRUE((*client)->Put(server->addr, Id(2), Bytes(1000, 1), kTimeout).ok());
  std::vector<uint8_t> wrong(999);
  EXPECT_EQ((*client)->Get(server->addr, Id(2), wrong, kTimeout).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(UcxTransport, LargePutIntoSmallLimitIsRefused) {
  testing::MapPeerService service;
  auto server = UcxTransport::Create({.listen = "127.0.0.1:0", .max_object_bytes = 1 << 20}, &service);
  ASSERT_TRUE(server.ok());
  auto client = UcxTransport::Create({}, nullptr);
  auto s = (*client)->Put((*server)->listen_address(), Id(1), Bytes(2 << 20, 3), kTimeout);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("limit"));
  EXPECT_EQ(service.count(), 0u);
  // The connection still works after a refusal.
  EXPECT_TRUE((*client)->Put((*server)->listen_address(), Id(2), Bytes(1000, 3), kTimeout).ok());
}

TEST(UcxTransport, IncompatibleVersionIsRefusedWithAClearError) {
  auto server = StartNode();
  ASSERT_TRUE(server);
  auto client = UcxTransport::Create({}, nullptr);
  auto s = (*client)->PingWithVersion(server->addr, 7, kTimeout);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("version 7"));
  EXPECT_TRUE((*client)->Ping(server->addr, kTimeout).ok());
}

TEST(UcxTransport, UnreachablePeerIsUnavailable) {
  auto client = UcxTransport::Create({}, nullptr);
  ASSERT_TRUE(client.ok());
  // Nothing listens there (a port just released by a listener we closed).
  std::string dead;
  {
    auto tmp = StartNode();
    ASSERT_TRUE(tmp);
    dead = tmp->addr;
  }
  auto s = (*client)->Ping(dead, absl::Seconds(3));
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_EQ((*client)->Ping("no-such-host.invalid:1", absl::Seconds(3)).code(),
            absl::StatusCode::kUnavailable);
}

TEST(UcxTransport, PeerThatNeverAnswersIsUnavailableAfterTheConnectTimeout) {
  testing::SilentListener silent;
  ASSERT_FALSE(silent.addr().empty());
  UcxTransportOptions options;
  options.connect_timeout = absl::Milliseconds(300);
  auto client = UcxTransport::Create(options, nullptr);
  ASSERT_TRUE(client.ok()) << client.status();
  std::vector<uint8_t> out(4096);
  auto data = Bytes(4096, 1);
  // Each call gives up after the connect timeout, not its own 10 s.
  for (int op = 0; op < 3; ++op) {
    absl::Time t0 = absl::Now();
    absl::Status s = op == 0   ? (*client)->Size(silent.addr(), Id(1), kTimeout).status()
                     : op == 1 ? (*client)->Get(silent.addr(), Id(1), out, kTimeout)
                               : (*client)->Put(silent.addr(), Id(1), data, kTimeout);
    absl::Duration took = absl::Now() - t0;
    EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << op << ": " << s;
    EXPECT_LT(took, absl::Seconds(3)) << op << ": " << s;
  }
  // A live peer is reached as before, and a call's own shorter timeout
  // still bounds it.
  auto server = StartNode();
  ASSERT_TRUE(server);
  ASSERT_TRUE((*client)->Put(server->addr, Id(2), data, kTimeout).ok());
  ASSERT_TRUE((*client)->Get(server->addr, Id(2), out, kTimeout).ok());
  EXPECT_EQ(out, data);
  absl::Time t0 = absl::Now();
  EXPECT_EQ((*client)->Ping(silent.addr(), absl::Milliseconds(100)).code(),
            absl::StatusCode::kUnavailable);
  EXPECT_LT(absl::Now() - t0, absl::Seconds(3));
}

TEST(UcxTransport, SlowPeerTimesOutAsUnavailableAndLateReplyIsIgnored) {
  auto server = StartNode();
  ASSERT_TRUE(server);
  auto client = UcxTransport::Create({}, nullptr);
  auto data = Bytes(1 << 20, 9);
  ASSERT_TRUE((*client)->Put(server->addr, Id(5), data, kTimeout).ok());
  const int answered = server->service.gets_past_delay();
  auto hold = server->service.HoldGets();  // the peer answers no get until released
  std::vector<uint8_t> out(data.size(), 0);
  auto s = (*client)->Get(server->addr, Id(5), out, absl::Milliseconds(200));
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_THAT(s.message(), HasSubstr("did not answer"));
  hold.Release();
  // The peer answers the timed-out get late; the next get may overlap it.
  ASSERT_TRUE(::kvtier::testing::WaitUntil(
      [&] { return server->service.gets_past_delay() > answered; }, std::chrono::seconds(10)));
  std::vector<uint8_t> again(data.size(), 0);
  ASSERT_TRUE((*client)->Get(server->addr, Id(5), again, kTimeout).ok());
  EXPECT_EQ(again, data);
}

// The peer holds the get (its service has not answered) until its
// connections are cut, so the get is in flight when the peer dies, however
// slow the machine.
TEST(UcxTransport, PeerDyingMidTransferGivesUnavailable) {
  auto server = StartNode();
  ASSERT_TRUE(server);
  auto client = UcxTransport::Create({}, nullptr);
  auto data = Bytes(64 << 20, 4);
  ASSERT_TRUE((*client)->Put(server->addr, Id(1), data, kTimeout).ok());
  const int begun = server->service.gets_begun();
  auto hold = server->service.HoldGets();
  std::vector<uint8_t> out(data.size(), 0);
  auto pending = std::async(std::launch::async, [&] {
    return (*client)->Get(server->addr, Id(1), out, kTimeout);
  });
  ASSERT_TRUE(::kvtier::testing::WaitUntil([&] { return server->service.gets_begun() > begun; },
                                           std::chrono::seconds(10)));
  // The peer dies: its listener and connections close with the get
  // unanswered, then it goes (its held service call ends, answering no one).
  server->transport->DropAllConnections();
  hold.Release();
  server.reset();
  absl::Status s = pending.get();
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_THAT(s.message(), HasSubstr("closed the connection"));
}

TEST(UcxTransport, ManyConcurrentCallersGetTheirOwnBytes) {
  auto server = StartNode();
  ASSERT_TRUE(server);
  auto client = UcxTransport::Create({}, nullptr);
  std::vector<std::thread> threads;
  std::atomic<int> bad{0};
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 20; ++i) {
        int k = t * 100 + i;
        auto data = Bytes(1000 + 5000 * (k % 7), static_cast<uint8_t>(k));
        if (!(*client)->Put(server->addr, Id(k), data, kTimeout).ok()) ++bad;
        std::vector<uint8_t> out(data.size());
        if (!(*client)->Get(server->addr, Id(k), out, kTimeout).ok() || out != data) ++bad;
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(bad.load(), 0);
  EXPECT_EQ(server->service.count(), 160u);
}

TEST(UcxTransport, RegisteredMemoryIsUsedForZeroCopyTransfers) {
  auto server = StartNode();
  ASSERT_TRUE(server);
  auto client = UcxTransport::Create({}, nullptr);
  std::vector<uint8_t> pool(32 << 20);
  ASSERT_TRUE((*client)->RegisterMemory(pool.data(), pool.size()).ok());
  auto data = Bytes(24 << 20, 8);
  std::memcpy(pool.data(), data.data(), data.size());
  ASSERT_TRUE((*client)->Put(server->addr, Id(3), {pool.data(), data.size()}, kTimeout).ok());
  std::memset(pool.data(), 0, pool.size());
  ASSERT_TRUE((*client)->Get(server->addr, Id(3), {pool.data(), data.size()}, kTimeout).ok());
  EXPECT_EQ(0, std::memcmp(pool.data(), data.data(), data.size()));
}

}  // namespace
}  // namespace kvtier::cluster
