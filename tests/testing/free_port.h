// FreeLoopbackPort: a TCP port on 127.0.0.1 that nothing listens on at the
// moment of the call (the kernel's choice for a socket bound to port 0), for
// tests that must name a port before a server binds it. Another process may
// take it before the server does; QtxdProcess::StartOnLoopbackPort retries.
#ifndef QTX_TESTS_TESTING_FREE_PORT_H_
#define QTX_TESTS_TESTING_FREE_PORT_H_

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

namespace qtx::testing {

// The port, or 0 when no socket could be bound (a server given port 0 then
// fails to start, naming the problem).
inline int FreeLoopbackPort() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return 0;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(a);
  int port = 0;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0) {
    port = ntohs(a.sin_port);
  }
  ::close(fd);
  return port;
}

}  // namespace qtx::testing

#endif  // QTX_TESTS_TESTING_FREE_PORT_H_
