// GPU gather+encode and decode+scatter against the CPU references: the chunk
// must be memcmp-equal to the codec's (after codec::SealChunk), and the cache
// after decode+scatter byte-equal to the reference's, untouched slots included.
#include <cuda_runtime_api.h>

#include <cstring>
#include <string>
#include <vector>

#include "codec/codec.h"
#include "gtest/gtest.h"
#include "kernels/device_copy.cuh"
#include "kernels/gpu_test_util.h"
#include "kernels/paged_codec.h"
#include "kernels/reference.h"

namespace kvtier::kernels {
namespace {

using codec::DType;
using codec::ScaleGranularity;
using testing::DeviceCache;
using testing::Fill;
using testing::HostCache;

struct Case {
  CacheLayout kind;
  DType dtype;        // cache K dtype and chunk dtype
  DType v_cache;      // cache V dtype (kFP8E4M3 for asymmetric caches)
  std::string codec;  // a preset (k16v8) or k=FMT[/GRAN],v=FMT[/GRAN] (codec::ParseCodec)
  uint32_t head_dim, block_size, tokens, first_slot, layers, heads;
  Fill fill;
  bool pinned_dst;
};

std::string Name(const Case& c) {
  return std::string(CacheLayoutName(c.kind)) + "/" + codec::DTypeName(c.dtype) + "/v" +
         codec::DTypeName(c.v_cache) + "/" + c.codec + "/d" + std::to_string(c.head_dim) + "/bs" +
         std::to_string(c.block_size) + "/t" + std::to_string(c.tokens) + "/s" +
         std::to_string(c.first_slot) + (c.pinned_dst ? "/pinned" : "");
}

// Decodes layers `r` of `chunk` (device memory, or mapped pinned host memory,
// read by the kernel or, with `staging`, copied into it first: the three
// decode paths) into a cache poisoned with `poison` and checks it against the
// CPU reference's decode of `want` into the same poisoned cache.
void CheckDecode(const Case& c, const PagedKvLayout& layout, const std::vector<uint8_t>& want,
                 const codec::ChunkHeader& header, const uint8_t* chunk,
                 const BlockSpan& host_span, const BlockSpan& dev_span, LayerRange r,
                 HostStaging* staging, uint8_t poison) {
  testing::PoisonedCaches caches;
  KVTIER_ASSERT_CUDA(caches.Init(c.kind, layout, poison));
  HostCache &expect = caches.expect, &gpu_out = caches.got;
  DeviceCache& dst = caches.dev;
  ASSERT_TRUE(ReferenceDecodeScatter(want, expect.layout, host_span, r).ok());
  absl::Status st = staging == nullptr
                        ? DecodeScatter(header, chunk, dst.layout, dev_span, r, nullptr)
                        : DecodeScatter(header, chunk, dst.layout, dev_span, r, *staging, nullptr);
  ASSERT_TRUE(st.ok()) << st;
  KVTIER_ASSERT_CUDA(cudaDeviceSynchronize());
  KVTIER_ASSERT_CUDA(dst.CopyTo(gpu_out));
  ASSERT_EQ(testing::CacheDifference(gpu_out, expect), "");
}

// Returns the host chunk produced by the GPU (sealed) and checks decode+scatter.
void RunCase(const Case& c, bool inject_non_finite = false) {
  SCOPED_TRACE(Name(c));
  auto layout = MakePagedKvLayout(c.kind, c.layers, /*num_blocks=*/0, c.block_size, c.heads,
                                  c.head_dim, c.dtype, c.v_cache);
  const uint32_t need = (c.first_slot + c.tokens + c.block_size - 1) / c.block_size;
  const uint32_t num_blocks = 2 * need + 3;
  layout = MakePagedKvLayout(c.kind, c.layers, num_blocks, c.block_size, c.heads, c.head_dim,
                             c.dtype, c.v_cache);
  ASSERT_TRUE(layout.ok()) << layout.status();
  HostCache host;
  host.Init(c.kind, *layout);
  host.FillValues(c.fill, 1234 + c.tokens);
  if (inject_non_finite && !IsSeparate(c.kind)) {
    // In the last layer: a chunk encoded by layer ranges carries the flag of
    // a launch after the first.
    uint16_t* p = static_cast<uint16_t*>(host.layout.v_layers[c.layers - 1]);
    for (int64_t i = 0; i < static_cast<int64_t>(LayerTensorElements(c.kind, *layout)); ++i) {
      p[i] = (i % 97 == 3) ? (c.dtype == DType::kBF16 ? 0x7FC0 : 0x7E00) : p[i];
      if (i % 101 == 5) p[i] = c.dtype == DType::kBF16 ? 0xFF80 : 0xFC00;  // -inf
    }
  }
  std::vector<int32_t> ids = testing::ShuffledBlocks(num_blocks, need, 77 + c.tokens);
  auto fmt = codec::ParseCodec(c.codec, c.dtype);
  ASSERT_TRUE(fmt.ok()) << fmt.status();
  codec::ChunkSpec spec;
  spec.geometry = {c.layers, c.heads, c.head_dim, c.tokens, c.block_size};
  spec.dtype = c.dtype;
  spec.k = fmt->k;
  spec.v = fmt->v;
  spec.fingerprint.bytes[3] = 0x5A;

  BlockSpan host_span{ids.data(), ids.data(), need, c.first_slot};
  auto want = ReferenceGatherEncode(spec, host.layout, host_span);
  ASSERT_TRUE(want.ok()) << want.status();
  if (IsSeparate(c.kind) == false && c.v_cache != DType::kFP8E4M3) {
    // For 16-bit caches the reference is exactly the codec's EncodeChunk.
    std::vector<uint16_t> k = GatherSection(host.layout, false, host_span, c.tokens);
    std::vector<uint16_t> v = GatherSection(host.layout, true, host_span, c.tokens);
    auto enc = codec::EncodeChunk(spec, codec::KvView{k, v});
    ASSERT_TRUE(enc.ok());
    ASSERT_EQ(*enc, *want);
  }
  if (inject_non_finite) {
    auto hdr = codec::ParseHeader(*want);
    ASSERT_TRUE(hdr.ok());
    ASSERT_EQ(hdr->spec.flags, codec::kFlagNonFinite);
  }

  DeviceCache dev;
  KVTIER_ASSERT_CUDA(dev.Upload(host));
  int32_t* d_ids = nullptr;
  uint32_t* ws = nullptr;
  KVTIER_ASSERT_CUDA(cudaMalloc(&d_ids, ids.size() * 4));
  KVTIER_ASSERT_CUDA(cudaMemcpy(d_ids, ids.data(), ids.size() * 4, cudaMemcpyHostToDevice));
  KVTIER_ASSERT_CUDA(cudaMalloc(&ws, kGatherEncodeWorkspaceBytes));
  KVTIER_ASSERT_CUDA(cudaMemset(ws, 0, kGatherEncodeWorkspaceBytes));
  const size_t bytes = want->size();
  uint8_t* d_chunk = nullptr;
  uint8_t* h_pinned = nullptr;
  if (c.pinned_dst) {
    KVTIER_ASSERT_CUDA(cudaHostAlloc(reinterpret_cast<void**>(&h_pinned), bytes, cudaHostAllocMapped));
    std::memset(h_pinned, 0xCD, bytes);  // poison: every byte must be written
    KVTIER_ASSERT_CUDA(cudaHostGetDevicePointer(reinterpret_cast<void**>(&d_chunk), h_pinned, 0));
  } else {
    KVTIER_ASSERT_CUDA(cudaMalloc(&d_chunk, bytes));
    KVTIER_ASSERT_CUDA(cudaMemset(d_chunk, 0xCD, bytes));
  }
  BlockSpan dev_span{d_ids, ids.data(), need, c.first_slot};
  // Twice: the workspace must be left clean by the first launch.
  for (int rep = 0; rep < 2; ++rep) {
    absl::Status st = GatherEncode(spec, dev.layout, dev_span, d_chunk, ws, nullptr);
    ASSERT_TRUE(st.ok()) << st;
    KVTIER_ASSERT_CUDA(cudaDeviceSynchronize());
    std::vector<uint8_t> got(bytes);
    if (c.pinned_dst) {
      std::memcpy(got.data(), h_pinned, bytes);
    } else {
      KVTIER_ASSERT_CUDA(cudaMemcpy(got.data(), d_chunk, bytes, cudaMemcpyDeviceToHost));
    }
    for (size_t off : {codec::kOffKChecksum, codec::kOffVChecksum, codec::kOffHeaderChecksum}) {
      uint64_t z;
      std::memcpy(&z, got.data() + off, 8);
      ASSERT_EQ(z, 0u) << "the kernel leaves the checksums to SealChunk";
    }
    ASSERT_TRUE(codec::SealChunk(got).ok());
    size_t first_diff = bytes;
    for (size_t i = 0; i < bytes; ++i)
      if (got[i] != (*want)[i]) {
        first_diff = i;
        break;
      }
    ASSERT_EQ(std::memcmp(got.data(), want->data(), bytes), 0)
        << "first differing byte at " << first_diff << " of " << bytes << ": got "
        << int(got[first_diff]) << " want " << int((*want)[first_diff]);
  }
  // Every launch leaves the workspace zero (flags, CTA count, per-layer amax).
  std::vector<uint32_t> ws_after(kGatherEncodeWorkspaceBytes / 4, 1u);
  KVTIER_ASSERT_CUDA(cudaMemcpy(ws_after.data(), ws, kGatherEncodeWorkspaceBytes,
                                cudaMemcpyDeviceToHost));
  for (size_t i = 0; i < ws_after.size(); ++i) ASSERT_EQ(ws_after[i], 0u) << "workspace word " << i;

  // Decode+scatter into a poisoned cache, on the GPU and on the CPU, from
  // device memory and from mapped pinned host memory.
  auto header = codec::VerifyChunk(*want);
  ASSERT_TRUE(header.ok()) << header.status();
  uint8_t* d_src = nullptr;
  uint8_t* h_src = nullptr;
  uint8_t* hd_src = nullptr;
  KVTIER_ASSERT_CUDA(cudaMalloc(&d_src, bytes));
  KVTIER_ASSERT_CUDA(cudaMemcpy(d_src, want->data(), bytes, cudaMemcpyHostToDevice));
  KVTIER_ASSERT_CUDA(cudaHostAlloc(reinterpret_cast<void**>(&h_src), bytes, cudaHostAllocMapped));
  std::memcpy(h_src, want->data(), bytes);
  KVTIER_ASSERT_CUDA(cudaHostGetDevicePointer(reinterpret_cast<void**>(&hd_src), h_src, 0));
  // A staging that holds the chunk, and one that holds no layer (the staged
  // call decodes without it).
  auto staging = HostStaging::Create(bytes);
  ASSERT_TRUE(staging.ok()) << staging.status();
  auto tiny = HostStaging::Create(16);
  ASSERT_TRUE(tiny.ok()) << tiny.status();
  struct Source {
    const uint8_t* chunk;
    HostStaging* staging;
    const char* name;
  };
  const Source sources[] = {{d_src, nullptr, "device memory"},
                            {hd_src, nullptr, "pinned host memory"},
                            {hd_src, staging->get(), "pinned host memory, staged"},
                            {hd_src, tiny->get(), "pinned host memory, staging < a layer"}};
  for (const Source& src : sources) {
    SCOPED_TRACE(std::string("decode from ") + src.name);
    CheckDecode(c, *layout, *want, *header, src.chunk, host_span, dev_span, LayerRange{},
                src.staging, 0x5C);
    if (::testing::Test::HasFatalFailure()) return;
  }

  // Layer ranges: the chunk encoded range by range is the single launch's
  // chunk; a range alone writes exactly its layers' records; a range decode
  // writes exactly its layers, as the reference's.
  if (c.layers >= 2) {
    const uint32_t a = c.layers / 3 == 0 ? 1 : c.layers / 3;
    const uint32_t b = a + (c.layers - a) / 2;
    std::vector<LayerRange> split = {{0, a}, {a, b}, {b, c.layers}};
    if (b == a) split = {{0, a}, {a, c.layers}};
    std::vector<uint8_t> got(bytes);
    auto fetch = [&]() {
      if (c.pinned_dst) {
        std::memcpy(got.data(), h_pinned, bytes);
        return cudaSuccess;
      }
      return cudaMemcpy(got.data(), d_chunk, bytes, cudaMemcpyDeviceToHost);
    };
    auto poison = [&]() {
      if (c.pinned_dst) {
        std::memset(h_pinned, 0xCD, bytes);
        return cudaSuccess;
      }
      return cudaMemset(d_chunk, 0xCD, bytes);
    };
    KVTIER_ASSERT_CUDA(poison());
    for (const LayerRange& r : split) {
      absl::Status rs = GatherEncode(spec, dev.layout, dev_span, r, d_chunk, ws, nullptr);
      ASSERT_TRUE(rs.ok()) << rs;
    }
    KVTIER_ASSERT_CUDA(cudaDeviceSynchronize());
    KVTIER_ASSERT_CUDA(fetch());
    ASSERT_TRUE(codec::SealChunk(got).ok());
    ASSERT_EQ(std::memcmp(got.data(), want->data(), bytes), 0) << "chunk encoded by layer ranges";

    const LayerRange tail{1, c.layers};
    KVTIER_ASSERT_CUDA(poison());
    absl::Status rs = GatherEncode(spec, dev.layout, dev_span, tail, d_chunk, ws, nullptr);
    ASSERT_TRUE(rs.ok()) << rs;
    KVTIER_ASSERT_CUDA(cudaDeviceSynchronize());
    KVTIER_ASSERT_CUDA(fetch());
    std::vector<bool> inside(bytes, false);
    for (const auto& [lo, hi] : LayerRecordBytes(header->layout, tail)) {
      for (uint64_t i = lo; i < hi; ++i) inside[i] = true;
    }
    for (size_t i = codec::kHeaderSize; i < bytes; ++i) {
      if (inside[i]) {
        ASSERT_EQ(got[i], (*want)[i]) << "byte " << i << " of layers [1, " << c.layers << ")";
      } else {
        ASSERT_EQ(got[i], 0xCD) << "byte " << i << " outside layers [1, " << c.layers << ")";
      }
    }
    ws_after.assign(kGatherEncodeWorkspaceBytes / 4, 1u);
    KVTIER_ASSERT_CUDA(cudaMemcpy(ws_after.data(), ws, kGatherEncodeWorkspaceBytes,
                                  cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < ws_after.size(); ++i) ASSERT_EQ(ws_after[i], 0u) << "workspace word " << i;

    // The middle range (with a staging too: other layers' records lie
    // between its K and V records, so it is decoded without) and the tail
    // [1, L) (staged when L >= 3).
    for (const LayerRange& r : {split[1], tail}) {
      for (const Source& src : sources) {
        SCOPED_TRACE(std::string("range [") + std::to_string(r.begin) + ", " +
                     std::to_string(r.end) + ") decode from " + src.name);
        CheckDecode(c, *layout, *want, *header, src.chunk, host_span, dev_span, r, src.staging,
                    0x3A);
        if (::testing::Test::HasFatalFailure()) return;
      }
    }
  }
  cudaFree(d_src);
  cudaFreeHost(h_src);
  cudaFree(d_ids);
  cudaFree(ws);
  if (c.pinned_dst) {
    cudaFreeHost(h_pinned);
  } else {
    cudaFree(d_chunk);
  }
}

constexpr CacheLayout kAllLayouts[] = {
    CacheLayout::kVllmFlashAttnNHD,  CacheLayout::kVllmFlashAttnHND, CacheLayout::kVllmFlashInferNHD,
    CacheLayout::kVllmFlashInferHND, CacheLayout::kSeparateNHD,      CacheLayout::kSeparateHND};

// A staging buffer keeps its memory for smaller sizes and grows for larger
// ones (what GpuPagedIo's pool relies on); the grown buffer is usable.
TEST(HostStagingGpu, ReserveKeepsOrGrowsTheBuffer) {
  KVTIER_SKIP_WITHOUT_GPU();
  auto s = HostStaging::Create(100);
  ASSERT_TRUE(s.ok()) << s.status();
  HostStaging& st = **s;
  EXPECT_EQ(st.capacity(), 100u);
  ASSERT_NE(st.data(), nullptr);
  const uint8_t* first = st.data();
  ASSERT_TRUE(st.Reserve(64).ok());
  EXPECT_EQ(st.data(), first);
  EXPECT_EQ(st.capacity(), 100u);
  ASSERT_TRUE(st.Reserve(size_t{3} << 20).ok());
  EXPECT_EQ(st.capacity(), size_t{3} << 20);
  std::vector<uint8_t> back(st.capacity());
  KVTIER_ASSERT_CUDA(cudaMemset(st.data(), 0xA5, st.capacity()));
  KVTIER_ASSERT_CUDA(cudaMemcpy(back.data(), st.data(), back.size(), cudaMemcpyDeviceToHost));
  EXPECT_EQ(back.front(), 0xA5);
  EXPECT_EQ(back.back(), 0xA5);
}

// The staged decode checks its input before it copies or launches anything:
// a null chunk, a header whose geometry is not the cache's and a layer range
// past the chunk are InvalidArgument, and the staging buffer is untouched.
TEST(HostStagingGpu, StagedDecodeOfBadInputIsInvalidArgumentAndCopiesNothing) {
  KVTIER_SKIP_WITHOUT_GPU();
  auto layout = MakePagedKvLayout(CacheLayout::kVllmFlashAttnNHD, 2, 3, 16, 2, 128, DType::kBF16,
                                  DType::kBF16);
  ASSERT_TRUE(layout.ok()) << layout.status();
  HostCache host;
  host.Init(CacheLayout::kVllmFlashAttnNHD, *layout);
  DeviceCache dev;
  KVTIER_ASSERT_CUDA(dev.Upload(host));
  std::vector<int32_t> ids = {2, 0, 1};
  int32_t* d_ids = nullptr;
  KVTIER_ASSERT_CUDA(cudaMalloc(&d_ids, ids.size() * 4));
  KVTIER_ASSERT_CUDA(cudaMemcpy(d_ids, ids.data(), ids.size() * 4, cudaMemcpyHostToDevice));
  const BlockSpan span{d_ids, ids.data(), 3, 0};
  codec::ChunkHeader header;
  header.spec.geometry = {2, 2, 128, 40, 16};
  header.spec.dtype = DType::kBF16;
  header.spec.k = {DType::kINT8, codec::ScaleGranularity::kPerTokenHead};
  header.spec.v = {DType::kINT8, codec::ScaleGranularity::kPerTokenHead};
  auto cl = codec::ValidateSpec(header.spec);
  ASSERT_TRUE(cl.ok()) << cl.status();
  header.layout = *cl;
  uint8_t *h_chunk = nullptr, *d_chunk = nullptr;
  KVTIER_ASSERT_CUDA(
      cudaHostAlloc(reinterpret_cast<void**>(&h_chunk), cl->total_bytes, cudaHostAllocMapped));
  std::memset(h_chunk, 0x11, cl->total_bytes);
  KVTIER_ASSERT_CUDA(cudaHostGetDevicePointer(reinterpret_cast<void**>(&d_chunk), h_chunk, 0));
  auto staging = HostStaging::Create(cl->total_bytes);
  ASSERT_TRUE(staging.ok()) << staging.status();
  HostStaging& st = **staging;
  KVTIER_ASSERT_CUDA(cudaMemset(st.data(), 0xA5, st.capacity()));
  // The header and chunk are good: the staged decode runs (a sanity check
  // that the bad cases below fail for their own reason).
  ASSERT_TRUE(DecodeScatter(header, d_chunk, dev.layout, span, {}, st, nullptr).ok());
  KVTIER_ASSERT_CUDA(cudaDeviceSynchronize());
  KVTIER_ASSERT_CUDA(cudaMemset(st.data(), 0xA5, st.capacity()));
  EXPECT_EQ(DecodeScatter(header, nullptr, dev.layout, span, {}, st, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(DecodeScatter(header, d_chunk, dev.layout, span, {1, 5}, st, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  codec::ChunkHeader other = header;
  other.spec.geometry.head_dim = 64;
  auto ol = codec::ValidateSpec(other.spec);
  ASSERT_TRUE(ol.ok());
  other.layout = *ol;
  EXPECT_EQ(DecodeScatter(other, d_chunk, dev.layout, span, {}, st, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  KVTIER_ASSERT_CUDA(cudaDeviceSynchronize());
  std::vector<uint8_t> back(st.capacity());
  KVTIER_ASSERT_CUDA(cudaMemcpy(back.data(), st.data(), back.size(), cudaMemcpyDeviceToHost));
  for (size_t i = 0; i < back.size(); ++i) ASSERT_EQ(back[i], 0xA5) << "staging byte " << i;
  cudaFreeHost(h_chunk);
  cudaFree(d_ids);
}

TEST(PagedCodecGpu, MatchesCodecOnEveryLayoutDtypeAndCodec) {
  KVTIER_SKIP_WITHOUT_GPU();
  for (CacheLayout kind : kAllLayouts)
    for (DType dt : {DType::kBF16, DType::kFP16})
      for (const char* name : {"k16v16", "k16v8", "k8v8"})
        for (Fill fill : {Fill::kIntegers, Fill::kNormal}) {
          RunCase({kind, dt, dt, name, 128, 16, 256, 0, 3, 4, fill, false});
          if (HasFatalFailure()) return;
        }
}

TEST(PagedCodecGpu, AwkwardShapes) {
  KVTIER_SKIP_WITHOUT_GPU();
  const Case cases[] = {
      // odd token count, chunk not aligned to blocks
      {CacheLayout::kVllmFlashAttnNHD, DType::kBF16, DType::kBF16, "k16v8", 128, 16, 77, 5, 2, 8, Fill::kNormal, false},
      {CacheLayout::kVllmFlashInferHND, DType::kFP16, DType::kFP16, "k16v8", 64, 32, 33, 31, 2, 3, Fill::kNormal, false},
      // a single block, largest head_dim
      {CacheLayout::kSeparateHND, DType::kBF16, DType::kBF16, "k8v8", 256, 64, 40, 0, 2, 2, Fill::kNormal, false},
      {CacheLayout::kVllmFlashAttnHND, DType::kBF16, DType::kBF16, "k16v8", 256, 16, 1, 0, 1, 1, Fill::kIntegers, false},
      {CacheLayout::kVllmFlashInferNHD, DType::kBF16, DType::kBF16, "k16v8", 256, 8, 100, 7, 2, 2, Fill::kNormal, false},
      {CacheLayout::kVllmFlashAttnNHD, DType::kFP16, DType::kFP16, "k16v16", 64, 64, 129, 63, 2, 5, Fill::kIntegers, false},
      // all-zero groups: scale 1
      {CacheLayout::kVllmFlashAttnNHD, DType::kBF16, DType::kBF16, "k8v8", 128, 16, 48, 0, 2, 2, Fill::kZero, false},
      // asymmetric caches: V kept in FP8, passed through
      {CacheLayout::kSeparateNHD, DType::kBF16, DType::kFP8E4M3, "k16v8", 128, 16, 256, 0, 3, 8, Fill::kNormal, false},
      {CacheLayout::kSeparateHND, DType::kFP16, DType::kFP8E4M3, "k16v8", 64, 32, 70, 0, 2, 4, Fill::kNormal, false},
      // into mapped pinned host memory
      {CacheLayout::kVllmFlashAttnNHD, DType::kBF16, DType::kBF16, "k16v8", 128, 16, 256, 0, 4, 8, Fill::kNormal, true},
      {CacheLayout::kSeparateNHD, DType::kBF16, DType::kFP8E4M3, "k16v8", 128, 16, 99, 0, 2, 4, Fill::kNormal, true},
  };
  for (const Case& c : cases) {
    RunCase(c);
    if (HasFatalFailure()) return;
  }
}

TEST(PagedCodecGpu, NonFiniteInputSetsFlagAndMatches) {
  KVTIER_SKIP_WITHOUT_GPU();
  for (DType dt : {DType::kBF16, DType::kFP16}) {
    RunCase({CacheLayout::kVllmFlashAttnNHD, dt, dt, "k16v8", 128, 16, 64, 3, 2, 2, Fill::kNormal, false},
            /*inject_non_finite=*/true);
    if (HasFatalFailure()) return;
  }
}

// Every chunk section format a 16-bit cache section can take, in
// codec::ParseCodec's explicit spelling.
std::vector<std::string> AllSectionNames() {
  std::vector<std::string> out = {"16"};
  for (const char* q : {"fp8e4m3", "int8", "int4"})
    for (const char* g : {"tensor", "block-head", "token-head"}) out.push_back(std::string(q) + "/" + g);
  return out;
}

std::string PairName(const std::string& k, const std::string& v) { return "k=" + k + ",v=" + v; }

// K and V each over {native, FP8, INT8, INT4} x {per-tensor, per-(block, head),
// per-(token, head)}: 100 pairs, each at head_dim 64/128/256 and block size
// 16/32, with odd token counts and chunks that start mid-block; layouts and
// dtypes rotate over the cases.
TEST(PagedCodecGpu, MatchesCodecOnEveryFormatPairOfA16BitCache) {
  KVTIER_SKIP_WITHOUT_GPU();
  const std::vector<std::string> names = AllSectionNames();
  uint32_t n = 0;
  for (const std::string& k : names)
    for (const std::string& v : names)
      for (uint32_t hd : {64u, 128u, 256u})
        for (uint32_t bs : {16u, 32u}) {
          const CacheLayout kind = kAllLayouts[n % 6];
          const DType dt = (n / 6) % 2 ? DType::kFP16 : DType::kBF16;
          const Fill fill = n % 5 == 0 ? Fill::kIntegers : Fill::kNormal;
          const uint32_t tokens = bs == 16 ? 77 : 45;
          const uint32_t first_slot = bs == 16 ? 5 : 31;
          ++n;
          RunCase({kind, dt, dt, PairName(k, v), hd, bs, tokens, first_slot, 2, 3, fill, false});
          if (HasFatalFailure()) return;
        }
}

TEST(PagedCodecGpu, QuantizedFormatsOnAwkwardShapes) {
  KVTIER_SKIP_WITHOUT_GPU();
  const Case cases[] = {
      // presets that use the new paths
      {CacheLayout::kVllmFlashAttnNHD, DType::kBF16, DType::kBF16, "k16v4", 128, 16, 256, 0, 3, 8, Fill::kNormal, false},
      {CacheLayout::kVllmFlashInferHND, DType::kFP16, DType::kFP16, "k8v4", 128, 16, 99, 3, 2, 4, Fill::kNormal, false},
      {CacheLayout::kVllmFlashAttnHND, DType::kBF16, DType::kBF16, "ki8vi8", 64, 16, 130, 15, 2, 4, Fill::kNormal, false},
      {CacheLayout::kSeparateNHD, DType::kFP16, DType::kFP16, "k16vi8", 256, 32, 64, 0, 2, 2, Fill::kIntegers, false},
      // one token; block sizes 8 and 64
      {CacheLayout::kVllmFlashAttnNHD, DType::kBF16, DType::kBF16, "k=int4/tensor,v=int8/token-head", 256, 16, 1, 7, 1, 1, Fill::kNormal, false},
      {CacheLayout::kVllmFlashInferNHD, DType::kFP16, DType::kFP16, "k=int8/block-head,v=int4/tensor", 64, 8, 37, 3, 3, 5, Fill::kNormal, false},
      {CacheLayout::kSeparateHND, DType::kBF16, DType::kBF16, "k=fp8e4m3/tensor,v=fp8e4m3/token-head", 128, 64, 129, 63, 2, 3, Fill::kNormal, false},
      {CacheLayout::kVllmFlashAttnHND, DType::kFP16, DType::kFP16, "k=int4/block-head,v=fp8e4m3/tensor", 256, 64, 200, 0, 2, 2, Fill::kNormal, false},
      // many layers with per-tensor scales (one amax word per layer and section)
      {CacheLayout::kVllmFlashAttnNHD, DType::kBF16, DType::kBF16, "k=int8/tensor,v=int4/tensor", 128, 16, 100, 9, 9, 2, Fill::kNormal, false},
      // all-zero groups: scale 1 (the amax pre-pass adds nothing)
      {CacheLayout::kVllmFlashAttnNHD, DType::kBF16, DType::kBF16, "k=int8/tensor,v=int4/token-head", 128, 16, 48, 0, 2, 2, Fill::kZero, false},
      {CacheLayout::kVllmFlashInferHND, DType::kFP16, DType::kFP16, "k=fp8e4m3/token-head,v=int4/block-head", 64, 32, 40, 1, 2, 2, Fill::kZero, false},
      // asymmetric caches: K quantized on the GPU, V passed through
      {CacheLayout::kSeparateNHD, DType::kBF16, DType::kFP8E4M3, "k=int8/token-head,v=fp8e4m3", 128, 16, 77, 0, 2, 4, Fill::kNormal, false},
      {CacheLayout::kSeparateHND, DType::kFP16, DType::kFP8E4M3, "k=int4/tensor,v=fp8e4m3", 64, 32, 70, 0, 3, 4, Fill::kNormal, false},
      // into mapped pinned host memory
      {CacheLayout::kVllmFlashAttnNHD, DType::kBF16, DType::kBF16, "k=int8/tensor,v=int4/token-head", 128, 16, 99, 2, 3, 4, Fill::kNormal, true},
      {CacheLayout::kSeparateNHD, DType::kBF16, DType::kFP8E4M3, "k=int4/block-head,v=fp8e4m3", 128, 16, 64, 0, 2, 4, Fill::kNormal, true},
      // model-like shapes (8 kv heads, 16-24 layers, 250-300 tokens): decodes
      // from host memory of more CTAs than the GPU holds at once
      {CacheLayout::kVllmFlashAttnNHD, DType::kBF16, DType::kBF16, "k=int4/token-head,v=int4/token-head", 128, 16, 250, 3, 24, 8, Fill::kNormal, false},
      {CacheLayout::kVllmFlashInferHND, DType::kFP16, DType::kFP16, "k=int8/block-head,v=int4/block-head", 128, 16, 256, 0, 20, 8, Fill::kNormal, false},
      {CacheLayout::kSeparateNHD, DType::kBF16, DType::kBF16, "k=fp8e4m3/token-head,v=int8/tensor", 64, 32, 300, 5, 16, 8, Fill::kNormal, false},
  };
  for (const Case& c : cases) {
    RunCase(c);
    if (HasFatalFailure()) return;
  }
}

TEST(PagedCodecGpu, NonFiniteInputSetsFlagAndMatchesForEveryQuantizedFormat) {
  KVTIER_SKIP_WITHOUT_GPU();
  for (DType dt : {DType::kBF16, DType::kFP16}) {
    for (const char* name : {"k=int8/tensor,v=int4/token-head", "k=int4/block-head,v=int8/tensor",
                             "k=fp8e4m3/token-head,v=fp8e4m3/tensor", "k=int8/token-head,v=16"}) {
      RunCase({CacheLayout::kVllmFlashAttnNHD, dt, dt, name, 128, 16, 64, 3, 2, 2, Fill::kNormal, false},
              /*inject_non_finite=*/true);
      if (HasFatalFailure()) return;
    }
  }
}

// A kernel that lets the next grid launch at once (programmatic dependent
// launch), sleeps about `sleep_ns`, then copies `n` block ids from `from`
// to `to`: a decode launched after it with PriorKernel::kLeavesChunk starts
// while it sleeps, and must read the ids it writes, not the ones before.
__global__ void GateThenWriteIds(const int32_t* from, int32_t* to, uint32_t n, uint64_t sleep_ns) {
  AllowDependentLaunch();
  uint64_t start, now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do {
    __nanosleep(1000);
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  } while (now - start < sleep_ns);
  for (uint32_t i = threadIdx.x; i < n; i += blockDim.x) to[i] = from[i];
}

// Decodes chained on one stream with PriorKernel::kLeavesChunk, as a prefix
// load enqueues them: each may start while the one before it runs. Chunks in
// host memory (both decode kernels: quantized formats and 16-bit / FP8
// per-(block, head) ones) and in device memory. The cache must be the
// reference's decode of the chunks in stream order: every decode reads block
// ids written by the kernel before the chain (which sleeps while the first
// decodes load their chunks), and the last chunk overwrites the blocks of
// the one before it.
TEST(PagedCodecGpu, ChainedDecodesFromHostKeepStreamOrder) {
  KVTIER_SKIP_WITHOUT_GPU();
  const CacheLayout kind = CacheLayout::kVllmFlashAttnNHD;
  const uint32_t L = 4, H = 8, D = 128, BS = 16, kChunks = 7;
  struct Run {
    uint32_t tokens, first_slot;
  };
  const Run runs[kChunks] = {{64, 0}, {64, 0}, {40, 5}, {64, 0}, {17, 0}, {64, 0}, {64, 0}};
  uint32_t total_ids = 0;
  std::vector<uint32_t> id_at(kChunks);
  for (uint32_t i = 0; i < kChunks; ++i) {
    id_at[i] = total_ids;
    total_ids += (runs[i].first_slot + runs[i].tokens + BS - 1) / BS;
  }
  const uint32_t num_blocks = total_ids + 4;
  auto layout = MakePagedKvLayout(kind, L, num_blocks, BS, H, D, DType::kBF16, DType::kBF16);
  ASSERT_TRUE(layout.ok()) << layout.status();
  HostCache src;
  src.Init(kind, *layout);
  src.FillValues(Fill::kNormal, 4242);
  // Chunk i comes from source blocks ids[id_at[i]...] and goes to the same
  // block ids of the destination; the last chunk takes its predecessor's
  // destination blocks (its source blocks are its own).
  std::vector<int32_t> ids = testing::ShuffledBlocks(num_blocks, total_ids, 99);
  std::vector<int32_t> dst_ids = ids;
  const uint32_t last = kChunks - 1, prev = kChunks - 2;
  for (uint32_t j = 0; j < (runs[last].tokens + BS - 1) / BS; ++j) {
    dst_ids[id_at[last] + j] = ids[id_at[prev] + j];
  }
  // What the ids hold until the gate kernel writes them: other valid blocks.
  std::vector<int32_t> stale(total_ids);
  for (uint32_t i = 0; i < total_ids; ++i) stale[i] = (dst_ids[i] + 1) % num_blocks;
  int32_t *d_ids = nullptr, *d_good = nullptr;
  KVTIER_ASSERT_CUDA(cudaMalloc(&d_ids, total_ids * 4));
  KVTIER_ASSERT_CUDA(cudaMalloc(&d_good, total_ids * 4));
  KVTIER_ASSERT_CUDA(cudaMemcpy(d_good, dst_ids.data(), total_ids * 4, cudaMemcpyHostToDevice));
  cudaStream_t stream;
  KVTIER_ASSERT_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));

  struct Format {
    const char* name;
    bool in_device;
  };
  for (const auto& [name, in_device] :
       {Format{"k=int4/token-head,v=int4/token-head", false},
        Format{"k=int4/block-head,v=int4/block-head", false}, Format{"ki8vi8", false},
        Format{"k=fp8e4m3/token-head,v=int8/tensor", false}, Format{"k16v4", false},
        Format{"k16v8", false}, Format{"k16v16", false}, Format{"ki8vi8", true},
        Format{"k16v8", true}}) {
    SCOPED_TRACE(std::string(name) + (in_device ? " in device memory" : " in host memory"));
    auto fmt = codec::ParseCodec(name, DType::kBF16);
    ASSERT_TRUE(fmt.ok()) << fmt.status();
    testing::PoisonedCaches caches;
    KVTIER_ASSERT_CUDA(caches.Init(kind, *layout, 0x6B));
    HostCache &expect = caches.expect, &got = caches.got;
    DeviceCache& dst = caches.dev;
    std::vector<std::vector<uint8_t>> chunks(kChunks);
    std::vector<codec::ChunkHeader> headers(kChunks);
    std::vector<uint8_t*> pinned(kChunks, nullptr), mapped(kChunks, nullptr);
    for (uint32_t i = 0; i < kChunks; ++i) {
      codec::ChunkSpec spec;
      spec.geometry = {L, H, D, runs[i].tokens, BS};
      spec.dtype = DType::kBF16;
      spec.k = fmt->k;
      spec.v = fmt->v;
      const uint32_t n = (runs[i].first_slot + runs[i].tokens + BS - 1) / BS;
      const BlockSpan from{ids.data() + id_at[i], ids.data() + id_at[i], n, runs[i].first_slot};
      auto chunk = ReferenceGatherEncode(spec, src.layout, from);
      ASSERT_TRUE(chunk.ok()) << chunk.status();
      chunks[i] = *std::move(chunk);
      auto header = codec::VerifyChunk(chunks[i]);
      ASSERT_TRUE(header.ok()) << header.status();
      headers[i] = *header;
      const BlockSpan to{dst_ids.data() + id_at[i], dst_ids.data() + id_at[i], n,
                         runs[i].first_slot};
      ASSERT_TRUE(ReferenceDecodeScatter(chunks[i], expect.layout, to).ok());
      if (in_device) {
        KVTIER_ASSERT_CUDA(cudaMalloc(&mapped[i], chunks[i].size()));
        KVTIER_ASSERT_CUDA(cudaMemcpy(mapped[i], chunks[i].data(), chunks[i].size(),
                                      cudaMemcpyHostToDevice));
        continue;
      }
      KVTIER_ASSERT_CUDA(cudaHostAlloc(reinterpret_cast<void**>(&pinned[i]), chunks[i].size(),
                                       cudaHostAllocMapped));
      std::memcpy(pinned[i], chunks[i].data(), chunks[i].size());
      KVTIER_ASSERT_CUDA(
          cudaHostGetDevicePointer(reinterpret_cast<void**>(&mapped[i]), pinned[i], 0));
    }
    KVTIER_ASSERT_CUDA(cudaMemcpy(d_ids, stale.data(), total_ids * 4, cudaMemcpyHostToDevice));
    GateThenWriteIds<<<1, 128, 0, stream>>>(d_good, d_ids, total_ids, 200'000);
    KVTIER_ASSERT_CUDA(cudaGetLastError());
    for (uint32_t i = 0; i < kChunks; ++i) {
      const uint32_t n = (runs[i].first_slot + runs[i].tokens + BS - 1) / BS;
      const BlockSpan to{d_ids + id_at[i], dst_ids.data() + id_at[i], n, runs[i].first_slot};
      const absl::Status st = DecodeScatter(headers[i], mapped[i], dst.layout, to, LayerRange{},
                                            stream, PriorKernel::kLeavesChunk);
      ASSERT_TRUE(st.ok()) << st;
    }
    KVTIER_ASSERT_CUDA(cudaStreamSynchronize(stream));
    KVTIER_ASSERT_CUDA(dst.CopyTo(got));
    ASSERT_EQ(testing::CacheDifference(got, expect), "");
    for (uint32_t i = 0; i < kChunks; ++i) {
      if (in_device) {
        cudaFree(mapped[i]);
      } else {
        cudaFreeHost(pinned[i]);
      }
    }
  }
  cudaStreamDestroy(stream);
  cudaFree(d_ids);
  cudaFree(d_good);
}

}  // namespace
}  // namespace kvtier::kernels
