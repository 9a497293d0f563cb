// kvtierd out of file descriptors. The real binary, under a small
// RLIMIT_NOFILE set in its child process, flooded with more TCP connections
// than it has descriptors: local and other TCP clients are served during the
// flood and right after it. And the two accept loops the daemon owns, the
// TCP listener's and the data plane's, when accept fails with EMFILE: they
// do not spin, and they accept again once descriptors are free. Every wait
// is bounded.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "client/kvtier_client.h"
#include "common/testing/temp_dir.h"
#include "common/testing/wait.h"
#include "gtest/gtest.h"
#include "server/metrics.h"
#include "server/options.h"
#include "server/shm_channel.h"
#include "server/tcp_acceptor.h"
#include "server/test_util.h"
#include "tests/daemon_process.h"

namespace kvtier::testing {
namespace {

using std::chrono::milliseconds;

const char kToken[] = "fd-limits-test-token-0123456789abcdef012345";
constexpr uint64_t kDaemonFdLimit = 256;
constexpr char kHttp2Preface[] = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

// Open TCP connections to 127.0.0.1:`port` from 127.0.0.`first_host`..,
// `per_host` from each source address, each sending the HTTP/2 preface and
// nothing more (no token, no SETTINGS). Connects are non-blocking: a daemon
// that no longer accepts leaves them in its backlog.
class Flood {
 public:
  Flood(int port, int first_host, int hosts, int per_host) {
    for (int h = 0; h < hosts; ++h) {
      for (int i = 0; i < per_host; ++i) {
        int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
        if (fd < 0) continue;
        sockaddr_in src{};
        src.sin_family = AF_INET;
        src.sin_addr.s_addr = htonl((127u << 24) | static_cast<uint32_t>(first_host + h));
        sockaddr_in dst{};
        dst.sin_family = AF_INET;
        dst.sin_port = htons(static_cast<uint16_t>(port));
        dst.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        if (::bind(fd, reinterpret_cast<sockaddr*>(&src), sizeof(src)) == 0) {
          (void)::connect(fd, reinterpret_cast<sockaddr*>(&dst), sizeof(dst));
        }
        fds_.push_back(fd);
      }
    }
    // The connects complete (loopback) and the prefaces go out.
    std::this_thread::sleep_for(milliseconds(200));
    for (int fd : fds_) (void)!::send(fd, kHttp2Preface, sizeof(kHttp2Preface) - 1, MSG_NOSIGNAL);
  }
  ~Flood() { Close(); }
  void Close() {
    for (int fd : fds_) ::close(fd);
    fds_.clear();
  }
  size_t size() const { return fds_.size(); }

 private:
  std::vector<int> fds_;
};

class FdLimitsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // The test holds every flood connection: up to its hard limit.
    rlimit r{};
    ::getrlimit(RLIMIT_NOFILE, &r);
    r.rlim_cur = r.rlim_max;
    ::setrlimit(RLIMIT_NOFILE, &r);
    token_path_ = dir_.path() + "/token";
    std::ofstream(token_path_) << kToken << "\n";
    ::chmod(token_path_.c_str(), 0600);
  }
  // kvtierd with a TCP listener on loopback, RLIMIT_NOFILE kDaemonFdLimit.
  void StartDaemon(std::vector<std::string> extra = {}) {
    DaemonProcess::Options o;
    o.fd_limit = kDaemonFdLimit;
    o.extra_args = {"--listen-tcp", "127.0.0.1:0", "--token-file", token_path_, "--keepalive-s", "60"};
    o.extra_args.insert(o.extra_args.end(), extra.begin(), extra.end());
    daemon_ = std::make_unique<DaemonProcess>(dir_.path(), o);
    ASSERT_TRUE(daemon_->WaitReady()) << Log();
    port_ = daemon_->tcp_port();
    ASSERT_GT(port_, 0) << Log();
  }
  std::string Log() {
    std::ifstream in(dir_.path() + "/kvtierd.log");
    return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  }
  // One put and get through a new client, within `timeout_ms` per call.
  absl::Status Served(bool tcp, uint32_t seed, int timeout_ms = 3000) {
    client::ClientOptions co;
    co.timeout_ms = timeout_ms;
    if (tcp) {
      co.tcp_addr = "127.0.0.1:" + std::to_string(port_);
      co.token = kToken;
    } else {
      co.socket_path = daemon_->socket();
    }
    auto c = client::KvtierClient::Connect(co);
    if (!c.ok()) return c.status();
    const auto chunk = MakeChunk(seed);
    if (absl::Status st = (*c)->Put(TestKey(seed), chunk); !st.ok()) return st;
    auto got = (*c)->Get(TestKey(seed));
    if (!got.ok()) return got.status();
    if (*got != chunk) return absl::DataLossError("wrong bytes");
    return absl::OkStatus();
  }
  // Served within `within` (new clients, tried again until then).
  absl::Status ServedWithin(bool tcp, uint32_t seed, milliseconds within) {
    absl::Status last;
    WaitUntil([&] { return (last = Served(tcp, seed, 1000)).ok(); }, within, milliseconds(100));
    return last;
  }

  TempDir dir_;
  std::string token_path_;
  std::unique_ptr<DaemonProcess> daemon_;
  int port_ = 0;
};

// More connections than the daemon has descriptors, from 40 addresses (so no
// per-peer limit applies): the listener's limit closes the excess at once,
// the Unix socket is served throughout, and after the flood both listeners
// serve new clients at once.
TEST_F(FdLimitsTest, TcpFloodPastTheFdLimitLeavesTheDaemonServing) {
  StartDaemon();
  Flood flood(port_, /*first_host=*/2, /*hosts=*/40, /*per_host=*/10);
  ASSERT_GT(flood.size(), kDaemonFdLimit);
  EXPECT_TRUE(Served(/*tcp=*/false, 1).ok()) << Log();
  flood.Close();
  EXPECT_TRUE(ServedWithin(/*tcp=*/false, 2, milliseconds(5000)).ok()) << Log();
  EXPECT_TRUE(ServedWithin(/*tcp=*/true, 3, milliseconds(5000)).ok()) << Log();
  EXPECT_EQ(Log().find("Failed accept4"), std::string::npos);
}

// One peer floods past the descriptor limit: beyond its per-peer limit its
// connections are closed at once, and another TCP peer is served meanwhile.
TEST_F(FdLimitsTest, PerPeerLimitKeepsOtherTcpPeersServed) {
  StartDaemon({"--max-tcp-connections-per-peer", "16"});
  Flood flood(port_, /*first_host=*/2, /*hosts=*/1, /*per_host=*/300);
  ASSERT_GT(flood.size(), kDaemonFdLimit);
  EXPECT_TRUE(Served(/*tcp=*/true, 4).ok()) << Log();
  EXPECT_TRUE(Served(/*tcp=*/false, 5).ok()) << Log();
  flood.Close();
  EXPECT_TRUE(ServedWithin(/*tcp=*/true, 6, milliseconds(5000)).ok()) << Log();
}

// The soft limit is raised to the hard one at startup.
TEST_F(FdLimitsTest, RaisesTheSoftFdLimitToTheHardLimit) {
  DaemonProcess::Options o;
  o.fd_limit = 200;
  o.fd_hard_limit = 300;
  daemon_ = std::make_unique<DaemonProcess>(dir_.path(), o);
  ASSERT_TRUE(daemon_->WaitReady()) << Log();
  std::ifstream in("/proc/" + std::to_string(daemon_->pid()) + "/limits");
  std::string line;
  bool found = false;
  while (std::getline(in, line)) {
    if (line.rfind("Max open files", 0) != 0) continue;
    found = true;
    std::istringstream fields(line.substr(std::string("Max open files").size()));
    uint64_t soft = 0, hard = 0;
    fields >> soft >> hard;
    EXPECT_EQ(soft, 300u) << line;
    EXPECT_EQ(hard, 300u) << line;
  }
  EXPECT_TRUE(found);
  EXPECT_NE(Log().find("file descriptor limit (RLIMIT_NOFILE) 300"), std::string::npos) << Log();
}

// Runs `body` with this process's descriptors used up (soft limit lowered
// to a few above those open, the rest filled), then frees them.
class FdExhaustion {
 public:
  FdExhaustion() {
    ::getrlimit(RLIMIT_NOFILE, &saved_);
    rlimit low = saved_;
    low.rlim_cur = static_cast<rlim_t>(server::OpenFdCount() + 16);
    ::setrlimit(RLIMIT_NOFILE, &low);
    for (;;) {
      int fd = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
      if (fd < 0) break;
      fillers_.push_back(fd);
    }
  }
  ~FdExhaustion() { Release(); }
  void Release() {
    for (int fd : fillers_) ::close(fd);
    fillers_.clear();
    ::setrlimit(RLIMIT_NOFILE, &saved_);
  }

 private:
  rlimit saved_{};
  std::vector<int> fillers_;
};

double CpuSeconds() {
  rusage u{};
  ::getrusage(RUSAGE_SELF, &u);
  return u.ru_utime.tv_sec + u.ru_stime.tv_sec + (u.ru_utime.tv_usec + u.ru_stime.tv_usec) / 1e6;
}

// CPU time this process uses over `ms` while the calling thread sleeps.
double CpuOver(int ms) {
  const double t0 = CpuSeconds();
  std::this_thread::sleep_for(milliseconds(ms));
  return CpuSeconds() - t0;
}

// The sockets a TcpAcceptor handed off, kept (and closed) by the test.
class HandedSockets {
 public:
  ~HandedSockets() { CloseAll(); }
  server::TcpAcceptor::Handoff Handoff() {
    return [this](int fd) {
      std::lock_guard<std::mutex> l(mu_);
      fds_.push_back(fd);
    };
  }
  size_t size() {
    std::lock_guard<std::mutex> l(mu_);
    return fds_.size();
  }
  void CloseFirst() {
    std::lock_guard<std::mutex> l(mu_);
    ::close(fds_.front());
    fds_.erase(fds_.begin());
  }
  void CloseAll() {
    std::lock_guard<std::mutex> l(mu_);
    for (int fd : fds_) ::close(fd);
    fds_.clear();
  }

 private:
  std::mutex mu_;
  std::vector<int> fds_;
};

TEST(TcpAcceptor, WaitsOutEmfileWithoutSpinningAndAcceptsAgain) {
  auto acceptor = server::TcpAcceptor::Listen("127.0.0.1:0", {});
  ASSERT_TRUE(acceptor.ok()) << acceptor.status();
  HandedSockets handed;
  (*acceptor)->Start(handed.Handoff());
  int client = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ASSERT_GE(client, 0);
  sockaddr_in dst{};
  dst.sin_family = AF_INET;
  dst.sin_port = htons(static_cast<uint16_t>((*acceptor)->port()));
  dst.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  {
    FdExhaustion exhausted;
    ASSERT_EQ(::connect(client, reinterpret_cast<sockaddr*>(&dst), sizeof(dst)), 0);
    ASSERT_TRUE(WaitUntil([&] { return (*acceptor)->accept_failures() > 0; }, milliseconds(3000)));
    EXPECT_LT(CpuOver(1000), 0.2);
    exhausted.Release();
    EXPECT_TRUE(WaitUntil([&] { return handed.size() == 1; }, milliseconds(3000)));
  }
  EXPECT_EQ((*acceptor)->connections(), 1);
  handed.CloseAll();
  // A closed connection stops counting.
  EXPECT_EQ((*acceptor)->connections(), 0);
  ::close(client);
}

TEST(TcpAcceptor, ClosesConnectionsBeyondItsLimits) {
  server::TcpAcceptorOptions o;
  o.max_connections = 3;
  o.max_connections_per_peer = 2;
  auto acceptor = server::TcpAcceptor::Listen("127.0.0.1:0", o);
  ASSERT_TRUE(acceptor.ok()) << acceptor.status();
  HandedSockets handed;
  (*acceptor)->Start(handed.Handoff());
  auto connect_from = [&](uint32_t host) {
    int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in src{};
    src.sin_family = AF_INET;
    src.sin_addr.s_addr = htonl((127u << 24) | host);
    sockaddr_in dst{};
    dst.sin_family = AF_INET;
    dst.sin_port = htons(static_cast<uint16_t>((*acceptor)->port()));
    dst.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    EXPECT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&src), sizeof(src)), 0);
    EXPECT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&dst), sizeof(dst)), 0);
    return fd;
  };
  std::vector<int> clients;
  for (int i = 0; i < 3; ++i) clients.push_back(connect_from(2));  // the third is over the peer limit
  ASSERT_TRUE(WaitUntil([&] { return (*acceptor)->refused() == 1; }, milliseconds(3000)));
  EXPECT_EQ(handed.size(), 2u);
  clients.push_back(connect_from(3));
  clients.push_back(connect_from(4));  // over the listener limit
  ASSERT_TRUE(WaitUntil([&] { return (*acceptor)->refused() == 2; }, milliseconds(3000)));
  EXPECT_EQ(handed.size(), 3u);
  // A connection that ends frees its place (the acceptor checks its
  // connections at most every 20 ms while refusing).
  handed.CloseFirst();
  std::this_thread::sleep_for(milliseconds(50));
  clients.push_back(connect_from(4));
  EXPECT_TRUE(WaitUntil([&] { return handed.size() == 3u; }, milliseconds(3000)));
  EXPECT_EQ((*acceptor)->refused(), 2u);
  (*acceptor)->Stop();
  for (int fd : clients) ::close(fd);
  handed.CloseAll();
}

TEST(ShmChannel, AcceptWaitsOutEmfileWithoutSpinning) {
  TempDir dir;
  const int pool = ::memfd_create("fd-limits-test-pool", MFD_CLOEXEC);
  ASSERT_GE(pool, 0);
  ASSERT_EQ(::ftruncate(pool, 4096), 0);
  server::ServerMetrics metrics;
  const std::string path = dir.path() + "/shm.sock";
  auto channel = server::ShmChannel::Start(path, pool, 4096, &metrics);
  ASSERT_TRUE(channel.ok()) << channel.status();
  int client = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ASSERT_GE(client, 0);
  timeval tv{5, 0};
  ::setsockopt(client, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::snprintf(addr.sun_path, sizeof(addr.sun_path), "%s", path.c_str());
  {
    FdExhaustion exhausted;
    ASSERT_EQ(::connect(client, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
    EXPECT_LT(CpuOver(1000), 0.2);
  }
  // With descriptors free again the channel accepts and passes the pool.
  uint64_t size = 0;
  EXPECT_EQ(::recv(client, &size, sizeof(size), MSG_WAITALL), static_cast<ssize_t>(sizeof(size)));
  EXPECT_EQ(size, 4096u);
  ::close(client);
  channel->reset();
  ::close(pool);
}

TEST(FdLimitOptions, AreValidatedAndReadFromTheConfigFile) {
  TempDir dir;
  server::DaemonOptions o = SmallDaemonOptions(dir.path());
  EXPECT_TRUE(server::ValidateDaemonOptions(o).ok());
  o.max_tcp_connections = 0;
  EXPECT_EQ(server::ValidateDaemonOptions(o).code(), absl::StatusCode::kInvalidArgument);
  o = SmallDaemonOptions(dir.path());
  o.max_tcp_connections = 8;
  o.max_tcp_connections_per_peer = 9;
  EXPECT_EQ(server::ValidateDaemonOptions(o).code(), absl::StatusCode::kInvalidArgument);
  o = SmallDaemonOptions(dir.path());
  o.fd_reserve = server::kMinFdReserve - 1;
  EXPECT_EQ(server::ValidateDaemonOptions(o).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(server::ResolveFdReserve(0, 256), 128u);
  EXPECT_EQ(server::ResolveFdReserve(0, 4096), 1024u);
  EXPECT_EQ(server::ResolveFdReserve(200, 4096), 200u);
  const std::string path = dir.path() + "/kvtierd.toml";
  std::ofstream(path) << "max_tcp_connections = 100\nmax_tcp_connections_per_peer = 10\nfd_reserve = 500\n";
  server::DaemonOptions from_file;
  ASSERT_TRUE(server::LoadConfigFile(path, &from_file).ok());
  EXPECT_EQ(from_file.max_tcp_connections, 100u);
  EXPECT_EQ(from_file.max_tcp_connections_per_peer, 10u);
  EXPECT_EQ(from_file.fd_reserve, 500u);
}

}  // namespace
}  // namespace kvtier::testing
