// NcclCommunicator: the Communicator for device memory, over NCCL (one CUDA
// device per sidecar, one rank per sidecar).
//
// Bootstrap: rank 0 calls ncclGetUniqueId and publishes the 128-byte id
// through the group's RendezvousClient under `key_prefix` + "nccl/unique_id"
// (the same KV path the Gloo bootstrap uses); every rank reads it and calls
// ncclCommInitRankConfig with ncclConfig_t.blocking = 0, then polls
// ncclCommGetAsyncError until the communicator is ready or the deadline
// passes (then ncclCommAbort + DEADLINE_EXCEEDED): a rank that never arrives
// never hangs Create().
//
// Two communicators: a nonblocking one only makes Create abortable. With
// blocking = 0 NCCL starts a host thread for every launch (every
// ncclGroupEnd, ~150-190 us on an H200 host), so Create then splits it
// (ncclCommSplit, color 0, key = rank) into a child with blocking = 1 and
// runs every collective on that child. The split is an asynchronous job of
// the nonblocking parent (NCCL runs it as the parent's group job), so Create
// polls the parent's ncclCommGetAsyncError and aborts the parent (which also
// stops the child's init) at the deadline. Create then warms the child up
// (the collectives and sizes the ops use, so that NCCL's runtime connection
// setup, which blocks on the peers' host threads, happens inside Create):
// on a helper thread, while Create polls to the deadline and calls
// ncclCommAbort on the child if it passes (aborting from another thread is
// how NCCL documents unblocking a blocking call). After Create, a blocking
// collective call returns once enqueued (the peers are met on the GPU), so
// the no-hang guarantee is unchanged: the wait below polls the stream.
//
// Collectives are enqueued on CommCall::stream, or, when that is null, on the
// stream `default_stream` returns for the calling thread (the CudaDevice's
// per-thread stream, so NCCL work is ordered after the thread's kernels and
// copies). AllGatherHost (host bytes in and out) runs on the communicator's
// own stream instead, so that it overlaps with device work the caller has
// already enqueued on its stream. With CommCall::enqueue_only (the
// stream-ordered AllGather of a channel) a call returns once enqueued.
// Otherwise each call then waits for its stream by
// polling cudaStreamQuery and ncclCommGetAsyncError until the work is done,
// the deadline passes, Abort() is called or NCCL reports an error; in the
// last three cases the communicator is broken from then on
// (communicator.h error codes: DEADLINE_EXCEEDED, ABORTED, UNAVAILABLE for a
// remote/system error, INTERNAL otherwise).
// The failing call marks the communicator broken and returns at once; the
// ncclCommAbort of both communicators (which also stops the in-flight
// kernels, and can take hundreds of milliseconds while NCCL tears down its
// connections and proxy threads) runs on a background thread, off the
// request path, so that the caller's error still reaches its client before
// the client's deadline. The destructor waits for that thread.
//
// Costs: one launch per call (AllGatherVParts batches its parts into one
// ncclGroupStart/End); AllGatherHost (the ops' small agreement messages) is
// H2D copy + ncclAllGather + D2H copy on one stream with one wait, through
// reusable pinned and device buffers (a host copy in a one-rank group).
// AllGatherHost therefore waits for the GPU when there are peers: NCCL runs
// one communicator's work in issue order, so it follows the previous
// enqueue-only gather, and on an H200 its copies were also seen queued
// behind device work parked on other streams. A stream-ordered AllGather of
// two or more ranks thus still waits at its header exchange for the GPU to
// reach the previous one (a host-side agreement transport would lift this;
// not built).
//
// AllGatherV: equal sizes use one ncclAllGather; unequal sizes a group
// (ncclGroupStart/End) of one ncclBroadcast per rank with a non-empty
// contribution, rooted at that rank and received at its offset, so that no
// rank pads or copies (see DESIGN note in nccl_communicator.cc).
//
// Both ncclComm_t are released with ncclCommAbort in the destructor (never
// leaked, never blocking on peers).
//
// Thread safety: as Communicator (one collective caller at a time); Abort()
// and the accessors from any thread.
#ifndef QTX_SERVER_BACKEND_NCCL_COMMUNICATOR_H_
#define QTX_SERVER_BACKEND_NCCL_COMMUNICATOR_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/backend/communicator.h"

struct ncclComm;

namespace qtx::server::backend {

struct NcclCommunicatorOptions {
  std::string group;  // for name() and messages
  int rank = 0;
  int world_size = 1;
  int device_ordinal = 0;  // the CUDA device of this rank
  // Scope of this communicator's rendezvous keys (unique per group instance).
  std::string key_prefix;
  RendezvousClient* store = nullptr;  // not owned; used only inside Create()
  // Create() fails with DEADLINE_EXCEEDED if the communicator is not ready by then.
  absl::Time deadline = absl::InfiniteFuture();
  // The cudaStream_t (as void*) for calls whose CommCall::stream is null;
  // called on the collective's thread. Null: the legacy default stream.
  std::function<absl::StatusOr<void*>()> default_stream;
};

class NcclCommunicator final : public Communicator {
 public:
  // INVALID_ARGUMENT for bad options (rank outside [0, world_size),
  // world_size < 1, no store, negative ordinal); DEADLINE_EXCEEDED when the
  // unique id or a peer did not arrive before the deadline (the half-built
  // communicator is aborted); UNAVAILABLE when the store is unreachable or
  // NCCL reports a remote/system error; INTERNAL for other CUDA/NCCL failures.
  static absl::StatusOr<std::unique_ptr<NcclCommunicator>> Create(
      const NcclCommunicatorOptions& options);

  ~NcclCommunicator() override;
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  std::string name() const override { return name_; }
  int rank() const override { return rank_; }
  int world_size() const override { return world_size_; }
  tensor::MemoryKind memory_kind() const override { return tensor::MemoryKind::kDevice; }

  // `send` may also be exactly recv + sum(recv_bytes[0..rank)) (in place).
  absl::Status AllGatherV(const void* send, std::span<const uint64_t> recv_bytes, void* recv,
                          const CommCall& call) override;
  absl::Status AllGatherVParts(std::span<const GatherPart> parts, const CommCall& call) override;
  absl::Status AllGatherHost(const void* send, uint64_t bytes, void* recv, const CommCall& call,
                             const std::function<void()>& in_flight = nullptr) override;
  absl::Status AllReduceMax(float* data, uint64_t count, const CommCall& call) override;
  absl::Status Barrier(const CommCall& call) override;
  // Sets a flag that the waiting call (or the next one) turns into
  // ncclCommAbort + ABORTED.
  void Abort() override;

 private:
  NcclCommunicator(std::string name, int rank, int world_size, int device, ncclComm* parent,
                   ncclComm* comm, float* scratch, void* side_stream,
                   std::function<absl::StatusOr<void*>()> default_stream);

  // Checks that the communicator is usable and the deadline has not passed,
  // makes the device current and returns the stream to enqueue on.
  absl::StatusOr<void*> Begin(const CommCall& call, const char* op);
  // After enqueueing (ncclGroupEnd or a single call returned `enqueued`):
  // waits until the work on `stream` is done (with `enqueue_only`: checks
  // the enqueue result and NCCL's async error, and returns without waiting);
  // on any failure aborts the communicator and returns the error.
  absl::Status Finish(int enqueued, void* stream, absl::Time deadline, const char* op,
                      bool enqueue_only = false);
  // Records the failure (the communicator is broken from now on), starts
  // ncclCommAbort on the reaper thread, returns `status` at once.
  absl::Status Fail(absl::Status status);
  // Enqueues `parts` on `stream` inside one ncclGroupStart/End; returns the
  // first NCCL result that is neither success nor in-progress, else the
  // group end's.
  int EnqueueGather(std::span<const GatherPart> parts, ncclComm* comm, void* stream);

  // Constant after construction.
  const std::string name_;
  const int rank_;
  const int world_size_;
  const int device_;
  const std::function<absl::StatusOr<void*>()> default_stream_;
  float* const scratch_;     // one device float for Barrier
  void* const side_stream_;  // cudaStream_t of AllGatherHost (owned)

  std::atomic<bool> abort_requested_{false};
  // Used by the (single) collective caller and the destructor only.
  std::thread reaper_;        // runs the ncclCommAbort of a failed call
  void* host_buf_ = nullptr;  // pinned, host_bytes_ (AllGatherHost)
  void* dev_buf_ = nullptr;   // device, host_bytes_ (AllGatherHost)
  uint64_t host_bytes_ = 0;
  mutable absl::Mutex mu_;
  ncclComm* parent_ ABSL_GUARDED_BY(mu_);  // nonblocking; null once aborted
  ncclComm* comm_ ABSL_GUARDED_BY(mu_);    // blocking child; null once aborted
  std::string broken_reason_ ABSL_GUARDED_BY(mu_);
};

}  // namespace qtx::server::backend

#endif  // QTX_SERVER_BACKEND_NCCL_COMMUNICATOR_H_
