// What tenancy costs a request: the daemon maps every client key to its
// tenant's stored key (server/tenants.h, docs/tenancy.md) before the engine
// sees it. Per key, best of --reps over a batch of 1024 keys:
//   baseline: XXH3-128 of the 16-byte key (the hash chunk keys are made of)
//   write key: SHA-256(salt || key), one compression (puts, deletes)
//   read key, "none" tenant: the same (lookups, gets)
//   read key, "read" tenant, key in neither namespace: two SHA-256 and two
//     lookups in the engine's table (the shared-namespace fallback)
//
// Usage: tenant_keys_bench [--reps N]
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "bench/bench_util.h"
#include "common/hash.h"
#include "server/tenants.h"
#include "tiering/dram_tier.h"
#include "tiering/placement_engine.h"

namespace kvtier {
namespace {

int Main(int argc, char** argv) {
  int reps = 50;
  for (int i = 1; i + 1 < argc; ++i) {
    if (std::strcmp(argv[i], "--reps") == 0) reps = std::max(1, std::atoi(argv[i + 1]));
  }
  constexpr size_t kKeys = 1024;
  std::vector<Hash128> keys(kKeys);
  for (size_t i = 0; i < kKeys; ++i) keys[i] = Hash128::Of("bench-key-" + std::to_string(i), 7);

  auto specs = server::ParseTenants(
      "[[tenant]]\nname = \"plain\"\n[[tenant]]\nname = \"reader\"\nshared = \"read\"\n");
  if (!specs.ok()) {
    std::fprintf(stderr, "%s\n", std::string(specs.status().message()).c_str());
    return 1;
  }
  server::TenantRegistry tenants(*std::move(specs));
  const server::Tenant& plain = *tenants.tenants()[0];
  const server::Tenant& reader = *tenants.tenants()[1];

  tiering::EngineTiers tiers;
  tiers.dram = tiering::DramTier::Open({.capacity_bytes = 64 << 20, .populate = false}).value();
  auto engine = tiering::PlacementEngine::Create({.maintenance_interval_ms = 0}, std::move(tiers));
  if (!engine.ok()) {
    std::fprintf(stderr, "%s\n", std::string(engine.status().message()).c_str());
    return 1;
  }
  tiering::PlacementEngine* e = engine->get();

  std::vector<Hash128> out(kKeys);
  const double base = bench::BestSeconds(reps, [&] {
    for (size_t i = 0; i < kKeys; ++i) out[i] = Hash128::Of(keys[i].bytes, 7);
  });
  const double write = bench::BestSeconds(reps, [&] {
    for (size_t i = 0; i < kKeys; ++i) out[i] = plain.WriteKey(keys[i]);
  });
  const double read_plain = bench::BestSeconds(reps, [&] {
    out = keys;
    plain.MapReadKeys(out, e);
  });
  const double read_shared = bench::BestSeconds(reps, [&] {
    out = keys;
    reader.MapReadKeys(out, e);
  });

  std::printf("tenant key mapping, %zu keys, best of %d (%s; load %s)\n", kKeys, reps,
              bench::CpuName().c_str(), bench::LoadAverage().c_str());
  auto row = [&](const char* what, double s) {
    std::printf("  %-44s %8.1f ns/key  %8.1f us/batch\n", what, s * 1e9 / kKeys, s * 1e6);
  };
  row("baseline: XXH3-128 of the key", base);
  row("write key (SHA-256 of salt and key)", write);
  row("read key, tenant without shared namespace", read_plain);
  row("read key, shared = read, key stored nowhere", read_shared);
  return 0;
}

}  // namespace
}  // namespace kvtier

int main(int argc, char** argv) { return kvtier::Main(argc, argv); }
