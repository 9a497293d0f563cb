#include "client/data_path.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "wire/chunk_check.h"
#include "wire/kvtier.pb.h"

namespace kvtier::client {

namespace pb = kvtier::proto::v1;

Tier TierFromWire(int t) {
  switch (t) {
    case pb::TIER_HBM: return Tier::kHbm;
    case pb::TIER_DRAM: return Tier::kDram;
    case pb::TIER_NVME: return Tier::kNvme;
    case pb::TIER_REMOTE: return Tier::kRemote;
  }
  return Tier::kUnknown;
}

absl::Status BufferTooSmall(size_t have, size_t need) {
  return absl::InvalidArgumentError(absl::StrCat("buffer of ", have, " bytes; the chunk is ", need));
}

absl::StatusOr<std::pair<uint64_t, Tier>> DataPath::GetThroughPool(
    const Hash128& key, ChunkSink sink, wire::PipelinedCopyVerifier* verifier) {
  bool verify = false;
  for (int attempt = 0;; ++attempt) {
    KVTIER_ASSIGN_OR_RETURN(HeldChunk held, Hold(key, verify));
    std::span<uint8_t> dst;
    absl::Status st;
    if (sink.out != nullptr) {
      if (sink.out->size() < held.data.size()) {
        st = BufferTooSmall(sink.out->size(), held.data.size());
      }
      dst = *sink.out;
    } else {
      sink.vec->resize(held.data.size());
      dst = std::span<uint8_t>(*sink.vec);
    }
    absl::Status check;
    if (st.ok() && held.checked) {  // the daemon checked them as this hold read them
      std::memcpy(dst.data(), held.data.data(), held.data.size());
    } else if (st.ok()) {
      check = (verifier ? verifier->CopyVerified(dst, held.data) : wire::CopyVerified(dst, held.data))
                  .status();
    }
    absl::Status u = ReleaseCopied(held);
    if (!st.ok()) return st;
    if (check.ok()) {
      if (!u.ok()) return u;
      return std::make_pair(static_cast<uint64_t>(held.data.size()), held.tier);
    }
    if (attempt == 1) {
      return absl::DataLossError(absl::StrCat("chunk ", key.ToHex(), " changed while read: ",
                                              check.message()));
    }
    verify = true;
  }
}

}  // namespace kvtier::client
