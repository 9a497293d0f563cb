#include "common/worker_pool.h"

#include <pthread.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <memory>
#include <thread>
#include <utility>

#include "absl/strings/numbers.h"

namespace kvtier {
namespace {

// One ParallelFor's items, shared with the pool threads that help. Only a
// thread that claimed an item below n calls fn, and the caller returns once
// all n calls returned, so a helper that comes later touches only this
// object (which it co-owns), never fn.
struct ForState {
  size_t n = 0;
  absl::FunctionRef<void(size_t)>* fn = nullptr;
  std::atomic<size_t> next{0};
  absl::Mutex mu;
  size_t done ABSL_GUARDED_BY(mu) = 0;

  void Work() {
    size_t mine = 0;
    for (size_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) {
      (*fn)(i);
      ++mine;
    }
    if (mine == 0) return;
    absl::MutexLock l(&mu);
    done += mine;
  }
};

}  // namespace

WorkerPool::WorkerPool(size_t threads, int nice) {
  threads_.reserve(threads);
  for (size_t i = 0; i < threads; ++i) {
    threads_.emplace_back([this, nice] {
      pthread_setname_np(pthread_self(), "kvtier-work");
      // Raising one's own nice value needs no privilege; were it refused,
      // the thread would only run at the default priority.
      if (nice > 0) {
        (void)setpriority(PRIO_PROCESS, static_cast<id_t>(::syscall(SYS_gettid)), nice);
      }
      Loop();
    });
  }
}

WorkerPool::~WorkerPool() {
  {
    absl::MutexLock l(&mu_);
    stop_ = true;
  }
  for (std::thread& t : threads_) t.join();
}

size_t WorkerPool::SharedThreads(const char* env) {
  const size_t cores = std::max<size_t>(2, std::thread::hardware_concurrency());
  size_t n = std::min<size_t>(cores - 1, 15);
  size_t asked = 0;
  if (env != nullptr && absl::SimpleAtoi(env, &asked) && asked >= 1) n = std::min<size_t>(asked, 64);
  return n;
}

int WorkerPool::SharedNice(const char* env) {
  int nice = 0;
  if (env == nullptr || !absl::SimpleAtoi(env, &nice) || nice < 0 || nice > 19) return 0;
  return nice;
}

WorkerPool& WorkerPool::Shared() {
  static WorkerPool* pool = new WorkerPool(SharedThreads(std::getenv("KVTIER_DATA_PATH_THREADS")),
                                           SharedNice(std::getenv("KVTIER_DATA_PATH_NICE")));
  return *pool;
}

void WorkerPool::Loop() {
  for (;;) {
    absl::AnyInvocable<void() &&> task;
    {
      absl::MutexLock l(&mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stop_ || !queue_.empty();
      };
      mu_.Await(absl::Condition(&ready));
      if (queue_.empty()) return;  // stopping, and nothing left to run
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    std::move(task)();
  }
}

void WorkerPool::Schedule(absl::AnyInvocable<void() &&> task) {
  absl::MutexLock l(&mu_);
  queue_.push_back(std::move(task));
}

void WorkerPool::ParallelFor(size_t n, absl::FunctionRef<void(size_t)> fn, size_t max_threads) {
  if (n == 0) return;
  const size_t helpers = std::min({n - 1, size(), max_threads > 0 ? max_threads - 1 : 0});
  if (helpers == 0) {
    for (size_t i = 0; i < n; ++i) fn(i);
    return;
  }
  auto state = std::make_shared<ForState>();
  state->n = n;
  state->fn = &fn;
  for (size_t h = 0; h < helpers; ++h) Schedule([state] { state->Work(); });
  state->Work();
  absl::MutexLock l(&state->mu);
  auto all_done = [s = state.get()]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(s->mu) { return s->done == s->n; };
  state->mu.Await(absl::Condition(&all_done));
}

}  // namespace kvtier
