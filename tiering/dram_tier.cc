#include "tiering/dram_tier.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>

#include "common/file.h"
#include "common/status.h"

namespace kvtier::tiering {
namespace {

class HostMemory : public PoolMemory {
 public:
  HostMemory(uint8_t* base, uint64_t size) : base_(base), size_(size) {}
  uint64_t size() const override { return size_; }
  absl::Status CopyIn(uint64_t offset, std::span<const uint8_t> src) override {
    std::memcpy(base_ + offset, src.data(), src.size());
    return absl::OkStatus();
  }
  absl::Status CopyOut(uint64_t offset, std::span<uint8_t> dst) override {
    std::memcpy(dst.data(), base_ + offset, dst.size());
    return absl::OkStatus();
  }

 private:
  uint8_t* base_;
  uint64_t size_;
};

// Allocates every page of the pool and maps it writable now, so puts do not
// take page faults. MAP_POPULATE is weaker: on a shared mapping the kernel
// prefaults for reading only (mm/gup.c, populate_vma_page_range), which
// leaves any write-fault work to the first put.
void PrefaultForWrite(uint8_t* base, uint64_t size) {
#ifdef MADV_POPULATE_WRITE
  if (madvise(base, size, MADV_POPULATE_WRITE) == 0) return;
#endif
  // Kernels before 5.14: touch each page (the pool holds no data yet).
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  for (uint64_t off = 0; off < size; off += page) {
    *reinterpret_cast<volatile uint8_t*>(base + off) = 0;
  }
}

}  // namespace

absl::StatusOr<std::unique_ptr<DramTier>> DramTier::Open(const DramTierOptions& o) {
  if (o.alignment == 0 || (o.alignment & (o.alignment - 1)) != 0) {
    return absl::InvalidArgumentError("alignment must be a power of two");
  }
  const uint64_t size = o.capacity_bytes / o.alignment * o.alignment;
  if (size == 0) return absl::InvalidArgumentError("DRAM capacity below one allocation unit");
  if (o.metadata_only) {
    void* p = mmap(nullptr, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) return ErrnoToStatus(errno, "mmap(PROT_NONE reservation)");
    return std::unique_ptr<DramTier>(new DramTier(-1, static_cast<uint8_t*>(p), size,
                                                  NewMetadataOnlyMemory(size), o.alignment));
  }
  int fd = memfd_create("kvtier-dram", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) return ErrnoToStatus(errno, "memfd_create");
  if (ftruncate(fd, static_cast<off_t>(size)) != 0) {
    int e = errno;
    close(fd);
    return ErrnoToStatus(e, "ftruncate(memfd)");
  }
  // Every same-host client receives this descriptor. Unsealed, one that
  // truncated it would make every mapping of the cut pages fault (SIGBUS),
  // the daemon's included. The size seals leave shared writable mappings
  // (and CUDA's registration of them) working; F_SEAL_SEAL stops a client
  // from adding a seal that would not (F_SEAL_FUTURE_WRITE).
  if (fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    int e = errno;
    close(fd);
    return ErrnoToStatus(e, "fcntl(memfd, F_ADD_SEALS)");
  }
  void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    int e = errno;
    close(fd);
    return ErrnoToStatus(e, "mmap(memfd)");
  }
  auto* base = static_cast<uint8_t*>(p);
  if (o.populate) PrefaultForWrite(base, size);
  if (o.register_memory) {
    absl::Status st = o.register_memory(base, size);
    if (!st.ok()) {
      munmap(p, size);
      close(fd);
      return st;
    }
  }
  return std::unique_ptr<DramTier>(
      new DramTier(fd, base, size, std::make_unique<HostMemory>(base, size), o.alignment));
}

DramTier::DramTier(int fd, uint8_t* base, uint64_t size, std::unique_ptr<PoolMemory> mem,
                   uint64_t alignment)
    : PoolTier(TierKind::kDram, std::move(mem), alignment), fd_(fd), base_(base), size_(size) {}

DramTier::~DramTier() {
  munmap(base_, size_);
  if (fd_ >= 0) close(fd_);
}

}  // namespace kvtier::tiering
