#include "server/shm_channel.h"

#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/file.h"
#include "common/status.h"
#include "server/data_plane_connection.h"
#include "server/metrics.h"
#include "server/tenants.h"
#include "spdlog/spdlog.h"

namespace kvtier::server {

namespace {
// How long the accept loop waits after accept failed for want of descriptors
// or memory.
constexpr int kAcceptBackoffMs = 100;
}  // namespace

absl::StatusOr<int> ListenUnixOwnerOnly(const std::string& path) {
  KVTIER_ASSIGN_OR_RETURN(sockaddr_un addr, UnixSocketAddress(path));
  int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::InternalError(absl::StrCat("socket: ", std::strerror(errno)));
  struct stat st;
  if (::lstat(path.c_str(), &st) == 0 && S_ISSOCK(st.st_mode)) ::unlink(path.c_str());
  mode_t old = ::umask(0077);
  int rc = ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  ::umask(old);
  if (rc != 0 || ::chmod(path.c_str(), 0600) != 0 || ::listen(fd, 64) != 0) {
    int e = errno;
    ::close(fd);
    return absl::FailedPreconditionError(absl::StrCat("listen on ", path, ": ", std::strerror(e)));
  }
  return fd;
}


struct ShmChannel::Conn {
  int fd = -1;
  const Tenant* tenant = nullptr;
  std::thread thread;
  std::atomic<bool> done{false};
};

absl::StatusOr<std::unique_ptr<ShmChannel>> ShmChannel::Start(const std::string& path, int fd,
                                                              uint64_t size,
                                                              ServerMetrics* metrics,
                                                              KvService* service,
                                                              ShmChannelOptions options) {
  auto lfd = ListenUnixOwnerOnly(path);
  if (!lfd.ok()) return lfd.status();
  int p[2];
  if (::pipe2(p, O_CLOEXEC) != 0) {
    ::close(*lfd);
    return absl::InternalError(absl::StrCat("pipe: ", std::strerror(errno)));
  }
  return std::unique_ptr<ShmChannel>(
      new ShmChannel(path, *lfd, p, fd, size, metrics, service, options));
}

int ResolvePutCheckThreads(int option) {
  if (option > 0) return option;
  return std::thread::hardware_concurrency() >= 4 ? 2 : 1;
}

ShmChannel::ShmChannel(std::string path, int listen_fd, int stop_fd[2], int fd, uint64_t size,
                       ServerMetrics* metrics, KvService* service, ShmChannelOptions options)
    : path_(std::move(path)), listen_fd_(listen_fd), stop_pipe_{stop_fd[0], stop_fd[1]}, fd_(fd),
      size_(size),
      metrics_(metrics),
      service_(service),
      options_(options),
      put_check_threads_(ResolvePutCheckThreads(options.put_check_threads)),
      default_tenants_(options.tenants == nullptr ? std::make_unique<TenantRegistry>() : nullptr),
      tenants_(options.tenants != nullptr ? options.tenants : default_tenants_.get()) {
  thread_ = std::thread([this] { Loop(); });
}

ShmChannel::~ShmChannel() {
  char c = 0;
  (void)!::write(stop_pipe_[1], &c, 1);
  thread_.join();
  std::list<std::unique_ptr<Conn>> conns;
  {
    absl::MutexLock l(&mu_);
    stopping_ = true;
    // Wakes each connection's thread (its recv returns 0); it frees what
    // the connection held and ends.
    for (auto& conn : conns_) ::shutdown(conn->fd, SHUT_RDWR);
    conns.swap(conns_);
  }
  for (auto& conn : conns) {
    conn->thread.join();
    ::close(conn->fd);
  }
  ::close(listen_fd_);
  ::close(stop_pipe_[0]);
  ::close(stop_pipe_[1]);
  ::unlink(path_.c_str());
}

int ShmChannel::connections() {
  absl::MutexLock l(&mu_);
  ReapFinished();
  return static_cast<int>(conns_.size());
}

void ShmChannel::ReapFinished() {
  for (auto it = conns_.begin(); it != conns_.end();) {
    if ((*it)->done.load()) {
      (*it)->thread.join();
      ::close((*it)->fd);
      it = conns_.erase(it);
    } else {
      ++it;
    }
  }
}

void ShmChannel::Loop() {
  for (;;) {
    pollfd fds[2] = {{listen_fd_, POLLIN, 0}, {stop_pipe_[0], POLLIN, 0}};
    if (::poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      return;
    }
    if (fds[1].revents != 0) return;
    if ((fds[0].revents & POLLIN) == 0) continue;
    int c = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (c < 0) {
      if (errno == EAGAIN || errno == EINTR || errno == ECONNABORTED) continue;
      // Out of descriptors or memory (EMFILE, ENFILE, ENOBUFS, ENOMEM): the
      // connection stays in the backlog and the socket readable, so accepting
      // again at once would spin. Waits (or stops) instead.
      pollfd stop{stop_pipe_[0], POLLIN, 0};
      if (::poll(&stop, 1, kAcceptBackoffMs) > 0) return;
      continue;
    }
    ucred cred{};
    socklen_t len = sizeof(cred);
    if (::getsockopt(c, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0 || cred.uid != ::geteuid()) {
      ::close(c);
      continue;
    }
    // With tenants, a uid of no tenant names one in its first request.
    const Tenant* tenant = tenants_->configured() ? tenants_->ByUid(cred.uid) : tenants_->only();
    if (!Adopt(c, tenant)) {
      // At the limit (or stopping): the pool, but no data plane; the client
      // sees the end of the stream where it sent kHello.
      (void)SendPool(c);
      ::close(c);
    }
  }
}

bool ShmChannel::SendPool(int c) {
  wire::shm::PoolMessage m;
  m.size = size_;
  cmsghdr* cm = CMSG_FIRSTHDR(&m.msg);
  cm->cmsg_level = SOL_SOCKET;
  cm->cmsg_type = SCM_RIGHTS;
  cm->cmsg_len = CMSG_LEN(sizeof(int));
  std::memcpy(CMSG_DATA(cm), &fd_, sizeof(int));
  ssize_t n;
  do {
    n = ::sendmsg(c, &m.msg, MSG_NOSIGNAL);
  } while (n < 0 && errno == EINTR);
  if (n != static_cast<ssize_t>(sizeof(m.size))) {
    spdlog::warn("{}: passing the pool descriptor failed ({} bytes sent): {}", path_, n,
                 n < 0 ? std::strerror(errno) : "short write");
    return false;
  }
  metrics_->Add(ServerMetric::kShmMaps);
  return true;
}

bool ShmChannel::Adopt(int c, const Tenant* tenant) {
  absl::MutexLock l(&mu_);
  ReapFinished();
  if (service_ == nullptr || stopping_ ||
      conns_.size() >= static_cast<size_t>(std::max(0, options_.max_connections))) {
    return false;
  }
  // A client that stops reading its answers gets its connection closed
  // (the thread's send fails) instead of holding the thread.
  timeval tv{options_.frame_timeout_ms / 1000, (options_.frame_timeout_ms % 1000) * 1000};
  ::setsockopt(c, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  auto conn = std::make_unique<Conn>();
  conn->fd = c;
  conn->tenant = tenant;
  Conn* p = conn.get();
  conns_.push_back(std::move(conn));
  // The connection is counted before its client has the pool, so a client
  // that has it and closes is never counted afterwards.
  p->thread = std::thread([this, p] {
    pthread_setname_np(pthread_self(), "kvtierd-shm");
    if (SendPool(p->fd)) {
      Serve(p);
    } else {
      ::shutdown(p->fd, SHUT_RDWR);
      p->done.store(true);
    }
  });
  return true;
}

void ShmChannel::Serve(Conn* conn) {
  {
    DataPlaneConnection dp(conn->fd, service_, tenants_, conn->tenant, metrics_, options_,
                           put_check_threads_);
    dp.Run();
  }  // frees what the connection held
  ::shutdown(conn->fd, SHUT_RDWR);  // the peer sees the end now; the fd is closed when reaped
  conn->done.store(true);
}

}  // namespace kvtier::server
