#include "tiering/replay/trace.h"

#include <sys/stat.h>

#include <fstream>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "common/testing/temp_dir.h"

namespace kvtier::tiering::replay {
namespace {

using ::kvtier::testing::TempDir;

using ::testing::HasSubstr;

absl::Status ParseError(const std::string& text, const TraceLimits& limits = {}) {
  return ParseTrace(text, 512, limits).status();
}

void ExpectInvalid(const std::string& text, const std::string& what, const TraceLimits& limits = {}) {
  absl::Status st = ParseError(text, limits);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << text;
  EXPECT_THAT(std::string(st.message()), HasSubstr(what)) << text;
}

TEST(ParseTrace, ReadsMooncakeLines) {
  auto t = ParseTrace(
      "{\"timestamp\": 0, \"input_length\": 1000, \"output_length\": 5, \"hash_ids\": [0, 1]}\n"
      "\n"
      "{\"timestamp\": 7, \"input_length\": 1100, \"output_length\": 6, \"hash_ids\": [0, 1, 2], \"x\": \"y\"}\r\n",
      512);
  ASSERT_TRUE(t.ok()) << t.status();
  ASSERT_EQ(t->requests.size(), 2u);
  EXPECT_EQ(t->requests[1].timestamp_ms, 7);
  EXPECT_EQ(t->requests[1].input_length, 1100u);
  EXPECT_EQ(t->requests[1].output_length, 6u);
  EXPECT_EQ(t->requests[1].hash_ids, (std::vector<uint64_t>{0, 1, 2}));
  EXPECT_EQ(t->distinct_blocks, 3u);
  EXPECT_EQ(t->block_reads, 5u);
}

TEST(ParseTrace, InputLengthDefaultsToWholeBlocks) {
  auto t = ParseTrace("{\"timestamp\": 1, \"hash_ids\": [4, 5, 6]}", 512);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->requests[0].input_length, 1536u);
}

TEST(ParseTrace, TruncatedLineNamesItsLine) {
  ExpectInvalid("{\"timestamp\": 0, \"hash_ids\": [0]}\n{\"timestamp\": 1, \"hash_ids\": [0, 1",
                "line 2: not valid JSON");
}

TEST(ParseTrace, CorruptedLinesAreInvalidArgument) {
  ExpectInvalid("{\"timestamp\": 0, \"hash_ids\": [0]}\n\x01\xff garbage\n", "line 2: not valid JSON");
  ExpectInvalid("[1, 2, 3]", "line 1: not a JSON object");
  ExpectInvalid("{\"hash_ids\": [0]}", "line 1: no timestamp");
  ExpectInvalid("{\"timestamp\": 0}", "line 1: no hash_ids");
  ExpectInvalid("{\"timestamp\": 0, \"hash_ids\": \"0,1\"}", "hash_ids is not an array");
  ExpectInvalid("{\"timestamp\": 0, \"hash_ids\": [0, -1]}", "a hash id is negative");
  ExpectInvalid("{\"timestamp\": 0, \"hash_ids\": [0.5]}", "not a non-negative integer");
  ExpectInvalid("{\"timestamp\": -3, \"hash_ids\": [0]}", "timestamp is negative");
  ExpectInvalid("{\"timestamp\": 0, \"hash_ids\": [18446744073709551615]}", "above 2^53");
  ExpectInvalid("{\"timestamp\": 0, \"input_length\": 2000, \"hash_ids\": [0, 1]}",
                "input_length 2000 is more than 2 blocks of 512 tokens");
  ExpectInvalid("{\"timestamp\": 5, \"hash_ids\": [0]}\n{\"timestamp\": 4, \"hash_ids\": [0]}",
                "line 2: timestamp 4 is earlier than the line before (5)");
}

TEST(ParseTrace, HostileLinesAreRefusedBeforeParsing) {
  ExpectInvalid("{\"timestamp\": 0, \"hash_ids\": [0], \"x\": " + std::string(100000, '[') + "}",
                "line 1: nesting deeper");
  ExpectInvalid("{\"timestamp\": 0, \"hash_ids\": [[0]]}", "nesting deeper");
  ExpectInvalid("{\"timestamp\": 0, \"hash_ids\": [0], \"x\": {\"y\": 1}}", "unknown field x is not a scalar");
  // Brackets inside strings do not count as nesting.
  EXPECT_TRUE(ParseTrace("{\"timestamp\": 0, \"hash_ids\": [0], \"note\": \"[[[{{\\\"\"}", 512).ok());
}

TEST(ParseTrace, OversizedInputIsRefusedByTheLimits) {
  TraceLimits small;
  small.max_line_bytes = 64;
  small.max_blocks_per_request = 4;
  small.max_requests = 2;
  ExpectInvalid("{\"timestamp\": 0, \"hash_ids\": [0]}\n{\"timestamp\": 0, \"hash_ids\": [" +
                    std::string(80, ' ') + "0]}",
                "line 2: longer than 64 bytes", small);
  ExpectInvalid("{\"timestamp\": 0, \"hash_ids\": [0, 1, 2, 3, 4]}", "hash_ids has 5 entries, more than 4",
                small);
  ExpectInvalid("{\"timestamp\": 0, \"hash_ids\": [0]}\n{\"timestamp\": 0, \"hash_ids\": [0]}\n"
                "{\"timestamp\": 0, \"hash_ids\": [0]}",
                "line 3: more than 2 requests", small);
}

TEST(ReadTrace, MissingFileIsNotFound) {
  EXPECT_EQ(ReadTrace("/nonexistent/trace.jsonl", 512).status().code(), absl::StatusCode::kNotFound);
}

// A FIFO with no writer is refused at once (a read would block for good);
// /proc files are no traces; neither is a file of no requests.
TEST(ReadTrace, OnlyARegularFileOfRequestsIsATrace) {
  TempDir dir;
  const std::string fifo = dir.path() + "/trace.fifo";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  auto f = ReadTrace(fifo, 512);
  EXPECT_EQ(f.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(f.status().message(), ::testing::HasSubstr("not a regular file"));
  EXPECT_EQ(ReadTrace("/proc/self/status", 512).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ReadTrace(dir.path(), 512).status().code(), absl::StatusCode::kInvalidArgument);
  const std::string empty = dir.path() + "/empty.jsonl";
  std::ofstream(empty) << "\n  \n";
  auto e = ReadTrace(empty, 512);
  EXPECT_EQ(e.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(e.status().message(), ::testing::HasSubstr("no requests"));
}

}  // namespace
}  // namespace kvtier::tiering::replay
