/* libkvtier's C API, GPU half (built into libkvtier.so when the library has
 * CUDA; kvtier_has_cuda() says so): store and load chunks between an
 * engine's paged KV cache on the GPU and kvtierd's shared-memory pool
 * (client/kvtier_gpu.h), layer by layer if wanted, and paged decode
 * attention over the cache (kernels/paged_attention.h).
 *
 * Conventions are kvtier_c.h's: int status (0 or an absl::StatusCode value),
 * kvtier_last_error() for the reason, struct_size in structs, opaque handles
 * released by their own call. Device memory (the cache, block tables, q and
 * out of attention) is passed as uint64 addresses, CUDA streams as the
 * uint64 value of their cudaStream_t (0: the legacy default stream), so that
 * bindings need no CUDA types.
 *
 * Threads: a kvtier_gpu and a kvtier_gpu_cache may be used from many
 * threads at once; a kvtier_gpu_store_op or kvtier_gpu_layerwise by one at a
 * time. Every call runs on the CUDA device of the cache it is given.
 */
#ifndef KVTIER_CLIENT_KVTIER_C_GPU_H_
#define KVTIER_CLIENT_KVTIER_C_GPU_H_

#include <stddef.h>
#include <stdint.h>

#include "client/kvtier_c.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Element dtypes of a cache section or of q (codec::DType). */
#define KVTIER_DTYPE_FP16 1
#define KVTIER_DTYPE_BF16 2
#define KVTIER_DTYPE_FP8E4M3 3

/* layer_end of a range that runs through the last layer. */
#define KVTIER_ALL_LAYERS 0xFFFFFFFFu

typedef struct kvtier_gpu kvtier_gpu;
typedef struct kvtier_gpu_cache kvtier_gpu_cache;
typedef struct kvtier_gpu_store_op kvtier_gpu_store_op;
typedef struct kvtier_gpu_layerwise kvtier_gpu_layerwise;

/* One paged KV cache (kernels::PagedKvLayout): per layer, the device address
 * of the tensor holding K and of the one holding V (the same address for
 * combined vLLM layouts, told apart by k_offset / v_offset), and strides in
 * elements of each section's own dtype, so that any torch strides fit:
 * element (block, slot, head, dim) of K of layer l is at
 *   k_layers[l] + elem * (k_offset + block*stride_block + slot*stride_token
 *                         + head*stride_head + dim)
 * (dim stride 1). An HF [batch, heads, seq, dim] tensor row is a cache of
 * virtual blocks: stride_block = block_size * seq stride, stride_token = seq
 * stride, stride_head = heads stride. Strides, offsets and head_dim are
 * multiples of 8 elements; addresses 16-byte aligned. */
typedef struct kvtier_gpu_cache_desc {
  size_t struct_size;        /* sizeof(kvtier_gpu_cache_desc) */
  uint32_t num_layers;
  uint32_t num_blocks;       /* blocks in each layer's tensor */
  uint32_t block_size;       /* tokens per block */
  uint32_t num_kv_heads;
  uint32_t head_dim;
  int32_t k_dtype;           /* KVTIER_DTYPE_BF16 | _FP16 | _FP8E4M3 */
  int32_t v_dtype;
  const uint64_t* k_layers;  /* [num_layers] device addresses (host array) */
  const uint64_t* v_layers;  /* [num_layers] */
  /* FP8 sections only: [num_layers] device addresses of float scales
   * [num_blocks][num_kv_heads]; NULL otherwise. */
  const uint64_t* k_scale_layers;
  const uint64_t* v_scale_layers;
  int64_t k_offset;
  int64_t v_offset;
  int64_t stride_block;
  int64_t stride_token;
  int64_t stride_head;
  int32_t device;            /* CUDA device of the tensors; < 0: the current one */
} kvtier_gpu_cache_desc;

/* Fills `d` with zeros, struct_size and device -1. */
KVTIER_C_EXPORT void kvtier_gpu_cache_desc_init(kvtier_gpu_cache_desc* d);
/* Checks the descriptor and copies the pointer arrays to the device once.
 * INVALID_ARGUMENT naming the field. */
KVTIER_C_EXPORT int kvtier_gpu_cache_create(const kvtier_gpu_cache_desc* d,
                                            kvtier_gpu_cache** out);
/* Frees the device copies and the attention workspaces (NULL: no-op).
 * REQUIRES: no work that uses the cache is still queued. */
KVTIER_C_EXPORT void kvtier_gpu_cache_destroy(kvtier_gpu_cache* cache);

/* The GPU path over a client that maps the daemon's pool: registers the
 * mapping with CUDA on `device` (< 0: the current one). FAILED_PRECONDITION
 * for a client without shared memory. The client must outlive it. */
KVTIER_C_EXPORT int kvtier_gpu_open(kvtier_client* c, int32_t device, kvtier_gpu** out);
KVTIER_C_EXPORT void kvtier_gpu_close(kvtier_gpu* gpu);

/* Encodes num_tokens tokens of `cache` (token t at block
 * block_ids[(first_slot + t) / block_size], slot (first_slot + t) %
 * block_size; block_ids is host memory of num_ids entries) as a chunk of
 * `codec` ("k16v8", "k16v16", ... ; the chunk dtype is the cache's K dtype)
 * and stores it as `key`, after the work queued on `stream`. Returns once
 * the daemon has committed it (durable: on NVMe). */
KVTIER_C_EXPORT int kvtier_gpu_store(kvtier_gpu* gpu, const uint8_t key[16],
                                     const uint8_t fingerprint[16], const char* codec,
                                     const kvtier_gpu_cache* cache, const int32_t* block_ids,
                                     uint32_t num_ids, uint32_t first_slot, uint32_t num_tokens,
                                     uint64_t stream, int durable);

/* kvtier_gpu_store of n chunks in one call: chunk i is keys[16 * i, 16 * i +
 * 16) with its num_ids block ids at block_ids[i * num_ids] (host memory),
 * every chunk num_tokens tokens from first_slot. The encodes of the next
 * chunks run on `stream` while the daemon commits the earlier ones, up to
 * four commits at once. Returns once every chunk is committed or failed.
 * statuses (n entries, may be null) gets each chunk's code; returns
 * KVTIER_OK if every chunk was stored, else the first failed chunk's code
 * (its message in kvtier_last_error). A chunk that fails does not stop the
 * others. */
KVTIER_C_EXPORT int kvtier_gpu_store_batch(kvtier_gpu* gpu, const uint8_t* keys, size_t n,
                                           const uint8_t fingerprint[16], const char* codec,
                                           const kvtier_gpu_cache* cache,
                                           const int32_t* block_ids, uint32_t num_ids,
                                           uint32_t first_slot, uint32_t num_tokens,
                                           uint64_t stream, int durable, int* statuses);

/* A store by layer ranges, so that a prefill can encode layer l while it
 * computes the next: begin reserves the slot; each store_layers enqueues the
 * encode of [layer_begin, layer_end) on `stream` without waiting (ranges in
 * order from layer 0, without gaps); commit waits, seals and stores as
 * `key` (commit_async does that on a libkvtier thread). Release frees the op. */
KVTIER_C_EXPORT int kvtier_gpu_store_begin(kvtier_gpu* gpu, const uint8_t fingerprint[16],
                                           const char* codec, const kvtier_gpu_cache* cache,
                                           uint32_t num_tokens, kvtier_gpu_store_op** out);
KVTIER_C_EXPORT int kvtier_gpu_store_layers(kvtier_gpu_store_op* op, const kvtier_gpu_cache* cache,
                                            const int32_t* block_ids, uint32_t num_ids,
                                            uint32_t first_slot, uint32_t layer_begin,
                                            uint32_t layer_end, uint64_t stream);
KVTIER_C_EXPORT int kvtier_gpu_store_commit(kvtier_gpu_store_op* op, const uint8_t key[16],
                                            int durable);
/* kvtier_gpu_store_commit without waiting: returns once the commit is
 * queued; a thread of the kvtier_gpu waits for the encodes and commits the
 * chunk as `key`, off the caller's thread. kvtier_gpu_store_wait gives its
 * result, for a caller that wants it. As with every store, the blocks must
 * not be written before the encodes ran (order such writes after the
 * encodes' stream). FAILED_PRECONDITION if the op was committed (either
 * way) before. */
KVTIER_C_EXPORT int kvtier_gpu_store_commit_async(kvtier_gpu_store_op* op, const uint8_t key[16],
                                                  int durable);
/* The result of kvtier_gpu_store_commit_async: waits up to timeout_ms (0:
 * answers at once; negative: no limit). DEADLINE_EXCEEDED while the commit
 * runs (ask again); else the commit's code, the same at every later call.
 * FAILED_PRECONDITION if no asynchronous commit was started. */
KVTIER_C_EXPORT int kvtier_gpu_store_wait(kvtier_gpu_store_op* op, int64_t timeout_ms);
/* Frees the op; the slot is aborted unless committed. An asynchronous
 * commit still running goes on and is not waited for (its result is
 * dropped); kvtier_gpu_close waits for every commit of its handle. */
KVTIER_C_EXPORT void kvtier_gpu_store_release(kvtier_gpu_store_op* op);

/* Decodes layers [layer_begin, layer_end) of chunk `key` into the same
 * layers of `cache` at block_ids (host memory) from first_slot; *tier is
 * set to the tier it came from (KVTIER_TIER_*). Returns after the decode has
 * finished. NOT_FOUND on a miss, DATA_LOSS for a corrupt chunk,
 * INVALID_ARGUMENT for a geometry mismatch. */
KVTIER_C_EXPORT int kvtier_gpu_load(kvtier_gpu* gpu, const uint8_t key[16],
                                    const kvtier_gpu_cache* cache, const int32_t* block_ids,
                                    uint32_t num_ids, uint32_t first_slot, uint32_t layer_begin,
                                    uint32_t layer_end, uint64_t stream, int* tier);

/* Loads n chunks layer group by layer group: holds them and checks their
 * headers (several at once), then queues on `stream`, for each group of
 * layer_group layers, that group's decode of every found chunk and an event.
 * Chunk i goes to block ids block_ids[offsets[i] .. offsets[i] + num_ids[i])
 * (host memory) from first_slots[i] (NULL: 0). Returns without waiting for
 * the device. The chunks' checksums are verified on host threads while they
 * decode: a missing or corrupt chunk does not fail the call, finish reports
 * it, and the slots of a chunk reported corrupt hold what was read (use none
 * of a load's slots before finish has said which chunks are good). */
KVTIER_C_EXPORT int kvtier_gpu_load_layerwise(kvtier_gpu* gpu, const uint8_t* keys, size_t n,
                                              const kvtier_gpu_cache* cache,
                                              const int32_t* block_ids, const uint64_t* offsets,
                                              const uint32_t* num_ids,
                                              const uint32_t* first_slots, uint32_t layer_group,
                                              uint64_t stream, kvtier_gpu_layerwise** out);
/* Makes `stream` wait on the device until `layer` of every found chunk is in
 * the cache (cudaStreamWaitEvent; the host does not block). */
KVTIER_C_EXPORT int kvtier_gpu_layerwise_wait_layer(kvtier_gpu_layerwise* lw, uint32_t layer,
                                                    uint64_t stream);
/* Waits for every decode, ends the holds, and fills statuses[i] (0 or the
 * chunk's status code) and tiers[i] (KVTIER_TIER_*, 0 for a failed chunk);
 * either array may be NULL. Returns the first CUDA / unhold error, else 0.
 * Idempotent. */
KVTIER_C_EXPORT int kvtier_gpu_layerwise_finish(kvtier_gpu_layerwise* lw, int* statuses,
                                                int* tiers);
/* Finishes if needed and frees the handle (NULL: no-op). */
KVTIER_C_EXPORT void kvtier_gpu_layerwise_release(kvtier_gpu_layerwise* lw);

/* One decode step of paged attention (kernels::PagedDecodeAttention): out =
 * softmax(q . K^T * sm_scale) . V for `batch` sequences of one query token.
 * q and out: [batch][num_q_heads][head_dim] contiguous, q_dtype (the cache's
 * 16-bit dtype); block_table: [batch][max_blocks_per_seq] int32; seq_lens:
 * [batch] int32; all device addresses. host_block_table / host_seq_lens are
 * optional host copies that are checked before launch. sm_scale <= 0 means
 * 1/sqrt(head_dim). The workspace is kept in `cache`, one per stream, and
 * grows stream-ordered on first use of a larger shape (call once outside a
 * CUDA graph capture to size it). Asynchronous. */
KVTIER_C_EXPORT int kvtier_attention_decode(kvtier_gpu_cache* cache, uint64_t q, int32_t q_dtype,
                                            uint32_t batch, uint32_t num_q_heads,
                                            uint64_t block_table,
                                            const int32_t* host_block_table,
                                            uint32_t max_blocks_per_seq, uint64_t seq_lens,
                                            const int32_t* host_seq_lens, uint32_t layer,
                                            float sm_scale, uint64_t out, uint64_t stream);

#ifdef __cplusplus
}  /* extern "C" */
#endif

#endif  /* KVTIER_CLIENT_KVTIER_C_GPU_H_ */
