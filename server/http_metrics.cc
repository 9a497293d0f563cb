#include "server/http_metrics.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace kvtier::server {

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
    const std::string& host_port, std::function<std::string()> render) {
  auto hp = SplitHostPort(host_port);
  if (!hp.ok()) return hp.status();
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* res = nullptr;
  std::string port_str = std::to_string(hp->second);
  if (int rc = ::getaddrinfo(hp->first.c_str(), port_str.c_str(), &hints, &res); rc != 0) {
    return absl::InvalidArgumentError(absl::StrCat("metrics address ", host_port, ": ",
                                                   ::gai_strerror(rc)));
  }
  int fd = ::socket(res->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (fd < 0 || ::bind(fd, res->ai_addr, res->ai_addrlen) != 0 || ::listen(fd, 16) != 0) {
    int e = errno;
    ::freeaddrinfo(res);
    if (fd >= 0) ::close(fd);
    return absl::FailedPreconditionError(absl::StrCat("metrics listen on ", host_port, ": ",
                                                      std::strerror(e)));
  }
  ::freeaddrinfo(res);
  sockaddr_storage ss{};
  socklen_t sl = sizeof(ss);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &sl);
  int port = ss.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port)
                                      : ntohs(reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
  int p[2];
  if (::pipe2(p, O_CLOEXEC) != 0) {
    ::close(fd);
    return absl::InternalError("pipe");
  }
  return std::unique_ptr<MetricsHttpServer>(new MetricsHttpServer(fd, port, p, std::move(render)));
}

MetricsHttpServer::MetricsHttpServer(int fd, int port, int stop[2],
                                     std::function<std::string()> render)
    : fd_(fd), port_(port), stop_pipe_{stop[0], stop[1]}, render_(std::move(render)) {
  thread_ = std::thread([this] { Loop(); });
}

MetricsHttpServer::~MetricsHttpServer() {
  char c = 0;
  (void)!::write(stop_pipe_[1], &c, 1);
  thread_.join();
  ::close(fd_);
  ::close(stop_pipe_[0]);
  ::close(stop_pipe_[1]);
}

void MetricsHttpServer::Loop() {
  for (;;) {
    pollfd fds[2] = {{fd_, POLLIN, 0}, {stop_pipe_[0], POLLIN, 0}};
    if (::poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      return;
    }
    if (fds[1].revents != 0) return;
    if ((fds[0].revents & POLLIN) == 0) continue;
    int c = ::accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (c < 0) continue;
    Serve(c);
    ::close(c);
  }
}

void MetricsHttpServer::Serve(int c) {
  timeval tv{1, 0};
  ::setsockopt(c, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  ::setsockopt(c, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  std::string req;
  char buf[1024];
  while (req.size() < 8192 && req.find("\r\n\r\n") == std::string::npos &&
         req.find("\n\n") == std::string::npos) {
    ssize_t n = ::recv(c, buf, sizeof(buf), 0);
    if (n <= 0) break;
    req.append(buf, static_cast<size_t>(n));
  }
  std::string status, body, type = "text/plain; charset=utf-8";
  if (req.rfind("GET /metrics ", 0) == 0 || req.rfind("GET /metrics?", 0) == 0) {
    status = "200 OK";
    body = render_();
    type = "text/plain; version=0.0.4; charset=utf-8";
  } else if (req.rfind("GET ", 0) == 0) {
    status = "404 Not Found";
    body = "kvtierd serves /metrics\n";
  } else {
    status = "400 Bad Request";
    body = "bad request\n";
  }
  std::string resp = absl::StrCat("HTTP/1.0 ", status, "\r\nContent-Type: ", type,
                                  "\r\nContent-Length: ", body.size(),
                                  "\r\nConnection: close\r\n\r\n", body);
  size_t off = 0;
  while (off < resp.size()) {
    ssize_t n = ::send(c, resp.data() + off, resp.size() - off, MSG_NOSIGNAL);
    if (n <= 0) break;
    off += static_cast<size_t>(n);
  }
}

}  // namespace kvtier::server
