// kvtierd's TCP listener with TLS (gRPC's SSL credentials), certificates made
// by the test with the openssl CLI: real handshakes that succeed (TLS,
// mutual TLS) and fail (expired client certificate, a client certificate
// from another CA, no client certificate when one is required, a client
// that trusts another CA, a plaintext client), the token still required
// over TLS, the startup checks (plaintext on a network address, mismatched
// key), and the verified client identity handlers read (PeerTlsIdentity).
#include <openssl/bio.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <sys/stat.h>

#include <fstream>
#include <future>

#include "client/kvtier_client.h"
#include "common/crypto.h"
#include "common/testing/temp_dir.h"
#include "common/testing/tls_certs.h"
#include "gmock/gmock.h"
#include "grpcpp/generic/async_generic_service.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "server/daemon.h"
#include "server/grpc_auth.h"
#include "server/metrics.h"
#include "server/tenants.h"
#include "server/test_util.h"
#include "tests/cli_runner.h"

namespace kvtier::testing {
namespace {

using ::testing::HasSubstr;

const std::string kToken = "tls-token-0123456789abcdef0123456789";

class TlsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(certs_.ok());
    token_path_ = dir_.path() + "/token";
    std::ofstream(token_path_) << kToken << "\n";
    ASSERT_EQ(::chmod(token_path_.c_str(), 0600), 0);
  }

  server::DaemonOptions Options(bool mtls) {
    server::DaemonOptions o = SmallDaemonOptions(dir_.path() + "/data");
    o.listen_tcp = "127.0.0.1:0";
    o.token_file = token_path_;
    o.tls_cert = certs_.Pem("server");
    o.tls_key = certs_.Key("server");
    if (mtls) o.tls_client_ca = certs_.Pem("ca");
    return o;
  }

  void Start(const server::DaemonOptions& o) {
    daemon_.reset();
    auto d = server::Daemon::Start(o);
    ASSERT_TRUE(d.ok()) << d.status();
    daemon_ = std::move(*d);
  }

  // Client options for the running daemon: the right CA, the right token,
  // and the client certificate `cert` ("" for none).
  client::ClientOptions ClientOpts(const std::string& cert) {
    client::ClientOptions co;
    co.tcp_addr = "127.0.0.1:" + std::to_string(daemon_->tcp_port());
    co.timeout_ms = 5000;
    co.token = kToken;
    co.tls_ca = certs_.Pem("ca");
    if (!cert.empty()) {
      co.tls_cert = certs_.Pem(cert);
      co.tls_key = certs_.Key(cert);
    }
    return co;
  }

  // Connects with `co`, puts chunk i and reads it back.
  void ExpectRoundTrip(const client::ClientOptions& co, uint32_t i) {
    auto c = client::KvtierClient::Connect(co);
    ASSERT_TRUE(c.ok()) << c.status();
    ASSERT_TRUE((*c)->Put(TestKey(i), MakeChunk(i)).ok());
    EXPECT_EQ((*c)->Get(TestKey(i)).value(), MakeChunk(i));
  }

  TlsCerts certs_;
  TempDir dir_;
  std::string token_path_;
  std::unique_ptr<server::Daemon> daemon_;
};

TEST_F(TlsTest, MutualTlsWithTheTokenServesPutsAndGets) {
  Start(Options(/*mtls=*/true));
  EXPECT_THAT(daemon_->Describe(), HasSubstr("(mutual TLS, token)"));
  ExpectRoundTrip(ClientOpts("client"), 1);
  // The token is still required over TLS.
  auto co = ClientOpts("client");
  co.token = kToken.substr(1) + "x";
  auto wrong = client::KvtierClient::Connect(co);
  EXPECT_EQ(wrong.status().code(), absl::StatusCode::kUnauthenticated) << wrong.status();
}

TEST_F(TlsTest, FailedHandshakesNeverReachTheService) {
  Start(Options(/*mtls=*/true));
  struct Case {
    const char* what;
    client::ClientOptions o;
  };
  std::vector<Case> cases;
  cases.push_back({"no client certificate", ClientOpts("")});
  cases.push_back({"expired client certificate", ClientOpts("expired")});
  cases.push_back({"client certificate from another CA", ClientOpts("other-client")});
  auto wrong_ca = ClientOpts("client");
  wrong_ca.tls_ca = certs_.Pem("other-ca");
  cases.push_back({"client trusts another CA", wrong_ca});
  auto plain = ClientOpts("");
  plain.tls_ca.clear();
  cases.push_back({"plaintext client", plain});
  auto wrong_name = ClientOpts("client");
  wrong_name.tls_server_name = "not-the-daemon.example";
  cases.push_back({"certificate for another name", wrong_name});
  for (Case& k : cases) {
    k.o.timeout_ms = 2000;
    auto c = client::KvtierClient::Connect(k.o);
    EXPECT_EQ(c.status().code(), absl::StatusCode::kUnavailable) << k.what << ": " << c.status();
  }
  // The daemon keeps serving good clients.
  ExpectRoundTrip(ClientOpts("client"), 2);
}

// The kvtier CLI's --tls-* flags reach libkvtier.
TEST_F(TlsTest, CliTakesTheTlsFlags) {
  Start(Options(/*mtls=*/true));
  const std::string conn = std::string(KVTIER_CLI_PATH) + " stats --addr 127.0.0.1:" +
                           std::to_string(daemon_->tcp_port()) + " --token-file " + token_path_;
  const std::string tls = " --tls-ca " + certs_.Pem("ca") + " --tls-cert " + certs_.Pem("client") +
                          " --tls-key " + certs_.Key("client");
  auto ok = RunCommand(conn + tls + " --json", dir_.path());
  EXPECT_EQ(ok.exit_code, 0) << ok.err;
  EXPECT_THAT(ok.out, HasSubstr("\"tiers\""));
  auto plain = RunCommand(conn, dir_.path());
  EXPECT_NE(plain.exit_code, 0);
  EXPECT_THAT(plain.err, HasSubstr("not reachable"));
  auto half = RunCommand(conn + " --tls-cert " + certs_.Pem("client"), dir_.path());
  EXPECT_NE(half.exit_code, 0);
  EXPECT_THAT(half.err, HasSubstr("tls_ca"));
}

TEST_F(TlsTest, ServerOnlyTlsNeedsNoClientCertificate) {
  Start(Options(/*mtls=*/false));
  EXPECT_THAT(daemon_->Describe(), HasSubstr("(TLS, token)"));
  ExpectRoundTrip(ClientOpts(""), 3);
  // The host name in the certificate's SAN works through the override too.
  auto named = ClientOpts("");
  named.tls_server_name = "localhost";
  EXPECT_TRUE(client::KvtierClient::Connect(named).ok());
}

TEST_F(TlsTest, StartupRefusesPlaintextOnNetworkAddressesAndBadKeys) {
  server::DaemonOptions o = SmallDaemonOptions(dir_.path() + "/data");
  o.token_file = token_path_;
  o.listen_tcp = "0.0.0.0:0";
  auto d = server::Daemon::Start(o);
  EXPECT_EQ(d.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(d.status().message(), HasSubstr("--insecure-tcp"));
  o.listen_tcp = "10.1.2.3:7000";
  EXPECT_EQ(server::ValidateDaemonOptions(o).code(), absl::StatusCode::kInvalidArgument);
  o.insecure_tcp = true;  // accepted (and logged); not bound here: tests stay on loopback
  EXPECT_TRUE(server::ValidateDaemonOptions(o).ok());
  for (const char* lo : {"127.0.0.1:0", "127.9.9.9:1", "localhost:5", "[::1]:0"}) {
    EXPECT_TRUE(server::IsLoopbackListen(lo)) << lo;
  }
  for (const char* net : {"0.0.0.0:0", "[::]:0", "10.0.0.1:1", "kvtier.example:1", ":7"}) {
    EXPECT_FALSE(server::IsLoopbackListen(net)) << net;
  }
  // Half a TLS configuration, or a key that is not the certificate's.
  server::DaemonOptions t = Options(true);
  t.tls_key.clear();
  EXPECT_EQ(server::ValidateDaemonOptions(t).code(), absl::StatusCode::kInvalidArgument);
  t = Options(true);
  t.tls_key = certs_.Key("client");
  auto bad = server::Daemon::Start(t);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument) << bad.status();
  EXPECT_THAT(bad.status().message(), HasSubstr("not the key of"));
  t = Options(true);
  t.tls_cert = token_path_;  // not PEM
  EXPECT_EQ(server::Daemon::Start(t).status().code(), absl::StatusCode::kInvalidArgument);
  t = Options(true);
  ASSERT_EQ(::chmod(t.tls_key.c_str(), 0644), 0);
  EXPECT_EQ(server::Daemon::Start(t).status().code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_EQ(::chmod(t.tls_key.c_str(), 0600), 0);
}

// A self-signed certificate valid from now + `from_s` to now + `to_s`, and
// its key, as PEM (the openssl CLI of Debian 12 cannot date one in the past).
std::pair<std::string, std::string> DatedCert(long from_s, long to_s) {
  auto pem = [](auto write) {
    BIO* b = BIO_new(BIO_s_mem());
    write(b);
    char* p = nullptr;
    const long n = BIO_get_mem_data(b, &p);
    std::string s(p, static_cast<size_t>(n));
    BIO_free(b);
    return s;
  };
  EVP_PKEY* key = EVP_EC_gen("P-256");
  X509* x = X509_new();
  ASN1_INTEGER_set(X509_get_serialNumber(x), 7);
  X509_gmtime_adj(X509_getm_notBefore(x), from_s);
  X509_gmtime_adj(X509_getm_notAfter(x), to_s);
  X509_set_pubkey(x, key);
  X509_NAME* name = X509_get_subject_name(x);
  X509_NAME_add_entry_by_txt(name, "CN", MBSTRING_ASC,
                             reinterpret_cast<const unsigned char*>("localhost"), -1, -1, 0);
  X509_set_issuer_name(x, name);
  X509_sign(x, key, EVP_sha256());
  auto cert = pem([&](BIO* b) { PEM_write_bio_X509(b, x); });
  auto k = pem([&](BIO* b) { PEM_write_bio_PrivateKey(b, key, nullptr, nullptr, 0, nullptr, nullptr); });
  X509_free(x);
  EVP_PKEY_free(key);
  return {cert, k};
}

// A certificate outside its validity fails every handshake: the daemon says
// so at start and does not serve.
TEST_F(TlsTest, StartupRefusesAnExpiredOrNotYetValidCertificate) {
  const auto [expired, expired_key] = DatedCert(-2 * 86400, -86400);
  absl::Status st = server::CheckServerTls({expired, expired_key, ""});
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(st.message(), HasSubstr("expired on"));
  const auto [future, future_key] = DatedCert(86400, 2 * 86400);
  st = server::CheckServerTls({future, future_key, ""});
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(st.message(), HasSubstr("not valid before"));
  const auto [good, good_key] = DatedCert(-60, 86400);
  EXPECT_TRUE(server::CheckServerTls({good, good_key, ""}).ok());
  // Through the daemon's start.
  server::DaemonOptions t = Options(true);
  t.tls_cert = dir_.path() + "/expired.pem";
  t.tls_key = dir_.path() + "/expired.key";
  std::ofstream(t.tls_cert) << expired;
  std::ofstream(t.tls_key) << expired_key;
  ASSERT_EQ(::chmod(t.tls_key.c_str(), 0600), 0);
  auto d = server::Daemon::Start(t);
  EXPECT_EQ(d.status().code(), absl::StatusCode::kFailedPrecondition) << d.status();
  EXPECT_THAT(d.status().message(), HasSubstr("expired on"));
}

// A service that answers every call with the caller's verified identity
// (in the status message), behind the daemon's TCP credentials.
TEST_F(TlsTest, TenantTokenMustMatchTheCertificatesTenant) {
  // Tenant "a" is the client certificate's CN; "b" has only a token.
  const std::string token_b = "tenant-b-tls-token-0123456789abcdef012345";
  auto sha = [](const std::string& t) {
    return HexOf(Sha256(AsBytes(t)));
  };
  const std::string tenants = dir_.path() + "/tenants.toml";
  std::ofstream(tenants) << "[[tenant]]\nname = \"a\"\ntls_cn = [\"" << TlsCerts::kClientCn
                         << "\"]\ntoken_sha256 = \"" << sha(kToken) << "\"\n[[tenant]]\nname = \"b\"\n"
                         << "token_sha256 = \"" << sha(token_b) << "\"\n";
  server::DaemonOptions o = Options(/*mtls=*/true);
  o.tenants = tenants;
  o.token_file.clear();
  Start(o);
  // A's certificate with A's token: served, in A's namespace.
  ExpectRoundTrip(ClientOpts("client"), 1);
  // A's certificate with B's token: refused before any chunk moves.
  client::ClientOptions co = ClientOpts("client");
  co.token = token_b;
  auto c = client::KvtierClient::Connect(co);
  absl::Status st = c.ok() ? (*c)->Get(TestKey(1)).status() : c.status();
  EXPECT_EQ(st.code(), absl::StatusCode::kUnauthenticated) << st;
  EXPECT_THAT(std::string(st.message()), HasSubstr("different tenants"));
}

class IdentityService : public grpc::CallbackGenericService {
  grpc::ServerGenericBidiReactor* CreateReactor(grpc::GenericCallbackServerContext* ctx) override {
    class Reactor : public grpc::ServerGenericBidiReactor {
     public:
      explicit Reactor(std::string id) { Finish(grpc::Status(grpc::StatusCode::ABORTED, "identity=" + id)); }
      void OnDone() override { delete this; }
    };
    return new Reactor(server::PeerTlsIdentity(*ctx->auth_context()));
  }
};

TEST_F(TlsTest, PeerTlsIdentityIsTheVerifiedClientCertificatesName) {
  server::ServerMetrics metrics;
  server::ServerTls tls{TlsCerts::Read(certs_.Pem("server")), TlsCerts::Read(certs_.Key("server")),
                        TlsCerts::Read(certs_.Pem("ca"))};
  ASSERT_TRUE(server::CheckServerTls(tls).ok());
  auto run = [&](const server::ServerTls* t, std::shared_ptr<grpc::ChannelCredentials> creds) {
    IdentityService service;  // one server each; outlives it
    grpc::ServerBuilder b;
    int port = 0;
    b.AddListeningPort("127.0.0.1:0", server::BearerTokenServerCredentials(kToken, &metrics, t), &port);
    b.RegisterCallbackGenericService(&service);
    auto srv = b.BuildAndStart();
    EXPECT_GT(port, 0);
    grpc::GenericStub stub(grpc::CreateChannel("127.0.0.1:" + std::to_string(port), creds));
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    ctx.AddMetadata("authorization", "Bearer " + kToken);
    grpc::Slice body(std::string("?"));
    grpc::ByteBuffer req(&body, 1), resp;
    std::promise<grpc::Status> done;
    stub.UnaryCall(&ctx, "/test.Identity/Get", {}, &req, &resp,
                   [&](grpc::Status s) { done.set_value(std::move(s)); });
    grpc::Status s = done.get_future().get();
    srv->Shutdown();
    return s;
  };
  grpc::SslCredentialsOptions ssl;
  ssl.pem_root_certs = TlsCerts::Read(certs_.Pem("ca"));
  ssl.pem_cert_chain = TlsCerts::Read(certs_.Pem("client"));
  ssl.pem_private_key = TlsCerts::Read(certs_.Key("client"));
  grpc::Status s = run(&tls, grpc::SslCredentials(ssl));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::ABORTED) << s.error_message();
  EXPECT_EQ(s.error_message(), std::string("identity=") + TlsCerts::kClientSan);
  // Server-only TLS, and plaintext: no client identity.
  server::ServerTls server_only = tls;
  server_only.client_ca.clear();
  grpc::SslCredentialsOptions anon;
  anon.pem_root_certs = ssl.pem_root_certs;
  s = run(&server_only, grpc::SslCredentials(anon));
  EXPECT_EQ(s.error_message(), "identity=");
  s = run(nullptr, grpc::InsecureChannelCredentials());
  EXPECT_EQ(s.error_message(), "identity=");
}

}  // namespace
}  // namespace kvtier::testing
