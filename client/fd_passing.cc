#include "qtx/fd_passing.h"

#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <map>
#include <utility>
#include <vector>

#include "absl/strings/str_format.h"

namespace qtx {
namespace {

void PutU32(char* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<char>((v >> (8 * i)) & 0xff);
}

uint32_t GetU32(const char* p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i)
    v |= static_cast<uint32_t>(static_cast<unsigned char>(p[i])) << (8 * i);
  return v;
}

// Reads exactly `n` bytes; false on EOF or error.
bool ReadFull(int fd, char* buf, size_t n) {
  size_t got = 0;
  while (got < n) {
    const ssize_t r = ::recv(fd, buf + got, n - got, 0);
    if (r > 0) {
      got += static_cast<size_t>(r);
    } else if (r < 0 && errno == EINTR) {
      continue;
    } else {
      return false;
    }
  }
  return true;
}

}  // namespace

absl::StatusOr<std::string> FdSocketPathForTarget(std::string_view target) {
  std::string_view path;
  if (target.starts_with("unix://")) {
    path = target.substr(7);
  } else if (target.starts_with("unix:")) {
    path = target.substr(5);
  } else {
    return absl::FailedPreconditionError(absl::StrFormat(
        "target '%s': file descriptors (VMM memory registration) travel only over qtxd's unix "
        "socket; connect with a unix: target on the same host",
        target));
  }
  if (path.empty()) {
    return absl::InvalidArgumentError(absl::StrFormat("target '%s': no socket path", target));
  }
  return std::string(path) + ".fd";
}

absl::StatusOr<std::unique_ptr<FdPassingConnection>> FdPassingConnection::Connect(
    const std::string& socket_path) {
  sockaddr_un addr = {};
  addr.sun_family = AF_UNIX;
  if (socket_path.empty() || socket_path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "fd socket path '%s': must be 1..%d characters", socket_path, sizeof(addr.sun_path) - 1));
  }
  std::memcpy(addr.sun_path, socket_path.data(), socket_path.size());
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    return absl::InternalError(absl::StrFormat("socket(AF_UNIX): %s", std::strerror(errno)));
  }
  if (::connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) != 0) {
    const int err = errno;
    ::close(fd);
    return absl::UnavailableError(absl::StrFormat(
        "cannot connect to qtxd's fd socket %s: %s (qtxd listens there next to its unix socket; "
        "an older qtxd cannot take VMM memory)",
        socket_path, std::strerror(err)));
  }
  return std::unique_ptr<FdPassingConnection>(new FdPassingConnection(fd));
}

FdPassingConnection::~FdPassingConnection() {
  if (fd_ >= 0) ::close(fd_);
}

bool FdPassingConnection::ok() const {
  std::lock_guard<std::mutex> lock(mu_);
  if (broken_) return false;
  // qtxd never writes unasked: a readable socket means it closed (qtxd
  // stopped or restarted), and the session is over.
  pollfd p{fd_, POLLIN, 0};
  if (::poll(&p, 1, 0) != 0) broken_ = true;
  return !broken_;
}

absl::StatusOr<std::string> FdPassingConnection::Send(std::span<const int> fds) {
  if (fds.empty() || fds.size() > kMaxFdsPerBatch) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%d descriptors: one batch carries 1..%d", fds.size(), kMaxFdsPerBatch));
  }
  char header[kFdPassingRequestBytes] = {};
  PutU32(header, kFdPassingMagic);
  PutU32(header + 4, kFdPassingVersion);
  PutU32(header + 8, static_cast<uint32_t>(fds.size()));
  PutU32(header + 12, 0);
  return SendRawForTesting(std::string_view(header, sizeof(header)), fds);
}

absl::StatusOr<std::string> FdPassingConnection::SendRawForTesting(std::string_view bytes,
                                                                   std::span<const int> fds) {
  std::lock_guard<std::mutex> lock(mu_);
  return SendLocked(bytes, fds);
}

absl::StatusOr<std::string> FdPassingConnection::SendLocked(std::string_view bytes,
                                                            std::span<const int> fds) {
  if (broken_) {
    return absl::UnavailableError("the connection to qtxd's fd socket broke earlier; reconnect");
  }
  if (fds.size() > 253) {
    return absl::InvalidArgumentError("more than 253 descriptors cannot go in one message");
  }
  iovec iov{const_cast<char*>(bytes.data()), bytes.size()};
  msghdr msg = {};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  std::vector<char> control;
  if (!fds.empty()) {
    control.assign(CMSG_SPACE(sizeof(int) * fds.size()), 0);
    msg.msg_control = control.data();
    msg.msg_controllen = control.size();
    cmsghdr* c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
    std::memcpy(CMSG_DATA(c), fds.data(), sizeof(int) * fds.size());
  }
  ssize_t sent;
  do {
    sent = ::sendmsg(fd_, &msg, MSG_NOSIGNAL);
  } while (sent < 0 && errno == EINTR);
  if (sent < 0 || static_cast<size_t>(sent) != bytes.size()) {
    const int err = sent < 0 ? errno : EIO;
    broken_ = true;
    // qtxd answers a connection it refuses (a peer of another user) at once
    // and closes it, so a send after that fails (EPIPE) with the refusal
    // already waiting in this socket: report qtxd's reason, not the pipe.
    pollfd p{fd_, POLLIN, 0};
    if (::poll(&p, 1, 0) > 0) {
      absl::StatusOr<std::string> refusal = ReadReplyLocked();
      if (!refusal.ok() && refusal.status().code() != absl::StatusCode::kUnavailable &&
          refusal.status().code() != absl::StatusCode::kInternal) {
        return refusal.status();
      }
    }
    return absl::UnavailableError(
        absl::StrFormat("sending descriptors to qtxd's fd socket failed: %s", std::strerror(err)));
  }
  return ReadReplyLocked();
}

absl::StatusOr<std::string> FdPassingConnection::ReadReplyLocked() {
  char reply[kFdPassingReplyBytes];
  if (!ReadFull(fd_, reply, sizeof(reply))) {
    broken_ = true;
    return absl::UnavailableError(
        "qtxd closed its fd socket without answering (it refused this connection or stopped)");
  }
  const uint32_t len = GetU32(reply + 24);
  if (GetU32(reply) != kFdPassingMagic || len > kMaxReplyMessage) {
    broken_ = true;
    return absl::InternalError("qtxd's fd socket answered with a malformed reply");
  }
  std::string message(len, '\0');
  if (len > 0 && !ReadFull(fd_, message.data(), len)) {
    broken_ = true;
    return absl::UnavailableError("qtxd's fd socket closed in the middle of a reply");
  }
  const uint32_t code = GetU32(reply + 4);
  if (code != 0) {
    const auto status_code =
        code <= 16 ? static_cast<absl::StatusCode>(code) : absl::StatusCode::kUnknown;
    return absl::Status(status_code, message.empty() ? "qtxd refused the descriptors" : message);
  }
  return std::string(reply + 8, kFdPassingTokenBytes);
}

absl::StatusOr<std::shared_ptr<FdPassingConnection>> SharedFdPassingConnection(
    std::string_view target) {
  static std::mutex* const mu = new std::mutex;
  // Leaked on purpose: the connections stay open until the process ends.
  static auto* const by_path = new std::map<std::string, std::shared_ptr<FdPassingConnection>>;
  absl::StatusOr<std::string> path = FdSocketPathForTarget(target);
  if (!path.ok()) return path.status();
  std::lock_guard<std::mutex> lock(*mu);
  auto it = by_path->find(*path);
  if (it != by_path->end() && it->second->ok()) return it->second;
  absl::StatusOr<std::unique_ptr<FdPassingConnection>> c = FdPassingConnection::Connect(*path);
  if (!c.ok()) return c.status();
  std::shared_ptr<FdPassingConnection> shared = std::move(*c);
  (*by_path)[*path] = shared;
  return shared;
}

}  // namespace qtx
