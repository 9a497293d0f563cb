#include "server/tenants.h"

#include <grpc/grpc_security_constants.h>
#include <grpcpp/security/auth_context.h>
#include <openssl/evp.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "common/crypto.h"
#include "common/file.h"
#include "server/grpc_auth.h"
#include "toml++/toml.h"

namespace kvtier::server {
namespace {

// Salt labels: a tenant's namespace is SHA-256(kTenantLabel || name), the
// shared one SHA-256(kSharedLabel). The NUL keeps the label and the name apart.
constexpr std::string_view kTenantLabel{"kvtier tenant namespace v1\0", 27};
constexpr std::string_view kSharedLabel{"kvtier shared namespace v1\0", 27};
constexpr uint64_t kMaxTenantsFileBytes = uint64_t{1} << 20;
constexpr size_t kMaxNameBytes = 64;
constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

std::array<uint8_t, 32> SaltOf(std::string_view label, std::string_view name) {
  std::string msg(label);
  msg += name;
  return Sha256({reinterpret_cast<const uint8_t*>(msg.data()), msg.size()});
}

const std::array<uint8_t, 32>& SharedSalt() {
  static const std::array<uint8_t, 32> salt = SaltOf(kSharedLabel, "");
  return salt;
}

// The first 16 bytes of SHA-256(salt || key): a keyed map that a client
// cannot steer into another salt's image (a 128-bit second preimage).
Hash128 Salted(const std::array<uint8_t, 32>& salt, const Hash128& key) {
  uint8_t msg[32 + 16];
  std::memcpy(msg, salt.data(), 32);
  std::memcpy(msg + 32, key.bytes.data(), 16);
  const std::array<uint8_t, 32> d = Sha256(msg);
  Hash128 out;
  std::memcpy(out.bytes.data(), d.data(), 16);
  return out;
}

bool ValidName(std::string_view n) {
  if (n.empty() || n.size() > kMaxNameBytes) return false;
  for (char c : n) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '_' || c == '.' || c == '-';
    if (!ok) return false;
  }
  return true;
}

int HexValue(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

absl::Status Bad(std::string_view tenant, std::string_view msg) {
  return absl::InvalidArgumentError(
      absl::StrCat("tenant '", std::string(tenant), "': ", std::string(msg)));
}

// One [[tenant]] table (`index` names it in errors before its name is read).
absl::StatusOr<TenantSpec> ParseTenant(const toml::table& t, size_t index) {
  static constexpr std::string_view kKeys[] = {"name",   "token_sha256", "uids",     "tls_cn",
                                               "shared", "dram_gib",     "nvme_gib", "hbm_gib"};
  TenantSpec s;
  const std::string where = absl::StrCat("#", index + 1);
  auto name = t["name"].value<std::string>();
  if (!name || !ValidName(*name)) {
    return Bad(where, "name must be 1..64 characters of A-Z a-z 0-9 _ . -");
  }
  s.name = *name;
  for (const auto& [k, v] : t) {
    bool known = false;
    for (std::string_view key : kKeys) known = known || k.str() == key;
    if (!known) return Bad(s.name, absl::StrCat("unknown key '", std::string(k.str()), "'"));
  }
  if (const toml::node* n = t.get("token_sha256")) {
    auto hex = n->value<std::string>();
    if (!hex || hex->size() != 64) return Bad(s.name, "token_sha256 must be 64 hex digits");
    for (size_t i = 0; i < 32; ++i) {
      const int hi = HexValue((*hex)[2 * i]), lo = HexValue((*hex)[2 * i + 1]);
      if (hi < 0 || lo < 0) return Bad(s.name, "token_sha256 must be 64 hex digits");
      s.token_sha256[i] = static_cast<uint8_t>(hi << 4 | lo);
    }
    s.has_token = true;
  }
  if (const toml::node* n = t.get("uids")) {
    const toml::array* a = n->as_array();
    if (a == nullptr) return Bad(s.name, "uids must be an array of integers");
    for (const toml::node& e : *a) {
      auto uid = e.value<int64_t>();
      // (uid_t)-1 is no user: chown(2) reads it as "leave unchanged".
      if (!e.is_integer() || !uid || *uid < 0 || *uid >= 0xffffffffLL) {
        return Bad(s.name, "uids must be integers in 0..4294967294");
      }
      s.uids.push_back(static_cast<uint32_t>(*uid));
    }
  }
  if (const toml::node* n = t.get("tls_cn")) {
    const toml::array* a = n->as_array();
    if (a == nullptr) return Bad(s.name, "tls_cn must be an array of strings");
    for (const toml::node& e : *a) {
      auto cn = e.value<std::string>();
      if (!cn || cn->empty() || cn->size() > 256) {
        return Bad(s.name, "tls_cn must hold strings of 1..256 bytes");
      }
      s.tls_cns.push_back(*cn);
    }
  }
  if (const toml::node* n = t.get("shared")) {
    auto v = n->value<std::string>();
    if (v && *v == "none") {
      s.shared = SharedAccess::kNone;
    } else if (v && *v == "read") {
      s.shared = SharedAccess::kRead;
    } else if (v && *v == "publish") {
      s.shared = SharedAccess::kPublish;
    } else {
      return Bad(s.name, "shared must be \"none\", \"read\" or \"publish\"");
    }
  }
  static constexpr std::pair<const char*, tiering::TierKind> kQuotas[] = {
      {"hbm_gib", tiering::TierKind::kHbm},
      {"dram_gib", tiering::TierKind::kDram},
      {"nvme_gib", tiering::TierKind::kNvme}};
  for (const auto& [key, kind] : kQuotas) {
    const toml::node* n = t.get(key);
    if (n == nullptr) continue;
    auto gib = n->value<double>();
    if (!gib || !std::isfinite(*gib) || *gib < 0 || *gib > 1 << 20) {
      return Bad(s.name, absl::StrCat(key, " must be a number of GiB in 0..1048576"));
    }
    s.quota_bytes[static_cast<int>(kind)] = static_cast<uint64_t>(*gib * kGiB);
  }
  return s;
}

}  // namespace

absl::StatusOr<std::vector<TenantSpec>> ParseTenants(std::string_view text) {
  toml::table root;
  try {
    root = toml::parse(text);
  } catch (const toml::parse_error& e) {
    return absl::InvalidArgumentError(absl::StrCat("tenants: ", std::string(e.description())));
  }
  for (const auto& [k, v] : root) {
    if (k.str() != "tenant") {
      return absl::InvalidArgumentError(
          absl::StrCat("tenants: unknown key '", std::string(k.str()), "' (expected [[tenant]])"));
    }
  }
  const toml::array* tables = root["tenant"].as_array();
  if (tables == nullptr || tables->empty()) {
    return absl::InvalidArgumentError("tenants: no [[tenant]] tables");
  }
  if (tables->size() > 4096) return absl::InvalidArgumentError("tenants: more than 4096 tenants");
  std::vector<TenantSpec> specs;
  absl::flat_hash_set<std::string> names, cns;
  absl::flat_hash_set<uint32_t> uids;
  for (size_t i = 0; i < tables->size(); ++i) {
    const toml::table* t = (*tables)[i].as_table();
    if (t == nullptr) {
      return absl::InvalidArgumentError("tenants: 'tenant' must be [[tenant]] tables");
    }
    auto spec = ParseTenant(*t, i);
    if (!spec.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("tenants: ", spec.status().message()));
    }
    if (!names.insert(spec->name).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("tenants: name '", spec->name, "' used twice"));
    }
    for (uint32_t uid : spec->uids) {
      if (!uids.insert(uid).second) {
        return absl::InvalidArgumentError(
            absl::StrCat("tenants: uid ", uid, " of '", spec->name, "' belongs to two tenants"));
      }
    }
    for (const std::string& cn : spec->tls_cns) {
      if (!cns.insert(cn).second) {
        return absl::InvalidArgumentError(absl::StrCat("tenants: tls_cn '", cn, "' of '",
                                                       spec->name, "' belongs to two tenants"));
      }
    }
    for (const TenantSpec& other : specs) {
      if (spec->has_token && other.has_token && spec->token_sha256 == other.token_sha256) {
        return absl::InvalidArgumentError(
            absl::StrCat("tenants: '", spec->name, "' and '", other.name, "' have the same token"));
      }
    }
    specs.push_back(*std::move(spec));
  }
  return specs;
}

absl::StatusOr<std::vector<TenantSpec>> LoadTenantsFile(const std::string& path) {
  auto bytes = ReadFileBytes(path, kMaxTenantsFileBytes);
  if (!bytes.ok()) {
    return absl::Status(bytes.status().code(),
                        absl::StrCat("tenants file ", path, ": ", bytes.status().message()));
  }
  auto specs =
      ParseTenants(std::string_view(reinterpret_cast<const char*>(bytes->data()), bytes->size()));
  if (!specs.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", specs.status().message()));
  }
  return specs;
}

Tenant::Tenant(TenantSpec spec, tiering::TenantId id, bool namespaced)
    : spec_(std::move(spec)), id_(id), namespaced_(namespaced) {
  salt_ = spec_.shared == SharedAccess::kPublish ? SharedSalt() : SaltOf(kTenantLabel, spec_.name);
}

Hash128 Tenant::WriteKey(const Hash128& k) const { return namespaced_ ? Salted(salt_, k) : k; }

Hash128 Tenant::ReadKey(const Hash128& k, tiering::PlacementEngine* engine) const {
  if (!namespaced_) return k;
  const Hash128 own = Salted(salt_, k);
  if (spec_.shared != SharedAccess::kRead || engine->Contains(own)) return own;
  const Hash128 shared = Salted(SharedSalt(), k);
  return engine->Contains(shared) ? shared : own;
}

void Tenant::MapReadKeys(std::span<Hash128> keys, tiering::PlacementEngine* engine) const {
  if (!namespaced_) return;
  for (Hash128& k : keys) k = ReadKey(k, engine);
}

void Tenant::CountRead(const absl::Status& st) const {
  if (st.ok()) hits_.fetch_add(1, std::memory_order_relaxed);
  if (absl::IsNotFound(st)) misses_.fetch_add(1, std::memory_order_relaxed);
}

void Tenant::CountPut(const absl::Status& st) const {
  if (st.ok()) puts_.fetch_add(1, std::memory_order_relaxed);
  if (absl::IsResourceExhausted(st)) put_rejections_.fetch_add(1, std::memory_order_relaxed);
}

TenantRegistry::TenantRegistry() {
  TenantSpec spec;
  spec.name = "default";
  tenants_.push_back(std::make_unique<Tenant>(std::move(spec), 0, /*namespaced=*/false));
}

TenantRegistry::TenantRegistry(std::vector<TenantSpec> specs) : configured_(true) {
  for (size_t i = 0; i < specs.size(); ++i) {
    tenants_.push_back(std::make_unique<Tenant>(std::move(specs[i]),
                                                static_cast<tiering::TenantId>(i + 1),
                                                /*namespaced=*/true));
    const Tenant* t = tenants_.back().get();
    for (uint32_t uid : t->spec().uids) by_uid_[uid] = t;
    for (const std::string& cn : t->spec().tls_cns) by_cn_[cn] = t;
  }
}

const Tenant* TenantRegistry::ByToken(std::string_view token) const {
  const std::array<uint8_t, 32> d =
      Sha256({reinterpret_cast<const uint8_t*>(token.data()), token.size()});
  const std::string_view given(reinterpret_cast<const char*>(d.data()), d.size());
  const Tenant* found = nullptr;
  for (const auto& t : tenants_) {
    const std::string_view want(reinterpret_cast<const char*>(t->spec().token_sha256.data()), 32);
    const bool eq = ConstantTimeEquals(given, want);
    if (eq && t->spec().has_token) found = t.get();
  }
  return found;
}

const Tenant* TenantRegistry::ByBearer(std::string_view authorization) const {
  constexpr std::string_view kBearer = "Bearer ";
  if (authorization.substr(0, kBearer.size()) != kBearer) return nullptr;
  return ByToken(authorization.substr(kBearer.size()));
}

const Tenant* TenantRegistry::ByUid(uint32_t uid) const {
  auto it = by_uid_.find(uid);
  return it == by_uid_.end() ? nullptr : it->second;
}

const Tenant* TenantRegistry::ByTlsIdentity(std::string_view cn) const {
  auto it = by_cn_.find(std::string(cn));
  return it == by_cn_.end() ? nullptr : it->second;
}

const Tenant* TenantRegistry::ByAuthContext(const grpc::AuthContext& ctx) const {
  const std::vector<grpc::string_ref> cns = ctx.FindPropertyValues(GRPC_X509_CN_PROPERTY_NAME);
  if (cns.size() != 1) return nullptr;
  return ByTlsIdentity(std::string_view(cns[0].data(), cns[0].size()));
}

std::vector<std::array<uint64_t, tiering::kNumTierKinds>> TenantRegistry::EngineQuotas() const {
  if (!configured_) return {};
  std::vector<std::array<uint64_t, tiering::kNumTierKinds>> q(tenants_.size() + 1);
  for (const auto& t : tenants_) q[t->id()] = t->spec().quota_bytes;
  return q;
}

}  // namespace kvtier::server
