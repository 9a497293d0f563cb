#include "cluster/peer_auth.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace kvtier::cluster {
namespace {

constexpr std::string_view kMacLabel = "kvtier peer-auth v1";
constexpr std::string_view kServerToClient = "server->client";
constexpr std::string_view kClientToServer = "client->server";

absl::Status CheckNodeId(std::string_view id, const char* what) {
  if (id.empty() || id.size() > kMaxAuthNodeIdBytes) {
    return absl::InvalidArgumentError(absl::StrCat("peer handshake: ", what, " node id of ", id.size(),
                                                   " bytes (1..", kMaxAuthNodeIdBytes, ")"));
  }
  return absl::OkStatus();
}

absl::Status BadLength(const char* what, size_t got, size_t min, size_t max) {
  return absl::InvalidArgumentError(absl::StrCat("peer handshake: ", what, " of ", got,
                                                 " bytes (want ", min, "..", max, ")"));
}

}  // namespace

std::vector<uint8_t> EncodeHello(const AuthHello& h) {
  std::vector<uint8_t> out(h.client_nonce.begin(), h.client_nonce.end());
  out.insert(out.end(), h.client_id.begin(), h.client_id.end());
  return out;
}

std::vector<uint8_t> EncodeChallenge(const AuthChallenge& c) {
  std::vector<uint8_t> out(c.server_nonce.begin(), c.server_nonce.end());
  out.insert(out.end(), c.server_mac.begin(), c.server_mac.end());
  out.insert(out.end(), c.server_id.begin(), c.server_id.end());
  return out;
}

std::vector<uint8_t> EncodeProof(const AuthProof& p) {
  std::vector<uint8_t> out(p.client_nonce.begin(), p.client_nonce.end());
  out.insert(out.end(), p.client_mac.begin(), p.client_mac.end());
  return out;
}

absl::StatusOr<AuthHello> DecodeHello(std::span<const uint8_t> b) {
  constexpr size_t kMin = kAuthNonceBytes + 1, kMax = kAuthNonceBytes + kMaxAuthNodeIdBytes;
  if (b.size() < kMin || b.size() > kMax) return BadLength("hello", b.size(), kMin, kMax);
  AuthHello h;
  std::memcpy(h.client_nonce.data(), b.data(), kAuthNonceBytes);
  h.client_id = std::string(AsChars(b.subspan(kAuthNonceBytes)));
  return h;
}

absl::StatusOr<AuthChallenge> DecodeChallenge(std::span<const uint8_t> b) {
  constexpr size_t kMin = kAuthNonceBytes + kAuthMacBytes + 1, kMax = kMaxAuthMessageBytes;
  if (b.size() < kMin || b.size() > kMax) return BadLength("challenge", b.size(), kMin, kMax);
  AuthChallenge c;
  std::memcpy(c.server_nonce.data(), b.data(), kAuthNonceBytes);
  std::memcpy(c.server_mac.data(), b.data() + kAuthNonceBytes, kAuthMacBytes);
  c.server_id = std::string(AsChars(b.subspan(kAuthNonceBytes + kAuthMacBytes)));
  return c;
}

absl::StatusOr<AuthProof> DecodeProof(std::span<const uint8_t> b) {
  constexpr size_t kSize = kAuthNonceBytes + kAuthMacBytes;
  if (b.size() != kSize) return BadLength("proof", b.size(), kSize, kSize);
  AuthProof p;
  std::memcpy(p.client_nonce.data(), b.data(), kAuthNonceBytes);
  std::memcpy(p.client_mac.data(), b.data() + kAuthNonceBytes, kAuthMacBytes);
  return p;
}

absl::StatusOr<PeerAuthenticator> PeerAuthenticator::Create(std::string_view secret, std::string node_id) {
  if (secret.size() < kMinClusterSecretBytes) {
    return absl::InvalidArgumentError(absl::StrCat("cluster secret of ", secret.size(),
                                                   " bytes; it must have at least ",
                                                   kMinClusterSecretBytes, " (openssl rand -hex 32)"));
  }
  KVTIER_RETURN_IF_ERROR(CheckNodeId(node_id, "this node's"));
  std::array<uint8_t, kSha256Bytes> key{};
  KVTIER_RETURN_IF_ERROR(HkdfSha256(AsBytes(secret), "kvtier cluster secret v1", "peer-auth", key));
  return PeerAuthenticator(key, std::move(node_id));
}

Mac256 PeerAuthenticator::Mac(std::string_view direction, const AuthNonce& client_nonce,
                              const AuthNonce& server_nonce, std::string_view client_id,
                              std::string_view server_id) const {
  return HmacSha256(key_, {kMacLabel, direction, AsChars(client_nonce), AsChars(server_nonce),
                           client_id, server_id});
}

absl::StatusOr<AuthHello> PeerAuthenticator::NewHello() const {
  AuthHello h;
  KVTIER_RETURN_IF_ERROR(SecureRandom(h.client_nonce));
  h.client_id = node_id_;
  return h;
}

absl::StatusOr<AuthChallenge> PeerAuthenticator::Answer(const AuthHello& hello) const {
  KVTIER_RETURN_IF_ERROR(CheckNodeId(hello.client_id, "the client's"));
  AuthChallenge c;
  KVTIER_RETURN_IF_ERROR(SecureRandom(c.server_nonce));
  c.server_id = node_id_;
  c.server_mac = Mac(kServerToClient, hello.client_nonce, c.server_nonce, hello.client_id, node_id_);
  return c;
}

absl::StatusOr<AuthProof> PeerAuthenticator::Prove(const AuthHello& hello,
                                                   const AuthChallenge& challenge) const {
  KVTIER_RETURN_IF_ERROR(CheckNodeId(challenge.server_id, "the server's"));
  if (ConstantTimeEquals(AsChars(challenge.server_nonce), AsChars(hello.client_nonce))) {
    return absl::InvalidArgumentError("peer handshake: the server echoed the client's nonce");
  }
  const Mac256 want =
      Mac(kServerToClient, hello.client_nonce, challenge.server_nonce, hello.client_id, challenge.server_id);
  if (!ConstantTimeEquals(AsChars(challenge.server_mac), AsChars(want))) {
    return absl::UnauthenticatedError(absl::StrCat(
        "peer '", challenge.server_id.substr(0, 64),
        "' failed authentication: it does not hold this cluster's secret"));
  }
  AuthProof p;
  p.client_nonce = hello.client_nonce;
  p.client_mac =
      Mac(kClientToServer, hello.client_nonce, challenge.server_nonce, hello.client_id, challenge.server_id);
  return p;
}

absl::Status PeerAuthenticator::Verify(const AuthHello& hello, const AuthChallenge& challenge,
                                       const AuthProof& proof) const {
  const Mac256 want =
      Mac(kClientToServer, hello.client_nonce, challenge.server_nonce, hello.client_id, node_id_);
  const bool nonce_ok = ConstantTimeEquals(AsChars(proof.client_nonce), AsChars(hello.client_nonce));
  const bool mac_ok = ConstantTimeEquals(AsChars(proof.client_mac), AsChars(want));
  if (!(nonce_ok & mac_ok)) {
    return absl::UnauthenticatedError(absl::StrCat(
        "peer '", hello.client_id.substr(0, 64),
        "' failed authentication: it does not hold this cluster's secret"));
  }
  return absl::OkStatus();
}

bool NonceHistory::Insert(const AuthNonce& n) {
  std::string k(AsChars(n));
  absl::MutexLock lock(&mu_);
  if (!seen_.insert(k).second) return false;
  order_.push_back(n);
  if (order_.size() > capacity_) {
    seen_.erase(std::string(AsChars(order_.front())));
    order_.pop_front();
  }
  return true;
}

}  // namespace kvtier::cluster
