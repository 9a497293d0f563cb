// A client that outlives its daemon: kvtierd killed (SIGKILL) or stopped
// (SIGTERM), and a new one started on the same socket and data dir. The
// client must take the new daemon's pool and never serve one key's bytes as
// another's, over the data plane and over gRPC holds alike.
#include <signal.h>

#include <memory>
#include <string>
#include <vector>

#include "client/kvtier_client.h"
#include "common/testing/temp_dir.h"
#include "gtest/gtest.h"
#include "server/test_util.h"
#include "tests/daemon_process.h"

namespace kvtier::testing {
namespace {

struct RestartCase {
  int signal;       // how the first daemon ends
  bool data_plane;  // client A's calls over the data plane (else gRPC holds)
};

std::string CaseName(const ::testing::TestParamInfo<RestartCase>& info) {
  return std::string(info.param.signal == SIGKILL ? "Killed" : "Terminated") +
         (info.param.data_plane ? "DataPlane" : "Grpc");
}

std::unique_ptr<client::KvtierClient> Connect(const std::string& socket, bool data_plane) {
  client::ClientOptions o;
  o.socket_path = socket;
  o.timeout_ms = 5000;
  if (!data_plane) o.max_data_connections = 0;
  auto c = client::KvtierClient::Connect(o);
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? *std::move(c) : nullptr;
}

class DaemonRestartTest : public ::testing::TestWithParam<RestartCase> {};

TEST_P(DaemonRestartTest, ClientTakesTheNewPoolAndNeverReadsAnotherKeysBytes) {
  const RestartCase rc = GetParam();
  TempDir dir;
  const std::vector<uint8_t> x = MakeChunk(1), y = MakeChunk(2), z = MakeChunk(3);
  ASSERT_EQ(x.size(), y.size());  // same size: the new daemon puts Y where the old pool has X
  auto first = std::make_unique<DaemonProcess>(dir.path());
  ASSERT_TRUE(first->WaitReady());
  auto a = Connect(first->socket(), rc.data_plane);
  ASSERT_TRUE(a != nullptr && a->uses_shared_memory());
  ASSERT_TRUE(a->Put(TestKey(1), x).ok());
  ASSERT_EQ(a->Get(TestKey(1)).value(), x);
  if (rc.signal == SIGKILL) {
    first->Kill();
  } else {
    ASSERT_EQ(first->Terminate(), 0);
  }
  first.reset();

  DaemonProcess second(dir.path());
  ASSERT_TRUE(second.WaitReady());
  auto b = Connect(second.socket(), true);
  ASSERT_TRUE(b != nullptr);
  ASSERT_TRUE(b->Put(TestKey(2), y).ok());

  // Every read of key 2 by A is Y or an error; a gRPC channel may take a
  // try to reconnect, the data plane none.
  int served = 0;
  for (int i = 0; i < 6; ++i) {
    auto got = a->Get(TestKey(2));
    if (got.ok()) {
      EXPECT_EQ(*got, y) << "try " << i << " read " << (*got == x ? "key 1's bytes" : "garbage");
      ++served;
    } else {
      EXPECT_TRUE(!rc.data_plane && i < 3) << "try " << i << ": " << got.status();
    }
  }
  EXPECT_GE(served, 3);
  auto held = a->Hold(TestKey(2));
  ASSERT_TRUE(held.ok()) << held.status();
  EXPECT_EQ(std::vector<uint8_t>(held->data.begin(), held->data.end()), y);
  EXPECT_TRUE(a->Unhold(*held).ok());

  // A's puts land in the new daemon's pool.
  absl::Status put = a->Put(TestKey(3), z);
  ASSERT_TRUE(put.ok()) << put;
  EXPECT_EQ(b->Get(TestKey(3)).value(), z);
  // Key 1: flushed to NVMe by SIGTERM, lost to SIGKILL (it was in DRAM only).
  auto one = a->Get(TestKey(1));
  if (rc.signal == SIGTERM) {
    ASSERT_TRUE(one.ok()) << one.status();
    EXPECT_EQ(*one, x);
  } else {
    EXPECT_TRUE(absl::IsNotFound(one.status())) << one.status();
  }
}

INSTANTIATE_TEST_SUITE_P(Restarts, DaemonRestartTest,
                         ::testing::Values(RestartCase{SIGKILL, true}, RestartCase{SIGTERM, true},
                                           RestartCase{SIGKILL, false},
                                           RestartCase{SIGTERM, false}),
                         CaseName);

}  // namespace
}  // namespace kvtier::testing
