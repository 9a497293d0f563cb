// The raw io_uring baseline the NVMe benchmarks compare against: the block
// requests that move one extent in requests of at most `max_io` bytes, to
// submit through a tiering::BlockDevice opened on the same file (O_DIRECT,
// the same queue depth as the tier), the way NvmeTier splits a chunk.
#ifndef KVTIER_BENCH_RAW_IO_H_
#define KVTIER_BENCH_RAW_IO_H_

#include <algorithm>
#include <cstdint>
#include <vector>

#include "tiering/io.h"

namespace kvtier::bench {

// Appends to `out` the requests for `bytes` at device offset `offset` into
// `buf`. REQUIRES: offset, bytes and buf block-aligned.
inline void AppendRawRequests(tiering::IoRequest::Op op, uint8_t* buf, uint64_t offset,
                              uint64_t bytes, uint64_t max_io,
                              std::vector<tiering::IoRequest>* out) {
  for (uint64_t d = 0; d < bytes; d += max_io) {
    out->push_back({op, offset + d, buf + d, std::min(max_io, bytes - d)});
  }
}

}  // namespace kvtier::bench

#endif  // KVTIER_BENCH_RAW_IO_H_
