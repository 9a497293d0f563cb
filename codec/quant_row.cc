#include "codec/quant_row.h"

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "codec/quant.h"

namespace kvtier::codec {
namespace {

#if defined(__SSE2__)
// FloatToFp8E4M3 of four floats, each code in the low byte of its lane:
//   normal (|y| >= 2^-6): the top bits of |y| from its exponent on, rounded
//     half to even on the 20 bits below;
//   subnormal: RNE(|y| * 2^9), by the float adder (|y| * 2^9 < 8, and 2^23
//     added leaves integers spaced 1 apart in the mantissa; the default
//     rounding mode is nearest even);
//   above 448 (infinities included) +-0x7E, NaN 0x7F.
// Integer compares are signed: |y|'s bits are below 2^31.
[[gnu::always_inline]] inline __m128i Fp8x4(__m128 y) {
  const __m128i u = _mm_castps_si128(y);
  const __m128i a = _mm_and_si128(u, _mm_set1_epi32(0x7FFFFFFF));
  const __m128i sign = _mm_and_si128(_mm_srli_epi32(u, 24), _mm_set1_epi32(0x80));
  const __m128i one = _mm_set1_epi32(1);
  __m128i q = _mm_sub_epi32(_mm_srli_epi32(a, 20), _mm_set1_epi32(960));  // ((e + 7) << 3) | m >> 20
  const __m128i rem = _mm_and_si128(a, _mm_set1_epi32(0xFFFFF));
  const __m128i above = _mm_cmpgt_epi32(rem, _mm_set1_epi32(0x80000));
  const __m128i tie = _mm_cmpeq_epi32(rem, _mm_set1_epi32(0x80000));
  q = _mm_add_epi32(q, _mm_and_si128(_mm_or_si128(above, _mm_and_si128(tie, q)), one));
  const __m128 scaled = _mm_mul_ps(_mm_castsi128_ps(a), _mm_set1_ps(512.0f));
  const __m128i m = _mm_sub_epi32(_mm_castps_si128(_mm_add_ps(scaled, _mm_set1_ps(8388608.0f))),
                                  _mm_set1_epi32(0x4B000000));
  const __m128i sub = _mm_cmplt_epi32(a, _mm_set1_epi32(0x3C800000));
  const __m128i sat = _mm_cmpgt_epi32(a, _mm_set1_epi32(0x43E00000));
  const __m128i nan = _mm_cmpgt_epi32(a, _mm_set1_epi32(0x7F800000));
  __m128i code = _mm_or_si128(_mm_and_si128(sub, m), _mm_andnot_si128(sub, q));
  code = _mm_or_si128(_mm_and_si128(sat, _mm_set1_epi32(0x7E)), _mm_andnot_si128(sat, code));
  code = _mm_or_si128(code, sign);
  return _mm_or_si128(_mm_and_si128(nan, _mm_set1_epi32(0x7F)), _mm_andnot_si128(nan, code));
}

// The codes of 16 floats (four vectors), packed into 16 bytes at dst.
[[gnu::always_inline]] inline void StoreCodes16(const __m128 (&y)[4], uint8_t* dst) {
  const __m128i lo = _mm_packs_epi32(Fp8x4(y[0]), Fp8x4(y[1]));  // codes <= 0xFF fit int16
  const __m128i hi = _mm_packs_epi32(Fp8x4(y[2]), Fp8x4(y[3]));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm_packus_epi16(lo, hi));
}
#endif

}  // namespace

KVTIER_HOST_SIMD_CLONES
void QuantizeFp8Row(const uint16_t* src, DType t, float scale, uint8_t* dst, uint32_t n) {
  uint32_t i = 0;
#if defined(__SSE2__)
  const __m128 s = _mm_set1_ps(scale);
  __m128 y[4];
  if (t == DType::kBF16) {
    const __m128i zero = _mm_setzero_si128();
    for (; i + 16 <= n; i += 16) {
      for (int h = 0; h < 2; ++h) {
        const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 8 * h));
        // A BF16 value is the top half of its float.
        y[2 * h] = _mm_div_ps(_mm_castsi128_ps(_mm_unpacklo_epi16(zero, v)), s);
        y[2 * h + 1] = _mm_div_ps(_mm_castsi128_ps(_mm_unpackhi_epi16(zero, v)), s);
      }
      StoreCodes16(y, dst + i);
    }
  } else {
    alignas(16) float x[16];
    for (; i + 16 <= n; i += 16) {
      for (int j = 0; j < 16; ++j) x[j] = Fp16ToFloat(src[i + j]);
      for (int j = 0; j < 4; ++j) y[j] = _mm_div_ps(_mm_load_ps(x + 4 * j), s);
      StoreCodes16(y, dst + i);
    }
  }
#endif
  for (; i < n; ++i) dst[i] = QuantizeFp8(Load16(src[i], t), scale);
}

}  // namespace kvtier::codec
