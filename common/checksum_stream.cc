#include "common/checksum_stream.h"

#include "xxhash.h"
#if defined(__x86_64__)
// The same run-time dispatch as Checksum64 (common/hash.cc), same values.
#include "xxh_x86dispatch.h"
#endif

namespace kvtier {

Checksum64Stream::Checksum64Stream() : state_(XXH3_createState()) {
  XXH3_64bits_reset(static_cast<XXH3_state_t*>(state_));
}

Checksum64Stream::~Checksum64Stream() { XXH3_freeState(static_cast<XXH3_state_t*>(state_)); }

void Checksum64Stream::Update(std::span<const uint8_t> data) {
#if defined(__x86_64__)
  XXH3_64bits_update_dispatch(static_cast<XXH3_state_t*>(state_), data.data(), data.size());
#else
  XXH3_64bits_update(static_cast<XXH3_state_t*>(state_), data.data(), data.size());
#endif
}

uint64_t Checksum64Stream::Digest() const {
  return XXH3_64bits_digest(static_cast<const XXH3_state_t*>(state_));
}

}  // namespace kvtier
