// Chunk keys (DESIGN.md "Keys", FORMAT.md "Prefix keys"): a chain of XXH3-128
// hashes over token ids, rooted in a model fingerprint. The same tokens give
// the same keys in every process and on every machine.
#ifndef KVTIER_CODEC_PREFIX_KEY_H_
#define KVTIER_CODEC_PREFIX_KEY_H_

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/hash.h"

namespace kvtier::codec {

// Seeds of the two hashes; part of the format, never change them.
inline constexpr uint64_t kFingerprintSeed = 0x6b7674696572'4650ull;  // "kvtierFP"
inline constexpr uint64_t kPrefixSeed = 0x6b7674696572'4b59ull;       // "kvtierKY"
inline constexpr uint32_t kDefaultChunkTokens = 256;

// What identifies the KV a model shard produces. Two engines share cached
// chunks only if every field matches.
struct ModelIdentity {
  std::string model_id;         // e.g. "meta-llama/Llama-3.1-8B-Instruct"
  std::string revision;         // e.g. a git sha; "" if unknown
  std::string dtype;            // "bf16" | "fp16"
  std::string kv_layout;        // e.g. "vllm-flash-nhd"
  std::string codec;            // codec name, e.g. "k16v8"
  uint32_t tp_world_size = 1;
  uint32_t tp_rank = 0;
};

// The canonical text that is hashed into the fingerprint (FORMAT.md).
std::string CanonicalIdentity(const ModelIdentity& id);

// XXH3-128(kFingerprintSeed, CanonicalIdentity(id)). InvalidArgument when a
// string field holds a newline (it would make the text ambiguous),
// model_id is empty or tp_rank >= tp_world_size.
absl::StatusOr<Hash128> ModelFingerprint(const ModelIdentity& id);

// key[i] = XXH3-128(kPrefixSeed, key[i-1] bytes || token ids of chunk i as
// u32 little-endian), key[-1] = fingerprint. Returns one key per full chunk of
// `chunk_tokens` tokens; with `include_partial`, also one for a trailing
// partial chunk. InvalidArgument if chunk_tokens is 0.
absl::StatusOr<std::vector<Hash128>> ChunkKeys(const Hash128& fingerprint,
                                               std::span<const uint32_t> tokens,
                                               uint32_t chunk_tokens = kDefaultChunkTokens,
                                               bool include_partial = false);

// One step of the chain: the key of a chunk given its parent's key.
Hash128 NextKey(const Hash128& parent, std::span<const uint32_t> chunk_tokens);

}  // namespace kvtier::codec

#endif  // KVTIER_CODEC_PREFIX_KEY_H_
