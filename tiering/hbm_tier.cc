#include "tiering/hbm_tier.h"

#include <atomic>
#include <cstdlib>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace kvtier::tiering {
namespace {

class FakeDeviceAllocator : public DeviceAllocator {
 public:
  explicit FakeDeviceAllocator(uint64_t limit) : limit_(limit) {}
  absl::StatusOr<void*> Allocate(uint64_t bytes) override {
    if (used_.fetch_add(bytes) + bytes > limit_) {
      used_.fetch_sub(bytes);
      return absl::ResourceExhaustedError(absl::StrCat("fake device: ", bytes, " bytes over limit"));
    }
    void* p = std::aligned_alloc(4096, (bytes + 4095) / 4096 * 4096);
    if (p == nullptr) {
      used_.fetch_sub(bytes);
      return absl::ResourceExhaustedError("fake device: host allocation failed");
    }
    return p;
  }
  void Free(void* p) override { std::free(p); }
  absl::Status CopyToDevice(void* dst, const void* src, uint64_t n) override {
    std::memcpy(dst, src, n);
    return absl::OkStatus();
  }
  absl::Status CopyToHost(void* dst, const void* src, uint64_t n) override {
    std::memcpy(dst, src, n);
    return absl::OkStatus();
  }

 private:
  const uint64_t limit_;
  std::atomic<uint64_t> used_{0};
};

// The pool's bytes: one device allocation, freed with the tier.
class DeviceMemory : public PoolMemory {
 public:
  DeviceMemory(std::unique_ptr<DeviceAllocator> a, void* base, uint64_t size)
      : alloc_(std::move(a)), base_(static_cast<uint8_t*>(base)), size_(size) {}
  ~DeviceMemory() override { alloc_->Free(base_); }
  uint64_t size() const override { return size_; }
  absl::Status CopyIn(uint64_t off, std::span<const uint8_t> src) override {
    return alloc_->CopyToDevice(base_ + off, src.data(), src.size());
  }
  absl::Status CopyOut(uint64_t off, std::span<uint8_t> dst) override {
    return alloc_->CopyToHost(dst.data(), base_ + off, dst.size());
  }

 private:
  std::unique_ptr<DeviceAllocator> alloc_;
  uint8_t* base_;
  uint64_t size_;
};

}  // namespace

std::unique_ptr<DeviceAllocator> NewFakeDeviceAllocator(uint64_t limit_bytes) {
  return std::make_unique<FakeDeviceAllocator>(limit_bytes);
}

#ifndef KVTIER_HAVE_CUDA
absl::StatusOr<std::unique_ptr<DeviceAllocator>> NewCudaDeviceAllocator(int) {
  return absl::FailedPreconditionError("kvtier was built without CUDA");
}
absl::Status CudaHostRegister(void*, uint64_t) {
  return absl::FailedPreconditionError("kvtier was built without CUDA");
}
#endif

absl::StatusOr<std::unique_ptr<HbmTier>> HbmTier::Open(const HbmTierOptions& o,
                                                       std::unique_ptr<DeviceAllocator> a) {
  if (o.alignment == 0 || (o.alignment & (o.alignment - 1)) != 0) {
    return absl::InvalidArgumentError("alignment must be a power of two");
  }
  const uint64_t size = o.capacity_bytes / o.alignment * o.alignment;
  if (size == 0) return absl::InvalidArgumentError("HBM capacity below one allocation unit");
  auto base = a->Allocate(size);
  if (!base.ok()) return base.status();
  void* b = *base;
  auto mem = std::make_unique<DeviceMemory>(std::move(a), b, size);
  return std::unique_ptr<HbmTier>(new HbmTier(std::move(mem), o.alignment, b));
}

}  // namespace kvtier::tiering
