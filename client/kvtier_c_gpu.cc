// libkvtier's C API, GPU half (kvtier_c_gpu.h), over GpuPagedIo and the
// paged decode attention kernel.
#include "client/kvtier_c_gpu.h"

#include <cuda_runtime_api.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <future>
#include <map>
#include <memory>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "client/kvtier_c_internal.h"
#include "client/kvtier_gpu.h"
#include "codec/chunk.h"
#include "codec/format.h"
#include "common/hash.h"
#include "common/status.h"
#include "common/worker_pool.h"
#include "kernels/cuda_status.h"
#include "kernels/paged_attention.h"
#include "kernels/paged_layout.h"

using kvtier::Hash128;
using kvtier::capi::Done;
using kvtier::capi::Fail;
namespace codec = kvtier::codec;
namespace kernels = kvtier::kernels;

// A paged cache: the descriptor with its per-layer pointer arrays in device
// memory (owned), and the attention workspaces (one per stream, grown
// stream-ordered).
struct kvtier_gpu_cache {
  kernels::PagedKvLayout layout;  // pointer arrays: device copies below
  int device = 0;
  void** d_k = nullptr;
  void** d_v = nullptr;
  float** d_k_scales = nullptr;
  float** d_v_scales = nullptr;
  absl::Mutex mu;
  struct Workspace {
    void* ptr = nullptr;
    size_t bytes = 0;
  };
  std::map<uint64_t, Workspace> workspaces ABSL_GUARDED_BY(mu);  // by stream
};

struct kvtier_gpu {
  int device = 0;
  std::shared_ptr<kvtier::client::KvtierClient> client;  // outlives io
  // Its commit threads run kvtier_gpu_store_commit_async's commits; its
  // destructor runs every queued one while client still exists.
  std::unique_ptr<kvtier::client::GpuPagedIo> io;
};

struct kvtier_gpu_store_op {
  kvtier_gpu* gpu = nullptr;
  std::unique_ptr<kvtier::client::PendingStore> pending;  // moved to the task by commit_async
  // commit_async's result, set by its task on the handle's commit threads (an op
  // released before the commit ends leaves it running).
  std::shared_future<absl::Status> committed;
};

struct kvtier_gpu_layerwise {
  int device = 0;
  std::unique_ptr<kvtier::client::LayerwiseLoad> load;
};

namespace {

cudaStream_t StreamOf(uint64_t s) { return reinterpret_cast<cudaStream_t>(static_cast<uintptr_t>(s)); }

Hash128 KeyOf(const uint8_t* bytes) {
  Hash128 k;
  std::memcpy(k.bytes.data(), bytes, Hash128::kSize);
  return k;
}

absl::StatusOr<codec::DType> DTypeOf(int32_t code, const char* field) {
  switch (code) {
    case KVTIER_DTYPE_FP16:
      return codec::DType::kFP16;
    case KVTIER_DTYPE_BF16:
      return codec::DType::kBF16;
    case KVTIER_DTYPE_FP8E4M3:
      return codec::DType::kFP8E4M3;
    default:
      return absl::InvalidArgumentError(absl::StrCat(field, " = ", code, " is not a dtype code"));
  }
}

// Makes `device` current for the scope of a call, restoring the caller's.
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    if (cudaGetDevice(&old_) != cudaSuccess) old_ = -1;
    if (old_ != device) status_ = cudaSetDevice(device);
  }
  ~DeviceScope() {
    if (old_ >= 0) cudaSetDevice(old_);
  }
  absl::Status status() const {
    return kernels::CudaStatus(status_, "cudaSetDevice", __FILE__, __LINE__);
  }

 private:
  int old_ = -1;
  cudaError_t status_ = cudaSuccess;
};

int CurrentDevice(int32_t wanted) {
  if (wanted >= 0) return wanted;
  int d = 0;
  if (cudaGetDevice(&d) != cudaSuccess) d = 0;
  return d;
}

// Block ids copied to the device on `stream` (stream-ordered memory, freed
// on the same stream after the work that reads them).
class DeviceIds {
 public:
  DeviceIds() = default;
  DeviceIds(const DeviceIds&) = delete;
  DeviceIds& operator=(const DeviceIds&) = delete;
  ~DeviceIds() {
    if (ptr_ != nullptr) cudaFreeAsync(ptr_, stream_);
  }
  absl::Status Upload(const int32_t* host, size_t n, cudaStream_t stream) {
    stream_ = stream;
    if (n == 0) return absl::OkStatus();
    KVTIER_CUDA_RETURN_IF_ERROR(cudaMallocAsync(reinterpret_cast<void**>(&ptr_), n * 4, stream));
    KVTIER_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(ptr_, host, n * 4, cudaMemcpyHostToDevice, stream));
    return absl::OkStatus();
  }
  const int32_t* get() const { return ptr_; }

 private:
  int32_t* ptr_ = nullptr;
  cudaStream_t stream_ = nullptr;
};

absl::StatusOr<codec::ChunkSpec> SpecFor(const uint8_t fingerprint[16], const char* codec_name,
                                         const kvtier_gpu_cache* cache, uint32_t num_tokens) {
  if (fingerprint == nullptr) return absl::InvalidArgumentError("fingerprint is null");
  const kernels::PagedKvLayout& d = cache->layout;
  codec::ChunkSpec spec;
  std::memcpy(spec.fingerprint.bytes.data(), fingerprint, Hash128::kSize);
  spec.geometry = codec::Geometry{d.num_layers, d.num_kv_heads, d.head_dim, num_tokens,
                                  d.block_size};
  // The chunk's 16-bit dtype: the cache's (an FP8 K takes V's 16-bit dtype, or BF16).
  spec.dtype = d.k_dtype != codec::DType::kFP8E4M3   ? d.k_dtype
               : d.v_dtype != codec::DType::kFP8E4M3 ? d.v_dtype
                                                     : codec::DType::kBF16;
  KVTIER_ASSIGN_OR_RETURN(codec::CodecFormat f,
                          codec::ParseCodec(codec_name == nullptr ? "k16v8" : codec_name,
                                            spec.dtype));
  spec.k = f.k;
  spec.v = f.v;
  KVTIER_RETURN_IF_ERROR(codec::ValidateSpec(spec).status());
  return spec;
}

void FreeCache(kvtier_gpu_cache* c) {
  if (c == nullptr) return;
  DeviceScope scope(c->device);
  {
    // cudaFree, not cudaFreeAsync: the streams may be gone; it waits for the device.
    absl::MutexLock l(&c->mu);
    for (auto& [stream, ws] : c->workspaces) cudaFree(ws.ptr);
  }
  cudaFree(c->d_k);
  if (c->d_v != c->d_k) cudaFree(c->d_v);
  cudaFree(c->d_k_scales);
  cudaFree(c->d_v_scales);
  delete c;
}

// Copies a host array of num_layers device addresses to the device.
template <typename T>
absl::Status UploadPointers(const uint64_t* host, uint32_t n, T*** out) {
  std::vector<T*> ptrs(n);
  for (uint32_t i = 0; i < n; ++i) ptrs[i] = reinterpret_cast<T*>(static_cast<uintptr_t>(host[i]));
  KVTIER_CUDA_RETURN_IF_ERROR(cudaMalloc(reinterpret_cast<void**>(out), n * sizeof(T*)));
  KVTIER_CUDA_RETURN_IF_ERROR(cudaMemcpy(*out, ptrs.data(), n * sizeof(T*), cudaMemcpyHostToDevice));
  return absl::OkStatus();
}

absl::Status CreateCache(const kvtier_gpu_cache_desc* d, kvtier_gpu_cache* c) {
  if (d == nullptr || d->struct_size < sizeof(kvtier_gpu_cache_desc)) {
    return absl::InvalidArgumentError("cache desc: null or struct_size too small");
  }
  if (d->num_layers == 0) return absl::InvalidArgumentError("cache desc: num_layers is 0");
  if (d->k_layers == nullptr || d->v_layers == nullptr) {
    return absl::InvalidArgumentError("cache desc: k_layers / v_layers is null");
  }
  kernels::PagedKvLayout& l = c->layout;
  l.num_layers = d->num_layers;
  l.num_blocks = d->num_blocks;
  l.block_size = d->block_size;
  l.num_kv_heads = d->num_kv_heads;
  l.head_dim = d->head_dim;
  KVTIER_ASSIGN_OR_RETURN(l.k_dtype, DTypeOf(d->k_dtype, "k_dtype"));
  KVTIER_ASSIGN_OR_RETURN(l.v_dtype, DTypeOf(d->v_dtype, "v_dtype"));
  l.k_offset = d->k_offset;
  l.v_offset = d->v_offset;
  l.stride_block = d->stride_block;
  l.stride_token = d->stride_token;
  l.stride_head = d->stride_head;
  if (l.k_dtype == codec::DType::kFP8E4M3 && d->k_scale_layers == nullptr) {
    return absl::InvalidArgumentError("cache desc: an fp8e4m3 K needs k_scale_layers");
  }
  if (l.v_dtype == codec::DType::kFP8E4M3 && d->v_scale_layers == nullptr) {
    return absl::InvalidArgumentError("cache desc: an fp8e4m3 V needs v_scale_layers");
  }
  for (uint32_t i = 0; i < d->num_layers; ++i) {
    if (d->k_layers[i] % 16 != 0 || d->v_layers[i] % 16 != 0 || d->k_layers[i] == 0 ||
        d->v_layers[i] == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("cache desc: layer ", i, "'s K or V address is null or not 16-byte aligned"));
    }
  }
  // Host pointers stand in for the check of nulls; the device copies follow.
  std::vector<void*> probe(d->num_layers, reinterpret_cast<void*>(16));
  std::vector<float*> probe_scales(d->num_layers, reinterpret_cast<float*>(16));
  l.k_layers = probe.data();
  l.v_layers = probe.data();
  l.k_scale_layers = d->k_scale_layers != nullptr ? probe_scales.data() : nullptr;
  l.v_scale_layers = d->v_scale_layers != nullptr ? probe_scales.data() : nullptr;
  KVTIER_RETURN_IF_ERROR(kernels::ValidatePagedKvLayout(l));
  DeviceScope scope(c->device);
  KVTIER_RETURN_IF_ERROR(scope.status());
  KVTIER_RETURN_IF_ERROR(UploadPointers(d->k_layers, d->num_layers, &c->d_k));
  if (std::memcmp(d->k_layers, d->v_layers, d->num_layers * sizeof(uint64_t)) == 0) {
    c->d_v = c->d_k;
  } else {
    KVTIER_RETURN_IF_ERROR(UploadPointers(d->v_layers, d->num_layers, &c->d_v));
  }
  if (d->k_scale_layers != nullptr) {
    KVTIER_RETURN_IF_ERROR(UploadPointers(d->k_scale_layers, d->num_layers, &c->d_k_scales));
  }
  if (d->v_scale_layers != nullptr) {
    KVTIER_RETURN_IF_ERROR(UploadPointers(d->v_scale_layers, d->num_layers, &c->d_v_scales));
  }
  l.k_layers = c->d_k;
  l.v_layers = c->d_v;
  l.k_scale_layers = c->d_k_scales;
  l.v_scale_layers = c->d_v_scales;
  return absl::OkStatus();
}

kernels::LayerRange RangeOf(uint32_t begin, uint32_t end) {
  return kernels::LayerRange{begin, end};  // KVTIER_ALL_LAYERS == kAllLayers
}
static_assert(KVTIER_ALL_LAYERS == kernels::LayerRange::kAllLayers, "one value for all layers");
static_assert(KVTIER_DTYPE_FP16 == static_cast<int>(codec::DType::kFP16) &&
                  KVTIER_DTYPE_BF16 == static_cast<int>(codec::DType::kBF16) &&
                  KVTIER_DTYPE_FP8E4M3 == static_cast<int>(codec::DType::kFP8E4M3),
              "the C dtype codes are codec::DType's");

}  // namespace

extern "C" {

void kvtier_gpu_cache_desc_init(kvtier_gpu_cache_desc* d) {
  if (d == nullptr) return;
  *d = kvtier_gpu_cache_desc{};
  d->struct_size = sizeof(kvtier_gpu_cache_desc);
  d->device = -1;
}

int kvtier_gpu_cache_create(const kvtier_gpu_cache_desc* d, kvtier_gpu_cache** out) {
  if (out == nullptr) return Fail(absl::InvalidArgumentError("out is null"));
  *out = nullptr;
  if (d == nullptr || d->struct_size < sizeof(kvtier_gpu_cache_desc)) {
    return Fail(absl::InvalidArgumentError("cache desc: null or struct_size too small"));
  }
  auto* c = new kvtier_gpu_cache;
  c->device = CurrentDevice(d->device);
  absl::Status st = CreateCache(d, c);
  if (!st.ok()) {
    FreeCache(c);
    return Fail(st);
  }
  *out = c;
  return Done(st);
}

void kvtier_gpu_cache_destroy(kvtier_gpu_cache* cache) { FreeCache(cache); }

int kvtier_gpu_open(kvtier_client* c, int32_t device, kvtier_gpu** out) {
  if (c == nullptr || out == nullptr) return Fail(absl::InvalidArgumentError("client or out is null"));
  *out = nullptr;
  const int dev = CurrentDevice(device);
  DeviceScope scope(dev);
  if (!scope.status().ok()) return Fail(scope.status());
  auto io = kvtier::client::GpuPagedIo::Create(c->impl.get());
  if (!io.ok()) return Fail(io.status());
  *out = new kvtier_gpu{dev, c->impl, std::move(*io)};
  return KVTIER_OK;
}

void kvtier_gpu_close(kvtier_gpu* gpu) {
  if (gpu == nullptr) return;
  DeviceScope scope(gpu->device);
  delete gpu;
}

int kvtier_gpu_store(kvtier_gpu* gpu, const uint8_t key[16], const uint8_t fingerprint[16],
                     const char* codec_name, const kvtier_gpu_cache* cache,
                     const int32_t* block_ids, uint32_t num_ids, uint32_t first_slot,
                     uint32_t num_tokens, uint64_t stream, int durable) {
  if (gpu == nullptr || key == nullptr || cache == nullptr || block_ids == nullptr) {
    return Fail(absl::InvalidArgumentError("gpu, key, cache or block_ids is null"));
  }
  DeviceScope scope(cache->device);
  if (!scope.status().ok()) return Fail(scope.status());
  auto spec = SpecFor(fingerprint, codec_name, cache, num_tokens);
  if (!spec.ok()) return Fail(spec.status());
  // Host checks first, so that a mismatch costs nothing on the device.
  kernels::BlockSpan host_span{block_ids, block_ids, num_ids, first_slot};
  absl::Status st = kernels::ValidateBlockSpan(cache->layout, host_span, num_tokens);
  if (!st.ok()) return Fail(st);
  DeviceIds ids;
  st = ids.Upload(block_ids, num_ids, StreamOf(stream));
  if (!st.ok()) return Fail(st);
  // The ids were checked above: the layers below check the span's shape only.
  kernels::BlockSpan span{ids.get(), nullptr, num_ids, first_slot};
  kvtier::client::PutOptions o;
  o.durable = durable != 0;
  return Done(gpu->io->Store(KeyOf(key), *spec, cache->layout, span, StreamOf(stream), o));
}

int kvtier_gpu_store_batch(kvtier_gpu* gpu, const uint8_t* keys, size_t n,
                           const uint8_t fingerprint[16], const char* codec_name,
                           const kvtier_gpu_cache* cache, const int32_t* block_ids,
                           uint32_t num_ids, uint32_t first_slot, uint32_t num_tokens,
                           uint64_t stream, int durable, int* statuses) {
  if (gpu == nullptr || cache == nullptr || (n > 0 && (keys == nullptr || block_ids == nullptr))) {
    return Fail(absl::InvalidArgumentError("gpu, cache, keys or block_ids is null"));
  }
  if (n > 0 && num_ids > SIZE_MAX / 4 / n) {
    return Fail(absl::InvalidArgumentError("n * num_ids block ids overflow"));
  }
  DeviceScope scope(cache->device);
  if (!scope.status().ok()) return Fail(scope.status());
  auto spec = SpecFor(fingerprint, codec_name, cache, num_tokens);
  if (!spec.ok()) return Fail(spec.status());
  // Host checks first, so that a mismatch costs nothing on the device.
  std::vector<absl::Status> results(n);
  for (size_t i = 0; i < n; ++i) {
    kernels::BlockSpan host_span{block_ids + i * num_ids, block_ids + i * num_ids, num_ids,
                                 first_slot};
    results[i] = kernels::ValidateBlockSpan(cache->layout, host_span, num_tokens);
  }
  // Every chunk's ids in one upload.
  DeviceIds ids;
  absl::Status st = ids.Upload(block_ids, n * size_t{num_ids}, StreamOf(stream));
  if (!st.ok()) return Fail(st);
  std::vector<kvtier::client::PagedChunk> chunks;
  std::vector<size_t> index;  // chunks[j] is chunk index[j] of the call
  for (size_t i = 0; i < n; ++i) {
    if (!results[i].ok()) continue;
    // Its ids were checked above: the layers below check the span's shape only.
    chunks.push_back({KeyOf(keys + 16 * i),
                      kernels::BlockSpan{ids.get() + i * num_ids, nullptr, num_ids, first_slot}});
    index.push_back(i);
  }
  kvtier::client::PutOptions o;
  o.durable = durable != 0;
  std::vector<absl::Status> stored =
      gpu->io->StoreBatch(chunks, *spec, cache->layout, StreamOf(stream), o);
  for (size_t j = 0; j < chunks.size(); ++j) results[index[j]] = std::move(stored[j]);
  absl::Status first;
  for (size_t i = 0; i < n; ++i) {
    if (statuses != nullptr) statuses[i] = static_cast<int>(results[i].code());
    if (first.ok() && !results[i].ok()) first = results[i];
  }
  return Done(first);
}

int kvtier_gpu_store_begin(kvtier_gpu* gpu, const uint8_t fingerprint[16], const char* codec_name,
                           const kvtier_gpu_cache* cache, uint32_t num_tokens,
                           kvtier_gpu_store_op** out) {
  if (gpu == nullptr || cache == nullptr || out == nullptr) {
    return Fail(absl::InvalidArgumentError("gpu, cache or out is null"));
  }
  *out = nullptr;
  DeviceScope scope(cache->device);
  if (!scope.status().ok()) return Fail(scope.status());
  auto spec = SpecFor(fingerprint, codec_name, cache, num_tokens);
  if (!spec.ok()) return Fail(spec.status());
  auto pending = gpu->io->BeginStore(*spec);
  if (!pending.ok()) return Fail(pending.status());
  *out = new kvtier_gpu_store_op{gpu, std::move(*pending)};
  return KVTIER_OK;
}

int kvtier_gpu_store_layers(kvtier_gpu_store_op* op, const kvtier_gpu_cache* cache,
                            const int32_t* block_ids, uint32_t num_ids, uint32_t first_slot,
                            uint32_t layer_begin, uint32_t layer_end, uint64_t stream) {
  if (op == nullptr || cache == nullptr || block_ids == nullptr) {
    return Fail(absl::InvalidArgumentError("op, cache or block_ids is null"));
  }
  if (op->pending == nullptr) {
    return Fail(absl::FailedPreconditionError("the store was committed asynchronously"));
  }
  DeviceScope scope(cache->device);
  if (!scope.status().ok()) return Fail(scope.status());
  DeviceIds ids;
  absl::Status st = ids.Upload(block_ids, num_ids, StreamOf(stream));
  if (!st.ok()) return Fail(st);
  kernels::BlockSpan span{ids.get(), block_ids, num_ids, first_slot};
  return Done(op->pending->EncodeLayers(cache->layout, span, RangeOf(layer_begin, layer_end),
                                        StreamOf(stream)));
}

int kvtier_gpu_store_commit(kvtier_gpu_store_op* op, const uint8_t key[16], int durable) {
  if (op == nullptr || key == nullptr) return Fail(absl::InvalidArgumentError("op or key is null"));
  if (op->pending == nullptr) {
    return Fail(absl::FailedPreconditionError("the store was committed asynchronously"));
  }
  DeviceScope scope(op->gpu->device);
  kvtier::client::PutOptions o;
  o.durable = durable != 0;
  return Done(op->pending->Commit(KeyOf(key), o));
}

int kvtier_gpu_store_commit_async(kvtier_gpu_store_op* op, const uint8_t key[16], int durable) {
  if (op == nullptr || key == nullptr) return Fail(absl::InvalidArgumentError("op or key is null"));
  if (op->pending == nullptr) {
    return Fail(absl::FailedPreconditionError("the store was committed asynchronously before"));
  }
  kvtier_gpu* gpu = op->gpu;
  kvtier::WorkerPool& pool = gpu->io->Committers();
  std::promise<absl::Status> result;
  op->committed = result.get_future().share();
  kvtier::client::PutOptions o;
  o.durable = durable != 0;
  pool.Schedule([pending = std::move(op->pending), result = std::move(result), key = KeyOf(key),
                  o, device = gpu->device]() mutable {
    absl::Status st;
    {
      DeviceScope scope(device);
      st = scope.status();
      if (st.ok()) st = pending->Commit(key, o);
      pending.reset();  // gives back its workspace and staging on this device
    }
    result.set_value(std::move(st));
  });
  return KVTIER_OK;
}

int kvtier_gpu_store_wait(kvtier_gpu_store_op* op, int64_t timeout_ms) {
  if (op == nullptr) return Fail(absl::InvalidArgumentError("op is null"));
  if (!op->committed.valid()) {
    return Fail(absl::FailedPreconditionError("no asynchronous commit was started"));
  }
  if (timeout_ms < 0) {
    op->committed.wait();
  } else if (op->committed.wait_for(std::chrono::milliseconds(timeout_ms)) !=
             std::future_status::ready) {
    return Fail(absl::DeadlineExceededError("the asynchronous commit is still running"));
  }
  return Done(op->committed.get());
}

void kvtier_gpu_store_release(kvtier_gpu_store_op* op) {
  if (op == nullptr) return;
  DeviceScope scope(op->gpu->device);
  delete op;
}

int kvtier_gpu_load(kvtier_gpu* gpu, const uint8_t key[16], const kvtier_gpu_cache* cache,
                    const int32_t* block_ids, uint32_t num_ids, uint32_t first_slot,
                    uint32_t layer_begin, uint32_t layer_end, uint64_t stream, int* tier) {
  if (gpu == nullptr || key == nullptr || cache == nullptr || block_ids == nullptr) {
    return Fail(absl::InvalidArgumentError("gpu, key, cache or block_ids is null"));
  }
  DeviceScope scope(cache->device);
  if (!scope.status().ok()) return Fail(scope.status());
  absl::Status st = kernels::ValidateLayerRange(RangeOf(layer_begin, layer_end),
                                                cache->layout.num_layers);
  if (!st.ok()) return Fail(st);
  DeviceIds ids;
  st = ids.Upload(block_ids, num_ids, StreamOf(stream));
  if (!st.ok()) return Fail(st);
  kernels::BlockSpan span{ids.get(), block_ids, num_ids, first_slot};
  auto t = gpu->io->Load(KeyOf(key), cache->layout, span, StreamOf(stream),
                         RangeOf(layer_begin, layer_end));
  if (!t.ok()) return Fail(t.status());
  if (tier != nullptr) *tier = static_cast<int>(*t);
  return Done(absl::OkStatus());
}

int kvtier_gpu_load_layerwise(kvtier_gpu* gpu, const uint8_t* keys, size_t n,
                              const kvtier_gpu_cache* cache, const int32_t* block_ids,
                              const uint64_t* offsets, const uint32_t* num_ids,
                              const uint32_t* first_slots, uint32_t layer_group, uint64_t stream,
                              kvtier_gpu_layerwise** out) {
  if (gpu == nullptr || keys == nullptr || cache == nullptr || block_ids == nullptr ||
      offsets == nullptr || num_ids == nullptr || out == nullptr) {
    return Fail(absl::InvalidArgumentError("a required pointer is null"));
  }
  *out = nullptr;
  DeviceScope scope(cache->device);
  if (!scope.status().ok()) return Fail(scope.status());
  uint64_t total = 0;
  for (size_t i = 0; i < n; ++i) total = std::max(total, offsets[i] + num_ids[i]);
  DeviceIds ids;
  absl::Status st = ids.Upload(block_ids, total, StreamOf(stream));
  if (!st.ok()) return Fail(st);
  std::vector<kvtier::client::PagedChunk> chunks(n);
  for (size_t i = 0; i < n; ++i) {
    chunks[i].key = KeyOf(keys + i * Hash128::kSize);
    chunks[i].blocks = kernels::BlockSpan{ids.get() + offsets[i], block_ids + offsets[i],
                                          num_ids[i], first_slots == nullptr ? 0 : first_slots[i]};
  }
  auto load = gpu->io->BeginLayerwiseLoad(chunks, cache->layout, layer_group, StreamOf(stream));
  if (!load.ok()) return Fail(load.status());
  *out = new kvtier_gpu_layerwise{cache->device, std::move(*load)};
  return KVTIER_OK;
}

int kvtier_gpu_layerwise_wait_layer(kvtier_gpu_layerwise* lw, uint32_t layer, uint64_t stream) {
  if (lw == nullptr) return Fail(absl::InvalidArgumentError("layerwise handle is null"));
  return Done(lw->load->WaitLayer(layer, StreamOf(stream)));
}

int kvtier_gpu_layerwise_finish(kvtier_gpu_layerwise* lw, int* statuses, int* tiers) {
  if (lw == nullptr) return Fail(absl::InvalidArgumentError("layerwise handle is null"));
  DeviceScope scope(lw->device);
  absl::Status st = lw->load->Finish();
  const auto& results = lw->load->results();
  for (size_t i = 0; i < results.size(); ++i) {
    if (statuses != nullptr) statuses[i] = static_cast<int>(results[i].status().code());
    if (tiers != nullptr) tiers[i] = results[i].ok() ? static_cast<int>(*results[i]) : 0;
  }
  return Done(st);
}

void kvtier_gpu_layerwise_release(kvtier_gpu_layerwise* lw) {
  if (lw == nullptr) return;
  DeviceScope scope(lw->device);
  delete lw;
}

int kvtier_attention_decode(kvtier_gpu_cache* cache, uint64_t q, int32_t q_dtype, uint32_t batch,
                            uint32_t num_q_heads, uint64_t block_table,
                            const int32_t* host_block_table, uint32_t max_blocks_per_seq,
                            uint64_t seq_lens, const int32_t* host_seq_lens, uint32_t layer,
                            float sm_scale, uint64_t out, uint64_t stream) {
  if (cache == nullptr) return Fail(absl::InvalidArgumentError("cache is null"));
  auto qd = DTypeOf(q_dtype, "q_dtype");
  if (!qd.ok()) return Fail(qd.status());
  kernels::DecodeAttentionParams p;
  p.q = reinterpret_cast<const void*>(static_cast<uintptr_t>(q));
  p.q_dtype = *qd;
  p.batch = batch;
  p.num_q_heads = num_q_heads;
  p.block_table = reinterpret_cast<const int32_t*>(static_cast<uintptr_t>(block_table));
  p.max_blocks_per_seq = max_blocks_per_seq;
  p.seq_lens = reinterpret_cast<const int32_t*>(static_cast<uintptr_t>(seq_lens));
  p.host_block_table = host_block_table;
  p.host_seq_lens = host_seq_lens;
  p.layer = layer;
  p.sm_scale = sm_scale > 0.0f ? sm_scale
                               : 1.0f / std::sqrt(static_cast<float>(cache->layout.head_dim));
  p.out = reinterpret_cast<void*>(static_cast<uintptr_t>(out));
  DeviceScope scope(cache->device);
  if (!scope.status().ok()) return Fail(scope.status());
  auto need = kernels::DecodeAttentionWorkspaceBytes(cache->layout, p);
  if (!need.ok()) return Fail(need.status());
  void* ws = nullptr;
  size_t ws_bytes = 0;
  {
    absl::MutexLock l(&cache->mu);
    kvtier_gpu_cache::Workspace& w = cache->workspaces[stream];
    if (w.bytes < *need) {
      // Stream-ordered: work already queued on this stream keeps the old one.
      if (w.ptr != nullptr) cudaFreeAsync(w.ptr, StreamOf(stream));
      w.ptr = nullptr;
      w.bytes = 0;
      cudaError_t e = cudaMallocAsync(&w.ptr, *need, StreamOf(stream));
      if (e != cudaSuccess) {
        return Fail(kernels::CudaStatus(e, "attention workspace", __FILE__, __LINE__));
      }
      w.bytes = *need;
    }
    ws = w.ptr;
    ws_bytes = w.bytes;
  }
  return Done(kernels::PagedDecodeAttention(cache->layout, p, ws, ws_bytes, StreamOf(stream)));
}

}  // extern "C"
