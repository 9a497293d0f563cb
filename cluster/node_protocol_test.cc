#include "cluster/node_protocol.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvtier::cluster {
namespace {

using ::testing::HasSubstr;

WireHeader Sample() {
  WireHeader h;
  h.op = Op::kGet;
  h.reply = true;
  h.request_id = 0x1122334455667788ull;
  h.id.key = Hash128::Of(std::string_view("k"), 0);
  h.id.part = tiering::Part::kV;
  h.status = absl::StatusCode::kNotFound;
  h.length = 25182336;
  return h;
}

TEST(Wire, HeaderRoundTrips) {
  std::array<uint8_t, kWireHeaderSize> buf;
  EncodeHeader(Sample(), buf);
  auto h = DecodeHeader(buf);
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_EQ(h->op, Op::kGet);
  EXPECT_TRUE(h->reply);
  EXPECT_EQ(h->request_id, 0x1122334455667788ull);
  EXPECT_EQ(h->id, Sample().id);
  EXPECT_EQ(h->status, absl::StatusCode::kNotFound);
  EXPECT_EQ(h->length, 25182336u);
  EXPECT_EQ(PeekRequestId(buf), 0x1122334455667788ull);
}

TEST(Wire, OtherVersionsAreRefusedNamingBoth) {
  WireHeader h = Sample();
  h.version = 2;
  std::array<uint8_t, kWireHeaderSize> buf;
  EncodeHeader(h, buf);
  auto r = DecodeHeader(buf);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(r.status().message(), HasSubstr("version 2"));
  EXPECT_THAT(r.status().message(), HasSubstr("version 1"));
  // A newer peer's longer header is still refused by version, not by size.
  std::vector<uint8_t> longer(buf.begin(), buf.end());
  longer.resize(96);
  EXPECT_EQ(DecodeHeader(longer).status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST(Wire, MalformedHeadersAreInvalidArgument) {
  std::array<uint8_t, kWireHeaderSize> good;
  EncodeHeader(Sample(), good);
  for (size_t n = 0; n < kWireHeaderSize; ++n) {
    EXPECT_EQ(DecodeHeader({good.data(), n}).status().code(), absl::StatusCode::kInvalidArgument) << n;
  }
  struct Case {
    size_t off;
    uint8_t value;
    const char* what;
  } cases[] = {{kWireOffMagic, 0, "magic"},       {kWireOffOp, 0, "op"},
               {kWireOffOp, 9, "op"},             {kWireOffFlags, 2, "flags"},
               {kWireOffPart, 3, "part"},         {kWireOffStatus, 99, "status"},
               {kWireOffReserved + 5, 1, "reserved"}, {kWireOffPart + 1, 1, "reserved"}};
  for (const Case& c : cases) {
    auto bad = good;
    bad[c.off] = c.value;
    auto r = DecodeHeader(bad);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << c.what;
    EXPECT_THAT(r.status().message(), HasSubstr(c.what));
  }
}

}  // namespace
}  // namespace kvtier::cluster
