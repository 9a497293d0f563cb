#include "codec/chunk.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"

#include "codec/codec.h"
#include "common/coding.h"
#include "codec/test_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvtier::codec {
namespace {

using ::testing::HasSubstr;

std::vector<uint8_t> SmallChunk(SectionFormat k = {DType::kFP16, ScaleGranularity::kNone},
                                SectionFormat v = {DType::kFP8E4M3,
                                                   ScaleGranularity::kPerBlockHead},
                                uint16_t version = kVersion) {
  Geometry g{2, 2, 8, 5, 4};
  auto spec = testing::MakeSpec(g, DType::kFP16, k, v);
  spec.version = version;
  auto kd = testing::MakeKv(g, DType::kFP16, {.seed = 1});
  auto vd = testing::MakeKv(g, DType::kFP16, {.seed = 2});
  auto chunk = EncodeChunk(spec, {kd, vd});
  EXPECT_TRUE(chunk.ok()) << chunk.status();
  return *chunk;
}

// Rewrites the header checksum so a crafted header passes it and faces the
// field checks.
void Reseal(std::vector<uint8_t>& c) {
  uint64_t sum = Checksum64({c.data(), kOffHeaderChecksum});
  std::memcpy(c.data() + kOffHeaderChecksum, &sum, 8);
}

template <typename T>
void Put(std::vector<uint8_t>& c, size_t off, T v) {
  std::memcpy(c.data() + off, &v, sizeof(T));
}

void ExpectError(const std::vector<uint8_t>& c, absl::StatusCode code, const char* field) {
  auto r = VerifyChunk(c);
  EXPECT_EQ(r.status().code(), code) << field << ": " << r.status();
  EXPECT_THAT(r.status().message(), HasSubstr(field));
}

TEST(Chunk, HeaderRoundTrips) {
  auto c = SmallChunk();
  auto h = VerifyChunk(c);
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_EQ(h->spec.geometry, (Geometry{2, 2, 8, 5, 4}));
  EXPECT_EQ(h->spec.dtype, DType::kFP16);
  EXPECT_EQ(h->spec.v.dtype, DType::kFP8E4M3);
  EXPECT_EQ(h->layout.total_bytes, c.size());
  EXPECT_EQ(std::memcmp(c.data(), "KVTC", 4), 0);
}

TEST(Chunk, EveryTruncationIsRejected) {
  auto c = SmallChunk();
  for (size_t n = 0; n < c.size(); ++n) {
    auto r = VerifyChunk({c.data(), n});
    ASSERT_FALSE(r.ok()) << n;
    if (n < kHeaderSize) {
      EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << n;
      EXPECT_THAT(r.status().message(), HasSubstr("header")) << n;
    } else {
      EXPECT_EQ(r.status().code(), absl::StatusCode::kDataLoss) << n;
      EXPECT_THAT(r.status().message(), HasSubstr("length")) << n;
    }
  }
}

TEST(Chunk, TrailingBytesAreRejected) {
  auto c = SmallChunk();
  c.push_back(0);
  ExpectError(c, absl::StatusCode::kDataLoss, "length");
}

constexpr SectionFormat kFp16{DType::kFP16, ScaleGranularity::kNone};
constexpr SectionFormat kFp8{DType::kFP8E4M3, ScaleGranularity::kPerBlockHead};

class ChunkVersions : public ::testing::TestWithParam<uint16_t> {};
INSTANTIATE_TEST_SUITE_P(V1AndV2, ChunkVersions, ::testing::Values(1, 2));

TEST_P(ChunkVersions, EverySingleBitFlipIsDetected) {
  auto c = SmallChunk(kFp16, kFp8, GetParam());
  auto parsed = ParseHeader(c);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->layout.version, GetParam());
  const uint64_t v_offset = parsed->layout.v_offset;
  for (size_t byte = 0; byte < c.size(); ++byte) {
    for (int bit = 0; bit < 8; ++bit) {
      c[byte] ^= static_cast<uint8_t>(1u << bit);
      auto r = VerifyChunk(c);
      ASSERT_FALSE(r.ok()) << "flip at byte " << byte << " bit " << bit;
      absl::StatusCode code = r.status().code();
      EXPECT_TRUE(code == absl::StatusCode::kDataLoss || code == absl::StatusCode::kInvalidArgument)
          << r.status();
      if (byte >= kHeaderSize) {
        EXPECT_EQ(code, absl::StatusCode::kDataLoss);
        const char* sec = byte < v_offset ? "k" : "v";
        EXPECT_THAT(r.status().message(),
                    ::testing::AnyOf(HasSubstr(absl::StrCat(sec, "_checksum")),
                                     HasSubstr(absl::StrCat(sec, " record "))))
            << "flip at byte " << byte;
      }
      c[byte] ^= static_cast<uint8_t>(1u << bit);
    }
  }
  EXPECT_TRUE(VerifyChunk(c).ok());
}

TEST(Chunk, HeaderBitFlipIsDataLossNamingTheChecksum) {
  auto c = SmallChunk();
  c[kOffNumTokens] ^= 1;
  ExpectError(c, absl::StatusCode::kDataLoss, "header_checksum");
}

TEST(Chunk, WrongMagicVersionAndHeaderSizeAreInvalidArgument) {
  auto c = SmallChunk();
  auto m = c;
  m[0] = 'X';
  ExpectError(m, absl::StatusCode::kInvalidArgument, "magic");
  auto v = c;
  Put<uint16_t>(v, kOffVersion, 3);
  Reseal(v);
  ExpectError(v, absl::StatusCode::kInvalidArgument, "version");
  auto hs = c;
  Put<uint16_t>(hs, kOffHeaderSize, 64);
  Reseal(hs);
  ExpectError(hs, absl::StatusCode::kInvalidArgument, "header_size");
}

TEST(Chunk, CraftedHeadersWithValidChecksumStillFaceFieldChecks) {
  auto base = SmallChunk();
  struct Case {
    size_t off;
    uint64_t value;
    int width;
    const char* field;
  } cases[] = {
      {kOffNumLayers, 0, 4, "num_layers"},
      {kOffNumLayers, 0xFFFFFFFF, 4, "num_layers"},
      {kOffNumKvHeads, 5000, 4, "num_kv_heads"},
      {kOffHeadDim, 0, 4, "head_dim"},
      {kOffNumTokens, 0x7FFFFFFF, 4, "num_tokens"},
      {kOffBlockSize, 0, 4, "block_size"},
      {kOffDType, 3, 1, "dtype"},
      {kOffKFormat, 0, 1, "k_format"},
      {kOffVFormat, 200, 1, "v_format"},
      {kOffVGranularity, 0, 1, "v_granularity"},
      {kOffKGranularity, 9, 1, "k_granularity"},
      {kOffScaleDType, 2, 1, "scale_dtype"},
      {kOffFlags, 0x8000, 2, "flags"},
      {kOffReserved0, 1, 4, "reserved"},
      {kOffReserved1 + 31, 1, 1, "reserved"},
      {kOffKSectionBytes, ~uint64_t{0}, 8, "k_section_bytes"},
      {kOffVSectionBytes, uint64_t{1} << 62, 8, "v_section_bytes"},
      {kOffVSectionBytes, 16, 8, "v_section_bytes"},
  };
  for (const Case& k : cases) {
    auto c = base;
    switch (k.width) {
      case 1: c[k.off] = static_cast<uint8_t>(k.value); break;
      case 2: Put<uint16_t>(c, k.off, static_cast<uint16_t>(k.value)); break;
      case 4: Put<uint32_t>(c, k.off, static_cast<uint32_t>(k.value)); break;
      default: Put<uint64_t>(c, k.off, k.value); break;
    }
    Reseal(c);
    ExpectError(c, absl::StatusCode::kInvalidArgument, k.field);
  }
}

TEST(Chunk, SixteenBitSectionMustUseTheChunkDtype) {
  auto c = SmallChunk();
  c[kOffKFormat] = static_cast<uint8_t>(DType::kBF16);
  Reseal(c);
  ExpectError(c, absl::StatusCode::kInvalidArgument, "k_format");
}

TEST(Chunk, SectionsVerifyAlone) {
  auto c = SmallChunk();
  auto h = ParseHeader(c);
  ASSERT_TRUE(h.ok());
  std::span<const uint8_t> all(c);
  auto k = all.subspan(h->layout.k_offset, h->layout.k.bytes);
  auto v = all.subspan(h->layout.v_offset, h->layout.v.bytes);
  EXPECT_TRUE(VerifySection(*h, Section::kK, k).ok());
  EXPECT_TRUE(VerifySection(*h, Section::kV, v).ok());
  EXPECT_EQ(VerifySection(*h, Section::kV, k).code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(VerifySection(*h, Section::kV, v.first(v.size() - 1)).code(),
            absl::StatusCode::kDataLoss);
  std::vector<uint8_t> vcopy(v.begin(), v.end());
  vcopy[3] ^= 0x10;
  auto s = VerifySection(*h, Section::kV, vcopy);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(s.message(), HasSubstr("v record 0"));
}

TEST_P(ChunkVersions, SealFillsInChecksumsOfAnUnsealedChunk) {
  auto c = SmallChunk(kFp16, kFp8, GetParam());
  auto sealed = c;
  auto h = ParseHeader(c);
  ASSERT_TRUE(h.ok()) << h.status();
  std::memset(c.data() + kOffKChecksum, 0, 16);
  std::memset(c.data() + kOffHeaderChecksum, 0, 8);
  // The tables too (version 2): Seal writes them, padding included.
  std::memset(c.data() + h->layout.k_offset + h->layout.k.table_offset, 0xAB,
              h->layout.k.table_bytes);
  std::memset(c.data() + h->layout.v_offset + h->layout.v.table_offset, 0xCD,
              h->layout.v.table_bytes);
  EXPECT_FALSE(VerifyChunk(c).ok());
  ASSERT_TRUE(SealChunk(c).ok());
  EXPECT_EQ(c, sealed);
  auto short_buf = c;
  short_buf.pop_back();
  EXPECT_EQ(SealChunk(short_buf).code(), absl::StatusCode::kInvalidArgument);
}

TEST(Chunk, AcceptChunkGivesTheHeaderAndBytesOnlyWhenEverythingMatches) {
  auto c = SmallChunk();
  auto h = ParseHeader(c);
  ASSERT_TRUE(h.ok()) << h.status();
  auto v = AcceptChunk(*h, c, absl::OkStatus());
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(v->bytes().data(), c.data());
  EXPECT_EQ(v->bytes().size(), c.size());
  EXPECT_EQ(v->header().layout.total_bytes, c.size());
  auto k = AcceptChunk(*h, c, absl::DataLossError("k record 1: stored ..."));
  EXPECT_EQ(k.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(k.status().message(), HasSubstr("k record 1"));
  auto len = AcceptChunk(*h, std::span<const uint8_t>(c).first(c.size() - 1), absl::OkStatus());
  EXPECT_EQ(len.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(len.status().message(), HasSubstr("length"));
}

TEST(Chunk, VersionOneChunksHaveNoTableAndStayReadable) {
  auto v1 = SmallChunk(kFp16, kFp8, 1);
  auto v2 = SmallChunk(kFp16, kFp8, 2);
  auto h1 = VerifyChunk(v1);
  auto h2 = VerifyChunk(v2);
  ASSERT_TRUE(h1.ok()) << h1.status();
  ASSERT_TRUE(h2.ok()) << h2.status();
  EXPECT_EQ(h1->spec.version, 1);
  EXPECT_EQ(h2->spec.version, 2);
  EXPECT_EQ(h1->layout.k.table_bytes, 0u);
  EXPECT_EQ(h2->layout.k.table_bytes, 16u);  // two layers: 16 bytes, already aligned
  EXPECT_EQ(v2.size(), v1.size() + 32);
  // The records are the same bytes; only the checksums differ.
  EXPECT_EQ(std::memcmp(v1.data() + kHeaderSize, v2.data() + kHeaderSize, h1->layout.k.bytes), 0);
  // Decoding either gives the same values.
  auto d1 = DecodeChunk(v1);
  auto d2 = DecodeChunk(v2);
  ASSERT_TRUE(d1.ok() && d2.ok());
  EXPECT_EQ(d1->k, d2->k);
  EXPECT_EQ(d1->v, d2->v);
}

TEST(Chunk, UnknownVersionsAreInvalidArgument) {
  for (uint16_t version : {uint16_t{0}, uint16_t{3}, uint16_t{0xFFFF}}) {
    auto c = SmallChunk();
    Put<uint16_t>(c, kOffVersion, version);
    Reseal(c);
    ExpectError(c, absl::StatusCode::kInvalidArgument, "version");
  }
}

TEST(Chunk, RecordsMovedBetweenLayersOrSectionsAreDetected) {
  // Same formats in K and V, so records of one fit the other's place.
  auto c = SmallChunk(kFp16, kFp16);
  auto h = ParseHeader(c);
  ASSERT_TRUE(h.ok()) << h.status();
  const SectionLayout& k = h->layout.k;
  // Swap K records 0 and 1 together with their table entries: each record
  // still matches its entry's value, but not its layer's seed.
  auto swapped = c;
  uint8_t* ks = swapped.data() + h->layout.k_offset;
  std::swap_ranges(ks, ks + k.layer_stride, ks + k.layer_stride);
  std::swap_ranges(ks + k.table_offset, ks + k.table_offset + 8, ks + k.table_offset + 8);
  EXPECT_EQ(VerifyChunk(swapped).status().code(), absl::StatusCode::kDataLoss);
  // K record 0 copied over V record 0 with its table entry.
  auto moved = c;
  uint8_t* vs = moved.data() + h->layout.v_offset;
  std::memcpy(vs, moved.data() + h->layout.k_offset, k.layer_stride);
  std::memcpy(vs + h->layout.v.table_offset, moved.data() + h->layout.k_offset + k.table_offset, 8);
  EXPECT_EQ(VerifyChunk(moved).status().code(), absl::StatusCode::kDataLoss);
}

TEST(Chunk, RecordTableCheckOfALayerRangeNamesTheRecordThatDiffers) {
  // A reader that hashed only some layers (a GPU load of a layer range)
  // checks the whole table against the header and those layers' entries.
  auto c = SmallChunk();
  auto h = ParseHeader(c);
  ASSERT_TRUE(h.ok()) << h.status();
  const SectionLayout& v = h->layout.v;
  ASSERT_GE(v.num_layers, 2u);
  std::span<const uint8_t> vs = std::span<const uint8_t>(c).subspan(h->layout.v_offset, v.bytes);
  std::span<const uint8_t> table = vs.subspan(v.table_offset, v.table_bytes);
  std::vector<uint64_t> last = {StoredRecordChecksum(v, vs, v.num_layers - 1)};
  EXPECT_TRUE(CheckRecordTable(Section::kV, v, h->v_checksum, last, table, v.num_layers - 1).ok());
  last[0] ^= 1;
  absl::Status bad = CheckRecordTable(Section::kV, v, h->v_checksum, last, table, v.num_layers - 1);
  EXPECT_EQ(bad.code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(bad.message().find("v record " + std::to_string(v.num_layers - 1)), std::string::npos)
      << bad.message();
  // The table itself against the header, whatever the range.
  last[0] ^= 1;
  EXPECT_EQ(CheckRecordTable(Section::kV, v, h->v_checksum ^ 1, last, table, v.num_layers - 1)
                .code(),
            absl::StatusCode::kDataLoss);
}

TEST(Chunk, RecordChecksumsAreSeededXxh3) {
  // FORMAT.md "Record checksums": XXH3-64 with seed (section << 32) | layer.
  const std::vector<uint8_t> bytes = {'k', 'v', 't', 'i', 'e', 'r'};
  EXPECT_EQ(RecordChecksum(Section::kK, 0, bytes), Checksum64(bytes, 0));
  EXPECT_EQ(RecordChecksum(Section::kK, 7, bytes), Checksum64(bytes, 7));
  EXPECT_EQ(RecordChecksum(Section::kV, 7, bytes), Checksum64(bytes, (uint64_t{1} << 32) | 7));
  EXPECT_NE(RecordChecksum(Section::kK, 7, bytes), RecordChecksum(Section::kV, 7, bytes));
}

TEST(Chunk, MatchesFormatTestVectors) {
  // FORMAT.md "Record checksums", "Test vectors".
  ChunkSpec spec;
  spec.geometry = {2, 1, 8, 4, 4};
  spec.dtype = DType::kFP16;
  spec.k = spec.v = {DType::kFP16, ScaleGranularity::kNone};
  std::vector<uint16_t> k(2 * 4 * 8), v(k.size());
  for (uint32_t l = 0; l < 2; ++l) {
    for (uint32_t t = 0; t < 4; ++t) {
      for (uint32_t d = 0; d < 8; ++d) {
        const size_t i = (l * 4 + t) * 8 + d;
        k[i] = static_cast<uint16_t>(0x3C00 + 64 * l + 8 * t + d);
        v[i] = static_cast<uint16_t>(k[i] + 0x0400);
      }
    }
  }
  auto c = EncodeChunk(spec, {k, v});
  ASSERT_TRUE(c.ok()) << c.status();
  auto h = VerifyChunk(*c);
  ASSERT_TRUE(h.ok()) << h.status();
  std::span<const uint8_t> ks = std::span<const uint8_t>(*c).subspan(h->layout.k_offset, h->layout.k.bytes);
  std::span<const uint8_t> vs = std::span<const uint8_t>(*c).subspan(h->layout.v_offset, h->layout.v.bytes);
  EXPECT_EQ(c->size(), 128u + 2 * (2 * 64 + 16));
  EXPECT_EQ(StoredRecordChecksum(h->layout.k, ks, 0), 0xc68905c7bbe42830ull);
  EXPECT_EQ(StoredRecordChecksum(h->layout.k, ks, 1), 0x75778c2688c25553ull);
  EXPECT_EQ(StoredRecordChecksum(h->layout.v, vs, 0), 0x23c57bd72930462cull);
  EXPECT_EQ(StoredRecordChecksum(h->layout.v, vs, 1), 0xaf00af954b80ace0ull);
  EXPECT_EQ(h->k_checksum, 0x5d82b37539943545ull);
  EXPECT_EQ(h->v_checksum, 0x88f6e3c109f2c4dull);
  EXPECT_EQ(LoadLE<uint64_t>(c->data() + kOffHeaderChecksum), 0xf6ae37d5bbfa0df8ull);
}

}  // namespace
}  // namespace kvtier::codec
