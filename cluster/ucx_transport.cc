#include "cluster/ucx_transport.h"

#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>
#include <ucp/api/ucp.h>

#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <future>
#include <optional>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "cluster/node_protocol.h"
#include "cluster/peer_address.h"
#include "cluster/peer_auth.h"
#include "common/status.h"

namespace kvtier::cluster {
namespace {

constexpr unsigned kAmRequest = 1;
constexpr unsigned kAmReply = 2;

absl::Status UcsError(const char* what, ucs_status_t s) {
  return absl::UnavailableError(absl::StrCat(what, ": ", ucs_status_string(s)));
}

}  // namespace

// A request this node sent and is waiting on.
struct Pending {
  enum State { kWaiting, kReceiving, kDone };
  absl::Mutex mu;
  State state ABSL_GUARDED_BY(mu) = kWaiting;
  bool send_done ABSL_GUARDED_BY(mu) = false;
  absl::Status status ABSL_GUARDED_BY(mu);
  uint64_t value ABSL_GUARDED_BY(mu) = 0;
  // Set before the request is sent, read by the progress thread only.
  Op op = Op::kPing;
  std::string peer;
  std::span<uint8_t> out;
  ucp_ep_h ep = nullptr;

  void Complete(absl::Status s, uint64_t v = 0) {
    absl::MutexLock lock(&mu);
    if (state == kDone) return;
    state = kDone;
    status = std::move(s);
    value = v;
  }
};

// Whether a request of `op` touches objects (and so needs an authenticated
// connection when the transport has a cluster secret).
bool IsChunkOp(Op op) { return op == Op::kPut || op == Op::kGet || op == Op::kSize || op == Op::kErase; }

struct UcxTransport::Impl {
  UcxTransportOptions options;
  PeerService* service = nullptr;
  // Set when the transport has a cluster secret.
  std::optional<PeerAuthenticator> auth;
  NonceHistory nonces;
  std::atomic<uint64_t> auth_failures{0};
  std::atomic<uint64_t> auth_successes{0};

  ucp_context_h context = nullptr;
  ucp_worker_h worker = nullptr;
  ucp_listener_h listener = nullptr;
  int worker_fd = -1;
  int event_fd = -1;
  int epoll_fd = -1;
  std::string bound;
  std::string worker_addr;  // "ucx:<hex>", set once at Create

  std::thread progress_thread;
  std::atomic<bool> stop_progress{false};

  std::mutex cmd_mu;
  std::deque<std::function<void()>> commands;  // guarded by cmd_mu

  // Progress-thread state.
  absl::flat_hash_map<std::string, ucp_ep_h> peers;      // client endpoints by address
  // Every live endpoint; a client endpoint by the address it is in `peers`
  // under (DropEndpoint removes it there by this name).
  absl::flat_hash_map<ucp_ep_h, std::string> ep_names;
  std::vector<void*> closing;                            // ep close requests in flight

  // Peers whose current client endpoint has carried a reply: requests to
  // them skip the connect probe. Written by the progress thread (a reply
  // arrives, an endpoint is dropped), read by callers.
  absl::Mutex answered_mu;
  absl::flat_hash_set<std::string> answered ABSL_GUARDED_BY(answered_mu);
  // Peers whose current client endpoint passed the handshake (with a secret).
  absl::flat_hash_set<std::string> authenticated ABSL_GUARDED_BY(answered_mu);
  // One lock per peer that callers hold while they handshake with it, so
  // concurrent first calls to a peer run one handshake, not one each.
  absl::flat_hash_map<std::string, std::shared_ptr<absl::Mutex>> handshake_locks ABSL_GUARDED_BY(answered_mu);

  // Server side of the handshake, by incoming endpoint (progress thread):
  // the challenges it answered and not yet saw proven (a few at once, for
  // clients that start several handshakes on one connection), and whether
  // the endpoint has authenticated.
  struct EpAuth {
    bool authenticated = false;
    std::deque<std::pair<AuthHello, AuthChallenge>> open;
  };
  static constexpr size_t kMaxOpenChallenges = 8;
  absl::flat_hash_map<ucp_ep_h, EpAuth> ep_auth;

  absl::Mutex pending_mu;
  absl::flat_hash_map<uint64_t, std::shared_ptr<Pending>> pending ABSL_GUARDED_BY(pending_mu);
  std::atomic<uint64_t> next_request_id{1};

  // Service pool.
  std::mutex svc_mu;
  std::condition_variable svc_cv;
  std::deque<std::function<void()>> svc_jobs;  // guarded by svc_mu
  bool svc_stop = false;                      // guarded by svc_mu
  std::vector<std::thread> svc_threads;

  struct Region {
    uintptr_t base;
    size_t bytes;
    ucp_mem_h memh;
  };
  std::mutex region_mu;
  std::vector<Region> regions;  // guarded by region_mu

  // --- plumbing ---
  void Post(std::function<void()> fn) {
    {
      std::lock_guard<std::mutex> lock(cmd_mu);
      commands.push_back(std::move(fn));
    }
    uint64_t one = 1;
    ssize_t n = ::write(event_fd, &one, sizeof(one));
    (void)n;
  }
  void Submit(std::function<void()> fn) {
    {
      std::lock_guard<std::mutex> lock(svc_mu);
      svc_jobs.push_back(std::move(fn));
    }
    svc_cv.notify_one();
  }
  ucp_mem_h FindMemh(const void* p, size_t n) {
    std::lock_guard<std::mutex> lock(region_mu);
    auto a = reinterpret_cast<uintptr_t>(p);
    for (const Region& r : regions) {
      if (a >= r.base && a + n <= r.base + r.bytes) return r.memh;
    }
    return nullptr;
  }

  void RunCommands() {
    std::deque<std::function<void()>> batch;
    {
      std::lock_guard<std::mutex> lock(cmd_mu);
      batch.swap(commands);
    }
    for (auto& fn : batch) fn();
  }

  bool HaveCommands() {
    std::lock_guard<std::mutex> lock(cmd_mu);
    return !commands.empty();
  }

  void ProgressLoop() {
    epoll_event evs[4];
    auto last_event = std::chrono::steady_clock::now();
    const auto spin = std::chrono::microseconds(options.spin_us);
    while (true) {
      bool busy = HaveCommands();
      RunCommands();
      while (ucp_worker_progress(worker) != 0) busy = true;
      if (stop_progress.load()) {
        if (!HaveCommands()) break;
        continue;
      }
      auto now = std::chrono::steady_clock::now();
      if (busy) last_event = now;
      if (now - last_event < spin) continue;
      ucs_status_t s = ucp_worker_arm(worker);
      if (s == UCS_ERR_BUSY) continue;
      int n = epoll_wait(epoll_fd, evs, 4, 50);
      for (int i = 0; i < n; ++i) {
        if (evs[i].data.fd == event_fd) {
          uint64_t v;
          ssize_t r = ::read(event_fd, &v, sizeof(v));
          (void)r;
        }
      }
    }
  }

  void ServiceLoop() {
    while (true) {
      std::function<void()> job;
      {
        std::unique_lock<std::mutex> lock(svc_mu);
        svc_cv.wait(lock, [&] { return svc_stop || !svc_jobs.empty(); });
        if (svc_jobs.empty()) return;
        job = std::move(svc_jobs.front());
        svc_jobs.pop_front();
      }
      job();
    }
  }

  // --- endpoints (progress thread) ---
  static void OnEpError(void* arg, ucp_ep_h ep, ucs_status_t status) {
    static_cast<Impl*>(arg)->DropEndpoint(ep, status);
  }

  // Closes `ep`: forcibly (what is in flight is cancelled), or, with
  // `flush`, after what was sent on it is delivered (a refusal's reply).
  void DropEndpoint(ucp_ep_h ep, ucs_status_t status, bool flush = false) {
    auto it = ep_names.find(ep);
    if (it == ep_names.end()) return;
    std::string name = it->second;
    ep_names.erase(it);
    ep_auth.erase(ep);
    auto pit = peers.find(name);
    if (pit != peers.end() && pit->second == ep) {
      peers.erase(pit);
      absl::MutexLock lock(&answered_mu);
      answered.erase(name);
      authenticated.erase(name);
    }
    // Requests still waiting for a reply on this endpoint will get none.
    std::vector<std::shared_ptr<Pending>> failed;
    {
      absl::MutexLock lock(&pending_mu);
      for (auto pit2 = pending.begin(); pit2 != pending.end();) {
        if (pit2->second->ep == ep) {
          failed.push_back(pit2->second);
          pending.erase(pit2++);
        } else {
          ++pit2;
        }
      }
    }
    for (auto& p : failed) {
      p->Complete(absl::UnavailableError(absl::StrCat("peer ", PrintablePeer(name), " closed the connection: ",
                                                      ucs_status_string(status))));
    }
    ucp_request_param_t prm{};
    prm.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    prm.flags = flush ? 0 : UCP_EP_CLOSE_FLAG_FORCE;
    void* req = ucp_ep_close_nbx(ep, &prm);
    if (UCS_PTR_IS_PTR(req)) closing.push_back(req);
  }

  absl::StatusOr<ucp_ep_h> Connect(const std::string& peer) {
    auto it = peers.find(peer);
    if (it != peers.end()) return it->second;
    if (peer.rfind("ucx:", 0) == 0) return ConnectWorker(peer);
    auto addr = ResolveHostPort(peer);
    if (!addr.ok()) return addr.status();
    ucp_ep_params_t ep{};
    ep.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR |
                    UCP_EP_PARAM_FIELD_ERR_HANDLER | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
    ep.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
    ep.sockaddr.addr = reinterpret_cast<const sockaddr*>(&*addr);
    ep.sockaddr.addrlen = SockaddrLen(*addr);
    ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    ep.err_handler.cb = &Impl::OnEpError;
    ep.err_handler.arg = this;
    ucp_ep_h h = nullptr;
    ucs_status_t s = ucp_ep_create(worker, &ep, &h);
    if (s != UCS_OK) return UcsError(absl::StrCat("connect to ", peer).c_str(), s);
    peers[peer] = h;
    ep_names[h] = peer;
    return h;
  }

  absl::StatusOr<ucp_ep_h> ConnectWorker(const std::string& peer) {
    std::string hex = peer.substr(4);
    if (hex.empty() || hex.size() % 2 != 0 || hex.size() > 65536 ||
        hex.find_first_not_of("0123456789abcdef") != std::string::npos) {
      return absl::InvalidArgumentError(absl::StrCat("peer '", peer.substr(0, 40),
                                                     "...' is not a ucx:<hex> worker address"));
    }
    std::vector<uint8_t> bytes(hex.size() / 2);
    for (size_t i = 0; i < bytes.size(); ++i) {
      bytes[i] = static_cast<uint8_t>(std::stoi(hex.substr(2 * i, 2), nullptr, 16));
    }
    ucp_ep_params_t ep{};
    ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLER |
                    UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
    ep.address = reinterpret_cast<const ucp_address_t*>(bytes.data());
    ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    ep.err_handler.cb = &Impl::OnEpError;
    ep.err_handler.arg = this;
    ucp_ep_h h = nullptr;
    ucs_status_t s = ucp_ep_create(worker, &ep, &h);
    if (s != UCS_OK) return UcsError("connect to a worker address", s);
    peers[peer] = h;
    ep_names[h] = peer;
    return h;
  }

  static void OnConnRequest(ucp_conn_request_h req, void* arg) {
    auto* self = static_cast<Impl*>(arg);
    ucp_ep_params_t ep{};
    ep.field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST | UCP_EP_PARAM_FIELD_ERR_HANDLER |
                    UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
    ep.conn_request = req;
    ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    ep.err_handler.cb = &Impl::OnEpError;
    ep.err_handler.arg = self;
    ucp_ep_h h = nullptr;
    if (ucp_ep_create(self->worker, &ep, &h) == UCS_OK) self->ep_names[h] = "incoming";
  }

  // --- sending (progress thread) ---
  struct SendCtx {
    Impl* impl;
    std::array<uint8_t, kWireHeaderSize> header;
    std::shared_ptr<Pending> pending;                   // requests
    std::unique_ptr<PeerService::GetSource> keepalive;  // replies carrying an object
    std::string text;                                   // replies carrying an error or a handshake
    ucp_ep_h close_after = nullptr;                     // a refusal: close once sent
  };

  static void OnSendDone(void* request, ucs_status_t status, void* user_data) {
    auto* ctx = static_cast<SendCtx*>(user_data);
    ctx->impl->FinishSend(ctx, status);
    ucp_request_free(request);
  }

  void FinishSend(SendCtx* ctx, ucs_status_t status) {
    if (ctx->pending) {
      {
        absl::MutexLock lock(&ctx->pending->mu);
        ctx->pending->send_done = true;
      }
      if (status != UCS_OK) {
        FailPending(ctx->pending, UcsError(absl::StrCat("send to ", PrintablePeer(ctx->pending->peer)).c_str(), status));
      }
    }
    if (ctx->close_after != nullptr) DropEndpoint(ctx->close_after, UCS_ERR_REJECTED, /*flush=*/true);
    delete ctx;
  }

  void FailPending(const std::shared_ptr<Pending>& p, absl::Status s) {
    {
      absl::MutexLock lock(&pending_mu);
      for (auto it = pending.begin(); it != pending.end(); ++it) {
        if (it->second == p) {
          pending.erase(it);
          break;
        }
      }
    }
    p->Complete(std::move(s));
  }

  // Sends one active message; `ctx` is consumed.
  void Send(ucp_ep_h ep, unsigned am_id, SendCtx* ctx, const void* payload, size_t len,
            bool want_reply) {
    ucp_request_param_t prm{};
    prm.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    prm.cb.send = &Impl::OnSendDone;
    prm.user_data = ctx;
    if (want_reply) {
      prm.op_attr_mask |= UCP_OP_ATTR_FIELD_FLAGS;
      prm.flags = UCP_AM_SEND_FLAG_REPLY;
    }
    if (len > 0) {
      if (ucp_mem_h memh = FindMemh(payload, len)) {
        prm.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
        prm.memh = memh;
      }
    }
    ucs_status_ptr_t r = ucp_am_send_nbx(ep, am_id, ctx->header.data(), kWireHeaderSize, payload,
                                         len, &prm);
    if (r == nullptr) {
      FinishSend(ctx, UCS_OK);
    } else if (UCS_PTR_IS_ERR(r)) {
      FinishSend(ctx, UCS_PTR_STATUS(r));
    }
  }

  void StartRequest(std::shared_ptr<Pending> p, uint64_t id, WireHeader h,
                    std::span<const uint8_t> payload) {
    auto ep = Connect(p->peer);
    if (!ep.ok()) {
      {
        absl::MutexLock lock(&pending_mu);
        pending.erase(id);
      }
      {
        absl::MutexLock lock(&p->mu);
        p->send_done = true;
      }
      p->Complete(ep.status());
      return;
    }
    p->ep = *ep;
    auto* ctx = new SendCtx{this, {}, p, nullptr, {}, nullptr};
    EncodeHeader(h, ctx->header);
    Send(*ep, kAmRequest, ctx, payload.data(), payload.size(), /*want_reply=*/true);
  }

  // Replies to `req` with `status` and, on success, `src`'s bytes or `body`.
  // With `close`, the connection is closed once the reply is sent.
  void SendReply(ucp_ep_h ep, const WireHeader& req, absl::Status status, uint64_t length,
                 std::unique_ptr<PeerService::GetSource> src, std::string body = {},
                 bool close = false) {
    if (!ep_names.contains(ep)) return;  // the requester is gone
    WireHeader h;
    h.op = req.op;
    h.reply = true;
    h.request_id = req.request_id;
    h.id = req.id;
    h.status = status.code();
    h.length = length;
    auto* ctx = new SendCtx{this, {}, nullptr, std::move(src), std::move(body), close ? ep : nullptr};
    const void* payload = nullptr;
    size_t len = 0;
    if (status.ok() && !ctx->text.empty()) {
      payload = ctx->text.data();
      len = ctx->text.size();
      h.length = len;
    } else if (!status.ok()) {
      ctx->text = std::string(status.message().substr(0, kMaxErrorMessage));
      payload = ctx->text.data();
      len = ctx->text.size();
      h.length = 0;
    } else if (ctx->keepalive) {
      payload = ctx->keepalive->bytes().data();
      len = ctx->keepalive->bytes().size();
    }
    EncodeHeader(h, ctx->header);
    Send(ep, kAmReply, ctx, payload, len, /*want_reply=*/false);
  }

  // --- receiving replies (progress thread) ---
  static ucs_status_t OnReply(void* arg, const void* header, size_t header_length, void* data,
                              size_t length, const ucp_am_recv_param_t* param) {
    return static_cast<Impl*>(arg)->HandleReply(header, header_length, data, length, param);
  }

  struct RecvCtx {
    Impl* impl;
    std::shared_ptr<Pending> pending;
  };
  static void OnRecvDone(void* request, ucs_status_t status, size_t length, void* user_data) {
    auto* ctx = static_cast<RecvCtx*>(user_data);
    if (status == UCS_OK) {
      ctx->pending->Complete(absl::OkStatus(), length);
    } else {
      ctx->pending->Complete(UcsError(absl::StrCat("receive from ", PrintablePeer(ctx->pending->peer)).c_str(), status));
    }
    delete ctx;
    ucp_request_free(request);
  }

  ucs_status_t HandleReply(const void* header, size_t header_length, void* data, size_t length,
                           const ucp_am_recv_param_t* param) {
    const bool rndv = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
    std::span<const uint8_t> hb(static_cast<const uint8_t*>(header), header_length);
    auto h = DecodeHeader(hb);
    uint64_t id = h.ok() ? h->request_id : PeekRequestId(hb);
    std::shared_ptr<Pending> p;
    {
      absl::MutexLock lock(&pending_mu);
      auto it = pending.find(id);
      if (it != pending.end()) {
        p = it->second;
        pending.erase(it);
      }
    }
    if (!p) {  // a reply to a request that timed out
      if (!rndv) return UCS_OK;
      Post([this, data] { ucp_am_data_release(worker, data); });
      return UCS_INPROGRESS;
    }
    if (auto it = peers.find(p->peer); it != peers.end() && it->second == p->ep) {
      absl::MutexLock lock(&answered_mu);
      answered.insert(p->peer);
    }
    auto release = [&] {
      if (rndv) Post([this, data] { ucp_am_data_release(worker, data); });
      return rndv ? UCS_INPROGRESS : UCS_OK;
    };
    if (!h.ok()) {
      p->Complete(absl::Status(h.status().code(), absl::StrCat("peer ", PrintablePeer(p->peer), ": ", h.status().message())));
      return release();
    }
    if (!h->reply || h->op != p->op) {
      p->Complete(absl::UnavailableError(absl::StrCat("peer ", PrintablePeer(p->peer), " sent a malformed reply")));
      return release();
    }
    if (h->status != absl::StatusCode::kOk) {
      // A refused handshake or an unauthenticated request: the peer closes
      // the connection after this reply, so drop it here first and let the
      // next call reconnect rather than find it half closed.
      if (h->status == absl::StatusCode::kUnauthenticated || h->op == Op::kHello || h->op == Op::kProof) {
        Post([this, ep = p->ep] { DropEndpoint(ep, UCS_ERR_REJECTED); });
      }
      std::string msg;
      if (!rndv) msg.assign(static_cast<const char*>(data), std::min(length, kMaxErrorMessage));
      p->Complete(absl::Status(h->status, absl::StrCat("peer ", PrintablePeer(p->peer), ": ", msg)));
      return release();
    }
    if (h->op == Op::kSize) {
      p->Complete(absl::OkStatus(), h->length);
      return release();
    }
    if (h->op == Op::kHello) {
      if (rndv || length > p->out.size()) {
        p->Complete(absl::InvalidArgumentError(absl::StrCat(
            "peer ", PrintablePeer(p->peer), ": handshake reply of ", length, " bytes (at most ",
            p->out.size(), ")")));
        return release();
      }
      std::memcpy(p->out.data(), data, length);
      p->Complete(absl::OkStatus(), length);
      return UCS_OK;
    }
    if (h->op != Op::kGet) {
      p->Complete(absl::OkStatus());
      return release();
    }
    if (length != p->out.size()) {
      p->Complete(absl::InvalidArgumentError(absl::StrCat(
          "peer ", PrintablePeer(p->peer), " returned ", length, " bytes, the buffer holds ", p->out.size())));
      return release();
    }
    if (!rndv) {
      std::memcpy(p->out.data(), data, length);
      p->Complete(absl::OkStatus(), length);
      return UCS_OK;
    }
    {
      absl::MutexLock lock(&p->mu);
      p->state = Pending::kReceiving;
    }
    Post([this, p, data, length] {
      ucp_request_param_t prm{};
      prm.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
      prm.cb.recv_am = &Impl::OnRecvDone;
      auto* ctx = new RecvCtx{this, p};
      prm.user_data = ctx;
      if (ucp_mem_h memh = FindMemh(p->out.data(), length)) {
        prm.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
        prm.memh = memh;
      }
      ucs_status_ptr_t r = ucp_am_recv_data_nbx(worker, data, p->out.data(), length, &prm);
      if (r == nullptr) {
        p->Complete(absl::OkStatus(), length);
        delete ctx;
      } else if (UCS_PTR_IS_ERR(r)) {
        p->Complete(UcsError("receive", UCS_PTR_STATUS(r)));
        delete ctx;
      }
    });
    return UCS_INPROGRESS;
  }

  // --- serving requests ---
  static ucs_status_t OnRequest(void* arg, const void* header, size_t header_length, void* data,
                                size_t length, const ucp_am_recv_param_t* param) {
    return static_cast<Impl*>(arg)->HandleRequest(header, header_length, data, length, param);
  }

  struct PutRecv {
    Impl* impl;
    ucp_ep_h ep;
    WireHeader req;
    std::shared_ptr<PeerService::PutSink> sink;
  };
  static void OnPutRecvDone(void* request, ucs_status_t status, size_t, void* user_data) {
    auto* ctx = static_cast<PutRecv*>(user_data);
    ctx->impl->FinishPutRecv(ctx, status == UCS_OK);
    ucp_request_free(request);
  }
  void FinishPutRecv(PutRecv* ctx, bool ok) {
    Submit([this, ctx, ok] {
      absl::Status s = ctx->sink->Commit(ok);
      if (!ok) s = absl::UnavailableError("transfer failed");
      ucp_ep_h ep = ctx->ep;
      WireHeader req = ctx->req;
      delete ctx;
      Post([this, ep, req, s] { SendReply(ep, req, s, 0, nullptr); });
    });
  }

  ucs_status_t HandleRequest(const void* header, size_t header_length, void* data, size_t length,
                             const ucp_am_recv_param_t* param) {
    const bool rndv = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
    auto release = [&] {
      if (rndv) Post([this, data] { ucp_am_data_release(worker, data); });
      return rndv ? UCS_INPROGRESS : UCS_OK;
    };
    if (!(param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP)) return release();
    ucp_ep_h ep = param->reply_ep;
    // A peer that connected by worker address reaches us on an endpoint UCX
    // created itself; remember it so replies go out on it.
    if (!ep_names.contains(ep)) ep_names[ep] = "worker-peer";
    std::span<const uint8_t> hb(static_cast<const uint8_t*>(header), header_length);
    auto h = DecodeHeader(hb);
    if (!h.ok()) {
      WireHeader bad;
      bad.request_id = PeekRequestId(hb);
      bad.op = header_length > kWireOffOp ? static_cast<Op>(static_cast<const uint8_t*>(header)[kWireOffOp]) : Op::kPing;
      SendReply(ep, bad, h.status(), 0, nullptr);
      return release();
    }
    WireHeader req = *h;
    if (req.reply) {
      SendReply(ep, req, absl::InvalidArgumentError("a reply was sent as a request"), 0, nullptr);
      return release();
    }
    if (req.op == Op::kPing) {
      SendReply(ep, req, absl::OkStatus(), 0, nullptr);
      return release();
    }
    if (req.op == Op::kHello || req.op == Op::kProof) {
      if (rndv || length != req.length || length > kMaxAuthMessageBytes) {
        RefuseAuth(ep, req, absl::InvalidArgumentError(absl::StrCat(
                                "peer handshake: message of ", length, " bytes (at most ",
                                kMaxAuthMessageBytes, ")")));
        return release();
      }
      if (!auth) {
        RefuseAuth(ep, req, absl::FailedPreconditionError(
                                "this node has no cluster secret and cannot authenticate"));
        return UCS_OK;
      }
      std::span<const uint8_t> body(static_cast<const uint8_t*>(data), length);
      if (req.op == Op::kHello) {
        HandleHello(ep, req, body);
      } else {
        HandleProof(ep, req, body);
      }
      return UCS_OK;
    }
    if (auth && !(ep_auth.contains(ep) && ep_auth[ep].authenticated)) {
      RefuseAuth(ep, req, absl::UnauthenticatedError(
                              "this node requires cluster authentication (--cluster-secret-file) "
                              "before any chunk operation"));
      return release();
    }
    if (service == nullptr) {
      SendReply(ep, req, absl::UnavailableError("this node serves no objects"), 0, nullptr);
      return release();
    }
    switch (req.op) {
      case Op::kPut: {
        if (length > options.max_object_bytes || length != req.length) {
          SendReply(ep, req,
                    absl::InvalidArgumentError(absl::StrCat("put of ", length, " bytes (header says ",
                                                            req.length, ", limit ",
                                                            options.max_object_bytes, ")")),
                    0, nullptr);
          return release();
        }
        if (rndv) {
          Submit([this, ep, req, data, length] {
            auto sink = service->BeginPut(req.id, length);
            if (!sink.ok()) {
              absl::Status s = sink.status();
              Post([this, ep, req, data, s] {
                ucp_am_data_release(worker, data);
                SendReply(ep, req, s, 0, nullptr);
              });
              return;
            }
            auto* ctx = new PutRecv{this, ep, req, std::shared_ptr<PeerService::PutSink>(std::move(*sink))};
            Post([this, ctx, data, length] {
              ucp_request_param_t prm{};
              prm.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
              prm.cb.recv_am = &Impl::OnPutRecvDone;
              prm.user_data = ctx;
              auto buf = ctx->sink->buffer();
              if (ucp_mem_h memh = FindMemh(buf.data(), length)) {
                prm.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
                prm.memh = memh;
              }
              ucs_status_ptr_t r = ucp_am_recv_data_nbx(worker, data, buf.data(), length, &prm);
              if (r == nullptr) {
                FinishPutRecv(ctx, true);
              } else if (UCS_PTR_IS_ERR(r)) {
                FinishPutRecv(ctx, false);
              }
            });
          });
          return UCS_INPROGRESS;
        }
        auto copy = std::make_shared<std::vector<uint8_t>>(static_cast<const uint8_t*>(data),
                                                           static_cast<const uint8_t*>(data) + length);
        Submit([this, ep, req, copy] {
          absl::Status s;
          auto sink = service->BeginPut(req.id, copy->size());
          if (!sink.ok()) {
            s = sink.status();
          } else {
            std::memcpy((*sink)->buffer().data(), copy->data(), copy->size());
            s = (*sink)->Commit(true);
          }
          Post([this, ep, req, s] { SendReply(ep, req, s, 0, nullptr); });
        });
        return UCS_OK;
      }
      case Op::kGet:
        Submit([this, ep, req] {
          auto src = service->BeginGet(req.id);
          if (!src.ok()) {
            absl::Status s = src.status();
            Post([this, ep, req, s] { SendReply(ep, req, s, 0, nullptr); });
            return;
          }
          auto holder = std::make_shared<std::unique_ptr<PeerService::GetSource>>(std::move(*src));
          Post([this, ep, req, holder] {
            uint64_t n = (*holder)->bytes().size();
            SendReply(ep, req, absl::OkStatus(), n, std::move(*holder));
          });
        });
        return release();
      case Op::kSize:
        Submit([this, ep, req] {
          auto n = service->Size(req.id);
          absl::Status s = n.status();
          uint64_t v = n.ok() ? *n : 0;
          Post([this, ep, req, s, v] { SendReply(ep, req, s, v, nullptr); });
        });
        return release();
      case Op::kErase:
        Submit([this, ep, req] {
          absl::Status s = service->Erase(req.id);
          Post([this, ep, req, s] { SendReply(ep, req, s, 0, nullptr); });
        });
        return release();
      default:
        return release();
    }
  }

  // Destroys the listener and force-closes every endpoint (what is in flight
  // on them is cancelled), and returns once the closes have finished.
  // REQUIRES: the progress thread runs, and this is not it.
  void CloseAll() {
    std::promise<void> closed;
    Post([this, &closed] {
      if (listener) {
        ucp_listener_destroy(listener);
        listener = nullptr;
      }
      std::vector<ucp_ep_h> eps;
      for (auto& [ep, name] : ep_names) eps.push_back(ep);
      for (ucp_ep_h ep : eps) DropEndpoint(ep, UCS_ERR_CANCELED);
      // Wait for the close requests (and the sends/receives they cancel).
      while (!closing.empty()) {
        ucp_worker_progress(worker);
        for (auto it = closing.begin(); it != closing.end();) {
          if (ucp_request_check_status(*it) != UCS_INPROGRESS) {
            ucp_request_free(*it);
            it = closing.erase(it);
          } else {
            ++it;
          }
        }
      }
      closed.set_value();
    });
    closed.get_future().wait();
  }

  bool Answered(const std::string& peer) {
    absl::MutexLock lock(&answered_mu);
    return answered.contains(peer);
  }

  // --- the handshake, server side (progress thread) ---
  // Counts a failed handshake, refuses `req` with `s` and closes `ep`.
  void RefuseAuth(ucp_ep_h ep, const WireHeader& req, absl::Status s) {
    auth_failures.fetch_add(1);
    SendReply(ep, req, std::move(s), 0, nullptr, {}, /*close=*/true);
  }

  // REQUIRES: auth.
  void HandleHello(ucp_ep_h ep, const WireHeader& req, std::span<const uint8_t> body) {
    auto hello = DecodeHello(body);
    if (!hello.ok()) return RefuseAuth(ep, req, hello.status());
    if (!nonces.Insert(hello->client_nonce)) {
      return RefuseAuth(ep, req, absl::InvalidArgumentError(
                                     "peer handshake: replayed nonce (a recorded hello was sent again)"));
    }
    auto challenge = auth->Answer(*hello);
    if (!challenge.ok()) return RefuseAuth(ep, req, challenge.status());
    std::vector<uint8_t> reply = EncodeChallenge(*challenge);
    EpAuth& st = ep_auth[ep];
    st.open.emplace_back(*std::move(hello), *std::move(challenge));
    if (st.open.size() > kMaxOpenChallenges) st.open.pop_front();
    SendReply(ep, req, absl::OkStatus(), 0, nullptr, std::string(reply.begin(), reply.end()));
  }

  // REQUIRES: auth.
  void HandleProof(ucp_ep_h ep, const WireHeader& req, std::span<const uint8_t> body) {
    auto proof = DecodeProof(body);
    if (!proof.ok()) return RefuseAuth(ep, req, proof.status());
    auto it = ep_auth.find(ep);
    if (it != ep_auth.end()) {
      auto& open = it->second.open;
      for (auto o = open.begin(); o != open.end(); ++o) {
        if (o->first.client_nonce != proof->client_nonce) continue;
        absl::Status v = auth->Verify(o->first, o->second, *proof);
        open.erase(o);
        if (!v.ok()) return RefuseAuth(ep, req, v);
        it->second.authenticated = true;
        it->second.open.clear();
        auth_successes.fetch_add(1);
        SendReply(ep, req, absl::OkStatus(), 0, nullptr);
        return;
      }
    }
    RefuseAuth(ep, req, absl::UnauthenticatedError(
                            "peer handshake: a proof for no challenge this connection was sent"));
  }

  // --- the handshake, client side (caller thread) ---
  absl::StatusOr<std::vector<uint8_t>> AuthCall(const std::string& peer, Op op,
                                                std::span<const uint8_t> payload, absl::Duration timeout) {
    std::vector<uint8_t> reply(kMaxAuthMessageBytes);
    KVTIER_ASSIGN_OR_RETURN(uint64_t n, Call(peer, op, tiering::ObjectKey{}, payload, reply, timeout));
    reply.resize(op == Op::kHello ? n : 0);
    return reply;
  }

  absl::Status Handshake(const std::string& peer, absl::Duration timeout) {
    KVTIER_ASSIGN_OR_RETURN(AuthHello hello, auth->NewHello());
    const std::vector<uint8_t> hello_bytes = EncodeHello(hello);
    auto challenge_bytes = AuthCall(peer, Op::kHello, hello_bytes, timeout);
    if (!challenge_bytes.ok()) {
      if (!absl::IsUnavailable(challenge_bytes.status())) auth_failures.fetch_add(1);
      return challenge_bytes.status();
    }
    auto challenge = DecodeChallenge(*challenge_bytes);
    absl::StatusOr<AuthProof> proof =
        challenge.ok() ? auth->Prove(hello, *challenge) : absl::StatusOr<AuthProof>(challenge.status());
    if (!proof.ok()) {
      auth_failures.fetch_add(1);
      Post([this, peer] {
        if (auto it = peers.find(peer); it != peers.end()) DropEndpoint(it->second, UCS_ERR_REJECTED);
      });
      return absl::Status(proof.status().code(),
                          absl::StrCat("peer ", PrintablePeer(peer), ": ", proof.status().message()));
    }
    const std::vector<uint8_t> proof_bytes = EncodeProof(*proof);
    auto done = AuthCall(peer, Op::kProof, proof_bytes, timeout);
    if (!done.ok()) {
      if (!absl::IsUnavailable(done.status())) auth_failures.fetch_add(1);
      return done.status();
    }
    auth_successes.fetch_add(1);
    absl::MutexLock lock(&answered_mu);
    authenticated.insert(peer);
    return absl::OkStatus();
  }

  // --- a whole request from a caller thread ---
  absl::StatusOr<uint64_t> Call(const std::string& peer, Op op, const tiering::ObjectKey& id,
                                std::span<const uint8_t> payload, std::span<uint8_t> out,
                                absl::Duration timeout, uint16_t version = kWireVersion) {
    if (stop_progress.load()) return absl::UnavailableError("transport is shutting down");
    if (auth && IsChunkOp(op)) {
      std::shared_ptr<absl::Mutex> handshake_lock;
      {
        absl::MutexLock lock(&answered_mu);
        if (!authenticated.contains(peer)) {
          auto& l = handshake_locks[peer];
          if (l == nullptr) l = std::make_shared<absl::Mutex>();
          handshake_lock = l;
        }
      }
      if (handshake_lock != nullptr) {
        absl::MutexLock serial(handshake_lock.get());
        bool done;
        {
          absl::MutexLock lock(&answered_mu);
          done = authenticated.contains(peer);  // another caller's handshake finished
        }
        // The handshake also probes a new connection, bounded as the ping is.
        if (!done) {
          const absl::Duration t = options.connect_timeout > absl::ZeroDuration()
                                       ? std::min(timeout, options.connect_timeout)
                                       : timeout;
          KVTIER_RETURN_IF_ERROR(Handshake(peer, t));
        }
      }
    } else if (IsChunkOp(op) && options.connect_timeout > absl::ZeroDuration() && !Answered(peer)) {
      // A new connection: make sure someone answers before waiting on a
      // request (and its payload) for the whole timeout.
      auto probe = Call(peer, Op::kPing, tiering::ObjectKey{}, {}, {}, std::min(timeout, options.connect_timeout));
      if (!probe.ok()) return probe.status();
    }
    auto p = std::make_shared<Pending>();
    p->op = op;
    p->peer = peer;
    p->out = out;
    uint64_t rid = next_request_id.fetch_add(1);
    WireHeader h;
    h.version = version;
    h.op = op;
    h.request_id = rid;
    h.id = id;
    h.length = op == Op::kGet || op == Op::kSize ? out.size() : payload.size();
    {
      absl::MutexLock lock(&pending_mu);
      pending[rid] = p;
    }
    Post([this, p, rid, h, payload] { StartRequest(p, rid, h, payload); });
    absl::Time deadline = absl::Now() + timeout;
    bool done;
    {
      absl::MutexLock lock(&p->mu);
      done = p->mu.AwaitWithDeadline(
          absl::Condition(+[](Pending* q) ABSL_NO_THREAD_SAFETY_ANALYSIS { return q->state == Pending::kDone; }, p.get()),
          deadline);
    }
    if (!done) {
      // Give up on the reply. A receive already writing into `out` must end
      // before we return, and so must a send still reading `payload`: close
      // the endpoint so UCX cancels both.
      bool need_close;
      {
        absl::MutexLock lock(&pending_mu);
        pending.erase(rid);
      }
      {
        absl::MutexLock lock(&p->mu);
        need_close = p->state == Pending::kReceiving || !p->send_done;
      }
      if (need_close) {
        Post([this, p] {
          if (p->ep != nullptr) DropEndpoint(p->ep, UCS_ERR_TIMED_OUT);
        });
      }
      absl::MutexLock lock(&p->mu);
      if (p->state == Pending::kReceiving || !p->send_done) {
        p->mu.Await(absl::Condition(+[](Pending* q) ABSL_NO_THREAD_SAFETY_ANALYSIS {
          return (q->state != Pending::kReceiving) && q->send_done;
        }, p.get()));
      }
      if (p->state != Pending::kDone) {
        p->state = Pending::kDone;
        p->status = absl::UnavailableError(absl::StrCat("peer ", PrintablePeer(peer), " did not answer within ",
                                                        absl::FormatDuration(timeout)));
      }
      if (p->status.ok()) return p->value;  // it finished while we closed
      return p->status;
    }
    // A put's payload may still be in flight even after the reply (it cannot
    // in practice: the peer replies after receiving it), so wait for the send.
    absl::MutexLock lock(&p->mu);
    p->mu.Await(absl::Condition(+[](Pending* q) ABSL_NO_THREAD_SAFETY_ANALYSIS { return q->send_done; }, p.get()));
    if (!p->status.ok()) return p->status;
    return p->value;
  }
};

UcxTransport::UcxTransport(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

absl::StatusOr<std::unique_ptr<UcxTransport>> UcxTransport::Create(
    const UcxTransportOptions& options, PeerService* service) {
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  impl->service = service;
  if (!options.cluster_secret.empty()) {
    std::string id = !options.node_id.empty() ? options.node_id
                     : !options.listen.empty() ? options.listen
                                               : "client";
    KVTIER_ASSIGN_OR_RETURN(PeerAuthenticator a, PeerAuthenticator::Create(options.cluster_secret, id));
    impl->auth.emplace(std::move(a));
  }
  std::optional<sockaddr_storage> listen_addr;
  if (!options.listen.empty()) {
    auto hp = ParseHostPort(options.listen);
    if (!hp.ok()) return hp.status();
    auto a = ResolveHostPort(options.listen);
    if (!a.ok()) return a.status();
    listen_addr = *a;
  }
  ucp_config_t* config = nullptr;
  ucs_status_t s = ucp_config_read(nullptr, nullptr, &config);
  if (s != UCS_OK) return UcsError("ucp_config_read", s);
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_NAME;
  params.features = UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
  params.name = "kvtier";
  s = ucp_init(&params, config, &impl->context);
  ucp_config_release(config);
  if (s != UCS_OK) return UcsError("ucp_init", s);
  ucp_worker_params_t wp{};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wp.thread_mode = UCS_THREAD_MODE_SINGLE;
  s = ucp_worker_create(impl->context, &wp, &impl->worker);
  if (s != UCS_OK) {
    ucp_cleanup(impl->context);
    return UcsError("ucp_worker_create", s);
  }
  // From here on the destructor of UcxTransport releases what exists.
  std::unique_ptr<UcxTransport> t(new UcxTransport(std::move(impl)));
  Impl* m = t->impl_.get();
  for (auto [id, cb] : {std::pair{kAmRequest, &Impl::OnRequest}, std::pair{kAmReply, &Impl::OnReply}}) {
    ucp_am_handler_param_t hp{};
    hp.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                    UCP_AM_HANDLER_PARAM_FIELD_ARG | UCP_AM_HANDLER_PARAM_FIELD_FLAGS;
    hp.id = id;
    hp.cb = cb;
    hp.arg = m;
    hp.flags = UCP_AM_FLAG_WHOLE_MSG;
    s = ucp_worker_set_am_recv_handler(m->worker, &hp);
    if (s != UCS_OK) return UcsError("ucp_worker_set_am_recv_handler", s);
  }
  {
    ucp_address_t* addr = nullptr;
    size_t len = 0;
    s = ucp_worker_get_address(m->worker, &addr, &len);
    if (s != UCS_OK) return UcsError("ucp_worker_get_address", s);
    static constexpr char kHex[] = "0123456789abcdef";
    m->worker_addr = "ucx:";
    const auto* p = reinterpret_cast<const uint8_t*>(addr);
    for (size_t i = 0; i < len; ++i) {
      m->worker_addr.push_back(kHex[p[i] >> 4]);
      m->worker_addr.push_back(kHex[p[i] & 0xF]);
    }
    ucp_worker_release_address(m->worker, addr);
  }
  s = ucp_worker_get_efd(m->worker, &m->worker_fd);
  if (s != UCS_OK) return UcsError("ucp_worker_get_efd", s);
  m->event_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  m->epoll_fd = epoll_create1(EPOLL_CLOEXEC);
  if (m->event_fd < 0 || m->epoll_fd < 0) return absl::UnavailableError("eventfd/epoll failed");
  for (int fd : {m->worker_fd, m->event_fd}) {
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.fd = fd;
    epoll_ctl(m->epoll_fd, EPOLL_CTL_ADD, fd, &ev);
  }
  if (listen_addr) {
    ucp_listener_params_t lp{};
    lp.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER;
    lp.sockaddr.addr = reinterpret_cast<const sockaddr*>(&*listen_addr);
    lp.sockaddr.addrlen = SockaddrLen(*listen_addr);
    lp.conn_handler.cb = &Impl::OnConnRequest;
    lp.conn_handler.arg = m;
    s = ucp_listener_create(m->worker, &lp, &m->listener);
    if (s != UCS_OK) return UcsError(absl::StrCat("listen on ", options.listen).c_str(), s);
    ucp_listener_attr_t attr{};
    attr.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR;
    s = ucp_listener_query(m->listener, &attr);
    if (s != UCS_OK) return UcsError("ucp_listener_query", s);
    m->bound = SockaddrToString(attr.sockaddr);
    // Report the host the caller asked for (a bound wildcard says nothing).
    auto asked = ParseHostPort(options.listen);
    auto got = ParseHostPort(m->bound);
    if (asked.ok() && got.ok()) {
      m->bound = absl::StrCat(asked->first.find(':') != std::string::npos ? "[" + asked->first + "]"
                                                                          : asked->first,
                              ":", got->second);
    }
  }
  for (int i = 0; i < std::max(1, options.service_threads); ++i) {
    m->svc_threads.emplace_back([m] { m->ServiceLoop(); });
  }
  m->progress_thread = std::thread([m] { m->ProgressLoop(); });
  return t;
}

UcxTransport::~UcxTransport() {
  Impl* m = impl_.get();
  if (m->progress_thread.joinable()) {
    {
      std::lock_guard<std::mutex> lock(m->svc_mu);
      m->svc_stop = true;
    }
    m->svc_cv.notify_all();
    for (auto& t : m->svc_threads) t.join();
    m->CloseAll();
    m->stop_progress = true;
    m->Post([] {});
    m->progress_thread.join();
    std::vector<std::shared_ptr<Pending>> left;
    {
      absl::MutexLock lock(&m->pending_mu);
      for (auto& [id, p] : m->pending) left.push_back(p);
      m->pending.clear();
    }
    for (auto& p : left) p->Complete(absl::UnavailableError("transport shut down"));
  }
  {
    std::lock_guard<std::mutex> lock(m->region_mu);
    for (auto& r : m->regions) ucp_mem_unmap(m->context, r.memh);
  }
  if (m->epoll_fd >= 0) ::close(m->epoll_fd);
  if (m->event_fd >= 0) ::close(m->event_fd);
  if (m->listener) ucp_listener_destroy(m->listener);
  if (m->worker) ucp_worker_destroy(m->worker);
  if (m->context) ucp_cleanup(m->context);
}

std::string UcxTransport::listen_address() const { return impl_->bound; }

std::string UcxTransport::worker_address() const { return impl_->worker_addr; }

absl::Status UcxTransport::RegisterMemory(void* data, size_t bytes) {
  ucp_mem_map_params_t mp{};
  mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
  mp.address = data;
  mp.length = bytes;
  ucp_mem_h memh = nullptr;
  ucs_status_t s = ucp_mem_map(impl_->context, &mp, &memh);
  if (s != UCS_OK) return UcsError("ucp_mem_map", s);
  std::lock_guard<std::mutex> lock(impl_->region_mu);
  impl_->regions.push_back({reinterpret_cast<uintptr_t>(data), bytes, memh});
  return absl::OkStatus();
}

absl::Status UcxTransport::Put(const std::string& peer, const tiering::ObjectKey& id,
                               std::span<const uint8_t> bytes, absl::Duration timeout) {
  return impl_->Call(peer, Op::kPut, id, bytes, {}, timeout).status();
}

absl::StatusOr<uint64_t> UcxTransport::Size(const std::string& peer, const tiering::ObjectKey& id,
                                            absl::Duration timeout) {
  return impl_->Call(peer, Op::kSize, id, {}, {}, timeout);
}

absl::Status UcxTransport::Get(const std::string& peer, const tiering::ObjectKey& id,
                               std::span<uint8_t> out, absl::Duration timeout) {
  return impl_->Call(peer, Op::kGet, id, {}, out, timeout).status();
}

absl::Status UcxTransport::Erase(const std::string& peer, const tiering::ObjectKey& id,
                                 absl::Duration timeout) {
  return impl_->Call(peer, Op::kErase, id, {}, {}, timeout).status();
}

absl::Status UcxTransport::Ping(const std::string& peer, absl::Duration timeout) {
  return impl_->Call(peer, Op::kPing, tiering::ObjectKey{}, {}, {}, timeout).status();
}

void UcxTransport::DropAllConnections() { impl_->CloseAll(); }

uint64_t UcxTransport::auth_failures() const { return impl_->auth_failures.load(); }

uint64_t UcxTransport::auth_successes() const { return impl_->auth_successes.load(); }

absl::StatusOr<std::vector<uint8_t>> UcxTransport::SendAuthMessage(const std::string& peer, Op op,
                                                                   std::span<const uint8_t> payload,
                                                                   absl::Duration timeout) {
  if (op != Op::kHello && op != Op::kProof) return absl::InvalidArgumentError("not a handshake op");
  return impl_->AuthCall(peer, op, payload, timeout);
}

absl::Status UcxTransport::PingWithVersion(const std::string& peer, uint16_t version,
                                           absl::Duration timeout) {
  return impl_->Call(peer, Op::kPing, tiering::ObjectKey{}, {}, {}, timeout, version).status();
}

}  // namespace kvtier::cluster
