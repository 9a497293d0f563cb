// Little-endian fixed-width loads and stores: the one encoding of integers in
// every kvtier format (the chunk header, the NVMe index values, the remote
// wire header, the shared-memory data-plane frames). Unaligned addresses are
// fine. kvtier builds for little-endian hosts only (x86-64, aarch64), where
// these are plain copies.
#ifndef KVTIER_COMMON_CODING_H_
#define KVTIER_COMMON_CODING_H_

#include <bit>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace kvtier {

static_assert(std::endian::native == std::endian::little, "kvtier assumes a little-endian host");

// The `T` stored little-endian at `p`. REQUIRES: p[0, sizeof(T)) is readable.
template <typename T>
inline T LoadLE(const uint8_t* p) {
  static_assert(std::is_trivially_copyable_v<T>, "LoadLE reads plain integers and floats");
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

// Stores `v` little-endian at `p`. REQUIRES: p[0, sizeof(T)) is writable.
template <typename T>
inline void StoreLE(uint8_t* p, T v) {
  static_assert(std::is_trivially_copyable_v<T>, "StoreLE writes plain integers and floats");
  std::memcpy(p, &v, sizeof(T));
}

}  // namespace kvtier

#endif  // KVTIER_COMMON_CODING_H_
