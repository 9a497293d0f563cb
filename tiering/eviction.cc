#include "tiering/eviction.h"

#include <deque>

#include "absl/container/flat_hash_set.h"

namespace kvtier::tiering {

const char* EvictionPolicyName(EvictionPolicyKind k) {
  return k == EvictionPolicyKind::kLru ? "lru" : "s3fifo";
}

namespace {

class LruPolicy : public EvictionPolicy {
 public:
  void OnInsert(const ObjectKey& id, uint64_t) override { Touch(id); }
  void OnAccess(const ObjectKey& id) override {
    if (pos_.contains(id)) Touch(id);
  }
  void OnErase(const ObjectKey& id) override {
    auto it = pos_.find(id);
    if (it == pos_.end()) return;
    order_.erase(it->second);
    pos_.erase(it);
  }
  std::optional<ObjectKey> PickVictim(
      const std::function<bool(const ObjectKey&)>& evictable) override {
    for (auto it = order_.rbegin(); it != order_.rend(); ++it) {
      if (evictable(*it)) return *it;
    }
    return std::nullopt;
  }
  size_t size() const override { return pos_.size(); }

 private:
  void Touch(const ObjectKey& id) {
    auto it = pos_.find(id);
    if (it != pos_.end()) order_.erase(it->second);
    order_.push_front(id);
    pos_[id] = order_.begin();
  }
  std::list<ObjectKey> order_;  // most recent first
  absl::flat_hash_map<ObjectKey, std::list<ObjectKey>::iterator> pos_;
};

class S3FifoPolicy : public EvictionPolicy {
 public:
  explicit S3FifoPolicy(uint64_t capacity)
      : small_target_(capacity / 10), ghost_max_(1 << 20) {}

  void OnInsert(const ObjectKey& id, uint64_t bytes) override {
    auto it = meta_.find(id);
    if (it != meta_.end()) {
      Bump(it->second);
      return;
    }
    bool was_ghost = ghost_set_.erase(id) > 0;
    Meta m{bytes, 0, was_ghost};
    if (was_ghost) {
      main_.push_back(id);
      main_bytes_ += bytes;
    } else {
      small_.push_back(id);
      small_bytes_ += bytes;
    }
    meta_[id] = m;
  }
  void OnAccess(const ObjectKey& id) override {
    auto it = meta_.find(id);
    if (it != meta_.end()) Bump(it->second);
  }
  void OnErase(const ObjectKey& id) override {
    auto it = meta_.find(id);
    if (it == meta_.end()) return;
    // Queue entries are removed lazily: PickVictim skips ids without meta.
    (it->second.in_main ? main_bytes_ : small_bytes_) -= it->second.bytes;
    meta_.erase(it);
  }

  std::optional<ObjectKey> PickVictim(
      const std::function<bool(const ObjectKey&)>& evictable) override {
    // Each object is moved at most ~4 times (frequency <= 3 plus a promotion)
    // before it becomes a victim; pinned ones are rotated. Bound the loop so
    // a tier full of pinned objects returns nullopt.
    size_t budget = 5 * (small_.size() + main_.size()) + 8;
    while (budget-- > 0 && (!small_.empty() || !main_.empty())) {
      bool from_small = !small_.empty() && (small_bytes_ >= small_target_ || main_.empty());
      auto& q = from_small ? small_ : main_;
      ObjectKey id = q.front();
      q.pop_front();
      auto it = meta_.find(id);
      if (it == meta_.end() || it->second.in_main != !from_small) continue;  // stale entry
      Meta& m = it->second;
      if (from_small) {
        if (m.freq > 0) {  // reused while on probation: promote
          small_bytes_ -= m.bytes;
          main_bytes_ += m.bytes;
          m.in_main = true;
          m.freq = 0;
          main_.push_back(id);
          continue;
        }
      } else if (m.freq > 0) {
        --m.freq;
        main_.push_back(id);
        continue;
      }
      if (!evictable(id)) {
        q.push_back(id);
        continue;
      }
      q.push_front(id);  // stays tracked until OnErase
      if (from_small) AddGhost(id);
      return id;
    }
    return std::nullopt;
  }
  size_t size() const override { return meta_.size(); }

 private:
  struct Meta {
    uint64_t bytes;
    uint8_t freq;
    bool in_main;
  };
  void Bump(Meta& m) {
    if (m.freq < 3) ++m.freq;
  }
  void AddGhost(const ObjectKey& id) {
    if (ghost_set_.insert(id).second) ghost_.push_back(id);
    while (ghost_.size() > ghost_max_ || ghost_.size() > 4 * meta_.size() + 64) {
      ghost_set_.erase(ghost_.front());
      ghost_.pop_front();
    }
  }

  const uint64_t small_target_;
  const size_t ghost_max_;
  std::deque<ObjectKey> small_, main_, ghost_;
  uint64_t small_bytes_ = 0, main_bytes_ = 0;
  absl::flat_hash_map<ObjectKey, Meta> meta_;
  absl::flat_hash_set<ObjectKey> ghost_set_;
};

}  // namespace

std::unique_ptr<EvictionPolicy> NewEvictionPolicy(EvictionPolicyKind kind, uint64_t capacity) {
  if (kind == EvictionPolicyKind::kLru) return std::make_unique<LruPolicy>();
  return std::make_unique<S3FifoPolicy>(capacity);
}

}  // namespace kvtier::tiering
