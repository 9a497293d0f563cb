/* libkvtier's C API: the small, stable surface that the `kvtier` Python
 * package (python/kvtier, through ctypes) and any other language binding
 * call. It wraps kvtier::client::KvtierClient (client/kvtier_client.h), the
 * CPU codec and, in a build with CUDA, the GPU paged-cache path
 * (client/kvtier_gpu.h) and the paged decode attention kernel.
 *
 * Conventions
 *   - Every call that can fail returns an int status: 0 (KVTIER_OK) or an
 *     absl::StatusCode value (5 NOT_FOUND, 3 INVALID_ARGUMENT, 14 UNAVAILABLE,
 *     15 DATA_LOSS, ...). The one-line reason of the calling thread's last
 *     failure is kvtier_last_error(); it stays valid until that thread's next
 *     call into this API.
 *   - A key is 16 bytes: the big-endian bytes of the 32-hex-digit form that the
 *     CLI prints (Hash128::ToHex), so key bytes and key text map 1:1.
 *   - Handles are opaque and released by their own *_close/_release call.
 *     A client may be used from many threads at once; a held chunk belongs to
 *     the thread that releases it.
 *   - Nothing here takes ownership of caller memory; everything this API
 *     allocates for the caller is freed with kvtier_free.
 *
 * ABI: only functions are added; structs passed by pointer carry their own
 * size in `struct_size` so a newer library can read an older caller's struct.
 * kvtier_abi_version() is bumped on any incompatible change.
 */
#ifndef KVTIER_CLIENT_KVTIER_C_H_
#define KVTIER_CLIENT_KVTIER_C_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__GNUC__)
#define KVTIER_C_EXPORT __attribute__((visibility("default")))
#else
#define KVTIER_C_EXPORT
#endif

#define KVTIER_OK 0
#define KVTIER_ABI_VERSION 1

/* Tiers, as kvtier::client::Tier. */
#define KVTIER_TIER_UNKNOWN 0
#define KVTIER_TIER_HBM 1
#define KVTIER_TIER_DRAM 2
#define KVTIER_TIER_NVME 3
#define KVTIER_TIER_REMOTE 4

typedef struct kvtier_client kvtier_client;
typedef struct kvtier_held kvtier_held;

KVTIER_C_EXPORT int kvtier_abi_version(void);
/* The library's version text, e.g. "0.4.0" (static storage). */
KVTIER_C_EXPORT const char* kvtier_version(void);
/* The calling thread's last failure reason ("" after a success). */
KVTIER_C_EXPORT const char* kvtier_last_error(void);
/* Frees memory this API allocated for the caller (NULL is a no-op). */
KVTIER_C_EXPORT void kvtier_free(void* p);
/* 1 if this build has the GPU path (kvtier_gpu_* and kvtier_attention_*). */
KVTIER_C_EXPORT int kvtier_has_cuda(void);

/* ---- Client ---------------------------------------------------------- */

typedef struct kvtier_client_options {
  size_t struct_size;         /* sizeof(kvtier_client_options) */
  const char* socket_path;    /* NULL or "": the default socket */
  const char* tcp_addr;       /* "HOST:PORT": TCP instead of the socket */
  const char* token;          /* bearer token, or NULL */
  const char* token_file;     /* file holding the token (read and checked), or NULL */
  int64_t timeout_ms;         /* per call; <= 0: the default (60000) */
  int32_t shared_memory;      /* map the daemon's pool (Unix socket); default 1 */
  int32_t max_data_connections; /* < 0: the default (4) */
  int32_t populate_mapping;   /* pre-fault the pool mapping; default 0 */
  /* Fields below were added after the first version; a caller whose
   * struct_size ends before them gets their defaults (NULL). */
  const char* tls_ca;          /* PEM CA file of the daemon's TLS certificate: TLS over TCP */
  const char* tls_cert;        /* PEM client certificate file (mutual TLS), or NULL */
  const char* tls_key;         /* PEM private key file of tls_cert, or NULL */
  const char* tls_server_name; /* name to check the certificate against, or NULL (the host) */
} kvtier_client_options;

/* Fills `o` with the defaults. */
KVTIER_C_EXPORT void kvtier_client_options_init(kvtier_client_options* o);
/* Connects (and checks the daemon answers). UNAVAILABLE if it does not. */
KVTIER_C_EXPORT int kvtier_client_open(const kvtier_client_options* o, kvtier_client** out);
/* Closes the handle. Holds (kvtier_held) and GPU handles taken through it
 * stay valid: the connection and its pool mapping go when the last of them
 * is released, so bytes a caller still reads are never unmapped under it. */
KVTIER_C_EXPORT void kvtier_client_close(kvtier_client* c);
/* 1 if chunk bytes move through the daemon's shared-memory pool. */
KVTIER_C_EXPORT int kvtier_client_uses_shared_memory(const kvtier_client* c);

/* Stores a chunk (the daemon verifies it first). durable: returns only once
 * the chunk is committed on the NVMe tier. */
KVTIER_C_EXPORT int kvtier_put(kvtier_client* c, const uint8_t key[16], const void* data,
                               uint64_t size, int durable);

/* Reads chunk `key` and verifies its checksums. Zero-copy through the pool
 * where the client maps it (the chunk stays pinned in the daemon until
 * kvtier_release), a private copy otherwise. On success *held, *data, *size
 * and *tier are set; NOT_FOUND on a miss, DATA_LOSS for a corrupt chunk (the
 * daemon drops it). */
KVTIER_C_EXPORT int kvtier_get(kvtier_client* c, const uint8_t key[16], kvtier_held** held,
                               const uint8_t** data, uint64_t* size, int* tier);
/* Ends a hold (NULL is a no-op). Returns the daemon's status of the unhold;
 * the hold is gone either way. */
KVTIER_C_EXPORT int kvtier_release(kvtier_held* held);

KVTIER_C_EXPORT int kvtier_delete(kvtier_client* c, const uint8_t key[16]);

/* Longest cached prefix of keys[0..n): *hits leading keys are cached, and
 * tiers[0..*hits) their fastest tier. `tiers` has room for n entries. */
KVTIER_C_EXPORT int kvtier_lookup(kvtier_client* c, const uint8_t* keys, size_t n, uint8_t* tiers,
                                  size_t* hits);

/* What loading the cached prefix of keys[0..n) costs and whether it pays
 * (KvtierClient::PlanLoad), with a recompute cost linear in tokens:
 * kvtier_plan_load_attention with attention_doubling_tokens 0. Arrays have
 * room for n entries. */
typedef struct kvtier_load_plan {
  size_t struct_size;     /* sizeof(kvtier_load_plan) */
  size_t hits;            /* cached leading chunks */
  size_t load_chunks;     /* leading hits worth loading (with a prefill rate) */
  double load_chunks_us;  /* their estimated load time */
  double saved_us;        /* recompute time that loading them saves */
  uint8_t* tiers;         /* [n] caller memory, or NULL */
  uint64_t* chunk_bytes;  /* [n] caller memory, or NULL */
  double* load_us;        /* [n] caller memory, or NULL */
} kvtier_load_plan;
KVTIER_C_EXPORT int kvtier_plan_load(kvtier_client* c, const uint8_t* keys, size_t n,
                                     double prefill_tokens_per_s, uint32_t tokens_per_chunk,
                                     kvtier_load_plan* plan);
/* kvtier_plan_load with the attention term of the recompute cost:
 * attention_doubling_tokens (C2) is the context length, in tokens, at which
 * one token's prefill costs twice its short-context cost, and
 * prefill_tokens_per_s the short-context rate r, so hit i (tokens [i*T,
 * (i+1)*T), T = tokens_per_chunk) recomputes in
 * 1e6 * T / r * (1 + (i*T + T/2) / C2) microseconds. 0 is the linear cost of
 * kvtier_plan_load. INVALID_ARGUMENT (from the daemon) for a negative or
 * non-finite value. */
KVTIER_C_EXPORT int kvtier_plan_load_attention(kvtier_client* c, const uint8_t* keys, size_t n,
                                               double prefill_tokens_per_s,
                                               double attention_doubling_tokens,
                                               uint32_t tokens_per_chunk, kvtier_load_plan* plan);

/* Moves present chunks into DRAM; *all_in_dram = 1 if all arrived within
 * deadline_ms. */
KVTIER_C_EXPORT int kvtier_prefetch(kvtier_client* c, const uint8_t* keys, size_t n,
                                    uint32_t deadline_ms, int* all_in_dram);

/* The daemon's tiers and counters as JSON text:
 * {"tiers":[{"tier":"dram","capacity_bytes":..,"used_bytes":..,"chunks":..,
 *   "read_bytes_per_s":..,"write_bytes_per_s":..}],"counters":{"name":n,...}}
 * *json is freed with kvtier_free. */
KVTIER_C_EXPORT int kvtier_stats_json(kvtier_client* c, char** json);

/* ---- Keys ------------------------------------------------------------ */

/* What identifies the KV of one model shard (codec::ModelIdentity). NULL
 * strings are "". */
typedef struct kvtier_model_identity {
  size_t struct_size;     /* sizeof(kvtier_model_identity) */
  const char* model_id;
  const char* revision;
  const char* dtype;      /* "bf16" | "fp16" */
  const char* kv_layout;  /* e.g. "vllm-flash-nhd" */
  const char* codec;      /* e.g. "k16v8" */
  uint32_t tp_world_size;
  uint32_t tp_rank;
} kvtier_model_identity;

/* Fills `id` with the CLI's defaults (`kvtier keys`): dtype "bf16",
 * kv_layout "nhd", codec "k16v8", tp 1/0. */
KVTIER_C_EXPORT void kvtier_model_identity_init(kvtier_model_identity* id);
KVTIER_C_EXPORT int kvtier_fingerprint(const kvtier_model_identity* id, uint8_t out[16]);
/* Keys of the full chunks of tokens[0..n) (and of a trailing partial chunk
 * with `partial`), exactly as `kvtier keys`. keys_out has room for
 * n / chunk_tokens + 1 keys (16 bytes each); *num_keys is set. */
KVTIER_C_EXPORT int kvtier_chunk_keys(const uint8_t fingerprint[16], const uint32_t* tokens,
                                      size_t n, uint32_t chunk_tokens, int partial,
                                      uint8_t* keys_out, size_t* num_keys);

/* ---- CPU codec ------------------------------------------------------- */

/* One chunk's shape and format. */
typedef struct kvtier_chunk_spec {
  size_t struct_size;       /* sizeof(kvtier_chunk_spec) */
  uint8_t fingerprint[16];
  uint32_t num_layers;
  uint32_t num_kv_heads;
  uint32_t head_dim;
  uint32_t num_tokens;
  uint32_t block_size;      /* the engine's block size (scale granularity) */
  const char* dtype;        /* "bf16" | "fp16": the engine's 16-bit dtype */
  const char* codec;        /* "k16v8", "k16v16", ... (codec::ParseCodec) */
} kvtier_chunk_spec;

/* Encoded size of a chunk of `spec`, header included. */
KVTIER_C_EXPORT int kvtier_chunk_bytes(const kvtier_chunk_spec* spec, uint64_t* bytes);
/* Encodes K and V (16-bit elements of spec->dtype, [layers][tokens][heads]
 * [head_dim] each) into out[0..out_size), which must be exactly
 * kvtier_chunk_bytes. */
KVTIER_C_EXPORT int kvtier_encode_chunk(const kvtier_chunk_spec* spec, const uint16_t* k,
                                        const uint16_t* v, uint8_t* out, uint64_t out_size);

/* A verified chunk's header. */
typedef struct kvtier_chunk_info {
  size_t struct_size;  /* sizeof(kvtier_chunk_info) */
  uint8_t fingerprint[16];
  uint32_t num_layers;
  uint32_t num_kv_heads;
  uint32_t head_dim;
  uint32_t num_tokens;
  uint32_t block_size;
  char dtype[8];       /* "bf16" | "fp16" */
  char codec[64];      /* codec::CodecName */
  uint64_t total_bytes;
} kvtier_chunk_info;
/* Verifies the chunk (header and both checksums) and describes it.
 * INVALID_ARGUMENT / DATA_LOSS for bad bytes. */
KVTIER_C_EXPORT int kvtier_chunk_inspect(const uint8_t* chunk, uint64_t size,
                                         kvtier_chunk_info* info);
/* Describes a chunk from its header alone: the header's fields and checksum
 * and the chunk's length are checked, the K and V sections are not (what a
 * caller needs to size the buffers of kvtier_decode_chunk, which verifies
 * everything). INVALID_ARGUMENT / DATA_LOSS for a bad header or length. */
KVTIER_C_EXPORT int kvtier_chunk_header(const uint8_t* chunk, uint64_t size,
                                        kvtier_chunk_info* info);
/* Verifies and decodes a chunk into k and v (16-bit elements of the chunk's
 * dtype, [layers][tokens][heads][head_dim]); each buffer holds `elements`
 * elements, which must be exactly layers*tokens*heads*head_dim. */
KVTIER_C_EXPORT int kvtier_decode_chunk(const uint8_t* chunk, uint64_t size, uint16_t* k,
                                        uint16_t* v, uint64_t elements);
/* As kvtier_decode_chunk, layers [layer_begin, layer_end) only, into buffers
 * of (layer_end - layer_begin)*tokens*heads*head_dim elements. */
KVTIER_C_EXPORT int kvtier_decode_chunk_layers(const uint8_t* chunk, uint64_t size,
                                               uint32_t layer_begin, uint32_t layer_end,
                                               uint16_t* k, uint16_t* v, uint64_t elements);

/* ---- Host KV pages ----------------------------------------------------
 * Chunks between the daemon and an engine's host KV pool (SGLang's HiCache
 * host pool), one page a chunk, encoded from and decoded into the pool in
 * place, a batch of pages on threads of the call: the caller makes one call
 * a batch (and a binding releases its interpreter lock once). */

/* Where a page's K and V live: the kv_heads*head_dim 16-bit elements of
 * (layer l, token t) start at k + l*layer_stride + t*token_stride
 * (elements), likewise in v. The strides must keep the rows apart in one of
 * the two orders (layer-major or token-major). */
typedef struct kvtier_host_page {
  uint16_t* k;
  uint16_t* v;
  uint64_t layer_stride;
  uint64_t token_stride;
} kvtier_host_page;

/* Encodes pages[i] as a chunk of `spec` and stores it under keys[i] (16
 * bytes each), for i < n, on up to `threads` threads (0 is 1, at most 64). Through the
 * shared pool a chunk is encoded into its slot in place and the daemon
 * checksums it as it commits. status[i] (n entries) is each page's result
 * (KVTIER_OK or its code); *bytes (may be NULL) the encoded bytes stored.
 * Returns KVTIER_OK if every page was stored, else the first failed page's
 * code, with kvtier_last_error naming it. */
KVTIER_C_EXPORT int kvtier_put_pages(kvtier_client* c, const kvtier_chunk_spec* spec,
                                     const uint8_t* keys, size_t n,
                                     const kvtier_host_page* pages, uint32_t threads,
                                     int* status, uint64_t* bytes);
/* Reads the chunk of keys[i] into pages[i], for i < n, on up to `threads`
 * threads, each layer record checked just before it is decoded. A page's
 * status is NOT_FOUND on a miss, INVALID_ARGUMENT for a chunk whose
 * fingerprint, dtype or geometry (block size aside) is not `expect`'s (its
 * codec is not compared), DATA_LOSS for corrupt bytes (the daemon drops the
 * chunk; the page may hold part of it). *bytes (may be NULL): the chunk
 * bytes read. Returns KVTIER_OK if every page was read or missed, else the
 * first failed page's code, with kvtier_last_error naming it. */
KVTIER_C_EXPORT int kvtier_get_pages(kvtier_client* c, const kvtier_chunk_spec* expect,
                                     const uint8_t* keys, size_t n,
                                     const kvtier_host_page* pages, uint32_t threads,
                                     int* status, uint64_t* bytes);

#ifdef __cplusplus
}  /* extern "C" */
#endif

#endif  /* KVTIER_CLIENT_KVTIER_C_H_ */
