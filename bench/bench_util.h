// Small helpers shared by the benchmarks: timing, the memcpy baseline, and
// the machine description every result carries.
#ifndef KVTIER_BENCH_BENCH_UTIL_H_
#define KVTIER_BENCH_BENCH_UTIL_H_

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

namespace kvtier::bench {

// Best-of-`reps` wall time of fn() in seconds (best, not mean: the least
// disturbed run is the closest to what the code can do).
inline double BestSeconds(int reps, const std::function<void()>& fn) {
  double best = 1e30;
  for (int i = 0; i < reps; ++i) {
    auto t0 = std::chrono::steady_clock::now();
    fn();
    auto t1 = std::chrono::steady_clock::now();
    best = std::min(best, std::chrono::duration<double>(t1 - t0).count());
  }
  return best;
}

// memcpy GB/s (decimal) of `bytes` between two pre-faulted buffers.
inline double MemcpyGBps(size_t bytes, int reps) {
  std::vector<uint8_t> src(bytes, 1), dst(bytes, 0);
  double s = BestSeconds(reps, [&] {
    std::memcpy(dst.data(), src.data(), bytes);
    asm volatile("" : : "r"(dst.data()) : "memory");
  });
  return bytes / s / 1e9;
}

// "model name, N cores" from /proc/cpuinfo, for the results file.
inline std::string CpuName() {
  std::ifstream in("/proc/cpuinfo");
  std::string line, name = "unknown cpu";
  while (std::getline(in, line)) {
    if (line.rfind("model name", 0) == 0) {
      name = line.substr(line.find(':') + 2);
      break;
    }
  }
  return name + ", " + std::to_string(sysconf(_SC_NPROCESSORS_ONLN)) + " cores";
}

// Writes a benchmark's JSON result to `path` ("" writes nothing). Returns
// false if the file cannot be written.
inline bool WriteJson(const std::string& path, const std::string& json) {
  if (path.empty()) return true;
  std::ofstream out(path);
  out << json;
  return static_cast<bool>(out);
}

// The 1/5/15-minute load averages: other work on the machine during a run.
inline std::string LoadAverage() {
  std::ifstream in("/proc/loadavg");
  std::string a, b, c;
  in >> a >> b >> c;
  return a + " " + b + " " + c;
}

}  // namespace kvtier::bench

#endif  // KVTIER_BENCH_BENCH_UTIL_H_
