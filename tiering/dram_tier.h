// DRAM tier: a host memory pool in one shared-memory region (memfd), so the
// daemon can map it into client processes and clients read and write chunk
// bytes in place by slot offset.
#ifndef KVTIER_TIERING_DRAM_TIER_H_
#define KVTIER_TIERING_DRAM_TIER_H_

#include <functional>
#include <memory>

#include "tiering/pool_tier.h"

namespace kvtier::tiering {

struct DramTierOptions {
  // Pool size in bytes; the hard capacity of the tier. Default: 1 GiB
  uint64_t capacity_bytes = uint64_t{1} << 30;
  // Allocation unit and alignment of every chunk in the pool. Default: 4096
  uint64_t alignment = 4096;
  // Allocate and map every page writable at startup (MADV_POPULATE_WRITE,
  // or a write per page on older kernels) so puts do not page-fault.
  // Default: true
  bool populate = true;
  // Called once with the pool's address and size, e.g. to register it with
  // CUDA (cudaHostRegister) so GPU copies from it are DMA. An error fails
  // Open. Default: none
  std::function<absl::Status(void* base, uint64_t size)> register_memory;
  // Account objects and slots without memory behind them (trace replay and
  // capacity planning, where a tier of hundreds of GiB holds no bytes): no
  // memfd (shm_fd() is -1), and base() is an inaccessible address
  // reservation (PROT_NONE, no swap reserved), so offsets are addresses
  // that fault if touched. Puts discard their bytes, reads leave the
  // caller's buffer as it is, and `populate` and `register_memory` are
  // ignored. Default: false
  bool metadata_only = false;
};

// Thread-safe. The region stays mapped until the tier is destroyed.
class DramTier : public PoolTier {
 public:
  // FailedPrecondition/ResourceExhausted if the region cannot be created.
  static absl::StatusOr<std::unique_ptr<DramTier>> Open(const DramTierOptions& options);
  ~DramTier() override;

  TierCapabilities capabilities() const override {
    return TierCapabilities{.shared_memory = fd_ >= 0};  // a metadata-only pool has no memfd
  }

  // The memfd of the pool (-1 for a metadata-only tier; owned by the tier; dup it to pass it to another
  // process over SCM_RIGHTS) and its size. Offsets of PoolExtent are
  // offsets into this file. It is sealed with F_SEAL_SHRINK | F_SEAL_GROW |
  // F_SEAL_SEAL: no holder of the descriptor can change its size or its
  // seals, and it stays writable and mappable MAP_SHARED read-write.
  int shm_fd() const { return fd_; }
  uint64_t shm_size() const { return size_; }
  // The pool mapped in this process.
  uint8_t* base() const { return base_; }

 private:
  DramTier(int fd, uint8_t* base, uint64_t size, std::unique_ptr<PoolMemory> mem,
           uint64_t alignment);
  int fd_;
  uint8_t* base_;
  uint64_t size_;
};

}  // namespace kvtier::tiering

#endif  // KVTIER_TIERING_DRAM_TIER_H_
