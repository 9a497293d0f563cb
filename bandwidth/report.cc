#include "bandwidth/report.h"

#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "nlohmann/json.hpp"

namespace kvtier::bandwidth {
namespace {

using Json = nlohmann::json;

std::string Num(double v) { return absl::StrFormat("%.12g", v); }

// `decimals` places, or 4 significant digits below 1 so small values stay visible.
std::string Fixed(double v, int decimals) {
  if (v >= 1 || v == 0) return absl::StrFormat("%.*f", decimals, v);
  return absl::StrFormat("%.4g", v);
}

std::string CsvField(const std::string& s) {
  if (s.find_first_of(",\"\n\r") == std::string::npos) return s;
  std::string out = "\"";
  for (char c : s) {
    if (c == '"') out += '"';
    out += c;
  }
  return out + "\"";
}

}  // namespace

std::string FormatShortfallCell(const LinkShortfall& s) {
  if (s.covered) return "in-HBM";
  if (s.factor < 10) return absl::StrFormat("%.2fx", s.factor);
  if (s.factor < 1000) return absl::StrFormat("%.1fx", s.factor);
  return absl::StrFormat("%.0fx", s.factor);
}

std::string FormatTable(std::span<const SweepRow> rows, const SweepOptions& options) {
  std::vector<std::string> header = {"model",    "context", "batch", "codec",
                                     "bytes/token", "GB/step", "req TB/s", "f(KV)",
                                     "bound",    "S(B)"};
  for (const Link& l : options.links) header.push_back(l.name);

  std::vector<std::vector<std::string>> cells;
  for (const SweepRow& r : rows) {
    std::vector<std::string> line = {
        r.model,
        absl::StrCat(r.context),
        absl::StrCat(r.batch),
        r.codec,
        absl::StrFormat("%.10g", r.bytes_per_token),
        Fixed(r.kv_bytes / kBytesPerGB, 2),
        Fixed(r.required_bytes_per_s / kBytesPerTB, 3),
        absl::StrFormat("%.3f", r.kv_fraction),
        absl::StrFormat("%.3fx", r.speedup_bound),
        absl::StrFormat("%.3f", r.hill_saturation)};
    for (const LinkShortfall& s : r.shortfall) line.push_back(FormatShortfallCell(s));
    cells.push_back(std::move(line));
  }
  std::vector<size_t> width(header.size());
  for (size_t i = 0; i < header.size(); ++i) {
    width[i] = header[i].size();
    for (const auto& line : cells) width[i] = std::max(width[i], line[i].size());
  }
  auto render = [&](const std::vector<std::string>& line) {
    std::string out;
    for (size_t i = 0; i < line.size(); ++i) {
      const size_t pad = width[i] - line[i].size();
      const bool left = i == 0 || i == 3;  // model and codec are text
      if (i > 0) out += "  ";
      if (left) {
        out += line[i];
        if (i + 1 < line.size()) out.append(pad, ' ');
      } else {
        out.append(pad, ' ');
        out += line[i];
      }
    }
    return out + "\n";
  };

  std::vector<std::string> link_text;
  for (const Link& l : options.links) link_text.push_back(absl::StrFormat("%s %g", l.name, l.gb_per_s));
  std::string out = absl::StrFormat(
      "# latency target %g ms per decode step; decimal units: GB = 1e9 bytes, TB/s = 1e12 "
      "bytes/s, GB/s = 1e9 bytes/s\n"
      "# GB/step = batch x context x bytes/token; req TB/s = GB/step / latency; f(KV) = KV "
      "share of the k16v16 step traffic (weights included); bound = 1/(f*c+(1-f)); S(B) = "
      "Hill batch saturation\n"
      "# link columns: shortfall = required / link bandwidth; \"in-HBM\" = the link streams "
      "the step's KV within the target (shortfall <= 1)\n"
      "# links (GB/s): %s\n",
      options.latency_s * 1e3, absl::StrJoin(link_text, ", "));
  out += render(header);
  for (const auto& line : cells) out += render(line);
  return out;
}

std::string FormatJson(std::span<const SweepRow> rows, const SweepOptions& options) {
  Json links = Json::array();
  for (const Link& l : options.links) {
    links.push_back({{"name", l.name}, {"gb_per_s", l.gb_per_s}});
  }
  Json out_rows = Json::array();
  for (const SweepRow& r : rows) {
    Json shortfall = Json::array();
    for (const LinkShortfall& s : r.shortfall) {
      shortfall.push_back({{"link", s.link},
                           {"gb_per_s", s.gb_per_s},
                           {"factor", s.factor},
                           {"covered", s.covered}});
    }
    out_rows.push_back({{"model", r.model},
                        {"context", r.context},
                        {"batch", r.batch},
                        {"codec", r.codec},
                        {"bytes_per_token", r.bytes_per_token},
                        {"native_bytes_per_token", r.native_bytes_per_token},
                        {"kv_bytes_per_step", r.kv_bytes},
                        {"kv_gb_per_step", r.kv_bytes / kBytesPerGB},
                        {"weight_gb", r.weight_bytes / kBytesPerGB},
                        {"kv_fraction", r.kv_fraction},
                        {"codec_ratio", r.codec_ratio},
                        {"speedup_bound", r.speedup_bound},
                        {"required_tb_per_s", r.required_bytes_per_s / kBytesPerTB},
                        {"hill_saturation", r.hill_saturation},
                        {"shortfall", std::move(shortfall)}});
  }
  Json root = {
      {"units",
       {{"bytes_per_token", "bytes"},
        {"kv_bytes_per_step", "bytes"},
        {"kv_gb_per_step", "decimal GB (1e9 bytes)"},
        {"weight_gb", "decimal GB (1e9 bytes)"},
        {"required_tb_per_s", "decimal TB/s (1e12 bytes/s)"},
        {"gb_per_s", "decimal GB/s (1e9 bytes/s)"},
        {"factor", "required / link; covered (\"in-HBM\") when <= 1"}}},
      {"latency_ms", options.latency_s * 1e3},
      {"chunk_tokens", options.chunking.chunk_tokens},
      {"block_size", options.chunking.block_size},
      {"hill",
       {{"s_max", options.hill.s_max}, {"b_half", options.hill.b_half}, {"g", options.hill.g}}},
      {"links", std::move(links)},
      {"rows", std::move(out_rows)}};
  return root.dump(2) + "\n";
}

std::string FormatCsv(std::span<const SweepRow> rows, const SweepOptions& options) {
  std::vector<std::string> header = {
      "model",          "context",           "batch",         "codec",
      "bytes_per_token", "kv_gb_per_step",   "weight_gb",     "kv_fraction",
      "codec_ratio",    "speedup_bound",     "required_tb_per_s", "hill_saturation"};
  for (const Link& l : options.links) header.push_back(CsvField("shortfall_" + l.name));
  std::string out = absl::StrJoin(header, ",") + "\n";
  for (const SweepRow& r : rows) {
    std::vector<std::string> line = {CsvField(r.model),
                                     absl::StrCat(r.context),
                                     absl::StrCat(r.batch),
                                     CsvField(r.codec),
                                     Num(r.bytes_per_token),
                                     Num(r.kv_bytes / kBytesPerGB),
                                     Num(r.weight_bytes / kBytesPerGB),
                                     Num(r.kv_fraction),
                                     Num(r.codec_ratio),
                                     Num(r.speedup_bound),
                                     Num(r.required_bytes_per_s / kBytesPerTB),
                                     Num(r.hill_saturation)};
    for (const LinkShortfall& s : r.shortfall) line.push_back(Num(s.factor));
    out += absl::StrJoin(line, ",") + "\n";
  }
  return out;
}

}  // namespace kvtier::bandwidth
