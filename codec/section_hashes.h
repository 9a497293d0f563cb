// Incremental section checksums (FORMAT.md "Header": the K and V checksums
// are XXH3-64, seed 0): hashes the sections of a buffer while its bytes become
// final in order, so that a copy, a streamed write or a read can be checked
// without a second pass over the bytes. The digests equal Checksum64 of the
// whole sections (codec::VerifyChunk, codec::VerifySection).
#ifndef KVTIER_CODEC_SECTION_HASHES_H_
#define KVTIER_CODEC_SECTION_HASHES_H_

#include <cstddef>
#include <cstdint>
#include <span>

#include "codec/chunk.h"

namespace kvtier::codec {

// The XXH3-64 of up to kMaxSections disjoint byte ranges ("sections") of one
// buffer, fed the buffer's bytes as [lo, hi) offset ranges. Two layouts are
// in use:
//   - a whole chunk (ResetChunk): K and V at their chunk offsets, so a range
//     fed may cover the header, K, the K/V boundary and V at once;
//   - a stored object that is a header followed by its sections back to back
//     (Reset): K and V of a whole chunk, or the one section of a split K-only
//     or V-only object.
// Each section carries the checksum it should have, for Matches. Hashing
// uses libxxhash's run-time dispatched XXH3 (AVX2/AVX-512 where the CPU has
// them), as Checksum64 does. Plain value; not thread-safe (one feeder at a
// time; a state handed between threads needs the caller's ordering).
class SectionHashes {
 public:
  static constexpr size_t kMaxSections = 2;
  // Section indices after ResetChunk.
  static constexpr size_t kK = 0;
  static constexpr size_t kV = 1;

  struct Range {
    uint64_t begin = 0;     // buffer offset of the section's first byte
    uint64_t bytes = 0;     // section length
    uint64_t checksum = 0;  // the XXH3-64 the section should have (Matches)
  };

  SectionHashes() = default;
  SectionHashes(const SectionHashes&) = delete;
  SectionHashes& operator=(const SectionHashes&) = delete;

  // Starts over with the K section (index kK) and the V section (index kV)
  // of a chunk laid out as `h` says, offsets relative to chunk byte 0,
  // expecting the header's k_checksum and v_checksum.
  void ResetChunk(const ChunkHeader& h);
  // Starts over with `sections`, in order.
  // REQUIRES: sections.size() <= kMaxSections; the sections do not overlap.
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
  // The XXH3-64 of the bytes of section i fed so far (the section's
  // checksum once Complete(i)). REQUIRES: i < num_sections().
  uint64_t Digest(size_t i) const;
  // Whether section i's digest is its expected checksum.
  // REQUIRES: i < num_sections().
  bool Matches(size_t i) const { return Digest(i) == sections_[i].checksum; }

 private:
  // Opaque storage for libxxhash's XXH3_state_t (xxhash.h stays out of this
  // header); section_hashes.cc static_asserts that it fits.
  static constexpr size_t kStateBytes = 576;
  static constexpr size_t kStateAlign = 64;
  struct alignas(kStateAlign) State {
    unsigned char bytes[kStateBytes];
  };

  Range sections_[kMaxSections] = {};
  uint64_t hashed_[kMaxSections] = {};  // bytes of each section fed so far
  size_t num_sections_ = 0;
  State states_[kMaxSections];
};

}  // namespace kvtier::codec

#endif  // KVTIER_CODEC_SECTION_HASHES_H_
