// GlooCommunicator: the Communicator for host memory, over Gloo's TCP
// transport (Debian libgloo). How CI runs multi-rank tests on one machine.
//
// Bootstrap: Create() connects a full mesh of TCP pairs, exchanging listening
// addresses through a RendezvousClient under `key_prefix` (wrapped as a
// gloo::rendezvous::Store inside gloo_communicator.cc, behind a
// gloo::rendezvous::PrefixStore).
//
// Gloo reports failures by throwing (gloo::IoException on timeouts and broken
// connections, gloo::EnforceNotMet on misuse). Every Gloo call is made inside
// a catch-all at this class's boundary: no exception ever leaves it; each
// becomes a Status per communicator.h.
//
// Mismatched sizes: Gloo's TCP transport terminates the process (an
// enforce in its event loop thread) when a peer sends more bytes than a
// receive was posted for, e.g. when ranks pass different recv_bytes to
// AllGatherV. So AllGatherV first all-gathers one message of a fixed size
// (kFirstMessageBytes) from every rank: a digest of the caller's recv_bytes,
// this rank's own size, and the first bytes of its contribution. Ranks that
// disagree all fail with INVALID_ARGUMENT after that message (the
// communicator stays in step and usable); only agreed sizes move beyond it,
// in a second Gloo all-gather for contributions longer than the first
// message's room.
//
// SIGPIPE: Gloo writes to its TCP peers with writev, and a write to a peer
// that has gone away raises SIGPIPE. The first Create() in a process sets
// SIGPIPE to ignored when it still has its default action (which ends the
// process), as qtxd's main does; a handler the process installed is kept.
//
// Thread safety: as Communicator (one collective caller at a time).
#ifndef QTX_SERVER_BACKEND_GLOO_COMMUNICATOR_H_
#define QTX_SERVER_BACKEND_GLOO_COMMUNICATOR_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/backend/communicator.h"

namespace gloo {
class Context;
}  // namespace gloo

namespace gloo::transport {
class UnboundBuffer;
}  // namespace gloo::transport

namespace qtx::server::backend {

struct GlooCommunicatorOptions {
  std::string group;  // for name() and messages
  int rank = 0;
  int world_size = 1;
  // Host (name or address) whose interface the TCP pairs listen on.
  std::string host = "127.0.0.1";
  // Scope of this communicator's rendezvous keys (unique per group instance).
  std::string key_prefix;
  RendezvousClient* store = nullptr;  // not owned; used only inside Create()
  // Create() fails with DEADLINE_EXCEEDED if the mesh is not connected by then.
  absl::Time deadline = absl::InfiniteFuture();
};

class GlooCommunicator final : public Communicator {
 public:
  // The size of the first message of every AllGatherV (see above).
  static constexpr uint64_t kFirstMessageBytes = 8192;
  // Of which the contribution's first bytes get all but this header.
  static constexpr uint64_t kFirstMessageHeaderBytes = 32;

  // Connects to every other rank. INVALID_ARGUMENT for bad options (rank
  // outside [0, world_size), world_size < 1, no store, empty host);
  // DEADLINE_EXCEEDED when a peer did not publish its address or connect
  // before the deadline; UNAVAILABLE when the store or a peer is unreachable;
  // INTERNAL when Gloo fails otherwise (e.g. `host` does not resolve).
  static absl::StatusOr<std::unique_ptr<GlooCommunicator>> Create(
      const GlooCommunicatorOptions& options);

  ~GlooCommunicator() override;
  GlooCommunicator(const GlooCommunicator&) = delete;
  GlooCommunicator& operator=(const GlooCommunicator&) = delete;

  std::string name() const override { return name_; }
  int rank() const override { return rank_; }
  int world_size() const override { return world_size_; }
  tensor::MemoryKind memory_kind() const override { return tensor::MemoryKind::kHost; }

  absl::Status AllGatherV(const void* send, std::span<const uint64_t> recv_bytes, void* recv,
                          const CommCall& call) override;
  absl::Status AllReduceMax(float* data, uint64_t count, const CommCall& call) override;
  absl::Status Barrier(const CommCall& call) override;
  void Abort() override;

 private:
  GlooCommunicator(std::string name, int rank, int world_size,
                   std::shared_ptr<gloo::Context> context);

  // Checks that the communicator is usable and the deadline has not passed;
  // returns the time left, at least 1 ms.
  absl::StatusOr<absl::Duration> Begin(const CommCall& call, const char* op);
  // Records a failure (the communicator is broken from now on), closes the
  // connections so that peers notice at once, and returns the status.
  absl::Status Fail(absl::Status status);
  // One gloo::allgatherv of `counts` bytes per rank from `in` into `out`
  // (Guarded; Abort() can wake it). Errors as AllGatherV; does not call Fail.
  absl::Status Allgatherv(const char* what, const void* in, void* out,
                          const std::vector<size_t>& counts, absl::Duration left,
                          const CommCall& call);

  // Constant after construction.
  const std::string name_;
  const int rank_;
  const int world_size_;
  const std::shared_ptr<gloo::Context> context_;

  // Used by the one collective caller only.
  uint32_t next_tag_ = 1;

  std::atomic<bool> aborted_{false};
  mutable absl::Mutex mu_;
  std::string broken_reason_ ABSL_GUARDED_BY(mu_);
  // The Gloo buffers of the collective in progress, which Abort() wakes.
  std::vector<gloo::transport::UnboundBuffer*> live_ ABSL_GUARDED_BY(mu_);
  friend class LiveBuffers;
};

}  // namespace qtx::server::backend

#endif  // QTX_SERVER_BACKEND_GLOO_COMMUNICATOR_H_
