#include "common/crypto.h"

#include <string>

#include "gtest/gtest.h"

namespace kvtier {
namespace {

// HmacSha256 length-prefixes each part; the vector is the openssl CLI's
// HMAC over the same prefixed bytes, so the prefix is part of the contract.
TEST(Crypto, HmacSha256LengthPrefixesEachPart) {
  const std::string key = "Jefe";
  auto ab_c = HmacSha256(AsBytes(key), {"ab", "c"});
  auto a_bc = HmacSha256(AsBytes(key), {"a", "bc"});
  EXPECT_NE(ab_c, a_bc);
  EXPECT_EQ(ab_c, HmacSha256(AsBytes(key), {"ab", "c"}));
  EXPECT_NE(ab_c, HmacSha256(AsBytes(std::string("Jefe2")), {"ab", "c"}));
  // u32 LE 3 || "abc" under HMAC-SHA256 with key "Jefe" (computed with
  // `printf '\x03\x00\x00\x00abc' | openssl dgst -sha256 -hmac Jefe`).
  EXPECT_EQ(HexOf(HmacSha256(AsBytes(key), {"abc"})),
            "f99d7f9ffc671647a4303f9b4e94d336208adcd6c1cca8f69a551d7d37ce41ff");
}

// RFC 5869 test case 1.
TEST(Crypto, HkdfSha256MatchesRfc5869) {
  std::string ikm(22, '\x0b');
  std::string salt;
  for (int i = 0; i <= 0x0c; ++i) salt.push_back(static_cast<char>(i));
  std::string info;
  for (int i = 0xf0; i <= 0xf9; ++i) info.push_back(static_cast<char>(i));
  uint8_t okm[42];
  ASSERT_TRUE(HkdfSha256(AsBytes(ikm), salt, info, okm).ok());
  EXPECT_EQ(HexOf(okm),
            "3cb25f25faacd57a90434f64d0362f2a2d2d0a90cf1a5a4c5db02d56ecc4c5bf34007208d5b887185865");
  EXPECT_EQ(HkdfSha256({}, salt, info, okm).code(), absl::StatusCode::kInvalidArgument);
  std::vector<uint8_t> huge(255 * 32 + 1);
  EXPECT_EQ(HkdfSha256(AsBytes(ikm), salt, info, huge).code(), absl::StatusCode::kInvalidArgument);
}

TEST(Crypto, SecureRandomFillsDistinctNonces) {
  std::array<uint8_t, 32> a{}, b{};
  ASSERT_TRUE(SecureRandom(a).ok());
  ASSERT_TRUE(SecureRandom(b).ok());
  EXPECT_NE(a, b);
  EXPECT_NE(a, (std::array<uint8_t, 32>{}));
}

TEST(Crypto, ConstantTimeEqualsComparesWholeSecrets) {
  EXPECT_TRUE(ConstantTimeEquals("s3cret-token", "s3cret-token"));
  EXPECT_FALSE(ConstantTimeEquals("s3cret-token", "s3cret-tokeN"));
  EXPECT_FALSE(ConstantTimeEquals("s3cret", "s3cret-token"));
  EXPECT_FALSE(ConstantTimeEquals("s3cret-token-and-more", "s3cret-token"));
  EXPECT_FALSE(ConstantTimeEquals("", "x"));
  EXPECT_TRUE(ConstantTimeEquals("", ""));
  // A NUL padding byte in `given` does not match the padding used inside.
  EXPECT_FALSE(ConstantTimeEquals(std::string("ab\0", 3), "ab"));
}

}  // namespace
}  // namespace kvtier
