// End-to-end tests of `kvtier codec encode|decode`, `kvtier inspect` and
// `kvtier keys`: the built binary, real files, exit codes and messages.
#include <algorithm>
#include <string>

#include "cli/npy.h"
#include "codec/numeric.h"
#include "codec/test_util.h"
#include "common/file.h"
#include "common/testing/temp_dir.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/cli_runner.h"

namespace kvtier {
namespace {

using ::testing::HasSubstr;
using testing::RunCommand;
using testing::TempDir;

const std::string kKvtier = KVTIER_CLI_PATH;

class CodecCli : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_FALSE(dir_.path().empty());
    codec::Geometry g{3, 2, 16, 37, 16};
    k_ = codec::testing::MakeKv(g, codec::DType::kBF16, {.seed = 1, .outlier_every = 8});
    v_ = codec::testing::MakeKv(g, codec::DType::kBF16, {.seed = 2});
    Write("k.npy", {"<u2", {3, 37, 2, 16}, k_});
    Write("v.npy", {"<u2", {3, 37, 2, 16}, v_});
  }
  void Write(const std::string& name, const npy::Array16& a) {
    ASSERT_TRUE(WriteFileAtomic(P(name), npy::Serialize(a)).ok());
  }
  std::string P(const std::string& name) const { return dir_.path() + "/" + name; }
  testing::CliResult Run(const std::string& args) {
    return RunCommand(kKvtier + " " + args, dir_.path());
  }
  void ExpectOneLineError(const testing::CliResult& r, int code, const std::string& what) {
    EXPECT_EQ(r.exit_code, code) << r.err;
    EXPECT_THAT(r.err, HasSubstr(what));
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  }

  TempDir dir_;
  std::vector<uint16_t> k_, v_;
};

TEST_F(CodecCli, EncodeInspectDecodeRoundTrips) {
  auto enc = Run("codec encode --k " + P("k.npy") + " --v " + P("v.npy") +
                 " --dtype bf16 --format k16v8 --block-size 16 -o " + P("c.kvt"));
  ASSERT_EQ(enc.exit_code, 0) << enc.err;
  auto insp = Run("inspect --json " + P("c.kvt"));
  ASSERT_EQ(insp.exit_code, 0) << insp.err;
  EXPECT_THAT(insp.out, HasSubstr("\"codec\":\"k16v8\""));
  EXPECT_THAT(insp.out, HasSubstr("\"num_tokens\":37"));
  EXPECT_THAT(insp.out, HasSubstr("\"v_format\":\"fp8e4m3/block-head\""));
  EXPECT_THAT(insp.out, HasSubstr("\"verified\":true"));
  auto human = Run("inspect " + P("c.kvt"));
  EXPECT_EQ(human.exit_code, 0);
  EXPECT_THAT(human.out, HasSubstr("3 layers x 37 tokens x 2 kv heads x 16 head dim"));
  auto dec = Run("codec decode " + P("c.kvt") + " --k-out " + P("k2.npy") + " --v-out " + P("v2.npy"));
  ASSERT_EQ(dec.exit_code, 0) << dec.err;
  auto k2 = npy::Parse(*ReadFileBytes(P("k2.npy"), 1 << 20));
  auto v2 = npy::Parse(*ReadFileBytes(P("v2.npy"), 1 << 20));
  ASSERT_TRUE(k2.ok() && v2.ok());
  EXPECT_EQ(k2->descr, "<u2");
  EXPECT_EQ(k2->shape, (std::vector<uint64_t>{3, 37, 2, 16}));
  EXPECT_EQ(k2->data, k_);  // K16: bit-exact
  double num = 0, den = 0;
  for (size_t i = 0; i < v_.size(); ++i) {
    double a = codec::Bf16ToFloat(v_[i]), b = codec::Bf16ToFloat(v2->data[i]);
    num += (a - b) * (a - b);
    den += a * a;
  }
  EXPECT_LT(std::sqrt(num / den), 0.03);
}

TEST_F(CodecCli, EveryPresetEncodes) {
  for (const char* f : {"k16v16", "k16v8", "k8v8", "k16v4", "k8v4", "k16vi8", "ki8vi8",
                        "k=16,v=int8/tensor"}) {
    auto r = Run(std::string("codec encode --k ") + P("k.npy") + " --v " + P("v.npy") +
                 " --dtype bf16 --format '" + f + "' -o " + P("x.kvt"));
    EXPECT_EQ(r.exit_code, 0) << f << ": " << r.err;
  }
}

TEST_F(CodecCli, BadInputGivesOneLineErrorAndExit2) {
  ExpectOneLineError(Run("codec encode --k " + P("missing.npy") + " --v " + P("v.npy") +
                         " --dtype bf16 -o " + P("x")),
                     2, "missing.npy");
  ExpectOneLineError(Run("codec encode --k " + P("k.npy") + " --v " + P("v.npy") +
                         " --dtype fp16 -o " + P("x")),
                     2, "<u2");
  ExpectOneLineError(Run("codec encode --k " + P("k.npy") + " --v " + P("v.npy") +
                         " --dtype bf16 --format k3v1 -o " + P("x")),
                     2, "unknown codec");
  ExpectOneLineError(Run("codec encode --k " + P("k.npy") + " --v " + P("v.npy") +
                         " --dtype bf16 --block-size 0 -o " + P("x")),
                     2, "block_size");
  Write("short.npy", {"<u2", {3, 36, 2, 16}, std::vector<uint16_t>(3 * 36 * 2 * 16)});
  ExpectOneLineError(Run("codec encode --k " + P("k.npy") + " --v " + P("short.npy") +
                         " --dtype bf16 -o " + P("x")),
                     2, "different shapes");
  Write("flat.npy", {"<u2", {3 * 37 * 2 * 16}, k_});
  ExpectOneLineError(Run("codec encode --k " + P("flat.npy") + " --v " + P("flat.npy") +
                         " --dtype bf16 -o " + P("x")),
                     2, "dimensions");
  ASSERT_TRUE(WriteFileAtomic(P("garbage.npy"), std::vector<uint8_t>(100, 0x41)).ok());
  ExpectOneLineError(Run("codec encode --k " + P("garbage.npy") + " --v " + P("v.npy") +
                         " --dtype bf16 -o " + P("x")),
                     2, "magic");
}

TEST_F(CodecCli, CorruptOrTruncatedChunksAreRejected) {
  ASSERT_EQ(Run("codec encode --k " + P("k.npy") + " --v " + P("v.npy") + " --dtype bf16 -o " +
                P("c.kvt"))
                .exit_code,
            0);
  auto bytes = *ReadFileBytes(P("c.kvt"), 1 << 20);
  auto flipped = bytes;
  flipped[flipped.size() / 2] ^= 0x04;
  ASSERT_TRUE(WriteFileAtomic(P("flip.kvt"), flipped).ok());
  ExpectOneLineError(Run("inspect " + P("flip.kvt")), 2, "checksum");
  ExpectOneLineError(Run("codec decode " + P("flip.kvt") + " --k-out " + P("a") + " --v-out " + P("b")),
                     2, "checksum");
  std::vector<uint8_t> truncated(bytes.begin(), bytes.begin() + 1000);
  ASSERT_TRUE(WriteFileAtomic(P("trunc.kvt"), truncated).ok());
  ExpectOneLineError(Run("inspect " + P("trunc.kvt")), 2, "length");
  std::vector<uint8_t> tiny(bytes.begin(), bytes.begin() + 50);
  ASSERT_TRUE(WriteFileAtomic(P("tiny.kvt"), tiny).ok());
  ExpectOneLineError(Run("inspect " + P("tiny.kvt")), 2, "header");
  ExpectOneLineError(Run("inspect " + P("k.npy")), 2, "magic");
  ExpectOneLineError(Run("inspect " + dir_.path()), 2, "not a regular file");
}

TEST_F(CodecCli, KeysMatchTheFormatTestVector) {
  std::string tokens;
  for (int i = 0; i < 512; ++i) tokens += (i ? "," : "") + std::to_string(i);
  auto r = Run("keys --model-id meta-llama/Llama-3.1-8B-Instruct --kv-layout vllm-flash-nhd --tokens " +
               tokens);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("fingerprint d73247c97a0f3e1b7a2db49501b020f8"));
  EXPECT_THAT(r.out, HasSubstr("chunk 0 32913676858d48fdfc7337f8fead302e"));
  EXPECT_THAT(r.out, HasSubstr("chunk 1 0398b0272fd3fd2bc65f6dffd472f25c"));
  ExpectOneLineError(Run("keys --model-id m --tokens 1,2,x"), 2, "'x'");
  ExpectOneLineError(Run("keys --model-id m --tokens 99999999999"), 2, "token id");
}

// Exit 1 means a cache miss and nothing else: an output path in a directory
// that does not exist is an ordinary failure (exit 2), as is a missing input.
TEST_F(CodecCli, MissingOutputDirectoryIsExit2NotAMiss) {
  auto enc = Run("codec encode --k " + P("k.npy") + " --v " + P("v.npy") +
                 " --dtype bf16 --format k16v8 --block-size 16 -o " + P("no/such/dir/c.kvt"));
  ExpectOneLineError(enc, 2, "no/such/dir");
  ASSERT_EQ(Run("codec encode --k " + P("k.npy") + " --v " + P("v.npy") +
                " --dtype bf16 --format k16v8 --block-size 16 -o " + P("c.kvt"))
                .exit_code,
            0);
  ExpectOneLineError(Run("codec decode " + P("c.kvt") + " --k-out " + P("no/dir/k.npy") +
                         " --v-out " + P("v2.npy")),
                     2, "no/dir");
  ExpectOneLineError(Run("inspect " + P("absent.kvt")), 2, "absent.kvt");
}

}  // namespace
}  // namespace kvtier
