#include "client/shm_pool.h"

#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/file.h"
#include "common/status.h"
#include "wire/shm_frames.h"

namespace kvtier::client {

absl::StatusOr<ShmHandshake> ConnectShm(const std::string& path) {
  KVTIER_ASSIGN_OR_RETURN(sockaddr_un addr, UnixSocketAddress(path));
  int s = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (s < 0) return absl::InternalError("socket");
  timeval tv{5, 0};
  ::setsockopt(s, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  ::setsockopt(s, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  if (::connect(s, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    int e = errno;
    ::close(s);
    return absl::FailedPreconditionError(absl::StrCat("connect ", path, ": ", std::strerror(e)));
  }
  wire::shm::PoolMessage m;
  ssize_t n;
  do {
    n = ::recvmsg(s, &m.msg, MSG_CMSG_CLOEXEC);
  } while (n < 0 && errno == EINTR);
  const int e = errno;
  cmsghdr* cm = CMSG_FIRSTHDR(&m.msg);
  if (n != static_cast<ssize_t>(sizeof(m.size)) || cm == nullptr || cm->cmsg_type != SCM_RIGHTS ||
      cm->cmsg_len != CMSG_LEN(sizeof(int))) {
    ::close(s);
    return absl::FailedPreconditionError(
        absl::StrCat("no pool descriptor from ", path, " (received ", n, " bytes",
                     n < 0 ? absl::StrCat(": ", std::strerror(e)) : std::string(),
                     cm == nullptr ? ", no descriptor" : "", ")"));
  }
  ShmHandshake h;
  h.sock = s;
  h.size = m.size;
  std::memcpy(&h.memfd, CMSG_DATA(cm), sizeof(int));
  return h;
}

absl::StatusOr<std::shared_ptr<const PoolMapping>> PoolMapping::Map(const ShmHandshake& h,
                                                                    bool populate) {
  const uint64_t id = wire::shm::PoolIdOf(h.memfd);
  void* p = ::mmap(nullptr, h.size, PROT_READ | PROT_WRITE,
                   MAP_SHARED | (populate ? MAP_POPULATE : 0), h.memfd, 0);
  ::close(h.memfd);
  if (p == MAP_FAILED) {
    return absl::FailedPreconditionError(absl::StrCat("mmap of the pool: ", std::strerror(errno)));
  }
  return std::shared_ptr<const PoolMapping>(new PoolMapping(static_cast<uint8_t*>(p), h.size, id));
}

PoolMapping::~PoolMapping() { ::munmap(base_, size_); }

absl::StatusOr<std::span<uint8_t>> PoolMapping::Range(uint64_t offset, uint64_t length) const {
  if (offset > size_ || length > size_ - offset) {
    return absl::InternalError("daemon named an extent outside the pool");
  }
  return std::span<uint8_t>(base_ + offset, length);
}

absl::StatusOr<std::shared_ptr<const PoolMapping>> SharedPool::Adopt(const ShmHandshake& h) {
  const uint64_t id = wire::shm::PoolIdOf(h.memfd);
  {
    absl::MutexLock l(&mu_);
    if (id != 0 && current_ != nullptr && current_->id() == id) {
      ::close(h.memfd);
      return current_;
    }
  }
  KVTIER_ASSIGN_OR_RETURN(std::shared_ptr<const PoolMapping> fresh,
                          PoolMapping::Map(h, populate_));
  absl::MutexLock l(&mu_);
  if (current_ != nullptr && current_->id() == fresh->id()) return current_;  // another call was first
  if (current_ != nullptr) replaced_.push_back(std::move(current_));
  current_ = fresh;
  return fresh;
}

absl::StatusOr<std::span<uint8_t>> SharedPool::ExtentRange(uint64_t pool_id, uint64_t offset,
                                                           uint64_t length) {
  if (pool_id == 0) {
    return absl::FailedPreconditionError(
        "kvtierd named no pool for a shared-memory extent (it predates pool ids); upgrade it");
  }
  std::shared_ptr<const PoolMapping> pool;
  {
    absl::MutexLock l(&mu_);
    pool = current_;
  }
  if (pool == nullptr || pool->id() != pool_id) {
    auto h = ConnectShm(socket_);
    if (h.ok()) {
      ::close(h->sock);
      KVTIER_ASSIGN_OR_RETURN(pool, Adopt(*h));
    }
  }
  if (pool == nullptr || pool->id() != pool_id) {
    return absl::UnavailableError(
        "kvtierd answered with an extent of a pool this client cannot map (the daemon "
        "restarted, or another one serves its side channel)");
  }
  return pool->Range(offset, length);
}

std::span<uint8_t> SharedPool::all() const {
  absl::MutexLock l(&mu_);
  return current_ ? current_->all() : std::span<uint8_t>();
}

}  // namespace kvtier::client
