// The launchers reject invalid input with a Status before touching the
// device, so these run (and must pass) on machines without a GPU.
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/paged_attention.h"
#include "kernels/paged_codec.h"
#include "kernels/record_hash.h"
#include "kernels/test_util.h"

namespace kvtier::kernels {
namespace {

using codec::DType;

struct Fixture {
  testing::HostCache cache;  // host pointers: never dereferenced, nothing launches
  std::vector<int32_t> ids = {2, 0, 1};
  BlockSpan span;
  codec::ChunkSpec spec;
  alignas(16) uint8_t dst[16];
  uint32_t ws[2];

  explicit Fixture(uint32_t head_dim = 128, uint32_t block_size = 16) {
    auto d = MakePagedKvLayout(CacheLayout::kVllmFlashAttnNHD, 2, 3, block_size, 2, head_dim,
                               DType::kBF16, DType::kBF16);
    cache.Init(CacheLayout::kVllmFlashAttnNHD, *d);
    span = BlockSpan{ids.data(), ids.data(), 3, 0};
    spec.geometry = {2, 2, head_dim, 40, block_size};
    spec.dtype = DType::kBF16;
    spec.k = {DType::kBF16, codec::ScaleGranularity::kNone};
    spec.v = {DType::kFP8E4M3, codec::ScaleGranularity::kPerBlockHead};
  }
  absl::StatusCode Encode() {
    return GatherEncode(spec, cache.layout, span, dst, ws, nullptr).code();
  }
};

TEST(GatherEncodeLaunch, NullPointersAreInvalidArgument) {
  Fixture f;
  f.cache.layout.k_layers = nullptr;
  EXPECT_EQ(f.Encode(), absl::StatusCode::kInvalidArgument);
  Fixture g;
  EXPECT_EQ(GatherEncode(g.spec, g.cache.layout, g.span, nullptr, g.ws, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(GatherEncode(g.spec, g.cache.layout, g.span, g.dst, nullptr, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  g.span.block_ids = nullptr;
  EXPECT_EQ(g.Encode(), absl::StatusCode::kInvalidArgument);
}

TEST(GatherEncodeLaunch, OutOfRangeBlockIdIsInvalidArgument) {
  Fixture f;
  f.ids[1] = 3;  // the cache has 3 blocks
  EXPECT_EQ(f.Encode(), absl::StatusCode::kInvalidArgument);
  f.ids[1] = -2;
  EXPECT_EQ(f.Encode(), absl::StatusCode::kInvalidArgument);
  Fixture g;
  g.spec.geometry.num_tokens = 49;  // needs 4 blocks, the span lists 3
  EXPECT_EQ(g.Encode(), absl::StatusCode::kInvalidArgument);
}

TEST(GatherEncodeLaunch, UnsupportedSizesAndFormatsAreInvalidArgument) {
  Fixture f(96);  // head_dim 96: not 64/128/256
  EXPECT_EQ(f.Encode(), absl::StatusCode::kInvalidArgument);
  Fixture g(128, 24);  // block size 24
  EXPECT_EQ(g.Encode(), absl::StatusCode::kInvalidArgument);
  Fixture h;
  h.spec.v = {DType::kINT4, codec::ScaleGranularity::kNone};  // a quantized section needs scales
  EXPECT_EQ(h.Encode(), absl::StatusCode::kInvalidArgument);
  Fixture i;
  i.spec.geometry.num_kv_heads = 4;  // differs from the cache
  EXPECT_EQ(i.Encode(), absl::StatusCode::kInvalidArgument);
  Fixture j;
  j.spec.dtype = DType::kFP16;  // cache is bf16
  j.spec.k = {DType::kFP16, codec::ScaleGranularity::kNone};
  EXPECT_EQ(j.Encode(), absl::StatusCode::kInvalidArgument);
  Fixture k;
  EXPECT_EQ(GatherEncode(k.spec, k.cache.layout, k.span, k.dst + 8, k.ws, nullptr).code(),
            absl::StatusCode::kInvalidArgument);  // misaligned destination
}

TEST(GatherEncodeLaunch, EmptyOrOutOfRangeLayerRangeIsInvalidArgument) {
  Fixture f;  // 2 layers
  for (LayerRange r : {LayerRange{1, 1}, LayerRange{0, 3}, LayerRange{2, LayerRange::kAllLayers},
                       LayerRange{1, 0}}) {
    EXPECT_EQ(GatherEncode(f.spec, f.cache.layout, f.span, r, f.dst, f.ws, nullptr).code(),
              absl::StatusCode::kInvalidArgument)
        << r.begin << ".." << r.end;
    EXPECT_EQ(ValidateGatherEncode(f.spec, f.cache.layout, f.span, f.dst, f.ws, r).code(),
              absl::StatusCode::kInvalidArgument);
  }
  for (LayerRange r : {LayerRange{}, LayerRange{0, 1}, LayerRange{1, 2}, LayerRange{1, LayerRange::kAllLayers}}) {
    EXPECT_TRUE(ValidateGatherEncode(f.spec, f.cache.layout, f.span, f.dst, f.ws, r).ok())
        << r.begin << ".." << r.end;
  }
}

// Bad input is InvalidArgument before the device is asked anything, for a
// chained decode (PriorKernel::kLeavesChunk) as for any other.
TEST(DecodeScatterLaunch, InvalidInputIsInvalidArgument) {
  for (PriorKernel prior : {PriorKernel::kUnknown, PriorKernel::kLeavesChunk}) {
    SCOPED_TRACE(prior == PriorKernel::kUnknown ? "kUnknown" : "kLeavesChunk");
    Fixture f;
    auto layout = codec::ValidateSpec(f.spec);
    ASSERT_TRUE(layout.ok());
    codec::ChunkHeader header;
    header.spec = f.spec;
    header.layout = *layout;
    f.ids[2] = 7;  // out of range
    EXPECT_EQ(DecodeScatter(header, f.dst, f.cache.layout, f.span, nullptr, prior).code(),
              absl::StatusCode::kInvalidArgument);
    Fixture g;
    EXPECT_EQ(DecodeScatter(header, nullptr, g.cache.layout, g.span, nullptr, prior).code(),
              absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(
        DecodeScatter(header, g.dst, g.cache.layout, g.span, LayerRange{2, 9}, nullptr, prior)
            .code(),
        absl::StatusCode::kInvalidArgument);
    header.spec.geometry.head_dim = 64;
    EXPECT_EQ(DecodeScatter(header, g.dst, g.cache.layout, g.span, nullptr, prior).code(),
              absl::StatusCode::kInvalidArgument);
  }
}

// A staging of no bytes is refused before anything is allocated (no device
// needed).
TEST(HostStagingCreate, ZeroBytesIsInvalidArgument) {
  EXPECT_EQ(HostStaging::Create(0).status().code(), absl::StatusCode::kInvalidArgument);
}

// The tensor-core partition rule on an H100 (132 SMs; 2 CTAs per SM for
// BF16 and K16/V8, 3 for FP8 at head_dim 128) picks the partition lengths
// that measured fastest on the H100 (bench/results/kernels.md).
TEST(DecodeAttentionPartition, TensorCoreRuleFillsTheGpuAndItsLastWave) {
  // batch 32, ctx 8K: one partition, 256 CTAs in one wave.
  EXPECT_EQ(DecodeAttentionPartitionTokens(32, 8, 8192, 132, 2), 8192u);
  EXPECT_EQ(DecodeAttentionPartitionTokens(32, 8, 8192, 132, 3), 8192u);
  // batch 8: 8192 and 4096 leave SMs idle (64, 128 CTAs).
  EXPECT_EQ(DecodeAttentionPartitionTokens(8, 8, 8192, 132, 2), 2048u);
  // batch 64, FP8: 512 CTAs fill 1.29 waves of 396, 1024 2.59, 2048 5.17; 4096 is 10.3.
  EXPECT_EQ(DecodeAttentionPartitionTokens(64, 8, 8192, 132, 3), 1024u);
  EXPECT_EQ(DecodeAttentionPartitionTokens(64, 8, 8192, 132, 2), 8192u);
  EXPECT_EQ(DecodeAttentionPartitionTokens(32, 8, 32768, 132, 2), 8192u);
  EXPECT_EQ(DecodeAttentionPartitionTokens(32, 8, 32768, 132, 3), 2048u);
  EXPECT_EQ(DecodeAttentionPartitionTokens(32, 8, 2048, 132, 2), 2048u);
  // Too little work to fill the GPU at all: the most CTAs.
  EXPECT_EQ(DecodeAttentionPartitionTokens(1, 1, 100, 132, 2), kAttentionMinPartitionTokens);
  // Degenerate inputs stay in range.
  EXPECT_EQ(DecodeAttentionPartitionTokens(1, 1, 1, 0, 0), kAttentionMinPartitionTokens);
  EXPECT_LE(DecodeAttentionPartitionTokens(65535, 64, uint64_t{1} << 30, 132, 2),
            kAttentionMaxPartitionTokens);
}

// The kernels compute row offsets as 32x32->64-bit products: a block stride
// of 2^32 elements or more is refused before anything launches.
TEST(DecodeAttentionLaunch, StridesOf2To32ElementsAreInvalidArgument) {
  Fixture f;
  std::vector<uint16_t> q(2 * 128), out(2 * 128);
  std::vector<int32_t> lens = {40};
  DecodeAttentionParams p;
  p.q = q.data();
  p.out = out.data();
  p.batch = 1;
  p.num_q_heads = 2;
  p.block_table = f.ids.data();
  p.max_blocks_per_seq = 3;
  p.seq_lens = lens.data();
  p.sm_scale = 0.1f;
  ASSERT_TRUE(DecodeAttentionWorkspaceBytes(f.cache.layout, p).ok());
  PagedKvLayout big = f.cache.layout;
  big.stride_block = int64_t{1} << 32;
  EXPECT_EQ(DecodeAttentionWorkspaceBytes(big, p).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(PagedDecodeAttention(big, p, nullptr, 0, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  big = f.cache.layout;
  big.stride_token = (int64_t{1} << 32) / 15;  // 15 slots past slot 0 reach 2^32
  EXPECT_EQ(DecodeAttentionWorkspaceBytes(big, p).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// Every chunk section format of the codec, for a 16-bit cache section.
std::vector<codec::SectionFormat> AllSectionFormats(DType native) {
  std::vector<codec::SectionFormat> out = {{native, codec::ScaleGranularity::kNone}};
  for (DType q : {DType::kFP8E4M3, DType::kINT8, DType::kINT4}) {
    for (auto g : {codec::ScaleGranularity::kPerTensor, codec::ScaleGranularity::kPerBlockHead,
                   codec::ScaleGranularity::kPerTokenHead}) {
      out.push_back({q, g});
    }
  }
  return out;
}

codec::ChunkHeader HeaderOf(const codec::ChunkSpec& spec) {
  codec::ChunkHeader h;
  h.spec = spec;
  auto layout = codec::ValidateSpec(spec);
  if (layout.ok()) h.layout = *layout;
  return h;
}

TEST(GatherEncodeLaunch, EveryFormatPairOfA16BitCacheIsAccepted) {
  for (uint32_t head_dim : {64u, 128u, 256u}) {
    for (uint32_t first_slot : {0u, 5u}) {
      for (const auto& k : AllSectionFormats(DType::kBF16)) {
        for (const auto& v : AllSectionFormats(DType::kBF16)) {
          Fixture f(head_dim);
          f.span.first_slot = first_slot;  // 45 slots: still 3 blocks
          f.spec.k = k;
          f.spec.v = v;
          SCOPED_TRACE(codec::CodecName({k, v}));
          EXPECT_TRUE(ValidateGatherEncode(f.spec, f.cache.layout, f.span, f.dst, f.ws).ok())
              << ValidateGatherEncode(f.spec, f.cache.layout, f.span, f.dst, f.ws);
          EXPECT_TRUE(ValidateDecodeScatter(HeaderOf(f.spec), f.dst, f.cache.layout, f.span).ok());
        }
      }
    }
  }
}

TEST(GatherEncodeLaunch, ValidateAgreesWithTheLauncherOnRejects) {
  Fixture f;
  f.spec.v = {DType::kINT8, codec::ScaleGranularity::kPerTensor};
  EXPECT_EQ(ValidateGatherEncode(f.spec, f.cache.layout, f.span, f.dst, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(GatherEncode(f.spec, f.cache.layout, f.span, f.dst, nullptr, nullptr).code(),
            absl::StatusCode::kInvalidArgument);  // per-tensor needs the workspace too
  EXPECT_EQ(ValidateGatherEncode(f.spec, f.cache.layout, f.span, f.dst + 8, f.ws).code(),
            absl::StatusCode::kInvalidArgument);
  Fixture g;
  g.spec.dtype = DType::kFP16;  // the cache is bf16; K INT4 still needs the chunk dtype
  g.spec.k = {DType::kINT4, codec::ScaleGranularity::kPerTokenHead};
  g.spec.v = {DType::kINT8, codec::ScaleGranularity::kPerBlockHead};
  absl::Status st = ValidateGatherEncode(g.spec, g.cache.layout, g.span, g.dst, g.ws);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("chunk dtype"), std::string::npos) << st;
  EXPECT_EQ(ValidateDecodeScatter(HeaderOf(g.spec), g.dst, g.cache.layout, g.span).code(),
            absl::StatusCode::kInvalidArgument);
}

// The per-tensor amax words fit every chunk the format allows.
TEST(GatherEncodeLaunch, WorkspaceHoldsAKAndAVAmaxPerLayer) {
  EXPECT_GE(kGatherEncodeWorkspaceBytes, 4 * (2 + 2 * size_t{codec::kMaxLayers}));
}

// An FP8 cache section is never re-quantized: it passes through to FP8
// per-(block, head) only, and only from a block boundary.
TEST(GatherEncodeLaunch, Fp8CacheWithAnyOtherChunkFormatIsInvalidArgument) {
  testing::HostCache cache;
  auto d = MakePagedKvLayout(CacheLayout::kSeparateNHD, 2, 3, 16, 2, 128, DType::kBF16,
                             DType::kFP8E4M3);
  ASSERT_TRUE(d.ok()) << d.status();
  cache.Init(CacheLayout::kSeparateNHD, *d);
  std::vector<int32_t> ids = {2, 0, 1};
  BlockSpan span{ids.data(), ids.data(), 3, 0};
  alignas(16) uint8_t dst[16];
  uint32_t ws[2];
  codec::ChunkSpec spec;
  spec.geometry = {2, 2, 128, 40, 16};
  spec.dtype = DType::kBF16;
  for (const auto& k : AllSectionFormats(DType::kBF16)) {
    for (const auto& v : AllSectionFormats(DType::kBF16)) {
      spec.k = k;
      spec.v = v;
      SCOPED_TRACE(codec::CodecName({k, v}));
      const bool pass8 =
          v.dtype == DType::kFP8E4M3 && v.granularity == codec::ScaleGranularity::kPerBlockHead;
      absl::Status enc = ValidateGatherEncode(spec, cache.layout, span, dst, ws);
      absl::Status dec = ValidateDecodeScatter(HeaderOf(spec), dst, cache.layout, span);
      if (pass8) {
        EXPECT_TRUE(enc.ok()) << enc;
        EXPECT_TRUE(dec.ok()) << dec;
      } else {
        EXPECT_EQ(enc.code(), absl::StatusCode::kInvalidArgument);
        EXPECT_NE(enc.message().find("passes through only to fp8e4m3/block-head"),
                  std::string::npos)
            << enc;
        EXPECT_EQ(dec.code(), absl::StatusCode::kInvalidArgument);
      }
    }
  }
  spec.k = {DType::kINT4, codec::ScaleGranularity::kPerTensor};
  spec.v = {DType::kFP8E4M3, codec::ScaleGranularity::kPerBlockHead};
  span.first_slot = 3;  // pass-through needs a block boundary
  EXPECT_EQ(ValidateGatherEncode(spec, cache.layout, span, dst, ws).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ValidateDecodeScatter(HeaderOf(spec), dst, cache.layout, span).code(),
            absl::StatusCode::kInvalidArgument);
}

// The device record hash takes version 2 records longer than 240 bytes, a
// multiple of 16, at 16-byte aligned addresses; anything else is refused
// before a launch (the reader hashes those on the host).
TEST(RecordHashLaunch, WhatTheDeviceHashDoesNotTakeIsInvalidArgument) {
  codec::ChunkSpec spec;
  spec.geometry = {2, 2, 128, 32, 16};
  spec.k = {DType::kBF16, codec::ScaleGranularity::kNone};
  spec.v = {DType::kFP8E4M3, codec::ScaleGranularity::kPerBlockHead};
  auto layout = codec::ValidateSpec(spec);
  ASSERT_TRUE(layout.ok());
  codec::ChunkHeader h;
  h.spec = spec;
  h.layout = *layout;
  alignas(16) static uint8_t bytes[64];
  alignas(16) static uint8_t ws[64];
  uint64_t out[4];
  StagedRecords ok{bytes, bytes, LayerRange{}};
  EXPECT_TRUE(CanHashOnDevice(h, ok));
  auto code = [&](const codec::ChunkHeader& hh, StagedRecords r, uint64_t* o) {
    return HashStagedRecords(hh, r, ws, o, nullptr).code();
  };
  EXPECT_EQ(code(h, {bytes + 8, bytes, LayerRange{}}, out), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code(h, {bytes, nullptr, LayerRange{}}, out), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code(h, ok, nullptr), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(HashStagedRecords(h, ok, nullptr, out, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code(h, {bytes, bytes, LayerRange{1, 1}}, out), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code(h, {bytes, bytes, LayerRange{0, 3}}, out), absl::StatusCode::kInvalidArgument);
  codec::ChunkHeader v1 = h;
  v1.layout.version = 1;
  EXPECT_FALSE(CanHashOnDevice(v1, ok));
  EXPECT_EQ(code(v1, ok, out), absl::StatusCode::kInvalidArgument);
  codec::ChunkHeader small = h;
  small.layout.v.layer_stride = 240;
  EXPECT_FALSE(CanHashOnDevice(small, ok));
  codec::ChunkHeader odd = h;
  odd.layout.k.layer_stride = 4104;
  EXPECT_FALSE(CanHashOnDevice(odd, ok));
  auto range = [&](const uint8_t* at, uint64_t n, void* w, uint64_t* o) {
    return HashDeviceRange(at, n, 0, w, o, nullptr).code();
  };
  EXPECT_EQ(range(bytes, 240, ws, out), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(range(bytes, 264, ws, out), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(range(bytes + 4, 256, ws, out), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(range(bytes, 256, ws, nullptr), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(range(bytes, 256, nullptr, out), absl::StatusCode::kInvalidArgument);
  // 128 bytes a 1 KiB block of each record: K's 16 KiB records take 16
  // blocks and V's 8 KiB + 16 bytes of scales 9; one layer half of it.
  EXPECT_EQ(StagedRecordsWorkspaceBytes(h, LayerRange{}), 2 * (16 + 9) * 128u);
  EXPECT_EQ(StagedRecordsWorkspaceBytes(h, LayerRange{1, 2}), (16 + 9) * 128u);
  EXPECT_EQ(DeviceRangeWorkspaceBytes(1024), 128u);
  EXPECT_EQ(DeviceRangeWorkspaceBytes(1025), 256u);
}

}  // namespace
}  // namespace kvtier::kernels
