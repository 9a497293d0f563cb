// A test fixture with a kvtierd (server::Daemon) running in the test's own
// process on a temp data dir, and libkvtier clients of it.
#ifndef KVTIER_TESTS_IN_PROCESS_DAEMON_H_
#define KVTIER_TESTS_IN_PROCESS_DAEMON_H_

#include <memory>
#include <utility>

#include "client/kvtier_client.h"
#include "common/testing/temp_dir.h"
#include "gtest/gtest.h"
#include "server/daemon.h"
#include "server/test_util.h"

namespace kvtier::testing {

class InProcessDaemonTest : public ::testing::Test {
 protected:
  // Stops the running daemon, if any, then starts one with `o`.
  void StartDaemon(server::DaemonOptions o) {
    daemon_.reset();
    auto d = server::Daemon::Start(o);
    ASSERT_TRUE(d.ok()) << d.status();
    daemon_ = std::move(*d);
  }
  void SetUp() override { StartDaemon(SmallDaemonOptions(dir_.path())); }

  // A client over the daemon's Unix socket (null, with a test failure, if it
  // cannot connect).
  std::unique_ptr<client::KvtierClient> Client(bool shm = true) {
    client::ClientOptions o;
    o.socket_path = daemon_->socket_path();
    o.shared_memory = shm;
    o.timeout_ms = 10000;
    auto c = client::KvtierClient::Connect(o);
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? std::move(*c) : nullptr;
  }

  TempDir dir_;
  std::unique_ptr<server::Daemon> daemon_;
};

}  // namespace kvtier::testing

#endif  // KVTIER_TESTS_IN_PROCESS_DAEMON_H_
