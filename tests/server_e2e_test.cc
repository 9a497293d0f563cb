// kvtierd end to end, in-process: the Daemon on a temp Unix socket (and
// 127.0.0.1:0 for TCP), libkvtier and raw gRPC stubs as clients.
#include <arpa/inet.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <fstream>
#include <map>
#include <random>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "client/kvtier_client.h"
#include "client/kvtier_client_internal.h"
#include "common/file.h"
#include "common/testing/temp_dir.h"
#include "gmock/gmock.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "server/test_util.h"
#include "tests/http_get.h"
#include "tests/in_process_daemon.h"
#include "wire/kvtier.grpc.pb.h"
#include "codec/chunk.h"
#include "wire/chunk_check.h"
#include "server/daemon.h"
#include "server/shm_channel.h"
#include "tests/cli_runner.h"
#include "tests/raw_data_plane.h"

namespace kvtier::server {
namespace {

namespace pb = kvtier::proto::v1;
using kvtier::testing::MakeChunk;
using kvtier::testing::SmallDaemonOptions;
using kvtier::testing::TestKey;

class E2eTest : public kvtier::testing::InProcessDaemonTest {
 protected:
  std::unique_ptr<pb::Kvtier::Stub> RawStub() {
    return pb::Kvtier::NewStub(
        grpc::CreateChannel("unix:" + daemon_->socket_path(), grpc::InsecureChannelCredentials()));
  }
  static void Deadline(grpc::ClientContext& ctx) {
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  }

};

TEST_F(E2eTest, SocketsAreOwnerOnly) {
  struct stat st;
  ASSERT_EQ(::stat(daemon_->socket_path().c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  ASSERT_EQ(::stat(daemon_->shm_socket_path().c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
}

// A put and a get of exact bytes by a new client over shared memory (key
// `seed`) and one over gRPC (key `seed + 1`).
void ExpectServes(Daemon* d, uint32_t seed) {
  for (bool shm : {true, false}) {
    client::ClientOptions o;
    o.socket_path = d->socket_path();
    o.shared_memory = shm;
    o.timeout_ms = 10000;
    auto c = client::KvtierClient::Connect(o);
    ASSERT_TRUE(c.ok()) << c.status();
    EXPECT_EQ((*c)->uses_shared_memory(), shm);
    const uint32_t i = seed + (shm ? 0 : 1);
    const auto chunk = MakeChunk(i);
    ASSERT_TRUE((*c)->Put(TestKey(i), chunk).ok());
    EXPECT_EQ((*c)->Get(TestKey(i)).value_or(std::vector<uint8_t>{}), chunk);
  }
}

bool SocketExists(const std::string& path) {
  struct stat st;
  return ::lstat(path.c_str(), &st) == 0 && S_ISSOCK(st.st_mode);
}

// A second daemon on a data dir in use fails before it opens a tier or a
// socket, with or without an NVMe tier (whose index has its own lock), and
// its failure removes nothing of the first daemon's.
TEST_F(E2eTest, SecondDaemonOnTheSameDataDirIsRefusedAndTheFirstKeepsServing) {
  for (double nvme_gib : {64.0 / 1024, 0.0}) {
    SCOPED_TRACE(::testing::Message() << "nvme_gib " << nvme_gib);
    daemon_.reset();
    DaemonOptions o = SmallDaemonOptions(dir_.path());
    o.nvme_gib = nvme_gib;
    StartDaemon(o);
    ASSERT_TRUE(daemon_);
    {
      auto second = Daemon::Start(o);
      EXPECT_EQ(second.status().code(), absl::StatusCode::kFailedPrecondition);
      EXPECT_THAT(second.status().message(), ::testing::HasSubstr(dir_.path()));
      EXPECT_THAT(second.status().message(),
                  ::testing::HasSubstr("pid " + std::to_string(::getpid())));
    }
    EXPECT_TRUE(SocketExists(daemon_->socket_path()));
    EXPECT_TRUE(SocketExists(daemon_->shm_socket_path()));
    ExpectServes(daemon_.get(), nvme_gib > 0 ? 40 : 42);
  }
  // Once the first daemon is gone the data dir is free again.
  ASSERT_TRUE(daemon_->Shutdown().ok());
  daemon_.reset();
  StartDaemon(SmallDaemonOptions(dir_.path()));
  ExpectServes(daemon_.get(), 44);
}

// Two daemons with their own data dirs never share a socket path, whether
// it is the first one's default socket or one outside both data dirs.
TEST_F(E2eTest, SecondDaemonOnTheSameSocketIsRefusedAndTheFirstKeepsServing) {
  DaemonOptions outside = SmallDaemonOptions(dir_.path() + "/a");
  outside.nvme_gib = 0;
  outside.socket = dir_.path() + "/outside.sock";
  auto first_outside = Daemon::Start(outside);
  ASSERT_TRUE(first_outside.ok()) << first_outside.status();
  for (const std::string& socket : {daemon_->socket_path(), outside.socket}) {
    SCOPED_TRACE(socket);
    DaemonOptions second = SmallDaemonOptions(dir_.path() + "/b");
    second.nvme_gib = 0;
    second.socket = socket;
    auto d = Daemon::Start(second);
    EXPECT_EQ(d.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_THAT(d.status().message(), ::testing::HasSubstr(socket));
  }
  for (Daemon* d : {daemon_.get(), first_outside->get()}) {
    SCOPED_TRACE(d->socket_path());
    EXPECT_TRUE(SocketExists(d->socket_path()));
    EXPECT_TRUE(SocketExists(d->shm_socket_path()));
    ExpectServes(d, 46);
  }
}

// In a directory where other users may create files (/tmp), the lock files
// beside the socket could be another user's: the daemon locks in its data
// dir instead, and refuses a socket path on which a process accepts
// connections.
TEST_F(E2eTest, SocketInASharedDirectoryIgnoresOthersLockFilesAndRefusesALiveSocket) {
  const std::string shared = dir_.path() + "/shared";
  ASSERT_EQ(::mkdir(shared.c_str(), 0700), 0);
  ASSERT_EQ(::chmod(shared.c_str(), 01777), 0);
  const std::string socket = shared + "/kvtierd.sock";
  // "Another user" made and holds both lock files first.
  auto squat = kvtier::ExclusiveFileLock::Acquire(socket + ".lock");
  auto squat_shm = kvtier::ExclusiveFileLock::Acquire(socket + ".shm.lock");
  ASSERT_TRUE(squat.ok() && squat_shm.ok());
  DaemonOptions a = SmallDaemonOptions(dir_.path() + "/a");
  a.nvme_gib = 0;
  a.socket = socket;
  auto first = Daemon::Start(a);
  ASSERT_TRUE(first.ok()) << first.status();
  DaemonOptions b = SmallDaemonOptions(dir_.path() + "/b");
  b.nvme_gib = 0;
  b.socket = socket;
  auto second = Daemon::Start(b);
  EXPECT_EQ(second.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(second.status().message(), ::testing::HasSubstr("in use"));
  EXPECT_TRUE(SocketExists(socket));
  ExpectServes(first->get(), 50);
}

// A second daemon whose --socket is the first one's data-plane socket is
// refused: it would replace that socket (and remove it when it stops).
TEST_F(E2eTest, SecondDaemonOnTheFirstsDataPlaneSocketIsRefused) {
  auto before = Client();
  ASSERT_TRUE(before && before->uses_shared_memory());
  DaemonOptions second = SmallDaemonOptions(dir_.path() + "/b");
  second.nvme_gib = 0;
  second.socket = daemon_->shm_socket_path();
  auto d = Daemon::Start(second);
  EXPECT_EQ(d.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(d.status().message(), ::testing::HasSubstr(daemon_->shm_socket_path()));
  d = absl::FailedPreconditionError("");  // a started one would stop (and unlink) here
  EXPECT_TRUE(SocketExists(daemon_->shm_socket_path()));
  auto after = Client();
  ASSERT_TRUE(after);
  EXPECT_TRUE(after->uses_shared_memory());
  ExpectServes(daemon_.get(), 49);
}

TEST_F(E2eTest, SharedMemoryAndInlineClientsSeeTheSameChunks) {
  auto shm = Client(true);
  auto inl = Client(false);
  ASSERT_TRUE(shm && inl);
  EXPECT_TRUE(shm->uses_shared_memory());
  EXPECT_FALSE(inl->uses_shared_memory());
  auto a = MakeChunk(1), b = MakeChunk(2);
  ASSERT_TRUE(shm->Put(TestKey(1), a).ok());
  ASSERT_TRUE(inl->Put(TestKey(2), b).ok());
  EXPECT_EQ(inl->Get(TestKey(1)).value(), a);
  EXPECT_EQ(shm->Get(TestKey(2)).value(), b);
  std::vector<uint8_t> buf(a.size() + 100);
  auto got = shm->GetInto(TestKey(1), buf);
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(got->first, a.size());
  EXPECT_EQ(got->second, client::Tier::kDram);
  EXPECT_TRUE(std::equal(a.begin(), a.end(), buf.begin()));
  std::vector<uint8_t> small(10);
  EXPECT_EQ(shm->GetInto(TestKey(1), small).status().code(), absl::StatusCode::kInvalidArgument);
  std::vector<Hash128> keys = {TestKey(1), TestKey(2), TestKey(3)};
  EXPECT_THAT(shm->Lookup(keys).value(),
              ::testing::ElementsAre(client::Tier::kDram, client::Tier::kDram));
  // A shared-memory get releases its lease without waiting; a call of the
  // same client that could see the pin (Stats here) waits for it, so after
  // it another client finds the chunk unpinned.
  ASSERT_TRUE(shm->Stats().ok());
  ASSERT_TRUE(inl->Delete(TestKey(1)).ok());
  EXPECT_EQ(shm->Get(TestKey(1)).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(inl->Delete(TestKey(1)).code(), absl::StatusCode::kNotFound);
  // Every shared-memory get released its hold: the chunk can be deleted.
  EXPECT_TRUE(shm->Delete(TestKey(2)).ok());
}

TEST_F(E2eTest, DurablePutReachesNvmeAndStatsCountIt) {
  auto c = Client();
  ASSERT_TRUE(c);
  client::PutOptions po;
  po.durable = true;
  ASSERT_TRUE(c->Put(TestKey(5), MakeChunk(5), po).ok());
  auto s = c->Stats();
  ASSERT_TRUE(s.ok());
  uint64_t nvme_chunks = 0, puts = 0, shm_bytes = 0;
  for (const auto& t : s->tiers) {
    if (t.tier == client::Tier::kNvme) nvme_chunks = t.chunks;
  }
  for (const auto& [n, v] : s->counters) {
    if (n == "puts") puts = v;
    if (n == "bytes_put_shm") shm_bytes = v;
  }
  EXPECT_EQ(nvme_chunks, 1u);
  EXPECT_EQ(puts, 1u);
  EXPECT_EQ(shm_bytes, MakeChunk(5).size());
}

// The engine counters of a Stats answer, by name.
std::map<std::string, uint64_t> Counters(client::KvtierClient& c) {
  std::map<std::string, uint64_t> m;
  auto s = c.Stats();
  EXPECT_TRUE(s.ok()) << s.status();
  if (s.ok()) {
    for (const auto& [n, v] : s->counters) m[n] = v;
  }
  return m;
}

// A chunk of about 400 KiB: 80 fill the 32 MiB DRAM tier of SmallDaemonOptions.
std::vector<uint8_t> MediumChunk(uint32_t seed) { return MakeChunk(seed, 256, 2, 4, 64); }

// Chunks read through shared memory (libkvtier's Get over the data plane)
// are uses like inline gets: under a frequency-aware policy (S3-FIFO: the
// default FLRU acts as LRU on a tier of 80 chunks) a chunk read ten times
// stays in DRAM while four DRAM tiers' worth of chunks that are only put
// pass through, and the reads move the engine's gets and hits counters.
TEST_F(E2eTest, SharedMemoryGetsKeepAChunkHotAndAreCounted) {
  DaemonOptions o = SmallDaemonOptions(dir_.path());
  o.eviction = "s3fifo";
  StartDaemon(o);
  auto c = Client();
  ASSERT_TRUE(c);
  ASSERT_TRUE(c->uses_shared_memory());
  const auto a = MediumChunk(40), filler = MediumChunk(41);
  ASSERT_TRUE(c->Put(TestKey(40), a).ok());
  for (int i = 0; i < 10; ++i) {
    auto got = c->Get(TestKey(40));
    ASSERT_TRUE(got.ok()) << got.status();
    ASSERT_EQ(*got, a);
  }
  auto n = Counters(*c);
  EXPECT_EQ(n["gets"], 10u);
  EXPECT_EQ(n["hits_dram"], 10u);
  EXPECT_EQ(n["misses"], 0u);
  const uint64_t dram = daemon_->engine()->dram()->capacity_bytes();
  const int fill = static_cast<int>(4 * dram / filler.size());
  for (int i = 0; i < fill; ++i) ASSERT_TRUE(c->Put(TestKey(1000 + i), filler).ok()) << i;
  auto got = c->Get(TestKey(40));
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, a);
  std::vector<Hash128> keys = {TestKey(40)};
  EXPECT_THAT(c->Lookup(keys).value(), ::testing::ElementsAre(client::Tier::kDram));
  n = Counters(*c);
  EXPECT_GT(n["evictions"], 0u);
  EXPECT_EQ(n["gets"], 11u);
  EXPECT_EQ(n["hits_dram"], 11u);
  EXPECT_EQ(n["misses"], 0u);
  EXPECT_EQ(c->Get(TestKey(39)).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(Counters(*c)["misses"], 1u);
}

// Admission to NVMe counts shared-memory reads: with admission after three
// uses, a chunk put and read twice over shared memory is written to NVMe when
// DRAM evicts it, while chunks put and read once are dropped.
TEST_F(E2eTest, ChunkReadOverSharedMemoryIsAdmittedToNvmeWhenEvicted) {
  daemon_.reset();
  DaemonOptions o = SmallDaemonOptions(dir_.path());
  o.nvme_admit_after_uses = 3;
  StartDaemon(o);
  auto c = Client();
  ASSERT_TRUE(c);
  ASSERT_TRUE(c->uses_shared_memory());
  const auto a = MediumChunk(42), filler = MediumChunk(43);
  ASSERT_TRUE(c->Put(TestKey(42), a).ok());
  for (int i = 0; i < 2; ++i) ASSERT_TRUE(c->Get(TestKey(42)).ok());
  const uint64_t dram = daemon_->engine()->dram()->capacity_bytes();
  const int fill = static_cast<int>(4 * dram / filler.size());
  for (int i = 0; i < fill; ++i) {
    ASSERT_TRUE(c->Put(TestKey(2000 + i), filler).ok()) << i;
    ASSERT_TRUE(c->Get(TestKey(2000 + i)).ok()) << i;
  }
  std::vector<Hash128> keys = {TestKey(42)};
  EXPECT_THAT(c->Lookup(keys).value(), ::testing::ElementsAre(client::Tier::kNvme));
  auto got = c->Get(TestKey(42));
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, a);
  auto n = Counters(*c);
  EXPECT_GT(n["admission_rejects"], 0u);
  EXPECT_GE(n["demotions"], 1u);
  EXPECT_EQ(n["hits_nvme"], 1u);
}

// Every accepted put counts once, whether its key is new or already stored,
// inline or through a slot, durable or not; a refused one does not count.
TEST_F(E2eTest, PutsCounterCountsEveryAcceptedPut) {
  auto shm = Client(true), inl = Client(false);
  ASSERT_TRUE(shm && inl);
  const auto a = MakeChunk(44);
  ASSERT_TRUE(shm->Put(TestKey(44), a).ok());
  EXPECT_EQ(Counters(*shm)["puts"], 1u);
  ASSERT_TRUE(shm->Put(TestKey(44), a).ok());
  EXPECT_EQ(Counters(*shm)["puts"], 2u);
  ASSERT_TRUE(inl->Put(TestKey(44), a).ok());
  EXPECT_EQ(Counters(*shm)["puts"], 3u);
  client::PutOptions durable;
  durable.durable = true;
  ASSERT_TRUE(shm->Put(TestKey(44), a, durable).ok());
  EXPECT_EQ(Counters(*shm)["puts"], 4u);
  auto bad = a;
  bad[bad.size() / 2] ^= 1;
  EXPECT_EQ(inl->Put(TestKey(45), bad).code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(shm->Put(TestKey(45), bad).code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(Counters(*shm)["puts"], 4u);
}

TEST_F(E2eTest, LongestCachedPrefixFromTokens) {
  auto c = Client();
  ASSERT_TRUE(c);
  Hash128 fp = Hash128::Of(std::string_view("model"), 1);
  std::vector<uint32_t> tokens(3 * 16 + 5);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<uint32_t>(i * 7);
  auto keys = client::KvtierClient::ChunkKeys(fp, tokens, 16).value();
  ASSERT_EQ(keys.size(), 3u);
  ASSERT_TRUE(c->Put(keys[0], MakeChunk(60)).ok());
  ASSERT_TRUE(c->Put(keys[1], MakeChunk(61)).ok());
  auto hit = c->LongestCachedPrefix(fp, tokens, 16);
  ASSERT_TRUE(hit.ok());
  EXPECT_EQ(hit->cached_chunks(), 2u);
  EXPECT_EQ(hit->keys, keys);
}

// Lookup with load estimates, over shared memory and inline gRPC: sizes
// and positive load times per hit; with a prefill rate, how many hits are
// worth loading, with the attention term if asked; hostile rates, attention
// doubling lengths and chunk sizes are InvalidArgument.
TEST_F(E2eTest, PlanLoadEstimatesEachHitAndSaysWhatIsWorthLoading) {
  auto c = Client(), inline_c = Client(false);
  ASSERT_TRUE(c && inline_c);
  auto a = MakeChunk(62), b = MakeChunk(63);
  ASSERT_TRUE(c->Put(TestKey(62), a).ok());
  ASSERT_TRUE(c->Put(TestKey(63), b).ok());
  const std::vector<Hash128> keys = {TestKey(62), TestKey(63), TestKey(64)};
  for (client::KvtierClient* cl : {c.get(), inline_c.get()}) {
    auto plan = cl->PlanLoad(keys);
    ASSERT_TRUE(plan.ok()) << plan.status();
    EXPECT_THAT(plan->tiers, ::testing::ElementsAre(client::Tier::kDram, client::Tier::kDram));
    EXPECT_THAT(plan->chunk_bytes, ::testing::ElementsAre(a.size(), b.size()));
    ASSERT_EQ(plan->load_us.size(), 2u);
    EXPECT_GT(plan->load_us[0], 0);
    EXPECT_EQ(plan->load_chunks, 0u);  // no prefill rate given
    // A fast prefill (1e12 tokens/s) makes recomputing cheaper than any load;
    // a slow one (1000 tokens/s, 16 ms per chunk of 16) makes both worth it.
    EXPECT_EQ(cl->PlanLoad(keys, 1e12, 16)->load_chunks, 0u);
    auto slow = cl->PlanLoad(keys, 1000, 16);
    ASSERT_TRUE(slow.ok());
    EXPECT_EQ(slow->load_chunks, 2u);
    EXPECT_DOUBLE_EQ(slow->load_chunks_us, slow->load_us[0] + slow->load_us[1]);
    EXPECT_NEAR(slow->saved_us, 32000 - slow->load_chunks_us, 1e-6);
    // With C2 = 16 tokens, the chunks of tokens [0, 16) and [16, 32)
    // recompute in 16 ms x (1 + 8/16) and x (1 + 24/16): 24 + 40 ms.
    auto attention = cl->PlanLoad(keys, 1000, 16, /*attention_doubling_tokens=*/16);
    ASSERT_TRUE(attention.ok()) << attention.status();
    EXPECT_EQ(attention->load_chunks, 2u);
    EXPECT_NEAR(attention->saved_us, 64000 - attention->load_chunks_us, 1e-6);
    for (auto [rate, tokens] : {std::pair{-1.0, 16u}, std::pair{std::nan(""), 16u},
                                std::pair{HUGE_VAL, 16u}, std::pair{1000.0, 0u},
                                std::pair{1000.0, (1u << 20) + 1}}) {
      EXPECT_EQ(cl->PlanLoad(keys, rate, tokens).status().code(), absl::StatusCode::kInvalidArgument)
          << rate << " " << tokens;
    }
    for (double c2 : {-1.0, std::nan(""), HUGE_VAL, -HUGE_VAL}) {
      for (double rate : {0.0, 1000.0}) {
        auto bad = cl->PlanLoad(keys, rate, 16, c2);
        EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument) << c2 << " " << rate;
        EXPECT_THAT(bad.status().message(), ::testing::HasSubstr("attention_doubling_tokens"));
        EXPECT_EQ(cl->LookupAndHold(keys, rate, 16, 0, c2).status().code(),
                  absl::StatusCode::kInvalidArgument)
            << c2 << " " << rate;
      }
    }
  }
  std::vector<Hash128> many(5000, TestKey(62));
  EXPECT_EQ(c->PlanLoad(many).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(c->PlanLoad(std::vector<Hash128>{TestKey(64)})->tiers.empty());
}

TEST_F(E2eTest, AsyncAndBatchedCalls) {
  auto c = Client();
  ASSERT_TRUE(c);
  std::vector<std::vector<uint8_t>> chunks;
  std::vector<Hash128> keys;
  for (uint32_t i = 0; i < 6; ++i) {
    chunks.push_back(MakeChunk(100 + i));
    keys.push_back(TestKey(100 + i));
  }
  std::vector<std::span<const uint8_t>> spans(chunks.begin(), chunks.end());
  for (const absl::Status& s : c->PutBatch(keys, spans)) EXPECT_TRUE(s.ok()) << s;
  auto got = c->GetBatch(keys);
  for (size_t i = 0; i < keys.size(); ++i) {
    ASSERT_TRUE(got[i].ok());
    EXPECT_EQ(*got[i], chunks[i]);
  }
  auto f = c->GetAsync(TestKey(100));
  auto l = c->LookupAsync(keys);
  EXPECT_EQ(f.get().value(), chunks[0]);
  EXPECT_EQ(l.get().value().size(), keys.size());
  auto miss = c->GetAsync(TestKey(999));
  EXPECT_EQ(miss.get().status().code(), absl::StatusCode::kNotFound);
}

TEST_F(E2eTest, BadRequestsGetTheirExactCodes) {
  auto stub = RawStub();
  {
    grpc::ClientContext ctx;
    Deadline(ctx);
    pb::LookupRequest req;  // version 0
    req.add_keys(std::string(16, 'a'));
    pb::LookupResponse resp;
    EXPECT_EQ(stub->Lookup(&ctx, req, &resp).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  }
  {
    grpc::ClientContext ctx;
    Deadline(ctx);
    pb::GetRequest req;
    req.set_version(1);
    req.set_key("short");
    pb::GetResponse resp;
    EXPECT_EQ(stub->Get(&ctx, req, &resp).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  }
  {
    grpc::ClientContext ctx;
    Deadline(ctx);
    pb::PutRequest req;  // neither bytes nor slot
    req.set_version(1);
    req.set_key(std::string(16, 'k'));
    pb::PutResponse resp;
    EXPECT_EQ(stub->Put(&ctx, req, &resp).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  }
  {
    grpc::ClientContext ctx;
    Deadline(ctx);
    pb::PutRequest req;  // a slot id the daemon never handed out
    req.set_version(1);
    req.set_key(std::string(16, 'k'));
    req.set_slot_id(123456789);
    pb::PutResponse resp;
    EXPECT_EQ(stub->Put(&ctx, req, &resp).error_code(), grpc::StatusCode::NOT_FOUND);
  }
  {
    grpc::ClientContext ctx;
    Deadline(ctx);
    pb::PutRequest req;  // corrupted chunk bytes
    req.set_version(1);
    req.set_key(std::string(16, 'k'));
    auto chunk = MakeChunk(7);
    chunk[300] ^= 4;
    req.set_inline_chunk(std::string(chunk.begin(), chunk.end()));
    pb::PutResponse resp;
    EXPECT_EQ(stub->Put(&ctx, req, &resp).error_code(), grpc::StatusCode::DATA_LOSS);
  }
  {
    grpc::ClientContext ctx;
    Deadline(ctx);
    pb::LookupRequest req;  // more keys than the limit
    req.set_version(1);
    for (int i = 0; i < 4097; ++i) req.add_keys(std::string(16, 'a'));
    pb::LookupResponse resp;
    EXPECT_EQ(stub->Lookup(&ctx, req, &resp).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  }
  {
    grpc::ClientContext ctx;
    Deadline(ctx);
    pb::GetRequest req;
    req.set_version(1);
    req.set_key(std::string(16, 'u'));  // unknown key
    pb::GetResponse resp;
    EXPECT_EQ(stub->Get(&ctx, req, &resp).error_code(), grpc::StatusCode::NOT_FOUND);
  }
  {
    grpc::ClientContext ctx;
    Deadline(ctx);
    pb::LookupRequest req;  // a protocol version the daemon does not serve
    req.set_version(2);
    req.add_keys(std::string(16, 'a'));
    pb::LookupResponse resp;
    EXPECT_EQ(stub->Lookup(&ctx, req, &resp).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  }
  auto truncated_put = [&](size_t keep) {
    grpc::ClientContext ctx;
    Deadline(ctx);
    pb::PutRequest req;
    req.set_version(1);
    req.set_key(std::string(16, 't'));
    auto chunk = MakeChunk(9);
    req.set_inline_chunk(std::string(chunk.begin(), chunk.begin() + keep));
    pb::PutResponse resp;
    return stub->Put(&ctx, req, &resp).error_code();
  };
  // Cut inside the header: malformed; cut after it: the lengths disagree.
  EXPECT_EQ(truncated_put(100), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(truncated_put(MakeChunk(9).size() - 1), grpc::StatusCode::DATA_LOSS);
  // The daemon still serves.
  auto c = Client();
  ASSERT_TRUE(c);
  EXPECT_TRUE(c->Put(TestKey(8), MakeChunk(8)).ok());
  EXPECT_EQ(c->Get(TestKey(9)).status().code(), absl::StatusCode::kNotFound);
}

TEST_F(E2eTest, MalformedProtobufIsRefusedAndTheDaemonKeepsServing) {
  auto channel = grpc::CreateChannel("unix:" + daemon_->socket_path(), grpc::InsecureChannelCredentials());
  grpc::GenericStub generic(channel);
  grpc::ClientContext ctx;
  Deadline(ctx);
  // Field 2 (key) as a length-delimited field claiming 100 bytes with 3 present.
  const char junk[] = {0x12, 0x64, 'a', 'b', 'c'};
  grpc::Slice slice(junk, sizeof(junk));
  grpc::ByteBuffer req(&slice, 1), resp;
  grpc::Status got;
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  generic.UnaryCall(&ctx, "/kvtier.proto.v1.Kvtier/Get", grpc::StubOptions(), &req, &resp,
                    [&](grpc::Status s) {
                      std::lock_guard<std::mutex> l(mu);
                      got = s;
                      done = true;
                      cv.notify_one();
                    });
  std::unique_lock<std::mutex> l(mu);
  ASSERT_TRUE(cv.wait_for(l, std::chrono::seconds(10), [&] { return done; }));
  EXPECT_EQ(got.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << got.error_message();
  EXPECT_THAT(got.error_message(), ::testing::HasSubstr("malformed GetRequest"));
  auto c = Client();
  ASSERT_TRUE(c);
  EXPECT_TRUE(c->Put(TestKey(9), MakeChunk(9)).ok());
}

TEST_F(E2eTest, OversizedMessageIsResourceExhausted) {
  daemon_.reset();
  DaemonOptions o = SmallDaemonOptions(dir_.path());
  o.max_message_mib = 1;
  StartDaemon(o);
  auto c = Client(false);
  ASSERT_TRUE(c);
  auto big = MakeChunk(11, 256, 8, 4, 128);  // ~1.5 MiB
  ASSERT_GT(big.size(), 1u << 20);
  EXPECT_EQ(c->Put(TestKey(11), big).code(), absl::StatusCode::kResourceExhausted);
  // Through shared memory the chunk never travels in a message.
  auto shm = Client(true);
  ASSERT_TRUE(shm);
  EXPECT_TRUE(shm->Put(TestKey(11), big).ok());
}

TEST_F(E2eTest, SlotWrittenAfterCommitIsDataLossOnGet) {
  auto c = Client();
  ASSERT_TRUE(c);
  auto other = MakeChunk(15);
  ASSERT_TRUE(c->Put(TestKey(15), other).ok());
  auto chunk = MakeChunk(12);
  auto slot = c->AllocateSlot(chunk.size());
  ASSERT_TRUE(slot.ok());
  std::copy(chunk.begin(), chunk.end(), slot->data.begin());
  ASSERT_TRUE(c->CommitSlot(*slot, TestKey(12)).ok());
  slot->data[1000] ^= 0x55;  // the slot is no longer the client's
  // The daemon hands out the extent without reading it; the client's check
  // of its copy finds the damage, the daemon confirms and drops the chunk.
  std::vector<uint8_t> buf(chunk.size());
  EXPECT_EQ(c->GetInto(TestKey(12), buf).status().code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(c->Get(TestKey(12)).status().code(), absl::StatusCode::kNotFound);
  // Only the corrupt chunk is dropped: the other committed one is intact.
  auto kept = c->Get(TestKey(15));
  ASSERT_TRUE(kept.ok()) << kept.status();
  EXPECT_EQ(*kept, other);
  // A committed slot cannot be committed or aborted again.
  EXPECT_EQ(c->CommitSlot(*slot, TestKey(13)).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(c->AbortSlot(*slot).code(), absl::StatusCode::kNotFound);
}

// The batched get holds its keys in groups (two read while the one before
// them is copied): a chunk damaged in the pool in a middle group is that
// key's DataLoss alone, found by the check of the copy, and dropped.
TEST_F(E2eTest, BatchGetReportsAChunkDamagedInThePoolAsDataLossOfItsKeyOnly) {
  auto c = Client();
  ASSERT_TRUE(c);
  std::vector<Hash128> keys;
  std::vector<std::vector<uint8_t>> chunks;
  for (uint32_t i = 0; i < 9; ++i) {
    keys.push_back(TestKey(40 + i));
    chunks.push_back(MakeChunk(40 + i));
    if (i != 4) ASSERT_TRUE(c->Put(keys.back(), chunks.back()).ok()) << i;
  }
  auto slot = c->AllocateSlot(chunks[4].size());
  ASSERT_TRUE(slot.ok()) << slot.status();
  std::copy(chunks[4].begin(), chunks[4].end(), slot->data.begin());
  ASSERT_TRUE(c->CommitSlot(*slot, keys[4]).ok());
  slot->data[slot->data.size() - 7] ^= 0x20;  // a payload byte, after the commit
  std::vector<std::vector<uint8_t>> bufs(keys.size(), std::vector<uint8_t>(chunks[0].size() + 64));
  std::vector<std::span<uint8_t>> outs(bufs.begin(), bufs.end());
  auto got = c->GetBatchInto(keys, outs);
  ASSERT_EQ(got.size(), keys.size());
  for (size_t i = 0; i < keys.size(); ++i) {
    if (i == 4) {
      EXPECT_EQ(got[i].status().code(), absl::StatusCode::kDataLoss) << got[i].status();
      continue;
    }
    ASSERT_TRUE(got[i].ok()) << i << " " << got[i].status();
    ASSERT_EQ(got[i]->first, chunks[i].size()) << i;
    EXPECT_TRUE(std::equal(chunks[i].begin(), chunks[i].end(), bufs[i].begin())) << i;
  }
  auto again = c->GetBatch(keys);
  EXPECT_EQ(again[4].status().code(), absl::StatusCode::kNotFound) << again[4].status();
  for (size_t i : {size_t{3}, size_t{5}}) {
    ASSERT_TRUE(again[i].ok()) << i << " " << again[i].status();
    EXPECT_EQ(*again[i], chunks[i]) << i;
  }
}

// A GPU store's slot: allocated and committed on a data-plane connection,
// with the checksums left to the daemon (PutOptions::daemon_seals).
TEST_F(E2eTest, SlotCommittedUnsealedIsSealedByTheDaemon) {
  auto c = Client();
  ASSERT_TRUE(c);
  auto chunk = MakeChunk(19, 64, 3, 2, 64);
  auto h = codec::ParseHeader(chunk).value();
  auto unsealed = chunk;
  std::memset(unsealed.data() + codec::kOffKChecksum, 0, 16);
  std::memset(unsealed.data() + codec::kOffHeaderChecksum, 0, 8);
  std::memset(unsealed.data() + h.layout.v_offset + h.layout.v.table_offset, 0,
              h.layout.v.table_bytes);
  auto slot = c->AllocateSlot(unsealed.size());
  ASSERT_TRUE(slot.ok()) << slot.status();
  EXPECT_NE(slot->connection, 0u);  // the data plane's
  std::copy(unsealed.begin(), unsealed.end(), slot->data.begin());
  client::PutOptions seal;
  seal.daemon_seals = true;
  ASSERT_TRUE(c->CommitSlot(*slot, TestKey(19), seal).ok());
  auto got = c->Get(TestKey(19));
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, chunk);
  // Unsealed without the flag: the daemon's check refuses it.
  auto again = c->AllocateSlot(unsealed.size());
  ASSERT_TRUE(again.ok()) << again.status();
  std::copy(unsealed.begin(), unsealed.end(), again->data.begin());
  EXPECT_EQ(c->CommitSlot(*again, TestKey(20)).code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(c->AbortSlot(*again).code(), absl::StatusCode::kNotFound);
}

// A landing commit (PutOptions::landing_layers), as a GPU store's copy engine
// does it, played by a thread: the header is in the slot before the commit,
// then each group of layers lands, followed by its wire::LandingMarker. The
// daemon seals each record as it lands and stores the chunk whole. Markers
// that do not come (or are another slot's) end the commit with
// DeadlineExceeded and leave the slot to the client, who commits it once its
// bytes are there; a malformed landing commit keeps the slot alike.
TEST_F(E2eTest, SlotCommittedWhileLandingIsSealedAsItLands) {
  auto c = Client();
  ASSERT_TRUE(c);
  constexpr uint32_t kLayers = 8, kGroup = 3;
  auto chunk = MakeChunk(23, 64, kLayers, 2, 64);
  const codec::ChunkLayout l = codec::ParseHeader(chunk).value().layout;
  auto unsealed = chunk;
  std::memset(unsealed.data() + codec::kOffKChecksum, 0, 16);
  std::memset(unsealed.data() + codec::kOffHeaderChecksum, 0, 8);
  // Lands [0, k_offset), then per section and group its records (V's first
  // group with the padding before V), each followed by the marker of slot
  // `marker_slot` (0: no markers), after `pause`.
  auto land = [&](const client::WritableSlot& slot, uint64_t marker_slot, absl::Duration pause) {
    uint8_t* dst = slot.data.data();
    for (uint32_t s = 0; s < 2; ++s) {
      const codec::SectionLayout& sec = s == 0 ? l.k : l.v;
      const uint64_t base = s == 0 ? l.k_offset : l.v_offset;
      for (uint32_t a = 0; a < kLayers; a += kGroup) {
        const uint32_t b = std::min(kLayers, a + kGroup);
        absl::SleepFor(pause);
        const uint64_t from = s == 1 && a == 0 ? l.k_offset + l.k.bytes : base + sec.data_offset(a);
        std::memcpy(dst + from, unsealed.data() + from, base + sec.data_offset(b) - from);
        if (marker_slot == 0) continue;
        auto* entry = reinterpret_cast<uint64_t*>(dst + base + sec.table_offset + 8 * (b - 1));
        __atomic_store_n(entry, wire::LandingMarker(marker_slot, static_cast<codec::Section>(s), b - 1),
                         __ATOMIC_RELEASE);
      }
    }
  };
  auto begin = [&]() {
    auto slot = c->AllocateSlot(unsealed.size());
    EXPECT_TRUE(slot.ok()) << slot.status();
    // What an earlier chunk in these bytes left, and the header.
    std::memset(slot->data.data(), 0xEE, slot->data.size());
    std::memcpy(slot->data.data(), unsealed.data(), l.k_offset);
    return *slot;
  };
  client::PutOptions landing;
  landing.daemon_seals = true;
  landing.landing_layers = kGroup;

  auto slot = begin();
  std::thread writer([&] { land(slot, slot.id, absl::Milliseconds(3)); });
  absl::Status st = c->CommitSlot(slot, TestKey(23), landing);
  writer.join();
  ASSERT_TRUE(st.ok()) << st;
  auto got = c->Get(TestKey(23));
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, chunk);

  // Another slot's markers: nothing lands as far as the daemon can tell.
  // Meanwhile another client's puts are served (the waiting commit holds a
  // few of the daemon's pool threads, not all).
  auto late = begin();
  land(late, late.id + 1, absl::ZeroDuration());
  const absl::Time t0 = absl::Now();
  std::thread waiting([&] {
    EXPECT_EQ(c->CommitSlot(late, TestKey(24), landing).code(),
              absl::StatusCode::kDeadlineExceeded);
  });
  auto other = Client();
  ASSERT_TRUE(other);
  absl::SleepFor(absl::Milliseconds(100));  // the commit is waiting by now
  const auto big = MakeChunk(27, 256, kLayers, 8, 128);
  const absl::Time p0 = absl::Now();
  for (uint32_t i = 0; i < 4; ++i) ASSERT_TRUE(other->Put(TestKey(30 + i), big).ok());
  EXPECT_LT(absl::Now() - p0, absl::Milliseconds(wire::shm::kLandingWaitMs / 2));
  waiting.join();
  EXPECT_GE(absl::Now() - t0, absl::Milliseconds(wire::shm::kLandingWaitMs));
  client::PutOptions sealed;
  sealed.daemon_seals = true;
  ASSERT_TRUE(c->CommitSlot(late, TestKey(24), sealed).ok());  // still the client's
  got = c->Get(TestKey(24));
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, chunk);

  // Groups larger than the chunk's layers, and a version 1 chunk: refused,
  // the slot kept.
  auto bad = begin();
  client::PutOptions wide = landing;
  wide.landing_layers = kLayers + 1;
  EXPECT_EQ(c->CommitSlot(bad, TestKey(25), wide).code(), absl::StatusCode::kInvalidArgument);
  const auto v1 = kvtier::testing::AsVersionOne(chunk);
  auto old = c->AllocateSlot(v1.size());
  ASSERT_TRUE(old.ok()) << old.status();
  std::copy(v1.begin(), v1.end(), old->data.begin());
  EXPECT_EQ(c->CommitSlot(*old, TestKey(26), landing).code(), absl::StatusCode::kInvalidArgument);
  // A header that does not parse (its magic gone), and a slot longer than
  // the chunk its header describes: refused, the slots kept.
  auto garbled = begin();
  garbled.data[0] ^= 0xFF;
  EXPECT_EQ(c->CommitSlot(garbled, TestKey(28), landing).code(),
            absl::StatusCode::kInvalidArgument);
  auto longer = c->AllocateSlot(unsealed.size() + 64);
  ASSERT_TRUE(longer.ok()) << longer.status();
  std::memcpy(longer->data.data(), unsealed.data(), l.k_offset);
  EXPECT_EQ(c->CommitSlot(*longer, TestKey(29), landing).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(c->AbortSlot(garbled).ok());
  EXPECT_TRUE(c->AbortSlot(*longer).ok());
  EXPECT_TRUE(c->AbortSlot(bad).ok());
  EXPECT_TRUE(c->AbortSlot(*old).ok());
  EXPECT_EQ(c->Get(TestKey(25)).status().code(), absl::StatusCode::kNotFound);
}

// The streamed put (what libkvtier's Put uses with shared memory) through a
// raw stub: a corrupt chunk, a stream without its commit message, a length
// beyond the slot and a changed slot id each get their code and free the slot.
TEST_F(E2eTest, StreamedPutChecksBytesAndStreamRules) {
  auto c = Client();
  ASSERT_TRUE(c);
  auto stub = RawStub();
  auto chunk = MakeChunk(18);
  auto run = [&](std::vector<uint8_t> bytes, const std::vector<std::pair<uint64_t, bool>>& msgs,
                 int64_t slot_delta = 0) {
    // A gRPC slot (the client allocates on its data-plane connection, whose
    // slots a gRPC call cannot name), written through the client's mapping.
    pb::AllocateSlotResponse slot;
    {
      grpc::ClientContext actx;
      Deadline(actx);
      pb::AllocateSlotRequest areq;
      areq.set_version(1);
      areq.set_bytes(bytes.size());
      EXPECT_TRUE(stub->AllocateSlot(&actx, areq, &slot).ok());
      if (slot.slot_id() == 0) return grpc::StatusCode::UNKNOWN;
    }
    std::copy(bytes.begin(), bytes.end(), c->mapped_pool().begin() + slot.extent().offset());
    grpc::ClientContext ctx;
    Deadline(ctx);
    pb::PutResponse resp;
    auto w = stub->PutStream(&ctx, &resp);
    for (size_t i = 0; i < msgs.size(); ++i) {
      pb::PutStreamRequest m;
      m.set_version(1);
      m.set_key(std::string(16, 's'));
      m.set_slot_id(slot.slot_id() + (i > 0 ? slot_delta : 0));
      m.set_written_bytes(msgs[i].first);
      m.set_commit(msgs[i].second);
      if (!w->Write(m)) break;
    }
    w->WritesDone();
    grpc::StatusCode code = w->Finish().error_code();
    // Whatever happened, the slot is no longer open.
    grpc::ClientContext xctx;
    Deadline(xctx);
    pb::AbortSlotRequest x;
    x.set_version(1);
    x.set_slot_id(slot.slot_id());
    pb::AbortSlotResponse xr;
    EXPECT_EQ(stub->AbortSlot(&xctx, x, &xr).error_code(), grpc::StatusCode::NOT_FOUND);
    return code;
  };
  const uint64_t n = chunk.size();
  auto bad = chunk;
  bad[n / 2] ^= 8;
  EXPECT_EQ(run(bad, {{n / 3, false}, {n, true}}), grpc::StatusCode::DATA_LOSS);
  EXPECT_EQ(run(chunk, {{n / 3, false}, {n / 2, false}}), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(run(chunk, {{n + 1, true}}), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(run(chunk, {{n / 2, false}, {n / 3, true}}), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(run(chunk, {{n / 3, false}, {n, true}}, 1), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(run(chunk, {{n / 3, false}, {n / 2, true}}), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(run(chunk, {{n / 3, false}, {n, true}}), grpc::StatusCode::OK);
  EXPECT_EQ(c->Get(Hash128::Of(std::string_view("x"), 0)).status().code(),
            absl::StatusCode::kNotFound);
  // The daemon still serves, and the committed chunk reads back.
  Hash128 k;
  std::memset(k.bytes.data(), 's', k.bytes.size());
  EXPECT_EQ(c->Get(k).value(), chunk);
}

TEST_F(E2eTest, HoldReadsTheChunkInPlaceUntilUnhold) {
  auto c = Client();
  ASSERT_TRUE(c);
  auto chunk = MakeChunk(17);
  ASSERT_TRUE(c->Put(TestKey(17), chunk).ok());
  auto h = c->Hold(TestKey(17));
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_NE(h->lease_id, 0u);
  EXPECT_TRUE(std::equal(h->data.begin(), h->data.end(), chunk.begin(), chunk.end()));
  EXPECT_EQ(c->Delete(TestKey(17)).code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(c->Unhold(*h).ok());
  EXPECT_TRUE(c->Delete(TestKey(17)).ok());
  EXPECT_EQ(c->Hold(TestKey(17)).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(Client(false)->Hold(TestKey(17)).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

// Holds taken at once from several threads go over several data-plane
// connections; Unhold goes back over the connection that took the hold
// (the daemon takes a release only from it), so every Unhold succeeds and
// leaves the chunk unpinned.
TEST_F(E2eTest, HoldsFromManyThreadsAreUnheldOverTheirOwnConnections) {
  auto c = Client();
  ASSERT_TRUE(c);
  constexpr int kThreads = 4, kRounds = 40;
  for (int t = 0; t < kThreads; ++t) ASSERT_TRUE(c->Put(TestKey(50 + t), MakeChunk(50 + t)).ok());
  for (int round = 0; round < kRounds; ++round) {
    std::vector<absl::StatusOr<client::HeldChunk>> held(kThreads, absl::UnknownError("not run"));
    std::atomic<int> ready{0};
    std::vector<std::thread> ts;
    for (int t = 0; t < kThreads; ++t) {
      ts.emplace_back([&, t] {
        ready.fetch_add(1);
        while (ready.load() < kThreads) std::this_thread::yield();
        held[t] = c->Hold(TestKey(50 + t));
      });
    }
    for (auto& t : ts) t.join();
    for (int t = 0; t < kThreads; ++t) {
      ASSERT_TRUE(held[t].ok()) << held[t].status();
      ASSERT_TRUE(c->Unhold(*held[t]).ok()) << "round " << round << " thread " << t;
    }
  }
  for (int t = 0; t < kThreads; ++t) EXPECT_TRUE(c->Delete(TestKey(50 + t)).ok()) << t;
}

TEST_F(E2eTest, PinsOfADisconnectedClientExpire) {
  auto a = Client();
  ASSERT_TRUE(a);
  ASSERT_TRUE(a->Put(TestKey(14), MakeChunk(14)).ok());
  std::vector<Hash128> keys = {TestKey(14)};
  ASSERT_TRUE(a->Pin(keys, 300).ok());
  a.reset();  // the client goes away without releasing
  auto b = Client();
  ASSERT_TRUE(b);
  EXPECT_EQ(b->Delete(TestKey(14)).code(), absl::StatusCode::kFailedPrecondition);
  absl::Status st;
  auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  do {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    st = b->Delete(TestKey(14));
  } while (absl::IsFailedPrecondition(st) && std::chrono::steady_clock::now() < until);
  EXPECT_TRUE(st.ok()) << st;
}

TEST_F(E2eTest, ConcurrentClientsOnOverlappingKeysGetExactBytesOrNotFound) {
  constexpr int kThreads = 8, kOps = 60, kKeys = 12;
  std::vector<std::vector<uint8_t>> chunks;
  for (int k = 0; k < kKeys; ++k) chunks.push_back(MakeChunk(200 + k));
  std::atomic<int> bad{0}, hits{0};
  std::vector<std::thread> ts;
  for (int t = 0; t < kThreads; ++t) {
    ts.emplace_back([&, t] {
      auto c = Client(t % 2 == 0);
      if (!c) {
        ++bad;
        return;
      }
      std::mt19937 rng(t);
      for (int i = 0; i < kOps; ++i) {
        int k = static_cast<int>(rng() % kKeys);
        int op = static_cast<int>(rng() % 4);
        if (op == 0 || op == 1) {
          absl::Status s = c->Put(TestKey(200 + k), chunks[k]);
          if (!s.ok()) ++bad;
        } else if (op == 2) {
          auto g = c->Get(TestKey(200 + k));
          if (g.ok()) {
            ++hits;
            if (*g != chunks[k]) ++bad;
          } else if (!absl::IsNotFound(g.status())) {
            ++bad;
          }
        } else {
          absl::Status s = c->Delete(TestKey(200 + k));
          // Another client may hold a get's lease, or the chunk may be gone.
          if (!s.ok() && !absl::IsNotFound(s) && !absl::IsFailedPrecondition(s) &&
              !absl::IsUnavailable(s)) {
            ++bad;
          }
        }
      }
    });
  }
  for (auto& t : ts) t.join();
  EXPECT_EQ(bad.load(), 0);
  EXPECT_GT(hits.load(), 0);
}

TEST_F(E2eTest, DataPlaneServesAStreamedPutAGetAndItsRelease) {
  RawDataPlane dp(daemon_->shm_socket_path());
  ASSERT_TRUE(dp.ok()) << dp.error();
  EXPECT_EQ(dp.Call(RawDataPlane::Op::kHello, {}), kOk);
  auto chunk = MakeChunk(30);
  uint64_t slot = dp.SlotWith(chunk);
  dp.Send(RawDataPlane::Op::kPutBegin, RawDataPlane::Begin(slot, TestKey(30)));
  dp.Send(RawDataPlane::Op::kPutProgress, RawDataPlane::U64(chunk.size() / 2));
  EXPECT_EQ(dp.Call(RawDataPlane::Op::kPutCommit, RawDataPlane::U64(chunk.size())), kOk);
  std::vector<uint8_t> g;
  ASSERT_EQ(dp.Call(RawDataPlane::Op::kGet, RawDataPlane::Get(TestKey(30)), &g), kOk);
  ASSERT_EQ(g.size(), wire::shm::kGetReplyBytes);
  wire::shm::Reader r(g.data());
  EXPECT_EQ(r.U8(), 2);  // TIER_DRAM
  for (int i = 0; i < 7; ++i) r.U8();
  EXPECT_EQ(r.U64(), chunk.size());
  const uint64_t offset = r.U64(), length = r.U64(), lease = r.U64();
  ASSERT_EQ(length, chunk.size());
  EXPECT_TRUE(std::equal(chunk.begin(), chunk.end(), dp.pool().begin() + offset));
  auto c = Client();
  ASSERT_TRUE(c);
  EXPECT_EQ(c->Delete(TestKey(30)).code(), absl::StatusCode::kFailedPrecondition);  // pinned
  EXPECT_EQ(dp.Call(RawDataPlane::Op::kRelease, RawDataPlane::U64(lease)), kOk);
  EXPECT_EQ(dp.Call(RawDataPlane::Op::kRelease, RawDataPlane::U64(lease)), kNotFound);
  EXPECT_TRUE(c->Delete(TestKey(30)).ok());
}

// Slot and lease ids are scoped to the data-plane connection that got them:
// another connection that names them (release, abort, put begin) gets the
// answer an unknown id gets, NotFound, and the owner's slot and lease are
// untouched: it can still commit and release them.
TEST_F(E2eTest, DataPlaneConnectionCannotUseAnotherConnectionsSlotOrLease) {
  using Op = RawDataPlane::Op;
  auto c = Client();
  ASSERT_TRUE(c);
  ASSERT_TRUE(c->Put(TestKey(46), MakeChunk(46)).ok());
  RawDataPlane a(daemon_->shm_socket_path()), b(daemon_->shm_socket_path());
  ASSERT_TRUE(a.ok()) << a.error();
  ASSERT_TRUE(b.ok()) << b.error();
  const auto chunk = MakeChunk(47);
  const uint64_t slot = a.SlotWith(chunk);
  std::vector<uint8_t> g;
  ASSERT_EQ(a.Call(Op::kGet, RawDataPlane::Get(TestKey(46)), &g), kOk);
  ASSERT_EQ(g.size(), wire::shm::kGetReplyBytes);
  wire::shm::Reader r(g.data());
  for (int i = 0; i < 8 + 3 * 8; ++i) r.U8();  // tier, reserved, chunk bytes, offset, length
  const uint64_t lease = r.U64();
  ASSERT_NE(lease, 0u);
  ASSERT_NE(slot, 0u);

  // What B hears for A's ids is what it hears for ids nobody holds.
  auto answer = [&](Op op, uint64_t id) {
    b.Send(op, RawDataPlane::U64(id));
    auto ans = b.Read();
    EXPECT_TRUE(ans.has_value());
    if (!ans) return std::make_pair(-1, std::string());
    return std::make_pair(static_cast<int>(ans->code),
                          std::string(ans->payload.begin(), ans->payload.end()));
  };
  auto begin_commit = [&](uint64_t id) {
    b.Send(Op::kPutBegin, RawDataPlane::Begin(id, TestKey(48)));
    return b.Call(Op::kPutCommit, RawDataPlane::U64(chunk.size()));
  };
  const uint64_t unknown = 0x5eed5eed5eedull;
  const auto unknown_release = answer(Op::kRelease, unknown);
  const auto unknown_abort = answer(Op::kAbortSlot, unknown);
  EXPECT_EQ(unknown_release.first, kNotFound);
  EXPECT_EQ(unknown_abort.first, kNotFound);
  auto with_id = [](std::string msg, uint64_t from, uint64_t to) {
    return absl::StrReplaceAll(msg, {{absl::StrCat(from), absl::StrCat(to)}});
  };
  const auto foreign_release = answer(Op::kRelease, lease);
  EXPECT_EQ(foreign_release.first, kNotFound);
  EXPECT_EQ(with_id(foreign_release.second, lease, unknown), unknown_release.second);
  const auto foreign_abort = answer(Op::kAbortSlot, slot);
  EXPECT_EQ(foreign_abort.first, kNotFound);
  EXPECT_EQ(with_id(foreign_abort.second, slot, unknown), unknown_abort.second);
  EXPECT_EQ(begin_commit(slot), kNotFound);
  EXPECT_EQ(begin_commit(unknown), kNotFound);
  EXPECT_EQ(c->Get(TestKey(48)).status().code(), absl::StatusCode::kNotFound);
  // Over gRPC too: a lease or slot is its connection's, whoever names it.
  EXPECT_EQ(c->Release(lease).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(c->Release(unknown).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(c->AbortSlot(client::WritableSlot{slot, {}}).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(c->CommitSlot(client::WritableSlot{slot, {}}, TestKey(48)).code(),
            absl::StatusCode::kNotFound);
  {
    auto stub = RawStub();
    grpc::ClientContext ctx;
    Deadline(ctx);
    pb::RenewRequest req;
    req.set_version(1);
    req.set_lease_id(lease);
    pb::PinResponse resp;
    EXPECT_EQ(stub->Renew(&ctx, req, &resp).error_code(), grpc::StatusCode::NOT_FOUND);
  }

  // A's lease still pins the chunk, and A's slot still takes A's put.
  EXPECT_EQ(c->Delete(TestKey(46)).code(), absl::StatusCode::kFailedPrecondition);
  a.Send(Op::kPutBegin, RawDataPlane::Begin(slot, TestKey(47)));
  EXPECT_EQ(a.Call(Op::kPutCommit, RawDataPlane::U64(chunk.size())), kOk);
  auto got = c->Get(TestKey(47));
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, chunk);
  EXPECT_EQ(a.Call(Op::kRelease, RawDataPlane::U64(lease)), kOk);
  EXPECT_TRUE(c->Delete(TestKey(46)).ok());
  // B's connection still serves.
  EXPECT_EQ(b.Call(Op::kHello, {}), kOk);
}

// Every malformed frame gets one error answer, then the daemon closes the
// connection; it goes on serving others.
TEST_F(E2eTest, DataPlaneRefusesMalformedFramesAndClosesTheConnection) {
  using Op = RawDataPlane::Op;
  auto chunk = MakeChunk(31);
  struct Case {
    const char* name;
    std::vector<uint8_t> frame;
    int code;
  };
  const std::vector<Case> cases = {
      {"wrong version", RawDataPlane::Frame(2, 1, {}), kInvalid},
      {"unknown op", RawDataPlane::Frame(1, 99, {}), kInvalid},
      {"op 0", RawDataPlane::Frame(1, 0, {}), kInvalid},
      {"short payload", RawDataPlane::Frame(1, 2, {1, 2, 3, 4}), kInvalid},
      {"long payload", RawDataPlane::Frame(1, 7, std::vector<uint8_t>(9)), kInvalid},
      {"oversized length", RawDataPlane::Frame(1, 6, {}, int64_t{1} << 31), kInvalid},
      {"progress outside a put", RawDataPlane::Frame(1, 4, RawDataPlane::U64(8)), kPrecondition},
      {"commit outside a put", RawDataPlane::Frame(1, 5, RawDataPlane::U64(8)), kPrecondition},
      {"range outside a put", RawDataPlane::Frame(1, 9, RawDataPlane::Range(0, 8)), kPrecondition},
      {"short range", RawDataPlane::Frame(1, 9, RawDataPlane::U64(8)), kInvalid},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    RawDataPlane dp(daemon_->shm_socket_path());
    ASSERT_TRUE(dp.ok()) << dp.error();
    dp.SendBytes(c.frame);
    auto a = dp.Read();
    ASSERT_TRUE(a.has_value());
    EXPECT_EQ(static_cast<int>(a->code), c.code);
    EXPECT_LE(a->payload.size(), wire::shm::kMaxErrorMessageBytes);
    EXPECT_TRUE(dp.Closed());
  }
  {
    SCOPED_TRACE("begin inside a put");
    RawDataPlane dp(daemon_->shm_socket_path());
    ASSERT_TRUE(dp.ok()) << dp.error();
    uint64_t slot = dp.SlotWith(chunk);
    dp.Send(Op::kPutBegin, RawDataPlane::Begin(slot, TestKey(31)));
    dp.Send(Op::kPutBegin, RawDataPlane::Begin(slot, TestKey(31)));
    auto a = dp.Read();
    ASSERT_TRUE(a.has_value());
    EXPECT_EQ(static_cast<int>(a->code), kPrecondition);
    EXPECT_TRUE(dp.Closed());
  }
  for (size_t cut : {size_t{3}, wire::shm::kRequestHeaderBytes + 5}) {
    SCOPED_TRACE(absl::StrCat("truncated after ", cut, " bytes, then disconnect"));
    RawDataPlane dp(daemon_->shm_socket_path());
    ASSERT_TRUE(dp.ok()) << dp.error();
    auto f = RawDataPlane::Frame(1, 2, RawDataPlane::Allocate(chunk.size()));
    f.resize(cut);
    dp.SendBytes(f);
    dp.Close();
  }
  WaitForDataPlaneConnections(daemon_.get(), 0);
  // The daemon still serves, through the data plane and gRPC.
  auto c = Client();
  ASSERT_TRUE(c);
  ASSERT_TRUE(c->Put(TestKey(31), chunk).ok());
  EXPECT_EQ(c->Get(TestKey(31)).value(), chunk);
}

// Bad field values get their codes and leave the connection usable.
TEST_F(E2eTest, DataPlaneWrongIdsAndBadPutsGetTheirCodes) {
  using Op = RawDataPlane::Op;
  RawDataPlane dp(daemon_->shm_socket_path());
  ASSERT_TRUE(dp.ok()) << dp.error();
  EXPECT_EQ(dp.Call(Op::kRelease, RawDataPlane::U64(12345)), kNotFound);
  EXPECT_EQ(dp.Call(Op::kAbortSlot, RawDataPlane::U64(12345)), kNotFound);
  EXPECT_EQ(dp.Call(Op::kGet, RawDataPlane::Get(TestKey(32))), kNotFound);
  EXPECT_EQ(dp.Call(Op::kGet, RawDataPlane::Get(TestKey(32), 1)), kInvalid);
  EXPECT_EQ(dp.Call(Op::kAllocate, RawDataPlane::Allocate(0)), kInvalid);
  auto chunk = MakeChunk(32);
  // A put of a slot that does not exist: NotFound, answered at the commit.
  dp.Send(Op::kPutBegin, RawDataPlane::Begin(999999, TestKey(32)));
  dp.Send(Op::kPutProgress, RawDataPlane::U64(chunk.size() / 2));
  EXPECT_EQ(dp.Call(Op::kPutCommit, RawDataPlane::U64(chunk.size())), kNotFound);
  // Corrupt bytes: DataLoss, and the slot is freed.
  auto bad = chunk;
  bad[bad.size() / 2] ^= 1;
  uint64_t slot = dp.SlotWith(bad);
  dp.Send(Op::kPutBegin, RawDataPlane::Begin(slot, TestKey(32)));
  EXPECT_EQ(dp.Call(Op::kPutCommit, RawDataPlane::U64(chunk.size())), kDataLoss);
  EXPECT_EQ(dp.Call(Op::kAbortSlot, RawDataPlane::U64(slot)), kNotFound);
  // Progress that goes backwards, a commit short of the slot, beyond it, an
  // unknown tier: InvalidArgument, slot freed.
  struct Bad {
    std::vector<uint64_t> progress;
    uint64_t commit;
    uint8_t tier;
  };
  for (const Bad& b : {Bad{{chunk.size() / 2, chunk.size() / 3}, chunk.size(), 0},
                       Bad{{}, chunk.size() - 1, 0}, Bad{{}, chunk.size() + 1, 0},
                       Bad{{}, chunk.size(), 9}}) {
    slot = dp.SlotWith(chunk);
    dp.Send(Op::kPutBegin, RawDataPlane::Begin(slot, TestKey(32), b.tier));
    for (uint64_t p : b.progress) dp.Send(Op::kPutProgress, RawDataPlane::U64(p));
    EXPECT_EQ(dp.Call(Op::kPutCommit, RawDataPlane::U64(b.commit)), kInvalid);
    EXPECT_EQ(dp.Call(Op::kAbortSlot, RawDataPlane::U64(slot)), kNotFound);
  }
  // Ranges (the order libkvtier writes in): a whole put in PutCopyOrder's
  // order is stored; a flipped V byte is DataLoss; a range beyond the slot,
  // one that leaves a gap in its section, or one before the header is
  // final: InvalidArgument at the commit, slot freed.
  auto big = MakeChunk(33, 256, 2, 4, 64);
  const auto l = codec::ParseHeader(big).value().layout;
  auto put_in_order = [&](const std::vector<uint8_t>& bytes, const Hash128& key) {
    const uint64_t s = dp.SlotWith(bytes);
    dp.Send(Op::kPutBegin, RawDataPlane::Begin(s, key));
    auto order = wire::PutCopyOrder(bytes, 4096);
    for (size_t i = 0; i + 1 < order.size(); ++i) {
      dp.Send(Op::kPutRange, RawDataPlane::Range(order[i].first, order[i].second));
    }
    return std::make_pair(s, dp.Call(Op::kPutCommit, RawDataPlane::U64(bytes.size())));
  };
  EXPECT_EQ(put_in_order(big, TestKey(33)).second, kOk);
  auto bad_v = big;
  bad_v[l.v_offset + 3] ^= 0x80;
  auto [bad_slot, bad_code] = put_in_order(bad_v, TestKey(34));
  EXPECT_EQ(bad_code, kDataLoss);
  EXPECT_EQ(dp.Call(Op::kAbortSlot, RawDataPlane::U64(bad_slot)), kNotFound);
  for (auto [o, n] : {std::make_pair(uint64_t(big.size()), uint64_t{1}),
                      std::make_pair(uint64_t{8}, ~uint64_t{0}),
                      std::make_pair(uint64_t(l.k_offset), uint64_t{64})}) {
    SCOPED_TRACE(absl::StrCat("range ", o, " +", n));
    slot = dp.SlotWith(big);
    dp.Send(Op::kPutBegin, RawDataPlane::Begin(slot, TestKey(35)));
    dp.Send(Op::kPutRange, RawDataPlane::Range(o, n));
    EXPECT_EQ(dp.Call(Op::kPutCommit, RawDataPlane::U64(big.size())), kInvalid);
    EXPECT_EQ(dp.Call(Op::kAbortSlot, RawDataPlane::U64(slot)), kNotFound);
  }
  slot = dp.SlotWith(big);
  dp.Send(Op::kPutBegin, RawDataPlane::Begin(slot, TestKey(35)));
  dp.Send(Op::kPutRange, RawDataPlane::Range(0, l.k_offset));
  dp.Send(Op::kPutRange, RawDataPlane::Range(l.v_offset + 64, 64));  // a gap in V
  EXPECT_EQ(dp.Call(Op::kPutCommit, RawDataPlane::U64(big.size())), kInvalid);
  EXPECT_EQ(dp.Call(Op::kHello, {}), kOk);
  EXPECT_EQ(dp.Call(Op::kGet, RawDataPlane::Get(TestKey(32))), kNotFound);
  auto c = Client();
  ASSERT_TRUE(c);
  EXPECT_EQ(c->Get(TestKey(33)).value(), big);
}

// With a second check thread per put (forced on, whatever the host), puts of
// chunks large enough for it through libkvtier store exact bytes, a flipped K
// or V byte is DataLoss, and the helper survives a put abandoned midway.
TEST_F(E2eTest, DataPlanePutsCheckedOnTwoThreads) {
  using Op = RawDataPlane::Op;
  daemon_.reset();
  DaemonOptions o = SmallDaemonOptions(dir_.path());
  o.put_check_threads = 2;
  StartDaemon(o);
  auto chunk = MakeChunk(36, 512, 4, 8, 128);  // K 4 MiB, V 2 MiB and more
  const auto l = codec::ParseHeader(chunk).value().layout;
  ASSERT_GE(l.v.bytes, uint64_t{2} << 20);
  auto c = Client();
  ASSERT_TRUE(c);
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(c->Put(TestKey(36), chunk).ok());
    EXPECT_EQ(c->Get(TestKey(36)).value(), chunk);
    ASSERT_TRUE(c->Delete(TestKey(36)).ok());
  }
  RawDataPlane dp(daemon_->shm_socket_path());
  ASSERT_TRUE(dp.ok()) << dp.error();
  for (uint64_t at : {l.k_offset + l.k.bytes - 1, l.v_offset + l.v.bytes - 1}) {
    auto bad = chunk;
    bad[at] ^= 2;
    const uint64_t slot = dp.SlotWith(bad);
    dp.Send(Op::kPutBegin, RawDataPlane::Begin(slot, TestKey(37)));
    auto order = wire::PutCopyOrder(bad, 1 << 20);
    for (size_t i = 0; i + 1 < order.size(); ++i) {
      dp.Send(Op::kPutRange, RawDataPlane::Range(order[i].first, order[i].second));
    }
    EXPECT_EQ(dp.Call(Op::kPutCommit, RawDataPlane::U64(bad.size())), kDataLoss) << at;
  }
  const int before = daemon_->data_plane_connections();
  {  // Abandoned midway: the connection closes with V half published.
    RawDataPlane gone(daemon_->shm_socket_path());
    ASSERT_TRUE(gone.ok()) << gone.error();
    const uint64_t slot = gone.SlotWith(chunk);
    gone.Send(Op::kPutBegin, RawDataPlane::Begin(slot, TestKey(38)));
    gone.Send(Op::kPutRange, RawDataPlane::Range(0, l.k_offset));
    gone.Send(Op::kPutRange, RawDataPlane::Range(l.v_offset, l.v.bytes / 2));
    gone.Close();
  }
  WaitForDataPlaneConnections(daemon_.get(), before);
  ASSERT_TRUE(c->Put(TestKey(39), chunk).ok());
  EXPECT_EQ(c->Get(TestKey(39)).value(), chunk);
}

// A client that disconnects in the middle of a put, or while it holds a
// get's lease, leaves nothing behind.
TEST_F(E2eTest, DataPlaneDisconnectFreesSlotsAndLeases) {
  using Op = RawDataPlane::Op;
  auto c = Client();
  ASSERT_TRUE(c);
  auto chunk = MakeChunk(33);
  ASSERT_TRUE(c->Put(TestKey(34), chunk).ok());
  uint64_t streamed = 0, idle = 0;
  {
    RawDataPlane dp(daemon_->shm_socket_path());
    ASSERT_TRUE(dp.ok()) << dp.error();
    streamed = dp.SlotWith(chunk);
    idle = dp.SlotWith(chunk);
    dp.Send(Op::kPutBegin, RawDataPlane::Begin(streamed, TestKey(33)));
    dp.Send(Op::kPutProgress, RawDataPlane::U64(chunk.size() / 2));
    EXPECT_EQ(dp.Call(Op::kHello, {}), kOk);  // the daemon has read the put's frames
  }
  {
    RawDataPlane dp(daemon_->shm_socket_path());
    ASSERT_TRUE(dp.ok()) << dp.error();
    ASSERT_EQ(dp.Call(Op::kGet, RawDataPlane::Get(TestKey(34))), kOk);
    EXPECT_EQ(c->Delete(TestKey(34)).code(), absl::StatusCode::kFailedPrecondition);
  }
  WaitForDataPlaneConnections(daemon_.get(), 1);  // the client's own
  EXPECT_EQ(c->AbortSlot(client::WritableSlot{streamed, {}}).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(c->AbortSlot(client::WritableSlot{idle, {}}).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(c->Get(TestKey(33)).status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(c->Delete(TestKey(34)).ok());
}

// The daemon serves at most 64 data-plane connections; a client beyond them
// still works, through gRPC.
TEST_F(E2eTest, DataPlaneConnectionsAreBoundedAndClientsFallBackToGrpc) {
  std::vector<std::unique_ptr<RawDataPlane>> conns;
  for (int i = 0; i < 64; ++i) {
    conns.push_back(std::make_unique<RawDataPlane>(daemon_->shm_socket_path()));
    ASSERT_TRUE(conns.back()->ok());
    ASSERT_EQ(conns.back()->Call(RawDataPlane::Op::kHello, {}), kOk);
  }
  RawDataPlane extra(daemon_->shm_socket_path());
  ASSERT_TRUE(extra.ok()) << extra.error();  // it gets the pool
  EXPECT_TRUE(extra.Closed());                // but no data plane
  EXPECT_EQ(daemon_->data_plane_connections(), 64);
  auto c = Client();
  ASSERT_TRUE(c);
  EXPECT_TRUE(c->uses_shared_memory());
  auto chunk = MakeChunk(35);
  ASSERT_TRUE(c->Put(TestKey(35), chunk).ok());
  EXPECT_EQ(c->Get(TestKey(35)).value(), chunk);
  auto h = c->Hold(TestKey(35));
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_TRUE(c->Unhold(*h).ok());
  conns.clear();
  WaitForDataPlaneConnections(daemon_.get(), 0);
}

// Every same-host client receives the pool's memfd; truncating it would
// make each mapping of the pool fault (SIGBUS), the daemon's first. The
// pool's size is sealed, so the daemon keeps serving with exact bytes.
TEST_F(E2eTest, ClientCannotTruncateTheSharedPool) {
  auto c = Client();
  ASSERT_TRUE(c);
  ASSERT_TRUE(c->uses_shared_memory());
  const auto stored = MakeChunk(50);
  ASSERT_TRUE(c->Put(TestKey(50), stored).ok());
  auto h = client::ConnectShm(daemon_->shm_socket_path());
  ASSERT_TRUE(h.ok()) << h.status();
  const int rc = ::ftruncate(h->memfd, 0);
  const int err = errno;
  // Where the truncation went through, restore the size (the pages come
  // back zeroed) so that the rest of the test reports the loss instead of
  // dying of SIGBUS.
  if (rc == 0) (void)!::ftruncate(h->memfd, static_cast<off_t>(h->size));
  EXPECT_EQ(rc, -1);
  EXPECT_EQ(err, EPERM);
  struct stat st;
  ASSERT_EQ(::fstat(h->memfd, &st), 0);
  EXPECT_EQ(static_cast<uint64_t>(st.st_size), h->size);
  ::close(h->memfd);
  ::close(h->sock);
  EXPECT_EQ(c->Get(TestKey(50)).value_or(std::vector<uint8_t>{}), stored);
  const auto next = MakeChunk(51);
  ASSERT_TRUE(c->Put(TestKey(51), next).ok());
  EXPECT_EQ(c->Get(TestKey(51)).value_or(std::vector<uint8_t>{}), next);
  ExpectServes(daemon_.get(), 52);
}

TEST_F(E2eTest, TcpRequiresTheBearerToken) {
  daemon_.reset();
  std::string token_path = dir_.path() + "/token";
  const std::string token = "tok-0123456789abcdef0123456789abcdef";
  std::ofstream(token_path) << "  " << token << "\n";
  ASSERT_EQ(::chmod(token_path.c_str(), 0600), 0);
  DaemonOptions o = SmallDaemonOptions(dir_.path());
  o.listen_tcp = "127.0.0.1:0";
  o.token_file = token_path;
  o.metrics_addr = "127.0.0.1:0";
  StartDaemon(o);
  ASSERT_GT(daemon_->tcp_port(), 0);
  client::ClientOptions co;
  co.tcp_addr = "127.0.0.1:" + std::to_string(daemon_->tcp_port());
  co.timeout_ms = 5000;
  co.token = token;
  auto good = client::KvtierClient::Connect(co);
  ASSERT_TRUE(good.ok()) << good.status();
  EXPECT_FALSE((*good)->uses_shared_memory());
  ASSERT_TRUE((*good)->Put(TestKey(15), MakeChunk(15)).ok());
  EXPECT_EQ((*good)->Get(TestKey(15)).value(), MakeChunk(15));
  // Wrong and missing tokens are refused.
  auto stub = pb::Kvtier::NewStub(grpc::CreateChannel(co.tcp_addr, grpc::InsecureChannelCredentials()));
  std::string wrong = token;
  wrong.back() ^= 1;
  for (const std::string& header : {std::string(), "Bearer " + wrong, token}) {
    grpc::ClientContext ctx;
    Deadline(ctx);
    if (!header.empty()) ctx.AddMetadata("authorization", header);
    pb::LookupRequest req;
    req.set_version(1);
    pb::LookupResponse resp;
    EXPECT_EQ(stub->Lookup(&ctx, req, &resp).error_code(), grpc::StatusCode::UNAUTHENTICATED)
        << header;
  }
  // The metrics endpoint counts the refusals.
  const std::string body = testing::HttpGetLocal(daemon_->metrics_port(), "/metrics");
  EXPECT_THAT(body, ::testing::StartsWith("HTTP/1.1 200 OK"));
  EXPECT_THAT(body, ::testing::HasSubstr("kvtier_auth_failures_total 3\n"));
  EXPECT_THAT(body, ::testing::HasSubstr("kvtier_requests_total{method=\"put\"} 1\n"));
  EXPECT_THAT(body, ::testing::HasSubstr(
                        "kvtier_request_errors_total{method=\"lookup\",code=\"UNAUTHENTICATED\"} 3\n"));
  EXPECT_THAT(body, ::testing::HasSubstr("kvtier_tier_chunks{tier=\"dram\"} 1\n"));
  EXPECT_THAT(body, ::testing::HasSubstr("kvtier_engine_puts_total 1\n"));
}

TEST_F(E2eTest, ShutdownWritesDramChunksToNvmeAndRestartServesThem) {
  auto c = Client();
  ASSERT_TRUE(c);
  auto chunk = MakeChunk(16);
  ASSERT_TRUE(c->Put(TestKey(16), chunk).ok());
  c.reset();
  ASSERT_TRUE(daemon_->Shutdown().ok());
  EXPECT_EQ(daemon_->flushed_chunks(), 1u);
  daemon_.reset();
  StartDaemon(SmallDaemonOptions(dir_.path()));
  auto c2 = Client();
  ASSERT_TRUE(c2);
  std::vector<Hash128> keys = {TestKey(16)};
  EXPECT_THAT(c2->Lookup(keys).value(), ::testing::ElementsAre(client::Tier::kNvme));
  EXPECT_EQ(c2->Get(TestKey(16)).value(), chunk);
}

}  // namespace
}  // namespace kvtier::server
