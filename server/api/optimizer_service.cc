#include "server/api/optimizer_service.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_format.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "common/status_macros.h"
#include "server/api/convert.h"
#include "server/api/request_context.h"
#include "server/ops/optimizer.h"
#include "spdlog/spdlog.h"

namespace qtx::server::api {
namespace {

absl::StatusOr<kernels::AdamWHyperParams> HyperFromProto(const v1::AdamWHyperParams& p) {
  kernels::AdamWHyperParams h;  // torch.optim.AdamW defaults
  if (p.has_lr()) h.lr = p.lr();
  if (p.has_beta1()) h.beta1 = p.beta1();
  if (p.has_beta2()) h.beta2 = p.beta2();
  if (p.has_eps()) h.eps = p.eps();
  if (p.has_weight_decay()) h.weight_decay = p.weight_decay();
  if (p.has_bias_correction()) h.bias_correction = p.bias_correction();
  QTX_RETURN_IF_ERROR(optimizer::ValidateHyperParams(h));
  return h;
}

void HyperToProto(const kernels::AdamWHyperParams& h, v1::AdamWHyperParams* p) {
  p->set_lr(h.lr);
  p->set_beta1(h.beta1);
  p->set_beta2(h.beta2);
  p->set_eps(h.eps);
  p->set_weight_decay(h.weight_decay);
  p->set_bias_correction(h.bias_correction);
}

absl::StatusOr<optimizer::OutputConfig> OutputFromProto(const v1::ParameterOutputConfig& o) {
  optimizer::OutputConfig out;
  switch (o.format()) {
    case v1::PARAMETER_FORMAT_UNSPECIFIED:
    case v1::PARAMETER_FORMAT_FP8:
      out.fp8 = true;
      break;
    case v1::PARAMETER_FORMAT_BF16:
      out.fp8 = false;
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrFormat("output.format=%d: unknown ParameterFormat (FP8=1, BF16=2)",
                          static_cast<int>(o.format())));
  }
  QTX_ASSIGN_OR_RETURN(out.quant, ParamsFromProto(o.fp8(), "output.fp8"));
  // The Optimizer's defaults: 128x128 tiles, both copies.
  if (o.fp8().scaling_mode() == v1::SCALING_MODE_UNSPECIFIED) {
    out.quant.scaling = kernels::BlockScaling::kBlock2D;
  }
  if (!o.fp8().has_columnwise()) out.quant.columnwise = true;
  out.bf16_copy = o.bf16_copy();
  if (out.fp8) QTX_RETURN_IF_ERROR(ops::ValidateQuantizeParams(out.quant, "output.fp8"));
  return out;
}

void OutputToProto(const optimizer::OutputConfig& o, v1::ParameterOutputConfig* p) {
  p->set_format(o.fp8 ? v1::PARAMETER_FORMAT_FP8 : v1::PARAMETER_FORMAT_BF16);
  ParamsToProto(o.quant, p->mutable_fp8());
  p->set_bf16_copy(o.bf16_copy);
}

void GroupInfoToProto(const optimizer::GroupInfo& g, v1::OptimizerGroupInfo* p) {
  p->set_name(g.config.name);
  p->set_step(g.config.step);
  p->set_update_count(g.update_count);
  p->set_num_parameters(static_cast<int32_t>(g.params.size()));
  p->set_num_elements(g.num_elements);
  p->set_state_bytes(g.state_bytes);
  p->set_moment_dtype(g.config.moment_dtype == kernels::MomentDType::kFloat32
                          ? v1::MOMENT_DTYPE_FLOAT32
                          : v1::MOMENT_DTYPE_BFLOAT16);
  HyperToProto(g.config.hyper, p->mutable_hyper_params());
  OutputToProto(g.config.output, p->mutable_output());
  p->set_last_checkpoint_step(g.last_checkpoint_step);
  p->set_error(g.error);
  for (const optimizer::ParameterInfo& param : g.params) {
    if (param.hyper.empty()) continue;
    v1::ParameterHyperParams* h = p->add_parameter_hyper_params();
    h->set_name(param.name);
    h->set_weight_decay(param.hyper.weight_decay.value_or(g.config.hyper.weight_decay));
    h->set_lr_scale(param.hyper.lr_scale.value_or(1.0));
  }
  for (const optimizer::ParameterInfo& param : g.params) {
    if (!param.shard.has_value()) continue;
    v1::ParameterShard* sh = p->add_parameter_shards();
    sh->set_name(param.name);
    sh->mutable_range()->set_begin(param.shard->begin);
    sh->mutable_range()->set_end(param.shard->end);
  }
}

// The deadline of a collective optimizer call: the call's own, and at most
// the Collective group's timeout from now.
absl::Time CollectiveDeadline(const grpc::CallbackServerContext* context,
                              collective::GroupRegistry* groups, const std::string& group) {
  absl::Time deadline = absl::FromChrono(context->deadline());
  if (!group.empty() && groups != nullptr) {
    absl::StatusOr<collective::GroupInfo> g = groups->GetGroup(group);
    deadline = std::min(deadline, absl::Now() + (g.ok() ? g->timeout : absl::Seconds(60)));
  }
  return deadline;
}

}  // namespace

grpc::ServerUnaryReactor* OptimizerService::OffloadOptimizerState(
    grpc::CallbackServerContext* context, const v1::OffloadOptimizerStateRequest* request,
    v1::OffloadOptimizerStateResponse* response) {
  return RunOnExecutor(context, "OffloadOptimizerState", executor_, [this, request, response] {
    ops::OffloadRequestSpec spec;
    spec.config.name = request->group();
    QTX_ASSIGN_OR_RETURN(spec.config.hyper, HyperFromProto(request->hyper_params()));
    switch (request->moment_dtype()) {
      case v1::MOMENT_DTYPE_UNSPECIFIED:
      case v1::MOMENT_DTYPE_FLOAT32:
        spec.config.moment_dtype = kernels::MomentDType::kFloat32;
        break;
      case v1::MOMENT_DTYPE_BFLOAT16:
        spec.config.moment_dtype = kernels::MomentDType::kBFloat16;
        break;
      default:
        return absl::InvalidArgumentError(
            absl::StrFormat("moment_dtype=%d: unknown MomentDType (FLOAT32=1, BFLOAT16=2)",
                            static_cast<int>(request->moment_dtype())));
    }
    QTX_ASSIGN_OR_RETURN(spec.config.output, OutputFromProto(request->output()));
    spec.config.step = request->step();
    spec.replace = request->replace();
    for (int i = 0; i < request->parameters_size(); ++i) {
      const v1::ParameterInit& p = request->parameters(i);
      const std::string field = absl::StrFormat("parameters[%d]", i);
      ops::OffloadParameterSpec ps;
      ps.name = p.name();
      ps.shape.assign(p.shape().begin(), p.shape().end());
      if (p.has_weight_decay()) ps.hyper.weight_decay = p.weight_decay();
      if (p.has_lr_scale()) ps.hyper.lr_scale = p.lr_scale();
      if (p.has_shard()) ps.shard = kernels::ElementRange{p.shard().begin(), p.shard().end()};
      if (!p.has_master()) return absl::InvalidArgumentError(field + ".master: missing");
      QTX_ASSIGN_OR_RETURN(ps.master, TensorRefFromProto(p.master(), field + ".master"));
      if (p.has_exp_avg()) {
        QTX_ASSIGN_OR_RETURN(ps.exp_avg, TensorRefFromProto(p.exp_avg(), field + ".exp_avg"));
      }
      if (p.has_exp_avg_sq()) {
        QTX_ASSIGN_OR_RETURN(ps.exp_avg_sq,
                             TensorRefFromProto(p.exp_avg_sq(), field + ".exp_avg_sq"));
      }
      spec.params.push_back(std::move(ps));
    }
    QTX_ASSIGN_OR_RETURN(optimizer::GroupInfo info,
                         ops::OffloadOptimizerState(spec, ctx_, *store_));
    spdlog::info("event=optimizer_group_offloaded group={} params={} bytes={} step={}",
                 info.config.name, info.params.size(), info.state_bytes, info.config.step);
    GroupInfoToProto(info, response->mutable_group());
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* OptimizerService::Step(grpc::CallbackServerContext* context,
                                                 const v1::StepRequest* request,
                                                 v1::StepResponse* response) {
  const absl::Time deadline = CollectiveDeadline(context, groups_, request->collective_group());
  return RunOnExecutor(context, "OptimizerStep", executor_, [this, request, response, deadline] {
    return StepOn(*request, deadline, response);
  });
}

absl::Status OptimizerService::StepOn(const v1::StepRequest& req, absl::Time deadline,
                                      v1::StepResponse* response) {
  const v1::StepRequest* request = &req;
  auto read = [&]() -> absl::StatusOr<ops::StepRequestSpec> {
    ops::StepRequestSpec spec;
    spec.group = request->group();
    spec.options.step = request->step();
    if (request->has_lr()) spec.options.lr = request->lr();
    if (request->has_max_grad_norm()) spec.options.max_grad_norm = request->max_grad_norm();
    spec.options.skip_if_non_finite = request->skip_if_non_finite();
    if (request->has_clip_factor()) spec.options.clip_factor = request->clip_factor();
    spec.options.skip = request->skip();
    spec.omit_parameters = request->omit_parameters();
    spec.events = CudaEventsFromProto(request->cuda_events());
    for (int i = 0; i < request->gradients_size(); ++i) {
      const v1::Gradient& g = request->gradients(i);
      ops::GradientSpec gs;
      gs.name = g.name();
      QTX_ASSIGN_OR_RETURN(gs.grad,
                           TensorRefFromProto(g.grad(), absl::StrFormat("gradients[%d].grad", i)));
      spec.gradients.push_back(std::move(gs));
    }
    for (const v1::ParameterDestination& d : request->destinations()) {
      ops::ParameterDestinationSpec ds;
      ds.name = d.name();
      QuantizeOutputsFromProto(d.fp8(), &ds.fp8);
      if (d.has_bf16()) ds.bf16 = SliceFromProto(d.bf16());
      spec.destinations.push_back(std::move(ds));
    }
    return spec;
  };
  absl::StatusOr<ops::StepRequestSpec> spec = read();
  absl::StatusOr<ops::StepResult> stepped = absl::UnknownError("Step did not run");
  if (request->collective_group().empty()) {
    QTX_RETURN_IF_ERROR(spec.status());
    stepped = ops::OptimizerStep(*spec, ctx_, *store_);
  } else {
    // A sharded group's collective step: it runs on the Collective group's
    // executor, in sequence order, with the owners' communicator. A rank
    // whose request cannot be read still takes part, so that the others
    // fail at once.
    if (groups_ == nullptr) {
      return absl::FailedPreconditionError("this server has no Collective groups to step over");
    }
    absl::Notification done;
    absl::Status status;
    collective::Collective c;
    c.sequence = request->sequence();
    c.deadline = deadline;
    c.run = [&](backend::Communicator& comm) {
      bool broken = false;
      const backend::CommCall call{deadline};
      absl::Status s;
      if (!spec.ok()) {
        s = ops::JoinShardedStepAsFailed(comm, call, &broken);
      } else {
        spec->comm = &comm;
        spec->comm_call = call;
        spec->comm_broken = &broken;
        stepped = ops::OptimizerStep(*spec, ctx_, *store_);
        s = stepped.status();
      }
      if (broken && s.code() != absl::StatusCode::kDeadlineExceeded) {
        s = absl::AbortedError(absl::StrFormat("%s (the group is now BROKEN)", s.message()));
      }
      return collective::CollectiveOutcome{broken ? s : absl::OkStatus(), broken};
    };
    c.finish = [&](absl::Status s) {
      status = std::move(s);
      done.Notify();
    };
    groups_->Submit(request->collective_group(), std::move(c));
    done.WaitForNotification();
    QTX_RETURN_IF_ERROR(spec.status());
    if (!status.ok()) return status;
  }
  QTX_ASSIGN_OR_RETURN(ops::StepResult result, std::move(stepped));
  {
    v1::StepStats* s = response->mutable_stats();
    s->set_step(result.stats.step);
    s->set_grad_norm(result.stats.grad_norm);
    s->set_skipped(result.stats.skipped);
    s->set_non_finite(result.stats.non_finite);
    s->set_clip_coef(result.stats.clip_coef);
    s->set_lr(result.stats.lr);
    s->set_replayed(result.stats.replayed);
    for (ops::ParameterResult& p : result.params) {
      v1::ParameterOutput* out = response->add_parameters();
      out->set_name(p.name);
      if (p.fp8) QuantizedTensorToProto(std::move(*p.fp8), out->mutable_fp8());
      if (p.bf16) OutputTensorToProto(std::move(*p.bf16), out->mutable_bf16());
    }
  }
  return absl::OkStatus();
}

grpc::ServerUnaryReactor* OptimizerService::GradNorm(grpc::CallbackServerContext* context,
                                                     const v1::GradNormRequest* request,
                                                     v1::GradNormResponse* response) {
  // A reduced GradNorm waits for its peers at most the Collective group's
  // timeout (and never past the call's own deadline).
  absl::Time deadline = absl::FromChrono(context->deadline());
  if (!request->collective_group().empty() && groups_ != nullptr) {
    absl::StatusOr<collective::GroupInfo> g = groups_->GetGroup(request->collective_group());
    const absl::Time cap = absl::Now() + (g.ok() ? g->timeout : absl::Seconds(60));
    deadline = std::min(deadline, cap);
  }
  return RunOnExecutor(context, "GradNorm", executor_, [this, request, response, deadline] {
    auto measure = [&]() -> absl::StatusOr<optimizer::GradNormStats> {
      ops::GradNormRequestSpec spec;
      spec.group = request->group();
      spec.step = request->step();
      spec.events = CudaEventsFromProto(request->cuda_events());
      for (int i = 0; i < request->gradients_size(); ++i) {
        const v1::Gradient& g = request->gradients(i);
        ops::GradientSpec gs;
        gs.name = g.name();
        QTX_ASSIGN_OR_RETURN(
            gs.grad, TensorRefFromProto(g.grad(), absl::StrFormat("gradients[%d].grad", i)));
        spec.gradients.push_back(std::move(gs));
      }
      return ops::OptimizerGradNorm(spec, ctx_, *store_);
    };
    const absl::StatusOr<optimizer::GradNormStats> local = measure();
    if (local.ok()) {
      response->set_step(local->step);
      response->set_sum_squares(local->sum_squares);
      response->set_non_finite(local->non_finite);
      response->set_grad_norm(std::sqrt(local->sum_squares));
      response->set_step_processed(local->step_processed);
    }
    if (request->collective_group().empty()) return local.status();
    if (groups_ == nullptr) {
      return absl::FailedPreconditionError("this server has no Collective groups to reduce over");
    }
    // The optimizer group is free again; the exchange runs on the Collective
    // group's own thread. A rank whose measurement failed still takes part
    // (so that the others fail at once) and reports its own error.
    absl::Notification done;
    absl::Status status;
    absl::StatusOr<ops::GradNormTotals> totals = absl::UnknownError("GradNorm did not reduce");
    collective::Collective c;
    c.sequence = request->sequence();
    c.deadline = deadline;
    c.run = [&](backend::Communicator& comm) {
      bool broken = false;
      totals = ops::ReduceGradNorm(local.ok() ? &*local : nullptr, comm,
                                   backend::CommCall{deadline}, &broken);
      absl::Status s = totals.status();
      if (broken && s.code() != absl::StatusCode::kDeadlineExceeded) {
        s = absl::AbortedError(absl::StrFormat("%s (the group is now BROKEN)", s.message()));
      }
      return collective::CollectiveOutcome{s, broken};
    };
    c.finish = [&](absl::Status s) {
      status = std::move(s);
      done.Notify();
    };
    groups_->Submit(request->collective_group(), std::move(c));
    done.WaitForNotification();
    QTX_RETURN_IF_ERROR(local.status());
    QTX_RETURN_IF_ERROR(status);
    QTX_RETURN_IF_ERROR(totals.status());
    response->set_total_sum_squares(totals->sum_squares);
    response->set_total_non_finite(totals->non_finite);
    response->set_ranks(totals->ranks);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* OptimizerService::GetState(grpc::CallbackServerContext* context,
                                                     const v1::GetStateRequest* request,
                                                     v1::GetStateResponse* response) {
  return RunOnExecutor(context, "GetState", executor_, [this, request, response] {
    std::vector<std::string> names(request->names().begin(), request->names().end());
    std::vector<ops::StateDestinationSpec> dests;
    for (const v1::StateDestination& d : request->destinations()) {
      ops::StateDestinationSpec ds;
      ds.name = d.name();
      if (d.has_master()) ds.master = SliceFromProto(d.master());
      if (d.has_exp_avg()) ds.exp_avg = SliceFromProto(d.exp_avg());
      if (d.has_exp_avg_sq()) ds.exp_avg_sq = SliceFromProto(d.exp_avg_sq());
      dests.push_back(std::move(ds));
    }
    QTX_ASSIGN_OR_RETURN(ops::GetStateResult r,
                         ops::GetOptimizerState(request->group(), names, request->include_moments(),
                                                ctx_, *store_, dests));
    GroupInfoToProto(r.group, response->mutable_group());
    for (ops::ParameterStateResult& p : r.params) {
      v1::ParameterState* out = response->add_parameters();
      out->set_name(p.name);
      OutputTensorToProto(std::move(p.master), out->mutable_master());
      if (p.exp_avg) OutputTensorToProto(std::move(*p.exp_avg), out->mutable_exp_avg());
      if (p.exp_avg_sq) OutputTensorToProto(std::move(*p.exp_avg_sq), out->mutable_exp_avg_sq());
    }
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* OptimizerService::SaveCheckpoint(grpc::CallbackServerContext* context,
                                                           const v1::SaveCheckpointRequest* request,
                                                           v1::SaveCheckpointResponse* response) {
  return RunOnExecutor(context, "SaveCheckpoint", executor_, [this, request, response] {
    QTX_ASSIGN_OR_RETURN(std::vector<optimizer::CheckpointResult> written,
                         store_->SaveCheckpoint(request->group()));
    for (const optimizer::CheckpointResult& c : written) {
      v1::CheckpointInfo* info = response->add_checkpoints();
      info->set_group(c.group);
      info->set_step(c.step);
      info->set_path(c.path);
      info->set_bytes(c.bytes);
    }
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* OptimizerService::LoadCheckpoint(grpc::CallbackServerContext* context,
                                                           const v1::LoadCheckpointRequest* request,
                                                           v1::LoadCheckpointResponse* response) {
  return RunOnExecutor(context, "LoadCheckpoint", executor_, [this, request, response] {
    optimizer::GroupInfo info;
    if (request->sources_size() > 0) {
      if (request->previous()) {
        return absl::InvalidArgumentError(
            "LoadCheckpoint: previous=true with sources: resharding reads the files named in "
            "sources (name a .qtxopt.prev file there to reshard from a previous checkpoint)");
      }
      const std::vector<std::string> sources(request->sources().begin(), request->sources().end());
      std::vector<std::pair<std::string, kernels::ElementRange>> shards;
      for (const v1::ParameterShard& s : request->shards()) {
        shards.push_back({s.name(), kernels::ElementRange{s.range().begin(), s.range().end()}});
      }
      QTX_ASSIGN_OR_RETURN(info, store_->LoadResharded(request->group(), sources, shards));
    } else {
      if (request->shards_size() > 0) {
        return absl::InvalidArgumentError(
            "LoadCheckpoint: shards without sources; new ranges are given when resharding from "
            "the old owners' checkpoints (sources)");
      }
      QTX_ASSIGN_OR_RETURN(info, store_->LoadCheckpoint(request->group(), request->previous()));
    }
    spdlog::info("event=optimizer_group_restored group={} step={}", info.config.name,
                 info.config.step);
    GroupInfoToProto(info, response->mutable_group());
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* OptimizerService::ReleaseGroup(grpc::CallbackServerContext* context,
                                                         const v1::ReleaseGroupRequest* request,
                                                         v1::ReleaseGroupResponse* /*response*/) {
  return RunOnExecutor(context, "ReleaseGroup", executor_,
                       [this, request] { return store_->ReleaseGroup(request->group()); });
}

grpc::ServerUnaryReactor* OptimizerService::ListGroups(
    grpc::CallbackServerContext* context, const v1::ListOptimizerGroupsRequest* /*request*/,
    v1::ListOptimizerGroupsResponse* response) {
  return RunOnExecutor(context, "ListOptimizerGroups", executor_, [this, response] {
    for (const optimizer::GroupInfo& g : store_->ListGroups()) {
      GroupInfoToProto(g, response->add_groups());
    }
    response->set_memory_limit_bytes(store_->memory_limit_bytes());
    response->set_memory_used_bytes(store_->memory_used_bytes());
    return absl::OkStatus();
  });
}

}  // namespace qtx::server::api
