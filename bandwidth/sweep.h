// A shortfall sweep: the bandwidth model evaluated over every combination of
// model, context, batch and codec, against a set of links.
#ifndef KVTIER_BANDWIDTH_SWEEP_H_
#define KVTIER_BANDWIDTH_SWEEP_H_

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "bandwidth/links.h"
#include "bandwidth/model.h"

namespace kvtier::bandwidth {

struct SweepOptions {
  // Context lengths, tokens per sequence. Default: 131072.
  std::vector<uint64_t> contexts = {131072};
  // Batch sizes, sequences per decode step. Default: 32.
  std::vector<uint64_t> batches = {32};
  // Codec names (codec::ParseCodec). Default: k16v8.
  std::vector<std::string> codecs = {"k16v8"};
  // Per-step decode latency target, seconds. Default: 10 ms.
  double latency_s = 0.010;
  // Links to compare against. Default: every preset.
  std::vector<Link> links{LinkPresets().begin(), LinkPresets().end()};
  HillCurve hill;
  ChunkingOptions chunking;
};

// The shortfall of one link for one row.
struct LinkShortfall {
  std::string link;
  double gb_per_s = 0;  // the link's bandwidth, decimal GB/s
  double factor = 0;    // required / link
  // The link covers the requirement: factor <= 1, i.e. the link streams the
  // step's KV within the latency target, as if the KV sat in HBM. Printed
  // "in-HBM" in tables.
  bool covered = false;
};

// One (model, context, batch, codec) combination. Bytes are bytes, bandwidth
// bytes per second.
struct SweepRow {
  std::string model;
  uint64_t context = 0;
  uint64_t batch = 0;
  std::string codec;               // canonical name (codec::CodecName)
  double bytes_per_token = 0;      // KV under `codec`
  double native_bytes_per_token = 0;  // KV under k16v16
  double kv_bytes = 0;             // per decode step, under `codec`
  double weight_bytes = 0;         // per decode step
  double kv_fraction = 0;          // f, of the uncompressed (k16v16) step traffic
  double codec_ratio = 0;          // c = bytes_per_token / native_bytes_per_token
  double speedup_bound = 0;        // 1 / (f*c + (1 - f))
  double required_bytes_per_s = 0;  // kv_bytes / latency
  double hill_saturation = 0;      // S(batch)
  std::vector<LinkShortfall> shortfall;  // one per SweepOptions::links, same order
};

// Evaluates the model. Rows are ordered model, context, batch, codec (each in
// the order given). InvalidArgument for an empty list, a zero context or
// batch, a non-positive latency, an unknown codec, a bad Hill curve or an
// invalid model.
absl::StatusOr<std::vector<SweepRow>> RunSweep(std::span<const ModelSpec> models,
                                               const SweepOptions& options);

}  // namespace kvtier::bandwidth

#endif  // KVTIER_BANDWIDTH_SWEEP_H_
