// Daemon metrics: request counts, errors by gRPC code, latency histograms per
// method, and byte counters, rendered with the engine's counters and tier
// usage in the Prometheus text format (docs/daemon.md "Metrics").
//
// Recording is lock-free (relaxed atomics); ServerMetrics is thread-safe.
#ifndef KVTIER_SERVER_METRICS_H_
#define KVTIER_SERVER_METRICS_H_

#include <array>
#include <atomic>
#include <cstdint>
#include <string>

#include "server/service.h"

namespace kvtier::server {

// The RPCs, in proto order; MethodName() names them (a test checks the table).
enum class Method : int {
  kLookup = 0,
  kAllocateSlot,
  kAbortSlot,
  kPut,
  kGet,
  kPrefetch,
  kPin,
  kRenew,
  kRelease,
  kDelete,
  kStats,
  kHealth,
  kCount,
};
const char* MethodName(Method m);

// Counters of the daemon; ServerMetricName() names them.
enum class ServerMetric : int {
  kBytesPutInline = 0,  // chunk bytes received in messages
  kBytesPutShm,         // chunk bytes committed from shared-memory slots
  kBytesGetInline,      // chunk bytes sent in messages
  kBytesGetShm,         // chunk bytes handed out through the pool
  kAuthFailures,        // TCP requests refused for a missing or wrong token
  kShmMaps,             // pool memfds passed to clients
  kCallsCancelled,      // gRPC calls cancelled at a deadline (write or stream idle timeout)
  kCount,
};
const char* ServerMetricName(ServerMetric m);

// Upper bounds (seconds) of the latency histogram buckets; +Inf is implied.
inline constexpr std::array<double, 12> kLatencyBuckets = {
    25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 100e-3, 1.0};
inline constexpr int kNumGrpcCodes = 17;

class ServerMetrics {
 public:
  // Records one finished request with its gRPC status code (0..16).
  void Record(Method m, int grpc_code, double seconds);
  void Add(ServerMetric m, uint64_t n = 1) {
    counters_[static_cast<int>(m)].fetch_add(n, std::memory_order_relaxed);
  }
  uint64_t Get(ServerMetric m) const { return counters_[static_cast<int>(m)].load(); }
  uint64_t Requests(Method m) const { return per_method_[static_cast<int>(m)].count.load(); }
  uint64_t Errors(Method m, int grpc_code) const {
    return per_method_[static_cast<int>(m)].codes[grpc_code].load();
  }

  // The whole exposition: these metrics, then `stats` (engine counters and
  // tier usage).
  std::string RenderPrometheus(const ServiceStats& stats) const;

 private:
  static constexpr int kMethods = static_cast<int>(Method::kCount);
  struct PerMethod {
    std::atomic<uint64_t> count{0};
    std::atomic<uint64_t> sum_ns{0};
    std::array<std::atomic<uint64_t>, kLatencyBuckets.size() + 1> buckets{};
    std::array<std::atomic<uint64_t>, kNumGrpcCodes> codes{};
  };
  std::array<PerMethod, kMethods> per_method_{};
  std::array<std::atomic<uint64_t>, static_cast<int>(ServerMetric::kCount)> counters_{};
};

// Name of a gRPC status code in Prometheus labels, e.g. "NOT_FOUND".
const char* GrpcCodeName(int code);

}  // namespace kvtier::server

#endif  // KVTIER_SERVER_METRICS_H_
