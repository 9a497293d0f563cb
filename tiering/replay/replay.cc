#include "tiering/replay/replay.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <queue>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "codec/format.h"
#include "common/coding.h"
#include "common/status.h"
#include "nlohmann/json.hpp"
#include "tiering/dram_tier.h"
#include "tiering/pool_tier.h"

namespace kvtier::tiering::replay {
namespace {

constexpr uint64_t kAlign = 4096;  // allocation unit of both metadata tiers
constexpr uint64_t kKeySeed = 0x6b76746965722d72;  // "kvtier-r": trace ids -> chunk keys

uint64_t BlockTokens(const TraceRequest& r, size_t i, uint32_t block_tokens) {
  return TraceBlockTokens(r, i, block_tokens);
}

double Percentile(std::vector<double>& v, double q) {
  if (v.empty()) return 0;
  const size_t k = std::min(v.size() - 1, static_cast<size_t>(q * static_cast<double>(v.size())));
  std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(k), v.end());
  return v[k];
}

size_t RequestCount(const Trace& trace, const ReplayOptions& o) {
  return o.max_requests == 0 ? trace.requests.size() : std::min(o.max_requests, trace.requests.size());
}

double TraceSeconds(const Trace& trace, size_t n) {
  if (n == 0) return 0;
  return static_cast<double>(trace.requests[n - 1].timestamp_ms - trace.requests[0].timestamp_ms) / 1e3;
}

void FinishTimes(ReplayResult& r, std::vector<double>& ttft, double rate) {
  r.prefill_seconds = rate > 0 ? static_cast<double>(r.token_reads) / rate : 0;
  const double recomputed_hits = rate > 0 ? static_cast<double>(r.prefix_hit_tokens) / rate : 0;
  r.saved_prefill_seconds = recomputed_hits - r.load_seconds;
  r.ttft_p50_s = Percentile(ttft, 0.50);
  r.ttft_p90_s = Percentile(ttft, 0.90);
  r.ttft_p99_s = Percentile(ttft, 0.99);
}

// A result with what every replay of `trace` reports before it runs: the
// policy, the sizes, and the requests it will replay.
ReplayResult StartResult(std::string policy, const Trace& trace, const ReplayOptions& options,
                         uint64_t chunk_bytes, uint64_t aligned_chunk_bytes) {
  ReplayResult r;
  r.policy = std::move(policy);
  r.dram_bytes = options.dram_bytes;
  r.nvme_bytes = options.nvme_bytes;
  r.chunk_bytes = chunk_bytes;
  r.capacity_chunks =
      options.dram_bytes / aligned_chunk_bytes + options.nvme_bytes / aligned_chunk_bytes;
  r.requests = RequestCount(trace, options);
  r.trace_seconds = TraceSeconds(trace, r.requests);
  return r;
}

}  // namespace

Hash128 TraceBlockKey(uint64_t id) {
  uint8_t b[8];
  StoreLE<uint64_t>(b, id);
  return Hash128::Of(std::span<const uint8_t>(b, 8), kKeySeed);
}

uint64_t TraceBlockTokens(const TraceRequest& r, size_t i, uint32_t block_tokens) {
  const uint64_t start = uint64_t{block_tokens} * i;
  if (r.input_length <= start) return 0;
  return std::min<uint64_t>(block_tokens, r.input_length - start);
}

absl::StatusOr<codec::ChunkSpec> ReplayChunkSpec(const bandwidth::ModelSpec& model,
                                                 std::string_view codec_name, uint32_t block_tokens) {
  KVTIER_ASSIGN_OR_RETURN(codec::CodecFormat f, codec::ParseCodec(codec_name, model.kv_dtype));
  codec::ChunkSpec s;
  s.fingerprint = Hash128::Of(absl::StrCat(model.name, "/", std::string(codec_name)), kKeySeed);
  s.geometry = codec::Geometry{model.num_layers, model.num_kv_heads, model.head_dim, block_tokens, 16};
  s.dtype = model.kv_dtype;
  s.k = f.k;
  s.v = f.v;
  KVTIER_RETURN_IF_ERROR(codec::ValidateSpec(s).status());
  return s;
}

uint64_t BytesForShare(const Trace& trace, uint64_t chunk_bytes, double share) {
  if (share <= 0) return 0;
  const auto chunks = static_cast<uint64_t>(std::ceil(share * static_cast<double>(trace.distinct_blocks)));
  return chunks * codec::AlignUp(chunk_bytes, kAlign);
}

absl::StatusOr<ReplayResult> ReplayTrace(const Trace& trace, const ReplayOptions& options) {
  KVTIER_ASSIGN_OR_RETURN(codec::ChunkLayout layout, codec::ValidateSpec(options.chunk));
  if (options.dram_bytes == 0 && options.nvme_bytes == 0) {
    return absl::InvalidArgumentError("replay needs a DRAM or an NVMe tier");
  }
  const uint64_t n = layout.total_bytes;
  const uint64_t aligned = codec::AlignUp(n, kAlign);
  for (uint64_t cap : {options.dram_bytes, options.nvme_bytes}) {
    if (cap != 0 && cap < aligned) {
      return absl::ResourceExhaustedError(
          absl::StrCat("a tier of ", cap, " bytes is smaller than one chunk (", aligned, " bytes)"));
    }
  }
  EngineTiers tiers;
  if (options.dram_bytes > 0) {
    DramTierOptions d;
    d.capacity_bytes = options.dram_bytes;
    d.metadata_only = true;
    KVTIER_ASSIGN_OR_RETURN(tiers.dram, DramTier::Open(d));
  }
  if (options.nvme_bytes > 0) tiers.nvme = NewMetadataTier(TierKind::kNvme, options.nvme_bytes, kAlign);
  PlacementEngineOptions eo = options.engine;
  eo.maintenance_interval_ms = 0;
  KVTIER_ASSIGN_OR_RETURN(std::unique_ptr<PlacementEngine> engine,
                          PlacementEngine::Create(eo, std::move(tiers)));

  // One chunk's worth of address space for puts and one for gets. Only the
  // put buffer's header is written: metadata-only tiers neither read the
  // payload nor write into the get buffer, so the pages stay untouched.
  std::unique_ptr<uint8_t[]> put_buf(new uint8_t[n]);
  std::unique_ptr<uint8_t[]> get_buf(new uint8_t[n]);
  codec::WriteHeader(options.chunk, layout, 0, 0, std::span<uint8_t>(put_buf.get(), codec::kHeaderSize));
  const std::span<const uint8_t> chunk(put_buf.get(), n);
  const std::span<uint8_t> out(get_buf.get(), n);
  const uint32_t bt = options.chunk.geometry.num_tokens;
  const TierKind put_tier = options.dram_bytes > 0 ? TierKind::kDram : TierKind::kNvme;
  const double rate = options.prefill_tokens_per_s;
  const bandwidth::PrefillCost prefill{.tokens_per_s = rate};
  const LoadCostModel& cost = eo.load_cost;

  ReplayResult r = StartResult(EvictionPolicySpecName(eo.eviction), trace, options, n, aligned);
  const size_t count = r.requests;
  std::vector<double> ttft;
  ttft.reserve(count);
  std::vector<Hash128> keys;
  for (size_t q = 0; q < count; ++q) {
    const TraceRequest& req = trace.requests[q];
    keys.clear();
    for (uint64_t id : req.hash_ids) keys.push_back(TraceBlockKey(id));
    size_t p = engine->LookupPrefix(keys).size();
    double load_us = 0;
    uint64_t recompute_tokens = 0;
    for (size_t i = 0; i < p; ++i) {
      auto t = engine->Get(keys[i], out);
      if (absl::IsNotFound(t.status())) {  // evicted by an earlier Get's promotion
        p = i;
        break;
      }
      KVTIER_RETURN_IF_ERROR(t.status());
      const int k = static_cast<int>(*t);
      const uint64_t tok = BlockTokens(req, i, bt);
      r.tiers[k].hits += 1;
      r.tiers[k].hit_tokens += tok;
      r.tiers[k].bytes_read += n;
      r.prefix_hit_tokens += tok;
      load_us += bandwidth::LoadMicros(n, cost.assumed_read_bytes_per_s[k], cost.latency_us[k]);
    }
    r.prefix_hits += p;
    r.chunk_hits += p;
    uint64_t prefix_tokens = 0;
    for (size_t i = 0; i < p; ++i) prefix_tokens += BlockTokens(req, i, bt);
    r.chunk_hit_tokens += prefix_tokens;
    // Stored blocks past the prefix are counted as the request found them,
    // before its own puts evict anything.
    for (size_t i = p; i < keys.size(); ++i) {
      const uint64_t tok = BlockTokens(req, i, bt);
      recompute_tokens += tok;
      if (engine->Contains(keys[i])) {
        r.chunk_hits += 1;
        r.chunk_hit_tokens += tok;
      }
    }
    for (size_t i = p; i < keys.size(); ++i) {
      if (!engine->Contains(keys[i])) r.tiers[static_cast<int>(put_tier)].bytes_written += n;
      KVTIER_RETURN_IF_ERROR(engine->Put(keys[i], chunk));
    }
    r.block_reads += keys.size();
    for (size_t i = 0; i < keys.size(); ++i) r.token_reads += BlockTokens(req, i, bt);
    r.load_seconds += load_us / 1e6;
    ttft.push_back(load_us / 1e6 +
                   bandwidth::RecomputeMicros(prefix_tokens, recompute_tokens, prefill) / 1e6);
  }
  r.evictions = engine->metric(EngineMetric::kEvictions);
  r.demotions = engine->metric(EngineMetric::kDemotions);
  r.promotions = engine->metric(EngineMetric::kPromotions);
  r.admission_rejects = engine->metric(EngineMetric::kAdmissionRejects);
  r.tiers[static_cast<int>(TierKind::kNvme)].bytes_written += r.demotions * n;
  r.tiers[static_cast<int>(TierKind::kDram)].bytes_written += r.promotions * n;
  FinishTimes(r, ttft, rate);
  return r;
}

ReplayResult BeladyReplay(const Trace& trace, const ReplayOptions& options) {
  const auto layout = codec::ValidateSpec(options.chunk);
  const uint64_t n = layout.ok() ? layout->total_bytes : 0;
  const uint64_t aligned = codec::AlignUp(std::max<uint64_t>(n, 1), kAlign);
  const uint32_t bt = options.chunk.geometry.num_tokens;
  const double rate = options.prefill_tokens_per_s;
  const bandwidth::PrefillCost prefill{.tokens_per_s = rate};
  const int dram = static_cast<int>(TierKind::kDram);
  const LoadCostModel& cost = options.engine.load_cost;

  ReplayResult r = StartResult("belady", trace, options, n, aligned);
  const size_t count = r.requests;

  // next[j]: position of the next read of the block read at position j.
  constexpr uint64_t kNever = std::numeric_limits<uint64_t>::max();
  std::vector<uint64_t> ids;
  for (size_t q = 0; q < count; ++q) {
    ids.insert(ids.end(), trace.requests[q].hash_ids.begin(), trace.requests[q].hash_ids.end());
  }
  std::vector<uint64_t> next(ids.size());
  {
    absl::flat_hash_map<uint64_t, uint64_t> later;
    for (size_t j = ids.size(); j-- > 0;) {
      auto [it, inserted] = later.try_emplace(ids[j], j);
      next[j] = inserted ? kNever : it->second;
      it->second = j;
    }
  }
  // Cached block -> its next read; a max-heap of (next read, block) with
  // stale entries skipped.
  absl::flat_hash_map<uint64_t, uint64_t> cache;
  std::priority_queue<std::pair<uint64_t, uint64_t>> heap;
  std::vector<double> ttft;
  size_t pos = 0;
  for (size_t q = 0; q < count; ++q) {
    const TraceRequest& req = trace.requests[q];
    bool in_prefix = true;
    double load_us = 0;
    uint64_t prefix_tokens = 0, recompute_tokens = 0;
    for (size_t i = 0; i < req.hash_ids.size(); ++i, ++pos) {
      const uint64_t id = ids[pos], nx = next[pos];
      const uint64_t tok = BlockTokens(req, i, bt);
      r.token_reads += tok;
      auto it = cache.find(id);
      if (it != cache.end()) {
        r.chunk_hits += 1;
        r.chunk_hit_tokens += tok;
        if (in_prefix) {
          r.prefix_hits += 1;
          r.prefix_hit_tokens += tok;
          prefix_tokens += tok;
          r.tiers[dram].hits += 1;
          r.tiers[dram].hit_tokens += tok;
          r.tiers[dram].bytes_read += n;
          load_us += bandwidth::LoadMicros(n, cost.assumed_read_bytes_per_s[dram], cost.latency_us[dram]);
        } else {
          recompute_tokens += tok;
        }
        if (nx == kNever) {
          cache.erase(it);
        } else {
          it->second = nx;
          heap.emplace(nx, id);
        }
        continue;
      }
      in_prefix = false;
      recompute_tokens += tok;
      if (nx == kNever || r.capacity_chunks == 0) continue;  // never read again: not stored
      if (cache.size() >= r.capacity_chunks) {
        while (!heap.empty()) {
          auto [vn, v] = heap.top();
          auto c = cache.find(v);
          if (c != cache.end() && c->second == vn) break;
          heap.pop();
        }
        if (heap.empty() || heap.top().first < nx) continue;  // keep what is read sooner
        cache.erase(heap.top().second);
        heap.pop();
        r.evictions += 1;
      }
      cache[id] = nx;
      heap.emplace(nx, id);
      r.tiers[dram].bytes_written += n;
    }
    r.block_reads += req.hash_ids.size();
    r.load_seconds += load_us / 1e6;
    ttft.push_back(load_us / 1e6 +
                   bandwidth::RecomputeMicros(prefix_tokens, recompute_tokens, prefill) / 1e6);
  }
  FinishTimes(r, ttft, rate);
  return r;
}

std::string ResultJson(const ReplayResult& r) {
  nlohmann::ordered_json j;
  j["policy"] = r.policy;
  j["dram_bytes"] = r.dram_bytes;
  j["nvme_bytes"] = r.nvme_bytes;
  j["chunk_bytes"] = r.chunk_bytes;
  j["capacity_chunks"] = r.capacity_chunks;
  j["requests"] = r.requests;
  j["block_reads"] = r.block_reads;
  j["token_reads"] = r.token_reads;
  j["chunk_hits"] = r.chunk_hits;
  j["prefix_hits"] = r.prefix_hits;
  j["chunk_hit_ratio"] = r.chunk_hit_ratio();
  j["token_hit_ratio"] = r.token_hit_ratio();
  j["prefix_hit_ratio"] = r.prefix_hit_ratio();
  j["prefix_hit_tokens"] = r.prefix_hit_tokens;
  j["prefix_token_hit_ratio"] = r.prefix_token_hit_ratio();
  nlohmann::ordered_json tiers = nlohmann::ordered_json::object();
  for (TierKind k : {TierKind::kDram, TierKind::kNvme}) {
    const uint64_t cap = k == TierKind::kDram ? r.dram_bytes : r.nvme_bytes;
    if (cap == 0 || (r.policy == "belady" && k != TierKind::kDram)) continue;
    const TierReplayStats& t = r.tiers[static_cast<int>(k)];
    tiers[TierName(k)] = {{"prefix_hits", t.hits},
                          {"prefix_hit_tokens", t.hit_tokens},
                          {"prefix_hit_ratio", r.block_reads ? double(t.hits) / double(r.block_reads) : 0.0},
                          {"prefix_token_hit_ratio",
                           r.token_reads ? double(t.hit_tokens) / double(r.token_reads) : 0.0},
                          {"bytes_read", t.bytes_read},
                          {"bytes_written", t.bytes_written}};
  }
  j["tiers"] = tiers;
  j["evictions"] = r.evictions;
  j["demotions"] = r.demotions;
  j["promotions"] = r.promotions;
  j["admission_rejects"] = r.admission_rejects;
  j["trace_seconds"] = r.trace_seconds;
  j["prefill_seconds"] = r.prefill_seconds;
  j["load_seconds"] = r.load_seconds;
  j["saved_prefill_seconds"] = r.saved_prefill_seconds;
  j["saved_gpu_s_per_hour"] = r.saved_gpu_s_per_hour();
  j["ttft_p50_s"] = r.ttft_p50_s;
  j["ttft_p90_s"] = r.ttft_p90_s;
  j["ttft_p99_s"] = r.ttft_p99_s;
  return j.dump();
}

absl::StatusOr<std::vector<PlanPoint>> PlanCapacity(const Trace& trace, const ReplayOptions& options,
                                                    const std::vector<uint64_t>& dram_bytes,
                                                    const std::vector<uint64_t>& nvme_bytes) {
  std::vector<PlanPoint> out;
  for (uint64_t nv : nvme_bytes) {
    for (uint64_t dr : dram_bytes) {
      ReplayOptions o = options;
      o.dram_bytes = dr;
      o.nvme_bytes = nv;
      PlanPoint p;
      p.dram_bytes = dr;
      p.nvme_bytes = nv;
      KVTIER_ASSIGN_OR_RETURN(p.policy, ReplayTrace(trace, o));
      p.belady = BeladyReplay(trace, o);
      out.push_back(std::move(p));
    }
  }
  return out;
}

std::string RenderPlanSvg(const std::vector<PlanPoint>& points) {
  constexpr double kW = 760, kH = 440, kL = 70, kR = 200, kT = 30, kB = 60;
  constexpr double kGiB = double(uint64_t{1} << 30);
  static constexpr const char* kColors[] = {"#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b"};
  double xmax = 1, ymax = 0.05;
  std::vector<uint64_t> nvmes;
  for (const PlanPoint& p : points) {
    xmax = std::max(xmax, double(p.dram_bytes) / kGiB);
    ymax = std::max({ymax, p.policy.prefix_hit_ratio(), p.belady.prefix_hit_ratio()});
    if (std::find(nvmes.begin(), nvmes.end(), p.nvme_bytes) == nvmes.end()) nvmes.push_back(p.nvme_bytes);
  }
  ymax = std::ceil(ymax * 10) / 10;
  auto X = [&](double gib) { return kL + gib / xmax * (kW - kL - kR); };
  auto Y = [&](double v) { return kH - kB - v / ymax * (kH - kT - kB); };
  std::string s = absl::StrFormat(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%.0f\" height=\"%.0f\" font-family=\"sans-serif\" "
      "font-size=\"12\">\n<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n",
      kW, kH);
  absl::StrAppendFormat(&s, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"black\"/>\n", kL,
                        Y(0), kW - kR, Y(0));
  absl::StrAppendFormat(&s, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"black\"/>\n", kL,
                        Y(0), kL, Y(ymax));
  for (int i = 0; i <= 5; ++i) {
    const double v = ymax * i / 5, g = xmax * i / 5;
    absl::StrAppendFormat(&s, "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"end\">%.2f</text>\n", kL - 6,
                          Y(v) + 4, v);
    absl::StrAppendFormat(&s, "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">%.0f</text>\n", X(g),
                          Y(0) + 18, g);
  }
  absl::StrAppendFormat(&s, "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">DRAM (GiB)</text>\n",
                        (kL + kW - kR) / 2, kH - 15);
  absl::StrAppendFormat(&s,
                        "<text transform=\"translate(18,%.1f) rotate(-90)\" text-anchor=\"middle\">"
                        "prefix block hit ratio</text>\n",
                        (kT + kH - kB) / 2);
  auto line = [&](uint64_t nvme, bool belady, const char* color, double legend_y) {
    std::string pts;
    for (const PlanPoint& p : points) {
      if (p.nvme_bytes != nvme) continue;
      const double v = belady ? p.belady.prefix_hit_ratio() : p.policy.prefix_hit_ratio();
      absl::StrAppendFormat(&pts, "%.1f,%.1f ", X(double(p.dram_bytes) / kGiB), Y(v));
    }
    absl::StrAppendFormat(&s, "<polyline fill=\"none\" stroke=\"%s\" stroke-width=\"2\"%s points=\"%s\"/>\n",
                          color, belady ? " stroke-dasharray=\"6,4\"" : "", pts);
    absl::StrAppendFormat(&s, "<text x=\"%.1f\" y=\"%.1f\" fill=\"%s\">%s, NVMe %.0f GiB</text>\n",
                          kW - kR + 10, legend_y, color, belady ? "belady" : points.front().policy.policy,
                          double(nvme) / kGiB);
  };
  for (size_t i = 0; i < nvmes.size(); ++i) line(nvmes[i], false, kColors[i % 6], kT + 16.0 * double(i));
  if (!nvmes.empty()) line(nvmes.back(), true, "#555555", kT + 16.0 * double(nvmes.size()));
  s += "</svg>\n";
  return s;
}

}  // namespace kvtier::tiering::replay
