#include "kernels/record_hash.h"

#define XXH_STATIC_LINKING_ONLY  // XXH3_generateSecret_fromSeed
#include <xxhash.h>

#include <algorithm>
#include <array>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "kernels/cuda_status.h"

namespace kvtier::kernels {
namespace {

// XXH3's constants (xxhash.h, the 0.8 output, frozen by its spec).
constexpr uint64_t kPrime32_1 = 0x9E3779B1u;
constexpr uint64_t kPrime32_2 = 0x85EBCA77u;
constexpr uint64_t kPrime32_3 = 0xC2B2AE3Du;
constexpr uint64_t kPrime64_1 = 0x9E3779B185EBCA87ull;
constexpr uint64_t kPrime64_2 = 0xC2B2AE3D27D4EB4Full;
constexpr uint64_t kPrime64_3 = 0x165667B19E3779F9ull;
constexpr uint64_t kPrime64_4 = 0x85EBCA77C2B2AE63ull;
constexpr uint64_t kPrime64_5 = 0x27D4EB2F165667C5ull;
constexpr int kSecretWords = 24;     // the 192-byte default secret
constexpr int kStripesPerBlock = 16;  // (192 - 64) / 8
constexpr int kBlockBytes = 64 * kStripesPerBlock;
constexpr int kScrambleWord = 16;     // secret + 192 - 64
constexpr int kLastStripeByte = 121;  // secret + 192 - 64 - 7
constexpr int kMergeByte = 11;

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
// Blocks a warp of the first kernel sums (16 loads a thread in flight).
constexpr uint32_t kBlocksPerWarp = 4;

// Ranges j = 0..count-1 at base + j * stride, each `bytes` long, hashed with
// seed seed0 + j % period; their per-block sums at sums[(first_sum + j *
// blocks) * 8].
struct RangeSet {
  const uint8_t* base;
  uint64_t stride;
  uint64_t bytes;
  uint64_t seed0;
  uint64_t first_sum;
  uint32_t count;
  uint32_t period;
  uint32_t blocks;  // 1 KiB blocks a range: the whole ones and the last (partial, maybe empty)
};

// Per block and accumulator lane i: the sum of the stripes' multiplied
// halves for accumulator i (x) and the sum of the stripes' words of lane i,
// which go to accumulator i ^ 1 (y).
using LaneSums = ulonglong2;

struct HashParams {
  uint64_t secret[kSecretWords];  // the default secret (seed 0)
  RangeSet set[2];
  LaneSums* sums;
  uint64_t* out;
};

__device__ __forceinline__ uint64_t MulHalves(uint64_t x) {
  return (x & 0xFFFFFFFFull) * (x >> 32);
}

// Word w of the secret of `seed` (XXH3_initCustomSecret: + seed for even
// words, - seed for odd ones).
__device__ __forceinline__ uint64_t SecretWord(const HashParams& p, int w, uint64_t seed) {
  return (w & 1) ? p.secret[w] - seed : p.secret[w] + seed;
}

// The secret's 8 bytes from `byte` on.
__device__ __forceinline__ uint64_t SecretAt(const HashParams& p, int byte, uint64_t seed) {
  const int q = byte >> 3, r = (byte & 7) * 8;
  const uint64_t lo = SecretWord(p, q, seed);
  return r == 0 ? lo : (lo >> r) | (SecretWord(p, q + 1, seed) << (64 - r));
}

__device__ __forceinline__ uint64_t Fold(uint64_t a, uint64_t b) {
  return (a * b) ^ __umul64hi(a, b);
}

// Unit `unit` of the units of both sets, set 0's `in0` first, `per` units a
// range: its set, range and unit within the range.
struct Unit {
  const RangeSet* set;
  uint32_t range;
  uint32_t rest;
};
__device__ __forceinline__ Unit Locate(const HashParams& p, uint32_t unit, uint32_t in0,
                                       uint32_t per0, uint32_t per1) {
  const bool first = unit < in0;
  const uint32_t u = first ? unit : unit - in0, per = first ? per0 : per1;
  return {first ? &p.set[0] : &p.set[1], u / per, u % per};
}

// XXH3's accumulation is sums between scrambles, so the blocks of a range
// are summed in parallel (this kernel) and only the scrambles run in order
// (RecordScanKernel). A warp sums kBlocksPerWarp blocks: thread t reads
// 8-byte word t % 8 of stripes t / 8, t / 8 + 4, ... (256 contiguous bytes a
// load), and the four threads of a lane combine their sums.
__global__ void __launch_bounds__(kThreads) BlockSumsKernel(const HashParams p,
                                                            uint32_t warps0, uint32_t warps1) {
  const uint32_t warp = blockIdx.x * kWarps + threadIdx.x / 32;
  const uint32_t per0 = (p.set[0].blocks + kBlocksPerWarp - 1) / kBlocksPerWarp;
  const uint32_t per1 = (p.set[1].blocks + kBlocksPerWarp - 1) / kBlocksPerWarp;
  if (warp >= warps0 + warps1) return;
  const Unit u = Locate(p, warp, warps0, per0, per1);
  const RangeSet& rs = *u.set;
  const uint8_t* const data = rs.base + uint64_t{u.range} * rs.stride;
  const uint64_t seed = rs.seed0 + u.range % rs.period;
  const uint64_t len = rs.bytes;
  const uint32_t full = rs.blocks - 1;
  const int last_stripes = int(((len - 1) - uint64_t{full} * kBlockBytes) / 64);
  const int lane = threadIdx.x & 31, i = lane & 7, sub = lane >> 3;
  uint64_t keys[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) keys[k] = SecretWord(p, sub + 4 * k + i, seed);
  const uint32_t first = u.rest * kBlocksPerWarp;
  uint64_t v[kBlocksPerWarp][4];
#pragma unroll
  for (uint32_t b = 0; b < kBlocksPerWarp; ++b) {
    const uint32_t block = first + b;
    const int stripes = block < full ? kStripesPerBlock : block == full ? last_stripes : 0;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      v[b][k] = sub + 4 * k < stripes ? reinterpret_cast<const uint64_t*>(
                                            data + uint64_t{block} * kBlockBytes)[lane + 32 * k]
                                      : 0;
    }
  }
#pragma unroll
  for (uint32_t b = 0; b < kBlocksPerWarp; ++b) {
    const uint32_t block = first + b;
    if (block > full) break;
    const int stripes = block < full ? kStripesPerBlock : last_stripes;
    uint64_t mul = 0, sum = 0;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      if (sub + 4 * k < stripes) {
        mul += MulHalves(v[b][k] ^ keys[k]);
        sum += v[b][k];
      }
    }
    mul += __shfl_xor_sync(0xFFFFFFFFu, mul, 8);
    sum += __shfl_xor_sync(0xFFFFFFFFu, sum, 8);
    mul += __shfl_xor_sync(0xFFFFFFFFu, mul, 16);
    sum += __shfl_xor_sync(0xFFFFFFFFu, sum, 16);
    if (sub == 0) {
      p.sums[(rs.first_sum + uint64_t{u.range} * rs.blocks + block) * 8 + i] =
          make_ulonglong2(mul, sum);
    }
  }
}

// One warp a range: the accumulators over its blocks' sums in order, with
// the scramble after each whole block, then the last stripe and the merge.
// Lane i (of each group of 8: all four groups compute the same) keeps
// accumulator i.
__global__ void __launch_bounds__(kThreads) RecordScanKernel(const HashParams p,
                                                             uint32_t ranges) {
  const uint32_t warp = blockIdx.x * kWarps + threadIdx.x / 32;
  if (warp >= ranges) return;
  const Unit u = Locate(p, warp, p.set[0].count, 1, 1);
  const RangeSet& rs = *u.set;
  const uint8_t* const data = rs.base + uint64_t{u.range} * rs.stride;
  const uint64_t seed = rs.seed0 + u.range % rs.period;
  const uint64_t len = rs.bytes;
  const uint32_t full = rs.blocks - 1;
  const int lane = threadIdx.x & 31, i = lane & 7;
  const uint64_t init[8] = {kPrime32_3, kPrime64_1, kPrime64_2, kPrime64_3,
                            kPrime64_4, kPrime32_2, kPrime64_5, kPrime32_1};
  uint64_t acc = init[i];
  const uint64_t scramble = SecretWord(p, kScrambleWord + i, seed);
  const LaneSums* sums = p.sums + (rs.first_sum + uint64_t{u.range} * rs.blocks) * 8;
  // The sums of the next kAhead blocks load while this batch's scrambles
  // run: the loads do not depend on the accumulator, and none is guarded
  // (a guarded load's use would wait for it before the next load issues);
  // indices past the whole blocks read the last block's sums, unused.
  constexpr uint32_t kAhead = 16;
  uint64_t m[kAhead], s[kAhead], next_m[kAhead], next_s[kAhead];
  auto fetch = [&](uint32_t b0, uint64_t (&tm)[kAhead], uint64_t (&ts)[kAhead]) {
#pragma unroll
    for (uint32_t d = 0; d < kAhead; ++d) {
      const uint64_t b = min(b0 + d, full);
      tm[d] = sums[b * 8 + i].x;
      ts[d] = sums[b * 8 + (i ^ 1)].y;
    }
  };
  fetch(0, m, s);
  for (uint32_t b0 = 0; b0 < full; b0 += kAhead) {
    fetch(b0 + kAhead, next_m, next_s);
#pragma unroll
    for (uint32_t d = 0; d < kAhead; ++d) {
      if (b0 + d < full) {
        acc += m[d] + s[d];
        acc ^= acc >> 47;
        acc ^= scramble;
        acc *= kPrime32_1;
      }
    }
#pragma unroll
    for (uint32_t d = 0; d < kAhead; ++d) {
      m[d] = next_m[d];
      s[d] = next_s[d];
    }
  }
  // The last, partial block (no scramble), then the last 64 bytes with the
  // secret's last stripe key.
  acc += sums[full * 8 + i].x + sums[full * 8 + (i ^ 1)].y;
  const uint64_t* tail = reinterpret_cast<const uint64_t*>(data + len - 64);
  acc += MulHalves(tail[i] ^ SecretAt(p, kLastStripeByte + 8 * i, seed)) + tail[i ^ 1];
  uint64_t a[8];
#pragma unroll
  for (int m = 0; m < 8; ++m) a[m] = __shfl_sync(0xFFFFFFFFu, acc, m);
  if (lane == 0) {
    uint64_t h = len * kPrime64_1;
#pragma unroll
    for (int m = 0; m < 4; ++m) {
      h += Fold(a[2 * m] ^ SecretAt(p, kMergeByte + 16 * m, seed),
                a[2 * m + 1] ^ SecretAt(p, kMergeByte + 16 * m + 8, seed));
    }
    h ^= h >> 37;
    h *= 0x165667919E3779F9ull;
    h ^= h >> 32;
    p.out[warp] = h;
  }
}

uint32_t BlocksOf(uint64_t bytes) { return static_cast<uint32_t>((bytes - 1) / kBlockBytes + 1); }

// The default secret as libxxhash has it (the secret of seed 0).
const std::array<uint64_t, kSecretWords>& DefaultSecret() {
  static const std::array<uint64_t, kSecretWords> words = [] {
    unsigned char bytes[8 * kSecretWords];
    XXH3_generateSecret_fromSeed(bytes, 0);
    std::array<uint64_t, kSecretWords> w;
    std::memcpy(w.data(), bytes, sizeof(bytes));  // little-endian words, as XXH3 reads them
    return w;
  }();
  return words;
}

bool RangeOk(const uint8_t* base, uint64_t stride, uint64_t bytes) {
  return base != nullptr && bytes >= kMinDeviceHashBytes && bytes % 16 == 0 &&
         stride % 16 == 0 && reinterpret_cast<uintptr_t>(base) % 16 == 0;
}

absl::Status Launch(HashParams& p, cudaStream_t stream) {
  uint64_t warps[2];
  for (int k = 0; k < 2; ++k) {
    RangeSet& rs = p.set[k];
    rs.blocks = BlocksOf(rs.bytes);
    rs.first_sum = k == 0 ? 0 : uint64_t{p.set[0].count} * p.set[0].blocks;
    warps[k] = uint64_t{rs.count} * ((rs.blocks + kBlocksPerWarp - 1) / kBlocksPerWarp);
  }
  const uint64_t all = warps[0] + warps[1];
  const uint32_t ranges = p.set[0].count + p.set[1].count;
  BlockSumsKernel<<<static_cast<uint32_t>((all + kWarps - 1) / kWarps), kThreads, 0, stream>>>(
      p, static_cast<uint32_t>(warps[0]), static_cast<uint32_t>(warps[1]));
  KVTIER_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  RecordScanKernel<<<(ranges + kWarps - 1) / kWarps, kThreads, 0, stream>>>(p, ranges);
  KVTIER_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return absl::OkStatus();
}

HashParams Params(void* workspace, uint64_t* out) {
  HashParams p{};
  std::memcpy(p.secret, DefaultSecret().data(), sizeof(p.secret));
  p.sums = static_cast<LaneSums*>(workspace);
  p.out = out;
  return p;
}

uint64_t SumsBytes(uint64_t ranges, uint64_t bytes) {
  return ranges * BlocksOf(bytes) * 8 * sizeof(LaneSums);
}

}  // namespace

bool CanHashOnDevice(const codec::ChunkHeader& header, const StagedRecords& records) {
  const codec::ChunkLayout& l = header.layout;
  return l.version >= 2 && RangeOk(records.k_records, l.k.layer_stride, l.k.layer_stride) &&
         RangeOk(records.v_records, l.v.layer_stride, l.v.layer_stride);
}

uint64_t StagedRecordsWorkspaceBytes(const codec::ChunkHeader& header, LayerRange layers,
                                     uint32_t chunks) {
  const codec::ChunkLayout& l = header.layout;
  const uint64_t n = uint64_t{chunks} * (layers.End(l.geometry.num_layers) - layers.begin);
  return SumsBytes(n, std::max<uint64_t>(l.k.layer_stride, 1)) +
         SumsBytes(n, std::max<uint64_t>(l.v.layer_stride, 1));
}

uint64_t DeviceRangeWorkspaceBytes(uint64_t bytes) {
  return SumsBytes(1, std::max<uint64_t>(bytes, 1));
}

absl::Status HashStagedRecords(const codec::ChunkHeader& header, const StagedRecords& records,
                               void* workspace, uint64_t* out, cudaStream_t stream) {
  const codec::ChunkLayout& l = header.layout;
  if (!CanHashOnDevice(header, records)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "records of version ", l.version, " with strides ", l.k.layer_stride, " / ",
        l.v.layer_stride, " are not hashed on the device (version 2, records of at least ",
        kMinDeviceHashBytes, " bytes, a multiple of 16, 16-byte aligned)"));
  }
  KVTIER_RETURN_IF_ERROR(ValidateLayerRange(records.layers, l.geometry.num_layers));
  if (out == nullptr || workspace == nullptr) {
    return absl::InvalidArgumentError("no workspace or output for the record checksums");
  }
  const uint32_t b = records.layers.begin, n = records.layers.End(l.geometry.num_layers) - b;
  if (records.chunks == 0 || uint64_t{records.chunks} * n > (uint64_t{1} << 24)) {
    return absl::InvalidArgumentError(
        absl::StrCat(records.chunks, " chunks of ", n, " records each: 1 to 2^24 records"));
  }
  const uint32_t count = records.chunks * n;
  HashParams p = Params(workspace, out);
  p.set[0] = {records.k_records, l.k.layer_stride, l.k.layer_stride,
              (uint64_t{static_cast<uint8_t>(codec::Section::kK)} << 32) | b, 0, count, n, 0};
  p.set[1] = {records.v_records, l.v.layer_stride, l.v.layer_stride,
              (uint64_t{static_cast<uint8_t>(codec::Section::kV)} << 32) | b, 0, count, n, 0};
  return Launch(p, stream);
}

absl::Status HashDeviceRange(const uint8_t* data, uint64_t bytes, uint64_t seed, void* workspace,
                             uint64_t* out, cudaStream_t stream) {
  if (!RangeOk(data, 16, bytes) || out == nullptr || workspace == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a device hash takes a 16-byte aligned range of at least ", kMinDeviceHashBytes,
        " bytes, a multiple of 16, a workspace and an output; got ", bytes, " bytes"));
  }
  HashParams p = Params(workspace, out);
  p.set[0] = {data, 0, bytes, seed, 0, 1, 1, 0};
  p.set[1] = {data, 0, bytes, seed, 0, 0, 1, 0};
  return Launch(p, stream);
}

}  // namespace kvtier::kernels
