// The control plane at engine speed, end to end against an in-process
// kvtierd: lookup, plan and lookup-and-hold over the shared-memory data
// plane, batched holds, gets and puts, prefetch with a byte budget, the
// held-bytes cap, leases that expire, holds of a killed client, and the
// batch ops under hostile frames.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <thread>

#include "absl/strings/str_cat.h"
#include "client/kvtier_client.h"
#include "common/testing/temp_dir.h"
#include "gtest/gtest.h"
#include "server/daemon.h"
#include "server/test_util.h"
#include "tests/in_process_daemon.h"
#include "tiering/placement_engine.h"
#include "tiering/test_util.h"
#include "tests/raw_data_plane.h"
#include "wire/shm_frames.h"

namespace kvtier::server {
namespace {

using kvtier::testing::MakeChunk;
using kvtier::testing::SmallDaemonOptions;
using kvtier::testing::TestKey;
using Op = wire::shm::Op;
constexpr int kExhausted = static_cast<int>(absl::StatusCode::kResourceExhausted);

class CtlTest : public kvtier::testing::InProcessDaemonTest {
 protected:
  // Puts chunks 0..n-1 (seeds base+i) as keys base+i.
  void PutChunks(client::KvtierClient& c, uint32_t base, uint32_t n) {
    for (uint32_t i = 0; i < n; ++i) ASSERT_TRUE(c.Put(TestKey(base + i), MakeChunk(base + i)).ok());
  }

  static uint64_t Counter(client::KvtierClient& c, const std::string& name) {
    auto s = c.Stats();
    EXPECT_TRUE(s.ok()) << s.status();
    if (!s.ok()) return 0;
    for (const auto& [n, v] : s->counters) {
      if (n == name) return v;
    }
    ADD_FAILURE() << "no counter " << name;
    return 0;
  }

  // Stores `chunk` as `key` on the NVMe tier only (the engine of the
  // in-process daemon: no client op chooses a tier).
  // Chunks base..base+n-1 (MakeChunk) stored on the NVMe tier only; their keys.
  std::vector<Hash128> PutOnNvme(uint32_t base, uint32_t n) {
    std::vector<Hash128> keys;
    tiering::PutOptions po;
    po.tier = tiering::TierKind::kNvme;
    for (uint32_t i = base; i < base + n; ++i) {
      keys.push_back(TestKey(i));
      EXPECT_TRUE(daemon_->engine()->Put(keys.back(), MakeChunk(i), po).ok());
    }
    return keys;
  }

  static std::vector<uint8_t> Keys(std::vector<uint8_t> head, std::span<const Hash128> keys) {
    for (const Hash128& k : keys) head.insert(head.end(), k.bytes.begin(), k.bytes.end());
    return head;
  }
  static std::vector<uint8_t> Fixed(uint32_t n, uint32_t second, size_t extra_zero_bytes = 0) {
    std::vector<uint8_t> b(8 + extra_zero_bytes);
    wire::shm::Writer(b.data()).U32(n).U32(second);
    return b;
  }

};

TEST_F(CtlTest, LookupAndPlanOverTheDataPlaneAgreeWithGrpc) {
  auto shm = Client();
  auto grpc = Client(/*shm=*/false);
  ASSERT_TRUE(shm && grpc);
  PutChunks(*shm, 100, 4);
  std::vector<Hash128> keys;
  for (uint32_t i = 0; i < 6; ++i) keys.push_back(TestKey(100 + i));
  auto a = shm->Lookup(keys);
  auto b = grpc->Lookup(keys);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(*a, *b);
  ASSERT_EQ(a->size(), 4u);
  for (client::Tier t : *a) EXPECT_EQ(t, client::Tier::kDram);
  auto pa = shm->PlanLoad(keys, 5000, 16);
  auto pb = grpc->PlanLoad(keys, 5000, 16);
  ASSERT_TRUE(pa.ok()) << pa.status();
  ASSERT_TRUE(pb.ok()) << pb.status();
  EXPECT_EQ(pa->tiers, pb->tiers);
  EXPECT_EQ(pa->chunk_bytes, pb->chunk_bytes);
  EXPECT_EQ(pa->load_chunks, pb->load_chunks);
  EXPECT_EQ(shm->PlanLoad(keys, -1, 16).status().code(), absl::StatusCode::kInvalidArgument);
  // The attention term over both: at 1M tokens/s a chunk of 16 tokens
  // recomputes in 16 us, less than a DRAM load (20 us and more): nothing is
  // worth loading. With C2 = 16 tokens chunk i costs 16 x (1.5 + i) us: 24,
  // 40, 56, 72, so all four are.
  EXPECT_EQ(shm->PlanLoad(keys, 1e6, 16)->load_chunks, 0u);
  EXPECT_EQ(grpc->PlanLoad(keys, 1e6, 16)->load_chunks, 0u);
  auto qa = shm->PlanLoad(keys, 1e6, 16, /*attention_doubling_tokens=*/16);
  auto qb = grpc->PlanLoad(keys, 1e6, 16, /*attention_doubling_tokens=*/16);
  ASSERT_TRUE(qa.ok()) << qa.status();
  ASSERT_TRUE(qb.ok()) << qb.status();
  EXPECT_EQ(qa->load_chunks, 4u);
  EXPECT_EQ(qb->load_chunks, 4u);
  EXPECT_NEAR(qa->saved_us, 192 - qa->load_chunks_us, 1e-9);
  EXPECT_NEAR(qb->saved_us, 192 - qb->load_chunks_us, 1e-9);
  // LookupAndHold holds what that plan loads, over the data plane and gRPC.
  for (client::KvtierClient* cl : {shm.get(), grpc.get()}) {
    auto none = cl->LookupAndHold(keys, 1e6, 16, 0);
    ASSERT_TRUE(none.ok()) << none.status();
    EXPECT_EQ(none->lease_id, 0u);
    auto held = cl->LookupAndHold(keys, 1e6, 16, 0, /*attention_doubling_tokens=*/16);
    ASSERT_TRUE(held.ok()) << held.status();
    EXPECT_EQ(held->plan.load_chunks, 4u);
    ASSERT_NE(held->lease_id, 0u);
    EXPECT_EQ(cl->Delete(TestKey(103)).code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_TRUE(cl->ReleasePlan(*held).ok());
  }
  // An empty lookup is a lookup of nothing.
  auto none = shm->Lookup({});
  ASSERT_TRUE(none.ok());
  EXPECT_TRUE(none->empty());
}

TEST_F(CtlTest, LookupAndHoldHoldsExactlyThePlannedChunksUntilReleased) {
  auto c = Client();
  ASSERT_TRUE(c);
  PutChunks(*c, 110, 3);
  std::vector<Hash128> keys = {TestKey(110), TestKey(111), TestKey(112), TestKey(113)};
  auto h = c->LookupAndHold(keys);
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_EQ(h->plan.tiers.size(), 3u);
  EXPECT_EQ(h->plan.load_chunks, 3u);  // without a rate: every hit
  ASSERT_NE(h->lease_id, 0u);
  for (uint32_t i = 0; i < 3; ++i) {
    EXPECT_EQ(c->Delete(TestKey(110 + i)).code(), absl::StatusCode::kFailedPrecondition) << i;
  }
  ASSERT_TRUE(c->ReleasePlan(*h).ok());
  EXPECT_EQ(c->ReleasePlan(*h).code(), absl::StatusCode::kNotFound);
  for (uint32_t i = 0; i < 3; ++i) EXPECT_TRUE(c->Delete(TestKey(110 + i)).ok()) << i;
  // A plan of nothing holds nothing.
  auto empty = c->LookupAndHold(keys);
  ASSERT_TRUE(empty.ok()) << empty.status();
  EXPECT_EQ(empty->lease_id, 0u);
  EXPECT_TRUE(c->ReleasePlan(*empty).ok());
}

// Without a data-plane connection (max_data_connections 0) the same calls
// go over gRPC: PlanLoad and Pin, Hold per key.
TEST_F(CtlTest, LookupAndHoldAndBatchesFallBackToGrpc) {
  client::ClientOptions o;
  o.socket_path = daemon_->socket_path();
  o.max_data_connections = 0;
  o.timeout_ms = 10000;
  auto c = client::KvtierClient::Connect(o);
  ASSERT_TRUE(c.ok()) << c.status();
  PutChunks(**c, 115, 2);
  std::vector<Hash128> keys = {TestKey(115), TestKey(116), TestKey(117)};
  auto h = (*c)->LookupAndHold(keys);
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_EQ(h->plan.load_chunks, 2u);
  EXPECT_EQ(h->connection, 0u);
  ASSERT_NE(h->lease_id, 0u);
  EXPECT_EQ((*c)->Delete(TestKey(115)).code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE((*c)->ReleasePlan(*h).ok());
  auto held = (*c)->HoldBatch(keys);
  ASSERT_TRUE(held.ok()) << held.status();
  EXPECT_TRUE((*held)[0].ok() && (*held)[1].ok());
  EXPECT_EQ((*held)[2].status().code(), absl::StatusCode::kNotFound);
  std::vector<client::HeldChunk> ones = {*(*held)[0], *(*held)[1]};
  EXPECT_TRUE((*c)->UnholdBatch(ones).ok());
  auto got = (*c)->GetBatch(keys);
  ASSERT_EQ(got.size(), 3u);
  ASSERT_TRUE(got[1].ok());
  EXPECT_EQ(*got[1], MakeChunk(116));
  EXPECT_TRUE((*c)->Delete(TestKey(115)).ok());
}

TEST_F(CtlTest, LeasesOfHoldsExpireAndAreCounted) {
  auto c = Client();
  ASSERT_TRUE(c);
  PutChunks(*c, 120, 2);
  const uint64_t before = Counter(*c, "leases_expired");
  std::vector<Hash128> keys = {TestKey(120), TestKey(121)};
  auto h = c->LookupAndHold(keys, 0, 256, /*lease_ms=*/50);
  ASSERT_TRUE(h.ok()) << h.status();
  ASSERT_NE(h->lease_id, 0u);
  EXPECT_EQ(c->Delete(TestKey(120)).code(), absl::StatusCode::kFailedPrecondition);
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  EXPECT_TRUE(c->Delete(TestKey(120)).ok());
  EXPECT_GE(Counter(*c, "leases_expired"), before + 1);
  EXPECT_EQ(c->ReleasePlan(*h).code(), absl::StatusCode::kNotFound);
}

TEST_F(CtlTest, BatchGetReturnsTheHitsAndNamesTheMisses) {
  auto c = Client();
  ASSERT_TRUE(c);
  PutChunks(*c, 130, 3);
  std::vector<Hash128> keys = {TestKey(130), TestKey(199), TestKey(131), TestKey(132), TestKey(198)};
  std::vector<std::vector<uint8_t>> bufs(keys.size(), std::vector<uint8_t>(1 << 16));
  std::vector<std::span<uint8_t>> outs(bufs.begin(), bufs.end());
  auto got = c->GetBatchInto(keys, outs);
  ASSERT_EQ(got.size(), keys.size());
  for (size_t i : {size_t{1}, size_t{4}}) {
    EXPECT_EQ(got[i].status().code(), absl::StatusCode::kNotFound) << i;
  }
  for (auto [i, seed] : {std::pair<size_t, uint32_t>{0, 130}, {2, 131}, {3, 132}}) {
    ASSERT_TRUE(got[i].ok()) << i << " " << got[i].status();
    const auto want = MakeChunk(seed);
    ASSERT_EQ(got[i]->first, want.size());
    EXPECT_EQ(got[i]->second, client::Tier::kDram);
    EXPECT_TRUE(std::equal(want.begin(), want.end(), bufs[i].begin())) << i;
  }
  auto vecs = c->GetBatch(keys);
  ASSERT_EQ(vecs.size(), keys.size());
  EXPECT_EQ(vecs[1].status().code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(vecs[2].ok());
  EXPECT_EQ(*vecs[2], MakeChunk(131));
  // Nothing stays held: every chunk can be deleted.
  for (uint32_t i = 0; i < 3; ++i) EXPECT_TRUE(c->Delete(TestKey(130 + i)).ok()) << i;
  // Duplicates and oversized batches are refused whole by HoldBatch;
  // GetBatch still serves them, one key at a time.
  PutChunks(*c, 133, 1);
  std::vector<Hash128> dup = {TestKey(133), TestKey(133)};
  EXPECT_EQ(c->HoldBatch(dup).status().code(), absl::StatusCode::kInvalidArgument);
  auto dup_got = c->GetBatch(dup);
  ASSERT_EQ(dup_got.size(), 2u);
  EXPECT_TRUE(dup_got[0].ok() && dup_got[1].ok());
  std::vector<Hash128> many(client::kMaxBatchKeys + 1);
  for (size_t i = 0; i < many.size(); ++i) many[i] = TestKey(10000 + static_cast<uint32_t>(i));
  EXPECT_EQ(c->HoldBatch(many).status().code(), absl::StatusCode::kInvalidArgument);
}

// A batch of 11 keys goes in four groups (3, 3, 3, 2), two held at a time
// while the one before them is copied: every key's result stays in its place
// (hits, misses, a buffer too small) and nothing stays held.
TEST_F(CtlTest, BatchGetInGroupsKeepsEveryResultInItsPlace) {
  auto c = Client();
  ASSERT_TRUE(c);
  PutChunks(*c, 400, 8);
  std::vector<Hash128> keys;
  std::vector<int> seed;  // -1: a miss
  int next = 400;
  for (int i = 0; i < 11; ++i) {
    const bool miss = i == 1 || i == 5 || i == 10;
    seed.push_back(miss ? -1 : next++);
    keys.push_back(TestKey(static_cast<uint32_t>(miss ? 490 + i : seed.back())));
  }
  std::vector<std::vector<uint8_t>> bufs(keys.size(), std::vector<uint8_t>(1 << 16));
  bufs[7].resize(16);  // too small for its chunk: that key alone fails
  std::vector<std::span<uint8_t>> outs(bufs.begin(), bufs.end());
  auto got = c->GetBatchInto(keys, outs);
  ASSERT_EQ(got.size(), keys.size());
  for (size_t i = 0; i < keys.size(); ++i) {
    if (seed[i] < 0) {
      EXPECT_EQ(got[i].status().code(), absl::StatusCode::kNotFound) << i;
    } else if (i == 7) {
      EXPECT_EQ(got[i].status().code(), absl::StatusCode::kInvalidArgument) << i;
    } else {
      ASSERT_TRUE(got[i].ok()) << i << " " << got[i].status();
      const auto want = MakeChunk(static_cast<uint32_t>(seed[i]));
      ASSERT_EQ(got[i]->first, want.size()) << i;
      EXPECT_TRUE(std::equal(want.begin(), want.end(), bufs[i].begin())) << i;
    }
  }
  auto vecs = c->GetBatch(keys);
  ASSERT_EQ(vecs.size(), keys.size());
  for (size_t i = 0; i < keys.size(); ++i) {
    if (seed[i] < 0) {
      EXPECT_EQ(vecs[i].status().code(), absl::StatusCode::kNotFound) << i;
    } else {
      ASSERT_TRUE(vecs[i].ok()) << i << " " << vecs[i].status();
      EXPECT_EQ(*vecs[i], MakeChunk(static_cast<uint32_t>(seed[i]))) << i;
    }
  }
  for (uint32_t i = 0; i < 8; ++i) EXPECT_TRUE(c->Delete(TestKey(400 + i)).ok()) << i;
}

TEST_F(CtlTest, BatchPutVerifiesEveryChunkBeforeItIsAcknowledged) {
  auto c = Client();
  ASSERT_TRUE(c);
  std::vector<std::vector<uint8_t>> chunks = {MakeChunk(140), MakeChunk(141), MakeChunk(142)};
  chunks[1][chunks[1].size() - 10] ^= 0x5a;  // a payload byte: the checksum fails
  std::vector<Hash128> keys = {TestKey(140), TestKey(141), TestKey(142)};
  std::vector<std::span<const uint8_t>> spans(chunks.begin(), chunks.end());
  auto shared = c->PutBatchShared(keys, spans);
  ASSERT_TRUE(shared.ok()) << shared.status();
  ASSERT_EQ(shared->size(), 3u);
  EXPECT_TRUE((*shared)[0].ok()) << (*shared)[0];
  EXPECT_EQ((*shared)[1].code(), absl::StatusCode::kDataLoss);
  EXPECT_TRUE((*shared)[2].ok()) << (*shared)[2];
  EXPECT_EQ(c->Get(TestKey(140)).value(), chunks[0]);
  EXPECT_EQ(c->Get(TestKey(141)).status().code(), absl::StatusCode::kNotFound);
  // PutBatch takes the same path, and the per-key one for repeated keys.
  std::vector<Hash128> dup = {TestKey(143), TestKey(143)};
  std::vector<std::vector<uint8_t>> same = {MakeChunk(143), MakeChunk(143)};
  std::vector<std::span<const uint8_t>> same_spans(same.begin(), same.end());
  EXPECT_EQ(c->PutBatchShared(dup, same_spans).status().code(),
            absl::StatusCode::kFailedPrecondition);
  for (const absl::Status& st : c->PutBatch(dup, same_spans)) EXPECT_TRUE(st.ok()) << st;
}

TEST_F(CtlTest, BatchGetReadsNvmeChunksAndPrefetchMovesThemWithinTheBudget) {
  auto c = Client();
  ASSERT_TRUE(c);
  std::vector<Hash128> keys = PutOnNvme(150, 4);
  auto tiers = c->Lookup(keys);
  ASSERT_TRUE(tiers.ok());
  ASSERT_EQ(tiers->size(), 4u);
  for (client::Tier t : *tiers) EXPECT_EQ(t, client::Tier::kNvme);
  // Prefetch within a budget of two chunks: the first two reach DRAM.
  const uint64_t chunk_bytes = MakeChunk(150).size();
  auto p = c->PrefetchWithin(keys, 2 * chunk_bytes, 5000);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_TRUE(p->completed);
  EXPECT_EQ(p->keys, 2u);
  EXPECT_EQ(p->bytes, 2 * chunk_bytes);
  tiers = c->Lookup(keys);
  ASSERT_TRUE(tiers.ok());
  EXPECT_EQ((*tiers)[0], client::Tier::kDram);
  EXPECT_EQ((*tiers)[1], client::Tier::kDram);
  EXPECT_EQ((*tiers)[3], client::Tier::kNvme);
  // The batch serves both: DRAM in place, NVMe through scratch slots.
  auto held = c->HoldBatch(keys);
  ASSERT_TRUE(held.ok()) << held.status();
  for (size_t i = 0; i < keys.size(); ++i) {
    ASSERT_TRUE((*held)[i].ok()) << i << (*held)[i].status();
    const auto want = MakeChunk(150 + static_cast<uint32_t>(i));
    EXPECT_TRUE(std::equal(want.begin(), want.end(), (*held)[i]->data.begin(), (*held)[i]->data.end()));
  }
  EXPECT_EQ((*held)[3]->tier, client::Tier::kNvme);
  EXPECT_NE((*held)[3]->scratch_slot_id, 0u);
  // The NVMe tier checked the scratch copies as it read them, so the reader
  // need not hash them again; the chunks handed out in DRAM are the reader's
  // to check, unless the hold asked the daemon to.
  EXPECT_FALSE((*held)[0]->checked);
  EXPECT_TRUE((*held)[3]->checked);
  auto one = c->Hold(keys[3]);
  ASSERT_TRUE(one.ok()) << one.status();
  EXPECT_TRUE(one->checked);
  EXPECT_TRUE(c->Unhold(*one).ok());
  auto asked = c->Hold(keys[0], /*verify=*/true);
  ASSERT_TRUE(asked.ok()) << asked.status();
  EXPECT_TRUE(asked->checked);
  EXPECT_TRUE(c->Unhold(*asked).ok());
  auto in_place = c->Hold(keys[0]);
  ASSERT_TRUE(in_place.ok()) << in_place.status();
  EXPECT_FALSE(in_place->checked);
  EXPECT_TRUE(c->Unhold(*in_place).ok());
  std::vector<client::HeldChunk> ones;
  for (auto& h : *held) ones.push_back(*h);
  EXPECT_TRUE(c->UnholdBatch(ones).ok());
  EXPECT_EQ(c->UnholdBatch(ones).code(), absl::StatusCode::kNotFound);
  // Prefetch without a budget, over gRPC.
  auto g = Client(/*shm=*/false);
  ASSERT_TRUE(g);
  EXPECT_EQ(g->PrefetchWithin(keys, 1, 100).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(g->PrefetchWithin(keys, 0, 5000).ok());
}

// A hold of an NVMe chunk is marked checked (the tier hashed it as it read
// it), and the reader skips its own check: a byte rotted on the disk must
// still reach the reader as DataLoss, never as checked bytes. The corrupt
// chunk is dropped; the other chunks of the batch are served and kept.
TEST_F(CtlTest, AChunkRottedOnDiskIsDataLossThroughAHoldThatSkipsTheReadersCheck) {
  auto c = Client();
  ASSERT_TRUE(c);
  std::vector<Hash128> keys = PutOnNvme(190, 3);
  tiering::NvmeTier* nvme = daemon_->engine()->nvme();
  ASSERT_NE(nvme, nullptr);
  ASSERT_TRUE(tiering::testing::FlipByteOnNvme(*nvme, {keys[1], tiering::Part::kWhole},
                                               MakeChunk(191).size() - 100)
                  .ok());
  EXPECT_EQ(c->Hold(keys[1]).status().code(), absl::StatusCode::kDataLoss);
  auto held = c->HoldBatch(keys);
  ASSERT_TRUE(held.ok()) << held.status();
  std::vector<client::HeldChunk> ones;
  for (size_t i : {size_t{0}, size_t{2}}) {
    ASSERT_TRUE((*held)[i].ok()) << i << (*held)[i].status();
    EXPECT_TRUE((*held)[i]->checked);
    const auto want = MakeChunk(190 + static_cast<uint32_t>(i));
    EXPECT_TRUE(std::equal(want.begin(), want.end(), (*held)[i]->data.begin(),
                           (*held)[i]->data.end()));
    ones.push_back(*(*held)[i]);
  }
  const absl::StatusCode code = (*held)[1].status().code();
  EXPECT_TRUE(code == absl::StatusCode::kDataLoss || code == absl::StatusCode::kNotFound) << code;
  ASSERT_TRUE(c->UnholdBatch(ones).ok());
  EXPECT_EQ(c->Get(keys[1]).status().code(), absl::StatusCode::kNotFound);  // dropped
  for (size_t i : {size_t{0}, size_t{2}}) {
    auto got = c->Get(keys[i]);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(*got, MakeChunk(190 + static_cast<uint32_t>(i)));
  }
}

TEST_F(CtlTest, HoldsBeyondTheHeldShareAreResourceExhausted) {
  DaemonOptions o = SmallDaemonOptions(dir_.path());
  const uint64_t chunk_bytes = MakeChunk(160).size();
  // Room for two chunks' holds: 32 MiB x share.
  o.max_held_share = (2.5 * static_cast<double>(chunk_bytes)) / (32.0 * 1024 * 1024);
  StartDaemon(o);
  auto c = Client();
  ASSERT_TRUE(c);
  PutChunks(*c, 160, 4);
  std::vector<Hash128> keys = {TestKey(160), TestKey(161), TestKey(162), TestKey(163)};
  EXPECT_EQ(c->LookupAndHold(keys).status().code(), absl::StatusCode::kResourceExhausted);
  auto two = c->LookupAndHold(std::span<const Hash128>(keys).first(2));
  ASSERT_TRUE(two.ok()) << two.status();
  auto third = c->Hold(keys[2]);
  EXPECT_EQ(third.status().code(), absl::StatusCode::kResourceExhausted);
  auto batch = c->HoldBatch(std::span<const Hash128>(keys).subspan(2));
  ASSERT_TRUE(batch.ok()) << batch.status();
  for (auto& h : *batch) EXPECT_EQ(h.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_GE(Counter(*c, "holds_refused"), 3u);
  ASSERT_TRUE(c->ReleasePlan(*two).ok());
  auto again = c->Hold(keys[2]);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_TRUE(c->Unhold(*again).ok());
  // A batched get holds a few groups at once; what the cap refuses (its own
  // groups in flight among the holders) is got one by one once the batch
  // holds nothing, so every key is got.
  PutChunks(*c, 164, 4);
  for (uint32_t i = 164; i < 168; ++i) keys.push_back(TestKey(i));
  for (int round = 0; round < 5; ++round) {
    auto got = c->GetBatch(keys);
    ASSERT_EQ(got.size(), keys.size());
    for (auto& g : got) EXPECT_TRUE(g.ok()) << g.status();
  }
}

// A client killed with holds (a lookup-and-hold lease and a batch of gets)
// has them released when its connection closes: not at their expiry.
TEST_F(CtlTest, HoldsOfAKilledClientAreReleasedAtOnce) {
  auto c = Client();
  ASSERT_TRUE(c);
  PutChunks(*c, 170, 3);
  const std::string path = daemon_->shm_socket_path();
  int ready[2];
  ASSERT_EQ(::pipe(ready), 0);
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    // The child speaks raw frames (no gRPC after fork), holds, then waits.
    ::close(ready[0]);
    auto h = client::ConnectShm(path);
    if (!h.ok()) ::_exit(2);
    auto frame = [&](Op op, const std::vector<uint8_t>& p) {
      std::vector<uint8_t> f = RawDataPlane::Frame(1, static_cast<uint16_t>(op), p);
      if (::send(h->sock, f.data(), f.size(), MSG_NOSIGNAL) != static_cast<ssize_t>(f.size())) {
        ::_exit(3);
      }
      uint8_t hdr[wire::shm::kResponseHeaderBytes];
      for (size_t got = 0; got < sizeof(hdr);) {
        const ssize_t k = ::recv(h->sock, hdr + got, sizeof(hdr) - got, 0);
        if (k <= 0) ::_exit(4);
        got += static_cast<size_t>(k);
      }
      wire::shm::Reader r(hdr);
      r.U16();
      r.U16();
      if (r.U32() != 0) ::_exit(5);
      std::vector<uint8_t> body(r.U32());
      for (size_t got = 0; got < body.size();) {
        const ssize_t k = ::recv(h->sock, body.data() + got, body.size() - got, 0);
        if (k <= 0) ::_exit(6);
        got += static_cast<size_t>(k);
      }
    };
    frame(Op::kHello, {});
    std::vector<Hash128> plan_keys = {TestKey(170), TestKey(171)};
    std::vector<uint8_t> plan(wire::shm::kPlanBytes);
    wire::shm::Writer(plan.data()).U32(2).U32(256).F64(0).U32(600000).U32(0);
    frame(Op::kPlanAndHold, Keys(plan, plan_keys));
    std::vector<Hash128> get_keys = {TestKey(172)};
    std::vector<uint8_t> get(wire::shm::kGetBatchBytes);
    wire::shm::Writer(get.data()).U32(1).U32(600000);
    frame(Op::kGetBatch, Keys(get, get_keys));
    const char b = 1;
    if (::write(ready[1], &b, 1) != 1) ::_exit(7);
    for (;;) ::pause();
  }
  ::close(ready[1]);
  char b = 0;
  ASSERT_EQ(::read(ready[0], &b, 1), 1) << "the child did not take its holds";
  ::close(ready[0]);
  for (uint32_t i = 0; i < 3; ++i) {
    EXPECT_EQ(c->Delete(TestKey(170 + i)).code(), absl::StatusCode::kFailedPrecondition) << i;
  }
  ASSERT_EQ(::kill(pid, SIGKILL), 0);
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  EXPECT_TRUE(WIFSIGNALED(status));
  WaitForDataPlaneConnections(daemon_.get(), 1);  // the parent client's own
  for (uint32_t i = 0; i < 3; ++i) EXPECT_TRUE(c->Delete(TestKey(170 + i)).ok()) << i;
  EXPECT_EQ(daemon_->engine()->held_bytes(), 0u);
}

// Malformed batch frames get one error answer and the connection closes;
// field values that are wrong get their codes and the connection serves on.
TEST_F(CtlTest, BatchOpsRefuseHostileFrames) {
  auto c = Client();
  ASSERT_TRUE(c);
  PutChunks(*c, 180, 2);
  const std::vector<Hash128> two = {TestKey(180), TestKey(181)};
  struct Case {
    const char* name;
    std::vector<uint8_t> frame;
  };
  std::vector<Hash128> over(wire::shm::kMaxBatchItems + 1, TestKey(1));
  const std::vector<Case> closing = {
      {"lookup: keys not whole", RawDataPlane::Frame(1, 10, std::vector<uint8_t>(8 + 15))},
      {"lookup: short fixed part", RawDataPlane::Frame(1, 10, std::vector<uint8_t>(4))},
      {"lookup: count says 3, two keys", RawDataPlane::Frame(1, 10, Keys(Fixed(3, 0), two))},
      {"lookup: count says 1, two keys", RawDataPlane::Frame(1, 10, Keys(Fixed(1, 0), two))},
      {"lookup: over the batch limit",
       RawDataPlane::Frame(1, 10, Keys(Fixed(static_cast<uint32_t>(over.size()), 0), over))},
      {"get batch: claims a huge payload", RawDataPlane::Frame(1, 13, {}, int64_t{1} << 30)},
      {"release batch: half an item", RawDataPlane::Frame(1, 14, std::vector<uint8_t>(8 + 8))},
      {"plan: no fixed part", RawDataPlane::Frame(1, 11, std::vector<uint8_t>(16))},
      {"plan (attention): a plain plan's fixed part",
       RawDataPlane::Frame(1, 19, Keys(Fixed(2, 16, wire::shm::kPlanBytes - 8), two))},
      {"plan and hold (attention): count says 3, two keys",
       RawDataPlane::Frame(1, 20, Keys(Fixed(3, 16, wire::shm::kPlanAttentionBytes - 8), two))},
      {"plan (attention): keys not whole",
       RawDataPlane::Frame(1, 19, std::vector<uint8_t>(wire::shm::kPlanAttentionBytes + 8))},
      {"unknown op", RawDataPlane::Frame(1, 21, {})},
  };
  for (const Case& k : closing) {
    SCOPED_TRACE(k.name);
    RawDataPlane dp(daemon_->shm_socket_path());
    ASSERT_TRUE(dp.ok()) << dp.error();
    dp.SendBytes(k.frame);
    auto a = dp.Read();
    ASSERT_TRUE(a.has_value());
    EXPECT_EQ(static_cast<int>(a->code), kInvalid);
    EXPECT_LE(a->payload.size(), wire::shm::kMaxErrorMessageBytes);
    EXPECT_TRUE(dp.Closed());
  }

  RawDataPlane a(daemon_->shm_socket_path()), b(daemon_->shm_socket_path());
  ASSERT_TRUE(a.ok() && b.ok());
  std::vector<uint8_t> out;
  // Unknown keys: answered, one NotFound per key.
  const std::vector<Hash128> unknown = {TestKey(190), TestKey(191)};
  std::vector<uint8_t> get_head(wire::shm::kGetBatchBytes);
  wire::shm::Writer(get_head.data()).U32(2);
  ASSERT_EQ(a.Call(Op::kGetBatch, Keys(get_head, unknown), &out), kOk);
  ASSERT_EQ(out.size(), 8 + 2 * wire::shm::kGetBatchItemBytes);
  wire::shm::Reader r(out.data() + 8);
  EXPECT_EQ(static_cast<int>(r.U32()), kNotFound);
  // Duplicate keys: the batch is refused whole; the connection serves on.
  const std::vector<Hash128> dup = {TestKey(180), TestKey(180)};
  EXPECT_EQ(a.Call(Op::kGetBatch, Keys(get_head, dup)), kInvalid);
  std::vector<uint8_t> commit_head(wire::shm::kCommitBatchBytes);
  wire::shm::Writer(commit_head.data()).U32(2);
  std::vector<uint8_t> commit = commit_head;
  for (int i = 0; i < 2; ++i) {
    std::vector<uint8_t> item(wire::shm::kCommitItemBytes);
    wire::shm::Writer(item.data()).U64(1000 + i).Raw(TestKey(185).bytes.data(), 16);
    commit.insert(commit.end(), item.begin(), item.end());
  }
  EXPECT_EQ(a.Call(Op::kCommitBatch, commit), kInvalid);
  // Commit flags: kCommitSeal is one (an unknown slot is still NotFound), and
  // kCommitSeal | kCommitLanding with its group of layers; any other bit is
  // refused, and so are landing without sealing or a group, a group without
  // landing, and landing of two slots.
  const uint8_t kLand = wire::shm::kCommitSeal | wire::shm::kCommitLanding;
  for (auto [flags, group] : std::vector<std::pair<uint8_t, uint8_t>>{
           {wire::shm::kCommitSeal, 0}, {kLand, 4}, {uint8_t{2}, 0}, {uint8_t{0x81}, 0},
           {wire::shm::kCommitLanding, 4}, {kLand, 0}, {wire::shm::kCommitSeal, 4}}) {
    std::vector<uint8_t> sealed(wire::shm::kCommitBatchBytes + wire::shm::kCommitItemBytes);
    wire::shm::Writer(sealed.data()).U32(1).U8(0).U8(flags).U8(group).U8(0).U64(4242).Raw(
        TestKey(187).bytes.data(), 16);
    if ((flags == wire::shm::kCommitSeal && group == 0) || (flags == kLand && group == 4)) {
      ASSERT_EQ(a.Call(Op::kCommitBatch, sealed, &out), kOk);
      ASSERT_EQ(out.size(), 8u + 4u);
      EXPECT_EQ(static_cast<int>(wire::shm::Reader(out.data() + 8).U32()), kNotFound);
    } else {
      EXPECT_EQ(a.Call(Op::kCommitBatch, sealed), kInvalid) << int{flags} << " " << int{group};
    }
  }
  std::vector<uint8_t> two_landing(wire::shm::kCommitBatchBytes + 2 * wire::shm::kCommitItemBytes);
  wire::shm::Writer(two_landing.data()).U32(2).U8(0).U8(kLand).U8(4).U8(0).U64(4242).Raw(
      TestKey(188).bytes.data(), 16).U64(4243).Raw(TestKey(189).bytes.data(), 16);
  EXPECT_EQ(a.Call(Op::kCommitBatch, two_landing), kInvalid);
  // Reserved bytes that are not zero.
  std::vector<uint8_t> bad_head = get_head;
  bad_head[9] = 1;
  EXPECT_EQ(a.Call(Op::kGetBatch, Keys(bad_head, two)), kInvalid);
  std::vector<uint8_t> plan(wire::shm::kPlanBytes);
  wire::shm::Writer(plan.data()).U32(2).U32(256).F64(0).U32(5).U32(0);  // a lease on a plain plan
  EXPECT_EQ(a.Call(Op::kPlanLoad, Keys(plan, two)), kInvalid);
  EXPECT_EQ(a.Call(Op::kHello, {}), kOk);
  // The plans with the attention term: attention_doubling_tokens follows
  // the plain plan's fields. One that is no length, or reserved bytes that
  // are not zero, is refused; the connection serves on.
  std::vector<uint8_t> attention(wire::shm::kPlanAttentionBytes);
  for (double c2 : {-1.0, std::nan(""), HUGE_VAL}) {
    for (Op op : {Op::kPlanLoadAttention, Op::kPlanAndHoldAttention}) {
      wire::shm::Writer(attention.data()).U32(2).U32(16).F64(1000).U32(0).U32(0).F64(c2);
      EXPECT_EQ(a.Call(op, Keys(attention, two)), kInvalid) << c2;
    }
  }
  wire::shm::Writer(attention.data()).U32(2).U32(16).F64(1000).U32(0).U32(1).F64(16);
  EXPECT_EQ(a.Call(Op::kPlanLoadAttention, Keys(attention, two)), kInvalid);
  wire::shm::Writer(attention.data()).U32(2).U32(16).F64(1000).U32(5).U32(0).F64(16);
  EXPECT_EQ(a.Call(Op::kPlanLoadAttention, Keys(attention, two)), kInvalid);
  // At 1000 tokens/s and C2 = 16 tokens, the two chunks of 16 tokens
  // recompute in 24 and 40 ms; the answer is a plain plan's.
  wire::shm::Writer(attention.data()).U32(2).U32(16).F64(1000).U32(0).U32(0).F64(16);
  ASSERT_EQ(a.Call(Op::kPlanLoadAttention, Keys(attention, two), &out), kOk);
  ASSERT_EQ(out.size(), wire::shm::kPlanReplyBytes + 2 * wire::shm::kPlanHitBytes);
  {
    wire::shm::Reader ar(out.data());
    EXPECT_EQ(ar.U32(), 2u);  // hits
    EXPECT_EQ(ar.U32(), 2u);  // worth loading
    const double load_us = ar.F64();
    EXPECT_NEAR(ar.F64(), 64000 - load_us, 1e-6);
    EXPECT_EQ(ar.U64(), 0u);  // no lease
  }

  // A's holds: B names them and hears NotFound; A's holds stand.
  ASSERT_EQ(a.Call(Op::kGetBatch, Keys(get_head, two), &out), kOk);
  ASSERT_EQ(out.size(), 8 + 2 * wire::shm::kGetBatchItemBytes);
  std::vector<uint64_t> leases;
  wire::shm::Reader g(out.data() + 8);
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(g.U32(), 0u);
    g.U32();
    g.U64();
    g.U64();
    g.U64();
    leases.push_back(g.U64());
    g.U64();
  }
  std::vector<uint8_t> rel = Fixed(3, 0);
  for (uint64_t l : leases) {
    std::vector<uint8_t> item(16);
    wire::shm::Writer(item.data()).U64(l).U64(0);
    rel.insert(rel.end(), item.begin(), item.end());
  }
  rel.insert(rel.end(), 16, 0);  // an item that names neither
  ASSERT_EQ(b.Call(Op::kReleaseBatch, rel, &out), kOk);
  ASSERT_EQ(out.size(), 8u + 3 * 4);
  wire::shm::Reader codes(out.data() + 8);
  EXPECT_EQ(static_cast<int>(codes.U32()), kNotFound);
  EXPECT_EQ(static_cast<int>(codes.U32()), kNotFound);
  EXPECT_EQ(static_cast<int>(codes.U32()), kInvalid);
  EXPECT_EQ(c->Delete(TestKey(180)).code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_EQ(a.Call(Op::kReleaseBatch, rel, &out), kOk);
  wire::shm::Reader mine(out.data() + 8);
  EXPECT_EQ(static_cast<int>(mine.U32()), kOk);
  EXPECT_EQ(static_cast<int>(mine.U32()), kOk);
  EXPECT_TRUE(c->Delete(TestKey(180)).ok());
  // A plan's lease is this connection's too.
  wire::shm::Writer(plan.data()).U32(1).U32(256).F64(0).U32(60000).U32(0);
  ASSERT_EQ(a.Call(Op::kPlanAndHold, Keys(plan, std::vector<Hash128>{TestKey(181)}), &out), kOk);
  ASSERT_EQ(out.size(), wire::shm::kPlanReplyBytes + wire::shm::kPlanHitBytes);
  wire::shm::Reader pr(out.data());
  EXPECT_EQ(pr.U32(), 1u);
  EXPECT_EQ(pr.U32(), 1u);
  pr.F64();
  pr.F64();
  const uint64_t plan_lease = pr.U64();
  ASSERT_NE(plan_lease, 0u);
  EXPECT_EQ(b.Call(Op::kRelease, RawDataPlane::U64(plan_lease)), kNotFound);
  EXPECT_EQ(c->Delete(TestKey(181)).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(a.Call(Op::kRelease, RawDataPlane::U64(plan_lease)), kOk);
  EXPECT_TRUE(c->Delete(TestKey(181)).ok());
}

// A daemon that takes fewer keys per request than a frame can carry refuses
// larger batches with InvalidArgument (nothing held) and serves on.
TEST_F(CtlTest, BatchesOverTheDaemonsKeyLimitAreInvalid) {
  DaemonOptions o = SmallDaemonOptions(dir_.path());
  o.max_keys_per_request = 4;
  StartDaemon(o);
  auto c = Client();
  ASSERT_TRUE(c);
  PutChunks(*c, 200, 5);
  std::vector<Hash128> keys;
  for (uint32_t i = 0; i < 5; ++i) keys.push_back(TestKey(200 + i));
  EXPECT_EQ(c->Lookup(keys).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(c->HoldBatch(keys).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(c->LookupAndHold(keys).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(c->PrefetchWithin(keys, 0, 0).status().code(), absl::StatusCode::kInvalidArgument);
  for (uint32_t i = 0; i < 5; ++i) EXPECT_TRUE(c->Delete(TestKey(200 + i)).ok()) << i;
  auto four = c->Lookup(std::span<const Hash128>(keys).first(4));
  EXPECT_TRUE(four.ok()) << four.status();
}

}  // namespace
}  // namespace kvtier::server
