// CPU codec benchmark: encode and decode GB/s of 16-bit KV per format, next to
// memcpy of the same bytes measured in the same run. Single thread (the CPU
// codec is the reference; the GPU kernels are the fast path).
//
// Usage: codec_bench [--json FILE] [--reps N] [--codec NAME]
#include <cstdio>
#include <cstring>

#include <malloc.h>
#include <string>

#include "bench/bench_util.h"
#include "codec/codec.h"
#include "codec/test_util.h"

using namespace kvtier;
using namespace kvtier::codec;

int main(int argc, char** argv) {
  // Every buffer from the heap and kept mapped: otherwise glibc's dynamic
  // mmap threshold hands the first formats' buffers fresh mappings (a page
  // fault per page, every repetition) and the later ones heap memory, and a
  // format's figures depend on its place in the list.
  mallopt(M_MMAP_THRESHOLD, 1 << 30);
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
  std::string json_path;
  int reps = 3;
  const char* only = nullptr;  // --codec NAME: that format alone
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--json") && i + 1 < argc) json_path = argv[++i];
    else if (!std::strcmp(argv[i], "--reps") && i + 1 < argc) reps = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--codec") && i + 1 < argc) only = argv[++i];
  }
  // Llama-3.1-8B, one 256-token chunk, block size 16: 32 MiB of BF16 K+V.
  Geometry g{32, 8, 128, 256, 16};
  const DType native = DType::kBF16;
  auto k = testing::MakeKv(g, native, {.seed = 1, .outlier_every = 16});
  auto v = testing::MakeKv(g, native, {.seed = 2});
  const size_t raw_bytes = (k.size() + v.size()) * sizeof(uint16_t);
  const double memcpy_gbps = bench::MemcpyGBps(raw_bytes, reps + 2);

  std::printf("machine: %s\n", bench::CpuName().c_str());
  std::printf("shape: Llama-3.1-8B chunk, 32 layers x 256 tokens x 8 kv heads x 128, bf16 (%.1f MiB)\n",
              raw_bytes / 1048576.0);
  std::printf("baseline: memcpy of %.1f MiB = %.2f GB/s (decimal)\n\n", raw_bytes / 1048576.0,
              memcpy_gbps);
  std::printf("%-8s %12s %10s %10s %10s %10s\n", "codec", "chunk bytes", "enc GB/s", "enc/memcpy",
              "dec GB/s", "dec/memcpy");
  std::string json = "{\"benchmark\":\"codec_cpu\",\"machine\":\"" + bench::CpuName() +
                     "\",\"shape\":\"llama-3.1-8b chunk 256 tokens bf16\",\"input_bytes\":" +
                     std::to_string(raw_bytes) + ",\"memcpy_gbps\":" + std::to_string(memcpy_gbps) +
                     ",\"results\":[";
  bool first = true;
  for (const char* name : {"k16v16", "k16v8", "k8v8", "k16v4", "k8v4", "k16vi8", "ki8vi8"}) {
    if (only != nullptr && std::strcmp(only, name) != 0) continue;
    auto fmt = ParseCodec(name, native);
    auto spec = testing::MakeSpec(g, native, fmt->k, fmt->v);
    auto layout = ValidateSpec(spec);
    std::vector<uint8_t> chunk(layout->total_bytes);
    double enc_s = bench::BestSeconds(reps, [&] {
      if (!EncodeChunkInto(spec, {k, v}, chunk).ok()) std::abort();
    });
    double dec_s = bench::BestSeconds(reps, [&] {
      auto d = DecodeChunk(chunk);
      if (!d.ok()) std::abort();
    });
    double enc = raw_bytes / enc_s / 1e9, dec = raw_bytes / dec_s / 1e9;
    std::printf("%-8s %12zu %10.2f %10.3f %10.2f %10.3f\n", name, chunk.size(), enc,
                enc / memcpy_gbps, dec, dec / memcpy_gbps);
    json += std::string(first ? "" : ",") + "{\"codec\":\"" + name + "\",\"chunk_bytes\":" +
            std::to_string(chunk.size()) + ",\"encode_gbps\":" + std::to_string(enc) +
            ",\"encode_vs_memcpy\":" + std::to_string(enc / memcpy_gbps) +
            ",\"decode_gbps\":" + std::to_string(dec) + ",\"decode_vs_memcpy\":" +
            std::to_string(dec / memcpy_gbps) + "}";
    first = false;
  }
  json += "]}\n";
  std::printf("\nGB/s are bytes of 16-bit K+V per second (encode input, decode output).\n");
  return bench::WriteJson(json_path, json) ? 0 : 2;
}
