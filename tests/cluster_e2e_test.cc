// Three kvtierd nodes and a private etcd on loopback: put on one node, get
// on another; a node killed with SIGKILL leaves every chunk readable with
// R = 2; the node restarts, rejoins and serves what its NVMe tier kept. A
// miss stays a miss with a forged member record, a killed member or a
// stopped one. Bounded: every wait has a deadline; everything started is
// killed at the end.
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <optional>
#include <thread>

#include "absl/time/time.h"
#include "cluster/etcd_test_util.h"
#include "cluster/membership.h"
#include "cluster/rendezvous.h"
#include "codec/codec.h"
#include "codec/test_util.h"
#include "common/file.h"
#include "common/testing/temp_dir.h"
#include "common/testing/wait.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/cli_runner.h"
#include "tests/http_get.h"

namespace kvtier {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;
using testing::RunCommand;
using testing::TempDir;

const std::string kKvtier = KVTIER_CLI_PATH;
const std::string kKvtierd = KVTIERD_PATH;

class Node {
 public:
  // `extra`: more kvtierd flags (e.g. --cluster-secret-file F).
  Node(std::string id, std::string dir, std::string etcd, int port, std::vector<std::string> extra = {})
      : id_(std::move(id)), dir_(std::move(dir)), etcd_(std::move(etcd)), port_(port), extra_(std::move(extra)) {}
  ~Node() { Kill(); }

  void Start() {
    std::filesystem::create_directories(dir_);
    std::filesystem::remove(ready_file());  // a killed node leaves its file behind
    pid_ = fork();
    if (pid_ == 0) {
      FILE* f = freopen((dir_ + ".log").c_str(), "a", stderr);
      (void)f;
      std::string adv = "127.0.0.1:" + std::to_string(port_);
      std::vector<std::string> args = {kKvtierd, "--data-dir", dir_, "--dram-gib", "0.0625",
                                       "--nvme-gib", "0.125", "--hbm-gib", "0", "--cluster", "e2e",
                                       "--etcd", etcd_, "--advertise", adv, "--node-id", id_,
                                       "--replicas", "2", "--cluster-lease-s", "2", "--log-level",
                                       "warn", "--ready-file", ready_file()};
      args.insert(args.end(), extra_.begin(), extra_.end());
      std::vector<char*> argv;
      for (std::string& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      execv(kKvtierd.c_str(), argv.data());
      _exit(127);
    }
  }
  // Stops (SIGSTOP) or resumes (SIGCONT) the process: a stopped node keeps
  // its sockets, the kernel takes connections, nothing answers.
  void Signal(int sig) {
    if (pid_ > 0) kill(pid_, sig);
  }
  void Kill() {
    if (pid_ > 0) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
      pid_ = -1;
    }
  }
  std::string socket() const { return dir_ + "/kvtierd.sock"; }
  std::string ready_file() const { return dir_ + ".ready"; }
  // Waits (up to 20 s) until the node has joined and every listener serves.
  bool WaitReady() const { return testing::WaitForFile(ready_file(), std::chrono::seconds(20)); }
  const std::string& id() const { return id_; }

 private:
  std::string id_, dir_, etcd_;
  int port_;
  std::vector<std::string> extra_;
  pid_t pid_ = -1;
};

class ClusterE2E : public ::testing::Test {
 protected:
  // Starts three nodes with `extra` flags (SecureClusterE2E adds a secret).
  void StartNodes(const std::vector<std::string>& extra) {
    ASSERT_TRUE(etcd_.ok()) << etcd_.error();
    for (int i = 0; i < 3; ++i) {
      nodes_.push_back(std::make_unique<Node>("node-" + std::to_string(i + 1),
                                              dir_.path() + "/n" + std::to_string(i + 1),
                                              etcd_.endpoint(), cluster::testing::FreePort(), extra));
      nodes_.back()->Start();
    }
    for (auto& n : nodes_) ASSERT_TRUE(n->WaitReady()) << n->id();
    ASSERT_TRUE(WaitMembers(3)) << Status();
    // etcd lists all three; wait until each node's watch has delivered the
    // others' registrations too, so every node computes the same owners.
    for (int n = 0; n < 3; ++n) ASSERT_TRUE(WaitListed(n, 3)) << "node " << n + 1;
  }
  void SetUp() override { StartNodes({}); }
  void TearDown() override {
    for (auto& n : nodes_) n->Kill();
  }
  testing::CliResult Cli(const std::string& args) { return RunCommand(kKvtier + " " + args, dir_.path()); }
  std::string Status() { return Cli("cluster status --etcd " + etcd_.endpoint() + " --cluster e2e --json").out; }
  // Waits (up to 15 s) until etcd lists `n` members.
  bool WaitMembers(size_t n) {
    return testing::WaitUntil([&] {
      auto j = nlohmann::json::parse(Status(), nullptr, false);
      return !j.is_discarded() && j.contains("members") && j["members"].size() == n;
    }, std::chrono::seconds(15), std::chrono::milliseconds(100));
  }
  // `kvtier stats --json` of node n (discarded JSON if it does not answer).
  nlohmann::json Stats(int n) {
    auto r = Cli("stats --json --socket " + nodes_[n]->socket());
    return nlohmann::json::parse(r.out, nullptr, false);
  }
  // The capacity node n offers the cluster (DRAM + NVMe) and its remote
  // tier's capacity (the sum over the other members it lists); nullopt while
  // it does not answer.
  std::optional<std::pair<uint64_t, uint64_t>> Capacities(int n) {
    nlohmann::json j = Stats(n);
    if (j.is_discarded() || !j.contains("tiers")) return std::nullopt;
    uint64_t own = 0, remote = 0;
    for (const auto& t : j["tiers"]) {
      uint64_t c = t["capacity_bytes"].get<uint64_t>();
      if (t["tier"] == "remote") remote = c;
      if (t["tier"] == "dram" || t["tier"] == "nvme") own += c;
    }
    return std::make_pair(own, remote);
  }
  // Waits (up to 15 s) until node n's remote tier offers the capacity of
  // `members` - 1 other nodes (all started alike) plus an amount that
  // `extra_ok` accepts: the other members its watch has delivered.
  template <typename F>
  bool WaitListed(int n, uint64_t members, F extra_ok) {
    return testing::WaitUntil([&] {
      auto c = Capacities(n);
      return c && c->second >= c->first * (members - 1) &&
             extra_ok(c->second - c->first * (members - 1));
    }, std::chrono::seconds(15), std::chrono::milliseconds(100));
  }
  bool WaitListed(int n, uint64_t members) {
    return WaitListed(n, members, [](uint64_t extra) { return extra == 0; });
  }
  // A get (or lookup) of a key nobody stored, on node n.
  struct Miss {
    int exit_code;
    absl::Duration took;
    std::string err;
  };
  Miss TimedMiss(int n, const std::string& verb = "get") {
    std::string key = Hash128::Of("never-stored", 0).ToHex();
    std::string args = verb == "get" ? "get --key " + key + " -o " + dir_.path() + "/miss"
                                     : "lookup --keys " + key;
    absl::Time t0 = absl::Now();
    auto r = Cli(args + " --socket " + nodes_[n]->socket());
    return {r.exit_code, absl::Now() - t0, r.err};
  }
  // Writes a chunk file; returns its path.
  std::string MakeChunk(int i, std::vector<uint8_t>* bytes) {
    codec::Geometry g{2, 2, 32, 64, 16};
    auto spec = codec::testing::MakeSpec(g, codec::DType::kBF16,
                                         {codec::DType::kBF16, codec::ScaleGranularity::kNone},
                                         {codec::DType::kFP8E4M3, codec::ScaleGranularity::kPerBlockHead});
    auto k = codec::testing::MakeKv(g, codec::DType::kBF16, {.seed = static_cast<uint32_t>(i + 1)});
    auto v = codec::testing::MakeKv(g, codec::DType::kBF16, {.seed = static_cast<uint32_t>(i + 101)});
    *bytes = *codec::EncodeChunk(spec, {k, v});
    std::string path = dir_.path() + "/chunk" + std::to_string(i);
    EXPECT_TRUE(WriteFileAtomic(path, *bytes).ok());
    return path;
  }
  std::string Key(int i) { return Hash128::Of("e2e-key-" + std::to_string(i), 0).ToHex(); }
  // Gets key i from node n and compares it with `want`.
  void ExpectGet(int n, int i, const std::vector<uint8_t>& want) {
    std::string out = dir_.path() + "/got";
    auto r = Cli("get --socket " + nodes_[n]->socket() + " --key " + Key(i) + " -o " + out);
    ASSERT_EQ(r.exit_code, 0) << "node " << n + 1 << " key " << i << ": " << r.err;
    auto got = ReadFileBytes(out, 1 << 26);
    ASSERT_TRUE(got.ok());
    EXPECT_EQ(*got, want) << "key " << i;
  }

  cluster::testing::EtcdServer etcd_;
  TempDir dir_;
  std::vector<std::unique_ptr<Node>> nodes_;
};

TEST_F(ClusterE2E, PutOnOneNodeGetOnAnotherSurviveAKillAndRejoin) {
  auto status = nlohmann::json::parse(Status());
  EXPECT_EQ(status["members"][0]["id"], "node-1");
  EXPECT_GT(status["members"][0]["capacity_bytes"].get<uint64_t>(), 0u);
  EXPECT_LE(status["members"][0]["lease_ttl_left_s"].get<int64_t>(), 2);

  // 1. Put on node 1, get on node 3.
  std::vector<uint8_t> a;
  std::string fa = MakeChunk(0, &a);
  auto put = Cli("put --socket " + nodes_[0]->socket() + " --key " + Key(0) + " " + fa);
  ASSERT_EQ(put.exit_code, 0) << put.err;
  ExpectGet(2, 0, a);

  // 2. Chunks put on node 2; node 2 is killed; node 3 still reads them all
  //    from the other owner (R = 2 spreads every key over two nodes).
  std::vector<std::vector<uint8_t>> chunks(12);
  for (int i = 1; i <= 11; ++i) {
    std::string f = MakeChunk(i, &chunks[i]);
    auto r = Cli("put --socket " + nodes_[1]->socket() + " --key " + Key(i) + " " + f);
    ASSERT_EQ(r.exit_code, 0) << r.err;
  }
  nodes_[1]->Kill();
  for (int i = 1; i <= 11; ++i) ExpectGet(2, i, chunks[i]);
  ASSERT_TRUE(WaitMembers(2)) << Status();  // its lease ran out
  for (int i = 1; i <= 11; ++i) ExpectGet(0, i, chunks[i]);

  // 3. Node 2 restarts with its data dir and rejoins; the replicas it held
  //    (on NVMe) are served by it again.
  nodes_[1]->Start();
  ASSERT_TRUE(nodes_[1]->WaitReady());
  ASSERT_TRUE(WaitMembers(3)) << Status();
  for (int n = 0; n < 3; ++n) ASSERT_TRUE(WaitListed(n, 3)) << "node " << n + 1;
  std::vector<cluster::Member> members = {{"node-1", "", "", 0, 0}, {"node-2", "", "", 0, 0},
                                                  {"node-3", "", "", 0, 0}};
  int owned = 0;
  // Key 0 was put on node 1: its owners other than node 1 hold NVMe replicas.
  for (int i = 0; i < 1; ++i) {
    auto owners = cluster::RendezvousOwners(Hash128::FromHex(Key(i)).value(), members, 2);
    bool node2_owns = owners[0].id == "node-2" || owners[1].id == "node-2";
    if (!node2_owns) continue;
    ++owned;
    auto r = Cli("lookup --socket " + nodes_[1]->socket() + " --keys " + Key(i));
    EXPECT_EQ(r.exit_code, 0) << r.err;
    EXPECT_THAT(r.out, HasSubstr("nvme")) << r.out;
  }
  // Whatever node 2 owns or not, every chunk is readable through it.
  ExpectGet(1, 0, a);
  for (int i = 1; i <= 11; ++i) ExpectGet(1, i, chunks[i]);
  RecordProperty("node2_owned_replicas_checked", owned);
}

// A miss is a miss (exit 1, within a bounded time), not an error, with a
// forged member record without a lease in etcd, right after a member is
// killed (it is listed until its lease expires), and while a member is
// stopped (it takes connections, nothing answers).
TEST_F(ClusterE2E, AMissStaysAMissWithAForgedDeadOrStoppedMember) {
  // 1. A well-formed member record without a lease, pointing at a port
  //    nothing listens on: no node takes it as a member.
  auto etcd = cluster::EtcdClient::Connect({etcd_.endpoint()});
  ASSERT_TRUE(etcd.ok()) << etcd.status();
  const std::string dead = "127.0.0.1:" + std::to_string(cluster::testing::FreePort());
  constexpr uint64_t kForgedBytes = 1000003, kSentinelBytes = 7;
  cluster::MemberRecord forged;
  forged.member = {"forged", dead, "", kForgedBytes, 0};
  forged.protocol = 1;
  ASSERT_TRUE((*etcd)->Put(cluster::MembersPrefix("e2e") + "forged", cluster::EncodeMemberRecord(forged)).ok());
  // A record with a lease, written after it: once a node lists this one,
  // its watch has delivered the forged record too.
  auto lease = (*etcd)->LeaseGrant(30);
  ASSERT_TRUE(lease.ok()) << lease.status();
  cluster::MemberRecord sentinel = forged;
  sentinel.member = {"sentinel", dead, "", kSentinelBytes, 0};
  ASSERT_TRUE((*etcd)->Put(cluster::MembersPrefix("e2e") + "sentinel", cluster::EncodeMemberRecord(sentinel),
                           *lease).ok());
  for (int n = 0; n < 3; ++n) {
    ASSERT_TRUE(WaitListed(n, 3, [&](uint64_t e) {
      return e == kSentinelBytes || e == kSentinelBytes + kForgedBytes;
    })) << "node " << n + 1;
  }
  ASSERT_TRUE((*etcd)->LeaseRevoke(*lease).ok());  // the sentinel leaves
  for (int n = 0; n < 3; ++n) {
    ASSERT_TRUE(WaitListed(n, 3, [&](uint64_t e) { return e == 0 || e == kForgedBytes; }))
        << "node " << n + 1;
    auto c = Capacities(n);
    ASSERT_TRUE(c);
    EXPECT_EQ(c->second, 2 * c->first) << "node " << n + 1 << " counts the forged record";
    Miss m = TimedMiss(n);
    EXPECT_EQ(m.exit_code, 1) << "node " << n + 1 << ": " << m.err;
  }

  // 2. Node 2 is killed; right after (it is listed until its lease
  //    expires), a miss on node 3 is a miss, found quickly.
  nodes_[1]->Kill();
  for (const char* verb : {"get", "lookup"}) {
    Miss m = TimedMiss(2, verb);
    EXPECT_EQ(m.exit_code, 1) << verb << ": " << m.err;
    EXPECT_LT(m.took, absl::Seconds(2)) << verb;
  }

  // 3. Node 1 stops answering (SIGSTOP: its connections stay open); a miss
  //    on node 3 waits one short lookup timeout, then node 1 is skipped.
  nodes_[0]->Signal(SIGSTOP);
  for (int i = 0; i < 2; ++i) {
    Miss m = TimedMiss(2);
    EXPECT_EQ(m.exit_code, 1) << i << ": " << m.err;
    EXPECT_LT(m.took, absl::Seconds(2)) << i;
  }
  nlohmann::json st = Stats(2);
  ASSERT_FALSE(st.is_discarded());
  EXPECT_GE(st["counters"]["remote_errors"].get<uint64_t>(), 1u) << st.dump();
  nodes_[0]->Signal(SIGCONT);
}

TEST_F(ClusterE2E, StatusAndBadClusterInput) {
  auto table = Cli("cluster status --etcd " + etcd_.endpoint() + " --cluster e2e");
  EXPECT_EQ(table.exit_code, 0) << table.err;
  EXPECT_THAT(table.out, HasSubstr("3 member(s)"));
  EXPECT_THAT(table.out, HasSubstr("node-2"));
  auto bad = Cli("cluster status --etcd https://127.0.0.1:1 --cluster e2e");
  EXPECT_EQ(bad.exit_code, 2);
  EXPECT_THAT(bad.err, HasSubstr("--etcd-ca"));
  auto bad_name = Cli("cluster status --etcd " + etcd_.endpoint() + " --cluster 'a/b'");
  EXPECT_EQ(bad_name.exit_code, 2);
  auto no_etcd = RunCommand(kKvtierd + " --cluster x --data-dir " + dir_.path() + "/z", dir_.path());
  EXPECT_EQ(no_etcd.exit_code, 2);
  EXPECT_THAT(no_etcd.err, HasSubstr("--etcd"));
}

// Three nodes that hold the cluster secret, and two intruders that join the
// same etcd: one with another secret, one with none. The members never list
// the intruders (their records are not signed with the secret), the
// intruder without a secret is refused at the handshake when it asks a
// member for a chunk, neither can read the members' chunks nor write into
// them, and the members keep serving; their /metrics count the refusals.
class SecureClusterE2E : public ClusterE2E {
 protected:
  std::string SecretFile(const std::string& name, const std::string& secret) {
    std::string path = dir_.path() + "/" + name;
    EXPECT_TRUE(WriteFileAtomic(path, {reinterpret_cast<const uint8_t*>(secret.data()), secret.size()}).ok());
    ::chmod(path.c_str(), 0600);
    return path;
  }
  static constexpr char kSecret[] = "e2e-secret-0123456789abcdef0123456789abcdef";
  void SetUp() override {
    StartNodes({"--cluster-secret-file", SecretFile("secret", kSecret), "--metrics-addr", "127.0.0.1:0"});
  }
  // Node n's /metrics ("" if it cannot be read).
  std::string Metrics(int n) {
    auto ready = ReadFileBytes(nodes_[n]->ready_file(), 1 << 16);
    if (!ready.ok()) return "";
    std::string text(ready->begin(), ready->end());
    size_t at = text.find("metrics http port ");
    if (at == std::string::npos) return "";
    return testing::HttpGetLocal(std::atoi(text.c_str() + at + 18), "/metrics");
  }
  // The counter `name` on node n's /metrics (-1 if it cannot be read).
  int64_t Metric(int n, const std::string& name) {
    const std::string body = Metrics(n);
    size_t line = body.find("\n" + name + " ");
    if (line == std::string::npos) return -1;
    return std::atoll(body.c_str() + line + name.size() + 2);
  }
};

TEST_F(SecureClusterE2E, NodesWithoutTheSecretCannotJoinReadOrWrite) {
  std::vector<uint8_t> a;
  std::string fa = MakeChunk(0, &a);
  ASSERT_EQ(Cli("put --socket " + nodes_[0]->socket() + " --key " + Key(0) + " " + fa).exit_code, 0);
  ExpectGet(2, 0, a);  // members authenticate each other and share chunks

  Node wrong("intruder-1", dir_.path() + "/i1", etcd_.endpoint(), cluster::testing::FreePort(),
             {"--cluster-secret-file", SecretFile("wrong", "not-the-secret-0123456789abcdef0123456789")});
  Node none("intruder-2", dir_.path() + "/i2", etcd_.endpoint(), cluster::testing::FreePort());
  wrong.Start();
  none.Start();
  ASSERT_TRUE(wrong.WaitReady());
  ASSERT_TRUE(none.WaitReady());
  ASSERT_TRUE(WaitMembers(5)) << Status();  // both wrote records into etcd
  // The members reject both records: each still lists the other two only.
  ASSERT_TRUE(testing::WaitUntil([&] { return Metric(0, "kvtier_cluster_records_rejected_total") >= 2; },
                                 std::chrono::seconds(15), std::chrono::milliseconds(200)))
      << Metric(0, "kvtier_cluster_records_rejected_total");
  for (int n = 0; n < 3; ++n) ASSERT_TRUE(WaitListed(n, 3)) << "node " << n + 1;
  // `kvtier cluster status` with the secret marks the intruders' records.
  auto status = nlohmann::json::parse(
      Cli("cluster status --etcd " + etcd_.endpoint() + " --cluster e2e --json --cluster-secret-file " +
          SecretFile("status-secret", kSecret)).out, nullptr, false);
  ASSERT_FALSE(status.is_discarded());
  ASSERT_EQ(status["members"].size(), 5u);
  for (const auto& m : status["members"]) {
    const bool intruder = m["id"].get<std::string>().rfind("intruder-", 0) == 0;
    EXPECT_EQ(m["signature"], intruder ? "invalid" : "valid") << m.dump();
  }
  EXPECT_THAT(Cli("cluster status --etcd " + etcd_.endpoint() + " --cluster e2e").out, HasSubstr("unchecked"));
  auto short_secret = Cli("cluster status --etcd " + etcd_.endpoint() + " --cluster e2e --cluster-secret-file " +
                          SecretFile("short", "short"));
  EXPECT_NE(short_secret.exit_code, 0);
  EXPECT_THAT(short_secret.err, HasSubstr("cluster secret"));
  EXPECT_NE(Cli("cluster status --etcd " + etcd_.endpoint() + " --cluster e2e --etcd-user root").exit_code, 0);

  auto cli_on = [&](const Node& node, const std::string& args) {
    return Cli(args + " --socket " + node.socket());
  };
  // Neither intruder reads the members' chunk.
  for (const Node* n : {&wrong, &none}) {
    auto r = cli_on(*n, "get --key " + Key(0) + " -o " + dir_.path() + "/stolen");
    EXPECT_EQ(r.exit_code, 1) << n->id() << ": " << r.err;
  }
  // The intruder without a secret asked the members and was refused.
  ASSERT_TRUE(testing::WaitUntil([&] {
    int64_t f = 0;
    for (int n = 0; n < 3; ++n) f += std::max<int64_t>(0, Metric(n, "kvtier_cluster_peer_auth_failures_total"));
    return f >= 1;
  }, std::chrono::seconds(10), std::chrono::milliseconds(200)));
  // What the intruders put stays with them: no member serves it.
  std::vector<uint8_t> b;
  std::string fb = MakeChunk(1, &b);
  for (const Node* n : {&wrong, &none}) {
    auto r = cli_on(*n, "put --key " + Key(1) + " " + fb);
    EXPECT_EQ(r.exit_code, 0) << n->id() << ": " << r.err;  // its own tiers take it
  }
  for (int n = 0; n < 3; ++n) {
    auto r = Cli("get --socket " + nodes_[n]->socket() + " --key " + Key(1) + " -o " + dir_.path() + "/x");
    EXPECT_EQ(r.exit_code, 1) << "node " << n + 1 << " serves an intruder's chunk";
  }
  // The members keep serving each other.
  ExpectGet(1, 0, a);
  EXPECT_GE(Metric(0, "kvtier_cluster_peer_auth_successes_total"), 1);
  // The secret is nowhere in etcd, the metrics or the logs.
  auto etcd = cluster::EtcdClient::Connect({etcd_.endpoint()});
  ASSERT_TRUE(etcd.ok());
  auto all = (*etcd)->GetPrefix("/");
  ASSERT_TRUE(all.ok());
  EXPECT_GE(all->first.size(), 5u);
  for (const auto& kv : all->first) EXPECT_THAT(kv.value, Not(HasSubstr(kSecret))) << kv.key;
  for (int n = 0; n < 3; ++n) {
    EXPECT_THAT(Metrics(n), Not(HasSubstr(kSecret)));
    auto log = ReadFileBytes(dir_.path() + "/n" + std::to_string(n + 1) + ".log", 1 << 24);
    ASSERT_TRUE(log.ok());
    EXPECT_THAT(std::string(log->begin(), log->end()), Not(HasSubstr(kSecret)));
  }
}

}  // namespace
}  // namespace kvtier
