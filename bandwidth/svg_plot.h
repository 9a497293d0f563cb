// Draws required KV bandwidth against context length as an SVG chart.
#ifndef KVTIER_BANDWIDTH_SVG_PLOT_H_
#define KVTIER_BANDWIDTH_SVG_PLOT_H_

#include <span>
#include <string>

#include "absl/status/statusor.h"
#include "bandwidth/sweep.h"

namespace kvtier::bandwidth {

// A self-contained SVG (no scripts, no external references): x = context in
// tokens on a log2 axis from min(smallest context, 1024) to the largest
// context; y = required bandwidth in decimal GB/s on a log10 axis spanning
// every series and link. One line per (model, batch, codec) with a dot at
// each requested context, and one dashed horizontal line per link, labelled
// with its name and GB/s. Same errors as RunSweep.
absl::StatusOr<std::string> RenderBandwidthSvg(std::span<const ModelSpec> models,
                                               const SweepOptions& options);

}  // namespace kvtier::bandwidth

#endif  // KVTIER_BANDWIDTH_SVG_PLOT_H_
