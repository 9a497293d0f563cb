// libkvtier's GPU paged-cache path against an in-process kvtierd: a chunk
// gathered and encoded on the GPU straight into a shared-memory slot must be
// byte-identical to the CPU codec's chunk of the same tokens, and loading it
// back must scatter exactly the CPU reference's values. Skips without a device.
// cuda_runtime.h (not _api.h): the typed cudaMalloc overloads the helpers use.
#include <cuda_runtime.h>

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

class ServerGpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    KVTIER_SKIP_WITHOUT_GPU();
    server::DaemonOptions o = SmallDaemonOptions(dir_.path());
    o.dram_gib = 64.0 / 1024;
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

  TempDir dir_;
  std::unique_ptr<server::Daemon> daemon_;
  std::unique_ptr<KvtierClient> client_;
  std::unique_ptr<GpuPagedIo> io_;
};

TEST_F(ServerGpuTest, PagedCacheStoreAndLoadMatchTheCpuCodec) {
  constexpr uint32_t kLayers = 4, kHeads = 8, kDim = 128, kBlock = 16, kTokens = 256;
  uint32_t case_index = 0;
  for (CacheLayout kind : {CacheLayout::kVllmFlashAttnNHD, CacheLayout::kSeparateHND}) {
    for (const char* name : {"k16v16", "k16v8"}) {
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
        if (!gpu_out.v_tensors.empty()) ASSERT_EQ(gpu_out.v_tensors[l], expect.v_tensors[l]);
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
    if (t.tier == Tier::kDram) EXPECT_EQ(t.used_bytes, 0u);
  }
  cudaFree(d_ids);
}

}  // namespace
}  // namespace kvtier::client
