// Chunk headers: serialization, validation and checksums (FORMAT.md "Header").
// Every function here treats its input bytes as hostile: no length is trusted
// before it is bounds-checked, and each failure names the field.
#ifndef KVTIER_CODEC_CHUNK_H_
#define KVTIER_CODEC_CHUNK_H_

#include <cstdint>
#include <span>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "codec/format.h"
#include "common/hash.h"

namespace kvtier::codec {

// What a chunk holds, without its lengths and checksums (those follow from it
// and the payload).
struct ChunkSpec {
  Hash128 fingerprint;             // model fingerprint (prefix_key.h)
  Geometry geometry;
  DType dtype = DType::kBF16;      // the engine's 16-bit dtype; decode produces it
  SectionFormat k{DType::kBF16, ScaleGranularity::kNone};
  SectionFormat v{DType::kFP8E4M3, ScaleGranularity::kPerBlockHead};
  uint16_t flags = 0;

  friend bool operator==(const ChunkSpec&, const ChunkSpec&) = default;
};

// A parsed, validated header.
struct ChunkHeader {
  ChunkSpec spec;
  ChunkLayout layout;       // computed from spec; lengths match the stored ones
  uint64_t k_checksum = 0;  // XXH3-64 of the K section
  uint64_t v_checksum = 0;  // XXH3-64 of the V section
};

// Header field offsets (FORMAT.md "Header"), 128 bytes in all.
inline constexpr size_t kOffMagic = 0;          // u32 'KVTC'
inline constexpr size_t kOffVersion = 4;        // u16
inline constexpr size_t kOffHeaderSize = 6;     // u16 = 128
inline constexpr size_t kOffFingerprint = 8;    // 16 bytes
inline constexpr size_t kOffNumLayers = 24;     // u32
inline constexpr size_t kOffNumKvHeads = 28;    // u32
inline constexpr size_t kOffHeadDim = 32;       // u32
inline constexpr size_t kOffNumTokens = 36;     // u32
inline constexpr size_t kOffBlockSize = 40;     // u32
inline constexpr size_t kOffDType = 44;         // u8
inline constexpr size_t kOffKFormat = 45;       // u8
inline constexpr size_t kOffVFormat = 46;       // u8
inline constexpr size_t kOffKGranularity = 47;  // u8
inline constexpr size_t kOffVGranularity = 48;  // u8
inline constexpr size_t kOffScaleDType = 49;    // u8 = 1 (fp32)
inline constexpr size_t kOffFlags = 50;         // u16
inline constexpr size_t kOffReserved0 = 52;     // u32 = 0
inline constexpr size_t kOffKSectionBytes = 56; // u64
inline constexpr size_t kOffVSectionBytes = 64; // u64
inline constexpr size_t kOffKChecksum = 72;     // u64
inline constexpr size_t kOffVChecksum = 80;     // u64
inline constexpr size_t kOffReserved1 = 88;     // 32 bytes = 0
inline constexpr size_t kOffHeaderChecksum = 120;  // u64: XXH3-64 of bytes [0, 120)

// Validates a spec (formats, granularities, geometry limits) and returns its layout.
absl::StatusOr<ChunkLayout> ValidateSpec(const ChunkSpec& spec);

// Writes the 128-byte header of `spec` with the given section checksums into
// `out`, computing the header checksum. REQUIRES: spec is valid, out.size() >= kHeaderSize.
void WriteHeader(const ChunkSpec& spec, const ChunkLayout& layout, uint64_t k_checksum,
                 uint64_t v_checksum, std::span<uint8_t> out);

// Parses and validates a header from the first kHeaderSize bytes of `bytes`.
// Checks magic, version, header size, header checksum, every enum, geometry
// limits and that the stored section lengths equal the computed ones. Does
// not look at the payload. InvalidArgument for malformed fields (wrong magic,
// unknown version, impossible geometry, short input), DataLoss for a header
// checksum mismatch.
absl::StatusOr<ChunkHeader> ParseHeader(std::span<const uint8_t> bytes);

// ParseHeader, then checks that `chunk` is exactly header + K + V bytes long
// and that both section checksums match. DataLoss on a mismatch or truncation.
absl::StatusOr<ChunkHeader> VerifyChunk(std::span<const uint8_t> chunk);

// A whole chunk whose header parsed and whose length and both section
// checksums matched, with the header as parsed: what a store takes, so that
// the layers below it (the placement engine, the tiers) use the header
// instead of parsing the bytes again. Only AcceptChunk makes one, and only
// the verifying functions call it (wire/chunk_check.h's VerifyChunkParallel
// and IncrementalChunkCheck, which hash the sections on two threads or while
// the bytes are written). It does not own the bytes: it is valid while they
// are, and describes them while they are unchanged.
class VerifiedChunk {
 public:
  const ChunkHeader& header() const { return header_; }
  std::span<const uint8_t> bytes() const { return bytes_; }

 private:
  friend absl::StatusOr<VerifiedChunk> AcceptChunk(const ChunkHeader& header,
                                                   std::span<const uint8_t> chunk,
                                                   uint64_t k_checksum, uint64_t v_checksum);
  VerifiedChunk(const ChunkHeader& header, std::span<const uint8_t> bytes)
      : header_(header), bytes_(bytes) {}

  ChunkHeader header_;
  std::span<const uint8_t> bytes_;
};

// The last step of every verification: `header` is ParseHeader's result for
// `chunk`, and `k_checksum` / `v_checksum` are the XXH3-64 the caller
// computed over its K and V sections. DataLoss if `chunk` is not the
// header's length or a checksum differs from the header's.
absl::StatusOr<VerifiedChunk> AcceptChunk(const ChunkHeader& header, std::span<const uint8_t> chunk,
                                          uint64_t k_checksum, uint64_t v_checksum);

enum class Section : uint8_t { kK = 0, kV = 1 };

// Checks one section's bytes against its header (for split placement, where
// K and V live in different tiers). DataLoss on length or checksum mismatch.
absl::Status VerifySection(const ChunkHeader& header, Section which,
                           std::span<const uint8_t> section);

// Fills in the section checksums and the header checksum of a chunk whose
// header fields and payload have been written by someone else (the GPU
// gather+encode kernel writes everything but the checksums). The header must
// otherwise be valid.
absl::Status SealChunk(std::span<uint8_t> chunk);

}  // namespace kvtier::codec

#endif  // KVTIER_CODEC_CHUNK_H_
