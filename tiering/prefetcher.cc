#include "tiering/prefetcher.h"

#include <utility>

namespace kvtier::tiering {

Prefetcher::~Prefetcher() { (void)Stop(); }

void Prefetcher::Start() {
  thread_ = std::thread([this] { Loop(); });
}

std::vector<std::pair<Hash128, PoolExtent>> Prefetcher::Stop() {
  {
    absl::MutexLock l(&mu_);
    stopping_ = true;
  }
  if (thread_.joinable()) thread_.join();
  absl::MutexLock l(&mu_);
  for (Job& job : jobs_) job.done.set_value(absl::CancelledError("engine stopped"));
  jobs_.clear();
  std::vector<std::pair<Hash128, PoolExtent>> left(promotions_.begin(), promotions_.end());
  promotions_.clear();
  return left;
}

std::future<absl::Status> Prefetcher::Enqueue(std::vector<Hash128> keys) {
  Job job;
  job.keys = std::move(keys);
  std::future<absl::Status> f = job.done.get_future();
  absl::MutexLock l(&mu_);
  if (stopping_) {
    job.done.set_value(absl::CancelledError("engine stopping"));
  } else {
    jobs_.push_back(std::move(job));
  }
  return f;
}

bool Prefetcher::EnqueuePromotion(const Hash128& key, const PoolExtent& extent) {
  absl::MutexLock l(&mu_);
  if (stopping_) return false;
  promotions_.emplace_back(key, extent);
  return true;
}

void Prefetcher::Loop() {
  for (;;) {
    Job job;
    {
      absl::MutexLock l(&mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stopping_ || !jobs_.empty() || !promotions_.empty();
      };
      mu_.Await(absl::Condition(&ready));
      if (stopping_) return;
      if (!promotions_.empty()) {
        const auto [key, extent] = promotions_.front();
        promotions_.pop_front();
        mu_.Unlock();
        target_->PromoteFromSlot(key, extent);
        mu_.Lock();
        continue;
      }
      job = std::move(jobs_.front());
      jobs_.pop_front();
    }
    job.done.set_value(Run(job.keys));
  }
}

absl::Status Prefetcher::Run(const std::vector<Hash128>& keys) {
  absl::Status first;
  auto note = [&first](absl::Status st) {
    if (!st.ok() && first.ok()) first = std::move(st);
  };
  std::vector<std::pair<Hash128, uint64_t>> group;
  uint64_t group_bytes = 0;
  for (const Hash128& k : keys) {
    uint64_t bytes = 0;
    switch (target_->RouteOf(k, &bytes)) {
      case PrefetchTarget::Route::kSkip:
        continue;
      case PrefetchTarget::Route::kPromote:
        note(target_->PromoteOne(k));
        continue;
      case PrefetchTarget::Route::kGroup:
        break;
    }
    group.emplace_back(k, bytes);
    group_bytes += bytes;
    if (group.size() >= kGroupChunks || group_bytes >= kGroupBytes) {
      note(target_->PrefetchGroup(group));
      group.clear();
      group_bytes = 0;
    }
  }
  if (!group.empty()) note(target_->PrefetchGroup(group));
  return first;
}

}  // namespace kvtier::tiering
