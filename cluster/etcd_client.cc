#include "cluster/etcd_client.h"

#include <atomic>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "grpcpp/grpcpp.h"
#include "cluster/etcd_rpc.grpc.pb.h"

namespace kvtier::cluster {
namespace {

absl::Status FromGrpc(const grpc::Status& s, const std::string& what) {
  std::string msg = absl::StrCat("etcd ", what, ": ", s.error_message());
  switch (s.error_code()) {
    case grpc::StatusCode::OK:
      return absl::OkStatus();
    case grpc::StatusCode::NOT_FOUND:
      return absl::NotFoundError(msg);
    case grpc::StatusCode::INVALID_ARGUMENT:
      return absl::InvalidArgumentError(msg);
    case grpc::StatusCode::FAILED_PRECONDITION:
      return absl::FailedPreconditionError(msg);
    case grpc::StatusCode::RESOURCE_EXHAUSTED:
      return absl::ResourceExhaustedError(msg);
    case grpc::StatusCode::CANCELLED:
      return absl::CancelledError(msg);
    case grpc::StatusCode::PERMISSION_DENIED:
    case grpc::StatusCode::UNAUTHENTICATED:
      return absl::PermissionDeniedError(msg);
    default:
      return absl::UnavailableError(msg);
  }
}

// etcd answers a missing lease with NOT_FOUND "requested lease not found".
bool LeaseMissing(const grpc::Status& s) {
  return s.error_code() == grpc::StatusCode::NOT_FOUND ||
         s.error_message().find("lease not found") != std::string::npos;
}

// The first key after every key with `prefix` (etcd's range_end for a prefix).
std::string PrefixEnd(const std::string& prefix) {
  std::string end = prefix;
  for (int i = static_cast<int>(end.size()) - 1; i >= 0; --i) {
    if (static_cast<uint8_t>(end[i]) < 0xFF) {
      end[i] = static_cast<char>(static_cast<uint8_t>(end[i]) + 1);
      end.resize(i + 1);
      return end;
    }
  }
  return std::string(1, '\0');  // every key
}

EtcdKeyValue ToDomain(const etcdserverpb::KeyValue& kv) {
  return EtcdKeyValue{kv.key(), kv.value(), kv.lease(), kv.mod_revision()};
}

class GrpcWatch : public EtcdWatch {
 public:
  ~GrpcWatch() override {
    Cancel();
    if (thread_.joinable()) thread_.join();
  }
  void Cancel() override { context_.TryCancel(); }

  grpc::ClientContext context_;
  std::thread thread_;
};

class GrpcEtcdClient : public EtcdClient {
 public:
  GrpcEtcdClient(std::vector<std::string> endpoints, const EtcdClientOptions& options)
      : timeout_(options.timeout), user_(options.user), password_(options.password) {
    std::shared_ptr<grpc::ChannelCredentials> creds = grpc::InsecureChannelCredentials();
    if (!options.ca.empty()) {
      grpc::SslCredentialsOptions ssl;
      ssl.pem_root_certs = options.ca;
      ssl.pem_cert_chain = options.cert;
      ssl.pem_private_key = options.key;
      creds = grpc::SslCredentials(ssl);
    }
    for (const auto& e : endpoints) {
      Endpoint ep;
      ep.address = e;
      ep.channel = grpc::CreateChannel(e, creds);
      ep.kv = etcdserverpb::KV::NewStub(ep.channel);
      ep.lease = etcdserverpb::Lease::NewStub(ep.channel);
      ep.watch = etcdserverpb::Watch::NewStub(ep.channel);
      ep.auth = etcdserverpb::Auth::NewStub(ep.channel);
      endpoints_.push_back(std::move(ep));
    }
  }

  absl::StatusOr<int64_t> Put(const std::string& key, const std::string& value,
                              int64_t lease) override {
    etcdserverpb::PutRequest req;
    req.set_key(key);
    req.set_value(value);
    req.set_lease(lease);
    etcdserverpb::PutResponse resp;
    auto s = Call("put", [&](Endpoint& ep, grpc::ClientContext* c) { return ep.kv->Put(c, req, &resp); });
    if (!s.ok()) return s;
    return resp.header().revision();
  }

  absl::StatusOr<std::pair<std::vector<EtcdKeyValue>, int64_t>> GetPrefix(
      const std::string& prefix) override {
    etcdserverpb::RangeRequest req;
    req.set_key(prefix);
    req.set_range_end(PrefixEnd(prefix));
    etcdserverpb::RangeResponse resp;
    auto s = Call("range", [&](Endpoint& ep, grpc::ClientContext* c) { return ep.kv->Range(c, req, &resp); });
    if (!s.ok()) return s;
    std::vector<EtcdKeyValue> out;
    for (const auto& kv : resp.kvs()) out.push_back(ToDomain(kv));
    return std::make_pair(std::move(out), resp.header().revision());
  }

  absl::StatusOr<int64_t> Delete(const std::string& key) override {
    etcdserverpb::DeleteRangeRequest req;
    req.set_key(key);
    etcdserverpb::DeleteRangeResponse resp;
    auto s = Call("delete", [&](Endpoint& ep, grpc::ClientContext* c) {
      return ep.kv->DeleteRange(c, req, &resp);
    });
    if (!s.ok()) return s;
    return resp.deleted();
  }

  absl::StatusOr<int64_t> LeaseGrant(int64_t ttl_s) override {
    etcdserverpb::LeaseGrantRequest req;
    req.set_ttl(ttl_s);
    etcdserverpb::LeaseGrantResponse resp;
    auto s = Call("lease grant", [&](Endpoint& ep, grpc::ClientContext* c) {
      return ep.lease->LeaseGrant(c, req, &resp);
    });
    if (!s.ok()) return s;
    if (!resp.error().empty()) return absl::UnavailableError(absl::StrCat("etcd lease grant: ", resp.error()));
    return resp.id();
  }

  absl::Status LeaseRevoke(int64_t id) override {
    etcdserverpb::LeaseRevokeRequest req;
    req.set_id(id);
    etcdserverpb::LeaseRevokeResponse resp;
    grpc::Status last;
    auto s = Call("lease revoke", [&](Endpoint& ep, grpc::ClientContext* c) {
      last = ep.lease->LeaseRevoke(c, req, &resp);
      return last;
    });
    if (!s.ok() && LeaseMissing(last)) return absl::NotFoundError("lease not found");
    return s;
  }

  absl::StatusOr<int64_t> LeaseKeepAlive(int64_t id) override {
    etcdserverpb::LeaseKeepAliveResponse resp;
    auto s = Call("lease keepalive", [&](Endpoint& ep, grpc::ClientContext* c) {
      auto stream = ep.lease->LeaseKeepAlive(c);
      etcdserverpb::LeaseKeepAliveRequest req;
      req.set_id(id);
      if (!stream->Write(req)) return stream->Finish();
      stream->WritesDone();
      if (!stream->Read(&resp)) return stream->Finish();
      c->TryCancel();
      (void)stream->Finish();
      return grpc::Status::OK;
    });
    if (!s.ok()) return s;
    if (resp.ttl() <= 0) return absl::NotFoundError(absl::StrCat("lease ", id, " expired"));
    return resp.ttl();
  }

  absl::StatusOr<int64_t> LeaseTimeToLive(int64_t id) override {
    etcdserverpb::LeaseTimeToLiveRequest req;
    req.set_id(id);
    etcdserverpb::LeaseTimeToLiveResponse resp;
    auto s = Call("lease ttl", [&](Endpoint& ep, grpc::ClientContext* c) {
      return ep.lease->LeaseTimeToLive(c, req, &resp);
    });
    if (!s.ok()) return s;
    if (resp.ttl() < 0) return absl::NotFoundError(absl::StrCat("lease ", id, " expired"));
    return resp.ttl();
  }

  absl::StatusOr<std::unique_ptr<EtcdWatch>> WatchPrefix(
      const std::string& prefix, int64_t start_revision,
      std::function<void(const std::vector<EtcdEvent>&)> on_events,
      std::function<void(const absl::Status&)> on_end) override {
    Endpoint& ep = endpoints_[current_.load() % endpoints_.size()];
    auto w = std::make_unique<GrpcWatch>();
    if (!user_.empty()) {
      auto token = Token(ep, /*renew=*/false);
      if (!token.ok()) return token.status();
      w->context_.AddMetadata("token", *token);
    }
    auto stream = std::shared_ptr<grpc::ClientReaderWriter<etcdserverpb::WatchRequest,
                                                           etcdserverpb::WatchResponse>>(
        ep.watch->Watch(&w->context_));
    etcdserverpb::WatchRequest req;
    auto* create = req.mutable_create_request();
    create->set_key(prefix);
    create->set_range_end(PrefixEnd(prefix));
    create->set_start_revision(start_revision);
    if (!stream->Write(req)) {
      grpc::Status s = stream->Finish();
      return FromGrpc(s.ok() ? grpc::Status(grpc::StatusCode::UNAVAILABLE, "stream closed") : s,
                      "watch");
    }
    GrpcWatch* raw = w.get();
    w->thread_ = std::thread([stream, raw, on_events = std::move(on_events),
                              on_end = std::move(on_end)] {
      etcdserverpb::WatchResponse resp;
      absl::Status end;
      while (stream->Read(&resp)) {
        if (resp.canceled()) {
          end = absl::UnavailableError(absl::StrCat("etcd watch canceled: ", resp.cancel_reason(),
                                                    resp.compact_revision() ? " (compacted)" : ""));
          raw->context_.TryCancel();
          break;
        }
        if (resp.events_size() == 0) continue;
        std::vector<EtcdEvent> events;
        for (const auto& e : resp.events()) {
          events.push_back({e.type() == etcdserverpb::Event::DELETE, ToDomain(e.kv())});
        }
        on_events(events);
      }
      grpc::Status s = stream->Finish();
      if (end.ok()) {
        end = s.error_code() == grpc::StatusCode::CANCELLED
                  ? absl::CancelledError("watch cancelled")
                  : FromGrpc(s.ok() ? grpc::Status(grpc::StatusCode::UNAVAILABLE, "watch stream ended") : s,
                             "watch");
      }
      on_end(end);
    });
    return std::unique_ptr<EtcdWatch>(std::move(w));
  }

 private:
  struct Endpoint {
    std::string address;
    std::shared_ptr<grpc::Channel> channel;
    std::unique_ptr<etcdserverpb::KV::Stub> kv;
    std::unique_ptr<etcdserverpb::Lease::Stub> lease;
    std::unique_ptr<etcdserverpb::Watch::Stub> watch;
    std::unique_ptr<etcdserverpb::Auth::Stub> auth;
  };

  void SetDeadline(grpc::ClientContext* ctx) const {
    ctx->set_deadline(std::chrono::system_clock::now() +
                      std::chrono::microseconds(absl::ToInt64Microseconds(timeout_)));
  }

  // The auth token for `ep`'s etcd: the one held, or (none held, or
  // `renew`) a new one from Authenticate. PermissionDenied for a wrong user
  // or password.
  absl::StatusOr<std::string> Token(Endpoint& ep, bool renew) {
    {
      absl::MutexLock lock(&token_mu_);
      if (!renew && !token_.empty()) return token_;
    }
    etcdserverpb::AuthenticateRequest req;
    req.set_name(user_);
    req.set_password(password_);
    etcdserverpb::AuthenticateResponse resp;
    grpc::ClientContext ctx;
    SetDeadline(&ctx);
    grpc::Status s = ep.auth->Authenticate(&ctx, req, &resp);
    if (!s.ok()) return FromGrpc(s, absl::StrCat("authenticate as '", user_, "'"));
    absl::MutexLock lock(&token_mu_);
    token_ = resp.token();
    return token_;
  }

  // One call of `fn` on `ep`, with the auth token when the client has a
  // user; an expired or revoked token is renewed once.
  grpc::Status CallOne(Endpoint& ep, const std::function<grpc::Status(Endpoint&, grpc::ClientContext*)>& fn) {
    for (int attempt = 0;; ++attempt) {
      grpc::ClientContext ctx;
      SetDeadline(&ctx);
      if (!user_.empty()) {
        auto token = Token(ep, /*renew=*/attempt > 0);
        if (!token.ok()) {
          return grpc::Status(absl::IsUnavailable(token.status()) ? grpc::StatusCode::UNAVAILABLE
                                                                  : grpc::StatusCode::PERMISSION_DENIED,
                              std::string(token.status().message()));
        }
        ctx.AddMetadata("token", *token);
      }
      grpc::Status s = fn(ep, &ctx);
      if (attempt == 0 && !user_.empty() && s.error_code() == grpc::StatusCode::UNAUTHENTICATED) continue;
      return s;
    }
  }

  // Runs `fn` against the endpoints, starting with the last one that worked,
  // moving on while they are unavailable.
  absl::Status Call(const char* what,
                    const std::function<grpc::Status(Endpoint&, grpc::ClientContext*)>& fn) {
    size_t n = endpoints_.size();
    size_t start = current_.load();
    grpc::Status last;
    for (size_t i = 0; i < n; ++i) {
      size_t idx = (start + i) % n;
      last = CallOne(endpoints_[idx], fn);
      if (last.error_code() != grpc::StatusCode::UNAVAILABLE &&
          last.error_code() != grpc::StatusCode::DEADLINE_EXCEEDED) {
        current_ = idx;
        break;
      }
    }
    return FromGrpc(last, what);
  }

  const absl::Duration timeout_;
  const std::string user_;
  const std::string password_;
  absl::Mutex token_mu_;
  std::string token_ ABSL_GUARDED_BY(token_mu_);
  std::vector<Endpoint> endpoints_;
  std::atomic<size_t> current_{0};
};

}  // namespace

absl::StatusOr<std::vector<std::string>> ParseEtcdEndpoints(const std::string& list) {
  std::vector<std::string> out;
  size_t num_https = 0;
  for (absl::string_view part : absl::StrSplit(list, ',', absl::SkipWhitespace())) {
    std::string e(absl::StripAsciiWhitespace(part));
    const bool https = e.rfind("https://", 0) == 0;
    if (https) {
      e = e.substr(8);
      ++num_https;
    } else if (e.rfind("http://", 0) == 0) {
      e = e.substr(7);
    }
    while (!e.empty() && e.back() == '/') e.pop_back();
    size_t colon = e.rfind(':');
    if (e.empty() || colon == std::string::npos || colon == 0 || colon + 1 == e.size() ||
        e.find_first_not_of("0123456789", colon + 1) != std::string::npos ||
        e.find('/') != std::string::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat("etcd endpoint '", std::string(part), "' is not http(s)://host:port"));
    }
    out.push_back(https ? "https://" + e : e);
  }
  if (out.empty()) return absl::InvalidArgumentError("no etcd endpoint given");
  if (num_https != 0 && num_https != out.size()) {
    return absl::InvalidArgumentError("etcd endpoints mix http:// and https://");
  }
  return out;
}

absl::StatusOr<std::unique_ptr<EtcdClient>> EtcdClient::Connect(const std::vector<std::string>& endpoints,
                                                                const EtcdClientOptions& options) {
  std::vector<std::string> parsed;
  for (const auto& e : endpoints) {
    auto p = ParseEtcdEndpoints(e);
    if (!p.ok()) return p.status();
    for (std::string& h : *p) {
      const bool https = h.rfind("https://", 0) == 0;
      if (https && options.ca.empty()) {
        return absl::InvalidArgumentError(absl::StrCat("etcd endpoint ", h, " needs a CA (--etcd-ca)"));
      }
      if (!https && !options.ca.empty()) {
        return absl::InvalidArgumentError(
            absl::StrCat("etcd endpoint ", h, " is plaintext but a CA is given: use https://"));
      }
      parsed.push_back(https ? h.substr(8) : h);
    }
  }
  if (parsed.empty()) return absl::InvalidArgumentError("no etcd endpoint given");
  if (options.cert.empty() != options.key.empty()) {
    return absl::InvalidArgumentError("an etcd client certificate needs its key, and a key its certificate");
  }
  if (options.user.empty() != options.password.empty()) {
    return absl::InvalidArgumentError("an etcd user needs a password, and a password a user");
  }
  return std::unique_ptr<EtcdClient>(new GrpcEtcdClient(std::move(parsed), options));
}

}  // namespace kvtier::cluster
