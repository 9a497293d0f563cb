// A raw client of kvtierd's shared-memory data plane for tests: frames that
// libkvtier never sends, read back as they come.
#ifndef KVTIER_TESTS_RAW_DATA_PLANE_H_
#define KVTIER_TESTS_RAW_DATA_PLANE_H_

#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "client/kvtier_client_internal.h"
#include "common/hash.h"
#include "gtest/gtest.h"
#include "server/daemon.h"
#include "wire/shm_frames.h"

namespace kvtier::server {

// A raw client of the shared-memory data plane (wire/DATA_PLANE.md), to
// send it what libkvtier never would.
class RawDataPlane {
 public:
  using Op = wire::shm::Op;
  struct Answer {
    uint16_t version = 0, op = 0;
    uint32_t code = 0;
    std::vector<uint8_t> payload;
  };

  // Connects, receives and maps the pool.
  explicit RawDataPlane(const std::string& path) {
    auto h = client::ConnectShm(path);
    if (!h.ok()) {
      error_ = h.status().ToString();
      return;
    }
    fd_ = h->sock;
    void* p = ::mmap(nullptr, h->size, PROT_READ | PROT_WRITE, MAP_SHARED, h->memfd, 0);
    ::close(h->memfd);
    if (p == MAP_FAILED) {
      error_ = absl::StrCat("mmap: ", std::strerror(errno));
      return;
    }
    pool_ = std::span<uint8_t>(static_cast<uint8_t*>(p), h->size);
  }
  ~RawDataPlane() {
    if (!pool_.empty()) ::munmap(pool_.data(), pool_.size());
    Close();
  }
  void Close() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }
  bool ok() const { return !pool_.empty(); }
  const std::string& error() const { return error_; }
  std::span<uint8_t> pool() const { return pool_; }

  void SendBytes(const std::vector<uint8_t>& b) {
    ssize_t n;
    do {
      n = ::send(fd_, b.data(), b.size(), MSG_NOSIGNAL);
    } while (n < 0 && errno == EINTR);
    ASSERT_EQ(n, static_cast<ssize_t>(b.size()));
  }
  static std::vector<uint8_t> Frame(uint16_t version, uint16_t op, const std::vector<uint8_t>& payload,
                                    int64_t claimed_len = -1) {
    std::vector<uint8_t> b(wire::shm::kRequestHeaderBytes + payload.size());
    wire::shm::Writer(b.data()).U16(version).U16(op).U32(
        claimed_len < 0 ? static_cast<uint32_t>(payload.size()) : static_cast<uint32_t>(claimed_len));
    std::copy(payload.begin(), payload.end(), b.begin() + wire::shm::kRequestHeaderBytes);
    return b;
  }
  void Send(Op op, const std::vector<uint8_t>& payload) {
    SendBytes(Frame(wire::shm::kVersion, static_cast<uint16_t>(op), payload));
  }
  // The next answer; nullopt at the end of the stream.
  std::optional<Answer> Read() {
    uint8_t h[wire::shm::kResponseHeaderBytes];
    if (!ReadFull(h, sizeof(h))) return std::nullopt;
    wire::shm::Reader r(h);
    Answer a;
    a.version = r.U16();
    a.op = r.U16();
    a.code = r.U32();
    a.payload.resize(r.U32());
    if (!ReadFull(a.payload.data(), a.payload.size())) return std::nullopt;
    return a;
  }
  // Sends and reads the answer's code (-1 at the end of the stream).
  int Call(Op op, const std::vector<uint8_t>& payload, std::vector<uint8_t>* out = nullptr) {
    Send(op, payload);
    auto a = Read();
    if (!a) return -1;
    EXPECT_EQ(a->op, static_cast<uint16_t>(op));
    if (out) *out = a->payload;
    return static_cast<int>(a->code);
  }
  // True once the daemon closed the connection (a daemon that closes with
  // request bytes unread resets it instead of ending the stream).
  bool Closed() {
    uint8_t b;
    ssize_t n;
    do {
      n = ::recv(fd_, &b, 1, 0);
    } while (n < 0 && errno == EINTR);
    return n == 0 || (n < 0 && errno == ECONNRESET);
  }

  static std::vector<uint8_t> U64(uint64_t v) {
    std::vector<uint8_t> b(8);
    wire::shm::Writer(b.data()).U64(v);
    return b;
  }
  static std::vector<uint8_t> Range(uint64_t offset, uint64_t length) {
    std::vector<uint8_t> b(wire::shm::kPutRangeBytes);
    wire::shm::Writer(b.data()).U64(offset).U64(length);
    return b;
  }
  static std::vector<uint8_t> Allocate(uint64_t bytes) {
    std::vector<uint8_t> b(wire::shm::kAllocateBytes);
    wire::shm::Writer(b.data()).U64(bytes).U32(0);
    return b;
  }
  static std::vector<uint8_t> Begin(uint64_t slot, const Hash128& key, uint8_t tier = 0) {
    std::vector<uint8_t> b(wire::shm::kPutBeginBytes);
    wire::shm::Writer(b.data()).U64(slot).Raw(key.bytes.data(), 16).U8(0).U8(tier).U16(0);
    return b;
  }
  static std::vector<uint8_t> Get(const Hash128& key, uint8_t reserved = 0) {
    std::vector<uint8_t> b(wire::shm::kGetBytes);
    wire::shm::Writer(b.data()).Raw(key.bytes.data(), 16).U32(0).U8(0).U8(reserved).U16(0);
    return b;
  }
  // Allocates a slot for `chunk` and copies it in; returns the slot id.
  uint64_t SlotWith(const std::vector<uint8_t>& chunk) {
    std::vector<uint8_t> out;
    EXPECT_EQ(Call(Op::kAllocate, Allocate(chunk.size()), &out), 0);
    if (out.size() != wire::shm::kSlotReplyBytes) return 0;
    wire::shm::Reader r(out.data());
    uint64_t id = r.U64(), offset = r.U64(), length = r.U64();
    EXPECT_EQ(length, chunk.size());
    std::copy(chunk.begin(), chunk.end(), pool_.begin() + offset);
    return id;
  }

 private:
  bool ReadFull(uint8_t* p, size_t n) {
    for (size_t got = 0; got < n;) {
      ssize_t k = ::recv(fd_, p + got, n - got, 0);
      if (k < 0 && errno == EINTR) continue;
      if (k <= 0) return false;
      got += static_cast<size_t>(k);
    }
    return true;
  }
  int fd_ = -1;
  std::span<uint8_t> pool_;
  std::string error_;
};

constexpr int kOk = 0;
constexpr int kInvalid = static_cast<int>(absl::StatusCode::kInvalidArgument);
constexpr int kNotFound = static_cast<int>(absl::StatusCode::kNotFound);
constexpr int kDataLoss = static_cast<int>(absl::StatusCode::kDataLoss);
constexpr int kPrecondition = static_cast<int>(absl::StatusCode::kFailedPrecondition);

// Waits (bounded) until the daemon has finished the connections that closed.
inline void WaitForDataPlaneConnections(Daemon* d, int n) {
  auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (d->data_plane_connections() != n && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_EQ(d->data_plane_connections(), n);
}

}  // namespace kvtier::server

#endif  // KVTIER_TESTS_RAW_DATA_PLANE_H_
