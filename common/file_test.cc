#include "common/file.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>

#include "gtest/gtest.h"

namespace kvtier {
namespace {

std::string TempDir() {
  std::string tmpl = (std::filesystem::temp_directory_path() / "kvtier-file-XXXXXX").string();
  char* dir = ::mkdtemp(tmpl.data());
  return dir ? std::string(dir) : std::string();
}

TEST(File, WriteThenReadRoundTrips) {
  std::string dir = TempDir();
  ASSERT_FALSE(dir.empty());
  std::vector<uint8_t> data = {1, 2, 3, 4, 5};
  ASSERT_TRUE(WriteFileAtomic(dir + "/f", data).ok());
  auto back = ReadFileBytes(dir + "/f", 100);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, data);
  std::filesystem::remove_all(dir);
}

TEST(File, ReadMissingFileIsNotFound) {
  auto r = ReadFileBytes("/nonexistent/kvtier/file", 100);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kNotFound);
}

TEST(File, ReadOversizedFileIsRefusedBeforeAllocating) {
  std::string dir = TempDir();
  std::vector<uint8_t> data(1000, 7);
  ASSERT_TRUE(WriteFileAtomic(dir + "/big", data).ok());
  auto r = ReadFileBytes(dir + "/big", 999);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  std::filesystem::remove_all(dir);
}

TEST(File, ReadDirectoryIsInvalidArgument) {
  std::string dir = TempDir();
  auto r = ReadFileBytes(dir, 100);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  std::filesystem::remove_all(dir);
}

TEST(File, WriteIntoMissingDirectoryFails) {
  std::vector<uint8_t> data(3, 1);
  EXPECT_EQ(WriteFileAtomic("/nonexistent/kvtier/dir/f", data).code(),
            absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace kvtier
