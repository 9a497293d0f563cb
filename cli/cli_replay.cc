// `kvtier replay` and `kvtier plan`: a request trace replayed through the
// placement engine over metadata-only tiers (tiering/replay/replay.h), beside
// LRU and the offline optimum, and a sweep of tier sizes for capacity
// planning. docs/tiering.md "Trace replay" describes both.
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "bandwidth/links.h"
#include "bandwidth/presets.h"
#include "cli/cli.h"
#include "cli/live_replay.h"
#include "common/file.h"
#include "common/status.h"
#include "nlohmann/json.hpp"
#include "tiering/eviction.h"
#include "tiering/replay/replay.h"

namespace kvtier::cli {
namespace {

namespace rp = tiering::replay;
constexpr double kGiB = double(uint64_t{1} << 30);

struct ReplayArgs {
  std::string trace;
  std::string model = "llama-3.1-8b";
  std::string codec = "k16v8";
  uint32_t block_tokens = 512;
  std::string policy;  // empty: the engine's default
  uint32_t nvme_admit_after_uses = tiering::PlacementEngineOptions{}.nvme_admit_after_uses;
  double prefill_tokens_per_s = 10000;
  std::string dram_link, nvme_link;
  std::string links_file;  // `kvtier probe --save`: dram-memcpy and disk-odirect
  size_t max_requests = 0;
  bool json = false;
  // replay: one size; plan: lists.
  std::vector<double> dram_gib, nvme_gib, dram_share, nvme_share;
  std::string plot;
  // --live: against a running kvtierd.
  bool live = false;
  std::string socket = client::kDefaultSocket;
  double time_scale = 1;
  double duration_s = 60;
  int concurrency = 4;
  uint32_t live_chunk_tokens = 0;  // 0: block_tokens
};

struct Setup {
  rp::Trace trace;
  rp::ReplayOptions options;
  uint64_t chunk_bytes = 0;
};

absl::StatusOr<Setup> Prepare(const ReplayArgs& a) {
  Setup s;
  KVTIER_ASSIGN_OR_RETURN(bandwidth::ModelSpec model, bandwidth::FindModelPreset(a.model));
  KVTIER_ASSIGN_OR_RETURN(s.options.chunk, rp::ReplayChunkSpec(model, a.codec, a.block_tokens));
  KVTIER_ASSIGN_OR_RETURN(codec::ChunkLayout layout, codec::ValidateSpec(s.options.chunk));
  s.chunk_bytes = layout.total_bytes;
  if (!a.policy.empty()) {
    KVTIER_ASSIGN_OR_RETURN(s.options.engine.eviction, tiering::ParseEvictionPolicySpec(a.policy));
  }
  if (a.nvme_admit_after_uses == 0) return absl::InvalidArgumentError("--nvme-admit-after must be at least 1");
  s.options.engine.nvme_admit_after_uses = a.nvme_admit_after_uses;
  if (!(a.prefill_tokens_per_s > 0)) return absl::InvalidArgumentError("--prefill-tokens-per-s must be positive");
  s.options.prefill_tokens_per_s = a.prefill_tokens_per_s;
  auto& bw = s.options.engine.load_cost.assumed_read_bytes_per_s;
  if (!a.links_file.empty()) {
    KVTIER_ASSIGN_OR_RETURN(std::vector<bandwidth::Link> links, bandwidth::LoadLinksFile(a.links_file));
    for (const bandwidth::Link& l : links) {
      if (l.name == "dram-memcpy") bw[static_cast<int>(tiering::TierKind::kDram)] = l.bytes_per_s();
      if (l.name == "disk-odirect") bw[static_cast<int>(tiering::TierKind::kNvme)] = l.bytes_per_s();
    }
  }
  if (!a.dram_link.empty()) {
    KVTIER_ASSIGN_OR_RETURN(bandwidth::Link l, bandwidth::ParseLink(a.dram_link));
    bw[static_cast<int>(tiering::TierKind::kDram)] = l.bytes_per_s();
  }
  if (!a.nvme_link.empty()) {
    KVTIER_ASSIGN_OR_RETURN(bandwidth::Link l, bandwidth::ParseLink(a.nvme_link));
    bw[static_cast<int>(tiering::TierKind::kNvme)] = l.bytes_per_s();
  }
  s.options.max_requests = a.max_requests;
  KVTIER_ASSIGN_OR_RETURN(s.trace, rp::ReadTrace(a.trace, a.block_tokens));
  return s;
}

// Tier sizes from GiB and shares of the trace's distinct blocks (both may be
// given; GiB first). InvalidArgument for a negative or non-finite size.
absl::StatusOr<std::vector<uint64_t>> Sizes(const Setup& s, const std::vector<double>& gib,
                                            const std::vector<double>& share, const char* what) {
  std::vector<uint64_t> out;
  for (double g : gib) {
    if (!(g >= 0) || g > 1e9) return absl::InvalidArgumentError(absl::StrCat("--", what, "-gib: bad size ", g));
    out.push_back(static_cast<uint64_t>(g * kGiB));
  }
  for (double f : share) {
    if (!(f >= 0) || f > 1e3) return absl::InvalidArgumentError(absl::StrCat("--", what, "-share: bad share ", f));
    out.push_back(rp::BytesForShare(s.trace, s.chunk_bytes, f));
  }
  return out;
}

double Share(const Setup& s, uint64_t bytes) {
  const double per = double(codec::AlignUp(s.chunk_bytes, 4096));
  return s.trace.distinct_blocks ? double(bytes) / per / double(s.trace.distinct_blocks) : 0;
}

nlohmann::ordered_json LoadRates(const rp::ReplayOptions& o) {
  const auto& bw = o.engine.load_cost.assumed_read_bytes_per_s;
  return {{"dram", bw[static_cast<int>(tiering::TierKind::kDram)] / 1e9},
          {"nvme", bw[static_cast<int>(tiering::TierKind::kNvme)] / 1e9}};
}

// What --json of replay and plan both start with: the trace, model, codec
// and chunk size.
nlohmann::ordered_json JsonHeader(const ReplayArgs& a, const Setup& s) {
  nlohmann::ordered_json j;
  j["trace"] = {{"path", a.trace},
                {"requests", s.trace.requests.size()},
                {"block_reads", s.trace.block_reads},
                {"distinct_blocks", s.trace.distinct_blocks},
                {"block_tokens", a.block_tokens}};
  j["model"] = a.model;
  j["codec"] = a.codec;
  j["chunk_bytes"] = s.chunk_bytes;
  return j;
}

void PrintHeader(const ReplayArgs& a, const Setup& s) {
  const auto& bw = s.options.engine.load_cost.assumed_read_bytes_per_s;
  std::printf("trace   %s: %zu requests, %llu block reads, %llu distinct blocks of %u tokens\n", a.trace.c_str(),
              s.trace.requests.size(), static_cast<unsigned long long>(s.trace.block_reads),
              static_cast<unsigned long long>(s.trace.distinct_blocks), a.block_tokens);
  if (a.max_requests != 0 && a.max_requests < s.trace.requests.size()) {
    std::printf("        replaying the first %zu requests (tier shares are of the whole trace's blocks)\n",
                a.max_requests);
  }
  std::printf("chunk   %s %s: %llu bytes per block (%.1f MiB)\n", a.model.c_str(), a.codec.c_str(),
              static_cast<unsigned long long>(s.chunk_bytes), double(s.chunk_bytes) / (1 << 20));
  std::printf("model   prefill %.0f tokens/s (stated rate); loads at DRAM %.1f GB/s, NVMe %.1f GB/s\n",
              s.options.prefill_tokens_per_s, bw[1] / 1e9, bw[2] / 1e9);
}

void PrintRow(const rp::ReplayResult& r) {
  const auto& d = r.tiers[static_cast<int>(tiering::TierKind::kDram)];
  const auto& n = r.tiers[static_cast<int>(tiering::TierKind::kNvme)];
  std::printf("%-8s %7.4f %7.4f %7.4f %7.4f %9llu %9llu %9.0f %9.0f %9.0f %9.0f %10.0f %8.3f %8.3f\n",
              r.policy.c_str(), r.prefix_hit_ratio(), r.chunk_hit_ratio(), r.prefix_token_hit_ratio(),
              r.token_hit_ratio(), static_cast<unsigned long long>(d.hits),
              static_cast<unsigned long long>(n.hits), double(d.bytes_read) / kGiB, double(n.bytes_read) / kGiB,
              double(d.bytes_written) / kGiB, double(n.bytes_written) / kGiB, r.saved_gpu_s_per_hour(),
              r.ttft_p50_s, r.ttft_p99_s);
}

void PrintLatency(const char* name, const LatencySummary& l) {
  std::printf("%-7s %8llu %7llu %9.3f %9.3f %9.3f %9.3f\n", name, static_cast<unsigned long long>(l.calls),
              static_cast<unsigned long long>(l.errors), l.p50_ms, l.p90_ms, l.p99_ms, l.max_ms);
}

absl::Status RunLive(const ReplayArgs& a, const Setup& s) {
  LiveReplayOptions o;
  o.client.socket_path = a.socket;
  o.client.populate_mapping = false;
  o.chunk = s.options.chunk;
  if (a.live_chunk_tokens != 0) o.chunk.geometry.num_tokens = a.live_chunk_tokens;
  o.time_scale = a.time_scale;
  o.duration_s = a.duration_s;
  o.concurrency = a.concurrency;
  o.block_tokens = a.block_tokens;
  rp::Trace trace = s.trace;
  if (a.max_requests != 0 && trace.requests.size() > a.max_requests) trace.requests.resize(a.max_requests);
  KVTIER_ASSIGN_OR_RETURN(LiveReplayResult r, RunLiveReplay(trace, o));
  if (a.json) {
    nlohmann::ordered_json j = nlohmann::ordered_json::parse(LiveResultJson(r));
    j["socket"] = a.socket;
    j["time_scale"] = a.time_scale;
    j["duration_s"] = a.duration_s;
    j["concurrency"] = a.concurrency;
    j["chunk_tokens"] = o.chunk.geometry.num_tokens;
    std::printf("%s\n", j.dump(2).c_str());
    return absl::OkStatus();
  }
  std::printf("live    %s: %llu requests in %.1f s (trace time x%.3g, at most %.0f s, %d in flight)\n",
              a.socket.c_str(), static_cast<unsigned long long>(r.requests), r.wall_s, a.time_scale,
              a.duration_s, a.concurrency);
  std::printf("        prefix hit ratio %.4f (%llu of %llu block reads); start late p50 %.1f ms, p99 %.1f ms\n\n",
              r.prefix_hit_ratio(), static_cast<unsigned long long>(r.prefix_hits),
              static_cast<unsigned long long>(r.block_reads), r.late_p50_ms, r.late_p99_ms);
  std::printf("%-7s %8s %7s %9s %9s %9s %9s\n", "call", "calls", "errors", "p50-ms", "p90-ms", "p99-ms", "max-ms");
  PrintLatency("lookup", r.lookup);
  PrintLatency("get", r.get);
  PrintLatency("put", r.put);
  if (!r.first_error.empty()) std::printf("\nfirst error: %s\n", r.first_error.c_str());
  return absl::OkStatus();
}

absl::Status RunReplay(const ReplayArgs& a) {
  KVTIER_ASSIGN_OR_RETURN(Setup s, Prepare(a));
  if (a.live) return RunLive(a, s);
  KVTIER_ASSIGN_OR_RETURN(std::vector<uint64_t> dram, Sizes(s, a.dram_gib, a.dram_share, "dram"));
  KVTIER_ASSIGN_OR_RETURN(std::vector<uint64_t> nvme, Sizes(s, a.nvme_gib, a.nvme_share, "nvme"));
  if (dram.size() > 1 || nvme.size() > 1) {
    return absl::InvalidArgumentError("replay takes one DRAM and one NVMe size (kvtier plan sweeps)");
  }
  rp::ReplayOptions o = s.options;
  o.dram_bytes = dram.empty() ? 0 : dram[0];
  o.nvme_bytes = nvme.empty() ? 0 : nvme[0];
  KVTIER_ASSIGN_OR_RETURN(rp::ReplayResult policy, rp::ReplayTrace(s.trace, o));
  rp::ReplayOptions lo = o;
  lo.engine.eviction = {.all = tiering::EvictionPolicyKind::kLru};
  KVTIER_ASSIGN_OR_RETURN(rp::ReplayResult lru, rp::ReplayTrace(s.trace, lo));
  rp::ReplayResult belady = rp::BeladyReplay(s.trace, o);
  if (a.json) {
    nlohmann::ordered_json j = JsonHeader(a, s);
    j["dram_bytes"] = o.dram_bytes;
    j["nvme_bytes"] = o.nvme_bytes;
    j["dram_share"] = Share(s, o.dram_bytes);
    j["nvme_share"] = Share(s, o.nvme_bytes);
    j["prefill_tokens_per_s"] = o.prefill_tokens_per_s;
    j["load_gb_per_s"] = LoadRates(o);
    j["policy"] = nlohmann::ordered_json::parse(rp::ResultJson(policy));
    j["lru"] = nlohmann::ordered_json::parse(rp::ResultJson(lru));
    j["belady"] = nlohmann::ordered_json::parse(rp::ResultJson(belady));
    std::printf("%s\n", j.dump(2).c_str());
    return absl::OkStatus();
  }
  PrintHeader(a, s);
  std::printf("tiers   DRAM %.1f GiB (%.2f%% of distinct blocks), NVMe %.1f GiB (%.2f%%); metadata only\n\n",
              double(o.dram_bytes) / kGiB, 100 * Share(s, o.dram_bytes), double(o.nvme_bytes) / kGiB,
              100 * Share(s, o.nvme_bytes));
  std::printf("%-8s %7s %7s %7s %7s %9s %9s %9s %9s %9s %9s %10s %8s %8s\n", "policy", "prefix", "chunk",
              "pfx-tok", "tok", "dram-hits", "nvme-hits", "dram-rGiB", "nvme-rGiB", "dram-wGiB", "nvme-wGiB",
              "saved-s/h", "ttft-p50", "ttft-p99");
  PrintRow(policy);
  PrintRow(lru);
  PrintRow(belady);
  std::printf("\nprefix = prefix-hit blocks / block reads (a stored block after a miss saves nothing);\n"
              "saved-s/h = prefill GPU-seconds saved per hour of trace, net of load time;\n"
              "belady = offline optimum over one cache of DRAM + NVMe.\n");
  return absl::OkStatus();
}

absl::Status RunPlan(const ReplayArgs& a) {
  KVTIER_ASSIGN_OR_RETURN(Setup s, Prepare(a));
  KVTIER_ASSIGN_OR_RETURN(std::vector<uint64_t> dram, Sizes(s, a.dram_gib, a.dram_share, "dram"));
  KVTIER_ASSIGN_OR_RETURN(std::vector<uint64_t> nvme, Sizes(s, a.nvme_gib, a.nvme_share, "nvme"));
  if (dram.empty()) {
    for (double f : {0.01, 0.02, 0.05, 0.1, 0.2, 0.4}) dram.push_back(rp::BytesForShare(s.trace, s.chunk_bytes, f));
  }
  if (nvme.empty()) nvme.push_back(0);
  KVTIER_ASSIGN_OR_RETURN(std::vector<rp::PlanPoint> plan, rp::PlanCapacity(s.trace, s.options, dram, nvme));
  if (!a.plot.empty()) {
    const std::string svg = rp::RenderPlanSvg(plan);
    KVTIER_RETURN_IF_ERROR(WriteFileAtomic(
        a.plot, std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(svg.data()), svg.size())));
  }
  if (a.json) {
    nlohmann::ordered_json j = JsonHeader(a, s);
    j["prefill_tokens_per_s"] = s.options.prefill_tokens_per_s;
    j["load_gb_per_s"] = LoadRates(s.options);
    j["points"] = nlohmann::ordered_json::array();
    for (const rp::PlanPoint& p : plan) {
      nlohmann::ordered_json pj;
      pj["dram_bytes"] = p.dram_bytes;
      pj["nvme_bytes"] = p.nvme_bytes;
      pj["dram_share"] = Share(s, p.dram_bytes);
      pj["nvme_share"] = Share(s, p.nvme_bytes);
      pj["policy"] = nlohmann::ordered_json::parse(rp::ResultJson(p.policy));
      pj["belady"] = nlohmann::ordered_json::parse(rp::ResultJson(p.belady));
      j["points"].push_back(pj);
    }
    std::printf("%s\n", j.dump(2).c_str());
    return absl::OkStatus();
  }
  PrintHeader(a, s);
  std::printf("\n%9s %7s %9s %7s %8s %8s %12s %9s %9s %9s\n", "dram-GiB", "dram-%", "nvme-GiB", "nvme-%",
              "prefix", "belady", "saved-GPU-s/h", "ttft-p50", "ttft-p90", "ttft-p99");
  for (const rp::PlanPoint& p : plan) {
    std::printf("%9.1f %7.2f %9.1f %7.2f %8.4f %8.4f %12.0f %9.3f %9.3f %9.3f\n", double(p.dram_bytes) / kGiB,
                100 * Share(s, p.dram_bytes), double(p.nvme_bytes) / kGiB, 100 * Share(s, p.nvme_bytes),
                p.policy.prefix_hit_ratio(), p.belady.prefix_hit_ratio(), p.policy.saved_gpu_s_per_hour(),
                p.policy.ttft_p50_s, p.policy.ttft_p90_s, p.policy.ttft_p99_s);
  }
  std::printf("\npolicy %s; TTFT = load of the cached prefix + prefill of the rest, without queueing.\n",
              plan.empty() ? "" : plan.front().policy.policy.c_str());
  return absl::OkStatus();
}

void AddCommon(CLI::App* cmd, ReplayArgs& a) {
  cmd->add_option("trace", a.trace, "trace file, one JSON request per line (Mooncake format)")->required();
  cmd->add_option("--model", a.model, "model preset (kvtier models)")->capture_default_str();
  cmd->add_option("--codec", a.codec, "codec: k16v16, k16v8, k8v8, ...")->capture_default_str();
  cmd->add_option("--block-tokens", a.block_tokens, "tokens per trace block (one chunk)")->capture_default_str();
  cmd->add_option("--policy", a.policy, "eviction policy: lru, s3fifo, arc, flru, or per tier (\"flru,nvme=lru\") (default: the engine's)");
  cmd->add_option("--nvme-admit-after", a.nvme_admit_after_uses,
                  "uses before a chunk evicted from DRAM is written to NVMe")
      ->capture_default_str();
  cmd->add_option("--prefill-tokens-per-s", a.prefill_tokens_per_s,
                  "the inference engine's prefill rate, tokens/s")
      ->capture_default_str();
  cmd->add_option("--dram-link", a.dram_link, "DRAM load link: preset (kvtier links) or name=GB/s");
  cmd->add_option("--nvme-link", a.nvme_link, "NVMe load link: preset (kvtier links) or name=GB/s");
  cmd->add_option("--links-file", a.links_file,
                  "links measured by `kvtier probe --save FILE`: dram-memcpy and disk-odirect set the "
                  "DRAM and NVMe load rates (--dram-link, --nvme-link override them)");
  cmd->add_option("--max-requests", a.max_requests, "replay only the first N requests (0: all)");
  cmd->add_flag("--json", a.json, "print JSON");
}

}  // namespace

void RegisterReplayCommands(CLI::App& app, CommandResult& result) {
  auto replay_args = std::make_shared<ReplayArgs>();
  ReplayArgs& r = *replay_args;
  CLI::App* replay = app.add_subcommand(
      "replay", "replay a request trace through the placement engine (metadata-only tiers), beside LRU and Belady");
  AddCommon(replay, r);
  replay->add_option("--dram-gib", r.dram_gib, "DRAM tier size in GiB")->expected(1);
  replay->add_option("--nvme-gib", r.nvme_gib, "NVMe tier size in GiB")->expected(1);
  replay->add_option("--dram-share", r.dram_share, "DRAM size as a share of the trace's distinct blocks")
      ->expected(1);
  replay->add_option("--nvme-share", r.nvme_share, "NVMe size as a share of the trace's distinct blocks")
      ->expected(1);
  replay->add_flag("--live", r.live,
                   "replay against a running kvtierd at the trace's arrival times; report call latencies");
  replay->add_option("--socket", r.socket, "--live: kvtierd Unix socket")->capture_default_str();
  replay->add_option("--time-scale", r.time_scale, "--live: trace time per wall time (10 = ten times faster)")
      ->capture_default_str();
  replay->add_option("--duration-s", r.duration_s, "--live: start no request after this many seconds")
      ->capture_default_str();
  replay->add_option("--concurrency", r.concurrency, "--live: requests in flight, one connection each")
      ->capture_default_str();
  replay->add_option("--live-chunk-tokens", r.live_chunk_tokens,
                     "--live: tokens of the chunk sent per block (default: --block-tokens)");
  replay->callback(Action(result, [replay_args] { return RunReplay(*replay_args); }));

  auto plan_args = std::make_shared<ReplayArgs>();
  ReplayArgs& p = *plan_args;
  CLI::App* plan = app.add_subcommand(
      "plan", "capacity planner: sweep DRAM and NVMe sizes over a trace; hit ratio, saved GPU-s/h, TTFT");
  AddCommon(plan, p);
  plan->add_option("--dram-gib", p.dram_gib, "DRAM sizes in GiB, comma separated")->delimiter(',');
  plan->add_option("--nvme-gib", p.nvme_gib, "NVMe sizes in GiB, comma separated")->delimiter(',');
  plan->add_option("--dram-share", p.dram_share,
                   "DRAM sizes as shares of distinct blocks (default 0.01,0.02,0.05,0.1,0.2,0.4)")
      ->delimiter(',');
  plan->add_option("--nvme-share", p.nvme_share, "NVMe sizes as shares of distinct blocks (default 0)")
      ->delimiter(',');
  plan->add_option("--plot", p.plot, "write an SVG of hit ratio against DRAM size");
  plan->callback(Action(result, [plan_args] { return RunPlan(*plan_args); }));
}

}  // namespace kvtier::cli
