// The CPU codec's row loops over QuantizeFp8 (codec/quant.h), in SIMD where
// the host has it: the same bits as the per-element rule.
#ifndef KVTIER_CODEC_QUANT_ROW_H_
#define KVTIER_CODEC_QUANT_ROW_H_

#include <cstdint>

#include "codec/format.h"

namespace kvtier::codec {

// dst[i] = QuantizeFp8(Load16(src[i], t), scale) for i < n. On x86-64 (SSE2,
// always there) 16 values at a time: the division, the round half to even,
// saturation and NaN as lane masks, without a branch; elsewhere, and for the
// last n % 16 values, one at a time. REQUIRES: t is kBF16 or kFP16; src and
// dst do not overlap.
void QuantizeFp8Row(const uint16_t* src, DType t, float scale, uint8_t* dst, uint32_t n);

}  // namespace kvtier::codec

#endif  // KVTIER_CODEC_QUANT_ROW_H_
