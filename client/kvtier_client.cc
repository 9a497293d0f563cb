#include "client/kvtier_client.h"

#include <poll.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <deque>
#include <optional>
#include <thread>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "client/kvtier_client_internal.h"
#include "codec/prefix_key.h"
#include "common/file.h"
#include "common/status.h"
#include "wire/chunk_check.h"
#include "wire/shm_frames.h"

namespace kvtier::client {

namespace pb = kvtier::proto::v1;
constexpr uint32_t kProtocolVersion = 1;

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

absl::Status FromGrpcStatus(const grpc::Status& s) {
  if (s.ok()) return absl::OkStatus();
  // grpc::StatusCode and absl::StatusCode share their numbering.
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
}

absl::StatusOr<ShmHandshake> ConnectShm(const std::string& path) {
  KVTIER_ASSIGN_OR_RETURN(sockaddr_un addr, UnixSocketAddress(path));
  int s = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (s < 0) return absl::InternalError("socket");
  timeval tv{5, 0};
  ::setsockopt(s, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  ::setsockopt(s, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  if (::connect(s, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    int e = errno;
    ::close(s);
    return absl::FailedPreconditionError(absl::StrCat("connect ", path, ": ", std::strerror(e)));
  }
  wire::shm::PoolMessage m;
  ssize_t n;
  do {
    n = ::recvmsg(s, &m.msg, MSG_CMSG_CLOEXEC);
  } while (n < 0 && errno == EINTR);
  const int e = errno;
  cmsghdr* cm = CMSG_FIRSTHDR(&m.msg);
  if (n != static_cast<ssize_t>(sizeof(m.size)) || cm == nullptr || cm->cmsg_type != SCM_RIGHTS ||
      cm->cmsg_len != CMSG_LEN(sizeof(int))) {
    ::close(s);
    return absl::FailedPreconditionError(
        absl::StrCat("no pool descriptor from ", path, " (received ", n, " bytes",
                     n < 0 ? absl::StrCat(": ", std::strerror(e)) : std::string(),
                     cm == nullptr ? ", no descriptor" : "", ")"));
  }
  ShmHandshake h;
  h.sock = s;
  h.size = m.size;
  std::memcpy(&h.memfd, CMSG_DATA(cm), sizeof(int));
  return h;
}

namespace {

Tier FromProto(int t) {
  switch (t) {
    case pb::TIER_HBM: return Tier::kHbm;
    case pb::TIER_DRAM: return Tier::kDram;
    case pb::TIER_NVME: return Tier::kNvme;
    case pb::TIER_REMOTE: return Tier::kRemote;
  }
  return Tier::kUnknown;
}

std::string KeyBytes(const Hash128& k) {
  return std::string(reinterpret_cast<const char*>(k.bytes.data()), k.bytes.size());
}


// A mapping of one daemon's pool. Its id is wire::shm::PoolIdOf the memfd
// it maps: extents that name another pool are never read through it.
class PoolMapping {
 public:
  // Maps the pool received in `h` (closes its memfd).
  static absl::StatusOr<std::shared_ptr<const PoolMapping>> Map(const ShmHandshake& h,
                                                                bool populate) {
    const uint64_t id = wire::shm::PoolIdOf(h.memfd);
    void* p = ::mmap(nullptr, h.size, PROT_READ | PROT_WRITE,
                     MAP_SHARED | (populate ? MAP_POPULATE : 0), h.memfd, 0);
    ::close(h.memfd);
    if (p == MAP_FAILED) {
      return absl::FailedPreconditionError(absl::StrCat("mmap of the pool: ", std::strerror(errno)));
    }
    return std::shared_ptr<const PoolMapping>(new PoolMapping(static_cast<uint8_t*>(p), h.size, id));
  }
  ~PoolMapping() { ::munmap(base_, size_); }

  uint64_t id() const { return id_; }
  std::span<uint8_t> all() const { return std::span<uint8_t>(base_, size_); }

  // The mapped range of an extent the daemon named; never trusted blindly.
  absl::StatusOr<std::span<uint8_t>> Range(uint64_t offset, uint64_t length) const {
    if (offset > size_ || length > size_ - offset) {
      return absl::InternalError("daemon named an extent outside the pool");
    }
    return std::span<uint8_t>(base_ + offset, length);
  }

 private:
  PoolMapping(uint8_t* base, uint64_t size, uint64_t id) : base_(base), size_(size), id_(id) {}
  uint8_t* const base_;
  const uint64_t size_;
  const uint64_t id_;
};

// One data-plane connection (wire/shm_frames.h; the protocol is specified in
// wire/DATA_PLANE.md): frames out, answers in.
// Not thread-safe; the client hands each to one call at a time. Once a
// transport error or a malformed answer marks it broken it is closed.
class DataConn {
 public:
  using Op = wire::shm::Op;

  // A slot allocated ahead of the next put (see PutOverDataPlane).
  struct Spare {
    uint64_t id = 0, offset = 0, length = 0;
    std::chrono::steady_clock::time_point use_by;
  };
  // The daemon keeps a spare this long; the client uses it for half of it.
  static constexpr uint32_t kSpareTtlMs = 2000;

  // Says hello on `sock` (owned from here on): with a `token`, the
  // tenant hello that names the client's tenant (kHelloTenant). Null if the
  // daemon does not serve the data plane on it (an older daemon, no room, a
  // token it refuses or one too long for the frame).
  // `owed_releases` (not owned) counts the releases sent on any connection
  // whose answers are not read yet. `serial` (nonzero) names the connection
  // within its client (HeldChunk::connection).
  // `pool` is the mapping of the memfd that came on `sock`: every extent an
  // answer on this connection names is in it.
  static std::unique_ptr<DataConn> Open(int sock, std::shared_ptr<const PoolMapping> pool,
                                        int64_t timeout_ms, std::atomic<int>* owed_releases,
                                        uint64_t serial, const std::string& token) {
    auto c = std::unique_ptr<DataConn>(new DataConn(sock, std::move(pool), owed_releases, serial));
    timeval tv{static_cast<time_t>(timeout_ms / 1000), static_cast<suseconds_t>(timeout_ms % 1000 * 1000)};
    ::setsockopt(sock, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    ::setsockopt(sock, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
    if (token.empty()) {
      if (!c->Call(Op::kHello, nullptr, 0, nullptr, 0).ok()) return nullptr;
      return c;
    }
    if (token.size() > wire::shm::kMaxBatchItems) return nullptr;
    std::vector<uint8_t> hello(wire::shm::kBatchHeaderBytes + token.size());
    wire::shm::Writer w(hello.data());
    w.U32(static_cast<uint32_t>(token.size())).U32(0).Raw(token.data(), token.size());
    if (!c->Call(Op::kHelloTenant, hello.data(), static_cast<uint32_t>(hello.size()), nullptr, 0).ok()) {
      return nullptr;
    }
    return c;
  }
  ~DataConn() {
    ::close(fd_);  // the daemon releases what the owed releases named
    DropOwed();
  }

  bool broken() const { return broken_; }
  uint64_t serial() const { return serial_; }
  const PoolMapping& pool() const { return *pool_; }

  // False once the daemon has closed its end (it exited or restarted): such
  // a connection is dropped before it is lent, so that the call it would
  // have served opens a fresh one (and maps the new daemon's pool).
  bool PeerOpen() const {
    if (broken_) return false;
    pollfd p{fd_, POLLRDHUP, 0};
    return ::poll(&p, 1, 0) == 0 || (p.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)) == 0;
  }

  // Sends one request. Unavailable if the connection failed.
  absl::Status Send(Op op, const uint8_t* payload, uint32_t n) {
    if (broken_) return absl::UnavailableError("data-plane connection closed");
    uint8_t buf[wire::shm::kRequestHeaderBytes + wire::shm::kMaxRequestPayloadBytes];
    wire::shm::Writer w(buf);
    w.U16(wire::shm::kVersion).U16(static_cast<uint16_t>(op)).U32(n);
    if (n > 0) w.Raw(payload, n);
    for (size_t sent = 0; sent < w.size();) {
      ssize_t k = ::send(fd_, buf + sent, w.size() - sent, MSG_NOSIGNAL);
      if (k < 0 && errno == EINTR) continue;
      if (k <= 0) return Broken(absl::StrCat("send: ", std::strerror(errno)));
      sent += static_cast<size_t>(k);
    }
    return absl::OkStatus();
  }

  // Reads the header of the answer to `op` and returns its payload length:
  // the daemon's error (read whole) as a status, or a malformed header as a
  // broken connection. The payload itself is left for the caller to read.
  absl::StatusOr<uint32_t> ReceiveHeader(Op op) {
    using wire::shm::kResponseHeaderBytes;
    uint8_t hdr[kResponseHeaderBytes];
    KVTIER_RETURN_IF_ERROR(ReadFull(hdr, sizeof(hdr), kAnswerSpinUs));
    wire::shm::Reader r(hdr);
    const uint16_t version = r.U16(), got_op = r.U16();
    const uint32_t code = r.U32(), len = r.U32();
    if (version != wire::shm::kVersion) {
      return Broken(absl::StrCat("answer of data-plane protocol version ", version));
    }
    if (code != 0) {
      if (len > wire::shm::kMaxErrorMessageBytes) return Broken("oversized error answer");
      std::string msg(len, '\0');
      KVTIER_RETURN_IF_ERROR(ReadFull(reinterpret_cast<uint8_t*>(msg.data()), len));
      // An answer to another op is the daemon refusing a frame; it closes.
      if (got_op != static_cast<uint16_t>(op)) broken_ = true;
      const auto c = code <= 16 ? static_cast<absl::StatusCode>(code) : absl::StatusCode::kUnknown;
      return absl::Status(c, msg);
    }
    if (got_op != static_cast<uint16_t>(op)) {
      return Broken(absl::StrCat("answer to data-plane op ", got_op, "; expected op ",
                                 static_cast<int>(op)));
    }
    return len;
  }

  // Reads the answer to `op`: the daemon's error, or its payload, which must
  // be exactly `n` bytes, into `out`.
  absl::Status Receive(Op op, uint8_t* out, uint32_t n) {
    KVTIER_ASSIGN_OR_RETURN(const uint32_t len, ReceiveHeader(op));
    if (len != n) {
      return Broken(absl::StrCat("answer to data-plane op ", static_cast<int>(op), " with ", len,
                                 " bytes; expected ", n));
    }
    return ReadFull(out, n);
  }

  absl::Status Call(Op op, const uint8_t* payload, uint32_t n, uint8_t* out, uint32_t out_n) {
    KVTIER_RETURN_IF_ERROR(Settle());
    KVTIER_RETURN_IF_ERROR(Send(op, payload, n));
    return Receive(op, out, out_n);
  }

  // Call of a batch op, whose answer has a variable length (at most
  // kMaxReplyPayloadBytes; the caller checks it against what it asked).
  absl::Status CallBatch(Op op, const uint8_t* payload, uint32_t n, std::vector<uint8_t>* out) {
    KVTIER_RETURN_IF_ERROR(Settle());
    KVTIER_RETURN_IF_ERROR(Send(op, payload, n));
    KVTIER_ASSIGN_OR_RETURN(const uint32_t len, ReceiveHeader(op));
    if (len > wire::shm::kMaxReplyPayloadBytes) {
      return Broken(absl::StrCat("answer to data-plane op ", static_cast<int>(op), " with ", len,
                                 " bytes, over the limit"));
    }
    out->resize(len);
    return ReadFull(out->data(), len);
  }

  // A malformed answer: the connection is closed (what it held is freed).
  absl::Status BadAnswer(Op op) {
    return Broken(absl::StrCat("malformed answer to data-plane op ", static_cast<int>(op)));
  }

  // Sends a request whose answer is read later, by Settle (every Call
  // settles first): the release after a get, a spare slot's allocation or
  // abort. REQUIRES: op is kRelease, kAllocate or kAbortSlot.
  absl::Status SendOwed(Op op, const uint8_t* payload, uint32_t n) {
    KVTIER_RETURN_IF_ERROR(Send(op, payload, n));
    owed_.push_back(op);
    if (op == Op::kRelease) owed_releases_->fetch_add(1);
    return absl::OkStatus();
  }

  // Reads every owed answer: an allocation becomes the spare; errors of a
  // release or an abort (an expired lease or slot) change nothing. Fails
  // only if the connection broke.
  absl::Status Settle() {
    while (!owed_.empty()) {
      const Op op = owed_.front();
      uint8_t rep[wire::shm::kSlotReplyBytes];
      const uint32_t n = op == Op::kAllocate ? sizeof(rep) : 0;
      absl::Status st = Receive(op, rep, n);
      if (broken_) {
        DropOwed();
        return st;
      }
      // Counted down only now: the answer says the daemon has done it.
      owed_.pop_front();
      if (op == Op::kRelease) owed_releases_->fetch_sub(1);
      if (op == Op::kAllocate && st.ok()) {
        wire::shm::Reader r(rep);
        spare_ = Spare{r.U64(), r.U64(), r.U64(),
                       std::chrono::steady_clock::now() + std::chrono::milliseconds(kSpareTtlMs / 2)};
      }
    }
    return absl::OkStatus();
  }

  // The spare slot, if any (it is the caller's from here on).
  std::optional<Spare> TakeSpare() { return std::exchange(spare_, std::nullopt); }

 private:
  DataConn(int fd, std::shared_ptr<const PoolMapping> pool, std::atomic<int>* owed_releases,
           uint64_t serial)
      : fd_(fd), pool_(std::move(pool)), owed_releases_(owed_releases), serial_(serial) {}

  void DropOwed() {
    for (Op op : owed_) {
      if (op == Op::kRelease) owed_releases_->fetch_sub(1);
    }
    owed_.clear();
  }

  // Answers come within tens of microseconds (a commit: the daemon's check
  // of the last piece): polling for them costs less than sleeping and being
  // woken, which on a VM is an inter-processor interrupt and a VM exit.
  static constexpr int64_t kAnswerSpinUs = 100;

  absl::Status ReadFull(uint8_t* p, size_t n, int64_t spin_us = 0) {
    size_t got = 0;
    if (spin_us > 0) {
      const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(spin_us);
      do {
        ssize_t k = ::recv(fd_, p, n, MSG_DONTWAIT);
        if (k > 0) {
          got = static_cast<size_t>(k);
          break;
        }
        if (k == 0) return Broken("the daemon closed the data-plane connection");
        if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
          return Broken(absl::StrCat("recv: ", std::strerror(errno)));
        }
        // The daemon's thread may be waiting for this core: let it run.
        sched_yield();
      } while (std::chrono::steady_clock::now() < until);
    }
    while (got < n) {
      ssize_t k = ::recv(fd_, p + got, n - got, 0);
      if (k < 0 && errno == EINTR) continue;
      if (k == 0) return Broken("the daemon closed the data-plane connection");
      if (k < 0) return Broken(absl::StrCat("recv: ", std::strerror(errno)));
      got += static_cast<size_t>(k);
    }
    return absl::OkStatus();
  }
  absl::Status Broken(std::string what) {
    broken_ = true;
    return absl::UnavailableError(std::move(what));
  }

  const int fd_;
  const std::shared_ptr<const PoolMapping> pool_;
  std::atomic<int>* const owed_releases_;
  const uint64_t serial_;
  bool broken_ = false;
  std::deque<Op> owed_;  // answers to read, in order
  std::optional<Spare> spare_;
};

class ClientImpl final : public KvtierClient {
 public:
  ClientImpl(std::shared_ptr<grpc::Channel> channel, std::unique_ptr<pb::Kvtier::StubInterface> owned,
             pb::Kvtier::StubInterface* stub, const ClientOptions& options)
      : channel_(std::move(channel)), owned_(std::move(owned)), stub_(stub), options_(options) {}
  ~ClientImpl() override { WaitForReleases(); }

  absl::Status Init() {
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
    if (options_.shared_memory && options_.tcp_addr.empty() && !resp.shm_socket().empty()) {
      shm_socket_ = resp.shm_socket();
      KVTIER_ASSIGN_OR_RETURN(ShmHandshake h, ConnectShm(shm_socket_));
      auto pool = PoolMapping::Map(h, options_.populate_mapping);
      if (!pool.ok()) {
        ::close(h.sock);
        return pool.status();
      }
      {
        absl::MutexLock l(&pool_mu_);
        pool_ = *pool;
      }
      shm_ = true;
      // The same connection carries the data plane, if the daemon serves it.
      std::unique_ptr<DataConn> c;
      if (options_.max_data_connections > 0) {
        c = DataConn::Open(h.sock, *pool, options_.timeout_ms, owed_releases_.get(),
                           next_conn_serial_++, options_.token);
      } else {
        ::close(h.sock);
      }
      if (c != nullptr) {
        absl::MutexLock l(&conns_mu_);
        data_plane_ = true;
        open_conns_ = 1;
        live_conns_.insert(c->serial());
        idle_conns_.push_back(std::move(c));
      }
      if (options_.check_on_helper_thread) {
        verifier_ = std::make_unique<wire::PipelinedCopyVerifier>();
      }
    }
    return absl::OkStatus();
  }

  std::string Target() const {
    return options_.tcp_addr.empty() ? "unix:" + options_.socket_path : options_.tcp_addr;
  }

  bool uses_shared_memory() const override { return shm_; }
  bool checks_on_helper_thread() const override { return verifier_ != nullptr; }

  absl::StatusOr<std::vector<Tier>> Lookup(std::span<const Hash128> keys) override {
    if (shm_ && keys.size() <= kMaxBatchKeys) {
      if (ConnLease c = AcquireConn()) return LookupOver(*c, keys);
    }
    pb::LookupRequest req;
    req.set_version(kProtocolVersion);
    for (const Hash128& k : keys) req.add_keys(KeyBytes(k));
    pb::LookupResponse resp;
    KVTIER_RETURN_IF_ERROR(Call(&pb::Kvtier::StubInterface::Lookup, req, &resp));
    std::vector<Tier> out;
    for (int t : resp.tiers()) out.push_back(FromProto(t));
    return out;
  }

  absl::StatusOr<LoadPlan> PlanLoad(std::span<const Hash128> keys, double prefill_tokens_per_s,
                                    uint32_t tokens_per_chunk) override {
    if (shm_ && keys.size() <= kMaxBatchKeys) {
      if (ConnLease c = AcquireConn()) {
        KVTIER_ASSIGN_OR_RETURN(HeldPlan h,
                                PlanOver(*c, keys, prefill_tokens_per_s, tokens_per_chunk, 0, false));
        return std::move(h.plan);
      }
    }
    pb::LookupRequest req;
    req.set_version(kProtocolVersion);
    for (const Hash128& k : keys) req.add_keys(KeyBytes(k));
    req.set_estimate_load(true);
    req.set_prefill_tokens_per_s(prefill_tokens_per_s);
    req.set_tokens_per_chunk(tokens_per_chunk);
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
    for (int t : resp.tiers()) plan.tiers.push_back(FromProto(t));
    plan.chunk_bytes.assign(resp.chunk_bytes().begin(), resp.chunk_bytes().end());
    plan.load_us.assign(resp.load_us().begin(), resp.load_us().end());
    plan.load_chunks = resp.load_chunks();
    plan.load_chunks_us = resp.load_chunks_us();
    plan.saved_us = resp.saved_us();
    return plan;
  }

  // The keys after a batch header (kLookup, kPlanLoad, kGetBatch, kPrefetch).
  static void WriteKeys(wire::shm::Writer& w, std::span<const Hash128> keys) {
    for (const Hash128& k : keys) w.Raw(k.bytes.data(), wire::shm::kKeyBytes);
  }

  absl::StatusOr<std::vector<Tier>> LookupOver(DataConn& c, std::span<const Hash128> keys) {
    namespace w = wire::shm;
    std::vector<uint8_t> req(w::kBatchHeaderBytes + keys.size() * w::kKeyBytes), rep;
    w::Writer b(req.data());
    b.U32(static_cast<uint32_t>(keys.size())).U32(0);
    WriteKeys(b, keys);
    KVTIER_RETURN_IF_ERROR(c.CallBatch(DataConn::Op::kLookup, req.data(), b.size(), &rep));
    if (rep.size() < w::kBatchHeaderBytes) return c.BadAnswer(DataConn::Op::kLookup);
    w::Reader r(rep.data());
    const uint32_t hits = r.U32();
    if (hits > keys.size() || rep.size() != w::kBatchHeaderBytes + hits) {
      return c.BadAnswer(DataConn::Op::kLookup);
    }
    (void)r.U32();
    std::vector<Tier> out(hits);
    for (Tier& t : out) t = FromProto(r.U8());
    return out;
  }

  absl::StatusOr<HeldPlan> PlanOver(DataConn& c, std::span<const Hash128> keys, double rate,
                                    uint32_t tokens_per_chunk, uint32_t lease_ms, bool hold) {
    namespace w = wire::shm;
    const DataConn::Op op = hold ? DataConn::Op::kPlanAndHold : DataConn::Op::kPlanLoad;
    std::vector<uint8_t> req(w::kPlanBytes + keys.size() * w::kKeyBytes), rep;
    w::Writer b(req.data());
    b.U32(static_cast<uint32_t>(keys.size())).U32(tokens_per_chunk).F64(rate);
    b.U32(hold ? lease_ms : 0).U32(0);
    WriteKeys(b, keys);
    KVTIER_RETURN_IF_ERROR(c.CallBatch(op, req.data(), b.size(), &rep));
    if (rep.size() < w::kPlanReplyBytes) return c.BadAnswer(op);
    w::Reader r(rep.data());
    const uint32_t hits = r.U32(), load = r.U32();
    if (hits > keys.size() || load > hits ||
        rep.size() != w::kPlanReplyBytes + uint64_t{hits} * w::kPlanHitBytes) {
      return c.BadAnswer(op);
    }
    HeldPlan h;
    h.plan.load_chunks = load;
    h.plan.load_chunks_us = r.F64();
    h.plan.saved_us = r.F64();
    h.lease_id = r.U64();
    h.expires_at_us = static_cast<int64_t>(r.U64());
    h.connection = h.lease_id != 0 ? c.serial() : 0;
    for (uint32_t i = 0; i < hits; ++i) {
      h.plan.tiers.push_back(FromProto(r.U8()));
      (void)r.U8();
      (void)r.U16();
      (void)r.U32();
      h.plan.chunk_bytes.push_back(r.U64());
      h.plan.load_us.push_back(r.F64());
    }
    return h;
  }

  absl::StatusOr<HeldPlan> LookupAndHold(std::span<const Hash128> keys, double rate,
                                         uint32_t tokens_per_chunk, uint32_t lease_ms) override {
    if (shm_ && keys.size() <= kMaxBatchKeys) {
      if (ConnLease c = AcquireConn()) {
        return PlanOver(*c, keys, rate, tokens_per_chunk, lease_ms, true);
      }
    }
    HeldPlan h;
    KVTIER_ASSIGN_OR_RETURN(h.plan, PlanLoad(keys, rate, tokens_per_chunk));
    if (rate <= 0) h.plan.load_chunks = h.plan.tiers.size();
    if (h.plan.load_chunks == 0) return h;
    KVTIER_ASSIGN_OR_RETURN(h.lease_id, Pin(keys.first(h.plan.load_chunks), lease_ms));
    return h;
  }

  absl::Status ReleasePlan(const HeldPlan& plan) override {
    if (plan.lease_id == 0) return absl::OkStatus();
    if (plan.connection != 0) {
      if (ConnLease c = AcquireConnBySerial(plan.connection)) {
        uint8_t req[wire::shm::kU64Bytes];
        wire::shm::Writer(req).U64(plan.lease_id);
        return (*c).Call(DataConn::Op::kRelease, req, sizeof(req), nullptr, 0);
      }
    }
    return Release(plan.lease_id);
  }

  absl::StatusOr<std::vector<absl::StatusOr<HeldChunk>>> HoldBatch(std::span<const Hash128> keys,
                                                                   bool verify) override {
    namespace w = wire::shm;
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
    std::vector<absl::StatusOr<HeldChunk>> out;
    ConnLease c = AcquireConn();
    if (!c) {
      for (const Hash128& k : keys) out.push_back(HoldRpc(k, verify));
      return out;
    }
    std::vector<uint8_t> req(w::kGetBatchBytes + keys.size() * w::kKeyBytes), rep;
    w::Writer b(req.data());
    b.U32(static_cast<uint32_t>(keys.size())).U32(0).U8(verify ? 1 : 0).U8(0).U16(0).U32(0);
    WriteKeys(b, keys);
    KVTIER_RETURN_IF_ERROR((*c).CallBatch(DataConn::Op::kGetBatch, req.data(), b.size(), &rep));
    if (rep.size() != w::kBatchHeaderBytes + keys.size() * w::kGetBatchItemBytes) {
      return (*c).BadAnswer(DataConn::Op::kGetBatch);
    }
    w::Reader r(rep.data());
    if (r.U32() != keys.size()) return (*c).BadAnswer(DataConn::Op::kGetBatch);
    (void)r.U32();
    for (size_t i = 0; i < keys.size(); ++i) {
      const uint32_t code = r.U32();
      HeldChunk h;
      h.tier = FromProto(r.U8());
      (void)r.U8();
      (void)r.U16();
      (void)r.U64();  // chunk bytes: the extent's length
      const uint64_t offset = r.U64(), length = r.U64();
      h.lease_id = r.U64();
      h.scratch_slot_id = r.U64();
      h.connection = (*c).serial();
      if (code != 0) {
        const auto sc = code <= 16 ? static_cast<absl::StatusCode>(code) : absl::StatusCode::kUnknown;
        out.push_back(absl::Status(sc, absl::StrCat("chunk ", keys[i].ToHex(), ": ",
                                                    absl::StatusCodeToString(sc))));
        continue;
      }
      auto range = (*c).pool().Range(offset, length);
      if (!range.ok() || (h.lease_id == 0) == (h.scratch_slot_id == 0)) {
        (void)UnholdOver(*c, h);
        out.push_back(absl::InternalError("daemon answered a hold outside the pool"));
        continue;
      }
      h.data = *range;
      out.push_back(h);
    }
    return out;
  }

  absl::Status UnholdBatch(std::span<const HeldChunk> chunks) override {
    namespace w = wire::shm;
    absl::Status first;
    auto note = [&first](absl::Status st) {
      if (first.ok()) first = std::move(st);
    };
    // The holds of each data-plane connection go back over it, in frames of
    // at most kMaxBatchItems.
    absl::flat_hash_map<uint64_t, std::vector<const HeldChunk*>> by_conn;
    for (const HeldChunk& h : chunks) {
      if (h.lease_id == 0 && h.scratch_slot_id == 0) continue;
      if (h.connection == 0) {
        note(Unhold(h));
      } else {
        by_conn[h.connection].push_back(&h);
      }
    }
    for (auto& [serial, hs] : by_conn) {
      ConnLease c = AcquireConnBySerial(serial);
      if (!c) {
        for (const HeldChunk* h : hs) note(Unhold(*h));
        continue;
      }
      for (size_t at = 0; at < hs.size(); at += w::kMaxBatchItems) {
        const size_t n = std::min<size_t>(w::kMaxBatchItems, hs.size() - at);
        std::vector<uint8_t> req(w::kBatchHeaderBytes + n * w::kReleaseItemBytes), rep;
        w::Writer b(req.data());
        b.U32(static_cast<uint32_t>(n)).U32(0);
        for (size_t i = 0; i < n; ++i) b.U64(hs[at + i]->lease_id).U64(hs[at + i]->lease_id != 0 ? 0 : hs[at + i]->scratch_slot_id);
        absl::Status st = (*c).CallBatch(DataConn::Op::kReleaseBatch, req.data(), b.size(), &rep);
        if (!st.ok()) {
          note(st);
          break;
        }
        if (rep.size() != w::kBatchHeaderBytes + n * 4) {
          note((*c).BadAnswer(DataConn::Op::kReleaseBatch));
          break;
        }
        w::Reader r(rep.data());
        (void)r.U32();
        (void)r.U32();
        for (size_t i = 0; i < n; ++i) {
          const uint32_t code = r.U32();
          if (code != 0) {
            const auto sc = code <= 16 ? static_cast<absl::StatusCode>(code) : absl::StatusCode::kUnknown;
            note(absl::Status(sc, "unhold of a chunk the daemon no longer held for this client"));
          }
        }
      }
    }
    return first;
  }

  absl::StatusOr<PrefetchResult> PrefetchWithin(std::span<const Hash128> keys, uint64_t byte_budget,
                                                uint32_t deadline_ms) override {
    namespace w = wire::shm;
    if (shm_ && keys.size() <= kMaxBatchKeys) {
      if (ConnLease c = AcquireConn()) {
        std::vector<uint8_t> req(w::kPrefetchBytes + keys.size() * w::kKeyBytes), rep;
        w::Writer b(req.data());
        b.U32(static_cast<uint32_t>(keys.size())).U32(deadline_ms).U64(byte_budget);
        WriteKeys(b, keys);
        KVTIER_RETURN_IF_ERROR((*c).CallBatch(DataConn::Op::kPrefetch, req.data(), b.size(), &rep));
        if (rep.size() != w::kPrefetchReplyBytes) return (*c).BadAnswer(DataConn::Op::kPrefetch);
        w::Reader r(rep.data());
        PrefetchResult out;
        out.completed = r.U8() != 0;
        (void)r.U8();
        (void)r.U16();
        out.keys = r.U32();
        out.bytes = r.U64();
        return out;
      }
    }
    if (byte_budget != 0) {
      return absl::FailedPreconditionError("a prefetch byte budget needs the shared-memory data plane");
    }
    PrefetchResult out;
    KVTIER_ASSIGN_OR_RETURN(out.completed, Prefetch(keys, deadline_ms));
    return out;
  }

  absl::StatusOr<std::vector<absl::Status>> PutBatchShared(
      std::span<const Hash128> keys, std::span<const std::span<const uint8_t>> chunks,
      const PutOptions& options) override {
    namespace w = wire::shm;
    if (!shm_) return absl::FailedPreconditionError("no shared-memory pool mapped");
    if (keys.size() != chunks.size() || keys.empty() || keys.size() > kMaxBatchKeys) {
      return absl::FailedPreconditionError("not a batch for one data-plane exchange");
    }
    absl::flat_hash_set<Hash128> seen;
    for (const Hash128& k : keys) {
      if (!seen.insert(k).second) return absl::FailedPreconditionError("a key twice in one batch");
    }
    WaitForReleases();
    ConnLease c = AcquireConn();
    if (!c) return absl::FailedPreconditionError("no data-plane connection free");
    const size_t n = keys.size();
    std::vector<uint8_t> req(w::kBatchHeaderBytes + n * w::kU64Bytes), rep;
    {
      w::Writer b(req.data());
      b.U32(static_cast<uint32_t>(n)).U32(0);
      for (const auto& ch : chunks) b.U64(ch.size());
      KVTIER_RETURN_IF_ERROR(
          (*c).CallBatch(DataConn::Op::kAllocateBatch, req.data(), b.size(), &rep));
    }
    if (rep.size() != w::kBatchHeaderBytes + n * w::kSlotReplyBytes) {
      return (*c).BadAnswer(DataConn::Op::kAllocateBatch);
    }
    std::vector<uint64_t> ids(n);
    std::vector<std::span<uint8_t>> dst(n);
    absl::Status bad;
    {
      w::Reader r(rep.data());
      (void)r.U32();
      (void)r.U32();
      for (size_t i = 0; i < n; ++i) {
        ids[i] = r.U64();
        const uint64_t offset = r.U64(), length = r.U64();
        (void)r.U64();
        auto range = (*c).pool().Range(offset, length);
        if (!range.ok() || range->size() != chunks[i].size()) {
          bad = absl::InternalError("daemon returned a slot outside the pool or of another size");
        } else {
          dst[i] = *range;
        }
      }
    }
    if (!bad.ok()) {
      for (uint64_t id : ids) {
        uint8_t a[w::kU64Bytes];
        w::Writer(a).U64(id);
        (void)(*c).Call(DataConn::Op::kAbortSlot, a, sizeof(a), nullptr, 0);
      }
      return bad;
    }
    // Non-temporal stores: the daemon's check reads the chunks from memory.
    for (size_t i = 0; i < n; ++i) wire::StreamCopy(dst[i], chunks[i]);
    req.resize(w::kCommitBatchBytes + n * w::kCommitItemBytes);
    w::Writer b(req.data());
    b.U32(static_cast<uint32_t>(n)).U8(options.durable ? 1 : 0).U8(0).U16(0);
    for (size_t i = 0; i < n; ++i) b.U64(ids[i]).Raw(keys[i].bytes.data(), w::kKeyBytes);
    KVTIER_RETURN_IF_ERROR((*c).CallBatch(DataConn::Op::kCommitBatch, req.data(), b.size(), &rep));
    if (rep.size() != w::kBatchHeaderBytes + n * 4) return (*c).BadAnswer(DataConn::Op::kCommitBatch);
    w::Reader r(rep.data());
    (void)r.U32();
    (void)r.U32();
    std::vector<absl::Status> out;
    for (size_t i = 0; i < n; ++i) {
      const uint32_t code = r.U32();
      if (code == 0) {
        out.push_back(absl::OkStatus());
        continue;
      }
      const auto sc = code <= 16 ? static_cast<absl::StatusCode>(code) : absl::StatusCode::kUnknown;
      out.push_back(absl::Status(sc, absl::StrCat("put of chunk ", keys[i].ToHex(),
                                                  " refused: ", absl::StatusCodeToString(sc))));
    }
    return out;
  }

  absl::Status Put(const Hash128& key, std::span<const uint8_t> chunk,
                   const PutOptions& options) override {
    WaitForReleases();
    if (shm_) {
      if (ConnLease c = AcquireConn()) return PutOverDataPlane(*c, key, chunk, options);
      KVTIER_ASSIGN_OR_RETURN(WritableSlot slot, AllocateSlot(chunk.size()));
      return StreamIntoSlot(slot, key, chunk, options);
    }
    pb::PutRequest req;
    req.set_version(kProtocolVersion);
    req.set_key(KeyBytes(key));
    req.set_inline_chunk(reinterpret_cast<const char*>(chunk.data()), chunk.size());
    req.set_durable(options.durable);
    pb::PutResponse resp;
    return Call(&pb::Kvtier::StubInterface::Put, req, &resp);
  }

  // Copies `chunk` into `slot` piece by piece, telling the daemon after each
  // piece, so that the daemon checks piece i while this thread copies piece
  // i + 1; the last message commits.
  absl::Status StreamIntoSlot(const WritableSlot& slot, const Hash128& key,
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

  // The streamed put over a data-plane connection: allocate, then copy the
  // chunk into the slot piece by piece with a progress frame after each (no
  // answer awaited), so that the daemon checks piece i while this thread
  // copies piece i + 1; the commit frame's answer says whether it is stored.
  // A connection that fails midway is closed, and the daemon frees the slot.
  absl::Status PutOverDataPlane(DataConn& c, const Hash128& key, std::span<const uint8_t> chunk,
                                const PutOptions& options) {
    namespace w = wire::shm;
    constexpr size_t kPieceBytes = size_t{1} << 20;
    uint8_t req[w::kMaxRequestPayloadBytes], rep[w::kSlotReplyBytes];
    KVTIER_RETURN_IF_ERROR(c.Settle());
    uint64_t id, offset, length;
    std::optional<DataConn::Spare> spare = c.TakeSpare();
    if (spare && spare->length == chunk.size() && std::chrono::steady_clock::now() < spare->use_by) {
      id = spare->id;
      offset = spare->offset;
      length = spare->length;
    } else {
      if (spare) {
        const uint32_t m = w::Writer(req).U64(spare->id).size();
        KVTIER_RETURN_IF_ERROR(c.SendOwed(DataConn::Op::kAbortSlot, req, m));
      }
      const uint32_t n = w::Writer(req).U64(chunk.size()).U32(0).size();
      KVTIER_RETURN_IF_ERROR(c.Call(DataConn::Op::kAllocate, req, n, rep, sizeof(rep)));
      w::Reader r(rep);
      id = r.U64();
      offset = r.U64();
      length = r.U64();
    }
    auto range = c.pool().Range(offset, length);
    absl::Status st = range.status();
    if (st.ok() && range->size() != chunk.size()) {
      st = absl::InternalError("daemon returned a slot of another size");
    }
    if (!st.ok()) {
      const uint32_t m = w::Writer(req).U64(id).size();
      (void)c.Call(DataConn::Op::kAbortSlot, req, m, nullptr, 0);
      return st;
    }
    {
      w::Writer b(req);
      b.U64(id).Raw(key.bytes.data(), w::kKeyBytes).U8(options.durable ? 1 : 0).U8(0).U16(0);
      KVTIER_RETURN_IF_ERROR(c.Send(DataConn::Op::kPutBegin, req, b.size()));
    }
    // The header, then K and V pieces interleaved, so that a daemon that
    // hashes V on a second thread (ShmChannelOptions::put_check_threads)
    // sees both sections advance at once; each piece is copied with
    // non-temporal stores (fenced), so the daemon reads it from memory
    // instead of snooping it out of this core's cache.
    const std::vector<std::pair<uint64_t, uint64_t>> order =
        wire::PutCopyOrder(chunk, kPieceBytes);
    for (size_t i = 0; i < order.size(); ++i) {
      const auto [o, k] = order[i];
      wire::StreamCopy(range->subspan(o, k), chunk.subspan(o, k));
      const bool last = i + 1 == order.size();
      const uint32_t m = last ? w::Writer(req).U64(chunk.size()).size()
                              : w::Writer(req).U64(o).U64(k).size();
      KVTIER_RETURN_IF_ERROR(
          c.Send(last ? DataConn::Op::kPutCommit : DataConn::Op::kPutRange, req, m));
    }
    if (order.empty()) {  // an empty chunk: the daemon answers the commit
      const uint32_t m = w::Writer(req).U64(0).size();
      KVTIER_RETURN_IF_ERROR(c.Send(DataConn::Op::kPutCommit, req, m));
    }
    // The next put's slot, allocated by the daemon right after this commit
    // (it is awake), so that the next put does not wait for an allocation;
    // its answer is read at the connection's next use. It costs the pool a
    // slot of this size for at most kSpareTtlMs, and the daemon frees it
    // when the connection closes.
    {
      const uint32_t m = w::Writer(req).U64(chunk.size()).U32(DataConn::kSpareTtlMs).size();
      KVTIER_RETURN_IF_ERROR(c.SendOwed(DataConn::Op::kAllocate, req, m));
    }
    return c.Receive(DataConn::Op::kPutCommit, nullptr, 0);
  }

  absl::StatusOr<WritableSlot> AllocateSlot(uint64_t bytes) override {
    if (!shm_) return absl::FailedPreconditionError("no shared-memory pool mapped");
    pb::AllocateSlotRequest req;
    req.set_version(kProtocolVersion);
    req.set_bytes(bytes);
    pb::AllocateSlotResponse resp;
    KVTIER_RETURN_IF_ERROR(Call(&pb::Kvtier::StubInterface::AllocateSlot, req, &resp));
    auto r = PoolRange(resp.extent());
    absl::Status st = r.status();
    if (st.ok() && r->size() < bytes) st = absl::InternalError("daemon returned a short slot");
    if (!st.ok()) {
      (void)AbortSlot(WritableSlot{resp.slot_id(), {}});
      return st;
    }
    return WritableSlot{resp.slot_id(), r->first(bytes)};
  }

  absl::Status CommitSlot(const WritableSlot& slot, const Hash128& key,
                          const PutOptions& options) override {
    WaitForReleases();
    pb::PutRequest req;
    req.set_version(kProtocolVersion);
    req.set_key(KeyBytes(key));
    req.set_slot_id(slot.id);
    req.set_durable(options.durable);
    pb::PutResponse resp;
    return Call(&pb::Kvtier::StubInterface::Put, req, &resp);
  }

  absl::Status AbortSlot(const WritableSlot& slot) override {
    WaitForReleases();
    pb::AbortSlotRequest req;
    req.set_version(kProtocolVersion);
    req.set_slot_id(slot.id);
    pb::AbortSlotResponse resp;
    return Call(&pb::Kvtier::StubInterface::AbortSlot, req, &resp);
  }

  absl::StatusOr<std::vector<uint8_t>> Get(const Hash128& key) override {
    std::vector<uint8_t> out;
    KVTIER_RETURN_IF_ERROR(GetImpl(key, nullptr, &out).status());
    return out;
  }

  absl::StatusOr<std::pair<std::vector<uint8_t>, Tier>> GetWithTier(const Hash128& key) override {
    std::vector<uint8_t> out;
    KVTIER_ASSIGN_OR_RETURN(auto got, GetImpl(key, nullptr, &out));
    return std::make_pair(std::move(out), got.second);
  }

  absl::StatusOr<std::pair<uint64_t, Tier>> GetInto(const Hash128& key,
                                                    std::span<uint8_t> out) override {
    return GetImpl(key, &out, nullptr);
  }

  absl::Status Delete(const Hash128& key) override {
    WaitForReleases();
    pb::DeleteRequest req;
    req.set_version(kProtocolVersion);
    req.set_key(KeyBytes(key));
    pb::DeleteResponse resp;
    return Call(&pb::Kvtier::StubInterface::Delete, req, &resp);
  }

  absl::StatusOr<bool> Prefetch(std::span<const Hash128> keys, uint32_t deadline_ms) override {
    WaitForReleases();
    pb::PrefetchRequest req;
    req.set_version(kProtocolVersion);
    for (const Hash128& k : keys) req.add_keys(KeyBytes(k));
    req.set_deadline_ms(deadline_ms);
    pb::PrefetchResponse resp;
    KVTIER_RETURN_IF_ERROR(Call(&pb::Kvtier::StubInterface::Prefetch, req, &resp));
    return resp.completed();
  }

  absl::StatusOr<uint64_t> Pin(std::span<const Hash128> keys, uint32_t ttl_ms) override {
    WaitForReleases();
    pb::PinRequest req;
    req.set_version(kProtocolVersion);
    for (const Hash128& k : keys) req.add_keys(KeyBytes(k));
    req.set_ttl_ms(ttl_ms);
    pb::PinResponse resp;
    KVTIER_RETURN_IF_ERROR(Call(&pb::Kvtier::StubInterface::Pin, req, &resp));
    return resp.lease_id();
  }

  absl::Status Release(uint64_t lease_id) override {
    WaitForReleases();
    pb::ReleaseRequest req;
    req.set_version(kProtocolVersion);
    req.set_lease_id(lease_id);
    pb::ReleaseResponse resp;
    return Call(&pb::Kvtier::StubInterface::Release, req, &resp);
  }

  absl::StatusOr<DaemonStats> Stats() override {
    WaitForReleases();
    pb::StatsRequest req;
    req.set_version(kProtocolVersion);
    pb::StatsResponse resp;
    KVTIER_RETURN_IF_ERROR(Call(&pb::Kvtier::StubInterface::Stats, req, &resp));
    DaemonStats s;
    for (const pb::TierStats& t : resp.tiers()) {
      s.tiers.push_back(TierStats{FromProto(t.tier()), t.capacity_bytes(), t.used_bytes(),
                                  t.chunks(), t.read_bytes_per_s(), t.write_bytes_per_s()});
    }
    for (const pb::Counter& c : resp.counters()) s.counters.emplace_back(c.name(), c.value());
    return s;
  }

 private:
  void Prepare(grpc::ClientContext& ctx, int64_t timeout_ms) const {
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(timeout_ms));
    if (!options_.token.empty()) ctx.AddMetadata("authorization", "Bearer " + options_.token);
  }

  template <typename Req, typename Resp>
  absl::Status Call(grpc::Status (pb::Kvtier::StubInterface::*method)(grpc::ClientContext*,
                                                                      const Req&, Resp*),
                    const Req& req, Resp* resp) {
    grpc::ClientContext ctx;
    Prepare(ctx, options_.timeout_ms);
    return FromGrpcStatus((stub_->*method)(&ctx, req, resp));
  }

  // Into `out` (span) or `vec` (resized).
  absl::StatusOr<std::pair<uint64_t, Tier>> GetImpl(const Hash128& key, std::span<uint8_t>* out,
                                                    std::vector<uint8_t>* vec) {
    if (!shm_) {
      pb::GetRequest req;
      req.set_version(kProtocolVersion);
      req.set_key(KeyBytes(key));
      req.set_mode(pb::GET_MODE_INLINE);
      pb::GetResponse resp;
      KVTIER_RETURN_IF_ERROR(Call(&pb::Kvtier::StubInterface::Get, req, &resp));
      const std::string& b = resp.inline_chunk();
      if (out != nullptr) {
        if (out->size() < b.size()) return TooSmall(out->size(), b.size());
        std::memcpy(out->data(), b.data(), b.size());
      } else {
        vec->assign(b.begin(), b.end());
      }
      return std::make_pair(static_cast<uint64_t>(b.size()), FromProto(resp.tier()));
    }
    // Shared memory: copy out of the pool and check the copy in one pass. On
    // a mismatch the daemon verifies the stored chunk (and drops it if it is
    // corrupt); if it finds it whole (the bytes changed under the copy), one
    // more try.
    bool verify = false;
    ConnLease c = AcquireConn();
    for (int attempt = 0;; ++attempt) {
      KVTIER_ASSIGN_OR_RETURN(HeldChunk held, c ? HoldOver(*c, key, verify) : HoldRpc(key, verify));
      std::span<uint8_t> dst;
      absl::Status st;
      if (out != nullptr) {
        if (out->size() < held.data.size()) st = TooSmall(out->size(), held.data.size());
        dst = *out;
      } else {
        vec->resize(held.data.size());
        dst = std::span<uint8_t>(*vec);
      }
      absl::Status check;
      if (st.ok()) {
        check = (verifier_ ? verifier_->CopyVerified(dst, held.data)
                           : wire::CopyVerified(dst, held.data))
                    .status();
      }
      absl::Status u;
      if (c && held.lease_id != 0) {
        // The bytes are in the caller's buffer: the release is sent and its
        // answer read at the connection's next use (an error there means the
        // lease had expired, which freed the chunk just the same).
        uint8_t req[wire::shm::kU64Bytes];
        wire::shm::Writer(req).U64(held.lease_id);
        u = (*c).SendOwed(DataConn::Op::kRelease, req, sizeof(req));
      } else if (c) {
        u = UnholdOver(*c, held);
      } else {
        // The bytes are in the caller's buffer: the lease goes back without
        // waiting for the answer.
        u = held.lease_id != 0 ? ReleaseAsync(held.lease_id) : Unhold(held);
      }
      if (!st.ok()) return st;
      if (check.ok()) {
        if (!u.ok()) return u;
        return std::make_pair(static_cast<uint64_t>(held.data.size()), held.tier);
      }
      if (attempt == 1) {
        return absl::DataLossError(absl::StrCat("chunk ", key.ToHex(), " changed while read: ",
                                                check.message()));
      }
      verify = true;
    }
  }

  static absl::Status TooSmall(size_t have, size_t need) {
    return absl::InvalidArgumentError(absl::StrCat("buffer of ", have, " bytes; the chunk is ", need));
  }

  absl::StatusOr<HeldChunk> Hold(const Hash128& key, bool verify) override {
    if (!shm_) return absl::FailedPreconditionError("no shared-memory pool mapped");
    if (ConnLease c = AcquireConn()) return HoldOver(*c, key, verify);
    return HoldRpc(key, verify);
  }

  absl::StatusOr<HeldChunk> HoldRpc(const Hash128& key, bool verify) {
    pb::GetRequest req;
    req.set_version(kProtocolVersion);
    req.set_key(KeyBytes(key));
    req.set_mode(pb::GET_MODE_SHM);
    req.set_verify(verify);
    pb::GetResponse resp;
    KVTIER_RETURN_IF_ERROR(Call(&pb::Kvtier::StubInterface::Get, req, &resp));
    HeldChunk h;
    h.tier = FromProto(resp.tier());
    h.lease_id = resp.lease_id();
    h.scratch_slot_id = resp.scratch_slot_id();
    auto r = PoolRange(resp.extent());
    if (!r.ok()) {
      (void)Unhold(h);
      return r.status();
    }
    h.data = *r;
    return h;
  }

  absl::StatusOr<HeldChunk> HoldOver(DataConn& c, const Hash128& key, bool verify) {
    namespace w = wire::shm;
    uint8_t req[w::kMaxRequestPayloadBytes], rep[w::kGetReplyBytes];
    w::Writer b(req);
    b.Raw(key.bytes.data(), w::kKeyBytes).U32(0).U8(verify ? 1 : 0).U8(0).U16(0);
    KVTIER_RETURN_IF_ERROR(c.Call(DataConn::Op::kGet, req, b.size(), rep, sizeof(rep)));
    w::Reader r(rep);
    HeldChunk h;
    h.tier = FromProto(r.U8());
    (void)r.U8();
    (void)r.U16();
    (void)r.U32();
    (void)r.U64();  // chunk bytes: the extent's length
    const uint64_t offset = r.U64(), length = r.U64();
    h.lease_id = r.U64();
    h.scratch_slot_id = r.U64();
    h.connection = c.serial();
    auto range = c.pool().Range(offset, length);
    if (!range.ok()) {
      (void)UnholdOver(c, h);
      return range.status();
    }
    h.data = *range;
    return h;
  }

  absl::Status Unhold(const HeldChunk& h) override {
    if (h.lease_id == 0 && h.scratch_slot_id == 0) return absl::OkStatus();
    // The daemon takes a release or abort of a data-plane hold only from
    // the connection that took it (gRPC gets NotFound, as for any id it
    // does not hold). If that connection has closed, the daemon ended the
    // hold with it; if it stays lent out for timeout_ms, the hold ends with
    // its lease.
    if (h.connection != 0) {
      if (ConnLease c = AcquireConnBySerial(h.connection)) return UnholdOver(*c, h);
    }
    if (h.lease_id != 0) return Release(h.lease_id);
    return AbortSlot(WritableSlot{h.scratch_slot_id, {}});
  }

  absl::Status UnholdOver(DataConn& c, const HeldChunk& h) {
    namespace w = wire::shm;
    uint8_t req[w::kU64Bytes];
    if (h.lease_id != 0) {
      w::Writer(req).U64(h.lease_id);
      return c.Call(DataConn::Op::kRelease, req, sizeof(req), nullptr, 0);
    }
    if (h.scratch_slot_id != 0) {
      w::Writer(req).U64(h.scratch_slot_id);
      return c.Call(DataConn::Op::kAbortSlot, req, sizeof(req), nullptr, 0);
    }
    return absl::OkStatus();
  }

  // A data-plane connection lent to one call; it goes back to the client's
  // idle list when the call ends (or is closed, if it broke). Empty when the
  // daemon has no data plane or every connection is busy: use gRPC.
  class ConnLease {
   public:
    ConnLease(ClientImpl* owner, std::unique_ptr<DataConn> c) : owner_(owner), c_(std::move(c)) {}
    ConnLease(ConnLease&& o) noexcept : owner_(o.owner_), c_(std::move(o.c_)) {}
    ConnLease& operator=(ConnLease&&) = delete;
    ~ConnLease() {
      if (c_) owner_->ReturnConn(std::move(c_));
    }
    explicit operator bool() const { return c_ != nullptr; }
    DataConn& operator*() const { return *c_; }

   private:
    ClientImpl* owner_;
    std::unique_ptr<DataConn> c_;
  };

  ConnLease AcquireConn() {
    {
      absl::MutexLock l(&conns_mu_);
      if (!data_plane_) return ConnLease(this, nullptr);
      while (!idle_conns_.empty()) {
        std::unique_ptr<DataConn> c = std::move(idle_conns_.back());
        idle_conns_.pop_back();
        if (c->PeerOpen()) return ConnLease(this, std::move(c));
        --open_conns_;  // the daemon went away: closed here
        live_conns_.erase(c->serial());
      }
      if (open_conns_ >= options_.max_data_connections) return ConnLease(this, nullptr);
      ++open_conns_;
    }
    std::unique_ptr<DataConn> c;
    auto h = ConnectShm(shm_socket_);
    if (h.ok()) {
      auto pool = AdoptPool(*h);
      if (pool.ok()) {
        c = DataConn::Open(h->sock, *std::move(pool), options_.timeout_ms, owed_releases_.get(),
                           next_conn_serial_++, options_.token);
      } else {
        ::close(h->sock);
      }
    }
    absl::MutexLock l(&conns_mu_);
    if (c == nullptr) {
      --open_conns_;
    } else {
      live_conns_.insert(c->serial());
    }
    return ConnLease(this, std::move(c));
  }

  // The mapping of the pool whose memfd came in `h` (the memfd is closed):
  // the current mapping if it is the same pool, else a new mapping that
  // becomes the current one (a restarted daemon's pool). Replaced mappings
  // stay mapped: chunks held in them are still read.
  absl::StatusOr<std::shared_ptr<const PoolMapping>> AdoptPool(const ShmHandshake& h) {
    const uint64_t id = wire::shm::PoolIdOf(h.memfd);
    {
      absl::MutexLock l(&pool_mu_);
      if (id != 0 && pool_ != nullptr && pool_->id() == id) {
        ::close(h.memfd);
        return pool_;
      }
    }
    KVTIER_ASSIGN_OR_RETURN(std::shared_ptr<const PoolMapping> fresh,
                            PoolMapping::Map(h, options_.populate_mapping));
    absl::MutexLock l(&pool_mu_);
    if (pool_ != nullptr && pool_->id() == fresh->id()) return pool_;  // another call was first
    if (pool_ != nullptr) old_pools_.push_back(std::move(pool_));
    pool_ = fresh;
    return fresh;
  }

  // The bytes of an extent that a gRPC reply named, read through a mapping
  // of the pool it names (ShmExtent.pool_id), never another's: a gRPC
  // channel reconnects to a restarted daemon by itself, whose offsets mean
  // nothing in the old pool. A pool not mapped yet is taken from the side
  // channel first. Unavailable if the daemon there serves another pool.
  absl::StatusOr<std::span<uint8_t>> PoolRange(const pb::ShmExtent& e) {
    if (e.pool_id() == 0) {
      return absl::FailedPreconditionError(
          "kvtierd named no pool for a shared-memory extent (it predates pool ids); upgrade it");
    }
    std::shared_ptr<const PoolMapping> pool;
    {
      absl::MutexLock l(&pool_mu_);
      pool = pool_;
    }
    if (pool == nullptr || pool->id() != e.pool_id()) {
      auto h = ConnectShm(shm_socket_);
      if (h.ok()) {
        ::close(h->sock);
        KVTIER_ASSIGN_OR_RETURN(pool, AdoptPool(*h));
      }
    }
    if (pool == nullptr || pool->id() != e.pool_id()) {
      return absl::UnavailableError(
          "kvtierd answered with an extent of a pool this client cannot map (the daemon "
          "restarted, or another one serves its side channel)");
    }
    return pool->Range(e.offset(), e.length());
  }

  // The data-plane connection `serial`, once no other call is using it.
  // Empty if it has closed, or is still lent out after timeout_ms.
  ConnLease AcquireConnBySerial(uint64_t serial) {
    absl::MutexLock l(&conns_mu_);
    auto idle_or_closed = [this, serial]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(conns_mu_) {
      return !live_conns_.contains(serial) ||
             std::any_of(idle_conns_.begin(), idle_conns_.end(),
                         [serial](const auto& c) { return c->serial() == serial; });
    };
    conns_mu_.AwaitWithTimeout(absl::Condition(&idle_or_closed),
                               absl::Milliseconds(options_.timeout_ms));
    for (auto it = idle_conns_.begin(); it != idle_conns_.end(); ++it) {
      if ((*it)->serial() == serial) {
        std::unique_ptr<DataConn> c = std::move(*it);
        idle_conns_.erase(it);
        return ConnLease(this, std::move(c));
      }
    }
    return ConnLease(this, nullptr);
  }

  void ReturnConn(std::unique_ptr<DataConn> c) {
    absl::MutexLock l(&conns_mu_);
    if (c->broken()) {
      --open_conns_;
      live_conns_.erase(c->serial());
      return;  // closed
    }
    idle_conns_.push_back(std::move(c));
  }

  // Sends Release and returns; the answer is only counted (an error there
  // means the lease had expired, which frees the chunk just the same). Calls
  // that could see the pin (Delete, Pin, Put, ...) and the destructor wait
  // for outstanding ones, so this client always sees its own gets released.
  absl::Status ReleaseAsync(uint64_t lease_id) {
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

  void WaitForReleases() {
    {
      absl::MutexLock l(&releases_->mu);
      releases_->mu.Await(absl::Condition(
          +[](int* n) { return *n == 0; }, &releases_->pending));
    }
    // Idle connections are settled here; a lent one is settled by its
    // borrower's first request, or here once it is back.
    while (owed_releases_->load() != 0) {
      {
        absl::MutexLock l(&conns_mu_);
        for (auto it = idle_conns_.begin(); it != idle_conns_.end();) {
          (void)(*it)->Settle();
          if ((*it)->broken()) {
            live_conns_.erase((*it)->serial());
            it = idle_conns_.erase(it);
            --open_conns_;
          } else {
            ++it;
          }
        }
      }
      if (owed_releases_->load() != 0) std::this_thread::yield();
    }
  }

  std::span<uint8_t> mapped_pool() const override {
    absl::MutexLock l(&pool_mu_);
    return pool_ ? pool_->all() : std::span<uint8_t>();
  }

  absl::Status CopyHeldChunk(std::span<uint8_t> dst, std::span<const uint8_t> src) override {
    return (verifier_ ? verifier_->CopyVerified(dst, src) : wire::CopyVerified(dst, src)).status();
  }

  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<pb::Kvtier::StubInterface> owned_;
  pb::Kvtier::StubInterface* stub_;
  const ClientOptions options_;
  // Whether bytes move through the daemon's pool (set by Init).
  bool shm_ = false;
  std::string shm_socket_;
  // The mapping of the daemon's pool as of the last handshake, and those of
  // pools replaced since (a daemon restarted): chunks held in them stay
  // mapped while this client lives.
  mutable absl::Mutex pool_mu_;
  std::shared_ptr<const PoolMapping> pool_ ABSL_GUARDED_BY(pool_mu_);
  std::vector<std::shared_ptr<const PoolMapping>> old_pools_ ABSL_GUARDED_BY(pool_mu_);
  // Releases sent on data-plane connections whose answers are unread;
  // declared before the connections, which hold a pointer to it.
  std::unique_ptr<std::atomic<int>> owed_releases_ = std::make_unique<std::atomic<int>>(0);
  // Hashes what a shared-memory get copies (check_on_helper_thread).
  std::unique_ptr<wire::PipelinedCopyVerifier> verifier_;
  // Data-plane connections (wire/DATA_PLANE.md).
  absl::Mutex conns_mu_;
  bool data_plane_ ABSL_GUARDED_BY(conns_mu_) = false;
  int open_conns_ ABSL_GUARDED_BY(conns_mu_) = 0;  // idle and lent
  std::vector<std::unique_ptr<DataConn>> idle_conns_ ABSL_GUARDED_BY(conns_mu_);
  // Serials of the open connections (idle and lent), and the next serial.
  absl::flat_hash_set<uint64_t> live_conns_ ABSL_GUARDED_BY(conns_mu_);
  std::atomic<uint64_t> next_conn_serial_{1};
  // Outstanding asynchronous Releases; shared with their callbacks.
  struct Releases {
    absl::Mutex mu;
    int pending ABSL_GUARDED_BY(mu) = 0;
  };
  std::shared_ptr<Releases> releases_ = std::make_shared<Releases>();
};

}  // namespace

namespace {


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

// Copies each held chunk into the buffer `dst(i, bytes)` gives for it,
// checking it in the same pass; `result(i, st)` gets each outcome: OK, the
// hold's error, InvalidArgument from `dst`, or the copy's DataLoss. Callers
// retry DataLoss and a hold refused at the held-bytes limit one key at a
// time, as a single get does (once the batch is unheld).
template <typename Copy, typename Dst, typename Result>
void CopyHeldChunks(std::span<const absl::StatusOr<HeldChunk>> held, Copy copy, Dst dst,
                    Result result) {
  for (size_t i = 0; i < held.size(); ++i) {
    if (!held[i].ok()) {
      result(i, held[i].status());
      continue;
    }
    absl::StatusOr<std::span<uint8_t>> out = dst(i, held[i]->data.size());
    if (!out.ok()) {
      result(i, out.status());
      continue;
    }
    result(i, copy(*out, held[i]->data));
  }
}

std::vector<HeldChunk> HeldOnes(std::span<const absl::StatusOr<HeldChunk>> held) {
  std::vector<HeldChunk> out;
  for (const auto& h : held) {
    if (h.ok()) out.push_back(*h);
  }
  return out;
}

}  // namespace

absl::Status KvtierClient::CopyHeldChunk(std::span<uint8_t> dst, std::span<const uint8_t> src) {
  return wire::CopyVerified(dst, src).status();
}

std::vector<absl::StatusOr<std::pair<uint64_t, Tier>>> KvtierClient::GetBatchInto(
    std::span<const Hash128> keys, std::span<const std::span<uint8_t>> outs) {
  std::vector<absl::StatusOr<std::pair<uint64_t, Tier>>> out(
      keys.size(), absl::InvalidArgumentError("keys and buffers differ in number"));
  if (outs.size() != keys.size()) return out;
  auto held = uses_shared_memory() ? HoldBatch(keys)
                                   : absl::StatusOr<std::vector<absl::StatusOr<HeldChunk>>>(
                                         absl::FailedPreconditionError("no shared memory"));
  if (!held.ok()) {
    for (size_t i = 0; i < keys.size(); ++i) out[i] = GetInto(keys[i], outs[i]);
    return out;
  }
  std::vector<size_t> retry;
  auto copy = [this](std::span<uint8_t> d, std::span<const uint8_t> s) {
    return CopyHeldChunk(d, s);
  };
  CopyHeldChunks(
      *held, copy,
      [&](size_t i, uint64_t bytes) -> absl::StatusOr<std::span<uint8_t>> {
        if (outs[i].size() < bytes) {
          return absl::InvalidArgumentError(
              absl::StrCat("buffer of ", outs[i].size(), " bytes; the chunk is ", bytes));
        }
        return outs[i].first(bytes);
      },
      [&](size_t i, absl::Status st) {
        if (st.ok()) {
          out[i] = std::make_pair(static_cast<uint64_t>((*held)[i]->data.size()), (*held)[i]->tier);
        } else if (absl::IsDataLoss(st) || absl::IsResourceExhausted(st)) {
          retry.push_back(i);
        } else {
          out[i] = std::move(st);
        }
      });
  (void)UnholdBatch(HeldOnes(*held));
  for (size_t i : retry) out[i] = GetInto(keys[i], outs[i]);
  return out;
}

std::vector<absl::StatusOr<std::vector<uint8_t>>> KvtierClient::GetBatch(
    std::span<const Hash128> keys) {
  if (uses_shared_memory()) {
    auto held = HoldBatch(keys);
    if (held.ok()) {
      std::vector<std::vector<uint8_t>> bufs(keys.size());
      std::vector<absl::StatusOr<std::vector<uint8_t>>> out(keys.size());
      std::vector<size_t> retry;
      auto copy = [this](std::span<uint8_t> d, std::span<const uint8_t> s) {
        return CopyHeldChunk(d, s);
      };
      CopyHeldChunks(
          *held, copy,
          [&](size_t i, uint64_t bytes) -> absl::StatusOr<std::span<uint8_t>> {
            bufs[i].resize(bytes);
            return std::span<uint8_t>(bufs[i]);
          },
          [&](size_t i, absl::Status st) {
            if (st.ok()) {
              out[i] = std::move(bufs[i]);
            } else if (absl::IsDataLoss(st) || absl::IsResourceExhausted(st)) {
              retry.push_back(i);
            } else {
              out[i] = std::move(st);
            }
          });
      (void)UnholdBatch(HeldOnes(*held));
      for (size_t i : retry) out[i] = Get(keys[i]);
      return out;
    }
  }
  std::vector<std::future<absl::StatusOr<std::vector<uint8_t>>>> fs;
  for (const Hash128& k : keys) fs.push_back(GetAsync(k));
  std::vector<absl::StatusOr<std::vector<uint8_t>>> out;
  for (auto& f : fs) out.push_back(f.get());
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
