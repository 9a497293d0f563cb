#include "common/hash.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/strings.h"
#define XXH_STATIC_LINKING_ONLY  // XXH3_state_t on the stack
#include "xxhash.h"
#if defined(__x86_64__)
// libxxhash's run-time dispatch picks the AVX2/AVX-512 kernel where the CPU
// has it (the portable build is ~4x slower on the chunk checksums); the
// values are the same.
#include "xxh_x86dispatch.h"
#endif

namespace kvtier {
namespace {

int HexValue(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

uint64_t LoadBigEndian64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v = (v << 8) | p[i];
  return v;
}

}  // namespace

namespace {

Hash128 Canonical(XXH128_hash_t h) {
  XXH128_canonical_t canonical;
  XXH128_canonicalFromHash(&canonical, h);
  Hash128 out;
  static_assert(sizeof(canonical.digest) == Hash128::kSize, "XXH128 canonical form is 16 bytes");
  std::memcpy(out.bytes.data(), canonical.digest, Hash128::kSize);
  return out;
}

}  // namespace

Hash128 Hash128::Of(std::span<const uint8_t> data, uint64_t seed) {
  return Canonical(XXH3_128bits_withSeed(data.data(), data.size(), seed));
}

Hash128 Hash128::OfParts(std::initializer_list<std::span<const uint8_t>> parts, uint64_t seed) {
  // A state on the stack must be initialized before a seeded reset: the
  // reset skips deriving the secret from the seed when the state's stale
  // seed field already equals `seed`, and would then hash with whatever
  // bytes the stack held (xxhash.h, XXH3_INITSTATE).
  XXH3_state_t state;
  XXH3_INITSTATE(&state);
  XXH3_128bits_reset_withSeed(&state, seed);
  for (std::span<const uint8_t> p : parts) XXH3_128bits_update(&state, p.data(), p.size());
  return Canonical(XXH3_128bits_digest(&state));
}

Hash128 Hash128::Of(std::string_view data, uint64_t seed) {
  return Of(std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(data.data()), data.size()),
            seed);
}

absl::StatusOr<Hash128> Hash128::FromHex(std::string_view hex) {
  if (hex.size() != 2 * kSize) {
    return absl::InvalidArgumentError(
        absl::StrCat("key must be 32 hex digits, got ", hex.size(), " characters"));
  }
  Hash128 out;
  for (size_t i = 0; i < kSize; ++i) {
    int hi = HexValue(hex[2 * i]);
    int lo = HexValue(hex[2 * i + 1]);
    if (hi < 0 || lo < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("key has a non-hex character at position ", hi < 0 ? 2 * i : 2 * i + 1));
    }
    out.bytes[i] = static_cast<uint8_t>(hi << 4 | lo);
  }
  return out;
}

std::string Hash128::ToHex() const {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string s(2 * kSize, '0');
  for (size_t i = 0; i < kSize; ++i) {
    s[2 * i] = kDigits[bytes[i] >> 4];
    s[2 * i + 1] = kDigits[bytes[i] & 0xF];
  }
  return s;
}

bool Hash128::IsZero() const {
  for (uint8_t b : bytes) {
    if (b != 0) return false;
  }
  return true;
}

uint64_t Hash128::high64() const { return LoadBigEndian64(bytes.data()); }
uint64_t Hash128::low64() const { return LoadBigEndian64(bytes.data() + 8); }

uint64_t Checksum64(std::span<const uint8_t> data) {
#if defined(__x86_64__)
  return XXH3_64bits_dispatch(data.data(), data.size());
#else
  return XXH3_64bits(data.data(), data.size());
#endif
}

uint64_t Checksum64(std::span<const uint8_t> data, uint64_t seed) {
#if defined(__x86_64__)
  return XXH3_64bits_withSeed_dispatch(data.data(), data.size(), seed);
#else
  return XXH3_64bits_withSeed(data.data(), data.size(), seed);
#endif
}

}  // namespace kvtier
