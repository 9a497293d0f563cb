// What bounds the gRPC calls of one kvtierd listener: the worker threads that
// run request logic (gRPC's own callback threads never block on a tier), the
// chunk bytes that calls may hold in memory (in total and per connection), and
// deadlines after which a call that makes no progress is cancelled: an answer
// its reader does not take (write timeout) or a put stream whose next message
// does not come (idle timeout). docs/daemon.md "Limits" lists the defaults.
#ifndef KVTIER_SERVER_GRPC_CALLS_H_
#define KVTIER_SERVER_GRPC_CALLS_H_

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "grpcpp/server_context.h"

namespace kvtier::server {

class ServerMetrics;

// A fixed set of threads running queued tasks in order. Thread-safe.
class WorkerPool {
 public:
  // REQUIRES: threads >= 1, max_queued >= 1.
  WorkerPool(int threads, size_t max_queued, const char* name);
  // Runs every task already queued, then joins the threads.
  ~WorkerPool();

  // Queues `task`; false (and `task` dropped) when `max_queued` tasks wait.
  bool TrySchedule(std::function<void()> task);

 private:
  void Run();

  const size_t max_queued_;
  absl::Mutex mu_;
  std::deque<std::function<void()>> queue_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
};

struct CallLimits {
  // Chunk bytes that the calls of one listener may hold at once (inline puts'
  // bodies, inline gets' answers, counted twice: the message and its encoded
  // copy); a call beyond it gets RESOURCE_EXHAUSTED. Default: 1 GiB
  uint64_t max_inflight_bytes = uint64_t{1} << 30;
  // The same for the calls of one connection (one peer address; every
  // Unix-socket client shares one). Default: 256 MiB
  uint64_t max_inflight_bytes_per_connection = uint64_t{256} << 20;
  // How long an answer may wait for its reader (HTTP/2 flow control) before
  // the call is cancelled and what it holds is freed. Default: 20000
  int write_timeout_ms = 20000;
  // How long a put stream may wait for its next message before it is
  // cancelled (its slot is freed). Default: 10000
  int stream_idle_timeout_ms = 10000;
};

// The live calls of one listener: their reserved bytes and their deadlines.
// A watchdog thread cancels (ServerContext::TryCancel) each call whose
// deadline passed. Thread-safe.
class CallTracker {
 public:
  // One call's record, owned by its reactor; Register it when the call
  // starts and Unregister it in the reactor's OnDone.
  struct Entry {
    grpc::CallbackServerContext* ctx = nullptr;
    std::string peer;
    uint64_t bytes = 0;
    std::chrono::steady_clock::time_point deadline{};  // none when epoch
  };

  // Counts cancellations in `metrics` (kCallsCancelled) when it is not null
  // (not owned; must outlive the tracker).
  CallTracker(const CallLimits& limits, ServerMetrics* metrics);
  // Joins the watchdog. REQUIRES: every entry was unregistered.
  ~CallTracker();

  const CallLimits& limits() const { return limits_; }

  void Register(Entry* e, grpc::CallbackServerContext* ctx);
  // Releases the entry's bytes; waits while the watchdog is cancelling it.
  void Unregister(Entry* e);
  // Adds `bytes` to the entry's hold. ResourceExhausted if that would pass
  // the listener's or the connection's limit (nothing is then added).
  absl::Status Reserve(Entry* e, uint64_t bytes);
  // The call is cancelled unless it ends (or Disarm) within `timeout_ms`.
  void Arm(Entry* e, int timeout_ms);
  void Disarm(Entry* e);

  // Bytes held by the listener's calls now.
  uint64_t inflight_bytes();
  // Calls cancelled at their deadline so far.
  uint64_t cancelled_calls();

 private:
  void Watch();
  // An entry whose deadline passed before `now`, or null.
  Entry* FirstDueLocked(std::chrono::steady_clock::time_point now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const CallLimits limits_;
  ServerMetrics* const metrics_;
  absl::Mutex mu_;
  absl::flat_hash_set<Entry*> entries_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, uint64_t> per_peer_ ABSL_GUARDED_BY(mu_);
  uint64_t total_ ABSL_GUARDED_BY(mu_) = 0;
  // Bytes reserved since the heap was last trimmed, and since when no call
  // has held any: once calls that held much are over, the watchdog returns
  // the heap's free memory to the system (malloc_trim), which the
  // allocator's per-thread arenas would otherwise keep.
  uint64_t reserved_since_trim_ ABSL_GUARDED_BY(mu_) = 0;
  std::chrono::steady_clock::time_point idle_since_ ABSL_GUARDED_BY(mu_);
  int trims_due_ ABSL_GUARDED_BY(mu_) = 0;  // trims left after the last calls that held much
  uint64_t cancelled_ ABSL_GUARDED_BY(mu_) = 0;
  // The entry whose context the watchdog is cancelling outside the lock.
  Entry* cancelling_ ABSL_GUARDED_BY(mu_) = nullptr;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread watchdog_;
};

}  // namespace kvtier::server

#endif  // KVTIER_SERVER_GRPC_CALLS_H_
