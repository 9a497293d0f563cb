#include "kernels/dispatch.h"

#include <cstdint>
#include <string>

#include "gtest/gtest.h"

namespace kvtier::kernels {
namespace {

TEST(KernelShapes, CheckHeadDimAcceptsExactlyTheList) {
  for (uint32_t hd : kKernelHeadDims) EXPECT_TRUE(CheckHeadDim(hd).ok()) << hd;
  for (uint32_t hd : {0u, 8u, 32u, 96u, 112u, 192u, 512u}) {
    EXPECT_EQ(CheckHeadDim(hd).code(), absl::StatusCode::kInvalidArgument) << hd;
  }
}

TEST(KernelShapes, CheckCodecBlockSizeAcceptsExactlyTheList) {
  for (uint32_t bs : kCodecBlockSizes) EXPECT_TRUE(CheckCodecBlockSize(bs).ok()) << bs;
  for (uint32_t bs : {0u, 1u, 4u, 24u, 128u}) {
    EXPECT_EQ(CheckCodecBlockSize(bs).code(), absl::StatusCode::kInvalidArgument) << bs;
  }
}

TEST(KernelShapes, AttentionBlockSizeIsAnyPowerOfTwo) {
  for (uint32_t bs : {1u, 2u, 16u, 64u, 256u, 1u << 20}) {
    EXPECT_TRUE(CheckAttentionBlockSize(bs).ok()) << bs;
  }
  for (uint32_t bs : {3u, 24u, 48u}) {
    EXPECT_EQ(CheckAttentionBlockSize(bs).code(), absl::StatusCode::kInvalidArgument) << bs;
  }
}

TEST(KernelShapes, UnsupportedSizeNamesTheValueAndTheSupportedOnes) {
  EXPECT_EQ(std::string(CheckHeadDim(96, "attention: ").message()),
            "attention: head_dim = 96 is not supported (64, 128, 256)");
  EXPECT_EQ(std::string(CheckCodecBlockSize(24).message()),
            "block_size = 24 is not supported (8, 16, 32, 64)");
  EXPECT_EQ(std::string(CheckAttentionBlockSize(24, "attention: ").message()),
            "attention: block_size = 24 must be a power of two");
}

TEST(KernelDispatch, HeadDimBecomesATemplateArgument) {
  for (uint32_t hd : kKernelHeadDims) {
    int seen = 0;
    const absl::Status st = KVTIER_DISPATCH_HEAD_DIM(hd, HD, {
      static_assert(HD > 0, "HD is a constant expression");
      seen = HD;
    });
    EXPECT_TRUE(st.ok()) << st;
    EXPECT_EQ(seen, static_cast<int>(hd));
  }
}

TEST(KernelDispatch, UnsupportedHeadDimSkipsTheBody) {
  int runs = 0;
  const absl::Status st = KVTIER_DISPATCH_HEAD_DIM(96u, HD, { runs += HD; });
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(std::string(st.message()), "head_dim = 96 is not supported (64, 128, 256)");
  EXPECT_EQ(runs, 0);
}

TEST(KernelDispatch, NestedDispatchReturnsTheBodysStatus) {
  int seen_hd = 0, seen_bs = 0;
  const absl::Status ok = KVTIER_DISPATCH_HEAD_DIM(256u, HD, {
    return KVTIER_DISPATCH_CODEC_BLOCK_SIZE(32u, BS, {
      seen_hd = HD;
      seen_bs = BS;
    });
  });
  EXPECT_TRUE(ok.ok()) << ok;
  EXPECT_EQ(seen_hd, 256);
  EXPECT_EQ(seen_bs, 32);

  const absl::Status bad_bs = KVTIER_DISPATCH_HEAD_DIM(64u, HD, {
    return KVTIER_DISPATCH_CODEC_BLOCK_SIZE(24u, BS, { seen_bs = BS + HD; });
  });
  EXPECT_EQ(bad_bs.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(std::string(bad_bs.message()), "block_size = 24 is not supported (8, 16, 32, 64)");
  EXPECT_EQ(seen_bs, 32);

  const absl::Status body = KVTIER_DISPATCH_HEAD_DIM(128u, HD, {
    if (HD == 128) return absl::FailedPreconditionError("from the body");
  });
  EXPECT_EQ(body.code(), absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace kvtier::kernels
