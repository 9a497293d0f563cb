// A fixed set of threads that runs short CPU tasks for the data path (hashing
// the layer records of a chunk, above all): ParallelFor spreads n items over
// the pool and the calling thread, and Schedule runs a task behind the caller.
#ifndef KVTIER_COMMON_WORKER_POOL_H_
#define KVTIER_COMMON_WORKER_POOL_H_

#include <cstddef>
#include <deque>
#include <thread>
#include <vector>

#include "absl/functional/any_invocable.h"
#include "absl/functional/function_ref.h"
#include "absl/synchronization/mutex.h"

namespace kvtier {

// Thread-safe. Tasks must not block on one another (ParallelFor's caller
// takes part in the work, so a ParallelFor inside a task cannot deadlock).
class WorkerPool {
 public:
  // REQUIRES: threads >= 1. The threads run at `nice` (0 to 19; Linux
  // schedules each thread by its own nice value): above 0 they take only
  // the cores that threads at the default priority leave idle, while a
  // ParallelFor's caller keeps its own priority and so its progress.
  explicit WorkerPool(size_t threads, int nice = 0);
  // Runs every task scheduled so far, then joins the threads.
  ~WorkerPool();
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  // The process's pool for the data path: SharedThreads of the environment's
  // KVTIER_DATA_PATH_THREADS at SharedNice of its KVTIER_DATA_PATH_NICE,
  // both read at the first call.
  static WorkerPool& Shared();
  // The size of the shared pool: one thread per core beyond the caller's, at
  // most 15 (XXH3 runs at memory speed on fewer), unless `env` is a count
  // >= 1 (at most 64 are started). An engine's host can leave cores to the
  // engine's own threads this way (kvtierd seals every stored chunk on it).
  static size_t SharedThreads(const char* env);
  // The nice value of the shared pool's threads: `env` when it is an
  // integer in [0, 19], else 0. Above 0 the pool takes only the cores that
  // threads at the default priority leave idle (docs/daemon.md).
  static int SharedNice(const char* env);

  size_t size() const { return threads_.size(); }

  // Calls fn(i) for every i in [0, n), on up to `max_threads` threads: the
  // caller's and pool threads that are free. Returns once every call has
  // returned. A pool thread that comes late finds no item left and calls
  // nothing, so fn may reference the caller's stack.
  void ParallelFor(size_t n, absl::FunctionRef<void(size_t)> fn, size_t max_threads = 64);

  // Runs `task` on a pool thread.
  void Schedule(absl::AnyInvocable<void() &&> task);

 private:
  void Loop();

  absl::Mutex mu_;
  std::deque<absl::AnyInvocable<void() &&>> queue_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
};

}  // namespace kvtier

#endif  // KVTIER_COMMON_WORKER_POOL_H_
