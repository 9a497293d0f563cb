// Bounded waits for tests: poll a condition until it holds or a deadline
// passes, instead of sleeping a fixed time and hoping it happened.
#ifndef KVTIER_COMMON_TESTING_WAIT_H_
#define KVTIER_COMMON_TESTING_WAIT_H_

#include <sys/stat.h>

#include <chrono>
#include <string>
#include <thread>

namespace kvtier::testing {

// Calls `condition` until it returns true or `timeout` has passed (it is
// called once more at the deadline), sleeping `poll` between calls. Returns
// whether it held.
template <typename F>
bool WaitUntil(F&& condition, std::chrono::milliseconds timeout,
               std::chrono::milliseconds poll = std::chrono::milliseconds(10)) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (!condition()) {
    if (std::chrono::steady_clock::now() >= deadline) return condition();
    std::this_thread::sleep_for(poll);
  }
  return true;
}

// Waits until the file at `path` exists (e.g. kvtierd's --ready-file).
inline bool WaitForFile(const std::string& path, std::chrono::milliseconds timeout) {
  return WaitUntil([&] {
    struct stat st;
    return ::stat(path.c_str(), &st) == 0;
  }, timeout);
}

}  // namespace kvtier::testing

#endif  // KVTIER_COMMON_TESTING_WAIT_H_
