// HBM tier: a device memory pool for hot chunks. Memory comes from a
// DeviceAllocator: CUDA (cudaMalloc) in production, a host-memory fake in
// CPU tests.
#ifndef KVTIER_TIERING_HBM_TIER_H_
#define KVTIER_TIERING_HBM_TIER_H_

#include <memory>

#include "tiering/pool_tier.h"

namespace kvtier::tiering {

// Allocates device memory and copies between it and host memory.
// Thread-safe.
class DeviceAllocator {
 public:
  virtual ~DeviceAllocator() = default;
  // ResourceExhausted when the device has no room.
  virtual absl::StatusOr<void*> Allocate(uint64_t bytes) = 0;
  virtual void Free(void* ptr) = 0;
  virtual absl::Status CopyToDevice(void* dst, const void* src, uint64_t bytes) = 0;
  virtual absl::Status CopyToHost(void* dst, const void* src, uint64_t bytes) = 0;
};

// Host memory posing as a device (CPU tests). `limit_bytes` caps the total
// allocation, like a device of that size.
std::unique_ptr<DeviceAllocator> NewFakeDeviceAllocator(uint64_t limit_bytes);

// cudaMalloc/cudaMemcpy on device `device`. Only in builds with CUDA
// (KVTIER_HAVE_CUDA); FailedPrecondition when no device is present.
absl::StatusOr<std::unique_ptr<DeviceAllocator>> NewCudaDeviceAllocator(int device);

// Registers host memory with CUDA (cudaHostRegister) so copies from it are
// DMA; use as DramTierOptions::register_memory. FailedPrecondition without
// CUDA or a device.
absl::Status CudaHostRegister(void* base, uint64_t size);

struct HbmTierOptions {
  // Pool size in bytes, allocated at Open as one device allocation; the
  // hard capacity of the tier. Default: 256 MiB
  uint64_t capacity_bytes = uint64_t{256} << 20;
  // Allocation unit and alignment of every chunk. Default: 4096
  uint64_t alignment = 4096;
};

class HbmTier : public PoolTier {
 public:
  // Takes ownership of `allocator`. ResourceExhausted if the pool cannot be
  // allocated.
  static absl::StatusOr<std::unique_ptr<HbmTier>> Open(const HbmTierOptions& options,
                                                       std::unique_ptr<DeviceAllocator> allocator);
  TierCapabilities capabilities() const override {
    return TierCapabilities{.device_memory = true};
  }
  // Device address of the pool; PoolExtent offsets are relative to it, so a
  // kernel can read a chunk in place at device_base() + offset.
  void* device_base() const { return base_; }

 private:
  HbmTier(std::unique_ptr<PoolMemory> mem, uint64_t alignment, void* base)
      : PoolTier(TierKind::kHbm, std::move(mem), alignment), base_(base) {}
  void* base_;
};

}  // namespace kvtier::tiering

#endif  // KVTIER_TIERING_HBM_TIER_H_
