#include "codec/chunk.h"

#include <cstring>

#include "codec/codec.h"
#include "codec/test_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvtier::codec {
namespace {

using ::testing::HasSubstr;

std::vector<uint8_t> SmallChunk(SectionFormat k = {DType::kFP16, ScaleGranularity::kNone},
                                SectionFormat v = {DType::kFP8E4M3,
                                                   ScaleGranularity::kPerBlockHead}) {
  Geometry g{2, 2, 8, 5, 4};
  auto spec = testing::MakeSpec(g, DType::kFP16, k, v);
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

TEST(Chunk, EverySingleBitFlipIsDetected) {
  auto c = SmallChunk();
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
        EXPECT_THAT(r.status().message(), HasSubstr(byte < kHeaderSize + 2 * 2 * 5 * 2 * 8
                                                        ? "k_checksum"
                                                        : "_checksum"));
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
  Put<uint16_t>(v, kOffVersion, 2);
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
  EXPECT_THAT(s.message(), HasSubstr("v_checksum"));
}

TEST(Chunk, SealFillsInChecksumsOfAnUnsealedChunk) {
  auto c = SmallChunk();
  auto sealed = c;
  std::memset(c.data() + kOffKChecksum, 0, 16);
  std::memset(c.data() + kOffHeaderChecksum, 0, 8);
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
  auto v = AcceptChunk(*h, c, h->k_checksum, h->v_checksum);
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(v->bytes().data(), c.data());
  EXPECT_EQ(v->bytes().size(), c.size());
  EXPECT_EQ(v->header().layout.total_bytes, c.size());
  auto k = AcceptChunk(*h, c, h->k_checksum ^ 1, h->v_checksum);
  EXPECT_EQ(k.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(k.status().message(), HasSubstr("k_checksum"));
  auto vs = AcceptChunk(*h, c, h->k_checksum, h->v_checksum ^ 1);
  EXPECT_EQ(vs.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(vs.status().message(), HasSubstr("v_checksum"));
  auto len = AcceptChunk(*h, std::span<const uint8_t>(c).first(c.size() - 1), h->k_checksum,
                         h->v_checksum);
  EXPECT_EQ(len.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(len.status().message(), HasSubstr("length"));
}

}  // namespace
}  // namespace kvtier::codec
