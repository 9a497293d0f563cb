// Minimal NumPy .npy reader and writer for the CLI: 16-bit element arrays
// (float16 '<f2', or uint16 '<u2' holding bfloat16 bits), C order.
// The reader treats its input as hostile: every length is bounds-checked and
// each failure names what is wrong.
#ifndef KVTIER_CLI_NPY_H_
#define KVTIER_CLI_NPY_H_

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace kvtier::npy {

struct Array16 {
  std::string descr;            // "<f2" or "<u2"
  std::vector<uint64_t> shape;
  std::vector<uint16_t> data;   // element bits, C order
};

// Largest header a reader accepts (NumPy itself writes < 4 KiB headers).
inline constexpr size_t kMaxHeaderBytes = 1 << 16;

// Parses a .npy file image. InvalidArgument for a bad magic, unsupported
// version, malformed or oversized header, a dtype other than '<f2'/'<u2'
// (or their native '=' forms), Fortran order, or a payload whose length does
// not match the shape.
absl::StatusOr<Array16> Parse(std::span<const uint8_t> file);

// Serializes a version 1.0 .npy image. REQUIRES: descr is "<f2" or "<u2" and
// data.size() equals the product of shape.
std::vector<uint8_t> Serialize(const Array16& array);

}  // namespace kvtier::npy

#endif  // KVTIER_CLI_NPY_H_
