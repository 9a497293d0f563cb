// Bit-exact scalar conversions used by the chunk codec (codec/FORMAT.md,
// "Numeric rules"). Integer-only where rounding matters, so the CPU reference
// and the CUDA kernels produce identical bytes; the GPU tests check these
// against the hardware conversions.
#ifndef KVTIER_CODEC_NUMERIC_H_
#define KVTIER_CODEC_NUMERIC_H_

#include <cmath>
#include <cstdint>
#include <cstring>

#include "common/host_device.h"

namespace kvtier::codec {

KVTIER_HD uint32_t FloatBits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
#endif
}

KVTIER_HD float BitsToFloat(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
#endif
}

// Canonical NaN written when a non-16-bit value is NaN and the target is a
// 16-bit format (what CUDA's cvt.rn.{f16,bf16}.f32 produce).
inline constexpr uint16_t kCanonicalNaN16 = 0x7FFF;
// FP8 e4m3 (OCP "e4m3fn"): no infinities, S.1111.111 is NaN, max finite 448.
inline constexpr uint8_t kFp8MaxFiniteCode = 0x7E;
inline constexpr uint8_t kFp8NaNCode = 0x7F;
inline constexpr float kFp8Max = 448.0f;

// --- 16-bit -> float (exact) ---

KVTIER_HD float Bf16ToFloat(uint16_t h) { return BitsToFloat(static_cast<uint32_t>(h) << 16); }

KVTIER_HD float Fp16ToFloat(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1F;
  uint32_t mant = h & 0x3FF;
  if (exp == 0x1F) return BitsToFloat(sign | 0x7F800000u | (mant << 13));  // inf / NaN
  if (exp == 0) {
    if (mant == 0) return BitsToFloat(sign);
    // Subnormal: mant * 2^-24, exact in float.
    float v = static_cast<float>(mant) * 5.9604644775390625e-08f;
    return sign ? -v : v;
  }
  return BitsToFloat(sign | ((exp + 112) << 23) | (mant << 13));
}

// --- float -> 16-bit, round to nearest even ---

KVTIER_HD uint16_t FloatToBf16(float f) {
  uint32_t u = FloatBits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return kCanonicalNaN16;
  uint32_t rounding = 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>((u + rounding) >> 16);
}

KVTIER_HD uint16_t FloatToFp16(float f) {
  uint32_t u = FloatBits(f);
  uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return kCanonicalNaN16;
  if (a >= 0x477FF000u) return sign | 0x7C00u;  // >= 65520 rounds to inf
  int32_t exp = static_cast<int32_t>(a >> 23) - 127;
  if (exp >= -14) {  // normal half
    uint32_t mant = a & 0x7FFFFFu;
    uint32_t h = (static_cast<uint32_t>(exp + 15) << 10) | (mant >> 13);
    uint32_t rem = mant & 0x1FFFu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;
    return static_cast<uint16_t>(sign | h);
  }
  if (exp < -26) return sign;  // below half the smallest subnormal (2^-25)
  // Subnormal half: value = m * 2^-24 with m = sig * 2^(exp + 1), where the
  // float's value is sig * 2^(exp - 23).
  uint32_t sig = (a & 0x7FFFFFu) | 0x800000u;
  uint32_t shift = static_cast<uint32_t>(-1 - exp);  // 14..25
  uint64_t s = sig;
  uint64_t m = s >> shift;
  uint64_t rem = s & ((uint64_t{1} << shift) - 1);
  uint64_t half = uint64_t{1} << (shift - 1);
  if (rem > half || (rem == half && (m & 1u))) ++m;
  return static_cast<uint16_t>(sign | static_cast<uint16_t>(m));
}

// --- FP8 e4m3 ---

// float -> e4m3, round to nearest even, saturating to +-448 (infinities
// included); any NaN -> 0x7F (the hardware drops a NaN's sign: checked on an
// H100 over all 2^32 float bit patterns). Matches cvt.rn.satfinite.e4m3x2.f32.
KVTIER_HD uint8_t FloatToFp8E4M3(float f) {
  uint32_t u = FloatBits(f);
  uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return kFp8NaNCode;
  if (a > 0x43E00000u) return sign | kFp8MaxFiniteCode;  // > 448
  int32_t exp = static_cast<int32_t>(a >> 23) - 127;
  uint32_t mant = a & 0x7FFFFFu;
  if (exp >= -6) {  // normal e4m3
    uint32_t q = (static_cast<uint32_t>(exp + 7) << 3) | (mant >> 20);
    uint32_t rem = mant & 0xFFFFFu;
#if defined(__CUDA_ARCH__)
    // The device predicates this branch itself.
    if (rem > 0x80000u || (rem == 0x80000u && (q & 1u))) ++q;
#else
    // The same rounding (half to even) without a branch: the remainder is at
    // or above half about as often as not, so on the host a branch here
    // mispredicts on real data (half of a k16v8 encode's time).
    q += static_cast<uint32_t>(rem > 0x80000u) | (static_cast<uint32_t>(rem == 0x80000u) & q & 1u);
#endif
    // q <= 0x7E here: values in (448, 464] were saturated above.
    return static_cast<uint8_t>(sign | q);
  }
  if (a < 0x00800000u) return sign;  // float subnormals are far below 2^-10
  // Subnormal e4m3: value = m * 2^-9 with m = sig * 2^(exp - 23 + 9).
  uint32_t shift = static_cast<uint32_t>(14 - exp);  // >= 21
  if (shift > 40) return sign;
  uint64_t sig = mant | 0x800000u;
  uint64_t m = sig >> shift;
  uint64_t rem = sig & ((uint64_t{1} << shift) - 1);
  uint64_t half = uint64_t{1} << (shift - 1);
  if (rem > half || (rem == half && (m & 1u))) ++m;
  return static_cast<uint8_t>(sign | static_cast<uint8_t>(m));  // m == 8 is 2^-6, correct
}

KVTIER_HD float Fp8E4M3ToFloat(uint8_t b) {
  uint32_t sign = static_cast<uint32_t>(b & 0x80u) << 24;
  uint32_t exp = (b >> 3) & 0xFu;
  uint32_t mant = b & 0x7u;
  if (exp == 0xF && mant == 0x7) return BitsToFloat(sign | 0x7FC00000u);
  if (exp == 0) {
    float v = static_cast<float>(mant) * 0.001953125f;  // mant * 2^-9
    return sign ? -v : v;
  }
  return BitsToFloat(sign | ((exp + 120) << 23) | (mant << 20));
}

// --- round to nearest even integer, for the INT formats ---
// REQUIRES: |f| < 2^22 (callers pass x / scale, bounded by the format's qmax).
KVTIER_HD int32_t RoundHalfEven(float f) {
#if defined(__CUDA_ARCH__)
  return __float2int_rn(f);
#else
  return static_cast<int32_t>(std::nearbyint(f));  // default mode: nearest even
#endif
}

}  // namespace kvtier::codec

#endif  // KVTIER_CODEC_NUMERIC_H_
