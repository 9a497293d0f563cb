#include "codec/section_hashes.h"

#include <algorithm>
#include <new>

#define XXH_STATIC_LINKING_ONLY  // XXH3_state_t's definition
#include "xxhash.h"
#if defined(__x86_64__)
// libxxhash's run-time dispatch, as common/hash.cc's Checksum64: the
// AVX2/AVX-512 kernel where the CPU has it; the values are the same.
#include "xxh_x86dispatch.h"
#endif

namespace kvtier::codec {
namespace {

XXH3_state_t* AsXxh(void* storage) { return std::launder(static_cast<XXH3_state_t*>(storage)); }
const XXH3_state_t* AsXxh(const void* storage) {
  return std::launder(static_cast<const XXH3_state_t*>(storage));
}

void Feed(XXH3_state_t* state, const uint8_t* p, size_t n) {
#if defined(__x86_64__)
  XXH3_64bits_update_dispatch(state, p, n);
#else
  XXH3_64bits_update(state, p, n);
#endif
}

}  // namespace

void SectionHashes::ResetChunk(const ChunkHeader& h) {
  static_assert(kK == 0 && kV == 1, "ResetChunk lays out K then V");
  const Range sections[] = {{h.layout.k_offset, h.layout.k.bytes, h.k_checksum},
                            {h.layout.v_offset, h.layout.v.bytes, h.v_checksum}};
  Reset(sections);
}

void SectionHashes::Reset(std::span<const Range> sections) {
  static_assert(sizeof(XXH3_state_t) <= kStateBytes, "State must hold an XXH3_state_t");
  static_assert(alignof(XXH3_state_t) <= kStateAlign, "State must be aligned as XXH3_state_t");
  num_sections_ = std::min(sections.size(), kMaxSections);
  for (size_t i = 0; i < num_sections_; ++i) {
    sections_[i] = sections[i];
    hashed_[i] = 0;
    XXH3_64bits_reset(::new (states_[i].bytes) XXH3_state_t);
  }
}

void SectionHashes::Update(const uint8_t* base, uint64_t lo, uint64_t hi) {
  for (size_t i = 0; i < num_sections_; ++i) {
    const Range& s = sections_[i];
    const uint64_t a = std::max(lo, s.begin), b = std::min(hi, s.begin + s.bytes);
    if (a >= b) continue;
    Feed(AsXxh(states_[i].bytes), base + a, b - a);
    hashed_[i] += b - a;
  }
}

uint64_t SectionHashes::Digest(size_t i) const {
  return XXH3_64bits_digest(AsXxh(states_[i].bytes));
}

}  // namespace kvtier::codec
