// Cluster membership over etcd (DESIGN.md "Daemon and client"): a node
// registers under /kvtier/<cluster>/members/<node id> with a lease it keeps
// alive, and watches the member list. A node whose lease expires (it died or
// was cut off) disappears from every other node's list; a node that comes
// back registers again. Membership is the MemberView the remote tier uses to
// compute key owners. Thread-safe.
#ifndef KVTIER_CLUSTER_MEMBERSHIP_H_
#define KVTIER_CLUSTER_MEMBERSHIP_H_

#include <atomic>
#include <functional>
#include <array>
#include <memory>
#include <optional>
#include <string_view>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "cluster/etcd_client.h"
#include "cluster/rendezvous.h"

namespace kvtier::cluster {

struct MembershipOptions {
  // Cluster name; nodes of one cluster share the key prefix
  // /kvtier/<cluster>/members/. Letters, digits, '-', '_' and '.'. Required.
  std::string cluster;
  // This node's id, unique in the cluster. Default: "" (the advertise address)
  std::string node_id;
  // Address peers reach this node's data path on ("host:port"). Required.
  std::string advertise;
  // This node's UCX worker address ("ucx:<hex>", UcxTransport::worker_address),
  // published so peers connect over every transport the hosts share.
  // Default: "" (peers use `advertise`)
  std::string worker_address;
  // Lease TTL in seconds: how long a dead node stays listed. Default: 5
  int64_t lease_ttl_s = 5;
  // Capacity this node offers to the cluster, in bytes. Default: 0
  uint64_t capacity_bytes = 0;
  // Reports this node's used bytes; re-published every few keep-alives.
  // Default: none (0)
  std::function<uint64_t()> used_bytes;
  // The cluster secret: this node signs its record with a key derived from
  // it, and only records signed with the same key count as members (others
  // are ignored and counted, rejected_records()). Default: "" (records are
  // neither signed nor checked)
  std::string cluster_secret;
};

// What a member publishes (JSON in etcd).
struct MemberRecord {
  Member member;
  uint32_t protocol = 0;  // wire protocol version of its data path
  int64_t lease = 0;
  // Hex HMAC-SHA256 of the record (RecordSigner); "" if unsigned.
  std::string mac;
};

// Signs member records with a key derived from the cluster secret
// (HKDF-SHA256, info "member-records"), so that a writer to etcd who lacks
// the secret cannot add a member or redirect a member's traffic. The MAC
// covers the record's etcd key, every field, and the lease it is stored
// under (a record copied under another lease does not verify). Immutable,
// thread-safe.
class RecordSigner {
 public:
  // InvalidArgument for a secret shorter than
  // kMinClusterSecretBytes.
  static absl::StatusOr<RecordSigner> Create(std::string_view cluster_secret);
  // The hex MAC of `r` (its `mac` ignored) stored under `etcd_key` with `lease`.
  std::string Sign(const std::string& etcd_key, const MemberRecord& r, int64_t lease) const;
  // True if r.mac is Sign(etcd_key, r, lease) (constant-time compare).
  bool Verify(const std::string& etcd_key, const MemberRecord& r, int64_t lease) const;

 private:
  explicit RecordSigner(std::array<uint8_t, 32> key) : key_(key) {}
  std::array<uint8_t, 32> key_;
};

// Serializes / parses a member record. Parse is given whatever is in etcd:
// InvalidArgument for anything that is not a well-formed record.
std::string EncodeMemberRecord(const MemberRecord& r);
absl::StatusOr<MemberRecord> DecodeMemberRecord(const std::string& json);

// The member a key-value pair of etcd describes. InvalidArgument (not a
// member) for a record that is malformed, is stored under another member's
// key, or has no lease (lease 0); with a `signer`, Unauthenticated for a
// record that is unsigned or whose MAC does not verify.
absl::StatusOr<MemberRecord> MemberFromKeyValue(const std::string& cluster, const EtcdKeyValue& kv,
                                                const RecordSigner* signer = nullptr);

std::string MembersPrefix(const std::string& cluster);
absl::Status ValidateClusterName(const std::string& cluster);

class Membership : public MemberView {
 public:
  // Registers this node and starts the keep-alive and watch threads.
  // InvalidArgument for bad options; Unavailable if etcd cannot be reached.
  static absl::StatusOr<std::unique_ptr<Membership>> Join(const MembershipOptions& options,
                                                          std::unique_ptr<EtcdClient> etcd);
  // Leaves: revokes the lease so the others drop this node at once.
  ~Membership() override;

  std::string self_id() const override { return node_id_; }
  std::vector<Member> LiveMembers() const override;
  // Times this node registered (1 + re-registrations after a lost lease).
  uint64_t registrations() const { return registrations_.load(); }
  // Records under the cluster's prefix that were not taken as members:
  // malformed, misplaced, without a lease, or (with a secret) not signed
  // with it. Each read of a record counts (a forged record seen at a resync
  // and again in a watch event counts twice).
  uint64_t rejected_records() const { return rejected_records_.load(); }

 private:
  Membership(const MembershipOptions& options, std::unique_ptr<EtcdClient> etcd);
  // What this node publishes under `lease`: its addresses, capacity and
  // current use, signed when it has a secret, as JSON.
  std::string SelfRecord(int64_t lease) const;
  // MemberFromKeyValue with this node's signer, counting rejections.
  std::optional<MemberRecord> Accept(const EtcdKeyValue& kv);
  absl::Status Register();
  absl::Status Resync();  // reloads the member list, restarts the watch
  void KeepAliveLoop();
  void Apply(const std::vector<EtcdEvent>& events);

  const MembershipOptions options_;
  const std::string node_id_;
  const std::string key_;
  std::unique_ptr<EtcdClient> etcd_;
  std::optional<RecordSigner> signer_;
  std::atomic<uint64_t> rejected_records_{0};

  mutable absl::Mutex mu_;
  std::vector<MemberRecord> members_ ABSL_GUARDED_BY(mu_);
  int64_t lease_ ABSL_GUARDED_BY(mu_) = 0;
  bool watch_broken_ ABSL_GUARDED_BY(mu_) = false;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::unique_ptr<EtcdWatch> watch_;  // touched by Join and the keep-alive thread only
  std::thread keepalive_;
  std::atomic<uint64_t> registrations_{0};
};

// One row of `kvtier cluster status`.
struct MemberStatus {
  MemberRecord record;
  int64_t ttl_left_s = -1;  // -1 if the lease could not be read
  // With a signer: whether the record's MAC verifies (members ignore a
  // record that does not). Without one: nullopt.
  std::optional<bool> signature_ok;
};

// Lists a cluster's members with the time left on their leases, and, with
// `signer`, whether each record is signed with the cluster's secret (records
// that fail are listed, marked, so that a forged one shows). Malformed or
// misplaced records and records without a lease are left out.
absl::StatusOr<std::vector<MemberStatus>> ListMembers(EtcdClient& etcd, const std::string& cluster,
                                                      const RecordSigner* signer = nullptr);

}  // namespace kvtier::cluster

#endif  // KVTIER_CLUSTER_MEMBERSHIP_H_
