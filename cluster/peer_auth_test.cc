// The cluster peers' challenge-response (peer_auth.h): the computations and
// message codecs directly, then over real UCX on loopback: nodes with the
// same secret talk, a node with a wrong or missing secret can neither read
// nor write, and hostile handshake messages (truncated, oversized, replayed,
// forged) are refused, counted and end the connection.
#include "cluster/peer_auth.h"

#include <atomic>
#include <thread>

#include "cluster/test_peer.h"
#include "cluster/ucx_transport.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvtier::cluster {
namespace {

using ::testing::HasSubstr;

const std::string kSecret = "0123456789abcdef0123456789abcdef-cluster-a";
const std::string kOtherSecret = "0123456789abcdef0123456789abcdef-cluster-b";
constexpr absl::Duration kTimeout = absl::Seconds(10);

PeerAuthenticator Auth(const std::string& secret, const std::string& id) {
  auto a = PeerAuthenticator::Create(secret, id);
  EXPECT_TRUE(a.ok()) << a.status();
  return *std::move(a);
}

TEST(PeerAuth, SameSecretAuthenticatesBothWays) {
  PeerAuthenticator client = Auth(kSecret, "node-a"), server = Auth(kSecret, "node-b");
  auto hello = client.NewHello().value();
  auto challenge = server.Answer(hello).value();
  EXPECT_EQ(challenge.server_id, "node-b");
  auto proof = client.Prove(hello, challenge);
  ASSERT_TRUE(proof.ok()) << proof.status();
  EXPECT_TRUE(server.Verify(hello, challenge, *proof).ok());
  // Fresh nonces: two handshakes never share a challenge.
  auto hello2 = client.NewHello().value();
  EXPECT_NE(hello.client_nonce, hello2.client_nonce);
  EXPECT_NE(server.Answer(hello).value().server_nonce, challenge.server_nonce);
}

TEST(PeerAuth, WrongSecretFailsOnEitherSide) {
  PeerAuthenticator good = Auth(kSecret, "node-a"), bad = Auth(kOtherSecret, "node-x");
  // A server with the wrong secret: the client refuses its challenge.
  auto hello = good.NewHello().value();
  auto challenge = bad.Answer(hello).value();
  auto proof = good.Prove(hello, challenge);
  EXPECT_EQ(proof.status().code(), absl::StatusCode::kUnauthenticated);
  EXPECT_THAT(proof.status().message(), HasSubstr("node-x"));
  // A client with the wrong secret: it cannot check the server's MAC, and a
  // proof it makes anyway does not verify.
  auto hello2 = bad.NewHello().value();
  auto challenge2 = good.Answer(hello2).value();
  AuthProof forged{hello2.client_nonce, {}};
  forged.client_mac = HmacSha256(AsBytes(kOtherSecret), {"anything"});
  EXPECT_EQ(good.Verify(hello2, challenge2, forged).code(), absl::StatusCode::kUnauthenticated);
}

TEST(PeerAuth, ReflectedAndReplayedProofsFail) {
  PeerAuthenticator a = Auth(kSecret, "node-a"), b = Auth(kSecret, "node-b");
  auto hello = a.NewHello().value();
  auto challenge = b.Answer(hello).value();
  auto proof = a.Prove(hello, challenge).value();
  // The server's own MAC sent back as the client's proof (reflection).
  AuthProof reflected{hello.client_nonce, challenge.server_mac};
  EXPECT_EQ(b.Verify(hello, challenge, reflected).code(), absl::StatusCode::kUnauthenticated);
  // A proof recorded from one handshake, replayed against a new challenge.
  auto challenge2 = b.Answer(hello).value();
  EXPECT_EQ(b.Verify(hello, challenge2, proof).code(), absl::StatusCode::kUnauthenticated);
  // A server that echoes the client's nonce is refused.
  AuthChallenge echo = challenge;
  echo.server_nonce = hello.client_nonce;
  EXPECT_EQ(a.Prove(hello, echo).status().code(), absl::StatusCode::kInvalidArgument);
  // Node ids are bound into the MAC: the same challenge for another claimed id fails.
  AuthHello renamed = hello;
  renamed.client_id = "node-z";
  EXPECT_EQ(b.Verify(renamed, challenge, proof).code(), absl::StatusCode::kUnauthenticated);
}

TEST(PeerAuth, ShortSecretsAndBadNodeIdsAreRefused) {
  EXPECT_EQ(PeerAuthenticator::Create("short", "n").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(PeerAuthenticator::Create(kSecret, "").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(PeerAuthenticator::Create(kSecret, std::string(kMaxAuthNodeIdBytes + 1, 'n')).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(PeerAuth, MessagesRoundTripAndHostileBytesAreInvalidArgument) {
  AuthHello h{{}, "node-a"};
  h.client_nonce[0] = 7;
  auto hd = DecodeHello(EncodeHello(h));
  ASSERT_TRUE(hd.ok());
  EXPECT_EQ(hd->client_nonce, h.client_nonce);
  EXPECT_EQ(hd->client_id, "node-a");
  AuthChallenge c{{}, {}, "node-b"};
  c.server_mac[31] = 9;
  auto cd = DecodeChallenge(EncodeChallenge(c));
  ASSERT_TRUE(cd.ok());
  EXPECT_EQ(cd->server_mac, c.server_mac);
  EXPECT_EQ(cd->server_id, "node-b");
  AuthProof p{{}, {}};
  p.client_mac[3] = 1;
  EXPECT_EQ(DecodeProof(EncodeProof(p))->client_mac, p.client_mac);

  std::vector<uint8_t> hello = EncodeHello(h);
  std::vector<uint8_t> challenge = EncodeChallenge(c);
  std::vector<uint8_t> proof = EncodeProof(p);
  // Truncated at every length, and one byte too long or far too long.
  for (size_t n = 0; n < kAuthNonceBytes + 1; ++n) {
    EXPECT_EQ(DecodeHello({hello.data(), n}).status().code(), absl::StatusCode::kInvalidArgument) << n;
  }
  for (size_t n = 0; n < kAuthNonceBytes + kAuthMacBytes + 1; ++n) {
    EXPECT_EQ(DecodeChallenge({challenge.data(), n}).status().code(), absl::StatusCode::kInvalidArgument) << n;
  }
  for (size_t n = 0; n < proof.size(); ++n) {
    EXPECT_EQ(DecodeProof({proof.data(), n}).status().code(), absl::StatusCode::kInvalidArgument) << n;
  }
  proof.push_back(0);
  EXPECT_EQ(DecodeProof(proof).status().code(), absl::StatusCode::kInvalidArgument);
  std::vector<uint8_t> huge(kMaxAuthMessageBytes + 1, 'x');
  EXPECT_EQ(DecodeHello(huge).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(DecodeChallenge(huge).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(DecodeHello(huge).status().message(), HasSubstr("hello of 321 bytes"));
}

TEST(NonceHistory, RefusesRepeatsAndForgetsTheOldest) {
  NonceHistory h(2);
  AuthNonce a{}, b{}, c{};
  a[0] = 1;
  b[0] = 2;
  c[0] = 3;
  EXPECT_TRUE(h.Insert(a));
  EXPECT_FALSE(h.Insert(a));
  EXPECT_TRUE(h.Insert(b));
  EXPECT_TRUE(h.Insert(c));  // `a` falls out
  EXPECT_FALSE(h.Insert(c));
  EXPECT_TRUE(h.Insert(a));
}

// --- over UCX ---

tiering::ObjectKey Id(int i) { return {Hash128::Of(std::to_string(i), 0), tiering::Part::kWhole}; }

struct Node {
  testing::MapPeerService service;
  std::unique_ptr<UcxTransport> transport;
  std::string addr;
};

std::unique_ptr<Node> StartNode(const std::string& secret, const std::string& id) {
  auto n = std::make_unique<Node>();
  UcxTransportOptions o;
  o.listen = "127.0.0.1:0";
  o.cluster_secret = secret;
  o.node_id = id;
  auto t = UcxTransport::Create(o, &n->service);
  EXPECT_TRUE(t.ok()) << t.status();
  if (!t.ok()) return nullptr;
  n->transport = std::move(*t);
  n->addr = n->transport->listen_address();
  return n;
}

std::unique_ptr<UcxTransport> Client(const std::string& secret, const std::string& id) {
  UcxTransportOptions o;
  o.cluster_secret = secret;
  o.node_id = id;
  auto t = UcxTransport::Create(o, nullptr);
  EXPECT_TRUE(t.ok()) << t.status();
  return t.ok() ? std::move(*t) : nullptr;
}

// A node holding kSecret (`server`) and, for the tests that want one, a
// client of it that holds the secret too.
class UcxPeerAuth : public ::testing::Test {
 protected:
  void SetUp() override {
    server = StartNode(kSecret, "server");
    ASSERT_TRUE(server);
    member = Client(kSecret, "member");
    ASSERT_TRUE(member);
  }
  std::unique_ptr<Node> server;
  std::unique_ptr<UcxTransport> member;
};

TEST_F(UcxPeerAuth, NodesWithTheSecretPutAndGetAfterOneHandshake) {
  UcxTransport* c = member.get();
  std::vector<uint8_t> data(5000, 0x5a);
  ASSERT_TRUE(c->Put(server->addr, Id(1), data, kTimeout).ok());
  std::vector<uint8_t> out(data.size());
  ASSERT_TRUE(c->Get(server->addr, Id(1), out, kTimeout).ok());
  EXPECT_EQ(out, data);
  EXPECT_EQ(c->Size(server->addr, Id(1), kTimeout).value(), data.size());
  EXPECT_TRUE(c->Erase(server->addr, Id(1), kTimeout).ok());
  EXPECT_EQ(c->auth_successes(), 1u);  // one connection, one handshake
  EXPECT_EQ(server->transport->auth_successes(), 1u);
  EXPECT_EQ(server->transport->auth_failures(), 0u);
  // By worker address too (the path cluster members use).
  ASSERT_TRUE(c->Put(server->transport->worker_address(), Id(2), data, kTimeout).ok());
  EXPECT_EQ(server->service.count(), 1u);
}

// Concurrent first calls to a peer share one handshake.
TEST_F(UcxPeerAuth, ConcurrentFirstCallsRunOneHandshake) {
  UcxTransport* c = member.get();
  std::vector<std::thread> threads;
  std::atomic<int> ok{0};
  for (int i = 0; i < 12; ++i) {
    threads.emplace_back([&, i] {
      std::vector<uint8_t> data(1000 + i, static_cast<uint8_t>(i));
      if (c->Put(server->addr, Id(100 + i), data, kTimeout).ok()) ok.fetch_add(1);
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(ok.load(), 12);
  EXPECT_EQ(c->auth_successes(), 1u);
  EXPECT_EQ(server->transport->auth_failures(), 0u);
  EXPECT_EQ(server->service.count(), 12u);
}

TEST_F(UcxPeerAuth, WrongOrMissingSecretCannotReadOrWrite) {
  UcxTransport* good = member.get();
  std::vector<uint8_t> data(4096, 0x11);
  ASSERT_TRUE(good->Put(server->addr, Id(1), data, kTimeout).ok());

  // A wrong secret: the client refuses the server's challenge.
  auto wrong = Client(kOtherSecret, "intruder");
  ASSERT_TRUE(wrong);
  std::vector<uint8_t> out(data.size());
  for (const std::string& peer : {server->addr, server->transport->worker_address()}) {
    absl::Status g = wrong->Get(peer, Id(1), out, kTimeout);
    EXPECT_EQ(g.code(), absl::StatusCode::kUnauthenticated) << g;
    EXPECT_THAT(g.message(), HasSubstr("does not hold this cluster's secret"));
    EXPECT_EQ(wrong->Put(peer, Id(2), data, kTimeout).code(), absl::StatusCode::kUnauthenticated);
  }
  EXPECT_GE(wrong->auth_failures(), 2u);

  // No secret at all: the chunk request itself is refused and counted.
  auto none = UcxTransport::Create({}, nullptr);
  ASSERT_TRUE(none.ok());
  const uint64_t before = server->transport->auth_failures();
  absl::Status g = (*none)->Get(server->addr, Id(1), out, kTimeout);
  EXPECT_EQ(g.code(), absl::StatusCode::kUnauthenticated) << g;
  EXPECT_THAT(g.message(), HasSubstr("requires cluster authentication"));
  EXPECT_EQ((*none)->Put(server->addr, Id(3), data, kTimeout).code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ((*none)->Erase(server->addr, Id(1), kTimeout).code(), absl::StatusCode::kUnauthenticated);
  EXPECT_GE(server->transport->auth_failures(), before + 3);
  EXPECT_EQ(server->service.count(), 1u);  // nothing written, nothing erased

  // A node with a secret does not talk to one without.
  auto open_server = StartNode("", "open");
  ASSERT_TRUE(open_server);
  EXPECT_EQ(good->Put(open_server->addr, Id(4), data, kTimeout).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(open_server->service.count(), 0u);

  // The good client still works after all of that.
  ASSERT_TRUE(good->Get(server->addr, Id(1), out, kTimeout).ok());
  EXPECT_EQ(out, data);
}

TEST_F(UcxPeerAuth, HostileHandshakeMessagesAreRefusedAndCounted) {
  auto raw = UcxTransport::Create({}, nullptr);
  ASSERT_TRUE(raw.ok());
  UcxTransport& r = **raw;
  // Truncated and oversized hellos.
  std::vector<uint8_t> truncated(10, 1);
  auto t = r.SendAuthMessage(server->addr, Op::kHello, truncated, kTimeout);
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument) << t.status();
  EXPECT_THAT(t.status().message(), HasSubstr("hello of 10 bytes"));
  std::vector<uint8_t> oversized(kMaxAuthMessageBytes + 100, 1);
  auto o = r.SendAuthMessage(server->addr, Op::kHello, oversized, kTimeout);
  EXPECT_EQ(o.status().code(), absl::StatusCode::kInvalidArgument) << o.status();
  // A proof with no challenge, and a forged one.
  std::vector<uint8_t> proof(kAuthNonceBytes + kAuthMacBytes, 2);
  auto p = r.SendAuthMessage(server->addr, Op::kProof, proof, kTimeout);
  EXPECT_EQ(p.status().code(), absl::StatusCode::kUnauthenticated) << p.status();
  // A well-formed hello, then a replay of it: the nonce is refused.
  PeerAuthenticator a = Auth(kSecret, "replayer");
  AuthHello hello = a.NewHello().value();
  auto first = r.SendAuthMessage(server->addr, Op::kHello, EncodeHello(hello), kTimeout);
  ASSERT_TRUE(first.ok()) << first.status();
  auto challenge = DecodeChallenge(*first);
  ASSERT_TRUE(challenge.ok());
  EXPECT_EQ(challenge->server_id, "server");
  auto replay = r.SendAuthMessage(server->addr, Op::kHello, EncodeHello(hello), kTimeout);
  EXPECT_EQ(replay.status().code(), absl::StatusCode::kInvalidArgument) << replay.status();
  EXPECT_THAT(replay.status().message(), HasSubstr("replayed nonce"));
  // A proof with a wrong MAC for an open challenge.
  auto hello2 = a.NewHello().value();
  auto second = r.SendAuthMessage(server->addr, Op::kHello, EncodeHello(hello2), kTimeout);
  ASSERT_TRUE(second.ok()) << second.status();
  AuthProof bad{hello2.client_nonce, {}};
  auto b = r.SendAuthMessage(server->addr, Op::kProof, EncodeProof(bad), kTimeout);
  EXPECT_EQ(b.status().code(), absl::StatusCode::kUnauthenticated) << b.status();
  EXPECT_GE(server->transport->auth_failures(), 5u);
  EXPECT_EQ(server->transport->auth_successes(), 0u);
  // The server keeps serving members.
  std::vector<uint8_t> data(100, 3);
  EXPECT_TRUE(member->Put(server->addr, Id(9), data, kTimeout).ok());
}

}  // namespace
}  // namespace kvtier::cluster
