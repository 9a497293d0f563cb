// The one place a cudaError_t becomes an absl::Status (with file and line).
#ifndef KVTIER_KERNELS_CUDA_STATUS_H_
#define KVTIER_KERNELS_CUDA_STATUS_H_

#include <cuda_runtime_api.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace kvtier::kernels {

// Internal for most errors; InvalidArgument for cudaErrorInvalidValue and
// friends; ResourceExhausted for allocation failures.
inline absl::Status CudaStatus(cudaError_t err, const char* expr, const char* file, int line) {
  if (err == cudaSuccess) return absl::OkStatus();
  std::string msg = absl::StrCat(file, ":", line, ": ", expr, ": ", cudaGetErrorName(err), " (",
                                 cudaGetErrorString(err), ")");
  switch (err) {
    case cudaErrorMemoryAllocation:
      return absl::ResourceExhaustedError(msg);
    case cudaErrorInvalidValue:
    case cudaErrorInvalidDevicePointer:
    case cudaErrorInvalidConfiguration:
      return absl::InvalidArgumentError(msg);
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
      return absl::FailedPreconditionError(msg);
    default:
      return absl::InternalError(msg);
  }
}

}  // namespace kvtier::kernels

// Evaluates a CUDA runtime call; returns a Status naming the call, file and
// line from the enclosing function when it fails.
#define KVTIER_CUDA_RETURN_IF_ERROR(expr)                                                   \
  do {                                                                                      \
    cudaError_t kvtier_cuda_err_ = (expr);                                                  \
    if (kvtier_cuda_err_ != cudaSuccess)                                                    \
      return ::kvtier::kernels::CudaStatus(kvtier_cuda_err_, #expr, __FILE__, __LINE__);    \
  } while (0)

#endif  // KVTIER_KERNELS_CUDA_STATUS_H_
