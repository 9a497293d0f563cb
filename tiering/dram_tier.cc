#include "tiering/dram_tier.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"
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

// The free pages of the kernel's hugetlb pool (/proc/meminfo), for errors.
std::string FreeHugePages() {
  std::ifstream in("/proc/meminfo");
  std::string line;
  while (std::getline(in, line)) {
    absl::string_view v = line;
    uint64_t n = 0;
    if (absl::ConsumePrefix(&v, "HugePages_Free:") &&
        absl::SimpleAtoi(absl::StripAsciiWhitespace(v), &n)) {
      return std::to_string(n);
    }
  }
  return "an unknown number";
}

}  // namespace

// The pieces of a pool still to populate, and the threads that do it.
struct DramTier::Populator {
  bool populate = false;
  std::function<absl::Status(void*, uint64_t)> register_memory;
  std::function<void(const DramPopulateReport&)> on_populated;
  uint64_t piece_bytes = 0;
  uint64_t pieces = 0;
  std::chrono::steady_clock::time_point start;
  std::atomic<uint64_t> next{1};      // piece 0 is Open's
  std::atomic<bool> stop{false};      // an error, or the destructor
  std::atomic<bool> closing{false};   // the destructor: no report
  std::atomic<int> running{0};
  absl::Mutex mu;
  absl::Status first_error ABSL_GUARDED_BY(mu);
  std::vector<std::thread> threads;
};

absl::StatusOr<std::unique_ptr<DramTier>> DramTier::Open(const DramTierOptions& o) {
  const auto start = std::chrono::steady_clock::now();
  if (o.alignment == 0 || (o.alignment & (o.alignment - 1)) != 0) {
    return absl::InvalidArgumentError("alignment must be a power of two");
  }
  if (o.populate_threads < 1) return absl::InvalidArgumentError("populate_threads must be at least 1");
  uint64_t size = o.capacity_bytes / o.alignment * o.alignment;
  if (size == 0) return absl::InvalidArgumentError("DRAM capacity below one allocation unit");
  if (o.metadata_only) {
    void* p = mmap(nullptr, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) return ErrnoToStatus(errno, "mmap(PROT_NONE reservation)");
    return std::unique_ptr<DramTier>(new DramTier(-1, static_cast<uint8_t*>(p), size,
                                                  NewMetadataOnlyMemory(size), o.alignment));
  }
  int fd = memfd_create("kvtier-dram",
                        MFD_CLOEXEC | MFD_ALLOW_SEALING | (o.huge_pages ? MFD_HUGETLB : 0));
  if (fd < 0) {
    return ErrnoToStatus(errno, o.huge_pages ? "memfd_create(MFD_HUGETLB)" : "memfd_create");
  }
  // The unit the pool is made of: a huge page, or a page.
  uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  if (o.huge_pages) {
    struct stat st {};
    if (fstat(fd, &st) != 0) {
      int e = errno;
      close(fd);
      return ErrnoToStatus(e, "fstat(hugetlb memfd)");
    }
    page = static_cast<uint64_t>(st.st_blksize);  // hugetlbfs: the huge page size
    size = size / page * page;
    if (size == 0 || page % o.alignment != 0) {
      close(fd);
      return absl::InvalidArgumentError(absl::StrCat(
          "a DRAM pool of huge pages needs at least one ", page >> 20, " MiB page and an "
          "alignment that divides it (capacity ", o.capacity_bytes, " bytes, alignment ",
          o.alignment, ")"));
    }
  }
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
    if (o.huge_pages && e == ENOMEM) {
      // A shared hugetlb mapping reserves its pages at mmap.
      return absl::ResourceExhaustedError(absl::StrCat(
          "a DRAM pool of huge pages needs ", size / page, " free ", page >> 20,
          " MiB pages; the kernel's hugetlb pool has ", FreeHugePages(), " (vm.nr_hugepages)"));
    }
    return ErrnoToStatus(e, "mmap(memfd)");
  }
  auto* base = static_cast<uint8_t*>(p);
  auto mem = std::make_unique<HostMemory>(base, size);
  if (!o.populate && !o.register_memory) {
    return std::unique_ptr<DramTier>(new DramTier(fd, base, size, std::move(mem), o.alignment));
  }
  // Pieces are whole pages (madvise) and whole allocation units.
  const uint64_t unit = std::max<uint64_t>(o.alignment, page);
  const uint64_t piece = (std::max<uint64_t>(o.populate_piece_bytes, 1) + unit - 1) / unit * unit;
  std::unique_ptr<DramTier> t(new DramTier(
      fd, base, size, std::move(mem), o.alignment,
      Pieces{.piece_bytes = piece, .fenced = o.register_memory != nullptr}));
  auto pop = std::make_unique<Populator>();
  pop->populate = o.populate;
  pop->register_memory = o.register_memory;
  pop->on_populated = o.on_populated;
  pop->piece_bytes = piece;
  pop->pieces = (size + piece - 1) / piece;
  pop->start = start;
  t->populator_ = std::move(pop);
  // The first piece now, so the tier has room once Open returns.
  KVTIER_RETURN_IF_ERROR(t->PreparePiece(0));
  Populator& q = *t->populator_;
  const int threads = static_cast<int>(
      std::clamp<uint64_t>(static_cast<uint64_t>(o.populate_threads), 1, std::max<uint64_t>(q.pieces - 1, 1)));
  q.running = threads;
  for (int i = 0; i < threads; ++i) q.threads.emplace_back([tier = t.get()] { tier->PopulateLoop(); });
  return t;
}

absl::Status DramTier::PreparePiece(uint64_t i) {
  const Populator& q = *populator_;
  const uint64_t off = i * q.piece_bytes;
  const uint64_t len = std::min(q.piece_bytes, size_ - off);
  if (q.populate) PrefaultForWrite(base_ + off, len);
  if (q.register_memory) KVTIER_RETURN_IF_ERROR(q.register_memory(base_ + off, len));
  MakeReady(off, len);
  return absl::OkStatus();
}

void DramTier::PopulateLoop() {
  Populator& q = *populator_;
  while (!q.stop.load(std::memory_order_acquire)) {
    const uint64_t i = q.next.fetch_add(1);
    if (i >= q.pieces) break;
    absl::Status st = PreparePiece(i);
    if (!st.ok()) {
      absl::MutexLock l(&q.mu);
      if (q.first_error.ok()) q.first_error = std::move(st);
      q.stop.store(true, std::memory_order_release);
    }
  }
  if (q.running.fetch_sub(1) != 1 || q.closing.load() || !q.on_populated) return;
  DramPopulateReport r;
  r.ready_bytes = ready_bytes();
  r.pool_bytes = size_;
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - q.start).count();
  {
    absl::MutexLock l(&q.mu);
    r.status = q.first_error;
  }
  q.on_populated(r);
}

DramTier::DramTier(int fd, uint8_t* base, uint64_t size, std::unique_ptr<PoolMemory> mem,
                   uint64_t alignment)
    : PoolTier(TierKind::kDram, std::move(mem), alignment), fd_(fd), base_(base), size_(size) {}

DramTier::DramTier(int fd, uint8_t* base, uint64_t size, std::unique_ptr<PoolMemory> mem,
                   uint64_t alignment, Pieces pieces)
    : PoolTier(TierKind::kDram, std::move(mem), alignment, pieces), fd_(fd), base_(base), size_(size) {}

DramTier::~DramTier() {
  if (populator_) {
    populator_->closing.store(true);
    populator_->stop.store(true, std::memory_order_release);
    for (std::thread& th : populator_->threads) th.join();
  }
  munmap(base_, size_);
  if (fd_ >= 0) close(fd_);
}

}  // namespace kvtier::tiering
