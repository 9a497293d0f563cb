// A blocking HTTP/1.0 GET to a loopback port, for tests that read a
// daemon's /metrics. Header-only.
#ifndef KVTIER_TESTS_HTTP_GET_H_
#define KVTIER_TESTS_HTTP_GET_H_

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <string>

namespace kvtier::testing {

// The whole answer (status line, headers, body) to "GET `path`" on
// 127.0.0.1:`port`; "" if the connection fails. Each receive waits at most
// 5 s, so a silent server does not hang the test.
inline std::string HttpGetLocal(int port, const std::string& path) {
  int s = ::socket(AF_INET, SOCK_STREAM, 0);
  if (s < 0) return "";
  timeval tv{5, 0};
  ::setsockopt(s, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  std::string body;
  if (::connect(s, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0) {
    const std::string rq = "GET " + path + " HTTP/1.0\r\n\r\n";
    if (::send(s, rq.data(), rq.size(), 0) == static_cast<ssize_t>(rq.size())) {
      char buf[4096];
      ssize_t n;
      while ((n = ::recv(s, buf, sizeof(buf), 0)) > 0) body.append(buf, static_cast<size_t>(n));
    }
  }
  ::close(s);
  return body;
}

}  // namespace kvtier::testing

#endif  // KVTIER_TESTS_HTTP_GET_H_
