// `kvtier shortfall`, `kvtier models`, `kvtier links` and `kvtier probe`:
// the bandwidth model (tiering/bandwidth, docs/bandwidth-model.md) on the
// command line.
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "cli/cli.h"
#include "cli/probe.h"
#include "common/file.h"
#include "common/status.h"
#include "common/strings.h"
#include "nlohmann/json.hpp"
#include "bandwidth/hf_config.h"
#include "bandwidth/links.h"
#include "bandwidth/presets.h"
#include "bandwidth/report.h"
#include "bandwidth/svg_plot.h"
#include "bandwidth/sweep.h"

namespace kvtier::cli {
namespace {

using bandwidth::Link;
using bandwidth::ModelSpec;

struct ShortfallArgs {
  std::vector<std::string> models;
  std::vector<std::string> hf_configs;
  std::vector<std::string> contexts;
  std::vector<std::string> batches;
  std::vector<std::string> codecs;
  std::string latency_ms = "10";
  std::string links;
  std::vector<std::string> links_files;
  std::string format = "table";
  std::string plot;
  std::string params;
  std::string weight_bytes;
  std::string hill_smax, hill_bh, hill_g;
  std::string chunk_tokens, block_size;
};

// A usage error is exit 2 (InvalidArgument), never "not found" (exit 1):
// exit 1 is reserved for cache misses.
absl::Status AsUsageError(const absl::Status& s) {
  if (s.ok() || s.code() != absl::StatusCode::kNotFound) return s;
  return absl::InvalidArgumentError(s.message());
}

// A positive count such as a context length: digits with an optional K (x1024)
// or M (x1048576) suffix, e.g. 131072, 128K, 1M.
absl::StatusOr<uint64_t> ParseCount(const std::string& text, const char* flag) {
  std::string s(absl::StripAsciiWhitespace(text));
  uint64_t scale = 1;
  if (!s.empty() && (s.back() == 'K' || s.back() == 'k')) {
    scale = 1024;
    s.pop_back();
  } else if (!s.empty() && (s.back() == 'M' || s.back() == 'm')) {
    scale = 1024 * 1024;
    s.pop_back();
  }
  uint64_t v = 0;
  const bool digits = !s.empty() && s.find_first_not_of("0123456789") == std::string::npos;
  if (!digits || !absl::SimpleAtoi(s, &v) || v == 0 || v > UINT64_MAX / scale) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, " wants positive integers (K = 1024, M = 1048576), got '", text, "'"));
  }
  return v * scale;
}

absl::StatusOr<std::vector<uint64_t>> ParseCounts(const std::vector<std::string>& items,
                                                  const char* flag) {
  std::vector<uint64_t> out;
  for (const std::string& item : items) {
    for (absl::string_view part : absl::StrSplit(item, ',')) {
      KVTIER_ASSIGN_OR_RETURN(uint64_t v, ParseCount(std::string(part), flag));
      out.push_back(v);
    }
  }
  return out;
}

absl::StatusOr<double> ParsePositive(const std::string& text, const char* flag) {
  double v = 0;
  if (!absl::SimpleAtod(text, &v) || !(v > 0) || !std::isfinite(v)) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, " wants a positive number, got '", text, "'"));
  }
  return v;
}

// Splits a comma-separated codec list. Explicit codecs contain a comma
// themselves ("k=16,v=int8/tensor"): a "v=..." piece joins the "k=..." before it.
std::vector<std::string> SplitCodecs(const std::vector<std::string>& items) {
  std::vector<std::string> out;
  for (const std::string& item : items) {
    for (absl::string_view part : absl::StrSplit(item, ',')) {
      std::string p(absl::StripAsciiWhitespace(part));
      if (p.starts_with("v=") && !out.empty() && out.back().starts_with("k=") &&
          out.back().find(",v=") == std::string::npos) {
        out.back() += "," + p;
      } else {
        out.push_back(std::move(p));
      }
    }
  }
  return out;
}

absl::StatusOr<std::vector<ModelSpec>> ResolveModels(const ShortfallArgs& a) {
  std::vector<ModelSpec> models;
  const bool params_given = !a.params.empty();
  for (const std::string& item : a.models) {
    for (absl::string_view name : absl::StrSplit(item, ',')) {
      absl::StatusOr<ModelSpec> m =
          bandwidth::FindModelPreset(AsStd(absl::StripAsciiWhitespace(name)));
      if (!m.ok()) return AsUsageError(m.status());
      models.push_back(*std::move(m));
    }
  }
  for (const std::string& item : a.hf_configs) {
    for (absl::string_view path : absl::StrSplit(item, ',')) {
      absl::StatusOr<ModelSpec> m =
          bandwidth::LoadHfConfig(std::string(path), /*allow_unknown_params=*/params_given);
      if (!m.ok()) return AsUsageError(m.status());
      models.push_back(*std::move(m));
    }
  }
  if (models.empty()) {
    return absl::InvalidArgumentError("give --model NAME or --hf-config FILE");
  }
  if (params_given) {
    uint64_t p = 0;
    if (a.params.find_first_not_of("0123456789") != std::string::npos ||
        !absl::SimpleAtoi(a.params, &p) || p == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("--params wants a positive integer count of weights, got '", a.params,
                       "'"));
    }
    for (ModelSpec& m : models) m.param_count = p;
  }
  if (!a.weight_bytes.empty()) {
    KVTIER_ASSIGN_OR_RETURN(double wb, ParsePositive(a.weight_bytes, "--weight-bytes"));
    for (ModelSpec& m : models) m.weight_bytes_per_param = wb;
  }
  return models;
}

absl::StatusOr<std::vector<Link>> ResolveLinks(const ShortfallArgs& a) {
  std::vector<Link> links;
  if (!a.links.empty()) {
    KVTIER_ASSIGN_OR_RETURN(links, bandwidth::ParseLinkList(a.links));
  } else if (a.links_files.empty()) {
    links.assign(bandwidth::LinkPresets().begin(), bandwidth::LinkPresets().end());
  }
  for (const std::string& path : a.links_files) {
    absl::StatusOr<std::vector<Link>> file = bandwidth::LoadLinksFile(path);
    if (!file.ok()) return AsUsageError(file.status());
    for (Link& l : *file) links.push_back(std::move(l));
  }
  absl::flat_hash_set<std::string> seen;
  for (const Link& l : links) {
    if (!seen.insert(l.name).second) {
      return absl::InvalidArgumentError(absl::StrCat("link '", l.name, "' given twice"));
    }
  }
  return links;
}

absl::Status CheckFormat(const std::string& format, bool csv_allowed) {
  if (format == "table" || format == "json" || (csv_allowed && format == "csv")) {
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "--format wants ", csv_allowed ? "table, json or csv" : "table or json", ", got '", format,
      "'"));
}

absl::Status RunShortfall(const ShortfallArgs& a) {
  KVTIER_RETURN_IF_ERROR(CheckFormat(a.format, /*csv_allowed=*/true));
  bandwidth::SweepOptions o;
  KVTIER_ASSIGN_OR_RETURN(std::vector<ModelSpec> models, ResolveModels(a));
  if (!a.contexts.empty()) {
    KVTIER_ASSIGN_OR_RETURN(o.contexts, ParseCounts(a.contexts, "--context"));
  }
  if (!a.batches.empty()) {
    KVTIER_ASSIGN_OR_RETURN(o.batches, ParseCounts(a.batches, "--batch"));
  }
  if (!a.codecs.empty()) o.codecs = SplitCodecs(a.codecs);
  KVTIER_ASSIGN_OR_RETURN(double latency_ms, ParsePositive(a.latency_ms, "--latency-ms"));
  o.latency_s = latency_ms / 1e3;
  KVTIER_ASSIGN_OR_RETURN(o.links, ResolveLinks(a));
  if (!a.hill_smax.empty()) {
    KVTIER_ASSIGN_OR_RETURN(o.hill.s_max, ParsePositive(a.hill_smax, "--hill-smax"));
  }
  if (!a.hill_bh.empty()) {
    KVTIER_ASSIGN_OR_RETURN(o.hill.b_half, ParsePositive(a.hill_bh, "--hill-bh"));
  }
  if (!a.hill_g.empty()) {
    KVTIER_ASSIGN_OR_RETURN(o.hill.g, ParsePositive(a.hill_g, "--hill-g"));
  }
  if (!a.chunk_tokens.empty()) {
    KVTIER_ASSIGN_OR_RETURN(uint64_t t, ParseCount(a.chunk_tokens, "--chunk-tokens"));
    if (t > codec::kMaxTokens) return absl::InvalidArgumentError("--chunk-tokens is too large");
    o.chunking.chunk_tokens = static_cast<uint32_t>(t);
  }
  if (!a.block_size.empty()) {
    KVTIER_ASSIGN_OR_RETURN(uint64_t b, ParseCount(a.block_size, "--block-size"));
    if (b > codec::kMaxBlockSize) return absl::InvalidArgumentError("--block-size is too large");
    o.chunking.block_size = static_cast<uint32_t>(b);
  }

  KVTIER_ASSIGN_OR_RETURN(std::vector<bandwidth::SweepRow> rows, bandwidth::RunSweep(models, o));
  std::string out;
  if (a.format == "json") {
    out = bandwidth::FormatJson(rows, o);
  } else if (a.format == "csv") {
    out = bandwidth::FormatCsv(rows, o);
  } else {
    out = bandwidth::FormatTable(rows, o);
  }
  if (!a.plot.empty()) {
    KVTIER_ASSIGN_OR_RETURN(std::string svg, bandwidth::RenderBandwidthSvg(models, o));
    KVTIER_RETURN_IF_ERROR(WriteFileAtomic(
        a.plot, std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(svg.data()),
                                         svg.size())));
    if (a.format == "table") out += absl::StrCat("# plot written to ", a.plot, "\n");
  }
  std::fwrite(out.data(), 1, out.size(), stdout);
  return absl::OkStatus();
}

absl::Status RunModels(const std::string& format) {
  KVTIER_RETURN_IF_ERROR(CheckFormat(format, /*csv_allowed=*/false));
  const codec::DType bf16 = codec::DType::kBF16;
  KVTIER_ASSIGN_OR_RETURN(codec::CodecFormat k16v16, codec::ParseCodec("k16v16", bf16));
  KVTIER_ASSIGN_OR_RETURN(codec::CodecFormat k16v8, codec::ParseCodec("k16v8", bf16));
  const bandwidth::ChunkingOptions chunking;  // the defaults KvBytesPerToken uses below
  nlohmann::json arr = nlohmann::json::array();
  std::string table = absl::StrFormat(
      "# bytes/token: KV of one token in a %u-token chunk, block size %u (scales included)\n"
      "%-18s %-38s %6s %8s %8s %15s %8s %12s %12s\n",
      chunking.chunk_tokens, chunking.block_size, "model", "hugging face repo", "layers",
      "kv_heads", "head_dim", "params", "dtype", "k16v16 B/tok", "k16v8 B/tok");
  for (const bandwidth::ModelPreset& p : bandwidth::ModelPresets()) {
    const ModelSpec& m = p.spec;
    KVTIER_ASSIGN_OR_RETURN(double native, bandwidth::KvBytesPerToken(m, k16v16, chunking));
    KVTIER_ASSIGN_OR_RETURN(double v8, bandwidth::KvBytesPerToken(m, k16v8, chunking));
    absl::StrAppendFormat(&table, "%-18s %-38s %6u %8u %8u %15u %8s %12.10g %12.10g\n", m.name,
                          p.hf_repo, m.num_layers, m.num_kv_heads, m.head_dim, m.param_count,
                          m.weight_dtype, native, v8);
    arr.push_back({{"name", m.name},
                   {"hf_repo", p.hf_repo},
                   {"num_layers", m.num_layers},
                   {"num_kv_heads", m.num_kv_heads},
                   {"head_dim", m.head_dim},
                   {"param_count", m.param_count},
                   {"torch_dtype", m.weight_dtype},
                   {"k16v16_bytes_per_token", native},
                   {"k16v8_bytes_per_token", v8}});
  }
  const std::string out = format == "json" ? arr.dump(2) + "\n" : table;
  std::fwrite(out.data(), 1, out.size(), stdout);
  return absl::OkStatus();
}

std::string LinksTable(std::span<const Link> links) {
  std::string out = absl::StrFormat("# decimal GB/s (1 GB/s = 1e9 bytes/s)\n%-16s %10s  %s\n",
                                    "link", "GB/s", "description");
  for (const Link& l : links) {
    absl::StrAppendFormat(&out, "%-16s %10.6g  %s\n", l.name, l.gb_per_s, l.description);
  }
  return out;
}

absl::Status RunLinks(const std::string& format) {
  KVTIER_RETURN_IF_ERROR(CheckFormat(format, /*csv_allowed=*/false));
  const std::span<const Link> links = bandwidth::LinkPresets();
  const std::string out = format == "json" ? bandwidth::LinksToJson(links) : LinksTable(links);
  std::fwrite(out.data(), 1, out.size(), stdout);
  return absl::OkStatus();
}

struct ProbeArgs {
  ProbeOptions options;
  std::string size_mb;
  std::string repeats;
  bool no_disk = false;
  bool no_gpu = false;
  std::string save;
  std::string format = "table";
};

absl::Status RunProbeCommand(ProbeArgs a) {
  KVTIER_RETURN_IF_ERROR(CheckFormat(a.format, /*csv_allowed=*/false));
  if (!a.size_mb.empty()) {
    KVTIER_ASSIGN_OR_RETURN(uint64_t mb, ParseCount(a.size_mb, "--size-mb"));
    if (mb > (uint64_t{1} << 20)) return absl::InvalidArgumentError("--size-mb is too large");
    a.options.bytes = mb << 20;
  }
  if (!a.repeats.empty()) {
    KVTIER_ASSIGN_OR_RETURN(uint64_t r, ParseCount(a.repeats, "--repeats"));
    if (r > 1000) return absl::InvalidArgumentError("--repeats is too large");
    a.options.repeats = static_cast<int>(r);
  }
  a.options.disk = !a.no_disk;
  a.options.gpu = !a.no_gpu;
  KVTIER_ASSIGN_OR_RETURN(ProbeReport report, RunProbe(a.options));
  if (!a.save.empty()) KVTIER_RETURN_IF_ERROR(bandwidth::SaveLinksFile(a.save, report.links));
  std::string out;
  if (a.format == "json") {
    out = bandwidth::LinksToJson(report.links);
  } else {
    out = LinksTable(report.links);
    for (const std::string& s : report.skipped) absl::StrAppend(&out, "# skipped ", s, "\n");
    if (!a.save.empty()) absl::StrAppend(&out, "# saved to ", a.save, "\n");
  }
  std::fwrite(out.data(), 1, out.size(), stdout);
  return absl::OkStatus();
}

}  // namespace

void RegisterBandwidthCommands(CLI::App& app, CommandResult& result) {
  auto shortfall_args = std::make_shared<ShortfallArgs>();
  ShortfallArgs& s = *shortfall_args;
  CLI::App* shortfall = app.add_subcommand(
      "shortfall",
      "KV bandwidth a decode step needs, and each link's shortfall (decimal GB/s, TB/s)");
  shortfall->add_option("--model", s.models, "preset model name(s), comma separated (kvtier models)")
      ->delimiter(',');
  shortfall->add_option("--hf-config", s.hf_configs, "Hugging Face config.json file(s)")
      ->delimiter(',');
  shortfall->add_option("--context", s.contexts,
                        "context lengths in tokens, e.g. 8192,128K (default 131072)");
  shortfall->add_option("--batch", s.batches, "batch sizes (default 32)");
  shortfall->add_option("--latency-ms", s.latency_ms, "per-step latency target in ms (default 10)");
  shortfall->add_option("--codec", s.codecs,
                        "codecs: k16v16, k16v8, k8v8, k16v4, ... or k=FMT[/GRAN],v=FMT[/GRAN] "
                        "(default k16v8)");
  shortfall->add_option("--links", s.links,
                        "links: preset names (kvtier links) or name=GB/s, comma separated "
                        "(default: every preset)");
  shortfall->add_option("--links-file", s.links_files,
                        "links measured by `kvtier probe --save FILE` (added to --links; "
                        "without --links, replace the presets)");
  shortfall->add_option("--format", s.format, "table, json or csv (default table)");
  shortfall->add_option("--plot", s.plot, "write an SVG plot of required bandwidth vs context");
  shortfall->add_option("--params", s.params, "parameter count (overrides the model's)");
  shortfall->add_option("--weight-bytes", s.weight_bytes,
                        "bytes per weight (default: from the model's dtype)");
  shortfall->add_option("--hill-smax", s.hill_smax, "Hill curve Smax (default 3.75)");
  shortfall->add_option("--hill-bh", s.hill_bh, "Hill curve Bh (default 5.1)");
  shortfall->add_option("--hill-g", s.hill_g, "Hill curve g (default 1.32)");
  shortfall->add_option("--chunk-tokens", s.chunk_tokens, "tokens per chunk (default 256)");
  shortfall->add_option("--block-size", s.block_size,
                        "engine block size in tokens, the scale group (default 16)");
  shortfall->callback(Action(result, [shortfall_args] { return RunShortfall(*shortfall_args); }));

  auto models_format = std::make_shared<std::string>("table");
  CLI::App* models = app.add_subcommand("models", "list the model presets");
  models->add_option("--format", *models_format, "table or json");
  models->callback(Action(result, [models_format] { return RunModels(*models_format); }));

  auto links_format = std::make_shared<std::string>("table");
  CLI::App* links = app.add_subcommand("links", "list the link presets (decimal GB/s)");
  links->add_option("--format", *links_format, "table or json");
  links->callback(Action(result, [links_format] { return RunLinks(*links_format); }));

  auto probe_args = std::make_shared<ProbeArgs>();
  ProbeArgs& p = *probe_args;
  CLI::App* probe = app.add_subcommand(
      "probe", "measure this machine's links: DRAM memcpy, O_DIRECT disk read, GPU copies");
  probe->add_option("--data-dir", p.options.data_dir,
                    "directory of the disk test (default ./kvtier-data; created if missing)");
  probe->add_option("--size-mb", p.size_mb, "MiB per measured transfer (default 256)");
  probe->add_option("--repeats", p.repeats, "runs per measurement, best reported (default 3)");
  probe->add_flag("--no-disk", p.no_disk, "skip the disk measurement");
  probe->add_flag("--no-gpu", p.no_gpu, "skip the GPU measurements");
  probe->add_option("--save", p.save, "write the measured links for shortfall --links-file");
  probe->add_option("--format", p.format, "table or json");
  probe->callback(Action(result, [probe_args] { return RunProbeCommand(*probe_args); }));
}

}  // namespace kvtier::cli
