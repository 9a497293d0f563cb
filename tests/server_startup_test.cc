// kvtierd's startup with a DRAM pool populated behind it (the real daemon):
// it is ready (ready file, listeners) while the pool is still populated,
// the pool's ready capacity (kvtier_tier_ready_bytes) grows to the whole
// pool, a log line says when, and SIGTERM while populating exits cleanly.
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <string>

#include "common/testing/temp_dir.h"
#include "common/testing/wait.h"
#include "gtest/gtest.h"
#include "tests/daemon_process.h"
#include "tests/http_get.h"

namespace kvtier::testing {
namespace {

std::string ReadAll(const std::string& path) {
  std::ifstream in(path);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

// The value of the sample `name` in a Prometheus text exposition; -1 if absent.
double Sample(const std::string& text, const std::string& name) {
  const size_t at = text.find("\n" + name + " ");
  return at == std::string::npos ? -1 : std::strtod(text.c_str() + at + name.size() + 2, nullptr);
}

DaemonProcess::Options PopulatedDaemon() {
  DaemonProcess::Options o;
  // 2 GiB takes this 2-core VM about 3.5 s to populate on one thread.
  o.extra_args = {"--dram-gib", "2", "--dram-populate", "true", "--metrics-addr", "127.0.0.1:0"};
  return o;
}

TEST(DaemonStartup, ReadyBeforeTheDramPoolIsPopulated) {
  TempDir dir;
  const auto start = std::chrono::steady_clock::now();
  DaemonProcess d(dir.path(), PopulatedDaemon());
  ASSERT_TRUE(d.WaitReady()) << ReadAll(dir.path() + "/kvtierd.log");
  const double ready_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const std::string ready = ReadAll(dir.path() + "/kvtierd.ready");
  const size_t at = ready.find("metrics http port ");
  ASSERT_NE(at, std::string::npos) << ready;
  const int port = std::atoi(ready.c_str() + at + 18);
  const std::string first = HttpGetLocal(port, "/metrics");
  const double capacity = Sample(first, "kvtier_tier_capacity_bytes{tier=\"dram\"}");
  const double at_ready = Sample(first, "kvtier_tier_ready_bytes{tier=\"dram\"}");
  EXPECT_NEAR(capacity, 2.0 * (1 << 30), 100);  // printed with 9 digits
  // Ready (and serving metrics) with part of the pool usable, the rest behind.
  EXPECT_GT(at_ready, 0);
  EXPECT_LT(at_ready, capacity) << "ready after " << ready_s << " s";
  const std::string log = dir.path() + "/kvtierd.log";
  ASSERT_TRUE(WaitUntil([&] { return ReadAll(log).find("DRAM pool populated") != std::string::npos; },
                        std::chrono::seconds(90)))
      << ReadAll(log);
  EXPECT_EQ(Sample(HttpGetLocal(port, "/metrics"), "kvtier_tier_ready_bytes{tier=\"dram\"}"), capacity);
  const std::string text = ReadAll(log);
  const size_t in = text.find(" GiB in ", text.find("DRAM pool populated"));
  ASSERT_NE(in, std::string::npos) << text;
  const double populate_s = std::strtod(text.c_str() + in + 8, nullptr);
  std::printf("kvtierd --dram-gib 2: ready after %.2f s (from fork), pool populated in %.2f s\n",
              ready_s, populate_s);
  EXPECT_EQ(d.Terminate(), 0);
}

TEST(DaemonStartup, TerminatedWhilePopulatingExitsCleanly) {
  TempDir dir;
  DaemonProcess d(dir.path(), PopulatedDaemon());
  ASSERT_TRUE(d.WaitReady()) << ReadAll(dir.path() + "/kvtierd.log");
  EXPECT_EQ(d.Terminate(), 0) << ReadAll(dir.path() + "/kvtierd.log");
}

}  // namespace
}  // namespace kvtier::testing
