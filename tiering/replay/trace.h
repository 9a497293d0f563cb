// Request traces for replay: one JSON object per line, in the format of the
// Mooncake FAST'25 traces (docs/tiering.md "Trace replay"):
//
//   {"timestamp": 0, "input_length": 6758, "output_length": 500,
//    "hash_ids": [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]}
//
// `timestamp` is the arrival time in milliseconds since the trace starts,
// `input_length` and `output_length` are token counts, and `hash_ids` name
// the request's prompt blocks in order (one per `block_tokens` tokens, the
// last one possibly partial): equal ids are equal prefixes, so a trace's ids
// play the role of kvtier's chain-hashed chunk keys.
//
// The parser is strict and bounded: it reads untrusted files.
#ifndef KVTIER_TIERING_REPLAY_TRACE_H_
#define KVTIER_TIERING_REPLAY_TRACE_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace kvtier::tiering::replay {

struct TraceRequest {
  int64_t timestamp_ms = 0;
  uint64_t input_length = 0;   // tokens
  uint64_t output_length = 0;  // tokens
  std::vector<uint64_t> hash_ids;
};

struct Trace {
  std::vector<TraceRequest> requests;  // in file order (arrival order)
  uint64_t distinct_blocks = 0;        // distinct hash_ids
  uint64_t block_reads = 0;            // sum of hash_ids sizes
};

struct TraceLimits {
  // Longest line accepted, in bytes. Default: 1 MiB
  size_t max_line_bytes = size_t{1} << 20;
  // Most hash_ids in one request. Default: 65536 (32 M tokens of 512)
  size_t max_blocks_per_request = 65536;
  // Most requests in one trace. Default: 16 M
  size_t max_requests = size_t{1} << 24;
  // Largest file read, in bytes. Default: 4 GiB
  uint64_t max_file_bytes = uint64_t{4} << 30;
};

// Parses trace text. Blank lines are skipped. A line that is not one JSON
// object, lacks `timestamp` or `hash_ids`, has a field of the wrong type, a
// negative or non-integer number, an id or length above 2^53, a timestamp
// earlier than the line before, nesting deeper than an array in an object,
// or that is longer than the limits allow is InvalidArgument
// "line N: <what>" (lines count from 1). `input_length` defaults to the
// block count x `block_tokens`; `output_length` to 0. Unknown fields with
// scalar values are ignored.
absl::StatusOr<Trace> ParseTrace(std::string_view text, uint32_t block_tokens,
                                 const TraceLimits& limits = {});

// Reads and parses a trace file. NotFound if it does not exist; otherwise
// as ParseTrace, with the path in the message.
absl::StatusOr<Trace> ReadTrace(const std::string& path, uint32_t block_tokens,
                                const TraceLimits& limits = {});

}  // namespace kvtier::tiering::replay

#endif  // KVTIER_TIERING_REPLAY_TRACE_H_
