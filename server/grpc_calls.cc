#include "server/grpc_calls.h"

#include <malloc.h>
#include <pthread.h>

#include "absl/strings/str_cat.h"
#include "server/metrics.h"

namespace kvtier::server {

WorkerPool::WorkerPool(int threads, size_t max_queued, const char* name) : max_queued_(max_queued) {
  for (int i = 0; i < threads; ++i) {
    threads_.emplace_back([this, name] {
      pthread_setname_np(pthread_self(), name);
      Run();
    });
  }
}

WorkerPool::~WorkerPool() {
  {
    absl::MutexLock l(&mu_);
    stopping_ = true;
  }
  for (std::thread& t : threads_) t.join();
}

bool WorkerPool::TrySchedule(std::function<void()> task) {
  absl::MutexLock l(&mu_);
  if (queue_.size() >= max_queued_) return false;
  queue_.push_back(std::move(task));
  return true;
}

void WorkerPool::Run() {
  for (;;) {
    std::function<void()> task;
    {
      absl::MutexLock l(&mu_);
      mu_.Await(absl::Condition(
          +[](WorkerPool* p) ABSL_NO_THREAD_SAFETY_ANALYSIS {
            return p->stopping_ || !p->queue_.empty();
          },
          this));
      if (queue_.empty()) return;  // stopping, and nothing left to run
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    task();
  }
}

CallTracker::CallTracker(const CallLimits& limits, ServerMetrics* metrics)
    : limits_(limits), metrics_(metrics) {
  watchdog_ = std::thread([this] {
    pthread_setname_np(pthread_self(), "kvtierd-calls");
    Watch();
  });
}

CallTracker::~CallTracker() {
  {
    absl::MutexLock l(&mu_);
    stopping_ = true;
  }
  watchdog_.join();
}

void CallTracker::Register(Entry* e, grpc::CallbackServerContext* ctx) {
  e->ctx = ctx;
  e->peer = ctx->peer();
  absl::MutexLock l(&mu_);
  entries_.insert(e);
}

void CallTracker::Unregister(Entry* e) {
  absl::MutexLock l(&mu_);
  // The watchdog may be inside TryCancel of this call; the context must live
  // until it returns. (When the cancellation itself ends the call on the
  // watchdog's thread, this runs inside that TryCancel and must not wait.)
  if (std::this_thread::get_id() != watchdog_.get_id()) {
    std::pair<CallTracker*, Entry*> arg(this, e);
    mu_.Await(absl::Condition(
        +[](std::pair<CallTracker*, Entry*>* a) ABSL_NO_THREAD_SAFETY_ANALYSIS {
          return a->first->cancelling_ != a->second;
        },
        &arg));
  }
  entries_.erase(e);
  if (e->bytes > 0) {
    total_ -= e->bytes;
    if (total_ == 0) idle_since_ = std::chrono::steady_clock::now();
    auto it = per_peer_.find(e->peer);
    if (it != per_peer_.end() && (it->second -= e->bytes) == 0) per_peer_.erase(it);
    e->bytes = 0;
  }
}

absl::Status CallTracker::Reserve(Entry* e, uint64_t bytes) {
  absl::MutexLock l(&mu_);
  const uint64_t peer = per_peer_.contains(e->peer) ? per_peer_[e->peer] : 0;
  if (total_ + bytes > limits_.max_inflight_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the daemon's calls hold ", total_, " chunk bytes; ", bytes, " more would pass the limit of ",
        limits_.max_inflight_bytes, " (retry later)"));
  }
  if (peer + bytes > limits_.max_inflight_bytes_per_connection) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "this connection's calls hold ", peer, " chunk bytes; ", bytes,
        " more would pass the limit of ", limits_.max_inflight_bytes_per_connection,
        " (read the answers, or retry later)"));
  }
  total_ += bytes;
  reserved_since_trim_ += bytes;
  per_peer_[e->peer] += bytes;
  e->bytes += bytes;
  return absl::OkStatus();
}

void CallTracker::Arm(Entry* e, int timeout_ms) {
  absl::MutexLock l(&mu_);
  e->deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
}

void CallTracker::Disarm(Entry* e) {
  absl::MutexLock l(&mu_);
  e->deadline = {};
}

uint64_t CallTracker::inflight_bytes() {
  absl::MutexLock l(&mu_);
  return total_;
}

uint64_t CallTracker::cancelled_calls() {
  absl::MutexLock l(&mu_);
  return cancelled_;
}

CallTracker::Entry* CallTracker::FirstDueLocked(std::chrono::steady_clock::time_point now) {
  for (Entry* e : entries_) {
    if (e->deadline != std::chrono::steady_clock::time_point{} && e->deadline < now) return e;
  }
  return nullptr;
}

void CallTracker::Watch() {
  constexpr auto kTick = std::chrono::milliseconds(20);
  // Calls that held this much, all over for this long: gRPC has freed
  // their buffers, and the heap keeps them unless trimmed. A second trim a
  // second later takes what gRPC freed after the first.
  constexpr uint64_t kTrimAfterBytes = uint64_t{64} << 20;
  constexpr std::chrono::milliseconds kTrimAfterIdle[] = {std::chrono::milliseconds(200),
                                                          std::chrono::milliseconds(1200)};
  absl::MutexLock l(&mu_);
  while (!stopping_) {
    mu_.AwaitWithTimeout(absl::Condition(&stopping_), absl::FromChrono(kTick));
    if (reserved_since_trim_ >= kTrimAfterBytes) trims_due_ = 2;  // new bytes: trim anew
    if (trims_due_ > 0 && total_ == 0 &&
        std::chrono::steady_clock::now() - idle_since_ >= kTrimAfterIdle[2 - trims_due_]) {
      reserved_since_trim_ = 0;
      --trims_due_;
      mu_.Unlock();
      ::malloc_trim(0);
      mu_.Lock();
    }
    while (Entry* due = FirstDueLocked(std::chrono::steady_clock::now())) {
      due->deadline = {};
      ++cancelled_;
      if (metrics_ != nullptr) metrics_->Add(ServerMetric::kCallsCancelled);
      cancelling_ = due;
      grpc::CallbackServerContext* ctx = due->ctx;
      mu_.Unlock();
      ctx->TryCancel();
      mu_.Lock();
      cancelling_ = nullptr;
    }
  }
}

}  // namespace kvtier::server
