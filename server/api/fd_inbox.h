// FdInbox: qtxd's fd socket. Clients pass file descriptors (the POSIX fd
// handles of cuMemCreate memory) with SCM_RIGHTS over a unix socket next to
// the gRPC socket ("<socket>.fd"); each batch is kept under a random
// one-time token that a gRPC request claims (Memory.RegisterRegion,
// cuda_vmm). Wire format: client/qtx/fd_passing.h.
//
// Rules:
// - Peers: SO_PEERCRED must show the server's own effective uid or root --
//   the users the gRPC socket (mode 0600) admits. Anyone else gets a
//   PERMISSION_DENIED reply and is disconnected.
// - Tokens: 16 random bytes, claimed at most once, expire after `token_ttl`
//   unclaimed (their descriptors are closed). At most `max_pending_fds`
//   descriptors wait unclaimed; a batch over that is refused with
//   RESOURCE_EXHAUSTED (its descriptors closed) and the connection stays.
// - A malformed message (size, magic, version, a count that does not match
//   the descriptors attached, truncated ancillary data) gets an
//   INVALID_ARGUMENT reply and the connection is closed.
// - Sessions: every connection has an id; a claim says which connection the
//   descriptors came from. When a connection closes (the client exited or
//   died), IsSessionOpen turns false at once and `on_session_closed(id)`
//   runs on the inbox thread `session_grace` later -- qtxd uses it to drop
//   that client's regions. The grace lets work the client queued before it
//   died (channel operations that name its regions, released when its
//   channel closes) find the regions and finish first.
//
// Thread safety: Claim, IsSessionOpen and pending_fds are safe for
// concurrent use; one internal thread serves the socket until destruction.
#ifndef QTX_SERVER_API_FD_INBOX_H_
#define QTX_SERVER_API_FD_INBOX_H_

#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace qtx::server::api {

// An owned file descriptor (closed on destruction). Movable.
class OwnedFd {
 public:
  OwnedFd() = default;
  explicit OwnedFd(int fd) : fd_(fd) {}
  OwnedFd(OwnedFd&& o) noexcept : fd_(o.Release()) {}
  OwnedFd& operator=(OwnedFd&& o) noexcept;
  OwnedFd(const OwnedFd&) = delete;
  OwnedFd& operator=(const OwnedFd&) = delete;
  ~OwnedFd();
  int get() const { return fd_; }
  int Release() {
    const int fd = fd_;
    fd_ = -1;
    return fd;
  }

 private:
  int fd_ = -1;
};

struct FdInboxOptions {
  std::string socket_path;  // created with mode 0600; a stale socket is replaced
  absl::Duration token_ttl = absl::Seconds(60);
  size_t max_pending_fds = 16384;
  size_t max_connections = 1024;
  absl::Duration session_grace = absl::Seconds(5);
  // Peers whose uid is this (or 0) may pass descriptors. Default: geteuid().
  // Tests set another uid to see a peer refused.
  uid_t allowed_uid = static_cast<uid_t>(-1);
  // Root may pass descriptors too (as it may connect to a 0600 socket).
  bool allow_root = true;
  std::function<void(uint64_t session)> on_session_closed;
};

// Descriptors of one or more claimed tokens, in order, and their session.
struct ClaimedFds {
  std::vector<OwnedFd> fds;
  uint64_t session = 0;
};

class FdInbox {
 public:
  // Listens on options.socket_path. FAILED_PRECONDITION when the path is
  // taken by a live listener or cannot be bound.
  static absl::StatusOr<std::unique_ptr<FdInbox>> Create(FdInboxOptions options);
  // Stops the thread, closes every connection and pending descriptor
  // (on_session_closed is not called) and removes the socket file.
  ~FdInbox();
  FdInbox(const FdInbox&) = delete;
  FdInbox& operator=(const FdInbox&) = delete;

  // Takes the descriptors of `tokens` (all from one connection), in order.
  // NOT_FOUND naming the token's position for one that is unknown, expired
  // or already claimed; INVALID_ARGUMENT for an empty list, a token that is
  // not 16 bytes, or tokens from different connections. On failure no token
  // is consumed.
  absl::StatusOr<ClaimedFds> Claim(const std::vector<std::string>& tokens);

  // Whether connection `session` is still open.
  bool IsSessionOpen(uint64_t session) const;

  // Descriptors waiting to be claimed (after expiring old ones).
  size_t pending_fds();

  const std::string& socket_path() const { return options_.socket_path; }

 private:
  struct Pending {
    std::vector<OwnedFd> fds;
    uint64_t session = 0;
    absl::Time expires;
  };
  explicit FdInbox(FdInboxOptions options) : options_(std::move(options)) {}
  void Serve();
  // Reads one message from connection `fd`; false when it must be closed.
  bool HandleMessage(int fd, uint64_t session);
  // Accepts one connection; returns its session id or 0 when refused.
  void Accept();
  void ExpireLocked(absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Constant after Create.
  const FdInboxOptions options_;
  int listen_fd_ = -1;
  int wake_read_ = -1;
  int wake_write_ = -1;
  std::thread thread_;

  // Used by the inbox thread only.
  std::map<int, uint64_t> connections_;                   // fd -> session
  std::vector<std::pair<absl::Time, uint64_t>> closing_;  // on_session_closed due, in order
  uint64_t next_session_ = 1;

  // State below is protected by mu_.
  mutable absl::Mutex mu_;
  std::map<std::string, Pending, std::less<>> pending_ ABSL_GUARDED_BY(mu_);
  size_t pending_fd_count_ ABSL_GUARDED_BY(mu_) = 0;
  std::set<uint64_t> open_sessions_ ABSL_GUARDED_BY(mu_);
};

}  // namespace qtx::server::api

#endif  // QTX_SERVER_API_FD_INBOX_H_
