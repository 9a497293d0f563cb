// ClusterTier over three nodes on loopback, each a real UcxTransport serving
// an in-memory store: replication, fallback to the other replica when a
// member dies, rejoin, network faults (drops, delays, corrupted transfers)
// that never return a corrupted chunk, and members that are unreachable or
// never answer, which turn a read into a miss, not an error.
#include "cluster/cluster_tier.h"

#include "cluster/test_peer.h"
#include "cluster/ucx_transport.h"
#include "codec/codec.h"
#include "codec/test_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvtier::cluster {
namespace {

std::vector<uint8_t> Chunk(uint32_t seed) {
  codec::Geometry g{2, 2, 16, 32, 16};
  auto spec = codec::testing::MakeSpec(g, codec::DType::kBF16,
                                       {codec::DType::kBF16, codec::ScaleGranularity::kNone},
                                       {codec::DType::kFP8E4M3, codec::ScaleGranularity::kPerBlockHead});
  auto k = codec::testing::MakeKv(g, codec::DType::kBF16, {.seed = seed});
  auto v = codec::testing::MakeKv(g, codec::DType::kBF16, {.seed = seed + 1000});
  return *codec::EncodeChunk(spec, {k, v});
}

tiering::ObjectKey Id(int i) { return {Hash128::Of(std::to_string(i), 0), tiering::Part::kWhole}; }

struct Node {
  std::string id;
  testing::MapPeerService store;
  std::unique_ptr<UcxTransport> transport;
  std::unique_ptr<StaticMemberView> view;
  std::unique_ptr<FaultInjectingTransport> faulty;
  std::unique_ptr<ClusterTier> tier;
};

class Cluster : public ::testing::Test {
 protected:
  void SetUp() override {
    for (int i = 0; i < 3; ++i) Start(i);
    Publish();
  }
  void Start(int i) {
    auto& n = nodes_[i];
    n = std::make_unique<Node>();
    n->id = "node-" + std::to_string(i + 1);
    auto t = UcxTransport::Create({.listen = "127.0.0.1:0"}, &n->store);
    ASSERT_TRUE(t.ok()) << t.status();
    n->transport = std::move(*t);
    n->view = std::make_unique<StaticMemberView>(n->id);
    n->faulty = std::make_unique<FaultInjectingTransport>(n->transport.get());
    n->tier = std::make_unique<ClusterTier>(Options(), n->view.get(), n->faulty.get(), &n->store);
  }
  ClusterTierOptions Options() {
    return {.replicas = 2, .timeout = absl::Seconds(3), .clock = &clock_};
  }
  // What etcd membership would deliver: every live node's id, listen and
  // worker address (peers connect to the worker address, as kvtierd's do),
  // and `extra` members.
  void Publish(const std::vector<Member>& extra = {}) {
    std::vector<Member> live = extra;
    for (auto& n : nodes_) {
      if (n) {
        live.push_back({n->id, n->transport->listen_address(), n->transport->worker_address(), 1 << 30, 0});
      }
    }
    for (auto& n : nodes_) {
      if (n) n->view->Set(live);
    }
  }
  // A node that holds no replica of `id` itself.
  int NonOwner(const tiering::ObjectKey& id) {
    auto owners = nodes_[0]->tier->Owners(id.key);
    for (int i = 0; i < 3; ++i) {
      if (nodes_[i]->id != owners[0].id && nodes_[i]->id != owners[1].id) return i;
    }
    return -1;
  }
  tiering::FakeClock clock_;
  std::unique_ptr<Node> nodes_[3];
};

TEST_F(Cluster, PutOnOneNodeGetOnAnother) {
  auto c = Chunk(1);
  ASSERT_TRUE(nodes_[0]->tier->Put(Id(1), c).ok());
  int copies = 0;
  for (auto& n : nodes_) copies += n->store.Has(Id(1));
  EXPECT_EQ(copies, 2);  // R = 2 owners hold it
  auto size = nodes_[2]->tier->Size(Id(1));
  ASSERT_TRUE(size.ok()) << size.status();
  std::vector<uint8_t> out(*size);
  ASSERT_TRUE(nodes_[2]->tier->Read(Id(1), out).ok());
  EXPECT_EQ(out, c);
  EXPECT_EQ(nodes_[0]->tier->Peers().size(), 2u);
  EXPECT_EQ(nodes_[0]->tier->capacity_bytes(), 2u << 30);
}

TEST_F(Cluster, EveryChunkStaysReadableWhenAnOwnerDies) {
  std::vector<std::vector<uint8_t>> chunks;
  for (int i = 0; i < 30; ++i) {
    chunks.push_back(Chunk(100 + i));
    ASSERT_TRUE(nodes_[0]->tier->Put(Id(i), chunks.back()).ok());
  }
  nodes_[1].reset();  // node 2 dies; nobody has told the others yet
  for (int i = 0; i < 30; ++i) {
    std::vector<uint8_t> out(chunks[i].size());
    ASSERT_TRUE(nodes_[2]->tier->Read(Id(i), out).ok()) << i;
    EXPECT_EQ(out, chunks[i]);
  }
  Publish();  // its lease expired: the member list drops it
  for (int i = 0; i < 30; ++i) {
    std::vector<uint8_t> out(chunks[i].size());
    ASSERT_TRUE(nodes_[0]->tier->Read(Id(i), out).ok()) << i;
    EXPECT_EQ(out, chunks[i]);
  }
}

TEST_F(Cluster, RejoinedNodeServesWhatItStillHolds) {
  auto c = Chunk(7);
  ASSERT_TRUE(nodes_[0]->tier->Put(Id(7), c).ok());
  // Move node 2's store aside, "restart" it with the same data (its NVMe
  // tier survived), at a new address.
  auto owners = nodes_[0]->tier->Owners(Id(7).key);
  int victim = owners[0].id == "node-1" ? (owners[1].id == "node-2" ? 1 : 2)
                                         : (owners[0].id == "node-2" ? 1 : 2);
  std::vector<uint8_t> held(c.size());
  auto src = nodes_[victim]->store.BeginGet(Id(7));
  ASSERT_TRUE(src.ok());
  std::copy((*src)->bytes().begin(), (*src)->bytes().end(), held.begin());
  nodes_[victim].reset();
  Publish();
  Start(victim);
  auto sink = nodes_[victim]->store.BeginPut(Id(7), held.size());
  std::copy(held.begin(), held.end(), (*sink)->buffer().begin());
  ASSERT_TRUE((*sink)->Commit(true).ok());
  Publish();
  // Only the rejoined node has it now (the other owner loses its copy).
  for (int i = 0; i < 3; ++i) {
    if (i != victim && nodes_[i]->store.Has(Id(7))) {
      ASSERT_TRUE(nodes_[i]->store.Erase(Id(7)).ok());
    }
  }
  int reader = (victim + 1) % 3;
  std::vector<uint8_t> out(c.size());
  ASSERT_TRUE(nodes_[reader]->tier->Read(Id(7), out).ok());
  EXPECT_EQ(out, c);
}

TEST_F(Cluster, CorruptReplicaIsSkippedAndNeverReturned) {
  auto c = Chunk(9);
  ASSERT_TRUE(nodes_[0]->tier->Put(Id(9), c).ok());
  auto owners = nodes_[0]->tier->Owners(Id(9).key);
  for (auto& n : nodes_) {
    if (n->id == owners[0].id) n->store.Corrupt(Id(9));
  }
  int reader = 0;
  for (int i = 0; i < 3; ++i) {
    if (nodes_[i]->id != owners[0].id && nodes_[i]->id != owners[1].id) reader = i;
  }
  std::vector<uint8_t> out(c.size());
  ASSERT_TRUE(nodes_[reader]->tier->Read(Id(9), out).ok());
  EXPECT_EQ(out, c);
  EXPECT_GE(nodes_[reader]->tier->metric(ClusterMetric::kCorruptReplicas), 1u);
  for (auto& n : nodes_) {
    if (n->id == owners[1].id) n->store.Corrupt(Id(9));  // now both copies are bad
  }
  auto s = nodes_[reader]->tier->Read(Id(9), out);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
}

TEST_F(Cluster, DroppedAndDelayedTransfersAreRetriedAndNeverCorrupt) {
  std::vector<std::vector<uint8_t>> chunks;
  for (int i = 0; i < 20; ++i) {
    chunks.push_back(Chunk(200 + i));
    ASSERT_TRUE(nodes_[0]->tier->Put(Id(i), chunks.back()).ok());
  }
  // One call in three fails after delivering a half-garbled buffer, and
  // every call is delayed. Transient faults, not a peer that is down: the
  // reader never skips a peer.
  ClusterTierOptions o = Options();
  o.down_backoff = absl::ZeroDuration();
  nodes_[2]->tier = std::make_unique<ClusterTier>(o, nodes_[2]->view.get(), nodes_[2]->faulty.get(),
                                                  &nodes_[2]->store);
  nodes_[2]->faulty->set_policy(
      {.one_in = 3, .latency_us = 2000, .drop_unflushed = true, .retryable = true, .seed = 42});
  int ok = 0;
  for (int round = 0; round < 3; ++round) {
    for (int i = 0; i < 20; ++i) {
      std::vector<uint8_t> out(chunks[i].size());
      absl::Status s = nodes_[2]->tier->Read(Id(i), out);
      if (s.ok()) {
        ++ok;
        ASSERT_EQ(out, chunks[i]) << "a corrupted chunk was returned";
      } else {
        EXPECT_TRUE(s.code() == absl::StatusCode::kNotFound ||
                    s.code() == absl::StatusCode::kDataLoss)
            << s;
      }
    }
  }
  EXPECT_GT(nodes_[2]->faulty->injected(), 5u);
  EXPECT_GT(ok, 40);  // retries on the other replica recover most reads
}

// A chunk that no live owner can serve is a miss, not an error: the owners'
// failures are counted, and owners that could not be reached are skipped
// until the back-off ends.
TEST_F(Cluster, AllReplicasUnreachableIsAMissAndCounted) {
  auto c = Chunk(3);
  ASSERT_TRUE(nodes_[0]->tier->Put(Id(3), c).ok());
  const int reader = NonOwner(Id(3));
  ASSERT_GE(reader, 0);
  ClusterTier& tier = *nodes_[reader]->tier;
  nodes_[reader]->faulty->set_policy({.fail_after_n = 0, .retryable = true});  // every request: Unavailable
  EXPECT_EQ(tier.Size(Id(3)).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(tier.errors(), 2u);  // both owners failed
  std::vector<uint8_t> out(c.size());
  EXPECT_EQ(tier.Read(Id(3), out).code(), absl::StatusCode::kNotFound);
  // Both are remembered as down: the read asked neither of them.
  EXPECT_EQ(tier.errors(), 2u);
  EXPECT_EQ(tier.metric(ClusterMetric::kPeersSkipped), 2u);
  nodes_[reader]->faulty->set_policy({});
  EXPECT_EQ(tier.Read(Id(3), out).code(), absl::StatusCode::kNotFound);
  clock_.AdvanceMicros(absl::ToInt64Microseconds(Options().down_backoff) + 1);
  ASSERT_TRUE(tier.Read(Id(3), out).ok());
  EXPECT_EQ(out, c);
  EXPECT_EQ(tier.Read(Id(12345), out).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(tier.errors(), 2u);  // a plain miss is no error
}

// An owner that answers with an error is reachable: the read is a miss, the
// errors are counted, and nothing is skipped afterwards.
TEST_F(Cluster, OwnersThatAnswerWithErrorsAreAMissAndCounted) {
  auto c = Chunk(4);
  ASSERT_TRUE(nodes_[0]->tier->Put(Id(4), c).ok());
  const int reader = NonOwner(Id(4));
  ASSERT_GE(reader, 0);
  ClusterTier& tier = *nodes_[reader]->tier;
  nodes_[reader]->faulty->set_policy({.fail_after_n = 0, .retryable = false});  // Internal
  EXPECT_EQ(tier.Size(Id(4)).status().code(), absl::StatusCode::kNotFound);
  std::vector<uint8_t> out(c.size());
  EXPECT_EQ(tier.Read(Id(4), out).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(tier.errors(), 4u);  // two owners, each asked by Size and by Read
  nodes_[reader]->faulty->set_policy({});
  ASSERT_TRUE(tier.Read(Id(4), out).ok());
  EXPECT_EQ(out, c);
  EXPECT_EQ(tier.metric(ClusterMetric::kPeersSkipped), 0u);
}

// A member that takes the connection but never answers (a stopped or hung
// kvtierd) costs one short probe, not the transfer timeout; it is skipped
// until the back-off ends, by reads and by puts, which store the other copy.
TEST_F(Cluster, MemberThatNeverAnswersIsSkippedAfterAShortProbe) {
  testing::SilentListener silent;
  ASSERT_FALSE(silent.addr().empty());
  Publish({{"node-silent", silent.addr(), "", 1 << 30, 0}});
  ClusterTier& tier = *nodes_[0]->tier;
  absl::Time t0 = absl::Now();
  EXPECT_EQ(tier.Size(Id(777)).status().code(), absl::StatusCode::kNotFound);
  EXPECT_LT(absl::Now() - t0, absl::Seconds(2));  // one probe, not the 3 s timeout
  EXPECT_EQ(tier.errors(), 1u);
  std::vector<uint8_t> out(Chunk(1).size());
  t0 = absl::Now();
  EXPECT_EQ(tier.Read(Id(777), out).code(), absl::StatusCode::kNotFound);
  EXPECT_LT(absl::Now() - t0, absl::Seconds(2));
  EXPECT_EQ(tier.errors(), 1u);
  EXPECT_EQ(tier.metric(ClusterMetric::kPeersSkipped), 1u);
  // A key the silent member owns: the put stores the other copy without
  // asking it, and the chunk is read back.
  int k = 0;
  while (k < 1000 && tier.Owners(Id(k).key)[0].id != "node-silent" &&
         tier.Owners(Id(k).key)[1].id != "node-silent") {
    ++k;
  }
  ASSERT_LT(k, 1000);
  auto c = Chunk(k);
  ASSERT_TRUE(tier.Put(Id(k), c).ok());
  EXPECT_EQ(tier.metric(ClusterMetric::kPeersSkipped), 2u);
  EXPECT_EQ(tier.metric(ClusterMetric::kPutReplicaFailures), 1u);
  ASSERT_TRUE(tier.Read(Id(k), out).ok());
  EXPECT_EQ(out, c);
  EXPECT_EQ(tier.errors(), 1u);
  // After the back-off the member is asked again.
  clock_.AdvanceMicros(absl::ToInt64Microseconds(Options().down_backoff) + 1);
  EXPECT_EQ(tier.Size(Id(777)).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(tier.errors(), 2u);
}

// A connected peer that stops answering (its service hangs) holds a lookup
// for the lookup timeout once, not for the transfer timeout on every miss.
TEST_F(Cluster, PeerThatStopsAnsweringCostsOneLookupTimeout) {
  ClusterTier& tier = *nodes_[0]->tier;
  ASSERT_EQ(tier.Size(Id(888)).status().code(), absl::StatusCode::kNotFound);  // connects
  nodes_[1]->store.set_delay_ms(2500);
  absl::Time t0 = absl::Now();
  EXPECT_EQ(tier.Size(Id(888)).status().code(), absl::StatusCode::kNotFound);
  EXPECT_LT(absl::Now() - t0, absl::Milliseconds(1500));
  EXPECT_EQ(tier.errors(), 1u);
  t0 = absl::Now();
  EXPECT_EQ(tier.Size(Id(889)).status().code(), absl::StatusCode::kNotFound);
  EXPECT_LT(absl::Now() - t0, absl::Milliseconds(1500));
  EXPECT_EQ(tier.errors(), 1u);
  EXPECT_EQ(tier.metric(ClusterMetric::kPeersSkipped), 1u);
  nodes_[1]->store.set_delay_ms(0);
}

TEST(VerifyObject, ChecksWholeChunksAndParts) {
  auto c = Chunk(5);
  EXPECT_TRUE(tiering::VerifyObject(Id(1), c).ok());
  auto h = codec::ParseHeader(c);
  ASSERT_TRUE(h.ok());
  std::vector<uint8_t> kpart(c.begin(), c.begin() + h->layout.v_offset);
  std::vector<uint8_t> vpart(c.begin(), c.begin() + codec::kHeaderSize);
  vpart.insert(vpart.end(), c.begin() + h->layout.v_offset, c.end());
  EXPECT_TRUE(tiering::VerifyObject({Id(1).key, tiering::Part::kK}, kpart).ok());
  EXPECT_TRUE(tiering::VerifyObject({Id(1).key, tiering::Part::kV}, vpart).ok());
  EXPECT_EQ(tiering::VerifyObject({Id(1).key, tiering::Part::kK}, vpart).code(), absl::StatusCode::kDataLoss);
  c[c.size() - 3] ^= 1;
  EXPECT_EQ(tiering::VerifyObject(Id(1), c).code(), absl::StatusCode::kDataLoss);
}

}  // namespace
}  // namespace kvtier::cluster
