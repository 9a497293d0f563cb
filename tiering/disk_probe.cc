#include "tiering/disk_probe.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/file.h"
#include "common/status.h"
#include "tiering/io.h"

namespace kvtier::tiering {
namespace {

constexpr uint64_t kDirectAlign = 4096;  // O_DIRECT buffer and offset alignment

// Closes and unlinks the probe's temporary file on every path.
class TempFile {
 public:
  TempFile() = default;
  TempFile(const TempFile&) = delete;
  TempFile& operator=(const TempFile&) = delete;
  ~TempFile() {
    if (fd_ >= 0) ::close(fd_);
    if (!path_.empty()) ::unlink(path_.c_str());
  }

  absl::Status Create(const std::string& dir) {
    std::string templ = (std::filesystem::path(dir) / "kvtier-probe-XXXXXX").string();
    int fd = ::mkstemp(templ.data());
    if (fd < 0) return ErrnoToStatus(errno, absl::StrCat("create a probe file in ", dir));
    path_ = templ;
    ::close(fd);
    return absl::OkStatus();
  }

  // Reopens the file with `flags` | O_DIRECT. FailedPrecondition when the
  // filesystem does not support O_DIRECT.
  absl::Status OpenDirect(int flags) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = ::open(path_.c_str(), flags | O_DIRECT | O_CLOEXEC);
    if (fd_ < 0) {
      const int err = errno;
      if (err == EINVAL) {
        return absl::FailedPreconditionError(
            absl::StrCat("the filesystem of ", path_, " does not support O_DIRECT"));
      }
      return ErrnoToStatus(err, absl::StrCat("open ", path_));
    }
    return absl::OkStatus();
  }

  int fd() const { return fd_; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  int fd_ = -1;
};

absl::Status WriteAll(int fd, const uint8_t* buf, uint64_t bytes, const std::string& path) {
  for (uint64_t off = 0; off < bytes; off += kDiskProbeIoBytes) {
    const uint64_t n = std::min(kDiskProbeIoBytes, bytes - off);
    ssize_t w = ::pwrite(fd, buf, n, static_cast<off_t>(off));
    if (w < 0) return ErrnoToStatus(errno, absl::StrCat("write ", path));
    if (static_cast<uint64_t>(w) != n) {
      return absl::UnavailableError(absl::StrCat("short write to ", path));
    }
  }
  if (::fdatasync(fd) != 0) return ErrnoToStatus(errno, absl::StrCat("fdatasync ", path));
  return absl::OkStatus();
}

// Reads [begin, end) of fd in kDiskProbeIoBytes requests into `buf`.
absl::Status ReadRange(int fd, uint8_t* buf, uint64_t begin, uint64_t end) {
  for (uint64_t off = begin; off < end; off += kDiskProbeIoBytes) {
    const uint64_t n = std::min(kDiskProbeIoBytes, end - off);
    ssize_t r = ::pread(fd, buf, n, static_cast<off_t>(off));
    if (r < 0) return ErrnoToStatus(errno, "O_DIRECT read");
    if (static_cast<uint64_t>(r) != n) return absl::UnavailableError("short O_DIRECT read");
  }
  return absl::OkStatus();
}

}  // namespace

void FillIncompressible(uint8_t* p, uint64_t bytes) {
  uint64_t x = 0x9E3779B97F4A7C15ull;
  for (uint64_t i = 0; i + 8 <= bytes; i += 8) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    std::memcpy(p + i, &x, 8);
  }
}

absl::StatusOr<DiskReadProbe> ProbeDiskRead(const std::string& dir, uint64_t bytes, int repeats) {
  if (bytes == 0) return absl::InvalidArgumentError("disk probe size must be positive");
  if (repeats <= 0) return absl::InvalidArgumentError("disk probe repeats must be positive");
  bytes = (bytes + kDiskProbeIoBytes - 1) / kDiskProbeIoBytes * kDiskProbeIoBytes;
  TempFile file;
  KVTIER_RETURN_IF_ERROR(file.Create(dir));
  {
    AlignedBuffer buf(kDiskProbeIoBytes, kDirectAlign);
    if (buf.data() == nullptr) return absl::ResourceExhaustedError("disk probe buffer");
    FillIncompressible(buf.data(), kDiskProbeIoBytes);
    KVTIER_RETURN_IF_ERROR(file.OpenDirect(O_WRONLY));
    KVTIER_RETURN_IF_ERROR(WriteAll(file.fd(), buf.data(), bytes, file.path()));
  }
  KVTIER_RETURN_IF_ERROR(file.OpenDirect(O_RDONLY));
  std::vector<AlignedBuffer> buffers;
  for (int t = 0; t < kDiskProbeThreads; ++t) {
    buffers.emplace_back(kDiskProbeIoBytes, kDirectAlign);
    if (buffers.back().data() == nullptr) return absl::ResourceExhaustedError("disk probe buffer");
  }
  // Each thread reads one contiguous, request-aligned share.
  const uint64_t share =
      (bytes / kDiskProbeThreads + kDiskProbeIoBytes - 1) / kDiskProbeIoBytes * kDiskProbeIoBytes;
  DiskReadProbe best{.bytes = bytes, .micros = INT64_MAX};
  for (int i = 0; i < repeats; ++i) {
    std::vector<absl::Status> results(kDiskProbeThreads);
    const auto t0 = std::chrono::steady_clock::now();
    {
      std::vector<std::jthread> threads;
      for (int t = 0; t < kDiskProbeThreads; ++t) {
        const uint64_t begin = std::min(bytes, share * t);
        const uint64_t end = std::min(bytes, begin + share);
        threads.emplace_back([&, t, begin, end] {
          results[t] = ReadRange(file.fd(), buffers[t].data(), begin, end);
        });
      }
    }
    const int64_t micros = std::max<int64_t>(
        1, std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - t0)
               .count());
    for (const absl::Status& s : results) KVTIER_RETURN_IF_ERROR(s);
    best.micros = std::min(best.micros, micros);
  }
  return best;
}

}  // namespace kvtier::tiering
