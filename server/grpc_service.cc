#include "server/grpc_service.h"

#include <chrono>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "common/strings.h"

namespace kvtier::server {

namespace pb = kvtier::proto::v1;
using tiering::TierKind;

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  // absl::StatusCode and grpc::StatusCode share their numbering.
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(status.message()));
}

bool ConstantTimeEquals(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  volatile unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff = diff | (a[i] ^ b[i]);
  return diff == 0;
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

GrpcAdapter::GrpcAdapter(KvService* service, ServerMetrics* metrics, AdapterOptions options)
    : service_(service), metrics_(metrics), options_(std::move(options)) {}

absl::Status GrpcAdapter::Authorize(grpc::ServerContext* ctx) {
  if (ctx->peer().rfind("unix:", 0) == 0) return absl::OkStatus();  // guarded by file mode 0600
  if (options_.token.empty()) {
    return absl::UnauthenticatedError("this daemon accepts no TCP clients without a token file");
  }
  const auto& md = ctx->client_metadata();
  auto it = md.find("authorization");
  constexpr std::string_view kBearer = "Bearer ";
  if (it != md.end()) {
    std::string_view v(it->second.data(), it->second.size());
    if (v.substr(0, kBearer.size()) == kBearer &&
        ConstantTimeEquals(v.substr(kBearer.size()), options_.token)) {
      return absl::OkStatus();
    }
  }
  metrics_->Add(ServerMetric::kAuthFailures);
  return absl::UnauthenticatedError("missing or wrong bearer token");
}

template <typename Body>
grpc::Status GrpcAdapter::Serve(Method m, grpc::ServerContext* ctx, uint32_t version, Body body) {
  auto t0 = std::chrono::steady_clock::now();
  absl::Status st = Authorize(ctx);
  if (st.ok() && version != kProtocolVersion) {
    st = absl::InvalidArgumentError(absl::StrCat("protocol version ", version,
                                                 " not served; this daemon speaks ",
                                                 kProtocolVersion));
  }
  if (st.ok()) st = body();
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  metrics_->Record(m, static_cast<int>(st.code()), s);
  return ToGrpcStatus(st);
}

grpc::Status GrpcAdapter::Lookup(grpc::ServerContext* ctx, const pb::LookupRequest* req,
                                 pb::LookupResponse* resp) {
  return Serve(Method::kLookup, ctx, req->version(), [&]() -> absl::Status {
    KVTIER_ASSIGN_OR_RETURN(auto keys, KeysFrom(req->keys(), service_->limits().max_keys_per_request));
    if (!req->estimate_load() && req->prefill_tokens_per_s() == 0) {
      KVTIER_ASSIGN_OR_RETURN(auto tiers, service_->Lookup(keys));
      for (TierKind t : tiers) resp->add_tiers(ToProto(t));
      return absl::OkStatus();
    }
    KVTIER_ASSIGN_OR_RETURN(KvService::LoadPlan plan,
                            service_->PlanLoad(keys, req->prefill_tokens_per_s(),
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
  });
}

grpc::Status GrpcAdapter::AllocateSlot(grpc::ServerContext* ctx, const pb::AllocateSlotRequest* req,
                                       pb::AllocateSlotResponse* resp) {
  return Serve(Method::kAllocateSlot, ctx, req->version(), [&]() -> absl::Status {
    KVTIER_ASSIGN_OR_RETURN(tiering::Slot slot, service_->AllocateSlot(req->bytes(), req->ttl_ms()));
    resp->set_slot_id(slot.id);
    resp->mutable_extent()->set_offset(slot.extent.offset);
    resp->mutable_extent()->set_length(slot.extent.length);
    resp->set_expires_at_us(slot.expires_at_us);
    return absl::OkStatus();
  });
}

grpc::Status GrpcAdapter::AbortSlot(grpc::ServerContext* ctx, const pb::AbortSlotRequest* req,
                                    pb::AbortSlotResponse*) {
  return Serve(Method::kAbortSlot, ctx, req->version(),
               [&]() { return service_->AbortSlot(req->slot_id()); });
}

grpc::Status GrpcAdapter::Put(grpc::ServerContext* ctx, const pb::PutRequest* req,
                              pb::PutResponse*) {
  return Serve(Method::kPut, ctx, req->version(), [&]() -> absl::Status {
    PutArgs args;
    KVTIER_ASSIGN_OR_RETURN(args.key, KeyFromBytes(req->key()));
    KVTIER_ASSIGN_OR_RETURN(args.tier, FromProto(req->tier()));
    args.durable = req->durable();
    switch (req->data_case()) {
      case pb::PutRequest::kInlineChunk: {
        const std::string& b = req->inline_chunk();
        KVTIER_RETURN_IF_ERROR(service_->Put(
            args, std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(b.data()), b.size())));
        metrics_->Add(ServerMetric::kBytesPutInline, b.size());
        return absl::OkStatus();
      }
      case pb::PutRequest::kSlotId: {
        KVTIER_RETURN_IF_ERROR(service_->CommitSlot(args, req->slot_id()));
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

grpc::Status GrpcAdapter::PutStream(grpc::ServerContext* ctx,
                                    grpc::ServerReader<pb::PutStreamRequest>* reader,
                                    pb::PutResponse*) {
  pb::PutStreamRequest m;
  bool got = reader->Read(&m);
  return Serve(Method::kPut, ctx, m.version(), [&]() -> absl::Status {
    if (!got) return absl::InvalidArgumentError("empty put stream");
    const uint64_t slot_id = m.slot_id();
    KVTIER_ASSIGN_OR_RETURN(auto check, service_->BeginStreamedCommit(slot_id));
    PutArgs args;
    args.durable = m.durable();
    auto key = KeyFromBytes(m.key());
    auto tier = FromProto(m.tier());
    absl::Status st = key.ok() ? tier.status() : key.status();
    if (st.ok()) {
      args.key = *key;
      args.tier = *tier;
    }
    while (st.ok()) {
      if (m.slot_id() != slot_id) {
        st = absl::InvalidArgumentError(absl::StrCat("put stream of slot ", slot_id,
                                                     " names slot ", m.slot_id()));
        break;
      }
      st = check->Advance(m.written_bytes());
      if (!st.ok() || m.commit()) break;
      if (!reader->Read(&m)) {
        st = absl::InvalidArgumentError("put stream ended without its commit message");
        break;
      }
    }
    if (!st.ok()) {
      (void)service_->AbortSlot(slot_id);
      return st;
    }
    KVTIER_RETURN_IF_ERROR(service_->FinishStreamedCommit(args, slot_id, *check));
    metrics_->Add(ServerMetric::kBytesPutShm, m.written_bytes());
    return absl::OkStatus();
  });
}

grpc::Status GrpcAdapter::Get(grpc::ServerContext* ctx, const pb::GetRequest* req,
                              pb::GetResponse* resp) {
  return Serve(Method::kGet, ctx, req->version(), [&]() -> absl::Status {
    KVTIER_ASSIGN_OR_RETURN(Hash128 key, KeyFromBytes(req->key()));
    GetMode mode;
    switch (req->mode()) {
      case pb::GET_MODE_INLINE: mode = GetMode::kCopy; break;
      case pb::GET_MODE_SHM: mode = GetMode::kShm; break;
      case pb::GET_MODE_SLOT: mode = GetMode::kSlot; break;
      default: return absl::InvalidArgumentError(absl::StrCat("unknown get mode ", req->mode()));
    }
    KVTIER_ASSIGN_OR_RETURN(GetResult r,
                            service_->Get(key, mode, req->slot_id(), req->lease_ms(), req->verify()));
    resp->set_tier(ToProto(r.tier));
    resp->set_chunk_bytes(r.chunk_bytes);
    if (mode == GetMode::kCopy) {
      resp->set_inline_chunk(reinterpret_cast<const char*>(r.bytes.data()), r.bytes.size());
      metrics_->Add(ServerMetric::kBytesGetInline, r.bytes.size());
    } else {
      resp->mutable_extent()->set_offset(r.extent.offset);
      resp->mutable_extent()->set_length(r.extent.length);
      resp->set_lease_id(r.lease_id);
      resp->set_scratch_slot_id(r.scratch_slot_id);
      metrics_->Add(ServerMetric::kBytesGetShm, r.chunk_bytes);
    }
    return absl::OkStatus();
  });
}

grpc::Status GrpcAdapter::Prefetch(grpc::ServerContext* ctx, const pb::PrefetchRequest* req,
                                   pb::PrefetchResponse* resp) {
  return Serve(Method::kPrefetch, ctx, req->version(), [&]() -> absl::Status {
    KVTIER_ASSIGN_OR_RETURN(auto keys, KeysFrom(req->keys(), service_->limits().max_keys_per_request));
    KVTIER_ASSIGN_OR_RETURN(bool done, service_->Prefetch(std::move(keys), req->deadline_ms()));
    resp->set_completed(done);
    return absl::OkStatus();
  });
}

grpc::Status GrpcAdapter::Pin(grpc::ServerContext* ctx, const pb::PinRequest* req,
                              pb::PinResponse* resp) {
  return Serve(Method::kPin, ctx, req->version(), [&]() -> absl::Status {
    KVTIER_ASSIGN_OR_RETURN(auto keys, KeysFrom(req->keys(), service_->limits().max_keys_per_request));
    KVTIER_ASSIGN_OR_RETURN(tiering::Lease l, service_->Pin(keys, req->ttl_ms()));
    SetLease(l, resp);
    return absl::OkStatus();
  });
}

grpc::Status GrpcAdapter::Renew(grpc::ServerContext* ctx, const pb::RenewRequest* req,
                                pb::PinResponse* resp) {
  return Serve(Method::kRenew, ctx, req->version(), [&]() -> absl::Status {
    KVTIER_ASSIGN_OR_RETURN(tiering::Lease l, service_->Renew(req->lease_id(), req->ttl_ms()));
    SetLease(l, resp);
    return absl::OkStatus();
  });
}

grpc::Status GrpcAdapter::Release(grpc::ServerContext* ctx, const pb::ReleaseRequest* req,
                                  pb::ReleaseResponse*) {
  return Serve(Method::kRelease, ctx, req->version(),
               [&]() { return service_->Release(req->lease_id()); });
}

grpc::Status GrpcAdapter::Delete(grpc::ServerContext* ctx, const pb::DeleteRequest* req,
                                 pb::DeleteResponse*) {
  return Serve(Method::kDelete, ctx, req->version(), [&]() -> absl::Status {
    KVTIER_ASSIGN_OR_RETURN(Hash128 key, KeyFromBytes(req->key()));
    return service_->Delete(key);
  });
}

grpc::Status GrpcAdapter::Stats(grpc::ServerContext* ctx, const pb::StatsRequest* req,
                                pb::StatsResponse* resp) {
  return Serve(Method::kStats, ctx, req->version(), [&]() -> absl::Status {
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
  });
}

grpc::Status GrpcAdapter::Health(grpc::ServerContext* ctx, const pb::HealthRequest* req,
                                 pb::HealthResponse* resp) {
  // Health answers any version so that a client can learn which one to speak.
  return Serve(Method::kHealth, ctx, kProtocolVersion, [&]() -> absl::Status {
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
  });
}

}  // namespace kvtier::server
