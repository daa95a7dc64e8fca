// Communicator: the collective transport between the sidecars of one group,
// and RendezvousClient: the key-value exchange a communicator bootstraps from.
//
// The ops (server/ops/allgather.cc) see only these interfaces; GlooCommunicator
// (CPU tensors, TCP) implements them today and an NcclCommunicator (GPU tensors)
// will implement the same class. The interface is the operations qtx needs and
// nothing else (STYLE.md §4): a variable-size all-gather of bytes, an in-place
// all-reduce MAX of floats (straddling-block amaxes) and a barrier.
//
// Memory: every pointer a Communicator method takes lives in memory_kind()
// memory (host for Gloo, device memory for NCCL). `CommCall::stream` names the
// stream the work is ordered on for a device communicator (a cudaStream_t,
// kept opaque so that this header needs no CUDA); host communicators ignore it.
//
// Completion: every method returns only after the operation is complete for
// this rank (a device communicator synchronizes `stream` before returning), or
// failed; except that a device communicator returns once the work is
// enqueued when CommCall::enqueue_only is set. A method never blocks past `CommCall::deadline` plus
// a short grace for tearing down the transport.
//
// Errors: every message begins with name(). Codes:
//   DEADLINE_EXCEEDED  a peer did not take part before the deadline;
//   UNAVAILABLE        the connection to a peer broke (peer process died);
//   ABORTED            Abort() was called, or an earlier call failed: the
//                      communicator is unusable from then on;
//   INVALID_ARGUMENT   bad arguments (checked before anything moves), or
//                      (GlooCommunicator::AllGatherV) ranks that passed
//                      different sizes, found out in step on every rank;
//   INTERNAL           the library failed in an unexpected way.
// After any error other than INVALID_ARGUMENT the communicator is broken and
// every later call fails with ABORTED: destroy it and create a new one.
//
// Thread safety: collective calls must be issued by one thread at a time, in
// the same order on every rank (the group's executor serializes them).
// Abort() and the accessors may be called from any thread.
#ifndef QTX_SERVER_BACKEND_COMMUNICATOR_H_
#define QTX_SERVER_BACKEND_COMMUNICATOR_H_

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "server/tensor/mapped_memory.h"

namespace qtx::server::backend {

// Per-call options of a collective.
struct CommCall {
  // The call fails with DEADLINE_EXCEEDED if it has not completed by then.
  absl::Time deadline = absl::InfiniteFuture();
  // cudaStream_t for a device communicator; ignored by host communicators.
  void* stream = nullptr;
  // Device communicators only, AllGatherV / AllGatherVParts / AllReduceMax /
  // Barrier: return once the collective is enqueued on the stream, without
  // waiting for it (the caller orders its later work on the same stream and
  // learns of completion from the GPU, e.g. a stream-ordered channel's done
  // write). Errors found while enqueueing are still returned; a failure of
  // the enqueued work itself (a peer that never takes part) is not seen by
  // this call. AllGatherHost always waits (its result is on the host). Host
  // communicators ignore it: they finish before returning.
  bool enqueue_only = false;
};

class Communicator {
 public:
  virtual ~Communicator() = default;

  // "gloo[group=g rank=1/4]": prefixes every error message.
  virtual std::string name() const = 0;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  // The memory the collective buffers must live in.
  virtual tensor::MemoryKind memory_kind() const = 0;

  // Gathers a variable-size byte buffer from every rank. Rank r contributes
  // `send` (recv_bytes[rank()] bytes); on return `recv` holds every rank's
  // contribution in rank order, rank r's at offset sum(recv_bytes[0..r)).
  // Every rank must pass the same `recv_bytes` (GlooCommunicator checks it
  // and fails every rank with INVALID_ARGUMENT; a device communicator cannot:
  // its collective may hang until the deadline or deliver other bytes, so
  // callers carry their own check in the data, as ops::AllGather does).
  // REQUIRES: recv_bytes.size() == world_size(); `recv` holds the total;
  // `send` and `recv` do not overlap, except that `send` may be exactly
  // recv + sum(recv_bytes[0..rank())) (in place: this rank's contribution
  // already at its place). Null pointers are allowed for 0 bytes.
  // INVALID_ARGUMENT when recv_bytes has the wrong length.
  virtual absl::Status AllGatherV(const void* send, std::span<const uint64_t> recv_bytes,
                                  void* recv, const CommCall& call) = 0;

  // Several AllGatherV in one step: for a device communicator one launch
  // (NCCL: one ncclGroupStart/End), so that a call pays the per-collective
  // host cost once. Each part follows AllGatherV's rules; every rank passes
  // the same parts in the same order. The default runs them one by one.
  struct GatherPart {
    const void* send = nullptr;
    std::span<const uint64_t> recv_bytes;
    void* recv = nullptr;
  };
  virtual absl::Status AllGatherVParts(std::span<const GatherPart> parts, const CommCall& call) {
    for (const GatherPart& p : parts) {
      absl::Status s = AllGatherV(p.send, p.recv_bytes, p.recv, call);
      if (!s.ok()) return s;
    }
    return absl::OkStatus();
  }

  // All-gather of `bytes` HOST bytes per rank (a small agreement message):
  // on return host `recv` holds every rank's `send`, in rank order. A device
  // communicator moves them through its own reusable pinned and device
  // buffers with a single wait; the default (host communicators) is
  // AllGatherV. `in_flight`, if set, is called at most once, and always when
  // the call returns OK, while the exchange is under way: a device
  // communicator calls it after its collective is enqueued and before waiting
  // for it (device work the caller enqueues there then cannot hold the
  // collective's kernel back); the default calls it first. Errors as
  // AllGatherV.
  virtual absl::Status AllGatherHost(const void* send, uint64_t bytes, void* recv,
                                     const CommCall& call,
                                     const std::function<void()>& in_flight = nullptr) {
    if (in_flight) in_flight();
    std::vector<uint64_t> sizes(static_cast<size_t>(world_size()), bytes);
    return AllGatherV(send, sizes, recv, call);
  }

  // Element-wise maximum over all ranks of `count` floats, in place: on return
  // data[i] = max over ranks of their data[i]. Every rank passes the same count.
  // NaN handling follows std::max (callers pass amaxes, which are never NaN).
  virtual absl::Status AllReduceMax(float* data, uint64_t count, const CommCall& call) = 0;

  // Returns when every rank has entered the barrier.
  virtual absl::Status Barrier(const CommCall& call) = 0;

  // Makes the communicator unusable: a call in progress fails as soon as the
  // transport notices (NCCL: ncclCommAbort; Gloo: at the latest at its
  // deadline), later calls fail with ABORTED. Idempotent; any thread.
  virtual void Abort() = 0;
};

// A key-value store shared by the ranks of a group for bootstrapping a
// communicator (Gloo addresses, the NCCL unique id). Rank 0's sidecar hosts
// the store (qtx.v1.Rendezvous); the other ranks reach it over gRPC.
// Keys are scoped by the caller (e.g. "<group>/<session>/..."), values are
// opaque bytes. Implementations are safe for concurrent use.
class RendezvousClient {
 public:
  virtual ~RendezvousClient() = default;

  // Stores `value` under `key`, replacing any previous value. UNAVAILABLE when
  // the store cannot be reached, DEADLINE_EXCEEDED past `deadline`.
  virtual absl::Status Set(std::string_view key, std::string_view value, absl::Time deadline) = 0;

  // Waits until every key exists, then returns their values in order.
  // DEADLINE_EXCEEDED if some key is still missing at `deadline` (the message
  // names the missing keys); UNAVAILABLE when the store cannot be reached.
  virtual absl::StatusOr<std::vector<std::string>> Get(std::span<const std::string> keys,
                                                       absl::Time deadline) = 0;
};

}  // namespace qtx::server::backend

#endif  // QTX_SERVER_BACKEND_COMMUNICATOR_H_
