// TenantRegistry::ByAuthContext over real TLS handshakes: a gRPC server with
// TLS that requires client certificates (certificates made by this test with
// the openssl command), and clients whose certificate CN is a tenant's, is
// no tenant's, or that present none.
#include <cstdlib>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/file.h"
#include "common/testing/temp_dir.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "server/tenants.h"
#include "wire/kvtier.grpc.pb.h"

namespace kvtier::server {
namespace {

namespace pb = kvtier::proto::v1;

// Answers Health with the tenant of the caller's certificate in
// shm_socket ("" for none): the lookup under test, on the server's side of a
// real handshake.
class TenantEcho final : public pb::Kvtier::Service {
 public:
  explicit TenantEcho(const TenantRegistry* tenants) : tenants_(tenants) {}
  grpc::Status Health(grpc::ServerContext* ctx, const pb::HealthRequest*,
                      pb::HealthResponse* resp) override {
    const Tenant* t = tenants_->ByAuthContext(*ctx->auth_context());
    resp->set_shm_socket(t == nullptr ? "" : t->name());
    return grpc::Status::OK;
  }

 private:
  const TenantRegistry* const tenants_;
};

class TenantsTlsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::string d = dir_.path();
    // A CA, the server's certificate (127.0.0.1) and two client
    // certificates, all signed by the CA.
    const std::string script = absl::StrCat(
        "set -e; cd ", d, "; exec >openssl.log 2>&1\n",
        "ec='-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes'\n",
        "openssl req -x509 $ec -keyout ca.key -out ca.pem -days 1 -subj /CN=test-ca\n",
        "for n in server a b; do\n", "  cn=$n.example; [ $n = server ] && cn=localhost\n",
        "  openssl req $ec -keyout $n.key -out $n.csr -subj /CN=$cn\n",
        "  printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\\n' > $n.ext\n",
        "  openssl x509 -req -in $n.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out $n.pem -days "
        "1 "
        "-extfile $n.ext\n",
        "done\n");
    ASSERT_EQ(std::system(absl::StrCat("bash -c '", EscapeQuotes(script), "'").c_str()), 0)
        << Read("openssl.log");
    tenants_ = std::make_unique<TenantRegistry>(
        ParseTenants("[[tenant]]\nname = \"team-a\"\ntls_cn = [\"a.example\"]\n").value());
    service_ = std::make_unique<TenantEcho>(tenants_.get());
    grpc::SslServerCredentialsOptions o(GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
    o.pem_root_certs = Read("ca.pem");
    o.pem_key_cert_pairs.push_back({Read("server.key"), Read("server.pem")});
    grpc::ServerBuilder b;
    b.AddListeningPort("127.0.0.1:0", grpc::SslServerCredentials(o), &port_);
    b.RegisterService(service_.get());
    server_ = b.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    ASSERT_NE(port_, 0);
  }
  void TearDown() override {
    if (server_) server_->Shutdown(std::chrono::system_clock::now());
  }

  static std::string EscapeQuotes(const std::string& s) {
    std::string out;
    for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
    return out;
  }
  std::string Read(const std::string& name) {
    auto b = ReadFileBytes(dir_.path() + "/" + name, 1 << 20);
    return b.ok() ? std::string(b->begin(), b->end()) : std::string();
  }

  // Health over TLS with client certificate `who` ("" for none); the
  // tenant the server found, or the call's error.
  grpc::Status Call(const std::string& who, std::string* tenant) {
    grpc::SslCredentialsOptions o;
    o.pem_root_certs = Read("ca.pem");
    if (!who.empty()) {
      o.pem_private_key = Read(who + ".key");
      o.pem_cert_chain = Read(who + ".pem");
    }
    auto stub = pb::Kvtier::NewStub(
        grpc::CreateChannel(absl::StrCat("127.0.0.1:", port_), grpc::SslCredentials(o)));
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    pb::HealthRequest req;
    pb::HealthResponse resp;
    grpc::Status st = stub->Health(&ctx, req, &resp);
    *tenant = resp.shm_socket();
    return st;
  }

  kvtier::testing::TempDir dir_;
  std::unique_ptr<TenantRegistry> tenants_;
  std::unique_ptr<TenantEcho> service_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
};

TEST_F(TenantsTlsTest, ClientCertificateCnNamesTheTenant) {
  std::string tenant;
  grpc::Status st = Call("a", &tenant);
  ASSERT_TRUE(st.ok()) << st.error_message();
  EXPECT_EQ(tenant, "team-a");
}

TEST_F(TenantsTlsTest, CertificateOfNoTenantNamesNone) {
  std::string tenant = "unset";
  grpc::Status st = Call("b", &tenant);
  ASSERT_TRUE(st.ok()) << st.error_message();
  EXPECT_EQ(tenant, "");
}

TEST_F(TenantsTlsTest, NoClientCertificateFailsTheHandshake) {
  std::string tenant;
  EXPECT_EQ(Call("", &tenant).error_code(), grpc::StatusCode::UNAVAILABLE);
}

}  // namespace
}  // namespace kvtier::server
