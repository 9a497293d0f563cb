// Chunks between the daemon and an engine's host KV pool (SGLang's HiCache
// host pool): one page is one chunk, encoded from or decoded into the pool's
// rows in place (codec::KvRows), many pages at once on threads of the call.
// A page's whole path (the slot or hold, the codec, the checks, the commit
// or unhold) runs on one thread, so a binding that calls this once per
// batch gives up its interpreter lock once per batch, not once per step.
//
// Thread-safe, as KvtierClient.
#ifndef KVTIER_CLIENT_HOST_PAGES_H_
#define KVTIER_CLIENT_HOST_PAGES_H_

#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "client/kvtier_client.h"
#include "codec/codec.h"
#include "common/hash.h"

namespace kvtier::client {

struct HostPagesResult {
  std::vector<absl::Status> status;  // one per page, in order
  uint64_t bytes = 0;                // encoded bytes of the pages that succeeded
};

// Encodes pages[i] as a chunk of `spec` and stores it under keys[i], for
// every i, on up to `threads` threads (at least one, at most 64). Through
// shared memory each chunk is encoded straight into a slot of the daemon's
// pool, which seals it as it commits (PutOptions::daemon_seals: the one
// hashing pass is the daemon's); otherwise it is encoded into a buffer and
// put. A page's
// status is InvalidArgument for rows that do not fit the spec
// (codec::ValidateRows), else the put's.
// REQUIRES: keys.size() == pages.size().
HostPagesResult PutHostPages(KvtierClient& client, const codec::ChunkSpec& spec,
                             std::span<const Hash128> keys,
                             std::span<const codec::KvRows<const uint16_t>> pages, size_t threads);

// Reads the chunk of keys[i] into pages[i], for every i, on up to `threads`
// threads, checking each layer record just before it decodes it (unless the
// daemon checked the bytes as it read them). A page's status: NotFound on a
// miss; InvalidArgument for a chunk whose fingerprint, dtype or geometry
// (the block size aside) is not `expect`'s, or for rows that do not fit it;
// DataLoss for corrupt bytes (the daemon then checks the stored chunk and
// drops it), after which that page's rows may hold part of the chunk.
// REQUIRES: keys.size() == pages.size().
HostPagesResult GetHostPages(KvtierClient& client, const codec::ChunkSpec& expect,
                             std::span<const Hash128> keys,
                             std::span<const codec::KvRows<uint16_t>> pages, size_t threads);

}  // namespace kvtier::client

#endif  // KVTIER_CLIENT_HOST_PAGES_H_
