#include "server/metrics.h"

#include <cstdio>

#include "absl/strings/str_cat.h"
#include "tiering/tier.h"

namespace kvtier::server {

const char* MethodName(Method m) {
  static constexpr const char* kNames[] = {
      "lookup", "allocate_slot", "abort_slot", "put",     "get",   "prefetch",
      "pin",    "renew",         "release",    "delete",  "stats", "health"};
  static_assert(sizeof(kNames) / sizeof(kNames[0]) == static_cast<int>(Method::kCount));
  int i = static_cast<int>(m);
  return i >= 0 && i < static_cast<int>(Method::kCount) ? kNames[i] : "unknown";
}

const char* ServerMetricName(ServerMetric m) {
  static constexpr const char* kNames[] = {"bytes_put_inline", "bytes_put_shm", "bytes_get_inline",
                                           "bytes_get_shm",    "auth_failures", "shm_maps",
                                           "calls_cancelled"};
  static_assert(sizeof(kNames) / sizeof(kNames[0]) == static_cast<int>(ServerMetric::kCount));
  int i = static_cast<int>(m);
  return i >= 0 && i < static_cast<int>(ServerMetric::kCount) ? kNames[i] : "unknown";
}

const char* GrpcCodeName(int code) {
  static constexpr const char* kNames[kNumGrpcCodes] = {
      "OK",           "CANCELLED",          "UNKNOWN",        "INVALID_ARGUMENT",
      "DEADLINE_EXCEEDED", "NOT_FOUND",     "ALREADY_EXISTS", "PERMISSION_DENIED",
      "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION", "ABORTED", "OUT_OF_RANGE",
      "UNIMPLEMENTED", "INTERNAL",          "UNAVAILABLE",    "DATA_LOSS",
      "UNAUTHENTICATED"};
  return code >= 0 && code < kNumGrpcCodes ? kNames[code] : "UNKNOWN";
}

void ServerMetrics::Record(Method m, int grpc_code, double seconds) {
  PerMethod& p = per_method_[static_cast<int>(m)];
  p.count.fetch_add(1, std::memory_order_relaxed);
  p.sum_ns.fetch_add(static_cast<uint64_t>(seconds * 1e9), std::memory_order_relaxed);
  size_t b = 0;
  while (b < kLatencyBuckets.size() && seconds > kLatencyBuckets[b]) ++b;
  p.buckets[b].fetch_add(1, std::memory_order_relaxed);
  if (grpc_code < 0 || grpc_code >= kNumGrpcCodes) grpc_code = 2;  // UNKNOWN
  p.codes[grpc_code].fetch_add(1, std::memory_order_relaxed);
}

namespace {
std::string Num(double v) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.9g", v);
  return buf;
}
}  // namespace

std::string ServerMetrics::RenderPrometheus(const ServiceStats& stats) const {
  std::string out;
  absl::StrAppend(&out, "# HELP kvtier_requests_total Requests served, by method.\n",
                  "# TYPE kvtier_requests_total counter\n");
  for (int i = 0; i < kMethods; ++i) {
    absl::StrAppend(&out, "kvtier_requests_total{method=\"", MethodName(static_cast<Method>(i)),
                    "\"} ", per_method_[i].count.load(), "\n");
  }
  absl::StrAppend(&out, "# HELP kvtier_request_errors_total Failed requests, by method and gRPC code.\n",
                  "# TYPE kvtier_request_errors_total counter\n");
  for (int i = 0; i < kMethods; ++i) {
    for (int c = 1; c < kNumGrpcCodes; ++c) {
      uint64_t n = per_method_[i].codes[c].load();
      if (n == 0) continue;
      absl::StrAppend(&out, "kvtier_request_errors_total{method=\"",
                      MethodName(static_cast<Method>(i)), "\",code=\"", GrpcCodeName(c), "\"} ", n,
                      "\n");
    }
  }
  absl::StrAppend(&out, "# HELP kvtier_request_latency_seconds Request latency, by method.\n",
                  "# TYPE kvtier_request_latency_seconds histogram\n");
  for (int i = 0; i < kMethods; ++i) {
    const char* name = MethodName(static_cast<Method>(i));
    uint64_t cum = 0;
    for (size_t b = 0; b <= kLatencyBuckets.size(); ++b) {
      cum += per_method_[i].buckets[b].load();
      std::string le = b < kLatencyBuckets.size() ? Num(kLatencyBuckets[b]) : "+Inf";
      absl::StrAppend(&out, "kvtier_request_latency_seconds_bucket{method=\"", name, "\",le=\"", le,
                      "\"} ", cum, "\n");
    }
    absl::StrAppend(&out, "kvtier_request_latency_seconds_sum{method=\"", name, "\"} ",
                    Num(per_method_[i].sum_ns.load() / 1e9), "\n");
    absl::StrAppend(&out, "kvtier_request_latency_seconds_count{method=\"", name, "\"} ",
                    per_method_[i].count.load(), "\n");
  }
  for (int i = 0; i < static_cast<int>(ServerMetric::kCount); ++i) {
    const char* name = ServerMetricName(static_cast<ServerMetric>(i));
    absl::StrAppend(&out, "# TYPE kvtier_", name, "_total counter\nkvtier_", name, "_total ",
                    counters_[i].load(), "\n");
  }
  for (const auto& [name, value] : stats.counters) {
    absl::StrAppend(&out, "# TYPE kvtier_engine_", name, "_total counter\nkvtier_engine_", name,
                    "_total ", value, "\n");
  }
  struct Gauge {
    const char* name;
    const char* help;
  };
  static constexpr Gauge kTierGauges[] = {
      {"kvtier_tier_capacity_bytes", "Hard capacity of the tier."},
      {"kvtier_tier_used_bytes", "Bytes allocated in the tier."},
      {"kvtier_tier_chunks", "Objects stored in the tier."},
      {"kvtier_tier_read_bytes_per_second", "Measured read bandwidth of the tier."},
      {"kvtier_tier_write_bytes_per_second", "Measured write bandwidth of the tier."},
      {"kvtier_tier_ready_bytes",
       "Capacity of the tier that can be allocated now; below the capacity while the DRAM pool "
       "is populated behind startup."}};
  for (int g = 0; g < 6; ++g) {
    absl::StrAppend(&out, "# HELP ", kTierGauges[g].name, " ", kTierGauges[g].help, "\n# TYPE ",
                    kTierGauges[g].name, " gauge\n");
    for (const tiering::TierUsage& u : stats.tiers) {
      double v = g == 0   ? static_cast<double>(u.capacity_bytes)
                 : g == 1 ? static_cast<double>(u.used_bytes)
                 : g == 2 ? static_cast<double>(u.objects)
                 : g == 3 ? u.bandwidth.read_bytes_per_s
                 : g == 4 ? u.bandwidth.write_bytes_per_s
                          : static_cast<double>(u.ready_bytes);
      absl::StrAppend(&out, kTierGauges[g].name, "{tier=\"", tiering::TierName(u.kind), "\"} ",
                      Num(v), "\n");
    }
  }
  if (stats.tenants.empty()) return out;
  // Per tenant (with a tenants file). Tenant names are [A-Za-z0-9_.-], so
  // they need no escaping in a label.
  absl::StrAppend(&out,
                  "# HELP kvtier_tenant_bytes Bytes of the tenant's chunks in the tier.\n"
                  "# TYPE kvtier_tenant_bytes gauge\n");
  for (const TenantStats& t : stats.tenants) {
    for (int k = 0; k < tiering::kNumTierKinds; ++k) {
      if (k == static_cast<int>(tiering::TierKind::kRemote)) continue;
      absl::StrAppend(&out, "kvtier_tenant_bytes{tenant=\"", t.name, "\",tier=\"",
                      tiering::TierName(static_cast<tiering::TierKind>(k)), "\"} ", t.usage.bytes[k],
                      "\n");
    }
  }
  struct TenantCounter {
    const char* name;
    const char* help;
    uint64_t (*value)(const TenantStats&);
  };
  static constexpr TenantCounter kTenantCounters[] = {
      {"kvtier_tenant_hits_total", "Reads of the tenant that found their chunk.",
       [](const TenantStats& t) { return t.hits; }},
      {"kvtier_tenant_misses_total", "Reads of the tenant that missed.",
       [](const TenantStats& t) { return t.misses; }},
      {"kvtier_tenant_puts_total", "Puts of the tenant that were stored.",
       [](const TenantStats& t) { return t.puts; }},
      {"kvtier_tenant_put_rejections_total", "Puts of the tenant refused as resource exhausted.",
       [](const TenantStats& t) { return t.put_rejections; }},
      {"kvtier_tenant_evictions_total", "Objects of the tenant evicted from a tier.",
       [](const TenantStats& t) { return t.usage.evictions; }},
      {"kvtier_tenant_quota_rejections_total", "Stores of the tenant's chunks refused at its quota.",
       [](const TenantStats& t) { return t.usage.quota_rejections; }}};
  for (const TenantCounter& c : kTenantCounters) {
    absl::StrAppend(&out, "# HELP ", c.name, " ", c.help, "\n# TYPE ", c.name, " counter\n");
    for (const TenantStats& t : stats.tenants) {
      absl::StrAppend(&out, c.name, "{tenant=\"", t.name, "\"} ", c.value(t), "\n");
    }
  }
  return out;
}

}  // namespace kvtier::server
