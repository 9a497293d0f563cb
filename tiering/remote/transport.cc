#include "tiering/remote/transport.h"

#include <chrono>
#include <thread>

#include "absl/strings/str_cat.h"

namespace kvtier::tiering::remote {

FaultInjectingTransport::FaultInjectingTransport(Transport* base, FaultPolicy policy)
    : base_(base) {
  set_policy(policy);
}

void FaultInjectingTransport::set_policy(const FaultPolicy& policy) {
  absl::MutexLock lock(&mu_);
  policy_ = policy;
  rng_ = policy.seed ? policy.seed : 1;
  calls_ = 0;
}

absl::Status FaultInjectingTransport::MaybeFail(const char* op) {
  int64_t latency_us;
  bool fail = false;
  bool retryable;
  {
    absl::MutexLock lock(&mu_);
    latency_us = policy_.latency_us;
    retryable = policy_.retryable;
    uint64_t n = calls_++;
    if (policy_.fail_after_n >= 0 && n >= static_cast<uint64_t>(policy_.fail_after_n)) fail = true;
    if (policy_.one_in > 0) {
      // xorshift64: a fixed, seeded sequence.
      rng_ ^= rng_ << 13;
      rng_ ^= rng_ >> 7;
      rng_ ^= rng_ << 17;
      if (rng_ % policy_.one_in == 0) fail = true;
    }
  }
  if (latency_us > 0) std::this_thread::sleep_for(std::chrono::microseconds(latency_us));
  if (!fail) return absl::OkStatus();
  injected_.fetch_add(1);
  std::string msg = absl::StrCat("injected fault in ", op);
  return retryable ? absl::UnavailableError(msg) : absl::InternalError(msg);
}

absl::Status FaultInjectingTransport::Put(const std::string& peer, const ObjectKey& id,
                                          std::span<const uint8_t> bytes, absl::Duration timeout) {
  if (auto s = MaybeFail("put"); !s.ok()) return s;
  return base_->Put(peer, id, bytes, timeout);
}

absl::StatusOr<uint64_t> FaultInjectingTransport::Size(const std::string& peer, const ObjectKey& id,
                                                       absl::Duration timeout) {
  if (auto s = MaybeFail("size"); !s.ok()) return s;
  return base_->Size(peer, id, timeout);
}

absl::Status FaultInjectingTransport::Get(const std::string& peer, const ObjectKey& id,
                                          std::span<uint8_t> out, absl::Duration timeout) {
  absl::Status s = MaybeFail("get");
  if (s.ok()) return base_->Get(peer, id, out, timeout);
  bool garble;
  {
    absl::MutexLock lock(&mu_);
    garble = policy_.drop_unflushed;
  }
  if (garble) {
    // Half the transfer arrived, the rest is whatever was in the buffer.
    (void)base_->Get(peer, id, out, timeout);
    for (size_t i = out.size() / 2; i < out.size(); ++i) out[i] ^= 0xA5;
  }
  return s;
}

absl::Status FaultInjectingTransport::Erase(const std::string& peer, const ObjectKey& id,
                                            absl::Duration timeout) {
  if (auto s = MaybeFail("erase"); !s.ok()) return s;
  return base_->Erase(peer, id, timeout);
}

absl::Status FaultInjectingTransport::Ping(const std::string& peer, absl::Duration timeout) {
  if (auto s = MaybeFail("ping"); !s.ok()) return s;
  return base_->Ping(peer, timeout);
}

}  // namespace kvtier::tiering::remote
