// The shared-memory side channel: a Unix socket (owner-only, beside the gRPC
// socket) on which the daemon passes the DRAM pool's memfd to same-host
// clients with SCM_RIGHTS, then serves the data plane on the same
// connection. Its wire format is specified in wire/DATA_PLANE.md, the
// payload layouts in wire/shm_frames.h.
#ifndef KVTIER_SERVER_SHM_CHANNEL_H_
#define KVTIER_SERVER_SHM_CHANNEL_H_

#include <sys/socket.h>
#include <sys/uio.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <list>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "wire/shm_frames.h"

namespace kvtier::server {

class KvService;
class ServerMetrics;
class Tenant;
class TenantRegistry;


struct ShmChannelOptions {
  // Most data-plane connections served at once (one daemon thread each); a
  // client beyond them gets the pool but no data plane (it uses gRPC).
  // Default: 64
  int max_connections = 64;
  // Most slots and leases one connection may hold open at once; beyond it
  // kAllocate and kGet get ResourceExhausted. Default: 1024
  size_t max_open_per_connection = 1024;
  // How long the rest of a frame may take once its first byte arrived, and
  // how long an answer may wait for room in the socket (a client that does
  // not read its answers); then the connection is closed. Default: 5000
  int frame_timeout_ms = 5000;
  // After answering a frame, a connection's thread polls for the next one
  // this long before it sleeps: a client's next request usually follows
  // within microseconds, and a sleeping thread's wakeup costs tens of them
  // (more on a VM). Default: 20
  int64_t spin_us = 20;
  // The same between the frames of a put, whose progress messages come one
  // piece's copy apart (1 MiB, about 100 us). Default: 300
  int64_t put_spin_us = 300;
  // Threads that check one put: 2 hashes its V section on a helper thread of
  // the connection while the connection's thread hashes K (the client copies
  // them interleaved, kPutRange), 1 hashes both on the connection's thread.
  // 0 picks 2 on hosts with at least 4 hardware threads, else 1: a put then
  // keeps three cores busy (the client's copy and two hashes). Default: 0
  int put_check_threads = 0;
  // The daemon's tenants (not owned; must outlive the channel). With a
  // tenants file the data plane serves a connection as the tenant its
  // kHelloTenant names, else as the tenant of its peer's uid; a connection
  // of neither is refused (Unauthenticated) at its first request.
  // Default: nullptr (one tenant, keys as sent)
  const TenantRegistry* tenants = nullptr;
};

// ShmChannelOptions::put_check_threads as the daemon applies it: 0 is 2 on
// hosts with at least 4 hardware threads, else 1.
int ResolvePutCheckThreads(int option);

// Thread-safe; one background thread accepts, and one thread per data-plane
// connection serves it (a DataPlaneConnection, data_plane_connection.h).
class ShmChannel {
 public:
  // Listens on `path` (replacing a stale socket file) with mode 0600 and
  // passes `fd` (not owned; must outlive the channel) to each client. With
  // a `service` (not owned; must outlive the channel) it also serves the
  // data-plane protocol; without one it closes each connection after the
  // descriptor.
  static absl::StatusOr<std::unique_ptr<ShmChannel>> Start(const std::string& path, int fd,
                                                           uint64_t size, ServerMetrics* metrics,
                                                           KvService* service = nullptr,
                                                           ShmChannelOptions options = {});
  // Stops accepting, closes every data-plane connection (freeing what it
  // held), joins the threads, closes and unlinks the socket.
  ~ShmChannel();

  const std::string& path() const { return path_; }
  // Data-plane connections being served now.
  int connections();

 private:
  struct Conn;
  ShmChannel(std::string path, int listen_fd, int stop_fd[2], int fd, uint64_t size,
             ServerMetrics* metrics, KvService* service, ShmChannelOptions options);
  void Loop();
  // Registers `c` and serves it on a new thread, which first passes the pool;
  // false (and `c` untouched) at the connection limit or while stopping.
  bool Adopt(int c, const Tenant* tenant);
  // Passes the pool's size and memfd (SCM_RIGHTS) to `c`.
  bool SendPool(int c);
  void Serve(Conn* conn);
  void ReapFinished() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::string path_;
  const int listen_fd_;
  int stop_pipe_[2];
  const int fd_;
  const uint64_t size_;
  ServerMetrics* const metrics_;
  KvService* const service_;
  const ShmChannelOptions options_;
  const int put_check_threads_;  // options_.put_check_threads, resolved
  std::unique_ptr<TenantRegistry> default_tenants_;  // when options_.tenants is null
  const TenantRegistry* tenants_;
  absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::list<std::unique_ptr<Conn>> conns_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;
};

// Binds and listens on a Unix socket at `path` with mode 0600 (an existing
// socket file is replaced). Returns the listening fd.
absl::StatusOr<int> ListenUnixOwnerOnly(const std::string& path);

}  // namespace kvtier::server

#endif  // KVTIER_SERVER_SHM_CHANNEL_H_
