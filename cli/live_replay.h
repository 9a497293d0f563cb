// Live trace replay: a request trace sent to a running kvtierd at the
// trace's arrival times (scaled), for a bounded time, measuring the latency
// of the daemon's lookups, gets and puts as a client sees them
// (`kvtier replay --live`). Each request looks up its blocks' keys
// (tiering::replay::TraceBlockKey), gets the cached prefix and puts the
// rest, as an inference engine would; every block is the same valid chunk.
#ifndef KVTIER_CLI_LIVE_REPLAY_H_
#define KVTIER_CLI_LIVE_REPLAY_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "client/kvtier_client.h"
#include "codec/chunk.h"
#include "tiering/replay/trace.h"

namespace kvtier::cli {

struct LiveReplayOptions {
  // How to reach the daemon. Default: ClientOptions{}
  client::ClientOptions client;
  // The chunk every block is sent as (its geometry sets its size).
  // Default: ChunkSpec{} (set it)
  codec::ChunkSpec chunk;
  // Trace time per wall time: 10 replays the trace ten times faster.
  // Default: 1
  double time_scale = 1;
  // No request starts after this many seconds (requests in flight finish).
  // Default: 60
  double duration_s = 60;
  // Requests in flight at once, one client connection each. Default: 4
  int concurrency = 4;
  // Tokens per trace block, for the trace's token counts. Default: 512
  uint32_t block_tokens = 512;
};

// Latency percentiles of one kind of call, in milliseconds.
struct LatencySummary {
  uint64_t calls = 0;
  uint64_t errors = 0;  // calls that failed (a get's miss included)
  double p50_ms = 0, p90_ms = 0, p99_ms = 0, max_ms = 0;
};

struct LiveReplayResult {
  uint64_t requests = 0;  // requests started
  uint64_t block_reads = 0;
  uint64_t prefix_hits = 0;  // blocks of the prefixes lookups found and gets read
  double wall_s = 0;
  LatencySummary lookup, get, put;
  // How late requests started against the scaled schedule, in ms.
  double late_p50_ms = 0, late_p99_ms = 0;
  std::string first_error;  // empty if every call succeeded

  double prefix_hit_ratio() const {
    return block_reads == 0 ? 0 : double(prefix_hits) / double(block_reads);
  }
};

// Runs the replay. InvalidArgument for a bad chunk spec, scale, duration or
// concurrency; Unavailable (or Connect's error) if the daemon cannot be
// reached. Errors of single calls are counted, not returned.
absl::StatusOr<LiveReplayResult> RunLiveReplay(const tiering::replay::Trace& trace,
                                               const LiveReplayOptions& options);

// The result as one JSON object.
std::string LiveResultJson(const LiveReplayResult& r);

}  // namespace kvtier::cli

#endif  // KVTIER_CLI_LIVE_REPLAY_H_
