// Tenants of one kvtierd (docs/tenancy.md): who a client is, which keys it
// sees, and its quotas. The tenants file (TOML, `--tenants FILE`) lists
// `[[tenant]]` tables:
//
//   [[tenant]]
//   name = "team-a"                # 1..64 of [A-Za-z0-9_.-], unique
//   token_sha256 = "<64 hex>"      # SHA-256 of the bearer token (optional)
//   uids = [1001]                  # Unix-socket peers (SO_PEERCRED), optional
//   tls_cn = ["team-a.example"]    # TLS client-certificate subject CNs, optional
//   shared = "read"                # "none" (default), "read" or "publish"
//   dram_gib = 1.0                 # byte quotas per tier (0 or absent: none)
//   nvme_gib = 4.0
//   hbm_gib = 0.0
//
// Keys are namespaced per tenant: the engine stores a client's key k as
// the first 16 bytes of SHA-256(salt || k), with salt = SHA-256 of a fixed
// label and the tenant's name (the same on every node, so the stored keys
// that cluster peers exchange agree). A client that sends another tenant's
// key reaches a different stored key: a miss. The shared namespace (salt
// from a fixed label alone) holds public prefixes: a "read" tenant's reads
// fall back to it per key, a "publish" tenant reads and writes only there.
//
// Without a tenants file the daemon has one tenant, "default", whose keys
// are stored as sent, without quotas: it behaves as if tenancy did not
// exist.
#ifndef KVTIER_SERVER_TENANTS_H_
#define KVTIER_SERVER_TENANTS_H_

#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/hash.h"
#include "tiering/placement_engine.h"

namespace grpc {
class AuthContext;
}

namespace kvtier::server {

// What a tenant may do with the shared namespace.
enum class SharedAccess : uint8_t {
  kNone = 0,     // its own namespace only
  kRead = 1,     // reads that miss its namespace fall back to the shared one
  kPublish = 2,  // reads, writes and deletes go to the shared namespace only
};

// One `[[tenant]]` table.
struct TenantSpec {
  std::string name;
  std::array<uint8_t, 32> token_sha256{};
  bool has_token = false;
  std::vector<uint32_t> uids;
  std::vector<std::string> tls_cns;
  SharedAccess shared = SharedAccess::kNone;
  // Byte quota per tier (tiering::TierKind index); 0: none.
  std::array<uint64_t, tiering::kNumTierKinds> quota_bytes{};
};

// Parses a tenants file's text. InvalidArgument (naming the tenant and the
// field) for a syntax error, an unknown key, a value of the wrong type or
// range, a name, token, uid or CN used twice, a token that is not 64 hex
// digits, or a file without tenants.
absl::StatusOr<std::vector<TenantSpec>> ParseTenants(std::string_view toml_text);
// Reads and parses the file at `path` (at most 1 MiB). NotFound if it does
// not exist; ParseTenants' errors otherwise.
absl::StatusOr<std::vector<TenantSpec>> LoadTenantsFile(const std::string& path);

// A tenant as the daemon serves it. Its counters are thread-safe.
class Tenant {
 public:
  Tenant(TenantSpec spec, tiering::TenantId id, bool namespaced);

  const std::string& name() const { return spec_.name; }
  const TenantSpec& spec() const { return spec_; }
  // Its id in the placement engine (PutOptions::tenant).
  tiering::TenantId id() const { return id_; }

  // The stored key of client key `k` for a write (put, commit) or a delete.
  Hash128 WriteKey(const Hash128& k) const;
  // The stored key of `k` for a read (lookup, plan, get, pin, prefetch): the
  // tenant's own; for a kRead tenant, the shared namespace's when the
  // tenant's own is not stored on this node.
  Hash128 ReadKey(const Hash128& k, tiering::PlacementEngine* engine) const;
  // ReadKey of every key, in place (nothing to do for the one tenant of a
  // daemon without a tenants file).
  void MapReadKeys(std::span<Hash128> keys, tiering::PlacementEngine* engine) const;

  // Counts a read's outcome: a hit (OK), a miss (NotFound), else nothing.
  void CountRead(const absl::Status& st) const;
  // Counts a put's outcome: a put (OK) or a quota rejection (ResourceExhausted).
  void CountPut(const absl::Status& st) const;
  uint64_t hits() const { return hits_.load(std::memory_order_relaxed); }
  uint64_t misses() const { return misses_.load(std::memory_order_relaxed); }
  uint64_t puts() const { return puts_.load(std::memory_order_relaxed); }
  uint64_t put_rejections() const { return put_rejections_.load(std::memory_order_relaxed); }

 private:
  const TenantSpec spec_;
  const tiering::TenantId id_;
  const bool namespaced_;
  std::array<uint8_t, 32> salt_{};
  mutable std::atomic<uint64_t> hits_{0}, misses_{0}, puts_{0}, put_rejections_{0};
};

// Every tenant of the daemon and the lookups from a client's identity.
// Thread-safe (immutable after Create).
class TenantRegistry {
 public:
  // The registry of `specs` (engine ids 1..n in order; 0 is left to chunks
  // of no known tenant). REQUIRES: specs passed ParseTenants' checks.
  explicit TenantRegistry(std::vector<TenantSpec> specs);
  // The registry without a tenants file: one tenant, "default", id 0, keys
  // stored as sent.
  TenantRegistry();

  // Whether a tenants file configured the tenants.
  bool configured() const { return configured_; }
  // The tenant of a bearer token; nullptr if none. The token's SHA-256 is
  // compared with every tenant's in constant time (no early exit).
  const Tenant* ByToken(std::string_view token) const;
  // The tenant of an "authorization: Bearer <token>" value; nullptr if none.
  const Tenant* ByBearer(std::string_view authorization) const;
  const Tenant* ByUid(uint32_t uid) const;
  // The tenant of a TLS client identity (the certificate's subject CN).
  const Tenant* ByTlsIdentity(std::string_view cn) const;
  // ByTlsIdentity of the peer's certificate subject CN in `ctx`
  // (GRPC_X509_CN_PROPERTY_NAME); nullptr without one.
  const Tenant* ByAuthContext(const grpc::AuthContext& ctx) const;
  // Without a tenants file, the one tenant.
  const Tenant* only() const { return configured_ ? nullptr : tenants_[0].get(); }

  std::span<const std::unique_ptr<Tenant>> tenants() const { return tenants_; }
  // PlacementEngineOptions::tenant_quotas for these tenants (index = engine
  // id); empty without a tenants file.
  std::vector<std::array<uint64_t, tiering::kNumTierKinds>> EngineQuotas() const;

 private:
  bool configured_ = false;
  std::vector<std::unique_ptr<Tenant>> tenants_;
  absl::flat_hash_map<uint32_t, const Tenant*> by_uid_;
  absl::flat_hash_map<std::string, const Tenant*> by_cn_;
};

}  // namespace kvtier::server

#endif  // KVTIER_SERVER_TENANTS_H_
