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
  uint16_t version = kVersion;     // the chunk format's version (FORMAT.md)

  friend bool operator==(const ChunkSpec&, const ChunkSpec&) = default;
};

// A parsed, validated header.
struct ChunkHeader {
  ChunkSpec spec;
  ChunkLayout layout;       // computed from spec; lengths match the stored ones
  // Version 1: XXH3-64 of the K (V) section. Version 2: XXH3-64 of the K (V)
  // section's record checksum table.
  uint64_t k_checksum = 0;
  uint64_t v_checksum = 0;
};

enum class Section : uint8_t { kK = 0, kV = 1 };

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

// ParseHeader without the header checksum, for a chunk whose writer left
// every checksum to the sealer (SealChunk, wire::SealChunkParallel): the
// fields face every other check.
absl::StatusOr<ChunkHeader> ParseUnsealedHeader(std::span<const uint8_t> bytes);

// ParseHeader, then checks that `chunk` is exactly header + K + V bytes long
// and that both section checksums match. DataLoss on a mismatch or truncation.
absl::StatusOr<ChunkHeader> VerifyChunk(std::span<const uint8_t> chunk);

// Version 2's layer records (FORMAT.md "Record checksums").
//
// The checksum of layer record `layer` of section `which`: XXH3-64 of the
// record's bytes with seed (which << 32) | layer, so that a record found at
// another layer or in the other section does not match.
uint64_t RecordChecksum(Section which, uint32_t layer, std::span<const uint8_t> record);
// The bytes of layer record `layer` within `section` (a section's bytes).
// REQUIRES: section.size() == sec.bytes, layer < sec.num_layers.
std::span<const uint8_t> RecordBytes(const SectionLayout& sec, std::span<const uint8_t> section,
                                     uint32_t layer);
// The checksum the table of `section` holds for `layer`.
// REQUIRES: version 2, section.size() == sec.bytes, layer < sec.num_layers.
uint64_t StoredRecordChecksum(const SectionLayout& sec, std::span<const uint8_t> section,
                              uint32_t layer);
// Writes the record checksum table of a section (its zero padding included)
// into `table` and returns the table's XXH3-64, the header's section
// checksum. REQUIRES: digests.size() == sec.num_layers, table.size() ==
// sec.table_bytes.
uint64_t WriteRecordTable(const SectionLayout& sec, std::span<const uint64_t> digests,
                          std::span<uint8_t> table);
// Version 2's section check, given the record checksums the caller computed
// from the record bytes of layers [first_layer, first_layer +
// computed.size()): the stored table's XXH3-64 must be `want` (the header's
// section checksum) and each of those stored entries the computed one.
// DataLoss naming `k_checksum` / `v_checksum` or the record (`k record 3`)
// otherwise. REQUIRES: first_layer + computed.size() <= sec.num_layers (a
// whole section's check: first_layer 0 and every layer).
absl::Status CheckRecordTable(Section which, const SectionLayout& sec, uint64_t want,
                              std::span<const uint64_t> computed,
                              std::span<const uint8_t> stored_table, uint32_t first_layer = 0);
// Its two halves, for a reader that checks some records only: the table
// against the header's section checksum `want`, and record `layer`'s computed
// checksum against the table in `section` (a section's bytes).
absl::Status CheckRecordTableHeader(Section which, const SectionLayout& sec, uint64_t want,
                                    std::span<const uint8_t> stored_table);
absl::Status CheckRecord(Section which, const SectionLayout& sec, std::span<const uint8_t> section,
                         uint32_t layer, uint64_t computed);

// A whole chunk whose header parsed and whose length and both section
// checksums matched, with the header as parsed: what a store takes, so that
// the layers below it (the placement engine, the tiers) use the header
// instead of parsing the bytes again. Only AcceptChunk makes one, and only
// the verifying functions call it (wire/chunk_check.h's VerifyChunkParallel
// and SealChunkParallel, which spread the records over a worker pool, and
// IncrementalChunkCheck, which hashes them while the bytes are written). It does not own the bytes: it is valid while they
// are, and describes them while they are unchanged.
class VerifiedChunk {
 public:
  const ChunkHeader& header() const { return header_; }
  std::span<const uint8_t> bytes() const { return bytes_; }

 private:
  friend absl::StatusOr<VerifiedChunk> AcceptChunk(const ChunkHeader& header,
                                                   std::span<const uint8_t> chunk,
                                                   const absl::Status& sections);
  VerifiedChunk(const ChunkHeader& header, std::span<const uint8_t> bytes)
      : header_(header), bytes_(bytes) {}

  ChunkHeader header_;
  std::span<const uint8_t> bytes_;
};

// The last step of every verification: `header` is ParseHeader's result for
// `chunk`, and `sections` the verdict of the caller's check of both sections
// against it (VerifySection's, or SectionHashes::Check's of each). DataLoss
// if `chunk` is not the header's length; `sections` if it is not OK.
absl::StatusOr<VerifiedChunk> AcceptChunk(const ChunkHeader& header, std::span<const uint8_t> chunk,
                                          const absl::Status& sections);

// Checks one section's bytes against its header (for split placement, where
// K and V live in different tiers): version 1 hashes the section, version 2
// each layer record and the table. DataLoss on length or checksum mismatch.
absl::Status VerifySection(const ChunkHeader& header, Section which,
                           std::span<const uint8_t> section);

// Fills in the section checksums (version 2: the record tables too) and the
// header checksum of a chunk whose header fields and payload have been
// written by someone else (the GPU gather+encode kernel writes everything but
// the checksums). The header must otherwise be valid.
absl::Status SealChunk(std::span<uint8_t> chunk);

}  // namespace kvtier::codec

#endif  // KVTIER_CODEC_CHUNK_H_
