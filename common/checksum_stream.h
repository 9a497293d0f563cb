// Checksum64 (common/hash.h) of data that arrives in pieces, e.g. a chunk
// section hashed layer range by layer range as a GPU kernel writes it.
#ifndef KVTIER_COMMON_CHECKSUM_STREAM_H_
#define KVTIER_COMMON_CHECKSUM_STREAM_H_

#include <cstdint>
#include <span>

namespace kvtier {

// Digest() after Update(a), Update(b) equals Checksum64 of a followed by b.
// Not thread-safe.
class Checksum64Stream {
 public:
  Checksum64Stream();
  ~Checksum64Stream();
  Checksum64Stream(const Checksum64Stream&) = delete;
  Checksum64Stream& operator=(const Checksum64Stream&) = delete;
  void Update(std::span<const uint8_t> data);
  uint64_t Digest() const;

 private:
  void* state_;  // XXH3_state_t (xxhash.h stays out of this header)
};

}  // namespace kvtier

#endif  // KVTIER_COMMON_CHECKSUM_STREAM_H_
