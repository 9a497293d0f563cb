// Gather+encode and decode+scatter throughput against the physical baselines
// measured in the same run on the same GPU:
//   device to device: kernel time vs cudaMemcpyAsync D2D of the same number
//     of bytes moved (bytes read + bytes written, a memcpy of N bytes moves 2N);
//   into pinned host memory: kernel time vs cudaMemcpyAsync D2H of the
//     encoded bytes into pinned memory;
//   from pinned host memory: decode+scatter of the chunk in mapped pinned
//     memory vs cudaMemcpyAsync H2D of the same encoded bytes, two ways: through
//     a HostStaging (a copy-engine copy into device memory, the decode from
//     there: the load path of GpuPagedIo::Load) and zero-copy (the kernel
//     reads host memory: the layer-wise load);
//   layer-wise load (Llama and Qwen k16v8): the load of a prefix of kRotate
//     chunks from mapped pinned memory, one DecodeScatter launch per chunk and
//     layer, interleaved with a stand-in compute kernel per layer on a second
//     stream vs the same launches serialized on one stream.
// Each ratio is the median over kTrials interleaved batches of (baseline
// time / kernel time) of the same batch, with its 10th-90th percentiles.
// Usage: kernel_codec_bench OUT.json [[--model=NAME] [--tokens=N] CODEC...]
//          (instead of the default list: CODECs of the Llama shape, or of the
//          model named by the --model= before them: llama3.1-8b, qwen2.5-7b;
//          chunks of the --tokens= before them, a multiple of 16, default 256)
//        kernel_codec_bench --check-division   (host only, no GPU: see CheckDivision)
#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "bench/kernel_bench_util.h"
#include "codec/chunk.h"
#include "codec/quant.h"
#include "kernels/gpu_test_util.h"
#include "kernels/paged_codec.h"

namespace kvtier::kernels {
namespace {

using codec::DType;

constexpr int kRotate = 8;   // distinct buffers, so repeats do not hit L2
constexpr uint32_t kBlockSize = 16;       // the cache's block size (vLLM's default)
constexpr uint32_t kDefaultTokens = 256;  // a chunk's tokens without --tokens=
constexpr int kIters = 50;   // launches per timed batch
constexpr int kTrials = 31;  // batches per function, interleaved across functions

// Times each fns[k](i) in batches of kIters calls, interleaved (batch t of
// every function, then batch t + 1, ...) so that clock or thermal drift hits
// all of them alike. Returns per function the time per call of every batch.
std::vector<std::vector<double>> TimeInterleaved(
    const std::vector<std::function<void(int)>>& fns, cudaStream_t stream = nullptr) {
  cudaEvent_t a, b;
  CHECK_CUDA(cudaEventCreate(&a));
  CHECK_CUDA(cudaEventCreate(&b));
  for (const auto& fn : fns)
    for (int i = 0; i < 2 * kRotate; ++i) fn(i);
  CHECK_CUDA(cudaDeviceSynchronize());
  std::vector<std::vector<double>> t(fns.size());
  for (int trial = 0; trial < kTrials; ++trial) {
    for (size_t k = 0; k < fns.size(); ++k) {
      CHECK_CUDA(cudaEventRecord(a, stream));
      for (int i = 0; i < kIters; ++i) fns[k](i);
      CHECK_CUDA(cudaEventRecord(b, stream));
      CHECK_CUDA(cudaEventSynchronize(b));
      float ms = 0;
      CHECK_CUDA(cudaEventElapsedTime(&ms, a, b));
      t[k].push_back(ms * 1e-3 / kIters);
    }
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return t;
}

double Quantile(std::vector<double> v, double q) {
  std::sort(v.begin(), v.end());
  return v[static_cast<size_t>(q * (v.size() - 1) + 0.5)];
}

// Baseline time over kernel time, batch by batch (same trial), summarized
// by the median and the 10th / 90th percentiles.
struct Ratio {
  double median, p10, p90;
};
Ratio PairedRatio(const std::vector<double>& baseline, const std::vector<double>& kernel) {
  std::vector<double> r;
  for (size_t i = 0; i < baseline.size(); ++i) r.push_back(baseline[i] / kernel[i]);
  return {Quantile(r, 0.5), Quantile(r, 0.1), Quantile(r, 0.9)};
}

// The stand-in for one layer's compute in LayerOverlap: `iters` dependent
// FMAs per thread in two CTAs per SM, no memory traffic, so the loads and the
// compute share only the SMs' issue slots and the launch queues.
__global__ void StandInCompute(uint32_t iters, float* out) {
  float a = static_cast<float>(threadIdx.x) * 1e-3f;
  for (uint32_t i = 0; i < iters; ++i) a = fmaf(a, 0.9999999f, 1e-3f);
  if (a == -1.0f) out[0] = a;  // never true: the loop's result is used
}

// The issue's layer-wise overlap: an engine loads layer l + 1 (one
// DecodeScatter of layer range [l + 1, l + 2) per chunk) from mapped pinned
// memory while it computes layer l. A prefix of kRotate chunks, every layer,
// four schedules timed kTrials times each, interleaved:
//   load only (every layer's launches on one stream), compute only (one
//   stand-in kernel per layer, calibrated to take about one layer's load),
//   serialized (load l then compute l, one stream) and overlapped (loads on
//   one stream, compute l on a second stream waiting for load l's event).
// `t_layer_chunk` is the measured time of one chunk's layer, which sizes the
// stand-in. Returns the JSON object.
std::string LayerOverlap(const codec::ChunkHeader& header, const PagedKvLayout& cache,
                         const std::function<BlockSpan(int)>& span,
                         const std::vector<uint8_t*>& chunks, double t_layer_chunk) {
  const uint32_t L = header.spec.geometry.num_layers;
  int sms = 0;
  CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  float* sink = nullptr;
  CHECK_CUDA(cudaMalloc(&sink, 4));
  cudaStream_t s_load, s_compute;
  CHECK_CUDA(cudaStreamCreateWithFlags(&s_load, cudaStreamNonBlocking));
  CHECK_CUDA(cudaStreamCreateWithFlags(&s_compute, cudaStreamNonBlocking));
  std::vector<cudaEvent_t> loaded(L);
  for (auto& e : loaded) CHECK_CUDA(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  cudaEvent_t a, b;
  CHECK_CUDA(cudaEventCreate(&a));
  CHECK_CUDA(cudaEventCreate(&b));
  // As GpuPagedIo::BeginLayerwiseLoad: every launch but a schedule's first
  // chained (PriorKernel::kLeavesChunk); `chained` false: none.
  auto load_layer = [&](uint32_t l, cudaStream_t s, bool chained = true) {
    for (int r = 0; r < kRotate; ++r) {
      const bool first = l == 0 && r == 0;
      CHECK_OK(DecodeScatter(header, chunks[r], cache, span(r), LayerRange{l, l + 1}, s,
                             chained && !first ? PriorKernel::kLeavesChunk
                                               : PriorKernel::kUnknown));
    }
  };
  uint32_t iters = 1 << 14;
  auto compute = [&](cudaStream_t s) {
    StandInCompute<<<2 * sms, 256, 0, s>>>(iters, sink);
    CHECK_CUDA(cudaGetLastError());
  };
  // Times fn (which enqueues on s_load and, for the overlap, s_compute, and
  // leaves s_compute joined into s_load) from an event on s_load.
  auto time = [&](const std::function<void()>& fn) {
    CHECK_CUDA(cudaEventRecord(a, s_load));
    fn();
    CHECK_CUDA(cudaEventRecord(b, s_load));
    CHECK_CUDA(cudaEventSynchronize(b));
    float ms = 0;
    CHECK_CUDA(cudaEventElapsedTime(&ms, a, b));
    return ms * 1e-3;
  };
  // Calibration: iters so that one stand-in takes kRotate chunks' layer load.
  const double t_layer = t_layer_chunk * kRotate;
  time([&] { compute(s_load); });
  const double t_probe = time([&] { compute(s_load); });
  iters = std::max<uint32_t>(1, static_cast<uint32_t>(iters * t_layer / t_probe));

  const std::vector<std::function<void()>> schedules = {
      [&] { for (uint32_t l = 0; l < L; ++l) load_layer(l, s_load); },
      [&] { for (uint32_t l = 0; l < L; ++l) compute(s_load); },
      [&] {
        for (uint32_t l = 0; l < L; ++l) {
          load_layer(l, s_load);
          compute(s_load);
        }
      },
      [&] {
        CHECK_CUDA(cudaEventRecord(loaded[0], s_load));
        CHECK_CUDA(cudaStreamWaitEvent(s_compute, loaded[0]));  // starts after `a`
        for (uint32_t l = 0; l < L; ++l) {
          load_layer(l, s_load);
          CHECK_CUDA(cudaEventRecord(loaded[l], s_load));
          CHECK_CUDA(cudaStreamWaitEvent(s_compute, loaded[l]));
          compute(s_compute);
        }
        CHECK_CUDA(cudaEventRecord(loaded[L - 1], s_compute));
        CHECK_CUDA(cudaStreamWaitEvent(s_load, loaded[L - 1]));
      },
      [&] { for (uint32_t l = 0; l < L; ++l) load_layer(l, s_load, /*chained=*/false); },
  };
  std::vector<std::vector<double>> t(schedules.size());
  for (const auto& fn : schedules) time(fn);  // warm-up
  for (int trial = 0; trial < kTrials; ++trial) {
    for (size_t k = 0; k < schedules.size(); ++k) t[k].push_back(time(schedules[k]));
  }
  const double t_load = Quantile(t[0], 0.5), t_compute = Quantile(t[1], 0.5);
  const double t_serial = Quantile(t[2], 0.5), t_overlap = Quantile(t[3], 0.5);
  const double t_unchained = Quantile(t[4], 0.5);
  const Ratio speedup = PairedRatio(t[2], t[3]), chaining = PairedRatio(t[4], t[0]);
  std::printf(
      "  layer-wise load of %d chunks x %u layers: load %.0f us (unchained %.0f us: chaining "
      "%.3f x), compute %.0f us, serialized %.0f us, overlapped %.0f us = %.2f x faster than "
      "serialized (bound %.2f)\n",
      kRotate, L, t_load * 1e6, t_unchained * 1e6, chaining.median, t_compute * 1e6,
      t_serial * 1e6, t_overlap * 1e6, speedup.median, t_serial / std::max(t_load, t_compute));
  for (auto& e : loaded) cudaEventDestroy(e);
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  cudaStreamDestroy(s_load);
  cudaStreamDestroy(s_compute);
  cudaFree(sink);
  return absl::StrCat(
      "{\"chunks\": ", kRotate, ", \"layers\": ", L, ", \"launches_per_layer\": ", kRotate,
      ", \"stand_in_compute\": \"dependent FMAs, 2 CTAs x 256 threads per SM\", "
      "\"stand_in_iters\": ", iters, ", \"t_load_s\": ", t_load,
      ", \"t_load_unchained_s\": ", t_unchained, ", \"unchained_vs_chained_load\": ",
      chaining.median, ", \"t_compute_s\": ", t_compute,
      ", \"t_serialized_s\": ", t_serial, ", \"t_overlapped_s\": ", t_overlap,
      ", \"overlapped_vs_serialized\": ", speedup.median, ", \"overlapped_vs_serialized_p10_p90\": [",
      speedup.p10, ", ", speedup.p90, "], \"bound_serialized_vs_max_load_compute\": ",
      t_serial / std::max(t_load, t_compute), "}");
}

struct Model {
  const char* name;
  uint32_t layers, heads, head_dim;
};

std::string RunModel(const Model& m, const char* codec_name, uint32_t T) {
  const uint32_t BS = kBlockSize, blocks_per_chunk = T / BS;
  const uint32_t num_blocks = blocks_per_chunk * kRotate + 5;
  auto layout = MakePagedKvLayout(CacheLayout::kVllmFlashAttnNHD, m.layers, num_blocks, BS,
                                  m.heads, m.head_dim, DType::kBF16, DType::kBF16);
  CHECK_OK(layout.status());
  testing::HostCache host;
  host.Init(CacheLayout::kVllmFlashAttnNHD, *layout);
  host.FillValues(testing::Fill::kNormal, 42);
  testing::DeviceCache dev;
  CHECK_CUDA(dev.Upload(host));

  auto fmt = codec::ParseCodec(codec_name, DType::kBF16);
  CHECK_OK(fmt.status());
  codec::ChunkSpec spec;
  spec.geometry = {m.layers, m.heads, m.head_dim, T, BS};
  spec.dtype = DType::kBF16;
  spec.k = fmt->k;
  spec.v = fmt->v;
  auto cl = codec::ValidateSpec(spec);
  CHECK_OK(cl.status());
  const size_t chunk_bytes = cl->total_bytes;
  const size_t kv16_bytes = size_t{2} * m.layers * T * m.heads * m.head_dim * 2;

  // kRotate disjoint, shuffled block lists.
  std::vector<int32_t> all = testing::ShuffledBlocks(num_blocks, blocks_per_chunk * kRotate, 9);
  int32_t* d_ids = nullptr;
  CHECK_CUDA(cudaMalloc(&d_ids, all.size() * 4));
  CHECK_CUDA(cudaMemcpy(d_ids, all.data(), all.size() * 4, cudaMemcpyHostToDevice));
  auto span = [&](int r) {
    return BlockSpan{d_ids + r * blocks_per_chunk, all.data() + r * blocks_per_chunk,
                     blocks_per_chunk, 0};
  };
  uint32_t* ws = nullptr;
  CHECK_CUDA(cudaMalloc(&ws, kGatherEncodeWorkspaceBytes));
  CHECK_CUDA(cudaMemset(ws, 0, kGatherEncodeWorkspaceBytes));
  std::vector<uint8_t*> d_chunks(kRotate), h_chunks(kRotate), hd_chunks(kRotate);
  for (int r = 0; r < kRotate; ++r) {
    CHECK_CUDA(cudaMalloc(&d_chunks[r], chunk_bytes));
    CHECK_CUDA(cudaHostAlloc(reinterpret_cast<void**>(&h_chunks[r]), chunk_bytes,
                             cudaHostAllocMapped));
    CHECK_CUDA(cudaHostGetDevicePointer(reinterpret_cast<void**>(&hd_chunks[r]), h_chunks[r], 0));
  }
  // Baseline buffers: memcpy of N = (read + write) / 2 bytes moves the same bytes.
  const size_t moved = kv16_bytes + chunk_bytes;
  const size_t n_equiv = moved / 2;
  std::vector<uint8_t*> src(kRotate), dst(kRotate);
  for (int r = 0; r < kRotate; ++r) {
    CHECK_CUDA(cudaMalloc(&src[r], n_equiv));
    CHECK_CUDA(cudaMalloc(&dst[r], n_equiv));
    CHECK_CUDA(cudaMemset(src[r], r + 1, n_equiv));
  }

  // The decode inputs: chunks encoded once, before timing.
  for (int r = 0; r < kRotate; ++r) {
    CHECK_OK(GatherEncode(spec, dev.layout, span(r), d_chunks[r], ws, nullptr));
  }
  CHECK_CUDA(cudaDeviceSynchronize());
  std::vector<uint8_t> first(chunk_bytes);
  CHECK_CUDA(cudaMemcpy(first.data(), d_chunks[0], chunk_bytes, cudaMemcpyDeviceToHost));
  CHECK_OK(codec::SealChunk(first));
  auto header = codec::VerifyChunk(first);
  CHECK_OK(header.status());
  // Device to device: encode, decode and the memcpy baseline, interleaved.
  // Encode writes into scratch chunks so the decode inputs stay intact.
  std::vector<uint8_t*> d_scratch(kRotate);
  for (int r = 0; r < kRotate; ++r) CHECK_CUDA(cudaMalloc(&d_scratch[r], chunk_bytes));
  const auto d2d = TimeInterleaved({
      [&](int i) {
        CHECK_OK(GatherEncode(spec, dev.layout, span(i % kRotate), d_scratch[i % kRotate], ws,
                              nullptr));
      },
      [&](int i) {
        CHECK_OK(DecodeScatter(*header, d_chunks[i % kRotate], dev.layout,
                               span((i + 3) % kRotate), nullptr));
      },
      [&](int i) {
        CHECK_CUDA(cudaMemcpyAsync(dst[i % kRotate], src[i % kRotate], n_equiv,
                                   cudaMemcpyDeviceToDevice));
      },
  });
  const auto pinned = TimeInterleaved({
      [&](int i) {
        CHECK_OK(GatherEncode(spec, dev.layout, span(i % kRotate), hd_chunks[i % kRotate], ws,
                              nullptr));
      },
      [&](int i) {
        CHECK_CUDA(cudaMemcpyAsync(h_chunks[i % kRotate], d_chunks[i % kRotate], chunk_bytes,
                                   cudaMemcpyDeviceToHost));
      },
  });
  // The load: decode+scatter from the mapped pinned chunks (the encoded bytes,
  // checksums 0: the kernel does not read them) vs a pinned H2D memcpy of them.
  for (int r = 0; r < kRotate; ++r) {
    CHECK_CUDA(cudaMemcpy(h_chunks[r], d_chunks[r], chunk_bytes, cudaMemcpyDeviceToHost));
  }
  auto staging = HostStaging::Create(chunk_bytes);
  CHECK_OK(staging.status());
  // On a stream of its own (programmatic dependent launches are for streams
  // an application creates).
  cudaStream_t ls;
  CHECK_CUDA(cudaStreamCreateWithFlags(&ls, cudaStreamNonBlocking));
  // Call i of a batch: the decode through `staging` (GpuPagedIo::Load's
  // path) or zero-copy; `chained`: each call after a batch's first told that
  // the kernel before it (the previous call's decode; the first call follows
  // other work) does not write its chunk, as a prefix load enqueues them.
  auto decode = [&](int i, bool staged, bool chained) {
    const PriorKernel prior =
        chained && i > 0 ? PriorKernel::kLeavesChunk : PriorKernel::kUnknown;
    const uint8_t* chunk = hd_chunks[i % kRotate];
    const BlockSpan to = span((i + 3) % kRotate);
    CHECK_OK(staged ? DecodeScatter(*header, chunk, dev.layout, to, LayerRange{}, **staging, ls,
                                    prior)
                    : DecodeScatter(*header, chunk, dev.layout, to, LayerRange{}, ls, prior));
  };
  const auto load = TimeInterleaved({
      [&](int i) { decode(i, /*staged=*/true, /*chained=*/false); },
      [&](int i) {
        CHECK_CUDA(cudaMemcpyAsync(d_scratch[i % kRotate], h_chunks[i % kRotate], chunk_bytes,
                                   cudaMemcpyHostToDevice, ls));
      },
      [&](int i) { decode(i, /*staged=*/false, /*chained=*/false); },
      [&](int i) { decode(i, /*staged=*/true, /*chained=*/true); },
      [&](int i) { decode(i, /*staged=*/false, /*chained=*/true); },
  }, ls);
  CHECK_CUDA(cudaDeviceSynchronize());
  CHECK_CUDA(cudaStreamDestroy(ls));
  staging->reset();
  for (int r = 0; r < kRotate; ++r) cudaFree(d_scratch[r]);
  const double t_load = Quantile(load[0], 0.5), t_h2d = Quantile(load[1], 0.5);
  const double t_zero_copy = Quantile(load[2], 0.5), t_chained = Quantile(load[3], 0.5);
  const double t_zc_chained = Quantile(load[4], 0.5);
  const Ratio ld = PairedRatio(load[1], load[0]), zc = PairedRatio(load[1], load[2]);
  const Ratio ch = PairedRatio(load[1], load[3]), zch = PairedRatio(load[1], load[4]);
  std::string overlap;
  if (std::strcmp(codec_name, "k16v8") == 0) {
    overlap = LayerOverlap(*header, dev.layout, span, hd_chunks, t_zero_copy / m.layers);
  }
  const double t_encode = Quantile(d2d[0], 0.5), t_decode = Quantile(d2d[1], 0.5);
  const double t_d2d = Quantile(d2d[2], 0.5);
  const double t_encode_pinned = Quantile(pinned[0], 0.5), t_d2h = Quantile(pinned[1], 0.5);
  const Ratio enc = PairedRatio(d2d[2], d2d[0]), dec = PairedRatio(d2d[2], d2d[1]);
  const Ratio pin = PairedRatio(pinned[1], pinned[0]);

  const double enc_ratio = enc.median, dec_ratio = dec.median, pin_ratio = pin.median;
  std::printf(
      "%-12s %-7s chunk %8zu B (fp16-equiv %8zu B) | D2D memcpy %6.1f GB/s moved | encode %6.1f "
      "GB/s moved = %.3f x memcpy | decode %6.1f GB/s = %.3f x | pinned D2H memcpy %5.1f GB/s, "
      "encode->pinned %5.1f GB/s = %.3f x (fp16-equivalent %5.1f GB/s)\n",
      m.name, codec_name, chunk_bytes, kv16_bytes, 2.0 * n_equiv / t_d2d / 1e9,
      moved / t_encode / 1e9, enc_ratio, moved / t_decode / 1e9, dec_ratio,
      chunk_bytes / t_d2h / 1e9, chunk_bytes / t_encode_pinned / 1e9, pin_ratio,
      kv16_bytes / t_encode_pinned / 1e9);
  std::printf(
      "%-12s %-7s load: pinned H2D memcpy %5.1f GB/s, decode+scatter from pinned (staged) "
      "%5.1f GB/s = %.3f x (fp16-equivalent %5.1f GB/s), zero-copy %5.1f GB/s = %.3f x, "
      "chained %5.1f GB/s = %.3f x, zero-copy chained %5.1f GB/s = %.3f x\n",
      m.name, codec_name, chunk_bytes / t_h2d / 1e9, chunk_bytes / t_load / 1e9, ld.median,
      kv16_bytes / t_load / 1e9, chunk_bytes / t_zero_copy / 1e9, zc.median,
      chunk_bytes / t_chained / 1e9, ch.median, chunk_bytes / t_zc_chained / 1e9, zch.median);

  for (int r = 0; r < kRotate; ++r) {
    cudaFree(d_chunks[r]);
    cudaFreeHost(h_chunks[r]);
    cudaFree(src[r]);
    cudaFree(dst[r]);
  }
  cudaFree(d_ids);
  cudaFree(ws);
  return absl::StrCat(
      "{\"model\": \"", m.name, "\", \"codec\": \"", codec_name, "\", \"layers\": ", m.layers,
      ", \"kv_heads\": ", m.heads, ", \"head_dim\": ", m.head_dim,
      ", \"chunk_tokens\": ", T, ", \"block_size\": ", kBlockSize,
      ", \"cache_layout\": \"vllm-flashattn-nhd\", \"dtype\": \"bf16\", \"chunk_bytes\": ",
      chunk_bytes, ", \"kv16_bytes\": ", kv16_bytes,
      ", \"bytes_moved_encode\": ", moved, ", \"t_d2d_memcpy_same_bytes_s\": ", t_d2d,
      ", \"t_gather_encode_d2d_s\": ", t_encode, ", \"t_decode_scatter_d2d_s\": ", t_decode,
      ", \"gather_encode_d2d_vs_memcpy\": ", enc_ratio,
      ", \"decode_scatter_d2d_vs_memcpy\": ", dec_ratio,
      ", \"t_pinned_d2h_memcpy_encoded_bytes_s\": ", t_d2h,
      ", \"t_gather_encode_to_pinned_s\": ", t_encode_pinned,
      ", \"gather_encode_pinned_vs_pinned_memcpy\": ", pin_ratio,
      ", \"fp16_equivalent_offload_gbps\": ", kv16_bytes / t_encode_pinned / 1e9,
      ", \"pinned_d2h_memcpy_gbps\": ", chunk_bytes / t_d2h / 1e9,
      ", \"t_pinned_h2d_memcpy_encoded_bytes_s\": ", t_h2d,
      ", \"t_decode_scatter_from_pinned_s\": ", t_load,
      ", \"decode_scatter_from_pinned_vs_pinned_h2d_memcpy\": ", ld.median,
      ", \"t_decode_scatter_zero_copy_from_pinned_s\": ", t_zero_copy,
      ", \"decode_scatter_zero_copy_from_pinned_vs_pinned_h2d_memcpy\": ", zc.median,
      ", \"t_decode_scatter_from_pinned_chained_s\": ", t_chained,
      ", \"decode_scatter_from_pinned_chained_vs_pinned_h2d_memcpy\": ", ch.median,
      ", \"t_decode_scatter_zero_copy_chained_s\": ", t_zc_chained,
      ", \"decode_scatter_zero_copy_chained_vs_pinned_h2d_memcpy\": ", zch.median,
      ", \"fp16_equivalent_load_gbps\": ", kv16_bytes / t_load / 1e9,
      ", \"pinned_h2d_memcpy_gbps\": ", chunk_bytes / t_h2d / 1e9,
      ", \"ratio_p10_p90\": {\"gather_encode_d2d\": [", enc.p10, ", ", enc.p90,
      "], \"decode_scatter_d2d\": [", dec.p10, ", ", dec.p90, "], \"gather_encode_pinned\": [",
      pin.p10, ", ", pin.p90, "], \"decode_scatter_from_pinned\": [", ld.p10, ", ", ld.p90,
      "], \"decode_scatter_zero_copy_from_pinned\": [", zc.p10, ", ", zc.p90,
      "], \"decode_scatter_from_pinned_chained\": [", ch.p10, ", ", ch.p90,
      "], \"decode_scatter_zero_copy_chained\": [", zch.p10, ", ", zch.p90,
      "]}, \"trials\": ", kTrials, ", \"iters_per_trial\": ", kIters,
      overlap.empty() ? "" : ", \"layer_overlap\": ", overlap, "}");
}


// The proof behind the fast path of the general encode kernel
// (QuantizeVecFast in kernels/paged_codec_encode.cu, whose formulas this repeats in
// the same IEEE binary32 operations: multiply, fma, add, each rounded to
// nearest even, no contraction). For BF16 and FP16, INT8, INT4 and FP8, every
// 16-bit amax >= FastMinAmax (scale = codec::ScaleFromAmax, reciprocal 1 /
// scale correctly rounded, as __frcp_rn) and every 16-bit x with |x| <= amax:
// the fast code must equal the codec's (QuantizeInt / QuantizeFp8, i.e.
// x / scale divided exactly). Prints the mismatches; returns their count.
// Also reports the largest amax below the bound whose codes differ (why the
// bound is there). About 6.4e9 pairs: seconds on 16 cores.
uint64_t CheckDivision() {
  using codec::BitsToFloat;
  using codec::FloatBits;
  uint64_t total_bad = 0;
  for (const bool bf16 : {true, false}) {
    const DType dt = bf16 ? DType::kBF16 : DType::kFP16;
    const uint32_t inf_bits = bf16 ? 0x7F80u : 0x7C00u;
    const float min_fast = bf16 ? 0x1p-103f : 0.0f;  // FastMinAmax
    for (const DType qt : {DType::kINT8, DType::kINT4, DType::kFP8E4M3}) {
      const int threads = std::max(1u, std::thread::hardware_concurrency());
      std::atomic<uint64_t> pairs{0}, bad{0};
      std::atomic<uint32_t> worst_below{0};
      std::vector<std::thread> pool;
      for (int t = 0; t < threads; ++t) {
        pool.emplace_back([&, t] {
          uint64_t n = 0, b = 0;
          uint32_t worst = 0;
          for (uint32_t ab = t; ab < inf_bits; ab += threads) {
            const float amax = codec::Load16(static_cast<uint16_t>(ab), dt);
            const float scale = codec::ScaleFromAmax(qt, amax);
            const float rcp = 1.0f / scale;
            const bool proven = amax >= min_fast;
            for (uint32_t xb = 0; xb <= ab; ++xb) {
              for (const uint32_t sign : {0u, 0x8000u}) {
                const float x = codec::Load16(static_cast<uint16_t>(xb | sign), dt);
                const float q0 = x * rcp;
                const float q = std::fmaf(std::fmaf(-q0, scale, x), rcp, q0);
                bool same;
                if (qt == DType::kFP8E4M3) {
                  const float qs = BitsToFloat(FloatBits(q) | (FloatBits(x) & 0x80000000u));
                  same = codec::FloatToFp8E4M3(qs) == codec::QuantizeFp8(x, scale);
                } else {
                  const int32_t code =
                      static_cast<int32_t>(FloatBits(q + 12582912.0f) - 0x4B400000u);
                  const int32_t qmax = static_cast<int32_t>(codec::QMax(qt));
                  same = code == codec::QuantizeInt(x, scale, qmax);
                }
                if (proven) {
                  ++n;
                  if (!same) {
                    if (b++ < 3) std::printf("  MISMATCH amax %04x x %04x\n", ab, xb | sign);
                  }
                } else if (!same) {
                  worst = std::max(worst, ab);
                }
              }
            }
          }
          pairs += n;
          bad += b;
          uint32_t w = worst_below.load();
          while (w < worst && !worst_below.compare_exchange_weak(w, worst)) {
          }
        });
      }
      for (auto& th : pool) th.join();
      std::printf("check-division %s %s: %llu (x, amax) pairs with amax >= %g, %llu mismatches; "
                  "largest amax below the bound with a mismatch: 0x%04x\n",
                  bf16 ? "bf16" : "fp16", codec::DTypeName(qt),
                  static_cast<unsigned long long>(pairs.load()), min_fast,
                  static_cast<unsigned long long>(bad.load()), worst_below.load());
      std::fflush(stdout);
      total_bad += bad.load();
    }
  }
  return total_bad;
}
}  // namespace
}  // namespace kvtier::kernels

int main(int argc, char** argv) {
  using namespace kvtier::kernels;
  if (argc > 1 && std::strcmp(argv[1], "--check-division") == 0) return CheckDivision() == 0 ? 0 : 1;
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // lines reach a log even if a time limit ends the run
  const Model models[] = {{"llama3.1-8b", 32, 8, 128}, {"qwen2.5-7b", 28, 4, 128}};
  // Every argument is checked before the first benchmark runs, so a typo
  // late on the command line costs no GPU time and no results.
  struct Job {
    const Model* model;
    const char* codec;
    uint32_t tokens;
  };
  std::vector<Job> jobs;
  if (argc > 2) {
    const Model* model = &models[0];
    uint32_t tokens = kDefaultTokens;
    for (int i = 2; i < argc; ++i) {
      if (std::strncmp(argv[i], "--model=", 8) == 0) {
        model = nullptr;
        for (const Model& m : models) {
          if (std::strcmp(argv[i] + 8, m.name) == 0) model = &m;
        }
        if (model == nullptr) {
          std::fprintf(stderr, "unknown model %s\n", argv[i] + 8);
          return 2;
        }
        continue;
      }
      if (std::strncmp(argv[i], "--tokens=", 9) == 0) {
        if (!absl::SimpleAtoi(argv[i] + 9, &tokens) || tokens == 0 || tokens % kBlockSize != 0 ||
            tokens > 65536) {
          std::fprintf(stderr, "--tokens: a multiple of %u in [%u, 65536], not %s\n", kBlockSize,
                       kBlockSize, argv[i] + 9);
          return 2;
        }
        continue;
      }
      if (absl::Status st = kvtier::codec::ParseCodec(argv[i], DType::kBF16).status(); !st.ok()) {
        std::fprintf(stderr, "codec %s: %s\n", argv[i], st.ToString().c_str());
        return 2;
      }
      jobs.push_back({model, argv[i], tokens});
    }
  } else {
    for (const Model& m : models) {
      for (const char* c : {"k16v8", "k16v16"}) jobs.push_back({&m, c, kDefaultTokens});
    }
    // The general kernels: INT8 per-(token, head) on both sections,
    // INT8 per-tensor V (amax pre-pass + encode pass), and the other
    // granularities and quantized formats.
    for (const char* c :
         {"ki8vi8", "k=16,v=int8/tensor", "k=int8/block-head,v=int8/block-head",
          "k=int8/tensor,v=int8/tensor", "k=int4/token-head,v=int4/token-head",
          "k=int4/block-head,v=int4/block-head", "k=fp8e4m3/token-head,v=fp8e4m3/token-head",
          "k16v4"}) {
      jobs.push_back({&models[0], c, kDefaultTokens});
    }
  }

  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s, %d SMs, L2 %d MiB\n", prop.name, prop.multiProcessorCount,
              prop.l2CacheSize >> 20);
  std::string json = absl::StrCat("{\"device\": \"", prop.name, "\", \"codec_kernels\": [");
  for (size_t j = 0; j < jobs.size(); ++j) {
    const auto start = std::chrono::steady_clock::now();
    json += (j == 0 ? "" : ", ") + RunModel(*jobs[j].model, jobs[j].codec, jobs[j].tokens);
    std::printf("  (%.1f s)\n", std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  json += "]}\n";
  if (argc > 1) {
    FILE* f = std::fopen(argv[1], "w");
    if (f == nullptr) return 1;
    std::fputs(json.c_str(), f);
    std::fclose(f);
  }
  return 0;
}
