#include "tiering/tier.h"

#include <algorithm>
#include <chrono>

#include "absl/strings/cord.h"
#include "codec/chunk.h"
#include "common/strings.h"

namespace kvtier::tiering {

namespace {
int64_t SteadyMicros() {
  return std::chrono::duration_cast<std::chrono::microseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}
}  // namespace

BandwidthMeter::Op BandwidthMeter::Start(bool write) {
  const int64_t now = SteadyMicros();
  absl::MutexLock l(&mu_);
  Direction& d = dir_[write ? 1 : 0];
  if (d.in_flight++ == 0) d.since_us = now;
  return Op(this, write);
}

void BandwidthMeter::Finish(bool write, uint64_t bytes) {
  const int64_t now = SteadyMicros();
  absl::MutexLock l(&mu_);
  Direction& d = dir_[write ? 1 : 0];
  if (bytes == 0) {
    // A failed move: its time counts only where it overlapped moves that
    // moved bytes (they count from `since_us`, which stays).
    --d.in_flight;
    return;
  }
  // At least a microsecond per busy stretch, so that bytes never come with no time.
  d.busy_us += std::max<int64_t>(now - d.since_us, 1);
  d.since_us = now;
  d.bytes += bytes;
  --d.in_flight;
}

void BandwidthMeter::Add(bool write, uint64_t bytes, int64_t micros) {
  absl::MutexLock l(&mu_);
  Direction& d = dir_[write ? 1 : 0];
  d.bytes += bytes;
  d.busy_us += std::max<int64_t>(micros, 1);
}

Bandwidth BandwidthMeter::Get() const {
  absl::MutexLock l(&mu_);
  Bandwidth bw;
  if (dir_[0].busy_us > 0) bw.read_bytes_per_s = dir_[0].bytes * 1e6 / dir_[0].busy_us;
  if (dir_[1].busy_us > 0) bw.write_bytes_per_s = dir_[1].bytes * 1e6 / dir_[1].busy_us;
  return bw;
}

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
