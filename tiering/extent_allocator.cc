#include "tiering/extent_allocator.h"

#include <algorithm>

namespace kvtier::tiering {

ExtentAllocator::ExtentAllocator(uint64_t size, uint64_t align, bool all_free)
    : size_(size / align * align), align_(align) {
  if (size_ > 0 && all_free) free_[0] = size_;
}

std::optional<uint64_t> ExtentAllocator::Allocate(uint64_t len) {
  len = Rounded(std::max<uint64_t>(len, 1));
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    if (it->second < len) continue;
    uint64_t off = it->first;
    uint64_t rest = it->second - len;
    free_.erase(it);
    if (rest > 0) free_[off + len] = rest;
    used_ += len;
    return off;
  }
  return std::nullopt;
}

bool ExtentAllocator::MarkUsed(uint64_t offset, uint64_t len) {
  len = Rounded(std::max<uint64_t>(len, 1));
  if (offset % align_ != 0 || offset + len > size_) return false;
  auto it = free_.upper_bound(offset);
  if (it == free_.begin()) return false;
  --it;
  uint64_t fo = it->first, fl = it->second;
  if (offset + len > fo + fl) return false;
  free_.erase(it);
  if (offset > fo) free_[fo] = offset - fo;
  if (fo + fl > offset + len) free_[offset + len] = fo + fl - (offset + len);
  used_ += len;
  return true;
}

void ExtentAllocator::Free(uint64_t offset, uint64_t len) {
  len = Rounded(std::max<uint64_t>(len, 1));
  used_ -= len;
  auto fenced = [this](uint64_t at) { return fence_ != 0 && at % fence_ == 0; };
  auto next = free_.lower_bound(offset);
  if (next != free_.end() && offset + len == next->first && !fenced(next->first)) {
    len += next->second;
    next = free_.erase(next);
  }
  if (next != free_.begin() && !fenced(offset)) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == offset) {
      prev->second += len;
      return;
    }
  }
  free_[offset] = len;
}

void ExtentAllocator::AddFree(uint64_t offset, uint64_t len) {
  used_ += Rounded(std::max<uint64_t>(len, 1));  // Free takes it back off
  Free(offset, len);
}

uint64_t ExtentAllocator::largest_free() const {
  uint64_t m = 0;
  for (auto& [o, l] : free_) m = std::max(m, l);
  return m;
}

}  // namespace kvtier::tiering
