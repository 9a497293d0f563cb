// A minimal HTTP/1.0 server for Prometheus scrapes: GET /metrics answers the
// text exposition, anything else 404. One background thread, one request per
// connection, 1 s read timeout; a slow or hostile peer cannot block it long.
#ifndef KVTIER_SERVER_HTTP_METRICS_H_
#define KVTIER_SERVER_HTTP_METRICS_H_

#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"

namespace kvtier::server {

class MetricsHttpServer {
 public:
  // Listens on "HOST:PORT" (port 0 picks a free port). `render` is called on
  // the server thread for each scrape.
  static absl::StatusOr<std::unique_ptr<MetricsHttpServer>> Start(
      const std::string& host_port, std::function<std::string()> render);
  ~MetricsHttpServer();

  int port() const { return port_; }

 private:
  MetricsHttpServer(int fd, int port, int stop[2], std::function<std::string()> render);
  void Loop();
  void Serve(int conn);

  const int fd_;
  const int port_;
  int stop_pipe_[2];
  std::function<std::string()> render_;
  std::thread thread_;
};

// Splits "HOST:PORT" ("[::1]:80" for IPv6). InvalidArgument if malformed.
absl::StatusOr<std::pair<std::string, int>> SplitHostPort(const std::string& host_port);

}  // namespace kvtier::server

#endif  // KVTIER_SERVER_HTTP_METRICS_H_
