// kvtierd's gRPC listeners under abuse, in-process: peers without the token,
// calls whose bodies never come, and readers that never grant HTTP/2
// flow-control window. A misbehaving HTTP/2 client (http2_test_client.h)
// plays the attacker; libkvtier plays the well-behaved local client, which
// must be served throughout. Every wait is bounded.
#include <sys/stat.h>

#include <chrono>
#include <fstream>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "client/kvtier_client.h"
#include "common/testing/temp_dir.h"
#include "gtest/gtest.h"
#include "server/test_util.h"
#include "wire/kvtier.pb.h"
#include "server/daemon.h"
#include "server/metrics.h"
#include "tests/cli_runner.h"
#include "tests/http2_test_client.h"

namespace kvtier::server {
namespace {

namespace pb = kvtier::proto::v1;
using kvtier::testing::Http2TestClient;
using kvtier::testing::MakeChunk;
using kvtier::testing::SmallDaemonOptions;
using kvtier::testing::TempDir;
using kvtier::testing::TestKey;
using std::chrono::milliseconds;

constexpr int kUnauthenticated = 16;
constexpr int kResourceExhausted = 8;
const char kToken[] = "abuse-test-token-0123456789abcdef0123456789";

// A K16/V8 chunk of 768 KiB, so that a few stalled answers reach the limits.
std::vector<uint8_t> BigChunk(uint32_t seed) {
  return MakeChunk(seed, /*tokens=*/128, /*layers=*/8, /*heads=*/4, /*dim=*/64);
}

std::string GetRequestBytes(const Hash128& key) {
  pb::GetRequest r;
  r.set_version(1);
  r.set_key(std::string(reinterpret_cast<const char*>(key.bytes.data()), key.bytes.size()));
  r.set_mode(pb::GET_MODE_INLINE);
  return r.SerializeAsString();
}

class GrpcAbuseTest : public ::testing::Test {
 protected:
  DaemonOptions Options() {
    DaemonOptions o = SmallDaemonOptions(dir_.path());
    const std::string token_path = dir_.path() + "/token";
    std::ofstream(token_path) << kToken << "\n";
    ::chmod(token_path.c_str(), 0600);
    o.listen_tcp = "127.0.0.1:0";
    o.token_file = token_path;
    return o;
  }
  void StartDaemon(const DaemonOptions& o) {
    auto d = Daemon::Start(o);
    ASSERT_TRUE(d.ok()) << d.status();
    daemon_ = std::move(*d);
  }
  std::unique_ptr<client::KvtierClient> LocalClient() {
    client::ClientOptions co;
    co.socket_path = daemon_->socket_path();
    co.timeout_ms = 5000;
    auto c = client::KvtierClient::Connect(co);
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? std::move(*c) : nullptr;
  }
  // A local client is served in full: health, put, lookup and get.
  void ExpectLocalClientServed(uint32_t seed) {
    auto c = LocalClient();
    ASSERT_TRUE(c);
    const auto chunk = MakeChunk(seed);
    ASSERT_TRUE(c->Put(TestKey(seed), chunk).ok());
    const Hash128 key = TestKey(seed);
    auto tiers = c->Lookup(std::span<const Hash128>(&key, 1));
    ASSERT_TRUE(tiers.ok()) << tiers.status();
    EXPECT_EQ(tiers->size(), 1u);
    auto got = c->Get(TestKey(seed));
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(*got, chunk);
  }

  TempDir dir_;
  std::unique_ptr<Daemon> daemon_;
};

// A call without the token is refused as soon as its headers arrive: the
// daemon does not wait for (or read) its body.
TEST_F(GrpcAbuseTest, UnauthenticatedTcpCallIsRefusedBeforeItsBody) {
  StartDaemon(Options());
  auto raw = Http2TestClient::ConnectTcp(daemon_->tcp_port(), {});
  ASSERT_TRUE(raw);
  std::vector<int32_t> ids;
  for (const char* method : {"Put", "PutStream", "Get", "Lookup", "AllocateSlot"}) {
    ids.push_back(raw->StartCall(method, {}, std::nullopt));
    ids.push_back(raw->StartCall(method, {{"authorization", "Bearer wrong-token"}}, std::nullopt));
    ids.push_back(raw->StartCall(method, {{"authorization", kToken}}, std::nullopt));  // no "Bearer "
  }
  auto all_answered = [&] {
    for (int32_t id : ids) {
      if (!raw->call(id).grpc_status) return false;
    }
    return true;
  };
  ASSERT_TRUE(raw->PumpUntil(all_answered, milliseconds(5000)));
  for (int32_t id : ids) EXPECT_EQ(*raw->call(id).grpc_status, kUnauthenticated) << id;
  EXPECT_EQ(daemon_->metrics()->Get(ServerMetric::kAuthFailures), ids.size());
}

// 4 connections x 64 put streams that never send a body, first without the
// token, then with it: none of them holds what the local clients need.
TEST_F(GrpcAbuseTest, PutStreamsWithoutBodiesDoNotStarveOtherClients) {
  DaemonOptions o = Options();
  o.stream_idle_timeout_ms = 500;
  StartDaemon(o);
  for (bool with_token : {false, true}) {
    SCOPED_TRACE(with_token ? "with the token" : "without the token");
    std::vector<std::unique_ptr<Http2TestClient>> conns;
    std::vector<std::vector<int32_t>> ids(4);
    for (int c = 0; c < 4; ++c) {
      conns.push_back(Http2TestClient::ConnectTcp(daemon_->tcp_port(), {}));
      ASSERT_TRUE(conns.back());
      for (int i = 0; i < 64; ++i) {
        std::vector<std::pair<std::string, std::string>> md;
        if (with_token) md.emplace_back("authorization", std::string("Bearer ") + kToken);
        ids[c].push_back(conns[c]->StartCall("PutStream", md, std::nullopt));
        ASSERT_GT(ids[c].back(), 0);
      }
      conns[c]->Pump(milliseconds(20));  // the daemon sees the headers
    }
    ExpectLocalClientServed(with_token ? 2 : 1);
    // Without the token every stream was refused at once; with it, each ends
    // at the idle timeout.
    const auto deadline_ms = milliseconds(with_token ? 10000 : 5000);
    for (int c = 0; c < 4; ++c) {
      auto ended = [&] {
        for (int32_t id : ids[c]) {
          if (!conns[c]->call(id).closed) return false;
        }
        return true;
      };
      ASSERT_TRUE(conns[c]->PumpUntil(ended, deadline_ms)) << "connection " << c;
      if (!with_token) {
        for (int32_t id : ids[c]) EXPECT_EQ(conns[c]->call(id).grpc_status, kUnauthenticated);
      }
    }
  }
  EXPECT_GE(daemon_->grpc_cancelled_calls(), 256u);
  ExpectLocalClientServed(3);
}

// 4 connections x 64 inline gets whose reader grants no flow-control window:
// the answers cannot be sent. The local clients are served meanwhile, the
// gets beyond the in-flight limit are refused, and at the write timeout the
// rest are cancelled and their bytes freed.
TEST_F(GrpcAbuseTest, ReadersThatGrantNoWindowDoNotStarveOtherClients) {
  DaemonOptions o = Options();
  o.dram_gib = 64.0 / 1024;
  o.max_inflight_mib = 32;
  o.max_inflight_mib_per_connection = 16;
  o.write_timeout_ms = 1000;
  StartDaemon(o);
  const auto chunk = BigChunk(7);
  {
    auto c = LocalClient();
    ASSERT_TRUE(c);
    ASSERT_TRUE(c->Put(TestKey(7), chunk).ok());
  }
  Http2TestClient::Options stall;
  stall.initial_window = 0;
  stall.grant_window = false;
  std::vector<std::unique_ptr<Http2TestClient>> conns;
  std::vector<std::vector<int32_t>> ids(4);
  for (int c = 0; c < 4; ++c) {
    // Over TCP each connection has its own budget; over the Unix socket they
    // would share one.
    conns.push_back(Http2TestClient::ConnectTcp(daemon_->tcp_port(), stall));
    ASSERT_TRUE(conns.back());
    for (int i = 0; i < 64; ++i) {
      ids[c].push_back(conns[c]->StartCall(
          "Get", {{"authorization", std::string("Bearer ") + kToken}}, GetRequestBytes(TestKey(7))));
      ASSERT_GT(ids[c].back(), 0);
    }
  }
  // Every connection reaches its limit: the gets beyond it are refused.
  const uint64_t per_get = 2 * chunk.size();
  const uint64_t held_per_conn = (uint64_t{16} << 20) / per_get * per_get;
  const auto until = std::chrono::steady_clock::now() + milliseconds(10000);
  while (daemon_->grpc_inflight_bytes() < 2 * held_per_conn &&
         std::chrono::steady_clock::now() < until) {
    for (auto& c : conns) c->Pump(milliseconds(5));
  }
  EXPECT_GE(daemon_->grpc_inflight_bytes(), 2 * held_per_conn);
  EXPECT_LE(daemon_->grpc_inflight_bytes(), uint64_t{32} << 20);
  ExpectLocalClientServed(8);
  // At the write timeout the stalled answers are cancelled; every call ends.
  for (int c = 0; c < 4; ++c) {
    auto ended = [&] {
      for (int32_t id : ids[c]) {
        if (!conns[c]->call(id).closed) return false;
      }
      return true;
    };
    ASSERT_TRUE(conns[c]->PumpUntil(ended, milliseconds(10000))) << "connection " << c;
    int refused = 0;
    for (int32_t id : ids[c]) {
      refused += conns[c]->call(id).grpc_status == kResourceExhausted;
      EXPECT_EQ(conns[c]->call(id).body_bytes, 0u);
    }
    EXPECT_GT(refused, 0) << "connection " << c;
  }
  // The client sees a call end just before the daemon's reactor releases it.
  const auto freed_by = std::chrono::steady_clock::now() + milliseconds(5000);
  while (daemon_->grpc_inflight_bytes() != 0 && std::chrono::steady_clock::now() < freed_by) {
    for (auto& c : conns) c->Pump(milliseconds(5));
  }
  EXPECT_EQ(daemon_->grpc_inflight_bytes(), 0u);
  EXPECT_GT(daemon_->grpc_cancelled_calls(), 0u);
  ExpectLocalClientServed(9);
}

}  // namespace
}  // namespace kvtier::server
