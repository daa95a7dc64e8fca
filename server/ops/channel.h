// Channel: the server side of one stream-ordered channel
// (proto/qtx/v1/channel.proto, ARCHITECTURE "Stream-ordered channels").
//
// Each submitted operation n becomes, on the device's channel queue
// (backend::ChannelQueue): wait ready >= n -> the op (ops::Quantize /
// ops::Dequantize with the queue set: enqueued, never waited for) ->
// done = n. A worker thread of the channel does the enqueueing, in
// submission order, so the thread that receives submissions (gRPC) never
// blocks. A failed operation n writes done = kChannelFailedOffset + n (which
// releases every wait of the client) and fails the channel for good: later
// operations are not run. An operation whose failure shows only once its
// device work has run (ChannelTask's completion check) fails the channel
// from the completion path: it and every later operation are never
// reported done, and the first operation not yet enqueued then writes the
// failure value.
//
// Progress (ops completed on the device, the first failure) is reported
// through the callback given to Open, from the channel's threads, as
// snapshots that only move forward (completed_through never decreases; the
// failure, once set, stays). Snapshots may arrive out of order: a receiver
// keeps the largest.
//
// A plan channel (proto/qtx/v1/channel.proto, "Plans") has no submissions:
// its worker runs the plan's operation as execution 1, 2, ... (each exactly
// like a submission with that sequence number), keeping up to `lookahead`
// executions enqueued beyond the last finished one. It stops at the first
// failure or at Close, which releases the executions still waiting.
//
// Thread safety: Submit may be called from any thread, one at a time (the
// stream's order is the submission order); the destructor must not race
// Submit.
#ifndef QTX_SERVER_OPS_CHANNEL_H_
#define QTX_SERVER_OPS_CHANNEL_H_

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <variant>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/backend/device.h"
#include "server/ops/quantize.h"
#include "server/tensor/region_table.h"
#include "server/tensor/tensor_ref.h"

namespace qtx::server::ops {

// At most this many operations of a plain channel are enqueued on the
// device beyond the last one known finished; the worker waits for room
// before enqueueing more. The client's stream hands over one operation at a
// time (it writes ready = n + 1 only after done = n), so a longer lead gains
// nothing, while hundreds of operations parked behind a ready word that does
// not move would sit in the device's command queue, where they cannot be
// taken back (and after a client is gone, at most this many run before the
// channel closes: Close).
inline constexpr uint64_t kMaxEnqueuedAhead = 32;

// While Close waits for a worker that does not return, it logs what the
// worker and the device queue wait on this often.
inline constexpr absl::Duration kCloseReportEvery = absl::Seconds(2);
// While Close waits for released work to drain, it stores the release values
// again this often (Channel::Close).
inline constexpr absl::Duration kCloseReleaseEvery = absl::Milliseconds(1);

// done = kChannelFailedOffset + n marks operation n as failed; sequence
// numbers stay below it (channel.proto).
inline constexpr uint64_t kChannelFailedOffset = uint64_t{1} << 62;
// The flag area: ready (uint64) at +0, done (uint64) at +8.
inline constexpr uint64_t kChannelFlagBytes = 16;

// A check of an operation that can be made only once its device work has
// completed (ops::AllGatherResult::completion_check: the one-round slot
// check, which the device runs in stream order): OK, or the op's failure.
using CompletionCheck = std::function<absl::Status()>;

// An operation the caller of Submit runs itself, ordered by the queue it is
// given: `run` must order its device work after the work enqueued on the
// queue so far and the queue after its own (backend::CudaEvents::queue), and
// return once its work is enqueued or done. Used for AllGather, which runs
// on its group's thread and only enqueues on a CUDA device: the channel pins
// `regions` (the names of the registered regions its device work reads or
// writes) until the queue has passed it, as for Quantize.
// `run` may set *check: the channel then calls it from its completion path,
// once the device has finished the op, and a failure there fails the op as
// if `run` had returned it (it is never reported done; its done word has
// moved on already, so the client's stream is released either way).
struct ChannelTask {
  std::function<absl::Status(backend::ChannelQueue* queue, CompletionCheck* check)> run;
  std::vector<std::string> regions;
};

// One submitted operation; an absl::Status is a submission the receiver
// could not even parse, which fails the channel at its turn (in order).
using ChannelOp =
    std::variant<QuantizeRequestSpec, DequantizeRequestSpec, ChannelTask, absl::Status>;

// The operation of a plan channel. `keepalive` owns what `op` borrows, for
// the channel's life.
struct ChannelPlan {
  std::variant<QuantizeRequestSpec, DequantizeRequestSpec> op;
  std::shared_ptr<const void> keepalive;
  uint32_t lookahead = 2;  // 1..kMaxPlanLookahead
};
inline constexpr uint32_t kMaxPlanLookahead = 16;

struct ChannelProgress {
  // Operations 1..completed_through finished successfully on the device.
  uint64_t completed_through = 0;
  // 0, or the first failed operation; `failure` is then its status.
  uint64_t failed_seq = 0;
  absl::Status failure;
};

class Channel {
 public:
  using ProgressFn = std::function<void(const ChannelProgress&)>;

  // Opens a channel on ctx.device whose flag area is the slice `flags` of a
  // registered region (pinned for the channel's life). INVALID_ARGUMENT
  // when the slice is not 16 bytes or its offset is not a multiple of 8;
  // NOT_FOUND for an unknown region; FAILED_PRECONDITION when the device
  // cannot order on that memory (the CPU needs shm; a CUDA device takes shm,
  // the robust default, or cuda_ipc) or has no channels. `ctx` members must
  // outlive the channel.
  // With `plan`, a plan channel (INVALID_ARGUMENT for a lookahead outside
  // 1..kMaxPlanLookahead).
  static absl::StatusOr<std::unique_ptr<Channel>> Open(
      const tensor::RegionSliceSpec& flags, const OpContext& ctx, ProgressFn on_progress,
      std::optional<ChannelPlan> plan = std::nullopt);

  // Stops taking submissions and ends the channel: every operation already
  // submitted is enqueued; then, if they have not all finished within
  // `grace`, the queue is released (its waits on the client's ready word
  // pass; backend::ChannelQueue::Release) so the device work drains; returns
  // when it has. No progress callback runs after it returns.
  // `client_gone` (the client's call was cancelled: its process may be dead):
  // no grace, the operations not yet enqueued are dropped, and the done word
  // is set to kChannelFailedOffset + (the first unfinished operation), so
  // that the waits the client's stream still holds pass
  // (backend::ChannelQueue::ReleaseClientWaits): a killed process's stream
  // parked on hundreds of those waits kept our queue from running, the GPU
  // idle, until they passed (H200, driver 580, no MPS:
  // tests/client/cuda/cuda_vmm_test.cc KillBusyClient*). Until the drain,
  // the release values are stored again every kCloseReleaseEvery (both
  // streams write over them).
  void Close(absl::Duration grace, bool client_gone = false);
  // Close(absl::ZeroDuration()) unless Close was called.
  ~Channel();

  Channel(const Channel&) = delete;
  Channel& operator=(const Channel&) = delete;

  // Hands operation `seq` to the worker. `keepalive` owns whatever `op`
  // borrows (the request message) until the op has been enqueued. A seq
  // that is not the previous one + 1 (starting at 1) fails the channel with
  // FAILED_PRECONDITION; after a failure, operations are dropped. Not for
  // plan channels (ignored: the caller refuses submissions to plans).
  void Submit(uint64_t seq, ChannelOp op, std::shared_ptr<const void> keepalive);

  const std::string& device_name() const { return device_name_; }
  bool is_plan() const { return plan_.has_value(); }

 private:
  struct Item {
    uint64_t seq = 0;
    ChannelOp op;
    std::shared_ptr<const void> keepalive;
  };

  Channel(const OpContext& ctx, std::shared_ptr<const tensor::Region> flags_pin,
          std::unique_ptr<backend::ChannelQueue> queue, ProgressFn on_progress,
          std::optional<ChannelPlan> plan);
  void WorkerLoop();
  void PlanLoop();
  void Run(Item& item);
  void Fail(uint64_t seq, absl::Status status);
  // Waits until fewer than kMaxEnqueuedAhead operations are enqueued beyond
  // the last finished one (or the channel failed on the device).
  absl::Status WaitForRoom();
  // Reports last_ok_seq_ done once the device has finished it (after the
  // completion checks of the operations up to it).
  absl::Status TrackCompletion();
  // Runs the completion checks of operations <= seq (their device work has
  // finished); the first failure goes into *progress (completed_through
  // then stops before it).
  void RunChecks(uint64_t seq, ChannelProgress* progress);
  void Report(const ChannelProgress& progress);
  // Joins the worker; while it has not returned, calls `every_slice` (if
  // set) every kCloseReleaseEvery and logs every kCloseReportEvery what the
  // worker and the queue are waiting on (event=channel_close_slow).
  void JoinWorker(const std::function<void()>& every_slice);

  // What the worker is doing, for JoinWorker's log.
  enum class Phase : int {
    kIdle,
    kWaitForRoom,
    kWaitReady,
    kEnqueueOp,
    kWriteDone,
    kTrackCompletion,
    kExited
  };
  static const char* PhaseName(Phase phase);

  // Pins of the regions used by enqueued operations, until they complete.
  struct Held {
    uint64_t seq = 0;
    std::vector<std::shared_ptr<const tensor::Region>> pins;
  };

  // Constant after construction.
  const OpContext ctx_;
  const std::string device_name_;
  const ProgressFn on_progress_;
  const std::optional<ChannelPlan> plan_;
  std::shared_ptr<const tensor::Region> flags_pin_;  // dropped after queue_
  std::unique_ptr<backend::ChannelQueue> queue_;

  // Used by the worker thread only.
  uint64_t next_seq_ = 1;
  bool failed_ = false;
  uint64_t ops_since_report_ = 0;
  uint64_t last_ok_seq_ = 0;       // the last operation enqueued successfully
  uint64_t last_tracked_seq_ = 0;  // the last one given to OnDrained

  // State below is protected by mu_.
  absl::Mutex mu_;
  std::deque<Item> items_ ABSL_GUARDED_BY(mu_);
  bool closing_ ABSL_GUARDED_BY(mu_) = false;
  bool busy_ ABSL_GUARDED_BY(mu_) = false;              // the worker is running an item
  uint64_t submitted_ ABSL_GUARDED_BY(mu_) = 0;         // highest seq handed to Submit
  uint64_t plan_enqueued_ ABSL_GUARDED_BY(mu_) = 0;     // plan executions enqueued
  uint64_t enqueued_through_ ABSL_GUARDED_BY(mu_) = 0;  // the last op enqueued
  ChannelProgress progress_ ABSL_GUARDED_BY(mu_);
  std::deque<Held> held_ ABSL_GUARDED_BY(mu_);  // oldest first
  // Completion checks of enqueued operations, oldest first.
  std::deque<std::pair<uint64_t, CompletionCheck>> checks_ ABSL_GUARDED_BY(mu_);
  bool reporting_ ABSL_GUARDED_BY(mu_) = true;     // false once Close finished
  bool worker_done_ ABSL_GUARDED_BY(mu_) = false;  // the worker thread returned

  std::thread worker_;
  std::atomic<Phase> phase_{Phase::kIdle};
  bool closed_ = false;  // Close has run (owner thread only)
};

}  // namespace qtx::server::ops

#endif  // QTX_SERVER_OPS_CHANNEL_H_
