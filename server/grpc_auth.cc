#include "server/grpc_auth.h"

#include <grpc/grpc.h>
#include <grpc/grpc_security.h>
#include <grpc/slice.h>

#include <openssl/bio.h>
#include <openssl/pem.h>
#include <openssl/x509.h>

#include <memory>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"

#include "common/crypto.h"
#include "server/metrics.h"

namespace kvtier::server {

bool IsBearerToken(std::string_view value, std::string_view token) {
  constexpr std::string_view kBearer = "Bearer ";
  if (value.substr(0, kBearer.size()) != kBearer) return false;
  return ConstantTimeEquals(value.substr(kBearer.size()), token);
}

namespace {

struct TokenState {
  std::function<bool(std::string_view)> accepts;
  ServerMetrics* metrics;
};

// The metrics' method of a call's ":path" ("/kvtier.proto.v1.Kvtier/Get");
// PutStream counts as a put.
std::optional<Method> MethodOfPath(std::string_view path) {
  constexpr std::string_view kPrefix = "/kvtier.proto.v1.Kvtier/";
  if (path.substr(0, kPrefix.size()) != kPrefix) return std::nullopt;
  static constexpr std::pair<std::string_view, Method> kMethods[] = {
      {"Lookup", Method::kLookup},   {"AllocateSlot", Method::kAllocateSlot},
      {"AbortSlot", Method::kAbortSlot}, {"Put", Method::kPut},
      {"PutStream", Method::kPut},   {"Get", Method::kGet},
      {"Prefetch", Method::kPrefetch}, {"Pin", Method::kPin},
      {"Renew", Method::kRenew},     {"Release", Method::kRelease},
      {"Delete", Method::kDelete},   {"Stats", Method::kStats},
      {"Health", Method::kHealth}};
  for (const auto& [name, m] : kMethods) {
    if (path.substr(kPrefix.size()) == name) return m;
  }
  return std::nullopt;
}

std::string_view View(const grpc_slice& s) {
  return std::string_view(reinterpret_cast<const char*>(GRPC_SLICE_START_PTR(s)),
                          GRPC_SLICE_LENGTH(s));
}

// grpc_auth_metadata_processor::process: runs on the transport's thread when
// a call's headers have arrived (the check does not block).
void ProcessToken(void* state, grpc_auth_context*, const grpc_metadata* md, size_t num_md,
                  grpc_process_auth_metadata_done_cb cb, void* user_data) {
  const auto* s = static_cast<const TokenState*>(state);
  bool ok = false;
  std::string_view path;
  for (size_t i = 0; i < num_md; ++i) {
    const std::string_view key = View(md[i].key);
    if (key == "authorization") ok = ok || s->accepts(View(md[i].value));
    if (key == ":path") path = View(md[i].value);
  }
  if (ok) {
    cb(user_data, nullptr, 0, nullptr, 0, GRPC_STATUS_OK, nullptr);
    return;
  }
  s->metrics->Add(ServerMetric::kAuthFailures);
  if (auto m = MethodOfPath(path)) s->metrics->Record(*m, GRPC_STATUS_UNAUTHENTICATED, 0);
  cb(user_data, nullptr, 0, nullptr, 0, GRPC_STATUS_UNAUTHENTICATED, "missing or wrong bearer token");
}

void DestroyToken(void* state) { delete static_cast<TokenState*>(state); }

// grpc::InsecureServerCredentials() refuses an auth metadata processor; the
// core's insecure credentials take one, so the port is added through them.
class BearerTokenCredentials final : public grpc::ServerCredentials {
 public:
  BearerTokenCredentials(std::function<bool(std::string_view)> accepts, ServerMetrics* metrics,
                         std::optional<ServerTls> tls)
      : accepts_(std::move(accepts)), metrics_(metrics), tls_(std::move(tls)) {}

  void SetAuthMetadataProcessor(const std::shared_ptr<grpc::AuthMetadataProcessor>&) override {}

 private:
  int AddPortToServer(const std::string& addr, grpc_server* server) override {
    grpc_server_credentials* creds = nullptr;
    if (tls_) {
      // The core copies the PEM strings.
      grpc_ssl_pem_key_cert_pair pair{tls_->private_key.c_str(), tls_->cert_chain.c_str()};
      const bool mtls = !tls_->client_ca.empty();
      creds = grpc_ssl_server_credentials_create_ex(
          mtls ? tls_->client_ca.c_str() : nullptr, &pair, 1,
          mtls ? GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY
               : GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE,
          nullptr);
    } else {
      creds = grpc_insecure_server_credentials_create();
    }
    if (creds == nullptr) return 0;
    grpc_auth_metadata_processor p;
    p.process = ProcessToken;
    p.destroy = DestroyToken;
    p.state = new TokenState{accepts_, metrics_};
    grpc_server_credentials_set_auth_metadata_processor(creds, p);
    const int port = grpc_server_add_http2_port(server, addr.c_str(), creds);
    grpc_server_credentials_release(creds);
    return port;
  }

  const std::function<bool(std::string_view)> accepts_;
  ServerMetrics* const metrics_;
  const std::optional<ServerTls> tls_;
};

struct BioFree {
  void operator()(BIO* b) const { BIO_free(b); }
};
struct X509Free {
  void operator()(X509* x) const { X509_free(x); }
};
struct PkeyFree {
  void operator()(EVP_PKEY* k) const { EVP_PKEY_free(k); }
};

std::unique_ptr<BIO, BioFree> MemBio(const std::string& pem) {
  return std::unique_ptr<BIO, BioFree>(BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size())));
}

std::unique_ptr<X509, X509Free> FirstCert(const std::string& pem) {
  auto bio = MemBio(pem);
  return std::unique_ptr<X509, X509Free>(bio ? PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr)
                                             : nullptr);
}

}  // namespace

absl::Status CheckServerTls(const ServerTls& tls) {
  auto cert = FirstCert(tls.cert_chain);
  if (cert == nullptr) return absl::InvalidArgumentError("--tls-cert holds no PEM certificate");
  auto bio = MemBio(tls.private_key);
  std::unique_ptr<EVP_PKEY, PkeyFree> key(
      bio ? PEM_read_bio_PrivateKey(bio.get(), nullptr, nullptr, nullptr) : nullptr);
  if (key == nullptr) return absl::InvalidArgumentError("--tls-key holds no PEM private key");
  if (X509_check_private_key(cert.get(), key.get()) != 1) {
    return absl::InvalidArgumentError("--tls-key is not the key of --tls-cert's certificate");
  }
  if (!tls.client_ca.empty() && FirstCert(tls.client_ca) == nullptr) {
    return absl::InvalidArgumentError("--tls-client-ca holds no PEM certificate");
  }
  // A certificate outside its validity fails every handshake: say so at
  // start, not as clients' handshake errors.
  auto when = [](const ASN1_TIME* t) {
    std::unique_ptr<BIO, decltype(&BIO_free)> out(BIO_new(BIO_s_mem()), &BIO_free);
    if (out == nullptr || ASN1_TIME_print(out.get(), t) != 1) return std::string("?");
    char* p = nullptr;
    const long n = BIO_get_mem_data(out.get(), &p);
    return std::string(p, static_cast<size_t>(n));
  };
  const ASN1_TIME* not_after = X509_get0_notAfter(cert.get());
  if (X509_cmp_current_time(not_after) <= 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("--tls-cert's certificate expired on ", when(not_after), "; renew it"));
  }
  const ASN1_TIME* not_before = X509_get0_notBefore(cert.get());
  if (X509_cmp_current_time(not_before) > 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("--tls-cert's certificate is not valid before ", when(not_before),
                     " (check the clock)"));
  }
  return absl::OkStatus();
}

std::shared_ptr<grpc::ServerCredentials> BearerTokenServerCredentials(std::string token,
                                                                      ServerMetrics* metrics,
                                                                      const ServerTls* tls) {
  return BearerTokenServerCredentials(
      [token = std::move(token)](std::string_view v) { return IsBearerToken(v, token); }, metrics, tls);
}

std::shared_ptr<grpc::ServerCredentials> BearerTokenServerCredentials(
    std::function<bool(std::string_view)> accepts, ServerMetrics* metrics, const ServerTls* tls) {
  return std::make_shared<BearerTokenCredentials>(std::move(accepts), metrics,
                                                  tls ? std::optional<ServerTls>(*tls) : std::nullopt);
}

std::string PeerTlsIdentity(const grpc::AuthContext& context) {
  // gRPC fills these properties from a client certificate only after it
  // verified the certificate against the listener's client CA.
  for (const char* property : {GRPC_X509_SAN_PROPERTY_NAME, GRPC_X509_CN_PROPERTY_NAME}) {
    for (const grpc::string_ref& v : context.FindPropertyValues(property)) {
      if (v.size() > 0) return std::string(v.data(), v.size());
    }
  }
  return "";
}

}  // namespace kvtier::server
