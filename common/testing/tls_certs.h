// Certificates for TLS tests, made by the `openssl` CLI in a temp dir: a CA,
// a server certificate for 127.0.0.1 / localhost, a client certificate, an
// expired client certificate, and a second CA with a client and a server
// certificate of its own (what a test's "wrong CA" presents). Header-only.
#ifndef KVTIER_COMMON_TESTING_TLS_CERTS_H_
#define KVTIER_COMMON_TESTING_TLS_CERTS_H_

#include <sys/stat.h>

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

#include "common/testing/temp_dir.h"
#include "gtest/gtest.h"

namespace kvtier::testing {

class TlsCerts {
 public:
  // The client certificate's subject CN and its DNS subject alternative name.
  static constexpr char kClientCn[] = "tenant-a";
  static constexpr char kClientSan[] = "tenant-a.clients.kvtier";

  // Makes every certificate; ok() tells (a failure is also ADD_FAILURE'd).
  TlsCerts() {
    const std::string d = dir_.path();
    const std::string ec = "-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes";
    auto ca = [&](const std::string& name) {
      return Run("openssl req -x509 " + ec + " -keyout " + d + "/" + name + ".key -out " + d + "/" + name +
                 ".pem -subj /CN=" + name + " -days 3650");
    };
    // `san` like "IP:127.0.0.1,DNS:localhost"; days < 0 makes it expired.
    auto leaf = [&](const std::string& name, const std::string& signer, const std::string& cn,
                    const std::string& san, int days) {
      std::ofstream(d + "/" + name + ".ext") << "subjectAltName=" << san << "\n";
      return Run("openssl req " + ec + " -keyout " + d + "/" + name + ".key -out " + d + "/" + name +
                 ".csr -subj /CN=" + cn) &&
             Run("openssl x509 -req -in " + d + "/" + name + ".csr -CA " + d + "/" + signer + ".pem -CAkey " +
                 d + "/" + signer + ".key -CAcreateserial -out " + d + "/" + name + ".pem -days " +
                 std::to_string(days) + " -extfile " + d + "/" + name + ".ext");
    };
    ok_ = ca("ca") && ca("other-ca") &&
          leaf("server", "ca", "localhost", "IP:127.0.0.1,DNS:localhost", 3650) &&
          leaf("client", "ca", kClientCn, std::string("DNS:") + kClientSan, 3650) &&
          leaf("expired", "ca", "expired-client", "DNS:expired.clients.kvtier", -1) &&
          leaf("other-client", "other-ca", "intruder", "DNS:intruder.clients.kvtier", 3650) &&
          leaf("other-server", "other-ca", "localhost", "IP:127.0.0.1,DNS:localhost", 3650);
    for (const char* key : {"ca", "other-ca", "server", "client", "expired", "other-client", "other-server"}) {
      ::chmod((d + "/" + key + ".key").c_str(), 0600);
    }
    if (!ok_) ADD_FAILURE() << "openssl could not make the test certificates in " << d;
  }

  bool ok() const { return ok_; }
  // "<dir>/<name>.pem" and "<dir>/<name>.key" for name in ca, other-ca,
  // server, client, expired, other-client, other-server.
  std::string Pem(const std::string& name) const { return dir_.path() + "/" + name + ".pem"; }
  std::string Key(const std::string& name) const { return dir_.path() + "/" + name + ".key"; }
  static std::string Read(const std::string& path) {
    std::ifstream in(path);
    std::stringstream s;
    s << in.rdbuf();
    return s.str();
  }

 private:
  static bool Run(const std::string& cmd) { return std::system((cmd + " >/dev/null 2>&1").c_str()) == 0; }

  TempDir dir_{"kvtier-tls"};
  bool ok_ = false;
};

}  // namespace kvtier::testing

#endif  // KVTIER_COMMON_TESTING_TLS_CERTS_H_
