// `kvtier cluster status`: the members of a kvtier cluster, read from etcd.
#include <cstdio>
#include <optional>
#include <string>

#include "absl/strings/str_cat.h"
#include "cli/cli.h"
#include "cluster/membership.h"
#include "cluster/peer_auth.h"
#include "common/file.h"
#include "common/status.h"
#include "nlohmann/json.hpp"

namespace kvtier::cli {
namespace {

struct StatusArgs {
  std::string etcd;
  std::string cluster;
  std::string etcd_ca, etcd_cert, etcd_key;
  std::string etcd_user, etcd_password_file;
  std::string cluster_secret_file;
  bool json = false;
};


std::string Gib(uint64_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.2f", bytes / 1073741824.0);
  return buf;
}

absl::Status RunStatus(const StatusArgs& a) {
  KVTIER_ASSIGN_OR_RETURN(auto endpoints, cluster::ParseEtcdEndpoints(a.etcd));
  cluster::EtcdClientOptions eo;
  if (!a.etcd_ca.empty()) {
    KVTIER_ASSIGN_OR_RETURN(eo.ca, ReadPemFile(a.etcd_ca, "--etcd-ca"));
  }
  if (!a.etcd_cert.empty() || !a.etcd_key.empty()) {
    KVTIER_ASSIGN_OR_RETURN(eo.cert, ReadPemFile(a.etcd_cert, "--etcd-cert"));
    KVTIER_ASSIGN_OR_RETURN(eo.key, ReadPemFile(a.etcd_key, "--etcd-key"));
  }
  if (!a.etcd_user.empty()) {
    if (a.etcd_password_file.empty()) return absl::InvalidArgumentError("--etcd-user needs --etcd-password-file");
    eo.user = a.etcd_user;
    KVTIER_ASSIGN_OR_RETURN(eo.password, ReadSecretFile(a.etcd_password_file, "etcd password", 1));
  }
  std::optional<cluster::RecordSigner> signer;
  if (!a.cluster_secret_file.empty()) {
    KVTIER_ASSIGN_OR_RETURN(std::string secret,
                            ReadSecretFile(a.cluster_secret_file, "cluster secret",
                                                   cluster::kMinClusterSecretBytes));
    KVTIER_ASSIGN_OR_RETURN(signer, cluster::RecordSigner::Create(secret));
  }
  KVTIER_ASSIGN_OR_RETURN(auto etcd, cluster::EtcdClient::Connect(endpoints, eo));
  KVTIER_ASSIGN_OR_RETURN(auto members, cluster::ListMembers(*etcd, a.cluster, signer ? &*signer : nullptr));
  auto signature = [](const cluster::MemberStatus& m) -> const char* {
    if (!m.signature_ok) return "unchecked";
    return *m.signature_ok ? "valid" : "invalid";
  };
  if (a.json) {
    nlohmann::json out = nlohmann::json::array();
    for (const auto& m : members) {
      out.push_back({{"id", m.record.member.id},
                     {"address", m.record.member.address},
                     {"lease_ttl_left_s", m.ttl_left_s},
                     {"capacity_bytes", m.record.member.capacity_bytes},
                     {"used_bytes", m.record.member.used_bytes},
                     {"protocol", m.record.protocol},
                     {"signature", signature(m)}});
    }
    std::printf("%s\n", nlohmann::json{{"cluster", a.cluster}, {"members", out}}.dump().c_str());
    return absl::OkStatus();
  }
  std::printf("cluster %s: %zu member(s)\n", a.cluster.c_str(), members.size());
  std::printf("%-24s %-24s %8s %14s %14s %10s\n", "ID", "ADDRESS", "TTL(s)", "CAPACITY(GiB)", "USED(GiB)",
              "SIGNATURE");
  for (const auto& m : members) {
    std::printf("%-24s %-24s %8lld %14s %14s %10s\n", m.record.member.id.c_str(),
                m.record.member.address.c_str(), static_cast<long long>(m.ttl_left_s),
                Gib(m.record.member.capacity_bytes).c_str(), Gib(m.record.member.used_bytes).c_str(),
                signature(m));
  }
  return absl::OkStatus();
}

}  // namespace

void RegisterClusterCommands(CLI::App& app, CommandResult& result) {
  auto* c = app.add_subcommand("cluster", "Inspect a kvtier cluster (members in etcd)");
  c->require_subcommand(1);
  static StatusArgs args;
  auto* s = c->add_subcommand("status", "List members: id, address, lease TTL left, capacity, used bytes");
  s->add_option("--etcd", args.etcd, "etcd endpoints http://HOST:PORT[,...] or https://...")->required();
  s->add_option("--etcd-ca", args.etcd_ca, "PEM CA of etcd's server certificate (https:// endpoints)");
  s->add_option("--etcd-cert", args.etcd_cert, "PEM client certificate presented to etcd");
  s->add_option("--etcd-key", args.etcd_key, "PEM private key of --etcd-cert");
  s->add_option("--etcd-user", args.etcd_user, "etcd user (etcd auth enabled; needs --etcd-password-file)");
  s->add_option("--etcd-password-file", args.etcd_password_file, "file holding the etcd user's password (mode 0600)");
  s->add_option("--cluster-secret-file", args.cluster_secret_file,
                "the cluster secret (mode 0600): mark each record's signature valid or invalid");
  s->add_option("--cluster", args.cluster, "cluster name")->required();
  s->add_flag("--json", args.json, "machine-readable output");
  s->callback(Action(result, [] { return RunStatus(args); }));
}

}  // namespace kvtier::cli
