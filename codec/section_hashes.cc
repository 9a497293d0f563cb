#include "codec/section_hashes.h"

#include <algorithm>
#include <cstring>
#include <new>

#include "absl/strings/str_cat.h"

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

SectionHashes::Range SectionHashes::Range::Of(const ChunkHeader& h, Section which,
                                              uint64_t begin) {
  const bool is_k = which == Section::kK;
  const SectionLayout& sec = is_k ? h.layout.k : h.layout.v;
  return {begin, sec.bytes, is_k ? h.k_checksum : h.v_checksum, h.layout.version, which, sec};
}

void SectionHashes::ResetChunk(const ChunkHeader& h) {
  static_assert(kK == 0 && kV == 1, "ResetChunk lays out K then V");
  const Range sections[] = {Range::Of(h, Section::kK, h.layout.k_offset),
                            Range::Of(h, Section::kV, h.layout.v_offset)};
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
    if (sections_[i].version >= 2) {
      records_[i].assign(sections_[i].layout.num_layers, 0);
      tables_[i].assign(sections_[i].layout.table_bytes, 0);
    }
  }
}

void SectionHashes::Update(const uint8_t* base, uint64_t lo, uint64_t hi) {
  for (size_t i = 0; i < num_sections_; ++i) {
    const Range& s = sections_[i];
    const uint64_t a = std::max(lo, s.begin), b = std::min(hi, s.begin + s.bytes);
    if (a >= b) continue;
    if (s.version >= 2) {
      UpdateRecords(i, base + s.begin, a - s.begin, b - s.begin);
    } else {
      Feed(AsXxh(states_[i].bytes), base + a, b - a);
    }
    hashed_[i] += b - a;
  }
}

void SectionHashes::UpdateRecords(size_t i, const uint8_t* section, uint64_t a, uint64_t b) {
  const SectionLayout& sec = sections_[i].layout;
  XXH3_state_t* state = AsXxh(states_[i].bytes);
  while (a < b) {
    if (a >= sec.table_offset) {
      std::memcpy(tables_[i].data() + (a - sec.table_offset), section + a, b - a);
      return;
    }
    const auto layer = static_cast<uint32_t>(a / sec.layer_stride);
    const uint64_t start = sec.data_offset(layer), end = start + sec.layer_stride;
    if (a == start) {
      XXH3_64bits_reset_withSeed(
          state, (uint64_t{static_cast<uint8_t>(sections_[i].which)} << 32) | layer);
    }
    const uint64_t n = std::min(b, end) - a;
    Feed(state, section + a, n);
    a += n;
    if (a == end) records_[i][layer] = XXH3_64bits_digest(state);
  }
}

absl::Status SectionHashes::Check(size_t i) const {
  const Range& s = sections_[i];
  if (!Complete(i)) {
    return absl::FailedPreconditionError(
        absl::StrCat("section ", i, ": ", hashed_[i], " of ", s.bytes, " bytes fed"));
  }
  if (s.version >= 2) return CheckRecordTable(s.which, s.layout, s.checksum, records_[i], tables_[i]);
  const uint64_t got = Digest(i);
  if (got == s.checksum) return absl::OkStatus();
  return absl::DataLossError(absl::StrCat(s.which == Section::kK ? "k" : "v",
                                          "_checksum: stored 0x", absl::Hex(s.checksum),
                                          ", computed 0x", absl::Hex(got)));
}

uint64_t SectionHashes::Digest(size_t i) const {
  return XXH3_64bits_digest(AsXxh(states_[i].bytes));
}

}  // namespace kvtier::codec
