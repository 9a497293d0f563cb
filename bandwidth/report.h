// Renders a shortfall sweep as a text table, JSON or CSV. Every output names
// its units: decimal GB (1e9 bytes), TB/s (1e12 bytes/s), GB/s (1e9 bytes/s).
#ifndef KVTIER_BANDWIDTH_REPORT_H_
#define KVTIER_BANDWIDTH_REPORT_H_

#include <span>
#include <string>

#include "bandwidth/sweep.h"

namespace kvtier::bandwidth {

// Aligned columns, one line per row: model, context, batch, codec,
// bytes/token, GB/step (KV), required TB/s, f (KV fraction of the
// uncompressed step traffic), the codec's speedup bound, S(B), then one
// column per link holding the shortfall factor ("123.4x") or "in-HBM" when
// the link covers the requirement (factor <= 1). A preamble states the
// latency target, the units, the link bandwidths and the meaning of "in-HBM".
std::string FormatTable(std::span<const SweepRow> rows, const SweepOptions& options);

// {"units": {...}, "latency_ms": .., "chunk_tokens": .., "block_size": ..,
//  "hill": {..}, "links": [{"name","gb_per_s"}], "rows": [{"model", "context",
//  "batch", "codec", "bytes_per_token", "native_bytes_per_token",
//  "kv_bytes_per_step", "kv_gb_per_step", "weight_gb", "kv_fraction",
//  "codec_ratio", "speedup_bound", "required_tb_per_s", "hill_saturation",
//  "shortfall": [{"link", "gb_per_s", "factor", "covered"}]}]}
std::string FormatJson(std::span<const SweepRow> rows, const SweepOptions& options);

// RFC 4180 CSV with a header line; units are in the column names
// (kv_gb_per_step, required_tb_per_s); one `shortfall_<link>` column per link
// holding the numeric factor (<= 1 means covered).
std::string FormatCsv(std::span<const SweepRow> rows, const SweepOptions& options);

// "in-HBM" when covered, else the factor with 3-4 significant digits and "x".
std::string FormatShortfallCell(const LinkShortfall& s);

}  // namespace kvtier::bandwidth

#endif  // KVTIER_BANDWIDTH_REPORT_H_
