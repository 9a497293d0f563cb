#include "client/rpc_client.h"

#include <algorithm>
#include <chrono>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "wire/chunk_check.h"

namespace kvtier::client {

namespace pb = kvtier::proto::v1;

namespace {

constexpr uint32_t kProtocolVersion = 1;

std::string KeyBytes(const Hash128& k) {
  return std::string(reinterpret_cast<const char*>(k.bytes.data()), k.bytes.size());
}

PoolExtent ExtentOf(const pb::ShmExtent& e) { return PoolExtent{e.pool_id(), e.offset(), e.length()}; }

}  // namespace

absl::Status FromGrpcStatus(const grpc::Status& s) {
  if (s.ok()) return absl::OkStatus();
  // grpc::StatusCode and absl::StatusCode share their numbering.
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
}

void RpcClient::Prepare(grpc::ClientContext& ctx, int64_t timeout_ms) const {
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(timeout_ms));
  if (!options_.token.empty()) ctx.AddMetadata("authorization", "Bearer " + options_.token);
}

template <typename Req, typename Resp>
absl::Status RpcClient::Call(grpc::Status (pb::Kvtier::StubInterface::*method)(grpc::ClientContext*,
                                                                               const Req&, Resp*),
                             const Req& req, Resp* resp) {
  grpc::ClientContext ctx;
  Prepare(ctx, options_.timeout_ms);
  return FromGrpcStatus((stub_->*method)(&ctx, req, resp));
}

std::string RpcClient::Target() const {
  return options_.tcp_addr.empty() ? "unix:" + options_.socket_path : options_.tcp_addr;
}

absl::StatusOr<std::string> RpcClient::Health() {
  grpc::ClientContext ctx;
  Prepare(ctx, 5000);
  pb::HealthRequest req;
  req.set_version(kProtocolVersion);
  pb::HealthResponse resp;
  grpc::Status s = stub_->Health(&ctx, req, &resp);
  if (s.error_code() == grpc::StatusCode::UNAUTHENTICATED) {
    return absl::UnauthenticatedError(
        absl::StrCat("kvtierd at ", Target(), " refused the token: ", s.error_message()));
  }
  if (!s.ok()) {
    return absl::UnavailableError(absl::StrCat("kvtierd not reachable at ", Target(), ": ",
                                               s.error_message()));
  }
  return resp.shm_socket();
}

absl::StatusOr<std::vector<Tier>> RpcClient::Lookup(std::span<const Hash128> keys) {
  pb::LookupRequest req;
  req.set_version(kProtocolVersion);
  for (const Hash128& k : keys) req.add_keys(KeyBytes(k));
  pb::LookupResponse resp;
  KVTIER_RETURN_IF_ERROR(Call(&pb::Kvtier::StubInterface::Lookup, req, &resp));
  std::vector<Tier> out;
  for (int t : resp.tiers()) out.push_back(TierFromWire(t));
  return out;
}

absl::StatusOr<LoadPlan> RpcClient::PlanLoad(std::span<const Hash128> keys,
                                             double prefill_tokens_per_s,
                                             double attention_doubling_tokens,
                                             uint32_t tokens_per_chunk) {
  pb::LookupRequest req;
  req.set_version(kProtocolVersion);
  for (const Hash128& k : keys) req.add_keys(KeyBytes(k));
  req.set_estimate_load(true);
  req.set_prefill_tokens_per_s(prefill_tokens_per_s);
  req.set_tokens_per_chunk(tokens_per_chunk);
  req.set_attention_doubling_tokens(attention_doubling_tokens);
  pb::LookupResponse resp;
  KVTIER_RETURN_IF_ERROR(Call(&pb::Kvtier::StubInterface::Lookup, req, &resp));
  const int n = resp.tiers_size();
  if (n > 0 && resp.chunk_bytes_size() == 0 && resp.load_us_size() == 0) {
    return absl::FailedPreconditionError(
        "this kvtierd does not estimate load times (it predates them); upgrade it");
  }
  if (resp.chunk_bytes_size() != n || resp.load_us_size() != n || resp.load_chunks() > uint32_t(n)) {
    return absl::InternalError("daemon answered a load estimate that does not match its hits");
  }
  LoadPlan plan;
  for (int t : resp.tiers()) plan.tiers.push_back(TierFromWire(t));
  plan.chunk_bytes.assign(resp.chunk_bytes().begin(), resp.chunk_bytes().end());
  plan.load_us.assign(resp.load_us().begin(), resp.load_us().end());
  plan.load_chunks = resp.load_chunks();
  plan.load_chunks_us = resp.load_chunks_us();
  plan.saved_us = resp.saved_us();
  return plan;
}

absl::Status RpcClient::PutInline(const Hash128& key, std::span<const uint8_t> chunk,
                                  const PutOptions& options) {
  pb::PutRequest req;
  req.set_version(kProtocolVersion);
  req.set_key(KeyBytes(key));
  req.set_inline_chunk(reinterpret_cast<const char*>(chunk.data()), chunk.size());
  req.set_durable(options.durable);
  pb::PutResponse resp;
  return Call(&pb::Kvtier::StubInterface::Put, req, &resp);
}

absl::Status RpcClient::PutStream(const WritableSlot& slot, const Hash128& key,
                                  std::span<const uint8_t> chunk, const PutOptions& options) {
  constexpr size_t kStreamPieceBytes = size_t{2} << 20;
  grpc::ClientContext ctx;
  Prepare(ctx, options_.timeout_ms);
  pb::PutResponse resp;
  std::unique_ptr<grpc::ClientWriterInterface<pb::PutStreamRequest>> w =
      stub_->PutStream(&ctx, &resp);
  pb::PutStreamRequest m;
  m.set_version(kProtocolVersion);
  m.set_key(KeyBytes(key));
  m.set_slot_id(slot.id);
  m.set_durable(options.durable);
  for (size_t o = 0; o < chunk.size();) {
    const size_t n = std::min(kStreamPieceBytes, chunk.size() - o);
    // Non-temporal stores: the daemon's check reads them from memory
    // instead of snooping them out of this core's cache.
    wire::StreamCopy(slot.data.subspan(o, n), chunk.subspan(o, n));
    o += n;
    m.set_written_bytes(o);
    m.set_commit(o == chunk.size());
    if (!w->Write(m)) break;  // the daemon ended the call; Finish says why
  }
  w->WritesDone();
  return FromGrpcStatus(w->Finish());
}

absl::StatusOr<std::pair<uint64_t, Tier>> RpcClient::GetInline(const Hash128& key,
                                                               ChunkSink sink) {
  pb::GetRequest req;
  req.set_version(kProtocolVersion);
  req.set_key(KeyBytes(key));
  req.set_mode(pb::GET_MODE_INLINE);
  pb::GetResponse resp;
  KVTIER_RETURN_IF_ERROR(Call(&pb::Kvtier::StubInterface::Get, req, &resp));
  const std::string& b = resp.inline_chunk();
  if (sink.out != nullptr) {
    if (sink.out->size() < b.size()) return BufferTooSmall(sink.out->size(), b.size());
    std::memcpy(sink.out->data(), b.data(), b.size());
  } else {
    sink.vec->assign(b.begin(), b.end());
  }
  return std::make_pair(static_cast<uint64_t>(b.size()), TierFromWire(resp.tier()));
}

absl::StatusOr<std::pair<HeldChunk, PoolExtent>> RpcClient::GetHeld(const Hash128& key,
                                                                    bool verify) {
  pb::GetRequest req;
  req.set_version(kProtocolVersion);
  req.set_key(KeyBytes(key));
  req.set_mode(pb::GET_MODE_SHM);
  req.set_verify(verify);
  pb::GetResponse resp;
  KVTIER_RETURN_IF_ERROR(Call(&pb::Kvtier::StubInterface::Get, req, &resp));
  HeldChunk h;
  h.tier = TierFromWire(resp.tier());
  h.lease_id = resp.lease_id();
  h.scratch_slot_id = resp.scratch_slot_id();
  return std::make_pair(h, ExtentOf(resp.extent()));
}

absl::StatusOr<std::pair<uint64_t, PoolExtent>> RpcClient::AllocateSlot(uint64_t bytes) {
  pb::AllocateSlotRequest req;
  req.set_version(kProtocolVersion);
  req.set_bytes(bytes);
  pb::AllocateSlotResponse resp;
  KVTIER_RETURN_IF_ERROR(Call(&pb::Kvtier::StubInterface::AllocateSlot, req, &resp));
  return std::make_pair(resp.slot_id(), ExtentOf(resp.extent()));
}

absl::Status RpcClient::CommitSlot(uint64_t slot_id, const Hash128& key,
                                   const PutOptions& options) {
  if (options.landing_layers != 0) {
    return absl::UnimplementedError("a landing commit needs the shared-memory data plane");
  }
  WaitForReleases();
  pb::PutRequest req;
  req.set_version(kProtocolVersion);
  req.set_key(KeyBytes(key));
  req.set_slot_id(slot_id);
  req.set_durable(options.durable);
  req.set_seal(options.daemon_seals);
  pb::PutResponse resp;
  return Call(&pb::Kvtier::StubInterface::Put, req, &resp);
}

absl::Status RpcClient::AbortSlot(uint64_t slot_id) {
  WaitForReleases();
  pb::AbortSlotRequest req;
  req.set_version(kProtocolVersion);
  req.set_slot_id(slot_id);
  pb::AbortSlotResponse resp;
  return Call(&pb::Kvtier::StubInterface::AbortSlot, req, &resp);
}

absl::Status RpcClient::Delete(const Hash128& key) {
  WaitForReleases();
  pb::DeleteRequest req;
  req.set_version(kProtocolVersion);
  req.set_key(KeyBytes(key));
  pb::DeleteResponse resp;
  return Call(&pb::Kvtier::StubInterface::Delete, req, &resp);
}

absl::StatusOr<bool> RpcClient::Prefetch(std::span<const Hash128> keys, uint32_t deadline_ms) {
  WaitForReleases();
  pb::PrefetchRequest req;
  req.set_version(kProtocolVersion);
  for (const Hash128& k : keys) req.add_keys(KeyBytes(k));
  req.set_deadline_ms(deadline_ms);
  pb::PrefetchResponse resp;
  KVTIER_RETURN_IF_ERROR(Call(&pb::Kvtier::StubInterface::Prefetch, req, &resp));
  return resp.completed();
}

absl::StatusOr<uint64_t> RpcClient::Pin(std::span<const Hash128> keys, uint32_t ttl_ms) {
  WaitForReleases();
  pb::PinRequest req;
  req.set_version(kProtocolVersion);
  for (const Hash128& k : keys) req.add_keys(KeyBytes(k));
  req.set_ttl_ms(ttl_ms);
  pb::PinResponse resp;
  KVTIER_RETURN_IF_ERROR(Call(&pb::Kvtier::StubInterface::Pin, req, &resp));
  return resp.lease_id();
}

absl::Status RpcClient::Release(uint64_t lease_id) {
  WaitForReleases();
  pb::ReleaseRequest req;
  req.set_version(kProtocolVersion);
  req.set_lease_id(lease_id);
  pb::ReleaseResponse resp;
  return Call(&pb::Kvtier::StubInterface::Release, req, &resp);
}

absl::StatusOr<DaemonStats> RpcClient::Stats() {
  WaitForReleases();
  pb::StatsRequest req;
  req.set_version(kProtocolVersion);
  pb::StatsResponse resp;
  KVTIER_RETURN_IF_ERROR(Call(&pb::Kvtier::StubInterface::Stats, req, &resp));
  DaemonStats s;
  for (const pb::TierStats& t : resp.tiers()) {
    s.tiers.push_back(TierStats{TierFromWire(t.tier()), t.capacity_bytes(), t.used_bytes(),
                                t.chunks(), t.read_bytes_per_s(), t.write_bytes_per_s()});
  }
  for (const pb::Counter& c : resp.counters()) s.counters.emplace_back(c.name(), c.value());
  return s;
}

absl::Status RpcClient::ReleaseAsync(uint64_t lease_id) {
  auto* async = stub_->async();
  if (async == nullptr) return Release(lease_id);
  struct Pending {
    grpc::ClientContext ctx;
    pb::ReleaseRequest req;
    pb::ReleaseResponse resp;
  };
  auto* p = new Pending;
  Prepare(p->ctx, options_.timeout_ms);
  p->req.set_version(kProtocolVersion);
  p->req.set_lease_id(lease_id);
  {
    absl::MutexLock l(&releases_->mu);
    ++releases_->pending;
  }
  async->Release(&p->ctx, &p->req, &p->resp, [p, r = releases_](grpc::Status) {
    delete p;
    absl::MutexLock l(&r->mu);
    --r->pending;
  });
  return absl::OkStatus();
}

void RpcClient::WaitForReleases() {
  {
    absl::MutexLock l(&releases_->mu);
    releases_->mu.Await(absl::Condition(
        +[](int* n) { return *n == 0; }, &releases_->pending));
  }
  if (settle_data_plane_) settle_data_plane_();
}

}  // namespace kvtier::client
