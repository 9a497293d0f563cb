// NVMe tier: io_uring round trips, durability across reopen and simulated
// power loss, checksums on read, config fingerprints, injected faults.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <functional>
#include <numeric>
#include <random>
#include <thread>

#include "absl/container/flat_hash_set.h"
#include "common/testing/temp_dir.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "codec/chunk.h"
#include "common/status.h"
#include "tiering/nvme_tier.h"
#include "tiering/odirect_test_util.h"
#include "tiering/test_util.h"

namespace kvtier::tiering {
namespace {

using ::kvtier::tiering::testing::KeyOf;
using ::kvtier::tiering::testing::MakeChunk;
using ::kvtier::testing::TempDir;

ObjectKey Obj(uint64_t seed) { return ObjectKey{KeyOf(seed), Part::kWhole}; }

absl::StatusOr<std::vector<uint8_t>> ReadAll(NvmeTier& t, const ObjectKey& id) {
  auto n = t.Size(id);
  if (!n.ok()) return n.status();
  std::vector<uint8_t> out(*n);
  absl::Status st = t.Read(id, out);
  if (!st.ok()) return st;
  return out;
}

// Chunks Obj(0) .. Obj(count - 1) all read back as MakeChunk(i, tokens).
void ExpectChunksReadable(NvmeTier& t, int count, uint32_t tokens = 16) {
  for (int i = 0; i < count; ++i) {
    auto got = ReadAll(t, Obj(i));
    ASSERT_TRUE(got.ok()) << i << ": " << got.status();
    EXPECT_EQ(*got, MakeChunk(i, tokens)) << i;
  }
}

std::unique_ptr<NvmeTier> OpenOrDie(NvmeTierOptions o) {
  auto t = NvmeTier::Open(o);
  EXPECT_TRUE(t.ok()) << t.status();
  return t.ok() ? std::move(*t) : nullptr;
}

TEST(NvmeTier, PutThenReadReturnsSameBytesOverIoUring) {
  TempDir dir;
  auto t = OpenOrDie({.dir = dir.path(), .capacity_bytes = 16 << 20, .max_io_bytes = 8192});
  ASSERT_NE(t, nullptr);
  for (uint32_t tokens : {1u, 7u, 16u, 64u}) {
    auto chunk = MakeChunk(tokens, tokens);
    ASSERT_TRUE(t->Put(Obj(tokens), chunk).ok());
    auto got = ReadAll(*t, Obj(tokens));
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(*got, chunk);
    // An aligned caller buffer takes the in-place path.
    AlignedBuffer buf(chunk.size(), 4096);
    ASSERT_TRUE(t->Read(Obj(tokens), {buf.data(), chunk.size()}).ok());
    EXPECT_EQ(0, memcmp(buf.data(), chunk.data(), chunk.size()));
  }
  EXPECT_GT(t->bandwidth().write_bytes_per_s, 0);
  EXPECT_GT(t->bandwidth().read_bytes_per_s, 0);
}

TEST(NvmeTier, MissReturnsNotFoundAndWrongBufferInvalidArgument) {
  TempDir dir;
  auto t = OpenOrDie({.dir = dir.path(), .capacity_bytes = 1 << 20});
  std::vector<uint8_t> out(10);
  EXPECT_EQ(t->Read(Obj(1), out).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(t->Erase(Obj(1)).code(), absl::StatusCode::kNotFound);
  auto chunk = MakeChunk(1);
  ASSERT_TRUE(t->Put(Obj(1), chunk).ok());
  EXPECT_EQ(t->Read(Obj(1), out).code(), absl::StatusCode::kInvalidArgument);
}

TEST(NvmeTier, PutRejectsGarbageWithInvalidArgument) {
  TempDir dir;
  auto t = OpenOrDie({.dir = dir.path(), .capacity_bytes = 1 << 20});
  std::vector<uint8_t> garbage(4096, 0xab);
  EXPECT_EQ(t->Put(Obj(1), garbage).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(t->used_bytes(), 0u);
}

TEST(NvmeTier, ReopenServesEveryCommittedChunk) {
  TempDir dir;
  std::vector<std::vector<uint8_t>> chunks;
  {
    auto t = OpenOrDie({.dir = dir.path(), .capacity_bytes = 4 << 20});
    for (int i = 0; i < 20; ++i) {
      chunks.push_back(MakeChunk(i));
      ASSERT_TRUE(t->Put(Obj(i), chunks.back()).ok());
    }
    ASSERT_TRUE(t->Erase(Obj(3)).ok());
  }
  auto t = OpenOrDie({.dir = dir.path(), .capacity_bytes = 4 << 20});
  EXPECT_EQ(t->List().size(), 19u);
  for (int i = 0; i < 20; ++i) {
    auto got = ReadAll(*t, Obj(i));
    if (i == 3) {
      EXPECT_EQ(got.status().code(), absl::StatusCode::kNotFound);
    } else {
      ASSERT_TRUE(got.ok()) << got.status();
      EXPECT_EQ(*got, chunks[i]);
    }
  }
}

TEST(NvmeTier, FullTierReturnsResourceExhaustedAndFileNeverGrows) {
  TempDir dir;
  const uint64_t cap = 256 << 10;
  auto t = OpenOrDie({.dir = dir.path(), .capacity_bytes = cap});
  int stored = 0;
  absl::Status st;
  for (int i = 0; i < 100; ++i) {
    st = t->Put(Obj(i), MakeChunk(i));
    if (!st.ok()) break;
    ++stored;
  }
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(IsTierFull(st));
  EXPECT_GT(stored, 5);
  EXPECT_LE(t->used_bytes(), cap);
  struct stat sb;
  ASSERT_EQ(stat(t->data_path().c_str(), &sb), 0);
  EXPECT_LE(static_cast<uint64_t>(sb.st_size), cap);
  EXPECT_LE(static_cast<uint64_t>(sb.st_blocks) * 512, cap);
  // Space is reclaimed: after erasing, puts succeed again and the file
  // stays the same size.
  for (int i = 0; i < stored; ++i) ASSERT_TRUE(t->Erase(Obj(i)).ok());
  EXPECT_EQ(t->used_bytes(), 0u);
  for (int i = 100; i < 100 + stored; ++i) ASSERT_TRUE(t->Put(Obj(i), MakeChunk(i)).ok());
  ASSERT_EQ(stat(t->data_path().c_str(), &sb), 0);
  EXPECT_LE(static_cast<uint64_t>(sb.st_size), cap);
}

// Bytes the files under `dir` occupy on disk (allocated blocks, so that
// preallocated space counts).
uint64_t DiskUsage(const std::string& dir) {
  uint64_t total = 0;
  for (const auto& e : std::filesystem::recursive_directory_iterator(dir)) {
    struct stat sb;
    if (::lstat(e.path().c_str(), &sb) == 0 && S_ISREG(sb.st_mode)) {
      total += static_cast<uint64_t>(sb.st_blocks) * 512;
    }
  }
  return total;
}

// The tier's whole directory (data file and RocksDB index with its WAL and
// logs) stays within the capacity plus the index allowance, while it fills,
// is overwritten many times, and is reopened.
TEST(NvmeTier, DirectoryStaysWithinCapacityPlusIndexAllowance) {
  TempDir dir;
  const uint64_t cap = uint64_t{40} << 20;
  NvmeTierOptions o{.dir = dir.path(), .capacity_bytes = cap};
  EXPECT_EQ(NvmeIndexAllowanceBytes(cap), uint64_t{16} << 20);
  EXPECT_EQ(NvmeIndexAllowanceBytes(uint64_t{8} << 30), (uint64_t{8} << 30) / 32);
  const uint64_t budget = cap + NvmeIndexAllowanceBytes(cap);
  uint64_t peak = 0;
  for (int round = 0; round < 2; ++round) {
    auto t = OpenOrDie(o);
    ASSERT_NE(t, nullptr);
    peak = std::max(peak, DiskUsage(dir.path()));
    // Small chunks (many index entries), overwritten and erased over and over.
    for (int i = 0; i < 1200; ++i) {
      const int k = i % 700;
      absl::Status st = t->Put(Obj(k), MakeChunk(k, 4), {.sync = i % 200 == 0});
      if (IsTierFull(st)) {
        (void)t->Erase(Obj((k + 350) % 700));
        continue;
      }
      ASSERT_TRUE(st.ok() || absl::IsResourceExhausted(st)) << st;
      if (i % 7 == 0) (void)t->Erase(Obj((k + 3) % 700));
      if (i % 500 == 0) peak = std::max(peak, DiskUsage(dir.path()));
    }
    ASSERT_TRUE(t->Flush().ok());
    peak = std::max(peak, DiskUsage(dir.path()));
  }
  peak = std::max(peak, DiskUsage(dir.path()));
  EXPECT_LE(peak, budget) << "peak " << peak << " bytes on disk";
  EXPECT_LT(peak, uint64_t{56} << 20);
}

TEST(NvmeTier, BitFlipInDataFileReturnsDataLossAndDropsEntry) {
  TempDir dir;
  auto c1 = MakeChunk(1), c2 = MakeChunk(2);
  uint64_t off;
  std::string path;
  {
    auto t = OpenOrDie({.dir = dir.path(), .capacity_bytes = 1 << 20});
    ASSERT_TRUE(t->Put(Obj(1), c1).ok());
    ASSERT_TRUE(t->Put(Obj(2), c2).ok());
    off = t->OffsetOf(Obj(1)).value();
    path = t->data_path();
  }
  // Flip one bit in the middle of chunk 1's V section, behind the tier's back.
  int fd = open(path.c_str(), O_RDWR);
  ASSERT_GE(fd, 0);
  uint64_t pos = off + c1.size() - 100;
  uint8_t b;
  ASSERT_EQ(pread(fd, &b, 1, pos), 1);
  b ^= 0x10;
  ASSERT_EQ(pwrite(fd, &b, 1, pos), 1);
  fsync(fd);
  close(fd);
  auto t = OpenOrDie({.dir = dir.path(), .capacity_bytes = 1 << 20});
  std::vector<uint8_t> out(c1.size());
  EXPECT_EQ(t->Read(Obj(1), out).code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(t->Size(Obj(1)).status().code(), absl::StatusCode::kNotFound);
  auto got2 = ReadAll(*t, Obj(2));
  ASSERT_TRUE(got2.ok());
  EXPECT_EQ(*got2, c2);
  // The drop is durable.
  t.reset();
  t = OpenOrDie({.dir = dir.path(), .capacity_bytes = 1 << 20});
  EXPECT_EQ(t->List().size(), 1u);
}

TEST(NvmeTier, ReadAfterTornWriteReturnsDataLoss) {
  TempDir dir;
  MemIoEnv mem;
  FaultInjectionIoEnv faulty(&mem, FaultPolicy{.torn_write_one_in = 1});
  auto t = OpenOrDie({.dir = dir.path(), .capacity_bytes = 1 << 20, .env = &faulty});
  auto chunk = MakeChunk(5, 64);  // several blocks, so half of it is torn off
  ASSERT_TRUE(t->Put(Obj(5), chunk).ok());  // the device lied
  std::vector<uint8_t> out(chunk.size());
  EXPECT_EQ(t->Read(Obj(5), out).code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(t->Read(Obj(5), out).code(), absl::StatusCode::kNotFound);
  faulty.SetPolicy({});
  ASSERT_TRUE(t->Put(Obj(6), MakeChunk(6)).ok());
  EXPECT_TRUE(ReadAll(*t, Obj(6)).ok());
}

TEST(NvmeTier, PowerLossKeepsEveryAcknowledgedChunk) {
  TempDir dir;
  MemIoEnv mem;
  std::vector<std::vector<uint8_t>> chunks;
  {
    auto t = OpenOrDie({.dir = dir.path(), .capacity_bytes = 2 << 20, .env = &mem});
    for (int i = 0; i < 30; ++i) {
      chunks.push_back(MakeChunk(i));
      ASSERT_TRUE(t->Put(Obj(i), chunks.back()).ok());
    }
  }
  mem.SimulateCrash();
  auto t = OpenOrDie({.dir = dir.path(), .capacity_bytes = 2 << 20, .env = &mem});
  for (int i = 0; i < 30; ++i) {
    auto got = ReadAll(*t, Obj(i));
    ASSERT_TRUE(got.ok()) << i << ": " << got.status();
    EXPECT_EQ(*got, chunks[i]);
  }
}

TEST(NvmeTier, FailedSyncLeavesNoIndexEntryAndDroppedWritesServeNothingTorn) {
  TempDir dir;
  MemIoEnv mem;
  FaultInjectionIoEnv faulty(&mem, FaultPolicy{.drop_unflushed = true});
  auto t = OpenOrDie({.dir = dir.path(), .capacity_bytes = 1 << 20, .env = &faulty});
  auto c1 = MakeChunk(1);
  ASSERT_TRUE(t->Put(Obj(1), c1).ok());
  // Next op (the write) succeeds, the sync after it fails.
  faulty.SetPolicy(FaultPolicy{.fail_after_n = 1, .drop_unflushed = true});
  EXPECT_EQ(t->Put(Obj(2), MakeChunk(2)).code(), absl::StatusCode::kInternal);
  faulty.SetPolicy(FaultPolicy{.drop_unflushed = true});
  ASSERT_TRUE(faulty.DropUnsyncedWrites().ok());
  t.reset();
  t = OpenOrDie({.dir = dir.path(), .capacity_bytes = 1 << 20, .env = &faulty});
  auto got = ReadAll(*t, Obj(1));
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(*got, c1);
  EXPECT_EQ(t->Size(Obj(2)).status().code(), absl::StatusCode::kNotFound);
}

// Forwards to another IoEnv and tracks which written offsets are not yet
// covered by a Sync that started after their write completed.
class SyncTrackingIoEnv : public IoEnv {
 public:
  explicit SyncTrackingIoEnv(IoEnv* base) : base_(base) {}
  absl::StatusOr<std::unique_ptr<BlockDevice>> OpenDevice(const std::string& path,
                                                          uint64_t size) override {
    auto d = base_->OpenDevice(path, size);
    if (!d.ok()) return d.status();
    return std::unique_ptr<BlockDevice>(new Device(this, std::move(*d)));
  }
  absl::Status RemoveFile(const std::string& path) override { return base_->RemoveFile(path); }
  bool Unsynced(uint64_t offset) {
    absl::MutexLock l(&mu_);
    return unsynced_.contains(offset);
  }

 private:
  class Device : public BlockDevice {
   public:
    Device(SyncTrackingIoEnv* env, std::unique_ptr<BlockDevice> base) : env_(env), base_(std::move(base)) {}
    uint64_t block_size() const override { return base_->block_size(); }
    uint64_t size() const override { return base_->size(); }
    absl::Status Submit(std::span<const IoRequest> reqs) override {
      absl::Status st = base_->Submit(reqs);
      absl::MutexLock l(&env_->mu_);
      for (const IoRequest& r : reqs) {
        if (r.op == IoRequest::Op::kWrite) env_->unsynced_.insert(r.offset);
      }
      return st;
    }
    absl::Status Sync() override {
      absl::flat_hash_set<uint64_t> covered;
      {
        absl::MutexLock l(&env_->mu_);
        covered = env_->unsynced_;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(2));  // let puts queue up
      absl::Status st = base_->Sync();
      if (!st.ok()) return st;
      absl::MutexLock l(&env_->mu_);
      for (uint64_t o : covered) env_->unsynced_.erase(o);
      return st;
    }

   private:
    SyncTrackingIoEnv* const env_;
    std::unique_ptr<BlockDevice> base_;
  };
  IoEnv* const base_;
  absl::Mutex mu_;
  absl::flat_hash_set<uint64_t> unsynced_ ABSL_GUARDED_BY(mu_);
};

TEST(NvmeTier, ConcurrentPutsShareGroupCommitsButEachAckFollowsItsDataSync) {
  // Slow syncs make puts queue behind each other's commit, so commits carry
  // several puts; whenever a Put returns OK, a Sync that started after its
  // data write completed must have finished.
  TempDir dir;
  MemIoEnv mem;
  SyncTrackingIoEnv tracking(&mem);
  auto t = OpenOrDie({.dir = dir.path(), .capacity_bytes = 4 << 20, .max_io_bytes = 1 << 20,
                      .env = &tracking});
  std::vector<std::thread> ts;
  std::atomic<int> failed{0}, unsynced_at_ack{0};
  for (int th = 0; th < 8; ++th) {
    ts.emplace_back([&, th] {
      for (int i = th; i < 48; i += 8) {
        if (!t->Put(Obj(i), MakeChunk(i)).ok()) {
          ++failed;
          continue;
        }
        auto off = t->OffsetOf(Obj(i));
        if (!off.ok() || tracking.Unsynced(*off)) ++unsynced_at_ack;
      }
    });
  }
  for (auto& th : ts) th.join();
  EXPECT_EQ(failed.load(), 0);
  EXPECT_EQ(unsynced_at_ack.load(), 0);
  t.reset();
  mem.SimulateCrash();  // nothing acknowledged may depend on unsynced bytes
  t = OpenOrDie({.dir = dir.path(), .capacity_bytes = 4 << 20, .env = &mem});
  ASSERT_NO_FATAL_FAILURE(ExpectChunksReadable(*t, 48));
}

TEST(NvmeTier, UnsyncedPutIsReadableAtOnceAndSurvivesPowerLossAfterFlush) {
  TempDir dir;
  MemIoEnv mem;
  auto t = OpenOrDie({.dir = dir.path(), .capacity_bytes = 4 << 20, .env = &mem});
  for (int i = 0; i < 8; ++i) ASSERT_TRUE(t->Put(Obj(i), MakeChunk(i), {.sync = false}).ok());
  ASSERT_NO_FATAL_FAILURE(ExpectChunksReadable(*t, 8));
  ASSERT_TRUE(t->Flush().ok());
  t.reset();
  mem.SimulateCrash();
  t = OpenOrDie({.dir = dir.path(), .capacity_bytes = 4 << 20, .env = &mem});
  ASSERT_NO_FATAL_FAILURE(ExpectChunksReadable(*t, 8));
}

TEST(NvmeTier, EraseRightAfterUnsyncedPutIsNeverUndoneByItsCommit) {
  TempDir dir;
  MemIoEnv mem;
  auto t = OpenOrDie({.dir = dir.path(), .capacity_bytes = 4 << 20, .env = &mem});
  for (int i = 0; i < 16; ++i) {
    ASSERT_TRUE(t->Put(Obj(i), MakeChunk(i), {.sync = false}).ok());
    ASSERT_TRUE(t->Erase(Obj(i)).ok());
  }
  ASSERT_TRUE(t->Flush().ok());
  EXPECT_EQ(t->used_bytes(), 0u);
  t.reset();
  t = OpenOrDie({.dir = dir.path(), .capacity_bytes = 4 << 20, .env = &mem});
  EXPECT_TRUE(t->List().empty());
  EXPECT_EQ(t->used_bytes(), 0u);
}

TEST(NvmeTier, FailedCommitDropsTheUnsyncedPutAndFlushReportsIt) {
  TempDir dir;
  MemIoEnv mem;
  FaultInjectionIoEnv faulty(&mem);
  auto t = OpenOrDie({.dir = dir.path(), .capacity_bytes = 4 << 20, .env = &faulty});
  ASSERT_TRUE(t->Put(Obj(1), MakeChunk(1)).ok());
  // The data write (operation 1) succeeds; the commit's fdatasync fails.
  faulty.SetPolicy(FaultPolicy{.fail_after_n = 1});
  ASSERT_TRUE(t->Put(Obj(2), MakeChunk(2), {.sync = false}).ok());
  EXPECT_EQ(t->Flush().code(), absl::StatusCode::kInternal);
  faulty.SetPolicy({});
  EXPECT_EQ(t->Size(Obj(2)).status().code(), absl::StatusCode::kNotFound);
  auto got = ReadAll(*t, Obj(1));
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(*got, MakeChunk(1));
}

TEST(NvmeTier, InjectedIoErrorsFailPutsWithoutCorruptingOthers) {
  for (bool retryable : {false, true}) {
    TempDir dir;
    MemIoEnv mem;
    FaultInjectionIoEnv faulty(&mem);
    auto t = OpenOrDie({.dir = dir.path(), .capacity_bytes = 4 << 20, .env = &faulty});
    faulty.SetPolicy(FaultPolicy{.one_in = 3, .retryable = retryable, .seed = 7});
    std::vector<int> ok_ids, failed;
    for (int i = 0; i < 40; ++i) {
      absl::Status st = t->Put(Obj(i), MakeChunk(i));
      if (st.ok()) {
        ok_ids.push_back(i);
      } else {
        EXPECT_EQ(st.code(), retryable ? absl::StatusCode::kUnavailable : absl::StatusCode::kInternal);
        failed.push_back(i);
      }
    }
    EXPECT_FALSE(ok_ids.empty());
    EXPECT_FALSE(failed.empty());
    EXPECT_GT(faulty.injected_faults(), 0u);
    faulty.SetPolicy({});
    for (int i : ok_ids) {
      auto got = ReadAll(*t, Obj(i));
      ASSERT_TRUE(got.ok()) << got.status();
      EXPECT_EQ(*got, MakeChunk(i));
    }
    for (int i : failed) EXPECT_EQ(t->Size(Obj(i)).status().code(), absl::StatusCode::kNotFound);
  }
}

TEST(NvmeTier, DeviceEnospcIsResourceExhaustedButNotTierFull) {
  TempDir dir;
  MemIoEnv mem;
  FaultInjectionIoEnv faulty(&mem);
  auto t = OpenOrDie({.dir = dir.path(), .capacity_bytes = 1 << 20, .env = &faulty});
  faulty.SetPolicy(FaultPolicy{.fail_after_n = 0, .enospc = true});
  absl::Status st = t->Put(Obj(1), MakeChunk(1));
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_FALSE(IsTierFull(st));
  EXPECT_EQ(t->used_bytes(), 0u);
}

TEST(NvmeTier, RestartWithDifferentConfigDoesNotServeOldChunks) {
  TempDir dir;
  {
    auto t = OpenOrDie({.dir = dir.path(), .capacity_bytes = 1 << 20, .config_fingerprint = "llama8b/k16v8/16"});
    ASSERT_TRUE(t->Put(Obj(1), MakeChunk(1)).ok());
  }
  EXPECT_EQ(NvmeTier::Open({.dir = dir.path(), .capacity_bytes = 1 << 20,
                            .config_fingerprint = "llama8b/k16v16/16",
                            .discard_on_config_mismatch = false})
                .status()
                .code(),
            absl::StatusCode::kFailedPrecondition);
  auto t = OpenOrDie({.dir = dir.path(), .capacity_bytes = 1 << 20, .config_fingerprint = "llama8b/k16v16/16"});
  EXPECT_EQ(t->Size(Obj(1)).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(t->dropped_at_open(), 1u);
  EXPECT_EQ(t->used_bytes(), 0u);
  t.reset();
  // Back to the old config: the chunks are gone for good, not resurrected.
  t = OpenOrDie({.dir = dir.path(), .capacity_bytes = 1 << 20, .config_fingerprint = "llama8b/k16v8/16"});
  EXPECT_EQ(t->Size(Obj(1)).status().code(), absl::StatusCode::kNotFound);
}

TEST(NvmeTier, ConcurrentPutsReadsAndErasesStayConsistent) {
  TempDir dir;
  auto t = OpenOrDie({.dir = dir.path(), .capacity_bytes = 8 << 20});
  std::vector<std::thread> threads;
  std::atomic<int> bad{0};
  for (int th = 0; th < 4; ++th) {
    threads.emplace_back([&, th] {
      for (int i = 0; i < 25; ++i) {
        int id = (th * 7 + i) % 30;  // overlapping keys across threads
        auto chunk = MakeChunk(id);
        absl::Status st = t->Put(Obj(id), chunk);
        if (!st.ok()) ++bad;
        auto got = ReadAll(*t, Obj(id));
        if (got.ok() && *got != chunk) ++bad;
        if (!got.ok() && !absl::IsNotFound(got.status())) ++bad;
        if (i % 5 == 4) {
          absl::Status e = t->Erase(Obj(id));
          if (!e.ok() && !absl::IsNotFound(e)) ++bad;
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(bad.load(), 0);
  uint64_t sum = 0;
  for (auto& [id, len] : t->List()) sum += (len + 4095) / 4096 * 4096;
  EXPECT_EQ(sum, t->used_bytes());
}

// Reads verify the section checksums while later requests are in flight
// (NvmeTier's StreamingVerifier). The cases below cover where the bad bytes
// are relative to the requests (max_io_bytes = 4 KiB: a 48 KiB chunk is 13
// requests; the last one, partial, goes through the bounce buffer unless
// the caller's buffer is unaligned, when they all do).
struct StreamedReadCase {
  const char* name;
  bool io_uring;
  bool aligned_buffer;
  friend void PrintTo(const StreamedReadCase& c, std::ostream* os) { *os << c.name; }
};

class NvmeTierStreamedRead : public ::testing::TestWithParam<StreamedReadCase> {
 protected:
  std::unique_ptr<NvmeTier> Open(const std::string& dir) {
    NvmeTierOptions o{.dir = dir, .capacity_bytes = 1 << 20, .max_io_bytes = 4096, .queue_depth = 4};
    if (!GetParam().io_uring) o.env = &mem_;
    auto t = NvmeTier::Open(o);
    if (GetParam().io_uring && absl::IsFailedPrecondition(t.status())) return nullptr;  // no O_DIRECT
    EXPECT_TRUE(t.ok()) << t.status();
    return t.ok() ? std::move(*t) : nullptr;
  }
  // Flips one bit of the data file behind the tier's back.
  void Flip(NvmeTier& t, uint64_t pos) {
    if (!GetParam().io_uring) {
      ASSERT_TRUE(mem_.CorruptByte(t.data_path(), pos, 4).ok());
      return;
    }
    int fd = open(t.data_path().c_str(), O_RDWR);
    ASSERT_GE(fd, 0);
    uint8_t b;
    ASSERT_EQ(pread(fd, &b, 1, pos), 1);
    b ^= 0x10;
    ASSERT_EQ(pwrite(fd, &b, 1, pos), 1);
    fsync(fd);
    close(fd);
  }
  absl::Status Read(NvmeTier& t, const ObjectKey& id, std::vector<uint8_t>* out) {
    auto n = t.Size(id);
    if (!n.ok()) return n.status();
    AlignedBuffer buf(*n + 1, 4096);
    // An unaligned buffer sends every request through the bounce buffer.
    uint8_t* p = GetParam().aligned_buffer ? buf.data() : buf.data() + 1;
    absl::Status st = t.Read(id, {p, *n});
    out->assign(p, p + *n);
    return st;
  }
  MemIoEnv mem_;
};

TEST_P(NvmeTierStreamedRead, BitFlipInHeaderOrFirstMiddleOrLastRequestIsDataLossAndDropsTheChunk) {
  const auto chunk = MakeChunk(5, 64);
  ASSERT_GT(chunk.size(), 12u * 4096);  // 13 requests
  ASSERT_NE(chunk.size() % 4096, 0u);   // the last one partial
  const uint64_t positions[] = {
      10,                        // a header field
      codec::kOffHeaderChecksum + 1,  // the header checksum the index also holds
      200,                       // K section, first request
      chunk.size() / 2,          // middle request
      chunk.size() - 4096,       // V section, second-to-last request
      chunk.size() - 1,          // V section, last (partial) request
  };
  for (uint64_t pos : positions) {
    SCOPED_TRACE(pos);
    TempDir dir;
    auto t = Open(dir.path());
    if (GetParam().io_uring) KVTIER_SKIP_WITHOUT_ODIRECT(t != nullptr);
    ASSERT_NE(t, nullptr);
    ASSERT_TRUE(t->Put(Obj(5), chunk).ok());
    ASSERT_TRUE(t->Put(Obj(6), MakeChunk(6, 64)).ok());
    std::vector<uint8_t> got;
    ASSERT_TRUE(Read(*t, Obj(5), &got).ok());
    EXPECT_EQ(got, chunk);
    Flip(*t, t->OffsetOf(Obj(5)).value() + pos);
    absl::Status st = Read(*t, Obj(5), &got);
    EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss) << st;
    EXPECT_EQ(t->Size(Obj(5)).status().code(), absl::StatusCode::kNotFound);
    ASSERT_TRUE(Read(*t, Obj(6), &got).ok());
    EXPECT_EQ(got, MakeChunk(6, 64));
  }
}

TEST_P(NvmeTierStreamedRead, ChunkShorterThanItsHeaderSaysIsDataLoss) {
  TempDir dir;
  auto t = Open(dir.path());
  if (GetParam().io_uring) KVTIER_SKIP_WITHOUT_ODIRECT(t != nullptr);
  ASSERT_NE(t, nullptr);
  auto chunk = MakeChunk(7, 64);
  chunk.resize(chunk.size() - 16);  // Put checks only the header
  ASSERT_TRUE(t->Put(Obj(7), chunk).ok());
  std::vector<uint8_t> got;
  absl::Status st = Read(*t, Obj(7), &got);
  EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss) << st;
  EXPECT_THAT(std::string(st.message()), ::testing::HasSubstr("length"));
  EXPECT_EQ(t->Size(Obj(7)).status().code(), absl::StatusCode::kNotFound);
}

TEST_P(NvmeTierStreamedRead, SplitPartsVerifyAloneAndACorruptPartIsDropped) {
  TempDir dir;
  auto t = Open(dir.path());
  if (GetParam().io_uring) KVTIER_SKIP_WITHOUT_ODIRECT(t != nullptr);
  ASSERT_NE(t, nullptr);
  const auto chunk = MakeChunk(8, 64);
  const auto h = codec::ParseHeader(chunk).value();
  // K object = the chunk's first v_offset bytes; V object = header + V.
  std::vector<uint8_t> k(chunk.begin(), chunk.begin() + h.layout.v_offset);
  std::vector<uint8_t> v(chunk.begin(), chunk.begin() + codec::kHeaderSize);
  v.insert(v.end(), chunk.begin() + h.layout.v_offset, chunk.end());
  const ObjectKey kid{KeyOf(8), Part::kK}, vid{KeyOf(8), Part::kV};
  ASSERT_TRUE(t->Put(kid, k).ok());
  ASSERT_TRUE(t->Put(vid, v).ok());
  std::vector<uint8_t> got;
  ASSERT_TRUE(Read(*t, kid, &got).ok());
  EXPECT_EQ(got, k);
  ASSERT_TRUE(Read(*t, vid, &got).ok());
  EXPECT_EQ(got, v);
  Flip(*t, t->OffsetOf(vid).value() + v.size() - 1);
  EXPECT_EQ(Read(*t, vid, &got).code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(t->Size(vid).status().code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(Read(*t, kid, &got).ok());
  EXPECT_EQ(got, k);
}

INSTANTIATE_TEST_SUITE_P(
    Devices, NvmeTierStreamedRead,
    ::testing::Values(StreamedReadCase{"MemAligned", false, true},
                      StreamedReadCase{"MemUnaligned", false, false},
                      StreamedReadCase{"IoUringAligned", true, true},
                      StreamedReadCase{"IoUringUnaligned", true, false}),
    [](const ::testing::TestParamInfo<StreamedReadCase>& info) { return info.param.name; });

TEST(NvmeTier, IoErrorInTheMiddleOfAReadFailsWithItsCodeAndKeepsTheChunk) {
  TempDir dir;
  MemIoEnv mem;
  FaultInjectionIoEnv faulty(&mem);
  auto t = OpenOrDie({.dir = dir.path(), .capacity_bytes = 1 << 20, .max_io_bytes = 4096, .env = &faulty});
  const auto chunk = MakeChunk(9, 64);
  ASSERT_TRUE(t->Put(Obj(9), chunk).ok());
  AlignedBuffer buf(chunk.size(), 4096);
  std::span<uint8_t> out(buf.data(), chunk.size());
  // The first half of the requests arrive (and are hashed), then one fails.
  faulty.SetPolicy({.fail_after_n = 0, .fail_mid_submit = true});
  EXPECT_EQ(t->Read(Obj(9), out).code(), absl::StatusCode::kInternal);
  faulty.SetPolicy({.fail_after_n = 0, .retryable = true, .fail_mid_submit = true});
  EXPECT_EQ(t->Read(Obj(9), out).code(), absl::StatusCode::kUnavailable);
  EXPECT_GT(faulty.injected_faults(), 0u);
  // An I/O error is not corruption: the chunk stays and reads back whole.
  faulty.SetPolicy({});
  ASSERT_TRUE(t->Read(Obj(9), out).ok());
  EXPECT_EQ(0, std::memcmp(buf.data(), chunk.data(), chunk.size()));
}

// Reports a Submit's completions in a scrambled order (reverse, or a seeded
// shuffle), after all of them ran, as an io_uring may deliver them.
class ScrambledCompletionsIoEnv : public IoEnv {
 public:
  ScrambledCompletionsIoEnv(IoEnv* base, bool reverse) : base_(base), reverse_(reverse) {}
  absl::StatusOr<std::unique_ptr<BlockDevice>> OpenDevice(const std::string& path,
                                                          uint64_t size) override {
    auto d = base_->OpenDevice(path, size);
    if (!d.ok()) return d.status();
    return std::unique_ptr<BlockDevice>(new Device(std::move(*d), reverse_));
  }
  absl::Status RemoveFile(const std::string& path) override { return base_->RemoveFile(path); }

 private:
  class Device : public BlockDevice {
   public:
    Device(std::unique_ptr<BlockDevice> base, bool reverse) : base_(std::move(base)), reverse_(reverse) {}
    uint64_t block_size() const override { return base_->block_size(); }
    uint64_t size() const override { return base_->size(); }
    absl::Status Submit(std::span<const IoRequest> reqs) override { return base_->Submit(reqs); }
    absl::Status SubmitWithCompletions(std::span<const IoRequest> reqs,
                                       CompletionFn on_complete) override {
      absl::Status st = base_->Submit(reqs);
      if (!st.ok()) return st;
      std::vector<size_t> order(reqs.size());
      std::iota(order.begin(), order.end(), 0);
      if (reverse_) {
        std::reverse(order.begin(), order.end());
      } else {
        std::shuffle(order.begin(), order.end(), rng_);
      }
      for (size_t i : order) on_complete(i);
      return st;
    }
    absl::Status Sync() override { return base_->Sync(); }

   private:
    std::unique_ptr<BlockDevice> base_;
    const bool reverse_;
    std::mt19937_64 rng_{11};
  };
  IoEnv* const base_;
  const bool reverse_;
};

TEST(NvmeTier, ReadVerifiesWhateverOrderTheRequestsCompleteIn) {
  for (bool reverse : {true, false}) {
    SCOPED_TRACE(reverse ? "reverse" : "shuffled");
    TempDir dir;
    MemIoEnv mem;
    ScrambledCompletionsIoEnv scrambled(&mem, reverse);
    auto t = OpenOrDie({.dir = dir.path(), .capacity_bytes = 1 << 20, .max_io_bytes = 4096, .env = &scrambled});
    for (int i = 0; i < 4; ++i) ASSERT_TRUE(t->Put(Obj(i), MakeChunk(i, 64)).ok());
    ASSERT_NO_FATAL_FAILURE(ExpectChunksReadable(*t, 4, 64));
    ASSERT_TRUE(mem.CorruptByte(t->data_path(), t->OffsetOf(Obj(2)).value() + 5000, 0).ok());
    EXPECT_EQ(ReadAll(*t, Obj(2)).status().code(), absl::StatusCode::kDataLoss);
    EXPECT_EQ(t->Size(Obj(2)).status().code(), absl::StatusCode::kNotFound);
  }
}

// --- Batched reads (ReadBatch): one submission for every chunk, each
// chunk's status its own.

// Forwards to `base`; each SubmitWithCompletions of reads goes through
// `on_reads`, which may count, fail or forward it.
class ReadHookIoEnv : public IoEnv {
 public:
  using Hook = std::function<absl::Status(BlockDevice& base, std::span<const IoRequest> reqs,
                                          BlockDevice::CompletionFn on_complete)>;
  ReadHookIoEnv(IoEnv* base, Hook on_reads) : base_(base), on_reads_(std::move(on_reads)) {}
  absl::StatusOr<std::unique_ptr<BlockDevice>> OpenDevice(const std::string& path,
                                                          uint64_t size) override {
    auto d = base_->OpenDevice(path, size);
    if (!d.ok()) return d.status();
    return std::unique_ptr<BlockDevice>(new Device(std::move(*d), &on_reads_));
  }
  absl::Status RemoveFile(const std::string& path) override { return base_->RemoveFile(path); }

 private:
  class Device : public BlockDevice {
   public:
    Device(std::unique_ptr<BlockDevice> base, Hook* hook) : base_(std::move(base)), hook_(hook) {}
    uint64_t block_size() const override { return base_->block_size(); }
    uint64_t size() const override { return base_->size(); }
    absl::Status Submit(std::span<const IoRequest> reqs) override { return base_->Submit(reqs); }
    absl::Status SubmitWithCompletions(std::span<const IoRequest> reqs,
                                       CompletionFn on_complete) override {
      if (reqs.empty() || reqs[0].op != IoRequest::Op::kRead) {
        return base_->SubmitWithCompletions(reqs, on_complete);
      }
      return (*hook_)(*base_, reqs, on_complete);
    }
    absl::Status Sync() override { return base_->Sync(); }

   private:
    std::unique_ptr<BlockDevice> base_;
    Hook* hook_;
  };
  IoEnv* const base_;
  Hook on_reads_;
};

// Buffers for a batch of Obj(0..n-1), chunks of `tokens` tokens.
struct Batch {
  std::vector<ObjectKey> ids;
  std::vector<std::vector<uint8_t>> bufs;
  std::vector<std::span<uint8_t>> outs;
  Batch(int n, uint32_t tokens) {
    for (int i = 0; i < n; ++i) {
      ids.push_back(Obj(i));
      bufs.emplace_back(MakeChunk(i, tokens).size(), 0);
    }
    for (auto& b : bufs) outs.emplace_back(b);
  }
};

TEST(NvmeTier, ReadBatchSubmitsTheRequestsOfEveryChunkAtOnce) {
  TempDir dir;
  MemIoEnv mem;
  std::vector<size_t> submissions;  // requests per submission of reads
  ReadHookIoEnv counting(&mem, [&](BlockDevice& base, std::span<const IoRequest> reqs,
                                   BlockDevice::CompletionFn on_complete) {
    submissions.push_back(reqs.size());
    return base.SubmitWithCompletions(reqs, on_complete);
  });
  auto t = OpenOrDie({.dir = dir.path(), .capacity_bytes = 4 << 20, .max_io_bytes = 8192, .env = &counting});
  for (int i = 0; i < 8; ++i) ASSERT_TRUE(t->Put(Obj(i), MakeChunk(i, 64)).ok());
  Batch b(8, 64);
  const uint64_t per_chunk = (b.bufs[0].size() + 8191) / 8192;
  submissions.clear();
  for (const absl::Status& st : t->ReadBatch(b.ids, b.outs)) EXPECT_TRUE(st.ok()) << st;
  ASSERT_EQ(submissions.size(), 1u);
  EXPECT_GE(submissions[0], 8 * per_chunk);  // 8 chunks' requests, 32 in flight
  for (int i = 0; i < 8; ++i) EXPECT_EQ(b.bufs[i], MakeChunk(i, 64)) << i;
}

TEST(NvmeTier, ReadBatchReportsACorruptByteAsDataLossOfItsChunkOnly) {
  TempDir dir;
  MemIoEnv mem;
  auto t = OpenOrDie({.dir = dir.path(), .capacity_bytes = 4 << 20, .max_io_bytes = 8192, .env = &mem});
  for (int i = 0; i < 4; ++i) ASSERT_TRUE(t->Put(Obj(i), MakeChunk(i, 64)).ok());
  ASSERT_TRUE(mem.CorruptByte(t->data_path(), t->OffsetOf(Obj(2)).value() + 9000, 3).ok());
  Batch b(4, 64);
  auto st = t->ReadBatch(b.ids, b.outs);
  for (int i : {0, 1, 3}) {
    EXPECT_TRUE(st[i].ok()) << i << ": " << st[i];
    EXPECT_EQ(b.bufs[i], MakeChunk(i, 64)) << i;
  }
  EXPECT_EQ(st[2].code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(t->Size(Obj(2)).status().code(), absl::StatusCode::kNotFound);  // dropped
}

// The data file cut short behind the tier's back (io_uring on O_DIRECT):
// at the start of the last chunk (its reads find the end of the file), or
// inside it, off a block boundary (a short read, then the end of the file).
// Only that chunk fails, as DataLoss; the batch's other chunks are served.
TEST(NvmeTier, ReadBatchOfATruncatedDataFileFailsOnlyTheCutChunk) {
  for (uint64_t cut_into : {uint64_t{0}, uint64_t{4096 + 100}}) {
    SCOPED_TRACE(cut_into);
    TempDir dir;
    auto t = OpenOrDie({.dir = dir.path(), .capacity_bytes = 4 << 20, .max_io_bytes = 8192});
    KVTIER_SKIP_WITHOUT_ODIRECT(t != nullptr);
    for (int i = 0; i < 4; ++i) ASSERT_TRUE(t->Put(Obj(i), MakeChunk(i, 64)).ok());
    int last = 0;
    for (int i = 1; i < 4; ++i) {
      if (t->OffsetOf(Obj(i)).value() > t->OffsetOf(Obj(last)).value()) last = i;
    }
    ASSERT_EQ(::truncate(t->data_path().c_str(),
                         static_cast<off_t>(t->OffsetOf(Obj(last)).value() + cut_into)),
              0);
    Batch b(4, 64);
    auto st = t->ReadBatch(b.ids, b.outs);
    for (int i = 0; i < 4; ++i) {
      if (i == last) {
        EXPECT_EQ(st[i].code(), absl::StatusCode::kDataLoss) << st[i];
      } else {
        EXPECT_TRUE(st[i].ok()) << i << ": " << st[i];
        EXPECT_EQ(b.bufs[i], MakeChunk(i, 64)) << i;
      }
    }
  }
}

TEST(NvmeTier, ReadBatchWhoseSubmissionFailsReadsTheUnfinishedChunksAgainAlone) {
  TempDir dir;
  MemIoEnv mem;
  // The first submission of reads fails half way (its first half reported
  // complete), as a media error in the middle of a batch would; later ones
  // go through.
  bool armed = false;
  int failed = 0;
  ReadHookIoEnv failing(&mem, [&](BlockDevice& base, std::span<const IoRequest> reqs,
                                  BlockDevice::CompletionFn on_complete) -> absl::Status {
    if (!armed) return base.SubmitWithCompletions(reqs, on_complete);
    armed = false;
    ++failed;
    const auto half = reqs.first(reqs.size() / 2);
    KVTIER_RETURN_IF_ERROR(base.Submit(half));
    for (size_t i = 0; i < half.size(); ++i) on_complete(i);
    return absl::InternalError("injected: media error half way through the batch");
  });
  auto t = OpenOrDie({.dir = dir.path(), .capacity_bytes = 4 << 20, .max_io_bytes = 4096, .env = &failing});
  for (int i = 0; i < 4; ++i) ASSERT_TRUE(t->Put(Obj(i), MakeChunk(i, 64)).ok());
  Batch b(4, 64);
  armed = true;
  auto st = t->ReadBatch(b.ids, b.outs);
  EXPECT_EQ(failed, 1);
  for (int i = 0; i < 4; ++i) {
    EXPECT_TRUE(st[i].ok()) << i << ": " << st[i];
    EXPECT_EQ(b.bufs[i], MakeChunk(i, 64)) << i;
    EXPECT_TRUE(t->Size(Obj(i)).ok()) << i;
  }
}

}  // namespace
}  // namespace kvtier::tiering
