// Incremental section checks (FORMAT.md "Header", "Record checksums"): hashes
// the sections of a buffer while its bytes become final in order, so that a
// copy, a streamed write or a read can be checked without a second pass over
// the bytes. The verdicts equal codec::VerifySection's of the whole sections.
#ifndef KVTIER_CODEC_SECTION_HASHES_H_
#define KVTIER_CODEC_SECTION_HASHES_H_

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "codec/chunk.h"

namespace kvtier::codec {

// The checks of up to kMaxSections disjoint byte ranges ("sections") of one
// buffer, fed the buffer's bytes as [lo, hi) offset ranges. Version 1 hashes
// each section whole (XXH3-64); version 2 hashes each layer record with its
// seed and keeps the record table as it is fed, for Check. Two layouts are in
// use:
//   - a whole chunk (ResetChunk): K and V at their chunk offsets, so a range
//     fed may cover the header, K, the K/V boundary and V at once;
//   - a stored object that is a header followed by its sections back to back
//     (Reset): K and V of a whole chunk, or the one section of a split K-only
//     or V-only object.
// Hashing uses libxxhash's run-time dispatched XXH3 (AVX2/AVX-512 where the
// CPU has them), as Checksum64 does. Plain value; not thread-safe (one feeder
// at a time; a state handed between threads needs the caller's ordering).
class SectionHashes {
 public:
  static constexpr size_t kMaxSections = 2;
  // Section indices after ResetChunk.
  static constexpr size_t kK = 0;
  static constexpr size_t kV = 1;

  struct Range {
    uint64_t begin = 0;     // buffer offset of the section's first byte
    uint64_t bytes = 0;     // section length
    uint64_t checksum = 0;  // the header's checksum of the section
    uint16_t version = 1;   // the chunk's format version
    Section which = Section::kK;
    SectionLayout layout;   // version 2: where the records and the table are

    // Section `which` of the chunk `h` describes, at buffer offset `begin`.
    static Range Of(const ChunkHeader& h, Section which, uint64_t begin);
  };

  SectionHashes() = default;
  SectionHashes(const SectionHashes&) = delete;
  SectionHashes& operator=(const SectionHashes&) = delete;

  // Starts over with the K section (index kK) and the V section (index kV)
  // of a chunk laid out as `h` says, offsets relative to chunk byte 0.
  void ResetChunk(const ChunkHeader& h);
  // Starts over with `sections`, in order.
  // REQUIRES: sections.size() <= kMaxSections; the sections do not overlap;
  // a version 2 range's bytes equal its layout's.
  void Reset(std::span<const Range> sections);

  // Hashes the bytes of [lo, hi) that lie in a section, each into its
  // section's state; bytes outside every section are skipped. `base` points
  // at buffer byte 0. REQUIRES: lo <= hi; within each section, bytes are fed
  // in order, each once, with no gap (ranges may split anywhere).
  void Update(const uint8_t* base, uint64_t lo, uint64_t hi);

  size_t num_sections() const { return num_sections_; }
  const Range& section(size_t i) const { return sections_[i]; }
  // Whether every byte of section i was fed. REQUIRES: i < num_sections().
  bool Complete(size_t i) const { return hashed_[i] == sections_[i].bytes; }
  // The verdict on section i once Complete(i): OK, or DataLoss as
  // codec::VerifySection words it. FailedPrecondition before.
  // REQUIRES: i < num_sections().
  absl::Status Check(size_t i) const;
  // Whether Check(i) is OK.
  bool Matches(size_t i) const { return Check(i).ok(); }
  // The XXH3-64 of the bytes of section i fed so far (the section's checksum
  // once Complete(i)). REQUIRES: i < num_sections(), a version 1 section.
  uint64_t Digest(size_t i) const;

 private:
  // Opaque storage for libxxhash's XXH3_state_t (xxhash.h stays out of this
  // header); section_hashes.cc static_asserts that it fits.
  static constexpr size_t kStateBytes = 576;
  static constexpr size_t kStateAlign = 64;
  struct alignas(kStateAlign) State {
    unsigned char bytes[kStateBytes];
  };

  // Feeds section i's bytes [a, b) (section offsets), version 2.
  void UpdateRecords(size_t i, const uint8_t* section, uint64_t a, uint64_t b);

  Range sections_[kMaxSections] = {};
  uint64_t hashed_[kMaxSections] = {};  // bytes of each section fed so far
  size_t num_sections_ = 0;
  State states_[kMaxSections];  // the section (v1) or the current record (v2)
  // Version 2: each record's checksum once fed whole, and the table as fed.
  std::vector<uint64_t> records_[kMaxSections];
  std::vector<uint8_t> tables_[kMaxSections];
};

}  // namespace kvtier::codec

#endif  // KVTIER_CODEC_SECTION_HASHES_H_
