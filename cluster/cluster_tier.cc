#include "cluster/cluster_tier.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "codec/chunk.h"

namespace kvtier::cluster {
const char* ClusterMetricName(ClusterMetric m) {
  switch (m) {
    case ClusterMetric::kPuts: return "remote_puts";
    case ClusterMetric::kPutReplicaFailures: return "remote_put_replica_failures";
    case ClusterMetric::kGets: return "remote_gets";
    case ClusterMetric::kGetRetries: return "remote_get_retries";
    case ClusterMetric::kCorruptReplicas: return "remote_corrupt_replicas";
    case ClusterMetric::kMisses: return "remote_misses";
    case ClusterMetric::kErrors: return "remote_errors";
    case ClusterMetric::kPeersSkipped: return "remote_peers_skipped";
    case ClusterMetric::kCount: break;
  }
  return "unknown";
}

ClusterTier::ClusterTier(const ClusterTierOptions& options, MemberView* view,
                         Transport* transport, PeerService* local)
    : options_(options),
      clock_(options.clock != nullptr ? options.clock : tiering::SystemClock()),
      view_(view),
      transport_(transport),
      local_(local) {}

bool ClusterTier::SkipIfDown(const Member& m) {
  const int64_t now = clock_->NowMicros();
  absl::MutexLock lock(&down_mu_);
  auto it = down_until_.find(DataPath(m));
  if (it == down_until_.end()) return false;
  if (it->second <= now) {
    down_until_.erase(it);
    return false;
  }
  Count(ClusterMetric::kPeersSkipped);
  return true;
}

void ClusterTier::CountIfFailed(const absl::Status& s) {
  if (!s.ok() && !absl::IsNotFound(s)) Count(ClusterMetric::kErrors);
}

void ClusterTier::Settle(const Member& m, const absl::Status& s) {
  const int64_t now = clock_->NowMicros();
  absl::MutexLock lock(&down_mu_);
  // A peer that fails authentication is skipped like one that is down: it
  // is not a member this node may trust, and asking again costs a handshake.
  if (!absl::IsUnavailable(s) && !absl::IsUnauthenticated(s)) {
    down_until_.erase(DataPath(m));  // it answered
    return;
  }
  if (options_.down_backoff <= absl::ZeroDuration()) return;
  // Drop ended back-offs, so the addresses of members that left do not pile up.
  absl::erase_if(down_until_, [now](const auto& e) { return e.second <= now; });
  down_until_[DataPath(m)] = now + absl::ToInt64Microseconds(options_.down_backoff);
}

tiering::TierCapabilities ClusterTier::capabilities() const {
  tiering::TierCapabilities c;
  c.durable = true;  // owners keep objects in their NVMe tiers
  c.verifies_on_read = true;
  return c;
}

uint64_t ClusterTier::capacity_bytes() const {
  uint64_t sum = 0;
  for (const Member& m : view_->LiveMembers()) {
    if (m.id != view_->self_id()) sum += m.capacity_bytes;
  }
  return sum;
}

uint64_t ClusterTier::used_bytes() const {
  uint64_t sum = 0;
  for (const Member& m : view_->LiveMembers()) {
    if (m.id != view_->self_id()) sum += m.used_bytes;
  }
  return sum;
}

std::vector<std::string> ClusterTier::Peers() const {
  std::vector<std::string> out;
  for (const Member& m : view_->LiveMembers()) {
    if (m.id != view_->self_id()) out.push_back(m.address);
  }
  return out;
}

std::vector<Member> ClusterTier::Owners(const Hash128& key) const {
  return RendezvousOwners(key, view_->LiveMembers(), options_.replicas);
}

std::vector<Member> ClusterTier::ReadOrder(const Hash128& key) const {
  std::vector<Member> live = view_->LiveMembers();
  std::vector<Member> order = RendezvousOwners(key, live, options_.search_non_owners ? live.size()
                                                                                    : options_.replicas);
  return order;
}

absl::Status ClusterTier::Put(const tiering::ObjectKey& id, std::span<const uint8_t> bytes,
                              const tiering::TierPutOptions& /*options*/) {
  Count(ClusterMetric::kPuts);
  std::vector<Member> owners = Owners(id.key);
  if (owners.empty()) return absl::UnavailableError("the cluster has no live members");
  tiering::BandwidthMeter::Op move = meter_.Start(/*write=*/true);
  int stored = 0;
  absl::Status last;
  for (const Member& m : owners) {
    absl::Status s;
    if (m.id == view_->self_id()) {
      if (local_ == nullptr) continue;
      auto sink = local_->BeginPut(id, bytes.size());
      if (sink.ok()) {
        std::memcpy((*sink)->buffer().data(), bytes.data(), bytes.size());
        s = (*sink)->Commit(true);
      } else {
        s = sink.status();
      }
    } else if (SkipIfDown(m)) {
      s = absl::UnavailableError(absl::StrCat("skipped: it could not be reached within the last ",
                                              absl::FormatDuration(options_.down_backoff)));
    } else {
      for (uint32_t a = 0; a < std::max(1u, options_.attempts_per_peer); ++a) {
        s = transport_->Put(DataPath(m), id, bytes, options_.timeout);
        CountIfFailed(s);
        if (s.code() != absl::StatusCode::kUnavailable) break;
      }
      Settle(m, s);
    }
    if (s.ok()) {
      ++stored;
    } else {
      Count(ClusterMetric::kPutReplicaFailures);
      last = absl::Status(s.code(), absl::StrCat("replica on ", m.id, ": ", s.message()));
    }
  }
  if (stored == 0) return last;
  move.Done(bytes.size());
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> ClusterTier::Size(const tiering::ObjectKey& id) {
  int unanswered = 0;
  for (const Member& m : ReadOrder(id.key)) {
    absl::StatusOr<uint64_t> n;
    if (m.id == view_->self_id()) {
      if (local_ == nullptr) continue;
      n = local_->Size(id);
    } else if (SkipIfDown(m)) {
      ++unanswered;
      continue;
    } else {
      n = transport_->Size(DataPath(m), id, std::min(options_.timeout, options_.lookup_timeout));
      CountIfFailed(n.status());
      Settle(m, n.status());
      if (!n.ok() && !absl::IsNotFound(n.status())) ++unanswered;
    }
    if (n.ok()) return n;
  }
  return MissError(unanswered);
}

absl::Status ClusterTier::MissError(int unanswered) {
  if (unanswered == 0) return absl::NotFoundError("no member has the object");
  return absl::NotFoundError(absl::StrCat("no member that answered has the object (", unanswered,
                                          " did not answer or failed)"));
}

absl::Status ClusterTier::ReadFrom(const Member& m, const tiering::ObjectKey& id, std::span<uint8_t> out) {
  absl::Status s;
  for (uint32_t a = 0; a < std::max(1u, options_.attempts_per_peer); ++a) {
    if (a > 0) Count(ClusterMetric::kGetRetries);
    s = transport_->Get(DataPath(m), id, out, options_.timeout);
    if (s.ok()) {
      s = tiering::VerifyObject(id, out);
      if (s.ok()) break;
      Count(ClusterMetric::kCorruptReplicas);
      s = absl::DataLossError(absl::StrCat("replica on ", m.id, " failed verification: ", s.message()));
      CountIfFailed(s);
      continue;  // a transfer corrupted on the way may succeed the second time
    }
    CountIfFailed(s);
    if (s.code() != absl::StatusCode::kUnavailable) break;
  }
  Settle(m, s);
  return s;
}

absl::Status ClusterTier::ReadLocal(const tiering::ObjectKey& id, std::span<uint8_t> out) {
  if (local_ == nullptr) return absl::NotFoundError("no local service");
  auto src = local_->BeginGet(id);
  if (!src.ok()) return src.status();
  auto bytes = (*src)->bytes();
  if (bytes.size() != out.size()) {
    return absl::InvalidArgumentError(absl::StrCat("local replica is ", bytes.size(),
                                                   " bytes, the buffer holds ", out.size()));
  }
  std::memcpy(out.data(), bytes.data(), bytes.size());
  absl::Status s = tiering::VerifyObject(id, out);
  if (!s.ok()) {
    Count(ClusterMetric::kCorruptReplicas);
    return absl::DataLossError(absl::StrCat("local replica failed verification: ", s.message()));
  }
  return s;
}

absl::Status ClusterTier::Read(const tiering::ObjectKey& id, std::span<uint8_t> out) {
  Count(ClusterMetric::kGets);
  tiering::BandwidthMeter::Op move = meter_.Start(/*write=*/false);
  int unanswered = 0;
  bool corrupt = false;
  for (const Member& m : ReadOrder(id.key)) {
    absl::Status s;
    if (m.id == view_->self_id()) {
      s = ReadLocal(id, out);
    } else if (SkipIfDown(m)) {
      ++unanswered;
      continue;
    } else {
      s = ReadFrom(m, id, out);
    }
    if (s.ok()) {
      move.Done(out.size());
      return s;
    }
    if (s.code() == absl::StatusCode::kDataLoss) {
      corrupt = true;
    } else if (!absl::IsNotFound(s) && m.id != view_->self_id()) {
      ++unanswered;
    }
  }
  Count(ClusterMetric::kMisses);
  if (corrupt) return absl::DataLossError("every copy found failed verification");
  return MissError(unanswered);
}

absl::Status ClusterTier::Erase(const tiering::ObjectKey& id) {
  bool erased = false;
  for (const Member& m : ReadOrder(id.key)) {
    absl::Status s;
    if (m.id == view_->self_id()) {
      s = local_ ? local_->Erase(id) : absl::NotFoundError("no local service");
    } else if (SkipIfDown(m)) {
      continue;
    } else {
      s = transport_->Erase(DataPath(m), id, options_.timeout);
      CountIfFailed(s);
      Settle(m, s);
    }
    erased |= s.ok();
  }
  return erased ? absl::OkStatus() : absl::NotFoundError("no member has the object");
}

}  // namespace kvtier::cluster
