// The read rate of the disk under a directory, measured with O_DIRECT reads
// of a file written for the purpose: what `kvtier probe` reports as
// disk-odirect, and what the NVMe tier prices its loads at before it has read
// anything of its own (NvmeTierOptions::read_probe_bytes).
#ifndef KVTIER_TIERING_DISK_PROBE_H_
#define KVTIER_TIERING_DISK_PROBE_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"

namespace kvtier::tiering {

struct DiskReadProbe {
  uint64_t bytes = 0;  // read per repeat
  int64_t micros = 0;  // the fastest repeat's wall time (>= 1)
  double bytes_per_s() const { return bytes * 1e6 / micros; }
};

// Concurrent readers, and the size of each read and write request.
inline constexpr int kDiskProbeThreads = 4;
inline constexpr uint64_t kDiskProbeIoBytes = uint64_t{4} << 20;

// Writes `bytes` (rounded up to whole requests) of incompressible data to a
// temporary file in `dir`, syncs it, then reads it back with O_DIRECT
// (bypassing the page cache) from kDiskProbeThreads threads, each reading
// its contiguous share in kDiskProbeIoBytes requests; best of `repeats`. The
// file is removed on every path. InvalidArgument for a zero size or repeat
// count; FailedPrecondition when the filesystem refuses O_DIRECT (tmpfs);
// the I/O error otherwise.
absl::StatusOr<DiskReadProbe> ProbeDiskRead(const std::string& dir, uint64_t bytes, int repeats);

// A fixed-seed, incompressible fill (xorshift64), so that no layer below
// can shortcut zero pages or compress.
void FillIncompressible(uint8_t* p, uint64_t bytes);

}  // namespace kvtier::tiering

#endif  // KVTIER_TIERING_DISK_PROBE_H_
