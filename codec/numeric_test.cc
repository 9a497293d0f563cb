#include "codec/numeric.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "codec/quant.h"
#include "codec/quant_row.h"
#include "gtest/gtest.h"

namespace kvtier::codec {
namespace {

// Independent definition of e4m3 values, from the OCP spec's formula.
float Fp8Reference(uint8_t code) {
  int sign = code >> 7;
  int exp = (code >> 3) & 0xF;
  int mant = code & 7;
  if (exp == 15 && mant == 7) return std::numeric_limits<float>::quiet_NaN();
  float v = exp == 0 ? std::ldexp(static_cast<float>(mant), -9)
                     : std::ldexp(1.0f + mant / 8.0f, exp - 7);
  return sign ? -v : v;
}

// Independent encoder: brute-force nearest finite e4m3 value, ties to the code
// with an even mantissa, saturating at 448.
uint8_t Fp8BruteForce(float x) {
  if (std::isnan(x)) return 0x7F;
  uint8_t sign = std::signbit(x) ? 0x80 : 0;
  double a = std::fabs(static_cast<double>(x));
  if (a > 448.0) return sign | 0x7E;
  uint8_t best = 0;
  double best_err = std::numeric_limits<double>::infinity();
  for (int c = 0; c <= 0x7E; ++c) {
    double err = std::fabs(Fp8Reference(static_cast<uint8_t>(c)) - a);
    if (err < best_err || (err == best_err && (c & 1) == 0)) {
      best = static_cast<uint8_t>(c);
      best_err = err;
    }
  }
  return sign | best;
}

TEST(Fp8E4M3, DecodesAll256CodesLikeTheSpec) {
  for (int c = 0; c < 256; ++c) {
    float got = Fp8E4M3ToFloat(static_cast<uint8_t>(c));
    float want = Fp8Reference(static_cast<uint8_t>(c));
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << c;
    } else {
      EXPECT_EQ(FloatBits(got), FloatBits(want)) << "code " << c;
    }
  }
  EXPECT_EQ(Fp8E4M3ToFloat(0x7E), 448.0f);
  EXPECT_EQ(Fp8E4M3ToFloat(0x01), std::ldexp(1.0f, -9));
  EXPECT_EQ(Fp8E4M3ToFloat(0x08), std::ldexp(1.0f, -6));
}

TEST(Fp8E4M3, EncodesEveryFiniteCodeToItself) {
  for (int c = 0; c < 256; ++c) {
    if ((c & 0x7F) == 0x7F) continue;  // NaN codes
    EXPECT_EQ(FloatToFp8E4M3(Fp8E4M3ToFloat(static_cast<uint8_t>(c))), c) << "code " << c;
  }
}

TEST(Fp8E4M3, RoundsToNearestEvenAtEveryBoundary) {
  for (int c = 0; c < 0x7E; ++c) {
    for (uint8_t sign : {uint8_t{0}, uint8_t{0x80}}) {
      float lo = Fp8Reference(static_cast<uint8_t>(c));
      float hi = Fp8Reference(static_cast<uint8_t>(c + 1));
      float mid = (lo + hi) / 2;  // exact: both have few mantissa bits
      float s = sign ? -1.0f : 1.0f;
      uint8_t even = (c & 1) == 0 ? static_cast<uint8_t>(c) : static_cast<uint8_t>(c + 1);
      EXPECT_EQ(FloatToFp8E4M3(s * mid), sign | even) << "midpoint after code " << c;
      EXPECT_EQ(FloatToFp8E4M3(s * std::nextafter(mid, 0.0f)), sign | c) << c;
      EXPECT_EQ(FloatToFp8E4M3(s * std::nextafter(mid, 1e9f)), sign | (c + 1)) << c;
    }
  }
}

TEST(Fp8E4M3, SaturatesOverflowAndInfinityAndKeepsNaN) {
  EXPECT_EQ(FloatToFp8E4M3(448.0f), 0x7E);
  EXPECT_EQ(FloatToFp8E4M3(463.9f), 0x7E);
  EXPECT_EQ(FloatToFp8E4M3(464.0f), 0x7E);
  EXPECT_EQ(FloatToFp8E4M3(1e30f), 0x7E);
  EXPECT_EQ(FloatToFp8E4M3(-1e30f), 0xFE);
  EXPECT_EQ(FloatToFp8E4M3(std::numeric_limits<float>::infinity()), 0x7E);
  EXPECT_EQ(FloatToFp8E4M3(-std::numeric_limits<float>::infinity()), 0xFE);
  EXPECT_EQ(FloatToFp8E4M3(std::numeric_limits<float>::quiet_NaN()), 0x7F);
  EXPECT_EQ(FloatToFp8E4M3(-std::numeric_limits<float>::quiet_NaN()), 0x7F);  // as the GPU does
  EXPECT_EQ(FloatToFp8E4M3(0.0f), 0x00);
  EXPECT_EQ(FloatToFp8E4M3(-0.0f), 0x80);
  EXPECT_EQ(FloatToFp8E4M3(std::ldexp(1.0f, -10)), 0x00);  // tie between 0 and 2^-9: even
  EXPECT_EQ(FloatToFp8E4M3(std::nextafter(std::ldexp(1.0f, -10), 1.0f)), 0x01);
  EXPECT_EQ(FloatToFp8E4M3(std::numeric_limits<float>::denorm_min()), 0x00);
}

TEST(Fp8E4M3, MatchesBruteForceOnRandomFloats) {
  std::mt19937 rng(1234);
  std::uniform_int_distribution<int> exp(-14, 10);
  std::uniform_real_distribution<float> mant(1.0f, 2.0f);
  for (int i = 0; i < 200000; ++i) {
    float x = std::ldexp(mant(rng), exp(rng)) * ((i & 1) ? -1.0f : 1.0f);
    ASSERT_EQ(FloatToFp8E4M3(x), Fp8BruteForce(x)) << x;
  }
}

// The row encoder (SIMD where the host has it) gives QuantizeFp8's bits for
// every 16-bit value of both source types, at scales that put values in
// every e4m3 range (ties, subnormals, saturation, NaN and infinities
// included), and at lengths and offsets that leave a scalar tail.
TEST(Fp8E4M3, RowMatchesTheScalarEncoderOnEvery16BitValue) {
  std::vector<uint16_t> all(65536);
  for (uint32_t i = 0; i < all.size(); ++i) all[i] = static_cast<uint16_t>(i);
  const float scales[] = {1.0f, 0.5f, 3.0f, 1.0f / 3.0f, 7.3e-3f, 448.0f / 65504.0f,
                          0x1p-10f, 1e-30f, 1e30f, 0x1p-149f};
  for (DType t : {DType::kBF16, DType::kFP16}) {
    for (float scale : scales) {
      for (auto [offset, n] : {std::pair<uint32_t, uint32_t>{0, 65536}, {3, 65536 - 10}}) {
        std::vector<uint8_t> row(n);
        QuantizeFp8Row(all.data() + offset, t, scale, row.data(), n);
        for (uint32_t i = 0; i < n; ++i) {
          const uint16_t bits = all[offset + i];
          ASSERT_EQ(row[i], QuantizeFp8(Load16(bits, t), scale))
              << (t == DType::kBF16 ? "bf16 " : "fp16 ") << std::hex << bits << " scale "
              << scale;
        }
      }
    }
  }
}

TEST(Fp16, MatchesCompilerConversionOnAll16BitValues) {
  for (uint32_t h = 0; h < 65536; ++h) {
    _Float16 f;
    uint16_t bits = static_cast<uint16_t>(h);
    std::memcpy(&f, &bits, 2);
    float want = static_cast<float>(f);
    float got = Fp16ToFloat(bits);
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got));
    } else {
      ASSERT_EQ(FloatBits(got), FloatBits(want)) << h;
      ASSERT_EQ(FloatToFp16(got), bits) << h;
    }
  }
}

TEST(Fp16, RoundsLikeTheCompilerOnAFloatSweep) {
  // Every 997th float bit pattern, plus the neighbourhood of the subnormal
  // and overflow boundaries.
  std::vector<uint32_t> patterns;
  for (uint64_t u = 0; u < (uint64_t{1} << 32); u += 997) patterns.push_back(static_cast<uint32_t>(u));
  for (float edge : {65504.0f, 65520.0f, 6.1035156e-05f, 5.9604645e-08f, 2.9802322e-08f}) {
    uint32_t b = FloatBits(edge);
    for (int d = -64; d <= 64; ++d) patterns.push_back(b + d);
  }
  for (uint32_t u : patterns) {
    float x = BitsToFloat(u);
    if (std::isnan(x)) {
      EXPECT_EQ(FloatToFp16(x), kCanonicalNaN16);
      continue;
    }
    _Float16 h = static_cast<_Float16>(x);
    uint16_t want;
    std::memcpy(&want, &h, 2);
    ASSERT_EQ(FloatToFp16(x), want) << std::hexfloat << x;
  }
}

TEST(Bf16, RoundTripsAndRoundsToNearestEven) {
  for (uint32_t h = 0; h < 65536; ++h) {
    uint16_t bits = static_cast<uint16_t>(h);
    float f = Bf16ToFloat(bits);
    if (std::isnan(f)) {
      EXPECT_EQ(FloatToBf16(f), kCanonicalNaN16);
      continue;
    }
    ASSERT_EQ(FloatToBf16(f), bits);
    // Halfway to the next bf16 value: ties go to the even one.
    uint32_t fb = FloatBits(f);
    if ((fb & 0x7F800000u) == 0x7F800000u) continue;
    float mid = BitsToFloat(fb | 0x8000u);
    uint16_t even = (bits & 1) ? static_cast<uint16_t>(bits + 1) : bits;
    ASSERT_EQ(FloatToBf16(mid), even) << h;
    ASSERT_EQ(FloatToBf16(BitsToFloat((fb | 0x8000u) + 1)), static_cast<uint16_t>(bits + 1)) << h;
  }
}

TEST(RoundHalfEven, TiesGoToEven) {
  EXPECT_EQ(RoundHalfEven(0.5f), 0);
  EXPECT_EQ(RoundHalfEven(1.5f), 2);
  EXPECT_EQ(RoundHalfEven(2.5f), 2);
  EXPECT_EQ(RoundHalfEven(-2.5f), -2);
  EXPECT_EQ(RoundHalfEven(-3.5f), -4);
  EXPECT_EQ(RoundHalfEven(6.49f), 6);
  EXPECT_EQ(RoundHalfEven(-126.7f), -127);
}

}  // namespace
}  // namespace kvtier::codec
