// The real binaries: kvtierd spawned in a temp data dir, driven with the
// `kvtier` CLI; SIGTERM, then a restart that serves the same bytes from NVMe.
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <thread>

#include "common/testing/temp_dir.h"
#include "common/testing/wait.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/test_util.h"
#include "tests/cli_runner.h"
#include "tests/daemon_process.h"

namespace kvtier::testing {
namespace {

class CliTest : public ::testing::Test {
 protected:
  CliResult Kvtier(const std::string& args) {
    return RunCommand(std::string(KVTIER_CLI_PATH) + " " + args, dir_.path());
  }
  std::string P(const std::string& name) { return dir_.path() + "/" + name; }
  void WriteChunk(const std::string& name, uint32_t seed) {
    auto c = MakeChunk(seed);
    std::ofstream(P(name), std::ios::binary).write(reinterpret_cast<const char*>(c.data()),
                                                   static_cast<std::streamsize>(c.size()));
  }
  TempDir dir_;
};

// kvtierd's NVMe tier reads its probe file at startup (--nvme-read-probe-mib),
// so the read rate that prices NVMe hits is there before the tier reads a chunk.
TEST_F(CliTest, NvmeReadRateIsMeasuredBeforeTheFirstRead) {
  DaemonProcess d(dir_.path());
  ASSERT_TRUE(d.WaitReady());
  const std::string sock = " --socket " + d.socket();
  double rate = 0;
  for (int i = 0; i < 200 && rate <= 0; ++i) {
    auto stats = Kvtier("stats --json" + sock);
    ASSERT_EQ(stats.exit_code, 0) << stats.err;
    const size_t nvme = stats.out.find("\"tier\":\"nvme\"");
    ASSERT_NE(nvme, std::string::npos) << stats.out;
    const std::string field = "\"read_bytes_per_s\":";
    const size_t at = stats.out.find(field, nvme);
    ASSERT_NE(at, std::string::npos) << stats.out;
    rate = std::strtod(stats.out.c_str() + at + field.size(), nullptr);
    EXPECT_THAT(stats.out, ::testing::HasSubstr("\"gets\":0"));
    if (rate <= 0) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_GT(rate, 0) << "the NVMe tier had no read rate 10 s after startup";
  EXPECT_EQ(d.Terminate(), 0);
}

TEST_F(CliTest, PutGetLookupDeleteStatsAgainstTheRealDaemon) {
  DaemonProcess d(dir_.path());
  ASSERT_TRUE(d.WaitReady());
  const std::string sock = " --socket " + d.socket();
  const std::string k1 = TestKey(1).ToHex(), k2 = TestKey(2).ToHex(), k3 = TestKey(3).ToHex();
  WriteChunk("a.kvc", 1);
  auto put = Kvtier("put --key " + k1 + sock + " " + P("a.kvc"));
  ASSERT_EQ(put.exit_code, 0) << put.err;
  EXPECT_THAT(put.out, ::testing::HasSubstr("stored " + k1));
  auto get = Kvtier("get --key " + k1 + sock + " -o " + P("out.kvc"));
  ASSERT_EQ(get.exit_code, 0) << get.err;
  EXPECT_EQ(ReadAll(P("out.kvc")), ReadAll(P("a.kvc")));
  auto lookup = Kvtier("lookup --keys " + k1 + "," + k2 + "," + k3 + sock);
  EXPECT_EQ(lookup.exit_code, 0) << lookup.err;
  EXPECT_THAT(lookup.out, ::testing::HasSubstr("cached prefix: 1 of 3 chunks"));
  EXPECT_THAT(lookup.out, ::testing::HasSubstr(k1 + " dram"));
  EXPECT_THAT(lookup.out, ::testing::HasSubstr(" bytes, load ~"));
  auto worth = Kvtier("lookup --keys " + k1 + " --prefill-tokens-per-s 1000 --tokens-per-chunk 16" + sock);
  EXPECT_EQ(worth.exit_code, 0) << worth.err;
  EXPECT_THAT(worth.out, ::testing::HasSubstr("worth loading: 1 of 1 cached chunks"));
  auto negative = Kvtier("lookup --keys " + k1 + " --prefill-tokens-per-s -1" + sock);
  EXPECT_EQ(negative.exit_code, 2);
  EXPECT_THAT(negative.err, ::testing::HasSubstr("prefill_tokens_per_s"));
  auto attention = Kvtier("lookup --keys " + k1 +
                          " --prefill-tokens-per-s 1000 --tokens-per-chunk 16"
                          " --attention-doubling-tokens 16" + sock);
  EXPECT_EQ(attention.exit_code, 0) << attention.err;
  EXPECT_THAT(attention.out, ::testing::HasSubstr("worth loading: 1 of 1 cached chunks"));
  auto no_length = Kvtier("lookup --keys " + k1 +
                          " --prefill-tokens-per-s 1000 --attention-doubling-tokens -1" + sock);
  EXPECT_EQ(no_length.exit_code, 2);
  EXPECT_THAT(no_length.err, ::testing::HasSubstr("attention_doubling_tokens"));
  auto stats = Kvtier("stats --json" + sock);
  EXPECT_EQ(stats.exit_code, 0);
  EXPECT_THAT(stats.out, ::testing::HasSubstr("\"tier\":\"dram\""));
  EXPECT_THAT(stats.out, ::testing::HasSubstr("\"puts\":1"));
  auto table = Kvtier("stats" + sock);
  EXPECT_THAT(table.out, ::testing::HasSubstr("nvme"));
  EXPECT_THAT(table.out, ::testing::HasSubstr("read_GB/s"));
  EXPECT_EQ(Kvtier("delete --key " + k1 + sock).exit_code, 0);

  // A miss exits 1 with "not found"; other failures exit 2 with one line.
  auto miss = Kvtier("get --key " + k1 + sock + " -o " + P("x"));
  EXPECT_EQ(miss.exit_code, 1);
  EXPECT_EQ(miss.err, "kvtier: not found: " + k1 + "\n");
  EXPECT_EQ(Kvtier("delete --key " + k1 + sock).exit_code, 1);
  EXPECT_EQ(Kvtier("lookup --keys " + k2 + sock).exit_code, 1);
  auto badkey = Kvtier("get --key xyz" + sock + " -o " + P("x"));
  EXPECT_EQ(badkey.exit_code, 2);
  EXPECT_THAT(badkey.err, ::testing::StartsWith("kvtier: key 'xyz'"));
  std::ofstream(P("junk.kvc")) << "not a chunk";
  auto junk = Kvtier("put --key " + k2 + sock + " " + P("junk.kvc"));
  EXPECT_EQ(junk.exit_code, 2);
  EXPECT_EQ(std::count(junk.err.begin(), junk.err.end(), '\n'), 1);
  auto nodaemon = Kvtier("stats --socket " + P("nope.sock"));
  EXPECT_EQ(nodaemon.exit_code, 2);
  EXPECT_THAT(nodaemon.err, ::testing::HasSubstr("not reachable"));
  EXPECT_EQ(d.Terminate(), 0);
}

TEST_F(CliTest, SigtermKeepsTheCacheWarmAcrossARestart) {
  const std::string k = TestKey(7).ToHex(), kd = TestKey(8).ToHex();
  WriteChunk("c.kvc", 7);
  WriteChunk("d.kvc", 8);
  {
    DaemonProcess d(dir_.path());
    ASSERT_TRUE(d.WaitReady());
    const std::string sock = " --socket " + d.socket();
    ASSERT_EQ(Kvtier("put --key " + k + sock + " " + P("c.kvc")).exit_code, 0);
    ASSERT_EQ(Kvtier("put --durable --key " + kd + sock + " " + P("d.kvc")).exit_code, 0);
    EXPECT_THAT(ReadAll(P("kvtierd.ready")), ::testing::StartsWith(std::to_string(d.pid()) + "\n"));
    ASSERT_EQ(d.Terminate(), 0);
    EXPECT_THAT(ReadAll(P("kvtierd.log")), ::testing::HasSubstr("wrote 1 DRAM chunks to NVMe"));
    EXPECT_EQ(ReadAll(P("kvtierd.ready")), "");  // removed once shutdown starts
  }
  DaemonProcess d(dir_.path());
  ASSERT_TRUE(d.WaitReady());
  const std::string sock = " --socket " + d.socket();
  auto lookup = Kvtier("lookup --keys " + k + "," + kd + sock);
  EXPECT_EQ(lookup.exit_code, 0) << lookup.err;
  EXPECT_THAT(lookup.out, ::testing::HasSubstr(k + " nvme"));
  EXPECT_THAT(lookup.out, ::testing::HasSubstr(kd + " nvme"));
  // Prefetch moves them into DRAM ahead of the gets.
  auto prefetch = Kvtier("prefetch --keys " + k + "," + kd + " --wait-ms 10000" + sock);
  EXPECT_EQ(prefetch.exit_code, 0) << prefetch.err;
  EXPECT_THAT(prefetch.out, ::testing::HasSubstr("prefetch: 2 chunks"));
  EXPECT_THAT(prefetch.out, ::testing::HasSubstr("in DRAM"));
  lookup = Kvtier("lookup --keys " + k + "," + kd + sock);
  EXPECT_THAT(lookup.out, ::testing::HasSubstr(k + " dram"));
  EXPECT_THAT(lookup.out, ::testing::HasSubstr(kd + " dram"));
  EXPECT_EQ(Kvtier("prefetch --keys " + k + " --budget-mib -1" + sock).exit_code, 2);
  ASSERT_EQ(Kvtier("get --key " + k + sock + " -o " + P("c.out")).exit_code, 0);
  EXPECT_EQ(ReadAll(P("c.out")), ReadAll(P("c.kvc")));
  ASSERT_EQ(Kvtier("get --key " + kd + sock + " -o " + P("d.out")).exit_code, 0);
  EXPECT_EQ(ReadAll(P("d.out")), ReadAll(P("d.kvc")));
  EXPECT_EQ(d.Terminate(), 0);
}

// A second kvtierd on a data dir in use exits 2 at once (bounded by
// `timeout` so a daemon that does start cannot hang the test), and the first
// one keeps its sockets and serves.
TEST_F(CliTest, SecondDaemonOnTheSameDataDirExitsAndTheFirstKeepsServing) {
  DaemonProcess d(dir_.path());
  ASSERT_TRUE(d.WaitReady());
  const std::string data = dir_.path() + "/data";
  for (const char* nvme_gib : {"0.0625", "0"}) {
    SCOPED_TRACE(nvme_gib);
    auto second = RunCommand("timeout 20 " + std::string(KVTIERD_PATH) + " --data-dir " + data +
                                 " --dram-gib 0.03125 --hbm-gib 0 --dram-populate false --nvme-gib " +
                                 nvme_gib,
                             dir_.path());
    EXPECT_EQ(second.exit_code, 2);
    EXPECT_THAT(second.err, ::testing::HasSubstr("data dir " + data + " is in use"));
    EXPECT_THAT(second.err, ::testing::HasSubstr("pid " + std::to_string(d.pid())));
    struct stat st;
    EXPECT_EQ(::stat(d.socket().c_str(), &st), 0);
    EXPECT_EQ(::stat((d.socket() + ".shm").c_str(), &st), 0);
  }
  const std::string sock = " --socket " + d.socket();
  const std::string k = TestKey(9).ToHex();
  WriteChunk("e.kvc", 9);
  auto put = Kvtier("put --key " + k + sock + " " + P("e.kvc"));
  ASSERT_EQ(put.exit_code, 0) << put.err;
  auto get = Kvtier("get --key " + k + sock + " -o " + P("e.out"));
  ASSERT_EQ(get.exit_code, 0) << get.err;
  EXPECT_EQ(ReadAll(P("e.out")), ReadAll(P("e.kvc")));
  EXPECT_EQ(d.Terminate(), 0);
}

TEST_F(CliTest, DaemonHelpDocumentsEveryOptionWithItsDefault) {
  auto r = RunCommand(std::string(KVTIERD_PATH) + " --help", dir_.path());
  EXPECT_EQ(r.exit_code, 0);
  for (const char* s : {"--data-dir TEXT=./kvtier-data", "--dram-gib FLOAT=4", "--nvme-gib FLOAT=8",
                        "--hbm-gib FLOAT=2", "--listen-tcp", "--token-file", "--metrics-addr",
                        "--max-message-mib UINT=64", "--max-keys-per-request UINT=4096",
                        "--max-concurrent-streams UINT=64", "--max-held-share FLOAT=0.5",
                        "<data-dir>/kvtierd.sock", "--config"}) {
    EXPECT_THAT(r.out, ::testing::HasSubstr(s));
  }
  auto bad = RunCommand(std::string(KVTIERD_PATH) + " --listen-tcp 127.0.0.1:0 --data-dir " +
                            dir_.path() + "/d",
                        dir_.path());
  EXPECT_EQ(bad.exit_code, 2);
  EXPECT_THAT(bad.err, ::testing::HasSubstr("--listen-tcp requires --token-file"));
  auto share = RunCommand(std::string(KVTIERD_PATH) + " --max-held-share 0 --data-dir " +
                              dir_.path() + "/d",
                          dir_.path());
  EXPECT_EQ(share.exit_code, 2);
  EXPECT_THAT(share.err, ::testing::HasSubstr("--max-held-share"));
}

}  // namespace
}  // namespace kvtier::testing
