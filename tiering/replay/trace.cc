#include "tiering/replay/trace.h"

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "common/file.h"
#include "common/status.h"
#include "nlohmann/json.hpp"

namespace kvtier::tiering::replay {
namespace {

// Integers a double represents exactly: the JSON numbers every producer
// writes without loss.
constexpr uint64_t kMaxExactInteger = uint64_t{1} << 53;

absl::Status LineError(size_t line, std::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("line ", line, ": ", std::string(what)));
}

// Deepest nesting of arrays and objects in `line` (brackets inside strings
// do not count), computed before parsing so a hostile line cannot make the
// parser recurse.
int NestingDepth(std::string_view line) {
  int depth = 0, deepest = 0;
  bool in_string = false, escaped = false;
  for (char c : line) {
    if (in_string) {
      if (escaped) {
        escaped = false;
      } else if (c == '\\') {
        escaped = true;
      } else if (c == '"') {
        in_string = false;
      }
      continue;
    }
    if (c == '"') in_string = true;
    if (c == '[' || c == '{') deepest = std::max(deepest, ++depth);
    if (c == ']' || c == '}') --depth;
  }
  return deepest;
}

absl::StatusOr<uint64_t> NonNegativeInteger(const nlohmann::json& v, size_t line,
                                            std::string_view field) {
  if (v.is_number_unsigned()) {
    const uint64_t u = v.get<uint64_t>();
    if (u > kMaxExactInteger) return LineError(line, absl::StrCat(std::string(field), " is above 2^53"));
    return u;
  }
  if (v.is_number_integer()) return LineError(line, absl::StrCat(std::string(field), " is negative"));
  return LineError(line, absl::StrCat(std::string(field), " is not a non-negative integer"));
}

absl::StatusOr<TraceRequest> ParseLine(std::string_view text, size_t line, uint32_t block_tokens,
                                       const TraceLimits& limits) {
  if (NestingDepth(text) > 2) return LineError(line, "nesting deeper than an array in an object");
  nlohmann::json j = nlohmann::json::parse(text.begin(), text.end(), nullptr,
                                           /*allow_exceptions=*/false);
  if (j.is_discarded()) return LineError(line, "not valid JSON (truncated or corrupted?)");
  if (!j.is_object()) return LineError(line, "not a JSON object");
  TraceRequest r;
  bool have_ts = false, have_ids = false, have_input = false;
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string& k = it.key();
    const nlohmann::json& v = it.value();
    if (k == "timestamp") {
      KVTIER_ASSIGN_OR_RETURN(uint64_t ts, NonNegativeInteger(v, line, k));
      r.timestamp_ms = static_cast<int64_t>(ts);
      have_ts = true;
    } else if (k == "input_length") {
      KVTIER_ASSIGN_OR_RETURN(r.input_length, NonNegativeInteger(v, line, k));
      have_input = true;
    } else if (k == "output_length") {
      KVTIER_ASSIGN_OR_RETURN(r.output_length, NonNegativeInteger(v, line, k));
    } else if (k == "hash_ids") {
      if (!v.is_array()) return LineError(line, "hash_ids is not an array");
      if (v.size() > limits.max_blocks_per_request) {
        return LineError(line, absl::StrCat("hash_ids has ", v.size(), " entries, more than ",
                                            limits.max_blocks_per_request));
      }
      r.hash_ids.reserve(v.size());
      for (const auto& id : v) {
        KVTIER_ASSIGN_OR_RETURN(uint64_t u, NonNegativeInteger(id, line, "a hash id"));
        r.hash_ids.push_back(u);
      }
      have_ids = true;
    } else if (v.is_structured()) {
      return LineError(line, absl::StrCat("unknown field ", k, " is not a scalar"));
    }
  }
  if (!have_ts) return LineError(line, "no timestamp");
  if (!have_ids) return LineError(line, "no hash_ids");
  const uint64_t covered = r.hash_ids.size() * uint64_t{block_tokens};
  if (!have_input) r.input_length = covered;
  if (r.input_length > covered) {
    return LineError(line, absl::StrCat("input_length ", r.input_length, " is more than ",
                                        r.hash_ids.size(), " blocks of ", block_tokens, " tokens"));
  }
  return r;
}

}  // namespace

absl::StatusOr<Trace> ParseTrace(std::string_view text, uint32_t block_tokens,
                                 const TraceLimits& limits) {
  if (block_tokens == 0) return absl::InvalidArgumentError("block_tokens must be positive");
  Trace t;
  absl::flat_hash_set<uint64_t> seen;
  size_t line = 0;
  while (!text.empty()) {
    ++line;
    const size_t nl = text.find('\n');
    std::string_view l = text.substr(0, nl);
    text = nl == std::string_view::npos ? std::string_view() : text.substr(nl + 1);
    if (!l.empty() && l.back() == '\r') l.remove_suffix(1);
    if (l.size() > limits.max_line_bytes) {
      return LineError(line, absl::StrCat("longer than ", limits.max_line_bytes, " bytes"));
    }
    if (l.find_first_not_of(" \t") == std::string_view::npos) continue;
    if (t.requests.size() == limits.max_requests) {
      return LineError(line, absl::StrCat("more than ", limits.max_requests, " requests"));
    }
    KVTIER_ASSIGN_OR_RETURN(TraceRequest r, ParseLine(l, line, block_tokens, limits));
    if (!t.requests.empty() && r.timestamp_ms < t.requests.back().timestamp_ms) {
      return LineError(line, absl::StrCat("timestamp ", r.timestamp_ms, " is earlier than the line before (",
                                          t.requests.back().timestamp_ms, ")"));
    }
    t.block_reads += r.hash_ids.size();
    for (uint64_t id : r.hash_ids) seen.insert(id);
    t.requests.push_back(std::move(r));
  }
  if (t.requests.empty()) return absl::InvalidArgumentError("the trace holds no requests");
  t.distinct_blocks = seen.size();
  return t;
}

absl::StatusOr<Trace> ReadTrace(const std::string& path, uint32_t block_tokens,
                                const TraceLimits& limits) {
  KVTIER_ASSIGN_OR_RETURN(std::vector<uint8_t> bytes, ReadFileBytes(path, limits.max_file_bytes));
  auto t = ParseTrace(std::string_view(reinterpret_cast<const char*>(bytes.data()), bytes.size()),
                      block_tokens, limits);
  if (!t.ok()) return absl::Status(t.status().code(), absl::StrCat(path, ": ", t.status().message()));
  return t;
}

}  // namespace kvtier::tiering::replay
