#include "common/file.h"

#include <sys/stat.h>
#include <unistd.h>

#include <string>
#include <vector>

#include "common/testing/temp_dir.h"
#include "gtest/gtest.h"

namespace kvtier {
namespace {

TEST(File, WriteThenReadRoundTrips) {
  testing::TempDir tmp("kvtier-file");
  const std::string& dir = tmp.path();
  ASSERT_FALSE(dir.empty());
  std::vector<uint8_t> data = {1, 2, 3, 4, 5};
  ASSERT_TRUE(WriteFileAtomic(dir + "/f", data).ok());
  auto back = ReadFileBytes(dir + "/f", 100);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, data);
}

TEST(File, ReadMissingFileIsNotFound) {
  auto r = ReadFileBytes("/nonexistent/kvtier/file", 100);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kNotFound);
}

TEST(File, ReadOversizedFileIsRefusedBeforeAllocating) {
  testing::TempDir tmp("kvtier-file");
  const std::string& dir = tmp.path();
  std::vector<uint8_t> data(1000, 7);
  ASSERT_TRUE(WriteFileAtomic(dir + "/big", data).ok());
  auto r = ReadFileBytes(dir + "/big", 999);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(File, ReadDirectoryIsInvalidArgument) {
  testing::TempDir tmp("kvtier-file");
  const std::string& dir = tmp.path();
  auto r = ReadFileBytes(dir, 100);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
}

// A FIFO with no writer is refused at once, not waited on.
TEST(File, ReadFifoIsInvalidArgumentWithoutBlocking) {
  testing::TempDir tmp("kvtier-file");
  const std::string fifo = tmp.path() + "/fifo";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  auto r = ReadFileBytes(fifo, 100);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(File, WriteIntoMissingDirectoryFails) {
  std::vector<uint8_t> data(3, 1);
  EXPECT_EQ(WriteFileAtomic("/nonexistent/kvtier/dir/f", data).code(),
            absl::StatusCode::kNotFound);
}

TEST(ExclusiveFileLock, SecondAcquireFailsUntilTheHolderReleases) {
  testing::TempDir tmp("kvtier-file");
  const std::string& dir = tmp.path();
  ASSERT_FALSE(dir.empty());
  const std::string path = dir + "/x.lock";
  {
    auto first = ExclusiveFileLock::Acquire(path);
    ASSERT_TRUE(first.ok()) << first.status();
    EXPECT_EQ(first->path(), path);
    struct stat st;
    ASSERT_EQ(::stat(path.c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 0777, 0600u);
    auto second = ExclusiveFileLock::Acquire(path);
    EXPECT_EQ(second.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_EQ(second.status().message(),
              path + " is locked by pid " + std::to_string(::getpid()));
    // A moved lock is still held, and the moved-from object releases nothing.
    ExclusiveFileLock moved = std::move(*first);
    first = absl::UnknownError("moved");
    EXPECT_EQ(ExclusiveFileLock::Acquire(path).status().code(),
              absl::StatusCode::kFailedPrecondition);
  }
  // Released with the last holder; the file stays.
  auto again = ExclusiveFileLock::Acquire(path);
  ASSERT_TRUE(again.ok()) << again.status();
  auto read = ReadFileBytes(path, 100);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(std::string(read->begin(), read->end()), std::to_string(::getpid()) + "\n");
}

TEST(ExclusiveFileLock, RefusesSymlinksAndMissingDirectories) {
  testing::TempDir tmp("kvtier-file");
  const std::string& dir = tmp.path();
  ASSERT_FALSE(dir.empty());
  std::vector<uint8_t> data = {'k', 'e', 'e', 'p'};
  ASSERT_TRUE(WriteFileAtomic(dir + "/target", data).ok());
  ASSERT_EQ(::symlink((dir + "/target").c_str(), (dir + "/link.lock").c_str()), 0);
  EXPECT_EQ(ExclusiveFileLock::Acquire(dir + "/link.lock").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ReadFileBytes(dir + "/target", 100).value(), data);
  EXPECT_EQ(ExclusiveFileLock::Acquire(dir).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ExclusiveFileLock::Acquire(dir + "/missing/x.lock").status().code(),
            absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace kvtier
