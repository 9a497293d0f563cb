#include "common/crypto.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/core_names.h>
#include <openssl/params.h>
#include <openssl/kdf.h>
#include <openssl/rand.h>

#include <cstdlib>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/coding.h"

namespace kvtier {

Mac256 HmacSha256(std::span<const uint8_t> key, std::initializer_list<std::string_view> parts) {
  // The HMAC implementation is fetched once; a context per call.
  static EVP_MAC* const kHmac = EVP_MAC_fetch(nullptr, "HMAC", nullptr);
  Mac256 mac{};
  std::unique_ptr<EVP_MAC_CTX, decltype(&EVP_MAC_CTX_free)> ctx(EVP_MAC_CTX_new(kHmac), &EVP_MAC_CTX_free);
  char digest[] = "SHA256";
  const OSSL_PARAM params[] = {OSSL_PARAM_construct_utf8_string(OSSL_MAC_PARAM_DIGEST, digest, 0),
                               OSSL_PARAM_construct_end()};
  static const uint8_t kNoKey = 0;
  const uint8_t* k = key.empty() ? &kNoKey : key.data();
  bool ok = ctx != nullptr && EVP_MAC_init(ctx.get(), k, key.size(), params) == 1;
  for (std::string_view p : parts) {
    uint8_t len[4];
    StoreLE<uint32_t>(len, static_cast<uint32_t>(p.size()));
    ok = ok && EVP_MAC_update(ctx.get(), len, sizeof(len)) == 1 &&
         EVP_MAC_update(ctx.get(), reinterpret_cast<const uint8_t*>(p.data()), p.size()) == 1;
  }
  size_t n = 0;
  ok = ok && EVP_MAC_final(ctx.get(), mac.data(), &n, mac.size()) == 1 && n == mac.size();
  // OpenSSL fails here only without memory or without its default provider;
  // a MAC that silently stayed zero would compare equal across peers.
  if (!ok) std::abort();
  return mac;
}

absl::Status HkdfSha256(std::span<const uint8_t> secret, std::string_view salt,
                        std::string_view info, std::span<uint8_t> out) {
  if (secret.empty()) return absl::InvalidArgumentError("HKDF: empty secret");
  if (out.size() == 0 || out.size() > 255 * kSha256Bytes) {
    return absl::InvalidArgumentError(absl::StrCat("HKDF: cannot derive ", out.size(), " bytes"));
  }
  std::unique_ptr<EVP_PKEY_CTX, decltype(&EVP_PKEY_CTX_free)> ctx(
      EVP_PKEY_CTX_new_id(EVP_PKEY_HKDF, nullptr), &EVP_PKEY_CTX_free);
  size_t len = out.size();
  if (ctx == nullptr || EVP_PKEY_derive_init(ctx.get()) <= 0 ||
      EVP_PKEY_CTX_set_hkdf_md(ctx.get(), EVP_sha256()) <= 0 ||
      EVP_PKEY_CTX_set1_hkdf_salt(ctx.get(), reinterpret_cast<const uint8_t*>(salt.data()),
                                  static_cast<int>(salt.size())) <= 0 ||
      EVP_PKEY_CTX_set1_hkdf_key(ctx.get(), secret.data(), static_cast<int>(secret.size())) <= 0 ||
      EVP_PKEY_CTX_add1_hkdf_info(ctx.get(), reinterpret_cast<const uint8_t*>(info.data()),
                                  static_cast<int>(info.size())) <= 0 ||
      EVP_PKEY_derive(ctx.get(), out.data(), &len) <= 0 || len != out.size()) {
    return absl::InternalError("HKDF-SHA256 failed in OpenSSL");
  }
  return absl::OkStatus();
}

absl::Status SecureRandom(std::span<uint8_t> out) {
  if (out.empty()) return absl::OkStatus();
  if (RAND_bytes(out.data(), static_cast<int>(out.size())) != 1) {
    return absl::InternalError("OpenSSL RAND_bytes failed (no entropy?)");
  }
  return absl::OkStatus();
}

bool ConstantTimeEquals(std::string_view given, std::string_view expected) {
  // Compares `expected` against a buffer of its own length, so neither the
  // loop nor CRYPTO_memcmp ever depends on `given`'s length or content.
  std::vector<uint8_t> g(expected.size(), 0);
  const size_t n = std::min(given.size(), expected.size());
  for (size_t i = 0; i < n; ++i) g[i] = static_cast<uint8_t>(given[i]);
  const int diff = expected.empty() ? 0 : CRYPTO_memcmp(g.data(), expected.data(), expected.size());
  return (diff == 0) & (given.size() == expected.size());
}

std::string HexOf(std::span<const uint8_t> bytes) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string s;
  s.reserve(2 * bytes.size());
  for (uint8_t b : bytes) {
    s.push_back(kHex[b >> 4]);
    s.push_back(kHex[b & 0xF]);
  }
  return s;
}

Mac256 Sha256(std::span<const uint8_t> data) {
  // The digest fetched once and a context per thread: OpenSSL's one-shot
  // SHA256() looks the algorithm up on every call, which costs three times
  // the hash of a key.
  static EVP_MD* const md = EVP_MD_fetch(nullptr, "SHA256", nullptr);
  struct CtxFree {
    void operator()(EVP_MD_CTX* c) const { EVP_MD_CTX_free(c); }
  };
  thread_local std::unique_ptr<EVP_MD_CTX, CtxFree> ctx(EVP_MD_CTX_new());
  Mac256 out;
  unsigned int n = 0;
  if (md == nullptr || ctx == nullptr || EVP_DigestInit_ex2(ctx.get(), md, nullptr) != 1 ||
      EVP_DigestUpdate(ctx.get(), data.data(), data.size()) != 1 ||
      EVP_DigestFinal_ex(ctx.get(), out.data(), &n) != 1 || n != out.size()) {
    // libcrypto without SHA-256 (or out of memory): no namespace can be
    // computed, and serving keys unsalted would break isolation.
    std::abort();
  }
  return out;
}

}  // namespace kvtier
