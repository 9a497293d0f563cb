// Eviction policies, one instance per tier, keyed by ObjectKey with byte
// sizes. The placement engine owns them and calls them under its mutex, so
// they are not thread-safe themselves.
//
//   LruPolicy     the baseline: evicts the least recently used object.
//   S3FifoPolicy  S3-FIFO (Yang et al., SOSP'23): a small probationary FIFO
//                 (10% of capacity), a main FIFO with 2-bit frequencies and
//                 a ghost FIFO of recently evicted keys. One-hit wonders
//                 (scans) leave through the small queue without disturbing
//                 the main one.
#ifndef KVTIER_TIERING_EVICTION_H_
#define KVTIER_TIERING_EVICTION_H_

#include <cstdint>
#include <functional>
#include <list>
#include <memory>
#include <optional>

#include "absl/container/flat_hash_map.h"
#include "tiering/tier.h"

namespace kvtier::tiering {

enum class EvictionPolicyKind : uint8_t { kLru = 0, kS3Fifo = 1 };
const char* EvictionPolicyName(EvictionPolicyKind k);  // "lru", "s3fifo"

class EvictionPolicy {
 public:
  virtual ~EvictionPolicy() = default;
  // An object of `bytes` bytes now lives in the tier. Re-inserting a tracked
  // object counts as an access.
  virtual void OnInsert(const ObjectKey& id, uint64_t bytes) = 0;
  // A hit on a tracked object (ignored if untracked).
  virtual void OnAccess(const ObjectKey& id) = 0;
  // The object left the tier (deleted, evicted or moved).
  virtual void OnErase(const ObjectKey& id) = 0;
  // The next object to evict among those for which `evictable` is true, or
  // nullopt if none is. Does not remove it: the caller calls OnErase once it
  // is gone. Bounded: visits each tracked object at most a few times.
  virtual std::optional<ObjectKey> PickVictim(
      const std::function<bool(const ObjectKey&)>& evictable) = 0;
  virtual size_t size() const = 0;
};

// `capacity_bytes`: the tier's capacity (S3-FIFO sizes its queues from it).
std::unique_ptr<EvictionPolicy> NewEvictionPolicy(EvictionPolicyKind kind,
                                                  uint64_t capacity_bytes);

}  // namespace kvtier::tiering

#endif  // KVTIER_TIERING_EVICTION_H_
