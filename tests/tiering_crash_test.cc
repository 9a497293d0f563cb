// kill -9 in the middle of a stream of durable puts, then restart: every
// acknowledged chunk and every chunk the NVMe index committed is readable
// and byte-identical; no torn chunk is ever served.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <map>
#include <set>
#include <thread>
#include <vector>

#include "common/testing/temp_dir.h"
#include "gtest/gtest.h"
#include "tiering/placement_engine.h"
#include "tiering/test_util.h"

namespace kvtier::tiering {
namespace {

using ::kvtier::tiering::testing::KeyOf;
using ::kvtier::tiering::testing::MakeChunk;
using ::kvtier::testing::TempDir;

constexpr uint64_t kNvmeBytes = 8 << 20;

absl::StatusOr<std::unique_ptr<PlacementEngine>> OpenEngine(const std::string& dir) {
  EngineTiers tiers;
  auto dram = DramTier::Open({.capacity_bytes = 4 << 20, .populate = false});
  if (!dram.ok()) return dram.status();
  auto nvme = NvmeTier::Open({.dir = dir, .capacity_bytes = kNvmeBytes, .config_fingerprint = "crash-test"});
  if (!nvme.ok()) return nvme.status();
  tiers.dram = std::move(*dram);
  tiers.nvme = std::move(*nvme);
  return PlacementEngine::Create({.maintenance_interval_ms = 0}, std::move(tiers));
}

// Child: durable puts of seeds first, first+1, ... forever; each seed is
// written to `ack_fd` after its put returned OK. Never returns.
[[noreturn]] void PutForever(const std::string& dir, int ack_fd, uint32_t first) {
  auto e = OpenEngine(dir);
  if (!e.ok()) _exit(3);
  for (uint32_t i = first;; ++i) {
    // Varying sizes so extents of different lengths interleave.
    auto chunk = MakeChunk(i, 8 + (i % 5) * 24);
    absl::Status st = (*e)->Put(KeyOf(i), chunk, {.durable = true});
    if (absl::IsResourceExhausted(st)) {
      // Full: free the oldest to keep the stream going.
      (void)(*e)->Delete(KeyOf(i - 200));
      continue;
    }
    if (!st.ok()) _exit(4);
    if (write(ack_fd, &i, sizeof(i)) != sizeof(i)) _exit(5);
  }
}

// Child: `threads` threads of durable puts, thread t putting seeds
// first + t, first + t + threads, ...; their commits share group commits.
[[noreturn]] void PutForeverConcurrently(const std::string& dir, int ack_fd, uint32_t first,
                                         int threads, bool durable = true) {
  auto e = OpenEngine(dir);
  if (!e.ok()) _exit(3);
  std::vector<std::thread> ts;
  for (int t = 0; t < threads; ++t) {
    ts.emplace_back([&, t] {
      for (uint32_t i = first + t;; i += threads) {
        auto chunk = MakeChunk(i, 8 + (i % 5) * 24);
        PutOptions o{.durable = durable};
        if (!durable) o.tier = TierKind::kNvme;  // acked before its index commit
        if (!(*e)->Put(KeyOf(i), chunk, o).ok()) _exit(4);
        if (write(ack_fd, &i, sizeof(i)) != sizeof(i)) _exit(5);  // atomic: < PIPE_BUF
      }
    });
  }
  for (auto& t : ts) t.join();
  _exit(6);
}

// Checks, after a restart, that every acked seed and every seed the index
// holds (among `candidates`) reads back byte-identical.
void ExpectAckedAndCommittedReadable(const std::string& dir, const std::vector<uint32_t>& acked,
                                     const std::vector<uint32_t>& candidates) {
  auto e = OpenEngine(dir);
  ASSERT_TRUE(e.ok()) << e.status();
  for (uint32_t i : acked) {
    auto want = MakeChunk(i, 8 + (i % 5) * 24);
    std::vector<uint8_t> out(want.size());
    auto src = (*e)->Get(KeyOf(i), out);
    ASSERT_TRUE(src.ok()) << "acked chunk " << i << ": " << src.status();
    EXPECT_EQ(out, want) << i;
  }
  std::map<Hash128, uint32_t> seed_of;
  for (uint32_t i : candidates) seed_of[KeyOf(i)] = i;
  for (auto& [id, len] : (*e)->nvme()->List()) {
    auto it = seed_of.find(id.key);
    ASSERT_NE(it, seed_of.end()) << "unknown key on NVMe";
    auto want = MakeChunk(it->second, 8 + (it->second % 5) * 24);
    std::vector<uint8_t> out(len);
    ASSERT_TRUE((*e)->nvme()->Read(id, out).ok()) << it->second;
    EXPECT_EQ(out, want);
  }
  EXPECT_LE((*e)->nvme()->used_bytes(), kNvmeBytes);
}

void KillDuringConcurrentPuts(bool durable) {
  TempDir dir;
  constexpr int kThreads = 4;
  std::vector<uint32_t> acked, candidates;
  for (int round = 0; round < 3; ++round) {
    const uint32_t first = 100000 * (round + 1);
    int fds[2];
    ASSERT_EQ(pipe(fds), 0);
    pid_t pid = fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      close(fds[0]);
      PutForeverConcurrently(dir.path(), fds[1], first, kThreads, durable);
    }
    close(fds[1]);
    const size_t want = 20 + 10 * round;
    size_t got = 0;
    uint32_t seed;
    while (got < want && read(fds[0], &seed, sizeof(seed)) == sizeof(seed)) {
      acked.push_back(seed);
      ++got;
    }
    kill(pid, SIGKILL);  // with puts of every thread in flight
    while (read(fds[0], &seed, sizeof(seed)) == sizeof(seed)) acked.push_back(seed);
    close(fds[0]);
    int status = 0;
    ASSERT_EQ(waitpid(pid, &status, 0), pid);
    ASSERT_TRUE(WIFSIGNALED(status)) << "child exited on its own: " << status;
    ASSERT_EQ(got, want);
    // Far more than were acked: puts in flight may have committed.
    for (uint32_t i = first; i < first + 1000; ++i) candidates.push_back(i);
  }
  // Non-durable puts promise nothing after a crash, except that whatever
  // the index committed reads back whole.
  if (!durable) acked.clear();
  ExpectAckedAndCommittedReadable(dir.path(), acked, candidates);
}

TEST(TieringCrash, KillDuringConcurrentDurablePutsKeepsEveryAcknowledgedChunk) {
  KillDuringConcurrentPuts(/*durable=*/true);
}

TEST(TieringCrash, KillDuringNonDurableNvmePutsNeverServesATornChunk) {
  KillDuringConcurrentPuts(/*durable=*/false);
}

TEST(TieringCrash, KillDuringDurablePutsKeepsEveryAcknowledgedChunk) {
  TempDir dir;
  std::vector<uint32_t> acked;
  uint32_t next = 0;
  // Three crash/restart rounds, each killed after a different number of acks.
  for (int round = 0; round < 3; ++round) {
    int fds[2];
    ASSERT_EQ(pipe(fds), 0);
    pid_t pid = fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      close(fds[0]);
      PutForever(dir.path(), fds[1], next);
    }
    close(fds[1]);
    const size_t want = 15 + 10 * round;
    size_t got = 0;
    uint32_t seed;
    while (got < want && read(fds[0], &seed, sizeof(seed)) == sizeof(seed)) {
      acked.push_back(seed);
      next = seed + 1;
      ++got;
    }
    kill(pid, SIGKILL);  // in the middle of the next put
    // Acks already in the pipe were acknowledged before the kill.
    while (read(fds[0], &seed, sizeof(seed)) == sizeof(seed)) {
      acked.push_back(seed);
      next = seed + 1;
    }
    close(fds[0]);
    int status = 0;
    ASSERT_EQ(waitpid(pid, &status, 0), pid);
    ASSERT_TRUE(WIFSIGNALED(status)) << "child exited on its own: " << status;
    ASSERT_EQ(got, want);
    next += 1;  // the put in flight at the kill may or may not have committed
  }

  auto e = OpenEngine(dir.path());
  ASSERT_TRUE(e.ok()) << e.status();
  // Every acknowledged chunk is readable and byte-identical (the stream is
  // far below the NVMe capacity, so the child never deleted any).
  for (uint32_t i : acked) {
    auto want = MakeChunk(i, 8 + (i % 5) * 24);
    std::vector<uint8_t> out(want.size());
    auto src = (*e)->Get(KeyOf(i), out);
    ASSERT_TRUE(src.ok()) << "acked chunk " << i << ": " << src.status();
    EXPECT_EQ(out, want) << i;
  }
  // The index lists every acknowledged chunk, so the walk below, which
  // trusts the listing, covers them too.
  std::set<Hash128> listed;
  for (auto& [id, len] : (*e)->nvme()->List()) listed.insert(id.key);
  for (uint32_t i : acked) EXPECT_TRUE(listed.contains(KeyOf(i))) << "acked chunk " << i;
  // Every chunk the index committed (acknowledged or not) reads back whole.
  std::map<Hash128, uint32_t> seed_of;
  for (uint32_t i = 0; i < next + 8; ++i) seed_of[KeyOf(i)] = i;
  for (auto& [id, len] : (*e)->nvme()->List()) {
    auto it = seed_of.find(id.key);
    ASSERT_NE(it, seed_of.end()) << "unknown key on NVMe";
    auto want = MakeChunk(it->second, 8 + (it->second % 5) * 24);
    std::vector<uint8_t> out(len);
    ASSERT_TRUE((*e)->nvme()->Read(id, out).ok()) << it->second;
    EXPECT_EQ(out, want);
  }
  EXPECT_LE((*e)->nvme()->used_bytes(), kNvmeBytes);
}

}  // namespace
}  // namespace kvtier::tiering
