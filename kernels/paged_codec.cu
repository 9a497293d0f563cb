#include "kernels/paged_codec.h"

#include <atomic>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "kernels/cuda_status.h"
#include "kernels/paged_codec_internal.cuh"

// What both directions share on the host: the parameter checks and the
// kernel launch. The kernels: paged_codec_encode.cu, paged_codec_decode.cu.
namespace kvtier::kernels::codec_internal {
namespace {

bool Is16(DType t) { return t == DType::kBF16 || t == DType::kFP16; }

absl::StatusOr<Mode> ResolveMode(const char* name, DType cache_dtype, DType chunk_dtype,
                                 codec::SectionFormat f, uint32_t first_slot) {
  const bool fp8_bh =
      f.dtype == DType::kFP8E4M3 && f.granularity == codec::ScaleGranularity::kPerBlockHead;
  if (Is16(cache_dtype)) {
    if (cache_dtype != chunk_dtype) {
      return absl::InvalidArgumentError(absl::StrCat(name, ": the cache holds ",
                                                     codec::DTypeName(cache_dtype),
                                                     " but the chunk dtype is ",
                                                     codec::DTypeName(chunk_dtype)));
    }
    if (Is16(f.dtype)) return Mode::kCopy16;
    if (fp8_bh) return Mode::kFp8;  // the fast kernels' FP8 path
    if (codec::IsQuantized(f.dtype) && f.granularity != codec::ScaleGranularity::kNone) {
      return Mode::kQuant;
    }
    // ValidateSpec refuses these already; kept so that no pair reaches a kernel unchecked.
    return absl::InvalidArgumentError(absl::StrCat(
        name, ": no GPU codec path for ", codec::DTypeName(f.dtype), "/",
        codec::GranularityName(f.granularity)));
  }
  if (cache_dtype != DType::kFP8E4M3 || !fp8_bh) {
    return absl::InvalidArgumentError(absl::StrCat(
        name, ": an ", codec::DTypeName(cache_dtype),
        " cache section passes through only to fp8e4m3/block-head, not ",
        codec::DTypeName(f.dtype), "/", codec::GranularityName(f.granularity),
        " (a quantized cache is never re-quantized on the GPU)"));
  }
  if (first_slot != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        name, ": an fp8e4m3 cache section needs a chunk that starts on a block boundary "
              "(first_slot = ", first_slot, ")"));
  }
  return Mode::kPass8;
}

}  // namespace

// Every check of both launchers, before anything touches the device.
absl::StatusOr<CodecParams> Prepare(const codec::ChunkSpec& spec, const codec::ChunkLayout& layout,
                                    const PagedKvLayout& cache, const BlockSpan& blocks,
                                    LayerRange layers, const uint8_t* chunk) {
  KVTIER_RETURN_IF_ERROR(ValidatePagedKvLayout(cache));
  const codec::Geometry& g = spec.geometry;
  if (g.num_layers != cache.num_layers || g.num_kv_heads != cache.num_kv_heads ||
      g.head_dim != cache.head_dim || g.block_size != cache.block_size) {
    return absl::InvalidArgumentError(absl::StrCat(
        "geometry: chunk (layers ", g.num_layers, ", kv_heads ", g.num_kv_heads, ", head_dim ",
        g.head_dim, ", block_size ", g.block_size, ") does not match the cache (",
        cache.num_layers, ", ", cache.num_kv_heads, ", ", cache.head_dim, ", ",
        cache.block_size, ")"));
  }
  KVTIER_RETURN_IF_ERROR(CheckHeadDim(cache.head_dim));
  KVTIER_RETURN_IF_ERROR(CheckCodecBlockSize(cache.block_size));
  KVTIER_RETURN_IF_ERROR(ValidateBlockSpan(cache, blocks, g.num_tokens));
  KVTIER_RETURN_IF_ERROR(ValidateLayerRange(layers, g.num_layers));
  if (chunk == nullptr) return absl::InvalidArgumentError("chunk pointer is null");
  if (reinterpret_cast<uintptr_t>(chunk) % 16 != 0) {
    return absl::InvalidArgumentError("chunk pointer is not 16-byte aligned");
  }
  if (uint64_t{g.num_blocks()} * g.num_kv_heads > 0x7FFFFFFFull || g.num_layers > 65535) {
    return absl::InvalidArgumentError("geometry: too many blocks x heads for one launch");
  }
  CodecParams p{};
  p.cache = cache;
  p.block_ids = blocks.block_ids;
  p.first_slot = blocks.first_slot;
  p.num_tokens = g.num_tokens;
  p.num_blocks_in_chunk = g.num_blocks();
  p.layer_begin = layers.begin;
  p.layer_end = layers.End(g.num_layers);
  p.bf16 = spec.dtype == DType::kBF16;
  const codec::SectionLayout* secs[2] = {&layout.k, &layout.v};
  const DType cache_dtypes[2] = {cache.k_dtype, cache.v_dtype};
  const codec::SectionFormat formats[2] = {spec.k, spec.v};
  const uint64_t offsets[2] = {layout.k_offset, layout.v_offset};
  for (int s = 0; s < 2; ++s) {
    KVTIER_ASSIGN_OR_RETURN(Mode m, ResolveMode(s == 0 ? "k" : "v", cache_dtypes[s], spec.dtype,
                                                formats[s], blocks.first_slot));
    SectionArgs& a = p.sec[s];
    a.mode = m;
    a.qdtype = formats[s].dtype;
    a.gran = formats[s].granularity;
    p.tensor_amax |= m == Mode::kQuant && a.gran == ScaleGranularity::kPerTensor;
    a.offset = offsets[s];
    a.layer_stride = secs[s]->layer_stride;
    a.data_bytes = secs[s]->data_bytes;
    a.payload = g.layer_elements() * codec::BitsPerElement(formats[s].dtype) / 8;
    a.scale_count = secs[s]->scale_count;
    a.scale_bytes = secs[s]->scale_bytes;
  }
  return p;
}

absl::StatusOr<HostAddress> HostAddressOf(const void* p) {
  cudaPointerAttributes a{};
  KVTIER_RETURN_IF_ERROR(OutsideCapture([&] { return cudaPointerGetAttributes(&a, p); }));
  if (a.type != cudaMemoryTypeHost) return HostAddress{false, nullptr};
  return HostAddress{true, static_cast<const uint8_t*>(a.hostPointer)};
}

absl::StatusOr<bool> IsHostMemory(const void* p) {
  KVTIER_ASSIGN_OR_RETURN(const HostAddress a, HostAddressOf(p));
  return a.in_host;
}

namespace {

// Whether the current device runs programmatic dependent launches (compute
// capability 9.0 or later). Asked once a device: every chained decode
// launch (hundreds in a layer-wise load) would otherwise repeat the query.
absl::StatusOr<bool> HasDependentLaunch() {
  constexpr int kKnownDevices = 64;
  static std::atomic<int8_t> known[kKnownDevices] = {};  // 0 not asked, 1 no, 2 yes
  int device = 0, major = 0;
  KVTIER_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  const bool cached = device >= 0 && device < kKnownDevices;
  if (cached) {
    const int8_t k = known[device].load(std::memory_order_relaxed);
    if (k != 0) return k == 2;
  }
  KVTIER_RETURN_IF_ERROR(OutsideCapture([&] {
    return cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  }));
  if (cached) known[device].store(major >= 9 ? 2 : 1, std::memory_order_relaxed);
  return major >= 9;
}

}  // namespace

absl::Status LaunchKernel(KernelFn fn, const CodecParams& p, dim3 grid, dim3 block, uint32_t smem,
                          PriorKernel prior, cudaStream_t stream) {
  cudaLaunchAttribute overlap{};
  overlap.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  overlap.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  if (prior == PriorKernel::kLeavesChunk) {
    KVTIER_ASSIGN_OR_RETURN(const bool dependent, HasDependentLaunch());
    if (dependent) {
      config.attrs = &overlap;
      config.numAttrs = 1;
    }
  }
  KVTIER_CUDA_RETURN_IF_ERROR(cudaLaunchKernelEx(&config, fn, p));
  return absl::OkStatus();
}

}  // namespace kvtier::kernels::codec_internal
