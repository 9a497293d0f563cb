// Paged decode attention, Llama-3.1-8B shape (32 q heads, 8 kv heads,
// head_dim 128, block size 16), batch 1/8/32/64 x context 1K..32K, for
// K16/V8, BF16 and symmetric FP8 caches: time per step, tokens/s and the
// cache bytes streamed per second. The same kernel in BF16 is the baseline;
// bench/kernel_sdpa_bench.py measures PyTorch SDPA in the same run.
// Usage: kernel_attention_bench OUT.json
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "bench/kernel_bench_util.h"
#include "kernels/paged_attention.h"

namespace kvtier::kernels {
namespace {

using codec::DType;

constexpr uint32_t HQ = 32, HKV = 8, D = 128, BS = 16;

__device__ uint32_t Hash(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  x ^= x >> 33;
  return static_cast<uint32_t>(x);
}

// Random BF16 values in about [-2, 2], or FP8 codes without NaN.
__global__ void FillRandom(uint8_t* p, size_t n, bool fp8, uint64_t seed) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n;
       i += size_t{gridDim.x} * blockDim.x) {
    uint32_t h = Hash(seed * 0x9E3779B97F4A7C15ull + i);
    if (fp8) {
      uint8_t c = static_cast<uint8_t>(h);
      p[i] = (c & 0x7F) == 0x7F ? 0x3F : c;
    } else if (i % 2 == 0 && i + 1 < n) {
      float f = (static_cast<int>(h % 4001) - 2000) * 1e-3f;
      uint32_t u = __float_as_uint(f) >> 16;
      p[i] = static_cast<uint8_t>(u);
      p[i + 1] = static_cast<uint8_t>(u >> 8);
    }
  }
}

__global__ void FillScales(float* p, size_t n) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n;
       i += size_t{gridDim.x} * blockDim.x)
    p[i] = 0.004f + 0.001f * (i % 7);
}

struct Format {
  const char* name;
  DType k, v;
};

const char* KernelName(AttentionKernel k) {
  switch (k) {
    case AttentionKernel::kAuto:
      return "auto";
    case AttentionKernel::kCudaCore:
      return "cuda_core";
    case AttentionKernel::kTensorCore:
      return "tensor_core";
  }
  return "?";
}

std::string Run(const Format& f, uint32_t batch, uint32_t ctx, uint32_t partition_tokens = 0,
                bool hnd = false, AttentionKernel kernel = AttentionKernel::kAuto) {
  const uint64_t tokens = uint64_t{batch} * ctx;
  const uint64_t elems = tokens * HKV * D;
  const double bytes_k = f.k == DType::kFP8E4M3 ? 1 : 2, bytes_v = f.v == DType::kFP8E4M3 ? 1 : 2;
  const uint64_t blocks_needed = tokens / BS;
  const double kv_bytes = elems * (bytes_k + bytes_v) +
                          ((f.k == DType::kFP8E4M3) + (f.v == DType::kFP8E4M3)) * 4.0 *
                              blocks_needed * HKV;
  // Enough distinct block tables to keep repeats out of the 50 MB L2.
  const int rotate = static_cast<int>(std::clamp<double>(1.0e9 / kv_bytes, 1, 64));
  const uint32_t num_blocks = static_cast<uint32_t>(blocks_needed * rotate);
  // vLLM's default NHD layouts ([.., block, token, head, dim]: a head's row
  // of one token is 256 contiguous bytes); HND ([.., block, head, token,
  // dim]) in the layout sweep.
  const CacheLayout kind =
      f.k == f.v ? (hnd ? CacheLayout::kVllmFlashAttnHND : CacheLayout::kVllmFlashAttnNHD)
                 : (hnd ? CacheLayout::kSeparateHND : CacheLayout::kSeparateNHD);
  auto layout = MakePagedKvLayout(kind, 1, num_blocks, BS, HKV, D, f.k == DType::kFP8E4M3
                                                                       ? DType::kFP8E4M3
                                                                       : DType::kBF16,
                                  f.v);
  CHECK_OK(layout.status());
  const size_t kb = LayerTensorElements(kind, *layout) * (size_t)bytes_k;
  const size_t vb = LayerVTensorElements(kind, *layout) * (size_t)bytes_v;
  uint8_t *k = nullptr, *v = nullptr;
  float *ks = nullptr, *vs = nullptr;
  CHECK_CUDA(cudaMalloc(&k, kb));
  FillRandom<<<4096, 256>>>(k, kb, f.k == DType::kFP8E4M3, 1);
  if (vb) {
    CHECK_CUDA(cudaMalloc(&v, vb));
    FillRandom<<<4096, 256>>>(v, vb, f.v == DType::kFP8E4M3, 2);
  } else {
    v = k;
  }
  const size_t ns = size_t{num_blocks} * HKV;
  CHECK_CUDA(cudaMalloc(&ks, ns * 4));
  CHECK_CUDA(cudaMalloc(&vs, ns * 4));
  FillScales<<<1024, 256>>>(ks, ns);
  FillScales<<<1024, 256>>>(vs, ns);
  void** d_ptrs = nullptr;
  CHECK_CUDA(cudaMalloc(&d_ptrs, 4 * sizeof(void*)));
  void* h_ptrs[4] = {k, v, ks, vs};
  CHECK_CUDA(cudaMemcpy(d_ptrs, h_ptrs, sizeof(h_ptrs), cudaMemcpyHostToDevice));
  PagedKvLayout c = *layout;
  c.k_layers = d_ptrs;
  c.v_layers = d_ptrs + 1;
  c.k_scale_layers = f.k == DType::kFP8E4M3 ? reinterpret_cast<float* const*>(d_ptrs + 2) : nullptr;
  c.v_scale_layers = f.v == DType::kFP8E4M3 ? reinterpret_cast<float* const*>(d_ptrs + 3) : nullptr;

  const uint32_t maxb = ctx / BS;
  std::vector<int32_t> table(uint64_t{rotate} * batch * maxb);
  for (size_t i = 0; i < table.size(); ++i) {
    // Blocks of a sequence in a scattered order (stride 7 inside each 64-block group).
    const size_t grp = i / 64 * 64, off = i % 64;
    table[i] = static_cast<int32_t>(grp + (off * 7) % 64 < num_blocks ? grp + (off * 7) % 64 : i);
  }
  std::vector<int32_t> lens(batch, static_cast<int32_t>(ctx));
  int32_t *d_table, *d_lens;
  uint16_t *d_q, *d_out;
  CHECK_CUDA(cudaMalloc(&d_table, table.size() * 4));
  CHECK_CUDA(cudaMemcpy(d_table, table.data(), table.size() * 4, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMalloc(&d_lens, batch * 4));
  CHECK_CUDA(cudaMemcpy(d_lens, lens.data(), batch * 4, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMalloc(&d_q, size_t{batch} * HQ * D * 2));
  CHECK_CUDA(cudaMalloc(&d_out, size_t{batch} * HQ * D * 2));
  FillRandom<<<64, 256>>>(reinterpret_cast<uint8_t*>(d_q), size_t{batch} * HQ * D * 2, false, 3);
  DecodeAttentionParams p;
  p.q = d_q;
  p.q_dtype = DType::kBF16;
  p.batch = batch;
  p.num_q_heads = HQ;
  p.block_table = d_table;
  p.max_blocks_per_seq = maxb;
  p.seq_lens = d_lens;
  p.sm_scale = 0.08838834764f;
  p.out = d_out;
  p.partition_tokens = partition_tokens;
  p.kernel = kernel;
  auto part_or = DecodeAttentionPartitionTokensFor(c, p);
  CHECK_OK(part_or.status());
  const uint32_t part = *part_or;
  auto wsb = DecodeAttentionWorkspaceBytes(c, p);
  CHECK_OK(wsb.status());
  void* ws = nullptr;
  CHECK_CUDA(cudaMalloc(&ws, *wsb));
  auto step = [&](int i) {
    DecodeAttentionParams q = p;
    q.block_table = d_table + uint64_t{static_cast<uint32_t>(i % rotate)} * batch * maxb;
    CHECK_OK(PagedDecodeAttention(c, q, ws, *wsb, nullptr));
  };
  for (int i = 0; i < 3; ++i) step(i);
  CHECK_CUDA(cudaDeviceSynchronize());
  // NaN / all-zero check of one output.
  std::vector<uint16_t> out(size_t{batch} * HQ * D);
  CHECK_CUDA(cudaMemcpy(out.data(), d_out, out.size() * 2, cudaMemcpyDeviceToHost));
  size_t nan = 0, nonzero = 0;
  for (uint16_t o : out) {
    nan += (o & 0x7F80) == 0x7F80 && (o & 0x7F);
    nonzero += (o & 0x7FFF) != 0;
  }
  if (nan || nonzero == 0) {
    std::fprintf(stderr, "bad output: %zu NaN, %zu non-zero\n", nan, nonzero);
    std::exit(1);
  }
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  const int iters = 20;
  std::vector<double> t;
  for (int trial = 0; trial < 7; ++trial) {
    cudaEventRecord(a);
    for (int i = 0; i < iters; ++i) step(i);
    cudaEventRecord(b);
    CHECK_CUDA(cudaEventSynchronize(b));
    float ms;
    cudaEventElapsedTime(&ms, a, b);
    t.push_back(ms * 1e-3 / iters);
  }
  std::sort(t.begin(), t.end());
  const double ts = t[t.size() / 2];
  std::printf(
      "attention %-6s %s %-13s batch %3u ctx %6u part %4u: %9.1f us  %9.0f tokens/s  %7.1f GB/s\n",
      f.name, hnd ? "HND" : "NHD", KernelName(kernel), batch, ctx, part, ts * 1e6, batch / ts,
      kv_bytes / ts / 1e9);
  cudaFree(k);
  if (vb) cudaFree(v);
  cudaFree(ks);
  cudaFree(vs);
  cudaFree(d_ptrs);
  cudaFree(d_table);
  cudaFree(d_lens);
  cudaFree(d_q);
  cudaFree(d_out);
  cudaFree(ws);
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return absl::StrCat("{\"format\": \"", f.name, "\", \"batch\": ", batch, ", \"context\": ", ctx,
                      ", \"partition_tokens\": ", part, ", \"kernel\": \"", KernelName(kernel),
                      "\", \"layout\": \"",
                      CacheLayoutName(kind), "\"",
                      ", \"t_s\": ", ts, ", \"tokens_per_s\": ", batch / ts,
                      ", \"kv_bytes\": ", kv_bytes, ", \"hbm_gbps\": ", kv_bytes / ts / 1e9, "}");
}

}  // namespace
}  // namespace kvtier::kernels

int main(int argc, char** argv) {
  using namespace kvtier::kernels;
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  const Format formats[] = {{"bf16", DType::kBF16, DType::kBF16},
                            {"k16v8", DType::kBF16, DType::kFP8E4M3},
                            {"fp8", DType::kFP8E4M3, DType::kFP8E4M3}};
  // --only FORMAT BATCH CTX PART: one tensor-core run (for profilers).
  if (argc == 6 && std::string(argv[1]) == "--only") {
    for (const Format& f : formats) {
      if (f.name != std::string(argv[2])) continue;
      std::printf("%s\n", Run(f, std::atoi(argv[3]), std::atoi(argv[4]), std::atoi(argv[5]), false,
                              AttentionKernel::kTensorCore)
                              .c_str());
      return 0;
    }
    return 2;
  }
  std::string json = absl::StrCat("{\"device\": \"", prop.name,
                                  "\", \"q_heads\": 32, \"kv_heads\": 8, \"head_dim\": 128, "
                                  "\"block_size\": 16, \"attention\": [");
  bool first = true;
  for (uint32_t batch : {1u, 8u, 32u, 64u})
    for (uint32_t ctx : {1024u, 2048u, 4096u, 8192u, 16384u, 32768u})
      for (const Format& f : formats) {
        json += (first ? "" : ", ") + Run(f, batch, ctx);
        first = false;
      }
  // Both kernels (CUDA-core FP32 FMAs, tensor-core mma) at the target shape
  // with NHD and HND blocks, and NHD at a few other shapes; the main table
  // uses kAuto (tensor cores for this group of 4).
  json += "], \"kernel_sweep\": [";
  first = true;
  for (const auto& [batch, ctx] : {std::pair{32u, 8192u}, std::pair{1u, 8192u}, std::pair{8u, 8192u},
                                   std::pair{32u, 2048u}, std::pair{64u, 32768u}})
    for (bool hnd : {false, true}) {
      if (hnd && batch != 32 || hnd && ctx != 8192) continue;
      for (AttentionKernel k : {AttentionKernel::kCudaCore, AttentionKernel::kTensorCore})
        for (const Format& f : formats) {
          json += (first ? "" : ", ") + Run(f, batch, ctx, 0, hnd, k);
          first = false;
        }
    }
  // Small batches, both kernels with their own partition rules: where kAuto
  // should switch from the CUDA-core to the tensor-core kernel.
  json += "], \"small_batch_sweep\": [";
  first = true;
  for (uint32_t batch : {1u, 2u, 4u})
    for (uint32_t ctx : {1024u, 4096u, 16384u, 32768u})
      for (AttentionKernel k : {AttentionKernel::kCudaCore, AttentionKernel::kTensorCore})
        for (const Format& f : formats) {
          json += (first ? "" : ", ") + Run(f, batch, ctx, 0, false, k);
          first = false;
        }
  // Partition size sweep (tensor-core kernel, NHD): the fixed cost of a CTA
  // (pipeline fill, epilogue, combine rows) against wave quantization.
  json += "], \"partition_sweep\": [";
  first = true;
  for (const auto& [batch, ctx] : {std::pair{32u, 8192u}, std::pair{8u, 8192u}, std::pair{64u, 8192u},
                                   std::pair{32u, 32768u}, std::pair{32u, 2048u}})
    for (uint32_t part : {256u, 512u, 1024u, 2048u, 4096u, 8192u}) {
      if (part > ctx) continue;
      for (const Format& f : formats) {
        json += (first ? "" : ", ") + Run(f, batch, ctx, part, false, AttentionKernel::kTensorCore);
        first = false;
      }
    }
  json += "]}\n";
  if (argc > 1) {
    FILE* out = std::fopen(argv[1], "w");
    if (out == nullptr) return 1;
    std::fputs(json.c_str(), out);
    std::fclose(out);
  }
  return 0;
}
