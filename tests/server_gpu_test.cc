// libkvtier's GPU paged-cache path against an in-process kvtierd: a chunk
// gathered and encoded on the GPU straight into a shared-memory slot must be
// byte-identical to the CPU codec's chunk of the same tokens, and loading it
// back must scatter exactly the CPU reference's values. Skips without a device.
// cuda_runtime.h (not _api.h): the typed cudaMalloc overloads the helpers use.
#include <cuda_runtime.h>

#include <functional>
#include <string>
#include <tuple>

#include "client/kvtier_client.h"
#include "client/kvtier_gpu.h"
#include "codec/codec.h"
#include "common/testing/temp_dir.h"
#include "gtest/gtest.h"
#include "kernels/gpu_test_util.h"
#include "kernels/reference.h"
#include "kernels/test_util.h"
#include "server/daemon.h"
#include "server/test_util.h"
#include "tests/cli_runner.h"

namespace kvtier::client {
namespace {

using kernels::BlockSpan;
using kernels::CacheLayout;
using kernels::testing::DeviceCache;
using kernels::testing::Fill;
using kernels::testing::HostCache;
using kvtier::testing::SmallDaemonOptions;
using kvtier::testing::TempDir;
using kvtier::testing::TestKey;

struct LayerCase;

class ServerGpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    KVTIER_SKIP_WITHOUT_GPU();
    ASSERT_NO_FATAL_FAILURE(Start([](server::DaemonOptions&) {}));
  }
  // (Re)starts kvtierd (64 MiB of DRAM, then `adjust`), the client and the GPU path.
  template <typename Adjust>
  void Start(Adjust adjust) {
    io_.reset();
    client_.reset();
    daemon_.reset();
    server::DaemonOptions o = SmallDaemonOptions(dir_.path());
    o.dram_gib = 64.0 / 1024;
    adjust(o);
    auto d = server::Daemon::Start(o);
    ASSERT_TRUE(d.ok()) << d.status();
    daemon_ = std::move(*d);
    ClientOptions co;
    co.socket_path = daemon_->socket_path();
    co.timeout_ms = 10000;
    auto c = KvtierClient::Connect(co);
    ASSERT_TRUE(c.ok()) << c.status();
    client_ = std::move(*c);
    ASSERT_TRUE(client_->uses_shared_memory());
    auto io = GpuPagedIo::Create(client_.get());
    ASSERT_TRUE(io.ok()) << io.status();
    io_ = std::move(*io);
  }
  void TearDown() override {
    io_.reset();
    client_.reset();
    daemon_.reset();
  }

  // Bit rot in DRAM: byte `at` of chunk `key` (by default one V payload byte)
  // flips in the pool, after the daemon verified it at put. at(header, size)
  // names the byte.
  void CorruptInPool(const Hash128& key,
                     const std::function<uint64_t(const codec::ChunkLayout&, uint64_t)>& at =
                         [](const codec::ChunkLayout&, uint64_t size) { return size - 80; }) {
    auto held = client_->Hold(key);
    ASSERT_TRUE(held.ok()) << held.status();
    auto header = codec::ParseHeader(held->data);
    ASSERT_TRUE(header.ok()) << header.status();
    const uint64_t where = at(header->layout, held->data.size());
    ASSERT_LT(where, held->data.size());
    const_cast<uint8_t*>(held->data.data())[where] ^= 0x40;
    ASSERT_TRUE(client_->Unhold(*held).ok());
  }

  TempDir dir_;
  std::unique_ptr<server::Daemon> daemon_;
  std::unique_ptr<KvtierClient> client_;
  // Stores chunk i of `c` as TestKey(first + i) for every chunk, and lists
  // them for a layer-wise load.
  void StoreChunks(const LayerCase& c, uint32_t first, std::vector<PagedChunk>* chunks);
  // Decodes the stored chunks TestKey(first + i) into `expect` with the CPU
  // reference, at chunk i's blocks.
  void ReferenceLoads(const LayerCase& c, uint32_t first, HostCache* expect);

  std::unique_ptr<GpuPagedIo> io_;
};

TEST_F(ServerGpuTest, PagedCacheStoreAndLoadMatchTheCpuCodec) {
  constexpr uint32_t kLayers = 4, kHeads = 8, kDim = 128, kBlock = 16, kTokens = 256;
  uint32_t case_index = 0;
  for (CacheLayout kind : {CacheLayout::kVllmFlashAttnNHD, CacheLayout::kSeparateHND}) {
    // k16v8 before the larger k16v16, so the pooled staging buffer of the
    // loads grows; ki8vi8 through the general decode; INT4 by the kernel
    // reading the pool itself (DecodeScatter's choice for 4-bit chunks).
    for (const char* name : {"k16v8", "k16v16", "ki8vi8", "k=int4/token-head,v=int4/token-head"}) {
      SCOPED_TRACE(std::string(kernels::CacheLayoutName(kind)) + "/" + name);
      const uint32_t need = kTokens / kBlock, num_blocks = 2 * need + 3;
      auto layout = kernels::MakePagedKvLayout(kind, kLayers, num_blocks, kBlock, kHeads, kDim,
                                               codec::DType::kBF16, codec::DType::kBF16);
      ASSERT_TRUE(layout.ok()) << layout.status();
      HostCache host;
      host.Init(kind, *layout);
      host.FillValues(Fill::kNormal, 4321);
      std::vector<int32_t> ids = kernels::testing::ShuffledBlocks(num_blocks, need, 99);
      auto fmt = codec::ParseCodec(name, codec::DType::kBF16);
      ASSERT_TRUE(fmt.ok());
      codec::ChunkSpec spec;
      spec.geometry = {kLayers, kHeads, kDim, kTokens, kBlock};
      spec.k = fmt->k;
      spec.v = fmt->v;
      spec.fingerprint = Hash128::Of(std::string_view("gpu-model"), 1);
      BlockSpan host_span{ids.data(), ids.data(), need, 0};
      // The CPU codec's chunk of the same tokens.
      std::vector<uint16_t> k = kernels::GatherSection(host.layout, false, host_span, kTokens);
      std::vector<uint16_t> v = kernels::GatherSection(host.layout, true, host_span, kTokens);
      auto want = codec::EncodeChunk(spec, codec::KvView{k, v});
      ASSERT_TRUE(want.ok()) << want.status();
      // The kernels' CPU reference agrees (its contract for 16-bit caches).
      auto ref = kernels::ReferenceGatherEncode(spec, host.layout, host_span);
      ASSERT_TRUE(ref.ok()) << ref.status();
      ASSERT_TRUE(*ref == *want);

      DeviceCache dev;
      KVTIER_ASSERT_CUDA(dev.Upload(host));
      int32_t* d_ids = nullptr;
      KVTIER_ASSERT_CUDA(cudaMalloc(&d_ids, ids.size() * 4));
      KVTIER_ASSERT_CUDA(cudaMemcpy(d_ids, ids.data(), ids.size() * 4, cudaMemcpyHostToDevice));
      BlockSpan dev_span{d_ids, ids.data(), need, 0};
      cudaStream_t stream;
      KVTIER_ASSERT_CUDA(cudaStreamCreate(&stream));

      const Hash128 key = TestKey(100 + case_index++);
      absl::Status st = io_->Store(key, spec, dev.layout, dev_span, stream);
      ASSERT_TRUE(st.ok()) << st;
      auto got = client_->Get(key);
      ASSERT_TRUE(got.ok()) << got.status();
      ASSERT_EQ(got->size(), want->size());
      EXPECT_TRUE(*got == *want) << "the GPU-encoded chunk differs from the CPU codec's";
      // The same through the kernels writing the slot (no staging buffer).
      io_->set_stage_stores(false);
      const Hash128 direct_key = TestKey(500 + case_index);
      st = io_->Store(direct_key, spec, dev.layout, dev_span, stream);
      io_->set_stage_stores(true);
      ASSERT_TRUE(st.ok()) << st;
      auto direct = client_->Get(direct_key);
      ASSERT_TRUE(direct.ok()) << direct.status();
      EXPECT_TRUE(*direct == *want) << "the chunk the kernels wrote into the slot differs";
      EXPECT_TRUE(client_->Delete(direct_key).ok());
      // The store above landed in groups (the daemon sealing each as it
      // landed) wherever the device writes 64-bit values from a stream
      // (compute capability 7.0 on); the same chunk one layer a group, and
      // in one copy committed after it.
      const codec::ChunkLayout chunk_layout = codec::ValidateSpec(spec).value();
      EXPECT_GT(io_->landing_layers(chunk_layout), 0u);
      for (uint64_t piece : {uint64_t{1}, uint64_t{0}}) {
        io_->set_landing(piece != 0, piece);
        if (piece != 0) EXPECT_EQ(io_->landing_layers(chunk_layout), 1u);
        const Hash128 other_key = TestKey(700 + case_index);
        st = io_->Store(other_key, spec, dev.layout, dev_span, stream);
        io_->set_landing(true);
        ASSERT_TRUE(st.ok()) << st;
        auto other = client_->Get(other_key);
        ASSERT_TRUE(other.ok()) << other.status();
        EXPECT_TRUE(*other == *want) << "landing piece bytes " << piece;
        EXPECT_TRUE(client_->Delete(other_key).ok());
      }

      // Load into a poisoned cache; compare with the CPU reference scatter.
      HostCache expect, gpu_out;
      expect.Init(kind, *layout);
      gpu_out.Init(kind, *layout);
      expect.Poison(0x5C);
      gpu_out.Poison(0x5C);
      DeviceCache dst;
      KVTIER_ASSERT_CUDA(dst.Upload(expect));
      ASSERT_TRUE(kernels::ReferenceDecodeScatter(*want, expect.layout, host_span).ok());
      auto tier = io_->Load(key, dst.layout, dev_span, stream);
      ASSERT_TRUE(tier.ok()) << tier.status();
      EXPECT_EQ(*tier, Tier::kDram);
      KVTIER_ASSERT_CUDA(dst.CopyTo(gpu_out));
      for (uint32_t l = 0; l < kLayers; ++l) {
        ASSERT_EQ(gpu_out.k_tensors[l], expect.k_tensors[l]) << "layer " << l;
        if (!gpu_out.v_tensors.empty()) { ASSERT_EQ(gpu_out.v_tensors[l], expect.v_tensors[l]); }
      }
      // The hold of the load was released: the chunk can be deleted.
      EXPECT_TRUE(client_->Delete(key).ok());
      EXPECT_EQ(io_->Load(key, dst.layout, dev_span, stream).status().code(),
                absl::StatusCode::kNotFound);
      cudaStreamDestroy(stream);
      cudaFree(d_ids);
    }
  }
}

TEST_F(ServerGpuTest, StoreWithAMismatchedSpecIsInvalidArgumentAndLeaksNoSlot) {
  constexpr uint32_t kLayers = 2, kHeads = 2, kDim = 64, kBlock = 16, kTokens = 32;
  auto layout = kernels::MakePagedKvLayout(CacheLayout::kVllmFlashAttnNHD, kLayers, 8, kBlock,
                                           kHeads, kDim, codec::DType::kBF16, codec::DType::kBF16);
  ASSERT_TRUE(layout.ok());
  HostCache host;
  host.Init(CacheLayout::kVllmFlashAttnNHD, *layout);
  host.FillValues(Fill::kIntegers, 7);
  DeviceCache dev;
  KVTIER_ASSERT_CUDA(dev.Upload(host));
  std::vector<int32_t> ids = {3, 5};
  int32_t* d_ids = nullptr;
  KVTIER_ASSERT_CUDA(cudaMalloc(&d_ids, ids.size() * 4));
  KVTIER_ASSERT_CUDA(cudaMemcpy(d_ids, ids.data(), ids.size() * 4, cudaMemcpyHostToDevice));
  BlockSpan span{d_ids, ids.data(), 2, 0};
  codec::ChunkSpec spec;
  spec.geometry = {kLayers, kHeads, 128, kTokens, kBlock};  // head_dim differs from the cache
  EXPECT_EQ(io_->Store(TestKey(3), spec, dev.layout, span, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  auto stats = client_->Stats();
  ASSERT_TRUE(stats.ok());
  for (const TierStats& t : stats->tiers) {
    if (t.tier == Tier::kDram) { EXPECT_EQ(t.used_bytes, 0u); }
  }
  cudaFree(d_ids);
}

// A BF16 vLLM FlashAttention cache of 4 layers with 64-token chunks at
// shuffled blocks, on the device, with its host copy.
struct LayerCase {
  static constexpr uint32_t kLayers = 4, kHeads = 2, kDim = 64, kBlock = 16, kTokens = 64;
  static constexpr uint32_t kNeed = kTokens / kBlock, kChunks = 3, kBlocks = kChunks * kNeed + 4;
  HostCache host;
  DeviceCache dev;
  std::vector<int32_t> ids;  // kChunks * kNeed
  int32_t* d_ids = nullptr;
  codec::ChunkSpec spec;

  void Init(uint64_t seed) {
    auto layout = kernels::MakePagedKvLayout(CacheLayout::kVllmFlashAttnNHD, kLayers, kBlocks,
                                             kBlock, kHeads, kDim, codec::DType::kBF16,
                                             codec::DType::kBF16);
    ASSERT_TRUE(layout.ok());
    host.Init(CacheLayout::kVllmFlashAttnNHD, *layout);
    host.FillValues(Fill::kNormal, seed);
    ids = kernels::testing::ShuffledBlocks(kBlocks, kChunks * kNeed, seed + 1);
    KVTIER_ASSERT_CUDA(dev.Upload(host));
    KVTIER_ASSERT_CUDA(cudaMalloc(&d_ids, ids.size() * 4));
    KVTIER_ASSERT_CUDA(cudaMemcpy(d_ids, ids.data(), ids.size() * 4, cudaMemcpyHostToDevice));
    auto fmt = codec::ParseCodec("k16v8", codec::DType::kBF16);
    ASSERT_TRUE(fmt.ok());
    spec.geometry = {kLayers, kHeads, kDim, kTokens, kBlock};
    spec.k = fmt->k;
    spec.v = fmt->v;
  }
  ~LayerCase() { cudaFree(d_ids); }
  BlockSpan Span(uint32_t chunk) const {
    return BlockSpan{d_ids + chunk * kNeed, ids.data() + chunk * kNeed, kNeed, 0};
  }
  BlockSpan HostSpan(uint32_t chunk) const {
    return BlockSpan{ids.data() + chunk * kNeed, ids.data() + chunk * kNeed, kNeed, 0};
  }
  // Host caches of this layout, every byte `poison`: the expected and the
  // read-back contents of a load target.
  void PoisonedCaches(uint8_t poison, HostCache* expect, HostCache* got) const {
    for (HostCache* h : {expect, got}) {
      h->Init(CacheLayout::kVllmFlashAttnNHD, host.layout);
      h->Poison(poison);
    }
  }
};

void ServerGpuTest::StoreChunks(const LayerCase& c, uint32_t first,
                                std::vector<PagedChunk>* chunks) {
  for (uint32_t i = 0; i < LayerCase::kChunks; ++i) {
    ASSERT_TRUE(io_->Store(TestKey(first + i), c.spec, c.dev.layout, c.Span(i), nullptr).ok());
    chunks->push_back({TestKey(first + i), c.Span(i)});
  }
}

void ServerGpuTest::ReferenceLoads(const LayerCase& c, uint32_t first, HostCache* expect) {
  for (uint32_t i = 0; i < LayerCase::kChunks; ++i) {
    auto chunk = client_->Get(TestKey(first + i));
    ASSERT_TRUE(chunk.ok()) << chunk.status();
    ASSERT_TRUE(kernels::ReferenceDecodeScatter(*chunk, expect->layout, c.HostSpan(i)).ok());
  }
}

TEST_F(ServerGpuTest, StoreByLayerRangesIsTheChunkOfOneStore) {
  LayerCase c;
  ASSERT_NO_FATAL_FAILURE(c.Init(31));
  cudaStream_t a, b;
  KVTIER_ASSERT_CUDA(cudaStreamCreate(&a));
  KVTIER_ASSERT_CUDA(cudaStreamCreate(&b));
  ASSERT_TRUE(io_->Store(TestKey(40), c.spec, c.dev.layout, c.Span(0), a).ok());
  auto pending = io_->BeginStore(c.spec);
  ASSERT_TRUE(pending.ok()) << pending.status();
  PendingStore& p = **pending;
  EXPECT_EQ(p.EncodeLayers(c.dev.layout, c.Span(0), {1, 2}, a).code(),
            absl::StatusCode::kInvalidArgument);  // must start at layer 0
  ASSERT_TRUE(p.EncodeLayers(c.dev.layout, c.Span(0), {0, 1}, a).ok());
  EXPECT_EQ(p.Commit(TestKey(41)).code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(p.EncodeLayers(c.dev.layout, c.Span(0), {1, 3}, b).ok());
  ASSERT_TRUE(p.EncodeLayers(c.dev.layout, c.Span(0), {3, kernels::LayerRange::kAllLayers}, b).ok());
  ASSERT_TRUE(p.Commit(TestKey(41)).ok());
  // The same ranges with the kernels writing the slot (no staging buffer).
  io_->set_stage_stores(false);
  auto direct = io_->BeginStore(c.spec);
  io_->set_stage_stores(true);
  ASSERT_TRUE(direct.ok()) << direct.status();
  ASSERT_TRUE((*direct)->EncodeLayers(c.dev.layout, c.Span(0), {0, 1}, a).ok());
  ASSERT_TRUE((*direct)->EncodeLayers(c.dev.layout, c.Span(0), {1, 3}, b).ok());
  ASSERT_TRUE((*direct)
                  ->EncodeLayers(c.dev.layout, c.Span(0), {3, kernels::LayerRange::kAllLayers}, b)
                  .ok());
  // WaitEncoded first (the device's part alone, twice: idempotent), then
  // the commit, which makes no CUDA call.
  ASSERT_TRUE((*direct)->WaitEncoded().ok());
  ASSERT_TRUE((*direct)->WaitEncoded().ok());
  ASSERT_TRUE((*direct)->Commit(TestKey(43)).ok());
  auto one = client_->Get(TestKey(40));
  auto ranged = client_->Get(TestKey(41));
  auto ranged_direct = client_->Get(TestKey(43));
  ASSERT_TRUE(one.ok() && ranged.ok() && ranged_direct.ok());
  EXPECT_TRUE(*one == *ranged);
  EXPECT_TRUE(*one == *ranged_direct);
  // An abandoned store gives its slot back, part-encoded or wholly encoded
  // and waited for; WaitEncoded before the last layer is refused.
  {
    auto q = io_->BeginStore(c.spec);
    ASSERT_TRUE(q.ok());
    ASSERT_TRUE((*q)->EncodeLayers(c.dev.layout, c.Span(1), {0, 2}, a).ok());
    EXPECT_EQ((*q)->WaitEncoded().code(), absl::StatusCode::kFailedPrecondition);
  }
  {
    auto q = io_->BeginStore(c.spec);
    ASSERT_TRUE(q.ok());
    ASSERT_TRUE((*q)->EncodeLayers(c.dev.layout, c.Span(1), {}, a).ok());
    ASSERT_TRUE((*q)->WaitEncoded().ok());
  }
  EXPECT_EQ(client_->Get(TestKey(42)).status().code(), absl::StatusCode::kNotFound);
  cudaStreamDestroy(a);
  cudaStreamDestroy(b);
}

TEST_F(ServerGpuTest, StoreBatchStoresEachChunkAsStoreWouldAndReportsEachFailure) {
  LayerCase c;
  ASSERT_NO_FATAL_FAILURE(c.Init(33));
  cudaStream_t stream;
  KVTIER_ASSERT_CUDA(cudaStreamCreate(&stream));
  // More chunks than StoreBatch encodes ahead and commits at once, one of
  // them with a block list one block short (InvalidArgument for it alone).
  std::vector<PagedChunk> chunks;
  std::vector<uint32_t> source;  // the LayerCase chunk each entry holds
  for (uint32_t i = 0; i < GpuPagedIo::kStoreBatchDepth + GpuPagedIo::kStoreBatchCommits + 3;
       ++i) {
    source.push_back(i % LayerCase::kChunks);
    chunks.push_back({TestKey(200 + i), c.Span(source.back())});
  }
  const size_t bad = 2;
  chunks[bad].blocks.num_ids -= 1;
  for (bool staged : {true, false}) {
    SCOPED_TRACE(staged ? "staged" : "zero-copy");
    io_->set_stage_stores(staged);
    std::vector<absl::Status> st = io_->StoreBatch(chunks, c.spec, c.dev.layout, stream);
    io_->set_stage_stores(true);
    ASSERT_EQ(st.size(), chunks.size());
    for (size_t i = 0; i < chunks.size(); ++i) {
      SCOPED_TRACE(i);
      if (i == bad) {
        EXPECT_EQ(st[i].code(), absl::StatusCode::kInvalidArgument) << st[i];
        EXPECT_EQ(client_->Get(chunks[i].key).status().code(), absl::StatusCode::kNotFound);
        continue;
      }
      ASSERT_TRUE(st[i].ok()) << st[i];
      auto want = kernels::ReferenceGatherEncode(c.spec, c.host.layout, c.HostSpan(source[i]));
      ASSERT_TRUE(want.ok()) << want.status();
      auto got = client_->Get(chunks[i].key);
      ASSERT_TRUE(got.ok()) << got.status();
      EXPECT_TRUE(*got == *want) << "chunk " << i << " differs from the CPU reference";
      EXPECT_TRUE(client_->Delete(chunks[i].key).ok());
    }
  }
  EXPECT_TRUE(io_->StoreBatch({}, c.spec, c.dev.layout, stream).empty());
  cudaStreamDestroy(stream);
}

TEST_F(ServerGpuTest, LoadOfALayerRangeWritesOnlyThoseLayers) {
  LayerCase c;
  ASSERT_NO_FATAL_FAILURE(c.Init(32));
  ASSERT_TRUE(io_->Store(TestKey(50), c.spec, c.dev.layout, c.Span(0), nullptr).ok());
  auto chunk = client_->Get(TestKey(50));
  ASSERT_TRUE(chunk.ok());
  HostCache expect, got;
  c.PoisonedCaches(0x77, &expect, &got);
  DeviceCache dst;
  KVTIER_ASSERT_CUDA(dst.Upload(expect));
  ASSERT_TRUE(kernels::ReferenceDecodeScatter(*chunk, expect.layout, c.HostSpan(0), {1, 3}).ok());
  auto tier = io_->Load(TestKey(50), dst.layout, c.Span(0), nullptr, {1, 3});
  ASSERT_TRUE(tier.ok()) << tier.status();
  KVTIER_ASSERT_CUDA(dst.CopyTo(got));
  for (uint32_t l = 0; l < LayerCase::kLayers; ++l) {
    ASSERT_EQ(got.k_tensors[l], expect.k_tensors[l]) << "layer " << l;
  }
  EXPECT_EQ(io_->Load(TestKey(50), dst.layout, c.Span(0), nullptr, {3, 9}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(ServerGpuTest, LayerwiseLoadDecodesEveryFoundChunkAndReportsTheMissing) {
  LayerCase c;
  ASSERT_NO_FATAL_FAILURE(c.Init(33));
  std::vector<PagedChunk> chunks;
  ASSERT_NO_FATAL_FAILURE(StoreChunks(c, 60, &chunks));
  chunks.insert(chunks.begin() + 1, PagedChunk{TestKey(69), c.Span(0)});  // a miss
  HostCache expect, got;
  c.PoisonedCaches(0x21, &expect, &got);
  DeviceCache dst;
  KVTIER_ASSERT_CUDA(dst.Upload(expect));
  ASSERT_NO_FATAL_FAILURE(ReferenceLoads(c, 60, &expect));
  cudaStream_t load_stream, compute;
  KVTIER_ASSERT_CUDA(cudaStreamCreate(&load_stream));
  KVTIER_ASSERT_CUDA(cudaStreamCreate(&compute));
  auto lw = io_->BeginLayerwiseLoad(chunks, dst.layout, /*layer_group=*/3, load_stream);
  ASSERT_TRUE(lw.ok()) << lw.status();
  EXPECT_EQ((*lw)->LayerEvent(2), (*lw)->LayerEvent(0));
  EXPECT_NE((*lw)->LayerEvent(3), (*lw)->LayerEvent(0));
  for (uint32_t l = 0; l < LayerCase::kLayers; ++l) ASSERT_TRUE((*lw)->WaitLayer(l, compute).ok());
  EXPECT_EQ((*lw)->WaitLayer(4, compute).code(), absl::StatusCode::kInvalidArgument);
  KVTIER_ASSERT_CUDA(cudaStreamSynchronize(compute));  // every layer is in
  KVTIER_ASSERT_CUDA(dst.CopyTo(got));
  for (uint32_t l = 0; l < LayerCase::kLayers; ++l) {
    ASSERT_EQ(got.k_tensors[l], expect.k_tensors[l]) << "layer " << l;
  }
  ASSERT_TRUE((*lw)->Finish().ok());
  const auto& r = (*lw)->results();
  ASSERT_EQ(r.size(), 4u);
  EXPECT_EQ(r[1].status().code(), absl::StatusCode::kNotFound);
  for (size_t i : {0, 2, 3}) {
    ASSERT_TRUE(r[i].ok()) << r[i].status();
    EXPECT_EQ(*r[i], Tier::kDram);
  }
  // Finish released the holds: the chunks can be deleted.
  for (uint32_t i = 0; i < LayerCase::kChunks; ++i) EXPECT_TRUE(client_->Delete(TestKey(60 + i)).ok());
  cudaStreamDestroy(load_stream);
  cudaStreamDestroy(compute);
}

// A load of one layer group (the vLLM connector's default), its decodes
// reading the pool, scatters the CPU reference's values and releases every
// hold; a second load of the same chunks does the same.
TEST_F(ServerGpuTest, LayerwiseLoadOfOneGroupMatchesTheCpuCodec) {
  LayerCase c;
  ASSERT_NO_FATAL_FAILURE(c.Init(36));
  std::vector<PagedChunk> chunks;
  ASSERT_NO_FATAL_FAILURE(StoreChunks(c, 100, &chunks));
  HostCache expect, got;
  c.PoisonedCaches(0x21, &expect, &got);
  ASSERT_NO_FATAL_FAILURE(ReferenceLoads(c, 100, &expect));
  cudaStream_t stream, compute;
  KVTIER_ASSERT_CUDA(cudaStreamCreate(&stream));
  KVTIER_ASSERT_CUDA(cudaStreamCreate(&compute));
  for (int pass = 0; pass < 2; ++pass) {
    SCOPED_TRACE(::testing::Message() << "pass " << pass);
    DeviceCache dst;
    HostCache poisoned;
    poisoned.Init(CacheLayout::kVllmFlashAttnNHD, c.host.layout);
    poisoned.Poison(0x21);
    KVTIER_ASSERT_CUDA(dst.Upload(poisoned));
    auto lw = io_->BeginLayerwiseLoad(chunks, dst.layout, LayerCase::kLayers, stream);
    ASSERT_TRUE(lw.ok()) << lw.status();
    // The one event covers every layer: a stream that waits for the last
    // layer sees the whole load.
    ASSERT_TRUE((*lw)->WaitLayer(LayerCase::kLayers - 1, compute).ok());
    KVTIER_ASSERT_CUDA(cudaStreamSynchronize(compute));
    KVTIER_ASSERT_CUDA(dst.CopyTo(got));
    for (uint32_t l = 0; l < LayerCase::kLayers; ++l) {  // K and V, in this layout
      ASSERT_EQ(got.k_tensors[l], expect.k_tensors[l]) << "layer " << l;
    }
    ASSERT_TRUE((*lw)->Finish().ok());
    for (const auto& r : (*lw)->results()) EXPECT_TRUE(r.ok()) << r.status();
  }
  // Finish released the holds: the chunks can be deleted.
  for (uint32_t i = 0; i < LayerCase::kChunks; ++i) {
    EXPECT_TRUE(client_->Delete(TestKey(100 + i)).ok());
  }
  cudaStreamDestroy(stream);
  cudaStreamDestroy(compute);
}

// kvtierd's hold limit admits about one and a half chunks at a time: a
// layer-wise load of three chunks runs in rounds (it finishes and releases
// what it holds, then holds the refused chunks again) and decodes every one,
// for one layer group and for several.
TEST_F(ServerGpuTest, LayerwiseLoadPastTheDaemonsHoldLimitLoadsEveryChunkInRounds) {
  LayerCase c;
  ASSERT_NO_FATAL_FAILURE(c.Init(35));
  auto layout = codec::ValidateSpec(c.spec);
  ASSERT_TRUE(layout.ok()) << layout.status();
  const double share = 1.5 * static_cast<double>(layout->total_bytes) / (64.0 * 1024 * 1024);
  ASSERT_NO_FATAL_FAILURE(Start([share](server::DaemonOptions& o) {
    o.max_held_share = share;
    o.max_holder_share = share;
  }));
  std::vector<PagedChunk> chunks;
  ASSERT_NO_FATAL_FAILURE(StoreChunks(c, 90, &chunks));
  // The limit is real: a second hold beside the first is refused.
  auto first = client_->Hold(TestKey(90));
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(client_->Hold(TestKey(91)).status().code(), absl::StatusCode::kResourceExhausted);
  ASSERT_TRUE(client_->Unhold(*first).ok());
  HostCache expect, got;
  c.PoisonedCaches(0x21, &expect, &got);
  ASSERT_NO_FATAL_FAILURE(ReferenceLoads(c, 90, &expect));
  cudaStream_t stream;
  KVTIER_ASSERT_CUDA(cudaStreamCreate(&stream));
  for (uint32_t group : {LayerCase::kLayers, 1u}) {
    SCOPED_TRACE(::testing::Message() << "layer_group " << group);
    DeviceCache dst;
    HostCache poisoned;
    poisoned.Init(CacheLayout::kVllmFlashAttnNHD, c.host.layout);
    poisoned.Poison(0x21);
    KVTIER_ASSERT_CUDA(dst.Upload(poisoned));
    auto lw = io_->BeginLayerwiseLoad(chunks, dst.layout, group, stream);
    ASSERT_TRUE(lw.ok()) << lw.status();
    ASSERT_TRUE((*lw)->Finish().ok());
    for (const auto& r : (*lw)->results()) EXPECT_TRUE(r.ok()) << r.status();
    KVTIER_ASSERT_CUDA(dst.CopyTo(got));
    for (uint32_t l = 0; l < LayerCase::kLayers; ++l) {  // K and V, in this layout
      ASSERT_EQ(got.k_tensors[l], expect.k_tensors[l]) << "layer " << l;
    }
  }
  cudaStreamDestroy(stream);
}

// For several layer groups and for one (every layer at once).
class LayerwiseCorruptionTest
    : public ServerGpuTest,
      public ::testing::WithParamInterface<std::tuple<uint32_t, bool>> {};

// With the device check on, the chunks go the staged way (copy stream,
// slabs, device hashes); off, the kernels read the pool and host threads
// hash it.
TEST_P(LayerwiseCorruptionTest, LayerwiseLoadReportsAChunkCorruptedInThePoolAtFinish) {
  const auto [group, on_device] = GetParam();
  io_->set_device_verify(on_device);
  LayerCase c;
  ASSERT_NO_FATAL_FAILURE(c.Init(34));
  std::vector<PagedChunk> chunks;
  ASSERT_NO_FATAL_FAILURE(StoreChunks(c, 80, &chunks));
  ASSERT_NO_FATAL_FAILURE(CorruptInPool(TestKey(81)));
  DeviceCache dst;
  HostCache poisoned;
  poisoned.Init(CacheLayout::kVllmFlashAttnNHD, c.host.layout);
  poisoned.Poison(0x21);
  KVTIER_ASSERT_CUDA(dst.Upload(poisoned));
  cudaStream_t stream;
  KVTIER_ASSERT_CUDA(cudaStreamCreate(&stream));
  auto lw = io_->BeginLayerwiseLoad(chunks, dst.layout, group, stream);
  ASSERT_TRUE(lw.ok()) << lw.status();
  ASSERT_TRUE((*lw)->Finish().ok());
  EXPECT_EQ(io_->chunks_checked_on_device(), on_device ? LayerCase::kChunks : 0u);
  const auto& r = (*lw)->results();
  ASSERT_EQ(r.size(), size_t{LayerCase::kChunks});
  EXPECT_EQ(r[1].status().code(), absl::StatusCode::kDataLoss) << r[1].status();
  for (uint32_t i = 0; i < LayerCase::kChunks; ++i) {
    if (i != 1) { EXPECT_TRUE(r[i].ok()) << i << ": " << r[i].status(); }
  }
  // The corrupt chunk is never served as good again.
  const absl::StatusCode code = client_->Get(TestKey(81)).status().code();
  EXPECT_TRUE(code == absl::StatusCode::kDataLoss || code == absl::StatusCode::kNotFound) << code;
  cudaStreamDestroy(stream);
}

INSTANTIATE_TEST_SUITE_P(GroupsDeviceAndHost, LayerwiseCorruptionTest,
                         ::testing::Combine(::testing::Values(1u, 2u, LayerCase::kLayers),
                                            ::testing::Bool()));

// Where a byte of a stored chunk rots: a K record, a V record, an entry of
// V's record table, the entry of layer 0 in K's record table, the header's
// token count.
enum class Rot { kKRecord, kVRecord, kVTable, kKTable, kHeader };

class LoadCorruptionTest : public ServerGpuTest,
                           public ::testing::WithParamInterface<std::tuple<bool, Rot>> {};

// A chunk whose bytes rot in the pool after the daemon verified them: Load
// decodes it through the staging buffer, the reader's check (on the device
// or on the host) fails, the daemon re-checks it and Load returns DataLoss;
// the chunk is not served as good again. Nothing else is lost: another
// chunk, loaded next by the same GpuPagedIo (reusing the pooled staging
// buffer and record sums), scatters the CPU reference's values.
TEST_P(LoadCorruptionTest, LoadOfAChunkCorruptedInThePoolIsDataLossAndTheNextLoadIsExact) {
  const auto [on_device, rot] = GetParam();
  io_->set_device_verify(on_device);
  LayerCase c;
  ASSERT_NO_FATAL_FAILURE(c.Init(35));
  for (uint32_t i = 0; i < 2; ++i) {
    ASSERT_TRUE(io_->Store(TestKey(90 + i), c.spec, c.dev.layout, c.Span(i), nullptr).ok());
  }
  auto good = client_->Get(TestKey(91));
  ASSERT_TRUE(good.ok()) << good.status();
  ASSERT_NO_FATAL_FAILURE(CorruptInPool(TestKey(90), [rot](const codec::ChunkLayout& l, uint64_t) {
    switch (rot) {
      case Rot::kKRecord:
        return l.k_offset + l.k.data_offset(1) + 5;
      case Rot::kVRecord:
        return l.v_offset + l.v.data_offset(l.geometry.num_layers - 1) + 9;
      case Rot::kVTable:
        return l.v_offset + l.v.table_offset + 8 + 2;
      case Rot::kKTable:
        return l.k_offset + l.k.table_offset;
      case Rot::kHeader:
        return uint64_t{36};
    }
    return uint64_t{0};
  }));
  HostCache expect, got;
  c.PoisonedCaches(0x3C, &expect, &got);
  DeviceCache dst;
  KVTIER_ASSERT_CUDA(dst.Upload(expect));
  EXPECT_EQ(io_->Load(TestKey(90), dst.layout, c.Span(0), nullptr).status().code(),
            absl::StatusCode::kDataLoss);
  const absl::StatusCode code = client_->Get(TestKey(90)).status().code();
  EXPECT_TRUE(code == absl::StatusCode::kDataLoss || code == absl::StatusCode::kNotFound) << code;

  // Chunk 1 into a poisoned cache: exactly the reference's values, every
  // other slot still poisoned.
  DeviceCache next;  // a fresh poisoned cache (a DeviceCache uploads once)
  KVTIER_ASSERT_CUDA(next.Upload(expect));
  ASSERT_TRUE(kernels::ReferenceDecodeScatter(*good, expect.layout, c.HostSpan(1)).ok());
  auto tier = io_->Load(TestKey(91), next.layout, c.Span(1), nullptr);
  ASSERT_TRUE(tier.ok()) << tier.status();
  EXPECT_EQ(*tier, Tier::kDram);
  // Both loads were checked where the test asked (the device takes these
  // records: 16 and 8 KiB); a rotted header fails before any launch.
  EXPECT_EQ(io_->chunks_checked_on_device(), on_device ? (rot == Rot::kHeader ? 1u : 2u) : 0u);
  KVTIER_ASSERT_CUDA(next.CopyTo(got));
  for (uint32_t l = 0; l < LayerCase::kLayers; ++l) {
    ASSERT_EQ(got.k_tensors[l], expect.k_tensors[l]) << "layer " << l;
  }
}

INSTANTIATE_TEST_SUITE_P(DeviceAndHost, LoadCorruptionTest,
                         ::testing::Combine(::testing::Bool(),
                                            ::testing::Values(Rot::kKRecord, Rot::kVRecord,
                                                              Rot::kVTable, Rot::kKTable,
                                                              Rot::kHeader)));

}  // namespace
}  // namespace kvtier::client
