#include "common/fault_injection.h"

#include <chrono>
#include <thread>

#include "absl/strings/str_cat.h"

namespace kvtier {

FaultInjector::FaultInjector(const FaultPolicy& policy) : policy_(policy), rng_(policy.seed) {}

void FaultInjector::SetPolicy(const FaultPolicy& policy) {
  absl::MutexLock l(&mu_);
  policy_ = policy;
  rng_.seed(policy.seed);
  ops_ = 0;
}

FaultPolicy FaultInjector::policy() const {
  absl::MutexLock l(&mu_);
  return policy_;
}

absl::Status FaultInjector::MaybeFail(const char* op, bool is_write) {
  bool fail = false;
  FaultPolicy p;
  {
    absl::MutexLock l(&mu_);
    p = policy_;
    ++ops_;
    if (p.fail_after_n >= 0 && ops_ > p.fail_after_n) fail = true;
    if (p.one_in > 0 && rng_() % p.one_in == 0) fail = true;
  }
  if (p.latency_us > 0) std::this_thread::sleep_for(std::chrono::microseconds(p.latency_us));
  if (!fail) return absl::OkStatus();
  injected_.fetch_add(1);
  if (p.enospc && is_write) return absl::ResourceExhaustedError(absl::StrCat("injected ENOSPC in ", op));
  if (p.retryable) return absl::UnavailableError(absl::StrCat("injected transient fault in ", op));
  return absl::InternalError(absl::StrCat("injected fault (EIO) in ", op));
}

bool FaultInjector::MaybeTear() {
  absl::MutexLock l(&mu_);
  if (policy_.torn_write_one_in == 0) return false;
  if (rng_() % policy_.torn_write_one_in != 0) return false;
  injected_.fetch_add(1);
  return true;
}

}  // namespace kvtier
