// qtx::Channel: stream-ordered asynchronous calls to one qtxd
// (proto/qtx/v1/channel.proto). Quantize and Dequantize on a channel return
// as soon as the operation is submitted; the ordering against the caller's
// work is done by the flag area, not by the host:
//
//   ready = n  (caller's stream)  ->  qtxd: wait ready >= n, op, done = n
//   wait done >= n  (caller's stream)
//
// so the sidecar reads the inputs only after the caller's earlier work on its
// stream, and the caller's later work on that stream runs only after the
// outputs are written. Tensors stay in registered regions (descriptors only).
//
// Where the flags live and how "the caller's stream" writes and waits is a
// ChannelFlags: qtx::cuda::OpenChannel (qtx_client_cuda, "qtx/cuda_channel.h")
// binds a channel to a CUDA stream of the caller (CUDA stream memory
// operations on device memory); HostChannelFlags (below) is the host form
// for a CPU sidecar, where the caller's "stream" is its host thread (ready is
// written at submission; outputs are valid once the op is reported done).
//
//   auto ch = qtx::cuda::OpenChannel(*client, stream);          // once
//   auto op = (*ch)->Quantize(input_slice, cfg, outputs);      // per layer
//   my_gemm<<<..., stream>>>(...);  // reads the outputs, after the wait
//   ...
//   QTX_RETURN_IF_ERROR((*ch)->Synchronize());                  // e.g. at step end
//
// Failures: a rejected or failed operation releases the caller's waits (its
// done word jumps past every sequence number) and fails the channel for good.
// The first failure is returned by the next call and by Synchronize(),
// naming the operation; its outputs, and those of every later operation, are
// never reported done. If qtxd goes away, the channel releases the caller's
// waits itself and every later call fails with UNAVAILABLE.
//
// Thread safety: one thread at a time per channel (like a CUDA stream, the
// submission order is the order of the calls); Query and Synchronize may be
// called from any thread.
#ifndef QTX_CLIENT_QTX_CHANNEL_H_
#define QTX_CLIENT_QTX_CHANNEL_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "qtx/collective_types.h"
#include "qtx/types.h"

namespace qtx {

class Client;
class ShmRegion;

// done = kChannelFailedOffset + n marks operation n failed (channel.proto).
inline constexpr uint64_t kChannelFailedOffset = uint64_t{1} << 62;
// The done value a client writes itself when qtxd is gone: ahead of every
// sequence number, so it releases every wait.
inline constexpr uint64_t kChannelReleaseAll = (uint64_t{1} << 63) - 1;

// The caller's side of the flag area: where it is and how the caller's
// stream writes "ready" and waits on "done". Implementations: HostChannelFlags
// (here), qtx::cuda's CUDA-stream flags (qtx_client_cuda).
class ChannelFlags {
 public:
  virtual ~ChannelFlags() = default;
  // The 16-byte flag area as registered with qtxd (ready at +0, done at +8).
  virtual RegionSlice slice() const = 0;
  // Orders "ready = seq" after the caller's work submitted so far.
  virtual absl::Status SignalReady(uint64_t seq) = 0;
  // Orders the caller's later work after "done >= seq" (as
  // CU_STREAM_WAIT_VALUE_GEQ compares: (int64_t)(done - seq) >= 0).
  virtual absl::Status WaitDone(uint64_t seq) = 0;
  // Writes done = kChannelReleaseAll from the caller's side: every present
  // and future WaitDone passes. With `sidecar_gone` (the stream to qtxd broke:
  // qtxd died) it also writes ready = kChannelReleaseAll, so that the work the
  // dead qtxd left parked on "ready >= n" can drain: under MPS a dead client's
  // parked stream waits would otherwise hold the MPS server, and with it
  // every other client of the GPU. Bounded time; never fails.
  virtual void ReleaseWaits(bool sidecar_gone) = 0;
};

// Flags in POSIX shared memory, for a CPU sidecar (qtxd --device=cpu
// --allow_client_shm): the caller's host is its stream. SignalReady stores at
// once; WaitDone enqueues nothing (the outputs of op n are valid once
// Query(n) says done, or after Synchronize()). The shm region is registered
// with qtxd under `region_name` and unregistered on destruction.
class HostChannelFlags final : public ChannelFlags {
 public:
  // INVALID_ARGUMENT / the server's status when the shm region cannot be
  // created or registered (FAILED_PRECONDITION without --allow_client_shm).
  static absl::StatusOr<std::unique_ptr<HostChannelFlags>> Create(Client& client,
                                                                  std::string region_name);
  ~HostChannelFlags() override;

  RegionSlice slice() const override;
  absl::Status SignalReady(uint64_t seq) override;
  absl::Status WaitDone(uint64_t seq) override;
  void ReleaseWaits(bool sidecar_gone) override;

  // The current words (for tests and diagnostics).
  uint64_t ready() const;
  uint64_t done() const;

 private:
  HostChannelFlags(Client& client, std::unique_ptr<ShmRegion> shm);
  Client& client_;
  std::unique_ptr<ShmRegion> shm_;
};

struct ChannelOptions {
  // Shown in qtxd's log ("rank3/tp"); at most 128 bytes.
  std::string label;
  // How long Open waits for qtxd to accept the channel.
  absl::Duration open_timeout = absl::Seconds(30);
  // How long Synchronize() waits before DEADLINE_EXCEEDED.
  absl::Duration sync_timeout = absl::Minutes(5);
  // Where a submission's stream write starts. false: on the calling thread
  // when no write is in flight (gRPC serializes the descriptor and usually
  // writes the socket right there, several microseconds). true: a thread of
  // the channel's own starts it; the call only queues the descriptor and
  // wakes that thread, so it returns sooner, and qtxd sees the descriptor a
  // thread wake-up later (the caller's stream waits on the flags anyway).
  // One more thread per channel, idle between submissions. The order of the
  // descriptors is the order of the calls either way.
  bool background_writer = false;
};

// Diagnostics for benchmarks (bench/python_channel_bench.py --breakdown):
// where the host time of Quantize / Dequantize / AllGather submissions goes
// on the calling thread. Off by default (one relaxed atomic load per
// submission); while on, every submission of this process adds its parts to
// the calling thread's profile.
struct ChannelSubmitProfile {
  uint64_t calls = 0;       // submissions that succeeded
  uint64_t check_ns = 0;    // the channel's state (closed, failed, qtxd gone)
  uint64_t build_ns = 0;    // the descriptor (the protobuf request)
  uint64_t signal_ns = 0;   // flags.SignalReady ("ready = n" on the caller's stream)
  uint64_t enqueue_ns = 0;  // the descriptor to the stream (a write started, or queued)
  uint64_t wait_ns = 0;     // flags.WaitDone ("wait done >= n" on the caller's stream)
};
void SetChannelSubmitProfiling(bool on);
// The calling thread's profile since the last call; clears it.
ChannelSubmitProfile TakeChannelSubmitProfile();

// The operation of a plan channel (Channel::OpenPlan): fixed once, run by
// qtxd once per execution. Tensors as for Channel::Quantize / Dequantize.
struct QuantizePlan {
  Tensor input;
  QuantizeConfig config;
  QuantizeOutputs outputs;
};
struct DequantizePlan {
  QuantizedTensor input;
  DType output_dtype = DType::kFloat32;
  RegionSlice output;
};
using PlanOp = std::variant<QuantizePlan, DequantizePlan>;

class Channel {
 public:
  // Opens a channel on `client`'s qtxd with `flags` (which the channel owns
  // and destroys after the stream ends). Fails with the server's status:
  // INVALID_ARGUMENT / NOT_FOUND / FAILED_PRECONDITION for a bad flag area
  // (a cuda_ipc region on a CUDA sidecar, a shm region on a CPU one);
  // UNAVAILABLE or DEADLINE_EXCEEDED when qtxd does not answer in time.
  // `client` must outlive the channel.
  static absl::StatusOr<std::unique_ptr<Channel>> Open(Client& client,
                                                       std::unique_ptr<ChannelFlags> flags,
                                                       const ChannelOptions& options = {});

  // Opens a plan channel (proto/qtx/v1/channel.proto, "Plans"): qtxd runs
  // `op` once per execution n = 1, 2, ..., each ordered by `flags` exactly
  // as submission n of a plain channel, with no submission: the caller moves
  // ready to n and waits for done >= n itself (qtx::cuda::Plan does both in
  // one kernel that a CUDA graph can capture and replay). qtxd keeps up to
  // `lookahead` (1..16, qtxd refuses more) executions enqueued ahead. A plan channel takes no
  // Quantize/Dequantize/AllGather (FAILED_PRECONDITION); its op is checked
  // by qtxd at each execution (a bad op fails the channel, seen by status()).
  // Close() releases the executions still enqueued: they run the op once
  // more each, so keep its tensors until Close returns. Errors as Open.
  static absl::StatusOr<std::unique_ptr<Channel>> OpenPlan(Client& client,
                                                           std::unique_ptr<ChannelFlags> flags,
                                                           const PlanOp& op,
                                                           const ChannelOptions& options = {},
                                                           uint32_t lookahead = 2);

  // Close(), errors ignored.
  ~Channel();
  Channel(const Channel&) = delete;
  Channel& operator=(const Channel&) = delete;

  // Submits a quantization and returns its operation id (1, 2, ...). Every
  // tensor must be a slice of a registered region in qtxd's compute memory
  // (`input` a region tensor, every requested output in `outputs`); qtxd
  // checks the rest when the op reaches its turn (a bad op fails the channel,
  // reported by a later call). Fails at once, submitting nothing, with the
  // channel's first failure, UNAVAILABLE when qtxd is gone, or
  // INVALID_ARGUMENT for inline tensors.
  absl::StatusOr<uint64_t> Quantize(const Tensor& input, const QuantizeConfig& config,
                                    const QuantizeOutputs& outputs);

  // Submits a dequantization of `input` (its tensors region slices) into
  // `output`. As Quantize.
  absl::StatusOr<uint64_t> Dequantize(const QuantizedTensor& input, DType output_dtype,
                                      const RegionSlice& output);

  // Submits this rank's part of the group's AllGather `sequence` (see
  // Client::AllGather; every rank of the group makes the matching call,
  // through its channel or a plain AllGather). `input` and every requested
  // output (sized for the gathered [sum M_r, N]) are region slices. The
  // sidecar reads the shard after the caller's earlier work on the stream,
  // and the caller's later work sees the gathered outputs. As Quantize.
  // `shard_rows` (optional, as for Client::AllGather): every rank's M_r in
  // rank order, the same list on every rank; then the sidecars gather in
  // one round and qtxd never waits for the GPU (the slot check runs on the
  // device). A check that fails there (a peer's rejected request, ranks
  // that disagree) fails this operation once its device work has run: it is
  // never reported done, and Query / Synchronize / the next call return the
  // error, naming the rank and field (docs/numerics.md §5.3).
  absl::StatusOr<uint64_t> AllGather(std::string_view group, uint64_t sequence, const Tensor& input,
                                     const QuantizeConfig& config, AllGatherMode mode,
                                     const QuantizeOutputs& outputs,
                                     const std::vector<int64_t>& shard_rows = {});

  // Whether operation `op` has finished: true when done, false while pending;
  // the failure when `op` failed or was not run because an earlier one
  // failed; UNAVAILABLE when qtxd went away before it was reported done;
  // INVALID_ARGUMENT for an id never returned.
  absl::StatusOr<bool> Query(uint64_t op) const;

  // Waits (host) until every submitted operation has finished. OK, the
  // channel's first failure (naming the operation), UNAVAILABLE when qtxd is
  // gone, DEADLINE_EXCEEDED after options.sync_timeout.
  absl::Status Synchronize();

  // Synchronize(), then ends the stream and releases the flags. Later calls
  // fail with FAILED_PRECONDITION. Returns Synchronize's status.
  absl::Status Close();

  // Operations submitted so far (the last id).
  uint64_t submitted() const;

  // Operations (of a plan: executions) qtxd reported done, in order.
  uint64_t completed() const;
  // OK while the channel can take work: else its first failure (naming the
  // operation or execution), UNAVAILABLE once qtxd is gone, or
  // FAILED_PRECONDITION once closed.
  absl::Status status() const;
  bool is_plan() const { return plan_; }
  // The flag area (for callers that drive a plan's flags themselves).
  ChannelFlags& flags() const { return *flags_; }

 private:
  class Stream;
  explicit Channel(std::unique_ptr<ChannelFlags> flags, ChannelOptions options);
  static absl::StatusOr<std::unique_ptr<Channel>> OpenWith(Client& client,
                                                           std::unique_ptr<ChannelFlags> flags,
                                                           const ChannelOptions& options,
                                                           const PlanOp* plan, uint32_t lookahead);
  // OK when a new operation may be submitted: not closed, not failed, qtxd
  // still there.
  absl::Status CheckUsable() const;
  // CheckUsable, and FAILED_PRECONDITION on a plan channel.
  absl::Status CheckSubmit() const;
  // One submission (defined and used in channel.cc only): CheckSubmit;
  // INVALID_ARGUMENT when `input` (if any) is an inline tensor; then `fill`
  // writes the operation into the descriptor of the next sequence number,
  // which goes to qtxd. Returns that number.
  template <typename Fill>
  absl::StatusOr<uint64_t> SubmitOp(const Tensor* input, Fill&& fill);

  std::unique_ptr<ChannelFlags> flags_;  // destroyed after stream_
  const ChannelOptions options_;
  std::unique_ptr<Stream> stream_;
  // Written by the submitting thread; Query, Synchronize and submitted() may
  // read them from others.
  std::atomic<uint64_t> next_seq_{1};
  std::atomic<bool> closed_{false};
  std::atomic<uint64_t> completed_at_close_{0};
  bool plan_ = false;
};

}  // namespace qtx

#endif  // QTX_CLIENT_QTX_CHANNEL_H_
