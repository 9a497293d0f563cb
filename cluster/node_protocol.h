// The node protocol: how kvtier nodes of one cluster talk to each other
// (cluster/NODE_PROTOCOL.md is the spec). Every message is one UCX active
// message whose header is a fixed 64-byte WireHeader and whose payload is the
// object bytes (put requests, get replies), a handshake message
// (cluster/peer_auth.h) or a UTF-8 error message (failed replies).
#ifndef KVTIER_CLUSTER_NODE_PROTOCOL_H_
#define KVTIER_CLUSTER_NODE_PROTOCOL_H_

#include <cstdint>
#include <span>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "tiering/tier.h"

namespace kvtier::cluster {

inline constexpr uint32_t kWireMagic = 0x5254564B;  // bytes 'K' 'V' 'T' 'R'
// Version 1. A peer refuses requests of any other version with a reply that
// says so (FailedPrecondition), written in this same layout: magic and
// version sit first in every version, so any peer can read them.
inline constexpr uint16_t kWireVersion = 1;
inline constexpr size_t kWireHeaderSize = 64;
// Error messages in replies are cut to this length.
inline constexpr size_t kMaxErrorMessage = 1024;

enum class Op : uint8_t {
  kPut = 1,    // payload: the object; reply: status
  kGet = 2,    // reply: the object (length in `length`)
  kSize = 3,   // reply: `length` = object size
  kErase = 4,  // reply: status
  kPing = 5,   // reply: status OK
  kHello = 6,  // payload: AuthHello (peer_auth.h); reply: AuthChallenge
  kProof = 7,  // payload: AuthProof; reply: status (Unauthenticated closes)
};

// Header field offsets, 64 bytes in all.
inline constexpr size_t kWireOffMagic = 0;       // u32
inline constexpr size_t kWireOffVersion = 4;     // u16
inline constexpr size_t kWireOffOp = 6;          // u8
inline constexpr size_t kWireOffFlags = 7;       // u8: bit 0 = reply
inline constexpr size_t kWireOffRequestId = 8;   // u64, echoed in the reply
inline constexpr size_t kWireOffKey = 16;        // 16 bytes, canonical Hash128
inline constexpr size_t kWireOffPart = 32;       // u8 (tiering::Part)
inline constexpr size_t kWireOffStatus = 36;     // i32 absl::StatusCode (replies)
inline constexpr size_t kWireOffLength = 40;     // u64 payload or object length
inline constexpr size_t kWireOffReserved = 48;   // 16 bytes = 0
inline constexpr uint8_t kWireFlagReply = 1;

struct WireHeader {
  uint16_t version = kWireVersion;
  Op op = Op::kPing;
  bool reply = false;
  uint64_t request_id = 0;
  tiering::ObjectKey id;
  absl::StatusCode status = absl::StatusCode::kOk;
  uint64_t length = 0;
};

void EncodeHeader(const WireHeader& h, std::span<uint8_t, kWireHeaderSize> out);

// Parses a header. InvalidArgument for a short buffer, bad magic, unknown op
// or part, or non-zero reserved bytes; FailedPrecondition (naming both
// versions) for another protocol version.
absl::StatusOr<WireHeader> DecodeHeader(std::span<const uint8_t> bytes);

// Request id of a header whose magic is right, whatever its version (0 if
// the buffer is too short or the magic wrong).
uint64_t PeekRequestId(std::span<const uint8_t> bytes);

}  // namespace kvtier::cluster

#endif  // KVTIER_CLUSTER_NODE_PROTOCOL_H_
