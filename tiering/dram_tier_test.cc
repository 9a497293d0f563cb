// DramTier's shared-memory pool: the memfd's size is sealed, so a process
// that holds the descriptor (every same-host client does) cannot shrink the
// pool under the daemon's and the other clients' mappings.
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

}  // namespace
}  // namespace kvtier::tiering
