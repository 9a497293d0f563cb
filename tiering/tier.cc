#include "tiering/tier.h"

#include "absl/strings/cord.h"
#include "codec/chunk.h"
#include "common/strings.h"

namespace kvtier::tiering {

absl::Status TierFullError(std::string_view message) {
  absl::Status st = absl::ResourceExhaustedError(AsAbsl(message));
  st.SetPayload(kTierFullPayload, absl::Cord("1"));
  return st;
}

bool IsTierFull(const absl::Status& status) {
  return absl::IsResourceExhausted(status) && status.GetPayload(kTierFullPayload).has_value();
}

absl::Status VerifyObject(const ObjectKey& id, std::span<const uint8_t> bytes) {
  if (id.part == Part::kWhole) return codec::VerifyChunk(bytes).status();
  auto h = codec::ParseHeader(bytes);
  if (!h.ok()) return h.status();
  return codec::VerifySection(*h, id.part == Part::kK ? codec::Section::kK : codec::Section::kV,
                              bytes.subspan(codec::kHeaderSize));
}

const char* TierName(TierKind kind) {
  switch (kind) {
    case TierKind::kHbm:
      return "hbm";
    case TierKind::kDram:
      return "dram";
    case TierKind::kNvme:
      return "nvme";
    case TierKind::kRemote:
      return "remote";
  }
  return "unknown";
}

}  // namespace kvtier::tiering
