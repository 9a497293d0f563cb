#include "cli/live_replay.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <memory>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/status.h"
#include "nlohmann/json.hpp"
#include "tiering/replay/replay.h"

namespace kvtier::cli {
namespace {

using Clock = std::chrono::steady_clock;

double Ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

LatencySummary Summarize(std::vector<double>& ms, uint64_t errors) {
  LatencySummary s;
  s.calls = ms.size() + errors;
  s.errors = errors;
  if (ms.empty()) return s;
  std::sort(ms.begin(), ms.end());
  auto at = [&](double q) { return ms[std::min(ms.size() - 1, static_cast<size_t>(q * double(ms.size())))]; };
  s.p50_ms = at(0.5);
  s.p90_ms = at(0.9);
  s.p99_ms = at(0.99);
  s.max_ms = ms.back();
  return s;
}

// What one worker measured.
struct WorkerLog {
  std::vector<double> lookup, get, put, late;
  uint64_t lookup_errors = 0, get_errors = 0, put_errors = 0;
  uint64_t requests = 0, block_reads = 0, prefix_hits = 0;
  std::string first_error;
  void Error(const absl::Status& st) {
    if (first_error.empty()) first_error = std::string(st.message());
  }
};

}  // namespace

absl::StatusOr<LiveReplayResult> RunLiveReplay(const tiering::replay::Trace& trace,
                                               const LiveReplayOptions& o) {
  if (!(o.time_scale > 0)) return absl::InvalidArgumentError("time scale must be positive");
  if (!(o.duration_s > 0) || o.duration_s > 86400) {
    return absl::InvalidArgumentError("duration must be in (0, 86400] seconds");
  }
  if (o.concurrency < 1 || o.concurrency > 256) return absl::InvalidArgumentError("concurrency must be 1..256");
  KVTIER_ASSIGN_OR_RETURN(codec::ChunkLayout layout, codec::ValidateSpec(o.chunk));
  // One valid chunk (zero payload, real checksums) stands for every block.
  std::vector<uint8_t> chunk(layout.total_bytes, 0);
  codec::WriteHeader(o.chunk, layout, 0, 0, chunk);
  KVTIER_RETURN_IF_ERROR(codec::SealChunk(chunk));

  std::vector<std::unique_ptr<client::KvtierClient>> clients;
  for (int i = 0; i < o.concurrency; ++i) {
    KVTIER_ASSIGN_OR_RETURN(std::unique_ptr<client::KvtierClient> c,
                            client::KvtierClient::Connect(o.client));
    clients.push_back(std::move(c));
  }
  const auto start = Clock::now();
  const auto deadline = start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(o.duration_s));
  const int64_t t0 = trace.requests.empty() ? 0 : trace.requests.front().timestamp_ms;
  std::atomic<size_t> next{0};
  std::vector<WorkerLog> logs(o.concurrency);
  auto work = [&](int w) {
    client::KvtierClient& c = *clients[w];
    WorkerLog& log = logs[w];
    std::vector<uint8_t> buf(chunk.size());
    std::vector<Hash128> keys;
    for (;;) {
      const size_t q = next.fetch_add(1);
      if (q >= trace.requests.size()) return;
      const auto& req = trace.requests[q];
      const auto due = start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(
                                   double(req.timestamp_ms - t0) / 1e3 / o.time_scale));
      if (due >= deadline) return;
      std::this_thread::sleep_until(due);
      log.late.push_back(Ms(Clock::now() - due));
      ++log.requests;
      log.block_reads += req.hash_ids.size();
      keys.clear();
      for (uint64_t id : req.hash_ids) keys.push_back(tiering::replay::TraceBlockKey(id));
      auto t = Clock::now();
      auto hits = c.Lookup(keys);
      size_t p = 0;
      if (hits.ok()) {
        log.lookup.push_back(Ms(Clock::now() - t));
        p = hits->size();
      } else {
        ++log.lookup_errors;
        log.Error(hits.status());
      }
      size_t got = 0;
      for (; got < p; ++got) {
        t = Clock::now();
        auto g = c.GetInto(keys[got], buf);
        if (!g.ok()) {  // evicted since the lookup: the prefix ends here
          ++log.get_errors;
          if (!absl::IsNotFound(g.status())) log.Error(g.status());
          break;
        }
        log.get.push_back(Ms(Clock::now() - t));
      }
      log.prefix_hits += got;
      for (size_t i = got; i < keys.size(); ++i) {
        t = Clock::now();
        absl::Status st = c.Put(keys[i], chunk);
        if (st.ok()) {
          log.put.push_back(Ms(Clock::now() - t));
        } else {
          ++log.put_errors;
          log.Error(st);
        }
      }
    }
  };
  std::vector<std::thread> threads;
  for (int w = 0; w < o.concurrency; ++w) threads.emplace_back(work, w);
  for (auto& th : threads) th.join();

  LiveReplayResult r;
  r.wall_s = std::chrono::duration<double>(Clock::now() - start).count();
  WorkerLog all;
  for (WorkerLog& l : logs) {
    all.lookup.insert(all.lookup.end(), l.lookup.begin(), l.lookup.end());
    all.get.insert(all.get.end(), l.get.begin(), l.get.end());
    all.put.insert(all.put.end(), l.put.begin(), l.put.end());
    all.late.insert(all.late.end(), l.late.begin(), l.late.end());
    all.lookup_errors += l.lookup_errors;
    all.get_errors += l.get_errors;
    all.put_errors += l.put_errors;
    r.requests += l.requests;
    r.block_reads += l.block_reads;
    r.prefix_hits += l.prefix_hits;
    if (r.first_error.empty()) r.first_error = l.first_error;
  }
  r.lookup = Summarize(all.lookup, all.lookup_errors);
  r.get = Summarize(all.get, all.get_errors);
  r.put = Summarize(all.put, all.put_errors);
  LatencySummary late = Summarize(all.late, 0);
  r.late_p50_ms = late.p50_ms;
  r.late_p99_ms = late.p99_ms;
  return r;
}

std::string LiveResultJson(const LiveReplayResult& r) {
  auto lat = [](const LatencySummary& s) {
    return nlohmann::ordered_json{{"calls", s.calls},   {"errors", s.errors}, {"p50_ms", s.p50_ms},
                                  {"p90_ms", s.p90_ms}, {"p99_ms", s.p99_ms}, {"max_ms", s.max_ms}};
  };
  nlohmann::ordered_json j;
  j["requests"] = r.requests;
  j["block_reads"] = r.block_reads;
  j["prefix_hits"] = r.prefix_hits;
  j["prefix_hit_ratio"] = r.prefix_hit_ratio();
  j["wall_s"] = r.wall_s;
  j["lookup"] = lat(r.lookup);
  j["get"] = lat(r.get);
  j["put"] = lat(r.put);
  j["late_p50_ms"] = r.late_p50_ms;
  j["late_p99_ms"] = r.late_p99_ms;
  j["first_error"] = r.first_error;
  return j.dump();
}

}  // namespace kvtier::cli
