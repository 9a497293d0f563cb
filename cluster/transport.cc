#include "cluster/transport.h"

namespace kvtier::cluster {

FaultInjectingTransport::FaultInjectingTransport(Transport* base, FaultPolicy policy)
    : base_(base), faults_(policy) {}

absl::Status FaultInjectingTransport::Put(const std::string& peer, const tiering::ObjectKey& id,
                                          std::span<const uint8_t> bytes, absl::Duration timeout) {
  if (auto s = faults_.MaybeFail("put", /*is_write=*/true); !s.ok()) return s;
  return base_->Put(peer, id, bytes, timeout);
}

absl::StatusOr<uint64_t> FaultInjectingTransport::Size(const std::string& peer, const tiering::ObjectKey& id,
                                                       absl::Duration timeout) {
  if (auto s = faults_.MaybeFail("size", /*is_write=*/false); !s.ok()) return s;
  return base_->Size(peer, id, timeout);
}

absl::Status FaultInjectingTransport::Get(const std::string& peer, const tiering::ObjectKey& id,
                                          std::span<uint8_t> out, absl::Duration timeout) {
  absl::Status s = faults_.MaybeFail("get", /*is_write=*/false);
  if (s.ok()) return base_->Get(peer, id, out, timeout);
  if (faults_.policy().drop_unflushed) {
    // Half the transfer arrived, the rest is whatever was in the buffer.
    (void)base_->Get(peer, id, out, timeout);
    for (size_t i = out.size() / 2; i < out.size(); ++i) out[i] ^= 0xA5;
  }
  return s;
}

absl::Status FaultInjectingTransport::Erase(const std::string& peer, const tiering::ObjectKey& id,
                                            absl::Duration timeout) {
  if (auto s = faults_.MaybeFail("erase", /*is_write=*/false); !s.ok()) return s;
  return base_->Erase(peer, id, timeout);
}

absl::Status FaultInjectingTransport::Ping(const std::string& peer, absl::Duration timeout) {
  if (auto s = faults_.MaybeFail("ping", /*is_write=*/false); !s.ok()) return s;
  return base_->Ping(peer, timeout);
}

}  // namespace kvtier::cluster
