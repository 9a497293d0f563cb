#include "bandwidth/svg_plot.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <set>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status.h"

namespace kvtier::bandwidth {
namespace {

// Canvas geometry, in SVG user units (pixels).
constexpr double kWidth = 960, kHeight = 600;
constexpr double kLeft = 90, kRight = 250, kTop = 56, kBottom = 64;
constexpr double kPlotW = kWidth - kLeft - kRight, kPlotH = kHeight - kTop - kBottom;

constexpr const char* kColors[] = {"#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e",
                                   "#8c564b", "#e377c2", "#17becf", "#7f7f7f", "#bcbd22"};

std::string Escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      default: out += c;
    }
  }
  return out;
}

std::string GbpsLabel(double gbps) {
  if (gbps >= 1e3) return absl::StrFormat("%g TB/s", gbps / 1e3);
  if (gbps >= 1) return absl::StrFormat("%g GB/s", gbps);
  return absl::StrFormat("%g MB/s", gbps * 1e3);
}

std::string TokensLabel(uint64_t t) {
  if (t >= (1u << 20) && t % (1u << 20) == 0) return absl::StrCat(t >> 20, "M");
  if (t >= 1024 && t % 1024 == 0) return absl::StrCat(t >> 10, "K");
  return absl::StrCat(t);
}

}  // namespace

absl::StatusOr<std::string> RenderBandwidthSvg(std::span<const ModelSpec> models,
                                               const SweepOptions& options) {
  if (options.contexts.empty()) return absl::InvalidArgumentError("no context given");
  const uint64_t max_ctx = *std::max_element(options.contexts.begin(), options.contexts.end());
  const uint64_t min_ctx = *std::min_element(options.contexts.begin(), options.contexts.end());
  if (min_ctx == 0) return absl::InvalidArgumentError("context must be positive");
  const uint64_t lo = std::min<uint64_t>(min_ctx, 1024);
  const uint64_t hi = std::max<uint64_t>(max_ctx, lo * 2);

  std::set<uint64_t> samples(options.contexts.begin(), options.contexts.end());
  samples.insert(lo);
  samples.insert(hi);
  for (uint64_t p = 1; p < hi; p *= 2) {
    if (p > lo) samples.insert(p);
  }
  SweepOptions sampled = options;
  sampled.contexts.assign(samples.begin(), samples.end());
  KVTIER_ASSIGN_OR_RETURN(std::vector<SweepRow> rows, RunSweep(models, sampled));

  // Series keyed by (model, batch, codec), in first-seen order.
  using Key = std::tuple<std::string, uint64_t, std::string>;
  std::vector<Key> order;
  std::map<Key, std::vector<std::pair<uint64_t, double>>> series;  // context, GB/s
  double ymin = 1e300, ymax = 0;
  for (const SweepRow& r : rows) {
    Key k{r.model, r.batch, r.codec};
    if (!series.contains(k)) order.push_back(k);
    const double gbps = r.required_bytes_per_s / kBytesPerGB;
    series[k].emplace_back(r.context, gbps);
    ymin = std::min(ymin, gbps);
    ymax = std::max(ymax, gbps);
  }
  for (const Link& l : options.links) {
    ymin = std::min(ymin, l.gb_per_s);
    ymax = std::max(ymax, l.gb_per_s);
  }
  const double dlo = std::floor(std::log10(ymin));
  const double dhi = std::max(std::ceil(std::log10(ymax)), dlo + 1);
  const double xl = std::log2(static_cast<double>(lo)), xh = std::log2(static_cast<double>(hi));
  auto px = [&](double ctx) { return kLeft + (std::log2(ctx) - xl) / (xh - xl) * kPlotW; };
  auto py = [&](double gbps) {
    return kTop + kPlotH - (std::log10(gbps) - dlo) / (dhi - dlo) * kPlotH;
  };

  std::string svg = absl::StrFormat(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%g\" height=\"%g\" viewBox=\"0 0 %g "
      "%g\" font-family=\"sans-serif\" font-size=\"12\">\n"
      "<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n"
      "<text x=\"%g\" y=\"24\" font-size=\"16\" text-anchor=\"middle\">Required KV bandwidth per "
      "decode step (latency target %g ms)</text>\n"
      "<text x=\"%g\" y=\"42\" text-anchor=\"middle\" fill=\"#555\">decimal units: 1 GB/s = "
      "1e9 bytes/s, 1 TB/s = 1e12 bytes/s; log scales</text>\n",
      kWidth, kHeight, kWidth, kHeight, kLeft + kPlotW / 2, options.latency_s * 1e3,
      kLeft + kPlotW / 2);

  // Axes, decade grid (y) and power-of-two ticks (x).
  for (double d = dlo; d <= dhi + 1e-9; d += 1) {
    const double y = py(std::pow(10.0, d));
    svg += absl::StrFormat(
        "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#ddd\"/>\n"
        "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"end\">%s</text>\n",
        kLeft, y, kLeft + kPlotW, y, kLeft - 6, y + 4, GbpsLabel(std::pow(10.0, d)));
  }
  const uint64_t step = (xh - xl) > 12 ? 4 : ((xh - xl) > 6 ? 2 : 1);
  uint64_t i = 0;
  for (uint64_t p = 1; p <= hi; p *= 2) {
    if (p < lo) continue;
    if (i++ % step != 0) continue;
    const double x = px(static_cast<double>(p));
    svg += absl::StrFormat(
        "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#eee\"/>\n"
        "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">%s</text>\n",
        x, kTop, x, kTop + kPlotH, x, kTop + kPlotH + 18, TokensLabel(p));
  }
  svg += absl::StrFormat(
      "<rect x=\"%g\" y=\"%g\" width=\"%g\" height=\"%g\" fill=\"none\" stroke=\"black\"/>\n"
      "<text x=\"%g\" y=\"%g\" text-anchor=\"middle\">context (tokens per sequence)</text>\n"
      "<text x=\"18\" y=\"%g\" text-anchor=\"middle\" transform=\"rotate(-90 18 %g)\">required "
      "bandwidth (decimal GB/s, TB/s)</text>\n",
      kLeft, kTop, kPlotW, kPlotH, kLeft + kPlotW / 2, kHeight - 20, kTop + kPlotH / 2,
      kTop + kPlotH / 2);

  // Links: dashed horizontal lines.
  for (const Link& l : options.links) {
    const double y = py(l.gb_per_s);
    svg += absl::StrFormat(
        "<line class=\"link\" x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#444\" "
        "stroke-dasharray=\"6 4\"/>\n"
        "<text x=\"%.1f\" y=\"%.1f\" fill=\"#444\">%s %s</text>\n",
        kLeft, y, kLeft + kPlotW, y, kLeft + kPlotW + 6, y + 4, Escape(l.name),
        GbpsLabel(l.gb_per_s));
  }

  // Series, with a legend box in the top-left corner (the lines rise to the right).
  double legend_w = 0;
  for (const auto& [model, batch, codec] : order) {
    legend_w = std::max(legend_w, 7.0 * absl::StrCat(model, " B=", batch, " ", codec).size());
  }
  svg += absl::StrFormat(
      "<rect x=\"%g\" y=\"%g\" width=\"%.1f\" height=\"%.1f\" fill=\"white\" "
      "fill-opacity=\"0.85\" stroke=\"#ccc\"/>\n",
      kLeft + 4, kTop + 4, legend_w + 40, 16.0 * static_cast<double>(order.size()) + 6);
  std::set<uint64_t> asked(options.contexts.begin(), options.contexts.end());
  for (size_t s = 0; s < order.size(); ++s) {
    const auto& [model, batch, codec] = order[s];
    const char* color = kColors[s % std::size(kColors)];
    std::string points;
    for (const auto& [ctx, gbps] : series[order[s]]) {
      absl::StrAppendFormat(&points, "%.1f,%.1f ", px(static_cast<double>(ctx)), py(gbps));
    }
    const std::string label = absl::StrCat(model, " B=", batch, " ", codec);
    svg += absl::StrFormat(
        "<polyline class=\"series\" fill=\"none\" stroke=\"%s\" stroke-width=\"2\" "
        "points=\"%s\"><title>%s</title></polyline>\n",
        color, points, Escape(label));
    for (const auto& [ctx, gbps] : series[order[s]]) {
      if (!asked.contains(ctx)) continue;
      svg += absl::StrFormat(
          "<circle cx=\"%.1f\" cy=\"%.1f\" r=\"3.5\" fill=\"%s\"><title>%s at %s: %s</title>"
          "</circle>\n",
          px(static_cast<double>(ctx)), py(gbps), color, Escape(label), TokensLabel(ctx),
          GbpsLabel(gbps));
    }
    const double ly = kTop + 14 + 16 * static_cast<double>(s);
    svg += absl::StrFormat(
        "<line x1=\"%g\" y1=\"%.1f\" x2=\"%g\" y2=\"%.1f\" stroke=\"%s\" stroke-width=\"2\"/>"
        "<text x=\"%g\" y=\"%.1f\">%s</text>\n",
        kLeft + 10, ly, kLeft + 30, ly, color, kLeft + 36, ly + 4, Escape(label));
  }
  svg += "</svg>\n";
  return svg;
}

}  // namespace kvtier::bandwidth
