#include "server/api/channel_service.h"

#include <algorithm>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "server/api/convert.h"
#include "server/api/request_context.h"
#include "server/ops/channel.h"
#include "spdlog/spdlog.h"

namespace qtx::server::api {

// One stream = one channel. Reads run back to back (each submission is
// handed to the channel and the next read starts); writes carry the
// channel's progress, one at a time, the newest state each time. The call
// finishes after the channel is closed (no progress callback can run any
// more) and its last progress is written.
class ChannelReactor final : public grpc::ServerBidiReactor<v1::ChannelRequest, v1::ChannelReply> {
 public:
  ChannelReactor(grpc::CallbackServerContext* context, StreamChannelService* service)
      : context_(context), service_(service), log_(StartRequest(context, "StreamChannel.Connect")) {
    StartRead(&in_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {
      // The client closed its side (clean) or is gone (cancelled).
      const bool gone = context_->IsCancelled();
      spdlog::debug("event=channel_read_end request_id={} cancelled={}", log_.request_id, gone);
      BeginClose(gone ? absl::ZeroDuration() : service_->close_grace_, absl::OkStatus(), gone);
      return;
    }
    if (channel_ == nullptr) {
      if (!in_.has_open()) {
        BeginClose(absl::ZeroDuration(),
                   absl::InvalidArgumentError(
                       "the first message of a channel must be `open` (with the flag area)"));
        return;
      }
      if (!Open(in_.open())) return;
    } else {
      if (!in_.has_submit()) {
        BeginClose(absl::ZeroDuration(),
                   absl::InvalidArgumentError(
                       "after `open`, every message of a channel must be `submit`"));
        return;
      }
      if (channel_->is_plan()) {
        BeginClose(absl::ZeroDuration(),
                   absl::FailedPreconditionError(
                       "submit: this channel is a plan (its executions need no submissions)"));
        return;
      }
      Submit();
    }
    StartRead(&in_);
  }

  void OnWriteDone(bool ok) override {
    {
      absl::MutexLock lock(&mu_);
      writing_ = false;
      if (!ok) write_failed_ = true;  // the client is gone; reads fail too
    }
    Pump();
  }

  void OnDone() override {
    service_->open_.fetch_sub(opened_ ? 1 : 0, std::memory_order_relaxed);
    delete this;
  }

 private:
  bool Open(const v1::ChannelOpen& open) {
    if (open.label().size() > 128) {
      BeginClose(absl::ZeroDuration(),
                 absl::InvalidArgumentError(
                     absl::StrFormat("open.label: %d bytes, at most 128", open.label().size())));
      return false;
    }
    if (!open.has_flags()) {
      BeginClose(absl::ZeroDuration(),
                 absl::InvalidArgumentError("open.flags: not set (the 16-byte flag area)"));
      return false;
    }
    std::optional<ops::ChannelPlan> plan;
    if (open.has_plan()) {
      absl::StatusOr<ops::ChannelPlan> parsed = PlanFromProto();
      if (!parsed.ok()) {
        BeginClose(absl::ZeroDuration(), parsed.status());
        return false;
      }
      plan = std::move(*parsed);
    }
    absl::StatusOr<std::unique_ptr<ops::Channel>> channel = ops::Channel::Open(
        SliceFromProto(open.flags()), service_->ctx_,
        [this](const ops::ChannelProgress& p) { OnProgress(p); }, std::move(plan));
    if (!channel.ok()) {
      BeginClose(absl::ZeroDuration(), channel.status());
      return false;
    }
    channel_ = std::move(*channel);
    const uint64_t id = service_->next_id_.fetch_add(1, std::memory_order_relaxed);
    service_->open_.fetch_add(1, std::memory_order_relaxed);
    opened_ = true;
    spdlog::info("event=channel_open request_id={} channel={} label=\"{}\" device={}",
                 log_.request_id, id, open.label(), channel_->device_name());
    {
      absl::MutexLock lock(&mu_);
      v1::ChannelOpened* opened = pending_opened_.emplace().mutable_opened();
      opened->set_channel_id(id);
      opened->set_device(channel_->device_name());
    }
    Pump();
    return true;
  }

  // The plan of the `open` in in_ (kept with the channel: the spec borrows
  // from the message).
  absl::StatusOr<ops::ChannelPlan> PlanFromProto() {
    auto msg = std::make_shared<v1::ChannelRequest>();
    msg->CopyFrom(in_);
    const v1::ChannelPlan& p = msg->open().plan();
    ops::ChannelPlan plan;
    plan.lookahead = p.lookahead() == 0 ? 2 : p.lookahead();
    if (p.has_quantize()) {
      absl::StatusOr<ops::QuantizeRequestSpec> spec = QuantizeRequestFromProto(p.quantize());
      if (!spec.ok()) return PlanError(spec.status());
      plan.op = std::move(*spec);
    } else if (p.has_dequantize()) {
      absl::StatusOr<ops::DequantizeRequestSpec> spec = DequantizeRequestFromProto(p.dequantize());
      if (!spec.ok()) return PlanError(spec.status());
      plan.op = std::move(*spec);
    } else {
      return absl::InvalidArgumentError("open.plan: no op set (quantize or dequantize)");
    }
    plan.keepalive = std::move(msg);
    return plan;
  }
  static absl::Status PlanError(const absl::Status& s) {
    return absl::Status(s.code(), absl::StrFormat("open.plan: %s", s.message()));
  }

  void Submit() {
    auto msg = std::make_shared<v1::ChannelRequest>();
    msg->Swap(&in_);  // the spec borrows from the message: convert the kept copy
    const v1::ChannelSubmit& submit = msg->submit();
    ops::ChannelOp op = absl::InvalidArgumentError(
        absl::StrFormat("submit.seq=%d: no op set (quantize or dequantize)", submit.seq()));
    if (submit.has_quantize()) {
      absl::StatusOr<ops::QuantizeRequestSpec> spec = QuantizeRequestFromProto(submit.quantize());
      if (spec.ok()) {
        op = std::move(*spec);
      } else {
        op = spec.status();
      }
    } else if (submit.has_all_gather()) {
      op = AllGatherTask(submit.all_gather());
    } else if (submit.has_dequantize()) {
      absl::StatusOr<ops::DequantizeRequestSpec> spec =
          DequantizeRequestFromProto(submit.dequantize());
      if (spec.ok()) {
        op = std::move(*spec);
      } else {
        op = spec.status();
      }
    }
    channel_->Submit(submit.seq(), std::move(op), std::move(msg));
  }

  // A channel AllGather runs on its group's thread like a plain one, ordered
  // on the GPU after the channel's queue and before its done write
  // (CudaEvents::queue). A request the channel cannot take still joins the
  // collective (as a failed one), so that every rank fails with it.
  ops::ChannelOp AllGatherTask(const v1::AllGatherRequest& request) {
    CollectiveService* collective = service_->collective_;
    if (collective == nullptr) {
      return absl::FailedPreconditionError("all_gather: this qtxd has no collective service");
    }
    auto spec = std::make_shared<ops::AllGatherRequestSpec>(AllGatherFromProto(request));
    if (spec->request_error.ok()) spec->request_error = CheckChannelAllGather(*spec);
    ops::ChannelTask task;
    // The regions its device work uses, pinned by the channel until that
    // work has completed (a CUDA AllGather on a channel only enqueues).
    auto add = [&task](const tensor::RegionSliceSpec& s) {
      if (!s.region.empty()) task.regions.push_back(s.region);
    };
    if (const auto* in = std::get_if<tensor::RegionSliceSpec>(&spec->input.data)) add(*in);
    for (const auto* o : {&spec->outputs.rowwise_data, &spec->outputs.rowwise_scale_inv,
                          &spec->outputs.columnwise_data, &spec->outputs.columnwise_scale_inv}) {
      if (o->has_value()) add(**o);
    }
    task.run = [collective, spec](backend::ChannelQueue* queue,
                                  ops::CompletionCheck* check) -> absl::Status {
      spec->events.queue = queue;
      absl::Notification done;
      absl::Status status;
      collective->SubmitAllGather(spec, absl::Now() + collective->GroupTimeout(spec->group),
                                  [&](absl::Status s, ops::AllGatherResult* r) {
                                    // One round: the slot check's verdict,
                                    // read when the device work is done.
                                    if (s.ok() && r != nullptr) {
                                      *check = std::move(r->completion_check);
                                    }
                                    status = std::move(s);
                                    done.Notify();
                                  });
      done.WaitForNotification();
      return status;
    };
    return task;
  }

  static absl::Status CheckChannelAllGather(const ops::AllGatherRequestSpec& spec) {
    if (!std::holds_alternative<tensor::RegionSliceSpec>(spec.input.data)) {
      return absl::InvalidArgumentError(
          "all_gather.input: not a region slice: channel ops take registered regions only");
    }
    if (!spec.events.empty()) {
      return absl::InvalidArgumentError(
          "all_gather.cuda_events: must be empty on a channel (the channel orders the op)");
    }
    const struct {
      bool requested;
      bool given;
      const char* field;
    } outs[] = {
        {spec.params.rowwise, spec.outputs.rowwise_data.has_value(), "outputs.rowwise_data"},
        {spec.params.rowwise, spec.outputs.rowwise_scale_inv.has_value(),
         "outputs.rowwise_scale_inv"},
        {spec.params.columnwise, spec.outputs.columnwise_data.has_value(),
         "outputs.columnwise_data"},
        {spec.params.columnwise, spec.outputs.columnwise_scale_inv.has_value(),
         "outputs.columnwise_scale_inv"},
    };
    for (const auto& o : outs) {
      if (o.requested && !o.given) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "all_gather.%s: not set: channel ops write into slices of registered regions only",
            o.field));
      }
    }
    return absl::OkStatus();
  }

  void OnProgress(const ops::ChannelProgress& p) {
    {
      absl::MutexLock lock(&mu_);
      MergeProgressLocked(p);
    }
    Pump();
  }

  void MergeProgressLocked(const ops::ChannelProgress& p) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    progress_.completed_through = std::max(progress_.completed_through, p.completed_through);
    if (progress_.failed_seq == 0 && p.failed_seq != 0) {
      progress_.failed_seq = p.failed_seq;
      progress_.failure = p.failure;
      spdlog::warn("event=channel_op_failed request_id={} seq={} code={} msg=\"{}\"",
                   log_.request_id, p.failed_seq, absl::StatusCodeToString(p.failure.code()),
                   std::string(p.failure.message()));
    }
    progress_dirty_ = true;
  }

  // Ends the channel off the reaction thread, then finishes with `status`.
  // `client_gone`: the call was cancelled (ops::Channel::Close).
  void BeginClose(absl::Duration grace, absl::Status status, bool client_gone = false) {
    auto close = [this, grace, client_gone, status = std::move(status)]() mutable {
      if (channel_ != nullptr) channel_->Close(grace, client_gone);
      {
        absl::MutexLock lock(&mu_);
        finish_status_ = std::move(status);
        finish_requested_ = true;
      }
      Pump();
    };
    if (!service_->executor_->Submit(close)) close();
  }

  // Starts the next write, or finishes the call once everything is written
  // and the channel is closed. Finish is called outside mu_: OnDone (which
  // deletes this) may run as soon as it is called.
  void Pump() {
    absl::Status finish;
    {
      absl::MutexLock lock(&mu_);
      if (!MaybeWriteLocked()) return;
      finish = finish_status_;
    }
    Finish(EndRequest(log_, finish));
  }

  // True when the caller must Finish now.
  bool MaybeWriteLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (writing_ || finished_) return false;
    if (!write_failed_) {
      if (pending_opened_.has_value()) {
        out_ = std::move(*pending_opened_);
        pending_opened_.reset();
        writing_ = true;
        StartWrite(&out_);
        return false;
      }
      if (progress_dirty_) {
        progress_dirty_ = false;
        out_.Clear();
        v1::ChannelProgress* p = out_.mutable_progress();
        p->set_completed_through(progress_.completed_through);
        if (progress_.failed_seq != 0) {
          p->set_failed_seq(progress_.failed_seq);
          p->set_failed_code(static_cast<int32_t>(progress_.failure.code()));
          p->set_failed_message(std::string(progress_.failure.message()));
        }
        writing_ = true;
        StartWrite(&out_);
        return false;
      }
    }
    if (!finish_requested_) return false;
    finished_ = true;
    return true;
  }

  grpc::CallbackServerContext* const context_;
  StreamChannelService* const service_;
  const RequestLog log_;

  // Used by the read path only (reads are serialized by gRPC).
  v1::ChannelRequest in_;
  std::unique_ptr<ops::Channel> channel_;  // closed on the executor, then kept till OnDone
  bool opened_ = false;

  // State below is protected by mu_.
  absl::Mutex mu_;
  v1::ChannelReply out_ ABSL_GUARDED_BY(mu_);  // the message being written
  std::optional<v1::ChannelReply> pending_opened_ ABSL_GUARDED_BY(mu_);
  ops::ChannelProgress progress_ ABSL_GUARDED_BY(mu_);
  bool progress_dirty_ ABSL_GUARDED_BY(mu_) = false;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool write_failed_ ABSL_GUARDED_BY(mu_) = false;
  bool finish_requested_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status finish_status_ ABSL_GUARDED_BY(mu_);
};

grpc::ServerBidiReactor<v1::ChannelRequest, v1::ChannelReply>* StreamChannelService::Connect(
    grpc::CallbackServerContext* context) {
  return new ChannelReactor(context, this);
}

}  // namespace qtx::server::api
