// Helpers for the remote tier's tests: an in-memory PeerService (a map from
// object id to bytes, with knobs to make it slow (gets and sizes), hold its
// gets until a test releases them, or refuse puts), and a listener that never
// answers.
#ifndef KVTIER_CLUSTER_TEST_PEER_H_
#define KVTIER_CLUSTER_TEST_PEER_H_

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "cluster/transport.h"

namespace kvtier::cluster::testing {

class MapPeerService : public PeerService {
 public:
  class Sink : public PutSink {
   public:
    Sink(MapPeerService* s, tiering::ObjectKey id, uint64_t n) : s_(s), id_(id), buf_(n) {}
    std::span<uint8_t> buffer() override { return buf_; }
    absl::Status Commit(bool ok) override {
      if (!ok) return absl::OkStatus();
      absl::MutexLock lock(&s_->mu_);
      s_->objects_[id_] = std::move(buf_);
      return absl::OkStatus();
    }

   private:
    MapPeerService* s_;
    tiering::ObjectKey id_;
    std::vector<uint8_t> buf_;
  };
  class Source : public GetSource {
   public:
    explicit Source(std::vector<uint8_t> b) : b_(std::move(b)) {}
    std::span<const uint8_t> bytes() override { return b_; }

   private:
    std::vector<uint8_t> b_;
  };

  absl::StatusOr<std::unique_ptr<PutSink>> BeginPut(const tiering::ObjectKey& id, uint64_t bytes) override {
    if (bytes > capacity_) return absl::ResourceExhaustedError("test peer is full");
    return std::unique_ptr<PutSink>(new Sink(this, id, bytes));
  }
  absl::StatusOr<std::unique_ptr<GetSource>> BeginGet(const tiering::ObjectKey& id) override {
    gets_begun_.fetch_add(1);
    if (delay_ms_ > 0) std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms_));
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(&gets_open_));
    gets_past_delay_.fetch_add(1);
    auto it = objects_.find(id);
    if (it == objects_.end()) return absl::NotFoundError("no such object");
    return std::unique_ptr<GetSource>(new Source(it->second));
  }
  absl::StatusOr<uint64_t> Size(const tiering::ObjectKey& id) override {
    if (delay_ms_ > 0) std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms_));
    absl::MutexLock lock(&mu_);
    auto it = objects_.find(id);
    if (it == objects_.end()) return absl::NotFoundError("no such object");
    return it->second.size();
  }
  absl::Status Erase(const tiering::ObjectKey& id) override {
    absl::MutexLock lock(&mu_);
    return objects_.erase(id) ? absl::OkStatus() : absl::NotFoundError("no such object");
  }
  size_t count() {
    absl::MutexLock lock(&mu_);
    return objects_.size();
  }
  bool Has(const tiering::ObjectKey& id) {
    absl::MutexLock lock(&mu_);
    return objects_.contains(id);
  }
  void Corrupt(const tiering::ObjectKey& id) {
    absl::MutexLock lock(&mu_);
    auto it = objects_.find(id);
    if (it != objects_.end() && !it->second.empty()) it->second.back() ^= 0xFF;
  }
  void set_delay_ms(int ms) { delay_ms_ = ms; }

  // While a hold lives (one at a time), gets that reach the service wait
  // (counted in gets_begun(), not in gets_past_delay()) until it is
  // released: the test acts while a get is known to be in flight and
  // unanswered, however slow the machine. A transport's destructor waits for
  // the service calls it runs, so release the hold before the server goes
  // (declare it after the server, and a failing assertion releases it first
  // too).
  class [[nodiscard]] GetHold {
   public:
    explicit GetHold(MapPeerService* s) : s_(s) { s_->SetGetsOpen(false); }
    GetHold(const GetHold&) = delete;
    GetHold& operator=(const GetHold&) = delete;
    ~GetHold() { Release(); }
    void Release() {
      if (s_ != nullptr) s_->SetGetsOpen(true);
      s_ = nullptr;
    }

   private:
    MapPeerService* s_;
  };
  GetHold HoldGets() { return GetHold(this); }

  // Gets that reached the service, and those of them past their delay and
  // hold (about to answer), so tests wait for a get to be in flight or
  // answered.
  int gets_begun() const { return gets_begun_.load(); }
  int gets_past_delay() const { return gets_past_delay_.load(); }
  void set_capacity(uint64_t c) { capacity_ = c; }

 private:
  void SetGetsOpen(bool open) {
    absl::MutexLock lock(&mu_);
    gets_open_ = open;
  }

  absl::Mutex mu_;
  absl::flat_hash_map<tiering::ObjectKey, std::vector<uint8_t>> objects_ ABSL_GUARDED_BY(mu_);
  bool gets_open_ ABSL_GUARDED_BY(mu_) = true;
  std::atomic<int> delay_ms_{0};
  std::atomic<int> gets_begun_{0};
  std::atomic<int> gets_past_delay_{0};
  std::atomic<uint64_t> capacity_{uint64_t{1} << 40};
};

// A loopback TCP listener that never accepts: the kernel completes the
// handshake, nothing ever answers (a stopped kvtierd, or not kvtierd at all).
// addr() is "127.0.0.1:<port>", or empty if the socket could not be set up.
class SilentListener {
 public:
  SilentListener() {
    fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(a);
    if (fd_ < 0 || ::bind(fd_, reinterpret_cast<sockaddr*>(&a), len) != 0 || ::listen(fd_, 64) != 0 ||
        ::getsockname(fd_, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
      return;
    }
    addr_ = "127.0.0.1:" + std::to_string(ntohs(a.sin_port));
  }
  ~SilentListener() {
    if (fd_ >= 0) ::close(fd_);
  }
  const std::string& addr() const { return addr_; }

 private:
  int fd_ = -1;
  std::string addr_;
};

}  // namespace kvtier::cluster::testing

#endif  // KVTIER_CLUSTER_TEST_PEER_H_
