#include "server/http_metrics.h"

#include <httplib.h>
#include <netdb.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <charconv>
#include <climits>
#include <cstring>
#include <optional>
#include <string_view>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"

namespace kvtier::server {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

constexpr char kMetricsPath[] = "/metrics";
constexpr char kExpositionType[] = "text/plain; version=0.0.4; charset=utf-8";
constexpr char kTextType[] = "text/plain; charset=utf-8";
// The answer to a connection over MetricsHttpOptions::max_connections.
constexpr std::string_view kBusyResponse =
    "HTTP/1.1 503 Service Unavailable\r\n"
    "Content-Type: text/plain; charset=utf-8\r\n"
    "Content-Length: 22\r\n"
    "Connection: close\r\n\r\n"
    "kvtierd metrics: busy\n";
// A connection closed with bytes of its request unread is drained for at
// most this long (and this many bytes) first: closing with unread input
// resets the connection, and the peer could lose the answer it is reading.
constexpr milliseconds kMaxLinger{1000};
constexpr size_t kMaxLingerBytes = 64 << 10;
constexpr size_t kReadBufferBytes = 4096;
// Room for a request line and the headers a scraper sends.
constexpr size_t kMinHeaderBytes = 256;
// Connections the kernel queues before accept. httplib's is 5: a burst of
// more scrapes than that has SYNs dropped, and each such client waits 1 s
// to retry.
constexpr int kListenBacklog = 128;

enum class Wait { kReady, kTimedOut, kStopped };

// Waits until `sock` is ready for `events` (or has an error to report),
// `deadline` passes or `stop_fd` becomes readable.
Wait WaitReady(int sock, short events, int stop_fd, Clock::time_point deadline) {
  for (;;) {
    int64_t left = std::chrono::ceil<milliseconds>(deadline - Clock::now()).count();
    if (left <= 0) return Wait::kTimedOut;
    pollfd fds[2] = {{sock, events, 0}, {stop_fd, POLLIN, 0}};
    int n = ::poll(fds, 2, static_cast<int>(std::min<int64_t>(left, INT_MAX)));
    if (n < 0 && errno != EINTR) return Wait::kStopped;
    if (n <= 0) continue;
    if (fds[1].revents != 0) return Wait::kStopped;
    if (fds[0].revents != 0) return Wait::kReady;
  }
}

void SocketAddress(int sock, bool peer, std::string& ip, int& port) {
  sockaddr_storage ss{};
  socklen_t len = sizeof(ss);
  sockaddr* sa = reinterpret_cast<sockaddr*>(&ss);
  if ((peer ? ::getpeername(sock, sa, &len) : ::getsockname(sock, sa, &len)) != 0) return;
  char host[NI_MAXHOST];
  char serv[NI_MAXSERV];
  if (::getnameinfo(sa, len, host, sizeof(host), serv, sizeof(serv), NI_NUMERICHOST | NI_NUMERICSERV) != 0) {
    return;
  }
  ip = host;
  std::from_chars(serv, serv + std::strlen(serv), port);
}

// One accepted connection as httplib reads and writes it. Reads are buffered
// and end at the request's deadline and header budget; writes end at the
// response's deadline; both end when the server stops (`stop_fd` readable).
// It also carries what the route handlers decide about the connection.
// Used by one worker thread.
class ConnectionStream final : public httplib::Stream {
 public:
  ConnectionStream(int sock, int stop_fd, const MetricsHttpOptions& options)
      : sock_(sock), stop_fd_(stop_fd), options_(options) {}

  // Starts the next request: a fresh read deadline and header budget.
  void BeginRequest(bool last) {
    read_deadline_ = Clock::now() + options_.read_timeout;
    write_deadline_.reset();
    budget_ = options_.max_header_bytes;
    budget_exceeded_ = false;
    timed_out_ = false;
    routed_ = false;
    last_ = last;
  }

  bool is_readable() const override {
    return off_ < len_ || WaitReady(sock_, POLLIN, stop_fd_, read_deadline_) == Wait::kReady;
  }
  bool is_writable() const override {
    return !stopped_ &&
           WaitReady(sock_, POLLOUT, stop_fd_,
                     write_deadline_.value_or(Clock::now() + options_.write_timeout)) == Wait::kReady;
  }

  // At the header budget it answers end of input, so that httplib answers
  // what it has read (with 400, which the error handler turns into 431).
  ssize_t read(char* ptr, size_t size) override {
    if (budget_ == 0) {
      budget_exceeded_ = true;
      return 0;
    }
    while (off_ == len_) {
      if (Wait w = WaitReady(sock_, POLLIN, stop_fd_, read_deadline_); w != Wait::kReady) {
        (w == Wait::kTimedOut ? timed_out_ : stopped_) = true;
        return -1;
      }
      ssize_t n = ::recv(sock_, buf_, sizeof(buf_), MSG_DONTWAIT);
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) continue;
      if (n <= 0) return n;
      off_ = 0;
      len_ = static_cast<size_t>(n);
    }
    size_t n = std::min({size, len_ - off_, budget_});
    std::memcpy(ptr, buf_ + off_, n);
    off_ += n;
    budget_ -= n;
    return static_cast<ssize_t>(n);
  }

  // Nothing is written once the server is stopping.
  ssize_t write(const char* ptr, size_t size) override {
    if (stopped_) return -1;
    if (!write_deadline_) write_deadline_ = Clock::now() + options_.write_timeout;
    for (;;) {
      ssize_t n = ::send(sock_, ptr, size, MSG_DONTWAIT | MSG_NOSIGNAL);
      if (n >= 0) return n;
      if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) return -1;
      if (Wait w = WaitReady(sock_, POLLOUT, stop_fd_, *write_deadline_); w != Wait::kReady) {
        stopped_ = stopped_ || w == Wait::kStopped;
        return -1;
      }
    }
  }

  void get_remote_ip_and_port(std::string& ip, int& port) const override {
    SocketAddress(sock_, /*peer=*/true, ip, port);
  }
  void get_local_ip_and_port(std::string& ip, int& port) const override {
    SocketAddress(sock_, /*peer=*/false, ip, port);
  }
  socket_t socket() const override { return sock_; }

  // The request was parsed and reached the routes.
  void MarkRouted() { routed_ = true; }
  bool routed() const { return routed_; }
  bool header_budget_exceeded() const { return budget_exceeded_; }
  // The request was not complete by its read deadline.
  bool timed_out() const { return timed_out_; }
  Clock::time_point read_deadline() const { return read_deadline_; }
  bool last_request() const { return last_; }
  // Closes the connection after this response; `unread_input` when bytes of
  // the request may be left unread (then it is drained before closing).
  void CloseAfterResponse(bool unread_input) {
    closing_ = true;
    linger_ = linger_ || unread_input;
  }
  bool closing() const { return closing_; }
  bool linger() const { return linger_; }

 private:
  const int sock_;
  const int stop_fd_;
  const MetricsHttpOptions& options_;
  char buf_[kReadBufferBytes];
  size_t off_ = 0;
  size_t len_ = 0;
  Clock::time_point read_deadline_;
  std::optional<Clock::time_point> write_deadline_;
  size_t budget_ = 0;
  bool budget_exceeded_ = false;
  bool timed_out_ = false;
  bool stopped_ = false;
  bool routed_ = false;
  bool last_ = false;
  bool closing_ = false;
  bool linger_ = false;
};

// The connection the calling worker is serving: httplib gives the route
// handlers only the request and the response.
thread_local ConnectionStream* tls_connection = nullptr;
// True on httplib's accept thread while it hands over a connection beyond
// MetricsHttpOptions::max_connections, which is refused on that thread.
thread_local bool tls_refuse = false;

// httplib's thread pool behind a count of the connections it holds (queued or
// being served). A connection beyond `max_open` runs at once on the calling
// (accept) thread with tls_refuse set, so the queue, and the file descriptors
// in it, stay bounded.
class BoundedTaskQueue final : public httplib::TaskQueue {
 public:
  BoundedTaskQueue(int threads, int max_open) : max_open_(max_open), pool_(static_cast<size_t>(threads)) {}

  void enqueue(std::function<void()> fn) override {
    if (open_.fetch_add(1) >= max_open_) {
      open_.fetch_sub(1);
      tls_refuse = true;
      fn();
      tls_refuse = false;
      return;
    }
    pool_.enqueue([this, fn = std::move(fn)] {
      fn();
      open_.fetch_sub(1);
    });
  }
  // Runs what is queued (each finds the server stopping and closes at once)
  // and joins the workers.
  void shutdown() override { pool_.shutdown(); }

 private:
  const int max_open_;
  std::atomic<int> open_{0};
  httplib::ThreadPool pool_;
};

}  // namespace

// httplib's server with each connection served through a ConnectionStream
// and the routes in the pre-routing handler, which sees every parsed request
// before httplib would read a body. process_and_close_socket is httplib's
// per-connection hook (a private virtual, which its TLS server overrides
// too): the worker pool calls it with each accepted socket; the protected
// process_request parses one request from a Stream and answers it.
class MetricsHttpServer::Impl final : public httplib::Server {
 public:
  Impl(int stop_fd, const MetricsHttpOptions& options, std::function<std::string()> render)
      : stop_fd_(stop_fd), options_(options), render_(std::move(render)) {
    new_task_queue = [this] { return new BoundedTaskQueue(options_.threads, options_.max_connections); };
    // httplib's default also sets SO_REUSEPORT, which would let a second
    // process bind the same port and take half the scrapes.
    set_socket_options([](socket_t sock) {
      int one = 1;
      ::setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    });
    set_tcp_nodelay(true);
    // These four only feed httplib's Keep-Alive header and its socket
    // timeouts; ConnectionStream enforces the limits.
    set_keep_alive_max_count(static_cast<size_t>(options_.keep_alive_max_requests));
    set_keep_alive_timeout(std::chrono::duration_cast<std::chrono::seconds>(options_.read_timeout).count());
    set_read_timeout(options_.read_timeout);
    set_write_timeout(options_.write_timeout);
    set_payload_max_length(0);  // no route reads a body
    set_pre_routing_handler(
        [this](const httplib::Request& req, httplib::Response& res) { return Route(req, res); });
    set_error_handler(HandlerWithResponse(
        [](const httplib::Request& req, httplib::Response& res) { return OnError(req, res); }));
    set_post_routing_handler(
        [](const httplib::Request& req, httplib::Response& res) { OnResponse(req, res); });
  }
  ~Impl() override {
    // A socket bound by Start but never handed to the accept loop (which
    // closes its own).
    if (!listen_started_) {
      if (socket_t s = svr_sock_.exchange(INVALID_SOCKET); s != INVALID_SOCKET) ::close(s);
    }
    ::close(stop_fd_);
  }

  // Runs httplib's accept loop until stop().
  void Listen() {
    listen_started_ = true;
    listen_after_bind();
    listen_returned_.store(true);
  }
  bool listen_returned() const { return listen_returned_.load(); }

  // REQUIRES: bound, not yet listening (Listen not called).
  absl::Status WidenBacklog() {
    if (::listen(svr_sock_, kListenBacklog) != 0) {
      return absl::InternalError(absl::StrCat("metrics listen backlog: ", std::strerror(errno)));
    }
    return absl::OkStatus();
  }

  // Makes every connection end at its next wait and refuses the rest; the
  // accept loop ends with stop().
  void BeginStop() {
    stopping_.store(true);
    uint64_t one = 1;
    (void)!::write(stop_fd_, &one, sizeof(one));
  }

 private:
  bool process_and_close_socket(socket_t sock) override {
    if (tls_refuse) {
      (void)!::send(sock, kBusyResponse.data(), kBusyResponse.size(), MSG_DONTWAIT | MSG_NOSIGNAL);
      ::shutdown(sock, SHUT_RDWR);
      ::close(sock);
      return false;
    }
    ConnectionStream conn(sock, stop_fd_, options_);
    tls_connection = &conn;
    bool ok = false;
    for (int served = 0; served < options_.keep_alive_max_requests && !stopping_.load(); ++served) {
      const bool last = served + 1 == options_.keep_alive_max_requests;
      conn.BeginRequest(last);
      bool closed = false;
      ok = process_request(conn, last, closed, nullptr);
      if (!ok || closed || conn.closing()) break;
    }
    tls_connection = nullptr;
    if (ok && conn.linger()) Linger(sock, conn.read_deadline());
    ::shutdown(sock, SHUT_RDWR);
    ::close(sock);
    return ok;
  }

  HandlerResponse Route(const httplib::Request& req, httplib::Response& res) {
    if (ConnectionStream* conn = tls_connection) {
      conn->MarkRouted();
      if (req.has_header("Transfer-Encoding") ||
          (req.has_header("Content-Length") && req.get_header_value("Content-Length") != "0")) {
        conn->CloseAfterResponse(/*unread_input=*/true);
      }
    }
    if (req.path != kMetricsPath) {
      res.status = 404;
      res.set_content("kvtierd serves /metrics\n", kTextType);
    } else if (req.method == "GET" || req.method == "HEAD") {
      std::string body;
      {
        absl::MutexLock l(&render_mu_);
        body = render_();
      }
      res.status = 200;
      res.set_content(body, kExpositionType);
    } else {
      res.status = 405;
      res.set_header("Allow", "GET, HEAD");
      res.set_content("kvtierd serves GET /metrics\n", kTextType);
    }
    return HandlerResponse::Handled;
  }

  // Every answer of 400 or more passes here, the routes' 404 and 405 too.
  static HandlerResponse OnError(const httplib::Request& req, httplib::Response& res) {
    ConnectionStream* conn = tls_connection;
    if (conn != nullptr && !conn->routed()) {
      // httplib gave up reading the request. A client that ran out of time
      // gets no more of it; the rest of a refused request is drained.
      conn->CloseAfterResponse(/*unread_input=*/!conn->timed_out());
      if (res.status == 400 && conn->timed_out()) {
        res.status = 408;
      } else if (res.status == 400 && conn->header_budget_exceeded()) {
        res.status = 431;
      }
    }
    if (res.body.empty()) {
      res.set_content(res.status == 408   ? "request timeout\n"
                      : res.status == 431 ? "request header fields too large\n"
                                          : "bad request\n",
                      kTextType);
    }
    return HandlerResponse::Handled;
  }

  // Called just before the status line is written: the connection headers
  // say what the connection loop will do.
  static void OnResponse(const httplib::Request& req, httplib::Response& res) {
    ConnectionStream* conn = tls_connection;
    if (conn == nullptr) return;
    const std::string connection = req.get_header_value("Connection");
    const bool client_closes =
        absl::EqualsIgnoreCase(connection, "close") ||
        (req.version != "HTTP/1.1" && !absl::EqualsIgnoreCase(connection, "keep-alive"));
    if (client_closes || conn->last_request()) conn->CloseAfterResponse(/*unread_input=*/false);
    if (conn->closing()) {
      res.headers.erase("Keep-Alive");
      res.headers.erase("Connection");
      res.set_header("Connection", "close");
    }
  }

  // Half-closes, then reads and drops what the peer still sends until it
  // closes too, for at most kMaxLinger and kMaxLingerBytes, and never past
  // the request's read deadline.
  void Linger(int sock, Clock::time_point read_deadline) {
    ::shutdown(sock, SHUT_WR);
    Clock::time_point deadline = std::min(Clock::now() + kMaxLinger, read_deadline);
    char buf[kReadBufferBytes];
    size_t drained = 0;
    while (drained < kMaxLingerBytes && WaitReady(sock, POLLIN, stop_fd_, deadline) == Wait::kReady) {
      ssize_t n = ::recv(sock, buf, sizeof(buf), MSG_DONTWAIT);
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) continue;
      if (n <= 0) break;
      drained += static_cast<size_t>(n);
    }
  }

  const int stop_fd_;  // an eventfd, readable once stopping
  const MetricsHttpOptions options_;
  std::atomic<bool> stopping_{false};
  bool listen_started_ = false;  // by the accept thread; read after it is joined
  std::atomic<bool> listen_returned_{false};
  absl::Mutex render_mu_;
  std::function<std::string()> render_ ABSL_GUARDED_BY(render_mu_);
};

absl::StatusOr<std::pair<std::string, int>> SplitHostPort(const std::string& hp) {
  size_t colon = hp.rfind(':');
  if (colon == std::string::npos || colon + 1 == hp.size()) {
    return absl::InvalidArgumentError(absl::StrCat("expected HOST:PORT, got '", hp, "'"));
  }
  std::string host = hp.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  int port = -1;
  const char* b = hp.data() + colon + 1;
  auto [p, ec] = std::from_chars(b, hp.data() + hp.size(), port);
  if (ec != std::errc() || p != hp.data() + hp.size() || port < 0 || port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("bad port in '", hp, "'"));
  }
  if (host.empty()) host = "0.0.0.0";
  return std::make_pair(host, port);
}

absl::StatusOr<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::Start(
    const std::string& host_port, std::function<std::string()> render, const MetricsHttpOptions& options) {
  if (options.threads < 1 || options.max_connections < options.threads ||
      options.read_timeout <= milliseconds(0) || options.write_timeout <= milliseconds(0) ||
      options.keep_alive_max_requests < 1 || options.max_header_bytes < kMinHeaderBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "metrics server options: need threads >= 1, max_connections >= threads, positive timeouts, "
        "keep_alive_max_requests >= 1 and max_header_bytes >= ",
        kMinHeaderBytes));
  }
  auto hp = SplitHostPort(host_port);
  if (!hp.ok()) return hp.status();
  // Resolve first, so that a bad host is told apart from a failed bind.
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* res = nullptr;
  if (int rc = ::getaddrinfo(hp->first.c_str(), std::to_string(hp->second).c_str(), &hints, &res); rc != 0) {
    return absl::InvalidArgumentError(absl::StrCat("metrics address ", host_port, ": ", ::gai_strerror(rc)));
  }
  ::freeaddrinfo(res);

  int stop_fd = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (stop_fd < 0) return absl::InternalError(absl::StrCat("eventfd: ", std::strerror(errno)));
  auto impl = std::make_unique<Impl>(stop_fd, options, std::move(render));
  errno = 0;
  int port = hp->second == 0 ? impl->bind_to_any_port(hp->first)
                             : (impl->bind_to_port(hp->first, hp->second) ? hp->second : -1);
  if (port <= 0) {
    int e = errno;
    return absl::FailedPreconditionError(
        absl::StrCat("metrics listen on ", host_port, ": ", e != 0 ? std::strerror(e) : "cannot bind"));
  }
  if (absl::Status s = impl->WidenBacklog(); !s.ok()) return s;
  return std::unique_ptr<MetricsHttpServer>(new MetricsHttpServer(port, std::move(impl)));
}

MetricsHttpServer::MetricsHttpServer(int port, std::unique_ptr<Impl> impl)
    : port_(port), impl_(std::move(impl)) {
  thread_ = std::thread([impl = impl_.get()] { impl->Listen(); });
  // httplib's stop() acts only once the loop runs; listen_after_bind marks it
  // running first thing, so this wait is short.
  while (!impl_->is_running() && !impl_->listen_returned()) std::this_thread::yield();
}

MetricsHttpServer::~MetricsHttpServer() {
  impl_->BeginStop();
  impl_->stop();
  thread_.join();
}

}  // namespace kvtier::server
