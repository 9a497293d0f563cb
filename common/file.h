// Whole-file helpers with Status errors. Reads are bounded: a file larger than
// the caller's limit is refused before any allocation. Also the address of a
// Unix socket path.
#ifndef KVTIER_COMMON_FILE_H_
#define KVTIER_COMMON_FILE_H_

#include <sys/socket.h>
#include <sys/un.h>

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace kvtier {

// The address of the Unix socket at `path`. InvalidArgument if the path
// does not fit sockaddr_un (107 bytes).
absl::StatusOr<sockaddr_un> UnixSocketAddress(const std::string& path);

// Reads all of `path`. NotFound if it does not exist, InvalidArgument if it is
// not a regular file or is larger than `max_bytes`, Unavailable on I/O errors.
absl::StatusOr<std::vector<uint8_t>> ReadFileBytes(const std::string& path, uint64_t max_bytes);

// ReadFileBytes as text, for a PEM file (certificates, CA bundles) up to
// 1 MiB; errors name `what` (a flag such as "--tls-cert") and the path.
absl::StatusOr<std::string> ReadPemFile(const std::string& path, std::string_view what);

// Writes `data` to `path` through a temporary file and rename, so a reader
// never sees a partial file.
absl::Status WriteFileAtomic(const std::string& path, std::span<const uint8_t> data);

// Maps an errno value to the Status code abseil's retry guidance suggests.
absl::Status ErrnoToStatus(int err, std::string_view what);

// An exclusive advisory lock (flock(2)) on a file, held from Acquire until
// the object is destroyed; the file records the holder's pid. The lock
// belongs to the open file description, so a second Acquire of the same
// path fails within one process too, and it ends with the process. The file
// stays after release: removing it would let a later process lock a new file
// of the same name while another still holds the old one. Movable; not
// thread-safe.
class ExclusiveFileLock {
 public:
  // Opens `path` (created with mode 0600; the descriptor is close-on-exec)
  // and locks it without waiting, then writes the caller's pid into it.
  // FailedPrecondition if another open of the file holds the lock: the
  // message names the file and the holder's pid where the file records one.
  // InvalidArgument if `path` is a symlink or not a regular file; otherwise
  // the failing call's errno as ErrnoToStatus maps it.
  static absl::StatusOr<ExclusiveFileLock> Acquire(const std::string& path);

  ExclusiveFileLock(ExclusiveFileLock&& other) noexcept;
  ExclusiveFileLock& operator=(ExclusiveFileLock&& other) noexcept;
  ExclusiveFileLock(const ExclusiveFileLock&) = delete;
  ExclusiveFileLock& operator=(const ExclusiveFileLock&) = delete;
  // Releases the lock (closes the file).
  ~ExclusiveFileLock();

  const std::string& path() const { return path_; }

 private:
  ExclusiveFileLock(std::string path, int fd) : path_(std::move(path)), fd_(fd) {}
  std::string path_;
  int fd_ = -1;
};

// Largest secret file ReadSecretFile reads.
inline constexpr uint64_t kMaxSecretFileBytes = 4096;

// Reads a secret (`what`: "token", "cluster secret", ...) from `path`
// (following a symlink) and trims surrounding whitespace.
// FailedPrecondition if group or others have any access to the file
// (mode & 077; the message says to chmod 600 it); InvalidArgument if it is
// not a regular file, is larger than kMaxSecretFileBytes, is empty or holds a
// secret shorter than `min_bytes`; NotFound if it does not exist.
absl::StatusOr<std::string> ReadSecretFile(const std::string& path, const char* what, size_t min_bytes);

}  // namespace kvtier

#endif  // KVTIER_COMMON_FILE_H_
