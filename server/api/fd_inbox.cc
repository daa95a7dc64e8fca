#include "server/api/fd_inbox.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "server/api/server.h"
#include "spdlog/spdlog.h"

namespace qtx::server::api {
namespace {

// The wire format of client/qtx/fd_passing.h (kept in step by
// tests/server/api/fd_inbox_test.cc, which speaks to this with that client).
constexpr uint32_t kMagic = 0x46585451;  // "QTXF"
constexpr uint32_t kVersion = 1;
constexpr size_t kRequestBytes = 16;
constexpr size_t kReplyBytes = 28;
constexpr size_t kTokenBytes = 16;
constexpr uint32_t kMaxFdsPerBatch = 250;
constexpr size_t kMaxReplyMessage = 1024;

void PutU32(char* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<char>((v >> (8 * i)) & 0xff);
}

uint32_t GetU32(const char* p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i)
    v |= static_cast<uint32_t>(static_cast<unsigned char>(p[i])) << (8 * i);
  return v;
}

// Best effort: the peer may be gone.
void Reply(int fd, const absl::Status& status, std::string_view token) {
  std::string msg(status.message().substr(0, kMaxReplyMessage));
  std::string out(kReplyBytes + msg.size(), '\0');
  PutU32(out.data(), kMagic);
  PutU32(out.data() + 4, static_cast<uint32_t>(status.code()));
  if (status.ok()) std::memcpy(out.data() + 8, token.data(), kTokenBytes);
  PutU32(out.data() + 24, static_cast<uint32_t>(msg.size()));
  std::memcpy(out.data() + kReplyBytes, msg.data(), msg.size());
  size_t done = 0;
  while (done < out.size()) {
    const ssize_t w = ::send(fd, out.data() + done, out.size() - done, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return;
    done += static_cast<size_t>(w);
  }
}

std::string HexPrefix(std::string_view token) {
  std::string out;
  for (size_t i = 0; i < token.size() && i < 4; ++i) {
    out += absl::StrFormat("%02x", static_cast<unsigned char>(token[i]));
  }
  return out;
}

}  // namespace

OwnedFd& OwnedFd::operator=(OwnedFd&& o) noexcept {
  if (this != &o) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = o.Release();
  }
  return *this;
}

OwnedFd::~OwnedFd() {
  if (fd_ >= 0) ::close(fd_);
}

absl::StatusOr<std::unique_ptr<FdInbox>> FdInbox::Create(FdInboxOptions options) {
  if (options.allowed_uid == static_cast<uid_t>(-1)) options.allowed_uid = ::geteuid();
  sockaddr_un addr = {};
  addr.sun_family = AF_UNIX;
  if (options.socket_path.empty() || options.socket_path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "fd socket path '%s': must be 1..%d characters (it is the unix socket path + \".fd\")",
        options.socket_path, sizeof(addr.sun_path) - 1));
  }
  if (absl::Status s = PrepareSocketPath(options.socket_path); !s.ok()) return s;
  std::memcpy(addr.sun_path, options.socket_path.data(), options.socket_path.size());
  std::unique_ptr<FdInbox> inbox(new FdInbox(std::move(options)));
  inbox->listen_fd_ = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (inbox->listen_fd_ < 0) {
    return absl::InternalError(absl::StrFormat("socket(AF_UNIX): %s", std::strerror(errno)));
  }
  // Created 0600 (umask for the bind), then chmod-ed in case umask was wider.
  const mode_t old_mask = ::umask(0177);
  const int bound =
      ::bind(inbox->listen_fd_, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr));
  const int bind_err = errno;
  ::umask(old_mask);
  if (bound != 0) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "fd socket %s: bind failed: %s", inbox->options_.socket_path, std::strerror(bind_err)));
  }
  if (::chmod(inbox->options_.socket_path.c_str(), 0600) != 0 ||
      ::listen(inbox->listen_fd_, 64) != 0) {
    return absl::FailedPreconditionError(
        absl::StrFormat("fd socket %s: %s", inbox->options_.socket_path, std::strerror(errno)));
  }
  int pipe_fds[2];
  if (::pipe2(pipe_fds, O_CLOEXEC | O_NONBLOCK) != 0) {
    return absl::InternalError(absl::StrFormat("pipe2: %s", std::strerror(errno)));
  }
  inbox->wake_read_ = pipe_fds[0];
  inbox->wake_write_ = pipe_fds[1];
  inbox->thread_ = std::thread([raw = inbox.get()] { raw->Serve(); });
  spdlog::info("event=fd_socket_listening path={} token_ttl_s={} max_pending_fds={}",
               inbox->options_.socket_path, absl::ToDoubleSeconds(inbox->options_.token_ttl),
               inbox->options_.max_pending_fds);
  return inbox;
}

FdInbox::~FdInbox() {
  if (thread_.joinable()) {
    const char c = 1;
    (void)!::write(wake_write_, &c, 1);
    thread_.join();
  }
  for (const auto& [fd, session] : connections_) ::close(fd);
  if (listen_fd_ >= 0) {
    ::close(listen_fd_);
    ::unlink(options_.socket_path.c_str());
  }
  if (wake_read_ >= 0) ::close(wake_read_);
  if (wake_write_ >= 0) ::close(wake_write_);
  absl::MutexLock lock(&mu_);
  pending_.clear();
}

void FdInbox::Serve() {
  std::vector<pollfd> fds;
  for (;;) {
    fds.clear();
    fds.push_back({wake_read_, POLLIN, 0});
    fds.push_back({listen_fd_, POLLIN, 0});
    for (const auto& [fd, session] : connections_) fds.push_back({fd, POLLIN, 0});
    int timeout_ms = 1000;
    if (!closing_.empty()) {
      const absl::Duration wait = closing_.front().first - absl::Now();
      timeout_ms =
          static_cast<int>(std::clamp<int64_t>(absl::ToInt64Milliseconds(wait) + 1, 0, 1000));
    }
    const int n = ::poll(fds.data(), fds.size(), timeout_ms);
    while (!closing_.empty() && closing_.front().first <= absl::Now()) {
      const uint64_t session = closing_.front().second;
      closing_.erase(closing_.begin());
      if (options_.on_session_closed) options_.on_session_closed(session);
    }
    {
      absl::MutexLock lock(&mu_);
      ExpireLocked(absl::Now());
    }
    if (n < 0) {
      if (errno == EINTR) continue;
      spdlog::error("event=fd_socket_poll_failed error=\"{}\"", std::strerror(errno));
      return;
    }
    if (fds[0].revents != 0) return;
    if (fds[1].revents & POLLIN) Accept();
    for (size_t i = 2; i < fds.size(); ++i) {
      if (fds[i].revents == 0) continue;
      const int fd = fds[i].fd;
      auto it = connections_.find(fd);
      if (it == connections_.end()) continue;
      const uint64_t session = it->second;
      if (HandleMessage(fd, session)) continue;
      ::close(fd);
      connections_.erase(it);
      {
        absl::MutexLock lock(&mu_);
        open_sessions_.erase(session);
        // Unclaimed descriptors of a closed session are of no use.
        for (auto p = pending_.begin(); p != pending_.end();) {
          if (p->second.session == session) {
            pending_fd_count_ -= p->second.fds.size();
            p = pending_.erase(p);
          } else {
            ++p;
          }
        }
      }
      spdlog::info("event=fd_session_closed session={} regions_dropped_in_s={}", session,
                   absl::ToDoubleSeconds(options_.session_grace));
      closing_.emplace_back(absl::Now() + options_.session_grace, session);
    }
  }
}

void FdInbox::Accept() {
  const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
  if (fd < 0) return;
  ucred cred = {};
  socklen_t len = sizeof(cred);
  if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
    Reply(fd, absl::PermissionDeniedError("qtxd cannot read this peer's credentials (SO_PEERCRED)"),
          {});
    ::close(fd);
    return;
  }
  if (cred.uid != options_.allowed_uid && !(options_.allow_root && cred.uid == 0)) {
    spdlog::warn("event=fd_socket_peer_refused pid={} uid={} allowed_uid={}", cred.pid, cred.uid,
                 options_.allowed_uid);
    Reply(fd,
          absl::PermissionDeniedError(absl::StrFormat(
              "qtxd's fd socket takes descriptors only from its own user (uid %d) or root; "
              "this peer is uid %d: run the client as qtxd's user",
              options_.allowed_uid, cred.uid)),
          {});
    ::close(fd);
    return;
  }
  if (connections_.size() >= options_.max_connections) {
    Reply(fd,
          absl::ResourceExhaustedError(absl::StrFormat(
              "qtxd's fd socket already serves %d connections", options_.max_connections)),
          {});
    ::close(fd);
    return;
  }
  const uint64_t session = next_session_++;
  connections_.emplace(fd, session);
  absl::MutexLock lock(&mu_);
  open_sessions_.insert(session);
}

bool FdInbox::HandleMessage(int fd, uint64_t session) {
  char header[kRequestBytes + 1];
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * 253)];
  iovec iov{header, sizeof(header)};
  msghdr msg = {};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  ssize_t got;
  do {
    got = ::recvmsg(fd, &msg, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
  } while (got < 0 && errno == EINTR);
  if (got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return true;
  // Every descriptor that arrived is owned here first, so each path closes it.
  std::vector<OwnedFd> fds;
  bool other_control = false;
  if (got > 0) {
    for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
      if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
        const size_t n = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        for (size_t i = 0; i < n; ++i) {
          int one;
          std::memcpy(&one, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
          fds.emplace_back(one);
        }
      } else {
        other_control = true;
      }
    }
  }
  if (got <= 0) return false;  // closed by the peer (or an error)
  auto refuse = [&](absl::Status s) {
    spdlog::warn("event=fd_message_refused session={} msg=\"{}\"", session,
                 std::string(s.message()));
    Reply(fd, s, {});
    return false;
  };
  if ((msg.msg_flags & MSG_CTRUNC) != 0) {
    return refuse(absl::InvalidArgumentError(absl::StrFormat(
        "more descriptors than one message may carry (at most %d per batch)", kMaxFdsPerBatch)));
  }
  if (other_control) {
    return refuse(absl::InvalidArgumentError("ancillary data other than SCM_RIGHTS"));
  }
  if (static_cast<size_t>(got) != kRequestBytes || (msg.msg_flags & MSG_TRUNC) != 0) {
    return refuse(absl::InvalidArgumentError(absl::StrFormat(
        "a request is exactly %d bytes (magic, version, count, reserved); got %d%s", kRequestBytes,
        got, static_cast<size_t>(got) > kRequestBytes ? " or more" : "")));
  }
  if (GetU32(header) != kMagic) {
    return refuse(
        absl::InvalidArgumentError("bad magic: this is qtxd's fd socket (qtx/fd_passing.h)"));
  }
  if (GetU32(header + 4) != kVersion) {
    return refuse(absl::InvalidArgumentError(absl::StrFormat(
        "protocol version %d: this qtxd speaks version %d", GetU32(header + 4), kVersion)));
  }
  const uint32_t count = GetU32(header + 8);
  if (count == 0 || count > kMaxFdsPerBatch) {
    return refuse(absl::InvalidArgumentError(
        absl::StrFormat("descriptor count %d: must be 1..%d", count, kMaxFdsPerBatch)));
  }
  if (count != fds.size()) {
    return refuse(absl::InvalidArgumentError(
        absl::StrFormat("the header announces %d descriptors but %d are attached (SCM_RIGHTS)",
                        count, fds.size())));
  }
  std::string token(kTokenBytes, '\0');
  if (::getrandom(token.data(), token.size(), 0) != static_cast<ssize_t>(token.size())) {
    Reply(fd, absl::InternalError("qtxd could not make a random token (getrandom)"), {});
    return true;
  }
  absl::Status accepted;
  {
    absl::MutexLock lock(&mu_);
    ExpireLocked(absl::Now());
    if (pending_fd_count_ + fds.size() > options_.max_pending_fds) {
      accepted = absl::ResourceExhaustedError(absl::StrFormat(
          "%d descriptors already wait to be claimed (limit %d): register the regions they were "
          "sent for, or wait %s for unclaimed ones to expire",
          pending_fd_count_, options_.max_pending_fds, absl::FormatDuration(options_.token_ttl)));
    } else {
      pending_fd_count_ += fds.size();
      Pending p;
      p.fds = std::move(fds);
      p.session = session;
      p.expires = absl::Now() + options_.token_ttl;
      pending_.emplace(token, std::move(p));
    }
  }
  if (!accepted.ok()) {
    Reply(fd, accepted, {});  // the descriptors are closed; the connection stays
    return true;
  }
  Reply(fd, absl::OkStatus(), token);
  return true;
}

void FdInbox::ExpireLocked(absl::Time now) {
  for (auto it = pending_.begin(); it != pending_.end();) {
    if (it->second.expires <= now) {
      spdlog::warn("event=fd_token_expired token={}... session={} fds={}", HexPrefix(it->first),
                   it->second.session, it->second.fds.size());
      pending_fd_count_ -= it->second.fds.size();
      it = pending_.erase(it);
    } else {
      ++it;
    }
  }
}

absl::StatusOr<ClaimedFds> FdInbox::Claim(const std::vector<std::string>& tokens) {
  if (tokens.empty()) {
    return absl::InvalidArgumentError(
        "cuda_vmm.fd_tokens: empty (send the chunks' descriptors to qtxd's fd socket first)");
  }
  absl::MutexLock lock(&mu_);
  ExpireLocked(absl::Now());
  uint64_t session = 0;
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (tokens[i].size() != kTokenBytes) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "cuda_vmm.fd_tokens[%d]: %d bytes, must be %d (as qtxd's fd socket returned it)", i,
          tokens[i].size(), kTokenBytes));
    }
    auto it = pending_.find(tokens[i]);
    if (it == pending_.end()) {
      return absl::NotFoundError(absl::StrFormat(
          "cuda_vmm.fd_tokens[%d] (%s...): no descriptors wait under this token: unknown, already "
          "claimed, expired (tokens live %s), or its fd-socket connection closed; send the "
          "descriptors again",
          i, HexPrefix(tokens[i]), absl::FormatDuration(options_.token_ttl)));
    }
    if (i == 0) session = it->second.session;
    if (it->second.session != session) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "cuda_vmm.fd_tokens[%d]: sent on another fd-socket connection than fd_tokens[0] (one "
          "region's descriptors come from one connection)",
          i));
    }
    for (size_t j = 0; j < i; ++j) {
      if (tokens[j] == tokens[i]) {
        return absl::InvalidArgumentError(
            absl::StrFormat("cuda_vmm.fd_tokens[%d] repeats fd_tokens[%d]", i, j));
      }
    }
  }
  ClaimedFds out;
  out.session = session;
  for (const std::string& t : tokens) {
    auto it = pending_.find(t);
    pending_fd_count_ -= it->second.fds.size();
    for (OwnedFd& fd : it->second.fds) out.fds.push_back(std::move(fd));
    pending_.erase(it);
  }
  return out;
}

bool FdInbox::IsSessionOpen(uint64_t session) const {
  absl::MutexLock lock(&mu_);
  return open_sessions_.count(session) != 0;
}

size_t FdInbox::pending_fds() {
  absl::MutexLock lock(&mu_);
  ExpireLocked(absl::Now());
  return pending_fd_count_;
}

}  // namespace qtx::server::api
