// Paged decode attention on the GPU against the CPU reference
// (ReferenceDecodeAttention, FP64 accumulation), for K16/V16, K16/V8 and
// symmetric FP8 caches, with every kernel choice (kAuto, CUDA cores, tensor
// cores). Tolerances (kernels/README.md): relative L2 error
// ||out - ref|| / ||ref|| below 1e-2 for BF16 output and 2e-3 for FP16
// output, and every element within 3e-2 * max|ref| (BF16) / 5e-3 * max|ref|
// (FP16); no NaN; output not all zero.
#include <cuda_runtime_api.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "codec/quant.h"
#include "kernels/gpu_test_util.h"
#include "kernels/paged_attention.h"
#include "kernels/reference.h"

namespace kvtier::kernels {
namespace {

using codec::DType;
using testing::DeviceCache;
using testing::HostCache;

struct AttnCase {
  CacheLayout kind;
  DType q_dtype, k_dtype, v_dtype;
  uint32_t head_dim, block_size, kv_heads, group;
  std::vector<int32_t> lens;
  uint32_t partition_tokens = 0;  // 0: the launcher's choice
};

void RunAttention(const AttnCase& c) {
  SCOPED_TRACE(std::string(CacheLayoutName(c.kind)) + " k=" + codec::DTypeName(c.k_dtype) +
               " v=" + codec::DTypeName(c.v_dtype) + " q=" + codec::DTypeName(c.q_dtype) +
               " d=" + std::to_string(c.head_dim) + " bs=" + std::to_string(c.block_size) +
               " g=" + std::to_string(c.group) + " part=" + std::to_string(c.partition_tokens));
  const uint32_t batch = static_cast<uint32_t>(c.lens.size());
  uint32_t max_len = 0;
  for (int32_t l : c.lens) max_len = std::max<uint32_t>(max_len, l);
  const uint32_t maxb = (max_len + c.block_size - 1) / c.block_size + 1;
  const uint32_t num_blocks = batch * maxb + 3;
  auto layout = MakePagedKvLayout(c.kind, 2, num_blocks, c.block_size, c.kv_heads, c.head_dim,
                                  c.k_dtype, c.v_dtype);
  ASSERT_TRUE(layout.ok()) << layout.status();
  HostCache host;
  host.Init(c.kind, *layout);
  host.FillValues(testing::Fill::kNormal, 99 + c.head_dim);
  std::vector<int32_t> all = testing::ShuffledBlocks(num_blocks, batch * maxb, 5);
  const uint32_t hq = c.kv_heads * c.group;
  std::vector<uint16_t> q(uint64_t{batch} * hq * c.head_dim);
  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (auto& x : q) {
    float f = nd(rng);
    x = c.q_dtype == DType::kBF16 ? codec::FloatToBf16(f) : codec::FloatToFp16(f);
  }
  DecodeAttentionParams p;
  p.q = q.data();
  p.q_dtype = c.q_dtype;
  p.batch = batch;
  p.num_q_heads = hq;
  p.block_table = all.data();
  p.max_blocks_per_seq = maxb;
  p.seq_lens = c.lens.data();
  p.layer = 1;
  p.sm_scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));
  std::vector<uint16_t> out(q.size());
  p.out = out.data();
  auto ref = ReferenceDecodeAttention(host.layout, p);
  ASSERT_TRUE(ref.ok()) << ref.status();

  DeviceCache dev;
  KVTIER_ASSERT_CUDA(dev.Upload(host));
  void *d_q, *d_out, *d_ws;
  int32_t *d_table, *d_lens;
  KVTIER_ASSERT_CUDA(cudaMalloc(&d_q, q.size() * 2));
  KVTIER_ASSERT_CUDA(cudaMalloc(&d_out, q.size() * 2));
  KVTIER_ASSERT_CUDA(cudaMalloc(&d_table, all.size() * 4));
  KVTIER_ASSERT_CUDA(cudaMalloc(&d_lens, batch * 4));
  KVTIER_ASSERT_CUDA(cudaMemcpy(d_q, q.data(), q.size() * 2, cudaMemcpyHostToDevice));
  KVTIER_ASSERT_CUDA(cudaMemcpy(d_table, all.data(), all.size() * 4, cudaMemcpyHostToDevice));
  KVTIER_ASSERT_CUDA(cudaMemcpy(d_lens, c.lens.data(), batch * 4, cudaMemcpyHostToDevice));
  DecodeAttentionParams dp = p;
  dp.q = d_q;
  dp.out = d_out;
  dp.block_table = d_table;
  dp.seq_lens = d_lens;
  dp.host_block_table = all.data();
  dp.host_seq_lens = c.lens.data();
  dp.partition_tokens = c.partition_tokens;
  // Every kernel choice computes the same function. The partition length
  // (so the workspace) depends on the kernel that runs.
  const AttentionKernel kernels[] = {AttentionKernel::kAuto, AttentionKernel::kCudaCore,
                                     AttentionKernel::kTensorCore};
  size_t ws_max = 0;
  for (AttentionKernel kernel : kernels) {
    dp.kernel = kernel;
    auto ws_bytes = DecodeAttentionWorkspaceBytes(dev.layout, dp);
    ASSERT_TRUE(ws_bytes.ok()) << ws_bytes.status();
    ws_max = std::max(ws_max, *ws_bytes);
  }
  KVTIER_ASSERT_CUDA(cudaMalloc(&d_ws, ws_max));
  for (AttentionKernel kernel : kernels) {
    dp.kernel = kernel;
    auto part = DecodeAttentionPartitionTokensFor(dev.layout, dp);
    ASSERT_TRUE(part.ok()) << part.status();
    SCOPED_TRACE("kernel " + std::to_string(static_cast<int>(kernel)) + " partition " +
                 std::to_string(*part));
    KVTIER_ASSERT_CUDA(cudaMemset(d_out, 0xFF, q.size() * 2));  // NaN poison
    absl::Status st = PagedDecodeAttention(dev.layout, dp, d_ws, ws_max, nullptr);
    ASSERT_TRUE(st.ok()) << st;
    KVTIER_ASSERT_CUDA(cudaDeviceSynchronize());
    KVTIER_ASSERT_CUDA(cudaMemcpy(out.data(), d_out, out.size() * 2, cudaMemcpyDeviceToHost));

    const bool bf16 = c.q_dtype == DType::kBF16;
    double num = 0, den = 0, ref_max = 0;
    for (float r : *ref) ref_max = std::max(ref_max, std::fabs(double{r}));
    size_t nonzero = 0, bad = 0;
    for (size_t i = 0; i < out.size(); ++i) {
      const float o = codec::Load16(out[i], c.q_dtype);
      ASSERT_FALSE(std::isnan(o)) << "NaN at " << i;
      nonzero += o != 0.0f;
      const double d = o - (*ref)[i];
      num += d * d;
      den += double{(*ref)[i]} * (*ref)[i];
      if (std::fabs(d) > (bf16 ? 3e-2 : 5e-3) * ref_max && bad++ < 5) {
        ADD_FAILURE() << "element " << i << ": gpu " << o << " ref " << (*ref)[i];
      }
    }
    EXPECT_GT(nonzero, out.size() / 2);
    const double rel = std::sqrt(num / den);
    EXPECT_LT(rel, bf16 ? 1e-2 : 2e-3);
    ::testing::Test::RecordProperty("rel_l2", std::to_string(rel));
  }
  cudaFree(d_q);
  cudaFree(d_out);
  cudaFree(d_ws);
  cudaFree(d_table);
  cudaFree(d_lens);
}

// 32 sequences of 1..1000 tokens.
std::vector<int32_t> Lens32() {
  std::vector<int32_t> lens;
  for (int i = 0; i < 32; ++i) lens.push_back(1 + (i * 619) % 1000);
  return lens;
}

TEST(PagedAttentionGpu, MatchesReferenceForEveryFormat) {
  KVTIER_SKIP_WITHOUT_GPU();
  const std::vector<int32_t> lens = {1, 300, 777, 16};
  const AttnCase cases[] = {
      {CacheLayout::kVllmFlashAttnNHD, DType::kBF16, DType::kBF16, DType::kBF16, 128, 16, 2, 4, lens},
      {CacheLayout::kVllmFlashInferHND, DType::kFP16, DType::kFP16, DType::kFP16, 128, 32, 2, 4, lens},
      {CacheLayout::kSeparateNHD, DType::kBF16, DType::kBF16, DType::kFP8E4M3, 128, 16, 2, 4, lens},
      {CacheLayout::kSeparateHND, DType::kFP16, DType::kFP16, DType::kFP8E4M3, 64, 16, 4, 7, lens},
      {CacheLayout::kSeparateNHD, DType::kBF16, DType::kFP8E4M3, DType::kFP8E4M3, 128, 16, 2, 4, lens},
      {CacheLayout::kSeparateNHD, DType::kBF16, DType::kBF16, DType::kFP8E4M3, 256, 64, 1, 8, {513, 2}},
      {CacheLayout::kVllmFlashAttnHND, DType::kBF16, DType::kBF16, DType::kBF16, 64, 8, 3, 1, {1000, 5, 257}},
      // Group sizes that pad to the 4- or 8-head kernel, a block size of 1 and 2.
      {CacheLayout::kVllmFlashInferNHD, DType::kFP16, DType::kFP16, DType::kFP16, 128, 2, 2, 3, {70, 1, 33}},
      {CacheLayout::kSeparateNHD, DType::kBF16, DType::kFP8E4M3, DType::kFP8E4M3, 64, 1, 2, 5, {200, 31}},
      {CacheLayout::kSeparateHND, DType::kBF16, DType::kBF16, DType::kFP8E4M3, 256, 16, 2, 2, {95, 640}},
      // Long sequences: many partitions of the launcher's choice, partial last ones.
      {CacheLayout::kSeparateNHD, DType::kBF16, DType::kBF16, DType::kFP8E4M3, 128, 16, 8, 4, {8192, 1, 3001, 511}},
      {CacheLayout::kVllmFlashAttnNHD, DType::kBF16, DType::kBF16, DType::kBF16, 128, 16, 8, 4, {4100, 2049}},
      // Forced partition lengths: the smallest (one tile) and the largest.
      {CacheLayout::kSeparateNHD, DType::kBF16, DType::kBF16, DType::kFP8E4M3, 128, 16, 2, 4, {1000, 33, 7}, 32},
      {CacheLayout::kSeparateNHD, DType::kBF16, DType::kFP8E4M3, DType::kFP8E4M3, 128, 32, 2, 8, {1500, 513}, 512},
      // More format x group x head_dim combinations for both kernels (FP8 K with FP16 q,
      // groups 1/2/8 at every head_dim, many partitions, odd lengths).
      {CacheLayout::kSeparateNHD, DType::kFP16, DType::kFP8E4M3, DType::kFP8E4M3, 256, 16, 2, 2, {777, 1}},
      {CacheLayout::kSeparateNHD, DType::kFP16, DType::kFP8E4M3, DType::kFP8E4M3, 128, 16, 2, 8, {2049, 95}},
      {CacheLayout::kSeparateHND, DType::kFP16, DType::kFP16, DType::kFP8E4M3, 128, 16, 2, 8, {3001, 64, 65}},
      {CacheLayout::kVllmFlashAttnNHD, DType::kBF16, DType::kBF16, DType::kBF16, 256, 16, 1, 8, {2500, 3}},
      {CacheLayout::kSeparateNHD, DType::kBF16, DType::kFP8E4M3, DType::kFP8E4M3, 64, 16, 4, 1, {999, 1025}},
      {CacheLayout::kVllmFlashInferNHD, DType::kFP16, DType::kFP16, DType::kFP16, 64, 16, 2, 2, {4097, 17}},
      {CacheLayout::kSeparateNHD, DType::kBF16, DType::kBF16, DType::kFP8E4M3, 64, 32, 2, 8, {1999, 1}, 64},
      // One partition per sequence (the partial kernel writes the output, no
      // combine): forced, and the tensor-core rule's own choice at batch 32.
      {CacheLayout::kSeparateNHD, DType::kBF16, DType::kBF16, DType::kFP8E4M3, 128, 16, 8, 4, {8000, 1, 3001, 511}, 8192},
      {CacheLayout::kVllmFlashAttnHND, DType::kFP16, DType::kFP16, DType::kFP16, 128, 16, 4, 4, {2000, 77}, 4096},
      {CacheLayout::kSeparateNHD, DType::kBF16, DType::kBF16, DType::kFP8E4M3, 128, 16, 8, 4, Lens32()},
      {CacheLayout::kSeparateNHD, DType::kBF16, DType::kFP8E4M3, DType::kFP8E4M3, 128, 16, 8, 4, Lens32()},
  };
  for (const AttnCase& c : cases) {
    RunAttention(c);
    if (HasFatalFailure()) return;
  }
}

TEST(PagedAttentionGpu, InvalidInputIsRejectedBeforeLaunch) {
  // No device needed: validation happens first.
  auto layout = MakePagedKvLayout(CacheLayout::kSeparateNHD, 1, 4, 16, 2, 96, DType::kBF16,
                                  DType::kFP8E4M3);
  HostCache host;
  host.Init(CacheLayout::kSeparateNHD, *layout);
  std::vector<int32_t> table = {0, 1}, lens = {20};
  uint16_t q[2 * 96];
  DecodeAttentionParams p;
  p.q = q;
  p.out = q;
  p.batch = 1;
  p.num_q_heads = 4;
  p.block_table = table.data();
  p.seq_lens = lens.data();
  p.host_block_table = table.data();
  p.host_seq_lens = lens.data();
  p.max_blocks_per_seq = 2;
  p.sm_scale = 0.1f;
  alignas(16) static float ws[1 << 16];
  // head_dim 96 is unsupported
  EXPECT_EQ(PagedDecodeAttention(host.layout, p, ws, sizeof(ws), nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  auto l2 = MakePagedKvLayout(CacheLayout::kSeparateNHD, 1, 4, 16, 2, 128, DType::kBF16,
                              DType::kFP8E4M3);
  HostCache h2;
  h2.Init(CacheLayout::kSeparateNHD, *l2);
  table[1] = 4;  // out of range
  EXPECT_EQ(PagedDecodeAttention(h2.layout, p, ws, sizeof(ws), nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  table[1] = 1;
  lens[0] = 33;  // longer than 2 blocks
  EXPECT_EQ(PagedDecodeAttention(h2.layout, p, ws, sizeof(ws), nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  lens[0] = 20;
  p.num_q_heads = 18;  // 9 q heads per kv head
  EXPECT_EQ(PagedDecodeAttention(h2.layout, p, ws, sizeof(ws), nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  p.num_q_heads = 4;
  p.partition_tokens = 48;  // not a multiple of 32
  EXPECT_EQ(PagedDecodeAttention(h2.layout, p, ws, sizeof(ws), nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  p.partition_tokens = 2 * kAttentionMaxPartitionTokens;  // above the largest
  EXPECT_EQ(PagedDecodeAttention(h2.layout, p, ws, sizeof(ws), nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  p.partition_tokens = 0;
  p.kernel = static_cast<AttentionKernel>(9);  // no such kernel
  EXPECT_EQ(PagedDecodeAttention(h2.layout, p, ws, sizeof(ws), nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  p.kernel = AttentionKernel::kAuto;
  EXPECT_EQ(PagedDecodeAttention(h2.layout, p, ws, 16, nullptr).code(),
            absl::StatusCode::kInvalidArgument);  // workspace too small
  p.q = nullptr;
  EXPECT_EQ(PagedDecodeAttention(h2.layout, p, ws, sizeof(ws), nullptr).code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvtier::kernels
