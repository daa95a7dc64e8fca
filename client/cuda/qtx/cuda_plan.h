// qtx::cuda::Plan: a stream-ordered qtx operation that a CUDA graph can
// capture and replay.
//
// A channel submission (qtx/cuda_channel.h) is a host call, so a captured
// graph cannot contain it: replaying the graph would replay only the
// caller's stream operations, with the sequence numbers of capture time,
// and order nothing. A plan fixes one operation (tensors, shapes, config)
// when it is created; qtxd then runs it once per execution, and the caller's
// side of an execution is one single-thread kernel, launched by Enqueue:
//
//   auto plan = qtx::cuda::Plan::Open(*client, qtx::QuantizePlan{x, cfg, outs});
//   cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal);
//   produce<<<..., stream>>>(x);
//   (*plan)->Enqueue(stream);       // captured: one kernel node
//   gemm<<<..., stream>>>(outs);    // runs after qtxd wrote the outputs
//   cudaStreamEndCapture(stream, &graph);
//   ... cudaGraphLaunch(exec, stream) every step ...
//
// The kernel moves the plan's ready word to the next execution number n (a
// counter in the flag memory, so every replay gets a new n) and spins until
// qtxd's done word reaches n; qtxd keeps the next executions enqueued on
// its own stream, each waiting for its n (channel.proto, "Plans"). What a
// graph may hold, precisely: Enqueue's kernel, any number of times, for any
// number of plans; not Channel::Quantize & co (host calls), not the plan's
// creation or Close. Replays must run in order on one stream at a time per
// plan (two concurrent replays of one plan would share its counter).
//
// The spinning kernel occupies one thread slot of one SM while it waits
// (backing off to ~1 us polls). Under MPS a hand-off costs microseconds;
// without MPS the two processes time-slice (about a millisecond per
// hand-off). Failures: a failed execution releases the kernel (qtxd writes
// the failure value), and status() and the next Enqueue report it; if qtxd
// goes away, the plan's flags are released for good (every later kernel
// passes at once) and status() is UNAVAILABLE. Outputs of a failed or
// released execution are not valid.
//
// Close() (or the destructor) after the stream has finished its last replay
// (e.g. cudaStreamSynchronize): qtxd then runs the executions it had
// enqueued ahead once more each on the same tensors before the plan ends,
// so keep them allocated until Close returns.
#ifndef QTX_CLIENT_CUDA_QTX_CUDA_PLAN_H_
#define QTX_CLIENT_CUDA_QTX_CUDA_PLAN_H_

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "qtx/channel.h"
#include "qtx/client.h"
#include "qtx/cuda_channel.h"

namespace qtx::cuda {

struct PlanOptions {
  ChannelOptions channel;  // label, open timeout
  FlagMemory memory = FlagMemory::kHostShm;
  // Executions qtxd keeps enqueued ahead (1..16).
  uint32_t lookahead = 2;
};

class Plan {
 public:
  // Opens a plan channel for `op` on the current CUDA device. Errors as
  // qtx::Channel::OpenPlan and CreateStreamFlags.
  static absl::StatusOr<std::unique_ptr<Plan>> Open(Client& client, const PlanOp& op,
                                                    const PlanOptions& options = {});
  ~Plan();
  Plan(const Plan&) = delete;
  Plan& operator=(const Plan&) = delete;

  // Enqueues one execution on `stream` (a stream of the plan's device): the
  // op reads its inputs after the stream's earlier work, and the stream's
  // later work runs after its outputs are written. One kernel launch; no
  // host wait; capturable. Fails at once, launching nothing, with the plan's
  // first failure, UNAVAILABLE when qtxd is gone, or FAILED_PRECONDITION
  // once closed; INTERNAL if the launch fails.
  absl::Status Enqueue(cudaStream_t stream);

  // Executions qtxd reported finished.
  uint64_t completed() const { return channel_->completed(); }
  // OK, or why the plan cannot run (as Enqueue would fail).
  absl::Status status() const { return channel_->status(); }

  // Ends the plan (see above). Returns its first failure, if any.
  absl::Status Close();

 private:
  Plan(std::unique_ptr<Channel> channel, unsigned long long* words)
      : channel_(std::move(channel)), words_(words) {}
  std::unique_ptr<Channel> channel_;
  unsigned long long* const words_;  // ready, done, counter (GPU addresses)
  bool closed_ = false;
};

}  // namespace qtx::cuda

#endif  // QTX_CLIENT_CUDA_QTX_CUDA_PLAN_H_
