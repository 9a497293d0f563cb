// Per-element quantization rules of the chunk format (FORMAT.md "Numeric
// rules"), shared by the CPU codec and the CUDA kernels.
#ifndef KVTIER_CODEC_QUANT_H_
#define KVTIER_CODEC_QUANT_H_

#include <cstdint>

#include "codec/format.h"
#include "codec/numeric.h"
#include "common/host_device.h"

namespace kvtier::codec {

// 16-bit source element -> float (exact). REQUIRES: t is kFP16 or kBF16.
KVTIER_HD float Load16(uint16_t bits, DType t) {
  return t == DType::kBF16 ? Bf16ToFloat(bits) : Fp16ToFloat(bits);
}

// float -> 16-bit element, nearest even, canonical NaN.
KVTIER_HD uint16_t Store16(float x, DType t) {
  return t == DType::kBF16 ? FloatToBf16(x) : FloatToFp16(x);
}

// Contribution of one value to a group's amax: |x| when finite, 0 otherwise.
// max() is order-independent, so any reduction order gives the same amax.
KVTIER_HD float AmaxTerm(float x) {
  uint32_t a = FloatBits(x) & 0x7FFFFFFFu;
  return a < 0x7F800000u ? BitsToFloat(a) : 0.0f;
}

// scale = amax / qmax (float division, nearest even); 1 for an all-zero group.
KVTIER_HD float ScaleFromAmax(DType t, float amax) {
  return amax > 0.0f ? amax / QMax(t) : 1.0f;
}

// Quantizes one value to an FP8 e4m3 code: RNE(x / scale), saturating.
KVTIER_HD uint8_t QuantizeFp8(float x, float scale) { return FloatToFp8E4M3(x / scale); }

// Quantizes one value to a symmetric integer code in [-qmax, qmax]:
// RNE(x / scale) clamped; NaN -> 0, +-inf -> +-qmax.
KVTIER_HD int32_t QuantizeInt(float x, float scale, int32_t qmax) {
  uint32_t a = FloatBits(x) & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return 0;
  if (a == 0x7F800000u) return (FloatBits(x) >> 31) ? -qmax : qmax;
  float q = x / scale;
  if (q >= static_cast<float>(qmax)) return qmax;
  if (q <= -static_cast<float>(qmax)) return -qmax;
  return RoundHalfEven(q);
}

// Value of a code: float(code) * scale, one float multiply.
KVTIER_HD float DequantizeFp8(uint8_t code, float scale) { return Fp8E4M3ToFloat(code) * scale; }
KVTIER_HD float DequantizeInt(int32_t code, float scale) {
  return static_cast<float>(code) * scale;
}

// INT4 packing: two's complement nibbles, element 2i in the low nibble of byte i.
KVTIER_HD uint8_t PackInt4(int32_t even, int32_t odd) {
  return static_cast<uint8_t>((static_cast<uint32_t>(even) & 0xFu) |
                              ((static_cast<uint32_t>(odd) & 0xFu) << 4));
}
KVTIER_HD int32_t UnpackInt4(uint8_t byte, bool high) {
  int32_t nib = high ? (byte >> 4) : (byte & 0xF);
  return nib >= 8 ? nib - 16 : nib;
}

}  // namespace kvtier::codec

#endif  // KVTIER_CODEC_QUANT_H_
