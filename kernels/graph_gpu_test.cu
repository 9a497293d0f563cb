// Every launcher is capturable in a CUDA graph: GatherEncode (whole chunk into
// device and mapped pinned memory, and layer ranges; per-tensor formats with
// their amax pre-pass), DecodeScatter of each layer range from mapped pinned
// host memory and of the whole chunk through a HostStaging (a memcpy node and
// the decode), and PagedDecodeAttention (both partial kernels, with and without the
// combine kernel). Each test captures the launches in global capture mode
// (any host synchronisation or unsafe call inside a launcher fails the
// capture), replays the graph twice and compares with the eager launches of
// the same inputs: chunks memcmp-equal (and equal to the CPU codec), caches
// byte-equal, attention outputs bit-equal.
#include <cuda_runtime_api.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "codec/codec.h"
#include "codec/quant.h"
#include "common/status.h"
#include "gtest/gtest.h"
#include "kernels/gpu_test_util.h"
#include "kernels/paged_attention.h"
#include "kernels/paged_codec.h"
#include "kernels/reference.h"

namespace kvtier::kernels {
namespace {

using codec::DType;
using testing::DeviceCache;
using testing::Fill;
using testing::HostCache;

// Captures `enqueue` (launches on the stream it is given) into a graph in
// global capture mode, instantiates it and replays it `replays` times on
// `stream`, then waits. Fails the test on any capture or launch error.
// `programmatic_edges`, when set, receives the graph's count of programmatic
// dependency edges (launches with PriorKernel::kLeavesChunk after a kernel).
void CaptureAndReplay(cudaStream_t stream, const std::function<absl::Status(cudaStream_t)>& enqueue,
                      int replays, size_t* programmatic_edges = nullptr) {
  KVTIER_ASSERT_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  const absl::Status st = enqueue(stream);
  cudaGraph_t graph = nullptr;
  const cudaError_t end = cudaStreamEndCapture(stream, &graph);
  ASSERT_TRUE(st.ok()) << "launch during capture: " << st;
  ASSERT_EQ(end, cudaSuccess) << "capture: " << cudaGetErrorString(end);
  size_t nodes = 0;
  KVTIER_ASSERT_CUDA(cudaGraphGetNodes(graph, nullptr, &nodes));
  EXPECT_GT(nodes, 0u) << "the capture recorded no launch";
  if (programmatic_edges != nullptr) {
    size_t n = 0;
    KVTIER_ASSERT_CUDA(cudaGraphGetEdges(graph, nullptr, nullptr, nullptr, &n));
    std::vector<cudaGraphNode_t> from(n), to(n);
    std::vector<cudaGraphEdgeData> data(n);
    KVTIER_ASSERT_CUDA(cudaGraphGetEdges(graph, from.data(), to.data(), data.data(), &n));
    *programmatic_edges = 0;
    for (const cudaGraphEdgeData& d : data) {
      *programmatic_edges += d.type == cudaGraphDependencyTypeProgrammatic;
    }
  }
  cudaGraphExec_t exec = nullptr;
  KVTIER_ASSERT_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  for (int i = 0; i < replays; ++i) KVTIER_ASSERT_CUDA(cudaGraphLaunch(exec, stream));
  KVTIER_ASSERT_CUDA(cudaStreamSynchronize(stream));
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
}

struct CodecGraphCase {
  CacheLayout kind;
  DType v_cache;
  const char* codec;
  uint32_t tokens, first_slot;
  uint32_t layers = 5, kv_heads = 2;
};

void RunCodecGraph(const CodecGraphCase& c) {
  SCOPED_TRACE(std::string(CacheLayoutName(c.kind)) + "/" + c.codec + "/t" +
               std::to_string(c.tokens) + "/s" + std::to_string(c.first_slot));
  const uint32_t L = c.layers, H = c.kv_heads, D = 128, BS = 16;
  const uint32_t need = (c.first_slot + c.tokens + BS - 1) / BS, num_blocks = 2 * need + 3;
  auto layout = MakePagedKvLayout(c.kind, L, num_blocks, BS, H, D, DType::kBF16, c.v_cache);
  ASSERT_TRUE(layout.ok()) << layout.status();
  HostCache host;
  host.Init(c.kind, *layout);
  host.FillValues(Fill::kNormal, 31 + c.tokens);
  std::vector<int32_t> ids = testing::ShuffledBlocks(num_blocks, need, 3 + c.tokens);
  auto fmt = codec::ParseCodec(c.codec, DType::kBF16);
  ASSERT_TRUE(fmt.ok()) << fmt.status();
  codec::ChunkSpec spec;
  spec.geometry = {L, H, D, c.tokens, BS};
  spec.dtype = DType::kBF16;
  spec.k = fmt->k;
  spec.v = fmt->v;
  BlockSpan host_span{ids.data(), ids.data(), need, c.first_slot};
  auto want = ReferenceGatherEncode(spec, host.layout, host_span);
  ASSERT_TRUE(want.ok()) << want.status();
  const size_t bytes = want->size();

  DeviceCache dev;
  KVTIER_ASSERT_CUDA(dev.Upload(host));
  int32_t* d_ids = nullptr;
  uint32_t* ws = nullptr;
  uint8_t *d_eager = nullptr, *d_graph = nullptr, *d_ranges = nullptr;
  KVTIER_ASSERT_CUDA(cudaMalloc(&d_ids, ids.size() * 4));
  KVTIER_ASSERT_CUDA(cudaMemcpy(d_ids, ids.data(), ids.size() * 4, cudaMemcpyHostToDevice));
  KVTIER_ASSERT_CUDA(cudaMalloc(&ws, kGatherEncodeWorkspaceBytes));
  KVTIER_ASSERT_CUDA(cudaMemset(ws, 0, kGatherEncodeWorkspaceBytes));
  for (uint8_t** p : {&d_eager, &d_graph, &d_ranges}) {
    KVTIER_ASSERT_CUDA(cudaMalloc(p, bytes));
    KVTIER_ASSERT_CUDA(cudaMemset(*p, 0xCD, bytes));
  }
  // A mapped pinned destination too (the store path of GpuPagedIo).
  uint8_t *h_enc = nullptr, *d_enc = nullptr;
  KVTIER_ASSERT_CUDA(cudaHostAlloc(reinterpret_cast<void**>(&h_enc), bytes, cudaHostAllocMapped));
  std::memset(h_enc, 0xCD, bytes);
  KVTIER_ASSERT_CUDA(cudaHostGetDevicePointer(reinterpret_cast<void**>(&d_enc), h_enc, 0));
  BlockSpan span{d_ids, ids.data(), need, c.first_slot};
  cudaStream_t stream;
  KVTIER_ASSERT_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));

  // Store: the whole chunk in one launch (into device and into mapped pinned
  // memory), and layer by layer (the launches share the workspace in stream
  // order), as one graph.
  const std::vector<LayerRange> ranges = {{0, 1}, {1, 3}, {3, L}};
  CaptureAndReplay(stream, [&](cudaStream_t s) {
    KVTIER_RETURN_IF_ERROR(GatherEncode(spec, dev.layout, span, d_graph, ws, s));
    KVTIER_RETURN_IF_ERROR(GatherEncode(spec, dev.layout, span, d_enc, ws, s));
    for (const LayerRange& r : ranges) {
      KVTIER_RETURN_IF_ERROR(GatherEncode(spec, dev.layout, span, r, d_ranges, ws, s));
    }
    return absl::OkStatus();
  }, 2);
  if (::testing::Test::HasFatalFailure()) return;
  ASSERT_TRUE(GatherEncode(spec, dev.layout, span, d_eager, ws, stream).ok());
  KVTIER_ASSERT_CUDA(cudaStreamSynchronize(stream));
  std::vector<uint8_t> eager(bytes), graph(bytes), by_range(bytes);
  KVTIER_ASSERT_CUDA(cudaMemcpy(eager.data(), d_eager, bytes, cudaMemcpyDeviceToHost));
  KVTIER_ASSERT_CUDA(cudaMemcpy(graph.data(), d_graph, bytes, cudaMemcpyDeviceToHost));
  KVTIER_ASSERT_CUDA(cudaMemcpy(by_range.data(), d_ranges, bytes, cudaMemcpyDeviceToHost));
  ASSERT_EQ(graph, eager) << "graph replay of the one-launch encode";
  ASSERT_EQ(std::memcmp(h_enc, eager.data(), bytes), 0)
      << "graph replay of the encode into mapped pinned memory";
  ASSERT_EQ(by_range, eager) << "graph replay of the layer-range encodes";
  ASSERT_TRUE(codec::SealChunk(eager).ok());
  ASSERT_EQ(eager, *want) << "the eager chunk is the CPU codec's";
  // The replays left the workspace clean (the eager launch after them was
  // already correct; this names the cause if it was not).
  std::vector<uint32_t> ws_after(kGatherEncodeWorkspaceBytes / 4, 1u);
  KVTIER_ASSERT_CUDA(cudaMemcpy(ws_after.data(), ws, kGatherEncodeWorkspaceBytes,
                                cudaMemcpyDeviceToHost));
  for (size_t i = 0; i < ws_after.size(); ++i) ASSERT_EQ(ws_after[i], 0u) << "workspace word " << i;

  // Load: each layer range decoded from mapped pinned host memory (as
  // GpuPagedIo::Load reads a chunk) into a poisoned cache, replayed as a
  // graph; the same launches eagerly into a second cache; the CPU reference
  // into a third.
  auto header = codec::VerifyChunk(*want);
  ASSERT_TRUE(header.ok()) << header.status();
  uint8_t *h_pinned = nullptr, *d_pinned = nullptr;
  KVTIER_ASSERT_CUDA(cudaHostAlloc(reinterpret_cast<void**>(&h_pinned), bytes, cudaHostAllocMapped));
  std::memcpy(h_pinned, want->data(), bytes);
  KVTIER_ASSERT_CUDA(cudaHostGetDevicePointer(reinterpret_cast<void**>(&d_pinned), h_pinned, 0));
  HostCache expect, out_graph, out_eager, out_staged;
  for (HostCache* hc : {&expect, &out_graph, &out_eager, &out_staged}) {
    hc->Init(c.kind, *layout);
    hc->Poison(0x5C);
  }
  DeviceCache dst_graph, dst_eager, dst_staged;
  KVTIER_ASSERT_CUDA(dst_graph.Upload(expect));
  KVTIER_ASSERT_CUDA(dst_eager.Upload(expect));
  KVTIER_ASSERT_CUDA(dst_staged.Upload(expect));
  ASSERT_TRUE(ReferenceDecodeScatter(*want, expect.layout, host_span).ok());
  auto staging = HostStaging::Create(bytes);
  ASSERT_TRUE(staging.ok()) << staging.status();
  // The ranges after the first follow a decode of the same chunk, which does
  // not write it: each may start while the one before it runs.
  auto prior = [&](const LayerRange& r) {
    return &r == &ranges.front() ? PriorKernel::kUnknown : PriorKernel::kLeavesChunk;
  };
  size_t programmatic = 0;
  CaptureAndReplay(stream, [&](cudaStream_t s) {
    for (const LayerRange& r : ranges) {
      KVTIER_RETURN_IF_ERROR(
          DecodeScatter(*header, d_pinned, dst_graph.layout, span, r, s, prior(r)));
    }
    return DecodeScatter(*header, d_pinned, dst_staged.layout, span, {}, **staging, s);
  }, 2, &programmatic);
  if (::testing::Test::HasFatalFailure()) return;
  // The chained decodes overlap on Hopper and later.
  int device = 0, major = 0;
  KVTIER_ASSERT_CUDA(cudaGetDevice(&device));
  KVTIER_ASSERT_CUDA(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  EXPECT_EQ(programmatic, major >= 9 ? ranges.size() - 1 : 0u);
  for (const LayerRange& r : ranges) {
    ASSERT_TRUE(
        DecodeScatter(*header, d_pinned, dst_eager.layout, span, r, stream, prior(r)).ok());
  }
  KVTIER_ASSERT_CUDA(cudaStreamSynchronize(stream));
  KVTIER_ASSERT_CUDA(dst_graph.CopyTo(out_graph));
  KVTIER_ASSERT_CUDA(dst_eager.CopyTo(out_eager));
  KVTIER_ASSERT_CUDA(dst_staged.CopyTo(out_staged));
  ASSERT_EQ(testing::CacheDifference(out_graph, out_eager), "");
  ASSERT_EQ(testing::CacheDifference(out_graph, expect), "");
  ASSERT_EQ(testing::CacheDifference(out_staged, expect), "") << "staged";
  cudaStreamDestroy(stream);
  cudaFreeHost(h_pinned);
  cudaFreeHost(h_enc);
  cudaFree(d_ids);
  cudaFree(ws);
  cudaFree(d_eager);
  cudaFree(d_graph);
  cudaFree(d_ranges);
}

TEST(CudaGraphGpu, StoreAndLoadOfLayerRangesReplayLikeEagerLaunches) {
  KVTIER_SKIP_WITHOUT_GPU();
  const CodecGraphCase cases[] = {
      {CacheLayout::kVllmFlashAttnNHD, DType::kBF16, "k16v8", 256, 0},
      {CacheLayout::kVllmFlashInferHND, DType::kBF16, "k16v16", 100, 5},
      // Per-tensor scales: two kernels per launch (amax pre-pass, encode).
      {CacheLayout::kVllmFlashAttnNHD, DType::kBF16, "k=int8/tensor,v=int8/tensor", 77, 3},
      {CacheLayout::kSeparateNHD, DType::kBF16, "k=int4/token-head,v=fp8e4m3/token-head", 130, 0},
      // FP8 cache section: codes and scales pass through.
      {CacheLayout::kSeparateHND, DType::kFP8E4M3, "k16v8", 64, 0},
      // Llama-like: a decode from host memory of more CTAs than the GPU
      // holds at once (range [3, 24): 336 CTAs of 1024 threads).
      {CacheLayout::kVllmFlashAttnNHD, DType::kBF16, "k=int4/token-head,v=int4/token-head", 256, 0,
       24, 8},
  };
  for (const CodecGraphCase& c : cases) {
    RunCodecGraph(c);
    if (HasFatalFailure()) return;
  }
}

struct AttnGraphCase {
  DType k_dtype, v_dtype;
  uint32_t head_dim, kv_heads, group;
  std::vector<int32_t> lens;
  uint32_t partition_tokens;  // 0: the launcher's rule; 8192: one partition (no combine)
};

void RunAttentionGraph(const AttnGraphCase& c, AttentionKernel kernel) {
  SCOPED_TRACE(std::string("k=") + codec::DTypeName(c.k_dtype) + " v=" +
               codec::DTypeName(c.v_dtype) + " d=" + std::to_string(c.head_dim) + " g=" +
               std::to_string(c.group) + " part=" + std::to_string(c.partition_tokens) +
               " kernel=" + std::to_string(static_cast<int>(kernel)));
  const uint32_t BS = 16, batch = static_cast<uint32_t>(c.lens.size());
  uint32_t max_len = 0;
  for (int32_t l : c.lens) max_len = std::max<uint32_t>(max_len, l);
  const uint32_t maxb = (max_len + BS - 1) / BS, num_blocks = batch * maxb + 3;
  auto layout = MakePagedKvLayout(CacheLayout::kSeparateNHD, 2, num_blocks, BS, c.kv_heads,
                                  c.head_dim, c.k_dtype, c.v_dtype);
  ASSERT_TRUE(layout.ok()) << layout.status();
  HostCache host;
  host.Init(CacheLayout::kSeparateNHD, *layout);
  host.FillValues(Fill::kNormal, 17 + c.head_dim);
  DeviceCache dev;
  KVTIER_ASSERT_CUDA(dev.Upload(host));
  std::vector<int32_t> table = testing::ShuffledBlocks(num_blocks, batch * maxb, 11);
  const uint32_t hq = c.kv_heads * c.group;
  std::vector<uint16_t> q(uint64_t{batch} * hq * c.head_dim);
  std::mt19937 rng(5);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (auto& x : q) x = codec::FloatToBf16(nd(rng));
  void *d_q, *d_eager, *d_graph, *d_ws;
  int32_t *d_table, *d_lens;
  KVTIER_ASSERT_CUDA(cudaMalloc(&d_q, q.size() * 2));
  KVTIER_ASSERT_CUDA(cudaMalloc(&d_eager, q.size() * 2));
  KVTIER_ASSERT_CUDA(cudaMalloc(&d_graph, q.size() * 2));
  KVTIER_ASSERT_CUDA(cudaMalloc(&d_table, table.size() * 4));
  KVTIER_ASSERT_CUDA(cudaMalloc(&d_lens, batch * 4));
  KVTIER_ASSERT_CUDA(cudaMemcpy(d_q, q.data(), q.size() * 2, cudaMemcpyHostToDevice));
  KVTIER_ASSERT_CUDA(cudaMemcpy(d_table, table.data(), table.size() * 4, cudaMemcpyHostToDevice));
  KVTIER_ASSERT_CUDA(cudaMemcpy(d_lens, c.lens.data(), batch * 4, cudaMemcpyHostToDevice));
  KVTIER_ASSERT_CUDA(cudaMemset(d_eager, 0xFF, q.size() * 2));  // NaN poison
  KVTIER_ASSERT_CUDA(cudaMemset(d_graph, 0xFF, q.size() * 2));
  DecodeAttentionParams p;
  p.q = d_q;
  p.q_dtype = DType::kBF16;
  p.batch = batch;
  p.num_q_heads = hq;
  p.block_table = d_table;
  p.max_blocks_per_seq = maxb;
  p.seq_lens = d_lens;
  p.host_block_table = table.data();
  p.host_seq_lens = c.lens.data();
  p.layer = 1;
  p.sm_scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));
  p.partition_tokens = c.partition_tokens;
  p.kernel = kernel;
  auto ws_bytes = DecodeAttentionWorkspaceBytes(dev.layout, p);
  ASSERT_TRUE(ws_bytes.ok()) << ws_bytes.status();
  KVTIER_ASSERT_CUDA(cudaMalloc(&d_ws, std::max<size_t>(*ws_bytes, 16)));
  cudaStream_t stream;
  KVTIER_ASSERT_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  // Captured first, so that a launcher's once-per-process setup (the
  // shared-memory limit) happens inside the capture when this test runs alone.
  DecodeAttentionParams pg = p;
  pg.out = d_graph;
  CaptureAndReplay(stream, [&](cudaStream_t s) {
    return PagedDecodeAttention(dev.layout, pg, d_ws, *ws_bytes, s);
  }, 2);
  if (::testing::Test::HasFatalFailure()) return;
  DecodeAttentionParams pe = p;
  pe.out = d_eager;
  ASSERT_TRUE(PagedDecodeAttention(dev.layout, pe, d_ws, *ws_bytes, stream).ok());
  KVTIER_ASSERT_CUDA(cudaStreamSynchronize(stream));
  std::vector<uint16_t> eager(q.size()), graph(q.size());
  KVTIER_ASSERT_CUDA(cudaMemcpy(eager.data(), d_eager, q.size() * 2, cudaMemcpyDeviceToHost));
  KVTIER_ASSERT_CUDA(cudaMemcpy(graph.data(), d_graph, q.size() * 2, cudaMemcpyDeviceToHost));
  size_t nonzero = 0;
  for (size_t i = 0; i < graph.size(); ++i) {
    ASSERT_FALSE(std::isnan(codec::Load16(graph[i], DType::kBF16))) << "NaN at " << i;
    nonzero += (graph[i] & 0x7FFF) != 0;
  }
  EXPECT_GT(nonzero, graph.size() / 2);
  ASSERT_EQ(graph, eager) << "graph replay differs from the eager launch";
  cudaStreamDestroy(stream);
  cudaFree(d_q);
  cudaFree(d_eager);
  cudaFree(d_graph);
  cudaFree(d_ws);
  cudaFree(d_table);
  cudaFree(d_lens);
}

TEST(CudaGraphGpu, AttentionReplaysLikeEagerLaunches) {
  KVTIER_SKIP_WITHOUT_GPU();
  const AttnGraphCase cases[] = {
      // Several partitions: the partial kernel and the combine kernel.
      {DType::kBF16, DType::kBF16, 128, 4, 4, {3000, 1, 777}, 0},
      {DType::kBF16, DType::kFP8E4M3, 128, 4, 4, {3000, 1, 777}, 256},
      {DType::kFP8E4M3, DType::kFP8E4M3, 128, 2, 8, {2049, 95}, 0},
      {DType::kBF16, DType::kFP8E4M3, 256, 2, 4, {1500, 33}, 512},
      // One partition: the partial kernel writes the output, no combine.
      {DType::kBF16, DType::kFP8E4M3, 128, 8, 4, {4000, 17}, 8192},
  };
  for (const AttnGraphCase& c : cases) {
    for (AttentionKernel k : {AttentionKernel::kCudaCore, AttentionKernel::kTensorCore}) {
      RunAttentionGraph(c, k);
      if (HasFatalFailure()) return;
    }
  }
}

}  // namespace
}  // namespace kvtier::kernels
