// The CPU codec's row loops over QuantizeFp8 (codec/quant.h), in SIMD where
// the host has it: the same bits as the per-element rule.
#ifndef KVTIER_CODEC_QUANT_ROW_H_
#define KVTIER_CODEC_QUANT_ROW_H_

#include <cstdint>

#include "codec/format.h"

// Marks a host function to be compiled twice, for AVX2 (VEX encoding) and
// for the baseline, the copy picked at load time by the CPU: legacy SSE code
// that runs after AVX code which left the registers' upper halves dirty runs
// at half speed (k16v8 encode 0.93 against 1.84 GB/s on the CPU VM,
// codec_bench), and AVX2 lets the compiler vectorize more.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define KVTIER_HOST_SIMD_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define KVTIER_HOST_SIMD_CLONES
#endif

namespace kvtier::codec {

// dst[i] = QuantizeFp8(Load16(src[i], t), scale) for i < n. On x86-64 (SSE2,
// always there) 16 values at a time: the division, the round half to even,
// saturation and NaN as lane masks, without a branch; elsewhere, and for the
// last n % 16 values, one at a time. REQUIRES: t is kBF16 or kFP16; src and
// dst do not overlap.
void QuantizeFp8Row(const uint16_t* src, DType t, float scale, uint8_t* dst, uint32_t n);

}  // namespace kvtier::codec

#endif  // KVTIER_CODEC_QUANT_ROW_H_
