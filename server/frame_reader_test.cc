// FrameReader: a frame must be whole within the timeout of its first byte,
// however slowly it trickles in; an idle connection may wait.
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <thread>

#include "gtest/gtest.h"
#include "server/data_plane_connection.h"

namespace kvtier::server {
namespace {

class SocketPair {
 public:
  SocketPair() { EXPECT_EQ(::socketpair(AF_UNIX, SOCK_STREAM, 0, fd_), 0); }
  ~SocketPair() {
    ::close(fd_[0]);
    ::close(fd_[1]);
  }
  int reader() const { return fd_[0]; }
  void Write(const char* bytes, size_t n) { EXPECT_EQ(::write(fd_[1], bytes, n), static_cast<ssize_t>(n)); }

 private:
  int fd_[2] = {-1, -1};
};

TEST(FrameReader, FrameTrickledPastTheTimeoutOfItsFirstByteIsRefused) {
  SocketPair s;
  FrameReader in(s.reader(), /*timeout_ms=*/300);
  std::thread writer([&] {
    for (int i = 0; i < 16; ++i) {  // one byte every 50 ms: each within the timeout
      s.Write("x", 1);
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  });
  const auto t0 = std::chrono::steady_clock::now();
  const bool whole = in.Fill(16, /*idle_ok=*/true);  // 16 bytes would take 800 ms
  const auto took = std::chrono::steady_clock::now() - t0;
  writer.join();
  EXPECT_FALSE(whole);
  EXPECT_LT(took, std::chrono::milliseconds(700));
}

TEST(FrameReader, IdleWaitIsUnboundedAndEachFrameGetsItsOwnTimeout) {
  SocketPair s;
  FrameReader in(s.reader(), /*timeout_ms=*/200);
  std::thread writer([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(400));  // idle past the timeout
    s.Write("abcd", 4);
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    s.Write("efgh", 4);
    std::this_thread::sleep_for(std::chrono::milliseconds(150));  // frame two starts anew
    s.Write("ijkl", 4);
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    s.Write("mnop", 4);
  });
  ASSERT_TRUE(in.Fill(8, /*idle_ok=*/true));
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(in.data()), 8), "abcdefgh");
  in.Consume(8);
  in.EndFrame();
  ASSERT_TRUE(in.Fill(8, /*idle_ok=*/true));
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(in.data()), 8), "ijklmnop");
  writer.join();
}

}  // namespace
}  // namespace kvtier::server
