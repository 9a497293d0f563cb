#include "codec/prefix_key.h"

#include <bit>

#include "absl/strings/str_cat.h"
#include "common/strings.h"

namespace kvtier::codec {

std::string CanonicalIdentity(const ModelIdentity& id) {
  return absl::StrCat("kvtier-fingerprint-v1\n", "model_id=", id.model_id, "\n",
                      "revision=", id.revision, "\n", "dtype=", id.dtype, "\n",
                      "kv_layout=", id.kv_layout, "\n", "codec=", id.codec, "\n",
                      "tp_world_size=", id.tp_world_size, "\n", "tp_rank=", id.tp_rank, "\n");
}

absl::StatusOr<Hash128> ModelFingerprint(const ModelIdentity& id) {
  if (id.model_id.empty()) return absl::InvalidArgumentError("model_id must not be empty");
  for (auto [name, value] : {std::pair<const char*, const std::string*>{"model_id", &id.model_id},
                             {"revision", &id.revision},
                             {"dtype", &id.dtype},
                             {"kv_layout", &id.kv_layout},
                             {"codec", &id.codec}}) {
    if (value->find('\n') != std::string::npos) {
      return absl::InvalidArgumentError(absl::StrCat(name, " must not contain a newline"));
    }
  }
  if (id.tp_world_size == 0 || id.tp_rank >= id.tp_world_size) {
    return absl::InvalidArgumentError(absl::StrCat("tp_rank ", id.tp_rank,
                                                   " must be below tp_world_size ",
                                                   id.tp_world_size));
  }
  return Hash128::Of(CanonicalIdentity(id), kFingerprintSeed);
}

Hash128 NextKey(const Hash128& parent, std::span<const uint32_t> chunk_tokens) {
  static_assert(std::endian::native == std::endian::little,
                "token ids are hashed as little-endian u32");
  std::span<const uint8_t> tokens(reinterpret_cast<const uint8_t*>(chunk_tokens.data()),
                                  chunk_tokens.size_bytes());
  return Hash128::OfParts({parent.bytes, tokens}, kPrefixSeed);
}

absl::StatusOr<std::vector<Hash128>> ChunkKeys(const Hash128& fingerprint,
                                               std::span<const uint32_t> tokens,
                                               uint32_t chunk_tokens, bool include_partial) {
  if (chunk_tokens == 0) return absl::InvalidArgumentError("chunk_tokens must be positive");
  std::vector<Hash128> keys;
  keys.reserve(tokens.size() / chunk_tokens + 1);
  Hash128 parent = fingerprint;
  size_t pos = 0;
  while (pos + chunk_tokens <= tokens.size()) {
    parent = NextKey(parent, tokens.subspan(pos, chunk_tokens));
    keys.push_back(parent);
    pos += chunk_tokens;
  }
  if (include_partial && pos < tokens.size()) keys.push_back(NextKey(parent, tokens.subspan(pos)));
  return keys;
}

}  // namespace kvtier::codec
