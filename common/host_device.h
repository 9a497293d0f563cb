// KVTIER_HD marks functions compiled for both host and device, so the CUDA
// kernels, the CPU references and the tests share one copy of index and
// numeric code.
#ifndef KVTIER_COMMON_HOST_DEVICE_H_
#define KVTIER_COMMON_HOST_DEVICE_H_

#if defined(__CUDACC__)
#define KVTIER_HD __host__ __device__ __forceinline__
#else
#define KVTIER_HD inline
#endif

#endif  // KVTIER_COMMON_HOST_DEVICE_H_
