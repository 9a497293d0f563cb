// Tenants end to end (docs/tenancy.md): a kvtierd with a tenants file,
// in-process, and libkvtier clients of several tenants over the Unix socket
// (gRPC and the shared-memory data plane) and TCP (127.0.0.1:0). A tenant
// never reaches another's chunks with the other's keys; the shared
// namespace; quotas under a put storm; per-tenant metrics.
#include <unistd.h>

#include <cstdio>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/kvtier_client.h"
#include "common/crypto.h"
#include "common/testing/temp_dir.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "server/daemon.h"
#include "server/metrics.h"
#include "server/tenants.h"
#include "server/test_util.h"
#include "tests/raw_data_plane.h"
#include "wire/kvtier.grpc.pb.h"
#include "wire/shm_frames.h"

namespace kvtier::server {
namespace {

namespace pb = kvtier::proto::v1;
using kvtier::testing::MakeChunk;
using kvtier::testing::SmallDaemonOptions;
using kvtier::testing::TestKey;
using ::testing::HasSubstr;

constexpr char kTokenA[] = "tenant-a-token-0123456789abcdef0123456789abcdef";
constexpr char kTokenB[] = "tenant-b-token-0123456789abcdef0123456789abcdef";
constexpr char kTokenPub[] = "tenant-pub-token-0123456789abcdef0123456789abcd";
constexpr char kTokenReader[] = "tenant-reader-token-0123456789abcdef0123456789";
constexpr uint64_t kQuotaB = uint64_t{2} << 20;

std::string TokenSha(std::string_view token) { return HexOf(Sha256(AsBytes(token))); }

class TenancyTest : public ::testing::Test {
 protected:
  // Tenant "a" is also the tenant of this process's uid (its clients need
  // no token on the Unix socket) unless `uid_tenant` is false.
  void StartDaemon(bool uid_tenant) {
    daemon_.reset();
    const std::string path = dir_.path() + "/tenants.toml";
    FILE* f = std::fopen(path.c_str(), "w");
    ASSERT_NE(f, nullptr);
    const std::string text =
        absl::StrCat("[[tenant]]\nname = \"a\"\nuids = [", uid_tenant ? ::getuid() : ::getuid() + 1,
                     "]\ntoken_sha256 = \"", TokenSha(kTokenA),
                     "\"\n[[tenant]]\nname = \"b\"\ntoken_sha256 = \"", TokenSha(kTokenB),
                     "\"\ndram_gib = ", static_cast<double>(kQuotaB) / (1 << 30),
                     "\n[[tenant]]\nname = \"pub\"\nshared = \"publish\"\ntoken_sha256 = \"",
                     TokenSha(kTokenPub),
                     "\"\n[[tenant]]\nname = \"reader\"\nshared = \"read\"\ntoken_sha256 = \"",
                     TokenSha(kTokenReader), "\"\n");
    std::fputs(text.c_str(), f);
    std::fclose(f);
    DaemonOptions o = SmallDaemonOptions(dir_.path());
    o.tenants = path;
    o.listen_tcp = "127.0.0.1:0";
    auto d = Daemon::Start(o);
    ASSERT_TRUE(d.ok()) << d.status();
    daemon_ = std::move(*d);
  }
  void SetUp() override { StartDaemon(/*uid_tenant=*/true); }

  // A client over the Unix socket with `token` (none: the uid's tenant);
  // with `shm`, it maps the pool, and with `data_plane` too it moves its
  // calls over the shared-memory data plane (else over gRPC).
  std::unique_ptr<client::KvtierClient> Client(const std::string& token, bool shm,
                                               bool data_plane = true) {
    client::ClientOptions o;
    o.socket_path = daemon_->socket_path();
    o.token = token;
    o.shared_memory = shm;
    o.max_data_connections = data_plane ? 4 : 0;
    o.timeout_ms = 10000;
    auto c = client::KvtierClient::Connect(o);
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? std::move(*c) : nullptr;
  }
  std::unique_ptr<client::KvtierClient> TcpClient(const std::string& token) {
    client::ClientOptions o;
    o.tcp_addr = absl::StrCat("127.0.0.1:", daemon_->tcp_port());
    o.token = token;
    o.timeout_ms = 10000;
    auto c = client::KvtierClient::Connect(o);
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? std::move(*c) : nullptr;
  }
  TenantStats StatsOf(const std::string& name) {
    for (const TenantStats& t : daemon_->service()->Stats().tenants) {
      if (t.name == name) return t;
    }
    ADD_FAILURE() << "no tenant " << name;
    return {};
  }

  kvtier::testing::TempDir dir_;
  std::unique_ptr<Daemon> daemon_;
};

std::vector<Hash128> Keys(uint32_t first, uint32_t n) {
  std::vector<Hash128> k;
  for (uint32_t i = first; i < first + n; ++i) k.push_back(TestKey(i));
  return k;
}

TEST_F(TenancyTest, AnotherTenantsKeysAreMissesOnEveryPath) {
  struct Mode {
    const char* name;
    bool shm, data_plane;
    uint32_t base;
  };
  for (const Mode m :
       {Mode{"data plane", true, true, 100}, Mode{"gRPC, pool mapped", true, false, 200},
        Mode{"gRPC, inline bytes", false, false, 300}}) {
    SCOPED_TRACE(m.name);
    const bool shm = m.shm;
    const uint32_t base = m.base;
    auto b = Client(kTokenB, shm, m.data_plane);
    auto a = Client("", shm, m.data_plane);  // the uid's tenant
    ASSERT_NE(a, nullptr);
    ASSERT_NE(b, nullptr);
    EXPECT_EQ(a->uses_shared_memory(), shm);
    EXPECT_EQ(b->uses_shared_memory(), shm);
    const std::vector<Hash128> keys = Keys(base, 4);
    for (uint32_t i = 0; i < 4; ++i) ASSERT_TRUE(b->Put(keys[i], MakeChunk(base + i)).ok());
    ASSERT_EQ(b->Lookup(keys).value().size(), 4u);

    // A, holding B's keys, finds nothing and can touch nothing.
    EXPECT_TRUE(a->Lookup(keys).value().empty());
    auto plan = a->PlanLoad(keys, 1e5, 16);
    ASSERT_TRUE(plan.ok()) << plan.status();
    EXPECT_TRUE(plan->tiers.empty());
    auto held = a->LookupAndHold(keys, 1e5, 16, 1000);
    ASSERT_TRUE(held.ok()) << held.status();
    EXPECT_TRUE(held->plan.tiers.empty());
    EXPECT_EQ(a->Get(keys[0]).status().code(), absl::StatusCode::kNotFound);
    if (shm) {  // in-place reads of the pool
      EXPECT_EQ(a->Hold(keys[0]).status().code(), absl::StatusCode::kNotFound);
      auto batch = a->HoldBatch(keys);
      ASSERT_TRUE(batch.ok()) << batch.status();
      for (const auto& h : *batch) EXPECT_EQ(h.status().code(), absl::StatusCode::kNotFound);
    }
    EXPECT_EQ(a->Pin(keys, 1000).status().code(), absl::StatusCode::kNotFound);
    EXPECT_EQ(a->Delete(keys[0]).code(), absl::StatusCode::kNotFound);
    auto pre = a->PrefetchWithin(keys, 0, 100);
    ASSERT_TRUE(pre.ok()) << pre.status();
    EXPECT_EQ(pre->keys, 0u);

    // The same client key in A's namespace is a different chunk.
    ASSERT_TRUE(a->Put(keys[1], MakeChunk(9999)).ok());
    EXPECT_EQ(a->Get(keys[1]).value(), MakeChunk(9999));
    EXPECT_EQ(b->Get(keys[1]).value(), MakeChunk(base + 1));
    // B's chunks are all still there.
    for (uint32_t i = 0; i < 4; ++i) EXPECT_EQ(b->Get(keys[i]).value(), MakeChunk(base + i));
    // A's delete of its own key leaves B's copy.
    ASSERT_TRUE(a->Delete(keys[1]).ok());
    EXPECT_EQ(b->Get(keys[1]).value(), MakeChunk(base + 1));
  }
  EXPECT_GT(StatsOf("a").misses, 0u);
  EXPECT_GT(StatsOf("b").hits, 0u);
  EXPECT_EQ(StatsOf("b").puts, 12u);
}

TEST_F(TenancyTest, UnknownTokenIsUnauthenticated) {
  // On the Unix socket too: a token names a tenant, and one of no tenant
  // is refused (libkvtier's Connect asks first; the data plane's tenant
  // hello: HelloTenantFramesAreChecked).
  client::ClientOptions o;
  o.socket_path = daemon_->socket_path();
  o.token = "no-tenant-has-this-token-0123456789abcdef";
  o.timeout_ms = 10000;
  absl::Status st = client::KvtierClient::Connect(o).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kUnauthenticated) << st;
  EXPECT_GT(daemon_->metrics()->Get(ServerMetric::kAuthFailures), 0u);
}

TEST_F(TenancyTest, SharedNamespaceIsReadByOptedInTenantsOnly) {
  auto pub = Client(kTokenPub, true);
  auto reader = Client(kTokenReader, true);
  auto a = Client("", true);
  ASSERT_NE(pub, nullptr);
  ASSERT_NE(reader, nullptr);
  const std::vector<Hash128> sys = Keys(300, 3);  // a public prefix
  for (uint32_t i = 0; i < 3; ++i) ASSERT_TRUE(pub->Put(sys[i], MakeChunk(300 + i)).ok());
  // The reader falls back to the shared namespace; "a" did not opt in.
  EXPECT_EQ(reader->Lookup(sys).value().size(), 3u);
  EXPECT_EQ(reader->Get(sys[2]).value(), MakeChunk(302));
  EXPECT_TRUE(a->Lookup(sys).value().empty());
  // A prefix of the shared system prompt, then the reader's own chunk.
  const Hash128 own = TestKey(310);
  ASSERT_TRUE(reader->Put(own, MakeChunk(310)).ok());
  std::vector<Hash128> prompt = sys;
  prompt.push_back(own);
  EXPECT_EQ(reader->Lookup(prompt).value().size(), 4u);
  // The reader's puts stay in its namespace: the publisher does not see them.
  EXPECT_EQ(pub->Get(own).status().code(), absl::StatusCode::kNotFound);
  // Its own chunk under a shared key shadows the shared one for it alone.
  ASSERT_TRUE(reader->Put(sys[0], MakeChunk(777)).ok());
  EXPECT_EQ(reader->Get(sys[0]).value(), MakeChunk(777));
  EXPECT_EQ(pub->Get(sys[0]).value(), MakeChunk(300));
  // Only the publisher deletes shared chunks.
  EXPECT_EQ(reader->Delete(sys[1]).code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(pub->Delete(sys[1]).ok());
  EXPECT_EQ(reader->Get(sys[1]).status().code(), absl::StatusCode::kNotFound);
}

TEST_F(TenancyTest, TcpTenantsAreServedInlineAndNeverGetPoolMemory) {
  auto b = TcpClient(kTokenB);
  auto a_local = Client("", true);
  ASSERT_NE(b, nullptr);
  ASSERT_TRUE(b->Put(TestKey(400), MakeChunk(400)).ok());
  EXPECT_EQ(b->Get(TestKey(400)).value(), MakeChunk(400));
  EXPECT_EQ(a_local->Get(TestKey(400)).status().code(), absl::StatusCode::kNotFound);

  auto stub = pb::Kvtier::NewStub(grpc::CreateChannel(
      absl::StrCat("127.0.0.1:", daemon_->tcp_port()), grpc::InsecureChannelCredentials()));
  auto call = [&](const std::string& token, auto fn) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    if (!token.empty()) ctx.AddMetadata("authorization", "Bearer " + token);
    return fn(ctx);
  };
  // A slot (pool memory) over TCP: refused, whoever asks.
  grpc::Status st = call(kTokenB, [&](grpc::ClientContext& ctx) {
    pb::AllocateSlotRequest req;
    req.set_version(1);
    req.set_bytes(4096);
    pb::AllocateSlotResponse resp;
    return stub->AllocateSlot(&ctx, req, &resp);
  });
  EXPECT_EQ(st.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << st.error_message();
  st = call(kTokenB, [&](grpc::ClientContext& ctx) {
    pb::GetRequest req;
    req.set_version(1);
    req.set_key(std::string(reinterpret_cast<const char*>(TestKey(400).bytes.data()), 16));
    req.set_mode(pb::GET_MODE_SHM);
    pb::GetResponse resp;
    return stub->Get(&ctx, req, &resp);
  });
  EXPECT_EQ(st.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << st.error_message();
  // No token, or a token of no tenant: unauthenticated.
  for (const std::string token : {std::string(), std::string(48, 'z')}) {
    st = call(token, [&](grpc::ClientContext& ctx) {
      pb::LookupRequest req;
      req.set_version(1);
      pb::LookupResponse resp;
      return stub->Lookup(&ctx, req, &resp);
    });
    EXPECT_EQ(st.error_code(), grpc::StatusCode::UNAUTHENTICATED) << st.error_message();
  }
}

TEST_F(TenancyTest, QuotaHoldsUnderAPutStormAndSparesOtherTenants) {
  auto a = Client("", true);
  auto b = Client(kTokenB, true);
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  const std::vector<Hash128> mine = Keys(500, 16);
  for (uint32_t i = 0; i < 16; ++i) ASSERT_TRUE(a->Put(mine[i], MakeChunk(500 + i)).ok());
  const uint64_t chunk = MakeChunk(0).size();
  // B stores four times its quota, bounded.
  const uint32_t n = static_cast<uint32_t>(4 * kQuotaB / chunk);
  for (uint32_t i = 0; i < n; ++i) {
    absl::Status st = b->Put(TestKey(10000 + i), MakeChunk(10000 + i));
    ASSERT_TRUE(st.ok()) << i << ": " << st;
  }
  const TenantStats sb = StatsOf("b");
  EXPECT_LE(sb.usage.bytes[static_cast<int>(tiering::TierKind::kDram)], kQuotaB);
  EXPECT_GT(sb.usage.evictions, 0u);
  EXPECT_EQ(StatsOf("a").usage.evictions, 0u);
  EXPECT_EQ(a->Lookup(mine).value().size(), 16u);
  for (uint32_t i = 0; i < 16; ++i) EXPECT_EQ(a->Get(mine[i]).value(), MakeChunk(500 + i));

  // Per-tenant series in the Prometheus exposition.
  const std::string text = daemon_->metrics()->RenderPrometheus(daemon_->service()->Stats());
  EXPECT_THAT(text, HasSubstr("kvtier_tenant_bytes{tenant=\"b\",tier=\"dram\"} "));
  EXPECT_THAT(text, HasSubstr(absl::StrCat("kvtier_tenant_puts_total{tenant=\"b\"} ", n)));
  EXPECT_THAT(text, HasSubstr("kvtier_tenant_hits_total{tenant=\"a\"} 16"));
  EXPECT_THAT(text, HasSubstr("kvtier_tenant_evictions_total{tenant=\"a\"} 0"));
  EXPECT_THAT(text, HasSubstr("kvtier_tenant_quota_rejections_total{tenant=\"b\"} 0"));
}

using Op = wire::shm::Op;

std::vector<uint8_t> HelloTenant(std::string_view token, int64_t count = -1) {
  std::vector<uint8_t> p(wire::shm::kBatchHeaderBytes + token.size());
  wire::shm::Writer(p.data())
      .U32(count < 0 ? static_cast<uint32_t>(token.size()) : static_cast<uint32_t>(count))
      .U32(0)
      .Raw(token.data(), token.size());
  return p;
}

constexpr int kUnauthenticated = static_cast<int>(absl::StatusCode::kUnauthenticated);

TEST_F(TenancyTest, HelloTenantFramesAreChecked) {
  {  // a tenant's token: served as that tenant
    RawDataPlane dp(daemon_->shm_socket_path());
    EXPECT_EQ(dp.Call(Op::kHelloTenant, HelloTenant(kTokenB)), 0);
    EXPECT_EQ(dp.Call(Op::kHello, {}), 0);
  }
  {  // a token of no tenant: refused, then closed
    RawDataPlane dp(daemon_->shm_socket_path());
    EXPECT_EQ(dp.Call(Op::kHelloTenant, HelloTenant(std::string(40, 'q'))), kUnauthenticated);
    EXPECT_TRUE(dp.Closed());
  }
  {  // the tenant hello after the first request
    RawDataPlane dp(daemon_->shm_socket_path());
    EXPECT_EQ(dp.Call(Op::kHello, {}), 0);
    EXPECT_EQ(dp.Call(Op::kHelloTenant, HelloTenant(kTokenB)), kPrecondition);
    EXPECT_TRUE(dp.Closed());
  }
  {  // a count that does not match the bytes
    RawDataPlane dp(daemon_->shm_socket_path());
    EXPECT_EQ(dp.Call(Op::kHelloTenant, HelloTenant(kTokenB, 3)), kInvalid);
    EXPECT_TRUE(dp.Closed());
  }
  {  // nonzero reserved bytes
    RawDataPlane dp(daemon_->shm_socket_path());
    std::vector<uint8_t> p = HelloTenant(kTokenB);
    p[4] = 1;
    EXPECT_EQ(dp.Call(Op::kHelloTenant, p), kInvalid);
    EXPECT_TRUE(dp.Closed());
  }
  {  // a token longer than a frame may carry
    RawDataPlane dp(daemon_->shm_socket_path());
    EXPECT_EQ(
        dp.Call(Op::kHelloTenant, HelloTenant(std::string(wire::shm::kMaxBatchItems + 1, 'x'))),
        kInvalid);
    EXPECT_TRUE(dp.Closed());
  }
  {  // a truncated frame: the connection ends, nothing is served
    RawDataPlane dp(daemon_->shm_socket_path());
    std::vector<uint8_t> f = RawDataPlane::Frame(
        wire::shm::kVersion, static_cast<uint16_t>(Op::kHelloTenant), HelloTenant(kTokenB));
    f.resize(f.size() - 5);
    dp.SendBytes(f);
    dp.Close();
  }
  // The daemon still serves.
  auto b = Client(kTokenB, true);
  ASSERT_NE(b, nullptr);
  EXPECT_TRUE(b->uses_shared_memory());
  ASSERT_TRUE(b->Put(TestKey(600), MakeChunk(600)).ok());
}

TEST_F(TenancyTest, AUidOfNoTenantMustNameItsTenant) {
  StartDaemon(/*uid_tenant=*/false);
  // gRPC without a token: no tenant (libkvtier's Connect already asks).
  client::ClientOptions o;
  o.socket_path = daemon_->socket_path();
  o.timeout_ms = 10000;
  absl::Status st = client::KvtierClient::Connect(o).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kUnauthenticated) << st;
  EXPECT_THAT(st.message(), HasSubstr("no tenant for uid"));
  // The data plane without a tenant hello: refused at the first request.
  {
    RawDataPlane dp(daemon_->shm_socket_path());
    EXPECT_EQ(dp.Call(Op::kLookup, std::vector<uint8_t>(wire::shm::kBatchHeaderBytes, 0)),
              kUnauthenticated);
    EXPECT_TRUE(dp.Closed());
  }
  // With a token, both planes serve the token's tenant.
  auto a = Client(kTokenA, true);
  ASSERT_NE(a, nullptr);
  EXPECT_TRUE(a->uses_shared_memory());
  ASSERT_TRUE(a->Put(TestKey(700), MakeChunk(700)).ok());
  EXPECT_EQ(a->Get(TestKey(700)).value(), MakeChunk(700));
  EXPECT_EQ(StatsOf("a").puts, 1u);
}

TEST(TenancyOptions, BadTenantsFileStopsTheDaemonWithItsReason) {
  kvtier::testing::TempDir dir;
  const std::string path = dir.path() + "/tenants.toml";
  FILE* f = std::fopen(path.c_str(), "w");
  ASSERT_NE(f, nullptr);
  std::fputs("[[tenant]]\nname = \"a\"\n[[tenant]]\nname = \"a\"\n", f);
  std::fclose(f);
  DaemonOptions o = SmallDaemonOptions(dir.path());
  o.tenants = path;
  auto d = Daemon::Start(o);
  ASSERT_FALSE(d.ok());
  EXPECT_EQ(d.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(d.status().message(), HasSubstr("used twice"));
}

}  // namespace
}  // namespace kvtier::server
