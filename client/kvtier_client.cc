#include "client/kvtier_client.h"

#include <unistd.h>

#include <cstring>
#include <optional>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "client/data_conn.h"
#include "client/data_path.h"
#include "client/data_plane_path.h"
#include "client/grpc_paths.h"
#include "client/kvtier_client_internal.h"
#include "client/rpc_client.h"
#include "client/shm_pool.h"
#include "codec/prefix_key.h"
#include "common/file.h"
#include "common/status.h"
#include "wire/chunk_check.h"

namespace kvtier::client {

namespace pb = kvtier::proto::v1;

const char* TierName(Tier t) {
  switch (t) {
    case Tier::kHbm: return "hbm";
    case Tier::kDram: return "dram";
    case Tier::kNvme: return "nvme";
    case Tier::kRemote: return "remote";
    case Tier::kUnknown: break;
  }
  return "unknown";
}

namespace {

// The KvtierClient of Connect: chooses the DataPath of each call (Route,
// RouteTo) and nothing else; the paths do the work (client/data_path.h).
class ClientImpl final : public KvtierClient {
 public:
  ClientImpl(std::shared_ptr<grpc::Channel> channel, std::unique_ptr<pb::Kvtier::StubInterface> owned,
             pb::Kvtier::StubInterface* stub, const ClientOptions& options)
      : channel_(std::move(channel)),
        owned_(std::move(owned)),
        options_(options),
        rpc_(stub, options, [this] {
          if (conns_ != nullptr) conns_->SettleOwedReleases();
        }),
        inline_path_(&rpc_) {}
  ~ClientImpl() override { rpc_.WaitForReleases(); }

  // Checks the daemon answers; with shared memory on a Unix socket, maps
  // its pool and opens the first data-plane connection.
  absl::Status Init() {
    KVTIER_ASSIGN_OR_RETURN(std::string shm_socket, rpc_.Health());
    if (!options_.shared_memory || !options_.tcp_addr.empty() || shm_socket.empty()) {
      return absl::OkStatus();
    }
    pool_ = std::make_unique<SharedPool>(shm_socket, options_.populate_mapping);
    KVTIER_ASSIGN_OR_RETURN(ShmHandshake h, ConnectShm(shm_socket));
    auto mapping = pool_->Adopt(h);
    if (!mapping.ok()) {
      ::close(h.sock);
      return mapping.status();
    }
    if (options_.check_on_helper_thread) {
      verifier_ = std::make_unique<wire::PipelinedCopyVerifier>();
    }
    // The same connection carries the data plane, if the daemon serves it.
    conns_ = std::make_unique<DataConnPool>(pool_.get(), options_);
    (void)conns_->Start(h.sock, *std::move(mapping));
    stream_path_ = std::make_unique<StreamGrpcPath>(&rpc_, pool_.get(), verifier_.get());
    shm_ = true;
    return absl::OkStatus();
  }

  bool uses_shared_memory() const override { return shm_; }
  bool checks_on_helper_thread() const override { return verifier_ != nullptr; }

  absl::StatusOr<std::vector<Tier>> Lookup(std::span<const Hash128> keys) override {
    return Route(keys.size())->Lookup(keys);
  }

  absl::StatusOr<LoadPlan> PlanLoad(std::span<const Hash128> keys, double prefill_tokens_per_s,
                                    uint32_t tokens_per_chunk,
                                    double attention_doubling_tokens) override {
    KVTIER_ASSIGN_OR_RETURN(HeldPlan h,
                            Route(keys.size())->Plan(keys, prefill_tokens_per_s,
                                                     attention_doubling_tokens, tokens_per_chunk,
                                                     0, false));
    return std::move(h.plan);
  }

  absl::StatusOr<HeldPlan> LookupAndHold(std::span<const Hash128> keys, double rate,
                                         uint32_t tokens_per_chunk, uint32_t lease_ms,
                                         double attention_doubling_tokens) override {
    return Route(keys.size())->Plan(keys, rate, attention_doubling_tokens, tokens_per_chunk,
                                    lease_ms, true);
  }

  absl::Status ReleasePlan(const HeldPlan& plan) override {
    if (plan.lease_id == 0) return absl::OkStatus();
    return RouteTo(plan.connection)->ReleasePlan(plan);
  }

  absl::StatusOr<std::vector<absl::StatusOr<HeldChunk>>> HoldBatch(std::span<const Hash128> keys,
                                                                   bool verify) override {
    if (!shm_) return absl::FailedPreconditionError("no shared-memory pool mapped");
    if (keys.size() > kMaxBatchKeys) {
      return absl::InvalidArgumentError(
          absl::StrCat(keys.size(), " keys in one batch; the limit is ", kMaxBatchKeys));
    }
    absl::flat_hash_set<Hash128> seen;
    for (const Hash128& k : keys) {
      if (!seen.insert(k).second) {
        return absl::InvalidArgumentError(absl::StrCat("key ", k.ToHex(), " twice in one batch"));
      }
    }
    return Route()->HoldBatch(keys, verify);
  }

  absl::Status UnholdBatch(std::span<const HeldChunk> chunks) override {
    absl::Status first;
    auto note = [&first](absl::Status st) {
      if (first.ok()) first = std::move(st);
    };
    // The holds of each data-plane connection go back over it.
    absl::flat_hash_map<uint64_t, std::vector<const HeldChunk*>> by_conn;
    for (const HeldChunk& h : chunks) {
      if (h.lease_id == 0 && h.scratch_slot_id == 0) continue;
      if (h.connection == 0) {
        note(RpcPath().Unhold(h));
      } else {
        by_conn[h.connection].push_back(&h);
      }
    }
    for (const auto& [serial, hs] : by_conn) note(RouteTo(serial)->UnholdBatch(hs));
    return first;
  }

  absl::StatusOr<PrefetchResult> PrefetchWithin(std::span<const Hash128> keys, uint64_t byte_budget,
                                                uint32_t deadline_ms) override {
    return Route(keys.size())->PrefetchWithin(keys, byte_budget, deadline_ms);
  }

  absl::StatusOr<std::vector<absl::Status>> PutBatchShared(
      std::span<const Hash128> keys, std::span<const std::span<const uint8_t>> chunks,
      const PutOptions& options) override {
    if (!shm_) return absl::FailedPreconditionError("no shared-memory pool mapped");
    if (keys.size() != chunks.size() || keys.empty() || keys.size() > kMaxBatchKeys) {
      return absl::FailedPreconditionError("not a batch for one data-plane exchange");
    }
    absl::flat_hash_set<Hash128> seen;
    for (const Hash128& k : keys) {
      if (!seen.insert(k).second) return absl::FailedPreconditionError("a key twice in one batch");
    }
    rpc_.WaitForReleases();
    return Route()->PutBatch(keys, chunks, options);
  }

  absl::Status Put(const Hash128& key, std::span<const uint8_t> chunk,
                   const PutOptions& options) override {
    rpc_.WaitForReleases();
    return Route()->Put(key, chunk, options);
  }

  // On a data-plane connection when one is free (a round trip of tens of
  // microseconds), else over gRPC; the slot is committed or aborted the way
  // it was allocated (on that connection: the daemon ties a data-plane
  // slot to its connection).
  absl::StatusOr<WritableSlot> AllocateSlot(uint64_t bytes) override {
    if (!shm_) return absl::FailedPreconditionError("no shared-memory pool mapped");
    if (conns_ != nullptr) {
      if (ConnLease c = conns_->Acquire()) {
        return DataPlanePath(std::move(c), verifier_.get()).AllocateSlot(bytes);
      }
    }
    return stream_path_->AllocateSlot(bytes);
  }
  absl::Status CommitSlot(const WritableSlot& slot, const Hash128& key,
                          const PutOptions& options) override {
    if (slot.connection == 0) return rpc_.CommitSlot(slot.id, key, options);
    KVTIER_ASSIGN_OR_RETURN(DataPlanePath path, SlotConnection(slot));
    return path.CommitSlot(slot.id, key, options);
  }
  absl::Status AbortSlot(const WritableSlot& slot) override {
    if (slot.connection == 0) return rpc_.AbortSlot(slot.id);
    KVTIER_ASSIGN_OR_RETURN(DataPlanePath path, SlotConnection(slot));
    return path.AbortSlot(slot.id);
  }

  absl::StatusOr<std::vector<uint8_t>> Get(const Hash128& key) override {
    std::vector<uint8_t> out;
    KVTIER_RETURN_IF_ERROR(Route()->Get(key, ChunkSink{nullptr, &out}).status());
    return out;
  }
  absl::StatusOr<std::pair<std::vector<uint8_t>, Tier>> GetWithTier(const Hash128& key) override {
    std::vector<uint8_t> out;
    KVTIER_ASSIGN_OR_RETURN(auto got, Route()->Get(key, ChunkSink{nullptr, &out}));
    return std::make_pair(std::move(out), got.second);
  }
  absl::StatusOr<std::pair<uint64_t, Tier>> GetInto(const Hash128& key,
                                                    std::span<uint8_t> out) override {
    return Route()->Get(key, ChunkSink{&out, nullptr});
  }

  absl::StatusOr<HeldChunk> Hold(const Hash128& key, bool verify) override {
    return Route()->Hold(key, verify);
  }
  // The daemon takes a release or abort of a data-plane hold only from the
  // connection that took it (gRPC gets NotFound, as for any id it does not
  // hold). If that connection has closed, the daemon ended the hold with
  // it; if it stays lent out for timeout_ms, the hold ends with its lease.
  absl::Status Unhold(const HeldChunk& h) override {
    if (h.lease_id == 0 && h.scratch_slot_id == 0) return absl::OkStatus();
    return RouteTo(h.connection)->Unhold(h);
  }
  absl::Status UnholdNoWait(const HeldChunk& h) override {
    if (h.lease_id == 0 && h.scratch_slot_id == 0) return absl::OkStatus();
    return RouteTo(h.connection)->UnholdNoWait(h);
  }

  absl::Status Delete(const Hash128& key) override { return rpc_.Delete(key); }
  absl::StatusOr<bool> Prefetch(std::span<const Hash128> keys, uint32_t deadline_ms) override {
    return rpc_.Prefetch(keys, deadline_ms);
  }
  absl::StatusOr<uint64_t> Pin(std::span<const Hash128> keys, uint32_t ttl_ms) override {
    return rpc_.Pin(keys, ttl_ms);
  }
  absl::Status Release(uint64_t lease_id) override { return rpc_.Release(lease_id); }
  absl::StatusOr<DaemonStats> Stats() override { return rpc_.Stats(); }

  std::span<uint8_t> mapped_pool() const override {
    return pool_ ? pool_->all() : std::span<uint8_t>();
  }

 protected:
  absl::Status CopyHeldChunk(std::span<uint8_t> dst, std::span<const uint8_t> src) override {
    return (verifier_ ? verifier_->CopyVerified(dst, src) : wire::CopyVerified(dst, src)).status();
  }

 private:
  // The path of one call: a lent data-plane connection, or the gRPC path.
  // Not movable (returned by guaranteed copy elision).
  class CallPath {
   public:
    explicit CallPath(DataPath* rpc) : path_(rpc) {}
    CallPath(ConnLease lease, wire::PipelinedCopyVerifier* verifier)
        : data_plane_(std::in_place, std::move(lease), verifier), path_(&*data_plane_) {}
    CallPath(const CallPath&) = delete;
    CallPath& operator=(const CallPath&) = delete;
    DataPath* operator->() const { return path_; }

   private:
    std::optional<DataPlanePath> data_plane_;
    DataPath* const path_;
  };

  // The data-plane connection that allocated `slot`, once no other call uses
  // it. NotFound if it closed (the daemon freed the slot with it).
  absl::StatusOr<DataPlanePath> SlotConnection(const WritableSlot& slot) {
    ConnLease c = conns_ != nullptr ? conns_->AcquireBySerial(slot.connection)
                                     : ConnLease(nullptr, nullptr);
    if (!c) {
      return absl::NotFoundError(absl::StrCat("slot ", slot.id, ": its data-plane connection ",
                                              slot.connection, " closed or stayed busy"));
    }
    return DataPlanePath(std::move(c), verifier_.get());
  }

  // The gRPC path: chunk bytes in the pool with shared memory, else inline.
  DataPath& RpcPath() {
    return stream_path_ ? static_cast<DataPath&>(*stream_path_) : inline_path_;
  }

  // A data-plane connection if one is free and `keys` fit one frame; the
  // gRPC path otherwise.
  CallPath Route(size_t keys = 0) {
    if (conns_ != nullptr && keys <= kMaxBatchKeys) {
      if (ConnLease c = conns_->Acquire()) return CallPath(std::move(c), verifier_.get());
    }
    return CallPath(&RpcPath());
  }

  // The data-plane connection `serial` once no other call is using it; the
  // gRPC path for serial 0, or if it has closed or stays lent for timeout_ms.
  CallPath RouteTo(uint64_t serial) {
    if (serial != 0 && conns_ != nullptr) {
      if (ConnLease c = conns_->AcquireBySerial(serial)) {
        return CallPath(std::move(c), verifier_.get());
      }
    }
    return CallPath(&RpcPath());
  }

  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<pb::Kvtier::StubInterface> owned_;
  const ClientOptions options_;
  // Shared-memory state, set by Init (null without a mapped pool). The pool
  // outlives the connections, which hold mappings of it.
  std::unique_ptr<SharedPool> pool_;
  // Hashes what a shared-memory get copies (check_on_helper_thread).
  std::unique_ptr<wire::PipelinedCopyVerifier> verifier_;
  std::unique_ptr<DataConnPool> conns_;
  bool shm_ = false;
  // Declared after conns_, whose owed releases its WaitForReleases settles.
  RpcClient rpc_;
  InlineGrpcPath inline_path_;
  std::unique_ptr<StreamGrpcPath> stream_path_;
};

// Plaintext, or TLS (with a client certificate) when tls_ca is set.
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> ChannelCredentials(const ClientOptions& o) {
  if (o.tls_ca.empty()) {
    if (!o.tls_cert.empty() || !o.tls_key.empty() || !o.tls_server_name.empty()) {
      return absl::InvalidArgumentError("the TLS client options need tls_ca (the daemon's CA)");
    }
    return grpc::InsecureChannelCredentials();
  }
  if (o.tcp_addr.empty()) return absl::InvalidArgumentError("TLS is for TCP: give tcp_addr");
  if (o.tls_cert.empty() != o.tls_key.empty()) {
    return absl::InvalidArgumentError("tls_cert and tls_key go together");
  }
  grpc::SslCredentialsOptions ssl;
  KVTIER_ASSIGN_OR_RETURN(ssl.pem_root_certs, ReadPemFile(o.tls_ca, "TLS CA"));
  if (!o.tls_cert.empty()) {
    KVTIER_ASSIGN_OR_RETURN(ssl.pem_cert_chain, ReadPemFile(o.tls_cert, "TLS certificate"));
    KVTIER_ASSIGN_OR_RETURN(ssl.pem_private_key, ReadPemFile(o.tls_key, "TLS key"));
  }
  return grpc::SslCredentials(ssl);
}

}  // namespace

absl::StatusOr<std::unique_ptr<KvtierClient>> KvtierClient::Connect(const ClientOptions& options) {
  grpc::ChannelArguments args;
  // A channel of its own: gRPC shares connections between the channels of
  // a process by default, and a client opened after the daemon restarted
  // would then start on the dead daemon's connection and fail its first call.
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  args.SetMaxReceiveMessageSize(options.max_message_mib << 20);
  args.SetMaxSendMessageSize(options.max_message_mib << 20);
  std::string target = options.tcp_addr.empty() ? "unix:" + options.socket_path : options.tcp_addr;
  KVTIER_ASSIGN_OR_RETURN(auto creds, ChannelCredentials(options));
  if (!options.tls_server_name.empty()) {
    args.SetString(GRPC_SSL_TARGET_NAME_OVERRIDE_ARG, options.tls_server_name);
  }
  auto channel = grpc::CreateCustomChannel(target, std::move(creds), args);
  auto stub = pb::Kvtier::NewStub(channel);
  pb::Kvtier::StubInterface* raw = stub.get();
  auto c = std::make_unique<ClientImpl>(channel, std::move(stub), raw, options);
  KVTIER_RETURN_IF_ERROR(c->Init());
  return std::unique_ptr<KvtierClient>(std::move(c));
}

std::unique_ptr<KvtierClient> NewClientForStub(pb::Kvtier::StubInterface* stub,
                                               const ClientOptions& options) {
  ClientOptions o = options;
  o.shared_memory = false;
  return std::make_unique<ClientImpl>(nullptr, nullptr, stub, o);
}

absl::StatusOr<std::vector<Hash128>> KvtierClient::ChunkKeys(const Hash128& fingerprint,
                                                             std::span<const uint32_t> tokens,
                                                             uint32_t chunk_tokens) {
  return codec::ChunkKeys(fingerprint, tokens, chunk_tokens);
}

absl::StatusOr<PrefixHit> KvtierClient::LongestCachedPrefix(const Hash128& fingerprint,
                                                            std::span<const uint32_t> tokens,
                                                            uint32_t chunk_tokens) {
  PrefixHit hit;
  KVTIER_ASSIGN_OR_RETURN(hit.keys, ChunkKeys(fingerprint, tokens, chunk_tokens));
  KVTIER_ASSIGN_OR_RETURN(hit.tiers, Lookup(hit.keys));
  return hit;
}

std::future<absl::Status> KvtierClient::PutAsync(const Hash128& key,
                                                 std::span<const uint8_t> chunk,
                                                 const PutOptions& options) {
  return std::async(std::launch::async, [this, key, chunk, options] { return Put(key, chunk, options); });
}

std::future<absl::StatusOr<std::vector<uint8_t>>> KvtierClient::GetAsync(const Hash128& key) {
  return std::async(std::launch::async, [this, key] { return Get(key); });
}

std::future<absl::StatusOr<std::vector<Tier>>> KvtierClient::LookupAsync(std::vector<Hash128> keys) {
  return std::async(std::launch::async, [this, keys = std::move(keys)] { return Lookup(keys); });
}

std::vector<absl::Status> KvtierClient::PutBatch(std::span<const Hash128> keys,
                                                 std::span<const std::span<const uint8_t>> chunks,
                                                 const PutOptions& options) {
  if (uses_shared_memory()) {
    auto shared = PutBatchShared(keys, chunks, options);
    if (shared.ok()) return *std::move(shared);
    if (!absl::IsFailedPrecondition(shared.status())) {
      return std::vector<absl::Status>(keys.size(), shared.status());
    }
  }
  std::vector<absl::Status> out(keys.size());
  if (chunks.size() != keys.size()) {
    for (auto& s : out) s = absl::InvalidArgumentError("keys and chunks differ in number");
    return out;
  }
  std::vector<std::future<absl::Status>> fs;
  for (size_t i = 0; i < keys.size(); ++i) fs.push_back(PutAsync(keys[i], chunks[i], options));
  for (size_t i = 0; i < fs.size(); ++i) out[i] = fs[i].get();
  return out;
}

namespace {

std::vector<HeldChunk> HeldOnes(std::span<const absl::StatusOr<HeldChunk>> held) {
  std::vector<HeldChunk> out;
  for (const auto& h : held) {
    if (h.ok()) out.push_back(*h);
  }
  return out;
}

// A batched get goes in about kGetGroups groups of keys, each one hold, and
// the daemon reads up to kGetGroupsInFlight of them (each on its own
// data-plane connection) while the caller's thread copies the group before
// them out of the pool: the disk stays busy during the copies, where one
// hold of the whole batch left it idle for all of them.
constexpr size_t kGetGroups = 4;
constexpr size_t kGetGroupsInFlight = 2;

using HeldBatch = absl::StatusOr<std::vector<absl::StatusOr<HeldChunk>>>;

// The batched get of `n` keys: `ops.hold(first, count)` holds keys [first,
// first + count); each held chunk is copied into the buffer `dst(i, bytes)`
// gives and checked in the same pass (`ops.copy`); `done(i, st, chunk)` gets OK
// with the held chunk, or the hold's error or dst's; the group is then
// unheld (`ops.unhold`). `fallback(i)` gets each key to get on its own, as a
// single get does: after its group is unheld, a DataLoss or every key of a
// group whose hold failed as a whole; after every group is unheld, a hold
// refused at the held-bytes limit.
template <typename Ops, typename Dst, typename Done, typename Fallback>
void HoldAndCopyInGroups(size_t n, Ops ops, Dst dst, Done done, Fallback fallback) {
  if (n == 0) return;
  const size_t per = (n + kGetGroups - 1) / kGetGroups;
  const size_t groups = (n + per - 1) / per;
  auto hold_group = [&](size_t g) { return ops.hold(g * per, std::min(per, n - g * per)); };
  std::vector<std::future<HeldBatch>> pending(groups);
  auto launch = [&](size_t g) {
    if (groups > 1 && g < groups) pending[g] = std::async(std::launch::async, hold_group, g);
  };
  for (size_t g = 0; g < kGetGroupsInFlight; ++g) launch(g);
  std::vector<size_t> refused;
  for (size_t g = 0; g < groups; ++g) {
    HeldBatch held = groups > 1 ? pending[g].get() : hold_group(0);
    launch(g + kGetGroupsInFlight);
    const size_t first = g * per, count = std::min(per, n - first);
    std::vector<size_t> retry;
    if (!held.ok() || held->size() != count) {
      if (held.ok()) (void)ops.unhold(HeldOnes(*held));
      auto& to = !held.ok() && absl::IsResourceExhausted(held.status()) ? refused : retry;
      for (size_t i = first; i < first + count; ++i) to.push_back(i);
    } else {
      for (size_t j = 0; j < count; ++j) {
        const size_t i = first + j;
        const absl::StatusOr<HeldChunk>& h = (*held)[j];
        absl::Status st = h.status();
        if (st.ok()) {
          absl::StatusOr<std::span<uint8_t>> out = dst(i, h->data.size());
          st = out.ok() ? ops.copy(*out, *h) : out.status();
        }
        if (absl::IsResourceExhausted(st)) {
          refused.push_back(i);
        } else if (absl::IsDataLoss(st)) {
          retry.push_back(i);
        } else {
          done(i, std::move(st), h.ok() ? &*h : nullptr);
        }
      }
      (void)ops.unhold(HeldOnes(*held));
    }
    for (size_t i : retry) fallback(i);
  }
  // Refused at the held-bytes limit, possibly by this batch's own groups in
  // flight: got one by one once the batch holds nothing.
  for (size_t i : refused) fallback(i);
}

}  // namespace

absl::Status CheckHeldBytes(const HeldChunk& held) {
  if (held.checked) return absl::OkStatus();
  return wire::VerifyChunkParallel(held.data).status();
}

absl::StatusOr<codec::ChunkHeader> ParseStoredHeader(std::span<const uint8_t> bytes) {
  auto header = codec::ParseHeader(bytes);
  if (!header.ok()) {
    return absl::DataLossError(absl::StrCat("stored chunk's header: ", header.status().message()));
  }
  if (bytes.size() != header->layout.total_bytes) {
    return absl::DataLossError(absl::StrCat("length: chunk is ", bytes.size(),
                                            " bytes, header says ", header->layout.total_bytes));
  }
  return header;
}

absl::Status KvtierClient::CopyHeldChunk(std::span<uint8_t> dst, std::span<const uint8_t> src) {
  return wire::CopyVerified(dst, src).status();
}

KvtierClient::HeldGroupOps KvtierClient::GroupOps(std::span<const Hash128> keys) {
  return HeldGroupOps{this, keys};
}

absl::StatusOr<std::vector<absl::StatusOr<HeldChunk>>> KvtierClient::HeldGroupOps::hold(
    size_t first, size_t count) const {
  return client->HoldBatch(keys.subspan(first, count));
}

absl::Status KvtierClient::HeldGroupOps::unhold(std::span<const HeldChunk> chunks) const {
  return client->UnholdBatch(chunks);
}

absl::Status KvtierClient::HeldGroupOps::copy(std::span<uint8_t> dst,
                                              const HeldChunk& held) const {
  if (held.checked) {
    std::memcpy(dst.data(), held.data.data(), held.data.size());
    return absl::OkStatus();
  }
  return client->CopyHeldChunk(dst, held.data);
}

std::vector<absl::StatusOr<std::pair<uint64_t, Tier>>> KvtierClient::GetBatchInto(
    std::span<const Hash128> keys, std::span<const std::span<uint8_t>> outs) {
  std::vector<absl::StatusOr<std::pair<uint64_t, Tier>>> out(
      keys.size(), absl::InvalidArgumentError("keys and buffers differ in number"));
  if (outs.size() != keys.size()) return out;
  if (!uses_shared_memory()) {
    for (size_t i = 0; i < keys.size(); ++i) out[i] = GetInto(keys[i], outs[i]);
    return out;
  }
  HoldAndCopyInGroups(
      keys.size(), GroupOps(keys),
      [&](size_t i, uint64_t bytes) -> absl::StatusOr<std::span<uint8_t>> {
        if (outs[i].size() < bytes) {
          return absl::InvalidArgumentError(
              absl::StrCat("buffer of ", outs[i].size(), " bytes; the chunk is ", bytes));
        }
        return outs[i].first(bytes);
      },
      [&](size_t i, absl::Status st, const HeldChunk* h) {
        if (st.ok()) {
          out[i] = std::make_pair(static_cast<uint64_t>(h->data.size()), h->tier);
        } else {
          out[i] = std::move(st);
        }
      },
      [&](size_t i) { out[i] = GetInto(keys[i], outs[i]); });
  return out;
}

std::vector<absl::StatusOr<std::vector<uint8_t>>> KvtierClient::GetBatch(
    std::span<const Hash128> keys) {
  std::vector<absl::StatusOr<std::vector<uint8_t>>> out;
  if (!uses_shared_memory()) {
    std::vector<std::future<absl::StatusOr<std::vector<uint8_t>>>> fs;
    for (const Hash128& k : keys) fs.push_back(GetAsync(k));
    for (auto& f : fs) out.push_back(f.get());
    return out;
  }
  out.resize(keys.size());
  std::vector<std::vector<uint8_t>> bufs(keys.size());
  HoldAndCopyInGroups(
      keys.size(), GroupOps(keys),
      [&](size_t i, uint64_t bytes) -> absl::StatusOr<std::span<uint8_t>> {
        bufs[i].resize(bytes);
        return std::span<uint8_t>(bufs[i]);
      },
      [&](size_t i, absl::Status st, const HeldChunk*) {
        if (st.ok()) {
          out[i] = std::move(bufs[i]);
        } else {
          out[i] = std::move(st);
        }
      },
      [&](size_t i) { out[i] = Get(keys[i]); });
  return out;
}

absl::StatusOr<std::string> ReadTokenFile(const std::string& path) {
  constexpr uint64_t kMaxTokenFileBytes = 4096;
  auto bytes = ReadFileBytes(path, kMaxTokenFileBytes);
  if (!bytes.ok()) {
    return absl::Status(bytes.status().code(),
                        absl::StrCat("token file: ", bytes.status().message()));
  }
  std::string_view text(reinterpret_cast<const char*>(bytes->data()), bytes->size());
  const auto is_space = [](char c) { return c == ' ' || c == '\t' || c == '\r' || c == '\n'; };
  while (!text.empty() && is_space(text.front())) text.remove_prefix(1);
  while (!text.empty() && is_space(text.back())) text.remove_suffix(1);
  if (text.empty()) return absl::InvalidArgumentError(absl::StrCat("token file ", path, " holds no token"));
  for (char c : text) {
    const auto u = static_cast<unsigned char>(c);
    if (u <= 0x20 || u == 0x7f) {
      return absl::InvalidArgumentError(absl::StrCat(
          "token file ", path, ": the token holds whitespace or a control character"));
    }
  }
  return std::string(text);
}

}  // namespace kvtier::client
