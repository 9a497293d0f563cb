// DRAM tier: a host memory pool in one shared-memory region (memfd), so the
// daemon can map it into client processes and clients read and write chunk
// bytes in place by slot offset.
#ifndef KVTIER_TIERING_DRAM_TIER_H_
#define KVTIER_TIERING_DRAM_TIER_H_

#include <functional>
#include <memory>

#include "tiering/pool_tier.h"

namespace kvtier::tiering {

// How the population of a DRAM pool behind DramTier::Open ended.
struct DramPopulateReport {
  uint64_t ready_bytes = 0;  // allocatable now: the whole pool unless `status` is an error
  uint64_t pool_bytes = 0;
  double seconds = 0;        // from the start of Open
  absl::Status status;       // the first error of populating or registering a piece
};

struct DramTierOptions {
  // Pool size in bytes; the hard capacity of the tier. Default: 1 GiB
  uint64_t capacity_bytes = uint64_t{1} << 30;
  // Allocation unit and alignment of every chunk in the pool. Default: 4096
  uint64_t alignment = 4096;
  // Allocate and map every page writable (MADV_POPULATE_WRITE, or a write
  // per page on older kernels) so puts do not page-fault. Open populates the
  // first piece (populate_piece_bytes) and returns; threads populate the
  // rest behind it, and the allocator hands out space only in pieces that
  // are populated (ready_bytes() grows to capacity_bytes()). Default: true
  bool populate = true;
  // Size of a piece of the pool that is populated, registered and made
  // allocatable at once; rounded up to the alignment. Default: 256 MiB
  uint64_t populate_piece_bytes = uint64_t{256} << 20;
  // Threads that populate the pool behind Open. Default: 2
  int populate_threads = 2;
  // Called once per piece with its address and size, after the piece is
  // populated (when `populate`) and before any of it is handed out, e.g. to
  // register it with CUDA (cudaHostRegister) so GPU copies from it are DMA.
  // When set, no object spans two pieces, so every copy lies inside one
  // registration, and the largest object is a piece. An error on the
  // first piece fails Open; on a later one it stops the population (the
  // pieces made ready so far stay) and is reported to `on_populated`.
  // Called from the tier's threads; must be thread-safe. Default: none
  std::function<absl::Status(void* base, uint64_t size)> register_memory;
  // Called once, from one of the tier's threads, when every piece is ready
  // or population stopped at an error; not called when the tier is
  // destroyed first, nor when Open makes the whole pool ready itself
  // (neither `populate` nor `register_memory`). Default: none
  std::function<void(const DramPopulateReport&)> on_populated;
  // Account objects and slots without memory behind them (trace replay and
  // capacity planning, where a tier of hundreds of GiB holds no bytes): no
  // memfd (shm_fd() is -1), and base() is an inaccessible address
  // reservation (PROT_NONE, no swap reserved), so offsets are addresses
  // that fault if touched. Puts discard their bytes, reads leave the
  // caller's buffer as it is, and `populate` and `register_memory` are
  // ignored. Default: false
  bool metadata_only = false;
  // Back the pool with the kernel's huge pages (memfd MFD_HUGETLB: 2 MiB on
  // x86-64), rounding the capacity down to whole huge pages. A reader's
  // O_DIRECT read into the pool then pins one page per 2 MiB instead of 512,
  // and a CUDA registration maps fewer pages. The pages come from the
  // hugetlb pool the administrator reserved (vm.nr_hugepages): Open fails
  // with ResourceExhausted, saying how many it needs and how many are free,
  // when there are not enough. Default: false
  bool huge_pages = false;
};

// Thread-safe. The region stays mapped until the tier is destroyed; the
// destructor stops the population threads and waits for them (each finishes
// the piece it is on).
class DramTier : public PoolTier {
 public:
  // FailedPrecondition/ResourceExhausted if the region cannot be created;
  // register_memory's error if the first piece cannot be registered.
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
  struct Populator;
  DramTier(int fd, uint8_t* base, uint64_t size, std::unique_ptr<PoolMemory> mem,
           uint64_t alignment);
  DramTier(int fd, uint8_t* base, uint64_t size, std::unique_ptr<PoolMemory> mem,
           uint64_t alignment, Pieces pieces);
  // Populates and registers piece `i`, then makes it allocatable.
  absl::Status PreparePiece(uint64_t i);
  void PopulateLoop();

  int fd_;
  uint8_t* base_;
  uint64_t size_;
  std::unique_ptr<Populator> populator_;  // null when the whole pool was ready at Open
};

}  // namespace kvtier::tiering

#endif  // KVTIER_TIERING_DRAM_TIER_H_
