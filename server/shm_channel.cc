#include "server/shm_channel.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace kvtier::server {

absl::StatusOr<int> ListenUnixOwnerOnly(const std::string& path) {
  sockaddr_un addr{};
  if (path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat("socket path too long: ", path));
  }
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
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

absl::StatusOr<std::unique_ptr<ShmChannel>> ShmChannel::Start(const std::string& path, int fd,
                                                              uint64_t size,
                                                              ServerMetrics* metrics) {
  auto lfd = ListenUnixOwnerOnly(path);
  if (!lfd.ok()) return lfd.status();
  int p[2];
  if (::pipe2(p, O_CLOEXEC) != 0) {
    ::close(*lfd);
    return absl::InternalError(absl::StrCat("pipe: ", std::strerror(errno)));
  }
  return std::unique_ptr<ShmChannel>(new ShmChannel(path, *lfd, p, fd, size, metrics));
}

ShmChannel::ShmChannel(std::string path, int listen_fd, int stop_fd[2], int fd, uint64_t size,
                       ServerMetrics* metrics)
    : path_(std::move(path)), listen_fd_(listen_fd), stop_pipe_{stop_fd[0], stop_fd[1]}, fd_(fd),
      size_(size), metrics_(metrics) {
  thread_ = std::thread([this] { Loop(); });
}

ShmChannel::~ShmChannel() {
  char c = 0;
  (void)!::write(stop_pipe_[1], &c, 1);
  thread_.join();
  ::close(listen_fd_);
  ::close(stop_pipe_[0]);
  ::close(stop_pipe_[1]);
  ::unlink(path_.c_str());
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
    if (c < 0) continue;
    ucred cred{};
    socklen_t len = sizeof(cred);
    if (::getsockopt(c, SOL_SOCKET, SO_PEERCRED, &cred, &len) == 0 && cred.uid == ::geteuid()) {
      uint64_t size = size_;  // little-endian hosts only (x86-64, aarch64)
      iovec iov{&size, sizeof(size)};
      alignas(cmsghdr) char ctrl[CMSG_SPACE(sizeof(int))] = {};
      msghdr msg{};
      msg.msg_iov = &iov;
      msg.msg_iovlen = 1;
      msg.msg_control = ctrl;
      msg.msg_controllen = sizeof(ctrl);
      cmsghdr* cm = CMSG_FIRSTHDR(&msg);
      cm->cmsg_level = SOL_SOCKET;
      cm->cmsg_type = SCM_RIGHTS;
      cm->cmsg_len = CMSG_LEN(sizeof(int));
      std::memcpy(CMSG_DATA(cm), &fd_, sizeof(int));
      if (::sendmsg(c, &msg, MSG_NOSIGNAL) == static_cast<ssize_t>(sizeof(size))) {
        metrics_->Add(ServerMetric::kShmMaps);
      }
    }
    ::close(c);
  }
}

}  // namespace kvtier::server
