// The few cryptographic primitives kvtier's network defences use
// (docs/security.md), all from OpenSSL: HMAC-SHA256, HKDF-SHA256, a
// cryptographically secure random source and a constant-time comparison.
// Functions are thread-safe.
#ifndef KVTIER_COMMON_CRYPTO_H_
#define KVTIER_COMMON_CRYPTO_H_

#include <array>
#include <cstdint>
#include <initializer_list>
#include <span>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace kvtier {

inline constexpr size_t kSha256Bytes = 32;
using Mac256 = std::array<uint8_t, kSha256Bytes>;

// SHA-256 of `data`. Aborts if libcrypto cannot compute it (no SHA-256 or
// out of memory): callers derive key namespaces from it, and no result is
// safe to fall back to.
Mac256 Sha256(std::span<const uint8_t> data);

// HMAC-SHA256 over the concatenation of `parts` keyed by `key`. A part is
// length-prefixed (u32 little endian) before it is hashed, so ("ab", "c")
// and ("a", "bc") give different MACs.
Mac256 HmacSha256(std::span<const uint8_t> key, std::initializer_list<std::string_view> parts);

// HKDF-SHA256 (RFC 5869): `out.size()` bytes (at most 255 x 32) derived from
// `secret` with `salt` and `info`. InvalidArgument for an empty secret or
// too long an output; Internal if OpenSSL fails.
absl::Status HkdfSha256(std::span<const uint8_t> secret, std::string_view salt,
                        std::string_view info, std::span<uint8_t> out);

// Fills `out` from OpenSSL's CSPRNG. Internal if it cannot (no entropy).
absl::Status SecureRandom(std::span<uint8_t> out);

// Constant-time equality of two byte strings (CRYPTO_memcmp): the time
// depends on the length of `expected` only, never on where the two differ or
// on `given`'s length.
bool ConstantTimeEquals(std::string_view given, std::string_view expected);

// Lowercase hex of `bytes`.
std::string HexOf(std::span<const uint8_t> bytes);

// Views of byte arrays as the string_views HmacSha256 takes.
inline std::string_view AsChars(std::span<const uint8_t> b) {
  return {reinterpret_cast<const char*>(b.data()), b.size()};
}
inline std::span<const uint8_t> AsBytes(std::string_view s) {
  return {reinterpret_cast<const uint8_t*>(s.data()), s.size()};
}

}  // namespace kvtier

#endif  // KVTIER_COMMON_CRYPTO_H_
