// The codec's integer conversion rules (codec/numeric.h) against the
// hardware conversions, on every float bit pattern (2^32 of them, on the
// device), plus a host-side check of a dense sample with every FP8 rounding
// boundary, so the host-compiled functions are covered too.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <limits>
#include <vector>

#include "codec/numeric.h"
#include "codec/quant.h"
#include "gtest/gtest.h"
#include "kernels/device_numeric.cuh"
#include "kernels/gpu_test_util.h"

namespace kvtier::kernels {
namespace {

struct Mismatches {
  unsigned long long fp8;          // every input, NaNs of both signs included
  unsigned long long bf16;
  unsigned long long fp16;
  unsigned long long quant;        // QuantizeFp8Device vs codec::QuantizeFp8
  uint32_t first_fp8, first_bf16, first_fp16, first_quant;
};

__global__ void SweepAll(uint64_t begin, uint64_t end, Mismatches* m) {
  for (uint64_t i = begin + blockIdx.x * uint64_t{blockDim.x} + threadIdx.x; i < end;
       i += uint64_t{gridDim.x} * blockDim.x) {
    const uint32_t bits = static_cast<uint32_t>(i);
    const float f = __uint_as_float(bits);
    const uint8_t hw8 = __nv_cvt_float_to_fp8(f, __NV_SATFINITE, __NV_E4M3);
    if (hw8 != codec::FloatToFp8E4M3(f)) {
      if (atomicAdd(&m->fp8, 1ull) == 0) m->first_fp8 = bits;
    }
    if (__bfloat16_as_ushort(__float2bfloat16_rn(f)) != codec::FloatToBf16(f)) {
      if (atomicAdd(&m->bf16, 1ull) == 0) m->first_bf16 = bits;
    }
    if (__half_as_ushort(__float2half_rn(f)) != codec::FloatToFp16(f)) {
      if (atomicAdd(&m->fp16, 1ull) == 0) m->first_fp16 = bits;
    }
    // The kernels' quantizer (hardware cvt) against the codec's rule, for a
    // few scales.
    const float scale = (bits & 3) == 0 ? 1.0f : (bits & 3) == 1 ? 0.0123f : (bits & 3) == 2 ? 3.5f : 1e-30f;
    if (QuantizeFp8Device(f, scale) != codec::FloatToFp8E4M3(__fdiv_rn(f, scale))) {
      if (atomicAdd(&m->quant, 1ull) == 0) m->first_quant = bits;
    }
  }
}

__global__ void HardwareFp8(const uint32_t* in, uint8_t* out, size_t n) {
  size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x;
  if (i < n) out[i] = __nv_cvt_float_to_fp8(__uint_as_float(in[i]), __NV_SATFINITE, __NV_E4M3);
}

TEST(NumericGpu, CodecConversionsMatchHardwareOnEveryFloat) {
  KVTIER_SKIP_WITHOUT_GPU();
  Mismatches* m = nullptr;
  KVTIER_ASSERT_CUDA(cudaMallocManaged(&m, sizeof(Mismatches)));
  *m = Mismatches{};
  SweepAll<<<4096, 256>>>(0, uint64_t{1} << 32, m);
  KVTIER_ASSERT_CUDA(cudaGetLastError());
  KVTIER_ASSERT_CUDA(cudaDeviceSynchronize());
  EXPECT_EQ(m->fp8, 0u) << "first mismatch at float bits 0x" << std::hex << m->first_fp8;
  EXPECT_EQ(m->bf16, 0u) << "first mismatch at float bits 0x" << std::hex << m->first_bf16;
  EXPECT_EQ(m->fp16, 0u) << "first mismatch at float bits 0x" << std::hex << m->first_fp16;
  EXPECT_EQ(m->quant, 0u) << "first mismatch at float bits 0x" << std::hex << m->first_quant;
  cudaFree(m);
}

TEST(NumericGpu, HostCodecMatchesHardwareAtEveryFp8Boundary) {
  KVTIER_SKIP_WITHOUT_GPU();
  std::vector<uint32_t> in;
  // Every e4m3 value, the midpoints between neighbours and one ulp either
  // side, both signs; plus a dense sweep of every 4099th bit pattern.
  for (int code = 0; code < 0x7F; ++code) {
    float a = codec::Fp8E4M3ToFloat(static_cast<uint8_t>(code));
    float b = code < 0x7E ? codec::Fp8E4M3ToFloat(static_cast<uint8_t>(code + 1)) : 464.0f;
    float mid = (a + b) / 2;  // exact: neighbours differ by a power of two
    for (float x : {a, mid, b}) {
      uint32_t u = codec::FloatBits(x);
      for (uint32_t v : {u - 1, u, u + 1}) {
        in.push_back(v);
        in.push_back(v | 0x80000000u);
      }
    }
  }
  for (uint64_t u = 0; u < (uint64_t{1} << 32); u += 4099) in.push_back(static_cast<uint32_t>(u));
  uint32_t* d_in = nullptr;
  uint8_t* d_out = nullptr;
  KVTIER_ASSERT_CUDA(cudaMalloc(&d_in, in.size() * 4));
  KVTIER_ASSERT_CUDA(cudaMalloc(&d_out, in.size()));
  KVTIER_ASSERT_CUDA(cudaMemcpy(d_in, in.data(), in.size() * 4, cudaMemcpyHostToDevice));
  HardwareFp8<<<(in.size() + 255) / 256, 256>>>(d_in, d_out, in.size());
  KVTIER_ASSERT_CUDA(cudaGetLastError());
  std::vector<uint8_t> hw(in.size());
  KVTIER_ASSERT_CUDA(cudaMemcpy(hw.data(), d_out, in.size(), cudaMemcpyDeviceToHost));
  size_t bad = 0;
  for (size_t i = 0; i < in.size(); ++i) {
    if (hw[i] != codec::FloatToFp8E4M3(codec::BitsToFloat(in[i]))) {
      if (bad++ < 5) ADD_FAILURE() << "bits 0x" << std::hex << in[i] << ": hw " << int(hw[i])
                                   << " codec " << int(codec::FloatToFp8E4M3(codec::BitsToFloat(in[i])));
    }
  }
  EXPECT_EQ(bad, 0u) << "of " << in.size();
  cudaFree(d_in);
  cudaFree(d_out);
}

// The decode kernels' dequantization of a pair of codes (`two`: FP8 or INT8
// codes in its two bytes, INT4 in its two low nibbles).
enum class PairFormat { kFp8, kInt8, kInt4 };

__device__ uint32_t DequantizePair(PairFormat f, uint32_t two, float scale, bool bf16) {
  switch (f) {
    case PairFormat::kFp8:
      return DequantizeFp8x2To16(static_cast<uint16_t>(two), scale, bf16);
    case PairFormat::kInt8:
      return DequantizeIntx2To16<8>(two, scale, bf16);
    case PairFormat::kInt4:
      return DequantizeIntx2To16<4>(two, scale, bf16);
  }
  return 0;
}

// DequantizePair of every pair of codes, for each scale and dtype.
__global__ void DequantizeEveryPair(PairFormat f, const float* scales, int num_scales,
                                    uint32_t* out) {
  const uint32_t pair = blockIdx.x * blockDim.x + threadIdx.x;  // < 2^16
  for (int s = 0; s < num_scales; ++s) {
    for (int bf16 = 0; bf16 < 2; ++bf16) {
      out[(size_t{2} * s + bf16) * 65536 + pair] = DequantizePair(f, pair, scales[s], bf16 != 0);
    }
  }
}

// The codec's value of code `i` (0 or 1) of a pair.
float CodecValue(PairFormat f, uint32_t two, int i, float scale) {
  switch (f) {
    case PairFormat::kFp8:
      return codec::DequantizeFp8(static_cast<uint8_t>(two >> (8 * i)), scale);
    case PairFormat::kInt8:
      return codec::DequantizeInt(static_cast<int8_t>(static_cast<uint8_t>(two >> (8 * i))),
                                  scale);
    case PairFormat::kInt4:
      return codec::DequantizeInt(codec::UnpackInt4(static_cast<uint8_t>(two), i != 0), scale);
  }
  return 0.0f;
}

// The decode kernels' pairs (FP8: hardware e4m3x2 -> f16x2; INT8 / INT4: the
// biased-mantissa conversion; then f32x2 -> 16-bit x2) give
// codec::Store16(codec::DequantizeFp8 / DequantizeInt(code, scale)) for every
// code (FP8 NaN codes of both signs too) and scales that make subnormal,
// overflowing, rounding-boundary and NaN results.
TEST(NumericGpu, PairDequantizeMatchesTheCodecForEveryCodePair) {
  KVTIER_SKIP_WITHOUT_GPU();
  const std::vector<float> scales = {1.0f,   0.5f,      3.0f / 448.0f, 1e-3f,  1e-30f, 7.1e-6f,
                                     1e30f,  146.3f,    -2.0f,         0.0f,   1.0f / 3.0f,
                                     std::numeric_limits<float>::infinity(),
                                     std::numeric_limits<float>::quiet_NaN()};
  const int n = static_cast<int>(scales.size());
  float* d_scales = nullptr;
  uint32_t* d_out = nullptr;
  KVTIER_ASSERT_CUDA(cudaMalloc(&d_scales, n * sizeof(float)));
  KVTIER_ASSERT_CUDA(cudaMalloc(&d_out, size_t{2} * n * 65536 * 4));
  KVTIER_ASSERT_CUDA(
      cudaMemcpy(d_scales, scales.data(), n * sizeof(float), cudaMemcpyHostToDevice));
  std::vector<uint32_t> got(size_t{2} * n * 65536);
  for (const PairFormat f : {PairFormat::kFp8, PairFormat::kInt8, PairFormat::kInt4}) {
    SCOPED_TRACE(f == PairFormat::kFp8 ? "fp8" : f == PairFormat::kInt8 ? "int8" : "int4");
    DequantizeEveryPair<<<256, 256>>>(f, d_scales, n, d_out);
    KVTIER_ASSERT_CUDA(cudaGetLastError());
    KVTIER_ASSERT_CUDA(cudaMemcpy(got.data(), d_out, got.size() * 4, cudaMemcpyDeviceToHost));
    uint64_t bad = 0;
    for (int s = 0; s < n; ++s) {
      for (int bf16 = 0; bf16 < 2; ++bf16) {
        const codec::DType dt = bf16 ? codec::DType::kBF16 : codec::DType::kFP16;
        // INT4 pairs are the low byte; the higher bits must not matter.
        for (uint32_t pair = 0; pair < 65536; ++pair) {
          const uint32_t want = uint32_t{codec::Store16(CodecValue(f, pair, 0, scales[s]), dt)} |
                                uint32_t{codec::Store16(CodecValue(f, pair, 1, scales[s]), dt)}
                                    << 16;
          const uint32_t g = got[(size_t{2} * s + bf16) * 65536 + pair];
          if (g != want && bad++ < 8) {
            ADD_FAILURE() << "scale " << scales[s] << (bf16 ? " bf16" : " fp16") << " codes 0x"
                          << std::hex << pair << ": got 0x" << g << ", codec 0x" << want;
          }
        }
      }
    }
    EXPECT_EQ(bad, 0u);
  }
  cudaFree(d_scales);
  cudaFree(d_out);
}

}  // namespace
}  // namespace kvtier::kernels
