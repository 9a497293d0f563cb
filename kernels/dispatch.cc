#include "kernels/dispatch.h"

#include <algorithm>
#include <iterator>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/strings.h"

namespace kvtier::kernels {
namespace {

template <size_t N>
bool InList(const uint32_t (&list)[N], uint32_t v) {
  return std::find(std::begin(list), std::end(list), v) != std::end(list);
}

}  // namespace

absl::Status UnsupportedHeadDim(uint32_t head_dim, std::string_view prefix) {
  return absl::InvalidArgumentError(absl::StrCat(AsAbsl(prefix), "head_dim = ", head_dim,
                                                 " is not supported (",
                                                 absl::StrJoin(kKernelHeadDims, ", "), ")"));
}

absl::Status UnsupportedCodecBlockSize(uint32_t block_size, std::string_view prefix) {
  return absl::InvalidArgumentError(absl::StrCat(AsAbsl(prefix), "block_size = ", block_size,
                                                 " is not supported (",
                                                 absl::StrJoin(kCodecBlockSizes, ", "), ")"));
}

absl::Status CheckHeadDim(uint32_t head_dim, std::string_view prefix) {
  if (InList(kKernelHeadDims, head_dim)) return absl::OkStatus();
  return UnsupportedHeadDim(head_dim, prefix);
}

absl::Status CheckCodecBlockSize(uint32_t block_size, std::string_view prefix) {
  if (InList(kCodecBlockSizes, block_size)) return absl::OkStatus();
  return UnsupportedCodecBlockSize(block_size, prefix);
}

absl::Status CheckAttentionBlockSize(uint32_t block_size, std::string_view prefix) {
  if ((block_size & (block_size - 1)) == 0) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(AsAbsl(prefix), "block_size = ", block_size, " must be a power of two"));
}

}  // namespace kvtier::kernels
