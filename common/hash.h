// 128-bit identifiers (chunk keys, model fingerprints) and their canonical
// byte and hex forms.
#ifndef KVTIER_COMMON_HASH_H_
#define KVTIER_COMMON_HASH_H_

#include <array>
#include <compare>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <span>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"

namespace kvtier {

// A 128-bit hash in canonical form: the 16 bytes of XXH128's canonical
// (big-endian) representation. Hex text is those bytes in order, lowercase,
// 32 characters. Plain value type; thread-compatible.
struct Hash128 {
  std::array<uint8_t, 16> bytes{};

  static constexpr size_t kSize = 16;

  // XXH3-128 of `data` with `seed`, in canonical form.
  static Hash128 Of(std::span<const uint8_t> data, uint64_t seed);
  static Hash128 Of(std::string_view data, uint64_t seed);
  // XXH3-128 of the concatenation of `parts`, without concatenating them.
  static Hash128 OfParts(std::initializer_list<std::span<const uint8_t>> parts, uint64_t seed);

  // Parses exactly 32 hex digits (either case). InvalidArgument otherwise.
  static absl::StatusOr<Hash128> FromHex(std::string_view hex);

  std::string ToHex() const;
  bool IsZero() const;

  // The high and low 64-bit halves (XXH128_hash_t's high64/low64).
  uint64_t high64() const;
  uint64_t low64() const;

  friend auto operator<=>(const Hash128&, const Hash128&) = default;
  friend bool operator==(const Hash128&, const Hash128&) = default;

  template <typename H>
  friend H AbslHashValue(H h, const Hash128& k) {
    return H::combine(std::move(h), k.low64(), k.high64());
  }
};

// XXH3-64 of `data` with seed 0: the checksum of the chunk format.
uint64_t Checksum64(std::span<const uint8_t> data);
// XXH3-64 of `data` with `seed`: the layer-record checksum of chunk format v2.
uint64_t Checksum64(std::span<const uint8_t> data, uint64_t seed);

}  // namespace kvtier

template <>
struct std::hash<kvtier::Hash128> {
  size_t operator()(const kvtier::Hash128& k) const noexcept {
    return static_cast<size_t>(k.low64() ^ (k.high64() * 0x9E3779B97F4A7C15ull));
  }
};

#endif  // KVTIER_COMMON_HASH_H_
