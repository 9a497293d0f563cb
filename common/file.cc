#include "common/file.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status.h"
#include "common/strings.h"

namespace kvtier {

absl::Status ErrnoToStatus(int err, std::string_view what) {
  std::string msg = absl::StrCat(AsAbsl(what), ": ", std::strerror(err));
  switch (err) {
    case ENOENT:
      return absl::NotFoundError(msg);
    case EACCES:
    case EPERM:
      return absl::PermissionDeniedError(msg);
    case ENOSPC:
    case EDQUOT:
    case ENOMEM:
      return absl::ResourceExhaustedError(msg);
    case EINVAL:
    case EISDIR:
    case ENOTDIR:
    case ENAMETOOLONG:
      return absl::InvalidArgumentError(msg);
    case EEXIST:
      return absl::AlreadyExistsError(msg);
    default:
      return absl::UnavailableError(msg);
  }
}

absl::StatusOr<sockaddr_un> UnixSocketAddress(const std::string& path) {
  sockaddr_un addr{};
  if (path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat("socket path too long: ", path));
  }
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  return addr;
}

absl::StatusOr<std::vector<uint8_t>> ReadFileBytes(const std::string& path, uint64_t max_bytes) {
  // O_NONBLOCK: opening a FIFO with no writer would block for good before
  // the regular-file check below could refuse it.
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) return ErrnoToStatus(errno, absl::StrCat("open ", path));
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    int err = errno;
    ::close(fd);
    return ErrnoToStatus(err, absl::StrCat("stat ", path));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    return absl::InvalidArgumentError(absl::StrCat(path, " is not a regular file"));
  }
  if (static_cast<uint64_t>(st.st_size) > max_bytes) {
    ::close(fd);
    return absl::InvalidArgumentError(absl::StrCat(path, " is ", st.st_size,
                                                   " bytes, more than the limit of ", max_bytes));
  }
  std::vector<uint8_t> data(static_cast<size_t>(st.st_size));
  size_t done = 0;
  while (done < data.size()) {
    ssize_t n = ::read(fd, data.data() + done, data.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      int err = errno;
      ::close(fd);
      return ErrnoToStatus(err, absl::StrCat("read ", path));
    }
    if (n == 0) break;  // The file shrank under us; return what exists.
    done += static_cast<size_t>(n);
  }
  data.resize(done);
  ::close(fd);
  return data;
}

absl::StatusOr<std::string> ReadPemFile(const std::string& path, std::string_view what) {
  auto bytes = ReadFileBytes(path, 1 << 20);
  if (!bytes.ok()) {
    return absl::Status(bytes.status().code(),
                        absl::StrCat(std::string(what), " ", path, ": ", bytes.status().message()));
  }
  return std::string(bytes->begin(), bytes->end());
}

absl::Status WriteFileAtomic(const std::string& path, std::span<const uint8_t> data) {
  std::string tmp = absl::StrCat(path, ".tmp.", ::getpid());
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return ErrnoToStatus(errno, absl::StrCat("create ", tmp));
  size_t done = 0;
  while (done < data.size()) {
    ssize_t n = ::write(fd, data.data() + done, data.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      int err = errno;
      ::close(fd);
      ::unlink(tmp.c_str());
      return ErrnoToStatus(err, absl::StrCat("write ", tmp));
    }
    done += static_cast<size_t>(n);
  }
  if (::close(fd) != 0) {
    int err = errno;
    ::unlink(tmp.c_str());
    return ErrnoToStatus(err, absl::StrCat("close ", tmp));
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    int err = errno;
    ::unlink(tmp.c_str());
    return ErrnoToStatus(err, absl::StrCat("rename to ", path));
  }
  return absl::OkStatus();
}

absl::StatusOr<ExclusiveFileLock> ExclusiveFileLock::Acquire(const std::string& path) {
  // O_NOFOLLOW: a lock file may sit in a shared directory (beside a socket),
  // where a planted symlink would have the pid written into another file.
  int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (fd < 0) {
    int err = errno;
    if (err == ELOOP) return absl::InvalidArgumentError(absl::StrCat("lock file ", path, " is a symlink"));
    return ErrnoToStatus(err, absl::StrCat("open lock file ", path));
  }
  ExclusiveFileLock lock(path, fd);
  struct stat st;
  if (::fstat(fd, &st) != 0) return ErrnoToStatus(errno, absl::StrCat("stat lock file ", path));
  if (!S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError(absl::StrCat("lock file ", path, " is not a regular file"));
  }
  int rc;
  do {
    rc = ::flock(fd, LOCK_EX | LOCK_NB);
  } while (rc != 0 && errno == EINTR);
  if (rc != 0) {
    int err = errno;
    if (err != EWOULDBLOCK) return ErrnoToStatus(err, absl::StrCat("lock ", path));
    char buf[32];
    ssize_t n = ::pread(fd, buf, sizeof(buf), 0);
    long pid = 0;
    if (n > 0) (void)std::from_chars(buf, buf + n, pid);
    return absl::FailedPreconditionError(
        pid > 0 ? absl::StrCat(path, " is locked by pid ", pid)
                : absl::StrCat(path, " is locked by another process"));
  }
  // The pid only serves the message of the next process that tries (a full
  // disk fails this write); the lock is held either way.
  const std::string pid = absl::StrCat(::getpid(), "\n");
  if (::ftruncate(fd, 0) == 0) (void)!::pwrite(fd, pid.data(), pid.size(), 0);
  return lock;
}

ExclusiveFileLock::ExclusiveFileLock(ExclusiveFileLock&& other) noexcept
    : path_(std::move(other.path_)), fd_(std::exchange(other.fd_, -1)) {}

ExclusiveFileLock& ExclusiveFileLock::operator=(ExclusiveFileLock&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    path_ = std::move(other.path_);
    fd_ = std::exchange(other.fd_, -1);
  }
  return *this;
}

ExclusiveFileLock::~ExclusiveFileLock() {
  if (fd_ >= 0) ::close(fd_);
}

absl::StatusOr<std::string> ReadSecretFile(const std::string& path, const char* what, size_t min_bytes) {
  // Checked on the file the path resolves to (a symlink, as in a mounted
  // secret, is followed).
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) return ErrnoToStatus(errno, absl::StrCat(what, " file ", path));
  if ((st.st_mode & 077) != 0) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "%s file %s is readable or writable by group or others (mode %04o); run chmod 600 %s",
        what, path, st.st_mode & 07777, path));
  }
  KVTIER_ASSIGN_OR_RETURN(std::vector<uint8_t> bytes, ReadFileBytes(path, kMaxSecretFileBytes));
  std::string t(bytes.begin(), bytes.end());
  size_t b = t.find_first_not_of(" \t\r\n");
  size_t e = t.find_last_not_of(" \t\r\n");
  if (b == std::string::npos) return absl::InvalidArgumentError(absl::StrCat(what, " file ", path, " is empty"));
  t = t.substr(b, e - b + 1);
  if (t.size() < min_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(what, " in ", path, " is ", t.size(),
                                                   " bytes; it must have at least ", min_bytes,
                                                   " (e.g. openssl rand -hex 32)"));
  }
  return t;
}

}  // namespace kvtier
