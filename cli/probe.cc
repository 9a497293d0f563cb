#include "cli/probe.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "common/file.h"
#include "common/status.h"
#include "tiering/disk_probe.h"
#include "tiering/io.h"

#ifdef KVTIER_PROBE_CUDA
#include <cuda_runtime_api.h>

#include "kernels/cuda_status.h"
#endif

namespace kvtier::cli {
namespace {

constexpr uint64_t kMiB = uint64_t{1} << 20;
constexpr uint64_t kAlign = 4096;  // page-aligned host buffers

using Clock = std::chrono::steady_clock;

absl::StatusOr<tiering::AlignedBuffer> Allocate(uint64_t bytes) {
  tiering::AlignedBuffer b(bytes, kAlign);
  if (b.data() == nullptr) {
    return absl::ResourceExhaustedError(absl::StrCat("cannot allocate ", bytes, " bytes"));
  }
  return b;
}

double GbPerS(uint64_t bytes, double seconds) { return bytes / seconds / 1e9; }

double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
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
    tiering::FillIncompressible(static_cast<uint8_t*>(host), bytes);
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
  KVTIER_ASSIGN_OR_RETURN(tiering::AlignedBuffer src, Allocate(bytes));
  KVTIER_ASSIGN_OR_RETURN(tiering::AlignedBuffer dst, Allocate(bytes));
  tiering::FillIncompressible(src.data(), bytes);
  std::memset(dst.data(), 1, bytes);  // fault every page in before timing
  double best = 0;
  for (int i = 0; i < repeats; ++i) {
    const auto t0 = Clock::now();
    std::memcpy(dst.data(), src.data(), bytes);
    const auto t1 = Clock::now();
    best = std::max(best, GbPerS(bytes, Seconds(t0, t1)));
  }
  // Keep the copy observable so it cannot be elided.
  if (std::memcmp(dst.data(), src.data(), 64) != 0) return absl::InternalError("memcpy mismatch");
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
    absl::StatusOr<tiering::DiskReadProbe> disk =
        tiering::ProbeDiskRead(options.data_dir, bytes, options.repeats);
    if (disk.ok()) {
      report.links.push_back(
          {"disk-odirect", disk->bytes_per_s() / 1e9,
           absl::StrCat("O_DIRECT sequential read in ", options.data_dir, ", ",
                        tiering::kDiskProbeThreads,
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
