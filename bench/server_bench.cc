// kvtierd benchmark over the Unix socket, against an in-process daemon:
//  1. Lookup latency (p50/p99) and lookups/s at 1 and 16 concurrent clients
//     (each its own connection), 8 keys per lookup, 4 of them cached.
//  2. Put and get throughput of one 256-token Llama-3.1-8B K16/V8 chunk
//     (~24 MiB, codec::EncodeChunk) through shared memory, as a fraction of
//     memcpy of the same bytes between two pre-faulted buffers measured in
//     the same run. Inline gRPC bytes (the remote path) are shown too.
//
// The shared-memory put and get each use a second thread for their checksum
// (the daemon's data-plane thread, a client helper thread), so the output
// also shows memcpy split over two threads.
//
// A get reads a chunk stored earlier, from memory rather than cache (each
// round flushes it first), so it is also compared with memcpy from a source
// flushed out of the cache: on a host whose L3 holds the 24 MiB chunk twice
// over (the H100 host's 300 MiB), the plain memcpy baseline copies cache to
// cache.
//
// Usage: server_bench [--json FILE] [--reps N] [--seconds S] [--check-thread 0|1]
//                     [--put-check-threads 0|1|2]
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "bench/bench_util.h"
#include "bench/llama_chunk.h"
#include "client/kvtier_client.h"
#include "codec/chunk.h"
#include "codec/codec.h"
#include "codec/test_util.h"
#include "wire/chunk_check.h"
#include "server/daemon.h"
#include "server/shm_channel.h"

using namespace kvtier;
using Clock = std::chrono::steady_clock;

namespace {

double Percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(p * v.size()))];
}
double Median(std::vector<double> v) { return Percentile(std::move(v), 0.5); }

int put_check_threads = 0;  // --put-check-threads: DaemonOptions::put_check_threads
int check_thread = -1;  // --check-thread: ClientOptions::check_on_helper_thread; -1 = default

std::unique_ptr<client::KvtierClient> Connect(const std::string& sock, bool shm) {
  client::ClientOptions o;
  o.socket_path = sock;
  o.shared_memory = shm;
  if (check_thread >= 0) o.check_on_helper_thread = check_thread != 0;
  return client::KvtierClient::Connect(o).value();
}

struct LookupResult {
  int clients;
  uint64_t lookups;
  double seconds, p50_us, p99_us;
};

LookupResult BenchLookups(const std::string& sock, const std::vector<Hash128>& keys, int clients,
                          double seconds) {
  std::vector<std::vector<double>> lat(clients);
  std::vector<std::thread> ts;
  std::atomic<int> ready{0};
  std::atomic<bool> go{false};
  for (int c = 0; c < clients; ++c) {
    ts.emplace_back([&, c] {
      auto cl = Connect(sock, false);
      for (int i = 0; i < 50; ++i) (void)cl->Lookup(keys);  // warm the connection
      ++ready;
      while (!go.load()) std::this_thread::yield();
      auto end = Clock::now() + std::chrono::duration<double>(seconds);
      while (Clock::now() < end) {
        auto t0 = Clock::now();
        auto r = cl->Lookup(keys);
        auto t1 = Clock::now();
        if (!r.ok() || r->size() != 4) std::abort();
        lat[c].push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
      }
    });
  }
  while (ready.load() < clients) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  auto t0 = Clock::now();
  go = true;
  for (auto& t : ts) t.join();
  double s = std::chrono::duration<double>(Clock::now() - t0).count();
  std::vector<double> all;
  for (auto& v : lat) all.insert(all.end(), v.begin(), v.end());
  return {clients, all.size(), s, Percentile(all, 0.5), Percentile(all, 0.99)};
}

}  // namespace

int main(int argc, char** argv) {
  std::string json_path;
  int reps = 15;
  double seconds = 2.0;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--json") && i + 1 < argc) json_path = argv[++i];
    else if (!std::strcmp(argv[i], "--reps") && i + 1 < argc) reps = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--seconds") && i + 1 < argc) seconds = std::atof(argv[++i]);
    else if (!std::strcmp(argv[i], "--check-thread") && i + 1 < argc) check_thread = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--put-check-threads") && i + 1 < argc) put_check_threads = std::atoi(argv[++i]);
  }
  std::string dir = (std::filesystem::temp_directory_path() /
                     ("kvtier-server-bench-" + std::to_string(::getpid()))).string();
  server::DaemonOptions o;
  o.data_dir = dir;
  o.dram_gib = 1.0;
  o.nvme_gib = 0.5;
  o.hbm_gib = 0;
  o.log_level = "off";
  o.put_check_threads = static_cast<uint32_t>(put_check_threads);
  auto daemon = server::Daemon::Start(o).value();
  const std::string sock = daemon->socket_path();

  std::vector<uint8_t> chunk = bench::LlamaK16V8Chunk();
  const size_t bytes = chunk.size();

  std::printf("machine: %s\n", bench::CpuName().c_str());
  std::printf("chunk: Llama-3.1-8B, 256 tokens, K16/V8: %zu bytes (%.2f MiB)\n", bytes,
              bytes / 1048576.0);

  // --- Lookups.
  auto c0 = Connect(sock, true);
  std::vector<Hash128> keys;
  for (int i = 0; i < 8; ++i) keys.push_back(Hash128::Of("bench-lookup-" + std::to_string(i), 3));
  auto small = codec::EncodeChunk(codec::testing::MakeSpec({2, 2, 64, 16, 16}, codec::DType::kBF16,
                                                           {codec::DType::kBF16, codec::ScaleGranularity::kNone},
                                                           {codec::DType::kFP8E4M3, codec::ScaleGranularity::kPerBlockHead}),
                                   codec::KvView{std::vector<uint16_t>(2 * 16 * 2 * 64, 0x3f80),
                                                 std::vector<uint16_t>(2 * 16 * 2 * 64, 0x3f80)})
                   .value();
  for (int i = 0; i < 4; ++i) (void)c0->Put(keys[i], small);
  std::vector<LookupResult> lookups = {BenchLookups(sock, keys, 1, seconds),
                                       BenchLookups(sock, keys, 16, seconds)};
  std::printf("\n%-8s %10s %10s %10s %12s\n", "clients", "lookups", "p50 us", "p99 us", "lookups/s");
  for (const auto& r : lookups) {
    std::printf("%-8d %10llu %10.1f %10.1f %12.0f\n", r.clients,
                static_cast<unsigned long long>(r.lookups), r.p50_us, r.p99_us, r.lookups / r.seconds);
  }

  // --- Baseline: memcpy of the chunk between two pre-faulted buffers.
  std::vector<uint8_t> dst(bytes, 0);
  std::vector<double> memcpy_s;
  for (int i = 0; i < reps; ++i) {
    auto t0 = Clock::now();
    std::memcpy(dst.data(), chunk.data(), bytes);
    asm volatile("" : : "r"(dst.data()) : "memory");
    memcpy_s.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
  }
  // A second baseline: the copy libkvtier uses (wire::StreamCopy,
  // non-temporal stores), alone, on one thread, between the same buffers.
  std::vector<double> stream_s;
  for (int i = 0; i < reps; ++i) {
    auto t0 = Clock::now();
    wire::StreamCopy(dst, chunk);
    asm volatile("" : : "r"(dst.data()) : "memory");
    stream_s.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
  }
  // memcpy from a source flushed out of the cache (a get's source is a chunk
  // stored earlier).
  std::vector<double> cold_memcpy_s;

  // For readers who weigh the helper threads: the same memcpy split in two
  // halves, one on a second thread (started before the clock starts).
  std::vector<double> memcpy2_s;
  {
    std::atomic<int> go{0}, done{0};
    std::atomic<bool> quit{false};
    std::thread helper([&] {
      for (int seen = 0;;) {
        while (go.load() == seen && !quit.load()) std::this_thread::yield();
        if (quit.load()) return;
        seen = go.load();
        std::memcpy(dst.data() + bytes / 2, chunk.data() + bytes / 2, bytes - bytes / 2);
        done.fetch_add(1);
      }
    });
    for (int i = 0; i < reps; ++i) {
      auto t0 = Clock::now();
      go.fetch_add(1);
      std::memcpy(dst.data(), chunk.data(), bytes / 2);
      while (done.load() != i + 1) std::this_thread::yield();
      asm volatile("" : : "r"(dst.data()) : "memory");
      memcpy2_s.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
    }
    quit = true;
    helper.join();
  }

  // --- Put through shared memory: allocate slot + copy into it + commit
  // (the daemon verifies both section checksums). A fresh key each time;
  // the previous one is deleted outside the timed region.
  auto timed = [&](auto&& fn) {
    auto t0 = Clock::now();
    fn();
    return std::chrono::duration<double>(Clock::now() - t0).count();
  };
  // The checksum passes: codec::VerifyChunk (one thread) and the daemon's
  // check at commit (K and V on two threads); both hash with Checksum64.
  std::vector<double> verify_s, fast_verify_s;
  for (int i = 0; i < reps; ++i) {
    verify_s.push_back(timed([&] {
      if (!codec::VerifyChunk(chunk).ok()) std::abort();
    }));
    fast_verify_s.push_back(timed([&] {
      if (!wire::VerifyChunkParallel(chunk).ok()) std::abort();
    }));
  }
  // memcpy into the pool's own pages (a slot in the client's mapping): the
  // same copy without the RPCs and the checksum, on the same memory.
  std::vector<double> pool_memcpy_s;
  {
    auto slot = c0->AllocateSlot(bytes).value();
    for (int i = 0; i < reps + 1; ++i) {
      double s = timed([&] {
        std::memcpy(slot.data.data(), chunk.data(), bytes);
        asm volatile("" : : "r"(slot.data.data()) : "memory");
      });
      if (i > 0) pool_memcpy_s.push_back(s);
    }
    (void)c0->AbortSlot(slot);
  }
  // The get's copy alone, out of a stored chunk's pages: plain memcpy, and
  // libkvtier's copy that checks the checksums in the same pass.
  std::vector<double> pool_out_s, pool_out_checked_s, pool_out_pipelined_s;
  {
    Hash128 key = Hash128::Of(std::string_view("bench-copy-out"), 5);
    if (!c0->Put(key, chunk).ok()) std::abort();
    auto h = c0->Hold(key).value();
    wire::PipelinedCopyVerifier pipelined;
    for (int i = 0; i < reps + 1; ++i) {
      double a = timed([&] {
        std::memcpy(dst.data(), h.data.data(), bytes);
        asm volatile("" : : "r"(dst.data()) : "memory");
      });
      double b = timed([&] {
        if (!wire::CopyVerified(dst, h.data).ok()) std::abort();
      });
      double p = timed([&] {
        if (!pipelined.CopyVerified(dst, h.data).ok()) std::abort();
      });
      if (i > 0) {
        pool_out_s.push_back(a);
        pool_out_checked_s.push_back(b);
        pool_out_pipelined_s.push_back(p);
      }
    }
    (void)c0->Unhold(h);
    (void)c0->Delete(key);
  }
  // Interleaved with a memcpy of the same bytes each round, so that the
  // ratios compare numbers taken under the same load.
  std::vector<double> put_s, get_s, hold_s, put_unary_s, put_inline_s, get_inline_s, round_memcpy_s;
  std::vector<double> get_part_s[3];
  wire::PipelinedCopyVerifier parts_verifier;
  for (int i = 0; i < reps + 1; ++i) {
    Hash128 key = Hash128::Of("bench-put-" + std::to_string(i), 5);
    double ms = timed([&] {
      std::memcpy(dst.data(), chunk.data(), bytes);
      asm volatile("" : : "r"(dst.data()) : "memory");
    });
    bench::FlushFromCache(chunk);
    double cms = timed([&] {
      std::memcpy(dst.data(), chunk.data(), bytes);
      asm volatile("" : : "r"(dst.data()) : "memory");
    });
    double s = timed([&] {
      if (!c0->Put(key, chunk).ok()) std::abort();
    });
    {  // The stored chunk, out of the cache (as a chunk stored earlier is).
      auto h = c0->Hold(key);
      if (!h.ok()) std::abort();
      bench::FlushFromCache(h->data);
      if (!c0->Unhold(*h).ok()) std::abort();
    }
    double gs = timed([&] {
      auto r = c0->GetInto(key, dst);
      if (!r.ok() || r->first != bytes) std::abort();
    });
    // The unstreamed put: copy into the slot, then a unary commit whose
    // check (two threads) starts only after the copy.
    Hash128 key2 = Hash128::Of("bench-put-unary-" + std::to_string(i), 5);
    double us = timed([&] {
      auto slot = c0->AllocateSlot(bytes);
      if (!slot.ok()) std::abort();
      wire::StreamCopy(slot->data, chunk);
      if (!c0->CommitSlot(*slot, key2).ok()) std::abort();
    });
    (void)c0->Delete(key2);
    // Zero-copy read: hold the extent, release it (no bytes move).
    double hs = timed([&] {
      auto h = c0->Hold(key);
      if (!h.ok() || h->data.size() != bytes || !c0->Unhold(*h).ok()) std::abort();
    });
    // The get's parts one by one: hold, the checked copy (with the helper thread),
    // unhold.
    {
      auto t0 = Clock::now();
      auto h = c0->Hold(key);
      if (!h.ok()) std::abort();
      auto t1 = Clock::now();
      if (!parts_verifier.CopyVerified(dst, h->data).ok()) std::abort();
      auto t2 = Clock::now();
      if (!c0->Unhold(*h).ok()) std::abort();
      auto t3 = Clock::now();
      if (i > 0) {
        get_part_s[0].push_back(std::chrono::duration<double>(t1 - t0).count());
        get_part_s[1].push_back(std::chrono::duration<double>(t2 - t1).count());
        get_part_s[2].push_back(std::chrono::duration<double>(t3 - t2).count());
      }
    }
    if (i > 0) {  // the first round faults the pool pages in
      round_memcpy_s.push_back(ms);
      cold_memcpy_s.push_back(cms);
      put_s.push_back(s);
      get_s.push_back(gs);
      hold_s.push_back(hs);
      put_unary_s.push_back(us);
    }
    if (dst != chunk) std::abort();
    (void)c0->Delete(key);
  }
  auto ci = Connect(sock, false);
  for (int i = 0; i < std::min(reps, 5) + 1; ++i) {
    Hash128 key = Hash128::Of("bench-inline-" + std::to_string(i), 5);
    double s = timed([&] {
      if (!ci->Put(key, chunk).ok()) std::abort();
    });
    double gs = timed([&] {
      auto r = ci->GetInto(key, dst);
      if (!r.ok()) std::abort();
    });
    if (i > 0) {
      put_inline_s.push_back(s);
      get_inline_s.push_back(gs);
    }
    (void)ci->Delete(key);
  }
  auto gbps = [&](double s) { return bytes / s / 1e9; };
  memcpy_s.insert(memcpy_s.end(), round_memcpy_s.begin(), round_memcpy_s.end());
  const double m = Median(memcpy_s);
  // Per-round ratios (put or get time vs the memcpy of the same round).
  std::vector<double> put_ratio, get_ratio, get_cold_ratio;
  for (size_t i = 0; i < put_s.size(); ++i) {
    put_ratio.push_back(round_memcpy_s[i] / put_s[i]);
    get_ratio.push_back(round_memcpy_s[i] / get_s[i]);
    get_cold_ratio.push_back(cold_memcpy_s[i] / get_s[i]);
  }
  struct Row {
    const char* name;
    double s;
  } rows[] = {{"memcpy (baseline)", m},
              {"memcpy + verify", m + Median(verify_s)},
              {"memcpy + fastverify", m + Median(fast_verify_s)},
              {"memcpy into pool", Median(pool_memcpy_s)},
              {"memcpy out of pool", Median(pool_out_s)},
              {"checked copy out", Median(pool_out_checked_s)},
              {"checked copy out/2t", Median(pool_out_pipelined_s)},
              {"memcpy, 2 threads", Median(memcpy2_s)},
              {"put shm", Median(put_s)},
              {"get shm", Median(get_s)},
              {"put inline", Median(put_inline_s)},
              {"get inline", Median(get_inline_s)},
              {"stream copy (NT)", Median(stream_s)},
              {"memcpy, cold source", Median(cold_memcpy_s)}};
  std::printf("\nmedian of %d; ratio = op GB/s / memcpy GB/s (target >= 0.8 for shm)\n", reps);
  std::printf("%-20s %10s %10s %8s\n", "op", "ms", "GB/s", "ratio");
  for (const Row& r : rows) {
    std::printf("%-20s %10.3f %10.2f %8.3f\n", r.name, r.s * 1e3, gbps(r.s), m / r.s);
  }
  const bool helper = c0->checks_on_helper_thread();
  const char* get_threads = helper ? "the client copies on one thread while a client helper thread hashes behind it"
                                   : "the client copies and hashes each piece on one thread";
  const int put_threads = server::ResolvePutCheckThreads(put_check_threads);
  const char* put_how = put_threads == 2
                            ? "the client copies K and V interleaved on one thread while the "
                              "daemon's data-plane thread hashes K and its helper thread V behind it"
                            : "the client copies on one thread while the daemon's data-plane "
                              "thread hashes behind it";
  std::printf("threads: the baselines (memcpy, stream copy) are one thread. put shm: %s.\n"
              "get shm: %s.\n"
              "checked copy out: copy+hash on one thread; /2t: with the helper thread.\n",
              put_how, get_threads);
  std::printf("against the stream copy (%.3f ms): put shm %.3f, get shm %.3f\n",
              rows[12].s * 1e3, rows[12].s / rows[8].s, rows[12].s / rows[9].s);
  std::printf("get shm against memcpy from a cold source (%.3f ms): %.3f (per-round %.3f)\n",
              rows[13].s * 1e3, rows[13].s / rows[9].s, Median(get_cold_ratio));
  std::printf("per-round ratio medians: put shm %.3f, get shm %.3f; hold+unhold (zero-copy) %.1f us\n",
              Median(put_ratio), Median(get_ratio), Median(hold_s) * 1e6);
  std::printf("get shm in parts: hold %.1f us, checked copy /2t %.3f ms, unhold %.1f us\n"
              "  (the get itself sends its release without waiting for the answer)\n",
              Median(get_part_s[0]) * 1e6, Median(get_part_s[1]) * 1e3, Median(get_part_s[2]) * 1e6);
  std::printf("put shm, unstreamed (slot copy + unary commit): %.3f ms, %.3f of memcpy\n",
              Median(put_unary_s) * 1e3, m / Median(put_unary_s));

  char buf[4096];
  std::string json = "{\"benchmark\":\"server\",\"machine\":\"" + bench::CpuName() +
                     "\",\"transport\":\"unix socket, in-process kvtierd\",\"lookup_keys\":8,"
                     "\"lookup_hits\":4,\"lookups\":[";
  for (size_t i = 0; i < lookups.size(); ++i) {
    const auto& r = lookups[i];
    std::snprintf(buf, sizeof(buf),
                  "%s{\"clients\":%d,\"lookups\":%llu,\"seconds\":%.3f,\"p50_us\":%.2f,"
                  "\"p99_us\":%.2f,\"lookups_per_s\":%.0f}",
                  i ? "," : "", r.clients, static_cast<unsigned long long>(r.lookups), r.seconds,
                  r.p50_us, r.p99_us, r.lookups / r.seconds);
    json += buf;
  }
  std::snprintf(buf, sizeof(buf),
                "],\"chunk\":{\"shape\":\"llama-3.1-8b 32x8x128, 256 tokens, k16v8\",\"bytes\":%zu},"
                "\"reps\":%d,\"statistic\":\"median\",\"memcpy_gbps\":%.3f,"
                "\"memcpy_plus_verify_gbps\":%.3f,\"memcpy_plus_verify_vs_memcpy\":%.3f,"
                "\"memcpy_plus_fast_verify_gbps\":%.3f,\"memcpy_plus_fast_verify_vs_memcpy\":%.3f,"
                "\"memcpy_into_pool_gbps\":%.3f,\"memcpy_into_pool_vs_memcpy\":%.3f,"
                "\"put_shm_gbps\":%.3f,\"put_shm_vs_memcpy\":%.3f,"
                "\"get_shm_gbps\":%.3f,\"get_shm_vs_memcpy\":%.3f,"
                "\"put_shm_vs_memcpy_per_round_median\":%.3f,"
                "\"get_shm_vs_memcpy_per_round_median\":%.3f,\"hold_unhold_us\":%.1f,"
                "\"put_inline_gbps\":%.3f,\"put_inline_vs_memcpy\":%.3f,"
                "\"get_inline_gbps\":%.3f,\"get_inline_vs_memcpy\":%.3f,"
                "\"memcpy_out_of_pool_gbps\":%.3f,\"memcpy_out_of_pool_vs_memcpy\":%.3f,"
                "\"checked_copy_out_of_pool_gbps\":%.3f,\"checked_copy_out_of_pool_vs_memcpy\":%.3f,"
                "\"put_shm_unstreamed_gbps\":%.3f,\"put_shm_unstreamed_vs_memcpy\":%.3f,"
                "\"checked_copy_out_helper_thread_gbps\":%.3f,"
                "\"checked_copy_out_helper_thread_vs_memcpy\":%.3f,"
                "\"memcpy_two_threads_gbps\":%.3f,\"memcpy_two_threads_vs_memcpy\":%.3f,"
                "\"stream_copy_gbps\":%.3f,\"stream_copy_vs_memcpy\":%.3f,"
                "\"put_shm_vs_stream_copy\":%.3f,\"get_shm_vs_stream_copy\":%.3f,"
                "\"put_check_threads\":%d,"
                "\"memcpy_cold_source_gbps\":%.3f,\"get_shm_vs_memcpy_cold_source\":%.3f,"
                "\"get_shm_vs_memcpy_cold_source_per_round_median\":%.3f,"
                "\"threads\":\"baselines (memcpy, stream copy): 1 thread; put shm: %s; get shm: "
                "%s\"}\n",
                bytes, reps, gbps(m), gbps(rows[1].s), m / rows[1].s, gbps(rows[2].s), m / rows[2].s,
                gbps(rows[3].s), m / rows[3].s, gbps(rows[8].s), m / rows[8].s, gbps(rows[9].s),
                m / rows[9].s, Median(put_ratio), Median(get_ratio), Median(hold_s) * 1e6,
                gbps(rows[10].s), m / rows[10].s, gbps(rows[11].s), m / rows[11].s,
                gbps(rows[4].s), m / rows[4].s, gbps(rows[5].s), m / rows[5].s,
                gbps(Median(put_unary_s)), m / Median(put_unary_s), gbps(rows[6].s), m / rows[6].s,
                gbps(rows[7].s), m / rows[7].s, gbps(rows[12].s), m / rows[12].s,
                rows[12].s / rows[8].s, rows[12].s / rows[9].s, put_threads, gbps(rows[13].s),
                rows[13].s / rows[9].s, Median(get_cold_ratio), put_how, get_threads);
  json += buf;
  if (!json_path.empty()) {
    FILE* f = std::fopen(json_path.c_str(), "w");
    if (f) {
      std::fputs(json.c_str(), f);
      std::fclose(f);
    }
  }
  c0.reset();
  ci.reset();
  (void)daemon->Shutdown();
  daemon.reset();
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
  return 0;
}
