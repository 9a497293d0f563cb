// The shapes the CUDA kernels support, and the one dispatch from runtime
// sizes to template arguments (FlashInfer's DISPATCH_HEAD_DIM). A size is
// supported exactly when it is in these lists: the launchers' host checks
// (Check* below, run by ValidateGatherEncode / ValidateDecodeScatter /
// PagedDecodeAttention before anything launches) and the dispatch macros read
// the same lists, so a size is added or removed here and nowhere else.
//
//   head_dim    64, 128, 256       gather+encode, decode+scatter, attention
//   block size  8, 16, 32, 64      gather+encode, decode+scatter (a template
//                                  argument of the codec kernels)
//               any power of two   attention (a runtime shift, not a template
//                                  argument: CheckAttentionBlockSize)
//
// CUDA-free: the checks are built into kvtier_kernels_ref (dispatch.cc).
#ifndef KVTIER_KERNELS_DISPATCH_H_
#define KVTIER_KERNELS_DISPATCH_H_

#include <cstdint>
#include <string_view>

#include "absl/status/status.h"

// The lists, as X-macros: KVTIER_KERNEL_HEAD_DIMS(X, args...) expands to
// X(64, args...) X(128, args...) X(256, args...).
#define KVTIER_KERNEL_HEAD_DIMS(X, ...) X(64, __VA_ARGS__) X(128, __VA_ARGS__) X(256, __VA_ARGS__)
#define KVTIER_CODEC_BLOCK_SIZES(X, ...) \
  X(8, __VA_ARGS__) X(16, __VA_ARGS__) X(32, __VA_ARGS__) X(64, __VA_ARGS__)

#define KVTIER_DISPATCH_LIST_ENTRY_(VALUE, ...) VALUE,

namespace kvtier::kernels {

inline constexpr uint32_t kKernelHeadDims[] = {KVTIER_KERNEL_HEAD_DIMS(KVTIER_DISPATCH_LIST_ENTRY_)};
inline constexpr uint32_t kCodecBlockSizes[] = {
    KVTIER_CODEC_BLOCK_SIZES(KVTIER_DISPATCH_LIST_ENTRY_)};

// InvalidArgument "<prefix>head_dim = <v> is not supported (64, 128, 256)".
// Never OK: the dispatch macros return it for a value outside the list.
absl::Status UnsupportedHeadDim(uint32_t head_dim, std::string_view prefix = "");
// InvalidArgument "<prefix>block_size = <v> is not supported (8, 16, 32, 64)".
absl::Status UnsupportedCodecBlockSize(uint32_t block_size, std::string_view prefix = "");

// OK when the size is in its list; else the Unsupported* error above.
// `prefix` starts the message (e.g. "attention: ").
absl::Status CheckHeadDim(uint32_t head_dim, std::string_view prefix = "");
absl::Status CheckCodecBlockSize(uint32_t block_size, std::string_view prefix = "");
// OK when block_size is a power of two (0 is refused by ValidatePagedKvLayout
// before this runs); else InvalidArgument "<prefix>block_size = <v> must be a
// power of two".
absl::Status CheckAttentionBlockSize(uint32_t block_size, std::string_view prefix = "");

}  // namespace kvtier::kernels

// KVTIER_DISPATCH_HEAD_DIM(head_dim, HD, { body }) is an absl::Status
// expression: for a head_dim of the list it runs `body` with
// `constexpr int HD` set to it, and yields what `body` returns (OK when
// `body` falls off its end); for any other value it yields
// UnsupportedHeadDim(head_dim) without running `body`. `body` is host code
// that may `return` an absl::Status; it is the body of a lambda capturing by
// reference. KVTIER_DISPATCH_CODEC_BLOCK_SIZE likewise; the two nest:
//   return KVTIER_DISPATCH_HEAD_DIM(hd, HD, {
//     return KVTIER_DISPATCH_CODEC_BLOCK_SIZE(bs, BS, { Launch<HD, BS>(...); });
//   });
#define KVTIER_DISPATCH_CASE_(VALUE, NAME, ...) \
  case VALUE: {                                 \
    constexpr int NAME = VALUE;                 \
    __VA_ARGS__                                 \
  }                                             \
    return ::absl::OkStatus();

#define KVTIER_DISPATCH_HEAD_DIM(head_dim, NAME, ...)                   \
  [&]() -> ::absl::Status {                                             \
    switch (head_dim) {                                                 \
      KVTIER_KERNEL_HEAD_DIMS(KVTIER_DISPATCH_CASE_, NAME, __VA_ARGS__) \
    }                                                                   \
    return ::kvtier::kernels::UnsupportedHeadDim(head_dim);             \
  }()

#define KVTIER_DISPATCH_CODEC_BLOCK_SIZE(block_size, NAME, ...)          \
  [&]() -> ::absl::Status {                                              \
    switch (block_size) {                                                \
      KVTIER_CODEC_BLOCK_SIZES(KVTIER_DISPATCH_CASE_, NAME, __VA_ARGS__) \
    }                                                                    \
    return ::kvtier::kernels::UnsupportedCodecBlockSize(block_size);     \
  }()

#endif  // KVTIER_KERNELS_DISPATCH_H_
