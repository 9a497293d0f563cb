// Device-side conversions that must give the codec's exact bits
// (codec/numeric.h). They use the hardware conversions where those are
// proven equal to the codec's integer rules by numeric_gpu_test.
#ifndef KVTIER_KERNELS_DEVICE_NUMERIC_CUH_
#define KVTIER_KERNELS_DEVICE_NUMERIC_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "codec/format.h"
#include "codec/numeric.h"
#include "codec/quant.h"

namespace kvtier::kernels {

// codec::QuantizeFp8(x, scale) == FloatToFp8E4M3(x / scale). The division is
// IEEE (nvcc's default -prec-div=true; never build with --use_fast_math).
// Any NaN becomes 0x7F whatever its sign, on the host and on the GPU alike.
__device__ __forceinline__ uint8_t QuantizeFp8Device(float x, float scale) {
  const float q = __fdiv_rn(x, scale);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(q, __NV_SATFINITE, __NV_E4M3));
#else
  return codec::FloatToFp8E4M3(q);
#endif
}

// codec::Store16(codec::DequantizeFp8(code, scale), dtype).
__device__ __forceinline__ uint16_t DequantizeFp8To16(uint8_t code, float scale, bool bf16) {
  const float x = __fmul_rn(codec::Fp8E4M3ToFloat(code), scale);
  if (bf16) return __bfloat16_as_ushort(__float2bfloat16_rn(x));
  return __half_as_ushort(__float2half_rn(x));
}

// Two binary32 values to 16 bits each (round to nearest even, the codec's
// canonical NaN), `lo` in the low half: one cvt of the pair.
__device__ __forceinline__ uint32_t Pack16x2(float lo, float hi, bool bf16) {
  if (bf16) {
    const __nv_bfloat162 b = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&b);
  }
  const __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}

// DequantizeFp8To16 of two codes (`two`: the first in the low byte), packed
// the same way. The hardware converts e4m3 pairs to f16 exactly (every e4m3
// value is an f16 value, NaN stays NaN) and f32 pairs to 16-bit with the
// codec's rounding and canonical NaN (numeric_gpu_test checks every pair).
__device__ __forceinline__ uint32_t DequantizeFp8x2To16(uint16_t two, float scale, bool bf16) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  const float2 f = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(two, __NV_E4M3)));
  return Pack16x2(__fmul_rn(f.x, scale), __fmul_rn(f.y, scale), bf16);
#else
  return uint32_t{DequantizeFp8To16(static_cast<uint8_t>(two), scale, bf16)} |
         uint32_t{DequantizeFp8To16(static_cast<uint8_t>(two >> 8), scale, bf16)} << 16;
#endif
}

// The value of a two's complement code of `bits` (8 or 4) bits held in the
// low bits of `code` (higher bits ignored), exactly: 2^23 with the biased
// code in its mantissa, less 2^23 and the bias (a logic op and an add
// instead of an integer-to-float conversion).
template <int kBits>
__device__ __forceinline__ float IntCodeToFloat(uint32_t code) {
  constexpr uint32_t kMask = (1u << kBits) - 1, kBias = 1u << (kBits - 1);
  return __int_as_float(0x4B000000u | ((code & kMask) ^ kBias)) - (8388608.0f + kBias);
}

// codec::Store16(codec::DequantizeInt(code, scale), dtype) of the two codes
// of `kBits` bits at the bottom of `two` (the first lowest), packed as
// DequantizeFp8x2To16.
template <int kBits>
__device__ __forceinline__ uint32_t DequantizeIntx2To16(uint32_t two, float scale, bool bf16) {
  return Pack16x2(__fmul_rn(IntCodeToFloat<kBits>(two), scale),
                  __fmul_rn(IntCodeToFloat<kBits>(two >> kBits), scale), bf16);
}

// Whether a 16-bit element of dtype bf16 / fp16 is NaN or infinite.
__device__ __forceinline__ bool NonFinite16(uint32_t bits, bool bf16) {
  return bf16 ? (bits & 0x7F80u) == 0x7F80u : (bits & 0x7C00u) == 0x7C00u;
}

}  // namespace kvtier::kernels

#endif  // KVTIER_KERNELS_DEVICE_NUMERIC_CUH_
