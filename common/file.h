// Whole-file helpers with Status errors. Reads are bounded: a file larger than
// the caller's limit is refused before any allocation.
#ifndef KVTIER_COMMON_FILE_H_
#define KVTIER_COMMON_FILE_H_

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace kvtier {

// Reads all of `path`. NotFound if it does not exist, InvalidArgument if it is
// not a regular file or is larger than `max_bytes`, Unavailable on I/O errors.
absl::StatusOr<std::vector<uint8_t>> ReadFileBytes(const std::string& path, uint64_t max_bytes);

// Writes `data` to `path` through a temporary file and rename, so a reader
// never sees a partial file.
absl::Status WriteFileAtomic(const std::string& path, std::span<const uint8_t> data);

// Maps an errno value to the Status code abseil's retry guidance suggests.
absl::Status ErrnoToStatus(int err, std::string_view what);

}  // namespace kvtier

#endif  // KVTIER_COMMON_FILE_H_
