// `kvtier put|get|delete|lookup|prefetch|stats`: talk to a running kvtierd through
// libkvtier (client/kvtier_client.h).
#include <cstdio>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "cli/cli.h"
#include "client/kvtier_client.h"
#include "common/status.h"
#include "common/strings.h"

namespace kvtier::cli {

namespace {

struct ConnFlags {
  std::string socket = client::kDefaultSocket;
  std::string addr;
  std::string token_file;
  std::string tls_ca, tls_cert, tls_key, tls_server_name;
};

void AddConnFlags(CLI::App* cmd, ConnFlags* f) {
  cmd->add_option("--socket", f->socket, "kvtierd Unix socket")->capture_default_str();
  cmd->add_option("--addr", f->addr, "kvtierd TCP HOST:PORT (instead of the socket)");
  cmd->add_option("--token-file", f->token_file, "bearer token file for --addr");
  cmd->add_option("--tls-ca", f->tls_ca, "PEM CA of the daemon's TLS certificate (TLS for --addr)");
  cmd->add_option("--tls-cert", f->tls_cert, "PEM client certificate (mutual TLS; needs --tls-ca)");
  cmd->add_option("--tls-key", f->tls_key, "PEM private key of --tls-cert");
  cmd->add_option("--tls-server-name", f->tls_server_name,
                  "name the daemon's certificate is checked against [default: the host of --addr]");
}

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open ", path));
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

absl::StatusOr<std::unique_ptr<client::KvtierClient>> Connect(const ConnFlags& f) {
  client::ClientOptions o;
  o.socket_path = f.socket;
  o.tcp_addr = f.addr;
  o.tls_ca = f.tls_ca;
  o.tls_cert = f.tls_cert;
  o.tls_key = f.tls_key;
  o.tls_server_name = f.tls_server_name;
  o.populate_mapping = false;  // one chunk per invocation: fault in only its pages
  if (!f.token_file.empty()) {
    KVTIER_ASSIGN_OR_RETURN(o.token, client::ReadTokenFile(f.token_file));
  }
  return client::KvtierClient::Connect(o);
}

absl::StatusOr<Hash128> ParseKey(const std::string& hex) {
  auto k = Hash128::FromHex(hex);
  if (!k.ok()) return absl::InvalidArgumentError(absl::StrCat("key '", hex, "': ", k.status().message()));
  return *k;
}

// The chunk keys of --keys: comma-separated, in prefix order, at least one.
absl::StatusOr<std::vector<Hash128>> ParseKeyList(const std::string& list) {
  std::vector<Hash128> keys;
  for (absl::string_view part : absl::StrSplit(AsAbsl(list), ',', absl::SkipEmpty())) {
    KVTIER_ASSIGN_OR_RETURN(Hash128 k, ParseKey(std::string(part)));
    keys.push_back(k);
  }
  if (keys.empty()) return absl::InvalidArgumentError("--keys is empty");
  return keys;
}

// "not found" is the whole message for a miss, as the CLI contract says.
absl::Status Miss(const absl::Status& st, const std::string& key) {
  if (absl::IsNotFound(st)) return CacheMiss(key);
  return st;
}

std::string JsonEscape(const std::string& s) {
  std::string o;
  for (char c : s) {
    if (c == '"' || c == '\\') o.push_back('\\');
    o.push_back(c);
  }
  return o;
}

// `kvtier put`.
void AddPutCommand(CLI::App& app, CommandResult& result) {
  auto* cmd = app.add_subcommand("put", "store a chunk file (from `kvtier codec encode`) in kvtierd");
  auto f = std::make_shared<ConnFlags>();
  auto key = std::make_shared<std::string>();
  auto file = std::make_shared<std::string>();
  auto durable = std::make_shared<bool>(false);
  AddConnFlags(cmd, f.get());
  cmd->add_option("--key", *key, "chunk key, 32 hex digits")->required();
  cmd->add_flag("--durable", *durable,
                "return only once the chunk is committed on NVMe (survives a crash; "
                "still evicted under capacity pressure like any chunk)");
  cmd->add_option("FILE", *file, "chunk file")->required();
  cmd->callback(Action(result, [=]() -> absl::Status {
    KVTIER_ASSIGN_OR_RETURN(Hash128 k, ParseKey(*key));
    auto bytes = ReadFile(*file);
    if (!bytes.ok()) return absl::InvalidArgumentError(std::string(bytes.status().message()));
    KVTIER_ASSIGN_OR_RETURN(auto c, Connect(*f));
    client::PutOptions po;
    po.durable = *durable;
    KVTIER_RETURN_IF_ERROR(c->Put(
        k, std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(bytes->data()), bytes->size()), po));
    std::printf("stored %s (%zu bytes%s)\n", k.ToHex().c_str(), bytes->size(),
                *durable ? ", durable" : "");
    return absl::OkStatus();
  }));
}

// `kvtier get`.
void AddGetCommand(CLI::App& app, CommandResult& result) {
  auto* cmd = app.add_subcommand("get", "fetch a chunk from kvtierd into a file");
  auto f = std::make_shared<ConnFlags>();
  auto key = std::make_shared<std::string>();
  auto out = std::make_shared<std::string>();
  AddConnFlags(cmd, f.get());
  cmd->add_option("--key", *key, "chunk key, 32 hex digits")->required();
  cmd->add_option("-o,--output", *out, "output file")->required();
  cmd->callback(Action(result, [=]() -> absl::Status {
    KVTIER_ASSIGN_OR_RETURN(Hash128 k, ParseKey(*key));
    KVTIER_ASSIGN_OR_RETURN(auto c, Connect(*f));
    auto bytes = c->Get(k);
    if (!bytes.ok()) return Miss(bytes.status(), *key);
    std::ofstream o(*out, std::ios::binary | std::ios::trunc);
    o.write(reinterpret_cast<const char*>(bytes->data()), static_cast<std::streamsize>(bytes->size()));
    if (!o) return absl::InternalError(absl::StrCat("cannot write ", *out));
    std::printf("wrote %zu bytes to %s\n", bytes->size(), out->c_str());
    return absl::OkStatus();
  }));
}

// `kvtier delete`.
void AddDeleteCommand(CLI::App& app, CommandResult& result) {
  auto* cmd = app.add_subcommand("delete", "remove a chunk from every tier of kvtierd");
  auto f = std::make_shared<ConnFlags>();
  auto key = std::make_shared<std::string>();
  AddConnFlags(cmd, f.get());
  cmd->add_option("--key", *key, "chunk key, 32 hex digits")->required();
  cmd->callback(Action(result, [=]() -> absl::Status {
    KVTIER_ASSIGN_OR_RETURN(Hash128 k, ParseKey(*key));
    KVTIER_ASSIGN_OR_RETURN(auto c, Connect(*f));
    KVTIER_RETURN_IF_ERROR(Miss(c->Delete(k), *key));
    std::printf("deleted %s\n", k.ToHex().c_str());
    return absl::OkStatus();
  }));
}

// `kvtier lookup`.
void AddLookupCommand(CLI::App& app, CommandResult& result) {
  auto* cmd = app.add_subcommand("lookup", "longest cached prefix of a key list, with the tier of each hit");
  auto f = std::make_shared<ConnFlags>();
  auto keys = std::make_shared<std::string>();
  auto prefill = std::make_shared<double>(0);
  auto chunk_tokens = std::make_shared<uint32_t>(256);
  auto doubling = std::make_shared<double>(0);
  AddConnFlags(cmd, f.get());
  cmd->add_option("--keys", *keys, "comma-separated chunk keys, in prefix order")->required();
  cmd->add_option("--prefill-tokens-per-s", *prefill,
                  "the engine's prefill throughput: also say how many hits are worth loading "
                  "rather than recomputing [default: not given]");
  cmd->add_option("--tokens-per-chunk", *chunk_tokens, "tokens per chunk, with --prefill-tokens-per-s")
      ->capture_default_str();
  cmd->add_option("--attention-doubling-tokens", *doubling,
                  "with --prefill-tokens-per-s (then the short-context rate): the context length "
                  "at which a token's prefill costs twice its short-context cost; 0: a recompute "
                  "cost linear in tokens")
      ->capture_default_str();
  cmd->callback(Action(result, [=]() -> absl::Status {
    KVTIER_ASSIGN_OR_RETURN(std::vector<Hash128> ks, ParseKeyList(*keys));
    KVTIER_ASSIGN_OR_RETURN(auto c, Connect(*f));
    KVTIER_ASSIGN_OR_RETURN(client::LoadPlan plan,
                            c->PlanLoad(ks, *prefill, *chunk_tokens, *doubling));
    std::printf("cached prefix: %zu of %zu chunks\n", plan.tiers.size(), ks.size());
    for (size_t i = 0; i < plan.tiers.size(); ++i) {
      std::printf("%s %s %llu bytes, load ~%.3f ms\n", ks[i].ToHex().c_str(),
                  client::TierName(plan.tiers[i]),
                  static_cast<unsigned long long>(plan.chunk_bytes[i]), plan.load_us[i] / 1e3);
    }
    if (*prefill > 0) {
      std::printf("worth loading: %zu of %zu cached chunks (~%.3f ms to load, saves ~%.3f ms of "
                  "prefill)\n",
                  plan.load_chunks, plan.tiers.size(), plan.load_chunks_us / 1e3,
                  plan.saved_us / 1e3);
    }
    if (plan.tiers.empty()) return CacheMiss("no cached prefix");
    return absl::OkStatus();
  }));
}

// `kvtier prefetch`.
void AddPrefetchCommand(CLI::App& app, CommandResult& result) {
  auto* cmd = app.add_subcommand(
      "prefetch", "move the leading NVMe- or remote-resident chunks of a cached prefix into DRAM");
  auto f = std::make_shared<ConnFlags>();
  auto keys = std::make_shared<std::string>();
  auto budget_mib = std::make_shared<double>(0);
  auto wait_ms = std::make_shared<uint32_t>(0);
  AddConnFlags(cmd, f.get());
  cmd->add_option("--keys", *keys, "comma-separated chunk keys, in prefix order")->required();
  cmd->add_option("--budget-mib", *budget_mib,
                  "most MiB to move (the leading chunks that fit); 0: no limit")
      ->capture_default_str();
  cmd->add_option("--wait-ms", *wait_ms, "wait up to this long for the chunks to arrive; 0: return at once")
      ->capture_default_str();
  cmd->callback(Action(result, [=]() -> absl::Status {
    KVTIER_ASSIGN_OR_RETURN(std::vector<Hash128> ks, ParseKeyList(*keys));
    if (!(*budget_mib >= 0)) return absl::InvalidArgumentError("--budget-mib must be >= 0");
    KVTIER_ASSIGN_OR_RETURN(auto c, Connect(*f));
    const auto budget = static_cast<uint64_t>(*budget_mib * 1048576.0);
    KVTIER_ASSIGN_OR_RETURN(client::PrefetchResult r, c->PrefetchWithin(ks, budget, *wait_ms));
    std::printf("prefetch: %u chunks, %llu bytes queued%s\n", r.keys,
                static_cast<unsigned long long>(r.bytes),
                *wait_ms == 0 ? "" : (r.completed ? ", in DRAM" : ", not all in DRAM yet"));
    return absl::OkStatus();
  }));
}

// `kvtier stats`.
void AddStatsCommand(CLI::App& app, CommandResult& result) {
  auto* cmd = app.add_subcommand("stats", "tier usage and counters of kvtierd");
  auto f = std::make_shared<ConnFlags>();
  auto json = std::make_shared<bool>(false);
  AddConnFlags(cmd, f.get());
  cmd->add_flag("--json", *json, "print JSON");
  cmd->callback(Action(result, [=]() -> absl::Status {
    KVTIER_ASSIGN_OR_RETURN(auto c, Connect(*f));
    KVTIER_ASSIGN_OR_RETURN(client::DaemonStats s, c->Stats());
    if (*json) {
      std::string o = "{\"tiers\":[";
      for (size_t i = 0; i < s.tiers.size(); ++i) {
        const auto& t = s.tiers[i];
        absl::StrAppend(&o, i ? "," : "", "{\"tier\":\"", client::TierName(t.tier),
                        "\",\"capacity_bytes\":", t.capacity_bytes, ",\"used_bytes\":", t.used_bytes,
                        ",\"chunks\":", t.chunks, ",\"read_bytes_per_s\":", t.read_bytes_per_s,
                        ",\"write_bytes_per_s\":", t.write_bytes_per_s, "}");
      }
      absl::StrAppend(&o, "],\"counters\":{");
      for (size_t i = 0; i < s.counters.size(); ++i) {
        absl::StrAppend(&o, i ? "," : "", "\"", JsonEscape(s.counters[i].first), "\":",
                        s.counters[i].second);
      }
      absl::StrAppend(&o, "}}");
      std::printf("%s\n", o.c_str());
      return absl::OkStatus();
    }
    // The rates are what the load-or-recompute plan prices each tier's hits at
    // (docs/daemon.md); 0 until the tier moved something (NVMe: its read probe).
    std::printf("%-8s %16s %16s %10s %10s %10s\n", "tier", "capacity_bytes", "used_bytes",
                "chunks", "read_GB/s", "write_GB/s");
    for (const auto& t : s.tiers) {
      std::printf("%-8s %16llu %16llu %10llu %10.2f %10.2f\n", client::TierName(t.tier),
                  static_cast<unsigned long long>(t.capacity_bytes),
                  static_cast<unsigned long long>(t.used_bytes),
                  static_cast<unsigned long long>(t.chunks), t.read_bytes_per_s / 1e9,
                  t.write_bytes_per_s / 1e9);
    }
    std::printf("\n%-24s %12s\n", "counter", "value");
    for (const auto& [name, v] : s.counters) {
      std::printf("%-24s %12llu\n", name.c_str(), static_cast<unsigned long long>(v));
    }
    return absl::OkStatus();
  }));
}

}  // namespace

void RegisterDaemonCommands(CLI::App& app, CommandResult& result) {
  AddPutCommand(app, result);
  AddGetCommand(app, result);
  AddDeleteCommand(app, result);
  AddLookupCommand(app, result);
  AddPrefetchCommand(app, result);
  AddStatsCommand(app, result);
}

}  // namespace kvtier::cli
