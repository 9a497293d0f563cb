#include "server/grpc_service.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <optional>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "common/strings.h"
#include "server/grpc_auth.h"

namespace kvtier::server {

namespace pb = kvtier::proto::v1;
using tiering::TierKind;

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  // absl::StatusCode and grpc::StatusCode share their numbering.
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(status.message()));
}

namespace {

absl::StatusOr<Hash128> KeyFromBytes(const std::string& b) {
  if (b.size() != Hash128::kSize) {
    return absl::InvalidArgumentError(absl::StrCat("key is ", b.size(), " bytes; keys are 16"));
  }
  Hash128 k;
  std::memcpy(k.bytes.data(), b.data(), Hash128::kSize);
  return k;
}

absl::StatusOr<std::vector<Hash128>> KeysFrom(const google::protobuf::RepeatedPtrField<std::string>& in,
                                              uint32_t limit) {
  if (static_cast<uint64_t>(in.size()) > limit) {
    return absl::InvalidArgumentError(absl::StrCat(in.size(), " keys in one request; the limit is ",
                                                   limit));
  }
  std::vector<Hash128> keys;
  keys.reserve(in.size());
  for (const std::string& b : in) {
    KVTIER_ASSIGN_OR_RETURN(Hash128 k, KeyFromBytes(b));
    keys.push_back(k);
  }
  return keys;
}

pb::Tier ToProto(TierKind k) {
  switch (k) {
    case TierKind::kHbm: return pb::TIER_HBM;
    case TierKind::kDram: return pb::TIER_DRAM;
    case TierKind::kNvme: return pb::TIER_NVME;
    case TierKind::kRemote: return pb::TIER_REMOTE;
  }
  return pb::TIER_UNSPECIFIED;
}

absl::StatusOr<std::optional<TierKind>> FromProto(int t) {
  switch (t) {
    case pb::TIER_UNSPECIFIED: return std::optional<TierKind>();
    case pb::TIER_HBM: return std::optional<TierKind>(TierKind::kHbm);
    case pb::TIER_DRAM: return std::optional<TierKind>(TierKind::kDram);
    case pb::TIER_NVME: return std::optional<TierKind>(TierKind::kNvme);
    case pb::TIER_REMOTE: return std::optional<TierKind>(TierKind::kRemote);
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown tier ", t));
}

void SetLease(const tiering::Lease& l, pb::PinResponse* resp) {
  resp->set_lease_id(l.id);
  resp->set_expires_at_us(l.expires_at_us);
}

}  // namespace

// A protobuf message parsed from a call's bytes; InvalidArgument if they are
// not one.
template <typename Msg>
absl::Status Parse(const grpc::ByteBuffer& in, Msg* msg) {
  grpc::ByteBuffer copy(in);  // shares the slices; Deserialize consumes its input
  grpc::Status st = grpc::SerializationTraits<Msg>::Deserialize(&copy, msg);
  if (st.ok()) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("malformed ", Msg::descriptor()->name(),
                                                 " message: ", st.error_message()));
}

// One unary call: its record in the tracker, its metrics, its one Finish.
class GrpcAdapter::UnaryCall final : public grpc::ServerUnaryReactor {
 public:
  UnaryCall(GrpcAdapter* adapter, Ctx* ctx, Method m, Bytes* out)
      : adapter_(adapter), method_(m), out_(out), t0_(std::chrono::steady_clock::now()) {
    adapter_->tracker_.Register(&entry_, ctx);
  }

  // The client's tenant (set before the body runs).
  const Tenant* tenant = nullptr;
  // Whether the call may name pool memory (slots, shared-memory gets): not
  // a TCP call of a daemon with tenants (PoolAccess).
  bool pool_access = true;

  // OK, or FailedPrecondition for a call without pool access.
  absl::Status PoolAccess() const {
    if (pool_access) return absl::OkStatus();
    return absl::FailedPreconditionError(
        "slots and shared-memory gets are served on the Unix socket only: a TCP client cannot "
        "map the pool");
  }

  // Holds `bytes` of chunk data for the rest of the call, or
  // ResourceExhausted.
  absl::Status Reserve(uint64_t bytes) { return adapter_->tracker_.Reserve(&entry_, bytes); }

  // Records and sends the outcome, with `resp` encoded on success; the answer
  // then has the write timeout to reach its reader. Call exactly once.
  void Reply(const absl::Status& st, const google::protobuf::MessageLite* resp = nullptr) {
    Finish(adapter_->Conclude(method_, t0_, &entry_, st, resp, out_));
  }

  void OnDone() override {
    adapter_->tracker_.Unregister(&entry_);
    delete this;
  }

 private:
  GrpcAdapter* const adapter_;
  const Method method_;
  Bytes* const out_;
  const std::chrono::steady_clock::time_point t0_;
  CallTracker::Entry entry_;
};

GrpcAdapter::GrpcAdapter(KvService* service, ServerMetrics* metrics, AdapterOptions options)
    : service_(service),
      metrics_(metrics),
      options_(std::move(options)),
      tenants_(options_.tenants != nullptr ? options_.tenants : &default_tenants_),
      memory_only_engine_(service->engine()->tier(TierKind::kRemote) == nullptr),
      tracker_(options_.limits, metrics),
      pool_(std::max(1, options_.threads), std::max<size_t>(1, options_.max_queued),
            options_.thread_name) {}

GrpcAdapter::~GrpcAdapter() = default;

grpc::Status GrpcAdapter::Conclude(Method m, std::chrono::steady_clock::time_point t0,
                                   CallTracker::Entry* entry, absl::Status st,
                                   const google::protobuf::MessageLite* resp, Bytes* out) {
  if (st.ok() && resp != nullptr) {
    bool own = false;
    grpc::Status enc = grpc::SerializationTraits<google::protobuf::MessageLite>::Serialize(*resp, out, &own);
    if (!enc.ok()) st = absl::InternalError(absl::StrCat("encoding the answer: ", enc.error_message()));
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  metrics_->Record(m, static_cast<int>(st.code()), s);
  tracker_.Arm(entry, options_.limits.write_timeout_ms);
  return ToGrpcStatus(st);
}

bool GrpcAdapter::PoolAccessOf(Ctx* ctx) const {
  return !tenants_->configured() || ctx->peer().rfind("unix:", 0) == 0;
}

absl::StatusOr<const Tenant*> GrpcAdapter::Authorize(Ctx* ctx) {
  const bool unix_peer = ctx->peer().rfind("unix:", 0) == 0;  // guarded by file mode 0600
  const auto& md = ctx->client_metadata();
  auto it = md.find("authorization");
  const std::optional<std::string_view> bearer =
      it == md.end() ? std::nullopt
                     : std::optional<std::string_view>(std::in_place, it->second.data(),
                                                       it->second.size());
  if (!tenants_->configured()) {
    if (unix_peer) return tenants_->only();
    if (options_.token.empty()) {
      return absl::UnauthenticatedError("this daemon accepts no TCP clients without a token file");
    }
    if (bearer && IsBearerToken(*bearer, options_.token)) return tenants_->only();
    metrics_->Add(ServerMetric::kAuthFailures);
    return absl::UnauthenticatedError("missing or wrong bearer token");
  }
  const Tenant* t = bearer ? tenants_->ByBearer(*bearer) : nullptr;
  if (t == nullptr && !bearer && unix_peer) {
    t = tenants_->ByUid(static_cast<uint32_t>(::getuid()));
    if (t == nullptr) {
      metrics_->Add(ServerMetric::kAuthFailures);
      return absl::UnauthenticatedError(absl::StrCat(
          "no tenant for uid ", ::getuid(), " in the tenants file: send a tenant's bearer token"));
    }
    return t;
  }
  if (t == nullptr) {
    metrics_->Add(ServerMetric::kAuthFailures);
    return absl::UnauthenticatedError("missing or wrong bearer token (no tenant has it)");
  }
  if (!unix_peer) {
    std::shared_ptr<const grpc::AuthContext> auth = ctx->auth_context();
    const Tenant* tls = auth != nullptr ? tenants_->ByAuthContext(*auth) : nullptr;
    if (tls != nullptr && tls != t) {
      metrics_->Add(ServerMetric::kAuthFailures);
      return absl::UnauthenticatedError("the bearer token and the TLS identity name different tenants");
    }
  }
  return t;
}

absl::Status GrpcAdapter::CheckVersion(uint32_t version) const {
  if (version == kProtocolVersion) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("protocol version ", version,
                                                 " not served; this daemon speaks ",
                                                 kProtocolVersion));
}

template <typename Req, typename Resp, typename Body>
grpc::ServerUnaryReactor* GrpcAdapter::Serve(Method m, Ctx* ctx, const Bytes* in, Bytes* out,
                                             Body body, ServeMode mode) {
  struct Messages {
    Req req;
    Resp resp;
  };
  auto* call = new UnaryCall(this, ctx, m, out);
  auto msgs = std::make_shared<Messages>();
  absl::StatusOr<const Tenant*> tenant = Authorize(ctx);
  absl::Status st = tenant.status();
  if (st.ok()) {
    call->tenant = *tenant;
    call->pool_access = PoolAccessOf(ctx);
    st = Parse(*in, &msgs->req);
  }
  if (st.ok() && mode.check_version) st = CheckVersion(msgs->req.version());
  if (!st.ok()) {
    call->Reply(st);
    return call;
  }
  auto run = [call, msgs, body = std::move(body)]() mutable {
    absl::Status s = body(*call, &msgs->req, &msgs->resp);
    call->Reply(s, &msgs->resp);
  };
  if (mode.run_inline) {
    run();
  } else if (!pool_.TrySchedule(std::move(run))) {
    call->Reply(absl::ResourceExhaustedError(absl::StrCat(
        "kvtierd is busy: ", options_.max_queued, " requests wait for a thread (retry later)")));
  }
  return call;
}

grpc::ServerUnaryReactor* GrpcAdapter::Lookup(Ctx* ctx, const Bytes* in, Bytes* out) {
  return Serve<pb::LookupRequest, pb::LookupResponse>(Method::kLookup, ctx, in, out, [this](UnaryCall& call, const pb::LookupRequest* req, pb::LookupResponse* resp) -> absl::Status {
    KVTIER_ASSIGN_OR_RETURN(auto keys, KeysFrom(req->keys(), service_->limits().max_keys_per_request));
    call.tenant->MapReadKeys(keys, service_->engine());
    if (!req->estimate_load() && req->prefill_tokens_per_s() == 0 &&
        req->attention_doubling_tokens() == 0) {
      KVTIER_ASSIGN_OR_RETURN(auto tiers, service_->Lookup(keys));
      for (TierKind t : tiers) resp->add_tiers(ToProto(t));
      return absl::OkStatus();
    }
    KVTIER_ASSIGN_OR_RETURN(KvService::LoadPlan plan,
                            service_->PlanLoad(keys,
                                               {.tokens_per_s = req->prefill_tokens_per_s(),
                                                .attention_doubling_tokens =
                                                    req->attention_doubling_tokens()},
                                               req->tokens_per_chunk()));
    for (size_t i = 0; i < plan.estimate.tiers.size(); ++i) {
      resp->add_tiers(ToProto(plan.estimate.tiers[i]));
      resp->add_chunk_bytes(plan.estimate.bytes[i]);
      resp->add_load_us(plan.estimate.load_us[i]);
    }
    resp->set_load_chunks(static_cast<uint32_t>(plan.decision.chunks));
    resp->set_load_chunks_us(plan.decision.load_us);
    resp->set_saved_us(plan.decision.saved_us());
    return absl::OkStatus();
  },
      ServeMode{.run_inline = memory_only_engine_});
}

grpc::ServerUnaryReactor* GrpcAdapter::AllocateSlot(Ctx* ctx, const Bytes* in, Bytes* out) {
  return Serve<pb::AllocateSlotRequest, pb::AllocateSlotResponse>(Method::kAllocateSlot, ctx, in, out, [this](UnaryCall& call, const pb::AllocateSlotRequest* req, pb::AllocateSlotResponse* resp) -> absl::Status {
    KVTIER_RETURN_IF_ERROR(call.PoolAccess());
    KVTIER_ASSIGN_OR_RETURN(tiering::Slot slot,
                            service_->AllocateSlot(req->bytes(), req->ttl_ms(),
                                                   GrpcHolder(call.tenant->id())));
    resp->set_slot_id(slot.id);
    resp->mutable_extent()->set_offset(slot.extent.offset);
    resp->mutable_extent()->set_length(slot.extent.length);
    resp->mutable_extent()->set_pool_id(options_.shm_pool_id);
    resp->set_expires_at_us(slot.expires_at_us);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* GrpcAdapter::AbortSlot(Ctx* ctx, const Bytes* in, Bytes* out) {
  return Serve<pb::AbortSlotRequest, pb::AbortSlotResponse>(Method::kAbortSlot, ctx, in, out,
               [this](UnaryCall& call, const pb::AbortSlotRequest* req, pb::AbortSlotResponse*) {
                 return service_->AbortSlot(req->slot_id(), GrpcHolder(call.tenant->id()).id);
               },
      ServeMode{.run_inline = true});
}

grpc::ServerUnaryReactor* GrpcAdapter::Put(Ctx* ctx, const Bytes* in, Bytes* out) {
  return Serve<pb::PutRequest, pb::PutResponse>(Method::kPut, ctx, in, out, [this](UnaryCall& call, const pb::PutRequest* req, pb::PutResponse*) -> absl::Status {
    PutArgs args;
    KVTIER_ASSIGN_OR_RETURN(Hash128 key, KeyFromBytes(req->key()));
    args.key = call.tenant->WriteKey(key);
    args.tenant = call.tenant->id();
    args.holder = GrpcHolder(args.tenant).id;
    KVTIER_ASSIGN_OR_RETURN(args.tier, FromProto(req->tier()));
    args.durable = req->durable();
    args.seal = req->seal();
    switch (req->data_case()) {
      case pb::PutRequest::kInlineChunk: {
        const std::string& b = req->inline_chunk();
        // The message's bytes and the parsed copy.
        KVTIER_RETURN_IF_ERROR(call.Reserve(2 * b.size()));
        absl::Status put = service_->Put(
            args, std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(b.data()), b.size()));
        call.tenant->CountPut(put);
        KVTIER_RETURN_IF_ERROR(put);
        metrics_->Add(ServerMetric::kBytesPutInline, b.size());
        return absl::OkStatus();
      }
      case pb::PutRequest::kSlotId: {
        KVTIER_RETURN_IF_ERROR(call.PoolAccess());
        absl::Status put = service_->CommitSlot(args, req->slot_id());
        call.tenant->CountPut(put);
        KVTIER_RETURN_IF_ERROR(put);
        auto n = service_->engine()->ChunkBytes(args.key);
        if (n.ok()) metrics_->Add(ServerMetric::kBytesPutShm, *n);
        return absl::OkStatus();
      }
      case pb::PutRequest::DATA_NOT_SET:
        break;
    }
    return absl::InvalidArgumentError("put carries neither inline bytes nor a slot id");
  });
}

// A streamed commit of a slot: each message reports bytes written, which are
// checked on the worker pool while the client copies on; the next message is
// read only after the last one was checked. A stream idle past the limit is
// cancelled, and a stream that ends without its commit frees the slot.
class GrpcAdapter::PutStreamCall final : public grpc::ServerReadReactor<grpc::ByteBuffer> {
 public:
  PutStreamCall(GrpcAdapter* adapter, Ctx* ctx, Bytes* out)
      : adapter_(adapter), out_(out), t0_(std::chrono::steady_clock::now()) {
    adapter_->tracker_.Register(&entry_, ctx);
    absl::StatusOr<const Tenant*> tenant = adapter_->Authorize(ctx);
    if (!tenant.ok()) {
      Reply(tenant.status());
      return;
    }
    tenant_ = *tenant;
    if (!adapter_->PoolAccessOf(ctx)) {
      Reply(absl::FailedPreconditionError(
          "put streams commit slots, served on the Unix socket only: a TCP client cannot map the "
          "pool"));
      return;
    }
    ReadNext();
  }

  void OnReadDone(bool ok) override {
    adapter_->tracker_.Disarm(&entry_);
    if (!adapter_->pool_.TrySchedule([this, ok] { Step(ok); })) {
      Reply(absl::ResourceExhaustedError("kvtierd is busy: too many requests wait for a thread"));
    }
  }

  void OnDone() override {
    if (slot_open_) (void)adapter_->service_->AbortSlot(slot_id_, StreamHolder());
    adapter_->tracker_.Unregister(&entry_);
    delete this;
  }

 private:
  void ReadNext() {
    adapter_->tracker_.Arm(&entry_, adapter_->options_.limits.stream_idle_timeout_ms);
    StartRead(&in_);
  }

  // Handles the message just read (`ok`) or the end of the stream.
  void Step(bool ok) {
    if (ok) {
      m_.Clear();
      if (absl::Status st = Parse(in_, &m_); !st.ok()) return check_ ? Fail(st) : Reply(st);
    }
    if (check_ == nullptr) {
      if (!ok) return Reply(absl::InvalidArgumentError("empty put stream"));
      if (absl::Status st = adapter_->CheckVersion(m_.version()); !st.ok()) return Reply(st);
      slot_id_ = m_.slot_id();
      auto check = adapter_->service_->BeginStreamedCommit(slot_id_, StreamHolder());
      if (!check.ok()) return Reply(check.status());
      check_ = std::move(*check);
      slot_open_ = true;
      args_.durable = m_.durable();
      auto key = KeyFromBytes(m_.key());
      auto tier = FromProto(m_.tier());
      absl::Status st = key.ok() ? tier.status() : key.status();
      if (!st.ok()) return Fail(st);
      args_.key = tenant_->WriteKey(*key);
      args_.tenant = tenant_->id();
      args_.holder = StreamHolder();
      args_.tier = *tier;
    } else if (!ok) {
      return Fail(absl::InvalidArgumentError("put stream ended without its commit message"));
    }
    if (m_.slot_id() != slot_id_) {
      return Fail(absl::InvalidArgumentError(
          absl::StrCat("put stream of slot ", slot_id_, " names slot ", m_.slot_id())));
    }
    if (absl::Status st = check_->Advance(m_.written_bytes()); !st.ok()) return Fail(st);
    if (!m_.commit()) return ReadNext();
    slot_open_ = false;
    absl::Status st = adapter_->service_->FinishStreamedCommit(args_, slot_id_, *check_);
    tenant_->CountPut(st);
    if (st.ok()) adapter_->metrics_->Add(ServerMetric::kBytesPutShm, m_.written_bytes());
    Reply(st);
  }

  // The stream's credential holds its slot (GrpcHolder).
  tiering::HolderId StreamHolder() const { return GrpcHolder(tenant_->id()).id; }

  void Fail(const absl::Status& st) {
    slot_open_ = false;
    (void)adapter_->service_->AbortSlot(slot_id_, StreamHolder());
    Reply(st);
  }

  void Reply(const absl::Status& st) {
    const pb::PutResponse resp;
    Finish(adapter_->Conclude(Method::kPut, t0_, &entry_, st, &resp, out_));
  }

  GrpcAdapter* const adapter_;
  Bytes* const out_;
  const std::chrono::steady_clock::time_point t0_;
  CallTracker::Entry entry_;
  grpc::ByteBuffer in_;
  pb::PutStreamRequest m_;
  std::unique_ptr<wire::IncrementalChunkCheck> check_;
  const Tenant* tenant_ = nullptr;
  uint64_t slot_id_ = 0;
  bool slot_open_ = false;  // begun and neither committed nor aborted
  PutArgs args_;
};

grpc::ServerReadReactor<grpc::ByteBuffer>* GrpcAdapter::PutStream(Ctx* ctx, Bytes* out) {
  return new PutStreamCall(this, ctx, out);
}

grpc::ServerUnaryReactor* GrpcAdapter::Get(Ctx* ctx, const Bytes* in, Bytes* out) {
  return Serve<pb::GetRequest, pb::GetResponse>(Method::kGet, ctx, in, out, [this](UnaryCall& call, const pb::GetRequest* req, pb::GetResponse* resp) -> absl::Status {
    KVTIER_ASSIGN_OR_RETURN(Hash128 client_key, KeyFromBytes(req->key()));
    const Hash128 key = call.tenant->ReadKey(client_key, service_->engine());
    GetMode mode;
    switch (req->mode()) {
      case pb::GET_MODE_INLINE: mode = GetMode::kCopy; break;
      case pb::GET_MODE_SHM: mode = GetMode::kShm; break;
      case pb::GET_MODE_SLOT: mode = GetMode::kSlot; break;
      default: return absl::InvalidArgumentError(absl::StrCat("unknown get mode ", req->mode()));
    }
    if (mode != GetMode::kCopy) KVTIER_RETURN_IF_ERROR(call.PoolAccess());
    if (mode == GetMode::kCopy) {
      // The answer holds the chunk twice until it is sent: the message and
      // its encoding.
      auto n = service_->engine()->ChunkBytes(key);
      if (!n.ok()) call.tenant->CountRead(n.status());
      KVTIER_RETURN_IF_ERROR(n.status());
      KVTIER_RETURN_IF_ERROR(call.Reserve(2 * *n));
    }
    auto got = service_->Get(key, mode, GrpcHolder(call.tenant->id()), req->slot_id(),
                             req->lease_ms(), req->verify());
    call.tenant->CountRead(got.status());
    KVTIER_ASSIGN_OR_RETURN(GetResult r, std::move(got));
    resp->set_tier(ToProto(r.tier));
    resp->set_chunk_bytes(r.chunk_bytes);
    if (mode == GetMode::kCopy) {
      resp->set_inline_chunk(reinterpret_cast<const char*>(r.bytes.data()), r.bytes.size());
      metrics_->Add(ServerMetric::kBytesGetInline, r.bytes.size());
    } else {
      resp->mutable_extent()->set_offset(r.extent.offset);
      resp->mutable_extent()->set_length(r.extent.length);
      resp->mutable_extent()->set_pool_id(options_.shm_pool_id);
      resp->set_lease_id(r.lease_id);
      resp->set_scratch_slot_id(r.scratch_slot_id);
      metrics_->Add(ServerMetric::kBytesGetShm, r.chunk_bytes);
    }
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* GrpcAdapter::Prefetch(Ctx* ctx, const Bytes* in, Bytes* out) {
  return Serve<pb::PrefetchRequest, pb::PrefetchResponse>(Method::kPrefetch, ctx, in, out, [this](UnaryCall& call, const pb::PrefetchRequest* req, pb::PrefetchResponse* resp) -> absl::Status {
    KVTIER_ASSIGN_OR_RETURN(auto keys, KeysFrom(req->keys(), service_->limits().max_keys_per_request));
    call.tenant->MapReadKeys(keys, service_->engine());
    KVTIER_ASSIGN_OR_RETURN(bool done, service_->Prefetch(std::move(keys), req->deadline_ms()));
    resp->set_completed(done);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* GrpcAdapter::Pin(Ctx* ctx, const Bytes* in, Bytes* out) {
  return Serve<pb::PinRequest, pb::PinResponse>(Method::kPin, ctx, in, out, [this](UnaryCall& call, const pb::PinRequest* req, pb::PinResponse* resp) -> absl::Status {
    KVTIER_ASSIGN_OR_RETURN(auto keys, KeysFrom(req->keys(), service_->limits().max_keys_per_request));
    call.tenant->MapReadKeys(keys, service_->engine());
    KVTIER_ASSIGN_OR_RETURN(tiering::Lease l,
                            service_->Pin(keys, req->ttl_ms(), GrpcHolder(call.tenant->id())));
    SetLease(l, resp);
    return absl::OkStatus();
  },
      ServeMode{.run_inline = memory_only_engine_});
}

grpc::ServerUnaryReactor* GrpcAdapter::Renew(Ctx* ctx, const Bytes* in, Bytes* out) {
  return Serve<pb::RenewRequest, pb::PinResponse>(Method::kRenew, ctx, in, out, [this](UnaryCall& call, const pb::RenewRequest* req, pb::PinResponse* resp) -> absl::Status {
    KVTIER_ASSIGN_OR_RETURN(tiering::Lease l, service_->Renew(req->lease_id(), req->ttl_ms(),
                                                              GrpcHolder(call.tenant->id()).id));
    SetLease(l, resp);
    return absl::OkStatus();
  },
      ServeMode{.run_inline = true});
}

grpc::ServerUnaryReactor* GrpcAdapter::Release(Ctx* ctx, const Bytes* in, Bytes* out) {
  return Serve<pb::ReleaseRequest, pb::ReleaseResponse>(Method::kRelease, ctx, in, out,
               [this](UnaryCall& call, const pb::ReleaseRequest* req, pb::ReleaseResponse*) {
                 return service_->Release(req->lease_id(), GrpcHolder(call.tenant->id()).id);
               },
      ServeMode{.run_inline = true});
}

grpc::ServerUnaryReactor* GrpcAdapter::Delete(Ctx* ctx, const Bytes* in, Bytes* out) {
  return Serve<pb::DeleteRequest, pb::DeleteResponse>(Method::kDelete, ctx, in, out, [this](UnaryCall& call, const pb::DeleteRequest* req, pb::DeleteResponse*) -> absl::Status {
    KVTIER_ASSIGN_OR_RETURN(Hash128 key, KeyFromBytes(req->key()));
    return service_->Delete(call.tenant->WriteKey(key));
  });
}

grpc::ServerUnaryReactor* GrpcAdapter::Stats(Ctx* ctx, const Bytes* in, Bytes* out) {
  return Serve<pb::StatsRequest, pb::StatsResponse>(Method::kStats, ctx, in, out, [this](UnaryCall&, const pb::StatsRequest*, pb::StatsResponse* resp) -> absl::Status {
    ServiceStats s = service_->Stats();
    for (const tiering::TierUsage& u : s.tiers) {
      pb::TierStats* t = resp->add_tiers();
      t->set_tier(ToProto(u.kind));
      t->set_capacity_bytes(u.capacity_bytes);
      t->set_used_bytes(u.used_bytes);
      t->set_chunks(u.objects);
      t->set_read_bytes_per_s(u.bandwidth.read_bytes_per_s);
      t->set_write_bytes_per_s(u.bandwidth.write_bytes_per_s);
    }
    for (const auto& [name, value] : s.counters) {
      pb::Counter* c = resp->add_counters();
      c->set_name(name);
      c->set_value(value);
    }
    for (int i = 0; i < static_cast<int>(ServerMetric::kCount); ++i) {
      auto m = static_cast<ServerMetric>(i);
      pb::Counter* c = resp->add_counters();
      c->set_name(ServerMetricName(m));
      c->set_value(metrics_->Get(m));
    }
    return absl::OkStatus();
  },
      ServeMode{.run_inline = true});
}

grpc::ServerUnaryReactor* GrpcAdapter::Health(Ctx* ctx, const Bytes* in, Bytes* out) {
  // Health answers any version so that a client can learn which one to
  // speak, and runs on the gRPC thread: it reads no tier, so a daemon whose
  // workers are all busy still answers it.
  return Serve<pb::HealthRequest, pb::HealthResponse>(
      Method::kHealth, ctx, in, out,
      [this](UnaryCall&, const pb::HealthRequest*, pb::HealthResponse* resp) -> absl::Status {
        resp->set_serving(true);
        resp->set_protocol_version(kProtocolVersion);
        tiering::DramTier* dram = service_->engine()->dram();
        if (dram != nullptr && !options_.shm_socket.empty()) {
          resp->set_shm_socket(options_.shm_socket);
          resp->set_shm_pool_bytes(dram->shm_size());
        }
        resp->set_max_keys_per_request(service_->limits().max_keys_per_request);
        resp->set_max_message_bytes(options_.max_message_bytes);
        return absl::OkStatus();
      },
      ServeMode{.check_version = false, .run_inline = true});
}

}  // namespace kvtier::server
