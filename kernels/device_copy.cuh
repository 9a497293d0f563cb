// Asynchronous global -> shared copies (cp.async, sm_80 and later), shared by
// the attention and codec kernels' pipelines; and the ordering of a grid
// against the one before it on its stream (programmatic dependent launch).
#ifndef KVTIER_KERNELS_DEVICE_COPY_CUH_
#define KVTIER_KERNELS_DEVICE_COPY_CUH_

#include <cstdint>

namespace kvtier::kernels {

// 16 bytes through L2 only. With valid false the destination gets 16 zero
// bytes and `src` is not read (rows past the sequence end).
__device__ __forceinline__ void CpAsync16(void* dst, const void* src, bool valid = true) {
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(src),
               "r"(valid ? 16 : 0));
}
// 4 bytes (cp.async.cg takes only 16); zeros when valid is false.
__device__ __forceinline__ void CpAsync4(void* dst, const void* src, bool valid = true) {
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(s), "l"(src),
               "r"(valid ? 4 : 0));
}
// Closes the group of this thread's copies issued since the last commit.
__device__ __forceinline__ void CpAsyncCommit() { asm volatile("cp.async.commit_group;\n" ::); }
// Waits until at most N of this thread's committed groups are in flight.
template <int N>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Programmatic dependent launch (sm_90 and later; no-ops before, and in a
// grid launched without cudaLaunchAttributeProgrammaticStreamSerialization).
// AllowDependentLaunch: a grid launched after this one with the attribute may
// start once every CTA of this one has executed it (or exited).
// WaitForPriorGrids: returns once the grids this one may overlap have
// completed and their memory writes are visible to it.
__device__ __forceinline__ void AllowDependentLaunch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void WaitForPriorGrids() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

}  // namespace kvtier::kernels

#endif  // KVTIER_KERNELS_DEVICE_COPY_CUH_
