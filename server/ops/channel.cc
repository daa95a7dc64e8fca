#include "server/ops/channel.h"

#include <algorithm>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/notification.h"
#include "common/status_macros.h"
#include "spdlog/spdlog.h"

namespace qtx::server::ops {
namespace {

// Coalescing: a completion is tracked after the last operation of a burst,
// and at least every this many operations.
constexpr uint64_t kReportEvery = 16;
static_assert(kReportEvery < kMaxEnqueuedAhead,
              "a tracked operation must lie inside the window, or the worker never wakes");

void AddRegion(const tensor::RegionSliceSpec& slice, std::vector<std::string>& names) {
  if (!slice.region.empty()) names.push_back(slice.region);
}
void AddRegion(const tensor::TensorRefSpec& ref, std::vector<std::string>& names) {
  if (const auto* s = std::get_if<tensor::RegionSliceSpec>(&ref.data)) AddRegion(*s, names);
}
template <typename T>
void AddRegion(const std::optional<T>& o, std::vector<std::string>& names) {
  if (o.has_value()) AddRegion(*o, names);
}

// The regions an operation's device work uses.
std::vector<std::string> RegionsOf(const ChannelOp& op) {
  std::vector<std::string> names;
  if (const auto* q = std::get_if<QuantizeRequestSpec>(&op)) {
    AddRegion(q->input, names);
    AddRegion(q->outputs.rowwise_data, names);
    AddRegion(q->outputs.rowwise_scale_inv, names);
    AddRegion(q->outputs.columnwise_data, names);
    AddRegion(q->outputs.columnwise_scale_inv, names);
  } else if (const auto* d = std::get_if<DequantizeRequestSpec>(&op)) {
    AddRegion(d->input.rowwise_data, names);
    AddRegion(d->input.rowwise_scale_inv, names);
    AddRegion(d->input.columnwise_data, names);
    AddRegion(d->input.columnwise_scale_inv, names);
    AddRegion(d->output, names);
  } else if (const auto* t = std::get_if<ChannelTask>(&op)) {
    names = t->regions;
  }
  return names;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Channel>> Channel::Open(const tensor::RegionSliceSpec& flags,
                                                       const OpContext& ctx, ProgressFn on_progress,
                                                       std::optional<ChannelPlan> plan) {
  if (plan.has_value() && (plan->lookahead < 1 || plan->lookahead > kMaxPlanLookahead)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "open.plan.lookahead=%d: must be 1..%d (0 means 2)", plan->lookahead, kMaxPlanLookahead));
  }
  if (flags.size != kChannelFlagBytes) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "open.flags.size=%d: the flag area is exactly %d bytes (ready and done, uint64 each)",
        flags.size, kChannelFlagBytes));
  }
  if (flags.offset % 8 != 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "open.flags.offset=%d: must be a multiple of 8 (the flags are 64-bit words)",
        flags.offset));
  }
  QTX_ASSIGN_OR_RETURN(
      tensor::OutputSlice slice,
      tensor::ResolveOutputSlice(flags, kChannelFlagBytes, 8, "open.flags", *ctx.regions));
  QTX_ASSIGN_OR_RETURN(
      std::unique_ptr<backend::ChannelQueue> queue,
      ctx.device->OpenChannelQueue(static_cast<std::byte*>(slice.data), slice.memory));
  return std::unique_ptr<Channel>(new Channel(ctx, std::move(slice.pin), std::move(queue),
                                              std::move(on_progress), std::move(plan)));
}

Channel::Channel(const OpContext& ctx, std::shared_ptr<const tensor::Region> flags_pin,
                 std::unique_ptr<backend::ChannelQueue> queue, ProgressFn on_progress,
                 std::optional<ChannelPlan> plan)
    : ctx_(ctx),
      device_name_(ctx.device->name()),
      on_progress_(std::move(on_progress)),
      plan_(std::move(plan)),
      flags_pin_(std::move(flags_pin)),
      queue_(std::move(queue)) {
  worker_ = std::thread([this] {
    if (plan_.has_value()) {
      PlanLoop();
    } else {
      WorkerLoop();
    }
    phase_.store(Phase::kExited);
    absl::MutexLock lock(&mu_);
    worker_done_ = true;
  });
}

Channel::~Channel() {
  if (!closed_) Close(absl::ZeroDuration());
}

void Channel::Submit(uint64_t seq, ChannelOp op, std::shared_ptr<const void> keepalive) {
  // A plan's worker makes its own items; the service refuses submissions to
  // plans before they get here.
  if (plan_.has_value()) return;
  absl::MutexLock lock(&mu_);
  if (closing_) return;
  submitted_ = std::max(submitted_, seq);
  items_.push_back({seq, std::move(op), std::move(keepalive)});
}

void Channel::WorkerLoop() {
  for (;;) {
    Item item;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](Channel* c)
               ABSL_NO_THREAD_SAFETY_ANALYSIS { return c->closing_ || !c->items_.empty(); },
          this));
      if (items_.empty()) return;  // closing and drained
      item = std::move(items_.front());
      items_.pop_front();
      busy_ = true;
    }
    Run(item);
    item.keepalive.reset();
    absl::MutexLock lock(&mu_);
    busy_ = false;
  }
}

// Execution n of the plan is enqueued once executions up to
// n - lookahead have finished (so at most `lookahead` wait on the device),
// unless the channel is closing or failed.
void Channel::PlanLoop() {
  for (;;) {
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](Channel* c) ABSL_NO_THREAD_SAFETY_ANALYSIS {
            return c->closing_ || c->progress_.failed_seq != 0 ||
                   c->plan_enqueued_ - c->progress_.completed_through < c->plan_->lookahead;
          },
          this));
      if (closing_ || progress_.failed_seq != 0) return;
      busy_ = true;
    }
    Item item;
    item.seq = next_seq_;
    std::visit([&](const auto& spec) { item.op = spec; }, plan_->op);
    Run(item);
    absl::MutexLock lock(&mu_);
    busy_ = false;
    plan_enqueued_ = next_seq_ - 1;
  }
}

void Channel::Run(Item& item) {
  absl::Cleanup back_to_idle = [this] { phase_.store(Phase::kIdle, std::memory_order_relaxed); };
  if (failed_) return;  // the channel failed earlier: nothing more runs
  phase_.store(Phase::kWaitForRoom, std::memory_order_relaxed);
  if (absl::Status room = WaitForRoom(); !room.ok()) {
    Fail(item.seq, std::move(room));
    return;
  }
  bool failed_on_device;
  {
    absl::MutexLock lock(&mu_);
    failed_on_device = progress_.failed_seq != 0;
  }
  if (failed_on_device) {
    // An earlier operation failed its completion check: this one and the
    // later ones are not run; the failure value releases the client's waits.
    failed_ = true;
    if (absl::Status s = queue_->WriteDone(kChannelFailedOffset + item.seq); !s.ok()) {
      spdlog::error("event=channel_fail_write_failed seq={} msg=\"{}\"", item.seq,
                    std::string(s.message()));
    }
    return;
  }
  if (item.seq != next_seq_) {
    Fail(item.seq, absl::FailedPreconditionError(absl::StrFormat(
                       "submit.seq=%d: expected %d (sequence numbers start at 1 and grow by one "
                       "per submission)",
                       item.seq, next_seq_)));
    return;
  }
  ++next_seq_;
  // Pin what the op's device work uses until that work has completed (the
  // op itself drops its pins once it is enqueued): a region unregistered
  // meanwhile is unmapped only after it.
  std::vector<std::shared_ptr<const tensor::Region>> pins;
  for (const std::string& name : RegionsOf(item.op)) {
    if (auto pin = ctx_.regions->Acquire(name); pin.ok()) pins.push_back(*std::move(pin));
  }
  phase_.store(Phase::kWaitReady, std::memory_order_relaxed);
  absl::Status status = queue_->WaitReady(item.seq);
  CompletionCheck check;
  if (status.ok()) {
    phase_.store(Phase::kEnqueueOp, std::memory_order_relaxed);
    status = std::visit(
        [&](auto& spec) -> absl::Status {
          using Spec = std::decay_t<decltype(spec)>;
          if constexpr (std::is_same_v<Spec, QuantizeRequestSpec> ||
                        std::is_same_v<Spec, DequantizeRequestSpec>) {
            spec.queue = queue_.get();
          }
          if constexpr (std::is_same_v<Spec, QuantizeRequestSpec>) {
            return Quantize(spec, ctx_).status();
          } else if constexpr (std::is_same_v<Spec, DequantizeRequestSpec>) {
            return Dequantize(spec, ctx_).status();
          } else if constexpr (std::is_same_v<Spec, ChannelTask>) {
            return spec.run(queue_.get(), &check);
          } else {
            return spec;  // the submission could not be parsed
          }
        },
        item.op);
  }
  if (!status.ok()) {
    Fail(item.seq, std::move(status));
    return;
  }
  phase_.store(Phase::kWriteDone, std::memory_order_relaxed);
  status = queue_->WriteDone(item.seq);
  if (!status.ok()) {
    Fail(item.seq, std::move(status));
    return;
  }
  bool burst_over;
  {
    absl::MutexLock lock(&mu_);
    burst_over = items_.empty();
    if (!pins.empty()) held_.push_back({item.seq, std::move(pins)});
    if (check) checks_.emplace_back(item.seq, std::move(check));
    enqueued_through_ = item.seq;
  }
  last_ok_seq_ = item.seq;
  if (burst_over || ++ops_since_report_ >= kReportEvery) {
    phase_.store(Phase::kTrackCompletion, std::memory_order_relaxed);
    status = TrackCompletion();
    if (!status.ok()) Fail(item.seq, std::move(status));
  }
}

absl::Status Channel::WaitForRoom() {
  {
    absl::MutexLock lock(&mu_);
    if (enqueued_through_ - progress_.completed_through < kMaxEnqueuedAhead) {
      return absl::OkStatus();
    }
  }
  // The last enqueued operation's completion must be reported (it is, unless
  // the burst goes on: kReportEvery < kMaxEnqueuedAhead keeps one inside).
  QTX_RETURN_IF_ERROR(TrackCompletion());
  absl::MutexLock lock(&mu_);
  // A device-found failure ends the wait too: Run then writes its value.
  mu_.Await(absl::Condition(
      +[](Channel* c) ABSL_NO_THREAD_SAFETY_ANALYSIS {
        return c->progress_.failed_seq != 0 ||
               c->enqueued_through_ - c->progress_.completed_through < kMaxEnqueuedAhead;
      },
      this));
  return absl::OkStatus();
}

absl::Status Channel::TrackCompletion() {
  ops_since_report_ = 0;
  if (last_ok_seq_ == last_tracked_seq_) return absl::OkStatus();
  const uint64_t seq = last_tracked_seq_ = last_ok_seq_;
  return queue_->OnDrained([this, seq] {
    ChannelProgress p;
    p.completed_through = seq;
    RunChecks(seq, &p);
    Report(p);
  });
}

void Channel::RunChecks(uint64_t seq, ChannelProgress* progress) {
  std::deque<std::pair<uint64_t, CompletionCheck>> due;
  {
    absl::MutexLock lock(&mu_);
    while (!checks_.empty() && checks_.front().first <= seq) {
      due.push_back(std::move(checks_.front()));
      checks_.pop_front();
    }
  }
  // Outside mu_ (a check reads mapped memory and builds a message; the
  // buffers it holds die with it).
  for (auto& [op, check] : due) {
    absl::Status s = check();
    if (!s.ok()) {
      progress->completed_through = op - 1;
      progress->failed_seq = op;
      progress->failure = std::move(s);
      return;
    }
  }
}

void Channel::Fail(uint64_t seq, absl::Status status) {
  // The operations before it that succeeded are reported done when they are.
  if (absl::Status s = TrackCompletion(); !s.ok()) {
    spdlog::error("event=channel_track_failed seq={} msg=\"{}\"", seq, std::string(s.message()));
  }
  failed_ = true;
  const absl::Status write = queue_->WriteDone(kChannelFailedOffset + seq);
  if (!write.ok()) {
    spdlog::error("event=channel_fail_write_failed seq={} msg=\"{}\"", seq,
                  std::string(write.message()));
  }
  ChannelProgress p;
  p.failed_seq = seq;
  p.failure = std::move(status);
  Report(p);
}

void Channel::Report(const ChannelProgress& update) {
  ChannelProgress snapshot;
  std::deque<Held> unpinned;  // dropped outside mu_ (a drop may unmap)
  {
    absl::MutexLock lock(&mu_);
    // The earliest failure wins (a completion check may report one after a
    // later operation's enqueue failure), and nothing from it on is done.
    if (update.failed_seq != 0 &&
        (progress_.failed_seq == 0 || update.failed_seq < progress_.failed_seq)) {
      progress_.failed_seq = update.failed_seq;
      progress_.failure = update.failure;
    }
    uint64_t through = update.completed_through;
    if (progress_.failed_seq != 0) through = std::min(through, progress_.failed_seq - 1);
    progress_.completed_through = std::max(progress_.completed_through, through);
    while (!held_.empty() && held_.front().seq <= progress_.completed_through) {
      unpinned.push_back(std::move(held_.front()));
      held_.pop_front();
    }
    if (!reporting_) return;
    snapshot = progress_;
  }
  // Outside mu_; the receiver keeps the largest snapshot (channel.h).
  on_progress_(snapshot);
}

const char* Channel::PhaseName(Phase phase) {
  switch (phase) {
    case Phase::kIdle:
      return "idle";
    case Phase::kWaitForRoom:
      return "wait_for_room";
    case Phase::kWaitReady:
      return "enqueue_wait_ready";
    case Phase::kEnqueueOp:
      return "enqueue_op";
    case Phase::kWriteDone:
      return "enqueue_write_done";
    case Phase::kTrackCompletion:
      return "track_completion";
    case Phase::kExited:
      return "exited";
  }
  return "unknown";
}

void Channel::JoinWorker(const std::function<void()>& every_slice) {
  if (!worker_.joinable()) return;
  const absl::Time start = absl::Now();
  absl::Time next_report = start + kCloseReportEvery;
  for (;;) {
    uint64_t enqueued, completed, submitted;
    size_t waiting;
    {
      absl::MutexLock lock(&mu_);
      if (mu_.AwaitWithTimeout(absl::Condition(&worker_done_), kCloseReleaseEvery)) break;
      enqueued = enqueued_through_;
      completed = progress_.completed_through;
      submitted = submitted_;
      waiting = items_.size();
    }
    if (every_slice) every_slice();
    if (absl::Now() < next_report) continue;
    next_report += kCloseReportEvery;
    // Reads of host words and counters only: a device call might block
    // behind whatever holds the worker.
    spdlog::warn(
        "event=channel_close_slow device={} waited_s={:.1f} worker={} submitted={} "
        "enqueued_through={} completed_through={} not_enqueued={} queue=\"{}\"",
        device_name_, absl::ToDoubleSeconds(absl::Now() - start), PhaseName(phase_.load()),
        submitted, enqueued, completed, waiting, queue_->DescribeState());
  }
  worker_.join();
}

void Channel::Close(absl::Duration grace, bool client_gone) {
  if (closed_) return;
  closed_ = true;
  // A plan's executions beyond the caller's last one wait for a ready word
  // that will not move: no grace.
  if (plan_.has_value() || client_gone) grace = absl::ZeroDuration();
  const absl::Time deadline = absl::Now() + grace;
  bool all_done;  // a plain channel all of whose ops finished: nothing waits
  {
    absl::MutexLock lock(&mu_);
    closing_ = true;
    if (client_gone) items_.clear();  // nobody waits for them any more
    // Everything submitted has finished (or the channel failed), or the
    // grace is over.
    mu_.AwaitWithDeadline(absl::Condition(
                              +[](Channel* c) ABSL_NO_THREAD_SAFETY_ANALYSIS {
                                return c->progress_.failed_seq != 0 ||
                                       (c->items_.empty() && !c->busy_ &&
                                        c->progress_.completed_through >= c->submitted_);
                              },
                              this),
                          deadline);
    all_done = !plan_.has_value() && progress_.failed_seq == 0 && items_.empty() && !busy_ &&
               progress_.completed_through >= submitted_;
  }
  // Otherwise work may wait for a ready word that will not move: the client
  // is gone or stopped, a plan's executions are beyond its last replay, or a
  // failed op's client died. Let it through, so the queue drains (the regions
  // it uses are still pinned).
  spdlog::debug("event=channel_close_begin all_done={} grace_ms={}", all_done,
                absl::ToInt64Milliseconds(grace));
  // The client's stream may hold a wait for every operation it submitted:
  // a value past all of them lets them pass.
  auto release_client = [this] {
    uint64_t first_unfinished;
    {
      absl::MutexLock lock(&mu_);
      first_unfinished = progress_.completed_through + 1;
    }
    queue_->ReleaseClientWaits(kChannelFailedOffset + first_unfinished);
  };
  // Until the device work has drained, both release values are stored again
  // every kCloseReleaseEvery: a client stream that still runs (a killed
  // process's stream lives on until its waits pass) writes its own ready
  // values over ours, and the done writes of our operations move the done
  // word back below the client's waits; either alone could park both
  // streams for good.
  std::function<void()> keep_released;
  if (!all_done) {
    keep_released = [this, client_gone, release_client] {
      if (client_gone) release_client();
      queue_->Release();
    };
    keep_released();
  }
  JoinWorker(keep_released);
  spdlog::debug("event=channel_close_worker_joined next_seq={}", next_seq_);
  if (!all_done) {
    absl::Notification drained;
    if (queue_->OnDrained([&drained] { drained.Notify(); }).ok()) {
      while (!drained.WaitForNotificationWithTimeout(kCloseReleaseEvery)) keep_released();
    }
    // No done write of ours is left: this value stays.
    if (client_gone) release_client();
  }
  queue_.reset();  // waits for the device work
  spdlog::debug("event=channel_close_drained");
  std::deque<Held> held;
  std::deque<std::pair<uint64_t, CompletionCheck>> checks;
  {
    absl::MutexLock lock(&mu_);
    reporting_ = false;
    held.swap(held_);
    checks.swap(checks_);
  }
  held.clear();
  checks.clear();
  flags_pin_.reset();
}

}  // namespace qtx::server::ops
