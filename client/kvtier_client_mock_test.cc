// libkvtier against a mock stub: the client's translation of requests and
// statuses, without a daemon.
#include "client/kvtier_client_internal.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "wire/kvtier_mock.grpc.pb.h"

namespace kvtier::client {
namespace {

namespace pb = kvtier::proto::v1;
using ::testing::_;
using ::testing::DoAll;
using ::testing::Invoke;
using ::testing::Return;

Hash128 Key(int i) { return Hash128::Of("mock-" + std::to_string(i), 0); }

TEST(ClientWithMockStub, LookupSendsVersionAndKeysAndMapsTiers) {
  pb::MockKvtierStub stub;
  EXPECT_CALL(stub, Lookup(_, _, _))
      .WillOnce(Invoke([](grpc::ClientContext*, const pb::LookupRequest& req, pb::LookupResponse* resp) {
        EXPECT_EQ(req.version(), 1u);
        EXPECT_EQ(req.keys_size(), 3);
        EXPECT_EQ(req.keys(1), std::string(reinterpret_cast<const char*>(Key(1).bytes.data()), 16));
        resp->add_tiers(pb::TIER_DRAM);
        resp->add_tiers(pb::TIER_NVME);
        return grpc::Status::OK;
      }));
  auto c = NewClientForStub(&stub, ClientOptions{});
  std::vector<Hash128> keys = {Key(0), Key(1), Key(2)};
  auto r = c->Lookup(keys);
  ASSERT_TRUE(r.ok());
  EXPECT_THAT(*r, ::testing::ElementsAre(Tier::kDram, Tier::kNvme));
}

// PlanLoad asks for the estimates and passes the prefill rate, chunk size
// and attention doubling length as they are (the daemon checks them).
TEST(ClientWithMockStub, PlanLoadSendsThePrefillCostAndMapsThePlan) {
  pb::MockKvtierStub stub;
  EXPECT_CALL(stub, Lookup(_, _, _))
      .WillOnce(Invoke([](grpc::ClientContext*, const pb::LookupRequest& req, pb::LookupResponse* resp) {
        EXPECT_TRUE(req.estimate_load());
        EXPECT_EQ(req.prefill_tokens_per_s(), 40000);
        EXPECT_EQ(req.tokens_per_chunk(), 256u);
        EXPECT_EQ(req.attention_doubling_tokens(), 32512);
        resp->add_tiers(pb::TIER_NVME);
        resp->add_chunk_bytes(1000);
        resp->add_load_us(6760);
        resp->set_load_chunks(1);
        resp->set_load_chunks_us(6760);
        resp->set_saved_us(150);
        return grpc::Status::OK;
      }))
      .WillOnce(Invoke([](grpc::ClientContext*, const pb::LookupRequest& req, pb::LookupResponse*) {
        EXPECT_EQ(req.attention_doubling_tokens(), 0);  // the default: linear
        EXPECT_EQ(req.prefill_tokens_per_s(), 1000);
        return grpc::Status::OK;
      }));
  auto c = NewClientForStub(&stub, ClientOptions{});
  std::vector<Hash128> keys = {Key(0), Key(1)};
  auto plan = c->PlanLoad(keys, 40000, 256, 32512);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_THAT(plan->tiers, ::testing::ElementsAre(Tier::kNvme));
  EXPECT_EQ(plan->load_chunks, 1u);
  EXPECT_EQ(plan->load_us, std::vector<double>{6760});
  EXPECT_EQ(plan->saved_us, 150);
  auto linear = c->PlanLoad(keys, 1000, 16);
  ASSERT_TRUE(linear.ok()) << linear.status();
  EXPECT_TRUE(linear->tiers.empty());
}

TEST(ClientWithMockStub, PutWithoutSharedMemorySendsInlineBytes) {
  pb::MockKvtierStub stub;
  std::vector<uint8_t> chunk = {1, 2, 3, 4};
  EXPECT_CALL(stub, Put(_, _, _))
      .WillOnce(Invoke([&](grpc::ClientContext*, const pb::PutRequest& req, pb::PutResponse*) {
        EXPECT_EQ(req.data_case(), pb::PutRequest::kInlineChunk);
        EXPECT_EQ(req.inline_chunk(), std::string("\x01\x02\x03\x04", 4));
        EXPECT_TRUE(req.durable());
        return grpc::Status::OK;
      }));
  auto c = NewClientForStub(&stub, ClientOptions{});
  PutOptions po;
  po.durable = true;
  EXPECT_TRUE(c->Put(Key(0), chunk, po).ok());
  EXPECT_EQ(c->AllocateSlot(10).status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST(ClientWithMockStub, ErrorsKeepTheirCodes) {
  pb::MockKvtierStub stub;
  EXPECT_CALL(stub, Get(_, _, _))
      .WillOnce(Return(grpc::Status(grpc::StatusCode::NOT_FOUND, "chunk not stored")))
      .WillOnce(Return(grpc::Status(grpc::StatusCode::DATA_LOSS, "corrupt")));
  EXPECT_CALL(stub, Delete(_, _, _))
      .WillOnce(Return(grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, "pinned")));
  auto c = NewClientForStub(&stub, ClientOptions{});
  auto g = c->Get(Key(1));
  EXPECT_EQ(g.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(g.status().message(), "chunk not stored");
  EXPECT_EQ(c->Get(Key(1)).status().code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(c->Delete(Key(1)).code(), absl::StatusCode::kFailedPrecondition);
}

TEST(ClientWithMockStub, InlineGetCopiesBytesAndSendsToken) {
  pb::MockKvtierStub stub;
  EXPECT_CALL(stub, Get(_, _, _))
      .WillOnce(Invoke([](grpc::ClientContext* ctx, const pb::GetRequest& req, pb::GetResponse* resp) {
        EXPECT_EQ(req.mode(), pb::GET_MODE_INLINE);
        resp->set_inline_chunk("abcdef");
        resp->set_tier(pb::TIER_NVME);
        return grpc::Status::OK;
      }));
  ClientOptions o;
  o.token = "t0k";
  auto c = NewClientForStub(&stub, o);
  std::vector<uint8_t> out(8);
  auto r = c->GetInto(Key(2), out);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->first, 6u);
  EXPECT_EQ(r->second, Tier::kNvme);
  EXPECT_EQ(std::string(out.begin(), out.begin() + 6), "abcdef");
}

}  // namespace
}  // namespace kvtier::client
