#include "server/tcp_acceptor.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <fstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "spdlog/spdlog.h"

namespace kvtier::server {

namespace {

constexpr int kSweepEveryMs = 1000;
// At a limit, the connections are checked at most this often: a flood of
// refused connections costs one pass over them per period, not per peer.
constexpr auto kMinSweepGap = std::chrono::milliseconds(20);

// The peer's address bytes: 4 for IPv4 (an IPv4-mapped IPv6 address
// included), 16 for IPv6.
std::string PeerKey(const sockaddr_storage& a) {
  if (a.ss_family == AF_INET) {
    const auto* in = reinterpret_cast<const sockaddr_in*>(&a);
    return std::string(reinterpret_cast<const char*>(&in->sin_addr), 4);
  }
  if (a.ss_family == AF_INET6) {
    const auto* in6 = reinterpret_cast<const sockaddr_in6*>(&a);
    if (IN6_IS_ADDR_V4MAPPED(&in6->sin6_addr)) {
      return std::string(reinterpret_cast<const char*>(&in6->sin6_addr) + 12, 4);
    }
    return std::string(reinterpret_cast<const char*>(&in6->sin6_addr), 16);
  }
  return "";
}

std::string PeerText(const sockaddr_storage& a) {
  char buf[INET6_ADDRSTRLEN] = "?";
  if (a.ss_family == AF_INET) {
    ::inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(&a)->sin_addr, buf, sizeof(buf));
  } else if (a.ss_family == AF_INET6) {
    ::inet_ntop(AF_INET6, &reinterpret_cast<const sockaddr_in6*>(&a)->sin6_addr, buf, sizeof(buf));
  }
  return buf;
}

}  // namespace

absl::StatusOr<std::unique_ptr<TcpAcceptor>> TcpAcceptor::Listen(const std::string& host_port,
                                                                 TcpAcceptorOptions options) {
  const size_t colon = host_port.rfind(':');
  int port = -1;
  if (colon == std::string::npos || !absl::SimpleAtoi(host_port.substr(colon + 1), &port) ||
      port < 0 || port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("TCP address '", host_port, "' is not HOST:PORT"));
  }
  std::string host = host_port.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* res = nullptr;
  const std::string service = std::to_string(port);
  if (int rc = ::getaddrinfo(host.empty() ? nullptr : host.c_str(), service.c_str(), &hints, &res); rc != 0) {
    return absl::InvalidArgumentError(absl::StrCat("TCP address '", host_port, "': ", ::gai_strerror(rc)));
  }
  std::string last_error = "no address";
  int fd = -1;
  for (addrinfo* ai = res; ai != nullptr && fd < 0; ai = ai->ai_next) {
    fd = ::socket(ai->ai_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) {
      last_error = std::strerror(errno);
      continue;
    }
    int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (::bind(fd, ai->ai_addr, ai->ai_addrlen) != 0 || ::listen(fd, SOMAXCONN) != 0) {
      last_error = std::strerror(errno);
      ::close(fd);
      fd = -1;
    }
  }
  ::freeaddrinfo(res);
  if (fd < 0) {
    return absl::FailedPreconditionError(absl::StrCat("cannot listen on ", host_port, ": ", last_error));
  }
  sockaddr_storage bound{};
  socklen_t len = sizeof(bound);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &len);
  const int bound_port = ntohs(bound.ss_family == AF_INET6
                                   ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                                   : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  int p[2];
  if (::pipe2(p, O_CLOEXEC) != 0) {
    const int e = errno;
    ::close(fd);
    return absl::InternalError(absl::StrCat("pipe: ", std::strerror(e)));
  }
  return std::unique_ptr<TcpAcceptor>(new TcpAcceptor(fd, bound_port, p, options));
}

TcpAcceptor::TcpAcceptor(int listen_fd, int port, int stop_pipe[2], TcpAcceptorOptions options)
    : listen_fd_(listen_fd), port_(port), stop_pipe_{stop_pipe[0], stop_pipe[1]}, options_(options) {}

TcpAcceptor::~TcpAcceptor() {
  Stop();
  ::close(listen_fd_);
  ::close(stop_pipe_[0]);
  ::close(stop_pipe_[1]);
}

void TcpAcceptor::Start(Handoff handoff) {
  thread_ = std::thread([this, h = std::move(handoff)] {
    pthread_setname_np(pthread_self(), "kvtierd-accept");
    Loop(h);
  });
}

void TcpAcceptor::Stop() {
  if (!thread_.joinable()) return;
  char c = 0;
  (void)!::write(stop_pipe_[1], &c, 1);
  thread_.join();
}

int TcpAcceptor::connections() {
  absl::MutexLock l(&mu_);
  Sweep();
  return static_cast<int>(conns_.size());
}

void TcpAcceptor::Sweep() {
  for (size_t i = 0; i < conns_.size();) {
    struct stat st;
    const Conn& c = conns_[i];
    if (::fstat(c.fd, &st) == 0 && st.st_dev == c.dev && st.st_ino == c.ino) {
      ++i;
      continue;
    }
    if (auto it = per_peer_.find(c.peer); it != per_peer_.end() && --it->second <= 0) per_peer_.erase(it);
    conns_[i] = std::move(conns_.back());
    conns_.pop_back();
  }
}

bool TcpAcceptor::Pause(int ms) {
  pollfd p{stop_pipe_[0], POLLIN, 0};
  int rc;
  do {
    rc = ::poll(&p, 1, ms);
  } while (rc < 0 && errno == EINTR);
  return rc == 0;
}

void TcpAcceptor::Loop(Handoff handoff) {
  using Clock = std::chrono::steady_clock;
  int backoff_ms = 0;
  Clock::time_point last_sweep = Clock::now();
  Clock::time_point last_warning{};
  for (;;) {
    pollfd fds[2] = {{listen_fd_, POLLIN, 0}, {stop_pipe_[0], POLLIN, 0}};
    const int rc = ::poll(fds, 2, kSweepEveryMs);
    if (rc < 0 && errno != EINTR) {
      if (!Pause(options_.max_backoff_ms)) return;
      continue;
    }
    if (fds[1].revents != 0) return;
    if (Clock::now() - last_sweep >= std::chrono::milliseconds(kSweepEveryMs)) {
      absl::MutexLock l(&mu_);
      Sweep();
      last_sweep = Clock::now();
    }
    if ((fds[0].revents & POLLIN) == 0) continue;
    sockaddr_storage addr{};
    socklen_t len = sizeof(addr);
    const int fd = ::accept4(listen_fd_, reinterpret_cast<sockaddr*>(&addr), &len,
                             SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) {
      const int e = errno;
      if (e == EAGAIN || e == EWOULDBLOCK || e == EINTR || e == ECONNABORTED) continue;
      // EMFILE and the like: the connection stays in the backlog and the
      // listener readable, so accepting again at once would spin.
      accept_failures_.fetch_add(1);
      backoff_ms = std::clamp(backoff_ms * 2, options_.min_backoff_ms, options_.max_backoff_ms);
      if (Clock::now() - last_warning >= std::chrono::seconds(10)) {
        last_warning = Clock::now();
        spdlog::warn("TCP listener port {}: accept failed ({}); accepting again in {} ms", port_,
                     std::strerror(e), backoff_ms);
      }
      if (!Pause(backoff_ms)) return;
      continue;
    }
    backoff_ms = 0;
    const std::string peer = PeerKey(addr);
    bool admit = false;
    {
      absl::MutexLock l(&mu_);
      auto over = [&] {
        if (conns_.size() >= static_cast<size_t>(options_.max_connections)) return true;
        auto it = per_peer_.find(peer);
        return it != per_peer_.end() && it->second >= options_.max_connections_per_peer;
      };
      if (over() && Clock::now() - last_sweep >= kMinSweepGap) {
        Sweep();
        last_sweep = Clock::now();
      }
      struct stat st;
      if (!over() && ::fstat(fd, &st) == 0) {
        conns_.push_back(Conn{fd, st.st_dev, st.st_ino, peer});
        ++per_peer_[peer];
        admit = true;
      }
    }
    if (!admit) {
      refused_.fetch_add(1);
      if (Clock::now() - last_warning >= std::chrono::seconds(10)) {
        last_warning = Clock::now();
        spdlog::warn("TCP listener port {}: connection from {} refused: at the limit of {} connections, "
                     "{} per peer",
                     port_, PeerText(addr), options_.max_connections, options_.max_connections_per_peer);
      }
      ::close(fd);
      continue;
    }
    int one = 1;
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    handoff(fd);
  }
}

absl::StatusOr<uint64_t> RaiseFdLimitToHard() {
  rlimit r{};
  if (::getrlimit(RLIMIT_NOFILE, &r) != 0) {
    return absl::InternalError(absl::StrCat("getrlimit(RLIMIT_NOFILE): ", std::strerror(errno)));
  }
  rlim_t want = r.rlim_max;
  if (want == RLIM_INFINITY) {
    uint64_t nr_open = 1 << 20;
    std::ifstream("/proc/sys/fs/nr_open") >> nr_open;
    want = nr_open;
  }
  if (want > r.rlim_cur) {
    rlimit raised{want, r.rlim_max};
    if (::setrlimit(RLIMIT_NOFILE, &raised) == 0) r.rlim_cur = want;
  }
  return static_cast<uint64_t>(r.rlim_cur);
}

uint64_t FdLimit() {
  rlimit r{};
  if (::getrlimit(RLIMIT_NOFILE, &r) != 0) return 0;
  return r.rlim_cur == RLIM_INFINITY ? uint64_t{1} << 20 : static_cast<uint64_t>(r.rlim_cur);
}

int OpenFdCount() {
  DIR* d = ::opendir("/proc/self/fd");
  if (d == nullptr) return 0;
  int n = 0;
  while (dirent* e = ::readdir(d)) {
    if (e->d_name[0] != '.') ++n;
  }
  ::closedir(d);
  return n - 1;  // the directory's own descriptor
}

}  // namespace kvtier::server
