// KvService called directly (no gRPC), plus the daemon's small pure parts:
// metric name tables, status mapping, token comparison, options.
#include <sys/stat.h>

#include <atomic>
#include <cmath>
#include <fstream>
#include <limits>
#include <thread>

#include "common/testing/temp_dir.h"
#include "common/testing/wait.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/test_util.h"
#include "tiering/test_util.h"
#include "wire/chunk_check.h"
#include "server/grpc_auth.h"
#include "server/grpc_service.h"
#include "server/http_metrics.h"
#include "server/metrics.h"
#include "server/options.h"
#include "server/service.h"
#include "tiering/placement_engine.h"

namespace kvtier::server {
namespace {

using kvtier::testing::AsVersionOne;
using kvtier::testing::MakeChunk;
using kvtier::testing::TempDir;
using kvtier::testing::TestKey;
using tiering::TierKind;

class ServiceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    tiering::PlacementEngineOptions eo;
    eo.maintenance_interval_ms = 10;
    Open(eo, /*max_keys_per_request=*/8);
  }
  // (Re)opens the engine (DRAM and NVMe tiers) and the service over it.
  void Open(const tiering::PlacementEngineOptions& eo, uint32_t max_keys_per_request) {
    service_.reset();
    engine_.reset();
    tiering::EngineTiers tiers;
    tiering::DramTierOptions d;
    d.capacity_bytes = 8 << 20;
    d.populate = false;
    tiers.dram = tiering::DramTier::Open(d).value();
    tiering::NvmeTierOptions n;
    n.dir = dir_.path() + "/nvme";
    n.capacity_bytes = 16 << 20;
    tiers.nvme = tiering::NvmeTier::Open(n).value();
    engine_ = tiering::PlacementEngine::Create(eo, std::move(tiers)).value();
    ServiceLimits limits;
    limits.max_keys_per_request = max_keys_per_request;
    service_ = std::make_unique<KvService>(engine_.get(), limits);
  }
  std::span<uint8_t> Pool(const tiering::PoolExtent& e) {
    return {engine_->dram()->base() + e.offset, e.length};
  }

  TempDir dir_;
  std::unique_ptr<tiering::PlacementEngine> engine_;
  std::unique_ptr<KvService> service_;
};

TEST_F(ServiceTest, PutThenGetReturnsSameBytes) {
  auto chunk = MakeChunk(1);
  ASSERT_TRUE(service_->Put({TestKey(1)}, chunk).ok());
  auto r = service_->Get(TestKey(1), GetMode::kCopy, tiering::Holder{});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->bytes, chunk);
  EXPECT_EQ(r->tier, TierKind::kDram);
}

TEST_F(ServiceTest, GetOfUnknownKeyReturnsNotFound) {
  EXPECT_EQ(service_->Get(TestKey(99), GetMode::kCopy, tiering::Holder{}).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(service_->Get(TestKey(99), GetMode::kShm, tiering::Holder{}).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(service_->Delete(TestKey(99)).code(), absl::StatusCode::kNotFound);
}

TEST_F(ServiceTest, PutOfCorruptPayloadReturnsDataLossAndStoresNothing) {
  auto chunk = MakeChunk(2);
  chunk[chunk.size() - 3] ^= 0x40;  // in the V section: the V checksum fails
  EXPECT_EQ(service_->Put({TestKey(2)}, chunk).code(), absl::StatusCode::kDataLoss);
  EXPECT_FALSE(engine_->Contains(TestKey(2)));
}

TEST_F(ServiceTest, PutOfMalformedBytesReturnsInvalidArgument) {
  std::vector<uint8_t> junk(300, 0xab);
  EXPECT_EQ(service_->Put({TestKey(3)}, junk).code(), absl::StatusCode::kInvalidArgument);
  auto chunk = MakeChunk(3);
  chunk.resize(chunk.size() - 10);  // truncated
  EXPECT_EQ(service_->Put({TestKey(3)}, chunk).code(), absl::StatusCode::kDataLoss);
}

TEST_F(ServiceTest, LookupReturnsLongestPrefixAndRejectsTooManyKeys) {
  ASSERT_TRUE(service_->Put({TestKey(10)}, MakeChunk(10)).ok());
  ASSERT_TRUE(service_->Put({TestKey(11)}, MakeChunk(11)).ok());
  std::vector<Hash128> keys = {TestKey(10), TestKey(11), TestKey(12), TestKey(13)};
  ASSERT_TRUE(service_->Put({TestKey(13)}, MakeChunk(13)).ok());  // after the gap: not in the prefix
  auto r = service_->Lookup(keys);
  ASSERT_TRUE(r.ok());
  EXPECT_THAT(*r, ::testing::ElementsAre(TierKind::kDram, TierKind::kDram));
  std::vector<Hash128> many(9, TestKey(10));
  EXPECT_EQ(service_->Lookup(many).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(service_->Pin(many, 0, tiering::Holder{}).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(ServiceTest, SlotCommitStoresBytesWrittenInPlace) {
  auto chunk = MakeChunk(20);
  auto slot = service_->AllocateSlot(chunk.size(), 0, tiering::Holder{});
  ASSERT_TRUE(slot.ok()) << slot.status();
  std::copy(chunk.begin(), chunk.end(), Pool(slot->extent).begin());
  ASSERT_TRUE(service_->CommitSlot({TestKey(20)}, slot->id).ok());
  auto r = service_->Get(TestKey(20), GetMode::kCopy, tiering::Holder{});
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->bytes, chunk);
  // The slot is consumed: committing it again is NotFound.
  EXPECT_EQ(service_->CommitSlot({TestKey(21)}, slot->id).code(), absl::StatusCode::kNotFound);
}

// A GPU store's commit: the slot's chunk has no checksums and the daemon
// computes them; the stored chunk is the sealed one, for both versions.
TEST_F(ServiceTest, SealingCommitComputesTheChecksumsOfAnUnsealedSlot) {
  for (uint16_t version : {uint16_t{1}, uint16_t{2}}) {
    auto sealed = MakeChunk(24 + version, 64, 3, 2, 64);
    if (version == 1) sealed = AsVersionOne(sealed);
    auto h = codec::ParseHeader(sealed).value();
    // What a GPU store leaves: every byte but the checksums (and tables).
    auto unsealed = sealed;
    std::memset(unsealed.data() + codec::kOffKChecksum, 0, 16);
    std::memset(unsealed.data() + codec::kOffHeaderChecksum, 0, 8);
    for (const auto& [off, sec] : {std::pair{h.layout.k_offset, h.layout.k},
                                   std::pair{h.layout.v_offset, h.layout.v}}) {
      std::memset(unsealed.data() + off + sec.table_offset, 0x5A, sec.table_bytes);
    }
    const Hash128 key = TestKey(40 + version);
    auto slot = service_->AllocateSlot(unsealed.size(), 0, tiering::Holder{});
    ASSERT_TRUE(slot.ok()) << slot.status();
    std::copy(unsealed.begin(), unsealed.end(), Pool(slot->extent).begin());
    // Without sealing, the zero checksums are a mismatch (and free the slot).
    PutArgs plain{key};
    EXPECT_EQ(service_->CommitSlot(plain, slot->id).code(), absl::StatusCode::kDataLoss);
    slot = service_->AllocateSlot(unsealed.size(), 0, tiering::Holder{});
    ASSERT_TRUE(slot.ok()) << slot.status();
    std::copy(unsealed.begin(), unsealed.end(), Pool(slot->extent).begin());
    PutArgs seal{key};
    seal.seal = true;
    ASSERT_TRUE(service_->CommitSlot(seal, slot->id).ok()) << version;
    auto r = service_->Get(key, GetMode::kCopy, tiering::Holder{});
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->bytes, sealed) << version;
  }
  // A malformed header is refused and frees the slot.
  auto chunk = MakeChunk(29);
  chunk[codec::kOffNumLayers] = 0;
  auto slot = service_->AllocateSlot(chunk.size(), 0, tiering::Holder{});
  ASSERT_TRUE(slot.ok());
  std::copy(chunk.begin(), chunk.end(), Pool(slot->extent).begin());
  PutArgs seal{TestKey(49)};
  seal.seal = true;
  EXPECT_EQ(service_->CommitSlot(seal, slot->id).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(engine_->Contains(TestKey(49)));
  EXPECT_EQ(service_->AbortSlot(slot->id, 0).code(), absl::StatusCode::kNotFound);
}

TEST_F(ServiceTest, CommitOfUnknownSlotReturnsNotFound) {
  EXPECT_EQ(service_->CommitSlot({TestKey(22)}, 424242).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(service_->AbortSlot(424242, 0).code(), absl::StatusCode::kNotFound);
}

TEST_F(ServiceTest, CommitOfCorruptSlotReturnsDataLossAndFreesIt) {
  auto chunk = MakeChunk(23);
  auto slot = service_->AllocateSlot(chunk.size(), 0, tiering::Holder{});
  ASSERT_TRUE(slot.ok());
  chunk[200] ^= 1;
  std::copy(chunk.begin(), chunk.end(), Pool(slot->extent).begin());
  EXPECT_EQ(service_->CommitSlot({TestKey(23)}, slot->id).code(), absl::StatusCode::kDataLoss);
  EXPECT_FALSE(engine_->Contains(TestKey(23)));
  EXPECT_EQ(service_->AbortSlot(slot->id, 0).code(), absl::StatusCode::kNotFound);
}

TEST_F(ServiceTest, ShmGetPinsTheChunkUntilReleased) {
  auto chunk = MakeChunk(30);
  ASSERT_TRUE(service_->Put({TestKey(30)}, chunk).ok());
  auto r = service_->Get(TestKey(30), GetMode::kShm, tiering::Holder{}, 0, 10000);
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_NE(r->lease_id, 0u);
  auto view = Pool(r->extent);
  EXPECT_TRUE(std::equal(view.begin(), view.end(), chunk.begin(), chunk.end()));
  EXPECT_EQ(service_->Delete(TestKey(30)).code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(service_->Release(r->lease_id, 0).ok());
  EXPECT_TRUE(service_->Delete(TestKey(30)).ok());
}

TEST_F(ServiceTest, BytesCorruptedInThePoolAfterCommitAreDataLossOnVerifiedGet) {
  auto chunk = MakeChunk(31);
  auto slot = service_->AllocateSlot(chunk.size(), 0, tiering::Holder{});
  ASSERT_TRUE(slot.ok());
  std::copy(chunk.begin(), chunk.end(), Pool(slot->extent).begin());
  ASSERT_TRUE(service_->CommitSlot({TestKey(31)}, slot->id).ok());
  Pool(slot->extent)[500] ^= 0xff;  // a client writing into a slot it no longer owns
  // A plain shared-memory get hands out the extent without reading it (the
  // reader checks what it copies)...
  auto r = service_->Get(TestKey(31), GetMode::kShm, tiering::Holder{}, 0, 10000);
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_TRUE(service_->Release(r->lease_id, 0).ok());
  // ...and the reader's follow-up with verify finds the damage and drops it.
  EXPECT_EQ(service_->Get(TestKey(31), GetMode::kShm, tiering::Holder{}, 0, 0, /*verify=*/true).status().code(),
            absl::StatusCode::kDataLoss);
  EXPECT_EQ(service_->Get(TestKey(31), GetMode::kCopy, tiering::Holder{}).status().code(), absl::StatusCode::kNotFound);
}

// A tier that verifies on read (NVMe) is trusted: its bytes are checked once,
// as they are read. A byte flipped on disk is still DataLoss before any byte
// is handed out, through a copy and through a scratch copy in the pool.
TEST_F(ServiceTest, ChunksReadFromNvmeAreCheckedOnceAndCorruptionIsStillDataLoss) {
  tiering::PutOptions on_nvme;
  on_nvme.tier = TierKind::kNvme;
  for (uint64_t k : {40, 41, 42, 43}) {
    ASSERT_TRUE(engine_->Put(TestKey(k), MakeChunk(k), on_nvme).ok());
  }
  tiering::GetOptions no_promote;
  no_promote.promote = false;
  std::vector<uint8_t> out(MakeChunk(40).size());
  bool verified = false;
  ASSERT_EQ(engine_->Get(TestKey(40), out, no_promote, &verified).value(), TierKind::kNvme);
  EXPECT_TRUE(verified);
  auto shared = engine_->GetShared(TestKey(40), 0, no_promote);
  ASSERT_TRUE(shared.ok()) << shared.status();
  EXPECT_NE(shared->slot_id, 0u);
  EXPECT_TRUE(shared->verified);
  ASSERT_TRUE(engine_->AbortSlot(shared->slot_id, 0).ok());

  auto flip = [&](uint64_t k) {
    return tiering::testing::FlipByteOnNvme(*engine_->nvme(), {TestKey(k), tiering::Part::kWhole}, 300);
  };
  ASSERT_TRUE(flip(41).ok());
  EXPECT_EQ(service_->Get(TestKey(41), GetMode::kCopy, tiering::Holder{}).status().code(),
            absl::StatusCode::kDataLoss);
  EXPECT_EQ(service_->Get(TestKey(41), GetMode::kCopy, tiering::Holder{}).status().code(),
            absl::StatusCode::kNotFound);  // dropped, not served again
  ASSERT_TRUE(flip(42).ok());
  EXPECT_EQ(service_->Get(TestKey(42), GetMode::kShm, tiering::Holder{}, 0, 10000).status().code(),
            absl::StatusCode::kDataLoss);
  auto good = service_->Get(TestKey(43), GetMode::kCopy, tiering::Holder{});
  ASSERT_TRUE(good.ok()) << good.status();
  EXPECT_EQ(good->bytes, MakeChunk(43));
  // A DRAM copy is not checked by its tier: Get says so, and the service hashes it.
  ASSERT_TRUE(engine_->Put(TestKey(44), MakeChunk(44)).ok());
  ASSERT_EQ(engine_->Get(TestKey(44), out, no_promote, &verified).value(), TierKind::kDram);
  EXPECT_FALSE(verified);
}

TEST_F(ServiceTest, CopyOutOfThePoolVerifiesWhatItCopies) {
  auto chunk = MakeChunk(33);
  ASSERT_TRUE(service_->Put({TestKey(33)}, chunk).ok());
  Pool(*engine_->Locate(TestKey(33))->parts[0].dram_slot)[700] ^= 1;
  EXPECT_EQ(service_->Get(TestKey(33), GetMode::kCopy, tiering::Holder{}).status().code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(service_->Get(TestKey(33), GetMode::kCopy, tiering::Holder{}).status().code(), absl::StatusCode::kNotFound);
}

// A chunk or a slot over the daemon's chunk limit is refused before any
// bytes are read or stored.
TEST_F(ServiceTest, ChunksOverTheSizeLimitAreInvalidArgument) {
  auto chunk = MakeChunk(34);
  ServiceLimits limits;
  limits.max_chunk_bytes = chunk.size() - 1;
  KvService small(engine_.get(), limits);
  EXPECT_EQ(small.Put({TestKey(34)}, chunk).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(small.AllocateSlot(chunk.size(), 0, tiering::Holder{}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(small.AllocateSlot(0, 0, tiering::Holder{}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(service_->Get(TestKey(34), GetMode::kCopy, tiering::Holder{}).status().code(),
            absl::StatusCode::kNotFound);
}

// The data-plane checks agree with the codec's on every byte (chunks large
// enough for the two-thread path, and small ones).
TEST_F(ServiceTest, PlanAndHoldHoldsWhatThePlanLoads) {
  for (uint32_t i = 0; i < 3; ++i) ASSERT_TRUE(service_->Put({TestKey(i)}, MakeChunk(i)).ok());
  std::vector<Hash128> keys = {TestKey(0), TestKey(1), TestKey(2), TestKey(3)};
  // A slow prefill (1 token/s): every hit is worth loading, and held.
  auto slow = service_->PlanAndHold(keys, {.tokens_per_s = 1}, 16, 0, tiering::Holder{});
  ASSERT_TRUE(slow.ok()) << slow.status();
  EXPECT_EQ(slow->plan.estimate.tiers.size(), 3u);
  EXPECT_EQ(slow->plan.decision.chunks, 3u);
  EXPECT_EQ(slow->held_chunks, 3u);
  ASSERT_NE(slow->lease.id, 0u);
  EXPECT_EQ(service_->Delete(TestKey(2)).code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(service_->Release(slow->lease.id, 0).ok());
  // A prefill faster than any load: nothing is worth loading, nothing held.
  auto fast = service_->PlanAndHold(keys, {.tokens_per_s = 1e15}, 16, 0, tiering::Holder{});
  ASSERT_TRUE(fast.ok()) << fast.status();
  EXPECT_EQ(fast->plan.decision.chunks, 0u);
  EXPECT_EQ(fast->held_chunks, 0u);
  EXPECT_EQ(fast->lease.id, 0u);
  EXPECT_TRUE(service_->Delete(TestKey(2)).ok());
  // Without a rate every hit is held.
  auto all = service_->PlanAndHold(keys, {}, 16, 0, tiering::Holder{});
  ASSERT_TRUE(all.ok()) << all.status();
  EXPECT_EQ(all->held_chunks, 2u);
  ASSERT_TRUE(service_->Release(all->lease.id, 0).ok());
  EXPECT_EQ(engine_->held_bytes(), 0u);
  EXPECT_EQ(
      service_->PlanAndHold(keys, {.tokens_per_s = -1}, 16, 0, tiering::Holder{}).status().code(),
      absl::StatusCode::kInvalidArgument);
}

// A 24K-token prefix of a Qwen2.5-7B-shaped model on NVMe: 96 chunks of 256
// tokens that load in ~649 ms, and whose recompute took 847 ms. Qwen2.5-7B's
// C2 is its 6,525,288,448 non-embedding parameters / (2 x 28 layers x 28
// query heads x 128 head dim) = 32,512 tokens. At 40K tokens/s (short
// context) a linear recompute cost says 614 ms, less than the load:
// recompute. With the attention term it is 847 ms: load all 96.
TEST_F(ServiceTest, LongPrefixIsLoadedWhenAttentionMakesItsRecomputeSlower) {
  constexpr int kNvme = static_cast<int>(TierKind::kNvme);
  tiering::PlacementEngineOptions eo;
  eo.maintenance_interval_ms = 10;
  eo.load_cost.assumed_read_bytes_per_s[kNvme] = 1e15;  // the latency is the load time
  eo.load_cost.latency_us[kNvme] = 6'760;               // x 96 = 648.96 ms
  Open(eo, /*max_keys_per_request=*/96);
  std::vector<Hash128> keys;
  for (uint32_t i = 0; i < 96; ++i) {
    PutArgs args;
    args.key = TestKey(i);
    args.tier = TierKind::kNvme;
    ASSERT_TRUE(service_->Put(args, MakeChunk(i)).ok()) << i;
    keys.push_back(TestKey(i));
  }
  const bandwidth::PrefillCost linear{.tokens_per_s = 40'000};
  const bandwidth::PrefillCost attention{
      .tokens_per_s = 40'000, .attention_doubling_tokens = 6'525'288'448.0 / (2.0 * 28 * 28 * 128)};

  auto by_tokens = service_->PlanLoad(keys, linear, 256);
  ASSERT_TRUE(by_tokens.ok()) << by_tokens.status();
  ASSERT_EQ(by_tokens->estimate.tiers, std::vector<TierKind>(96, TierKind::kNvme));
  double load_us = 0;
  for (double us : by_tokens->estimate.load_us) load_us += us;
  EXPECT_NEAR(load_us, 649'000, 100);
  EXPECT_EQ(by_tokens->decision.chunks, 0u);  // 6.4 ms a chunk to recompute, 6.76 to load

  auto by_flops = service_->PlanLoad(keys, attention, 256);
  ASSERT_TRUE(by_flops.ok()) << by_flops.status();
  EXPECT_EQ(by_flops->decision.chunks, 96u);
  EXPECT_NEAR(by_flops->decision.load_us, 649'000, 100);
  EXPECT_NEAR(by_flops->decision.recompute_us, 847'000, 1'000);
  EXPECT_NEAR(by_flops->decision.saved_us(), 198'000, 1'000);

  // The hold follows the plan.
  auto held = service_->PlanAndHold(keys, attention, 256, 0, tiering::Holder{});
  ASSERT_TRUE(held.ok()) << held.status();
  EXPECT_EQ(held->held_chunks, 96u);
  ASSERT_TRUE(service_->Release(held->lease.id, 0).ok());
  auto none = service_->PlanAndHold(keys, linear, 256, 0, tiering::Holder{});
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_EQ(none->held_chunks, 0u);
  EXPECT_EQ(none->lease.id, 0u);
  EXPECT_EQ(engine_->held_bytes(), 0u);
}

TEST_F(ServiceTest, PlanRefusesAnAttentionDoublingThatIsNoLength) {
  ASSERT_TRUE(service_->Put({TestKey(1)}, MakeChunk(1)).ok());
  const std::vector<Hash128> keys = {TestKey(1)};
  for (double c2 : {-1.0, -0.0001, std::nan(""), std::numeric_limits<double>::infinity(),
                    -std::numeric_limits<double>::infinity()}) {
    for (double rate : {0.0, 1000.0}) {
      auto plan = service_->PlanLoad(keys, {.tokens_per_s = rate, .attention_doubling_tokens = c2},
                                     256);
      EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument) << c2 << " at " << rate;
      EXPECT_THAT(plan.status().message(), ::testing::HasSubstr("attention_doubling_tokens"));
      EXPECT_EQ(service_->PlanAndHold(keys, {.tokens_per_s = rate, .attention_doubling_tokens = c2},
                                      256, 0, tiering::Holder{})
                    .status()
                    .code(),
                absl::StatusCode::kInvalidArgument);
    }
  }
  auto zero = service_->PlanLoad(keys, {.tokens_per_s = 1000, .attention_doubling_tokens = 0}, 256);
  ASSERT_TRUE(zero.ok()) << zero.status();
  auto tiny =
      service_->PlanLoad(keys, {.tokens_per_s = 1000, .attention_doubling_tokens = 1e-3}, 256);
  ASSERT_TRUE(tiny.ok()) << tiny.status();
  EXPECT_EQ(tiny->decision.chunks, 1u);
  EXPECT_EQ(engine_->held_bytes(), 0u);
}

TEST_F(ServiceTest, GetBatchSharedServesHitsNamesMissesAndRefusesDuplicates) {
  ASSERT_TRUE(service_->Put({TestKey(1)}, MakeChunk(1)).ok());
  std::vector<Hash128> keys = {TestKey(1), TestKey(2)};
  auto got = service_->GetBatchShared(keys, 0, /*verify=*/true, tiering::Holder{});
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_EQ(got->size(), 2u);
  ASSERT_TRUE((*got)[0].ok());
  EXPECT_EQ((*got)[1].status().code(), absl::StatusCode::kNotFound);
  const auto want = MakeChunk(1);
  auto bytes = Pool((*got)[0]->extent);
  EXPECT_TRUE(std::equal(want.begin(), want.end(), bytes.begin(), bytes.end()));
  ASSERT_TRUE(service_->Release((*got)[0]->lease_id, 0).ok());
  std::vector<Hash128> dup = {TestKey(1), TestKey(1)};
  EXPECT_EQ(service_->GetBatchShared(dup, 0, false, tiering::Holder{}).status().code(),
            absl::StatusCode::kInvalidArgument);
  std::vector<Hash128> many(9, TestKey(1));
  EXPECT_EQ(service_->GetBatchShared(many, 0, false, tiering::Holder{}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(engine_->held_bytes(), 0u);
}

TEST(ChunkCheck, AgreesWithTheCodecAndFindsEveryCorruption) {
  for (uint32_t tokens : {16u, 256u}) {
    auto chunk = MakeChunk(40 + tokens, tokens, 4, 8, 128);
    ASSERT_TRUE(wire::VerifyChunkParallel(chunk).ok());
    std::vector<uint8_t> dst(chunk.size() + 8);
    auto h = wire::CopyVerified(dst, chunk);
    ASSERT_TRUE(h.ok()) << h.status();
    EXPECT_TRUE(std::equal(chunk.begin(), chunk.end(), dst.begin()));
    for (size_t at : {size_t{0}, size_t{130}, chunk.size() / 2, chunk.size() - 1}) {
      auto bad = chunk;
      bad[at] ^= 0x10;
      absl::StatusCode want = codec::VerifyChunk(bad).status().code();
      ASSERT_NE(want, absl::StatusCode::kOk);
      EXPECT_EQ(wire::VerifyChunkParallel(bad).status().code(), want) << at;
      EXPECT_EQ(wire::CopyVerified(dst, bad).status().code(), want) << at;
    }
    auto shortc = std::span<const uint8_t>(chunk).first(chunk.size() - 1);
    EXPECT_EQ(wire::VerifyChunkParallel(shortc).status().code(), absl::StatusCode::kDataLoss);
    EXPECT_EQ(wire::CopyVerified(dst, shortc).status().code(), absl::StatusCode::kDataLoss);
  }
}

// A version 1 chunk (whole-section checksums) still verifies and fails as
// the codec says, on the pool.
TEST(ChunkCheck, VersionOneChunksVerifyInParallelToo) {
  auto v1 = AsVersionOne(MakeChunk(71, 256, 4, 8, 128));
  const codec::ChunkLayout layout = codec::ParseHeader(v1).value().layout;
  auto ok = wire::VerifyChunkParallel(v1);
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(ok->header().spec.version, 1);
  for (size_t at : {size_t(layout.k_offset + 3), size_t(layout.v_offset + 3)}) {
    auto bad = v1;
    bad[at] ^= 1;
    auto st = wire::VerifyChunkParallel(bad).status();
    EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss);
    EXPECT_EQ(st.message(), codec::VerifyChunk(bad).status().message());
  }
}

// CheckRecordsParallel checks the layers asked for (and the tables), and
// reports a bad record there as the codec words it.
TEST(ChunkCheck, CheckRecordsParallelChecksTheLayersAskedFor) {
  auto chunk = MakeChunk(72, 64, 6, 4, 64);
  auto h = codec::ParseHeader(chunk).value();
  const auto& l = h.layout;
  EXPECT_TRUE(wire::CheckRecordsParallel(h, chunk, 0, 6).ok());
  EXPECT_TRUE(wire::CheckRecordsParallel(h, chunk, 2, 3).ok());
  EXPECT_TRUE(wire::CheckRecordsParallel(h, chunk, 5, 99).ok());  // clamped to the layers
  auto bad = chunk;
  bad[l.v_offset + l.v.data_offset(4) + 7] ^= 0x40;  // V record 4
  for (auto [b, e, fails] : {std::tuple{0u, 6u, true}, std::tuple{4u, 5u, true},
                             std::tuple{0u, 4u, false}, std::tuple{5u, 6u, false}}) {
    absl::Status st = wire::CheckRecordsParallel(h, bad, b, e);
    EXPECT_EQ(st.ok(), !fails) << b << ".." << e << ": " << st;
    if (fails) EXPECT_THAT(std::string(st.message()), ::testing::StartsWith("v record 4"));
  }
  auto table = chunk;
  table[l.k_offset + l.k.table_offset + 1] ^= 1;  // K's entry for layer 0
  for (auto [b, e] : {std::pair{0u, 6u}, std::pair{3u, 4u}}) {
    absl::Status st = wire::CheckRecordsParallel(h, table, b, e);
    EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss);
    EXPECT_THAT(std::string(st.message()), ::testing::StartsWith("k_checksum"));
  }
}

// StreamCopy delivers every byte for any length and alignment (non-temporal
// stores after an aligned head, memcpy below 4 KiB).
TEST(ChunkCheck, StreamCopyCopiesEveryByteAtAnyAlignment) {
  std::vector<uint8_t> src(300000 + 64);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<uint8_t>(i * 131 + 7);
  for (size_t n : {size_t{0}, size_t{1}, size_t{31}, size_t{4095}, size_t{4096}, size_t{70001},
                   size_t{300000}}) {
    for (size_t soff : {size_t{0}, size_t{3}}) {
      for (size_t doff : {size_t{0}, size_t{5}, size_t{32}}) {
        std::vector<uint8_t> dst(n + 64, 0xEE);
        wire::StreamCopy(std::span<uint8_t>(dst).subspan(doff, n),
                   std::span<const uint8_t>(src).subspan(soff, n));
        ASSERT_TRUE(std::equal(src.begin() + soff, src.begin() + soff + n, dst.begin() + doff))
            << n << " " << soff << " " << doff;
        EXPECT_TRUE(std::all_of(dst.begin(), dst.begin() + doff, [](uint8_t b) { return b == 0xEE; }));
        EXPECT_TRUE(std::all_of(dst.begin() + doff + n, dst.end(), [](uint8_t b) { return b == 0xEE; }));
      }
    }
  }
}

// PutCopyOrder covers each byte once: the header first, each section front
// to back, K and V interleaved in proportion; garbage goes front to back.
TEST(ChunkCheck, PutCopyOrderInterleavesTheSectionsAndCoversEveryByteOnce) {
  auto chunk = MakeChunk(3, 256, 4, 4, 128);
  auto h = codec::ParseHeader(chunk).value();
  const auto& l = h.layout;
  auto order = wire::PutCopyOrder(chunk, 64 << 10);
  ASSERT_FALSE(order.empty());
  EXPECT_EQ(order[0], std::make_pair(uint64_t{0}, l.k_offset));
  std::vector<int> seen(chunk.size(), 0);
  uint64_t k_next = l.k_offset, v_next = l.v_offset, k_done = 0, v_done = 0;
  double worst_skew = 0;
  for (size_t i = 1; i < order.size(); ++i) {
    auto [o, n] = order[i];
    ASSERT_LE(n, uint64_t{64} << 10);
    for (uint64_t b = o; b < o + n; ++b) ++seen[b];
    if (o < l.v_offset) {
      ASSERT_EQ(o, k_next);
      k_next += n;
      k_done += n;
    } else {
      ASSERT_EQ(o, v_next);
      v_next += n;
      v_done += n;
    }
    worst_skew = std::max(worst_skew, std::abs(double(k_done) / l.k.bytes - double(v_done) / l.v.bytes));
  }
  for (uint64_t b = 0; b < l.k_offset; ++b) ++seen[b];
  EXPECT_TRUE(std::all_of(seen.begin(), seen.end(), [](int c) { return c == 1; }));
  EXPECT_LT(worst_skew, 0.2);  // pieces alternate; neither section runs ahead
  auto garbage = chunk;
  garbage[0] ^= 1;
  auto flat = wire::PutCopyOrder(garbage, 100000);
  uint64_t next = 0;
  for (auto [o, n] : flat) {
    ASSERT_EQ(o, next);
    next += n;
  }
  EXPECT_EQ(next, chunk.size());
}

// A streamed check fed the put's ranges, with and without the helper thread
// that hashes V: whole chunks pass, a flipped byte in K or V is DataLoss
// naming the section, and hostile ranges are InvalidArgument.
TEST(ChunkCheck, IncrementalCheckTakesInterleavedRangesOnOneOrTwoThreads) {
  wire::TrailingHasher helper;
  // V is 2 MiB or more (the helper's threshold) in the large chunk.
  for (uint32_t tokens : {16u, 512u}) {
    auto chunk = MakeChunk(11 + tokens, tokens, 4, 8, 128);
    auto l = codec::ParseHeader(chunk).value().layout;
    auto order = wire::PutCopyOrder(chunk, 256 << 10);
    for (wire::TrailingHasher* h : {static_cast<wire::TrailingHasher*>(nullptr), &helper}) {
      for (int round = 0; round < 3; ++round) {
        wire::IncrementalChunkCheck c(chunk, h);
        for (auto [o, n] : order) ASSERT_TRUE(c.AdvanceRange(o, n).ok());
        ASSERT_TRUE(c.Finish().ok()) << tokens;
      }
      for (size_t at : {size_t(l.k_offset + 5), size_t(l.v_offset + l.v.bytes / 2)}) {
        auto bad = chunk;
        bad[at] ^= 4;
        wire::IncrementalChunkCheck c(bad, h);
        for (auto [o, n] : order) ASSERT_TRUE(c.AdvanceRange(o, n).ok());
        auto f = c.Finish();
        EXPECT_EQ(f.status().code(), absl::StatusCode::kDataLoss);
        EXPECT_THAT(std::string(f.status().message()),
                    ::testing::StartsWith(at < l.v_offset ? "k record" : "v record"));
      }
      {  // The prefix form (Advance) and ranges mixed.
        wire::IncrementalChunkCheck c(chunk, h);
        ASSERT_TRUE(c.Advance(l.k_offset + 1000).ok());
        ASSERT_TRUE(c.AdvanceRange(l.v_offset, 100).ok());
        ASSERT_TRUE(c.AdvanceRange(l.k_offset + 10, 5000).ok());  // overlaps final bytes
        ASSERT_TRUE(c.Advance(chunk.size()).ok());
        ASSERT_TRUE(c.Finish().ok());
      }
      {  // A range before the header is final.
        wire::IncrementalChunkCheck c(chunk, h);
        EXPECT_EQ(c.AdvanceRange(l.k_offset, 10).code(), absl::StatusCode::kInvalidArgument);
      }
      {  // A gap inside a section.
        wire::IncrementalChunkCheck c(chunk, h);
        ASSERT_TRUE(c.AdvanceRange(0, l.k_offset).ok());
        EXPECT_EQ(c.AdvanceRange(l.v_offset + 64, 64).code(), absl::StatusCode::kInvalidArgument);
      }
      {  // Beyond the region, and offset + length overflowing.
        wire::IncrementalChunkCheck c(chunk, h);
        EXPECT_EQ(c.AdvanceRange(chunk.size(), 1).code(), absl::StatusCode::kInvalidArgument);
        EXPECT_EQ(c.AdvanceRange(8, ~uint64_t{0}).code(), absl::StatusCode::kInvalidArgument);
      }
      {  // Committed with a section incomplete; then abandoned mid-put.
        wire::IncrementalChunkCheck c(chunk, h);
        for (size_t i = 0; i + 1 < order.size(); ++i) {
          ASSERT_TRUE(c.AdvanceRange(order[i].first, order[i].second).ok());
        }
        EXPECT_EQ(c.Finish().status().code(), absl::StatusCode::kInvalidArgument);
      }
      {  // A malformed header once 128 bytes are final.
        auto bad = chunk;
        bad[0] ^= 1;
        wire::IncrementalChunkCheck c(bad, h);
        EXPECT_EQ(c.AdvanceRange(0, codec::kHeaderSize).code(), absl::StatusCode::kInvalidArgument);
      }
    }
  }
}

// The helper's verdict is the sections' whatever the publishing pace, a
// flipped byte fails it, and an abandoned job leaves it usable.
TEST(ChunkCheck, TrailingHasherMatchesTheSectionChecksums) {
  auto chunk = MakeChunk(77, 512, 4, 8, 128);
  auto h = codec::ParseHeader(chunk).value();
  const auto& l = h.layout;
  wire::TrailingHasher t;
  for (uint64_t step : {uint64_t{4096}, uint64_t{1} << 20, uint64_t(chunk.size())}) {
    while (!t.Start(chunk.data(), h, codec::kHeaderSize, chunk.size())) std::this_thread::yield();
    for (uint64_t o = codec::kHeaderSize; o < chunk.size();) {
      o = std::min<uint64_t>(chunk.size(), o + step);
      t.Publish(o);
    }
    EXPECT_TRUE(t.Finish().ok());
    auto bad = chunk;
    bad[l.v_offset + l.v.bytes / 3] ^= 0x20;
    while (!t.Start(bad.data(), h, codec::kHeaderSize, bad.size())) std::this_thread::yield();
    t.Publish(bad.size());
    absl::Status st = t.Finish();
    EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss);
    EXPECT_THAT(std::string(st.message()), ::testing::StartsWith("v record"));
    ASSERT_TRUE(::kvtier::testing::WaitUntil(
        [&] { return t.Start(chunk.data(), h, l.v_offset, chunk.size()); },
        std::chrono::seconds(5), std::chrono::milliseconds(1)));
    t.Publish(l.v_offset + 4096);
    t.Abandon();
  }
}

TEST_F(ServiceTest, GetIntoClientSlotCopiesAndChecksItsSize) {
  auto chunk = MakeChunk(32);
  ASSERT_TRUE(service_->Put({TestKey(32)}, chunk).ok());
  auto small = service_->AllocateSlot(chunk.size() / 2, 0, tiering::Holder{});
  ASSERT_TRUE(small.ok());
  EXPECT_EQ(service_->Get(TestKey(32), GetMode::kSlot, tiering::Holder{}, small->id).status().code(),
            absl::StatusCode::kInvalidArgument);
  auto slot = service_->AllocateSlot(chunk.size(), 0, tiering::Holder{});
  ASSERT_TRUE(slot.ok());
  auto r = service_->Get(TestKey(32), GetMode::kSlot, tiering::Holder{}, slot->id);
  ASSERT_TRUE(r.ok()) << r.status();
  auto view = Pool(r->extent);
  EXPECT_TRUE(std::equal(view.begin(), view.end(), chunk.begin(), chunk.end()));
  EXPECT_EQ(service_->Get(TestKey(32), GetMode::kSlot, tiering::Holder{}, 999999).status().code(),
            absl::StatusCode::kNotFound);
}

TEST_F(ServiceTest, FlushWritesDramChunksToNvme) {
  ASSERT_TRUE(service_->Put({TestKey(40)}, MakeChunk(40)).ok());
  ASSERT_TRUE(service_->Put({TestKey(41)}, MakeChunk(41)).ok());
  auto n = service_->FlushDramToNvme();
  EXPECT_EQ(n.written, 2u);
  EXPECT_EQ(engine_->nvme()->List().size(), 2u);
}

// A chunk whose DRAM bytes are corrupt is never persisted, and the report
// says so instead of leaving it out silently.
TEST_F(ServiceTest, FlushReportsTheChunksItLeavesOut) {
  ASSERT_TRUE(service_->Put({TestKey(42)}, MakeChunk(42)).ok());
  ASSERT_TRUE(service_->Put({TestKey(43)}, MakeChunk(43)).ok());
  auto loc = engine_->Locate(TestKey(43));
  ASSERT_TRUE(loc.ok()) << loc.status();
  ASSERT_TRUE(loc->parts[0].dram_slot.has_value());
  auto bytes = Pool(*loc->parts[0].dram_slot);
  bytes[bytes.size() - 1] ^= 0x40;  // a V byte
  const KvService::FlushReport r = service_->FlushDramToNvme();
  EXPECT_EQ(r.written, 1u);
  EXPECT_EQ(r.corrupt, 1u);
  EXPECT_EQ(r.no_room, 0u);
  EXPECT_EQ(r.failed, 0u);
  EXPECT_TRUE(r.first_error.ok());
  EXPECT_EQ(engine_->nvme()->List().size(), 1u);
  // The corrupt chunk is dropped and counted as data loss.
  EXPECT_EQ(engine_->metric(tiering::EngineMetric::kDataLoss), 1u);
  EXPECT_FALSE(engine_->Contains(TestKey(43)));
}

TEST_F(ServiceTest, StatsListsTiersAndEveryEngineCounter) {
  ASSERT_TRUE(service_->Put({TestKey(50)}, MakeChunk(50)).ok());
  ServiceStats s = service_->Stats();
  ASSERT_EQ(s.tiers.size(), 2u);
  EXPECT_EQ(s.counters.size(), static_cast<size_t>(tiering::EngineMetric::kCount));
  EXPECT_EQ(s.counters[0].first, "puts");
  EXPECT_EQ(s.counters[0].second, 1u);
}

TEST(ServerMetrics, NameTablesAgreeWithTheEnums) {
  std::set<std::string> names;
  for (int i = 0; i < static_cast<int>(Method::kCount); ++i) {
    std::string n = MethodName(static_cast<Method>(i));
    EXPECT_NE(n, "unknown");
    EXPECT_TRUE(names.insert(n).second) << n;
  }
  EXPECT_STREQ(MethodName(Method::kLookup), "lookup");
  EXPECT_STREQ(MethodName(Method::kHealth), "health");
  for (int i = 0; i < static_cast<int>(ServerMetric::kCount); ++i) {
    std::string n = ServerMetricName(static_cast<ServerMetric>(i));
    EXPECT_NE(n, "unknown");
    EXPECT_TRUE(names.insert(n).second) << n;
  }
  EXPECT_STREQ(ServerMetricName(ServerMetric::kShmMaps), "shm_maps");
  EXPECT_STREQ(GrpcCodeName(5), "NOT_FOUND");
  EXPECT_STREQ(GrpcCodeName(16), "UNAUTHENTICATED");
}

TEST(ServerMetrics, RenderCountsRequestsErrorsAndBuckets) {
  ServerMetrics m;
  m.Record(Method::kGet, 0, 20e-6);
  m.Record(Method::kGet, 5, 3e-3);
  m.Add(ServerMetric::kBytesGetInline, 77);
  std::string text = m.RenderPrometheus(ServiceStats{});
  EXPECT_THAT(text, ::testing::HasSubstr("kvtier_requests_total{method=\"get\"} 2\n"));
  EXPECT_THAT(text, ::testing::HasSubstr(
                        "kvtier_request_errors_total{method=\"get\",code=\"NOT_FOUND\"} 1\n"));
  EXPECT_THAT(text, ::testing::HasSubstr(
                        "kvtier_request_latency_seconds_bucket{method=\"get\",le=\"2.5e-05\"} 1\n"));
  EXPECT_THAT(text, ::testing::HasSubstr(
                        "kvtier_request_latency_seconds_bucket{method=\"get\",le=\"+Inf\"} 2\n"));
  EXPECT_THAT(text, ::testing::HasSubstr("kvtier_bytes_get_inline_total 77\n"));
}

TEST(GrpcAdapter, StatusMappingKeepsCodeAndMessage) {
  grpc::Status s = ToGrpcStatus(absl::DataLossError("bad sum"));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::DATA_LOSS);
  EXPECT_EQ(s.error_message(), "bad sum");
  EXPECT_EQ(ToGrpcStatus(absl::NotFoundError("x")).error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_TRUE(ToGrpcStatus(absl::OkStatus()).ok());
}

TEST(DaemonOptions, ConfigFileSetsValuesAndRejectsUnknownKeys) {
  TempDir dir;
  std::string path = dir.path() + "/kvtierd.toml";
  {
    std::ofstream f(path);
    f << "data_dir = \"/tmp/x\"\ndram_gib = 0.25\nmax_keys_per_request = 17\ndram_populate = false\n"
         "dram_huge_pages = true\nnvme_read_probe_mib = 0\n";
  }
  DaemonOptions o;
  ASSERT_TRUE(LoadConfigFile(path, &o).ok());
  EXPECT_EQ(o.data_dir, "/tmp/x");
  EXPECT_DOUBLE_EQ(o.dram_gib, 0.25);
  EXPECT_EQ(o.max_keys_per_request, 17u);
  EXPECT_FALSE(o.dram_populate);
  EXPECT_TRUE(o.dram_huge_pages);
  EXPECT_EQ(o.nvme_read_probe_mib, 0u);
  EXPECT_EQ(o.SocketPath(), "/tmp/x/kvtierd.sock");
  {
    std::ofstream f(path);
    f << "tenants = \"/etc/kvtier/tenants.toml\"\n";
  }
  ASSERT_TRUE(LoadConfigFile(path, &o).ok());
  EXPECT_EQ(o.tenants, "/etc/kvtier/tenants.toml");
  {
    std::ofstream f(path);
    f << "dram_gibs = 1\n";
  }
  EXPECT_EQ(LoadConfigFile(path, &o).code(), absl::StatusCode::kInvalidArgument);
  {
    std::ofstream f(path);
    f << "dram_gib = \"lots\"\n";
  }
  EXPECT_EQ(LoadConfigFile(path, &o).code(), absl::StatusCode::kInvalidArgument);
  {
    std::ofstream f(path);
    f << "dram_gib = [\n";
  }
  EXPECT_EQ(LoadConfigFile(path, &o).code(), absl::StatusCode::kInvalidArgument);
}

TEST(DaemonOptions, ValidationRequiresATokenForTcp) {
  DaemonOptions o;
  EXPECT_TRUE(ValidateDaemonOptions(o).ok());
  o.listen_tcp = "127.0.0.1:0";
  EXPECT_EQ(ValidateDaemonOptions(o).code(), absl::StatusCode::kInvalidArgument);
  o.token_file = "/dev/null";
  EXPECT_TRUE(ValidateDaemonOptions(o).ok());
  // A tenants file's tokens stand for the daemon's token.
  o.token_file.clear();
  o.tenants = "/dev/null";
  EXPECT_TRUE(ValidateDaemonOptions(o).ok());
  o.nvme_read_probe_mib = kMaxNvmeReadProbeMib + 1;  // a probe of the whole disk: refused
  EXPECT_EQ(ValidateDaemonOptions(o).code(), absl::StatusCode::kInvalidArgument);
  o.nvme_read_probe_mib = kMaxNvmeReadProbeMib;
  EXPECT_TRUE(ValidateDaemonOptions(o).ok());
  o.dram_gib = -1;
  EXPECT_EQ(ValidateDaemonOptions(o).code(), absl::StatusCode::kInvalidArgument);
}

TEST(DaemonOptions, EvictionNamesAPolicy) {
  DaemonOptions o;
  EXPECT_EQ(o.eviction, "flru,nvme=lru");
  for (const char* name : {"lru", "s3fifo", "arc", "flru", "flru,nvme=lru", "dram=arc"}) {
    o.eviction = name;
    EXPECT_TRUE(ValidateDaemonOptions(o).ok()) << name;
  }
  o.eviction = "lfu";
  absl::Status st = ValidateDaemonOptions(o);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(st.message(), ::testing::HasSubstr("--eviction"));
}

// Writes `content` to `path` with exactly `mode` (whatever the umask).
void WriteTokenFile(const std::string& path, const std::string& content, mode_t mode) {
  std::ofstream(path, std::ios::trunc) << content;
  ASSERT_EQ(::chmod(path.c_str(), mode), 0);
}

TEST(DaemonOptions, TokenFileMustBeOwnerOnlyAndLongEnough) {
  TempDir dir;
  const std::string path = dir.path() + "/token";
  const std::string token(kMinTokenBytes, 'k');
  WriteTokenFile(path, "  " + token + "\n", 0600);
  auto ok = ReadTokenFile(path);
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(*ok, token);
  WriteTokenFile(path, token, 0400);
  EXPECT_TRUE(ReadTokenFile(path).ok());
  for (mode_t mode : {0644, 0640, 0604, 0660, 0606}) {
    SCOPED_TRACE(::testing::Message() << "mode " << std::oct << mode);
    WriteTokenFile(path, token, mode);
    auto st = ReadTokenFile(path).status();
    EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_THAT(st.message(), ::testing::HasSubstr(path));
    EXPECT_THAT(st.message(), ::testing::HasSubstr("chmod 600"));
  }
  WriteTokenFile(path, " " + token.substr(1) + " \n", 0600);
  auto short_token = ReadTokenFile(path).status();
  EXPECT_EQ(short_token.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(short_token.message(), ::testing::HasSubstr(path));
  EXPECT_THAT(short_token.message(), ::testing::HasSubstr(std::to_string(kMinTokenBytes)));
  WriteTokenFile(path, " \n\t", 0600);
  EXPECT_EQ(ReadTokenFile(path).status().code(), absl::StatusCode::kInvalidArgument);
  WriteTokenFile(path, "", 0600);
  EXPECT_EQ(ReadTokenFile(path).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ReadTokenFile(dir.path() + "/missing").status().code(), absl::StatusCode::kNotFound);
}

TEST(MetricsHttpServer, SplitHostPortParsesAndRejects) {
  auto a = SplitHostPort("127.0.0.1:9400");
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->first, "127.0.0.1");
  EXPECT_EQ(a->second, 9400);
  auto b = SplitHostPort("[::1]:0");
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->first, "::1");
  EXPECT_EQ(SplitHostPort("nohost").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(SplitHostPort("h:99999").status().code(), absl::StatusCode::kInvalidArgument);
}

// The get's checked copy with a helper thread: the same bytes and codes as
// CopyVerified, from many callers at once (all but one run it on their own
// thread), for chunks smaller and larger than a piece.
TEST(PipelinedCopyVerifier, CopiesExactlyAndFindsEveryCorruption) {
  wire::PipelinedCopyVerifier v;
  for (uint32_t tokens : {16u, 256u}) {
    auto chunk = MakeChunk(40 + tokens, tokens, 4, 4, 128);
    std::vector<uint8_t> out(chunk.size() + 7, 0);
    for (int i = 0; i < 20; ++i) {
      std::fill(out.begin(), out.end(), 0);
      ASSERT_TRUE(v.CopyVerified(out, chunk).ok());
      EXPECT_TRUE(std::equal(chunk.begin(), chunk.end(), out.begin()));
    }
    for (size_t at : {chunk.size() / 3, chunk.size() - 1}) {  // in K, in V
      auto bad = chunk;
      bad[at] ^= 0x40;
      EXPECT_EQ(v.CopyVerified(out, bad).status().code(), absl::StatusCode::kDataLoss);
    }
    auto bad_header = chunk;
    bad_header[0] ^= 1;  // magic
    EXPECT_EQ(v.CopyVerified(out, bad_header).status().code(),
              absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(v.CopyVerified(out, std::span<const uint8_t>(chunk).first(chunk.size() - 1))
                  .status()
                  .code(),
              absl::StatusCode::kDataLoss);
    ASSERT_TRUE(v.CopyVerified(out, chunk).ok());  // the helper is still usable
  }
  auto chunk = MakeChunk(60, 256, 4, 4, 128);
  std::vector<std::thread> ts;
  std::atomic<int> bad{0};
  for (int t = 0; t < 4; ++t) {
    ts.emplace_back([&] {
      std::vector<uint8_t> out(chunk.size());
      for (int i = 0; i < 10; ++i) {
        if (!v.CopyVerified(out, chunk).ok() || out != chunk) ++bad;
      }
    });
  }
  for (auto& t : ts) t.join();
  EXPECT_EQ(bad.load(), 0);
}

}  // namespace
}  // namespace kvtier::server
