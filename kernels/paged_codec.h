// GPU gather+encode (paged cache -> one chunk, all layers in one launch) and
// decode+scatter (chunk -> paged cache). Both produce exactly the bytes and
// values of the CPU codec (codec/codec.h) and of kernels/reference.h.
//
// Supported on the GPU (kernels/dispatch.h): head_dim 64, 128, 256; block_size
// 8, 16, 32, 64.
// A 16-bit cache section goes to and from every chunk section format of the
// codec: native (16-bit), FP8 e4m3, INT8 or INT4, the quantized ones with
// per-tensor, per-(block, head) or per-(token, head) scales. An FP8 cache
// section passes through to an FP8 per-(block, head) chunk section when the
// chunk starts on a block boundary. Anything else (an FP8 cache with any
// other chunk format, a 16-bit cache whose dtype is not the chunk's) is
// InvalidArgument before any launch.
#ifndef KVTIER_KERNELS_PAGED_CODEC_H_
#define KVTIER_KERNELS_PAGED_CODEC_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "codec/chunk.h"
#include "kernels/paged_layout.h"
#include "kernels/record_hash.h"

namespace kvtier::kernels {

// Device scratch of GatherEncode: u32 words that must be zero before the
// first launch (cudaMemset once); each completed launch leaves them zero
// again. Words 0-1 carry the non-finite flag and the CTA count; then two
// words per layer (K, V) carry the per-layer amax of per-tensor sections
// (written by a first pass, read by the encode pass, zeroed by its last CTA).
// Sized for codec::kMaxLayers, so one size serves every chunk. One workspace
// must not serve two launches that can run at the same time; after a launch
// that failed part-way, clear it again.
inline constexpr size_t kGatherEncodeWorkspaceBytes = 4 * (2 + 2 * size_t{codec::kMaxLayers});

// Encodes the `spec.geometry.num_tokens` tokens at `blocks` of every layer of
// `cache` into one chunk at `dst` (spec.geometry.total bytes of
// codec::ComputeLayout). `dst` is device memory or the device address of
// mapped pinned host memory (cudaHostAlloc(..., cudaHostAllocMapped) +
// cudaHostGetDevicePointer); the kernel writes it directly, no staging.
//
// The kernel writes every byte of the chunk except the checksums
// (k_checksum, v_checksum, header_checksum, which it leaves 0, and the
// version 2 record tables, which it does not touch): call codec::SealChunk
// (or wire::SealChunkParallel) on the host bytes afterwards. After sealing the chunk is
// byte-identical to ReferenceGatherEncode (for 16-bit caches:
// codec::EncodeChunk of the gathered tokens), flags included.
//
// REQUIRES: dst 16-byte aligned; per-layer pointers 16-byte aligned.
// InvalidArgument (before any launch) for an invalid spec or descriptor,
// geometry that differs from the cache, unsupported head_dim / block size /
// format pair, out-of-range block ids (when blocks.host_block_ids is set), a
// null dst or workspace. Errors of the launch itself come back through
// KVTIER_CUDA_RETURN_IF_ERROR. Asynchronous: returns once enqueued on `stream`.
absl::Status GatherEncode(const codec::ChunkSpec& spec, const PagedKvLayout& cache,
                          const BlockSpan& blocks, uint8_t* dst, uint32_t* workspace,
                          cudaStream_t stream);

// GatherEncode of layers [layers.begin, layers.end) only: writes those
// layers' records of the K and V sections (data, scales, padding) and the
// header, and leaves every other byte of `dst` as it is. A chunk may be
// encoded in several range launches on one stream (e.g. layer by layer as a
// prefill computes them); once they cover every layer and the chunk is
// sealed it is byte-identical to the single launch's. The header's
// non-finite flag is the OR over the launches: the launch whose range starts
// at layer 0 writes the header afresh, later ones add their flag to it.
// REQUIRES (besides GatherEncode's): the launch that covers layer 0 runs
// before the other launches of the same chunk; launches of one chunk run in
// stream order (one workspace serves one launch at a time).
// InvalidArgument as GatherEncode, or for an empty or out-of-range `layers`.
absl::Status GatherEncode(const codec::ChunkSpec& spec, const PagedKvLayout& cache,
                          const BlockSpan& blocks, LayerRange layers, uint8_t* dst,
                          uint32_t* workspace, cudaStream_t stream);

// Every host-side check of GatherEncode, without launching anything (no
// device needed): OK exactly when GatherEncode would launch. Errors as
// GatherEncode's InvalidArgument cases.
absl::Status ValidateGatherEncode(const codec::ChunkSpec& spec, const PagedKvLayout& cache,
                                  const BlockSpan& blocks, const uint8_t* dst,
                                  const uint32_t* workspace, LayerRange layers = {});

// What a decode launch may assume of the kernel enqueued just before it on
// its stream.
enum class PriorKernel {
  // Nothing: the decode starts once the work before it completes (stream
  // order).
  kUnknown,
  // It does not write the chunk's bytes (e.g. it is the decode of another
  // chunk, or there is none). Then, on a GPU of compute capability 9.0 or
  // later, the decode kernel may start while that kernel runs (a
  // programmatic dependent launch, which graph capture keeps as a
  // programmatic edge): it reads its part of the chunk early, and reads the
  // block ids and writes the cache only once the kernel before it has
  // completed and its writes are visible. A chain of decodes (the chunks of
  // a prefix, layer range by layer range) so keeps the link busy across
  // launches (H200: kernels/README.md). A decode through a HostStaging's
  // copy ignores it (its kernel follows the copy). The caller guarantees the
  // premise: a kernel that writes the chunk just before a decode launched
  // with kLeavesChunk races with the decode's reads.
  kLeavesChunk,
};
// Every decode kernel lets a launch after it start early in turn: a kernel
// launched after a decode with cudaLaunchAttributeProgrammaticStreamSerialization
// must wait (cudaGridDependencySynchronize / griddepcontrol.wait) before it
// reads what the decode wrote, as that attribute requires.

// Decodes the chunk at `chunk` (device memory or mapped pinned host memory)
// whose parsed header is `header` into the cache slots at `blocks`: 16-bit
// cache sections receive codec::DecodeChunk's values, FP8 cache sections the
// chunk's codes and scales. The header is taken from the caller, who parsed
// it on the host (codec::ParseHeader / VerifyChunk: tiers keep headers in
// host memory and verify checksums where the bytes are); the kernel does not
// verify checksums. Slots not covered by the chunk are untouched.
// InvalidArgument as GatherEncode. Asynchronous.
absl::Status DecodeScatter(const codec::ChunkHeader& header, const uint8_t* chunk,
                           const PagedKvLayout& cache, const BlockSpan& blocks,
                           cudaStream_t stream, PriorKernel prior = PriorKernel::kUnknown);

// DecodeScatter of layers [layers.begin, layers.end) of the chunk into the
// same layers of the cache; the other layers of the cache are untouched.
// Launches of different ranges of one chunk are independent (any order, any
// streams). InvalidArgument as DecodeScatter, or for an empty or
// out-of-range `layers`. Asynchronous.
absl::Status DecodeScatter(const codec::ChunkHeader& header, const uint8_t* chunk,
                           const PagedKvLayout& cache, const BlockSpan& blocks,
                           LayerRange layers, cudaStream_t stream,
                           PriorKernel prior = PriorKernel::kUnknown);

// Device memory through which DecodeScatter loads a chunk that is in pinned
// host memory: one copy-engine H2D copy of the layer range's records into
// it, then the decode from device memory, both on the caller's stream. A
// copy engine moves host memory at the link's rate, SMs reading it do not:
// on the H200 the decode kernels reach 0.88-0.92 of a pinned memcpy reading
// the chunk over PCIe, the copy and a decode from HBM 0.92-0.95 (all but
// 4-bit chunks; kernels/README.md).
// Not thread-safe: one thread uses it at a time.
class HostStaging {
 public:
  // Allocates `bytes` (> 0) of device memory on the current device.
  // InvalidArgument for 0; CUDA errors as Internal.
  static absl::StatusOr<std::unique_ptr<HostStaging>> Create(size_t bytes);
  ~HostStaging();
  HostStaging(const HostStaging&) = delete;
  HostStaging& operator=(const HostStaging&) = delete;

  // Grows the buffer to at least `bytes`; keeps it when it is large enough.
  // REQUIRES: no launch that uses it is in flight, no stream capture on this
  // thread (it allocates).
  absl::Status Reserve(size_t bytes);
  size_t capacity() const { return capacity_; }
  uint8_t* data() const { return data_; }

 private:
  HostStaging() = default;
  uint8_t* data_ = nullptr;
  size_t capacity_ = 0;
};

// DecodeScatter of a chunk through `staging`: one cudaMemcpyAsync of the
// bytes from layer layers.begin's K record to layer layers.end - 1's V record
// into `staging`, and the decode from there, when
//   - the chunk is in host memory and those bytes fit `staging`,
//   - at most a quarter of them belong to other layers (the whole chunk, or
//     a range that leaves out a few layers at an end), and
//   - the range's records are at least 3/8 of the bytes the decode writes
//     into the cache (all but 4-bit chunks, for which the kernel reading
//     host memory is faster);
// otherwise exactly DecodeScatter above. Results, errors and graph capture
// as DecodeScatter. With `staged`, a launch that staged the range sets it to
// where its records are in `staging` (for HashStagedRecords: the bytes the
// decode reads) and clears it otherwise. REQUIRES: launches that share
// `staging` run in stream order (a launch overwrites what the previous one's
// decode reads).
absl::Status DecodeScatter(const codec::ChunkHeader& header, const uint8_t* chunk,
                           const PagedKvLayout& cache, const BlockSpan& blocks,
                           LayerRange layers, HostStaging& staging, cudaStream_t stream,
                           PriorKernel prior = PriorKernel::kUnknown,
                           StagedRecords* staged = nullptr);

// DecodeScatter of layers `layers` of a chunk whose records of those layers
// a reader copied into device memory, as StagedRecords (chunks = 1) lays
// them out: K's record of layer l at k_records + (l - layers.begin) *
// k.layer_stride, V's at v_records (REQUIRES: device memory, 16-byte
// aligned). Results and errors as DecodeScatter; InvalidArgument for a null
// address. Asynchronous.
absl::Status DecodeStagedScatter(const codec::ChunkHeader& header, const StagedRecords& records,
                                 const PagedKvLayout& cache, const BlockSpan& blocks,
                                 cudaStream_t stream);

// Every host-side check of DecodeScatter, without launching anything.
absl::Status ValidateDecodeScatter(const codec::ChunkHeader& header, const uint8_t* chunk,
                                   const PagedKvLayout& cache, const BlockSpan& blocks,
                                   LayerRange layers = {});

}  // namespace kvtier::kernels

#endif  // KVTIER_KERNELS_PAGED_CODEC_H_
