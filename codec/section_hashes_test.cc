// codec::SectionHashes against codec::VerifyChunk / VerifySection and
// Checksum64 on real chunks: every way of splitting the bytes gives the
// sections' checksums, and a flipped byte moves the digest of its own section
// only.
#include "codec/section_hashes.h"

#include <algorithm>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "codec/codec.h"
#include "codec/test_util.h"
#include "common/hash.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvtier::codec {
namespace {

using ::testing::HasSubstr;
using Pieces = std::vector<std::pair<uint64_t, uint64_t>>;  // [lo, hi) in feed order

// A chunk whose K section is a few KiB (odd token count, V quantized with
// per-block-head scales), so that byte-at-a-time feeding stays cheap.
constexpr SectionFormat kFp16{DType::kFP16, ScaleGranularity::kNone};
constexpr SectionFormat kFp8{DType::kFP8E4M3, ScaleGranularity::kPerBlockHead};

std::vector<uint8_t> RealChunk(SectionFormat k = kFp16, SectionFormat v = kFp8,
                               uint16_t version = kVersion) {
  Geometry g{3, 2, 16, 37, 16};
  auto spec = testing::MakeSpec(g, DType::kFP16, k, v);
  spec.version = version;
  auto kd = testing::MakeKv(g, DType::kFP16, {.seed = 11, .outlier_every = 8});
  auto vd = testing::MakeKv(g, DType::kFP16, {.seed = 12});
  auto chunk = EncodeChunk(spec, {kd, vd});
  EXPECT_TRUE(chunk.ok()) << chunk.status();
  return chunk.ok() ? *chunk : std::vector<uint8_t>();
}

std::span<const uint8_t> KOf(const std::vector<uint8_t>& c, const ChunkHeader& h) {
  return std::span<const uint8_t>(c).subspan(h.layout.k_offset, h.layout.k.bytes);
}
std::span<const uint8_t> VOf(const std::vector<uint8_t>& c, const ChunkHeader& h) {
  return std::span<const uint8_t>(c).subspan(h.layout.v_offset, h.layout.v.bytes);
}

// [from, to) in consecutive pieces of `n` bytes.
Pieces Fixed(uint64_t from, uint64_t to, uint64_t n) {
  Pieces p;
  for (uint64_t o = from; o < to; o += n) p.emplace_back(o, std::min(to, o + n));
  return p;
}

// Every split pattern of a chunk of `size` bytes whose V section starts at
// `v_offset`, named for the failure messages.
std::vector<std::pair<std::string, Pieces>> Splits(uint64_t size, uint64_t k_offset,
                                                   uint64_t v_offset) {
  std::vector<std::pair<std::string, Pieces>> s;
  s.push_back({"whole", {{0, size}}});
  for (uint64_t n : {1, 2, 3, 7, 64, 127, 1000, 4097, 65536}) {
    s.push_back({"pieces of " + std::to_string(n), Fixed(0, size, n)});
  }
  // From the end of the header on, as a copy that copied the header first.
  s.push_back({"after the header, 61", Fixed(k_offset, size, 61)});
  s.push_back({"split at the K/V boundary", {{0, v_offset}, {v_offset, size}}});
  s.push_back({"a piece across the K/V boundary",
               {{0, v_offset - 1}, {v_offset - 1, v_offset + 1}, {v_offset + 1, size}}});
  s.push_back({"header alone, then both sections at once", {{0, k_offset}, {k_offset, size}}});
  // K and V pieces interleaved (a streamed put's order): each section in
  // order on its own, not the chunk.
  {
    Pieces k = Fixed(k_offset, v_offset, 509), v = Fixed(v_offset, size, 263), p{{0, k_offset}};
    for (size_t i = 0; i < std::max(k.size(), v.size()); ++i) {
      if (i < v.size()) p.push_back(v[i]);
      if (i < k.size()) p.push_back(k[i]);
    }
    s.push_back({"V and K interleaved", p});
  }
  {
    std::mt19937 rng(20261122);
    std::uniform_int_distribution<uint64_t> len(0, 3000);
    Pieces p;
    for (uint64_t o = 0; o < size;) {
      const uint64_t hi = std::min(size, o + len(rng));
      p.emplace_back(o, hi);  // empty pieces included
      o = hi;
    }
    s.push_back({"seeded random lengths", p});
  }
  return s;
}

void Feed(SectionHashes& hashes, const std::vector<uint8_t>& c, const Pieces& pieces) {
  for (auto [lo, hi] : pieces) hashes.Update(c.data(), lo, hi);
}

// Each test runs on version 1 (a checksum a section) and 2 (a checksum a
// layer record, and a table).
class SectionHashesVersions : public ::testing::TestWithParam<uint16_t> {};
INSTANTIATE_TEST_SUITE_P(V1AndV2, SectionHashesVersions, ::testing::Values(1, 2));

// The message of a mismatch in section `sec` ("k" or "v").
::testing::Matcher<const std::string&> NamesSection(const std::string& sec) {
  return ::testing::AnyOf(HasSubstr(sec + "_checksum"), HasSubstr(sec + " record "));
}

TEST_P(SectionHashesVersions, ChunkChecksEqualVerifyChunkForEverySplit) {
  for (auto [k, v] : {std::pair<SectionFormat, SectionFormat>{
                          {DType::kFP16, ScaleGranularity::kNone},
                          {DType::kFP8E4M3, ScaleGranularity::kPerBlockHead}},
                      {{DType::kINT8, ScaleGranularity::kPerBlockHead},
                       {DType::kINT4, ScaleGranularity::kPerTokenHead}}}) {
    const std::vector<uint8_t> c = RealChunk(k, v, GetParam());
    auto h = VerifyChunk(c);
    ASSERT_TRUE(h.ok()) << h.status();
    const bool v1 = GetParam() == 1;
    if (v1) {
      ASSERT_EQ(Checksum64(KOf(c, *h)), h->k_checksum);
      ASSERT_EQ(Checksum64(VOf(c, *h)), h->v_checksum);
    }
    for (const auto& [name, pieces] : Splits(c.size(), h->layout.k_offset, h->layout.v_offset)) {
      SCOPED_TRACE(name);
      SectionHashes hashes;
      hashes.ResetChunk(*h);
      ASSERT_EQ(hashes.num_sections(), 2u);
      Feed(hashes, c, pieces);
      EXPECT_TRUE(hashes.Complete(SectionHashes::kK));
      EXPECT_TRUE(hashes.Complete(SectionHashes::kV));
      if (v1) {
        EXPECT_EQ(hashes.Digest(SectionHashes::kK), h->k_checksum);
        EXPECT_EQ(hashes.Digest(SectionHashes::kV), h->v_checksum);
      }
      EXPECT_TRUE(hashes.Check(SectionHashes::kK).ok()) << hashes.Check(SectionHashes::kK);
      EXPECT_TRUE(hashes.Check(SectionHashes::kV).ok()) << hashes.Check(SectionHashes::kV);
    }
  }
}

TEST(SectionHashes, PartialSectionDigestIsThatOfTheBytesFedSoFar) {
  const std::vector<uint8_t> c = RealChunk(kFp16, kFp8, 1);
  auto h = VerifyChunk(c);
  ASSERT_TRUE(h.ok()) << h.status();
  SectionHashes hashes;
  hashes.ResetChunk(*h);
  const uint64_t mid = h->layout.k_offset + h->layout.k.bytes / 2 + 1;
  hashes.Update(c.data(), 0, mid);
  EXPECT_FALSE(hashes.Complete(SectionHashes::kK));
  EXPECT_FALSE(hashes.Complete(SectionHashes::kV));
  EXPECT_EQ(hashes.Digest(SectionHashes::kK),
            Checksum64(std::span<const uint8_t>(c).subspan(h->layout.k_offset,
                                                           mid - h->layout.k_offset)));
  EXPECT_EQ(hashes.Digest(SectionHashes::kV), Checksum64({}));
  EXPECT_FALSE(hashes.Matches(SectionHashes::kK));
  EXPECT_EQ(hashes.Check(SectionHashes::kK).code(), absl::StatusCode::kFailedPrecondition);
  hashes.Update(c.data(), mid, c.size());
  EXPECT_TRUE(hashes.Complete(SectionHashes::kK));
  EXPECT_TRUE(hashes.Matches(SectionHashes::kK));
  EXPECT_TRUE(hashes.Matches(SectionHashes::kV));
}

TEST_P(SectionHashesVersions, FlippedByteFailsItsSectionOnly) {
  const bool v1 = GetParam() == 1;
  const std::vector<uint8_t> clean = RealChunk(kFp16, kFp8, GetParam());
  auto h = VerifyChunk(clean);
  ASSERT_TRUE(h.ok()) << h.status();
  const ChunkLayout& l = h->layout;
  struct Case {
    const char* what;
    uint64_t offset;
    size_t section;  // the digest that must change
  } cases[] = {{"first K byte", l.k_offset, SectionHashes::kK},
               {"middle K byte", l.k_offset + l.k.bytes / 2, SectionHashes::kK},
               {"last K byte", l.k_offset + l.k.bytes - 1, SectionHashes::kK},
               {"first V byte", l.v_offset, SectionHashes::kV},
               {"middle V byte", l.v_offset + l.v.bytes / 3, SectionHashes::kV},
               {"last V byte", l.v_offset + l.v.bytes - 1, SectionHashes::kV}};
  for (const Case& cs : cases) {
    SCOPED_TRACE(cs.what);
    std::vector<uint8_t> c = clean;
    c[cs.offset] ^= 0x10;
    auto r = VerifyChunk(c);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kDataLoss);
    const std::string sec = cs.section == SectionHashes::kK ? "k" : "v";
    EXPECT_THAT(std::string(r.status().message()), NamesSection(sec));
    const size_t other = cs.section == SectionHashes::kK ? SectionHashes::kV : SectionHashes::kK;
    for (const auto& [name, pieces] : Splits(c.size(), l.k_offset, l.v_offset)) {
      SCOPED_TRACE(name);
      SectionHashes hashes;
      hashes.ResetChunk(*h);  // the clean header: its checksums are the stored ones
      Feed(hashes, c, pieces);
      absl::Status st = hashes.Check(cs.section);
      EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss);
      EXPECT_EQ(st.message(), r.status().message());  // VerifyChunk's words
      if (v1) {
        EXPECT_NE(hashes.Digest(cs.section), Checksum64(cs.section == SectionHashes::kK
                                                            ? KOf(clean, *h)
                                                            : VOf(clean, *h)));
        EXPECT_EQ(hashes.Digest(cs.section),
                  Checksum64(cs.section == SectionHashes::kK ? KOf(c, *h) : VOf(c, *h)));
      }
      EXPECT_TRUE(hashes.Matches(other));
    }
  }
}

TEST_P(SectionHashesVersions, HeaderBytesAreNotHashed) {
  std::vector<uint8_t> c = RealChunk(kFp16, kFp8, GetParam());
  auto h = VerifyChunk(c);
  ASSERT_TRUE(h.ok()) << h.status();
  for (size_t i = 0; i < h->layout.k_offset; ++i) c[i] ^= 0xFF;
  SectionHashes hashes;
  hashes.ResetChunk(*h);
  Feed(hashes, c, Fixed(0, c.size(), 100));
  EXPECT_TRUE(hashes.Matches(SectionHashes::kK));
  EXPECT_TRUE(hashes.Matches(SectionHashes::kV));
}

TEST_P(SectionHashesVersions, ResetStartsOver) {
  const std::vector<uint8_t> a = RealChunk(kFp16, kFp8, GetParam());
  const std::vector<uint8_t> b = RealChunk(kFp16, kFp16, GetParam());
  auto ha = VerifyChunk(a);
  auto hb = VerifyChunk(b);
  ASSERT_TRUE(ha.ok()) << ha.status();
  ASSERT_TRUE(hb.ok()) << hb.status();
  SectionHashes hashes;
  hashes.ResetChunk(*ha);
  hashes.Update(a.data(), 0, a.size() - 5);
  hashes.ResetChunk(*hb);
  hashes.Update(b.data(), 0, b.size());
  EXPECT_TRUE(hashes.Matches(SectionHashes::kK));
  EXPECT_TRUE(hashes.Matches(SectionHashes::kV));
  if (GetParam() == 1) {
    EXPECT_EQ(hashes.Digest(SectionHashes::kK), hb->k_checksum);
    EXPECT_EQ(hashes.Digest(SectionHashes::kV), hb->v_checksum);
  }
}

// A stored object as the NVMe tier lays it out: the chunk's header, then the
// sections of `part` back to back.
struct Object {
  std::vector<uint8_t> bytes;
  std::vector<SectionHashes::Range> sections;
};

enum class Part { kWhole, kK, kV };

Object MakeObject(const std::vector<uint8_t>& chunk, const ChunkHeader& h, Part part) {
  Object o;
  o.bytes.assign(chunk.begin(), chunk.begin() + kHeaderSize);
  auto add = [&](std::span<const uint8_t> section, Section which) {
    o.sections.push_back(SectionHashes::Range::Of(h, which, o.bytes.size()));
    o.bytes.insert(o.bytes.end(), section.begin(), section.end());
  };
  if (part != Part::kV) add(KOf(chunk, h), Section::kK);
  if (part != Part::kK) add(VOf(chunk, h), Section::kV);
  return o;
}

// Feeds `o` as prefixes that grow by `n` bytes, as read completions arrive.
void FeedPrefixes(SectionHashes& hashes, const Object& o, uint64_t n) {
  for (uint64_t p = kHeaderSize; p < o.bytes.size(); p += n) {
    hashes.Update(o.bytes.data(), p, std::min<uint64_t>(o.bytes.size(), p + n));
  }
}

TEST_P(SectionHashesVersions, ObjectSectionsMatchVerifySection) {
  const std::vector<uint8_t> c = RealChunk(kFp16, kFp8, GetParam());
  auto h = VerifyChunk(c);
  ASSERT_TRUE(h.ok()) << h.status();
  for (Part part : {Part::kWhole, Part::kK, Part::kV}) {
    const Object o = MakeObject(c, *h, part);
    const size_t want = part == Part::kWhole ? 2 : 1;
    ASSERT_EQ(o.sections.size(), want);
    for (uint64_t n : {1, 5, 128, 4096, 1 << 20}) {
      SCOPED_TRACE(::testing::Message()
                   << "part " << static_cast<int>(part) << ", pieces of " << n);
      SectionHashes hashes;
      hashes.Reset(o.sections);
      ASSERT_EQ(hashes.num_sections(), want);
      FeedPrefixes(hashes, o, n);
      for (size_t i = 0; i < want; ++i) {
        EXPECT_TRUE(hashes.Complete(i));
        EXPECT_TRUE(hashes.Matches(i));
        const SectionHashes::Range& r = hashes.section(i);
        if (GetParam() == 1) {
          EXPECT_EQ(hashes.Digest(i),
                    Checksum64(std::span<const uint8_t>(o.bytes).subspan(r.begin, r.bytes)));
        }
      }
    }
  }
  // A split object's one section is the chunk's section: VerifySection agrees.
  for (auto [part, which] : {std::pair{Part::kK, Section::kK}, std::pair{Part::kV, Section::kV}}) {
    const Object o = MakeObject(c, *h, part);
    EXPECT_TRUE(VerifySection(*h, which,
                              std::span<const uint8_t>(o.bytes).subspan(kHeaderSize))
                    .ok());
  }
}

TEST_P(SectionHashesVersions, FlippedByteInSplitObjectFailsItsSection) {
  const std::vector<uint8_t> c = RealChunk(kFp16, kFp8, GetParam());
  auto h = VerifyChunk(c);
  ASSERT_TRUE(h.ok()) << h.status();
  for (auto [part, which, name] : {std::tuple{Part::kK, Section::kK, "k_checksum"},
                                   std::tuple{Part::kV, Section::kV, "v_checksum"}}) {
    Object o = MakeObject(c, *h, part);
    o.bytes[o.bytes.size() - 2] ^= 0x01;
    absl::Status st =
        VerifySection(*h, which, std::span<const uint8_t>(o.bytes).subspan(kHeaderSize));
    EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss);
    EXPECT_THAT(st.message(), HasSubstr(name));
    SectionHashes hashes;
    hashes.Reset(o.sections);
    FeedPrefixes(hashes, o, 333);
    EXPECT_TRUE(hashes.Complete(0));
    EXPECT_FALSE(hashes.Matches(0));
  }
  // In a whole object, a flipped V byte leaves K matching.
  Object o = MakeObject(c, *h, Part::kWhole);
  o.bytes[o.sections[1].begin] ^= 0x80;
  SectionHashes hashes;
  hashes.Reset(o.sections);
  FeedPrefixes(hashes, o, 1);
  EXPECT_TRUE(hashes.Matches(0));
  EXPECT_FALSE(hashes.Matches(1));
}

}  // namespace
}  // namespace kvtier::codec
