#include "kernels/paged_layout.h"

#include <vector>

#include "gtest/gtest.h"

namespace kvtier::kernels {
namespace {

using codec::DType;

// Row-major index of a multi-dimensional array, written out by hand per layout
// so the descriptor's strides are checked against the engines' shapes.
int64_t RowMajor(std::initializer_list<std::pair<int64_t, int64_t>> idx_and_dim) {
  int64_t off = 0;
  for (auto [i, n] : idx_and_dim) off = off * n + i;
  return off;
}

TEST(PagedKvLayout, StridesMatchEveryEngineShape) {
  const uint32_t NB = 7, BS = 16, H = 3, D = 64;
  for (CacheLayout kind :
       {CacheLayout::kVllmFlashAttnNHD, CacheLayout::kVllmFlashAttnHND,
        CacheLayout::kVllmFlashInferNHD, CacheLayout::kVllmFlashInferHND,
        CacheLayout::kSeparateNHD, CacheLayout::kSeparateHND}) {
    auto d = MakePagedKvLayout(kind, 2, NB, BS, H, D, DType::kBF16, DType::kBF16);
    ASSERT_TRUE(d.ok()) << d.status();
    for (uint32_t b : {0u, 3u, NB - 1})
      for (uint32_t s : {0u, 5u, BS - 1})
        for (uint32_t h : {0u, H - 1})
          for (uint32_t e : {0u, 9u, D - 1}) {
            int64_t k = 0, v = 0;
            switch (kind) {
              case CacheLayout::kVllmFlashAttnNHD:
                k = RowMajor({{0, 2}, {b, NB}, {s, BS}, {h, H}, {e, D}});
                v = RowMajor({{1, 2}, {b, NB}, {s, BS}, {h, H}, {e, D}});
                break;
              case CacheLayout::kVllmFlashAttnHND:
                k = RowMajor({{0, 2}, {b, NB}, {h, H}, {s, BS}, {e, D}});
                v = RowMajor({{1, 2}, {b, NB}, {h, H}, {s, BS}, {e, D}});
                break;
              case CacheLayout::kVllmFlashInferNHD:
                k = RowMajor({{b, NB}, {0, 2}, {s, BS}, {h, H}, {e, D}});
                v = RowMajor({{b, NB}, {1, 2}, {s, BS}, {h, H}, {e, D}});
                break;
              case CacheLayout::kVllmFlashInferHND:
                k = RowMajor({{b, NB}, {0, 2}, {h, H}, {s, BS}, {e, D}});
                v = RowMajor({{b, NB}, {1, 2}, {h, H}, {s, BS}, {e, D}});
                break;
              case CacheLayout::kSeparateNHD:
                k = v = RowMajor({{b, NB}, {s, BS}, {h, H}, {e, D}});
                break;
              case CacheLayout::kSeparateHND:
                k = v = RowMajor({{b, NB}, {h, H}, {s, BS}, {e, D}});
                break;
            }
            EXPECT_EQ(d->k_elem(b, s, h, e), k) << CacheLayoutName(kind);
            EXPECT_EQ(d->v_elem(b, s, h, e), v) << CacheLayoutName(kind);
          }
    EXPECT_EQ(LayerTensorElements(kind, *d),
              (IsSeparate(kind) ? 1u : 2u) * uint64_t{NB} * BS * H * D);
  }
}

TEST(PagedKvLayout, CombinedLayoutWithTwoDtypesIsInvalidArgument) {
  auto d = MakePagedKvLayout(CacheLayout::kVllmFlashAttnNHD, 1, 4, 16, 2, 64, DType::kBF16,
                             DType::kFP8E4M3);
  EXPECT_EQ(d.status().code(), absl::StatusCode::kInvalidArgument);
  auto sep = MakePagedKvLayout(CacheLayout::kSeparateNHD, 1, 4, 16, 2, 64, DType::kBF16,
                               DType::kFP8E4M3);
  EXPECT_TRUE(sep.ok());
}

TEST(PagedKvLayout, ZeroSizeIsInvalidArgument) {
  EXPECT_EQ(MakePagedKvLayout(CacheLayout::kSeparateNHD, 1, 0, 16, 2, 64, DType::kBF16,
                              DType::kBF16)
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MakePagedKvLayout(CacheLayout::kSeparateNHD, 1, 4, 16, 2, 64, DType::kINT8,
                              DType::kBF16)
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(ValidatePagedKvLayout, RejectsNullPointersAndMisalignedStrides) {
  auto d = MakePagedKvLayout(CacheLayout::kSeparateNHD, 1, 4, 16, 2, 64, DType::kBF16,
                             DType::kFP8E4M3);
  ASSERT_TRUE(d.ok());
  void* p[1] = {nullptr};
  float* s[1] = {nullptr};
  PagedKvLayout x = *d;
  EXPECT_EQ(ValidatePagedKvLayout(x).code(), absl::StatusCode::kInvalidArgument);  // null arrays
  x.k_layers = p;
  x.v_layers = p;
  EXPECT_EQ(ValidatePagedKvLayout(x).code(), absl::StatusCode::kInvalidArgument);  // no V scales
  x.v_scale_layers = s;
  EXPECT_TRUE(ValidatePagedKvLayout(x).ok());
  x.stride_head = 12;
  EXPECT_EQ(ValidatePagedKvLayout(x).code(), absl::StatusCode::kInvalidArgument);
  x.stride_head = 64;
  x.head_dim = 60;
  EXPECT_EQ(ValidatePagedKvLayout(x).code(), absl::StatusCode::kInvalidArgument);
}

TEST(BlockSpan, LocatesTokensOfAnUnalignedRun) {
  BlockSpan span;
  span.first_slot = 5;
  EXPECT_EQ(span.list_index(0, 16), 0u);
  EXPECT_EQ(span.slot(0, 16), 5u);
  EXPECT_EQ(span.list_index(10, 16), 0u);
  EXPECT_EQ(span.slot(10, 16), 15u);
  EXPECT_EQ(span.list_index(11, 16), 1u);
  EXPECT_EQ(span.slot(11, 16), 0u);
}

TEST(ValidateBlockSpan, ChecksCountFirstSlotAndHostIds) {
  auto d = MakePagedKvLayout(CacheLayout::kSeparateNHD, 1, 4, 16, 2, 64, DType::kBF16,
                             DType::kBF16);
  ASSERT_TRUE(d.ok());
  std::vector<int32_t> ids = {3, 1, 2};
  BlockSpan span{ids.data(), ids.data(), 3, 5};
  EXPECT_TRUE(ValidateBlockSpan(*d, span, 43).ok());  // 5 + 43 = 48 = 3 blocks
  EXPECT_EQ(ValidateBlockSpan(*d, span, 44).code(), absl::StatusCode::kInvalidArgument);
  ids[2] = 4;  // out of range
  EXPECT_EQ(ValidateBlockSpan(*d, span, 43).code(), absl::StatusCode::kInvalidArgument);
  ids[2] = -1;
  EXPECT_EQ(ValidateBlockSpan(*d, span, 43).code(), absl::StatusCode::kInvalidArgument);
  ids[2] = 0;
  span.first_slot = 16;
  EXPECT_EQ(ValidateBlockSpan(*d, span, 10).code(), absl::StatusCode::kInvalidArgument);
  span.first_slot = 0;
  span.block_ids = nullptr;
  EXPECT_EQ(ValidateBlockSpan(*d, span, 10).code(), absl::StatusCode::kInvalidArgument);
}

TEST(ValidateLayerRange, AcceptsNonEmptyRangesWithinTheLayers) {
  EXPECT_TRUE(ValidateLayerRange(LayerRange{}, 32).ok());
  EXPECT_TRUE(ValidateLayerRange(LayerRange{31, 32}, 32).ok());
  EXPECT_TRUE(ValidateLayerRange(LayerRange{5, LayerRange::kAllLayers}, 32).ok());
  EXPECT_EQ(LayerRange{}.End(32), 32u);
  EXPECT_TRUE(LayerRange{}.IsAll(32));
  EXPECT_TRUE((LayerRange{0, 32}.IsAll(32)));
  EXPECT_FALSE((LayerRange{1, 32}.IsAll(32)));
  EXPECT_EQ(ValidateLayerRange(LayerRange{3, 3}, 32).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ValidateLayerRange(LayerRange{4, 3}, 32).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ValidateLayerRange(LayerRange{0, 33}, 32).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ValidateLayerRange(LayerRange{32, LayerRange::kAllLayers}, 32).code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvtier::kernels
