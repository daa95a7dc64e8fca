#include "qtx/channel.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <deque>
#include <thread>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "client_impl.h"
#include "proto_convert.h"
#include "qtx/client.h"
#include "qtx/shm_region.h"
#include "qtx/v1/channel.grpc.pb.h"

namespace qtx {

using client_internal::FromGrpcStatus;
using client_internal::ToProto;

// ---- HostChannelFlags ----

static_assert(std::atomic_ref<uint64_t>::is_always_lock_free);

absl::StatusOr<std::unique_ptr<HostChannelFlags>> HostChannelFlags::Create(
    Client& client, std::string region_name) {
  absl::StatusOr<std::unique_ptr<ShmRegion>> shm = ShmRegion::Create(region_name, 16);
  if (!shm.ok()) return shm.status();
  if (absl::Status s = client.RegisterShmRegion(**shm); !s.ok()) return s;
  return std::unique_ptr<HostChannelFlags>(new HostChannelFlags(client, std::move(*shm)));
}

HostChannelFlags::HostChannelFlags(Client& client, std::unique_ptr<ShmRegion> shm)
    : client_(client), shm_(std::move(shm)) {}

HostChannelFlags::~HostChannelFlags() { (void)client_.UnregisterRegion(shm_->name()); }

RegionSlice HostChannelFlags::slice() const { return RegionSlice{shm_->name(), 0, 16}; }

absl::Status HostChannelFlags::SignalReady(uint64_t seq) {
  std::atomic_ref<uint64_t>(reinterpret_cast<uint64_t*>(shm_->data())[0])
      .store(seq, std::memory_order_release);
  return absl::OkStatus();
}

absl::Status HostChannelFlags::WaitDone(uint64_t) { return absl::OkStatus(); }

void HostChannelFlags::ReleaseWaits(bool sidecar_gone) {
  uint64_t* words = reinterpret_cast<uint64_t*>(shm_->data());
  if (sidecar_gone) {
    std::atomic_ref<uint64_t>(words[0]).store(kChannelReleaseAll, std::memory_order_release);
  }
  std::atomic_ref<uint64_t>(words[1]).store(kChannelReleaseAll, std::memory_order_release);
}

uint64_t HostChannelFlags::ready() const {
  return std::atomic_ref<uint64_t>(reinterpret_cast<uint64_t*>(shm_->data())[0])
      .load(std::memory_order_acquire);
}

uint64_t HostChannelFlags::done() const {
  return std::atomic_ref<uint64_t>(reinterpret_cast<uint64_t*>(shm_->data())[1])
      .load(std::memory_order_acquire);
}

// ---- submission profile (ChannelSubmitProfile) ----

namespace {

std::atomic<bool> g_submit_profiling{false};
thread_local ChannelSubmitProfile t_submit_profile;

// Adds the time since the previous mark to a field of this thread's profile
// (nothing when profiling is off).
class SubmitTimer {
 public:
  SubmitTimer() : on_(g_submit_profiling.load(std::memory_order_relaxed)) {
    if (on_) last_ = Clock::now();
  }
  void Mark(uint64_t ChannelSubmitProfile::*field) {
    if (!on_) return;
    const Clock::time_point now = Clock::now();
    t_submit_profile.*field +=
        std::chrono::duration_cast<std::chrono::nanoseconds>(now - last_).count();
    last_ = now;
  }
  void Done() {
    if (on_) ++t_submit_profile.calls;
  }

 private:
  using Clock = std::chrono::steady_clock;
  const bool on_;
  Clock::time_point last_;
};

}  // namespace

void SetChannelSubmitProfiling(bool on) { g_submit_profiling.store(on); }

ChannelSubmitProfile TakeChannelSubmitProfile() {
  const ChannelSubmitProfile p = t_submit_profile;
  t_submit_profile = ChannelSubmitProfile();
  return p;
}

// ---- Channel::Stream: the bidirectional gRPC stream ----

// Writes go one at a time from a queue (the submitting thread starts a write
// only when none is in flight; OnWriteDone starts the next); reads run back
// to back and update the progress. StartWrite and Finish-related calls are
// made outside mu_, so that a reaction run on another thread never waits on
// a caller that holds it. With a background writer (ChannelOptions), the
// write that starts when none is in flight is started by writer_ instead of
// the submitting thread.
class Channel::Stream final : public grpc::ClientBidiReactor<v1::ChannelRequest, v1::ChannelReply> {
 public:
  Stream(ChannelFlags* flags) : flags_(flags) {}

  ~Stream() override {
    if (writer_.joinable()) {
      {
        absl::MutexLock lock(&mu_);
        stop_writer_ = true;
      }
      writer_.join();
    }
  }

  void Start(Client::Impl& impl, v1::ChannelRequest open, bool background_writer) {
    CallOptions call;
    call.timeout = absl::InfiniteDuration();  // lives as long as the channel
    impl.Prepare(&context_, call);
    impl.stream_channel->async()->Connect(&context_, this);
    StartRead(&in_);
    Enqueue(std::move(open));
    StartCall();
    if (background_writer) {
      // After StartCall: from here on every write may start on writer_.
      writer_ = std::thread([this] { WriterLoop(); });
      absl::MutexLock lock(&mu_);
      background_ = true;
    }
  }

  // Queues a request; starts its write if none is in flight (or has writer_
  // start it).
  void Enqueue(v1::ChannelRequest request) {
    const v1::ChannelRequest* start = nullptr;
    {
      absl::MutexLock lock(&mu_);
      queue_.push_back(std::move(request));
      if (!writing_) {
        writing_ = true;
        if (background_) {
          kick_ = true;  // writer_ wakes when mu_ is released
        } else {
          start = &queue_.front();
        }
      }
    }
    if (start != nullptr) StartWrite(start);
  }

  // writer_: starts the write of the queue's front each time Enqueue found
  // none in flight (OnWriteDone starts the ones after it).
  void WriterLoop() {
    for (;;) {
      const v1::ChannelRequest* start = nullptr;
      {
        absl::MutexLock lock(&mu_);
        mu_.Await(absl::Condition(
            +[](Stream* s) ABSL_NO_THREAD_SAFETY_ANALYSIS { return s->kick_ || s->stop_writer_; },
            this));
        // Stopping happens after OnDone: nothing may be written any more.
        if (stop_writer_) return;
        kick_ = false;
        start = &queue_.front();
      }
      StartWrite(start);
    }
  }

  // Ends the request side after the queued writes.
  void CloseWrites() {
    bool now = false;
    {
      absl::MutexLock lock(&mu_);
      close_writes_ = true;
      if (!writing_ && !writes_done_) {
        writes_done_ = true;
        now = true;
      }
    }
    if (now) StartWritesDone();
  }

  void OnWriteDone(bool ok) override {
    const v1::ChannelRequest* next = nullptr;
    bool writes_done = false;
    {
      absl::MutexLock lock(&mu_);
      queue_.pop_front();
      if (ok && !queue_.empty()) {
        next = &queue_.front();
      } else {
        writing_ = false;
        if (ok && close_writes_ && !writes_done_) writes_done = writes_done_ = true;
      }
    }
    if (next != nullptr) StartWrite(next);
    if (writes_done) StartWritesDone();
  }

  void OnReadDone(bool ok) override {
    if (!ok) return;  // OnDone follows with the status
    {
      absl::MutexLock lock(&mu_);
      if (in_.has_opened()) {
        opened_ = true;
        device_ = in_.opened().device();
      } else if (in_.has_progress()) {
        const v1::ChannelProgress& p = in_.progress();
        completed_through_ = std::max(completed_through_, p.completed_through());
        // The earliest failure wins: an operation whose failure is known
        // only once its device work has completed (a one-round AllGather's
        // slot check) may be reported after a later one's.
        if (p.failed_seq() != 0 && (failed_seq_ == 0 || p.failed_seq() < failed_seq_)) {
          failed_seq_ = p.failed_seq();
          failure_ =
              absl::Status(static_cast<absl::StatusCode>(p.failed_code()), p.failed_message());
        }
      }
    }
    StartRead(&in_);
  }

  void OnDone(const grpc::Status& status) override {
    {
      absl::MutexLock lock(&mu_);
      ended_ = true;
      end_status_ = status.ok() ? absl::OkStatus() : FromGrpcStatus(status);
    }
    // Waits may be parked on work qtxd will never do: release them, unless
    // the channel ended cleanly with everything done.
    bool clean;
    {
      absl::MutexLock lock(&mu_);
      clean = status.ok() && closing_ && completed_through_ >= submitted_;
    }
    // UNAVAILABLE: the connection broke, qtxd is gone (a live qtxd ends a
    // stream with its own status and releases its own parked work).
    if (!clean) flags_->ReleaseWaits(status.error_code() == grpc::StatusCode::UNAVAILABLE);
    absl::MutexLock lock(&mu_);
    done_ = true;
  }

  void Cancel() { context_.TryCancel(); }

  // Blocks until OnDone ran (the reactor may then be destroyed).
  void AwaitDone() {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(&done_));
  }

  struct Snapshot {
    bool opened = false;
    bool ended = false;
    absl::Status end_status;
    uint64_t completed_through = 0;
    uint64_t failed_seq = 0;
    absl::Status failure;
    std::string device;
  };

  Snapshot Get() const {
    absl::MutexLock lock(&mu_);
    return Snapshot{opened_,     ended_,   end_status_, completed_through_,
                    failed_seq_, failure_, device_};
  }

  // Waits until `cond` holds for the snapshot, or `deadline`. Returns the
  // last snapshot.
  template <typename Cond>
  Snapshot WaitFor(Cond cond, absl::Time deadline) const {
    absl::MutexLock lock(&mu_);
    auto holds = [&]() ABSL_NO_THREAD_SAFETY_ANALYSIS {
      return cond(Snapshot{opened_, ended_, end_status_, completed_through_, failed_seq_, failure_,
                           device_});
    };
    mu_.AwaitWithDeadline(absl::Condition(&holds), deadline);
    return Snapshot{opened_,     ended_,   end_status_, completed_through_,
                    failed_seq_, failure_, device_};
  }

  // Operation `seq`: "ready = seq" on the caller's stream, the descriptor
  // to qtxd, "wait done >= seq" on the caller's stream.
  // `next` moves past seq once the descriptor is queued (even if the wait
  // then fails: qtxd will see seq).
  absl::Status Submit(ChannelFlags& flags, uint64_t seq, v1::ChannelRequest request,
                      std::atomic<uint64_t>& next, SubmitTimer& timer) {
    if (absl::Status s = flags.SignalReady(seq); !s.ok()) return s;
    timer.Mark(&ChannelSubmitProfile::signal_ns);
    {
      absl::MutexLock lock(&mu_);
      submitted_ = seq;
    }
    Enqueue(std::move(request));
    next.store(seq + 1);
    timer.Mark(&ChannelSubmitProfile::enqueue_ns);
    absl::Status s = flags.WaitDone(seq);
    timer.Mark(&ChannelSubmitProfile::wait_ns);
    if (s.ok()) timer.Done();
    return s;
  }
  void NoteClosing() {
    absl::MutexLock lock(&mu_);
    closing_ = true;
  }

 private:
  ChannelFlags* const flags_;
  grpc::ClientContext context_;
  v1::ChannelReply in_;  // used by the read path only

  mutable absl::Mutex mu_;
  std::deque<v1::ChannelRequest> queue_ ABSL_GUARDED_BY(mu_);  // front: being written
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool close_writes_ ABSL_GUARDED_BY(mu_) = false;
  bool writes_done_ ABSL_GUARDED_BY(mu_) = false;
  bool opened_ ABSL_GUARDED_BY(mu_) = false;
  std::string device_ ABSL_GUARDED_BY(mu_);
  uint64_t completed_through_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t failed_seq_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Status failure_ ABSL_GUARDED_BY(mu_);
  uint64_t submitted_ ABSL_GUARDED_BY(mu_) = 0;
  bool closing_ ABSL_GUARDED_BY(mu_) = false;
  bool ended_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status end_status_ ABSL_GUARDED_BY(mu_);
  bool done_ ABSL_GUARDED_BY(mu_) = false;
  bool background_ ABSL_GUARDED_BY(mu_) = false;
  bool kick_ ABSL_GUARDED_BY(mu_) = false;  // writer_: start the front's write
  bool stop_writer_ ABSL_GUARDED_BY(mu_) = false;
  std::thread writer_;  // background writer (ChannelOptions), if any
};

// ---- Channel ----

namespace {

absl::Status FailureOf(uint64_t failed_seq, const absl::Status& failure) {
  return absl::Status(failure.code(),
                      absl::StrFormat("channel operation %d failed: %s (the channel is failed; "
                                      "open a new one)",
                                      failed_seq, failure.message()));
}

absl::Status GoneStatus(const absl::Status& end_status) {
  return absl::UnavailableError(absl::StrFormat(
      "the channel's stream to qtxd ended (%s): pending operations are not done and their waits "
      "were released",
      end_status.ok() ? "closed by qtxd" : end_status.ToString()));
}

}  // namespace

Channel::Channel(std::unique_ptr<ChannelFlags> flags, ChannelOptions options)
    : flags_(std::move(flags)), options_(std::move(options)) {}

absl::StatusOr<std::unique_ptr<Channel>> Channel::Open(Client& client,
                                                       std::unique_ptr<ChannelFlags> flags,
                                                       const ChannelOptions& options) {
  return OpenWith(client, std::move(flags), options, nullptr, 0);
}

absl::StatusOr<std::unique_ptr<Channel>> Channel::OpenPlan(Client& client,
                                                           std::unique_ptr<ChannelFlags> flags,
                                                           const PlanOp& op,
                                                           const ChannelOptions& options,
                                                           uint32_t lookahead) {
  // 0 would mean "qtxd's default" on the wire; the upper bound is qtxd's to
  // enforce (its refusal names it).
  if (lookahead < 1) {
    return absl::InvalidArgumentError(
        absl::StrFormat("Channel::OpenPlan: lookahead=%d: must be at least 1", lookahead));
  }
  return OpenWith(client, std::move(flags), options, &op, lookahead);
}

absl::StatusOr<std::unique_ptr<Channel>> Channel::OpenWith(Client& client,
                                                           std::unique_ptr<ChannelFlags> flags,
                                                           const ChannelOptions& options,
                                                           const PlanOp* plan, uint32_t lookahead) {
  if (flags == nullptr) return absl::InvalidArgumentError("Channel::Open: flags is null");
  v1::ChannelRequest open;
  if (plan != nullptr) {
    v1::ChannelPlan* p = open.mutable_open()->mutable_plan();
    p->set_lookahead(lookahead);
    if (const auto* q = std::get_if<QuantizePlan>(plan)) {
      if (!q->input.in_region()) {
        return absl::InvalidArgumentError(
            "plan input: inline tensor; channel ops take slices of registered regions only");
      }
      ToProto(q->input, p->mutable_quantize()->mutable_input());
      ToProto(q->config, p->mutable_quantize()->mutable_config());
      ToProto(q->outputs, p->mutable_quantize()->mutable_outputs());
    } else {
      const auto& d = std::get<DequantizePlan>(*plan);
      ToProto(d.input, p->mutable_dequantize()->mutable_input());
      p->mutable_dequantize()->set_output_dtype(static_cast<v1::DType>(d.output_dtype));
      ToProto(d.output, p->mutable_dequantize()->mutable_output());
    }
  }
  std::unique_ptr<Channel> channel(new Channel(std::move(flags), options));
  channel->plan_ = plan != nullptr;
  channel->stream_ = std::make_unique<Stream>(channel->flags_.get());
  ToProto(channel->flags_->slice(), open.mutable_open()->mutable_flags());
  open.mutable_open()->set_label(options.label);
  // A plan channel has no submissions to hand off.
  channel->stream_->Start(*client.impl_, std::move(open),
                          options.background_writer && plan == nullptr);
  const Stream::Snapshot s =
      channel->stream_->WaitFor([](const Stream::Snapshot& s) { return s.opened || s.ended; },
                                absl::Now() + options.open_timeout);
  if (s.opened) return channel;
  absl::Status status =
      s.ended ? (s.end_status.ok() ? absl::UnavailableError("qtxd ended the channel at open")
                                   : s.end_status)
              : absl::DeadlineExceededError(
                    absl::StrFormat("qtxd did not accept the channel within %s",
                                    absl::FormatDuration(options.open_timeout)));
  channel->stream_->Cancel();
  channel->stream_->AwaitDone();
  channel->closed_ = true;
  return status;
}

Channel::~Channel() { (void)Close(); }

absl::Status Channel::CheckSubmit() const {
  if (plan_) {
    return absl::FailedPreconditionError(
        "this channel is a plan: its executions need no submissions (open a plain channel for "
        "Quantize/Dequantize/AllGather calls)");
  }
  return CheckUsable();
}

absl::Status Channel::CheckUsable() const {
  if (closed_) return absl::FailedPreconditionError("the channel is closed");
  const Stream::Snapshot s = stream_->Get();
  if (s.failed_seq != 0) return FailureOf(s.failed_seq, s.failure);
  if (s.ended) return GoneStatus(s.end_status);
  return absl::OkStatus();
}

uint64_t Channel::submitted() const { return next_seq_.load() - 1; }

uint64_t Channel::completed() const {
  return closed_.load() ? completed_at_close_.load() : stream_->Get().completed_through;
}

absl::Status Channel::status() const { return CheckUsable(); }

template <typename Fill>
absl::StatusOr<uint64_t> Channel::SubmitOp(const Tensor* input, Fill&& fill) {
  SubmitTimer timer;
  if (absl::Status s = CheckSubmit(); !s.ok()) return s;
  timer.Mark(&ChannelSubmitProfile::check_ns);
  if (input != nullptr && !input->in_region()) {
    return absl::InvalidArgumentError(
        "input: inline tensor; channel ops take slices of registered regions only");
  }
  const uint64_t seq = next_seq_.load();
  v1::ChannelRequest request;
  v1::ChannelSubmit* submit = request.mutable_submit();
  submit->set_seq(seq);
  fill(*submit);
  timer.Mark(&ChannelSubmitProfile::build_ns);
  if (absl::Status s = stream_->Submit(*flags_, seq, std::move(request), next_seq_, timer);
      !s.ok()) {
    return s;
  }
  return seq;
}

absl::StatusOr<uint64_t> Channel::Quantize(const Tensor& input, const QuantizeConfig& config,
                                           const QuantizeOutputs& outputs) {
  return SubmitOp(&input, [&](v1::ChannelSubmit& submit) {
    v1::QuantizeRequest* q = submit.mutable_quantize();
    ToProto(input, q->mutable_input());
    ToProto(config, q->mutable_config());
    ToProto(outputs, q->mutable_outputs());
  });
}

absl::StatusOr<uint64_t> Channel::AllGather(std::string_view group, uint64_t sequence,
                                            const Tensor& input, const QuantizeConfig& config,
                                            AllGatherMode mode, const QuantizeOutputs& outputs,
                                            const std::vector<int64_t>& shard_rows) {
  return SubmitOp(&input, [&](v1::ChannelSubmit& submit) {
    v1::AllGatherRequest* a = submit.mutable_all_gather();
    a->set_group(std::string(group));
    a->set_sequence(sequence);
    ToProto(input, a->mutable_input());
    ToProto(config, a->mutable_config());
    a->set_mode(static_cast<v1::AllGatherMode>(mode));
    ToProto(outputs, a->mutable_outputs());
    for (int64_t m : shard_rows) a->add_shard_rows(m);
  });
}

absl::StatusOr<uint64_t> Channel::Dequantize(const QuantizedTensor& input, DType output_dtype,
                                             const RegionSlice& output) {
  return SubmitOp(nullptr, [&](v1::ChannelSubmit& submit) {
    v1::DequantizeRequest* d = submit.mutable_dequantize();
    ToProto(input, d->mutable_input());
    d->set_output_dtype(static_cast<v1::DType>(output_dtype));
    ToProto(output, d->mutable_output());
  });
}

absl::StatusOr<bool> Channel::Query(uint64_t op) const {
  const uint64_t next = next_seq_.load();
  if (op == 0 || op >= next) {
    return absl::InvalidArgumentError(
        absl::StrFormat("operation %d: not an id this channel returned (1..%d)", op, next - 1));
  }
  const Stream::Snapshot s = stream_->Get();
  if (op <= s.completed_through) return true;
  if (s.failed_seq != 0 && op >= s.failed_seq) {
    if (op == s.failed_seq) return FailureOf(s.failed_seq, s.failure);
    return absl::Status(s.failure.code(),
                        absl::StrFormat("operation %d was not run: operation %d failed before "
                                        "it: %s",
                                        op, s.failed_seq, s.failure.message()));
  }
  if (s.ended) return GoneStatus(s.end_status);
  return false;
}

absl::Status Channel::Synchronize() {
  if (closed_) return absl::FailedPreconditionError("the channel is closed");
  const uint64_t last = next_seq_.load() - 1;
  const Stream::Snapshot s = stream_->WaitFor(
      [last](const Stream::Snapshot& s) {
        return s.completed_through >= last || s.failed_seq != 0 || s.ended;
      },
      absl::Now() + options_.sync_timeout);
  if (s.failed_seq != 0) return FailureOf(s.failed_seq, s.failure);
  if (s.completed_through >= last) return absl::OkStatus();
  if (s.ended) return GoneStatus(s.end_status);
  return absl::DeadlineExceededError(
      absl::StrFormat("Synchronize: operations %d..%d not done after %s", s.completed_through + 1,
                      last, absl::FormatDuration(options_.sync_timeout)));
}

absl::Status Channel::Close() {
  if (closed_.load()) return absl::OkStatus();
  absl::Status status = Synchronize();
  completed_at_close_.store(stream_->Get().completed_through);
  closed_.store(true);
  stream_->NoteClosing();
  const Stream::Snapshot s = stream_->Get();
  if (s.ended) {
    // qtxd ended the stream (it is gone): nothing may be written any more.
    if (status.ok() && plan_) status = GoneStatus(s.end_status);
  } else if (status.ok()) {
    stream_->CloseWrites();
  } else {
    stream_->Cancel();
  }
  stream_->AwaitDone();
  stream_.reset();
  flags_.reset();
  return status;
}

}  // namespace qtx
