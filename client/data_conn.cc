#include "client/data_conn.h"

#include <poll.h>
#include <sched.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace kvtier::client {

namespace {

// Answers come within tens of microseconds (a commit: the daemon's check
// of the last piece): polling for them costs less than sleeping and being
// woken, which on a VM is an inter-processor interrupt and a VM exit.
constexpr int64_t kAnswerSpinUs = 100;

}  // namespace

std::unique_ptr<DataConn> DataConn::Open(int sock, std::shared_ptr<const PoolMapping> pool,
                                         int64_t timeout_ms, std::atomic<int>* owed_releases,
                                         uint64_t serial, const std::string& token) {
  auto c = std::unique_ptr<DataConn>(new DataConn(sock, std::move(pool), owed_releases, serial));
  timeval tv{static_cast<time_t>(timeout_ms / 1000), static_cast<suseconds_t>(timeout_ms % 1000 * 1000)};
  ::setsockopt(sock, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  ::setsockopt(sock, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  if (token.empty()) {
    if (!c->Call(Op::kHello, nullptr, 0, nullptr, 0).ok()) return nullptr;
    return c;
  }
  if (token.size() > wire::shm::kMaxBatchItems) return nullptr;
  std::vector<uint8_t> hello(wire::shm::kBatchHeaderBytes + token.size());
  wire::shm::Writer w(hello.data());
  w.U32(static_cast<uint32_t>(token.size())).U32(0).Raw(token.data(), token.size());
  if (!c->Call(Op::kHelloTenant, hello.data(), static_cast<uint32_t>(hello.size()), nullptr, 0).ok()) {
    return nullptr;
  }
  return c;
}

DataConn::~DataConn() {
  ::close(fd_);  // the daemon releases what the owed releases named
  DropOwed();
}

bool DataConn::PeerOpen() const {
  if (broken_) return false;
  pollfd p{fd_, POLLRDHUP, 0};
  return ::poll(&p, 1, 0) == 0 || (p.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)) == 0;
}

absl::Status DataConn::Send(Op op, const uint8_t* payload, uint32_t n) {
  if (broken_) return absl::UnavailableError("data-plane connection closed");
  uint8_t buf[wire::shm::kRequestHeaderBytes + wire::shm::kMaxRequestPayloadBytes];
  wire::shm::Writer w(buf);
  w.U16(wire::shm::kVersion).U16(static_cast<uint16_t>(op)).U32(n);
  if (n > 0) w.Raw(payload, n);
  for (size_t sent = 0; sent < w.size();) {
    ssize_t k = ::send(fd_, buf + sent, w.size() - sent, MSG_NOSIGNAL);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) return Broken(absl::StrCat("send: ", std::strerror(errno)));
    sent += static_cast<size_t>(k);
  }
  return absl::OkStatus();
}

absl::StatusOr<uint32_t> DataConn::ReceiveHeader(Op op) {
  using wire::shm::kResponseHeaderBytes;
  uint8_t hdr[kResponseHeaderBytes];
  KVTIER_RETURN_IF_ERROR(ReadFull(hdr, sizeof(hdr), kAnswerSpinUs));
  wire::shm::Reader r(hdr);
  const uint16_t version = r.U16(), got_op = r.U16();
  const uint32_t code = r.U32(), len = r.U32();
  if (version != wire::shm::kVersion) {
    return Broken(absl::StrCat("answer of data-plane protocol version ", version));
  }
  if (code != 0) {
    if (len > wire::shm::kMaxErrorMessageBytes) return Broken("oversized error answer");
    std::string msg(len, '\0');
    KVTIER_RETURN_IF_ERROR(ReadFull(reinterpret_cast<uint8_t*>(msg.data()), len));
    // An answer to another op is the daemon refusing a frame; it closes.
    if (got_op != static_cast<uint16_t>(op)) broken_ = true;
    const auto c = code <= 16 ? static_cast<absl::StatusCode>(code) : absl::StatusCode::kUnknown;
    return absl::Status(c, msg);
  }
  if (got_op != static_cast<uint16_t>(op)) {
    return Broken(absl::StrCat("answer to data-plane op ", got_op, "; expected op ",
                               static_cast<int>(op)));
  }
  return len;
}

absl::Status DataConn::Receive(Op op, uint8_t* out, uint32_t n) {
  KVTIER_ASSIGN_OR_RETURN(const uint32_t len, ReceiveHeader(op));
  if (len != n) {
    return Broken(absl::StrCat("answer to data-plane op ", static_cast<int>(op), " with ", len,
                               " bytes; expected ", n));
  }
  return ReadFull(out, n);
}

absl::Status DataConn::Call(Op op, const uint8_t* payload, uint32_t n, uint8_t* out,
                            uint32_t out_n) {
  KVTIER_RETURN_IF_ERROR(Settle());
  KVTIER_RETURN_IF_ERROR(Send(op, payload, n));
  return Receive(op, out, out_n);
}

absl::Status DataConn::CallBatch(Op op, const uint8_t* payload, uint32_t n,
                                 std::vector<uint8_t>* out) {
  KVTIER_RETURN_IF_ERROR(Settle());
  KVTIER_RETURN_IF_ERROR(Send(op, payload, n));
  KVTIER_ASSIGN_OR_RETURN(const uint32_t len, ReceiveHeader(op));
  if (len > wire::shm::kMaxReplyPayloadBytes) {
    return Broken(absl::StrCat("answer to data-plane op ", static_cast<int>(op), " with ", len,
                               " bytes, over the limit"));
  }
  out->resize(len);
  return ReadFull(out->data(), len);
}

absl::Status DataConn::BadAnswer(Op op) {
  return Broken(absl::StrCat("malformed answer to data-plane op ", static_cast<int>(op)));
}

absl::Status DataConn::SendOwed(Op op, const uint8_t* payload, uint32_t n) {
  KVTIER_RETURN_IF_ERROR(Send(op, payload, n));
  owed_.push_back(op);
  if (op == Op::kRelease) owed_releases_->fetch_add(1);
  return absl::OkStatus();
}

absl::Status DataConn::Settle() {
  while (!owed_.empty()) {
    const Op op = owed_.front();
    uint8_t rep[wire::shm::kSlotReplyBytes];
    const uint32_t n = op == Op::kAllocate ? sizeof(rep) : 0;
    absl::Status st = Receive(op, rep, n);
    if (broken_) {
      DropOwed();
      return st;
    }
    // Counted down only now: the answer says the daemon has done it.
    owed_.pop_front();
    if (op == Op::kRelease) owed_releases_->fetch_sub(1);
    if (op == Op::kAllocate && st.ok()) {
      wire::shm::Reader r(rep);
      spare_ = Spare{r.U64(), r.U64(), r.U64(),
                     std::chrono::steady_clock::now() + std::chrono::milliseconds(kSpareTtlMs / 2)};
    }
  }
  return absl::OkStatus();
}

void DataConn::DropOwed() {
  for (Op op : owed_) {
    if (op == Op::kRelease) owed_releases_->fetch_sub(1);
  }
  owed_.clear();
}

absl::Status DataConn::ReadFull(uint8_t* p, size_t n, int64_t spin_us) {
  size_t got = 0;
  if (spin_us > 0) {
    const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(spin_us);
    do {
      ssize_t k = ::recv(fd_, p, n, MSG_DONTWAIT);
      if (k > 0) {
        got = static_cast<size_t>(k);
        break;
      }
      if (k == 0) return Broken("the daemon closed the data-plane connection");
      if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
        return Broken(absl::StrCat("recv: ", std::strerror(errno)));
      }
      // The daemon's thread may be waiting for this core: let it run.
      sched_yield();
    } while (std::chrono::steady_clock::now() < until);
  }
  while (got < n) {
    ssize_t k = ::recv(fd_, p + got, n - got, 0);
    if (k < 0 && errno == EINTR) continue;
    if (k == 0) return Broken("the daemon closed the data-plane connection");
    if (k < 0) return Broken(absl::StrCat("recv: ", std::strerror(errno)));
    got += static_cast<size_t>(k);
  }
  return absl::OkStatus();
}

absl::Status DataConn::Broken(std::string what) {
  broken_ = true;
  return absl::UnavailableError(std::move(what));
}

ConnLease::~ConnLease() {
  if (c_) owner_->Return(std::move(c_));
}

DataConnPool::~DataConnPool() = default;

bool DataConnPool::Start(int sock, std::shared_ptr<const PoolMapping> mapping) {
  if (options_.max_data_connections <= 0) {
    ::close(sock);
    return false;
  }
  std::unique_ptr<DataConn> c = DataConn::Open(sock, std::move(mapping), options_.timeout_ms,
                                               owed_releases_.get(), next_serial_++, options_.token);
  if (c == nullptr) return false;
  absl::MutexLock l(&mu_);
  serving_ = true;
  open_ = 1;
  live_.insert(c->serial());
  idle_.push_back(std::move(c));
  return true;
}

ConnLease DataConnPool::Acquire() {
  {
    absl::MutexLock l(&mu_);
    if (!serving_) return ConnLease(this, nullptr);
    while (!idle_.empty()) {
      std::unique_ptr<DataConn> c = std::move(idle_.back());
      idle_.pop_back();
      if (c->PeerOpen()) return ConnLease(this, std::move(c));
      --open_;  // the daemon went away: closed here
      live_.erase(c->serial());
    }
    if (open_ >= options_.max_data_connections) return ConnLease(this, nullptr);
    ++open_;
  }
  std::unique_ptr<DataConn> c;
  auto h = ConnectShm(pool_->socket());
  if (h.ok()) {
    auto mapping = pool_->Adopt(*h);
    if (mapping.ok()) {
      c = DataConn::Open(h->sock, *std::move(mapping), options_.timeout_ms, owed_releases_.get(),
                         next_serial_++, options_.token);
    } else {
      ::close(h->sock);
    }
  }
  absl::MutexLock l(&mu_);
  if (c == nullptr) {
    --open_;
  } else {
    live_.insert(c->serial());
  }
  return ConnLease(this, std::move(c));
}

ConnLease DataConnPool::AcquireBySerial(uint64_t serial) {
  absl::MutexLock l(&mu_);
  auto idle_or_closed = [this, serial]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return !live_.contains(serial) ||
           std::any_of(idle_.begin(), idle_.end(),
                       [serial](const auto& c) { return c->serial() == serial; });
  };
  mu_.AwaitWithTimeout(absl::Condition(&idle_or_closed), absl::Milliseconds(options_.timeout_ms));
  for (auto it = idle_.begin(); it != idle_.end(); ++it) {
    if ((*it)->serial() == serial) {
      std::unique_ptr<DataConn> c = std::move(*it);
      idle_.erase(it);
      return ConnLease(this, std::move(c));
    }
  }
  return ConnLease(this, nullptr);
}

void DataConnPool::Return(std::unique_ptr<DataConn> c) {
  absl::MutexLock l(&mu_);
  if (c->broken()) {
    --open_;
    live_.erase(c->serial());
    return;  // closed
  }
  idle_.push_back(std::move(c));
}

void DataConnPool::SettleOwedReleases() {
  while (owed_releases_->load() != 0) {
    {
      absl::MutexLock l(&mu_);
      for (auto it = idle_.begin(); it != idle_.end();) {
        (void)(*it)->Settle();
        if ((*it)->broken()) {
          live_.erase((*it)->serial());
          it = idle_.erase(it);
          --open_;
        } else {
          ++it;
        }
      }
    }
    if (owed_releases_->load() != 0) std::this_thread::yield();
  }
}

}  // namespace kvtier::client
