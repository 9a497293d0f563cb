// The I/O layer: MemIoEnv (crash simulation), FaultInjectionIoEnv (each
// fault kind), the io_uring O_DIRECT device, AlignedBuffer and FakeClock.
#include "tiering/io.h"
#include "tiering/odirect_test_util.h"

#include <sys/stat.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <thread>
#include <vector>

#include "common/testing/temp_dir.h"
#include "gtest/gtest.h"

namespace kvtier::tiering {
namespace {

constexpr uint64_t kBlock = 4096;

AlignedBuffer Filled(uint64_t len, uint8_t seed) {
  AlignedBuffer b(len, kBlock);
  for (uint64_t i = 0; i < len; ++i) b.data()[i] = static_cast<uint8_t>(seed + i * 7);
  return b;
}

absl::Status Write(BlockDevice& d, uint64_t off, const AlignedBuffer& b) {
  IoRequest r{IoRequest::Op::kWrite, off, b.data(), b.size()};
  return d.Submit({&r, 1});
}

std::vector<uint8_t> Read(BlockDevice& d, uint64_t off, uint64_t len) {
  AlignedBuffer b(len, kBlock);
  IoRequest r{IoRequest::Op::kRead, off, b.data(), len};
  EXPECT_TRUE(d.Submit({&r, 1}).ok());
  return std::vector<uint8_t>(b.data(), b.data() + len);
}

std::vector<uint8_t> Bytes(const AlignedBuffer& b) { return {b.data(), b.data() + b.size()}; }

TEST(AlignedBuffer, IsAlignedAndMovable) {
  AlignedBuffer a(10000, kBlock);
  ASSERT_NE(a.data(), nullptr);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(a.data()) % kBlock, 0u);
  EXPECT_EQ(a.size(), 10000u);
  uint8_t* p = a.data();
  AlignedBuffer b(std::move(a));
  EXPECT_EQ(b.data(), p);
  EXPECT_EQ(a.data(), nullptr);
  AlignedBuffer c;
  c = std::move(b);
  EXPECT_EQ(c.data(), p);
}

TEST(MemIoEnv, WrittenBytesReadBackAndSurviveReopen) {
  MemIoEnv env;
  auto w = Filled(2 * kBlock, 3);
  {
    auto d = env.OpenDevice("f", 8 * kBlock).value();
    EXPECT_EQ(d->size(), 8 * kBlock);
    ASSERT_TRUE(Write(*d, kBlock, w).ok());
    ASSERT_TRUE(d->Sync().ok());
  }
  auto d = env.OpenDevice("f", 8 * kBlock).value();
  EXPECT_EQ(Read(*d, kBlock, 2 * kBlock), Bytes(w));
  EXPECT_EQ(Read(*d, 0, kBlock), std::vector<uint8_t>(kBlock, 0));
}

TEST(MemIoEnv, MisalignedOrOutOfRangeRequestIsInvalidArgument) {
  MemIoEnv env;
  auto d = env.OpenDevice("f", 4 * kBlock).value();
  AlignedBuffer b(2 * kBlock, kBlock);
  IoRequest bad_off{IoRequest::Op::kWrite, 100, b.data(), kBlock};
  IoRequest bad_len{IoRequest::Op::kWrite, 0, b.data(), 100};
  IoRequest past_end{IoRequest::Op::kRead, 3 * kBlock, b.data(), 2 * kBlock};
  for (const IoRequest& r : {bad_off, bad_len, past_end}) {
    EXPECT_EQ(d->Submit({&r, 1}).code(), absl::StatusCode::kInvalidArgument);
  }
  EXPECT_EQ(env.OpenDevice("g", kBlock + 1).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(MemIoEnv, SimulateCrashRevertsOnlyUnsyncedWrites) {
  MemIoEnv env;
  auto d = env.OpenDevice("f", 4 * kBlock).value();
  auto a = Filled(kBlock, 1), b = Filled(kBlock, 2), c = Filled(kBlock, 3);
  ASSERT_TRUE(Write(*d, 0, a).ok());
  ASSERT_TRUE(d->Sync().ok());
  ASSERT_TRUE(Write(*d, 0, b).ok());      // overwrite, unsynced
  ASSERT_TRUE(Write(*d, kBlock, c).ok());  // new, unsynced
  env.SimulateCrash();
  EXPECT_EQ(Read(*d, 0, kBlock), Bytes(a));
  EXPECT_EQ(Read(*d, kBlock, kBlock), std::vector<uint8_t>(kBlock, 0));
}

TEST(MemIoEnv, CorruptByteFlipsOneBit) {
  MemIoEnv env;
  auto d = env.OpenDevice("f", kBlock).value();
  auto a = Filled(kBlock, 9);
  ASSERT_TRUE(Write(*d, 0, a).ok());
  ASSERT_TRUE(env.CorruptByte("f", 10, 3).ok());
  auto got = Read(*d, 0, kBlock);
  EXPECT_EQ(got[10], a.data()[10] ^ 8);
  got[10] = a.data()[10];
  EXPECT_EQ(got, Bytes(a));
  EXPECT_EQ(env.CorruptByte("nope", 0, 0).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(env.CorruptByte("f", kBlock, 0).code(), absl::StatusCode::kOutOfRange);
}

TEST(FaultInjectionIoEnv, DefaultPolicyInjectsNothing) {
  MemIoEnv mem;
  FaultInjectionIoEnv env(&mem);
  auto d = env.OpenDevice("f", 4 * kBlock).value();
  auto a = Filled(2 * kBlock, 5);
  for (int i = 0; i < 50; ++i) {
    ASSERT_TRUE(Write(*d, 0, a).ok());
    ASSERT_TRUE(d->Sync().ok());
  }
  EXPECT_EQ(Read(*d, 0, 2 * kBlock), Bytes(a));
  EXPECT_EQ(env.injected_faults(), 0u);
}

TEST(FaultInjectionIoEnv, FailAfterNFailsEveryLaterOperationWithTheChosenCode) {
  MemIoEnv mem;
  FaultInjectionIoEnv env(&mem);
  auto d = env.OpenDevice("f", 4 * kBlock).value();
  auto a = Filled(kBlock, 5);
  env.SetPolicy({.fail_after_n = 2});
  EXPECT_TRUE(Write(*d, 0, a).ok());
  EXPECT_TRUE(d->Sync().ok());
  EXPECT_EQ(Write(*d, 0, a).code(), absl::StatusCode::kInternal);
  EXPECT_EQ(d->Sync().code(), absl::StatusCode::kInternal);
  env.SetPolicy({.fail_after_n = 0, .retryable = true});
  EXPECT_EQ(Write(*d, 0, a).code(), absl::StatusCode::kUnavailable);
  env.SetPolicy({.fail_after_n = 0, .enospc = true});
  EXPECT_EQ(Write(*d, 0, a).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(d->Sync().code(), absl::StatusCode::kInternal);  // ENOSPC is for writes
  EXPECT_EQ(env.injected_faults(), 5u);
  env.SetPolicy({});
  EXPECT_TRUE(Write(*d, 0, a).ok());
}

TEST(FaultInjectionIoEnv, OneInFailsSomeOperationsReproduciblyFromTheSeed) {
  auto run = [](uint64_t seed) {
    MemIoEnv mem;
    FaultInjectionIoEnv env(&mem);
    auto d = env.OpenDevice("f", kBlock).value();
    env.SetPolicy({.one_in = 4, .seed = seed});
    auto a = Filled(kBlock, 1);
    std::vector<bool> failed;
    for (int i = 0; i < 200; ++i) failed.push_back(!Write(*d, 0, a).ok());
    return failed;
  };
  auto f = run(7);
  int n = std::accumulate(f.begin(), f.end(), 0);
  EXPECT_GT(n, 20);
  EXPECT_LT(n, 100);
  EXPECT_EQ(run(7), f);
  EXPECT_NE(run(8), f);
}

TEST(FaultInjectionIoEnv, TornWriteReportsSuccessButPersistsOnlyTheFirstHalf) {
  MemIoEnv mem;
  FaultInjectionIoEnv env(&mem);
  auto d = env.OpenDevice("f", 8 * kBlock).value();
  env.SetPolicy({.torn_write_one_in = 1});
  auto a = Filled(4 * kBlock, 11);
  ASSERT_TRUE(Write(*d, 0, a).ok());
  auto got = Read(*d, 0, 4 * kBlock);
  EXPECT_TRUE(std::equal(got.begin(), got.begin() + 2 * kBlock, a.data()));
  EXPECT_EQ(std::vector<uint8_t>(got.begin() + 2 * kBlock, got.end()),
            std::vector<uint8_t>(2 * kBlock, 0));
  EXPECT_EQ(env.injected_faults(), 1u);
}

TEST(FaultInjectionIoEnv, DropUnsyncedWritesRestoresPriorBytes) {
  MemIoEnv mem;
  FaultInjectionIoEnv env(&mem, {.drop_unflushed = true});
  auto d = env.OpenDevice("f", 4 * kBlock).value();
  auto a = Filled(kBlock, 1), b = Filled(kBlock, 2);
  ASSERT_TRUE(Write(*d, 0, a).ok());
  ASSERT_TRUE(d->Sync().ok());
  ASSERT_TRUE(Write(*d, 0, b).ok());
  ASSERT_TRUE(Write(*d, kBlock, b).ok());
  EXPECT_EQ(Read(*d, 0, kBlock), Bytes(b));
  ASSERT_TRUE(env.DropUnsyncedWrites().ok());
  EXPECT_EQ(Read(*d, 0, kBlock), Bytes(a));
  EXPECT_EQ(Read(*d, kBlock, kBlock), std::vector<uint8_t>(kBlock, 0));
  // The device stays usable.
  ASSERT_TRUE(Write(*d, 2 * kBlock, b).ok());
  EXPECT_EQ(Read(*d, 2 * kBlock, kBlock), Bytes(b));
}

// A file in a temp dir, removed after. Its tests skip where /tmp refuses O_DIRECT
// (KVTIER_SKIP_WITHOUT_ODIRECT: they fail instead under KVTIER_REQUIRE_ODIRECT=1).
class UringDeviceTest : public ::testing::Test {
 protected:
  void SetUp() override { path_ = dir_.path() + "/dev.bin"; }
  std::unique_ptr<BlockDevice> Open(uint64_t size, uint32_t qd) {
    env_ = NewUringIoEnv({.queue_depth = qd});
    auto d = env_->OpenDevice(path_, size);
    if (absl::IsFailedPrecondition(d.status())) return nullptr;  // no O_DIRECT
    EXPECT_TRUE(d.ok()) << d.status();
    return d.ok() ? std::move(*d) : nullptr;
  }
  ::kvtier::testing::TempDir dir_{"kvtier-io-test"};
  std::string path_;
  std::unique_ptr<IoEnv> env_;
};

TEST_F(UringDeviceTest, ManyRequestsBeyondQueueDepthRoundTrip) {
  auto d = Open(64 * kBlock, 4);
  KVTIER_SKIP_WITHOUT_ODIRECT(d != nullptr);
  struct stat st;
  ASSERT_EQ(stat(path_.c_str(), &st), 0);
  EXPECT_EQ(static_cast<uint64_t>(st.st_size), 64 * kBlock);  // sized at open
  auto a = Filled(64 * kBlock, 17);
  std::vector<IoRequest> w;
  for (uint64_t i = 0; i < 32; ++i) {  // 32 requests of 2 blocks at depth 4
    w.push_back({IoRequest::Op::kWrite, i * 2 * kBlock, a.data() + i * 2 * kBlock, 2 * kBlock});
  }
  ASSERT_TRUE(d->Submit(w).ok());
  ASSERT_TRUE(d->Sync().ok());
  AlignedBuffer r(64 * kBlock, kBlock);
  std::vector<IoRequest> rd;
  for (uint64_t i = 0; i < 64; ++i) rd.push_back({IoRequest::Op::kRead, i * kBlock, r.data() + i * kBlock, kBlock});
  ASSERT_TRUE(d->Submit(rd).ok());
  EXPECT_EQ(std::memcmp(r.data(), a.data(), 64 * kBlock), 0);
}

TEST_F(UringDeviceTest, ConcurrentSubmitsFromManyThreads) {
  auto d = Open(64 * kBlock, 8);
  KVTIER_SKIP_WITHOUT_ODIRECT(d != nullptr);
  std::vector<std::thread> ts;
  std::atomic<int> bad{0};
  for (int t = 0; t < 8; ++t) {
    ts.emplace_back([&, t] {
      auto a = Filled(8 * kBlock, static_cast<uint8_t>(t));
      for (int rep = 0; rep < 10; ++rep) {
        if (!Write(*d, t * 8 * kBlock, a).ok()) ++bad;
        if (Read(*d, t * 8 * kBlock, 8 * kBlock) != Bytes(a)) ++bad;
      }
    });
  }
  for (auto& t : ts) t.join();
  EXPECT_EQ(bad.load(), 0);
}

TEST_F(UringDeviceTest, MisalignedRequestIsInvalidArgumentBeforeAnyIo) {
  auto d = Open(4 * kBlock, 4);
  KVTIER_SKIP_WITHOUT_ODIRECT(d != nullptr);
  AlignedBuffer b(2 * kBlock, kBlock);
  IoRequest unaligned_buf{IoRequest::Op::kWrite, 0, b.data() + 1, kBlock};
  IoRequest bad_len{IoRequest::Op::kWrite, 0, b.data(), 100};
  IoRequest past_end{IoRequest::Op::kRead, 3 * kBlock, b.data(), 2 * kBlock};
  for (const IoRequest& r : {unaligned_buf, bad_len, past_end}) {
    EXPECT_EQ(d->Submit({&r, 1}).code(), absl::StatusCode::kInvalidArgument);
  }
  EXPECT_EQ(env_->OpenDevice(dir_.path() + "/odd.bin", kBlock + 1).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(UringDeviceTest, ReopenWithSmallerSizeShrinksTheFile) {
  ASSERT_NE(Open(16 * kBlock, 4), nullptr);
  auto d = Open(4 * kBlock, 4);
  ASSERT_NE(d, nullptr);
  struct stat st;
  ASSERT_EQ(stat(path_.c_str(), &st), 0);
  EXPECT_EQ(static_cast<uint64_t>(st.st_size), 4 * kBlock);
  EXPECT_TRUE(env_->RemoveFile(path_).ok());
  EXPECT_TRUE(env_->RemoveFile(path_).ok());  // already gone: still OK
}

TEST_F(UringDeviceTest, SubmitWithCompletionsReportsEachRequestOnceWithItsBytes) {
  auto d = Open(64 * kBlock, 4);
  KVTIER_SKIP_WITHOUT_ODIRECT(d != nullptr);
  auto a = Filled(64 * kBlock, 29);
  ASSERT_TRUE(Write(*d, 0, a).ok());
  AlignedBuffer r(64 * kBlock, kBlock);
  std::memset(r.data(), 0, 64 * kBlock);
  std::vector<IoRequest> rd;  // 16 requests of 4 blocks at depth 4
  for (uint64_t i = 0; i < 16; ++i) {
    rd.push_back({IoRequest::Op::kRead, i * 4 * kBlock, r.data() + i * 4 * kBlock, 4 * kBlock});
  }
  std::vector<int> reported(rd.size(), 0);
  int bytes_wrong = 0;
  ASSERT_TRUE(d->SubmitWithCompletions(rd, [&](size_t i) {
                 ++reported[i];
                 // A reported request's bytes are in place when it is reported.
                 if (std::memcmp(rd[i].buf, a.data() + rd[i].offset, rd[i].len) != 0) ++bytes_wrong;
               }).ok());
  EXPECT_EQ(reported, std::vector<int>(rd.size(), 1));
  EXPECT_EQ(bytes_wrong, 0);
}

TEST_F(UringDeviceTest, SubmitWithCompletionsRejectsABadRequestWithoutReportingIt) {
  auto d = Open(8 * kBlock, 4);
  KVTIER_SKIP_WITHOUT_ODIRECT(d != nullptr);
  AlignedBuffer b(2 * kBlock, kBlock);
  IoRequest past_end{IoRequest::Op::kRead, 7 * kBlock, b.data(), 2 * kBlock};
  int reported = 0;
  EXPECT_EQ(d->SubmitWithCompletions({&past_end, 1}, [&](size_t) { ++reported; }).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(reported, 0);
}

TEST(FaultInjectionIoEnv, FailMidSubmitCompletesTheFirstHalfThenFails) {
  MemIoEnv mem;
  FaultInjectionIoEnv faulty(&mem);
  auto d = faulty.OpenDevice("f", 8 * kBlock).value();
  auto a = Filled(8 * kBlock, 5);
  ASSERT_TRUE(Write(*d, 0, a).ok());
  for (bool retryable : {false, true}) {
    faulty.SetPolicy({.fail_after_n = 0, .retryable = retryable, .fail_mid_submit = true});
    AlignedBuffer r(8 * kBlock, kBlock);
    std::memset(r.data(), 0, 8 * kBlock);
    std::vector<IoRequest> rd;
    for (uint64_t i = 0; i < 4; ++i) {
      rd.push_back({IoRequest::Op::kRead, i * 2 * kBlock, r.data() + i * 2 * kBlock, 2 * kBlock});
    }
    std::vector<size_t> reported;
    absl::Status st = d->SubmitWithCompletions(rd, [&](size_t i) { reported.push_back(i); });
    EXPECT_EQ(st.code(), retryable ? absl::StatusCode::kUnavailable : absl::StatusCode::kInternal);
    EXPECT_EQ(reported, (std::vector<size_t>{0, 1}));
    EXPECT_EQ(std::memcmp(r.data(), a.data(), 4 * kBlock), 0);  // the first half ran
    EXPECT_EQ(r.data()[4 * kBlock], 0);                          // the rest did not
    // Without fail_mid_submit the failure comes before any request runs.
    faulty.SetPolicy({.fail_after_n = 0});
    reported.clear();
    EXPECT_EQ(d->SubmitWithCompletions(rd, [&](size_t i) { reported.push_back(i); }).code(),
              absl::StatusCode::kInternal);
    EXPECT_TRUE(reported.empty());
    faulty.SetPolicy({});
  }
}

TEST(FaultInjectionIoEnv, SubmitWithCompletionsReportsTornWritesAsComplete) {
  MemIoEnv mem;
  FaultInjectionIoEnv faulty(&mem, FaultPolicy{.torn_write_one_in = 1});
  auto d = faulty.OpenDevice("f", 8 * kBlock).value();
  auto a = Filled(4 * kBlock, 9);
  // A one-block write torn in half writes nothing, yet reports completion.
  std::vector<IoRequest> w = {{IoRequest::Op::kWrite, 0, a.data(), kBlock},
                              {IoRequest::Op::kWrite, kBlock, a.data() + kBlock, 3 * kBlock}};
  std::vector<size_t> reported;
  ASSERT_TRUE(d->SubmitWithCompletions(w, [&](size_t i) { reported.push_back(i); }).ok());
  std::sort(reported.begin(), reported.end());
  EXPECT_EQ(reported, (std::vector<size_t>{0, 1}));
}

TEST(FakeClock, MovesOnlyWhenAdvanced) {
  FakeClock c;
  int64_t t = c.NowMicros();
  EXPECT_EQ(c.NowMicros(), t);
  c.AdvanceMicros(250);
  EXPECT_EQ(c.NowMicros(), t + 250);
  EXPECT_GE(SystemClock()->NowMicros(), 0);
}

}  // namespace
}  // namespace kvtier::tiering
