// kvtierd's Prometheus endpoint: GET (or HEAD) /metrics answers the text
// exposition format 0.0.4; any other path is 404, any other method on
// /metrics is 405. HTTP is cpp-httplib's (parsing, keep-alive, gzip or brotli
// when the scraper accepts it, the accept loop and a fixed worker pool); the
// limits of MetricsHttpOptions are enforced on every connection, so that slow,
// stalled, oversized or numerous clients can neither hold the workers nor
// grow the daemon's memory or file descriptors without bound.
#ifndef KVTIER_SERVER_HTTP_METRICS_H_
#define KVTIER_SERVER_HTTP_METRICS_H_

#include <chrono>
#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <utility>

#include "absl/status/statusor.h"

namespace kvtier::server {

// Limits of the metrics endpoint. Whatever a client does, a worker is free
// again within read_timeout + write_timeout (plus the render) of taking up one
// of its requests, and within read_timeout if the client never completes a
// request (stalled or trickling). So when `threads` such clients take every
// worker, a scrape that arrives behind them waits at most read_timeout
// (k * read_timeout behind k * threads of them), and a connection beyond
// max_connections is answered 503.
struct MetricsHttpOptions {
  // Worker threads; each serves one connection at a time. Default: 4
  int threads = 4;
  // Connections held open at once: served by a worker or waiting for one, in
  // arrival order. One more is answered 503 (without reading its request) and
  // closed at once. Default: 32
  int max_connections = 32;
  // A request's line and headers must be complete within this time of a
  // worker taking up the connection, or of the previous response on a
  // kept-alive connection (so it is also the longest a connection idles).
  // It is a total, not a per-read timeout: a client trickling bytes is closed
  // at the deadline too, answered 408 if its request line had arrived.
  // Default: 5 s
  std::chrono::milliseconds read_timeout{5000};
  // A response must be written within this time, or the connection is closed.
  // Default: 5 s
  std::chrono::milliseconds write_timeout{5000};
  // Requests served on one connection; the last answer says
  // "Connection: close". Default: 5
  int keep_alive_max_requests = 5;
  // Most bytes of a request line and headers together. A larger request is
  // answered 431 (414 when the request line alone passes 8 KiB, httplib's
  // limit) and its connection closed. Request bodies are never read: a
  // request that has one is answered and its connection closed.
  // Default: 16 KiB
  size_t max_header_bytes = 16 << 10;
};

// Owns the listening socket, httplib's accept thread and the worker pool.
// Start and the destructor are called from one thread; port() from any.
class MetricsHttpServer {
 public:
  // Listens on "HOST:PORT" ("[::1]:0" for IPv6; port 0 picks a free port)
  // and serves until destroyed. `render` returns the exposition text; it is
  // called on a worker thread for each GET or HEAD of /metrics, never by two
  // threads at once, so a slow render holds up the other scrapes.
  // InvalidArgument for a malformed or unresolvable address or bad options;
  // FailedPrecondition if the address cannot be bound (in use, not local).
  static absl::StatusOr<std::unique_ptr<MetricsHttpServer>> Start(const std::string& host_port,
                                                                  std::function<std::string()> render,
                                                                  const MetricsHttpOptions& options = {});
  // Stops accepting, closes every open connection (including one in the
  // middle of a request or response) and joins all threads, without waiting
  // on any client (only on a `render` call in progress); `render` is not
  // called afterwards.
  ~MetricsHttpServer();

  MetricsHttpServer(const MetricsHttpServer&) = delete;
  MetricsHttpServer& operator=(const MetricsHttpServer&) = delete;

  // The bound port (the one picked when the address said 0).
  int port() const { return port_; }

 private:
  class Impl;
  MetricsHttpServer(int port, std::unique_ptr<Impl> impl);

  const int port_;
  std::unique_ptr<Impl> impl_;
  std::thread thread_;  // httplib's accept loop
};

// Splits "HOST:PORT" ("[::1]:80" for IPv6); an empty host is 0.0.0.0.
// InvalidArgument if malformed.
absl::StatusOr<std::pair<std::string, int>> SplitHostPort(const std::string& host_port);

}  // namespace kvtier::server

#endif  // KVTIER_SERVER_HTTP_METRICS_H_
