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
//  3. The control plane (RunCtl): the lookup of 8 keys over the data plane
//     (1 client p50/p99; keys/s with 16 clients) against a raw Unix-socket
//     ping-pong of the same frame sizes, blocking and spinning, measured in
//     the same run; a batched get of 8 chunks from DRAM against memcpy of
//     the same bytes, and from NVMe against raw io_uring O_DIRECT reads of
//     the same extents, request size and queue depth; the time to load a
//     prefix from NVMe (in batches of 8 chunks) with and without a prefetch
//     issued 10/50/200 ms ahead; --prefetch-chunks 128 is a 32K-token prefix.
//
// Usage: server_bench [--json FILE] [--reps N] [--seconds S] [--check-thread 0|1]
//                     [--put-check-threads 0|1|2] [--ctl-only]
//                     [--prefetch-chunks N] [--dram-huge-pages]
// --dram-huge-pages backs the daemon's DRAM pool with huge pages
// (DaemonOptions::dram_huge_pages; reserve them first: vm.nr_hugepages).
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <sys/socket.h>
#include <unistd.h>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "bench/bench_util.h"
#include "bench/llama_chunk.h"
#include "bench/raw_io.h"
#include "client/kvtier_client.h"
#include "codec/chunk.h"
#include "codec/codec.h"
#include "codec/test_util.h"
#include "wire/chunk_check.h"
#include "server/daemon.h"
#include "server/shm_channel.h"
#include "tiering/io.h"
#include "tiering/placement_engine.h"

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


// A raw Unix-socket round trip: `req` bytes one way, `rep` bytes back, with
// the peer a thread that echoes; `spin` polls (MSG_DONTWAIT) instead of
// blocking, as the data plane does. Microseconds per round trip.
std::vector<double> UdsPingPong(size_t req, size_t rep, bool spin, double seconds) {
  int sv[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM, 0, sv) != 0) std::abort();
  auto read_full = [spin](int fd, uint8_t* p, size_t n) {
    for (size_t got = 0; got < n;) {
      const ssize_t k = ::recv(fd, p + got, n - got, spin ? MSG_DONTWAIT : 0);
      if (k > 0) got += static_cast<size_t>(k);
      else if (k == 0) return false;
    }
    return true;
  };
  std::thread echo([&] {
    std::vector<uint8_t> b(std::max(req, rep));
    while (read_full(sv[1], b.data(), req)) {
      if (::send(sv[1], b.data(), rep, MSG_NOSIGNAL) != static_cast<ssize_t>(rep)) break;
    }
  });
  std::vector<uint8_t> b(std::max(req, rep));
  std::vector<double> lat;
  const auto end = Clock::now() + std::chrono::duration<double>(seconds);
  for (int i = 0; Clock::now() < end; ++i) {
    auto t0 = Clock::now();
    if (::send(sv[0], b.data(), req, MSG_NOSIGNAL) != static_cast<ssize_t>(req)) std::abort();
    if (!read_full(sv[0], b.data(), rep)) std::abort();
    if (i >= 100) lat.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
  }
  ::shutdown(sv[0], SHUT_RDWR);
  echo.join();
  ::close(sv[0]);
  ::close(sv[1]);
  return lat;
}

// The control-plane measurements (section 3 of the header), as JSON fields.
std::string RunCtl(server::Daemon* daemon, const std::vector<uint8_t>& chunk, int reps,
                   double seconds, int prefetch_chunks) {
  const std::string sock = daemon->socket_path();
  tiering::PlacementEngine* engine = daemon->engine();
  char buf[512];
  std::string json;
  auto field = [&](const char* name, double v) {
    std::snprintf(buf, sizeof(buf), ",\"%s\":%.3f", name, v);
    json += buf;
  };

  // Lookups over the data plane: 8 keys, 4 cached.
  std::vector<Hash128> keys;
  for (int i = 0; i < 8; ++i) keys.push_back(Hash128::Of("bench-ctl-lookup-" + std::to_string(i), 5));
  auto c = Connect(sock, true);
  const std::vector<uint8_t> small =
      codec::EncodeChunk(
          codec::testing::MakeSpec({2, 2, 64, 16, 16}, codec::DType::kBF16,
                                   {codec::DType::kBF16, codec::ScaleGranularity::kNone},
                                   {codec::DType::kFP8E4M3, codec::ScaleGranularity::kPerBlockHead}),
          codec::KvView{std::vector<uint16_t>(2 * 16 * 2 * 64, 0x3f80),
                        std::vector<uint16_t>(2 * 16 * 2 * 64, 0x3f80)})
          .value();
  for (int i = 0; i < 4; ++i) {
    if (!c->Put(keys[i], small).ok()) std::abort();
  }
  // Frame sizes of that lookup: header + 8 + 8 keys; header + 8 + 4 tiers.
  const size_t req = wire::shm::kRequestHeaderBytes + 8 + 8 * 16;
  const size_t rep = wire::shm::kResponseHeaderBytes + 8 + 4;
  const std::vector<double> uds = UdsPingPong(req, rep, false, seconds);
  const std::vector<double> uds_spin = UdsPingPong(req, rep, true, seconds);
  auto lookup_run = [&](int clients) {
    std::vector<std::vector<double>> lat(clients);
    std::vector<std::thread> ts;
    std::atomic<int> ready{0};
    std::atomic<bool> go{false};
    for (int i = 0; i < clients; ++i) {
      ts.emplace_back([&, i] {
        auto cl = Connect(sock, true);
        for (int k = 0; k < 100; ++k) (void)cl->Lookup(keys);
        ++ready;
        while (!go.load()) std::this_thread::yield();
        const auto end = Clock::now() + std::chrono::duration<double>(seconds);
        while (Clock::now() < end) {
          auto t0 = Clock::now();
          auto r = cl->Lookup(keys);
          if (!r.ok() || r->size() != 4) std::abort();
          lat[i].push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
        }
      });
    }
    while (ready.load() < clients) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    const auto t0 = Clock::now();
    go = true;
    for (auto& t : ts) t.join();
    const double s = std::chrono::duration<double>(Clock::now() - t0).count();
    std::vector<double> all;
    for (auto& v : lat) all.insert(all.end(), v.begin(), v.end());
    return std::make_pair(all, s);
  };
  auto [one, one_s] = lookup_run(1);
  auto [many, many_s] = lookup_run(16);
  // Lookup-and-hold: the plan and the hold of its chunks in one call (the
  // release, a second call, is not timed).
  std::vector<double> hold_lat;
  {
    const auto end = Clock::now() + std::chrono::duration<double>(seconds);
    for (int i = 0; Clock::now() < end; ++i) {
      auto t0 = Clock::now();
      auto h = c->LookupAndHold(keys);
      const double us = std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
      if (!h.ok() || h->plan.load_chunks != 4 || !c->ReleasePlan(*h).ok()) std::abort();
      if (i >= 100) hold_lat.push_back(us);
    }
  }
  std::printf("\ncontrol plane: lookup of 8 keys (4 cached) over the data plane\n");
  std::printf("  uds ping-pong (blocking) p50 %.1f us p99 %.1f us; spinning p50 %.1f us p99 %.1f us\n",
              Median(uds), Percentile(uds, 0.99), Median(uds_spin), Percentile(uds_spin, 0.99));
  std::printf("  lookup 1 client p50 %.1f us p99 %.1f us (%.2fx / %.2fx the blocking ping-pong)\n",
              Median(one), Percentile(one, 0.99), Median(one) / Median(uds),
              Percentile(one, 0.99) / Percentile(uds, 0.99));
  std::printf("  16 clients: %.0f lookups/s, %.0f keys/s\n", many.size() / many_s,
              8 * many.size() / many_s);
  std::printf("  lookup-and-hold, 1 client: p50 %.1f us p99 %.1f us\n", Median(hold_lat),
              Percentile(hold_lat, 0.99));
  field("uds_pingpong_p50_us", Median(uds));
  field("uds_pingpong_p99_us", Percentile(uds, 0.99));
  field("uds_spin_pingpong_p50_us", Median(uds_spin));
  field("uds_spin_pingpong_p99_us", Percentile(uds_spin, 0.99));
  field("lookup_p50_us_1_client", Median(one));
  field("lookup_p99_us_1_client", Percentile(one, 0.99));
  field("lookup_p50_vs_uds_pingpong", Median(one) / Median(uds));
  field("lookup_p99_vs_uds_pingpong", Percentile(one, 0.99) / Percentile(uds, 0.99));
  field("lookup_keys_per_s_16_clients", 8 * many.size() / many_s);
  field("lookup_and_hold_p50_us_1_client", Median(hold_lat));
  field("lookup_and_hold_p99_us_1_client", Percentile(hold_lat, 0.99));
  field("lookup_p50_us_16_clients", Median(many));
  field("lookup_p99_us_16_clients", Percentile(many, 0.99));

  // Batched gets of 8 chunks: from DRAM vs memcpy; from NVMe vs raw reads.
  constexpr int kBatch = 8;
  const size_t bytes = chunk.size();
  std::vector<Hash128> bkeys;
  for (int i = 0; i < kBatch; ++i) bkeys.push_back(Hash128::Of("bench-ctl-batch-" + std::to_string(i), 5));
  std::vector<std::vector<uint8_t>> dsts(kBatch, std::vector<uint8_t>(bytes, 1));
  std::vector<std::span<uint8_t>> outs(dsts.begin(), dsts.end());
  std::vector<std::span<const uint8_t>> srcs(kBatch, std::span<const uint8_t>(chunk));
  for (const absl::Status& st : c->PutBatch(bkeys, srcs)) {
    if (!st.ok()) std::abort();
  }
  std::vector<double> dram_ratio, dram_s, memcpy_s;
  for (int r = 0; r < reps; ++r) {
    auto t0 = Clock::now();
    for (int i = 0; i < kBatch; ++i) std::memcpy(dsts[i].data(), chunk.data(), bytes);
    const double m = std::chrono::duration<double>(Clock::now() - t0).count();
    t0 = Clock::now();
    for (const auto& g : c->GetBatchInto(bkeys, outs)) {
      if (!g.ok() || g->second != client::Tier::kDram) std::abort();
    }
    const double g = std::chrono::duration<double>(Clock::now() - t0).count();
    memcpy_s.push_back(m);
    dram_s.push_back(g);
    dram_ratio.push_back(m / g);
  }
  const double gb = kBatch * bytes / 1e9;
  std::printf("  batched DRAM get, %d x %.1f MiB: %.2f GB/s vs memcpy %.2f GB/s: %.3f\n", kBatch,
              bytes / 1048576.0, gb / Median(dram_s), gb / Median(memcpy_s), Median(dram_ratio));
  field("dram_batch_get_gbps", gb / Median(dram_s));
  field("dram_batch_memcpy_gbps", gb / Median(memcpy_s));
  field("dram_batch_get_vs_memcpy", Median(dram_ratio));

  tiering::NvmeTier* nvme = engine->nvme();
  auto to_nvme = [&](std::span<const Hash128> ks) {
    for (const Hash128& k : ks) {
      (void)engine->Delete(k);
      tiering::PutOptions po;
      po.tier = tiering::TierKind::kNvme;
      if (!engine->Put(k, chunk, po).ok()) std::abort();
    }
    if (!nvme->Flush().ok()) std::abort();
  };
  // The raw baseline: a second O_DIRECT io_uring handle on the tier's data
  // file reads the very extents, 1 MiB requests, queue depth 32, all in one
  // submission.
  auto env = tiering::NewUringIoEnv({});
  auto dev = env->OpenDevice(nvme->data_path(), nvme->capacity_bytes()).value();
  const uint64_t rounded = (bytes + 4095) / 4096 * 4096;
  tiering::AlignedBuffer raw_dst(kBatch * rounded, 4096);
  // The same reads into pool pages (a slot of the DRAM tier's shared
  // memory, where the daemon's batch reads land), to tell the device from
  // the destination: O_DIRECT into shared-memory pages can cost more than
  // into private ones.
  std::vector<tiering::Slot> pool_slots;
  for (int i = 0; i < kBatch; ++i) pool_slots.push_back(engine->AllocateSlot(rounded, 60000).value());
  std::vector<double> nvme_ratio, hold_ratio, hold_pool_ratio, nvme_s, raw_s, hold_s, raw_pool_s;
  std::vector<double> one_hold_ratio, one_hold_s, in_place_s, in_place_pool_ratio;
  for (int r = 0; r < reps; ++r) {
    to_nvme(bkeys);
    std::vector<tiering::IoRequest> rq_pool;
    for (int i = 0; i < kBatch; ++i) {
      const uint64_t off = nvme->OffsetOf({bkeys[i], tiering::Part::kWhole}).value();
      bench::AppendRawRequests(tiering::IoRequest::Op::kRead,
                               engine->dram()->base() + pool_slots[i].extent.offset, off, rounded,
                               uint64_t{1} << 20, &rq_pool);
    }
    auto tp = Clock::now();
    if (!dev->Submit(rq_pool).ok()) std::abort();
    const double raw_pool = std::chrono::duration<double>(Clock::now() - tp).count();
    std::vector<tiering::IoRequest> rq;
    for (int i = 0; i < kBatch; ++i) {
      const uint64_t off = nvme->OffsetOf({bkeys[i], tiering::Part::kWhole}).value();
      bench::AppendRawRequests(tiering::IoRequest::Op::kRead, raw_dst.data() + i * rounded, off,
                               rounded, uint64_t{1} << 20, &rq);
    }
    auto t0 = Clock::now();
    if (!dev->Submit(rq).ok()) std::abort();
    const double raw = std::chrono::duration<double>(Clock::now() - t0).count();
    t0 = Clock::now();
    for (const auto& g : c->GetBatchInto(bkeys, outs)) {
      if (!g.ok() || g->second != client::Tier::kNvme) std::abort();
    }
    const double got = std::chrono::duration<double>(Clock::now() - t0).count();
    to_nvme(bkeys);
    t0 = Clock::now();
    auto held = c->HoldBatch(bkeys).value();
    const double hold = std::chrono::duration<double>(Clock::now() - t0).count();
    std::vector<client::HeldChunk> hs;
    for (auto& h : held) hs.push_back(h.value());
    (void)c->UnholdBatch(hs);
    // The get as one hold of the whole batch, then every copy and check
    // (what GetBatchInto did before it went in groups): the same run's
    // baseline for the grouped get.
    to_nvme(bkeys);
    t0 = Clock::now();
    {
      auto all = c->HoldBatch(bkeys).value();
      std::vector<client::HeldChunk> ones;
      for (size_t i = 0; i < all.size(); ++i) {
        ones.push_back(all[i].value());
        if (!wire::CopyVerified(outs[i], ones.back().data).ok()) std::abort();
      }
      (void)c->UnholdBatch(ones);
    }
    const double one_hold = std::chrono::duration<double>(Clock::now() - t0).count();
    // What a GPU load does with the batch: hold it and check each chunk in
    // the pool, where the decode then reads it (no copy out of the pool).
    to_nvme(bkeys);
    t0 = Clock::now();
    {
      auto all = c->HoldBatch(bkeys).value();
      std::vector<client::HeldChunk> ones;
      for (auto& h : all) {
        ones.push_back(h.value());
        // The reader's check, unless the daemon's tier checked the bytes as
        // this hold read them (HeldChunk::checked), as a GPU load does.
        if (!ones.back().checked && !wire::VerifyChunkParallel(ones.back().data).ok()) {
          std::abort();
        }
      }
      (void)c->UnholdBatch(ones);
    }
    const double in_place = std::chrono::duration<double>(Clock::now() - t0).count();
    in_place_s.push_back(in_place);
    in_place_pool_ratio.push_back(raw_pool / in_place);
    one_hold_s.push_back(one_hold);
    one_hold_ratio.push_back(raw / one_hold);
    raw_s.push_back(raw);
    raw_pool_s.push_back(raw_pool);
    nvme_s.push_back(got);
    hold_s.push_back(hold);
    nvme_ratio.push_back(raw / got);
    hold_ratio.push_back(raw / hold);
    hold_pool_ratio.push_back(raw_pool / hold);
  }
  for (const tiering::Slot& sl : pool_slots) (void)engine->AbortSlot(sl.id);
  std::printf("  batched NVMe get, %d chunks: %.2f GB/s (hold only %.2f GB/s) vs raw io_uring "
              "O_DIRECT qd32 %.2f GB/s: %.3f (hold only %.3f)\n",
              kBatch, gb / Median(nvme_s), gb / Median(hold_s), gb / Median(raw_s),
              Median(nvme_ratio), Median(hold_ratio));
  std::printf("    raw reads into pool pages %.2f GB/s: hold only %.3f of them\n",
              gb / Median(raw_pool_s), Median(hold_pool_ratio));
  std::printf("    one hold of the batch, then every copy: %.2f GB/s: %.3f of raw io_uring\n",
              gb / Median(one_hold_s), Median(one_hold_ratio));
  std::printf("    hold and check in the pool (a GPU load's host side): %.2f GB/s: %.3f of raw "
              "reads into pool pages\n",
              gb / Median(in_place_s), Median(in_place_pool_ratio));
  field("nvme_batch_get_gbps", gb / Median(nvme_s));
  field("nvme_batch_hold_gbps", gb / Median(hold_s));
  field("nvme_raw_uring_gbps", gb / Median(raw_s));
  field("nvme_batch_get_vs_raw_uring", Median(nvme_ratio));
  field("nvme_batch_one_hold_get_gbps", gb / Median(one_hold_s));
  field("nvme_batch_one_hold_get_vs_raw_uring", Median(one_hold_ratio));
  field("nvme_batch_hold_vs_raw_uring", Median(hold_ratio));
  field("nvme_raw_uring_into_pool_gbps", gb / Median(raw_pool_s));
  field("nvme_batch_hold_vs_raw_uring_into_pool", Median(hold_pool_ratio));
  field("nvme_batch_hold_check_in_pool_gbps", gb / Median(in_place_s));
  field("nvme_batch_hold_check_in_pool_vs_raw_uring_into_pool", Median(in_place_pool_ratio));

  // Prefetch: load a prefix of `prefetch_chunks` chunks from NVMe with no
  // prefetch, and with one issued 10/50/200 ms before the load.
  for (const Hash128& k : bkeys) (void)engine->Delete(k);
  std::vector<Hash128> pkeys;
  for (int i = 0; i < prefetch_chunks; ++i) {
    pkeys.push_back(Hash128::Of("bench-ctl-prefix-" + std::to_string(i), 5));
  }
  std::vector<std::vector<uint8_t>> pdst(prefetch_chunks, std::vector<uint8_t>(bytes));
  std::vector<std::span<uint8_t>> pouts(pdst.begin(), pdst.end());
  std::snprintf(buf, sizeof(buf), ",\"prefetch_prefix_tokens\":%d", prefetch_chunks * 256);
  json += buf;
  std::printf("  load of a %d-token prefix (%d chunks) from NVMe:", prefetch_chunks * 256,
              prefetch_chunks);
  for (int lead : {-1, 10, 50, 200}) {
    std::vector<double> load_ms;
    for (int r = 0; r < std::max(1, reps / 3); ++r) {
      to_nvme(pkeys);
      if (lead >= 0) {
        if (!c->PrefetchWithin(pkeys, 0, 0).ok()) std::abort();
        std::this_thread::sleep_for(std::chrono::milliseconds(lead));
      }
      // The load: batches of kBatch chunks, one after the other.
      auto t0 = Clock::now();
      for (int at = 0; at < prefetch_chunks; at += kBatch) {
        const int n = std::min(kBatch, prefetch_chunks - at);
        for (const auto& g : c->GetBatchInto(std::span<const Hash128>(pkeys).subspan(at, n),
                                             std::span<const std::span<uint8_t>>(pouts).subspan(at, n))) {
          if (!g.ok()) std::abort();
        }
      }
      load_ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
    }
    std::printf(" %s %.1f ms;", lead < 0 ? "no prefetch" : (std::to_string(lead) + " ms ahead").c_str(),
                Median(load_ms));
    if (lead < 0) {
      field("prefix_load_ms_no_prefetch", Median(load_ms));
    } else {
      std::snprintf(buf, sizeof(buf), ",\"prefix_load_ms_prefetch_%dms_ahead\":%.3f", lead,
                    Median(load_ms));
      json += buf;
    }
  }
  std::printf("\n");
  for (const Hash128& k : pkeys) (void)engine->Delete(k);
  return json;
}
}  // namespace

int main(int argc, char** argv) {
  std::string json_path;
  int reps = 15;
  double seconds = 2.0;
  bool ctl_only = false;
  bool huge_pages = false;
  int prefetch_chunks = 32;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--json") && i + 1 < argc) json_path = argv[++i];
    else if (!std::strcmp(argv[i], "--reps") && i + 1 < argc) reps = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--seconds") && i + 1 < argc) seconds = std::atof(argv[++i]);
    else if (!std::strcmp(argv[i], "--check-thread") && i + 1 < argc) check_thread = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--put-check-threads") && i + 1 < argc) put_check_threads = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--ctl-only")) ctl_only = true;
    else if (!std::strcmp(argv[i], "--dram-huge-pages")) huge_pages = true;
    else if (!std::strcmp(argv[i], "--prefetch-chunks") && i + 1 < argc) prefetch_chunks = std::atoi(argv[++i]);
  }
  std::string dir = (std::filesystem::temp_directory_path() /
                     ("kvtier-server-bench-" + std::to_string(::getpid()))).string();
  server::DaemonOptions o;
  o.data_dir = dir;
  // Room for the prefix of the prefetch measurement (24 MiB chunks) and
  // more, in DRAM and on NVMe.
  const double prefix_gib = prefetch_chunks * 24.0 / 1024;
  o.dram_gib = std::max(2.0, 1.5 * prefix_gib + 0.5);
  o.nvme_gib = std::max(2.0, 1.5 * prefix_gib + 0.5);
  o.hbm_gib = 0;
  o.log_level = "off";
  o.put_check_threads = static_cast<uint32_t>(put_check_threads);
  o.dram_huge_pages = huge_pages;
  auto started = server::Daemon::Start(o);
  if (!started.ok()) {
    std::fprintf(stderr, "server_bench: %s\n", started.status().ToString().c_str());
    return 1;
  }
  auto daemon = *std::move(started);
  const std::string sock = daemon->socket_path();

  std::vector<uint8_t> chunk = bench::LlamaK16V8Chunk();
  const size_t bytes = chunk.size();

  std::printf("machine: %s\n", bench::CpuName().c_str());
  std::printf("chunk: Llama-3.1-8B, 256 tokens, K16/V8: %zu bytes (%.2f MiB)\n", bytes,
              bytes / 1048576.0);
  std::printf("DRAM pool: %s pages\n", huge_pages ? "huge" : "4 KiB");

  const std::string ctl_json = RunCtl(daemon.get(), chunk, reps, seconds, prefetch_chunks) +
                               ",\"dram_huge_pages\":" + (huge_pages ? "true" : "false");
  if (ctl_only) {
    std::string json = "{\"benchmark\":\"server-ctl\",\"machine\":\"" + bench::CpuName() +
                       "\",\"hardware_threads\":" +
                       std::to_string(std::thread::hardware_concurrency()) + ",\"chunk_bytes\":" +
                       std::to_string(bytes) + ",\"reps\":" + std::to_string(reps) + ctl_json + "}\n";
    if (!json_path.empty()) {
      FILE* f = std::fopen(json_path.c_str(), "w");
      if (f) {
        std::fputs(json.c_str(), f);
        std::fclose(f);
      }
    }
    (void)daemon->Shutdown();
    daemon.reset();
    std::error_code ec;
    std::filesystem::remove_all(dir, ec);
    return 0;
  }

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
  // The control-plane fields go inside the object.
  json.resize(json.size() - 2);
  json += ctl_json + "}\n";
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
