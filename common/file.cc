#include "common/file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
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

absl::StatusOr<std::vector<uint8_t>> ReadFileBytes(const std::string& path, uint64_t max_bytes) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
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

}  // namespace kvtier
