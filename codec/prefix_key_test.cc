#include "codec/prefix_key.h"

#include <numeric>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvtier::codec {
namespace {

std::vector<std::string> Hex(const std::vector<Hash128>& keys) {
  std::vector<std::string> out;
  for (const auto& k : keys) out.push_back(k.ToHex());
  return out;
}

// The vectors of codec/FORMAT.md "Test vectors".
TEST(PrefixKey, MatchesFormatTestVectors) {
  ModelIdentity a{"meta-llama/Llama-3.1-8B-Instruct", "", "bf16", "vllm-flash-nhd", "k16v8", 1, 0};
  auto fa = ModelFingerprint(a);
  ASSERT_TRUE(fa.ok());
  EXPECT_EQ(fa->ToHex(), "d73247c97a0f3e1b7a2db49501b020f8");
  std::vector<uint32_t> tokens(512);
  std::iota(tokens.begin(), tokens.end(), 0u);
  auto ka = ChunkKeys(*fa, tokens, 256);
  ASSERT_TRUE(ka.ok());
  EXPECT_THAT(Hex(*ka), ::testing::ElementsAre("32913676858d48fdfc7337f8fead302e",
                                               "0398b0272fd3fd2bc65f6dffd472f25c"));

  ModelIdentity b{"Qwen/Qwen2.5-7B-Instruct", "a09a3545", "fp16", "vllm-flashinfer-hnd", "k8v8", 4, 3};
  auto fb = ModelFingerprint(b);
  ASSERT_TRUE(fb.ok());
  EXPECT_EQ(fb->ToHex(), "e7f931b7f12e394bb490bf1ba387e2c8");
  std::vector<uint32_t> tb = {151643, 9707, 11, 1879, 0, 4294967295u, 42, 7, 100000, 3};
  auto kb = ChunkKeys(*fb, tb, 4, /*include_partial=*/true);
  ASSERT_TRUE(kb.ok());
  EXPECT_THAT(Hex(*kb), ::testing::ElementsAre("41a1cf7f7356ca480ed5d98c8e3b8656",
                                               "6c8bb6b7e16372ee92764ab1cc7639ba",
                                               "eb98de38caebf9ecda2d85f622459bb5"));
}

TEST(PrefixKey, OnlyFullChunksGetKeysByDefault) {
  Hash128 fp = Hash128::Of(std::string_view("m"), 0);
  std::vector<uint32_t> tokens(1000, 7);
  auto keys = ChunkKeys(fp, tokens, 256);
  ASSERT_TRUE(keys.ok());
  EXPECT_EQ(keys->size(), 3u);
  auto with_partial = ChunkKeys(fp, tokens, 256, true);
  ASSERT_TRUE(with_partial.ok());
  ASSERT_EQ(with_partial->size(), 4u);
  EXPECT_EQ((*with_partial)[2], (*keys)[2]);
  auto exact = ChunkKeys(fp, std::span(tokens).first(512), 256, true);
  ASSERT_TRUE(exact.ok());
  EXPECT_EQ(exact->size(), 2u);  // no empty partial chunk
}

TEST(PrefixKey, KeysDependOnTheWholePrefix) {
  Hash128 fp = Hash128::Of(std::string_view("m"), 0);
  std::vector<uint32_t> a(512, 1), b(512, 1);
  b[3] = 2;  // differs in the first chunk only
  auto ka = ChunkKeys(fp, a, 256);
  auto kb = ChunkKeys(fp, b, 256);
  ASSERT_TRUE(ka.ok() && kb.ok());
  EXPECT_NE((*ka)[0], (*kb)[0]);
  EXPECT_NE((*ka)[1], (*kb)[1]);  // same second chunk, different prefix
  auto other_model = ChunkKeys(Hash128::Of(std::string_view("n"), 0), a, 256);
  EXPECT_NE((*ka)[0], (*other_model)[0]);
}

TEST(PrefixKey, SharedPrefixesShareKeys) {
  Hash128 fp = Hash128::Of(std::string_view("m"), 0);
  std::vector<uint32_t> a(768), b(768);
  std::iota(a.begin(), a.end(), 0u);
  std::iota(b.begin(), b.end(), 0u);
  b[600] = 99999;  // diverges in the third chunk
  auto ka = ChunkKeys(fp, a, 256);
  auto kb = ChunkKeys(fp, b, 256);
  EXPECT_EQ((*ka)[0], (*kb)[0]);
  EXPECT_EQ((*ka)[1], (*kb)[1]);
  EXPECT_NE((*ka)[2], (*kb)[2]);
}

TEST(PrefixKey, FingerprintRejectsAmbiguousFields) {
  ModelIdentity id{"m", "", "bf16", "nhd", "k16v8", 1, 0};
  EXPECT_TRUE(ModelFingerprint(id).ok());
  auto bad = id;
  bad.model_id = "";
  EXPECT_EQ(ModelFingerprint(bad).status().code(), absl::StatusCode::kInvalidArgument);
  bad = id;
  bad.revision = "a\nmodel_id=x";
  EXPECT_EQ(ModelFingerprint(bad).status().code(), absl::StatusCode::kInvalidArgument);
  bad = id;
  bad.codec = "k=16,v=int8/tensor";  // '=' is fine: each line splits at its first '='
  EXPECT_TRUE(ModelFingerprint(bad).ok());
  bad = id;
  bad.tp_rank = 1;
  EXPECT_EQ(ModelFingerprint(bad).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ChunkKeys(Hash128{}, std::vector<uint32_t>{1}, 0).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvtier::codec
