// How kvtier nodes move objects between each other: a Transport (client side)
// and the PeerService a node exposes to its peers (server side). UCX is the
// production transport (ucx_transport.h); tests wrap it in
// FaultInjectingTransport.
#ifndef KVTIER_CLUSTER_TRANSPORT_H_
#define KVTIER_CLUSTER_TRANSPORT_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/fault_injection.h"
#include "tiering/tier.h"

namespace kvtier::cluster {

// What a node serves to its peers. Implementations are called from the
// transport's service thread, one request at a time per thread; they may
// block on I/O. Thread-safe.
class PeerService {
 public:
  virtual ~PeerService() = default;

  // A buffer the transport receives an incoming put of `bytes` bytes into.
  // Commit(true) stores it, Commit(false) drops it (transfer failed). The
  // object is released after Commit.
  class PutSink {
   public:
    virtual ~PutSink() = default;
    virtual std::span<uint8_t> buffer() = 0;
    virtual absl::Status Commit(bool transfer_ok) = 0;
  };
  // The bytes of an object being sent to a peer, valid until destroyed.
  class GetSource {
   public:
    virtual ~GetSource() = default;
    virtual std::span<const uint8_t> bytes() = 0;
  };

  // ResourceExhausted if there is no room, InvalidArgument for a bad size.
  virtual absl::StatusOr<std::unique_ptr<PutSink>> BeginPut(const tiering::ObjectKey& id,
                                                            uint64_t bytes) = 0;
  // NotFound on a miss, DataLoss if the local copy is corrupt.
  virtual absl::StatusOr<std::unique_ptr<GetSource>> BeginGet(const tiering::ObjectKey& id) = 0;
  virtual absl::StatusOr<uint64_t> Size(const tiering::ObjectKey& id) = 0;
  virtual absl::Status Erase(const tiering::ObjectKey& id) = 0;
};

// Client side: requests to peers named "host:port". Every call is bounded by
// `timeout`; a peer that cannot be reached, drops the connection or does not
// answer in time gives Unavailable (retry another replica). Status codes the
// peer returns (NotFound, ResourceExhausted, DataLoss, ...) pass through.
// Thread-safe.
class Transport {
 public:
  virtual ~Transport() = default;
  virtual absl::Status Put(const std::string& peer, const tiering::ObjectKey& id,
                           std::span<const uint8_t> bytes, absl::Duration timeout) = 0;
  virtual absl::StatusOr<uint64_t> Size(const std::string& peer, const tiering::ObjectKey& id,
                                        absl::Duration timeout) = 0;
  // Reads the object into `out`, which must be exactly its size (else the
  // peer's InvalidArgument). On error `out` may hold partial data: callers
  // verify what they read (codec checksums) before using it.
  virtual absl::Status Get(const std::string& peer, const tiering::ObjectKey& id, std::span<uint8_t> out,
                           absl::Duration timeout) = 0;
  virtual absl::Status Erase(const std::string& peer, const tiering::ObjectKey& id,
                             absl::Duration timeout) = 0;
  virtual absl::Status Ping(const std::string& peer, absl::Duration timeout) = 0;
};

// Forwards to another Transport (not owned; must outlive this one),
// injecting the faults of its policy (common/fault_injection.h: every call is
// one operation, Put a write; drop_unflushed garbles the buffer of a failed
// Get; torn_write_one_in and fail_mid_submit do not apply). The policy can be
// changed while calls run. Thread-safe.
class FaultInjectingTransport : public Transport {
 public:
  explicit FaultInjectingTransport(Transport* base, FaultPolicy policy = {});
  void set_policy(const FaultPolicy& policy) { faults_.SetPolicy(policy); }
  uint64_t injected() const { return faults_.injected(); }

  absl::Status Put(const std::string& peer, const tiering::ObjectKey& id, std::span<const uint8_t> bytes,
                   absl::Duration timeout) override;
  absl::StatusOr<uint64_t> Size(const std::string& peer, const tiering::ObjectKey& id,
                                absl::Duration timeout) override;
  absl::Status Get(const std::string& peer, const tiering::ObjectKey& id, std::span<uint8_t> out,
                   absl::Duration timeout) override;
  absl::Status Erase(const std::string& peer, const tiering::ObjectKey& id,
                     absl::Duration timeout) override;
  absl::Status Ping(const std::string& peer, absl::Duration timeout) override;

 private:
  Transport* const base_;
  FaultInjector faults_;
};

}  // namespace kvtier::cluster

#endif  // KVTIER_CLUSTER_TRANSPORT_H_
