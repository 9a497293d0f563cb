// XXH3-64 of a chunk's layer records on the GPU (FORMAT.md "Record
// checksums"), so that a reader checks the bytes it decodes where they are,
// in device memory after the copy engine brought them, instead of hashing the
// same bytes on host threads while the copy engine reads them (on the H200
// host that contention slowed a 25 MB pinned H2D copy from 0.47 to 0.7 ms).
//
// Bit-exact with libxxhash's XXH3_64bits_withSeed (the CPU reference; the
// GPU test compares every length class) for inputs longer than 240 bytes, its
// long-input path; shorter records are the host's to hash. XXH3 adds a
// block's stripes into its eight accumulators and scrambles them after each
// 1 KiB block: the sums of every block of every record are taken at once
// (bandwidth-bound), and only the scrambles run in order, one warp a record.
#ifndef KVTIER_KERNELS_RECORD_HASH_H_
#define KVTIER_KERNELS_RECORD_HASH_H_

#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/status.h"
#include "codec/chunk.h"
#include "kernels/paged_layout.h"

namespace kvtier::kernels {

// The shortest input the device hash takes: XXH3's long-input path starts
// above 240 bytes.
inline constexpr uint64_t kMinDeviceHashBytes = 241;

// Records of layers [layers.begin, layers.end) of both sections of
// `chunks` version 2 chunks laid out as `header` says, as a reader staged
// them in device memory: with n = layers.end - layers.begin, chunk c's K
// record of layer l at k_records + (c * n + l - layers.begin) *
// k.layer_stride, V's likewise at v_records.
struct StagedRecords {
  const uint8_t* k_records = nullptr;
  const uint8_t* v_records = nullptr;
  LayerRange layers;
  uint32_t chunks = 1;
};

// Whether HashStagedRecords takes records of `header`'s chunk at these
// addresses: version 2, every record longer than 240 bytes and a multiple of
// 16, both bases 16-byte aligned.
bool CanHashOnDevice(const codec::ChunkHeader& header, const StagedRecords& records);

// Device scratch HashStagedRecords needs for the records of `layers` of
// `chunks` chunks: 128 bytes a 1 KiB block of every record (about 1/8 of
// the records' bytes).
uint64_t StagedRecordsWorkspaceBytes(const codec::ChunkHeader& header, LayerRange layers,
                                     uint32_t chunks = 1);

// Launches the record checksums of `records` on `stream`: with n =
// layers.end - layers.begin and C = chunks, out[c * n + j] is chunk c's K
// record of layer layers.begin + j and out[C * n + c * n + j] its V record;
// each equals codec::RecordChecksum of the record's bytes.
// Two kernels: every 1 KiB block's stripe sums at once into `workspace`
// (device memory of StagedRecordsWorkspaceBytes, 16-byte aligned), then one
// warp a record for XXH3's in-order scrambles and its merge. `out` is
// device-writable (device memory, or mapped pinned host memory's device
// address). InvalidArgument (nothing launched) where CanHashOnDevice is
// false, for an empty or out-of-range layer range or a null pointer.
// Asynchronous; reads the records after the work queued on `stream`.
absl::Status HashStagedRecords(const codec::ChunkHeader& header, const StagedRecords& records,
                               void* workspace, uint64_t* out, cudaStream_t stream);

// XXH3_64bits_withSeed of one device range of `bytes` (> 240, a multiple of
// 16, 16-byte aligned) into *out, with DeviceRangeWorkspaceBytes(bytes) of
// workspace: the primitive above, for tests.
uint64_t DeviceRangeWorkspaceBytes(uint64_t bytes);
absl::Status HashDeviceRange(const uint8_t* data, uint64_t bytes, uint64_t seed, void* workspace,
                             uint64_t* out, cudaStream_t stream);

}  // namespace kvtier::kernels

#endif  // KVTIER_KERNELS_RECORD_HASH_H_
