// Trace replay: drives the placement engine with a request trace, over tiers
// that hold metadata only (NewMetadataTier, DramTierOptions::metadata_only),
// so that a trace which needs terabytes of KV replays on any machine, and
// reports what the engine's decisions would save. Also the offline optimum
// (Belady) over the same trace and capacity, and a capacity planner that
// sweeps tier sizes. docs/tiering.md "Trace replay" describes the model.
//
// A request reads its blocks in order as an inference engine would:
// LookupPrefix finds the longest stored prefix, each block of it is read
// with Get (a use: eviction order, admission counts, promotion from NVMe),
// and every block past it is prefilled and stored with Put (a block already
// stored counts as one more use). Only prefix hits save prefill: a stored
// block after the first miss is a chunk hit, not a prefix hit.
//
// Not thread-safe: one replay at a time per engine (it makes its own).
#ifndef KVTIER_TIERING_REPLAY_REPLAY_H_
#define KVTIER_TIERING_REPLAY_REPLAY_H_

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "bandwidth/model.h"
#include "codec/chunk.h"
#include "tiering/placement_engine.h"
#include "tiering/replay/trace.h"

namespace kvtier::tiering::replay {

// The chunk key of trace block `id`: a fixed hash of the id, the same in
// every process, so a live replay against a daemon and an offline one name
// blocks alike.
Hash128 TraceBlockKey(uint64_t id);

// Tokens of block `i` of `r`: full blocks of `block_tokens`, then what is
// left of input_length.
uint64_t TraceBlockTokens(const TraceRequest& r, size_t i, uint32_t block_tokens);

// The chunk a trace block stands for: `block_tokens` tokens of `model` under
// `codec`. InvalidArgument if the codec or geometry is outside the format.
absl::StatusOr<codec::ChunkSpec> ReplayChunkSpec(const bandwidth::ModelSpec& model,
                                                 std::string_view codec, uint32_t block_tokens);

struct ReplayOptions {
  // The chunk every block is (ReplayChunkSpec). Its geometry's num_tokens is
  // the trace's block size. Default: ChunkSpec{} (set it)
  codec::ChunkSpec chunk;
  // Tier capacities in bytes; 0 leaves the tier out (one is required).
  // Default: 0
  uint64_t dram_bytes = 0;
  uint64_t nvme_bytes = 0;
  // Engine options (eviction policy, admission, promotion). The replay
  // turns the maintenance thread off (tiers evict on demand, at 100%).
  // Default: PlacementEngineOptions{}
  PlacementEngineOptions engine;
  // Prefill throughput of the inference engine, in tokens per second: what
  // a prefix hit saves is the time to recompute it at this rate, less the
  // time to load it (engine.load_cost). Default: 10000
  double prefill_tokens_per_s = 10000;
  // Stop after this many requests; 0 replays the whole trace. Default: 0
  size_t max_requests = 0;
};

// Hits and traffic of one tier (prefix hits served from it).
struct TierReplayStats {
  uint64_t hits = 0;          // prefix blocks read from the tier
  uint64_t hit_tokens = 0;
  uint64_t bytes_read = 0;    // chunk bytes of those reads
  uint64_t bytes_written = 0; // puts, demotions and promotions into the tier
};

struct ReplayResult {
  std::string policy;  // eviction policy name, or "belady"
  uint64_t dram_bytes = 0, nvme_bytes = 0, chunk_bytes = 0;
  uint64_t capacity_chunks = 0;  // (dram + nvme) / aligned chunk bytes
  uint64_t requests = 0;
  uint64_t block_reads = 0, token_reads = 0;
  uint64_t chunk_hits = 0, chunk_hit_tokens = 0;    // stored when read
  uint64_t prefix_hits = 0, prefix_hit_tokens = 0;  // stored, and so was the prefix
  // Indexed by TierKind; empty for Belady.
  std::array<TierReplayStats, kNumTierKinds> tiers{};
  uint64_t evictions = 0, demotions = 0, promotions = 0, admission_rejects = 0;
  double trace_seconds = 0;         // last timestamp - first
  double prefill_seconds = 0;       // every prompt token recomputed
  double load_seconds = 0;          // loading the prefix hits
  double saved_prefill_seconds = 0; // recompute time of prefix hits - load_seconds
  // Time to first token per request, without queueing: load of its prefix
  // hits + recompute of the rest. Percentiles in seconds.
  double ttft_p50_s = 0, ttft_p90_s = 0, ttft_p99_s = 0;

  double chunk_hit_ratio() const { return Ratio(chunk_hits, block_reads); }
  double token_hit_ratio() const { return Ratio(chunk_hit_tokens, token_reads); }
  double prefix_hit_ratio() const { return Ratio(prefix_hits, block_reads); }
  double prefix_token_hit_ratio() const { return Ratio(prefix_hit_tokens, token_reads); }
  // Saved prefill GPU-seconds per hour of trace.
  double saved_gpu_s_per_hour() const {
    return trace_seconds > 0 ? saved_prefill_seconds * 3600.0 / trace_seconds : 0;
  }

 private:
  static double Ratio(uint64_t a, uint64_t b) { return b == 0 ? 0 : double(a) / double(b); }
};

// Replays `trace` through a PlacementEngine over metadata-only tiers of the
// given sizes. InvalidArgument for a bad chunk spec or no tier;
// ResourceExhausted if a tier is smaller than one chunk.
absl::StatusOr<ReplayResult> ReplayTrace(const Trace& trace, const ReplayOptions& options);

// The offline optimum over the same request sequence: one cache of
// (dram + nvme) bytes in chunks, where a missed block may be stored or not
// and the block evicted is the one whose next read is farthest away
// (Belady's MIN; optimal for equal-size blocks). Loads count as DRAM reads.
ReplayResult BeladyReplay(const Trace& trace, const ReplayOptions& options);

// Tier sizes for a share of the trace's distinct blocks: ceil(share x
// distinct) chunks of `chunk_bytes` rounded up to 4096.
uint64_t BytesForShare(const Trace& trace, uint64_t chunk_bytes, double share);

// The result as JSON (one object; the field names of ReplayResult).
std::string ResultJson(const ReplayResult& r);

// --- Capacity planning: the replay over a grid of tier sizes.

struct PlanPoint {
  uint64_t dram_bytes = 0, nvme_bytes = 0;
  ReplayResult policy;
  ReplayResult belady;
};

// Replays every (dram, nvme) pair of the grid with options.engine's policy,
// and Belady at the same sizes.
absl::StatusOr<std::vector<PlanPoint>> PlanCapacity(const Trace& trace, const ReplayOptions& options,
                                                    const std::vector<uint64_t>& dram_bytes,
                                                    const std::vector<uint64_t>& nvme_bytes);

// A self-contained SVG: prefix hit ratio (y) against DRAM GiB (x), one line
// per NVMe size, and the Belady line of the largest NVMe size dashed.
std::string RenderPlanSvg(const std::vector<PlanPoint>& points);

}  // namespace kvtier::tiering::replay

#endif  // KVTIER_TIERING_REPLAY_REPLAY_H_
