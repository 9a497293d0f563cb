// The C API's argument checks (no daemon): null pointers, short structs,
// wrong lengths and hostile chunk bytes give a status and a reason, never a
// crash. Calls against a running daemon are tested from Python
// (python/tests/test_client.py).
#include "client/kvtier_c.h"

#include <cstddef>
#include <cstring>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace {

constexpr int kInvalidArgument = 3;
constexpr int kNotFound = 5;
constexpr int kDataLoss = 15;

kvtier_chunk_spec Spec(const char* codec) {
  kvtier_chunk_spec s{};
  s.struct_size = sizeof(s);
  s.num_layers = 2;
  s.num_kv_heads = 2;
  s.head_dim = 64;
  s.num_tokens = 32;
  s.block_size = 16;
  s.dtype = "bf16";
  s.codec = codec;
  return s;
}

std::vector<uint8_t> Encode(const kvtier_chunk_spec& s) {
  uint64_t bytes = 0;
  EXPECT_EQ(kvtier_chunk_bytes(&s, &bytes), KVTIER_OK) << kvtier_last_error();
  const size_t n = size_t{s.num_layers} * s.num_tokens * s.num_kv_heads * s.head_dim;
  std::vector<uint16_t> k(n), v(n);
  for (size_t i = 0; i < n; ++i) {
    k[i] = static_cast<uint16_t>(0x3f80 + (i % 64));  // bf16 values near 1
    v[i] = static_cast<uint16_t>(0xbf80 + (i % 32));
  }
  std::vector<uint8_t> out(bytes);
  EXPECT_EQ(kvtier_encode_chunk(&s, k.data(), v.data(), out.data(), out.size()), KVTIER_OK)
      << kvtier_last_error();
  return out;
}

TEST(KvtierC, NullAndShortArgumentsAreInvalid) {
  kvtier_client* c = nullptr;
  EXPECT_EQ(kvtier_client_open(nullptr, &c), kInvalidArgument);
  EXPECT_NE(std::string(kvtier_last_error()), "");
  kvtier_client_options o;
  kvtier_client_options_init(&o);
  EXPECT_EQ(kvtier_client_open(&o, nullptr), kInvalidArgument);
  o.struct_size = 8;
  EXPECT_EQ(kvtier_client_open(&o, &c), kInvalidArgument);
  EXPECT_EQ(c, nullptr);
  uint8_t key[16] = {};
  EXPECT_EQ(kvtier_put(nullptr, key, "x", 1, 0), kInvalidArgument);
  EXPECT_EQ(kvtier_delete(nullptr, key), kInvalidArgument);
  size_t hits = 7;
  EXPECT_EQ(kvtier_lookup(nullptr, key, 1, nullptr, &hits), kInvalidArgument);
  kvtier_load_plan plan{};
  plan.struct_size = sizeof(plan);
  EXPECT_EQ(kvtier_plan_load(nullptr, key, 1, 1000, 256, &plan), kInvalidArgument);
  EXPECT_EQ(kvtier_plan_load_attention(nullptr, key, 1, 1000, 32512, 256, &plan), kInvalidArgument);
  EXPECT_NE(std::string(kvtier_last_error()), "");
  kvtier_host_page page{};
  int status = -1;
  const kvtier_chunk_spec spec = Spec("k16v8");
  EXPECT_EQ(kvtier_put_pages(nullptr, &spec, key, 1, &page, 1, &status, nullptr), kInvalidArgument);
  EXPECT_EQ(kvtier_get_pages(nullptr, &spec, key, 1, &page, 1, &status, nullptr), kInvalidArgument);
  EXPECT_EQ(status, -1);  // nothing was attempted
  EXPECT_EQ(kvtier_release(nullptr), KVTIER_OK);
  kvtier_client_close(nullptr);
  kvtier_free(nullptr);
}

// The TLS fields sit at the struct's end: a caller built against the first
// version (struct_size ending at populate_mapping) is served without them,
// whatever lies past its struct; a current caller's TLS options are checked.
TEST(KvtierC, ClientOptionsOfTheFirstVersionIgnoreTheTlsFields) {
  kvtier_client_options o;
  kvtier_client_options_init(&o);
  EXPECT_EQ(o.struct_size, sizeof(kvtier_client_options));
  EXPECT_EQ(o.tls_ca, nullptr);
  o.socket_path = "/nonexistent/kvtierd.sock";
  o.timeout_ms = 1000;
  o.tls_cert = "/not/read/by/an/old/caller.pem";
  o.struct_size = offsetof(kvtier_client_options, tls_ca);
  kvtier_client* c = nullptr;
  EXPECT_EQ(kvtier_client_open(&o, &c), 14);  // reached the connect: the TLS field was not read
  o.struct_size = sizeof(kvtier_client_options);
  EXPECT_EQ(kvtier_client_open(&o, &c), kInvalidArgument);  // a certificate without tls_ca
  EXPECT_NE(std::string(kvtier_last_error()).find("tls_ca"), std::string::npos);
  o.tls_cert = nullptr;
  o.tls_ca = "/nonexistent/ca.pem";
  EXPECT_EQ(kvtier_client_open(&o, &c), kInvalidArgument);  // TLS without tcp_addr
  o.tcp_addr = "127.0.0.1:1";
  EXPECT_EQ(kvtier_client_open(&o, &c), kNotFound);  // the CA file
  EXPECT_EQ(c, nullptr);
}

TEST(KvtierC, OpenWithoutDaemonIsUnavailable) {
  kvtier_client_options o;
  kvtier_client_options_init(&o);
  o.socket_path = "/nonexistent/kvtierd.sock";
  o.timeout_ms = 1000;
  kvtier_client* c = nullptr;
  EXPECT_EQ(kvtier_client_open(&o, &c), 14);
  EXPECT_NE(std::string(kvtier_last_error()).find("not reachable"), std::string::npos);
  o.token = "t";
  o.token_file = "/nonexistent";
  EXPECT_EQ(kvtier_client_open(&o, &c), kInvalidArgument);
  o.token = nullptr;
  EXPECT_EQ(kvtier_client_open(&o, &c), kNotFound);  // the token file
}

TEST(KvtierC, KeysMatchTheCliAndCheckArguments) {
  kvtier_model_identity id;
  kvtier_model_identity_init(&id);
  id.model_id = "m";
  uint8_t fp[16];
  ASSERT_EQ(kvtier_fingerprint(&id, fp), KVTIER_OK);
  std::vector<uint32_t> tokens(600);
  for (uint32_t i = 0; i < tokens.size(); ++i) tokens[i] = i;
  std::vector<uint8_t> keys(16 * 3);
  size_t n = 0;
  ASSERT_EQ(kvtier_chunk_keys(fp, tokens.data(), tokens.size(), 256, 0, keys.data(), &n), KVTIER_OK);
  ASSERT_EQ(n, 2u);
  // `kvtier keys --model-id m --tokens 0,...,599`, chunk 0.
  const uint8_t want[16] = {0x67, 0xb5, 0x99, 0x16, 0x98, 0xbb, 0x15, 0x66,
                            0xb4, 0x4b, 0x1d, 0x67, 0x72, 0x23, 0x42, 0x80};
  EXPECT_EQ(std::memcmp(keys.data(), want, 16), 0);
  EXPECT_EQ(kvtier_chunk_keys(fp, tokens.data(), tokens.size(), 0, 0, keys.data(), &n),
            kInvalidArgument);
  id.model_id = "";
  EXPECT_EQ(kvtier_fingerprint(&id, fp), kInvalidArgument);
  id.model_id = "m";
  id.tp_rank = 1;
  EXPECT_EQ(kvtier_fingerprint(&id, fp), kInvalidArgument);
}

TEST(KvtierC, CodecRejectsHostileChunks) {
  const kvtier_chunk_spec s = Spec("k16v8");
  std::vector<uint8_t> chunk = Encode(s);
  kvtier_chunk_info info{};
  info.struct_size = sizeof(info);
  ASSERT_EQ(kvtier_chunk_inspect(chunk.data(), chunk.size(), &info), KVTIER_OK);
  EXPECT_STREQ(info.codec, "k16v8");
  EXPECT_EQ(info.total_bytes, chunk.size());
  const uint64_t elements = uint64_t{2} * 32 * 2 * 64;
  std::vector<uint16_t> k(elements), v(elements);
  EXPECT_EQ(kvtier_decode_chunk(chunk.data(), chunk.size(), k.data(), v.data(), elements),
            KVTIER_OK);
  EXPECT_EQ(kvtier_decode_chunk(chunk.data(), chunk.size(), k.data(), v.data(), elements - 1),
            kInvalidArgument);
  EXPECT_EQ(kvtier_decode_chunk_layers(chunk.data(), chunk.size(), 1, 3, k.data(), v.data(),
                                       elements / 2),
            kInvalidArgument);
  EXPECT_EQ(kvtier_decode_chunk_layers(chunk.data(), chunk.size(), 1, 1, k.data(), v.data(), 0),
            kInvalidArgument);
  // Truncated, extended, empty, corrupted payload.
  EXPECT_NE(kvtier_chunk_inspect(chunk.data(), chunk.size() - 1, &info), KVTIER_OK);
  std::vector<uint8_t> longer = chunk;
  longer.push_back(0);
  EXPECT_NE(kvtier_chunk_inspect(longer.data(), longer.size(), &info), KVTIER_OK);
  EXPECT_NE(kvtier_chunk_inspect(chunk.data(), 0, &info), KVTIER_OK);
  EXPECT_EQ(kvtier_chunk_inspect(nullptr, 10, &info), kInvalidArgument);
  std::vector<uint8_t> bad = chunk;
  bad[bad.size() - 100] ^= 0x10;
  EXPECT_EQ(kvtier_decode_chunk(bad.data(), bad.size(), k.data(), v.data(), elements), kDataLoss);
  // The header alone: a payload flip passes, a length or header flip does not.
  ASSERT_EQ(kvtier_chunk_header(bad.data(), bad.size(), &info), KVTIER_OK);
  EXPECT_EQ(info.total_bytes, chunk.size());
  EXPECT_EQ(kvtier_chunk_header(chunk.data(), chunk.size() - 1, &info), kDataLoss);
  std::vector<uint8_t> bad_header = chunk;
  bad_header[24] ^= 1;  // num_layers, under the header checksum
  EXPECT_NE(kvtier_chunk_header(bad_header.data(), bad_header.size(), &info), KVTIER_OK);
  EXPECT_EQ(kvtier_chunk_header(nullptr, 10, &info), kInvalidArgument);
  info.struct_size = 4;
  EXPECT_EQ(kvtier_chunk_inspect(chunk.data(), chunk.size(), &info), kInvalidArgument);
  EXPECT_EQ(kvtier_chunk_header(chunk.data(), chunk.size(), &info), kInvalidArgument);
}

TEST(KvtierC, CodecRejectsBadSpecs) {
  kvtier_chunk_spec s = Spec("k16v99");
  uint64_t bytes = 0;
  EXPECT_EQ(kvtier_chunk_bytes(&s, &bytes), kInvalidArgument);
  s = Spec("k16v8");
  s.dtype = "fp8e4m3";
  EXPECT_EQ(kvtier_chunk_bytes(&s, &bytes), kInvalidArgument);
  s = Spec("k16v8");
  s.num_layers = 0;
  EXPECT_EQ(kvtier_chunk_bytes(&s, &bytes), kInvalidArgument);
  s = Spec("k16v8");
  s.struct_size = 0;
  EXPECT_EQ(kvtier_chunk_bytes(&s, &bytes), kInvalidArgument);
  s = Spec("k16v16");
  std::vector<uint8_t> out(10);
  std::vector<uint16_t> kv(2 * 32 * 2 * 64);
  EXPECT_EQ(kvtier_encode_chunk(&s, kv.data(), kv.data(), out.data(), out.size()),
            kInvalidArgument);
  EXPECT_EQ(kvtier_encode_chunk(&s, nullptr, kv.data(), out.data(), out.size()), kInvalidArgument);
}

}  // namespace
