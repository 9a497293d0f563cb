#include "codec/codec.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "codec/test_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvtier::codec {
namespace {

using testing::DataOptions;
using testing::MakeKv;
using testing::MakeSpec;

constexpr SectionFormat kNone16{DType::kFP16, ScaleGranularity::kNone};

double RelativeError(const std::vector<uint16_t>& a, const std::vector<uint16_t>& b, DType t) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    double x = Load16(a[i], t), y = Load16(b[i], t);
    num += (x - y) * (x - y);
    den += x * x;
  }
  return std::sqrt(num / den);
}

// Every K/V format pair the format allows, with the engine dtype.
std::vector<std::pair<SectionFormat, SectionFormat>> AllPairs(DType native) {
  std::vector<SectionFormat> fmts = {{native, ScaleGranularity::kNone}};
  for (DType q : {DType::kFP8E4M3, DType::kINT8, DType::kINT4}) {
    for (ScaleGranularity g : {ScaleGranularity::kPerTensor, ScaleGranularity::kPerBlockHead,
                               ScaleGranularity::kPerTokenHead}) {
      fmts.push_back({q, g});
    }
  }
  std::vector<std::pair<SectionFormat, SectionFormat>> out;
  for (auto k : fmts) {
    for (auto v : fmts) out.push_back({k, v});
  }
  return out;
}

TEST(Codec, SixteenBitKeysAreBitExactForEveryPair) {
  for (DType native : {DType::kFP16, DType::kBF16}) {
    Geometry g{2, 3, 16, 37, 16};  // odd token count, partial last block
    auto k = MakeKv(g, native, {.seed = 5, .outlier_every = 7});
    auto v = MakeKv(g, native, {.seed = 6});
    for (auto [kf, vf] : AllPairs(native)) {
      if (IsQuantized(kf.dtype)) continue;
      auto chunk = EncodeChunk(MakeSpec(g, native, kf, vf), {k, v});
      ASSERT_TRUE(chunk.ok()) << chunk.status();
      auto dec = DecodeChunk(*chunk);
      ASSERT_TRUE(dec.ok()) << dec.status();
      EXPECT_EQ(dec->k, k);
    }
  }
}

TEST(Codec, Fp8ValuesMeetTheErrorBoundWithOutlierChannels) {
  for (DType native : {DType::kFP16, DType::kBF16}) {
    Geometry g{4, 8, 128, 256, 16};
    auto k = MakeKv(g, native, {.seed = 11, .outlier_every = 16, .outlier_scale = 20.0f});
    auto v = MakeKv(g, native, {.seed = 12, .outlier_every = 16, .outlier_scale = 20.0f});
    auto chunk = EncodeChunk(
        MakeSpec(g, native, {native, ScaleGranularity::kNone},
                 {DType::kFP8E4M3, ScaleGranularity::kPerBlockHead}),
        {k, v});
    ASSERT_TRUE(chunk.ok());
    auto dec = DecodeChunk(*chunk);
    ASSERT_TRUE(dec.ok());
    double err = RelativeError(v, dec->v, native);
    EXPECT_LE(err, 0.03) << DTypeName(native);
    EXPECT_GT(err, 0.0);
    EXPECT_EQ(dec->k, k);
  }
}

TEST(Codec, IntFormatsMeetTheirErrorBounds) {
  Geometry g{2, 4, 64, 64, 16};
  auto v = MakeKv(g, DType::kBF16, {.seed = 3});
  struct Case {
    SectionFormat f;
    double bound;
  } cases[] = {
      {{DType::kINT8, ScaleGranularity::kPerTokenHead}, 0.01},
      {{DType::kINT8, ScaleGranularity::kPerBlockHead}, 0.015},
      {{DType::kINT4, ScaleGranularity::kPerTokenHead}, 0.20},
      {{DType::kFP8E4M3, ScaleGranularity::kPerTensor}, 0.035},
  };
  for (const Case& c : cases) {
    auto chunk = EncodeChunk(MakeSpec(g, DType::kBF16, {DType::kBF16, ScaleGranularity::kNone}, c.f),
                             {v, v});
    ASSERT_TRUE(chunk.ok());
    auto dec = DecodeChunk(*chunk);
    ASSERT_TRUE(dec.ok());
    EXPECT_LE(RelativeError(v, dec->v, DType::kBF16), c.bound) << DTypeName(c.f.dtype);
  }
}

TEST(Codec, ReencodingDecodedDataIsByteIdenticalForEveryPair) {
  for (DType native : {DType::kFP16, DType::kBF16}) {
    Geometry g{2, 2, 8, 19, 8};
    auto k = MakeKv(g, native, {.seed = 21, .outlier_every = 5});
    auto v = MakeKv(g, native, {.seed = 22});
    for (auto [kf, vf] : AllPairs(native)) {
      auto spec = MakeSpec(g, native, kf, vf);
      auto first = EncodeChunk(spec, {k, v});
      ASSERT_TRUE(first.ok()) << first.status();
      auto dec = DecodeChunk(*first);
      ASSERT_TRUE(dec.ok());
      auto second = EncodeChunk(spec, {dec->k, dec->v});
      ASSERT_TRUE(second.ok());
      EXPECT_EQ(*first, *second) << DTypeName(native) << " K " << DTypeName(kf.dtype) << "/"
                                 << GranularityName(kf.granularity) << " V "
                                 << DTypeName(vf.dtype) << "/" << GranularityName(vf.granularity);
    }
  }
}

TEST(Codec, AllZeroInputEncodesWithUnitScalesAndDecodesToZero) {
  Geometry g{1, 2, 8, 16, 16};
  std::vector<uint16_t> zeros(g.layer_elements(), 0);
  for (auto [kf, vf] : AllPairs(DType::kFP16)) {
    auto chunk = EncodeChunk(MakeSpec(g, DType::kFP16, kf, vf), {zeros, zeros});
    ASSERT_TRUE(chunk.ok());
    auto h = ParseHeader(*chunk);
    ASSERT_TRUE(h.ok());
    if (IsQuantized(vf.dtype)) {
      float scale;
      std::memcpy(&scale, chunk->data() + h->layout.v_offset + h->layout.v.scale_offset(0), 4);
      EXPECT_EQ(scale, 1.0f);
    }
    auto dec = DecodeChunk(*chunk);
    ASSERT_TRUE(dec.ok());
    EXPECT_EQ(dec->k, zeros);
    EXPECT_EQ(dec->v, zeros);
    EXPECT_EQ(h->spec.flags, 0);
  }
}

TEST(Codec, NonFiniteInputIsFlaggedAndNeverSpreadsToFiniteValues) {
  Geometry g{1, 1, 8, 4, 4};  // one scale group per layer for block-head
  std::vector<uint16_t> v(g.layer_elements());
  for (size_t i = 0; i < v.size(); ++i) v[i] = FloatToFp16(static_cast<float>(i) - 10.0f);
  v[3] = 0x7E00;  // NaN
  v[5] = 0x7C00;  // +inf
  v[6] = 0xFC00;  // -inf
  for (DType q : {DType::kFP8E4M3, DType::kINT8, DType::kINT4}) {
    SectionFormat vf{q, ScaleGranularity::kPerBlockHead};
    auto chunk = EncodeChunk(MakeSpec(g, DType::kFP16, kNone16, vf), {v, v});
    ASSERT_TRUE(chunk.ok());
    auto h = ParseHeader(*chunk);
    ASSERT_TRUE(h.ok());
    EXPECT_EQ(h->spec.flags, kFlagNonFinite);
    auto dec = DecodeChunk(*chunk);
    ASSERT_TRUE(dec.ok());
    EXPECT_EQ(dec->k, v);  // 16-bit K keeps NaN and inf bit for bit
    float amax = 21.0f;    // largest finite |x|
    for (size_t i = 0; i < v.size(); ++i) {
      float x = Fp16ToFloat(dec->v[i]);
      if (i == 3) {
        if (q == DType::kFP8E4M3) {
          EXPECT_EQ(dec->v[i], kCanonicalNaN16);
        } else {
          EXPECT_EQ(x, 0.0f);  // INT formats have no NaN code
        }
        continue;
      }
      ASSERT_TRUE(std::isfinite(x)) << i << " " << DTypeName(q);
      if (i == 5) {
        EXPECT_EQ(x, amax);
      }
      if (i == 6) {
        EXPECT_EQ(x, -amax);
      }
    }
  }
}

TEST(Codec, HugeBf16ValuesDoNotOverflowScales) {
  Geometry g{1, 1, 4, 1, 1};
  std::vector<uint16_t> v = {0x7F7F, 0xFF7F, 0x0001, 0x0000};  // +-max bf16, min subnormal, 0
  auto chunk = EncodeChunk(MakeSpec(g, DType::kBF16, {DType::kBF16, ScaleGranularity::kNone},
                                    {DType::kFP8E4M3, ScaleGranularity::kPerTokenHead}),
                           {v, v});
  ASSERT_TRUE(chunk.ok());
  auto dec = DecodeChunk(*chunk);
  ASSERT_TRUE(dec.ok());
  EXPECT_EQ(dec->v[0], 0x7F7F);
  EXPECT_EQ(dec->v[1], 0xFF7F);
  EXPECT_EQ(dec->v[3], 0x0000);
}

TEST(Codec, RejectsMismatchedInputSizes) {
  Geometry g{1, 2, 8, 4, 4};
  std::vector<uint16_t> ok(g.layer_elements()), bad(g.layer_elements() - 1);
  auto spec = MakeSpec(g, DType::kFP16, kNone16, {DType::kFP8E4M3, ScaleGranularity::kPerBlockHead});
  EXPECT_EQ(EncodeChunk(spec, {ok, bad}).status().code(), absl::StatusCode::kInvalidArgument);
  std::vector<uint8_t> small(10);
  EXPECT_EQ(EncodeChunkInto(spec, {ok, ok}, small).code(), absl::StatusCode::kInvalidArgument);
}

TEST(Codec, DecodeRejectsCorruptedChunks) {
  Geometry g{1, 2, 8, 4, 4};
  auto k = MakeKv(g, DType::kFP16, {.seed = 1});
  auto chunk = EncodeChunk(
      MakeSpec(g, DType::kFP16, kNone16, {DType::kFP8E4M3, ScaleGranularity::kPerBlockHead}), {k, k});
  ASSERT_TRUE(chunk.ok());
  auto bad = *chunk;
  bad.back() ^= 1;
  EXPECT_EQ(DecodeChunk(bad).status().code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(DecodeChunk({chunk->data(), 100}).status().code(), absl::StatusCode::kInvalidArgument);
}

// K and V of `g` in token-major rows (SGLang's page_first host pool): row
// (l, t) at l*row + t*layers*row, with `pad` spare elements after each token.
struct TokenMajor {
  std::vector<uint16_t> k, v;
  uint64_t row, token_stride;

  TokenMajor(const Geometry& g, uint64_t pad) {
    row = uint64_t{g.num_kv_heads} * g.head_dim;
    token_stride = g.num_layers * row + pad;
    k.assign(token_stride * g.num_tokens, 0xAAAA);
    v.assign(token_stride * g.num_tokens, 0xAAAA);
  }
  KvRows<uint16_t> Rows() { return {k.data(), v.data(), row, token_stride}; }
  KvRows<const uint16_t> ConstRows() const { return {k.data(), v.data(), row, token_stride}; }
  // Rearranges contiguous [layers][tokens][heads][dim] into these rows.
  void Fill(const Geometry& g, const std::vector<uint16_t>& ck, const std::vector<uint16_t>& cv) {
    for (uint32_t l = 0; l < g.num_layers; ++l) {
      for (uint32_t t = 0; t < g.num_tokens; ++t) {
        const uint64_t from = (uint64_t{l} * g.num_tokens + t) * row;
        std::copy_n(ck.begin() + from, row, k.begin() + l * row + t * token_stride);
        std::copy_n(cv.begin() + from, row, v.begin() + l * row + t * token_stride);
      }
    }
  }
};

TEST(CodecRows, StridedRowsEncodeAndDecodeAsTheContiguousChunkForEveryPair) {
  for (DType native : {DType::kFP16, DType::kBF16}) {
    Geometry g{3, 2, 16, 21, 8};
    auto k = MakeKv(g, native, {.seed = 7, .outlier_every = 5});
    auto v = MakeKv(g, native, {.seed = 8});
    TokenMajor rows(g, /*pad=*/3);
    rows.Fill(g, k, v);
    for (auto [kf, vf] : AllPairs(native)) {
      auto spec = MakeSpec(g, native, kf, vf);
      auto want = EncodeChunk(spec, {k, v});
      ASSERT_TRUE(want.ok()) << want.status();
      std::vector<uint8_t> got(want->size());
      ASSERT_TRUE(EncodeChunkRows(spec, rows.ConstRows(), got).ok());
      ASSERT_EQ(got, *want);  // byte for byte, checksums included
      auto dec = DecodeChunk(*want);
      ASSERT_TRUE(dec.ok());
      auto header = ParseHeader(*want);
      ASSERT_TRUE(header.ok());
      TokenMajor out(g, 3);
      ASSERT_TRUE(DecodeChunkRows(*header, *want, 0, g.num_layers, out.Rows(), true).ok());
      TokenMajor expect(g, 3);
      expect.Fill(g, dec->k, dec->v);
      // The padding between tokens is untouched (0xAAAA in both).
      EXPECT_EQ(out.k, expect.k);
      EXPECT_EQ(out.v, expect.v);
    }
  }
}

TEST(CodecRows, UnsealedEncodeIsSealedIntoTheSameBytes) {
  Geometry g{2, 2, 8, 16, 16};
  auto k = MakeKv(g, DType::kBF16, {.seed = 1});
  auto spec = MakeSpec(g, DType::kBF16, {DType::kBF16, ScaleGranularity::kNone},
                       {DType::kFP8E4M3, ScaleGranularity::kPerBlockHead});
  auto want = EncodeChunk(spec, {k, k});
  ASSERT_TRUE(want.ok());
  std::vector<uint8_t> got(want->size());
  ASSERT_TRUE(EncodeChunkRows(spec, KvRows<const uint16_t>::Contiguous(k.data(), k.data(), g), got,
                              /*seal=*/false)
                  .ok());
  EXPECT_NE(got, *want);
  EXPECT_FALSE(VerifyChunk(got).ok());
  ASSERT_TRUE(SealChunk(got).ok());
  EXPECT_EQ(got, *want);
}

TEST(CodecRows, OverlappingStridesAndNullRowsAreRefused) {
  Geometry g{2, 2, 8, 4, 4};
  std::vector<uint16_t> buf(1024);
  const uint64_t row = 16;
  for (auto [ls, ts] : std::vector<std::pair<uint64_t, uint64_t>>{
           {0, 0}, {row, row}, {row - 1, 2 * row}, {row * 4 - 1, row}, {row, row * 2 - 1}}) {
    KvRows<const uint16_t> rows{buf.data(), buf.data(), ls, ts};
    EXPECT_EQ(ValidateRows(rows, g).code(), absl::StatusCode::kInvalidArgument) << ls << " " << ts;
  }
  EXPECT_TRUE(ValidateRows(KvRows<const uint16_t>{buf.data(), buf.data(), row * 4, row}, g).ok());
  EXPECT_TRUE(ValidateRows(KvRows<const uint16_t>{buf.data(), buf.data(), row, row * 2}, g).ok());
  EXPECT_EQ(ValidateRows(KvRows<const uint16_t>{nullptr, buf.data(), row * 4, row}, g).code(),
            absl::StatusCode::kInvalidArgument);
  auto spec = MakeSpec(g, DType::kFP16, kNone16, kNone16);
  auto layout = ValidateSpec(spec);
  ASSERT_TRUE(layout.ok());
  std::vector<uint8_t> out(layout->total_bytes);
  EXPECT_EQ(EncodeChunkRows(spec, {buf.data(), buf.data(), row, row}, out).code(),
            absl::StatusCode::kInvalidArgument);
}

class CodecRowsVersions : public ::testing::TestWithParam<uint16_t> {};

// A corrupt byte of any record is found before that record is decoded: the
// rows of earlier layers may be written, the bad layer's and later ones not.
TEST_P(CodecRowsVersions, CorruptionIsFoundBeforeTheBadRecordIsDecoded) {
  Geometry g{3, 2, 8, 8, 8};
  auto k = MakeKv(g, DType::kFP16, {.seed = 3});
  auto spec = MakeSpec(g, DType::kFP16, kNone16, {DType::kFP8E4M3, ScaleGranularity::kPerBlockHead});
  spec.version = GetParam();
  auto chunk = EncodeChunk(spec, {k, k});
  ASSERT_TRUE(chunk.ok());
  auto header = ParseHeader(*chunk);
  ASSERT_TRUE(header.ok());
  const ChunkLayout& lay = header->layout;
  for (uint32_t bad_layer = 0; bad_layer < g.num_layers; ++bad_layer) {
    for (bool in_v : {false, true}) {
      auto bad = *chunk;
      const uint64_t at = (in_v ? lay.v_offset + lay.v.data_offset(bad_layer)
                                : lay.k_offset + lay.k.data_offset(bad_layer)) + 5;
      bad[at] ^= 0x10;
      TokenMajor out(g, 0);
      auto st = DecodeChunkRows(*header, bad, 0, g.num_layers, out.Rows(), /*verify=*/true);
      EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss) << bad_layer << " " << in_v;
      // The bad layer's rows (and the later ones') are untouched.
      for (uint32_t l = bad_layer; l < g.num_layers; ++l) {
        for (uint32_t t = 0; t < g.num_tokens; ++t) {
          EXPECT_EQ(out.k[l * out.row + t * out.token_stride], 0xAAAA) << l;
          EXPECT_EQ(out.v[l * out.row + t * out.token_stride], 0xAAAA) << l;
        }
      }
      // Unverified, the same bytes decode (the caller trusts a daemon's check).
      EXPECT_TRUE(DecodeChunkRows(*header, bad, 0, g.num_layers, out.Rows(), false).ok());
    }
  }
  // A truncated chunk and a bad range are refused before anything is written.
  TokenMajor out(g, 0);
  EXPECT_EQ(DecodeChunkRows(*header, {chunk->data(), chunk->size() - 1}, 0, 3, out.Rows(), true)
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(DecodeChunkRows(*header, *chunk, 2, 4, out.Rows(), true).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(DecodeChunkRows(*header, *chunk, 1, 1, out.Rows(), true).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(std::all_of(out.k.begin(), out.k.end(), [](uint16_t x) { return x == 0xAAAA; }));
}

INSTANTIATE_TEST_SUITE_P(V1AndV2, CodecRowsVersions, ::testing::Values(1, 2));

// Every 8-bit code decodes to Store16(Dequantize(code, scale)) bit for bit,
// whether the layer is decoded through per-scale tables (a scale covering
// many values) or value by value (one scale a row).
TEST(Codec, EveryEightBitCodeDecodesExactlyThroughTablesAndWithout) {
  for (DType q : {DType::kFP8E4M3, DType::kINT8}) {
    for (ScaleGranularity gran : {ScaleGranularity::kPerBlockHead, ScaleGranularity::kPerTokenHead}) {
      for (DType native : {DType::kBF16, DType::kFP16}) {
        Geometry g{2, 2, 128, 64, 64};
        auto k = MakeKv(g, native, {.seed = 9, .outlier_every = 3});
        auto chunk = EncodeChunk(MakeSpec(g, native, {native, ScaleGranularity::kNone}, {q, gran}),
                                 {k, k});
        ASSERT_TRUE(chunk.ok());
        auto header = ParseHeader(*chunk);
        ASSERT_TRUE(header.ok());
        const SectionLayout& v = header->layout.v;
        for (uint32_t l = 0; l < g.num_layers; ++l) {
          uint8_t* data = chunk->data() + header->layout.v_offset + v.data_offset(l);
          for (uint64_t i = 0; i < g.layer_elements(); ++i) data[i] = static_cast<uint8_t>(i * 7 + l);
        }
        ASSERT_TRUE(SealChunk(*chunk).ok());
        auto dec = DecodeChunk(*chunk);
        ASSERT_TRUE(dec.ok()) << dec.status();
        for (uint32_t l = 0; l < g.num_layers; ++l) {
          const uint8_t* base = chunk->data() + header->layout.v_offset + v.data_offset(l);
          const float* scales = reinterpret_cast<const float*>(base + v.data_bytes);
          for (uint32_t t = 0; t < g.num_tokens; ++t) {
            for (uint32_t h = 0; h < g.num_kv_heads; ++h) {
              const float scale = scales[v.scale_index(t, h)];
              for (uint32_t d = 0; d < g.head_dim; ++d) {
                const uint64_t i = v.element_index(t, h, d);
                const float x = q == DType::kFP8E4M3
                                    ? DequantizeFp8(base[i], scale)
                                    : DequantizeInt(static_cast<int8_t>(base[i]), scale);
                ASSERT_EQ(dec->v[l * g.layer_elements() + i], Store16(x, native))
                    << DTypeName(q) << " layer " << l << " t " << t << " h " << h << " d " << d;
              }
            }
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace kvtier::codec
