#include "tiering/tier.h"

#include "absl/strings/cord.h"
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
