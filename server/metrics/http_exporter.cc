#include "server/metrics/http_exporter.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <list>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace qtx::server::metrics {
namespace {

// Longest request head we read before answering 431.
constexpr size_t kMaxRequestBytes = 8192;

struct Connection {
  int fd = -1;
  absl::Time deadline;
  std::string in;
  std::string out;  // set once the request is complete
  size_t sent = 0;
};

std::string Response(absl::string_view status, absl::string_view content_type,
                     absl::string_view body) {
  return absl::StrCat("HTTP/1.1 ", status, "\r\nContent-Type: ", content_type,
                      "\r\nContent-Length: ", body.size(), "\r\nConnection: close\r\n\r\n", body);
}

std::string NumericAddress(const sockaddr_storage& ss) {
  char buf[INET6_ADDRSTRLEN] = {};
  if (ss.ss_family == AF_INET) {
    ::inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(&ss)->sin_addr, buf, sizeof(buf));
  } else if (ss.ss_family == AF_INET6) {
    ::inet_ntop(AF_INET6, &reinterpret_cast<const sockaddr_in6*>(&ss)->sin6_addr, buf, sizeof(buf));
  }
  return buf;
}

}  // namespace

HttpExporter::HttpExporter(HttpExporterOptions options, const Metrics* metrics)
    : options_(std::move(options)), metrics_(metrics) {}

absl::StatusOr<std::unique_ptr<HttpExporter>> HttpExporter::Create(
    const HttpExporterOptions& options, const Metrics* metrics) {
  if (options.port < 1 || options.port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrFormat("--metrics_port=%d: must be 1..65535", options.port));
  }
  if (options.max_connections < 1 || options.request_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        "metrics exporter: max_connections and request_timeout "
        "must be positive");
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  const std::string port = std::to_string(options.port);
  if (int rc = ::getaddrinfo(options.host.c_str(), port.c_str(), &hints, &found); rc != 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("--metrics_host=%s: cannot resolve: %s", options.host, ::gai_strerror(rc)));
  }
  std::unique_ptr<HttpExporter> e(new HttpExporter(options, metrics));
  std::string error = "no address";
  for (addrinfo* a = found; a != nullptr; a = a->ai_next) {
    const int fd =
        ::socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) {
      error = std::strerror(errno);
      continue;
    }
    // SO_REUSEADDR only (no SO_REUSEPORT): a second qtxd must not share the port.
    int yes = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
    if (::bind(fd, a->ai_addr, a->ai_addrlen) != 0 || ::listen(fd, 128) != 0) {
      error = std::strerror(errno);
      ::close(fd);
      continue;
    }
    sockaddr_storage ss{};
    socklen_t len = sizeof(ss);
    ::getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &len);
    e->bound_address_ = NumericAddress(ss);
    e->listen_fd_ = fd;
    break;
  }
  ::freeaddrinfo(found);
  if (e->listen_fd_ < 0) {
    return absl::UnavailableError(
        absl::StrFormat("--metrics_host=%s --metrics_port=%d: cannot listen (port in use?): %s",
                        options.host, options.port, error));
  }
  if (::pipe2(e->wake_fds_, O_CLOEXEC | O_NONBLOCK) != 0) {
    return absl::InternalError(absl::StrCat("metrics exporter: pipe2: ", std::strerror(errno)));
  }
  HttpExporter* raw = e.get();
  e->thread_ = std::thread([raw] { raw->Loop(); });
  return e;
}

HttpExporter::~HttpExporter() {
  if (thread_.joinable()) {
    const char stop = 's';
    (void)!::write(wake_fds_[1], &stop, 1);
    thread_.join();
  }
  for (int fd : {listen_fd_, wake_fds_[0], wake_fds_[1]}) {
    if (fd >= 0) ::close(fd);
  }
}

void HttpExporter::Loop() {
  std::list<Connection> conns;  // oldest first
  auto close_conn = [](Connection& c) { ::close(c.fd); };
  std::vector<pollfd> fds;
  std::vector<std::list<Connection>::iterator> polled;
  for (;;) {
    const absl::Time now = absl::Now();
    // Time out connections past their deadline.
    for (auto it = conns.begin(); it != conns.end();) {
      if (it->deadline <= now) {
        close_conn(*it);
        it = conns.erase(it);
      } else {
        ++it;
      }
    }
    absl::Time earliest = absl::InfiniteFuture();
    for (const Connection& c : conns) earliest = std::min(earliest, c.deadline);
    fds.clear();
    polled.clear();
    fds.push_back({wake_fds_[0], POLLIN, 0});
    fds.push_back({listen_fd_, POLLIN, 0});
    for (auto it = conns.begin(); it != conns.end(); ++it) {
      fds.push_back({it->fd, static_cast<short>(it->out.empty() ? POLLIN : POLLOUT), 0});
      polled.push_back(it);
    }
    int timeout_ms = -1;
    if (earliest != absl::InfiniteFuture()) {
      timeout_ms =
          static_cast<int>(std::max<int64_t>(1, absl::ToInt64Milliseconds(earliest - now) + 1));
    }
    const int n = ::poll(fds.data(), fds.size(), timeout_ms);
    if (n < 0 && errno != EINTR) break;
    if (n <= 0) continue;
    if (fds[0].revents != 0) break;  // stop
    for (size_t i = 0; i < polled.size(); ++i) {
      const short rev = fds[i + 2].revents;
      if (rev == 0) continue;
      Connection& c = *polled[i];
      bool done = false;
      if (c.out.empty()) {
        char buf[4096];
        const ssize_t got = ::recv(c.fd, buf, sizeof(buf), 0);
        if (got == 0 || (got < 0 && errno != EAGAIN && errno != EINTR)) {
          done = true;
        } else if (got > 0) {
          c.in.append(buf, static_cast<size_t>(got));
          const bool complete =
              absl::StrContains(c.in, "\r\n\r\n") || absl::StrContains(c.in, "\n\n");
          if (complete) {
            const absl::string_view line(c.in.data(), c.in.find('\n'));
            if (absl::StartsWith(line, "GET /metrics ") || line == "GET /metrics" ||
                absl::StartsWith(line, "GET /metrics?")) {
              c.out = Response("200 OK", "text/plain; version=0.0.4; charset=utf-8",
                               metrics_->RenderPrometheus());
            } else if (absl::StartsWith(line, "GET ")) {
              c.out = Response("404 Not Found", "text/plain", "not found; try /metrics\n");
            } else {
              c.out = Response("405 Method Not Allowed", "text/plain", "only GET\n");
            }
          } else if (c.in.size() > kMaxRequestBytes) {
            c.out = Response("431 Request Header Fields Too Large", "text/plain",
                             "request too large\n");
          }
        }
      } else {
        const ssize_t put =
            ::send(c.fd, c.out.data() + c.sent, c.out.size() - c.sent, MSG_NOSIGNAL);
        if (put < 0 && errno != EAGAIN && errno != EINTR) {
          done = true;
        } else if (put > 0) {
          c.sent += static_cast<size_t>(put);
          done = c.sent == c.out.size();
        }
      }
      if (done) {
        close_conn(c);
        conns.erase(polled[i]);
      }
    }
    if (fds[1].revents != 0) {
      for (;;) {
        const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) break;
        if (conns.size() >= static_cast<size_t>(options_.max_connections)) {
          close_conn(conns.front());
          conns.pop_front();
        }
        conns.push_back(Connection{fd, absl::Now() + options_.request_timeout, {}, {}, 0});
      }
    }
  }
  for (Connection& c : conns) close_conn(c);
}

}  // namespace qtx::server::metrics
