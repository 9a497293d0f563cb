// Internal to the codec kernels (paged_codec.cu, paged_codec_encode.cu,
// paged_codec_decode.cu): the launch parameters the kernels take, the
// thread-to-element map, the host-memory CTA shape, and the launch helpers
// both directions share. Not a public header: include paged_codec.h.
#ifndef KVTIER_KERNELS_PAGED_CODEC_INTERNAL_CUH_
#define KVTIER_KERNELS_PAGED_CODEC_INTERNAL_CUH_

#include <algorithm>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/status.h"
#include "kernels/dispatch.h"
#include "kernels/paged_codec.h"

namespace kvtier::kernels::codec_internal {

using codec::DType;
using codec::ScaleGranularity;

constexpr int kThreads = 128;
constexpr int kVecElems = 8;  // one 16-byte vector of 16-bit elements, 8 bytes of FP8 codes

// What a kernel does with one section (K or V).
enum class Mode : uint32_t {
  kCopy16 = 0,  // 16-bit cache <-> native chunk section, bit for bit
  kFp8 = 1,     // 16-bit cache <-> FP8 chunk section with per-(block, head) scales
  kPass8 = 2,   // FP8 cache <-> FP8 chunk section: codes and scales copied
  kQuant = 3,   // 16-bit cache <-> FP8 / INT8 / INT4 section, any granularity (general kernels)
};

// Launches with a kQuant section run the general instantiations of the
// kernels (kGeneral = true); the others run the fast ones, whose code is that
// of the three modes above only.
struct SectionArgs {
  Mode mode;
  DType qdtype;                 // kQuant: kFP8E4M3, kINT8 or kINT4
  ScaleGranularity gran;        // the section's scales (kNone: 16-bit; kFp8 / kPass8: block-head)
  // Layer 0's record, from `chunk` (mod 2^64: a HostStaging buffer holds
  // the bytes from layer_begin's K record on, so this may "precede" it).
  uint64_t offset;
  uint64_t layer_stride;  // bytes per layer record
  uint64_t data_bytes;    // per layer, padded
  uint64_t payload;       // per layer, unpadded data bytes
  uint64_t scale_count;   // per layer
  uint64_t scale_bytes;   // per layer, padded

  // Layer `layer`'s record of the section in `chunk`: codes, then scales.
  __device__ uint8_t* LayerBase(uint8_t* chunk, uint32_t layer) const {
    return chunk + (offset + layer_stride * layer);
  }
  __device__ float* LayerScales(uint8_t* chunk, uint32_t layer) const {
    return reinterpret_cast<float*>(LayerBase(chunk, layer) + data_bytes);
  }
};

// One buffer of DecodeFromHostKernel's stage, as byte offsets in it: for
// each section the codes ([token][head in the CTA][a head's row of codes],
// row_bytes per row), its per-(token, head) scales ([token][head in the
// CTA]) and its group scales (per-tensor: one; per-(block, head): one per
// head in the CTA). Every offset is a multiple of 16.
struct HostStage {
  uint32_t codes[2];
  uint32_t row_bytes[2];
  uint32_t token_scales[2];
  uint32_t group[2];
  uint32_t bytes;  // the buffer
};

struct alignas(16) Header128 {
  uint4 w[codec::kHeaderSize / 16];
};
static_assert(sizeof(Header128) == codec::kHeaderSize, "the header is 8 16-byte vectors");
static_assert(codec::kOffFlags == 50, "flags live in the high half of header word 12");

struct CodecParams {
  PagedKvLayout cache;
  const int32_t* block_ids;
  uint32_t first_slot;
  uint32_t num_tokens;
  uint32_t num_blocks_in_chunk;  // ceil(num_tokens / block_size)
  uint32_t layer_begin;          // first layer of the launch (grid y = layer - layer_begin)
  uint32_t heads_per_cta;        // kv heads of one CTA (blockDim.y; divides num_kv_heads)
  bool staged;                   // general encode: kQuant sections go through a CodecStage
  uint32_t layer_end;
  bool bf16;                     // the chunk dtype
  SectionArgs sec[2];            // K, V
  uint8_t* chunk;                // encode: destination; decode: source
  uint32_t* workspace;           // encode only
  bool tensor_amax;              // encode: a kQuant per-tensor section (amax pre-pass ran)
  Header128 header;              // encode only: the header with flags and checksums 0
  HostStage host_stage;          // DecodeFromHostKernel only
};

// Thread-to-element map of one CTA: (layer, chunk block, kv head) is a tile
// of BS tokens x HD dims, split into 8-element vectors.
template <int HD, int BS>
struct Tile {
  static_assert(HD % kVecElems == 0, "head_dim must be a multiple of the 8-element vector");
  static constexpr int kVecsPerRow = HD / kVecElems;
  static constexpr int kVecs = BS * kVecsPerRow;
  static constexpr int kPerThread = (kVecs + kThreads - 1) / kThreads;
  // Element index, within a layer of a chunk section ([token][kv_head][dim],
  // codec::SectionLayout::element_index), of vector v of the tile at t0.
  static __device__ __forceinline__ uint64_t ChunkIndex(uint32_t t0, int v, uint32_t H,
                                                        uint32_t head) {
    return (uint64_t{t0 + v / kVecsPerRow} * H + head) * HD + (v % kVecsPerRow) * kVecElems;
  }
  // This thread's tile (grid x = chunk block * (kv heads / G) + head group,
  // y = layer - layer_begin; G = heads_per_cta kv heads per CTA, threadIdx.y
  // the head within the group):
  // kv heads H, kv head, chunk block, layer, first chunk token, tokens.
  struct Coords {
    uint32_t H, head, cb, layer, t0, nt;
  };
  static __device__ __forceinline__ Coords Here(const CodecParams& p) {
    return At(p, blockIdx.x, blockIdx.y);
  }
  // The same for the tile at grid position (x, y).
  static __device__ __forceinline__ Coords At(const CodecParams& p, uint32_t x, uint32_t y) {
    const uint32_t H = p.cache.num_kv_heads, groups = H / p.heads_per_cta;
    const uint32_t cb = x / groups, t0 = cb * BS;
    return {H, (x % groups) * p.heads_per_cta + threadIdx.y, cb, p.layer_begin + y, t0,
            min(static_cast<uint32_t>(BS), p.num_tokens - t0)};
  }
  // Cache block (x) and slot (y) of chunk token `token` (BlockSpan's map).
  static __device__ __forceinline__ uint2 CacheSlot(const int32_t* block_ids, uint32_t first_slot,
                                                    uint32_t token) {
    return make_uint2(static_cast<uint32_t>(__ldg(block_ids + (first_slot + token) / BS)),
                      (first_slot + token) % BS);
  }
};

// Workspace words (kGatherEncodeWorkspaceBytes): the OR of the non-finite
// flags, the count of finished CTAs, then the amax bits of layer l, section s
// at kWsAmax + 2 * l + s.
constexpr int kWsFlags = 0;
constexpr int kWsCount = 1;
constexpr int kWsAmax = 2;
static_assert(kGatherEncodeWorkspaceBytes == 4 * (kWsAmax + 2 * size_t{codec::kMaxLayers}),
              "the workspace holds the two counters and a K and a V amax per layer");

// Kernels with a chunk in host memory (mapped pinned): the general encode
// and every decode. A CTA serves up to kMaxHeadsPerCta kv heads of a chunk
// block (threadIdx.y = head), and the codes and per-(token, head) scales go
// through a stage in shared memory, moved between stage and chunk in 16-byte
// vectors by consecutive threads (StoreStage, LoadHostTile): they are runs
// of whole heads x tokens in the chunk ([token][kv_head] order), so full
// PCIe lines instead of a 4-byte access per scale and half-line INT4 rows.
// With a chunk in device memory a CTA serves one head and accesses the chunk
// directly (more, smaller CTAs without the stage's barrier hide HBM latency
// better). kMaxHeadsPerCta keeps a section's staged 8-bit codes within 16 KiB.
template <int HD, int BS>
inline constexpr int kMaxHeadsPerCta = 16384 / (BS * HD) >= 8 ? 8
                                       : 16384 / (BS * HD) >= 1 ? 16384 / (BS * HD) : 1;

// Kv heads of a CTA with a chunk in host memory: the most, up to
// kMaxHeadsPerCta, that divide the `kv_heads`.
template <int HD, int BS>
uint32_t HostHeadsPerCta(uint32_t kv_heads) {
  uint32_t g = std::min<uint32_t>(kMaxHeadsPerCta<HD, BS>, kv_heads);
  while (kv_heads % g != 0) --g;
  return g;
}

// The stage in dynamic shared memory of a CTA of `g` heads: codes
// [section][token][head in the CTA][code bytes of a row] (INT4 rows half as
// long), then scales [section][token][head in the CTA] (per-(token, head)).
template <int HD, int BS>
struct CodecStage {
  uint8_t* base;
  uint32_t g;
  static constexpr uint32_t Bytes(uint32_t heads) { return 2 * BS * heads * (HD + 4); }
  __device__ __forceinline__ uint8_t* codes(int s) const { return base + s * BS * g * HD; }
  __device__ __forceinline__ float* scales(int s) const {
    return reinterpret_cast<float*>(base + 2 * BS * g * HD) + s * BS * g;
  }
};

// Checks `spec` against the cache, the block span and the layer range and
// fills the parameters both directions share (paged_codec.cu).
absl::StatusOr<CodecParams> Prepare(const codec::ChunkSpec& spec, const codec::ChunkLayout& layout,
                                    const PagedKvLayout& cache, const BlockSpan& blocks,
                                    LayerRange layers, const uint8_t* chunk);

using KernelFn = void (*)(CodecParams);

// Runs `query` (CUDA calls that are not stream operations: pointer and
// function attributes, occupancy) with this thread in relaxed stream capture
// mode, so that a thread capturing a CUDA graph in global mode may make them.
template <typename Query>
absl::Status OutsideCapture(Query&& query) {
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  KVTIER_CUDA_RETURN_IF_ERROR(cudaThreadExchangeStreamCaptureMode(&mode));
  const cudaError_t e = query();
  KVTIER_CUDA_RETURN_IF_ERROR(cudaThreadExchangeStreamCaptureMode(&mode));
  KVTIER_CUDA_RETURN_IF_ERROR(e);
  return absl::OkStatus();
}

// Where `p` points: whether into host memory (pinned, mapped or registered,
// which a kernel reaches over PCIe), and then its host address.
struct HostAddress {
  bool in_host;
  const uint8_t* host;  // null when unknown
};
absl::StatusOr<HostAddress> HostAddressOf(const void* p);

absl::StatusOr<bool> IsHostMemory(const void* p);

// Whether a launch needs the general kernels (some section is kQuant).
inline bool NeedsGeneral(const CodecParams& p) {
  return p.sec[0].mode == Mode::kQuant || p.sec[1].mode == Mode::kQuant;
}

// Launches `fn(p)` on `stream`; with `prior` kLeavesChunk (decode kernels
// only: they wait for the prior grid before their first store) as a
// programmatic dependent launch where the device has them.
absl::Status LaunchKernel(KernelFn fn, const CodecParams& p, dim3 grid, dim3 block, uint32_t smem,
                          PriorKernel prior, cudaStream_t stream);

// The one dispatch point: runtime head_dim and block size (kernels/dispatch.h)
// to an instantiation of Kernel (a struct template with `fast` and `general`
// kernels). `staged`: a general encode into host memory, whose CTAs serve
// HostHeadsPerCta kv heads (blockDim.y) and take a CodecStage in dynamic
// shared memory; else one head a CTA.
template <template <int, int> class Kernel>
absl::Status Launch(CodecParams p, bool staged, cudaStream_t stream,
                    PriorKernel prior = PriorKernel::kUnknown) {
  const bool general = NeedsGeneral(p);
  const uint32_t H = p.cache.num_kv_heads;
  KernelFn fn = nullptr;
  uint32_t g = 1, smem = 0;
  KVTIER_RETURN_IF_ERROR(KVTIER_DISPATCH_HEAD_DIM(p.cache.head_dim, HD, {
    return KVTIER_DISPATCH_CODEC_BLOCK_SIZE(p.cache.block_size, BS, {
      fn = general ? Kernel<HD, BS>::general : Kernel<HD, BS>::fast;
      if (general && staged) {
        g = HostHeadsPerCta<HD, BS>(H);
        smem = CodecStage<HD, BS>::Bytes(g);
      }
    });
  }));
  p.heads_per_cta = g;
  p.staged = smem != 0;
  return LaunchKernel(fn, p, dim3(p.num_blocks_in_chunk * (H / g), p.layer_end - p.layer_begin),
                      dim3(kThreads, g), smem, prior, stream);
}

}  // namespace kvtier::kernels::codec_internal

#endif  // KVTIER_KERNELS_PAGED_CODEC_INTERNAL_CUH_
