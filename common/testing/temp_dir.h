// The temp directory of every kvtier test: a fresh directory under the
// system temp dir ($TMPDIR, else /tmp), removed with everything in it when
// the object goes away. Header-only, so any test target can use it.
#ifndef KVTIER_COMMON_TESTING_TEMP_DIR_H_
#define KVTIER_COMMON_TESTING_TEMP_DIR_H_

#include <stdlib.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <string>
#include <string_view>
#include <system_error>

#include "gtest/gtest.h"

namespace kvtier::testing {

// Not copyable: one owner removes the tree. If the directory cannot be
// created the test fails (ADD_FAILURE) and path() is empty.
class TempDir {
 public:
  // The directory is named `<prefix>-XXXXXX` with a unique suffix.
  explicit TempDir(std::string_view prefix = "kvtier-test") {
    std::error_code ec;
    std::filesystem::path base = std::filesystem::temp_directory_path(ec);
    if (ec) base = "/tmp";
    std::string tmpl = (base / (std::string(prefix) + "-XXXXXX")).string();
    if (::mkdtemp(tmpl.data()) != nullptr) {
      path_ = tmpl;
    } else {
      ADD_FAILURE() << "mkdtemp(" << tmpl << "): " << std::strerror(errno);
    }
  }
  ~TempDir() {
    if (path_.empty()) return;
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  // The absolute path of the directory, without a trailing slash.
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

}  // namespace kvtier::testing

#endif  // KVTIER_COMMON_TESTING_TEMP_DIR_H_
