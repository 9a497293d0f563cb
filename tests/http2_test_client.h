// A deliberately misbehaving HTTP/2 client for the daemon's fault tests,
// built on nghttp2: it starts gRPC calls whose bodies never come, and it can
// refuse the server every byte of flow-control window, so that the server's
// answers cannot be sent. Single-threaded; every wait is bounded.
#ifndef KVTIER_TESTS_HTTP2_TEST_CLIENT_H_
#define KVTIER_TESTS_HTTP2_TEST_CLIENT_H_

#include <nghttp2/nghttp2.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace kvtier::testing {

class Http2TestClient {
 public:
  struct Options {
    // The initial flow-control window this client grants each stream; 0
    // lets the server send headers and trailers but no message bytes.
    uint32_t initial_window = 65535;
    // Send WINDOW_UPDATEs as data is received (a well-behaved reader).
    bool grant_window = true;
  };
  // One call's outcome as far as this client has seen it.
  struct CallState {
    std::optional<int> grpc_status;  // from the trailers
    bool closed = false;             // END_STREAM or RST_STREAM seen
    uint32_t reset_code = 0;         // RST_STREAM error code, if reset
    size_t body_bytes = 0;           // DATA bytes received
  };

  // Connects to a Unix socket path or to 127.0.0.1:`port` and sends the
  // connection preface; nullptr on failure.
  static std::unique_ptr<Http2TestClient> ConnectUnix(const std::string& path, Options o) {
    int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_un a{};
    a.sun_family = AF_UNIX;
    std::strncpy(a.sun_path, path.c_str(), sizeof(a.sun_path) - 1);
    return Finish(fd, ::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), o);
  }
  static std::unique_ptr<Http2TestClient> ConnectTcp(int port, Options o) {
    int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<uint16_t>(port));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    return Finish(fd, ::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), o);
  }

  ~Http2TestClient() {
    nghttp2_session_del(session_);
    ::close(fd_);
  }

  // Starts a call of kvtier.proto.v1.Kvtier/`method` with extra `metadata`.
  // With a `message` (a serialized request), the body is that one message
  // and the call's half-close; without, the body never comes. Returns the
  // stream id, or -1.
  int32_t StartCall(const std::string& method,
                    const std::vector<std::pair<std::string, std::string>>& metadata,
                    std::optional<std::string> message) {
    std::vector<std::pair<std::string, std::string>> h = {
        {":method", "POST"}, {":scheme", "http"},
        {":path", "/kvtier.proto.v1.Kvtier/" + method}, {":authority", "localhost"},
        {"content-type", "application/grpc"}, {"te", "trailers"}};
    h.insert(h.end(), metadata.begin(), metadata.end());
    std::vector<nghttp2_nv> nv;
    for (auto& [k, v] : h) {
      nv.push_back({reinterpret_cast<uint8_t*>(k.data()), reinterpret_cast<uint8_t*>(v.data()),
                    k.size(), v.size(), NGHTTP2_NV_FLAG_NONE});
    }
    auto body = std::make_unique<Body>();
    if (message) {
      body->bytes.push_back(0);  // not compressed
      const uint32_t n = static_cast<uint32_t>(message->size());
      for (int s = 24; s >= 0; s -= 8) body->bytes.push_back(static_cast<char>((n >> s) & 0xff));
      body->bytes += *message;
      body->complete = true;
    }
    nghttp2_data_provider dp;
    dp.source.ptr = body.get();
    dp.read_callback = &Http2TestClient::ReadBody;
    const int32_t id = nghttp2_submit_request(session_, nullptr, nv.data(), nv.size(), &dp, nullptr);
    if (id < 0) return -1;
    bodies_[id] = std::move(body);
    calls_[id];
    Flush();
    return id;
  }

  // Exchanges frames until `done()` holds or `timeout` passes; true if it held.
  template <typename Pred>
  bool PumpUntil(Pred done, std::chrono::milliseconds timeout) {
    const auto until = std::chrono::steady_clock::now() + timeout;
    while (!done()) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          until - std::chrono::steady_clock::now());
      if (left.count() <= 0 || broken_) return done();
      pollfd p{fd_, POLLIN, 0};
      if (::poll(&p, 1, static_cast<int>(std::min<int64_t>(left.count(), 50))) > 0) {
        uint8_t buf[16384];
        const ssize_t n = ::recv(fd_, buf, sizeof(buf), 0);
        if (n <= 0 || nghttp2_session_mem_recv(session_, buf, static_cast<size_t>(n)) < 0) {
          broken_ = true;
        }
      }
      Flush();
    }
    return true;
  }
  // Exchanges frames for `d` (to let the server see what was sent).
  void Pump(std::chrono::milliseconds d) {
    PumpUntil([] { return false; }, d);
  }

  const CallState& call(int32_t id) { return calls_[id]; }
  // True once the server closed the connection (or it broke).
  bool broken() const { return broken_; }

 private:
  struct Body {
    std::string bytes;
    size_t sent = 0;
    bool complete = false;  // false: the rest never comes
  };

  explicit Http2TestClient(int fd) : fd_(fd) {}

  static std::unique_ptr<Http2TestClient> Finish(int fd, int connect_rc, Options o) {
    if (fd < 0) return nullptr;
    if (connect_rc != 0) {
      ::close(fd);
      return nullptr;
    }
    std::unique_ptr<Http2TestClient> c(new Http2TestClient(fd));
    nghttp2_session_callbacks* cb;
    nghttp2_session_callbacks_new(&cb);
    nghttp2_session_callbacks_set_send_callback(cb, &Http2TestClient::Send);
    nghttp2_session_callbacks_set_on_header_callback(cb, &Http2TestClient::OnHeader);
    nghttp2_session_callbacks_set_on_stream_close_callback(cb, &Http2TestClient::OnClose);
    nghttp2_session_callbacks_set_on_data_chunk_recv_callback(cb, &Http2TestClient::OnData);
    nghttp2_option* opt;
    nghttp2_option_new(&opt);
    nghttp2_option_set_no_auto_window_update(opt, o.grant_window ? 0 : 1);
    nghttp2_session_client_new2(&c->session_, cb, c.get(), opt);
    nghttp2_option_del(opt);
    nghttp2_session_callbacks_del(cb);
    nghttp2_settings_entry s[] = {{NGHTTP2_SETTINGS_INITIAL_WINDOW_SIZE, o.initial_window},
                                  {NGHTTP2_SETTINGS_ENABLE_PUSH, 0}};
    nghttp2_submit_settings(c->session_, NGHTTP2_FLAG_NONE, s, 2);
    c->Flush();
    return c;
  }

  void Flush() {
    if (!broken_ && nghttp2_session_send(session_) != 0) broken_ = true;
  }

  static ssize_t Send(nghttp2_session*, const uint8_t* data, size_t n, int, void* self) {
    auto* c = static_cast<Http2TestClient*>(self);
    size_t sent = 0;
    while (sent < n) {
      const ssize_t k = ::send(c->fd_, data + sent, n - sent, MSG_NOSIGNAL);
      if (k <= 0) return NGHTTP2_ERR_CALLBACK_FAILURE;
      sent += static_cast<size_t>(k);
    }
    return static_cast<ssize_t>(n);
  }
  static ssize_t ReadBody(nghttp2_session*, int32_t, uint8_t* buf, size_t len, uint32_t* flags,
                          nghttp2_data_source* src, void*) {
    auto* b = static_cast<Body*>(src->ptr);
    if (!b->complete) return NGHTTP2_ERR_DEFERRED;
    const size_t n = std::min(len, b->bytes.size() - b->sent);
    std::memcpy(buf, b->bytes.data() + b->sent, n);
    b->sent += n;
    if (b->sent == b->bytes.size()) *flags |= NGHTTP2_DATA_FLAG_EOF;
    return static_cast<ssize_t>(n);
  }
  static int OnHeader(nghttp2_session*, const nghttp2_frame* f, const uint8_t* name, size_t nlen,
                      const uint8_t* value, size_t vlen, uint8_t, void* self) {
    auto* c = static_cast<Http2TestClient*>(self);
    if (std::string(reinterpret_cast<const char*>(name), nlen) == "grpc-status") {
      c->calls_[f->hd.stream_id].grpc_status =
          std::stoi(std::string(reinterpret_cast<const char*>(value), vlen));
    }
    return 0;
  }
  static int OnClose(nghttp2_session*, int32_t id, uint32_t code, void* self) {
    auto* c = static_cast<Http2TestClient*>(self);
    c->calls_[id].closed = true;
    c->calls_[id].reset_code = code;
    return 0;
  }
  static int OnData(nghttp2_session*, uint8_t, int32_t id, const uint8_t*, size_t len, void* self) {
    static_cast<Http2TestClient*>(self)->calls_[id].body_bytes += len;
    return 0;
  }

  const int fd_;
  nghttp2_session* session_ = nullptr;
  bool broken_ = false;
  std::map<int32_t, std::unique_ptr<Body>> bodies_;
  std::map<int32_t, CallState> calls_;
};

}  // namespace kvtier::testing

#endif  // KVTIER_TESTS_HTTP2_TEST_CLIENT_H_
