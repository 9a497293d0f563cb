// The TCP listener's accept loop, owned by the daemon instead of gRPC: it
// binds and listens, accepts each connection itself and hands the socket to
// gRPC (grpc::experimental::ExternalConnectionAcceptor, with the listener's
// credentials, TLS included). gRPC's own accept loop (iomgr's
// tcp_server_posix in 1.51) stops a listener for good at the first accept
// error other than EAGAIN, ECONNABORTED or EINTR, so one moment without a
// free descriptor (EMFILE) would end the listener; this loop waits and
// accepts again instead, and bounds the connections it serves, in all and
// per peer address, so that the connections of the TCP listener alone
// cannot use up the daemon's descriptors (docs/daemon.md "Descriptor
// limits").
#ifndef KVTIER_SERVER_TCP_ACCEPTOR_H_
#define KVTIER_SERVER_TCP_ACCEPTOR_H_

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace kvtier::server {

struct TcpAcceptorOptions {
  // Most connections served at once; a connection beyond them is closed as
  // soon as it is accepted. Default: 4096
  int max_connections = 4096;
  // Most connections served at once from one peer IP address (an IPv4
  // address mapped into IPv6 counts as the IPv4 one); a connection beyond
  // them is closed as soon as it is accepted. Default: 256
  int max_connections_per_peer = 256;
  // After accept fails for want of descriptors or memory (EMFILE, ENFILE,
  // ENOBUFS, ENOMEM) or for another reason, the loop waits this long before
  // the next accept, doubling per failure in a row up to max_backoff_ms.
  // Default: 10
  int min_backoff_ms = 10;
  // Default: 1000
  int max_backoff_ms = 1000;
};

// Thread-safe. One thread accepts. A connection counts until its socket is
// gone: the loop keeps each handed-off socket's descriptor number with its
// inode, and a connection whose descriptor no longer refers to that socket
// (gRPC closed it) no longer counts. It checks them once a second, and
// before it refuses a connection at a limit (at most every 20 ms, so that a
// flood of refused connections costs one pass per period).
class TcpAcceptor {
 public:
  // Gets each accepted socket (non-blocking, close-on-exec, TCP_NODELAY)
  // and owns it from then on; called on the accept thread.
  using Handoff = std::function<void(int fd)>;

  // Binds and listens on `host_port` ("HOST:PORT", "[V6]:PORT"; port 0
  // picks one; a host name binds its first address). InvalidArgument for a
  // malformed address, FailedPrecondition if it cannot be bound.
  static absl::StatusOr<std::unique_ptr<TcpAcceptor>> Listen(const std::string& host_port,
                                                             TcpAcceptorOptions options);
  // Stops the loop and closes the listening socket; the connections handed
  // off stay with their owner.
  ~TcpAcceptor();

  // Starts the accept thread. REQUIRES: called once.
  void Start(Handoff handoff);
  // Stops accepting (joins the thread); connections that then arrive wait in
  // the backlog until the destructor closes it. Idempotent.
  void Stop();

  int port() const { return port_; }
  int listen_fd() const { return listen_fd_; }
  // Connections counted now (checked first).
  int connections();
  // Connections closed at once for a limit, and accept calls that failed,
  // since Listen.
  uint64_t refused() const { return refused_.load(); }
  uint64_t accept_failures() const { return accept_failures_.load(); }

 private:
  struct Conn {
    int fd;
    dev_t dev;
    ino_t ino;
    std::string peer;  // the peer's address bytes
  };
  TcpAcceptor(int listen_fd, int port, int stop_pipe[2], TcpAcceptorOptions options);
  void Loop(Handoff handoff);
  // Drops the connections whose descriptor no longer refers to their socket.
  void Sweep() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Waits `ms` or until Stop; false if stopping.
  bool Pause(int ms);

  const int listen_fd_;
  const int port_;
  int stop_pipe_[2];
  const TcpAcceptorOptions options_;
  std::thread thread_;
  std::atomic<uint64_t> refused_{0};
  std::atomic<uint64_t> accept_failures_{0};
  absl::Mutex mu_;
  std::vector<Conn> conns_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, int> per_peer_ ABSL_GUARDED_BY(mu_);
};

// Raises the soft RLIMIT_NOFILE to the hard limit (capped at
// /proc/sys/fs/nr_open when the hard limit is unlimited) and returns the
// soft limit now in force. Internal if getrlimit fails; a refused raise
// keeps the old limit and is not an error.
absl::StatusOr<uint64_t> RaiseFdLimitToHard();
// The soft RLIMIT_NOFILE now.
uint64_t FdLimit();
// Descriptors this process has open now (/proc/self/fd).
int OpenFdCount();

}  // namespace kvtier::server

#endif  // KVTIER_SERVER_TCP_ACCEPTOR_H_
