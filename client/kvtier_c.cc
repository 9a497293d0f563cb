// libkvtier's C API (kvtier_c.h) over KvtierClient and the CPU codec.
#include "client/kvtier_c.h"

#include <algorithm>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <new>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "client/host_pages.h"
#include "client/kvtier_c_internal.h"
#include "client/kvtier_client.h"
#include "codec/chunk.h"
#include "codec/codec.h"
#include "codec/format.h"
#include "codec/prefix_key.h"
#include "common/hash.h"
#include "nlohmann/json.hpp"
#include "wire/chunk_check.h"

using kvtier::Hash128;
using kvtier::client::KvtierClient;

// A chunk read for the caller: either held in place in the daemon's pool
// (zero-copy) or a private copy of an inline get.
struct kvtier_held {
  std::shared_ptr<KvtierClient> client;  // keeps the pool mapped while held
  std::optional<kvtier::client::HeldChunk> hold;
  std::vector<uint8_t> copy;
};

namespace {
thread_local std::string g_last_error;
}  // namespace

namespace kvtier::capi {

int Fail(const absl::Status& st) {
  std::string msg(st.message());
  for (char& ch : msg) {
    if (ch == '\n' || ch == '\r') ch = ' ';
  }
  g_last_error = std::move(msg);
  return static_cast<int>(st.code());
}

int Done(const absl::Status& st) {
  if (st.ok()) {
    g_last_error.clear();
    return KVTIER_OK;
  }
  return Fail(st);
}

}  // namespace kvtier::capi

namespace {

using kvtier::capi::Done;
using kvtier::capi::Fail;

int Invalid(const std::string& what) { return Fail(absl::InvalidArgumentError(what)); }

Hash128 KeyOf(const uint8_t* bytes) {
  Hash128 k;
  std::memcpy(k.bytes.data(), bytes, Hash128::kSize);
  return k;
}

std::vector<Hash128> KeysOf(const uint8_t* bytes, size_t n) {
  std::vector<Hash128> keys(n);
  for (size_t i = 0; i < n; ++i) keys[i] = KeyOf(bytes + i * Hash128::kSize);
  return keys;
}

const char* Str(const char* s) { return s == nullptr ? "" : s; }

// A caller struct is usable when it is at least as large as this library's
// first version of it (fields are only ever appended).
template <typename T>
bool SizedAtLeast(const T* p, size_t first_version_size) {
  return p != nullptr && p->struct_size >= first_version_size;
}

absl::StatusOr<kvtier::codec::ChunkSpec> SpecOf(const kvtier_chunk_spec* s) {
  namespace codec = kvtier::codec;
  if (!SizedAtLeast(s, sizeof(kvtier_chunk_spec))) {
    return absl::InvalidArgumentError("chunk spec: null or struct_size too small");
  }
  codec::ChunkSpec spec;
  std::memcpy(spec.fingerprint.bytes.data(), s->fingerprint, Hash128::kSize);
  spec.geometry = codec::Geometry{s->num_layers, s->num_kv_heads, s->head_dim, s->num_tokens,
                                  s->block_size};
  auto dtype = codec::ParseDType(s->dtype == nullptr ? "bf16" : s->dtype);
  if (!dtype.ok()) return dtype.status();
  if (*dtype != codec::DType::kBF16 && *dtype != codec::DType::kFP16) {
    return absl::InvalidArgumentError(absl::StrCat("chunk dtype must be bf16 or fp16, not ", s->dtype));
  }
  spec.dtype = *dtype;
  auto format = codec::ParseCodec(s->codec == nullptr ? "k16v8" : s->codec, spec.dtype);
  if (!format.ok()) return format.status();
  spec.k = format->k;
  spec.v = format->v;
  auto layout = codec::ValidateSpec(spec);
  if (!layout.ok()) return layout.status();
  return spec;
}

void CopyText(char* dst, size_t cap, std::string_view src) {
  size_t n = std::min(cap - 1, src.size());
  std::memcpy(dst, src.data(), n);
  dst[n] = '\0';
}

}  // namespace

extern "C" {

int kvtier_abi_version(void) { return KVTIER_ABI_VERSION; }

const char* kvtier_version(void) { return KVTIER_VERSION_STRING; }

const char* kvtier_last_error(void) { return g_last_error.c_str(); }

int kvtier_has_cuda(void) { return KVTIER_C_HAVE_CUDA; }

void kvtier_free(void* p) { std::free(p); }

// ---- Client ---------------------------------------------------------------

void kvtier_client_options_init(kvtier_client_options* o) {
  if (o == nullptr) return;
  *o = kvtier_client_options{};
  o->struct_size = sizeof(kvtier_client_options);
  o->timeout_ms = 60000;
  o->shared_memory = 1;
  o->max_data_connections = -1;
  o->populate_mapping = 0;
}

int kvtier_client_open(const kvtier_client_options* o, kvtier_client** out) {
  if (out == nullptr) return Invalid("out is null");
  *out = nullptr;
  kvtier::client::ClientOptions opts;
  // The first version of the struct ended at populate_mapping.
  constexpr size_t kFirstVersionSize = offsetof(kvtier_client_options, tls_ca);
  if (!SizedAtLeast(o, kFirstVersionSize)) {
    return Invalid("client options: null or struct_size too small");
  }
  if (o->struct_size >= offsetof(kvtier_client_options, tls_server_name) + sizeof(const char*)) {
    opts.tls_ca = Str(o->tls_ca);
    opts.tls_cert = Str(o->tls_cert);
    opts.tls_key = Str(o->tls_key);
    opts.tls_server_name = Str(o->tls_server_name);
  }
  if (o->socket_path != nullptr && o->socket_path[0] != '\0') opts.socket_path = o->socket_path;
  opts.tcp_addr = Str(o->tcp_addr);
  if (o->token != nullptr && o->token_file != nullptr) {
    return Invalid("give a token or a token file, not both");
  }
  if (o->token != nullptr) {
    opts.token = o->token;
  } else if (o->token_file != nullptr) {
    auto token = kvtier::client::ReadTokenFile(o->token_file);
    if (!token.ok()) return Fail(token.status());
    opts.token = *std::move(token);
  }
  if (o->timeout_ms > 0) opts.timeout_ms = o->timeout_ms;
  opts.shared_memory = o->shared_memory != 0;
  if (o->max_data_connections >= 0) opts.max_data_connections = o->max_data_connections;
  opts.populate_mapping = o->populate_mapping != 0;
  auto client = KvtierClient::Connect(opts);
  if (!client.ok()) return Fail(client.status());
  auto* c = new (std::nothrow) kvtier_client;
  if (c == nullptr) return Fail(absl::ResourceExhaustedError("out of memory"));
  c->impl = *std::move(client);
  *out = c;
  return Done(absl::OkStatus());
}

// The client itself goes when the last of its holds and GPU handles does.
void kvtier_client_close(kvtier_client* c) { delete c; }

int kvtier_client_uses_shared_memory(const kvtier_client* c) {
  return c != nullptr && c->impl->uses_shared_memory() ? 1 : 0;
}

int kvtier_put(kvtier_client* c, const uint8_t key[16], const void* data, uint64_t size,
               int durable) {
  if (c == nullptr || key == nullptr) return Invalid("client or key is null");
  if (data == nullptr && size > 0) return Invalid("data is null");
  kvtier::client::PutOptions po;
  po.durable = durable != 0;
  return Done(c->impl->Put(KeyOf(key),
                           std::span<const uint8_t>(static_cast<const uint8_t*>(data), size), po));
}

int kvtier_get(kvtier_client* c, const uint8_t key[16], kvtier_held** held, const uint8_t** data,
               uint64_t* size, int* tier) {
  if (c == nullptr || key == nullptr || held == nullptr || data == nullptr || size == nullptr) {
    return Invalid("client, key or an output is null");
  }
  *held = nullptr;
  *data = nullptr;
  *size = 0;
  auto h = std::make_unique<kvtier_held>();
  h->client = c->impl;
  const Hash128 k = KeyOf(key);
  kvtier::client::Tier t = kvtier::client::Tier::kUnknown;
  if (c->impl->uses_shared_memory()) {
    auto hold = c->impl->Hold(k, /*verify=*/false);
    if (!hold.ok()) return Fail(hold.status());
    // The reader's check: the daemon verified at put; the bytes in the pool
    // are checked again here, where they are read (unless the daemon checked
    // them as this hold read them, from NVMe or a peer).
    absl::Status verified = kvtier::client::CheckHeldBytes(*hold);
    if (!verified.ok()) {
      (void)c->impl->Unhold(*hold);
      // The daemon checks the stored bytes and drops a corrupt chunk.
      auto recheck = c->impl->Hold(k, /*verify=*/true);
      if (recheck.ok()) {
        (void)c->impl->Unhold(*recheck);
        return Fail(absl::DataLossError(
            absl::StrCat("chunk changed while it was read: ", verified.message())));
      }
      return Fail(recheck.status());
    }
    t = hold->tier;
    *data = hold->data.data();
    *size = hold->data.size();
    h->hold = *hold;
  } else {
    auto got = c->impl->GetWithTier(k);
    if (!got.ok()) return Fail(got.status());
    h->copy = std::move(got->first);
    t = got->second;
    *data = h->copy.data();
    *size = h->copy.size();
  }
  if (tier != nullptr) *tier = static_cast<int>(t);
  *held = h.release();
  return Done(absl::OkStatus());
}

int kvtier_release(kvtier_held* held) {
  if (held == nullptr) return KVTIER_OK;
  absl::Status st;
  if (held->hold.has_value()) st = held->client->Unhold(*held->hold);
  delete held;
  return Done(st);
}

int kvtier_delete(kvtier_client* c, const uint8_t key[16]) {
  if (c == nullptr || key == nullptr) return Invalid("client or key is null");
  return Done(c->impl->Delete(KeyOf(key)));
}

int kvtier_lookup(kvtier_client* c, const uint8_t* keys, size_t n, uint8_t* tiers, size_t* hits) {
  if (c == nullptr || hits == nullptr || (n > 0 && (keys == nullptr || tiers == nullptr))) {
    return Invalid("client, keys, tiers or hits is null");
  }
  *hits = 0;
  auto found = c->impl->Lookup(KeysOf(keys, n));
  if (!found.ok()) return Fail(found.status());
  if (found->size() > n) return Fail(absl::InternalError("daemon answered more hits than keys"));
  for (size_t i = 0; i < found->size(); ++i) tiers[i] = static_cast<uint8_t>((*found)[i]);
  *hits = found->size();
  return Done(absl::OkStatus());
}

int kvtier_plan_load(kvtier_client* c, const uint8_t* keys, size_t n, double prefill_tokens_per_s,
                     uint32_t tokens_per_chunk, kvtier_load_plan* plan) {
  return kvtier_plan_load_attention(c, keys, n, prefill_tokens_per_s, 0, tokens_per_chunk, plan);
}

int kvtier_plan_load_attention(kvtier_client* c, const uint8_t* keys, size_t n,
                               double prefill_tokens_per_s, double attention_doubling_tokens,
                               uint32_t tokens_per_chunk, kvtier_load_plan* plan) {
  if (c == nullptr || (n > 0 && keys == nullptr)) return Invalid("client or keys is null");
  if (!SizedAtLeast(plan, sizeof(kvtier_load_plan))) {
    return Invalid("load plan: null or struct_size too small");
  }
  auto p = c->impl->PlanLoad(KeysOf(keys, n), prefill_tokens_per_s, tokens_per_chunk,
                             attention_doubling_tokens);
  if (!p.ok()) return Fail(p.status());
  const size_t hits = p->tiers.size();
  if (hits > n || p->chunk_bytes.size() != hits || p->load_us.size() != hits) {
    return Fail(absl::InternalError("daemon answered a plan whose lengths do not match the keys"));
  }
  plan->hits = hits;
  plan->load_chunks = p->load_chunks;
  plan->load_chunks_us = p->load_chunks_us;
  plan->saved_us = p->saved_us;
  for (size_t i = 0; i < hits; ++i) {
    if (plan->tiers != nullptr) plan->tiers[i] = static_cast<uint8_t>(p->tiers[i]);
    if (plan->chunk_bytes != nullptr) plan->chunk_bytes[i] = p->chunk_bytes[i];
    if (plan->load_us != nullptr) plan->load_us[i] = p->load_us[i];
  }
  return Done(absl::OkStatus());
}

int kvtier_prefetch(kvtier_client* c, const uint8_t* keys, size_t n, uint32_t deadline_ms,
                    int* all_in_dram) {
  if (c == nullptr || (n > 0 && keys == nullptr)) return Invalid("client or keys is null");
  auto r = c->impl->Prefetch(KeysOf(keys, n), deadline_ms);
  if (!r.ok()) return Fail(r.status());
  if (all_in_dram != nullptr) *all_in_dram = *r ? 1 : 0;
  return Done(absl::OkStatus());
}

int kvtier_stats_json(kvtier_client* c, char** json) {
  if (c == nullptr || json == nullptr) return Invalid("client or json is null");
  *json = nullptr;
  auto s = c->impl->Stats();
  if (!s.ok()) return Fail(s.status());
  nlohmann::json j;
  j["tiers"] = nlohmann::json::array();
  for (const auto& t : s->tiers) {
    j["tiers"].push_back({{"tier", kvtier::client::TierName(t.tier)},
                          {"capacity_bytes", t.capacity_bytes},
                          {"used_bytes", t.used_bytes},
                          {"chunks", t.chunks},
                          {"read_bytes_per_s", t.read_bytes_per_s},
                          {"write_bytes_per_s", t.write_bytes_per_s}});
  }
  j["counters"] = nlohmann::json::object();
  for (const auto& [name, value] : s->counters) j["counters"][name] = value;
  const std::string text = j.dump();
  char* out = static_cast<char*>(std::malloc(text.size() + 1));
  if (out == nullptr) return Fail(absl::ResourceExhaustedError("out of memory"));
  std::memcpy(out, text.c_str(), text.size() + 1);
  *json = out;
  return Done(absl::OkStatus());
}

// ---- Keys -----------------------------------------------------------------

void kvtier_model_identity_init(kvtier_model_identity* id) {
  if (id == nullptr) return;
  *id = kvtier_model_identity{};
  id->struct_size = sizeof(kvtier_model_identity);
  id->dtype = "bf16";
  id->kv_layout = "nhd";
  id->codec = "k16v8";
  id->tp_world_size = 1;
  id->tp_rank = 0;
}

int kvtier_fingerprint(const kvtier_model_identity* id, uint8_t out[16]) {
  if (!SizedAtLeast(id, sizeof(kvtier_model_identity)) || out == nullptr) {
    return Invalid("model identity: null or struct_size too small, or out is null");
  }
  kvtier::codec::ModelIdentity m{Str(id->model_id), Str(id->revision),  Str(id->dtype),
                                 Str(id->kv_layout), Str(id->codec), id->tp_world_size,
                                 id->tp_rank};
  auto fp = kvtier::codec::ModelFingerprint(m);
  if (!fp.ok()) return Fail(fp.status());
  std::memcpy(out, fp->bytes.data(), Hash128::kSize);
  return Done(absl::OkStatus());
}

int kvtier_chunk_keys(const uint8_t fingerprint[16], const uint32_t* tokens, size_t n,
                      uint32_t chunk_tokens, int partial, uint8_t* keys_out, size_t* num_keys) {
  if (fingerprint == nullptr || keys_out == nullptr || num_keys == nullptr ||
      (n > 0 && tokens == nullptr)) {
    return Invalid("fingerprint, tokens, keys_out or num_keys is null");
  }
  *num_keys = 0;
  auto keys = kvtier::codec::ChunkKeys(KeyOf(fingerprint), std::span<const uint32_t>(tokens, n),
                                       chunk_tokens, partial != 0);
  if (!keys.ok()) return Fail(keys.status());
  for (size_t i = 0; i < keys->size(); ++i) {
    std::memcpy(keys_out + i * Hash128::kSize, (*keys)[i].bytes.data(), Hash128::kSize);
  }
  *num_keys = keys->size();
  return Done(absl::OkStatus());
}

// ---- CPU codec ------------------------------------------------------------

int kvtier_chunk_bytes(const kvtier_chunk_spec* s, uint64_t* bytes) {
  if (bytes == nullptr) return Invalid("bytes is null");
  auto spec = SpecOf(s);
  if (!spec.ok()) return Fail(spec.status());
  auto layout = kvtier::codec::ValidateSpec(*spec);
  if (!layout.ok()) return Fail(layout.status());
  *bytes = layout->total_bytes;
  return Done(absl::OkStatus());
}

int kvtier_encode_chunk(const kvtier_chunk_spec* s, const uint16_t* k, const uint16_t* v,
                        uint8_t* out, uint64_t out_size) {
  auto spec = SpecOf(s);
  if (!spec.ok()) return Fail(spec.status());
  if (k == nullptr || v == nullptr || out == nullptr) return Invalid("k, v or out is null");
  const uint64_t elements = spec->geometry.num_layers * spec->geometry.layer_elements();
  kvtier::codec::KvView kv{std::span<const uint16_t>(k, elements),
                           std::span<const uint16_t>(v, elements)};
  return Done(kvtier::codec::EncodeChunkInto(*spec, kv, std::span<uint8_t>(out, out_size)));
}

}  // extern "C"

namespace {

int DescribeChunk(const kvtier::codec::ChunkHeader& h, kvtier_chunk_info* info) {
  const auto& spec = h.spec;
  std::memcpy(info->fingerprint, spec.fingerprint.bytes.data(), Hash128::kSize);
  info->num_layers = spec.geometry.num_layers;
  info->num_kv_heads = spec.geometry.num_kv_heads;
  info->head_dim = spec.geometry.head_dim;
  info->num_tokens = spec.geometry.num_tokens;
  info->block_size = spec.geometry.block_size;
  CopyText(info->dtype, sizeof(info->dtype), kvtier::codec::DTypeName(spec.dtype));
  CopyText(info->codec, sizeof(info->codec),
           kvtier::codec::CodecName(kvtier::codec::CodecFormat{spec.k, spec.v}));
  info->total_bytes = h.layout.total_bytes;
  return Done(absl::OkStatus());
}

}  // namespace

extern "C" {

int kvtier_chunk_inspect(const uint8_t* chunk, uint64_t size, kvtier_chunk_info* info) {
  if (chunk == nullptr && size > 0) return Invalid("chunk is null");
  if (!SizedAtLeast(info, sizeof(kvtier_chunk_info))) {
    return Invalid("chunk info: null or struct_size too small");
  }
  auto h = kvtier::wire::VerifyChunkParallel(std::span<const uint8_t>(chunk, size));
  if (!h.ok()) return Fail(h.status());
  return DescribeChunk(h->header(), info);
}

int kvtier_chunk_header(const uint8_t* chunk, uint64_t size, kvtier_chunk_info* info) {
  if (chunk == nullptr && size > 0) return Invalid("chunk is null");
  if (!SizedAtLeast(info, sizeof(kvtier_chunk_info))) {
    return Invalid("chunk info: null or struct_size too small");
  }
  auto h = kvtier::codec::ParseHeader(std::span<const uint8_t>(chunk, size));
  if (!h.ok()) return Fail(h.status());
  if (h->layout.total_bytes != size) {
    return Fail(absl::DataLossError(absl::StrCat("chunk is ", size, " bytes, its header says ",
                                                 h->layout.total_bytes)));
  }
  return DescribeChunk(*h, info);
}

int kvtier_decode_chunk_layers(const uint8_t* chunk, uint64_t size, uint32_t layer_begin,
                               uint32_t layer_end, uint16_t* k, uint16_t* v, uint64_t elements) {
  namespace codec = kvtier::codec;
  if (chunk == nullptr || k == nullptr || v == nullptr) return Invalid("chunk, k or v is null");
  const std::span<const uint8_t> bytes(chunk, size);
  auto verified = kvtier::wire::VerifyChunkParallel(bytes);
  if (!verified.ok()) return Fail(verified.status());
  const codec::ChunkHeader& h = verified->header();
  const codec::Geometry& g = h.spec.geometry;
  if (layer_begin >= layer_end || layer_end > g.num_layers) {
    return Invalid(absl::StrCat("layer range [", layer_begin, ", ", layer_end,
                                ") is not within the chunk's ", g.num_layers, " layers"));
  }
  const uint64_t want = g.layer_elements() * (layer_end - layer_begin);
  if (elements != want) {
    return Invalid(absl::StrCat("output buffers hold ", elements, " elements; the layers need ", want));
  }
  // Verified above, on the worker pool.
  return Done(codec::DecodeChunkRows(h, bytes, layer_begin, layer_end,
                                     codec::KvRows<uint16_t>::Contiguous(k, v, g),
                                     /*verify=*/false));
}

int kvtier_decode_chunk(const uint8_t* chunk, uint64_t size, uint16_t* k, uint16_t* v,
                        uint64_t elements) {
  if (chunk == nullptr) return Invalid("chunk is null");
  auto header = kvtier::codec::ParseHeader(std::span<const uint8_t>(chunk, size));
  if (!header.ok()) return Fail(header.status());
  return kvtier_decode_chunk_layers(chunk, size, 0, header->spec.geometry.num_layers, k, v,
                                    elements);
}

}  // extern "C"

namespace {

// What kvtier_put_pages and kvtier_get_pages share: the argument checks, the
// pages as codec rows, and the result (status[], *bytes, and the first
// failure, a miss aside with `misses_ok`).
template <typename Row, typename Run>
int HostPagesCall(kvtier_client* c, const kvtier_chunk_spec* s, const uint8_t* keys, size_t n,
                  const kvtier_host_page* pages, int* status, uint64_t* bytes, bool misses_ok,
                  Run run) {
  if (c == nullptr) return Invalid("client is null");
  if (n > 0 && (keys == nullptr || pages == nullptr || status == nullptr)) {
    return Invalid("keys, pages or status is null");
  }
  auto spec = SpecOf(s);
  if (!spec.ok()) return Fail(spec.status());
  std::vector<kvtier::codec::KvRows<Row>> rows(n);
  for (size_t i = 0; i < n; ++i) {
    rows[i] = {pages[i].k, pages[i].v, pages[i].layer_stride, pages[i].token_stride};
  }
  const kvtier::client::HostPagesResult r = run(*c->impl, *spec, KeysOf(keys, n), rows);
  if (bytes != nullptr) *bytes = r.bytes;
  absl::Status first;
  size_t first_page = 0;
  for (size_t i = 0; i < r.status.size(); ++i) {
    status[i] = static_cast<int>(r.status[i].code());
    if (r.status[i].ok() || (misses_ok && absl::IsNotFound(r.status[i])) || !first.ok()) continue;
    first = r.status[i];
    first_page = i;
  }
  if (first.ok()) return Done(first);
  return Fail(absl::Status(first.code(), absl::StrCat("page ", first_page, ": ", first.message())));
}

}  // namespace

extern "C" {

int kvtier_put_pages(kvtier_client* c, const kvtier_chunk_spec* s, const uint8_t* keys, size_t n,
                     const kvtier_host_page* pages, uint32_t threads, int* status,
                     uint64_t* bytes) {
  return HostPagesCall<const uint16_t>(
      c, s, keys, n, pages, status, bytes, /*misses_ok=*/false,
      [threads](auto& client, const auto& spec, const auto& k, const auto& rows) {
        return kvtier::client::PutHostPages(client, spec, k, rows, threads);
      });
}

int kvtier_get_pages(kvtier_client* c, const kvtier_chunk_spec* expect, const uint8_t* keys,
                     size_t n, const kvtier_host_page* pages, uint32_t threads, int* status,
                     uint64_t* bytes) {
  return HostPagesCall<uint16_t>(
      c, expect, keys, n, pages, status, bytes, /*misses_ok=*/true,
      [threads](auto& client, const auto& spec, const auto& k, const auto& rows) {
        return kvtier::client::GetHostPages(client, spec, k, rows, threads);
      });
}

}  // extern "C"
