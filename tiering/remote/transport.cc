#include "tiering/remote/transport.h"

#include <chrono>
#include <thread>
#include <vector>

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

namespace {

class HeapSink : public PeerService::PutSink {
 public:
  HeapSink(Tier* tier, ObjectKey id, uint64_t bytes) : tier_(tier), id_(id), buf_(bytes) {}
  std::span<uint8_t> buffer() override { return buf_; }
  absl::Status Commit(bool ok) override {
    if (!ok) return absl::OkStatus();
    return tier_->Put(id_, buf_);
  }

 private:
  Tier* tier_;
  ObjectKey id_;
  std::vector<uint8_t> buf_;
};

class HeapSource : public PeerService::GetSource {
 public:
  explicit HeapSource(std::vector<uint8_t> b) : buf_(std::move(b)) {}
  std::span<const uint8_t> bytes() override { return buf_; }

 private:
  std::vector<uint8_t> buf_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<PeerService::PutSink>> TierPeerService::BeginPut(
    const ObjectKey& id, uint64_t bytes) {
  if (bytes > tier_->capacity_bytes()) {
    return absl::ResourceExhaustedError(absl::StrCat("object of ", bytes,
                                                     " bytes is larger than the tier"));
  }
  return std::unique_ptr<PutSink>(new HeapSink(tier_, id, bytes));
}

absl::StatusOr<std::unique_ptr<PeerService::GetSource>> TierPeerService::BeginGet(
    const ObjectKey& id) {
  auto size = tier_->Size(id);
  if (!size.ok()) return size.status();
  std::vector<uint8_t> buf(*size);
  if (auto s = tier_->Read(id, buf); !s.ok()) return s;
  return std::unique_ptr<GetSource>(new HeapSource(std::move(buf)));
}

}  // namespace kvtier::tiering::remote
