#include "cli/probe.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/file.h"
#include "common/status.h"

#ifdef KVTIER_PROBE_CUDA
#include <cuda_runtime_api.h>

#include "kernels/cuda_status.h"
#endif

namespace kvtier::cli {
namespace {

constexpr uint64_t kMiB = uint64_t{1} << 20;
constexpr uint64_t kDirectAlign = 4096;        // O_DIRECT buffer and offset alignment
constexpr uint64_t kIoBytes = 4 * kMiB;        // one read or write request
constexpr int kReadThreads = 4;                // concurrent O_DIRECT readers

using Clock = std::chrono::steady_clock;

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};
using AlignedBuffer = std::unique_ptr<uint8_t, FreeDeleter>;

absl::StatusOr<AlignedBuffer> Allocate(uint64_t bytes) {
  void* p = std::aligned_alloc(kDirectAlign, bytes);
  if (p == nullptr) {
    return absl::ResourceExhaustedError(absl::StrCat("cannot allocate ", bytes, " bytes"));
  }
  return AlignedBuffer(static_cast<uint8_t*>(p));
}

// A fixed-seed, incompressible fill (xorshift64), so that no layer below
// can shortcut zero pages.
void Fill(uint8_t* p, uint64_t bytes) {
  uint64_t x = 0x9E3779B97F4A7C15ull;
  for (uint64_t i = 0; i + 8 <= bytes; i += 8) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    std::memcpy(p + i, &x, 8);
  }
}

double GbPerS(uint64_t bytes, double seconds) { return bytes / seconds / 1e9; }

double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

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
  for (uint64_t off = 0; off < bytes; off += kIoBytes) {
    const uint64_t n = std::min(kIoBytes, bytes - off);
    ssize_t w = ::pwrite(fd, buf, n, static_cast<off_t>(off));
    if (w < 0) return ErrnoToStatus(errno, absl::StrCat("write ", path));
    if (static_cast<uint64_t>(w) != n) {
      return absl::UnavailableError(absl::StrCat("short write to ", path));
    }
  }
  if (::fdatasync(fd) != 0) return ErrnoToStatus(errno, absl::StrCat("fdatasync ", path));
  return absl::OkStatus();
}

// Reads [begin, end) of fd in kIoBytes requests into `buf`.
absl::Status ReadRange(int fd, uint8_t* buf, uint64_t begin, uint64_t end) {
  for (uint64_t off = begin; off < end; off += kIoBytes) {
    const uint64_t n = std::min(kIoBytes, end - off);
    ssize_t r = ::pread(fd, buf, n, static_cast<off_t>(off));
    if (r < 0) return ErrnoToStatus(errno, "O_DIRECT read");
    if (static_cast<uint64_t>(r) != n) return absl::UnavailableError("short O_DIRECT read");
  }
  return absl::OkStatus();
}

#ifdef KVTIER_PROBE_CUDA
// Times `repeats` copies of `bytes` with CUDA events; best GB/s.
absl::StatusOr<double> TimeCudaCopy(void* dst, const void* src, uint64_t bytes,
                                    cudaMemcpyKind kind, int repeats, cudaStream_t stream) {
  cudaEvent_t start, stop;
  KVTIER_CUDA_RETURN_IF_ERROR(cudaEventCreate(&start));
  KVTIER_CUDA_RETURN_IF_ERROR(cudaEventCreate(&stop));
  double best = 0;
  absl::Status status;
  for (int i = 0; i <= repeats && status.ok(); ++i) {  // the first run warms up
    status = [&]() -> absl::Status {
      KVTIER_CUDA_RETURN_IF_ERROR(cudaEventRecord(start, stream));
      KVTIER_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst, src, bytes, kind, stream));
      KVTIER_CUDA_RETURN_IF_ERROR(cudaEventRecord(stop, stream));
      KVTIER_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(stop));
      float ms = 0;
      KVTIER_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&ms, start, stop));
      if (i > 0 && ms > 0) best = std::max(best, GbPerS(bytes, ms / 1e3));
      return absl::OkStatus();
    }();
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  if (!status.ok()) return status;
  return best;
}

// Pinned host <-> device and device <-> device copies on device 0.
// FailedPrecondition when there is no usable GPU.
absl::StatusOr<std::vector<bandwidth::Link>> MeasureGpu(uint64_t bytes, int repeats) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    cudaGetLastError();  // clear the sticky "no device" error
    return absl::FailedPreconditionError("no GPU (cudaGetDeviceCount found none)");
  }
  KVTIER_CUDA_RETURN_IF_ERROR(cudaSetDevice(0));
  cudaDeviceProp prop;
  KVTIER_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, 0));
  void* host = nullptr;
  void* dev_a = nullptr;
  void* dev_b = nullptr;
  cudaStream_t stream = nullptr;
  auto cleanup = [&] {
    if (host) cudaFreeHost(host);
    if (dev_a) cudaFree(dev_a);
    if (dev_b) cudaFree(dev_b);
    if (stream) cudaStreamDestroy(stream);
  };
  std::vector<bandwidth::Link> links;
  absl::Status status = [&]() -> absl::Status {
    KVTIER_CUDA_RETURN_IF_ERROR(cudaMallocHost(&host, bytes));
    KVTIER_CUDA_RETURN_IF_ERROR(cudaMalloc(&dev_a, bytes));
    KVTIER_CUDA_RETURN_IF_ERROR(cudaMalloc(&dev_b, bytes));
    KVTIER_CUDA_RETURN_IF_ERROR(cudaStreamCreate(&stream));
    Fill(static_cast<uint8_t*>(host), bytes);
    const std::string gpu = prop.name;
    KVTIER_ASSIGN_OR_RETURN(double h2d, TimeCudaCopy(dev_a, host, bytes, cudaMemcpyHostToDevice,
                                                     repeats, stream));
    links.push_back({"h2d-pinned", h2d, absl::StrCat("pinned host -> ", gpu, ", cudaMemcpyAsync")});
    KVTIER_ASSIGN_OR_RETURN(double d2h, TimeCudaCopy(host, dev_a, bytes, cudaMemcpyDeviceToHost,
                                                     repeats, stream));
    links.push_back({"d2h-pinned", d2h, absl::StrCat(gpu, " -> pinned host, cudaMemcpyAsync")});
    KVTIER_ASSIGN_OR_RETURN(double d2d, TimeCudaCopy(dev_b, dev_a, bytes,
                                                     cudaMemcpyDeviceToDevice, repeats, stream));
    links.push_back({"d2d-copy", d2d,
                     absl::StrCat(gpu, " device -> device copy (bytes copied; HBM moves 2x)")});
    return absl::OkStatus();
  }();
  cleanup();
  if (!status.ok()) return status;
  return links;
}
#endif  // KVTIER_PROBE_CUDA

// memcpy between two touched host buffers of `bytes`: GB/s.
absl::StatusOr<double> MeasureDramCopy(uint64_t bytes, int repeats) {
  KVTIER_ASSIGN_OR_RETURN(AlignedBuffer src, Allocate(bytes));
  KVTIER_ASSIGN_OR_RETURN(AlignedBuffer dst, Allocate(bytes));
  Fill(src.get(), bytes);
  std::memset(dst.get(), 1, bytes);  // fault every page in before timing
  double best = 0;
  for (int i = 0; i < repeats; ++i) {
    const auto t0 = Clock::now();
    std::memcpy(dst.get(), src.get(), bytes);
    const auto t1 = Clock::now();
    best = std::max(best, GbPerS(bytes, Seconds(t0, t1)));
  }
  // Keep the copy observable so it cannot be elided.
  if (std::memcmp(dst.get(), src.get(), 64) != 0) return absl::InternalError("memcpy mismatch");
  return best;
}

// Writes a temporary file of `bytes` in `dir`, then reads it back with
// O_DIRECT (bypassing the page cache) in kIoBytes requests from kReadThreads
// threads: GB/s. FailedPrecondition when the filesystem refuses O_DIRECT.
absl::StatusOr<double> MeasureDirectRead(const std::string& dir, uint64_t bytes, int repeats) {
  TempFile file;
  KVTIER_RETURN_IF_ERROR(file.Create(dir));
  {
    KVTIER_ASSIGN_OR_RETURN(AlignedBuffer buf, Allocate(kIoBytes));
    Fill(buf.get(), kIoBytes);
    KVTIER_RETURN_IF_ERROR(file.OpenDirect(O_WRONLY));
    KVTIER_RETURN_IF_ERROR(WriteAll(file.fd(), buf.get(), bytes, file.path()));
  }
  KVTIER_RETURN_IF_ERROR(file.OpenDirect(O_RDONLY));
  std::vector<AlignedBuffer> buffers;
  for (int t = 0; t < kReadThreads; ++t) {
    KVTIER_ASSIGN_OR_RETURN(AlignedBuffer b, Allocate(kIoBytes));
    buffers.push_back(std::move(b));
  }
  // Each thread reads one contiguous, kIoBytes-aligned share.
  const uint64_t share = (bytes / kReadThreads + kIoBytes - 1) / kIoBytes * kIoBytes;
  double best = 0;
  for (int i = 0; i < repeats; ++i) {
    std::vector<absl::Status> results(kReadThreads);
    const auto t0 = Clock::now();
    {
      std::vector<std::jthread> threads;
      for (int t = 0; t < kReadThreads; ++t) {
        const uint64_t begin = std::min(bytes, share * t);
        const uint64_t end = std::min(bytes, begin + share);
        threads.emplace_back([&, t, begin, end] {
          results[t] = ReadRange(file.fd(), buffers[t].get(), begin, end);
        });
      }
    }
    const auto t1 = Clock::now();
    for (const absl::Status& s : results) KVTIER_RETURN_IF_ERROR(s);
    best = std::max(best, GbPerS(bytes, Seconds(t0, t1)));
  }
  return best;
}

}  // namespace

absl::StatusOr<ProbeReport> RunProbe(const ProbeOptions& options) {
  if (options.bytes == 0) return absl::InvalidArgumentError("probe size must be positive");
  if (options.repeats <= 0) return absl::InvalidArgumentError("repeats must be positive");
  const uint64_t bytes = (options.bytes + kMiB - 1) / kMiB * kMiB;
  ProbeReport report;

  KVTIER_ASSIGN_OR_RETURN(double dram, MeasureDramCopy(bytes, options.repeats));
  report.links.push_back({"dram-memcpy", dram, "host DRAM memcpy, one thread (bytes copied)"});

  if (options.disk) {
    std::error_code ec;
    std::filesystem::create_directories(options.data_dir, ec);
    if (ec) {
      return ErrnoToStatus(ec.value(), absl::StrCat("create data directory ", options.data_dir));
    }
    absl::StatusOr<double> disk = MeasureDirectRead(options.data_dir, bytes, options.repeats);
    if (disk.ok()) {
      report.links.push_back(
          {"disk-odirect", *disk,
           absl::StrCat("O_DIRECT sequential read in ", options.data_dir, ", ", kReadThreads,
                        " threads x 4 MiB requests")});
    } else if (disk.status().code() == absl::StatusCode::kFailedPrecondition) {
      report.skipped.push_back(absl::StrCat("disk-odirect: ", disk.status().message()));
    } else {
      return disk.status();
    }
  } else {
    report.skipped.push_back("disk-odirect: disabled (--no-disk)");
  }

  if (!options.gpu) {
    report.skipped.push_back("gpu: disabled (--no-gpu)");
  } else {
#ifdef KVTIER_PROBE_CUDA
    absl::StatusOr<std::vector<bandwidth::Link>> gpu = MeasureGpu(bytes, options.repeats);
    if (gpu.ok()) {
      for (bandwidth::Link& l : *gpu) report.links.push_back(std::move(l));
    } else if (gpu.status().code() == absl::StatusCode::kFailedPrecondition) {
      report.skipped.push_back(absl::StrCat("gpu: ", gpu.status().message()));
    } else {
      return gpu.status();
    }
#else
    report.skipped.push_back("gpu: this kvtier was built without CUDA");
#endif
  }
  return report;
}

}  // namespace kvtier::cli
