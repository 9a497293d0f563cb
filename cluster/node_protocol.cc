#include "cluster/node_protocol.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/coding.h"

namespace kvtier::cluster {
void EncodeHeader(const WireHeader& h, std::span<uint8_t, kWireHeaderSize> out) {
  uint8_t* p = out.data();
  std::memset(p, 0, kWireHeaderSize);
  StoreLE<uint32_t>(p + kWireOffMagic, kWireMagic);
  StoreLE<uint16_t>(p + kWireOffVersion, h.version);
  p[kWireOffOp] = static_cast<uint8_t>(h.op);
  p[kWireOffFlags] = h.reply ? kWireFlagReply : 0;
  StoreLE<uint64_t>(p + kWireOffRequestId, h.request_id);
  std::memcpy(p + kWireOffKey, h.id.key.bytes.data(), Hash128::kSize);
  p[kWireOffPart] = static_cast<uint8_t>(h.id.part);
  StoreLE<int32_t>(p + kWireOffStatus, static_cast<int32_t>(h.status));
  StoreLE<uint64_t>(p + kWireOffLength, h.length);
}

uint64_t PeekRequestId(std::span<const uint8_t> bytes) {
  if (bytes.size() < kWireOffRequestId + 8) return 0;
  if (LoadLE<uint32_t>(bytes.data() + kWireOffMagic) != kWireMagic) return 0;
  return LoadLE<uint64_t>(bytes.data() + kWireOffRequestId);
}

absl::StatusOr<WireHeader> DecodeHeader(std::span<const uint8_t> bytes) {
  if (bytes.size() < kWireOffVersion + 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("wire header: ", bytes.size(), " bytes, too short"));
  }
  const uint8_t* p = bytes.data();
  if (LoadLE<uint32_t>(p + kWireOffMagic) != kWireMagic) {
    return absl::InvalidArgumentError("wire header: bad magic (not a kvtier peer)");
  }
  WireHeader h;
  h.version = LoadLE<uint16_t>(p + kWireOffVersion);
  if (h.version != kWireVersion) {
    return absl::FailedPreconditionError(absl::StrCat(
        "wire protocol version ", h.version, " is not supported by this peer (it speaks version ",
        kWireVersion, ")"));
  }
  if (bytes.size() != kWireHeaderSize) {
    return absl::InvalidArgumentError(absl::StrCat("wire header: ", bytes.size(),
                                                   " bytes, want ", kWireHeaderSize));
  }
  uint8_t op = p[kWireOffOp];
  if (op < static_cast<uint8_t>(Op::kPut) || op > static_cast<uint8_t>(Op::kProof)) {
    return absl::InvalidArgumentError(absl::StrCat("wire header: unknown op ", op));
  }
  h.op = static_cast<Op>(op);
  uint8_t flags = p[kWireOffFlags];
  if ((flags & ~kWireFlagReply) != 0) {
    return absl::InvalidArgumentError("wire header: unknown flags");
  }
  h.reply = (flags & kWireFlagReply) != 0;
  h.request_id = LoadLE<uint64_t>(p + kWireOffRequestId);
  std::memcpy(h.id.key.bytes.data(), p + kWireOffKey, Hash128::kSize);
  uint8_t part = p[kWireOffPart];
  if (part > static_cast<uint8_t>(tiering::Part::kV)) {
    return absl::InvalidArgumentError(absl::StrCat("wire header: unknown part ", part));
  }
  h.id.part = static_cast<tiering::Part>(part);
  int32_t code = LoadLE<int32_t>(p + kWireOffStatus);
  if (code < 0 || code > static_cast<int32_t>(absl::StatusCode::kUnauthenticated)) {
    return absl::InvalidArgumentError(absl::StrCat("wire header: unknown status code ", code));
  }
  h.status = static_cast<absl::StatusCode>(code);
  h.length = LoadLE<uint64_t>(p + kWireOffLength);
  for (size_t i = kWireOffReserved; i < kWireHeaderSize; ++i) {
    if (p[i] != 0) return absl::InvalidArgumentError("wire header: reserved bytes are not zero");
  }
  for (size_t i = kWireOffPart + 1; i < kWireOffStatus; ++i) {
    if (p[i] != 0) return absl::InvalidArgumentError("wire header: reserved bytes are not zero");
  }
  return h;
}

}  // namespace kvtier::cluster
