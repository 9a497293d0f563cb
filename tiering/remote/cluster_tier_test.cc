// ClusterTier over three nodes on loopback, each a real UcxTransport serving
// an in-memory store: replication, fallback to the other replica when a
// member dies, rejoin, and network faults (drops, delays, corrupted
// transfers) that never return a corrupted chunk.
#include "tiering/remote/cluster_tier.h"

#include "codec/codec.h"
#include "codec/test_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tiering/remote/test_peer.h"
#include "tiering/remote/ucx_transport.h"

namespace kvtier::tiering::remote {
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

ObjectKey Id(int i) { return {Hash128::Of(std::to_string(i), 0), Part::kWhole}; }

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
    n->tier = std::make_unique<ClusterTier>(
        ClusterTierOptions{.replicas = 2, .timeout = absl::Seconds(3)}, n->view.get(),
        n->faulty.get(), &n->store);
  }
  // What etcd membership would deliver: every live node's id and address.
  void Publish() {
    std::vector<Member> live;
    for (auto& n : nodes_) {
      if (n) live.push_back({n->id, n->transport->listen_address(), "", 1 << 30, 0});
    }
    for (auto& n : nodes_) {
      if (n) n->view->Set(live);
    }
  }
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
  // every call is delayed.
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
        EXPECT_TRUE(s.code() == absl::StatusCode::kUnavailable ||
                    s.code() == absl::StatusCode::kDataLoss)
            << s;
      }
    }
  }
  EXPECT_GT(nodes_[2]->faulty->injected(), 5u);
  EXPECT_GT(ok, 40);  // retries on the other replica recover most reads
}

TEST_F(Cluster, AllReplicasDownIsUnavailableNotNotFound) {
  auto c = Chunk(3);
  ASSERT_TRUE(nodes_[0]->tier->Put(Id(3), c).ok());
  auto owners = nodes_[0]->tier->Owners(Id(3).key);
  int reader = 0;  // a node that holds no replica itself
  for (int i = 0; i < 3; ++i) {
    if (nodes_[i]->id != owners[0].id && nodes_[i]->id != owners[1].id) reader = i;
  }
  nodes_[reader]->faulty->set_policy({.fail_after_n = 0});
  std::vector<uint8_t> out(c.size());
  EXPECT_EQ(nodes_[reader]->tier->Read(Id(3), out).code(), absl::StatusCode::kUnavailable);
  nodes_[reader]->faulty->set_policy({});
  EXPECT_TRUE(nodes_[reader]->tier->Read(Id(3), out).ok());
  EXPECT_EQ(nodes_[reader]->tier->Read(Id(12345), out).code(), absl::StatusCode::kNotFound);
}

TEST(VerifyObject, ChecksWholeChunksAndParts) {
  auto c = Chunk(5);
  EXPECT_TRUE(VerifyObject(Id(1), c).ok());
  auto h = codec::ParseHeader(c);
  ASSERT_TRUE(h.ok());
  std::vector<uint8_t> kpart(c.begin(), c.begin() + h->layout.v_offset);
  std::vector<uint8_t> vpart(c.begin(), c.begin() + codec::kHeaderSize);
  vpart.insert(vpart.end(), c.begin() + h->layout.v_offset, c.end());
  EXPECT_TRUE(VerifyObject({Id(1).key, Part::kK}, kpart).ok());
  EXPECT_TRUE(VerifyObject({Id(1).key, Part::kV}, vpart).ok());
  EXPECT_EQ(VerifyObject({Id(1).key, Part::kK}, vpart).code(), absl::StatusCode::kDataLoss);
  c[c.size() - 3] ^= 1;
  EXPECT_EQ(VerifyObject(Id(1), c).code(), absl::StatusCode::kDataLoss);
}

}  // namespace
}  // namespace kvtier::tiering::remote
