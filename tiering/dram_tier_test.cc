// DramTier's shared-memory pool: the memfd's size is sealed, so a process
// that holds the descriptor (every same-host client does) cannot shrink the
// pool under the daemon's and the other clients' mappings. Also the
// metadata-only tiers (DramTierOptions::metadata_only, NewMetadataTier).
#include "tiering/dram_tier.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <vector>

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

}  // namespace
}  // namespace kvtier::tiering
