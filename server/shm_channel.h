// The shared-memory side channel: a Unix socket (owner-only, beside the gRPC
// socket) on which the daemon passes the DRAM pool's memfd to same-host
// clients with SCM_RIGHTS (docs/daemon.md "Shared-memory data plane").
//
// Wire format, server -> client, one message per connection:
//   u64 little-endian pool size, with the memfd as SCM_RIGHTS ancillary data.
// Peers whose uid (SO_PEERCRED) differs from the daemon's are closed without
// an answer.
#ifndef KVTIER_SERVER_SHM_CHANNEL_H_
#define KVTIER_SERVER_SHM_CHANNEL_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "server/metrics.h"

namespace kvtier::server {

// Thread-safe; one background thread accepts and answers.
class ShmChannel {
 public:
  // Listens on `path` (replacing a stale socket file) with mode 0600 and
  // passes `fd` (not owned; must outlive the channel) to each client.
  static absl::StatusOr<std::unique_ptr<ShmChannel>> Start(const std::string& path, int fd,
                                                           uint64_t size, ServerMetrics* metrics);
  // Stops the thread, closes and unlinks the socket.
  ~ShmChannel();

  const std::string& path() const { return path_; }

 private:
  ShmChannel(std::string path, int listen_fd, int stop_fd[2], int fd, uint64_t size,
             ServerMetrics* metrics);
  void Loop();

  const std::string path_;
  const int listen_fd_;
  int stop_pipe_[2];
  const int fd_;
  const uint64_t size_;
  ServerMetrics* const metrics_;
  std::thread thread_;
};

// Binds and listens on a Unix socket at `path` with mode 0600 (an existing
// socket file is replaced). Returns the listening fd.
absl::StatusOr<int> ListenUnixOwnerOnly(const std::string& path);

}  // namespace kvtier::server

#endif  // KVTIER_SERVER_SHM_CHANNEL_H_
