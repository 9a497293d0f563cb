#include "cluster/membership.h"

#include <algorithm>
#include <chrono>

#include "absl/strings/str_cat.h"
#include "cluster/node_protocol.h"
#include "cluster/peer_auth.h"
#include "common/crypto.h"
#include "nlohmann/json.hpp"

namespace kvtier::cluster {

std::string MembersPrefix(const std::string& cluster) {
  return absl::StrCat("/kvtier/", cluster, "/members/");
}

absl::Status ValidateClusterName(const std::string& cluster) {
  if (cluster.empty() || cluster.size() > 128 ||
      cluster.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.") !=
          std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cluster name '", cluster, "' must be 1-128 letters, digits, '-', '_' or '.'"));
  }
  return absl::OkStatus();
}

std::string EncodeMemberRecord(const MemberRecord& r) {
  nlohmann::json j = {{"id", r.member.id},
                      {"address", r.member.address},
                      {"worker", r.member.worker},
                      {"capacity_bytes", r.member.capacity_bytes},
                      {"used_bytes", r.member.used_bytes},
                      {"protocol", r.protocol}};
  if (!r.mac.empty()) j["mac"] = r.mac;
  return j.dump();
}

absl::StatusOr<RecordSigner> RecordSigner::Create(std::string_view cluster_secret) {
  if (cluster_secret.size() < kMinClusterSecretBytes) {
    return absl::InvalidArgumentError(absl::StrCat("cluster secret of ", cluster_secret.size(),
                                                   " bytes; it must have at least ",
                                                   kMinClusterSecretBytes));
  }
  std::array<uint8_t, 32> key{};
  auto st = HkdfSha256(AsBytes(cluster_secret), "kvtier cluster secret v1", "member-records", key);
  if (!st.ok()) return st;
  return RecordSigner(key);
}

std::string RecordSigner::Sign(const std::string& etcd_key, const MemberRecord& r, int64_t lease) const {
  const std::string capacity = std::to_string(r.member.capacity_bytes);
  const std::string used = std::to_string(r.member.used_bytes);
  const std::string protocol = std::to_string(r.protocol);
  const std::string lease_text = std::to_string(lease);
  return HexOf(HmacSha256(key_, {"kvtier member-record v1", etcd_key, r.member.id, r.member.address,
                                 r.member.worker, capacity, used, protocol, lease_text}));
}

bool RecordSigner::Verify(const std::string& etcd_key, const MemberRecord& r, int64_t lease) const {
  return ConstantTimeEquals(r.mac, Sign(etcd_key, r, lease));
}

absl::StatusOr<MemberRecord> DecodeMemberRecord(const std::string& text) {
  nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    return absl::InvalidArgumentError("member record is not a JSON object");
  }
  MemberRecord r;
  auto str = [&](const char* k, std::string& out) -> absl::Status {
    auto it = j.find(k);
    if (it == j.end() || !it->is_string() || it->get<std::string>().empty() ||
        it->get<std::string>().size() > 256) {
      return absl::InvalidArgumentError(absl::StrCat("member record: '", k, "' must be a short string"));
    }
    out = it->get<std::string>();
    return absl::OkStatus();
  };
  auto num = [&](const char* k, uint64_t& out) -> absl::Status {
    auto it = j.find(k);
    if (it == j.end() || !it->is_number_unsigned()) {
      return absl::InvalidArgumentError(absl::StrCat("member record: '", k, "' must be a non-negative integer"));
    }
    out = it->get<uint64_t>();
    return absl::OkStatus();
  };
  if (auto s = str("id", r.member.id); !s.ok()) return s;
  if (auto s = str("address", r.member.address); !s.ok()) return s;
  if (auto it = j.find("worker"); it != j.end()) {
    if (!it->is_string() || it->get<std::string>().size() > 8192 ||
        (!it->get<std::string>().empty() && it->get<std::string>().rfind("ucx:", 0) != 0)) {
      return absl::InvalidArgumentError("member record: 'worker' must be a ucx:<hex> string");
    }
    r.member.worker = it->get<std::string>();
  }
  if (auto s = num("capacity_bytes", r.member.capacity_bytes); !s.ok()) return s;
  if (auto s = num("used_bytes", r.member.used_bytes); !s.ok()) return s;
  uint64_t proto = 0;
  if (auto s = num("protocol", proto); !s.ok()) return s;
  if (proto > 0xFFFF) return absl::InvalidArgumentError("member record: bad protocol");
  r.protocol = static_cast<uint32_t>(proto);
  if (auto it = j.find("mac"); it != j.end()) {
    if (!it->is_string() || it->get<std::string>().size() != 2 * kSha256Bytes ||
        it->get<std::string>().find_first_not_of("0123456789abcdef") != std::string::npos) {
      return absl::InvalidArgumentError("member record: 'mac' must be 64 lowercase hex digits");
    }
    r.mac = it->get<std::string>();
  }
  return r;
}

absl::StatusOr<MemberRecord> MemberFromKeyValue(const std::string& cluster, const EtcdKeyValue& kv,
                                                const RecordSigner* signer) {
  // etcd deletes a key when its lease expires or is revoked, and refuses a
  // put under a lease it does not know: a record with a lease is as alive as
  // the node keeping that lease. A record without one outlives any node (no
  // kvtierd writes one): it is forged or left by hand.
  if (kv.lease == 0) return absl::InvalidArgumentError(absl::StrCat(kv.key, " has no lease"));
  auto r = DecodeMemberRecord(kv.value);
  if (!r.ok()) return r.status();
  const std::string prefix = MembersPrefix(cluster);
  if (kv.key.size() <= prefix.size() || kv.key.compare(0, prefix.size(), prefix) != 0 ||
      kv.key.substr(prefix.size()) != r->member.id) {
    return absl::InvalidArgumentError(absl::StrCat(kv.key, " holds the record of '", r->member.id, "'"));
  }
  if (signer != nullptr && !signer->Verify(kv.key, *r, kv.lease)) {
    return absl::UnauthenticatedError(absl::StrCat(
        kv.key, r->mac.empty() ? " is not signed" : " has a MAC that does not verify",
        " with this cluster's secret"));
  }
  r->lease = kv.lease;
  return r;
}

Membership::Membership(const MembershipOptions& options, std::unique_ptr<EtcdClient> etcd)
    : options_(options),
      node_id_(options.node_id.empty() ? options.advertise : options.node_id),
      key_(MembersPrefix(options.cluster) + node_id_),
      etcd_(std::move(etcd)) {}

std::optional<MemberRecord> Membership::Accept(const EtcdKeyValue& kv) {
  auto r = MemberFromKeyValue(options_.cluster, kv, signer_ ? &*signer_ : nullptr);
  if (r.ok()) return *std::move(r);
  rejected_records_.fetch_add(1);
  return std::nullopt;
}

absl::StatusOr<std::unique_ptr<Membership>> Membership::Join(const MembershipOptions& options,
                                                             std::unique_ptr<EtcdClient> etcd) {
  if (auto s = ValidateClusterName(options.cluster); !s.ok()) return s;
  if (options.advertise.empty()) return absl::InvalidArgumentError("--advertise is required in a cluster");
  if (options.lease_ttl_s < 2 || options.lease_ttl_s > 3600) {
    return absl::InvalidArgumentError("lease TTL must be 2..3600 seconds");
  }
  std::unique_ptr<Membership> m(new Membership(options, std::move(etcd)));
  if (m->node_id_.find('/') != std::string::npos) {
    return absl::InvalidArgumentError("node id must not contain '/'");
  }
  if (!options.cluster_secret.empty()) {
    auto signer = RecordSigner::Create(options.cluster_secret);
    if (!signer.ok()) return signer.status();
    m->signer_.emplace(*signer);
  }
  if (auto s = m->Register(); !s.ok()) return s;
  if (auto s = m->Resync(); !s.ok()) return s;
  m->keepalive_ = std::thread([p = m.get()] { p->KeepAliveLoop(); });
  return m;
}

Membership::~Membership() {
  int64_t lease;
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    lease = lease_;
  }
  if (keepalive_.joinable()) keepalive_.join();
  watch_.reset();
  if (lease != 0) (void)etcd_->LeaseRevoke(lease);
}

std::string Membership::SelfRecord(int64_t lease) const {
  MemberRecord r;
  r.member = {node_id_, options_.advertise, options_.worker_address, options_.capacity_bytes,
              options_.used_bytes ? options_.used_bytes() : 0};
  r.protocol = kWireVersion;
  if (signer_) r.mac = signer_->Sign(key_, r, lease);
  return EncodeMemberRecord(r);
}

absl::Status Membership::Register() {
  auto lease = etcd_->LeaseGrant(options_.lease_ttl_s);
  if (!lease.ok()) return lease.status();
  auto put = etcd_->Put(key_, SelfRecord(*lease), *lease);
  if (!put.ok()) return put.status();
  absl::MutexLock lock(&mu_);
  lease_ = *lease;
  registrations_.fetch_add(1);
  return absl::OkStatus();
}

absl::Status Membership::Resync() {
  watch_.reset();
  auto got = etcd_->GetPrefix(MembersPrefix(options_.cluster));
  if (!got.ok()) return got.status();
  std::vector<MemberRecord> members;
  for (const EtcdKeyValue& kv : got->first) {
    if (auto r = Accept(kv)) members.push_back(*r);
  }
  {
    absl::MutexLock lock(&mu_);
    members_ = std::move(members);
    watch_broken_ = false;
  }
  auto w = etcd_->WatchPrefix(
      MembersPrefix(options_.cluster), got->second + 1,
      [this](const std::vector<EtcdEvent>& events) { Apply(events); },
      [this](const absl::Status& s) {
        absl::MutexLock lock(&mu_);
        if (!absl::IsCancelled(s)) watch_broken_ = true;
      });
  if (!w.ok()) return w.status();
  watch_ = std::move(*w);
  return absl::OkStatus();
}

void Membership::Apply(const std::vector<EtcdEvent>& events) {
  const std::string prefix = MembersPrefix(options_.cluster);
  absl::MutexLock lock(&mu_);
  for (const EtcdEvent& e : events) {
    std::string id = e.kv.key.substr(std::min(prefix.size(), e.kv.key.size()));
    members_.erase(std::remove_if(members_.begin(), members_.end(),
                                  [&](const MemberRecord& r) { return r.member.id == id; }),
                   members_.end());
    if (e.deleted) continue;
    if (auto r = Accept(e.kv)) members_.push_back(*r);
  }
}

void Membership::KeepAliveLoop() {
  const auto period = std::chrono::milliseconds(options_.lease_ttl_s * 1000 / 3);
  int tick = 0;
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      auto stop = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stopping_; };
      if (mu_.AwaitWithTimeout(absl::Condition(&stop), absl::FromChrono(period))) return;
    }
    int64_t lease;
    bool broken;
    {
      absl::MutexLock lock(&mu_);
      lease = lease_;
      broken = watch_broken_;
    }
    auto ttl = etcd_->LeaseKeepAlive(lease);
    if (absl::IsNotFound(ttl.status())) {
      (void)Register();  // the lease expired (a long pause, or etcd lost it)
    } else if (ttl.ok() && options_.used_bytes && ++tick % 5 == 0) {
      (void)etcd_->Put(key_, SelfRecord(lease), lease);
    }
    if (broken) (void)Resync();
  }
}

std::vector<Member> Membership::LiveMembers() const {
  absl::MutexLock lock(&mu_);
  std::vector<Member> out;
  for (const auto& r : members_) out.push_back(r.member);
  std::sort(out.begin(), out.end(), [](const Member& a, const Member& b) { return a.id < b.id; });
  return out;
}

absl::StatusOr<std::vector<MemberStatus>> ListMembers(EtcdClient& etcd, const std::string& cluster,
                                                      const RecordSigner* signer) {
  if (auto s = ValidateClusterName(cluster); !s.ok()) return s;
  auto got = etcd.GetPrefix(MembersPrefix(cluster));
  if (!got.ok()) return got.status();
  std::vector<MemberStatus> out;
  for (const EtcdKeyValue& kv : got->first) {
    auto r = MemberFromKeyValue(cluster, kv);
    if (!r.ok()) continue;
    MemberStatus st;
    st.record = *r;
    if (signer != nullptr) st.signature_ok = signer->Verify(kv.key, *r, kv.lease);
    auto ttl = etcd.LeaseTimeToLive(kv.lease);
    st.ttl_left_s = ttl.ok() ? *ttl : -1;
    out.push_back(st);
  }
  std::sort(out.begin(), out.end(), [](const MemberStatus& a, const MemberStatus& b) {
    return a.record.member.id < b.record.member.id;
  });
  return out;
}

}  // namespace kvtier::cluster
