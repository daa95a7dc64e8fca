// Passing file descriptors to qtxd. gRPC cannot carry descriptors, so qtxd
// listens on a second unix socket next to its gRPC socket ("<path>.fd") and
// takes them there with SCM_RIGHTS; each batch is answered with a random
// one-time token that a gRPC request (Memory.RegisterRegion, cuda_vmm) then
// names. The connection is the client's session: when it closes (the client
// exits or dies), qtxd drops the regions registered with its descriptors.
//
// Wire format (both ends little-endian; one sendmsg / one reply per batch):
//   request  16 bytes: u32 magic 'QTXF' (0x46585451), u32 version (1),
//            u32 descriptor count n (1..kMaxFdsPerBatch), u32 reserved (0);
//            ancillary data: SCM_RIGHTS with exactly n descriptors.
//   reply    28 bytes + message: u32 magic, u32 status code (absl::StatusCode;
//            0 = OK), 16-byte token (zeros unless OK), u32 message length
//            (<= kMaxReplyMessage), then the message (why, when not OK).
// qtxd checks the peer with SO_PEERCRED: only its own user (or root) may pass
// descriptors, the same users the 0600 gRPC socket admits.
//
// Thread safety: FdPassingConnection is safe for concurrent use (one batch
// at a time on the socket).
#ifndef QTX_CLIENT_QTX_FD_PASSING_H_
#define QTX_CLIENT_QTX_FD_PASSING_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace qtx {

inline constexpr uint32_t kFdPassingMagic = 0x46585451;  // "QTXF"
inline constexpr uint32_t kFdPassingVersion = 1;
inline constexpr size_t kFdPassingRequestBytes = 16;
inline constexpr size_t kFdPassingReplyBytes = 28;
inline constexpr size_t kFdPassingTokenBytes = 16;
// Linux accepts at most 253 descriptors in one SCM_RIGHTS message.
inline constexpr uint32_t kMaxFdsPerBatch = 250;
inline constexpr uint32_t kMaxReplyMessage = 1024;

// The fd socket of the qtxd at gRPC `target` ("unix:///abs/path",
// "unix:path"): "<path>.fd". FAILED_PRECONDITION for a TCP target
// (descriptors only travel over a unix socket on the same host).
absl::StatusOr<std::string> FdSocketPathForTarget(std::string_view target);

class FdPassingConnection {
 public:
  // Connects to `socket_path`. UNAVAILABLE if nothing listens there (a qtxd
  // too old to take descriptors, or not running).
  static absl::StatusOr<std::unique_ptr<FdPassingConnection>> Connect(
      const std::string& socket_path);
  ~FdPassingConnection();
  FdPassingConnection(const FdPassingConnection&) = delete;
  FdPassingConnection& operator=(const FdPassingConnection&) = delete;

  // Sends `fds` (1..kMaxFdsPerBatch; the caller keeps and closes its copies)
  // and returns qtxd's one-time token for them. INVALID_ARGUMENT for a bad
  // count; UNAVAILABLE when the connection broke; otherwise qtxd's refusal
  // (PERMISSION_DENIED for a peer of another user, RESOURCE_EXHAUSTED when
  // too many descriptors wait unclaimed, ...).
  absl::StatusOr<std::string> Send(std::span<const int> fds);

  // Sends raw bytes with `fds` attached and reads one reply: for tests of
  // qtxd's checks. Returns the reply's status (OK: the token).
  absl::StatusOr<std::string> SendRawForTesting(std::string_view bytes, std::span<const int> fds);

  // False once a send or read failed or qtxd closed its end (the session is
  // over; connect again).
  bool ok() const;

 private:
  explicit FdPassingConnection(int fd) : fd_(fd) {}
  absl::StatusOr<std::string> SendLocked(std::string_view bytes, std::span<const int> fds);
  // Reads one reply: the token, or qtxd's status for the request.
  absl::StatusOr<std::string> ReadReplyLocked();

  mutable std::mutex mu_;
  int fd_;                       // guarded by mu_
  mutable bool broken_ = false;  // guarded by mu_
};

// A process-wide connection to the fd socket of `target`'s qtxd, made on
// first use and kept open until the process ends (so that the regions
// registered through it live as long as the process, or until unregistered).
// Reconnects if the previous connection broke (qtxd restarted).
absl::StatusOr<std::shared_ptr<FdPassingConnection>> SharedFdPassingConnection(
    std::string_view target);

}  // namespace qtx

#endif  // QTX_CLIENT_QTX_FD_PASSING_H_
