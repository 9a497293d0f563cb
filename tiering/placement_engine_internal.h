// Helpers shared by the placement engine's source files (placement_engine.cc
// and placement_engine_{read,holds,prefetch}.cc, split by concern); not part
// of the engine's interface and included by nothing else, so these names
// stand in kvtier::tiering only in those files.
#ifndef KVTIER_TIERING_PLACEMENT_ENGINE_INTERNAL_H_
#define KVTIER_TIERING_PLACEMENT_ENGINE_INTERNAL_H_

#include <cstdint>
#include <optional>
#include <span>

#include "absl/status/statusor.h"
#include "codec/chunk.h"
#include "tiering/tier.h"

namespace kvtier::tiering {

// A tier's bit in ChunkState::where.
inline uint8_t Bit(TierKind k) { return static_cast<uint8_t>(1u << static_cast<int>(k)); }
// A part's index in ChunkState::where.
inline int PartIndex(Part p) { return static_cast<int>(p); }

// The fastest tier in a bitmask (lowest TierKind).
inline std::optional<TierKind> Fastest(uint8_t mask) {
  for (int k = 0; k < kNumTierKinds; ++k) {
    if (mask & (1u << k)) return static_cast<TierKind>(k);
  }
  return std::nullopt;
}

// Bounds on the eviction loop of one store: evictions, and rounds without a
// victim (other threads may be freeing space) before giving up.
inline constexpr int kMaxEvictionsPerStore = 100000;
inline constexpr int kMaxIdleRounds = 3;

// Stores that no caller waits on (demotion, promotion): not synced, and the
// tier checks the header itself (the bytes come from another tier).
inline constexpr TierPutOptions kBackground{.sync = false};

// Put-side check of a chunk (`what`: "chunk" or "slot"): a valid header whose
// total length is the chunk's. InvalidArgument otherwise.
absl::StatusOr<codec::ChunkHeader> CheckPutChunk(std::span<const uint8_t> bytes, const char* what);

}  // namespace kvtier::tiering

#endif  // KVTIER_TIERING_PLACEMENT_ENGINE_INTERNAL_H_
