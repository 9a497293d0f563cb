// The shared-memory data plane's copy-and-check arrangements, without the
// daemon: which way of copying a 24 MiB chunk and hashing its sections keeps
// up with memcpy on this host (docs/daemon.md "Numbers"). Each variant runs
// the library's own pieces (wire/chunk_check.h) on a real Llama-3.1-8B
// 256-token K16/V8 chunk; the baselines (memcpy, the stream copy, the hash
// alone) are measured in the same run, medians of --reps.
//
// Get (chunk in the pool -> the reader's buffer), the source flushed out of
// the cache before each rep, as a stored chunk is:
//   plain stores + hash of the destination, 1 thread   (before this design)
//   plain stores + a helper hashing the destination    (before this design)
//   wire::CopyVerified                               (1 thread)
//   wire::PipelinedCopyVerifier                      (copy + helper)
// Put (the writer's buffer -> a slot; a "daemon" thread checks behind it,
// fed the pieces as the data plane's frames would):
//   plain stores, front to back, 1 checking thread     (before this design)
//   stream copy, front to back, 1 checking thread
//   stream copy, K/V interleaved, 2 checking threads   (the default on 4+)
//
// Usage: copy_check_bench [--reps N] [--json FILE]
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "bench/bench_util.h"
#include "bench/llama_chunk.h"
#include "codec/chunk.h"
#include "codec/section_hashes.h"
#include "common/hash.h"
#include "wire/chunk_check.h"

namespace kvtier {
namespace {

using Clock = std::chrono::steady_clock;

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Median seconds of `fn` over `reps` (after one warm-up), `before` run
// untimed ahead of each.
double Time(int reps, const std::function<void()>& before, const std::function<void()>& fn) {
  std::vector<double> t;
  for (int r = 0; r <= reps; ++r) {
    if (before) before();
    auto t0 = Clock::now();
    fn();
    const double s = std::chrono::duration<double>(Clock::now() - t0).count();
    if (r > 0) t.push_back(s);
  }
  return Median(t);
}

// A thread that feeds a put's pieces to an IncrementalChunkCheck as the
// writer announces them, as kvtierd's connection thread does with the data
// plane's frames.
class CheckingThread {
 public:
  CheckingThread() : thread_([this] { Loop(); }) {}
  ~CheckingThread() {
    quit_.store(true);
    thread_.join();
  }
  // Starts checking `slot`, written in `order`; `helper` as the daemon's.
  void Begin(std::span<const uint8_t> slot, const std::vector<std::pair<uint64_t, uint64_t>>* order,
             wire::TrailingHasher* helper) {
    slot_ = slot;
    order_ = order;
    helper_ = helper;
    published_.store(0);
    done_.store(false);
    go_.fetch_add(1, std::memory_order_release);
  }
  void Published(size_t pieces) { published_.store(pieces, std::memory_order_release); }
  // Waits for the verdict.
  bool Wait() {
    while (!done_.load(std::memory_order_acquire)) _mm_pause();
    return ok_;
  }

 private:
  void Loop() {
    int seen = 0;
    for (;;) {
      while (go_.load(std::memory_order_acquire) == seen) {
        if (quit_.load()) return;
        _mm_pause();
      }
      seen = go_.load();
      wire::IncrementalChunkCheck check(slot_, helper_);
      bool ok = true;
      for (size_t i = 0; i < order_->size();) {
        const size_t p = published_.load(std::memory_order_acquire);
        if (p == i) {
          _mm_pause();
          continue;
        }
        for (; i < p; ++i) ok = ok && check.AdvanceRange((*order_)[i].first, (*order_)[i].second).ok();
      }
      ok_ = ok && check.Finish().ok();
      done_.store(true, std::memory_order_release);
    }
  }

  std::span<const uint8_t> slot_;
  const std::vector<std::pair<uint64_t, uint64_t>>* order_ = nullptr;
  wire::TrailingHasher* helper_ = nullptr;
  std::atomic<size_t> published_{0};
  std::atomic<int> go_{0};
  std::atomic<bool> done_{false}, quit_{false};
  bool ok_ = false;
  std::thread thread_;
};

int Main(int argc, char** argv) {
  int reps = 15;
  std::string json_path;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--reps") && i + 1 < argc) reps = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--json") && i + 1 < argc) json_path = argv[++i];
  }
  // The writer's buffer is malloc'ed (16 bytes past a page), the slot and the
  // reader's buffer page aligned, as in the daemon's pool.
  std::vector<uint8_t> chunk = bench::LlamaK16V8Chunk();
  const size_t n = chunk.size();
  const auto h = codec::ParseHeader(chunk).value();
  auto aligned = [](size_t bytes) {
    auto* p = static_cast<uint8_t*>(std::aligned_alloc(4096, (bytes + 4095) & ~size_t{4095}));
    std::memset(p, 0, bytes);
    return std::unique_ptr<uint8_t, decltype(&std::free)>(p, &std::free);
  };
  auto slot_mem = aligned(n), out_mem = aligned(n);
  std::span<uint8_t> slot(slot_mem.get(), n), out(out_mem.get(), n);
  std::memcpy(slot.data(), chunk.data(), n);
  constexpr size_t kPiece = size_t{1} << 20;  // libkvtier's put piece

  struct Row {
    std::string name;
    double s;
  };
  std::vector<Row> rows;
  const double memcpy_s = Time(reps, nullptr, [&] {
    std::memcpy(out.data(), chunk.data(), n);
    asm volatile("" : : "r"(out.data()) : "memory");
  });
  rows.push_back({"memcpy (baseline)", memcpy_s});
  rows.push_back({"memcpy, cold source", Time(reps, [&] { bench::FlushFromCache(slot); }, [&] {
                    std::memcpy(out.data(), slot.data(), n);
                    asm volatile("" : : "r"(out.data()) : "memory");
                  })});
  rows.push_back({"stream copy", Time(reps, nullptr, [&] { wire::StreamCopy(out, chunk); })});
  rows.push_back({"XXH3-64 of the chunk", Time(reps, nullptr, [&] {
                    volatile uint64_t x = Checksum64(chunk);
                    (void)x;
                  })});

  // --- Get.
  auto flush_slot = [&] { bench::FlushFromCache(slot); };
  auto old_get_one_thread = [&] {  // 256 KiB plain-store pieces, each hashed from out
    codec::SectionHashes hashes;
    hashes.ResetChunk(h);
    std::memcpy(out.data(), slot.data(), codec::kHeaderSize);
    for (size_t o = codec::kHeaderSize; o < n; o += 256 << 10) {
      const size_t m = std::min<size_t>(256 << 10, n - o);
      std::memcpy(out.data() + o, slot.data() + o, m);
      hashes.Update(out.data(), o, o + m);
    }
    if (!hashes.Matches(codec::SectionHashes::kK) || !hashes.Matches(codec::SectionHashes::kV)) {
      std::abort();
    }
  };
  rows.push_back({"get: plain stores + hash dst, 1 thread", Time(reps, flush_slot, old_get_one_thread)});
  {
    wire::TrailingHasher helper;
    rows.push_back({"get: plain stores + helper hashing dst", Time(reps, flush_slot, [&] {
                      std::memcpy(out.data(), slot.data(), codec::kHeaderSize);
                      while (!helper.Start(out.data(), h, codec::kHeaderSize, n)) _mm_pause();
                      for (size_t o = codec::kHeaderSize; o < n; o += 256 << 10) {
                        const size_t m = std::min<size_t>(256 << 10, n - o);
                        std::memcpy(out.data() + o, slot.data() + o, m);
                        helper.Publish(o + m);
                      }
                      if (!helper.Finish().ok()) std::abort();
                    })});
  }
  rows.push_back({"get: wire::CopyVerified (1 thread)", Time(reps, flush_slot, [&] {
                    if (!wire::CopyVerified(out, slot).ok()) std::abort();
                  })});
  {
    wire::PipelinedCopyVerifier pipelined;
    rows.push_back({"get: wire::PipelinedCopyVerifier (2 threads)", Time(reps, flush_slot, [&] {
                      if (!pipelined.CopyVerified(out, slot).ok()) std::abort();
                    })});
  }

  // --- Put.
  {
    CheckingThread daemon;
    wire::TrailingHasher helper;
    std::vector<std::pair<uint64_t, uint64_t>> flat;
    for (uint64_t o = 0; o < n; o += kPiece) flat.emplace_back(o, std::min<uint64_t>(kPiece, n - o));
    const auto interleaved = wire::PutCopyOrder(chunk, kPiece);
    auto put = [&](const std::vector<std::pair<uint64_t, uint64_t>>& order, bool stream,
                   wire::TrailingHasher* h2) {
      return [&, stream, h2] {
        daemon.Begin(slot, &order, h2);
        for (size_t i = 0; i < order.size(); ++i) {
          auto [o, m] = order[i];
          if (stream) {
            wire::StreamCopy(slot.subspan(o, m), std::span<const uint8_t>(chunk).subspan(o, m));
          } else {
            std::memcpy(slot.data() + o, chunk.data() + o, m);
          }
          daemon.Published(i + 1);
        }
        if (!daemon.Wait()) std::abort();
      };
    };
    rows.push_back({"put: plain stores, 1 checking thread", Time(reps, nullptr, put(flat, false, nullptr))});
    rows.push_back({"put: stream copy, 1 checking thread", Time(reps, nullptr, put(flat, true, nullptr))});
    rows.push_back({"put: stream copy, K/V interleaved, 2 checking threads",
                    Time(reps, nullptr, put(interleaved, true, &helper))});
  }

  std::printf("copy_check_bench: %zu-byte Llama-3.1-8B K16/V8 chunk, median of %d, %s\n", n, reps,
              bench::CpuName().c_str());
  std::printf("%-56s %9s %9s %8s\n", "variant", "ms", "GB/s", "vs memcpy");
  std::string json = "{\"benchmark\":\"copy_check\",\"machine\":\"" + bench::CpuName() +
                     "\",\"bytes\":" + std::to_string(n) + ",\"reps\":" + std::to_string(reps) +
                     ",\"statistic\":\"median\",\"rows\":[";
  for (size_t i = 0; i < rows.size(); ++i) {
    const Row& r = rows[i];
    std::printf("%-56s %9.3f %9.2f %8.3f\n", r.name.c_str(), r.s * 1e3, n / r.s / 1e9, memcpy_s / r.s);
    char buf[256];
    std::snprintf(buf, sizeof(buf), "%s{\"name\":\"%s\",\"ms\":%.4f,\"gbps\":%.3f,\"vs_memcpy\":%.3f}",
                  i ? "," : "", r.name.c_str(), r.s * 1e3, n / r.s / 1e9, memcpy_s / r.s);
    json += buf;
  }
  json += "]}\n";
  if (!json_path.empty() && !bench::WriteJson(json_path, json)) {
    std::fprintf(stderr, "cannot write %s\n", json_path.c_str());
    return 2;
  }
  return 0;
}

}  // namespace
}  // namespace kvtier

int main(int argc, char** argv) { return kvtier::Main(argc, argv); }
