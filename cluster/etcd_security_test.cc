// etcd over TLS with client-certificate authentication and with user and
// password (real etcd processes; certificates made by the test with the
// openssl CLI), and member records signed with the cluster secret: a record
// that is unsigned, signed with another secret or altered is ignored and
// counted, so a writer to etcd without the secret cannot add a member or
// redirect one's traffic.
#include <chrono>
#include <thread>

#include "cluster/etcd_rpc.grpc.pb.h"
#include "cluster/etcd_test_util.h"
#include "cluster/membership.h"
#include "common/testing/tls_certs.h"
#include "common/testing/wait.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"

namespace kvtier::cluster {
namespace {

using ::kvtier::testing::TlsCerts;
using ::testing::HasSubstr;

const std::string kSecret = "cluster-secret-0123456789abcdef0123456789";
const std::string kOtherSecret = "another-secret-0123456789abcdef0123456789";

EtcdClientOptions ClientTls(const TlsCerts& certs, const std::string& cert, const std::string& ca = "ca") {
  EtcdClientOptions o;
  o.timeout = absl::Seconds(2);
  o.ca = TlsCerts::Read(certs.Pem(ca));
  if (!cert.empty()) {
    o.cert = TlsCerts::Read(certs.Pem(cert));
    o.key = TlsCerts::Read(certs.Key(cert));
  }
  return o;
}

MemberRecord Record(const std::string& id, const std::string& address) {
  MemberRecord r;
  r.member = {id, address, "", 1000, 0};
  r.protocol = 1;
  return r;
}

TEST(RecordSigner, MacCoversEveryFieldTheKeyAndTheLease) {
  auto s = RecordSigner::Create(kSecret);
  ASSERT_TRUE(s.ok()) << s.status();
  const std::string key = MembersPrefix("c") + "node-1";
  MemberRecord r = Record("node-1", "10.0.0.1:7000");
  r.mac = s->Sign(key, r, 42);
  EXPECT_EQ(r.mac.size(), 64u);
  EXPECT_TRUE(s->Verify(key, r, 42));
  auto back = DecodeMemberRecord(EncodeMemberRecord(r));
  ASSERT_TRUE(back.ok());
  EXPECT_TRUE(s->Verify(key, *back, 42));
  EXPECT_FALSE(s->Verify(key, r, 43));                         // another lease
  EXPECT_FALSE(s->Verify(MembersPrefix("d") + "node-1", r, 42));  // another cluster
  for (int field = 0; field < 5; ++field) {
    MemberRecord t = r;
    switch (field) {
      case 0: t.member.address = "10.6.6.6:7000"; break;  // redirect its traffic
      case 1: t.member.worker = "ucx:00"; break;
      case 2: t.member.capacity_bytes += 1; break;
      case 3: t.member.used_bytes += 1; break;
      case 4: t.protocol += 1; break;
    }
    EXPECT_FALSE(s->Verify(key, t, 42)) << field;
  }
  auto other = RecordSigner::Create(kOtherSecret);
  ASSERT_TRUE(other.ok());
  EXPECT_FALSE(other->Verify(key, r, 42));
  EXPECT_EQ(RecordSigner::Create("short").status().code(), absl::StatusCode::kInvalidArgument);
  // A MAC that is not 64 hex digits is a malformed record.
  std::string bad = EncodeMemberRecord(r);
  bad.replace(bad.find(r.mac), 2, "ZZ");
  EXPECT_EQ(DecodeMemberRecord(bad).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(EtcdEndpoints, HttpsNeedsACaAndListsDoNotMixSchemes) {
  auto e = ParseEtcdEndpoints("https://127.0.0.1:2379,https://h:2");
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_THAT(*e, ::testing::ElementsAre("https://127.0.0.1:2379", "https://h:2"));
  EXPECT_EQ(ParseEtcdEndpoints("https://h:1,http://h:2").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseEtcdEndpoints("https://h").status().code(), absl::StatusCode::kInvalidArgument);
  EtcdClientOptions tls;
  tls.ca = "pem";
  EXPECT_EQ(EtcdClient::Connect({"https://h:1"}, EtcdClientOptions{}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(EtcdClient::Connect({"http://h:1"}, tls).status().code(), absl::StatusCode::kInvalidArgument);
  tls.cert = "pem";
  EXPECT_EQ(EtcdClient::Connect({"https://h:1"}, tls).status().code(), absl::StatusCode::kInvalidArgument);
  EtcdClientOptions user;
  user.user = "root";
  EXPECT_EQ(EtcdClient::Connect({"h:1"}, user).status().code(), absl::StatusCode::kInvalidArgument);
}

class EtcdTlsTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    certs_ = new TlsCerts();
    EtcdServerTlsFor(*certs_);
  }
  static void EtcdServerTlsFor(const TlsCerts& certs) {
    testing::EtcdServerTls tls;
    tls.cert = certs.Pem("server");
    tls.key = certs.Key("server");
    tls.ca = certs.Pem("ca");
    tls.client_cert_auth = true;
    tls.client = ClientTls(certs, "client");
    etcd_ = new testing::EtcdServer(&tls);
  }
  static void TearDownTestSuite() {
    delete etcd_;
    delete certs_;
  }
  void SetUp() override {
    ASSERT_TRUE(certs_->ok());
    ASSERT_TRUE(etcd_->ok()) << etcd_->error();
  }
  static TlsCerts* certs_;
  static testing::EtcdServer* etcd_;
};
TlsCerts* EtcdTlsTest::certs_ = nullptr;
testing::EtcdServer* EtcdTlsTest::etcd_ = nullptr;

TEST_F(EtcdTlsTest, ClientCertificateHandshakes) {
  auto good = EtcdClient::Connect({etcd_->endpoint()}, ClientTls(*certs_, "client"));
  ASSERT_TRUE(good.ok()) << good.status();
  EXPECT_TRUE((*good)->Put("/tls/x", "1").ok());
  struct Case {
    const char* what;
    EtcdClientOptions o;
  };
  std::vector<Case> cases = {{"no client certificate", ClientTls(*certs_, "")},
                             {"expired client certificate", ClientTls(*certs_, "expired")},
                             {"client certificate of another CA", ClientTls(*certs_, "other-client")},
                             {"client trusts another CA", ClientTls(*certs_, "client", "other-ca")}};
  for (Case& c : cases) {
    auto client = EtcdClient::Connect({etcd_->endpoint()}, c.o);
    ASSERT_TRUE(client.ok()) << c.what;
    auto put = (*client)->Put("/tls/y", "1");
    EXPECT_EQ(put.status().code(), absl::StatusCode::kUnavailable) << c.what << ": " << put.status();
  }
  // A plaintext client against the TLS port.
  std::string plain = etcd_->endpoint();
  plain.replace(0, 5, "http");
  auto p = EtcdClient::Connect({plain}, absl::Seconds(2));
  ASSERT_TRUE(p.ok());
  EXPECT_EQ((*p)->Put("/tls/z", "1").status().code(), absl::StatusCode::kUnavailable);
  auto got = (*good)->GetPrefix("/tls/");
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(got->first.size(), 1u);  // only the good client's put landed
}

TEST_F(EtcdTlsTest, SignedMembersOverTlsIgnoreForgedRecords) {
  const std::string cluster = "signed";
  auto join = [&](const std::string& id, const std::string& secret) {
    MembershipOptions o;
    o.cluster = cluster;
    o.node_id = id;
    o.advertise = "127.0.0.1:" + std::to_string(7100 + id.back());
    o.lease_ttl_s = 5;
    o.cluster_secret = secret;
    auto m = Membership::Join(o, EtcdClient::Connect({etcd_->endpoint()}, ClientTls(*certs_, "client")).value());
    EXPECT_TRUE(m.ok()) << m.status();
    return m.ok() ? std::move(*m) : nullptr;
  };
  auto a = join("node-1", kSecret);
  auto b = join("node-2", kSecret);
  ASSERT_TRUE(a && b);
  auto ids = [](const Membership& m) {
    std::vector<std::string> out;
    for (const auto& x : m.LiveMembers()) out.push_back(x.id);
    return out;
  };
  auto eventually = [](auto pred) {
    return ::kvtier::testing::WaitUntil(pred, std::chrono::seconds(10), std::chrono::milliseconds(50));
  };
  ASSERT_TRUE(eventually([&] { return ids(*a).size() == 2 && ids(*b).size() == 2; }));

  // A writer to etcd without the secret: an unsigned record, one signed with
  // another secret, and node-2's record redirected to another address (its
  // MAC kept). None is a member; node-2 drops out until it re-publishes.
  const uint64_t before = a->rejected_records();
  auto writer = EtcdClient::Connect({etcd_->endpoint()}, ClientTls(*certs_, "client")).value();
  auto lease = writer->LeaseGrant(30).value();
  const std::string prefix = MembersPrefix(cluster);
  ASSERT_TRUE(writer->Put(prefix + "forged-1", EncodeMemberRecord(Record("forged-1", "10.6.6.6:1")), lease).ok());
  MemberRecord other = Record("forged-2", "10.6.6.6:2");
  other.mac = RecordSigner::Create(kOtherSecret)->Sign(prefix + "forged-2", other, lease);
  ASSERT_TRUE(writer->Put(prefix + "forged-2", EncodeMemberRecord(other), lease).ok());
  auto kvs = writer->GetPrefix(prefix + "node-2").value().first;
  ASSERT_EQ(kvs.size(), 1u);
  MemberRecord redirected = DecodeMemberRecord(kvs[0].value).value();
  redirected.member.address = "10.6.6.6:3";
  ASSERT_TRUE(writer->Put(prefix + "node-2", EncodeMemberRecord(redirected), kvs[0].lease).ok());
  ASSERT_TRUE(eventually([&] { return a->rejected_records() >= before + 3; })) << a->rejected_records();
  for (const auto& m : a->LiveMembers()) {
    EXPECT_NE(m.address, "10.6.6.6:3") << "a redirected record was taken";
    EXPECT_THAT(m.id, ::testing::Not(HasSubstr("forged")));
  }
  // A node without the secret (or with another) reads etcd but its record
  // is not a member for the others.
  const uint64_t before_nodes = a->rejected_records();
  auto c = join("node-3", "");
  auto d = join("node-4", kOtherSecret);
  ASSERT_TRUE(c && d);
  ASSERT_TRUE(eventually([&] { return a->rejected_records() >= before_nodes + 2; }));
  for (const std::string& id : ids(*a)) EXPECT_TRUE(id == "node-1" || id == "node-2") << id;
  // node-4 checks records with its own secret: of what is in etcd, only
  // its own record and the one signed with that secret are its members.
  EXPECT_THAT(ids(*d), ::testing::ElementsAre("forged-2", "node-4"));
}

// etcd with authentication enabled (root user, password) on a TLS port
// without client certificates: the client authenticates, and a wrong
// password or none is refused; an expired token is renewed.
TEST(EtcdAuth, UserAndPasswordGetATokenThatIsRenewed) {
  TlsCerts certs;
  ASSERT_TRUE(certs.ok());
  testing::EtcdServerTls tls;
  tls.cert = certs.Pem("server");
  tls.key = certs.Key("server");
  tls.client = ClientTls(certs, "");
  tls.extra_args = {"--auth-token", "simple", "--auth-token-ttl", "1"};
  testing::EtcdServer etcd(&tls);
  ASSERT_TRUE(etcd.ok()) << etcd.error();
  {
    // Set up the root user and enable auth (etcd's Auth API).
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = TlsCerts::Read(certs.Pem("ca"));
    auto stub = etcdserverpb::Auth::NewStub(
        grpc::CreateChannel(etcd.endpoint().substr(8), grpc::SslCredentials(ssl)));
    auto call = [](auto fn) {
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
      return fn(&ctx);
    };
    etcdserverpb::AuthUserAddRequest add;
    add.set_name("root");
    add.set_password("root-password");
    etcdserverpb::AuthUserAddResponse add_resp;
    ASSERT_TRUE(call([&](grpc::ClientContext* c) { return stub->UserAdd(c, add, &add_resp); }).ok());
    etcdserverpb::AuthUserGrantRoleRequest grant;
    grant.set_user("root");
    grant.set_role("root");
    etcdserverpb::AuthUserGrantRoleResponse grant_resp;
    ASSERT_TRUE(call([&](grpc::ClientContext* c) { return stub->UserGrantRole(c, grant, &grant_resp); }).ok());
    etcdserverpb::AuthEnableRequest enable;
    etcdserverpb::AuthEnableResponse enable_resp;
    ASSERT_TRUE(call([&](grpc::ClientContext* c) { return stub->AuthEnable(c, enable, &enable_resp); }).ok());
  }
  EtcdClientOptions o = ClientTls(certs, "");
  o.user = "root";
  o.password = "root-password";
  auto good = EtcdClient::Connect({etcd.endpoint()}, o);
  ASSERT_TRUE(good.ok()) << good.status();
  ASSERT_TRUE((*good)->Put("/auth/x", "1").ok());
  std::this_thread::sleep_for(std::chrono::milliseconds(2500));  // the token's TTL passes
  auto got = (*good)->GetPrefix("/auth/");
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->first.size(), 1u);
  // Membership (lease, watch) works with the token.
  MembershipOptions mo;
  mo.cluster = "auth";
  mo.node_id = "node-1";
  mo.advertise = "127.0.0.1:7001";
  mo.cluster_secret = kSecret;
  auto m = Membership::Join(mo, std::move(*good));
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ((*m)->LiveMembers().size(), 1u);

  o.password = "wrong-password";
  auto wrong = EtcdClient::Connect({etcd.endpoint()}, o).value();
  auto w = wrong->Put("/auth/y", "1");
  EXPECT_EQ(w.status().code(), absl::StatusCode::kPermissionDenied) << w.status();
  EXPECT_THAT(w.status().message(), HasSubstr("authenticate as 'root'"));
  auto anonymous = EtcdClient::Connect({etcd.endpoint()}, ClientTls(certs, "")).value();
  EXPECT_FALSE(anonymous->Put("/auth/z", "1").ok());
}

}  // namespace
}  // namespace kvtier::cluster
