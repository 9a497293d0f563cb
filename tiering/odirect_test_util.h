// Tests of the production I/O path (io_uring on O_DIRECT files) skip where the
// file system of the temp dir refuses O_DIRECT (tmpfs, some overlays). With
// KVTIER_REQUIRE_ODIRECT=1 in the environment (.ci/run sets it) they fail
// instead, so that CI never passes without running that path.
#ifndef KVTIER_TIERING_ODIRECT_TEST_UTIL_H_
#define KVTIER_TIERING_ODIRECT_TEST_UTIL_H_

#include <cstdlib>
#include <cstring>

#include "gtest/gtest.h"

namespace kvtier::tiering::testing {

inline bool ODirectRequired() {
  const char* v = std::getenv("KVTIER_REQUIRE_ODIRECT");
  return v != nullptr && std::strcmp(v, "1") == 0;
}

}  // namespace kvtier::tiering::testing

// In a test body: skips (or, when required, fails) unless `available`.
#define KVTIER_SKIP_WITHOUT_ODIRECT(available)                                        \
  do {                                                                                \
    if (!(available)) {                                                               \
      if (::kvtier::tiering::testing::ODirectRequired()) {                            \
        FAIL() << "O_DIRECT refused under the temp dir, and KVTIER_REQUIRE_ODIRECT=1"; \
      }                                                                               \
      GTEST_SKIP() << "O_DIRECT not supported under the temp dir";                    \
    }                                                                                 \
  } while (0)

#endif  // KVTIER_TIERING_ODIRECT_TEST_UTIL_H_
