// cudaMalloc-backed DeviceAllocator; compiled only when KVTIER_HAVE_CUDA.
#include <cuda_runtime.h>

#include "absl/strings/str_cat.h"
#include "tiering/hbm_tier.h"

namespace kvtier::tiering {
namespace {

// The one place a cudaError_t becomes a Status (file and line included).
#define KVTIER_CUDA_STATUS(expr) CudaStatus((expr), #expr, __FILE__, __LINE__)
absl::Status CudaStatus(cudaError_t e, const char* what, const char* file, int line) {
  if (e == cudaSuccess) return absl::OkStatus();
  std::string msg = absl::StrCat(file, ":", line, ": ", what, ": ", cudaGetErrorString(e));
  if (e == cudaErrorMemoryAllocation) return absl::ResourceExhaustedError(msg);
  if (e == cudaErrorNoDevice || e == cudaErrorInsufficientDriver) {
    return absl::FailedPreconditionError(msg);
  }
  return absl::InternalError(msg);
}

class CudaDeviceAllocator : public DeviceAllocator {
 public:
  explicit CudaDeviceAllocator(int device) : device_(device) {}
  absl::StatusOr<void*> Allocate(uint64_t bytes) override {
    absl::Status st = KVTIER_CUDA_STATUS(cudaSetDevice(device_));
    if (!st.ok()) return st;
    void* p = nullptr;
    st = KVTIER_CUDA_STATUS(cudaMalloc(&p, bytes));
    if (!st.ok()) return st;
    return p;
  }
  void Free(void* p) override {
    cudaSetDevice(device_);
    cudaFree(p);
  }
  absl::Status CopyToDevice(void* dst, const void* src, uint64_t n) override {
    absl::Status st = KVTIER_CUDA_STATUS(cudaSetDevice(device_));
    if (!st.ok()) return st;
    return KVTIER_CUDA_STATUS(cudaMemcpy(dst, src, n, cudaMemcpyHostToDevice));
  }
  absl::Status CopyToHost(void* dst, const void* src, uint64_t n) override {
    absl::Status st = KVTIER_CUDA_STATUS(cudaSetDevice(device_));
    if (!st.ok()) return st;
    return KVTIER_CUDA_STATUS(cudaMemcpy(dst, src, n, cudaMemcpyDeviceToHost));
  }

 private:
  const int device_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<DeviceAllocator>> NewCudaDeviceAllocator(int device) {
  int count = 0;
  absl::Status st = KVTIER_CUDA_STATUS(cudaGetDeviceCount(&count));
  if (!st.ok()) return absl::FailedPreconditionError(st.message());
  if (count <= device) return absl::FailedPreconditionError("no CUDA device");
  return std::unique_ptr<DeviceAllocator>(new CudaDeviceAllocator(device));
}

absl::Status CudaHostRegister(void* base, uint64_t size) {
  return KVTIER_CUDA_STATUS(cudaHostRegister(base, size, cudaHostRegisterDefault));
}

}  // namespace kvtier::tiering
