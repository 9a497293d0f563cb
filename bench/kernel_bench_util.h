// Shared by the GPU kernel benchmarks: abort-on-error checks. Benchmarks are
// programs, not tests: a failed CUDA call or Status ends the run with the
// file, line and reason.
#ifndef KVTIER_BENCH_KERNEL_BENCH_UTIL_H_
#define KVTIER_BENCH_KERNEL_BENCH_UTIL_H_

#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#include "absl/status/status.h"

#define CHECK_CUDA(x)                                                                         \
  do {                                                                                        \
    cudaError_t e_ = (x);                                                                     \
    if (e_ != cudaSuccess) {                                                                  \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                           \
    }                                                                                         \
  } while (0)
#define CHECK_OK(x)                                                                  \
  do {                                                                               \
    absl::Status s_ = (x);                                                           \
    if (!s_.ok()) {                                                                  \
      std::fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, s_.ToString().c_str()); \
      std::exit(1);                                                                  \
    }                                                                                \
  } while (0)

#endif  // KVTIER_BENCH_KERNEL_BENCH_UTIL_H_
