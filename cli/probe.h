// `kvtier probe`: measures the bandwidth of this machine's links, so that
// `kvtier shortfall --links-file` can compare against measured numbers
// rather than datasheet presets.
//
// Every figure is bytes moved by one copy or read divided by its wall time,
// best of `repeats` runs, in decimal GB/s (1e9 bytes/s). A memcpy of N bytes
// counts N (the memory system moves at least 2N), matching how the model
// counts the KV bytes a link must carry.
#ifndef KVTIER_CLI_PROBE_H_
#define KVTIER_CLI_PROBE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "bandwidth/links.h"

namespace kvtier::cli {

struct ProbeOptions {
  // Directory of the disk test; created if missing. The test file is a
  // temporary file inside it, removed afterwards. Default: ./kvtier-data.
  std::string data_dir = "./kvtier-data";
  // Bytes per measured copy or read (rounded up to a MiB). Default: 256 MiB.
  uint64_t bytes = uint64_t{256} << 20;
  // Runs per measurement; the best is reported. Default: 3.
  int repeats = 3;
  // Measure the disk (O_DIRECT reads). Default: true.
  bool disk = true;
  // Measure GPU copies when a GPU is present. Default: true.
  bool gpu = true;
};

struct ProbeReport {
  std::vector<bandwidth::Link> links;  // measured, in GB/s
  std::vector<std::string> skipped;    // "what: why" for each measurement not made
};

// Runs every enabled measurement. A measurement that cannot run here (no
// GPU, a filesystem without O_DIRECT) is listed in `skipped`, not an error.
// InvalidArgument for bad options; the error of creating data_dir otherwise.
absl::StatusOr<ProbeReport> RunProbe(const ProbeOptions& options);

}  // namespace kvtier::cli

#endif  // KVTIER_CLI_PROBE_H_
