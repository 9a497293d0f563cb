#include "tiering/eviction.h"

#include <algorithm>
#include <array>
#include <deque>
#include <set>
#include <vector>
#include <string>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/strings.h"

namespace kvtier::tiering {

const char* EvictionPolicyName(EvictionPolicyKind k) {
  switch (k) {
    case EvictionPolicyKind::kLru:
      return "lru";
    case EvictionPolicyKind::kS3Fifo:
      return "s3fifo";
    case EvictionPolicyKind::kArc:
      return "arc";
    case EvictionPolicyKind::kFreqLru:
      return "flru";
  }
  return "unknown";
}

absl::StatusOr<EvictionPolicyKind> ParseEvictionPolicy(std::string_view name) {
  for (auto k : {EvictionPolicyKind::kLru, EvictionPolicyKind::kS3Fifo, EvictionPolicyKind::kArc,
                 EvictionPolicyKind::kFreqLru}) {
    if (name == EvictionPolicyName(k)) return k;
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown eviction policy \"", std::string(name),
                                                 "\" (lru, s3fifo, arc, flru)"));
}

absl::StatusOr<EvictionPolicySpec> ParseEvictionPolicySpec(std::string_view spec,
                                                         EvictionPolicyKind fallback) {
  EvictionPolicySpec out;
  out.all = fallback;
  bool have_all = false;
  for (absl::string_view piece : absl::StrSplit(AsAbsl(spec), ',')) {
    std::string_view item = AsStd(absl::StripAsciiWhitespace(piece));
    auto bad = [&](std::string_view why) {
      return absl::InvalidArgumentError(
          absl::StrCat("eviction \"", std::string(spec), "\": item \"", std::string(item), "\": ", std::string(why)));
    };
    if (item.empty()) return bad("empty (POLICY or TIER=POLICY)");
    size_t eq = item.find('=');
    absl::StatusOr<EvictionPolicyKind> kind =
        ParseEvictionPolicy(AsStd(absl::StripAsciiWhitespace(AsAbsl(eq == item.npos ? item : item.substr(eq + 1)))));
    if (!kind.ok()) return bad(AsStd(kind.status().message()));
    if (eq == item.npos) {
      if (have_all) return bad("a second policy for every tier");
      have_all = true;
      out.all = *kind;
      continue;
    }
    std::string_view tier = AsStd(absl::StripAsciiWhitespace(AsAbsl(item.substr(0, eq))));
    std::optional<int> index;
    for (int k = 0; k < kNumTierKinds; ++k) {
      if (tier == TierName(static_cast<TierKind>(k))) index = k;
    }
    if (!index) return bad("unknown tier (hbm, dram, nvme, remote)");
    if (out.tier[*index]) return bad("the tier's policy is given twice");
    out.tier[*index] = *kind;
  }
  return out;
}

std::string EvictionPolicySpecName(const EvictionPolicySpec& s) {
  std::string out = EvictionPolicyName(s.all);
  for (int k = 0; k < kNumTierKinds; ++k) {
    if (s.tier[k] && *s.tier[k] != s.all) {
      absl::StrAppend(&out, ",", TierName(static_cast<TierKind>(k)), "=", EvictionPolicyName(*s.tier[k]));
    }
  }
  return out;
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
  bool IsGhost(const ObjectKey&) const override { return false; }

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
  S3FifoPolicy(uint64_t capacity, double small_fraction)
      : small_target_(static_cast<uint64_t>(static_cast<double>(capacity) * small_fraction)),
        ghost_max_(1 << 20) {}

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
  bool IsGhost(const ObjectKey& id) const override { return ghost_set_.contains(id); }

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


// ARC over bytes. T1/T2 hold resident objects (most recent at the front),
// B1/B2 the ghosts of objects evicted from T1/T2. `p_` is the target size
// of T1 in bytes.
class ArcPolicy : public EvictionPolicy {
 public:
  explicit ArcPolicy(uint64_t capacity) : c_(capacity) {}

  void OnInsert(const ObjectKey& id, uint64_t bytes) override {
    auto it = pos_.find(id);
    if (it != pos_.end()) {
      if (it->second.list == kT1 || it->second.list == kT2) {
        MoveTo(it->second, kT2);
        return;
      }
      // A ghost hit: adapt the target towards the list that lost it.
      const int g = it->second.list;
      const uint64_t b1 = std::max<uint64_t>(bytes_[kB1], 1), b2 = std::max<uint64_t>(bytes_[kB2], 1);
      if (g == kB1) {
        p_ = std::min(c_, p_ + std::max<uint64_t>(bytes, bytes * b2 / b1));
      } else {
        const uint64_t d = std::max<uint64_t>(bytes, bytes * b1 / b2);
        p_ = p_ > d ? p_ - d : 0;
      }
      MoveTo(it->second, kT2);
      bytes_[kT2] = bytes_[kT2] - it->second.bytes + bytes;
      it->second.bytes = bytes;
      TrimGhosts();
      return;
    }
    lists_[kT1].push_front(id);
    pos_[id] = Pos{kT1, lists_[kT1].begin(), bytes};
    bytes_[kT1] += bytes;
    TrimGhosts();
  }
  void OnAccess(const ObjectKey& id) override {
    auto it = pos_.find(id);
    if (it != pos_.end() && (it->second.list == kT1 || it->second.list == kT2)) MoveTo(it->second, kT2);
  }
  void OnErase(const ObjectKey& id) override {
    auto it = pos_.find(id);
    if (it == pos_.end() || !(it->second.list == kT1 || it->second.list == kT2)) return;
    if (victim_ && *victim_ == id) {
      // Evicted: keep a ghost in B1 or B2.
      MoveTo(it->second, it->second.list == kT1 ? kB1 : kB2);
      victim_.reset();
      TrimGhosts();
      return;
    }
    Remove(it);
  }
  std::optional<ObjectKey> PickVictim(
      const std::function<bool(const ObjectKey&)>& evictable) override {
    // REPLACE: evict from T1 while it is above its target, else from T2;
    // fall back to the other list if every object in the first is pinned.
    const bool t1_first = bytes_[kT1] > 0 && (bytes_[kT1] > p_ || bytes_[kT2] == 0);
    for (int l : {t1_first ? kT1 : kT2, t1_first ? kT2 : kT1}) {
      for (auto it = lists_[l].rbegin(); it != lists_[l].rend(); ++it) {
        if (evictable(*it)) {
          victim_ = *it;
          return *it;
        }
      }
    }
    return std::nullopt;
  }
  size_t size() const override { return lists_[kT1].size() + lists_[kT2].size(); }
  bool IsGhost(const ObjectKey& id) const override {
    auto it = pos_.find(id);
    return it != pos_.end() && (it->second.list == kB1 || it->second.list == kB2);
  }

 private:
  enum : int { kT1 = 0, kT2 = 1, kB1 = 2, kB2 = 3 };
  struct Pos {
    int list;
    std::list<ObjectKey>::iterator it;
    uint64_t bytes;
  };
  // Moves an entry to the front of list `to`.
  void MoveTo(Pos& p, int to) {
    bytes_[p.list] -= std::min(bytes_[p.list], p.bytes);
    lists_[to].splice(lists_[to].begin(), lists_[p.list], p.it);
    p.list = to;
    p.it = lists_[to].begin();
    bytes_[to] += p.bytes;
  }
  void Remove(absl::flat_hash_map<ObjectKey, Pos>::iterator it) {
    bytes_[it->second.list] -= std::min(bytes_[it->second.list], it->second.bytes);
    lists_[it->second.list].erase(it->second.it);
    pos_.erase(it);
  }
  void DropOldest(int l) {
    auto it = pos_.find(lists_[l].back());
    Remove(it);
  }
  // |T1| + |B1| <= c and |T1| + |T2| + |B1| + |B2| <= 2c (in bytes).
  void TrimGhosts() {
    while (!lists_[kB1].empty() && bytes_[kT1] + bytes_[kB1] > c_) DropOldest(kB1);
    while (!lists_[kB2].empty() && bytes_[kT1] + bytes_[kT2] + bytes_[kB1] + bytes_[kB2] > 2 * c_) {
      DropOldest(kB2);
    }
  }

  const uint64_t c_;
  uint64_t p_ = 0;
  std::array<std::list<ObjectKey>, 4> lists_;
  std::array<uint64_t, 4> bytes_{};
  absl::flat_hash_map<ObjectKey, Pos> pos_;
  std::optional<ObjectKey> victim_;
};

// A hash of an object that is the same in every process (keys are XXH3
// outputs, so their bits are already uniform): the sketch and the sampling
// of the miniature caches must not depend on absl's per-process hash seed,
// or two runs of one trace would differ.
uint64_t StableHash(const ObjectKey& id) {
  return id.key.low64() ^ (static_cast<uint64_t>(id.part) * 0x9E3779B97F4A7C15ull);
}

// A count-min sketch of 4-bit-saturating use counts (kept in bytes), 4 rows
// of 2^18 counters (1 MiB). Every kResetFactor x width increments all
// counters halve, so counts follow the recent workload (TinyLFU's reset).
class FrequencySketch {
 public:
  FrequencySketch() : rows_(kRows * kWidth, 0) {}
  // Counts one use of `id` and returns its estimated uses (at most 15).
  uint32_t Increment(const ObjectKey& id) {
    const uint64_t h = StableHash(id);
    uint32_t est = 15;
    for (int r = 0; r < kRows; ++r) {
      uint8_t& c = rows_[r * kWidth + Index(h, r)];
      if (c < 15) ++c;
      est = std::min<uint32_t>(est, c);
    }
    if (++increments_ >= kResetFactor * kWidth) {
      for (uint8_t& c : rows_) c >>= 1;
      increments_ = 0;
    }
    return est;
  }

 private:
  static constexpr int kRows = 4;
  static constexpr uint64_t kWidth = uint64_t{1} << 18;
  static constexpr uint64_t kResetFactor = 10;
  static uint64_t Index(uint64_t h, int row) {
    // A different odd multiplier per row spreads one hash over the rows.
    static constexpr uint64_t kMul[kRows] = {0x9E3779B97F4A7C15ull, 0xC2B2AE3D27D4EB4Full,
                                             0x165667B19E3779F9ull, 0xD6E8FEB86659FD93ull};
    return ((h ^ (h >> 29)) * kMul[row]) >> (64 - 18);
  }
  std::vector<uint8_t> rows_;
  uint64_t increments_ = 0;
};

// Objects by eviction priority (lowest first): the logical time of the last
// use plus a bonus of `bonus` x (objects held) per use beyond the first, up
// to `max_bonus_uses` of them. Uses are counted by the caller (the sketch).
class FreqLruOrder {
 public:
  explicit FreqLruOrder(uint32_t max_bonus_uses) : max_bonus_uses_(max_bonus_uses) {}

  // A use of `id` (`uses` counted so far, this one included) with bonus
  // multiplier `bonus`. Returns true if `id` was held.
  bool Use(const ObjectKey& id, uint64_t bytes, uint32_t uses, double bonus) {
    const uint32_t extra = std::min(uses > 0 ? uses - 1 : 0, max_bonus_uses_);
    auto [it, inserted] = held_.try_emplace(id, Held{0, bytes, uses});
    const double p = static_cast<double>(++clock_) +
                     bonus * static_cast<double>(held_.size()) * static_cast<double>(extra);
    if (!inserted) {
      order_.erase({it->second.priority, id});
    } else {
      bytes_ += bytes;
    }
    it->second.priority = p;
    it->second.uses = uses;
    order_.insert({p, id});
    return !inserted;
  }
  bool Contains(const ObjectKey& id) const { return held_.contains(id); }
  void Erase(const ObjectKey& id) {
    auto it = held_.find(id);
    if (it == held_.end()) return;
    order_.erase({it->second.priority, id});
    bytes_ -= it->second.bytes;
    held_.erase(it);
  }
  // The lowest-priority object for which `evictable` is true.
  std::optional<ObjectKey> Lowest(const std::function<bool(const ObjectKey&)>& evictable) const {
    for (const auto& [p, id] : order_) {
      if (evictable(id)) return id;
    }
    return std::nullopt;
  }
  // Evicts lowest-priority objects until at most `capacity` bytes are held,
  // calling `evicted(id, bytes, uses)` for each (uses: at its last use).
  template <typename F>
  void Trim(uint64_t capacity, F&& evicted) {
    while (bytes_ > capacity && !order_.empty()) {
      const ObjectKey id = order_.begin()->second;
      const Held h = held_.at(id);
      Erase(id);
      evicted(id, h.bytes, h.uses);
    }
  }
  void Trim(uint64_t capacity) {
    Trim(capacity, [](const ObjectKey&, uint64_t, uint32_t) {});
  }
  size_t size() const { return held_.size(); }

 private:
  struct Held {
    double priority;
    uint64_t bytes;
    uint32_t uses;
  };
  struct Less {
    bool operator()(const std::pair<double, ObjectKey>& a, const std::pair<double, ObjectKey>& b) const {
      if (a.first != b.first) return a.first < b.first;
      if (a.second.key.bytes != b.second.key.bytes) return a.second.key.bytes < b.second.key.bytes;
      return a.second.part < b.second.part;
    }
  };
  const uint32_t max_bonus_uses_;
  uint64_t clock_ = 0;
  uint64_t bytes_ = 0;
  absl::flat_hash_map<ObjectKey, Held> held_;
  std::set<std::pair<double, ObjectKey>, Less> order_;
};

// FreqLruOrder over the tier, with its bonus chosen by miniature
// simulations (Waldspurger et al., ATC'17): one object in kSampleRate (by
// key hash) also goes through small caches of capacity / kSampleRate bytes,
// one per candidate bonus, and every kEpoch sampled uses the bonus whose
// cache hit most (hits decay by half per epoch) becomes the tier's. Zero is
// a candidate, so where frequency does not pay (a tier large enough that
// recency alone keeps what is reused) the policy is LRU. With a tier below
// (TierBelow), each small cache evicts into a small LRU cache of that
// tier's capacity / kSampleRate, admitting what the engine would admit, and
// a hit in either counts: the bonus is chosen for the hits of both tiers,
// since what this tier keeps decides what the one below receives.
class FreqLruPolicy : public EvictionPolicy {
 public:
  FreqLruPolicy(uint64_t capacity, double bonus, uint32_t max_bonus_uses, const TierBelow& below)
      : bonus_(bonus),
        order_(max_bonus_uses),
        mini_capacity_(capacity / kSampleRate),
        below_capacity_(below.capacity_bytes / kSampleRate),
        below_admit_after_uses_(below.admit_after_uses) {
    for (double b : {0.0, 0.25, 0.5, 1.0, 2.0, 4.0}) {
      minis_.push_back(Mini{b, FreqLruOrder(max_bonus_uses), FreqLruOrder(0), 0});
    }
  }

  void OnInsert(const ObjectKey& id, uint64_t bytes) override { Use(id, bytes); }
  void OnAccess(const ObjectKey& id) override {
    if (order_.Contains(id)) Use(id, 0);
  }
  void OnErase(const ObjectKey& id) override { order_.Erase(id); }
  std::optional<ObjectKey> PickVictim(
      const std::function<bool(const ObjectKey&)>& evictable) override {
    return order_.Lowest(evictable);
  }
  size_t size() const override { return order_.size(); }
  bool IsGhost(const ObjectKey&) const override { return false; }

 private:
  static constexpr uint64_t kSampleRate = 16;
  static constexpr uint64_t kEpoch = 1024;
  static constexpr double kSwitchMargin = 1.02;
  struct Mini {
    double bonus;
    FreqLruOrder order;
    FreqLruOrder below;  // LRU (bonus 0); empty without a tier below
    double hits;
  };

  // One use of a sampled object in miniature cache `m`: a hit in it or in
  // its tier below, as the engine would serve it (a hit below is copied up
  // and stays below too).
  void UseMini(Mini& m, const ObjectKey& id, uint64_t bytes, uint32_t uses) {
    bool hit = m.order.Contains(id);
    if (!hit && m.below.Contains(id)) {
      m.below.Use(id, bytes, uses, 0);
      hit = true;
    }
    m.order.Use(id, bytes, uses, m.bonus);
    if (hit) m.hits += 1;
    m.order.Trim(mini_capacity_, [&](const ObjectKey& v, uint64_t vb, uint32_t vu) {
      if (below_capacity_ == 0 || vu < below_admit_after_uses_ || m.below.Contains(v)) return;
      m.below.Use(v, vb, vu, 0);
      m.below.Trim(below_capacity_);
    });
  }

  void Use(const ObjectKey& id, uint64_t bytes) {
    const uint32_t uses = sketch_.Increment(id);
    order_.Use(id, bytes, uses, bonus_);
    if (id.key.high64() % kSampleRate != 0) return;
    // The miniature caches see each use of a sampled object with its size
    // (remembered from its insert: an access carries none).
    auto [sz, fresh] = sample_bytes_.try_emplace(id, bytes);
    if (!fresh && bytes != 0) sz->second = bytes;
    for (Mini& m : minis_) UseMini(m, id, sz->second, uses);
    if (sample_bytes_.size() > 4 * (minis_[0].order.size() + minis_[0].below.size() + 1024)) {
      // Forget sizes of objects no miniature cache holds.
      absl::erase_if(sample_bytes_, [&](const auto& kv) {
        for (const Mini& m : minis_) {
          if (m.order.Contains(kv.first) || m.below.Contains(kv.first)) return false;
        }
        return true;
      });
    }
    if (++sampled_ % kEpoch != 0) return;
    // The current bonus stays unless another's cache hit kSwitchMargin more.
    const Mini* current = nullptr;
    const Mini* best = nullptr;
    for (const Mini& m : minis_) {
      if (m.bonus == bonus_) current = &m;
      if (best == nullptr || m.hits > best->hits) best = &m;
    }
    const double bar = current != nullptr ? current->hits * kSwitchMargin : 0;
    if (best->hits > 0 && best->hits > bar) bonus_ = best->bonus;
    for (Mini& m : minis_) m.hits /= 2;
  }

  double bonus_;
  FrequencySketch sketch_;
  FreqLruOrder order_;
  const uint64_t mini_capacity_;
  const uint64_t below_capacity_;
  const uint32_t below_admit_after_uses_;
  std::vector<Mini> minis_;
  absl::flat_hash_map<ObjectKey, uint64_t> sample_bytes_;
  uint64_t sampled_ = 0;
};

}  // namespace

std::unique_ptr<EvictionPolicy> NewEvictionPolicy(EvictionPolicyKind kind, uint64_t capacity,
                                                  const EvictionOptions& options, const TierBelow& below) {
  switch (kind) {
    case EvictionPolicyKind::kLru:
      return std::make_unique<LruPolicy>();
    case EvictionPolicyKind::kS3Fifo:
      return std::make_unique<S3FifoPolicy>(capacity, options.s3fifo_small_fraction);
    case EvictionPolicyKind::kArc:
      return std::make_unique<ArcPolicy>(capacity);
    case EvictionPolicyKind::kFreqLru:
      return std::make_unique<FreqLruPolicy>(capacity, options.flru_bonus, options.flru_max_bonus_uses,
                                             below);
  }
  return std::make_unique<LruPolicy>();
}

}  // namespace kvtier::tiering
