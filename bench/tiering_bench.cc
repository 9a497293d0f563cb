// Tiering benchmarks, each against its physical baseline in the same run:
//   dram  engine Put/Get of 1.5/6/24 MiB chunks vs memcpy of the same bytes
//         between the same addresses (caller buffer <-> the pool slots the
//         engine used); also memcpy into a private anonymous buffer
//         (memcpy_put_anon_gbps), which excludes the pool's pages
//   nvme  engine Put/Get on the NVMe tier vs raw io_uring O_DIRECT writes and
//         reads of the same bytes, same directory, request size and queue
//         depth: non-durable puts (aligned and unaligned source; timing ends
//         after a Flush) vs raw writes; durable puts (1 and 4 writers) vs raw
//         writes + fdatasync per chunk; gets vs raw reads, as two batches,
//         and interleaved chunk by chunk with raw reads of the very extents
//         of the tier's data file the gets read. Both sides read one chunk per
//         Submit, so at most ceil(chunk / request) requests are in flight on
//         either (queue_depth is the ring's limit, not reached by 6 MiB)
//   nvme-batch  engine GetSharedBatch of 16 chunks (6 MiB) stored on NVMe
//         only (every chunk's requests in one submission, read into DRAM-pool
//         scratch slots and verified as they arrive) vs raw io_uring O_DIRECT
//         reads of the very extents (a second handle on the tier's data
//         file) into pool pages, 1 MiB requests, queue depth 32, one
//         submission; which goes first alternates. Without promotion, and
//         with it (the scratch slots become the DRAM copies; each rep
//         stores the chunks on NVMe only again, untimed)
//   trace hit ratio of LRU (baseline), S3-FIFO (the engine's default), ARC
//         and FLRU on a multi-turn chat / shared-document trace with DRAM = 10%
//         and NVMe = 50% of the working set, plus four more trace seeds
//   holds a shared get and release with 10k / 100k idle leases of another
//         holder open vs the same with the lease table empty
// Usage: tiering_bench [--dir DIR] [--json FILE] [--only dram|nvme|nvme-batch|trace|holds]
//   experiment knobs (defaults = the engine's): --s3fifo-small F
//   --admission-history N --admit-after N --dram-fraction F --nvme-fraction F
//   --trace-seed S. Prints JSON.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "bench/raw_io.h"
#include "codec/codec.h"
#include "tiering/placement_engine.h"

namespace kvtier::tiering {
namespace {

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

std::vector<uint8_t> Chunk(uint32_t layers, uint32_t heads, uint32_t dim, uint32_t tokens, uint64_t seed) {
  codec::ChunkSpec spec;
  spec.fingerprint = Hash128::Of("bench", 1);
  spec.geometry = codec::Geometry{layers, heads, dim, tokens, 16};
  const size_t n = size_t{layers} * tokens * heads * dim;
  std::vector<uint16_t> k(n), v(n);
  std::mt19937_64 rng(seed);
  for (size_t i = 0; i < n; ++i) {
    k[i] = static_cast<uint16_t>(0x3c00 | (rng() & 0x3ff));
    v[i] = static_cast<uint16_t>(0x3c00 | (rng() & 0x3ff));
  }
  return codec::EncodeChunk(spec, {k, v}).value();
}

Hash128 Key(uint64_t i) { return Hash128::Of(std::to_string(i), 9); }

std::string Dram() {
  std::ostringstream js;
  js << "[";
  const uint64_t pool = 512ull << 20;
  struct Size { uint32_t tokens; };
  bool first = true;
  for (uint32_t tokens : {64u, 256u, 1024u}) {
    auto chunk = Chunk(8, 8, 128, tokens, tokens);  // 1.5, 6, 24 MiB
    const uint64_t n = std::min<uint64_t>(pool / ((chunk.size() + 4095) / 4096 * 4096) - 1, 256);
    EngineTiers tiers;
    tiers.dram = DramTier::Open({.capacity_bytes = pool}).value();
    auto e = PlacementEngine::Create({.maintenance_interval_ms = 0}, std::move(tiers)).value();
    std::vector<uint8_t> dst(n * chunk.size()), anon(n * chunk.size());
    std::memset(dst.data(), 1, dst.size());
    std::memset(anon.data(), 1, anon.size());
    uint8_t* const pool_base = e->dram()->base();
    std::vector<uint64_t> slot(n);  // where the engine put each chunk
    const int reps = 3;
    double put_s = 0, get_s = 0, cpy_s = 0, cpy_get_s = 0, anon_s = 0;
    for (int r = 0; r < reps; ++r) {
      double t0 = Now();
      for (uint64_t i = 0; i < n; ++i) {
        if (!e->Put(Key(i), chunk).ok()) std::abort();
      }
      double t1 = Now();
      for (uint64_t i = 0; i < n; ++i) {
        if (!e->Get(Key(i), {dst.data() + i * chunk.size(), chunk.size()}).ok()) std::abort();
      }
      double t2 = Now();
      for (uint64_t i = 0; i < n; ++i) {
        slot[i] = e->Locate(Key(i)).value().parts[0].dram_slot->offset;
        if (!e->Delete(Key(i)).ok()) std::abort();
      }
      // Baselines: memcpy of the same bytes between the same addresses: the
      // caller's chunk into the pool slots the engine used, and those slots
      // into the caller's buffers.
      double t3 = Now();
      for (uint64_t i = 0; i < n; ++i) std::memcpy(pool_base + slot[i], chunk.data(), chunk.size());
      double t4 = Now();
      for (uint64_t i = 0; i < n; ++i) {
        std::memcpy(dst.data() + i * chunk.size(), pool_base + slot[i], chunk.size());
      }
      double t5 = Now();
      // A second baseline, for comparison: into a private anonymous
      // buffer packed at chunk-size strides (not the pool).
      for (uint64_t i = 0; i < n; ++i) std::memcpy(anon.data() + i * chunk.size(), chunk.data(), chunk.size());
      anon_s += Now() - t5;
      put_s += t1 - t0;
      get_s += t2 - t1;
      cpy_s += t4 - t3;
      cpy_get_s += t5 - t4;
    }
    double bytes = double(n) * chunk.size() * reps;
    double put = bytes / put_s / 1e9, get = bytes / get_s / 1e9, cpy = bytes / cpy_s / 1e9;
    double cpy_get = bytes / cpy_get_s / 1e9;
    js << (first ? "" : ",") << "\n    {\"chunk_bytes\": " << chunk.size() << ", \"chunks\": " << n
       << ", \"put_gbps\": " << put << ", \"get_gbps\": " << get << ", \"memcpy_put_gbps\": " << cpy
       << ", \"memcpy_get_gbps\": " << cpy_get << ", \"memcpy_put_anon_gbps\": " << bytes / anon_s / 1e9
       << ", \"put_ratio\": " << put / cpy << ", \"get_ratio\": " << get / cpy_get
       << ", \"put_ratio_vs_anon\": " << put / (bytes / anon_s / 1e9) << "}";
    first = false;
  }
  js << "\n  ]";
  return js.str();
}

// One shared get and its release (the engine's half of a data-plane get),
// with the lease table empty (the baseline) and with `idle` leases that
// another holder keeps open: what a client pays for others' holds.
std::string Holds() {
  std::ostringstream js;
  js << "[";
  bool first = true;
  for (uint64_t idle : {uint64_t{10'000}, uint64_t{100'000}}) {
    PlacementEngineOptions o;
    o.maintenance_interval_ms = 0;
    o.max_holds_per_holder = idle + 1;
    o.max_held_keys_per_holder = idle + 1;
    EngineTiers tiers;
    tiers.dram = DramTier::Open({.capacity_bytes = 64 << 20, .populate = true}).value();
    auto e = PlacementEngine::Create(o, std::move(tiers)).value();
    const auto chunk = Chunk(2, 2, 64, 16, 1);
    if (!e->Put(Key(0), chunk).ok() || !e->Put(Key(1), chunk).ok()) std::abort();
    GetOptions reader;
    reader.holder = Holder{1, 0};
    auto round_trips_us = [&](int n) {
      const double t0 = Now();
      for (int i = 0; i < n; ++i) {
        auto r = e->GetShared(Key(0), 0, reader);
        if (!r.ok() || !e->Release(r->lease_id, reader.holder.id).ok()) std::abort();
      }
      return (Now() - t0) / n * 1e6;
    };
    const int n = 20000;
    (void)round_trips_us(n / 10);  // warm
    const double empty_us = round_trips_us(n);
    const Hash128 other = Key(1);
    for (uint64_t i = 0; i < idle; ++i) {
      if (!e->Pin(std::span<const Hash128>(&other, 1), 600000, true, Holder{2, 0}).ok()) std::abort();
    }
    const double held_us = round_trips_us(n);
    js << (first ? "" : ",") << "\n    {\"idle_leases\": " << idle
       << ", \"get_release_us_empty_table\": " << empty_us
       << ", \"get_release_us\": " << held_us << ", \"ratio_vs_empty_table\": " << held_us / empty_us
       << "}";
    first = false;
  }
  js << "\n  ]";
  return js.str();
}

// Median latency in microseconds of a small durable write on `dir`: a 4 KiB
// pwrite + fdatasync, what an index commit costs the device (RocksDB's WAL
// write is one), beyond what a raw data write pays.
double SmallSyncLatencyUs(const std::string& dir) {
  std::string path = dir + "/sync-probe";
  int fd = open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) return -1;
  std::vector<char> page(4096, 1);
  std::vector<double> us;
  for (int i = 0; i < 21; ++i) {
    double t0 = Now();
    if (pwrite(fd, page.data(), page.size(), 0) != 4096 || fdatasync(fd) != 0) break;
    us.push_back((Now() - t0) * 1e6);
  }
  close(fd);
  unlink(path.c_str());
  if (us.empty()) return -1;
  std::sort(us.begin(), us.end());
  return us[us.size() / 2];
}

// Runs fn(t) on `threads` threads and returns the wall time.
template <typename F>
double Timed(int threads, F fn) {
  double t0 = Now();
  std::vector<std::thread> ts;
  for (int t = 0; t < threads; ++t) ts.emplace_back([&, t] { fn(t); });
  for (auto& t : ts) t.join();
  return Now() - t0;
}

// The NVMe benchmarks' device settings (the tier's defaults) and chunk.
constexpr uint32_t kNvmeQueueDepth = 32;
constexpr uint64_t kNvmeRequestBytes = 1 << 20;
std::vector<uint8_t> NvmeChunk() { return Chunk(8, 8, 128, 256, 7); }  // 6 MiB
uint64_t Blocks(uint64_t bytes) { return (bytes + 4095) / 4096 * 4096; }

std::string Nvme(const std::string& base) {
  std::string dir = base + "/kvtier-bench-nvme";
  std::string raw_dir = base + "/kvtier-bench-raw";
  std::filesystem::remove_all(dir);
  std::filesystem::remove_all(raw_dir);
  std::filesystem::create_directories(raw_dir);
  const uint32_t qd = kNvmeQueueDepth;
  const uint64_t io = kNvmeRequestBytes;
  const std::vector<uint8_t> chunk = NvmeChunk();
  const uint64_t alloc = Blocks(chunk.size());
  const uint64_t n = 16;    // chunks per measurement
  const int writers = 4;    // concurrent putters in the "concurrent" runs
  const int reps = 9;
  const uint64_t cap = (n + 2) * alloc;
  EngineTiers tiers;
  tiers.nvme = NvmeTier::Open({.dir = dir, .capacity_bytes = cap, .max_io_bytes = io, .queue_depth = qd}).value();
  auto e = PlacementEngine::Create({.maintenance_interval_ms = 0}, std::move(tiers)).value();
  auto env = NewUringIoEnv({.queue_depth = qd});
  auto dev = env->OpenDevice(raw_dir + "/raw.bin", cap).value();
  // Sources: the caller's (unaligned) vector, and a page-aligned copy, as
  // chunks arrive from DRAM-pool slots and demotions in the daemon.
  AlignedBuffer asrc(alloc, 4096), dst(alloc, 4096), rdst(alloc, 4096);
  std::memcpy(asrc.data(), chunk.data(), chunk.size());
  std::memset(asrc.data() + chunk.size(), 0, alloc - chunk.size());
  std::span<const uint8_t> aligned(asrc.data(), chunk.size());
  auto raw_reqs = [&](IoRequest::Op op, uint8_t* buf, uint64_t off) {
    std::vector<IoRequest> r;
    bench::AppendRawRequests(op, buf, off, alloc, io, &r);
    return r;
  };
  // Engine puts to the NVMe tier. Non-durable: acknowledged once the data is
  // written, the index committed in the background; the timing includes a
  // final Flush, so every put is durable when the clock stops. Durable:
  // each put waits for its commit (data fdatasync, then index).
  auto engine_put = [&](int threads, std::span<const uint8_t> src, bool durable) {
    return Timed(threads, [&](int t) {
      for (uint64_t i = t; i < n; i += threads) {
        absl::Status st = e->Put(Key(i), src, {.tier = TierKind::kNvme, .durable = durable});
        if (!st.ok()) { fprintf(stderr, "%s\n", st.ToString().c_str()); std::abort(); }
      }
      if (!durable && t == 0 && !e->nvme()->Flush().ok()) std::abort();
    });
  };
  auto engine_clear = [&] {
    for (uint64_t i = 0; i < n; ++i) {
      if (!e->Delete(Key(i)).ok()) std::abort();
    }
  };
  // Raw baseline: the same bytes, request size and queue depth on the same
  // filesystem; with `sync`, each chunk made durable (fdatasync) before the
  // writer's next one, like a durable put.
  auto raw_put = [&](int threads, bool sync) {
    return Timed(threads, [&](int t) {
      for (uint64_t i = t; i < n; i += threads) {
        if (!dev->Submit(raw_reqs(IoRequest::Op::kWrite, asrc.data(), i * alloc)).ok()) std::abort();
        if (sync && !dev->Sync().ok()) std::abort();
      }
    });
  };
  // Each rep runs every engine measurement next to its raw baseline, in
  // alternating order, so that the (noisy, shared) disk's state drifts
  // alike for both; ratios are per-rep medians, GB/s are over all reps.
  struct Series {
    double eng_s = 0, raw_s = 0;
    std::vector<double> ratios;
    void Add(double eng, double raw) {
      eng_s += eng;
      raw_s += raw;
      ratios.push_back(raw / eng);
    }
    double Median() {
      std::sort(ratios.begin(), ratios.end());
      return ratios[ratios.size() / 2];
    }
  };
  const double sync_us_before = SmallSyncLatencyUs(raw_dir);
  Series put, uput, dput, cput, get, iget;
  auto engine_get = [&] {
    double t0 = Now();
    for (uint64_t i = 0; i < n; ++i) {
      if (!e->Get(Key(i), {dst.data(), chunk.size()}, {.promote = false}).ok()) std::abort();
    }
    return Now() - t0;
  };
  auto raw_get = [&] {
    double t0 = Now();
    for (uint64_t i = 0; i < n; ++i) {
      if (!dev->Submit(raw_reqs(IoRequest::Op::kRead, rdst.data(), i * alloc)).ok()) std::abort();
    }
    return Now() - t0;
  };
  // Gets and raw reads of the very extents the gets read (a second O_DIRECT
  // handle on the tier's data file), alternating chunk by chunk (which goes
  // first alternating too), so that neither where the host put the two
  // files nor the disk's drift within a rep (both large on a shared VM)
  // favours one side.
  auto same_file = env->OpenDevice(dir + "/data.kvt", cap).value();
  auto interleaved_get = [&](int r) {
    double eng = 0, raw = 0;
    for (uint64_t i = 0; i < n; ++i) {
      const uint64_t off = e->nvme()->OffsetOf({Key(i), Part::kWhole}).value();
      for (int k = 0; k < 2; ++k) {
        const bool do_raw = (k == 0) == ((i + r) % 2 == 0);
        double t0 = Now();
        if (do_raw) {
          if (!same_file->Submit(raw_reqs(IoRequest::Op::kRead, rdst.data(), off)).ok()) std::abort();
          raw += Now() - t0;
        } else {
          if (!e->Get(Key(i), {dst.data(), chunk.size()}, {.promote = false}).ok()) std::abort();
          eng += Now() - t0;
        }
      }
    }
    iget.Add(eng, raw);
  };
  for (int r = 0; r < reps; ++r) {
    const bool raw_first = r % 2 == 0;
    double eng, raw;
    auto pair = [&](auto eng_fn, auto raw_fn) {
      if (raw_first) raw = raw_fn();
      eng = eng_fn();
      if (!raw_first) raw = raw_fn();
    };
    pair([&] { return engine_put(1, aligned, false); }, [&] { return raw_put(1, false); });
    put.Add(eng, raw);
    pair(engine_get, raw_get);
    get.Add(eng, raw);
    interleaved_get(r);
    engine_clear();
    pair([&] { return engine_put(1, chunk, false); }, [&] { return raw_put(1, false); });
    uput.Add(eng, raw);
    engine_clear();
    pair([&] { return engine_put(1, aligned, true); }, [&] { return raw_put(1, true); });
    dput.Add(eng, raw);
    engine_clear();
    pair([&] { return engine_put(writers, aligned, true); }, [&] { return raw_put(writers, true); });
    cput.Add(eng, raw);
    engine_clear();
  }
  const double sync_us_after = SmallSyncLatencyUs(raw_dir);
  same_file.reset();
  e.reset();
  dev.reset();
  std::filesystem::remove_all(dir);
  std::filesystem::remove_all(raw_dir);
  const double gb = double(n) * chunk.size() * reps / 1e9;
  std::ostringstream js;
  js << "{\"dir\": \"" << base << "\", \"chunk_bytes\": " << chunk.size() << ", \"chunks\": " << n
     << ", \"reps\": " << reps << ", \"queue_depth\": " << qd << ", \"request_bytes\": " << io
     << ", \"raw_requests_per_chunk\": " << (alloc + io - 1) / io
     << ",\n    \"small_write_fdatasync_us_before\": " << sync_us_before
     << ", \"small_write_fdatasync_us_after\": " << sync_us_after
     << ",\n    \"put_gbps\": " << gb / put.eng_s << ", \"raw_write_gbps\": " << gb / put.raw_s
     << ", \"put_ratio\": " << put.Median()
     << ",\n    \"put_unaligned_src_gbps\": " << gb / uput.eng_s
     << ", \"raw_write_gbps_2\": " << gb / uput.raw_s
     << ", \"put_unaligned_src_ratio\": " << uput.Median()
     << ",\n    \"durable_put_gbps\": " << gb / dput.eng_s
     << ", \"raw_write_sync_gbps\": " << gb / dput.raw_s
     << ", \"durable_put_ratio\": " << dput.Median()
     << ",\n    \"writers\": " << writers << ", \"durable_put_concurrent_gbps\": " << gb / cput.eng_s
     << ", \"raw_write_sync_concurrent_gbps\": " << gb / cput.raw_s
     << ", \"durable_put_concurrent_ratio\": " << cput.Median()
     << ",\n    \"get_gbps\": " << gb / get.eng_s << ", \"raw_read_gbps\": " << gb / get.raw_s
     << ", \"get_ratio\": " << get.Median()
     << ",\n    \"get_interleaved_gbps\": " << gb / iget.eng_s
     << ", \"raw_read_same_extents_gbps\": " << gb / iget.raw_s
     << ", \"get_interleaved_ratio\": " << iget.Median() << "}";
  return js.str();
}

std::string NvmeBatch(const std::string& base) {
  const std::string dir = base + "/kvtier-bench-nvme-batch";
  std::filesystem::remove_all(dir);
  const std::vector<uint8_t> chunk = NvmeChunk();
  const int n = 16;  // chunks per batch
  const int reps = 9;
  const uint64_t alloc = Blocks(chunk.size());
  EngineTiers tiers;
  // Scratch slots, the raw reads' slots and the promoted copies.
  tiers.dram = DramTier::Open({.capacity_bytes = 4 * n * alloc}).value();
  while (tiers.dram->ready_bytes() < tiers.dram->capacity_bytes()) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  tiers.nvme = NvmeTier::Open({.dir = dir, .capacity_bytes = (n + 2) * alloc, .max_io_bytes = kNvmeRequestBytes,
                               .queue_depth = kNvmeQueueDepth}).value();
  auto e = PlacementEngine::Create({.maintenance_interval_ms = 0}, std::move(tiers)).value();
  std::vector<Hash128> keys;
  for (int i = 0; i < n; ++i) keys.push_back(Key(i));
  auto to_nvme = [&] {
    for (const Hash128& k : keys) {
      (void)e->Delete(k);
      if (!e->Put(k, chunk, {.tier = TierKind::kNvme}).ok()) std::abort();
    }
  };
  auto env = NewUringIoEnv({.queue_depth = kNvmeQueueDepth});
  auto same_file = env->OpenDevice(dir + "/data.kvt", e->nvme()->capacity_bytes()).value();
  std::vector<Slot> raw_slots;
  for (int i = 0; i < n; ++i) raw_slots.push_back(e->AllocateSlot(alloc, 600000).value());
  auto raw_get = [&] {
    std::vector<IoRequest> rq;
    for (int i = 0; i < n; ++i) {
      const uint64_t off = e->nvme()->OffsetOf({keys[i], Part::kWhole}).value();
      bench::AppendRawRequests(IoRequest::Op::kRead, e->dram()->base() + raw_slots[i].extent.offset,
                               off, alloc, kNvmeRequestBytes, &rq);
    }
    double t0 = Now();
    if (!same_file->Submit(rq).ok()) std::abort();
    return Now() - t0;
  };
  auto engine_get = [&](bool promote) {
    double t0 = Now();
    auto got = e->GetSharedBatch(keys, 0, {.promote = promote});
    const double t = Now() - t0;
    for (const auto& r : got) {
      if (!r.ok() || r->tier != TierKind::kNvme || !r->verified) std::abort();
      if (!e->AbortSlot(r->slot_id).ok()) std::abort();
    }
    return t;
  };
  struct Series {
    double eng_s = 0, raw_s = 0;
    std::vector<double> ratios;
  } plain, promoted;
  to_nvme();
  (void)engine_get(false);  // warm-up: the first touch of the scratch slots' pages
  for (int r = 0; r < reps; ++r) {
    for (Series* se : {&plain, &promoted}) {
      const bool promote = se == &promoted;
      if (promote || r > 0) to_nvme();  // a promoted rep left them in DRAM
      if (!e->nvme()->Flush().ok()) std::abort();
      double eng, raw;
      if (r % 2 == 0) {
        raw = raw_get();
        eng = engine_get(promote);
      } else {
        eng = engine_get(promote);
        raw = raw_get();
      }
      se->eng_s += eng;
      se->raw_s += raw;
      se->ratios.push_back(raw / eng);
      // The promotions (on the engine's background thread) end before the
      // next measurement.
      const uint64_t want = uint64_t(r + 1) * n;
      for (int w = 0; promote && w < 5000 && e->metric(EngineMetric::kPromotions) < want; ++w) {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
    }
  }
  const uint64_t promotions = e->metric(EngineMetric::kPromotions);
  for (const Slot& sl : raw_slots) (void)e->AbortSlot(sl.id);
  same_file.reset();
  e.reset();
  std::filesystem::remove_all(dir);
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  auto list = [](const std::vector<double>& v) {
    std::ostringstream o;
    for (size_t i = 0; i < v.size(); ++i) o << (i ? ", " : "") << v[i];
    return o.str();
  };
  const double gb = double(n) * chunk.size() * reps / 1e9;
  std::ostringstream js;
  js << "{\"chunk_bytes\": " << chunk.size() << ", \"chunks_per_batch\": " << n
     << ", \"reps\": " << reps << ", \"queue_depth\": " << kNvmeQueueDepth << ", \"request_bytes\": " << kNvmeRequestBytes
     << ",\n    \"batch_get_gbps\": " << gb / plain.eng_s
     << ", \"raw_read_into_pool_gbps\": " << gb / plain.raw_s
     << ", \"batch_get_ratio\": " << median(plain.ratios)
     << ", \"batch_get_ratios\": [" << list(plain.ratios) << "]"
     << ",\n    \"batch_get_promote_gbps\": " << gb / promoted.eng_s
     << ", \"raw_read_into_pool_gbps_2\": " << gb / promoted.raw_s
     << ", \"batch_get_promote_ratio\": " << median(promoted.ratios)
     << ", \"batch_get_promote_ratios\": [" << list(promoted.ratios) << "]"
     << ", \"promotions\": " << promotions << "}";
  return js.str();
}

// Multi-turn chat over shared documents: each conversation picks a document
// by Zipf(1.0) over 200 documents; each turn reads the document's chunks and
// the conversation's history, then appends 1-2 chunks to the history.
struct TraceResult {
  uint64_t gets, hits_dram, hits_nvme, evictions, demotions, admission_rejects;
};

// Trace knobs (command-line flags, for experiments; defaults = the engine's).
struct TraceKnobs {
  PlacementEngineOptions engine;
  double dram_fraction = 0.1, nvme_fraction = 0.5;
  uint64_t trace_seed = 20240601;
  std::vector<EvictionPolicyKind> kinds = {EvictionPolicyKind::kLru, EvictionPolicyKind::kS3Fifo,
                                           EvictionPolicyKind::kArc, EvictionPolicyKind::kFreqLru};
};
TraceKnobs g_knobs;

std::vector<std::pair<uint64_t, bool>> MakeTrace(uint64_t* working_set) {
  std::mt19937_64 rng(g_knobs.trace_seed);
  const int docs = 200;
  std::vector<double> cdf(docs);
  double z = 0;
  for (int d = 0; d < docs; ++d) cdf[d] = (z += 1.0 / (d + 1));
  std::vector<int> doc_len(docs);
  for (int d = 0; d < docs; ++d) doc_len[d] = 4 + rng() % 12;
  struct Conv { int doc; uint64_t id; int hist; int turns_left; };
  std::vector<Conv> active;
  uint64_t next_conv = 0;
  std::vector<std::pair<uint64_t, bool>> trace;  // key id, is-new (append)
  std::uniform_real_distribution<double> u(0, z);
  for (int step = 0; step < 4000; ++step) {
    while (active.size() < 24) {
      int d = std::lower_bound(cdf.begin(), cdf.end(), u(rng)) - cdf.begin();
      active.push_back({d, next_conv++, 0, 2 + int(rng() % 10)});
    }
    size_t ci = rng() % active.size();
    Conv& c = active[ci];
    for (int k = 0; k < doc_len[c.doc]; ++k) trace.push_back({(uint64_t(c.doc) << 40) | k, false});
    for (int k = 0; k < c.hist; ++k) trace.push_back({(1ull << 62) | (c.id << 16) | k, false});
    int add = 1 + rng() % 2;
    for (int k = 0; k < add; ++k) trace.push_back({(1ull << 62) | (c.id << 16) | (c.hist + k), true});
    c.hist += add;
    if (--c.turns_left == 0) active.erase(active.begin() + ci);
  }
  std::vector<uint64_t> ids;
  for (auto& [k, n] : trace) ids.push_back(k);
  std::sort(ids.begin(), ids.end());
  *working_set = std::unique(ids.begin(), ids.end()) - ids.begin();
  return trace;
}

TraceResult RunTrace(EvictionPolicyKind kind, const std::vector<std::pair<uint64_t, bool>>& trace,
                     uint64_t ws, const std::vector<uint8_t>& chunk, const std::string& index_dir) {
  const uint64_t alloc = (chunk.size() + 4095) / 4096 * 4096;
  MemIoEnv mem;
  std::filesystem::remove_all(index_dir);
  EngineTiers tiers;
  tiers.dram = DramTier::Open({.capacity_bytes = uint64_t(ws * g_knobs.dram_fraction) * alloc, .populate = false}).value();
  tiers.nvme = NvmeTier::Open({.dir = index_dir, .capacity_bytes = uint64_t(ws * g_knobs.nvme_fraction) * alloc, .env = &mem}).value();
  PlacementEngineOptions eo = g_knobs.engine;
  eo.eviction = {.all = kind};
  eo.maintenance_interval_ms = 0;
  auto e = PlacementEngine::Create(eo, std::move(tiers)).value();
  std::vector<uint8_t> out(chunk.size());
  for (auto& [id, is_new] : trace) {
    Hash128 k = Key(id);
    if (is_new || !e->Get(k, out).ok()) (void)e->Put(k, chunk);
  }
  TraceResult r{e->metric(EngineMetric::kGets),      e->metric(EngineMetric::kHitsDram),
                e->metric(EngineMetric::kHitsNvme),  e->metric(EngineMetric::kEvictions),
                e->metric(EngineMetric::kDemotions), e->metric(EngineMetric::kAdmissionRejects)};
  e.reset();
  std::filesystem::remove_all(index_dir);
  return r;
}

std::string Trace() {
  uint64_t ws = 0;
  auto trace = MakeTrace(&ws);
  auto chunk = Chunk(2, 2, 64, 16, 3);
  std::ostringstream js;
  const PlacementEngineOptions& o = g_knobs.engine;
  js << "{\"requests\": " << trace.size() << ", \"working_set_chunks\": " << ws
     << ", \"dram_fraction\": " << g_knobs.dram_fraction
     << ", \"nvme_fraction\": " << g_knobs.nvme_fraction << ", \"nvme_admit_after_uses\": "
     << o.nvme_admit_after_uses << ", \"admission_history\": " << o.admission_history
     << ", \"s3fifo_small_fraction\": " << o.eviction_options.s3fifo_small_fraction
     << ", \"default_policy\": \"" << EvictionPolicySpecName(PlacementEngineOptions{}.eviction) << "\"";
  for (auto kind : g_knobs.kinds) {
    TraceResult r = RunTrace(kind, trace, ws, chunk, "/dev/shm/kvtier-bench-trace-index");
    js << ",\n    \"" << EvictionPolicyName(kind) << "\": {\"gets\": " << r.gets
       << ", \"dram_hit_ratio\": " << double(r.hits_dram) / r.gets
       << ", \"total_hit_ratio\": " << double(r.hits_dram + r.hits_nvme) / r.gets
       << ", \"hits_dram\": " << r.hits_dram << ", \"hits_nvme\": " << r.hits_nvme
       << ", \"misses\": " << r.gets - r.hits_dram - r.hits_nvme << ", \"evictions\": " << r.evictions
       << ", \"demotions\": " << r.demotions << ", \"admission_rejects\": " << r.admission_rejects
       << "}";
  }
  // The same trace generator with other seeds: is the winner robust?
  js << ",\n    \"other_seeds\": [";
  const uint64_t main_seed = g_knobs.trace_seed;
  for (uint64_t seed = 1; seed <= 4; ++seed) {
    g_knobs.trace_seed = seed;
    uint64_t sws = 0;
    auto st = MakeTrace(&sws);
    js << (seed == 1 ? "" : ",") << "\n      {\"seed\": " << seed;
    for (auto kind : g_knobs.kinds) {
      TraceResult r = RunTrace(kind, st, sws, chunk, "/dev/shm/kvtier-bench-trace-index");
      js << ", \"" << EvictionPolicyName(kind) << "\": [" << double(r.hits_dram) / r.gets << ", "
         << double(r.hits_dram + r.hits_nvme) / r.gets << "]";
    }
    js << "}";
  }
  g_knobs.trace_seed = main_seed;
  js << "]}";
  return js.str();
}

}  // namespace
}  // namespace kvtier::tiering

int main(int argc, char** argv) {
  using kvtier::tiering::g_knobs;
  std::string dir = "/tmp", json, only;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string a = argv[i], v = argv[i + 1];
    if (a == "--dir") dir = v;
    if (a == "--json") json = v;
    if (a == "--only") only = v;  // dram, nvme, nvme-batch, trace or holds
    if (a == "--s3fifo-small") g_knobs.engine.eviction_options.s3fifo_small_fraction = std::stod(v);
    if (a == "--admission-history") g_knobs.engine.admission_history = std::stoul(v);
    if (a == "--trace-seed") g_knobs.trace_seed = std::stoull(v);
    if (a == "--dram-fraction") g_knobs.dram_fraction = std::stod(v);
    if (a == "--nvme-fraction") g_knobs.nvme_fraction = std::stod(v);
    if (a == "--admit-after") g_knobs.engine.nvme_admit_after_uses = std::stoul(v);
  }
  char host[256] = {};
  gethostname(host, sizeof(host) - 1);
  std::ostringstream out;
  out << "{\n  \"bench\": \"tiering\",\n  \"host\": \"" << host << "\",\n  \"cpus\": "
      << sysconf(_SC_NPROCESSORS_ONLN);
  if (only.empty() || only == "dram") out << ",\n  \"dram\": " << kvtier::tiering::Dram();
  if (only.empty() || only == "nvme") out << ",\n  \"nvme\": " << kvtier::tiering::Nvme(dir);
  if (only.empty() || only == "nvme-batch") {
    out << ",\n  \"nvme_batch\": " << kvtier::tiering::NvmeBatch(dir);
  }
  if (only.empty() || only == "trace") out << ",\n  \"trace\": " << kvtier::tiering::Trace();
  if (only.empty() || only == "holds") out << ",\n  \"holds\": " << kvtier::tiering::Holds();
  out << "\n}\n";
  std::fputs(out.str().c_str(), stdout);
  if (!json.empty()) std::ofstream(json) << out.str();
  return 0;
}
