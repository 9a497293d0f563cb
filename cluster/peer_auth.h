// Mutual authentication of two kvtier nodes that hold the same cluster
// secret (docs/security.md, "Cluster peers"). Every UCX connection between
// nodes runs this challenge-response before any chunk operation:
//
//   client -> server  Hello   nonce_c (32 bytes) || client node id
//   server -> client  reply   nonce_s (32) || mac_s (32) || server node id
//   client -> server  Proof   nonce_c (32) || mac_c (32)
//   server -> client  reply   status OK, or Unauthenticated and the
//                     connection is closed
//
//   mac_x = HMAC-SHA256(K, "kvtier peer-auth v1" || direction_x || nonce_c ||
//                          nonce_s || client id || server id)
//   K     = HKDF-SHA256(secret, salt "kvtier cluster secret v1", info "peer-auth")
//
// Both nonces are fresh (CSPRNG) for each handshake, so a recorded Hello or
// Proof is worthless on another connection; the direction label keeps a
// server's answer from being reflected back as a client's proof. MACs are
// compared in constant time. The secret itself never crosses the wire.
#ifndef KVTIER_CLUSTER_PEER_AUTH_H_
#define KVTIER_CLUSTER_PEER_AUTH_H_

#include <array>
#include <cstdint>
#include <deque>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/crypto.h"

namespace kvtier::cluster {

inline constexpr size_t kAuthNonceBytes = 32;
inline constexpr size_t kAuthMacBytes = kSha256Bytes;
// Longest node id a handshake carries.
inline constexpr size_t kMaxAuthNodeIdBytes = 256;
// Largest handshake message (a Hello reply with the longest node id).
inline constexpr size_t kMaxAuthMessageBytes = kAuthNonceBytes + kAuthMacBytes + kMaxAuthNodeIdBytes;
// Shortest cluster secret accepted, in bytes (`openssl rand -hex 32` gives 64).
inline constexpr size_t kMinClusterSecretBytes = 32;

using AuthNonce = std::array<uint8_t, kAuthNonceBytes>;

struct AuthHello {
  AuthNonce client_nonce{};
  std::string client_id;
};
struct AuthChallenge {  // the server's answer to a Hello
  AuthNonce server_nonce{};
  Mac256 server_mac{};
  std::string server_id;
};
struct AuthProof {
  AuthNonce client_nonce{};
  Mac256 client_mac{};
};

std::vector<uint8_t> EncodeHello(const AuthHello& h);
std::vector<uint8_t> EncodeChallenge(const AuthChallenge& c);
std::vector<uint8_t> EncodeProof(const AuthProof& p);
// Each is given what a peer sent. InvalidArgument for a message that is
// truncated, too long, or carries an empty or oversized node id.
absl::StatusOr<AuthHello> DecodeHello(std::span<const uint8_t> bytes);
absl::StatusOr<AuthChallenge> DecodeChallenge(std::span<const uint8_t> bytes);
absl::StatusOr<AuthProof> DecodeProof(std::span<const uint8_t> bytes);

// The key of a cluster secret and the two sides' computations. Immutable,
// thread-safe.
class PeerAuthenticator {
 public:
  // InvalidArgument for a secret shorter than kMinClusterSecretBytes or a
  // node id that is empty or longer than kMaxAuthNodeIdBytes.
  static absl::StatusOr<PeerAuthenticator> Create(std::string_view secret, std::string node_id);

  const std::string& node_id() const { return node_id_; }

  // Client: a Hello with a fresh nonce.
  absl::StatusOr<AuthHello> NewHello() const;
  // Server: the challenge answering `hello` (fresh server nonce, server MAC).
  absl::StatusOr<AuthChallenge> Answer(const AuthHello& hello) const;
  // Client: checks the server's MAC and returns the proof to send back.
  // Unauthenticated if the MAC is wrong (the server holds another secret or
  // is not a cluster member); InvalidArgument if the server echoed the
  // client's own nonce.
  absl::StatusOr<AuthProof> Prove(const AuthHello& hello, const AuthChallenge& challenge) const;
  // Server: checks a client's proof against the challenge it answered.
  // Unauthenticated for a wrong MAC or a nonce that is not this handshake's.
  absl::Status Verify(const AuthHello& hello, const AuthChallenge& challenge,
                      const AuthProof& proof) const;

 private:
  PeerAuthenticator(std::array<uint8_t, kSha256Bytes> key, std::string node_id)
      : key_(key), node_id_(std::move(node_id)) {}
  Mac256 Mac(std::string_view direction, const AuthNonce& client_nonce, const AuthNonce& server_nonce,
             std::string_view client_id, std::string_view server_id) const;

  std::array<uint8_t, kSha256Bytes> key_;
  std::string node_id_;
};

// The client nonces a server has seen lately (a bounded FIFO): a Hello that
// repeats one is a replay and is refused. Thread-safe.
class NonceHistory {
 public:
  explicit NonceHistory(size_t capacity = 4096) : capacity_(capacity) {}
  // False (and nothing recorded) if `n` is already in the history.
  bool Insert(const AuthNonce& n);

 private:
  const size_t capacity_;
  absl::Mutex mu_;
  std::deque<AuthNonce> order_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_set<std::string> seen_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvtier::cluster

#endif  // KVTIER_CLUSTER_PEER_AUTH_H_
