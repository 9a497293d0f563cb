// kvtierd's memory after large inline gets end: the heap's free memory goes
// back to the system instead of staying in the allocator's arenas.
#include <atomic>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "client/kvtier_client.h"
#include "common/testing/temp_dir.h"
#include "common/testing/wait.h"
#include "gtest/gtest.h"
#include "server/test_util.h"
#include "tests/daemon_process.h"

namespace kvtier::testing {
namespace {

int64_t RssMiB(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stoll(line.substr(6)) / 1024;
  }
  return -1;
}

TEST(DaemonMemory, InlineGetsGiveTheirMemoryBackOnceTheyEnd) {
  TempDir dir;
  DaemonProcess::Options po;
  po.extra_args = {"--dram-gib", "0.5", "--nvme-gib", "0"};
  DaemonProcess d(dir.path(), po);
  ASSERT_TRUE(d.WaitReady());
  const std::vector<uint8_t> chunk = MakeChunk(1, /*tokens=*/64, /*layers=*/32, /*heads=*/8, 128);
  ASSERT_GE(chunk.size(), 6u << 20);
  client::ClientOptions o;
  o.socket_path = d.socket();
  o.shared_memory = false;  // inline: every get's bytes pass through the daemon's heap
  o.timeout_ms = 20000;
  {
    auto c = client::KvtierClient::Connect(o);
    ASSERT_TRUE(c.ok()) << c.status();
    for (uint32_t i = 0; i < 12; ++i) ASSERT_TRUE((*c)->Put(TestKey(i), chunk).ok()) << i;
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  const int64_t before = RssMiB(d.pid());
  ASSERT_GT(before, 0);
  std::atomic<int> served{0};
  std::vector<std::thread> readers;
  for (int t = 0; t < 16; ++t) {
    readers.emplace_back([&] {
      auto c = client::KvtierClient::Connect(o);
      if (!c.ok()) return;
      for (int round = 0; round < 3; ++round) {
        for (uint32_t i = 0; i < 12; ++i) {
          // Past the daemon's in-flight limits a get is refused: fine here.
          if ((*c)->Get(TestKey(i)).ok()) ++served;
        }
      }
    });
  }
  for (std::thread& t : readers) t.join();
  EXPECT_GE(served.load(), 96);
  // Within a few seconds of the last get the daemon is back near where it
  // started (it held hundreds of MiB in buffers while the gets ran).
  int64_t after = 0;
  EXPECT_TRUE(WaitUntil([&] { return (after = RssMiB(d.pid())) <= before + 80; },
                        std::chrono::seconds(5)))
      << "RSS " << before << " MiB before the gets, " << after << " MiB after";
  std::printf("RSS %lld MiB before the gets, %lld MiB after\n", static_cast<long long>(before),
              static_cast<long long>(after));
}

}  // namespace
}  // namespace kvtier::testing
