// qtx::Client's Optimizer calls: plain types (qtx/optimizer_types.h) <->
// qtx.v1.Optimizer messages, one unary RPC each.
#include <string>
#include <utility>
#include <vector>

#include "client/client_impl.h"
#include "client/proto_convert.h"
#include "common/status_macros.h"
#include "qtx/client.h"
#include "qtx/v1/optimizer.grpc.pb.h"

namespace qtx {

using client_internal::FromProto;
using client_internal::SetCudaEvents;
using client_internal::ToProto;

namespace {

void HyperToProto(const AdamWHyperParams& h, v1::AdamWHyperParams* p) {
  p->set_lr(h.lr);
  p->set_beta1(h.beta1);
  p->set_beta2(h.beta2);
  p->set_eps(h.eps);
  p->set_weight_decay(h.weight_decay);
  p->set_bias_correction(h.bias_correction);
}

// The server fills every field; unset ones keep torch's defaults.
AdamWHyperParams HyperFromProto(const v1::AdamWHyperParams& p) {
  AdamWHyperParams h;
  if (p.has_lr()) h.lr = p.lr();
  if (p.has_beta1()) h.beta1 = p.beta1();
  if (p.has_beta2()) h.beta2 = p.beta2();
  if (p.has_eps()) h.eps = p.eps();
  if (p.has_weight_decay()) h.weight_decay = p.weight_decay();
  if (p.has_bias_correction()) h.bias_correction = p.bias_correction();
  return h;
}

void OutputToProto(const ParameterOutputConfig& o, v1::ParameterOutputConfig* p) {
  p->set_format(o.format == ParameterOutputConfig::Format::kBf16 ? v1::PARAMETER_FORMAT_BF16
                                                                 : v1::PARAMETER_FORMAT_FP8);
  ToProto(o.fp8, p->mutable_fp8());  // every field explicit: no server-side defaults apply
  p->set_bf16_copy(o.bf16_copy);
}

ParameterOutputConfig OutputFromProto(const v1::ParameterOutputConfig& p) {
  ParameterOutputConfig o;
  o.format = p.format() == v1::PARAMETER_FORMAT_BF16 ? ParameterOutputConfig::Format::kBf16
                                                     : ParameterOutputConfig::Format::kFp8;
  o.fp8 = FromProto(p.fp8());
  o.bf16_copy = p.bf16_copy();
  return o;
}

MomentDType MomentFromProto(v1::MomentDType d) {
  return d == v1::MOMENT_DTYPE_BFLOAT16 ? MomentDType::kBFloat16 : MomentDType::kFloat32;
}

OptimizerGroupInfo GroupFromProto(const v1::OptimizerGroupInfo& p) {
  OptimizerGroupInfo g;
  g.name = p.name();
  g.step = p.step();
  g.update_count = p.update_count();
  g.num_parameters = p.num_parameters();
  g.num_elements = p.num_elements();
  g.state_bytes = p.state_bytes();
  g.moment_dtype = MomentFromProto(p.moment_dtype());
  g.hyper_params = HyperFromProto(p.hyper_params());
  g.output = OutputFromProto(p.output());
  g.last_checkpoint_step = p.last_checkpoint_step();
  g.error = p.error();
  for (const v1::ParameterHyperParams& h : p.parameter_hyper_params()) {
    g.parameter_hyper_params.push_back({h.name(), h.weight_decay(), h.lr_scale()});
  }
  for (const v1::ParameterShard& sh : p.parameter_shards()) {
    g.parameter_shards.push_back({sh.name(), FromProto(sh.range())});
  }
  return g;
}

}  // namespace

absl::StatusOr<OptimizerGroupInfo> Client::OffloadOptimizerState(
    const OptimizerGroupConfig& config, const std::vector<OptimizerParameterInit>& parameters,
    const CallOptions& call) {
  v1::OffloadOptimizerStateRequest request;
  request.set_group(config.group);
  HyperToProto(config.hyper_params, request.mutable_hyper_params());
  request.set_moment_dtype(static_cast<v1::MomentDType>(config.moment_dtype));
  OutputToProto(config.output, request.mutable_output());
  request.set_step(config.step);
  request.set_replace(config.replace);
  for (const OptimizerParameterInit& p : parameters) {
    v1::ParameterInit* out = request.add_parameters();
    out->set_name(p.name);
    for (int64_t d : p.shape) out->add_shape(d);
    ToProto(p.master, out->mutable_master());
    if (p.exp_avg) ToProto(*p.exp_avg, out->mutable_exp_avg());
    if (p.exp_avg_sq) ToProto(*p.exp_avg_sq, out->mutable_exp_avg_sq());
    if (p.weight_decay) out->set_weight_decay(*p.weight_decay);
    if (p.lr_scale) out->set_lr_scale(*p.lr_scale);
    if (p.shard) ToProto(*p.shard, out->mutable_shard());
  }
  v1::OffloadOptimizerStateResponse response;
  QTX_RETURN_IF_ERROR(impl_->Call(*impl_->optimizer, &v1::Optimizer::Stub::OffloadOptimizerState,
                                  request, &response, call));
  return GroupFromProto(response.group());
}

absl::StatusOr<OptimizerStepResult> Client::Step(std::string_view group, int64_t step,
                                                 const std::vector<OptimizerGradient>& gradients,
                                                 const StepOptions& options,
                                                 const CallOptions& call) {
  v1::StepRequest request;
  request.set_group(std::string(group));
  request.set_step(step);
  for (const OptimizerGradient& g : gradients) {
    v1::Gradient* out = request.add_gradients();
    out->set_name(g.name);
    ToProto(g.grad, out->mutable_grad());
  }
  if (options.lr) request.set_lr(*options.lr);
  if (options.max_grad_norm) request.set_max_grad_norm(*options.max_grad_norm);
  request.set_skip_if_non_finite(options.skip_if_non_finite);
  if (options.clip_factor) request.set_clip_factor(*options.clip_factor);
  request.set_skip(options.skip);
  for (const ParameterDestination& d : options.destinations) {
    v1::ParameterDestination* out = request.add_destinations();
    out->set_name(d.name);
    ToProto(d.fp8, out->mutable_fp8());
    if (d.bf16) ToProto(*d.bf16, out->mutable_bf16());
  }
  request.set_omit_parameters(options.omit_parameters);
  request.set_collective_group(options.collective_group);
  request.set_sequence(options.sequence);
  SetCudaEvents(call, &request);
  v1::StepResponse response;
  QTX_RETURN_IF_ERROR(
      impl_->Call(*impl_->optimizer, &v1::Optimizer::Stub::Step, request, &response, call));
  OptimizerStepResult result;
  const v1::StepStats& s = response.stats();
  result.stats = {s.step(),      s.grad_norm(), s.skipped(), s.non_finite(),
                  s.clip_coef(), s.lr(),        s.replayed()};
  result.parameters.reserve(response.parameters_size());
  for (v1::ParameterOutput& p : *response.mutable_parameters()) {
    ParameterOutput out;
    out.name = p.name();
    if (p.has_fp8()) out.fp8 = FromProto(std::move(*p.mutable_fp8()));
    if (p.has_bf16()) out.bf16 = FromProto(std::move(*p.mutable_bf16()));
    result.parameters.push_back(std::move(out));
  }
  return result;
}

absl::StatusOr<GradNormResult> Client::GradNorm(std::string_view group, int64_t step,
                                                const std::vector<OptimizerGradient>& gradients,
                                                const GradNormOptions& options,
                                                const CallOptions& call) {
  v1::GradNormRequest request;
  request.set_group(std::string(group));
  request.set_step(step);
  request.set_collective_group(options.collective_group);
  request.set_sequence(options.sequence);
  for (const OptimizerGradient& g : gradients) {
    v1::Gradient* out = request.add_gradients();
    out->set_name(g.name);
    ToProto(g.grad, out->mutable_grad());
  }
  SetCudaEvents(call, &request);
  v1::GradNormResponse response;
  QTX_RETURN_IF_ERROR(
      impl_->Call(*impl_->optimizer, &v1::Optimizer::Stub::GradNorm, request, &response, call));
  GradNormResult r;
  r.step = response.step();
  r.sum_squares = response.sum_squares();
  r.non_finite = response.non_finite();
  r.grad_norm = response.grad_norm();
  r.step_processed = response.step_processed();
  r.total_sum_squares = response.total_sum_squares();
  r.total_non_finite = response.total_non_finite();
  r.ranks = response.ranks();
  return r;
}

absl::StatusOr<OptimizerState> Client::GetState(std::string_view group,
                                                const GetStateOptions& options,
                                                const CallOptions& call) {
  v1::GetStateRequest request;
  request.set_group(std::string(group));
  for (const std::string& n : options.names) request.add_names(n);
  request.set_include_moments(options.include_moments);
  for (const StateDestination& d : options.destinations) {
    v1::StateDestination* out = request.add_destinations();
    out->set_name(d.name);
    if (d.master) ToProto(*d.master, out->mutable_master());
    if (d.exp_avg) ToProto(*d.exp_avg, out->mutable_exp_avg());
    if (d.exp_avg_sq) ToProto(*d.exp_avg_sq, out->mutable_exp_avg_sq());
  }
  v1::GetStateResponse response;
  QTX_RETURN_IF_ERROR(
      impl_->Call(*impl_->optimizer, &v1::Optimizer::Stub::GetState, request, &response, call));
  OptimizerState state;
  state.group = GroupFromProto(response.group());
  state.parameters.reserve(response.parameters_size());
  for (v1::ParameterState& p : *response.mutable_parameters()) {
    OptimizerParameterState out;
    out.name = p.name();
    out.master = FromProto(std::move(*p.mutable_master()));
    if (p.has_exp_avg()) out.exp_avg = FromProto(std::move(*p.mutable_exp_avg()));
    if (p.has_exp_avg_sq()) out.exp_avg_sq = FromProto(std::move(*p.mutable_exp_avg_sq()));
    state.parameters.push_back(std::move(out));
  }
  return state;
}

absl::StatusOr<std::vector<CheckpointInfo>> Client::SaveCheckpoint(std::string_view group,
                                                                   const CallOptions& call) {
  v1::SaveCheckpointRequest request;
  request.set_group(std::string(group));
  v1::SaveCheckpointResponse response;
  QTX_RETURN_IF_ERROR(impl_->Call(*impl_->optimizer, &v1::Optimizer::Stub::SaveCheckpoint, request,
                                  &response, call));
  std::vector<CheckpointInfo> out;
  out.reserve(response.checkpoints_size());
  for (const v1::CheckpointInfo& c : response.checkpoints()) {
    out.push_back({c.group(), c.step(), c.path(), c.bytes()});
  }
  return out;
}

absl::StatusOr<OptimizerGroupInfo> Client::LoadCheckpoint(std::string_view group, bool previous,
                                                          const CallOptions& call) {
  v1::LoadCheckpointRequest request;
  request.set_group(std::string(group));
  request.set_previous(previous);
  v1::LoadCheckpointResponse response;
  QTX_RETURN_IF_ERROR(impl_->Call(*impl_->optimizer, &v1::Optimizer::Stub::LoadCheckpoint, request,
                                  &response, call));
  return GroupFromProto(response.group());
}

absl::StatusOr<OptimizerGroupInfo> Client::LoadResharded(std::string_view group,
                                                         const std::vector<std::string>& sources,
                                                         const std::vector<ParameterShard>& shards,
                                                         const CallOptions& call) {
  v1::LoadCheckpointRequest request;
  request.set_group(std::string(group));
  for (const std::string& s : sources) request.add_sources(s);
  for (const ParameterShard& s : shards) {
    v1::ParameterShard* p = request.add_shards();
    p->set_name(s.name);
    ToProto(s.range, p->mutable_range());
  }
  v1::LoadCheckpointResponse response;
  QTX_RETURN_IF_ERROR(impl_->Call(*impl_->optimizer, &v1::Optimizer::Stub::LoadCheckpoint, request,
                                  &response, call));
  return GroupFromProto(response.group());
}

absl::Status Client::ReleaseGroup(std::string_view group, const CallOptions& call) {
  v1::ReleaseGroupRequest request;
  request.set_group(std::string(group));
  v1::ReleaseGroupResponse response;
  return impl_->Call(*impl_->optimizer, &v1::Optimizer::Stub::ReleaseGroup, request, &response,
                     call);
}

absl::StatusOr<OptimizerGroupList> Client::ListOptimizerGroups(const CallOptions& call) {
  v1::ListOptimizerGroupsRequest request;
  v1::ListOptimizerGroupsResponse response;
  QTX_RETURN_IF_ERROR(
      impl_->Call(*impl_->optimizer, &v1::Optimizer::Stub::ListGroups, request, &response, call));
  OptimizerGroupList out;
  for (const v1::OptimizerGroupInfo& g : response.groups()) out.groups.push_back(GroupFromProto(g));
  out.memory_limit_bytes = response.memory_limit_bytes();
  out.memory_used_bytes = response.memory_used_bytes();
  return out;
}

}  // namespace qtx
