// DramTier's shared-memory pool: the memfd's size is sealed, so a process
// that holds the descriptor (every same-host client does) cannot shrink the
// pool under the daemon's and the other clients' mappings. Also the
// metadata-only tiers (DramTierOptions::metadata_only, NewMetadataTier),
// and a pool populated in pieces behind Open (DramTierOptions::populate).
#include "tiering/dram_tier.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <fstream>
#include <string>
#include <utility>
#include <set>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "common/hash.h"
#include "gtest/gtest.h"
#include "tiering/pool_tier.h"

namespace kvtier::tiering {
namespace {

constexpr uint64_t kPoolBytes = 1 << 20;

DramTierOptions SmallPool() {
  DramTierOptions o;
  o.capacity_bytes = kPoolBytes;
  o.populate = false;
  return o;
}

std::vector<uint8_t> Pattern(uint64_t n, uint8_t seed) {
  std::vector<uint8_t> b(n);
  for (uint64_t i = 0; i < n; ++i) b[i] = static_cast<uint8_t>(seed + i * 13);
  return b;
}

TEST(DramTier, PoolSizeIsSealedAndTheSealsCannotChange) {
  auto tier = DramTier::Open(SmallPool());
  ASSERT_TRUE(tier.ok()) << tier.status();
  const int fd = (*tier)->shm_fd();
  EXPECT_EQ(::fcntl(fd, F_GET_SEALS), F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL);
  // No write seal: clients and the daemon write the pool through shared
  // writable mappings, and CUDA registers them.
  EXPECT_EQ(::fcntl(fd, F_ADD_SEALS, F_SEAL_WRITE), -1);
  EXPECT_EQ(errno, EPERM);
  EXPECT_EQ(::fcntl(fd, F_ADD_SEALS, F_SEAL_FUTURE_WRITE), -1);
  EXPECT_EQ(errno, EPERM);
  EXPECT_EQ(::fcntl(fd, F_GET_SEALS), F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL);
}

// The free pages of the kernel's hugetlb pool and their size (/proc/meminfo).
std::pair<uint64_t, uint64_t> FreeHugePages() {
  std::ifstream in("/proc/meminfo");
  std::string name;
  uint64_t free = 0, kib = 0;
  while (in >> name) {
    if (name == "HugePages_Free:") in >> free;
    if (name == "Hugepagesize:") in >> kib;
    in.ignore(1 << 10, '\n');
  }
  return {free, kib << 10};
}

TEST(DramTier, HugePagesBeyondTheFreeOnesAreResourceExhaustedWithTheCounts) {
  const auto [free, page] = FreeHugePages();
  if (page == 0) GTEST_SKIP() << "no hugetlb support";
  DramTierOptions o = SmallPool();
  o.huge_pages = true;
  o.capacity_bytes = (free + 1) * page;
  auto tier = DramTier::Open(o);
  ASSERT_EQ(tier.status().code(), absl::StatusCode::kResourceExhausted) << tier.status();
  EXPECT_NE(tier.status().message().find("needs " + std::to_string(free + 1) + " free"),
            std::string::npos)
      << tier.status();
  EXPECT_NE(tier.status().message().find("vm.nr_hugepages"), std::string::npos) << tier.status();
  o.capacity_bytes = page - 1;  // less than one huge page
  EXPECT_EQ(DramTier::Open(o).status().code(), absl::StatusCode::kInvalidArgument);
}

// Runs where the administrator reserved huge pages (vm.nr_hugepages >= 3).
TEST(DramTier, HugePagePoolIsSealedRoundedAndServesObjects) {
  const auto [free, page] = FreeHugePages();
  if (free < 3) GTEST_SKIP() << "fewer than 3 free huge pages (vm.nr_hugepages)";
  DramTierOptions o;
  o.huge_pages = true;
  o.capacity_bytes = 2 * page + page / 2;  // rounded down to 2 pages
  o.populate_piece_bytes = page / 4;       // rounded up to a page
  auto tier = DramTier::Open(o);
  ASSERT_TRUE(tier.ok()) << tier.status();
  DramTier& t = **tier;
  EXPECT_EQ(t.shm_size(), 2 * page);
  struct stat st;
  ASSERT_EQ(::fstat(t.shm_fd(), &st), 0);
  EXPECT_EQ(static_cast<uint64_t>(st.st_blksize), page);
  EXPECT_EQ(::fcntl(t.shm_fd(), F_GET_SEALS), F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL);
  const std::vector<uint8_t> stored = Pattern(page + 12345, 3);
  const ObjectKey id{Hash128::Of("dram-huge", 1)};
  for (int i = 0; i < 2000 && t.ready_bytes() < t.capacity_bytes(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ASSERT_TRUE(t.Put(id, stored).ok());
  std::vector<uint8_t> out(stored.size());
  ASSERT_TRUE(t.Read(id, out).ok());
  EXPECT_EQ(out, stored);
  // A client maps the descriptor it receives, in whole huge pages.
  void* p = ::mmap(nullptr, t.shm_size(), PROT_READ, MAP_SHARED, t.shm_fd(), 0);
  ASSERT_NE(p, MAP_FAILED) << std::strerror(errno);
  ::munmap(p, t.shm_size());
}

// What a client could do with the descriptor it receives over SCM_RIGHTS:
// truncating it would make every mapping of the cut pages fault (SIGBUS).
TEST(DramTier, TruncatingThePoolFailsAndLeavesItsBytes) {
  auto tier = DramTier::Open(SmallPool());
  ASSERT_TRUE(tier.ok()) << tier.status();
  DramTier& t = **tier;
  ASSERT_EQ(t.shm_size(), kPoolBytes);
  const ObjectKey id{Hash128::Of("dram-seal", 1)};
  const std::vector<uint8_t> stored = Pattern(kPoolBytes / 2, 7);
  ASSERT_TRUE(t.Put(id, stored).ok());
  // The descriptor as a client holds it: another open of the same file.
  const int client_fd = ::fcntl(t.shm_fd(), F_DUPFD_CLOEXEC, 0);
  ASSERT_GE(client_fd, 0);
  for (off_t size : {off_t{0}, off_t{kPoolBytes / 2}, off_t{kPoolBytes * 2}}) {
    const int rc = ::ftruncate(client_fd, size);
    const int err = errno;
    // Where it went through, restore the size (cut pages come back zeroed),
    // so that the checks below report the loss instead of dying of SIGBUS.
    if (rc == 0) (void)!::ftruncate(client_fd, kPoolBytes);
    EXPECT_EQ(rc, -1) << size;
    EXPECT_EQ(err, EPERM) << size;
  }
  EXPECT_EQ(::fallocate(client_fd, 0, 0, kPoolBytes * 2), -1);
  EXPECT_EQ(errno, EPERM);
  struct stat st;
  ASSERT_EQ(::fstat(client_fd, &st), 0);
  EXPECT_EQ(static_cast<uint64_t>(st.st_size), kPoolBytes);
  // The daemon's mapping still reads the object, and the last page of the
  // pool is still there for a client's new mapping.
  std::vector<uint8_t> out(stored.size());
  ASSERT_TRUE(t.Read(id, out).ok());
  EXPECT_EQ(out, stored);
  void* p = ::mmap(nullptr, kPoolBytes, PROT_READ | PROT_WRITE, MAP_SHARED, client_fd, 0);
  ASSERT_NE(p, MAP_FAILED) << std::strerror(errno);
  auto* client_view = static_cast<volatile uint8_t*>(p);
  client_view[kPoolBytes - 1] = 0x5a;
  EXPECT_EQ(t.base()[kPoolBytes - 1], 0x5a);
  ::munmap(p, kPoolBytes);
  ::close(client_fd);
}

ObjectKey Obj(int i) { return {Hash128::Of(std::string_view("obj"), static_cast<uint64_t>(i)), Part::kWhole}; }

TEST(DramTier, MetadataOnlyAccountsTerabytesWithoutMemory) {
  DramTierOptions o;
  o.capacity_bytes = uint64_t{4} << 40;  // 4 TiB: far beyond this machine
  o.metadata_only = true;
  auto tier = DramTier::Open(o);
  ASSERT_TRUE(tier.ok()) << tier.status();
  DramTier& t = **tier;
  EXPECT_EQ(t.shm_fd(), -1);
  EXPECT_FALSE(t.capabilities().shared_memory);
  EXPECT_EQ(t.capacity_bytes(), uint64_t{4} << 40);
  // 1 TiB objects whose bytes are the pool's own inaccessible reservation:
  // a put that touched them would fault.
  const uint64_t tib = uint64_t{1} << 40;
  std::vector<uint8_t> page = Pattern(4096, 1);
  std::span<const uint8_t> huge(t.base(), tib);
  for (int i = 0; i < 4; ++i) ASSERT_TRUE(t.Put(Obj(i), huge).ok()) << i;
  EXPECT_EQ(t.used_bytes(), 4 * tib);
  absl::Status full = t.Put(Obj(4), huge);
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(IsTierFull(full));
  EXPECT_EQ(t.Size(Obj(2)).value(), tib);
  ASSERT_TRUE(t.Erase(Obj(2)).ok());
  EXPECT_EQ(t.used_bytes(), 3 * tib);
  EXPECT_EQ(t.Erase(Obj(2)).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(t.List().size(), 3u);
  // Reads leave the caller's buffer as it is.
  std::vector<uint8_t> out = Pattern(4096, 7);
  ASSERT_TRUE(t.Put(Obj(9), std::span<const uint8_t>(page.data(), 4096)).ok());
  ASSERT_TRUE(t.Read(Obj(9), out).ok());
  EXPECT_EQ(out, Pattern(4096, 7));
  EXPECT_EQ(t.Read(Obj(9), std::span<uint8_t>(out.data(), 100)).code(), absl::StatusCode::kInvalidArgument);
}

TEST(MetadataTier, HasTheKindAndCapacityItStandsFor) {
  auto t = NewMetadataTier(TierKind::kNvme, (uint64_t{1} << 30) + 100, 4096);
  EXPECT_EQ(t->kind(), TierKind::kNvme);
  EXPECT_EQ(t->capacity_bytes(), uint64_t{1} << 30);  // whole allocation units
  EXPECT_FALSE(t->capabilities().durable);
  std::vector<uint8_t> b(5000);
  ASSERT_TRUE(t->Put(Obj(1), b).ok());
  EXPECT_EQ(t->used_bytes(), 8192u);  // rounded to the unit
  EXPECT_TRUE(t->Flush().ok());
  EXPECT_EQ(t->Read(Obj(2), b).code(), absl::StatusCode::kNotFound);
}

// --- A pool populated behind Open.

constexpr uint64_t kMiB = 1 << 20;

// Watches a pool's population through register_memory (called per piece
// after its pages are populated and before it is handed out) and
// on_populated. Pieces from `gate_from` on wait for Release.
struct PopulationWatch {
  uint64_t piece_bytes = 0;
  uint64_t gate_from = UINT64_MAX;
  uint64_t fail_piece = UINT64_MAX;
  uint8_t* base = nullptr;  // set by the first call
  absl::Mutex mu;
  std::set<uint64_t> registered ABSL_GUARDED_BY(mu);
  std::atomic<int> reports{0};
  DramPopulateReport report;
  absl::Notification released, finished;

  void Attach(DramTierOptions& o) {
    o.populate_piece_bytes = piece_bytes;
    o.register_memory = [this](void* p, uint64_t size) -> absl::Status {
      auto* at = static_cast<uint8_t*>(p);
      uint64_t i;
      {
        absl::MutexLock l(&mu);
        if (base == nullptr) base = at;  // piece 0 comes first, from Open
        i = static_cast<uint64_t>(at - base) / piece_bytes;
      }
      if (size == 0 || size > piece_bytes) return absl::InternalError("not a piece");
      if (i >= gate_from) released.WaitForNotification();
      if (i == fail_piece) return absl::InternalError("registration refused");
      absl::MutexLock l(&mu);
      registered.insert(i);
      return absl::OkStatus();
    };
    o.on_populated = [this](const DramPopulateReport& r) {
      report = r;
      reports.fetch_add(1);
      finished.Notify();
    };
  }
  bool Registered(uint64_t piece) {
    absl::MutexLock l(&mu);
    return registered.count(piece) != 0;
  }
};

DramTierOptions PopulatedPool(uint64_t bytes) {
  DramTierOptions o;
  o.capacity_bytes = bytes;
  o.populate = true;
  o.populate_threads = 2;
  return o;
}

TEST(DramTier, PopulatedPoolServesOnlyReadyPiecesAndGrowsToTheWholePool) {
  PopulationWatch w;
  w.piece_bytes = 32 * kMiB;
  w.gate_from = 2;  // pieces 0 and 1 only, until released
  DramTierOptions o = PopulatedPool(320 * kMiB);
  w.Attach(o);
  auto tier = DramTier::Open(o);
  ASSERT_TRUE(tier.ok()) << tier.status();
  DramTier& t = **tier;
  EXPECT_EQ(t.capacity_bytes(), 320 * kMiB);
  // Open returned with piece 0 ready; piece 1 follows, the rest wait.
  for (int i = 0; i < 2000 && t.ready_bytes() < 64 * kMiB; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ASSERT_EQ(t.ready_bytes(), 64 * kMiB);
  // Puts fill the ready pieces, never the others, and then find the tier full.
  const std::vector<uint8_t> obj = Pattern(3 * kMiB, 3);
  int stored = 0;
  absl::Status st;
  for (; stored < 100; ++stored) {
    st = t.Put(Obj(stored), obj);
    if (!st.ok()) break;
  }
  EXPECT_EQ(stored, 20);  // 10 objects of 3 MiB in each 32 MiB piece
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(IsTierFull(st)) << st;
  EXPECT_LE(t.used_bytes(), t.ready_bytes());
  w.released.Notify();
  // While the rest is populated, puts and gets go on, each object inside one
  // piece that was populated and registered before it was handed out.
  for (int i = stored; i < 100; ++i) {
    st = t.Put(Obj(i), Pattern(3 * kMiB, static_cast<uint8_t>(i)));
    if (IsTierFull(st)) {
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
      --i;
      continue;
    }
    ASSERT_TRUE(st.ok()) << st;
  }
  for (int i = 0; i < 100; ++i) {
    auto ext = t.AcquireRef(Obj(i));
    ASSERT_TRUE(ext.ok()) << ext.status();
    const uint64_t piece = ext->offset / w.piece_bytes;
    EXPECT_EQ((ext->offset + ext->length - 1) / w.piece_bytes, piece) << i;
    EXPECT_TRUE(w.Registered(piece)) << i;
    std::vector<uint8_t> out(ext->length);
    t.ReleaseRef(*ext);
    ASSERT_TRUE(t.Read(Obj(i), out).ok());
    EXPECT_EQ(out, i < stored ? obj : Pattern(3 * kMiB, static_cast<uint8_t>(i))) << i;
  }
  ASSERT_TRUE(w.finished.WaitForNotificationWithTimeout(absl::Seconds(60)));
  EXPECT_EQ(w.reports.load(), 1);
  EXPECT_TRUE(w.report.status.ok()) << w.report.status;
  EXPECT_EQ(w.report.ready_bytes, 320 * kMiB);
  EXPECT_EQ(w.report.pool_bytes, 320 * kMiB);
  EXPECT_GT(w.report.seconds, 0);
  EXPECT_EQ(t.ready_bytes(), t.capacity_bytes());
  for (uint64_t p = 0; p < 10; ++p) EXPECT_TRUE(w.Registered(p)) << p;
}

TEST(DramTier, PopulatedPoolWithoutRegistrationIsUsableAtOnce) {
  DramTierOptions o = PopulatedPool(256 * kMiB);
  o.populate_piece_bytes = 64 * kMiB;
  absl::Notification done;
  o.on_populated = [&](const DramPopulateReport&) { done.Notify(); };
  auto tier = DramTier::Open(o);
  ASSERT_TRUE(tier.ok()) << tier.status();
  DramTier& t = **tier;
  EXPECT_GE(t.ready_bytes(), 64 * kMiB);
  const std::vector<uint8_t> obj = Pattern(kMiB, 9);
  ASSERT_TRUE(t.Put(Obj(1), obj).ok());
  std::vector<uint8_t> out(kMiB);
  ASSERT_TRUE(t.Read(Obj(1), out).ok());
  EXPECT_EQ(out, obj);
  ASSERT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(60)));
  EXPECT_EQ(t.ready_bytes(), 256 * kMiB);
  // Unfenced: one object may take the whole pool.
  ASSERT_TRUE(t.Erase(Obj(1)).ok());
  EXPECT_TRUE(t.Put(Obj(2), std::span<const uint8_t>(t.base(), 200 * kMiB)).ok());
}

TEST(DramTier, DestroyWhilePopulatingStopsThePopulationWithoutAReport) {
  PopulationWatch w;
  w.piece_bytes = 16 * kMiB;
  DramTierOptions o = PopulatedPool(512 * kMiB);
  w.Attach(o);
  // Each piece takes a while, so the pool is destroyed half populated.
  auto slow = o.register_memory;
  o.register_memory = [slow](void* p, uint64_t n) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    return slow(p, n);
  };
  auto tier = DramTier::Open(o);
  ASSERT_TRUE(tier.ok()) << tier.status();
  ASSERT_TRUE((*tier)->Put(Obj(1), Pattern(kMiB, 1)).ok());
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  tier->reset();
  int pieces;
  {
    absl::MutexLock l(&w.mu);
    pieces = static_cast<int>(w.registered.size());
  }
  EXPECT_LT(pieces, 32);
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_EQ(w.reports.load(), 0);
  absl::MutexLock l(&w.mu);
  EXPECT_EQ(static_cast<int>(w.registered.size()), pieces);  // nothing ran after the destructor
}

TEST(DramTier, RegistrationErrorOnTheFirstPieceFailsOpen) {
  PopulationWatch w;
  w.piece_bytes = 4 * kMiB;
  w.fail_piece = 0;
  DramTierOptions o = PopulatedPool(16 * kMiB);
  w.Attach(o);
  auto tier = DramTier::Open(o);
  EXPECT_EQ(tier.status().code(), absl::StatusCode::kInternal);
}

TEST(DramTier, RegistrationErrorLaterStopsThePopulationAndIsReported) {
  PopulationWatch w;
  w.piece_bytes = 4 * kMiB;
  w.fail_piece = 3;
  DramTierOptions o = PopulatedPool(64 * kMiB);
  o.populate_threads = 1;
  w.Attach(o);
  auto tier = DramTier::Open(o);
  ASSERT_TRUE(tier.ok()) << tier.status();
  ASSERT_TRUE(w.finished.WaitForNotificationWithTimeout(absl::Seconds(60)));
  EXPECT_EQ(w.report.status.code(), absl::StatusCode::kInternal);
  EXPECT_EQ(w.report.ready_bytes, 12 * kMiB);  // pieces 0, 1, 2
  EXPECT_EQ((*tier)->ready_bytes(), 12 * kMiB);
  EXPECT_EQ((*tier)->capacity_bytes(), 64 * kMiB);
}

TEST(DramTier, ObjectLargerThanARegisteredPieceIsRefusedAsNotTierFull) {
  PopulationWatch w;
  w.piece_bytes = 4 * kMiB;
  DramTierOptions o = PopulatedPool(16 * kMiB);
  w.Attach(o);
  auto tier = DramTier::Open(o);
  ASSERT_TRUE(tier.ok()) << tier.status();
  ASSERT_TRUE(w.finished.WaitForNotificationWithTimeout(absl::Seconds(60)));
  absl::Status st = (*tier)->Put(Obj(1), Pattern(5 * kMiB, 1));
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_FALSE(IsTierFull(st));  // evicting would not help
  EXPECT_TRUE((*tier)->Put(Obj(2), Pattern(4 * kMiB, 1)).ok());
}

}  // namespace
}  // namespace kvtier::tiering
