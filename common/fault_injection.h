// Fault injection shared by the forwarding test wrappers of kvtier's I/O
// interfaces (tiering::FaultInjectionIoEnv over an IoEnv,
// cluster::FaultInjectingTransport over a Transport): one policy and
// one seeded decision object, so that every wrapper counts operations, draws
// failures and chooses error codes the same way.
#ifndef KVTIER_COMMON_FAULT_INJECTION_H_
#define KVTIER_COMMON_FAULT_INJECTION_H_

#include <atomic>
#include <cstdint>
#include <random>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"

namespace kvtier {

// Faults to inject. Every field defaults to "no fault"; the seed is fixed.
struct FaultPolicy {
  // Every operation after the first `fail_after_n` fails. Default: -1 (never)
  int64_t fail_after_n = -1;
  // Each operation fails with probability 1/one_in, drawn from the seeded
  // generator. Default: 0 (never)
  uint32_t one_in = 0;
  // Delay added to each operation before it is decided and forwarded, in
  // microseconds. Default: 0
  int64_t latency_us = 0;
  // Data in flight is lost or garbled around a failure. IoEnv: unsynced
  // writes are lost when DropUnsyncedWrites() is called (the wrapper
  // remembers the prior bytes of each unsynced write). Transport: a failed
  // Get first delivers a half-garbled object into the caller's buffer, as a
  // transfer cut off mid-way would. Default: false
  bool drop_unflushed = false;
  // Injected failures are Unavailable (retryable) instead of Internal
  // (EIO-like). Default: false
  bool retryable = false;
  // Injected failures of writes (IoEnv writes and opens, Transport puts) are
  // ResourceExhausted (ENOSPC, tier full). Default: false
  bool enospc = false;
  // IoEnv only: each write is torn with probability 1/torn_write_one_in:
  // only its first half reaches the device, yet the write reports success (a
  // lying device or a power cut). Default: 0 (never)
  uint32_t torn_write_one_in = 0;
  // IoEnv only: an injected failure of a Submit of several requests happens
  // after the requests in its first half (the first size/2) completed, and
  // were reported by SubmitWithCompletions, as a device error in the middle
  // of a transfer would; false: before any of its requests runs.
  // Default: false
  bool fail_mid_submit = false;
  // Seed of the generator behind one_in and torn_write_one_in. Default: 301
  uint64_t seed = 301;
};

// Decides, operation by operation, which faults to inject under a policy.
// The wrappers call MaybeFail once per forwarded operation. Thread-safe; the
// policy may be replaced while operations run.
class FaultInjector {
 public:
  explicit FaultInjector(const FaultPolicy& policy = {});
  FaultInjector(const FaultInjector&) = delete;
  FaultInjector& operator=(const FaultInjector&) = delete;

  // Replaces the policy, restarts the operation count and reseeds the
  // generator from policy.seed. injected() keeps counting.
  void SetPolicy(const FaultPolicy& policy);
  FaultPolicy policy() const;

  // Counts one operation named `op` (for the message), sleeps
  // policy.latency_us, and returns the fault to inject: OK for none;
  // ResourceExhausted for a write under policy.enospc; else Unavailable if
  // policy.retryable; else Internal.
  absl::Status MaybeFail(const char* op, bool is_write);
  // Whether to tear the write about to be forwarded (policy.torn_write_one_in).
  // A tear counts as an injected fault.
  bool MaybeTear();

  // Faults injected so far (failures and tears), across policies.
  uint64_t injected() const { return injected_.load(); }

 private:
  mutable absl::Mutex mu_;
  FaultPolicy policy_ ABSL_GUARDED_BY(mu_);
  std::mt19937_64 rng_ ABSL_GUARDED_BY(mu_);
  int64_t ops_ ABSL_GUARDED_BY(mu_) = 0;
  std::atomic<uint64_t> injected_{0};
};

}  // namespace kvtier

#endif  // KVTIER_COMMON_FAULT_INJECTION_H_
