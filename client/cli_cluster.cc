// `kvtier cluster status`: the members of a kvtier cluster, read from etcd.
#include <cstdio>
#include <string>

#include "client/cli.h"
#include "absl/strings/str_cat.h"
#include "common/file.h"
#include "common/status.h"
#include "nlohmann/json.hpp"
#include "cluster/membership.h"

namespace kvtier::cli {
namespace {

struct StatusArgs {
  std::string etcd;
  std::string cluster;
  std::string etcd_ca, etcd_cert, etcd_key;
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
  KVTIER_ASSIGN_OR_RETURN(auto etcd, cluster::EtcdClient::Connect(endpoints, eo));
  KVTIER_ASSIGN_OR_RETURN(auto members, cluster::ListMembers(*etcd, a.cluster));
  if (a.json) {
    nlohmann::json out = nlohmann::json::array();
    for (const auto& m : members) {
      out.push_back({{"id", m.record.member.id},
                     {"address", m.record.member.address},
                     {"lease_ttl_left_s", m.ttl_left_s},
                     {"capacity_bytes", m.record.member.capacity_bytes},
                     {"used_bytes", m.record.member.used_bytes},
                     {"protocol", m.record.protocol}});
    }
    std::printf("%s\n", nlohmann::json{{"cluster", a.cluster}, {"members", out}}.dump().c_str());
    return absl::OkStatus();
  }
  std::printf("cluster %s: %zu member(s)\n", a.cluster.c_str(), members.size());
  std::printf("%-24s %-24s %8s %14s %14s\n", "ID", "ADDRESS", "TTL(s)", "CAPACITY(GiB)", "USED(GiB)");
  for (const auto& m : members) {
    std::printf("%-24s %-24s %8lld %14s %14s\n", m.record.member.id.c_str(),
                m.record.member.address.c_str(), static_cast<long long>(m.ttl_left_s),
                Gib(m.record.member.capacity_bytes).c_str(), Gib(m.record.member.used_bytes).c_str());
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
  s->add_option("--cluster", args.cluster, "cluster name")->required();
  s->add_flag("--json", args.json, "machine-readable output");
  s->callback(Action(result, [] { return RunStatus(args); }));
}

}  // namespace kvtier::cli
