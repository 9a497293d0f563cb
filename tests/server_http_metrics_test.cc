// MetricsHttpServer over loopback with raw sockets: what a scrape gets, what
// other requests get, and that slow, stalled or oversized clients neither
// delay scrapes nor stop the server from shutting down. Every client here has
// its own deadline; nothing waits on a fixed sleep.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/http_metrics.h"

namespace kvtier::server {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

// About 20 KB of exposition text: bigger than one socket write, so a scrape
// that gets all of it got a complete answer.
std::string RenderFixture() {
  std::string s = "# TYPE kvtier_test_total counter\n";
  for (int i = 0; i < 500; ++i) absl::StrAppend(&s, "kvtier_test_total{i=\"", i, "\"} ", i * 7, "\n");
  return s;
}

struct HttpResponse {
  std::string status_line;
  int status = 0;
  std::map<std::string, std::string> headers;  // names lower-cased
  std::string body;

  std::string Header(const std::string& name) const {
    auto it = headers.find(name);
    return it == headers.end() ? "" : it->second;
  }
};

// One loopback TCP connection whose reads end at a deadline.
class Conn {
 public:
  explicit Conn(int port) {
    fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<uint16_t>(port));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (fd_ >= 0 && ::connect(fd_, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
      ::close(fd_);
      fd_ = -1;
    }
  }
  ~Conn() {
    if (fd_ >= 0) ::close(fd_);
  }
  Conn(const Conn&) = delete;
  Conn& operator=(const Conn&) = delete;

  bool ok() const { return fd_ >= 0; }
  int fd() const { return fd_; }

  // False when the peer has closed or reset the connection.
  bool Send(std::string_view s) {
    while (!s.empty()) {
      ssize_t n = ::send(fd_, s.data(), s.size(), MSG_NOSIGNAL);
      if (n <= 0) return false;
      s.remove_prefix(static_cast<size_t>(n));
    }
    return true;
  }

  // One response: status line, headers and a Content-Length body (none for
  // HEAD). nullopt if it is not complete by `deadline` or the peer closes
  // first.
  std::optional<HttpResponse> ReadResponse(Clock::time_point deadline, bool head = false) {
    size_t end;
    while ((end = buf_.find("\r\n\r\n")) == std::string::npos) {
      if (!Fill(deadline)) return std::nullopt;
    }
    HttpResponse r;
    std::string head_text = buf_.substr(0, end);
    buf_.erase(0, end + 4);
    size_t eol = head_text.find("\r\n");
    r.status_line = head_text.substr(0, eol);
    if (r.status_line.size() < 12 || !absl::SimpleAtoi(r.status_line.substr(9, 3), &r.status)) {
      return std::nullopt;
    }
    size_t pos = eol == std::string::npos ? head_text.size() : eol + 2;
    while (pos < head_text.size()) {
      size_t next = head_text.find("\r\n", pos);
      if (next == std::string::npos) next = head_text.size();
      std::string line = head_text.substr(pos, next - pos);
      size_t colon = line.find(':');
      if (colon != std::string::npos) {
        r.headers[absl::AsciiStrToLower(line.substr(0, colon))] =
            std::string(absl::StripAsciiWhitespace(line.substr(colon + 1)));
      }
      pos = next + 2;
    }
    size_t length = 0;
    if (!head && !absl::SimpleAtoi(r.Header("content-length"), &length)) return std::nullopt;
    while (buf_.size() < length) {
      if (!Fill(deadline)) return std::nullopt;
    }
    r.body = buf_.substr(0, length);
    buf_.erase(0, length);
    return r;
  }

  // True if the peer closes (EOF or reset) by `deadline`; bytes that arrive
  // before that are dropped.
  bool WaitClosed(Clock::time_point deadline) {
    for (;;) {
      int wait = Remaining(deadline);
      pollfd p{fd_, POLLIN, 0};
      if (wait <= 0 || ::poll(&p, 1, wait) <= 0) return false;
      char c[4096];
      ssize_t n = ::recv(fd_, c, sizeof(c), 0);
      if (n <= 0) return true;
    }
  }

 private:
  static int Remaining(Clock::time_point deadline) {
    auto left = std::chrono::duration_cast<milliseconds>(deadline - Clock::now()).count();
    return static_cast<int>(std::max<int64_t>(left, 0));
  }
  bool Fill(Clock::time_point deadline) {
    int wait = Remaining(deadline);
    pollfd p{fd_, POLLIN, 0};
    if (wait <= 0 || ::poll(&p, 1, wait) <= 0) return false;
    char c[4096];
    ssize_t n = ::recv(fd_, c, sizeof(c), 0);
    if (n <= 0) return false;
    buf_.append(c, static_cast<size_t>(n));
    return true;
  }

  int fd_ = -1;
  std::string buf_;
};

// A whole request on a fresh connection; nullopt if no complete answer by
// `deadline`.
std::optional<HttpResponse> Request(int port, const std::string& request, Clock::time_point deadline,
                                    bool head = false) {
  Conn c(port);
  if (!c.ok() || !c.Send(request)) return std::nullopt;
  return c.ReadResponse(deadline, head);
}

std::optional<HttpResponse> Scrape(int port, Clock::time_point deadline) {
  return Request(port, "GET /metrics HTTP/1.1\r\nHost: kvtier\r\nConnection: close\r\n\r\n", deadline);
}

std::unique_ptr<MetricsHttpServer> StartFixture(const MetricsHttpOptions& options = {},
                                                std::function<std::string()> render = RenderFixture) {
  auto s = MetricsHttpServer::Start("127.0.0.1:0", std::move(render), options);
  EXPECT_TRUE(s.ok()) << s.status();
  return s.ok() ? std::move(*s) : nullptr;
}

// A client that sends the start of a request, then one more header byte
// every `interval`, until the server closes the connection, `total` has
// passed or the Trickler is destroyed (which stops it at once).
class Trickler {
 public:
  Trickler(int port, milliseconds interval, milliseconds total)
      : conn_(port), stop_fd_(::eventfd(0, EFD_CLOEXEC)) {
    EXPECT_TRUE(conn_.ok());
    started_ = Clock::now();
    thread_ = std::thread([this, interval, total] { Run(interval, total); });
  }
  ~Trickler() {
    uint64_t one = 1;
    EXPECT_EQ(::write(stop_fd_, &one, sizeof(one)), static_cast<ssize_t>(sizeof(one)));
    thread_.join();
    ::close(stop_fd_);
  }

  // Waits until more than `n` bytes have followed the start of the request,
  // or the client has finished; returns the count.
  int WaitSentMoreThan(int n, Clock::time_point deadline) {
    std::unique_lock<std::mutex> l(mu_);
    cv_.wait_until(l, deadline, [&] { return sent_ > n || done_; });
    return sent_;
  }
  // Waits until the client has finished; true if it finished because the
  // server closed the connection (EOF or reset). `answer` gets what the
  // server sent before closing.
  bool WaitClosedByServer(Clock::time_point deadline, std::string* answer = nullptr) {
    std::unique_lock<std::mutex> l(mu_);
    cv_.wait_until(l, deadline, [&] { return done_; });
    if (answer != nullptr) *answer = answer_;
    return done_ && closed_by_server_;
  }
  // When the client started; when it saw the server close.
  Clock::time_point started() const { return started_; }
  Clock::time_point closed_at() {
    std::lock_guard<std::mutex> l(mu_);
    return closed_at_;
  }
  bool done() {
    std::lock_guard<std::mutex> l(mu_);
    return done_;
  }

 private:
  void Run(milliseconds interval, milliseconds total) {
    const Clock::time_point end = started_ + total;
    Clock::time_point next = started_ + interval;
    bool closed = !conn_.Send("GET /metrics HTTP/1.1\r\nX-Slow: ");
    while (!closed) {
      Clock::time_point until = std::min(next, end);
      int wait = static_cast<int>(
          std::max<int64_t>(std::chrono::ceil<milliseconds>(until - Clock::now()).count(), 0));
      pollfd fds[2] = {{conn_.fd(), POLLIN, 0}, {stop_fd_, POLLIN, 0}};
      if (::poll(fds, 2, wait) < 0 || fds[1].revents != 0) break;
      if (fds[0].revents != 0) {
        char c[4096];
        ssize_t n = ::recv(conn_.fd(), c, sizeof(c), 0);
        std::lock_guard<std::mutex> l(mu_);
        if (n > 0) {
          answer_.append(c, static_cast<size_t>(n));
          continue;
        }
        closed = true;
        break;
      }
      if (Clock::now() >= end) break;
      if (Clock::now() >= next) {
        closed = !conn_.Send("a");
        next += interval;
        std::lock_guard<std::mutex> l(mu_);
        if (!closed) ++sent_;
        cv_.notify_all();
      }
    }
    std::lock_guard<std::mutex> l(mu_);
    closed_by_server_ = closed;
    closed_at_ = Clock::now();
    done_ = true;
    cv_.notify_all();
  }

  Conn conn_;
  const int stop_fd_;
  Clock::time_point started_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  bool closed_by_server_ = false;
  Clock::time_point closed_at_;
  int sent_ = 0;
  std::string answer_;
  std::thread thread_;
};

TEST(MetricsHttpServer, ServesMetricsWithThePrometheusContentType) {
  auto server = StartFixture();
  ASSERT_TRUE(server);
  ASSERT_GT(server->port(), 0);
  for (const char* target : {"/metrics", "/metrics?name[]=kvtier_test_total"}) {
    auto r = Request(server->port(), absl::StrCat("GET ", target, " HTTP/1.1\r\nHost: k\r\n\r\n"),
                     Clock::now() + milliseconds(5000));
    ASSERT_TRUE(r) << target;
    EXPECT_EQ(r->status, 200) << target;
    EXPECT_EQ(r->Header("content-type"), "text/plain; version=0.0.4; charset=utf-8");
    EXPECT_EQ(r->body, RenderFixture());
  }
  // A scraper that accepts gzip gets it.
  auto gz = Request(server->port(), "GET /metrics HTTP/1.1\r\nHost: k\r\nAccept-Encoding: gzip\r\n\r\n",
                    Clock::now() + milliseconds(5000));
  ASSERT_TRUE(gz);
  EXPECT_EQ(gz->status, 200);
  EXPECT_EQ(gz->Header("content-encoding"), "gzip");
  EXPECT_THAT(gz->body, ::testing::StartsWith("\x1f\x8b"));
  EXPECT_LT(gz->body.size(), RenderFixture().size());
  // An HTTP/1.0 client gets the answer and then the end of the connection.
  Conn c(server->port());
  ASSERT_TRUE(c.Send("GET /metrics HTTP/1.0\r\n\r\n"));
  auto r = c.ReadResponse(Clock::now() + milliseconds(5000));
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200);
  EXPECT_EQ(r->body, RenderFixture());
  EXPECT_TRUE(c.WaitClosed(Clock::now() + milliseconds(5000)));
}

TEST(MetricsHttpServer, AnswersOtherPathsWith404AndOtherMethodsWith405) {
  auto server = StartFixture();
  ASSERT_TRUE(server);
  const int port = server->port();
  auto deadline = [] { return Clock::now() + milliseconds(5000); };
  auto missing = Request(port, "GET /nope HTTP/1.1\r\nHost: k\r\n\r\n", deadline());
  ASSERT_TRUE(missing);
  EXPECT_EQ(missing->status, 404);
  EXPECT_EQ(missing->body, "kvtierd serves /metrics\n");
  auto post_missing =
      Request(port, "POST /nope HTTP/1.1\r\nHost: k\r\nContent-Length: 0\r\n\r\n", deadline());
  ASSERT_TRUE(post_missing);
  EXPECT_EQ(post_missing->status, 404);
  for (const char* method : {"POST", "PUT", "DELETE", "OPTIONS", "PATCH"}) {
    auto r = Request(port, absl::StrCat(method, " /metrics HTTP/1.1\r\nHost: k\r\nContent-Length: 0\r\n\r\n"),
                     deadline());
    ASSERT_TRUE(r) << method;
    EXPECT_EQ(r->status, 405) << method;
    EXPECT_EQ(r->Header("allow"), "GET, HEAD") << method;
  }
  // A request with a body is answered without reading the body.
  auto with_body =
      Request(port, "POST /metrics HTTP/1.1\r\nHost: k\r\nContent-Length: 5\r\n\r\nhello", deadline());
  ASSERT_TRUE(with_body);
  EXPECT_EQ(with_body->status, 405);
  EXPECT_EQ(with_body->Header("connection"), "close");
  auto head = Request(port, "HEAD /metrics HTTP/1.1\r\nHost: k\r\n\r\n", deadline(), /*head=*/true);
  ASSERT_TRUE(head);
  EXPECT_EQ(head->status, 200);
  EXPECT_EQ(head->Header("content-length"), std::to_string(RenderFixture().size()));
  EXPECT_EQ(head->body, "");
}

TEST(MetricsHttpServer, RefusesAnOversizedHeaderWith431) {
  auto server = StartFixture();
  ASSERT_TRUE(server);
  // 40 header lines of 1000 bytes: each line is short, the block is 40 KB.
  std::string big = "GET /metrics HTTP/1.1\r\nHost: k\r\n";
  for (int i = 0; i < 40; ++i) absl::StrAppend(&big, "X-Pad-", i, ": ", std::string(990, 'p'), "\r\n");
  big += "\r\n";
  auto r = Request(server->port(), big, Clock::now() + milliseconds(5000));
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 431);
  EXPECT_EQ(r->Header("connection"), "close");
  // One endless header line gets the same answer.
  Conn endless(server->port());
  ASSERT_TRUE(endless.Send("GET /metrics HTTP/1.1\r\nX-Endless: " + std::string(64 << 10, 'e')));
  auto e = endless.ReadResponse(Clock::now() + milliseconds(5000));
  ASSERT_TRUE(e);
  EXPECT_EQ(e->status, 431);
  // A header block under the limit (8 KB) is served.
  std::string fits = "GET /metrics HTTP/1.1\r\nHost: k\r\n";
  for (int i = 0; i < 8; ++i) absl::StrAppend(&fits, "X-Pad-", i, ": ", std::string(990, 'p'), "\r\n");
  fits += "\r\n";
  auto ok = Request(server->port(), fits, Clock::now() + milliseconds(5000));
  ASSERT_TRUE(ok);
  EXPECT_EQ(ok->status, 200);
  EXPECT_EQ(ok->body, RenderFixture());
}

// A slowloris client (one header byte every 0.5 s, for up to 6 s) is
// connected first; scrapes on other connections, one after each of its
// bytes, are each answered in full within 1 s.
TEST(MetricsHttpServer, SlowlorisClientDoesNotDelayScrapes) {
  auto server = StartFixture();
  ASSERT_TRUE(server);
  Trickler slow(server->port(), milliseconds(500), milliseconds(6000));
  int seen = slow.WaitSentMoreThan(0, Clock::now() + milliseconds(2000));
  ASSERT_GT(seen, 0);
  int scrapes = 0;
  while (!slow.done() && scrapes < 12) {
    Clock::time_point start = Clock::now();
    auto r = Scrape(server->port(), start + milliseconds(1000));
    ASSERT_TRUE(r) << "scrape " << scrapes << " not answered within 1 s";
    EXPECT_EQ(r->status, 200);
    EXPECT_EQ(r->body, RenderFixture());
    ++scrapes;
    seen = slow.WaitSentMoreThan(seen, Clock::now() + milliseconds(2000));
  }
  EXPECT_GE(scrapes, 5);
}

// Sixteen clients at once, three scrapes each: all answered in full, each
// within 0.9 s, and `render` never runs on two threads at once.
TEST(MetricsHttpServer, ConcurrentScrapesAreAllAnswered) {
  std::atomic<int> rendering{0}, overlaps{0}, renders{0};
  auto server = StartFixture({}, [&] {
    if (rendering.fetch_add(1) != 0) ++overlaps;
    ++renders;
    std::string s = RenderFixture();
    rendering.fetch_sub(1);
    return s;
  });
  ASSERT_TRUE(server);
  constexpr int kClients = 16, kEach = 3;
  std::atomic<int> good{0};
  std::vector<std::thread> clients;
  for (int t = 0; t < kClients; ++t) {
    clients.emplace_back([&] {
      for (int i = 0; i < kEach; ++i) {
        // Under 1 s: a connection whose SYN was dropped would wait that long.
        auto r = Scrape(server->port(), Clock::now() + milliseconds(900));
        if (r && r->status == 200 && r->body == RenderFixture()) ++good;
      }
    });
  }
  for (auto& t : clients) t.join();
  EXPECT_EQ(good.load(), kClients * kEach);
  EXPECT_EQ(renders.load(), kClients * kEach);
  EXPECT_EQ(overlaps.load(), 0);
}

// Destroying the server with one trickling and one silent client connected
// returns within 1 s, and both see their connection closed.
TEST(MetricsHttpServer, DestructorReturnsPromptlyWithStalledClients) {
  auto server = StartFixture();
  ASSERT_TRUE(server);
  Trickler slow(server->port(), milliseconds(100), milliseconds(5000));
  ASSERT_GT(slow.WaitSentMoreThan(2, Clock::now() + milliseconds(2000)), 2);
  Conn silent(server->port());
  ASSERT_TRUE(silent.ok());
  ASSERT_TRUE(silent.Send("GET /metrics HTTP/1.1\r\n"));
  Clock::time_point start = Clock::now();
  server.reset();
  EXPECT_LT(Clock::now() - start, milliseconds(1000));
  EXPECT_TRUE(slow.WaitClosedByServer(Clock::now() + milliseconds(2000)));
  EXPECT_TRUE(silent.WaitClosed(Clock::now() + milliseconds(2000)));
}

// The read timeout is a total: a client that keeps trickling bytes is closed
// at it (with 408, its request line having arrived) all the same.
TEST(MetricsHttpServer, TricklingClientIsClosedAtTheReadTimeout) {
  MetricsHttpOptions o;
  o.read_timeout = milliseconds(1000);
  auto server = StartFixture(o);
  ASSERT_TRUE(server);
  Trickler slow(server->port(), milliseconds(100), milliseconds(5000));
  std::string answer;
  ASSERT_TRUE(slow.WaitClosedByServer(Clock::now() + milliseconds(5000), &answer));
  auto lived = slow.closed_at() - slow.started();
  EXPECT_GE(lived, milliseconds(900));
  EXPECT_LT(lived, milliseconds(2000));
  EXPECT_THAT(answer, ::testing::StartsWith("HTTP/1.1 408 "));
}

// `threads` trickling clients hold every worker; a scrape behind them is
// answered within the read timeout (plus 0.5 s of slack).
TEST(MetricsHttpServer, StalledClientsFillingThePoolDelayAScrapeAtMostTheReadTimeout) {
  MetricsHttpOptions o;
  o.threads = 2;
  o.read_timeout = milliseconds(1000);
  auto server = StartFixture(o);
  ASSERT_TRUE(server);
  Trickler a(server->port(), milliseconds(100), milliseconds(5000));
  Trickler b(server->port(), milliseconds(100), milliseconds(5000));
  ASSERT_GT(a.WaitSentMoreThan(1, Clock::now() + milliseconds(2000)), 1);
  ASSERT_GT(b.WaitSentMoreThan(1, Clock::now() + milliseconds(2000)), 1);
  Clock::time_point start = Clock::now();
  auto r = Scrape(server->port(), start + o.read_timeout + milliseconds(500));
  ASSERT_TRUE(r) << "no answer within the read timeout";
  EXPECT_EQ(r->status, 200);
  EXPECT_EQ(r->body, RenderFixture());
}

// One worker and room for two connections: a third is answered 503 at once;
// once the two are gone, scrapes are served again.
TEST(MetricsHttpServer, ConnectionsOverTheLimitAreAnswered503) {
  MetricsHttpOptions o;
  o.threads = 1;
  o.max_connections = 2;
  o.read_timeout = milliseconds(3000);
  auto server = StartFixture(o);
  ASSERT_TRUE(server);
  auto first = std::make_unique<Conn>(server->port());
  auto second = std::make_unique<Conn>(server->port());
  ASSERT_TRUE(first->ok() && second->ok());
  Conn third(server->port());
  ASSERT_TRUE(third.ok());
  auto busy = third.ReadResponse(Clock::now() + milliseconds(1000));
  ASSERT_TRUE(busy);
  EXPECT_EQ(busy->status, 503);
  EXPECT_EQ(busy->Header("connection"), "close");
  EXPECT_TRUE(third.WaitClosed(Clock::now() + milliseconds(1000)));
  first.reset();
  second.reset();
  // The server sees both closes at once; poll until the count has dropped.
  Clock::time_point deadline = Clock::now() + milliseconds(2000);
  std::optional<HttpResponse> r;
  int attempts = 0;
  do {
    r = Scrape(server->port(), deadline);
    ++attempts;
  } while (r && r->status == 503 && Clock::now() < deadline && attempts < 100);
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200);
}

// Two requests per connection: three pipelined requests get two answers, the
// second saying "Connection: close", then the end of the connection.
TEST(MetricsHttpServer, KeepAliveServesAtMostMaxRequestsPerConnection) {
  MetricsHttpOptions o;
  o.keep_alive_max_requests = 2;
  auto server = StartFixture(o);
  ASSERT_TRUE(server);
  Conn c(server->port());
  std::string one = "GET /metrics HTTP/1.1\r\nHost: k\r\n\r\n";
  ASSERT_TRUE(c.Send(one + one + one));
  auto r1 = c.ReadResponse(Clock::now() + milliseconds(5000));
  ASSERT_TRUE(r1);
  EXPECT_EQ(r1->status, 200);
  EXPECT_EQ(r1->Header("connection"), "");
  EXPECT_EQ(r1->Header("keep-alive"), "timeout=5, max=2");
  auto r2 = c.ReadResponse(Clock::now() + milliseconds(5000));
  ASSERT_TRUE(r2);
  EXPECT_EQ(r2->status, 200);
  EXPECT_EQ(r2->Header("connection"), "close");
  EXPECT_EQ(r2->Header("keep-alive"), "");
  EXPECT_EQ(r2->body, RenderFixture());
  EXPECT_TRUE(c.WaitClosed(Clock::now() + milliseconds(5000)));
}

TEST(MetricsHttpServer, StartRejectsBadOptionsAndAddressesAndATakenPort) {
  MetricsHttpOptions no_threads;
  no_threads.threads = 0;
  EXPECT_EQ(MetricsHttpServer::Start("127.0.0.1:0", RenderFixture, no_threads).status().code(),
            absl::StatusCode::kInvalidArgument);
  MetricsHttpOptions tiny;
  tiny.max_header_bytes = 10;
  EXPECT_EQ(MetricsHttpServer::Start("127.0.0.1:0", RenderFixture, tiny).status().code(),
            absl::StatusCode::kInvalidArgument);
  MetricsHttpOptions few;
  few.threads = 4;
  few.max_connections = 2;
  EXPECT_EQ(MetricsHttpServer::Start("127.0.0.1:0", RenderFixture, few).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MetricsHttpServer::Start("127.0.0.1:70000", RenderFixture).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MetricsHttpServer::Start("127.0.0.1", RenderFixture).status().code(),
            absl::StatusCode::kInvalidArgument);
  // A port in use is refused, not shared.
  auto server = StartFixture();
  ASSERT_TRUE(server);
  auto again = MetricsHttpServer::Start(absl::StrCat("127.0.0.1:", server->port()), RenderFixture);
  EXPECT_EQ(again.status().code(), absl::StatusCode::kFailedPrecondition);
  auto r = Scrape(server->port(), Clock::now() + milliseconds(5000));
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200);
}

}  // namespace
}  // namespace kvtier::server
