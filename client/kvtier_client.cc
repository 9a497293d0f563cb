#include "client/kvtier_client.h"

#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <chrono>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "client/kvtier_client_internal.h"
#include "codec/prefix_key.h"
#include "common/status.h"
#include "server/chunk_check.h"

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

// Receives the pool memfd from the daemon's side channel and maps it.
class PoolMapping {
 public:
  static absl::StatusOr<std::unique_ptr<PoolMapping>> Map(const std::string& path, bool populate) {
    sockaddr_un addr{};
    if (path.size() >= sizeof(addr.sun_path)) return absl::InvalidArgumentError("shm socket path too long");
    addr.sun_family = AF_UNIX;
    std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
    int s = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (s < 0) return absl::InternalError("socket");
    timeval tv{5, 0};
    ::setsockopt(s, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    if (::connect(s, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
      int e = errno;
      ::close(s);
      return absl::FailedPreconditionError(absl::StrCat("connect ", path, ": ", std::strerror(e)));
    }
    uint64_t size = 0;
    iovec iov{&size, sizeof(size)};
    alignas(cmsghdr) char ctrl[CMSG_SPACE(sizeof(int))] = {};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = ctrl;
    msg.msg_controllen = sizeof(ctrl);
    ssize_t n = ::recvmsg(s, &msg, MSG_CMSG_CLOEXEC);
    ::close(s);
    cmsghdr* cm = CMSG_FIRSTHDR(&msg);
    if (n != static_cast<ssize_t>(sizeof(size)) || cm == nullptr || cm->cmsg_type != SCM_RIGHTS ||
        cm->cmsg_len != CMSG_LEN(sizeof(int))) {
      return absl::FailedPreconditionError(absl::StrCat("no pool descriptor from ", path));
    }
    int fd;
    std::memcpy(&fd, CMSG_DATA(cm), sizeof(int));
    void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED | (populate ? MAP_POPULATE : 0),
                     fd, 0);
    ::close(fd);
    if (p == MAP_FAILED) {
      return absl::FailedPreconditionError(absl::StrCat("mmap of the pool: ", std::strerror(errno)));
    }
    return std::unique_ptr<PoolMapping>(new PoolMapping(static_cast<uint8_t*>(p), size));
  }
  ~PoolMapping() { ::munmap(base_, size_); }

  std::span<uint8_t> all() const { return std::span<uint8_t>(base_, size_); }

  // The mapped range of an extent the daemon named; never trusted blindly.
  absl::StatusOr<std::span<uint8_t>> Range(const pb::ShmExtent& e) const {
    if (e.offset() > size_ || e.length() > size_ - e.offset()) {
      return absl::InternalError("daemon named an extent outside the pool");
    }
    return std::span<uint8_t>(base_ + e.offset(), e.length());
  }

 private:
  PoolMapping(uint8_t* base, uint64_t size) : base_(base), size_(size) {}
  uint8_t* base_;
  uint64_t size_;
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
    if (!s.ok()) {
      return absl::UnavailableError(absl::StrCat("kvtierd not reachable at ", Target(), ": ",
                                                 s.error_message()));
    }
    if (options_.shared_memory && options_.tcp_addr.empty() && !resp.shm_socket().empty()) {
      KVTIER_ASSIGN_OR_RETURN(pool_, PoolMapping::Map(resp.shm_socket(), options_.populate_mapping));
    }
    return absl::OkStatus();
  }

  std::string Target() const {
    return options_.tcp_addr.empty() ? "unix:" + options_.socket_path : options_.tcp_addr;
  }

  bool uses_shared_memory() const override { return pool_ != nullptr; }

  absl::StatusOr<std::vector<Tier>> Lookup(std::span<const Hash128> keys) override {
    pb::LookupRequest req;
    req.set_version(kProtocolVersion);
    for (const Hash128& k : keys) req.add_keys(KeyBytes(k));
    pb::LookupResponse resp;
    KVTIER_RETURN_IF_ERROR(Call(&pb::Kvtier::StubInterface::Lookup, req, &resp));
    std::vector<Tier> out;
    for (int t : resp.tiers()) out.push_back(FromProto(t));
    return out;
  }

  absl::Status Put(const Hash128& key, std::span<const uint8_t> chunk,
                   const PutOptions& options) override {
    WaitForReleases();
    if (pool_) {
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
      // Plain stores in cache-sized pieces: the daemon reads them from cache.
      server::CopyInPieces(slot.data.subspan(o, n), chunk.subspan(o, n));
      o += n;
      m.set_written_bytes(o);
      m.set_commit(o == chunk.size());
      if (!w->Write(m)) break;  // the daemon ended the call; Finish says why
    }
    w->WritesDone();
    return FromGrpcStatus(w->Finish());
  }

  absl::StatusOr<WritableSlot> AllocateSlot(uint64_t bytes) override {
    if (!pool_) return absl::FailedPreconditionError("no shared-memory pool mapped");
    pb::AllocateSlotRequest req;
    req.set_version(kProtocolVersion);
    req.set_bytes(bytes);
    pb::AllocateSlotResponse resp;
    KVTIER_RETURN_IF_ERROR(Call(&pb::Kvtier::StubInterface::AllocateSlot, req, &resp));
    KVTIER_ASSIGN_OR_RETURN(std::span<uint8_t> r, pool_->Range(resp.extent()));
    if (r.size() < bytes) return absl::InternalError("daemon returned a short slot");
    return WritableSlot{resp.slot_id(), r.first(bytes)};
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
    if (!pool_) {
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
    for (int attempt = 0;; ++attempt) {
      KVTIER_ASSIGN_OR_RETURN(HeldChunk held, Hold(key, verify));
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
      if (st.ok()) check = server::CopyVerified(dst, held.data).status();
      // The bytes are in the caller's buffer: the lease goes back without
      // waiting for the answer.
      absl::Status u = held.lease_id != 0 ? ReleaseAsync(held.lease_id) : Unhold(held);
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
    if (!pool_) return absl::FailedPreconditionError("no shared-memory pool mapped");
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
    auto r = pool_->Range(resp.extent());
    if (!r.ok()) {
      (void)Unhold(h);
      return r.status();
    }
    h.data = *r;
    return h;
  }

  absl::Status Unhold(const HeldChunk& h) override {
    if (h.lease_id != 0) return Release(h.lease_id);
    if (h.scratch_slot_id != 0) return AbortSlot(WritableSlot{h.scratch_slot_id, {}});
    return absl::OkStatus();
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
    absl::MutexLock l(&releases_->mu);
    releases_->mu.Await(absl::Condition(
        +[](int* n) { return *n == 0; }, &releases_->pending));
  }

  std::span<uint8_t> mapped_pool() const override {
    return pool_ ? pool_->all() : std::span<uint8_t>();
  }

  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<pb::Kvtier::StubInterface> owned_;
  pb::Kvtier::StubInterface* stub_;
  const ClientOptions options_;
  std::unique_ptr<PoolMapping> pool_;
  // Outstanding asynchronous Releases; shared with their callbacks.
  struct Releases {
    absl::Mutex mu;
    int pending ABSL_GUARDED_BY(mu) = 0;
  };
  std::shared_ptr<Releases> releases_ = std::make_shared<Releases>();
};

}  // namespace

absl::StatusOr<std::unique_ptr<KvtierClient>> KvtierClient::Connect(const ClientOptions& options) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(options.max_message_mib << 20);
  args.SetMaxSendMessageSize(options.max_message_mib << 20);
  std::string target = options.tcp_addr.empty() ? "unix:" + options.socket_path : options.tcp_addr;
  auto channel = grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), args);
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

std::vector<absl::StatusOr<std::vector<uint8_t>>> KvtierClient::GetBatch(
    std::span<const Hash128> keys) {
  std::vector<std::future<absl::StatusOr<std::vector<uint8_t>>>> fs;
  for (const Hash128& k : keys) fs.push_back(GetAsync(k));
  std::vector<absl::StatusOr<std::vector<uint8_t>>> out;
  for (auto& f : fs) out.push_back(f.get());
  return out;
}

}  // namespace kvtier::client
