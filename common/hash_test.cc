#include "common/hash.h"

#include <algorithm>
#include <span>
#include <unordered_set>
#include <vector>

#include "common/checksum_stream.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvtier {
namespace {

using ::testing::HasSubstr;

// Fills the stack below the caller so that an XXH3_state_t (64-byte
// aligned) that the next call at the same depth puts there starts with a
// stale seed field equal to the seed it is reset with (byte 552 of the
// state, word 5 of its 64-byte line), no external secret and a zeroed
// custom secret.
[[gnu::noinline]] uint64_t PoisonStack(uint64_t seed) {
  alignas(64) volatile uint64_t words[4096];
  for (size_t i = 0; i < 4096; ++i) words[i] = i % 8 == 5 ? seed : 0;
  return words[13];
}

[[gnu::noinline]] Hash128 HashInParts(std::span<const uint8_t> a, std::span<const uint8_t> b,
                                      uint64_t seed) {
  return Hash128::OfParts({a, b}, seed);
}

TEST(Hash128, OfPartsIgnoresStaleStackState) {
  const uint64_t seed = 0x6b7674696572'4b59ull;
  std::vector<uint8_t> data(1100);
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<uint8_t>(i * 7);
  const Hash128 want = Hash128::Of(data, seed);
  const std::span<const uint8_t> all(data);
  for (int round = 0; round < 8; ++round) {
    EXPECT_EQ(PoisonStack(seed), seed);
    EXPECT_EQ(HashInParts(all.first(16), all.subspan(16), seed), want) << "round " << round;
  }
}

TEST(Hash128, HexRoundTrips) {
  Hash128 h = Hash128::Of(std::string_view("kvtier"), 7);
  std::string hex = h.ToHex();
  EXPECT_EQ(hex.size(), 32u);
  auto back = Hash128::FromHex(hex);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, h);
}

TEST(Hash128, FromHexAcceptsUpperCase) {
  auto h = Hash128::FromHex("00112233445566778899AABBCCDDEEFF");
  ASSERT_TRUE(h.ok());
  EXPECT_EQ(h->ToHex(), "00112233445566778899aabbccddeeff");
  EXPECT_EQ(h->high64(), 0x0011223344556677ull);
  EXPECT_EQ(h->low64(), 0x8899aabbccddeeffull);
}

TEST(Hash128, FromHexRejectsBadLengthAndCharacters) {
  auto short_hex = Hash128::FromHex("abcd");
  EXPECT_EQ(short_hex.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(short_hex.status().message(), HasSubstr("32 hex digits"));
  auto bad = Hash128::FromHex("zz112233445566778899aabbccddeeff");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(), HasSubstr("position 0"));
  EXPECT_EQ(Hash128::FromHex(std::string(33, 'a')).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Hash128::FromHex("").status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(Hash128, SeedChangesTheHash) {
  EXPECT_NE(Hash128::Of(std::string_view("x"), 1), Hash128::Of(std::string_view("x"), 2));
}

TEST(Hash128, WorksInHashSets) {
  std::unordered_set<Hash128> set;
  for (int i = 0; i < 100; ++i) set.insert(Hash128::Of(std::to_string(i), 0));
  EXPECT_EQ(set.size(), 100u);
}

TEST(Checksum64, MatchesKnownXxh3Value) {
  // XXH3-64 of the empty input with seed 0 (xxHash's published value).
  EXPECT_EQ(Checksum64({}), 0x2D06800538D394C2ull);
}

TEST(Checksum64Stream, PiecesGiveTheChecksumOfTheWhole) {
  std::vector<uint8_t> data(3 * 1024 * 1024 + 77);
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<uint8_t>(i * 131 + (i >> 9));
  const std::span<const uint8_t> all(data);
  for (size_t piece : {size_t{1}, size_t{63}, size_t{4096}, size_t{1} << 20, data.size()}) {
    Checksum64Stream s;
    for (size_t o = 0; o < data.size(); o += piece) {
      s.Update(all.subspan(o, std::min(piece, data.size() - o)));
    }
    EXPECT_EQ(s.Digest(), Checksum64(all)) << "pieces of " << piece;
  }
  Checksum64Stream empty;
  EXPECT_EQ(empty.Digest(), Checksum64({}));
}

}  // namespace
}  // namespace kvtier
