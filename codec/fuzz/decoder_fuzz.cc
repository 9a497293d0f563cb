// libFuzzer target over the chunk decoder: any byte string must give either a
// decoded chunk or InvalidArgument/DataLoss, never a crash, a sanitizer
// report or another status code.
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "codec/chunk.h"
#include "codec/codec.h"

namespace {

// Fuzzed bytes rarely carry a valid checksum; re-seal a copy so the field
// checks and the decoder behind them are reached too.
void DecodeOne(const uint8_t* data, size_t size) {
  auto r = kvtier::codec::DecodeChunk({data, size});
  if (r.ok()) {
    const auto& g = r->header.spec.geometry;
    if (r->k.size() != g.layer_elements() * g.num_layers) std::abort();
    return;
  }
  auto code = r.status().code();
  if (code != absl::StatusCode::kInvalidArgument && code != absl::StatusCode::kDataLoss) std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  DecodeOne(data, size);
  if (size >= kvtier::codec::kHeaderSize && size <= (1u << 20)) {
    std::vector<uint8_t> copy(data, data + size);
    if (kvtier::codec::SealChunk(copy).ok()) DecodeOne(copy.data(), copy.size());
  }
  return 0;
}
