// First-fit allocator of byte ranges in a fixed-size space (the DRAM/HBM
// pools and the NVMe data file share it). Free ranges coalesce on release, so
// space is reclaimed without growing the space. Not thread-safe: the owning
// tier serializes calls under its mutex.
#ifndef KVTIER_TIERING_EXTENT_ALLOCATOR_H_
#define KVTIER_TIERING_EXTENT_ALLOCATOR_H_

#include <cstdint>
#include <map>
#include <optional>

namespace kvtier::tiering {

class ExtentAllocator {
 public:
  // Manages [0, size) in units of `align` bytes (sizes are rounded up).
  // With `all_free` false nothing is free until AddFree hands ranges over
  // (a pool whose memory becomes usable piece by piece).
  ExtentAllocator(uint64_t size, uint64_t align, bool all_free = true);

  // Free ranges never merge across a multiple of `fence`, so no allocation
  // spans one (the pieces of a pool registered one by one with a device).
  // 0: no fences. REQUIRES: a multiple of the alignment; called before any
  // range is free.
  void set_fence(uint64_t fence) { fence_ = fence; }
  uint64_t fence() const { return fence_; }

  // Returns the offset of a free range of at least `len` bytes (rounded up to
  // the alignment), or nullopt if no contiguous range is large enough.
  std::optional<uint64_t> Allocate(uint64_t len);
  // Marks [offset, offset+len) as used (recovery from an index). False if
  // any part of it is not free or it lies outside the space.
  bool MarkUsed(uint64_t offset, uint64_t len);
  // Returns a range from Allocate/MarkUsed to the free pool.
  void Free(uint64_t offset, uint64_t len);
  // Makes [offset, offset+len), held back since construction, free.
  // REQUIRES: it lies inside the space, is aligned and was never free.
  void AddFree(uint64_t offset, uint64_t len);

  uint64_t Rounded(uint64_t len) const { return (len + align_ - 1) / align_ * align_; }
  uint64_t size() const { return size_; }
  uint64_t used() const { return used_; }
  uint64_t largest_free() const;

 private:
  const uint64_t size_;
  const uint64_t align_;
  uint64_t fence_ = 0;
  uint64_t used_ = 0;
  std::map<uint64_t, uint64_t> free_;  // offset -> length
};

}  // namespace kvtier::tiering

#endif  // KVTIER_TIERING_EXTENT_ALLOCATOR_H_
