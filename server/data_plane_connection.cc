#include "server/data_plane_connection.h"

#include <poll.h>
#include <sched.h>
#include <sys/socket.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "server/metrics.h"
#include "tiering/placement_engine.h"

namespace kvtier::server {
namespace {

using wire::shm::Op;
using Clock = std::chrono::steady_clock;

// One answer frame; false if it could not be sent (the peer is gone).
// `frame` has kResponseHeaderBytes of room before the `n` payload bytes
// (unused on an error, whose payload is the message).
bool Answer(int fd, uint16_t op, const absl::Status& st, uint8_t* frame, uint32_t n) {
  using wire::shm::kResponseHeaderBytes;
  uint8_t err[kResponseHeaderBytes + wire::shm::kMaxErrorMessageBytes];
  if (!st.ok()) {
    absl::string_view msg = st.message().substr(0, wire::shm::kMaxErrorMessageBytes);
    frame = err;
    n = static_cast<uint32_t>(msg.size());
    std::memcpy(err + kResponseHeaderBytes, msg.data(), msg.size());
  }
  wire::shm::Writer w(frame);
  w.U16(wire::shm::kVersion).U16(op).U32(static_cast<uint32_t>(st.code())).U32(n);
  const size_t total = kResponseHeaderBytes + n;
  // The socket has a send timeout, so a signal interrupts send() even under
  // SA_RESTART (socket(7)); tests saw EINTR on such sockets in this process.
  // Retry, and finish a partial write.
  for (size_t sent = 0; sent < total;) {
    const ssize_t k = ::send(fd, frame + sent, total - sent, MSG_NOSIGNAL);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) return false;
    sent += static_cast<size_t>(k);
  }
  return true;
}

uint8_t TierNumber(tiering::TierKind k) {  // proto Tier numbering
  switch (k) {
    case tiering::TierKind::kHbm: return 1;
    case tiering::TierKind::kDram: return 2;
    case tiering::TierKind::kNvme: return 3;
    case tiering::TierKind::kRemote: return 4;
  }
  return 0;
}

absl::StatusOr<std::optional<tiering::TierKind>> TierOf(uint8_t t) {
  switch (t) {
    case 0: return std::optional<tiering::TierKind>();
    case 1: return std::optional<tiering::TierKind>(tiering::TierKind::kHbm);
    case 2: return std::optional<tiering::TierKind>(tiering::TierKind::kDram);
    case 3: return std::optional<tiering::TierKind>(tiering::TierKind::kNvme);
    case 4: return std::optional<tiering::TierKind>(tiering::TierKind::kRemote);
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown tier ", t));
}

double SecondsSince(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

}  // namespace

bool FrameReader::Fill(size_t n, bool idle_ok, int64_t spin_us) {
  if (end_ - begin_ >= n) return true;
  if (begin_ > 0) {
    std::memmove(buf_, buf_ + begin_, end_ - begin_);
    end_ -= begin_;
    begin_ = 0;
  }
  // A client in the middle of a put or a get sends its next frame within
  // microseconds: polling for it costs less than a sleep and a wakeup,
  // which on a VM is an inter-processor interrupt and a VM exit.
  if (end_ == 0 && idle_ok && spin_us > 0) {
    const auto until = Clock::now() + std::chrono::microseconds(spin_us);
    do {
      ssize_t k = ::recv(fd_, buf_, sizeof(buf_), MSG_DONTWAIT);
      if (k > 0) {
        end_ = static_cast<size_t>(k);
        break;
      }
      if (k == 0) return false;
      if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) return false;
      // The client may be waiting for this core (a host with fewer free
      // cores than polling threads): let it run.
      sched_yield();
    } while (Clock::now() < until);
  }
  while (end_ < n) {
    if (end_ > 0 && !frame_deadline_) {
      frame_deadline_ = Clock::now() + std::chrono::milliseconds(timeout_ms_);
    }
    const int flags = (end_ == 0 && idle_ok) ? 0 : MSG_DONTWAIT;
    ssize_t k = ::recv(fd_, buf_ + end_, sizeof(buf_) - end_, flags);
    if (k > 0) {
      end_ += static_cast<size_t>(k);
      continue;
    }
    if (k == 0) return false;
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) return false;
    if (!frame_deadline_) frame_deadline_ = Clock::now() + std::chrono::milliseconds(timeout_ms_);
    const auto left = std::chrono::ceil<std::chrono::milliseconds>(*frame_deadline_ - Clock::now());
    if (left.count() <= 0) return false;
    pollfd pf{fd_, POLLIN, 0};
    int r = ::poll(&pf, 1, static_cast<int>(left.count()));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
  }
  if (end_ > 0 && !frame_deadline_) {
    frame_deadline_ = Clock::now() + std::chrono::milliseconds(timeout_ms_);
  }
  return true;
}

tiering::HolderId DataPlaneConnection::NextHolderId() {
  // Below 2^63: GrpcHolder's ids have the top bit set.
  static std::atomic<uint64_t> next{1};
  return next.fetch_add(1, std::memory_order_relaxed);
}

DataPlaneConnection::DataPlaneConnection(int fd, KvService* service,
                                         const TenantRegistry* tenants, const Tenant* tenant,
                                         ServerMetrics* metrics, const ShmChannelOptions& options,
                                         int put_check_threads)
    : fd_(fd),
      service_(service),
      tenants_(tenants),
      tenant_(tenant),
      metrics_(metrics),
      options_(options),
      put_check_threads_(put_check_threads),
      holder_id_(NextHolderId()),
      in_(fd, options.frame_timeout_ms),
      payload_(wire::shm::kMaxRequestPayloadBytes),
      answer_(wire::shm::kResponseHeaderBytes + wire::shm::kMaxReplyPayloadBytes) {}

DataPlaneConnection::~DataPlaneConnection() {
  // The client is gone (or broke the protocol): free what it held (the slot
  // of a put still open included).
  for (uint64_t id : slots_) (void)service_->AbortSlot(id, holder_id_);
  for (uint64_t id : leases_) (void)service_->Release(id, holder_id_);
}

absl::Status DataPlaneConnection::CheckFrame(uint16_t version, uint16_t op, uint32_t len) const {
  const wire::shm::RequestShape shape = wire::shm::ShapeOf(op);
  if (version != wire::shm::kVersion) {
    return absl::InvalidArgumentError(absl::StrCat("data-plane protocol version ", version,
                                                   " not served; this daemon speaks ",
                                                   wire::shm::kVersion));
  }
  if (shape.fixed == wire::shm::kUnknownOp.fixed) {
    return absl::InvalidArgumentError(absl::StrCat("unknown data-plane op ", op));
  }
  if (!wire::shm::PayloadLengthFits(op, len)) {
    if (shape.item == 0) {
      return absl::InvalidArgumentError(absl::StrCat("data-plane op ", op, " with ", len,
                                                     " payload bytes; it takes ", shape.fixed));
    }
    return absl::InvalidArgumentError(absl::StrCat(
        "data-plane op ", op, " with ", len, " payload bytes; it takes ", shape.fixed, " + n x ",
        shape.item, " with n <= ", wire::shm::kMaxBatchItems));
  }
  if ((op == static_cast<uint16_t>(Op::kPutProgress) || op == static_cast<uint16_t>(Op::kPutRange) ||
       op == static_cast<uint16_t>(Op::kPutCommit)) &&
      !put_) {
    return absl::FailedPreconditionError(absl::StrCat("data-plane op ", op, " outside a put"));
  }
  if (op == static_cast<uint16_t>(Op::kPutBegin) && put_) {
    return absl::FailedPreconditionError(
        absl::StrCat("put begun inside the put of slot ", put_->slot_id));
  }
  if (op == static_cast<uint16_t>(Op::kHelloTenant) && served_any_) {
    return absl::FailedPreconditionError("the tenant hello must be the connection's first request");
  }
  if (op != static_cast<uint16_t>(Op::kHelloTenant) && tenant_ == nullptr) {
    return absl::UnauthenticatedError(
        "this uid is no tenant's: the first request must be a tenant hello with a tenant's token");
  }
  return absl::OkStatus();
}

void DataPlaneConnection::Run() {
  using wire::shm::kRequestHeaderBytes;
  for (;;) {
    if (!in_.Fill(kRequestHeaderBytes, /*idle_ok=*/true,
                  put_ ? options_.put_spin_us : options_.spin_us)) {
      return;
    }
    wire::shm::Reader h(in_.data());
    const uint16_t version = h.U16(), op = h.U16();
    const uint32_t len = h.U32();
    if (absl::Status violation = CheckFrame(version, op, len); !violation.ok()) {
      if (absl::IsUnauthenticated(violation)) metrics_->Add(ServerMetric::kAuthFailures);
      (void)Answer(fd_, op, violation, nullptr, 0);
      return;
    }
    served_any_ = true;
    in_.Consume(kRequestHeaderBytes);
    if (!in_.Fill(len, /*idle_ok=*/false)) return;  // truncated frame
    std::memcpy(payload_.data(), in_.data(), len);
    in_.Consume(len);
    in_.EndFrame();
    if (!wire::shm::BatchCountMatches(op, payload_.data(), len)) {
      (void)Answer(fd_, op,
                   absl::InvalidArgumentError(absl::StrCat(
                       "data-plane op ", op, ": the item count does not match ", len,
                       " payload bytes")),
                   nullptr, 0);
      return;
    }
    wire::shm::Reader r(payload_.data());
    wire::shm::Writer w(answer_.data() + wire::shm::kResponseHeaderBytes);
    const uint32_t n = wire::shm::ShapeOf(op).item != 0 ? r.U32() : 0;
    absl::Status st;
    const auto t0 = Clock::now();
    switch (static_cast<Op>(op)) {
      case Op::kHello: break;
      case Op::kHelloTenant:
        st = OnHelloTenant(r, n);
        if (!st.ok()) {
          metrics_->Add(ServerMetric::kAuthFailures);
          (void)Answer(fd_, op, st, nullptr, 0);
          return;
        }
        break;
      case Op::kAllocate: st = OnAllocate(r, w, t0); break;
      case Op::kPutBegin: OnPutBegin(r, t0); continue;
      case Op::kPutProgress: OnPutProgress(r); continue;
      case Op::kPutRange: OnPutRange(r); continue;
      case Op::kPutCommit: st = OnPutCommit(r); break;
      case Op::kGet: st = OnGet(r, w, t0); break;
      case Op::kRelease: st = OnRelease(r, t0); break;
      case Op::kAbortSlot: st = OnAbortSlot(r, t0); break;
      case Op::kLookup:
        st = OnLookup(r, n, w);
        metrics_->Record(Method::kLookup, static_cast<int>(st.code()), SecondsSince(t0));
        break;
      case Op::kPlanLoad:
      case Op::kPlanAndHold:
      case Op::kPlanLoadAttention:
      case Op::kPlanAndHoldAttention:
        st = OnPlan(r, n, static_cast<Op>(op), w);
        metrics_->Record(Method::kLookup, static_cast<int>(st.code()), SecondsSince(t0));
        break;
      case Op::kGetBatch:
        st = OnGetBatch(r, n, w);
        metrics_->Record(Method::kGet, static_cast<int>(st.code()), SecondsSince(t0));
        break;
      case Op::kReleaseBatch:
        st = OnReleaseBatch(r, n, w);
        metrics_->Record(Method::kRelease, static_cast<int>(st.code()), SecondsSince(t0));
        break;
      case Op::kPrefetch:
        st = OnPrefetch(r, n, w);
        metrics_->Record(Method::kPrefetch, static_cast<int>(st.code()), SecondsSince(t0));
        break;
      case Op::kAllocateBatch:
        st = OnAllocateBatch(r, n, w);
        metrics_->Record(Method::kAllocateSlot, static_cast<int>(st.code()), SecondsSince(t0));
        break;
      case Op::kCommitBatch:
        st = OnCommitBatch(r, n, w);
        metrics_->Record(Method::kPut, static_cast<int>(st.code()), SecondsSince(t0));
        break;
    }
    if (!Answer(fd_, op, st, answer_.data(), st.ok() ? static_cast<uint32_t>(w.size()) : 0)) {
      return;
    }
  }
}

bool DataPlaneConnection::Room(size_t n) {
  if (slots_.size() + leases_.size() + n <= options_.max_open_per_connection) return true;
  service_->ForgetEnded(slots_, leases_);
  return slots_.size() + leases_.size() + n <= options_.max_open_per_connection;
}

absl::Status DataPlaneConnection::Full() const {
  return absl::ResourceExhaustedError(absl::StrCat(
      "this connection holds ", slots_.size() + leases_.size(), " slots and leases; the limit is ",
      options_.max_open_per_connection));
}

void DataPlaneConnection::FailPut(absl::Status st) {
  put_->error = std::move(st);
  put_->check.reset();
  if (slots_.erase(put_->slot_id) > 0) (void)service_->AbortSlot(put_->slot_id, holder_id_);
}

absl::Status DataPlaneConnection::OnHelloTenant(wire::shm::Reader& r, uint32_t n) {
  if (r.U32() != 0) return absl::InvalidArgumentError("tenant hello with nonzero reserved bytes");
  std::string token(n, '\0');
  r.Raw(token.data(), n);
  if (!tenants_->configured()) {
    tenant_ = tenants_->only();  // one tenant: the token names nothing
    return absl::OkStatus();
  }
  const Tenant* t = tenants_->ByToken(token);
  if (t == nullptr) return absl::UnauthenticatedError("no tenant has this token");
  tenant_ = t;
  return absl::OkStatus();
}

absl::Status DataPlaneConnection::OnAllocate(wire::shm::Reader& r, wire::shm::Writer& w,
                                             Clock::time_point t0) {
  const uint64_t bytes = r.U64();
  const uint32_t ttl_ms = r.U32();
  absl::Status st;
  if (!Room()) {
    st = Full();
  } else {
    auto slot = service_->AllocateSlot(bytes, ttl_ms, Holder());
    st = slot.status();
    if (slot.ok()) {
      slots_.insert(slot->id);
      w.U64(slot->id).U64(slot->extent.offset).U64(slot->extent.length);
      w.U64(static_cast<uint64_t>(slot->expires_at_us));
    }
  }
  metrics_->Record(Method::kAllocateSlot, static_cast<int>(st.code()), SecondsSince(t0));
  return st;
}

void DataPlaneConnection::OnPutBegin(wire::shm::Reader& r, Clock::time_point t0) {
  put_.emplace();
  put_->t0 = t0;
  put_->slot_id = r.U64();
  Hash128 key;
  r.Raw(key.bytes.data(), wire::shm::kKeyBytes);
  put_->args.key = tenant_->WriteKey(key);
  put_->args.tenant = tenant_->id();
  put_->args.holder = holder_id_;
  const uint8_t durable = r.U8(), tier = r.U8();
  const uint16_t zero = r.U16();
  put_->args.durable = durable != 0;
  auto t = TierOf(tier);
  absl::Status bad = t.status();
  if (bad.ok() && (durable > 1 || zero != 0)) {
    bad = absl::InvalidArgumentError("put begin with nonzero reserved bytes");
  }
  if (bad.ok() && !slots_.contains(put_->slot_id)) bad = UnknownSlotError(put_->slot_id);
  if (!bad.ok()) {
    FailPut(std::move(bad));
    return;
  }
  put_->args.tier = *t;
  if (put_check_threads_ >= 2 && !put_hasher_) {
    put_hasher_ = std::make_unique<wire::TrailingHasher>();
  }
  auto check = service_->BeginStreamedCommit(put_->slot_id, holder_id_, put_hasher_.get());
  if (check.ok()) {
    put_->check = std::move(*check);
  } else {
    FailPut(check.status());
  }
}

void DataPlaneConnection::OnPutProgress(wire::shm::Reader& r) {
  const uint64_t n = r.U64();
  if (!put_->error.ok()) return;
  if (absl::Status a = put_->check->Advance(n); !a.ok()) FailPut(std::move(a));
}

void DataPlaneConnection::OnPutRange(wire::shm::Reader& r) {
  const uint64_t offset = r.U64(), length = r.U64();
  if (!put_->error.ok()) return;
  if (absl::Status a = put_->check->AdvanceRange(offset, length); !a.ok()) FailPut(std::move(a));
}

absl::Status DataPlaneConnection::OnPutCommit(wire::shm::Reader& r) {
  const uint64_t n = r.U64();
  if (put_->error.ok()) {
    if (absl::Status a = put_->check->Advance(n); !a.ok()) FailPut(std::move(a));
  }
  absl::Status st = put_->error;
  if (st.ok()) {
    st = service_->FinishStreamedCommit(put_->args, put_->slot_id, *put_->check);
    tenant_->CountPut(st);
    slots_.erase(put_->slot_id);
    if (st.ok()) metrics_->Add(ServerMetric::kBytesPutShm, n);
  }
  metrics_->Record(Method::kPut, static_cast<int>(st.code()), SecondsSince(put_->t0));
  put_.reset();
  return st;
}

absl::Status DataPlaneConnection::OnGet(wire::shm::Reader& r, wire::shm::Writer& w,
                                        Clock::time_point t0) {
  Hash128 key;
  r.Raw(key.bytes.data(), wire::shm::kKeyBytes);
  const uint32_t lease_ms = r.U32();
  const uint8_t verify = r.U8(), z0 = r.U8(), z1 = r.U8(), z2 = r.U8();
  absl::Status st;
  if (verify > 1 || (z0 | z1 | z2) != 0) {
    st = absl::InvalidArgumentError("get with nonzero reserved bytes");
  } else if (!Room()) {
    st = Full();
  } else {
    auto g = service_->Get(tenant_->ReadKey(key, service_->engine()), GetMode::kShm, Holder(), 0,
                           lease_ms, verify != 0);
    st = g.status();
    tenant_->CountRead(st);
    if (g.ok()) {
      if (g->lease_id != 0) leases_.insert(g->lease_id);
      if (g->scratch_slot_id != 0) slots_.insert(g->scratch_slot_id);
      w.U8(TierNumber(g->tier)).U8(g->checked ? wire::shm::kHoldChecked : 0).U16(0).U32(0);
      w.U64(g->chunk_bytes);
      w.U64(g->extent.offset).U64(g->extent.length).U64(g->lease_id).U64(g->scratch_slot_id);
      metrics_->Add(ServerMetric::kBytesGetShm, g->chunk_bytes);
    }
  }
  metrics_->Record(Method::kGet, static_cast<int>(st.code()), SecondsSince(t0));
  return st;
}

absl::Status DataPlaneConnection::OnRelease(wire::shm::Reader& r, Clock::time_point t0) {
  const uint64_t id = r.U64();
  absl::Status st = leases_.erase(id) > 0 ? service_->Release(id, holder_id_) : UnknownLeaseError(id);
  metrics_->Record(Method::kRelease, static_cast<int>(st.code()), SecondsSince(t0));
  return st;
}

absl::Status DataPlaneConnection::OnAbortSlot(wire::shm::Reader& r, Clock::time_point t0) {
  const uint64_t id = r.U64();
  absl::Status st = slots_.erase(id) > 0 ? service_->AbortSlot(id, holder_id_) : UnknownSlotError(id);
  metrics_->Record(Method::kAbortSlot, static_cast<int>(st.code()), SecondsSince(t0));
  return st;
}

std::vector<Hash128> DataPlaneConnection::ReadKeys(wire::shm::Reader& r, uint32_t n) {
  std::vector<Hash128> keys(n);
  for (Hash128& k : keys) r.Raw(k.bytes.data(), wire::shm::kKeyBytes);
  tenant_->MapReadKeys(keys, service_->engine());
  return keys;
}

absl::Status DataPlaneConnection::OnLookup(wire::shm::Reader& r, uint32_t n,
                                           wire::shm::Writer& w) {
  if (r.U32() != 0) return absl::InvalidArgumentError("lookup with nonzero reserved bytes");
  const std::vector<Hash128> keys = ReadKeys(r, n);
  KVTIER_ASSIGN_OR_RETURN(std::vector<tiering::TierKind> tiers, service_->Lookup(keys));
  w.U32(static_cast<uint32_t>(tiers.size())).U32(0);
  for (tiering::TierKind t : tiers) w.U8(TierNumber(t));
  return absl::OkStatus();
}

absl::Status DataPlaneConnection::OnPlan(wire::shm::Reader& r, uint32_t n, Op op,
                                         wire::shm::Writer& w) {
  const bool hold = op == Op::kPlanAndHold || op == Op::kPlanAndHoldAttention;
  const uint32_t tokens_per_chunk = r.U32();
  bandwidth::PrefillCost prefill{.tokens_per_s = r.F64()};
  const uint32_t lease_ms = r.U32(), zero = r.U32();
  if (op == Op::kPlanLoadAttention || op == Op::kPlanAndHoldAttention) {
    prefill.attention_doubling_tokens = r.F64();
  }
  if (zero != 0 || (!hold && lease_ms != 0)) {
    return absl::InvalidArgumentError("plan with nonzero reserved bytes");
  }
  const std::vector<Hash128> keys = ReadKeys(r, n);
  KvService::HeldPlan h;
  if (hold) {
    if (!Room()) return Full();
    KVTIER_ASSIGN_OR_RETURN(
        h, service_->PlanAndHold(keys, prefill, tokens_per_chunk, lease_ms, Holder()));
    if (h.lease.id != 0) leases_.insert(h.lease.id);
  } else {
    KVTIER_ASSIGN_OR_RETURN(h.plan, service_->PlanLoad(keys, prefill, tokens_per_chunk));
  }
  const tiering::PrefixLoadEstimate& e = h.plan.estimate;
  // With a hold, the chunks to load are the ones held (every hit without a
  // rate, whose time saved is then unknown: 0).
  const uint32_t load = hold ? h.held_chunks : static_cast<uint32_t>(h.plan.decision.chunks);
  double load_us = 0;
  for (uint32_t i = 0; i < load && i < e.load_us.size(); ++i) load_us += e.load_us[i];
  w.U32(static_cast<uint32_t>(e.tiers.size())).U32(load);
  w.F64(load_us).F64(h.plan.decision.chunks > 0 ? h.plan.decision.saved_us() : 0.0);
  w.U64(h.lease.id).U64(static_cast<uint64_t>(h.lease.expires_at_us));
  for (size_t i = 0; i < e.tiers.size(); ++i) {
    w.U8(TierNumber(e.tiers[i])).U8(0).U16(0).U32(0).U64(e.bytes[i]).F64(e.load_us[i]);
  }
  return absl::OkStatus();
}

absl::Status DataPlaneConnection::OnGetBatch(wire::shm::Reader& r, uint32_t n,
                                             wire::shm::Writer& w) {
  const uint32_t lease_ms = r.U32();
  const uint8_t verify = r.U8();
  uint8_t zero = 0;
  for (int i = 0; i < 7; ++i) zero |= r.U8();
  if (verify > 1 || zero != 0) return absl::InvalidArgumentError("get batch with nonzero reserved bytes");
  const std::vector<Hash128> keys = ReadKeys(r, n);
  if (!Room(n)) return Full();
  KVTIER_ASSIGN_OR_RETURN(auto results, service_->GetBatchShared(keys, lease_ms, verify != 0, Holder()));
  w.U32(n).U32(0);
  uint64_t bytes = 0;
  for (const absl::StatusOr<GetResult>& g : results) {
    tenant_->CountRead(g.status());
    if (!g.ok()) {
      w.U32(static_cast<uint32_t>(g.status().code())).U32(0).U64(0).U64(0).U64(0).U64(0).U64(0);
      continue;
    }
    if (g->lease_id != 0) leases_.insert(g->lease_id);
    if (g->scratch_slot_id != 0) slots_.insert(g->scratch_slot_id);
    w.U32(0).U8(TierNumber(g->tier)).U8(g->checked ? wire::shm::kHoldChecked : 0).U16(0);
    w.U64(g->chunk_bytes);
    w.U64(g->extent.offset).U64(g->extent.length).U64(g->lease_id).U64(g->scratch_slot_id);
    bytes += g->chunk_bytes;
  }
  metrics_->Add(ServerMetric::kBytesGetShm, bytes);
  return absl::OkStatus();
}

absl::Status DataPlaneConnection::OnReleaseBatch(wire::shm::Reader& r, uint32_t n,
                                                 wire::shm::Writer& w) {
  if (r.U32() != 0) return absl::InvalidArgumentError("release batch with nonzero reserved bytes");
  w.U32(n).U32(0);
  for (uint32_t i = 0; i < n; ++i) {
    const uint64_t lease = r.U64(), slot = r.U64();
    absl::Status st;
    if ((lease == 0) == (slot == 0)) {
      st = absl::InvalidArgumentError("a release item names one lease or one scratch slot");
    } else if (lease != 0) {
      st = leases_.erase(lease) > 0 ? service_->Release(lease, holder_id_) : UnknownLeaseError(lease);
    } else {
      st = slots_.erase(slot) > 0 ? service_->AbortSlot(slot, holder_id_) : UnknownSlotError(slot);
    }
    w.U32(static_cast<uint32_t>(st.code()));
  }
  return absl::OkStatus();
}

absl::Status DataPlaneConnection::OnPrefetch(wire::shm::Reader& r, uint32_t n,
                                             wire::shm::Writer& w) {
  const uint32_t deadline_ms = r.U32();
  const uint64_t budget = r.U64();
  const std::vector<Hash128> keys = ReadKeys(r, n);
  KVTIER_ASSIGN_OR_RETURN(KvService::PrefetchReport rep,
                          service_->PrefetchWithin(keys, budget, deadline_ms));
  w.U8(rep.completed ? 1 : 0).U8(0).U16(0).U32(rep.keys).U64(rep.bytes);
  return absl::OkStatus();
}

absl::Status DataPlaneConnection::OnAllocateBatch(wire::shm::Reader& r, uint32_t n,
                                                  wire::shm::Writer& w) {
  const uint32_t ttl_ms = r.U32();
  if (!Room(n)) return Full();
  std::vector<tiering::Slot> got;
  absl::Status st;
  for (uint32_t i = 0; i < n && st.ok(); ++i) {
    auto slot = service_->AllocateSlot(r.U64(), ttl_ms, Holder());
    st = slot.status();
    if (slot.ok()) got.push_back(*slot);
  }
  if (!st.ok()) {  // all or nothing
    for (const tiering::Slot& s : got) (void)service_->AbortSlot(s.id, holder_id_);
    return st;
  }
  w.U32(n).U32(0);
  for (const tiering::Slot& s : got) {
    slots_.insert(s.id);
    w.U64(s.id).U64(s.extent.offset).U64(s.extent.length).U64(static_cast<uint64_t>(s.expires_at_us));
  }
  return absl::OkStatus();
}

absl::Status DataPlaneConnection::OnCommitBatch(wire::shm::Reader& r, uint32_t n,
                                                wire::shm::Writer& w) {
  const uint8_t durable = r.U8(), flags = r.U8(), landing = r.U8(), z2 = r.U8();
  const bool landed = (flags & wire::shm::kCommitLanding) != 0;
  if (durable > 1 ||
      (flags & ~(wire::shm::kCommitSeal | wire::shm::kCommitLanding)) != 0 || z2 != 0 ||
      (landing != 0) != landed) {
    return absl::InvalidArgumentError("commit batch with nonzero reserved bytes");
  }
  if (landed && ((flags & wire::shm::kCommitSeal) == 0 || n != 1)) {
    return absl::InvalidArgumentError("a landing commit seals exactly one slot");
  }
  std::vector<std::pair<uint64_t, Hash128>> items(n);
  absl::flat_hash_set<Hash128> keys;
  absl::flat_hash_set<uint64_t> ids;
  for (auto& [id, key] : items) {
    id = r.U64();
    r.Raw(key.bytes.data(), wire::shm::kKeyBytes);
    if (!keys.insert(key).second) {
      return absl::InvalidArgumentError(absl::StrCat("key ", key.ToHex(), " twice in one batch"));
    }
    if (!ids.insert(id).second) {
      return absl::InvalidArgumentError(absl::StrCat("slot ", id, " twice in one batch"));
    }
  }
  w.U32(n).U32(0);
  for (const auto& [id, key] : items) {
    absl::Status st;
    if (slots_.erase(id) == 0) {
      st = UnknownSlotError(id);
    } else {
      PutArgs args;
      args.key = tenant_->WriteKey(key);
      args.tenant = tenant_->id();
      args.holder = holder_id_;
      args.durable = durable != 0;
      args.seal = (flags & wire::shm::kCommitSeal) != 0;
      args.landing_layers = landing;
      // Verified (header, lengths, checksums), or sealed, before it is stored.
      st = service_->CommitSlot(args, id);
      // A landing commit that failed before the seal left the slot to the
      // client (its device may still write it).
      if (!st.ok() && landed && service_->HoldsSlot(id, holder_id_)) slots_.insert(id);
      tenant_->CountPut(st);
    }
    w.U32(static_cast<uint32_t>(st.code()));
  }
  return absl::OkStatus();
}

}  // namespace kvtier::server
