#include "server/ops/optimizer.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "kernels/block_geometry.h"
#include "server/ops/output_placement.h"
#include "server/optimizer/group_state.h"
#include "server/tensor/dtype.h"

namespace qtx::server::ops {
namespace {

using tensor::DType;
using tensor::MemoryKind;

int64_t ElementCount(const std::vector<int64_t>& shape) {
  int64_t c = 1;
  for (int64_t d : shape) c *= d;  // validated shapes: no overflow
  return c;
}

absl::Status RequireHost(MemoryKind kind, std::string_view field) {
  if (kind != MemoryKind::kHost) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "%s: device-memory (CUDA IPC) tensors are not supported by the Optimizer yet; use "
        "inline bytes or a shm region",
        field));
  }
  return absl::OkStatus();
}

// With `shard_count` set (a sharded parameter), any shape of that many
// elements is accepted instead of `shape`.
absl::StatusOr<tensor::TensorView> ResolveHighPrecision(const tensor::TensorRefSpec& spec,
                                                        const std::vector<int64_t>& shape,
                                                        std::string_view field,
                                                        const OpContext& ctx, bool allow_fp16,
                                                        std::optional<int64_t> shard_count = {}) {
  QTX_ASSIGN_OR_RETURN(tensor::TensorView v,
                       tensor::ResolveInput(spec, field, *ctx.regions, ctx.limits));
  const bool ok = v.dtype == DType::kFloat32 || v.dtype == DType::kBFloat16 ||
                  (allow_fp16 && v.dtype == DType::kFloat16);
  if (!ok) {
    return absl::InvalidArgumentError(absl::StrFormat("%s.dtype=%s: must be FLOAT32 or BFLOAT16%s",
                                                      field, tensor::DTypeName(v.dtype),
                                                      allow_fp16 ? " (or FLOAT16)" : ""));
  }
  if (shard_count.has_value()) {
    if (ElementCount(v.shape) != *shard_count) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s.shape=[%s]: must hold the %d elements of the parameter's shard range",
                          field, absl::StrJoin(v.shape, ","), *shard_count));
    }
  } else if (v.shape != shape) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s.shape=[%s]: must equal the parameter's shape [%s]", field,
                        absl::StrJoin(v.shape, ","), absl::StrJoin(shape, ",")));
  }
  QTX_RETURN_IF_ERROR(RequireHost(v.memory, field));
  return v;
}

// Where one output buffer goes: a client region slice or an inline string.
struct Placement {
  OutputTensor* tensor = nullptr;
  std::optional<tensor::RegionSliceSpec> slice;
  uint64_t bytes = 0;
  uint64_t alignment = 1;
  std::string field;
};

// Resolves region slices, checks the inline total, then sizes inline buffers
// (heap-allocated so that moving the strings later keeps the pointers valid).
// Returns the pointer of every placement, in order; with `device` set, device
// (CUDA IPC) slices are allowed and (*device)[k] tells which they are.
absl::StatusOr<std::vector<void*>> Place(std::vector<Placement>& ps, const OpContext& ctx,
                                         std::vector<tensor::OutputSlice>& pins,
                                         std::vector<bool>* device = nullptr) {
  uint64_t inline_bytes = 0;
  for (const Placement& p : ps) {
    if (!p.slice.has_value()) inline_bytes += p.bytes;
  }
  if (inline_bytes > ctx.max_inline_output_bytes) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "the parameters returned inline need %d bytes, above the %d-byte message budget "
        "(--max_message_mb): give region destinations or set omit_parameters",
        inline_bytes, ctx.max_inline_output_bytes));
  }
  std::vector<void*> ptrs;
  ptrs.reserve(ps.size());
  for (Placement& p : ps) {
    if (p.slice.has_value()) {
      QTX_ASSIGN_OR_RETURN(
          tensor::OutputSlice s,
          tensor::ResolveOutputSlice(*p.slice, p.bytes, p.alignment, p.field, *ctx.regions));
      if (device != nullptr) {
        device->push_back(s.memory == MemoryKind::kDevice);
      } else {
        QTX_RETURN_IF_ERROR(RequireHost(s.memory, p.field));
      }
      p.tensor->region = *p.slice;
      ptrs.push_back(s.data);
      pins.push_back(std::move(s));
    } else {
      ptrs.push_back(nullptr);  // sized below, once every slice is known to be disjoint
      if (device != nullptr) device->push_back(false);
    }
  }
  // Two destinations sharing bytes would get one tensor over the other.
  std::vector<size_t> order;
  for (size_t k = 0; k < ps.size(); ++k) {
    if (ps[k].slice.has_value() && ps[k].bytes > 0) order.push_back(k);
  }
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return std::less<const char*>()(static_cast<const char*>(ptrs[a]),
                                    static_cast<const char*>(ptrs[b]));
  });
  for (size_t i = 1; i < order.size(); ++i) {
    const size_t a = order[i - 1], b = order[i];
    if (tensor::RangesOverlap(ptrs[a], ps[a].bytes, ptrs[b], ps[b].bytes)) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s (region '%s' offset %d, %d bytes) overlaps %s (region '%s' offset %d, %d bytes): "
          "destinations may not share bytes",
          ps[b].field, ps[b].slice->region, ps[b].slice->offset, ps[b].bytes, ps[a].field,
          ps[a].slice->region, ps[a].slice->offset, ps[a].bytes));
    }
  }
  for (size_t k = 0; k < ps.size(); ++k) {
    Placement& p = ps[k];
    if (p.slice.has_value()) continue;
    p.tensor->inline_data.reserve(std::max<uint64_t>(p.bytes, 64));
    p.tensor->inline_data.resize(p.bytes);
    ptrs[k] = p.tensor->inline_data.data();
  }
  return ptrs;
}

// ---- The GPU path of Step: device tensors through a TransferPipeline ----

constexpr uint64_t kStagingAlign = 256;

uint64_t AlignUp(uint64_t x) { return (x + kStagingAlign - 1) / kStagingAlign * kStagingAlign; }

// The group's transfer pipeline and its page-locked staging, kept across
// steps by the store (optimizer::StepScratch).
class DeviceStepScratch final : public optimizer::StepScratch {
 public:
  explicit DeviceStepScratch(std::unique_ptr<backend::TransferPipeline> pipeline)
      : pipeline_(std::move(pipeline)) {}
  backend::TransferPipeline& pipeline() { return *pipeline_; }

 private:
  std::unique_ptr<backend::TransferPipeline> pipeline_;
};

// One copy between a device tensor and its slot in the staging.
struct StagedCopy {
  void* device = nullptr;
  uint64_t bytes = 0;
  uint64_t offset = 0;  // in the staging
  int slot = 0;         // outputs: 0..3 the FP8 buffers, 4 BF16 (see OptimizerStep)
};

// StepHooks on a TransferPipeline: every device gradient is queued inbound at
// Begin, in parameter order; parameter i's device outputs are queued outbound
// once the host wrote them.
class DeviceStepHooks final : public optimizer::StepHooks {
 public:
  DeviceStepHooks(backend::TransferPipeline* pipeline, std::byte* staging,
                  backend::CudaEvents events, std::vector<std::optional<StagedCopy>> grads,
                  std::vector<std::vector<StagedCopy>> outputs)
      : pipeline_(pipeline),
        staging_(staging),
        events_(std::move(events)),
        grads_(std::move(grads)),
        outputs_(std::move(outputs)),
        tickets_(grads_.size(), -1) {}

  absl::Status Begin(bool gradients) override {
    QTX_RETURN_IF_ERROR(pipeline_->Begin(events_));
    if (!gradients) return absl::OkStatus();
    for (size_t i = 0; i < grads_.size(); ++i) {
      if (!grads_[i].has_value()) continue;
      QTX_ASSIGN_OR_RETURN(
          tickets_[i], pipeline_->CopyToHostAsync(staging_ + grads_[i]->offset, grads_[i]->device,
                                                  grads_[i]->bytes));
    }
    return absl::OkStatus();
  }
  absl::Status GradientArrived(size_t i) override {
    if (i < tickets_.size() && tickets_[i] >= 0) return pipeline_->WaitInbound(tickets_[i]);
    return absl::OkStatus();
  }
  absl::Status OutputsWritten(size_t i) override {
    if (i >= outputs_.size()) return absl::OkStatus();
    for (const StagedCopy& c : outputs_[i]) {
      QTX_RETURN_IF_ERROR(pipeline_->CopyFromHostAsync(c.device, staging_ + c.offset, c.bytes));
    }
    return absl::OkStatus();
  }
  absl::Status Finish() override { return pipeline_->Finish(); }
  void Abort() override {
    const absl::Status s = pipeline_->Drain();
    (void)s;  // the step's own error is the one reported
  }

 private:
  backend::TransferPipeline* const pipeline_;
  std::byte* const staging_;
  const backend::CudaEvents events_;
  const std::vector<std::optional<StagedCopy>> grads_;
  const std::vector<std::vector<StagedCopy>> outputs_;
  std::vector<int> tickets_;
};

OutputTensor MakeTensor(DType dtype, std::vector<int64_t> shape) {
  OutputTensor t;
  t.dtype = dtype;
  t.shape = std::move(shape);
  return t;
}

// ---- Step: the parts of preparing one step's buffers under the group's lock ----

using GradientViews = absl::flat_hash_map<std::string, tensor::TensorView>;
using DestinationIndex = absl::flat_hash_map<std::string, const ParameterDestinationSpec*>;

// Output slots of one parameter, as StagedCopy::slot and PlaceParameterOutputs
// number them.
enum OutputSlot : int {
  kRowwiseData = 0,
  kRowwiseScaleInv = 1,
  kColumnwiseData = 2,
  kColumnwiseScaleInv = 3,
  kBf16 = 4,
};

// Points output buffer `slot` of one parameter at `p`.
void SetOutputPointer(optimizer::ParameterOutputBuffers& o, int slot, void* p) {
  switch (slot) {
    case kRowwiseData:
      o.fp8.rowwise_data = static_cast<uint8_t*>(p);
      break;
    case kRowwiseScaleInv:
      o.fp8.rowwise_scale_inv = static_cast<float*>(p);
      break;
    case kColumnwiseData:
      o.fp8.columnwise_data = static_cast<uint8_t*>(p);
      break;
    case kColumnwiseScaleInv:
      o.fp8.columnwise_scale_inv = static_cast<float*>(p);
      break;
    default:
      o.bf16 = static_cast<uint16_t*>(p);
      break;
  }
}

// What one Step call resolved: its tensors, the pins that keep client
// regions mapped until it returns, and the device (CUDA IPC) gradients and
// outputs, per parameter, that travel through the group's transfer pipeline.
struct StepPlan {
  GradientViews grads;
  DestinationIndex dests;
  std::vector<tensor::OutputSlice> pins;
  std::vector<std::optional<StagedCopy>> grad_copies;
  std::vector<std::vector<StagedCopy>> out_copies;
  bool any_device = false;
};

// Resolves the request's gradients (before the group's lock is taken).
// INVALID_ARGUMENT for a bad tensor or a parameter named twice.
absl::StatusOr<GradientViews> ResolveGradients(const std::vector<GradientSpec>& gradients,
                                               const OpContext& ctx) {
  GradientViews grads;
  for (size_t i = 0; i < gradients.size(); ++i) {
    const GradientSpec& g = gradients[i];
    const std::string field = absl::StrFormat("gradients[%d]", i);
    QTX_ASSIGN_OR_RETURN(tensor::TensorView v,
                         tensor::ResolveInput(g.grad, field + ".grad", *ctx.regions, ctx.limits));
    if (!grads.emplace(g.name, std::move(v)).second) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s.name='%s': a gradient for this parameter was already given", field, g.name));
    }
  }
  return grads;
}

// Indexes the destinations by parameter name. INVALID_ARGUMENT for a name
// given twice.
absl::StatusOr<DestinationIndex> IndexDestinations(
    const std::vector<ParameterDestinationSpec>& destinations) {
  DestinationIndex dests;
  for (size_t i = 0; i < destinations.size(); ++i) {
    const ParameterDestinationSpec& d = destinations[i];
    if (!dests.emplace(d.name, &d).second) {
      return absl::InvalidArgumentError(
          absl::StrFormat("destinations[%d].name='%s': given twice", i, d.name));
    }
  }
  return dests;
}

// INVALID_ARGUMENT when a gradient or destination names no parameter of the
// group.
absl::Status CheckNamesKnown(const optimizer::GroupInfo& info, const StepPlan& plan) {
  absl::flat_hash_map<std::string_view, size_t> index;
  for (size_t i = 0; i < info.params.size(); ++i) index[info.params[i].name] = i;
  for (const auto& [name, view] : plan.grads) {
    if (!index.contains(name)) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "gradients: '%s' is not a parameter of group '%s'", name, info.config.name));
    }
  }
  for (const auto& [name, d] : plan.dests) {
    if (!index.contains(name)) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "destinations: '%s' is not a parameter of group '%s'", name, info.config.name));
    }
  }
  return absl::OkStatus();
}

// Appends every parameter's gradient to bufs.grads, in the group's order,
// and notes the device ones for the transfer pipeline. INVALID_ARGUMENT for a
// missing gradient, or one of the wrong dtype or shape.
absl::Status GatherGradients(const optimizer::GroupInfo& info, StepPlan& plan,
                             optimizer::StepBuffers& bufs) {
  for (const optimizer::ParameterInfo& p : info.params) {
    auto it = plan.grads.find(p.name);
    if (it == plan.grads.end()) {
      return absl::InvalidArgumentError(
          absl::StrFormat("gradients: missing the gradient of parameter '%s'", p.name));
    }
    const tensor::TensorView& v = it->second;
    const std::string field = absl::StrFormat("gradients['%s'].grad", p.name);
    if (v.dtype != DType::kFloat32 && v.dtype != DType::kBFloat16 && v.dtype != DType::kFloat16) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s.dtype=%s: must be FLOAT32 or BFLOAT16 (or FLOAT16)", field,
                          tensor::DTypeName(v.dtype)));
    }
    if (p.shard.has_value()) {
      if (ElementCount(v.shape) != p.count()) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "%s.shape=[%s]: must hold the %d elements of the parameter's shard [%d, %d) (its "
            "slice of the flattened gradient)",
            field, absl::StrJoin(v.shape, ","), p.count(), p.shard->begin, p.shard->end));
      }
    } else if (v.shape != p.shape) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s.shape=[%s]: must equal the parameter's shape [%s]", field,
                          absl::StrJoin(v.shape, ","), absl::StrJoin(p.shape, ",")));
    }
    if (v.memory == MemoryKind::kDevice) {
      plan.grad_copies[bufs.grads.size()] = StagedCopy{const_cast<void*>(v.data), v.byte_size, 0};
      plan.any_device = true;
    }
    bufs.grads.push_back({v.data, *tensor::ToInputDType(v.dtype)});
  }
  return absl::OkStatus();
}

// The output placements of a step, and for placement k the (parameter,
// OutputSlot) it fills.
struct OutputPlacements {
  std::vector<Placement> ps;
  std::vector<std::pair<size_t, int>> slots;
};

// Adds one FP8 buffer of parameter `param` to `out` when the group produces
// it (`wanted`); INVALID_ARGUMENT when it does not but a destination asks for
// it.
absl::Status AddFp8Output(OutputPlacements& out, bool wanted, std::optional<OutputTensor>& t,
                          DType dtype, std::vector<int64_t> shape, uint64_t bytes, uint64_t align,
                          const std::optional<tensor::RegionSliceSpec>& slice,
                          const std::string& field, std::string_view name, const std::string& group,
                          size_t param, int slot) {
  if (!wanted) {
    if (slice.has_value()) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s.fp8.%s: group '%s' does not produce this copy", field, name, group));
    }
    return absl::OkStatus();
  }
  t = MakeTensor(dtype, std::move(shape));
  out.ps.push_back({&*t, slice, bytes, align, absl::StrFormat("%s.fp8.%s", field, name)});
  out.slots.emplace_back(param, slot);
  return absl::OkStatus();
}

// Sizes the results of every parameter, places their buffers (destinations
// or inline) and points bufs.outputs at them; device destinations are noted
// for the transfer pipeline. INVALID_ARGUMENT for a destination of a copy
// the group does not produce, of the wrong size, or overlapping another;
// RESOURCE_EXHAUSTED for inline outputs above the message budget.
absl::Status PlaceParameterOutputs(const optimizer::GroupInfo& info, const OpContext& ctx,
                                   StepPlan& plan, std::vector<ParameterResult>& results,
                                   optimizer::StepBuffers& bufs) {
  const optimizer::OutputConfig& out = info.config.output;
  const kernels::QuantizeParams& q = out.quant;
  const bool sharded = optimizer::IsSharded(info.params);
  results.resize(info.params.size());
  OutputPlacements placed;
  for (size_t i = 0; i < info.params.size(); ++i) {
    const optimizer::ParameterInfo& p = info.params[i];
    ParameterResult& r = results[i];
    r.name = p.name;
    const ParameterDestinationSpec* d = nullptr;
    if (auto it = plan.dests.find(p.name); it != plan.dests.end()) d = it->second;
    const std::string field = absl::StrFormat("destinations['%s']", p.name);
    if (d != nullptr && !out.fp8 &&
        (d->fp8.rowwise_data || d->fp8.rowwise_scale_inv || d->fp8.columnwise_data ||
         d->fp8.columnwise_scale_inv)) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s.fp8: group '%s' returns BF16 parameters, not FP8", field, info.config.name));
    }
    if (d != nullptr && d->bf16.has_value() && !out.bf16()) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s.bf16: group '%s' returns no BF16 copy (set output.bf16_copy)", field,
                          info.config.name));
    }
    if (out.fp8) {
      const kernels::QuantizedLayout l = kernels::ComputeLayout(q.scaling, p.m, p.n);
      r.fp8.emplace();
      r.fp8->shape = p.shape;
      r.fp8->source_dtype = DType::kFloat32;
      r.fp8->params = q;
      QTX_ASSIGN_OR_RETURN(auto buffers, DescribeQuantizedOutputs(q, l));
      const QuantizeOutputSpecs none;
      const QuantizeOutputSpecs& s = d != nullptr ? d->fp8 : none;
      const std::string& g = info.config.name;
      if (sharded) {
        // The FP8 shard (docs/numerics.md §10): the owned elements of the
        // rowwise data, and every tile's scale_inv.
        if (s.columnwise_data.has_value()) {
          return absl::InvalidArgumentError(absl::StrFormat(
              "%s.fp8.columnwise_data: group '%s' is data-parallel sharded and returns the FP8 "
              "shard as rowwise_data only (the columnwise copy is the byte transpose of the "
              "gathered rowwise data)",
              field, g));
        }
        buffers[kRowwiseData].requested = true;
        buffers[kRowwiseData].shape = {p.count()};
        buffers[kRowwiseData].bytes = static_cast<uint64_t>(p.count());
      }
      std::optional<OutputTensor>* const results[4] = {
          &r.fp8->rowwise_data, &r.fp8->rowwise_scale_inv, &r.fp8->columnwise_data,
          &r.fp8->columnwise_scale_inv};
      for (int k = kRowwiseData; k <= kColumnwiseScaleInv; ++k) {
        if (sharded && k == kColumnwiseData) continue;
        const QuantizedBufferInfo& b = buffers[k];
        QTX_RETURN_IF_ERROR(AddFp8Output(placed, b.requested, *results[k], b.dtype, b.shape,
                                         b.bytes, kQuantizedOutputAlignment[k], OutputSpec(s, k),
                                         field, QuantizedOutputName(k), g, i, k));
      }
    }
    if (out.bf16()) {
      r.bf16 = MakeTensor(DType::kBFloat16, sharded ? std::vector<int64_t>{p.count()} : p.shape);
      placed.ps.push_back({&*r.bf16, d != nullptr ? d->bf16 : std::nullopt,
                           static_cast<uint64_t>(p.count()) * 2, 2, field + ".bf16"});
      placed.slots.emplace_back(i, kBf16);
    }
  }
  std::vector<bool> on_device;
  QTX_ASSIGN_OR_RETURN(std::vector<void*> ptrs, Place(placed.ps, ctx, plan.pins, &on_device));
  for (size_t k = 0; k < ptrs.size(); ++k) {
    if (!on_device[k]) continue;
    plan.out_copies[placed.slots[k].first].push_back(
        StagedCopy{ptrs[k], placed.ps[k].bytes, 0, placed.slots[k].second});
    plan.any_device = true;
  }
  bufs.outputs.resize(info.params.size());
  for (size_t k = 0; k < ptrs.size(); ++k) {
    SetOutputPointer(bufs.outputs[placed.slots[k].first], placed.slots[k].second, ptrs[k]);
  }
  return absl::OkStatus();
}

// Points the buffers of device tensors at slots of the group's staging and
// attaches the hooks that move them (optimizer::StepHooks). The staging is
// sized once and reused while it is large enough. FAILED_PRECONDITION on a
// server that does not compute on a CUDA device; RESOURCE_EXHAUSTED when the
// staging does not fit the memory cap.
absl::Status UseTransferPipeline(StepPlan& plan, const OpContext& ctx,
                                 const backend::CudaEvents& events, optimizer::StepBuffers& bufs,
                                 optimizer::StepScratchSlot& slot) {
  if (ctx.device->memory_kind() != MemoryKind::kDevice) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "device-memory (CUDA IPC) tensors need a CUDA device, but this server computes on %s",
        ctx.device->name()));
  }
  uint64_t total = 0;
  for (auto& g : plan.grad_copies) {
    if (!g.has_value()) continue;
    g->offset = total;
    total += AlignUp(g->bytes);
  }
  for (auto& outs : plan.out_copies) {
    for (StagedCopy& c : outs) {
      c.offset = total;
      total += AlignUp(c.bytes);
    }
  }
  auto* scratch = dynamic_cast<DeviceStepScratch*>(slot.get());
  if (scratch == nullptr || scratch->pipeline().staging_bytes() < total) {
    QTX_ASSIGN_OR_RETURN(
        optimizer::StepScratch * made,
        slot.Replace(total, [&]() -> absl::StatusOr<std::unique_ptr<optimizer::StepScratch>> {
          QTX_ASSIGN_OR_RETURN(std::unique_ptr<backend::TransferPipeline> pipeline,
                               ctx.device->CreateTransferPipeline());
          QTX_RETURN_IF_ERROR(pipeline->Staging(total).status());
          return std::make_unique<DeviceStepScratch>(std::move(pipeline));
        }));
    scratch = static_cast<DeviceStepScratch*>(made);
  }
  backend::TransferPipeline& pipeline = scratch->pipeline();
  QTX_ASSIGN_OR_RETURN(std::byte* const staging, pipeline.Staging(total));
  for (size_t i = 0; i < plan.grad_copies.size() && i < bufs.grads.size(); ++i) {
    if (plan.grad_copies[i].has_value()) {
      bufs.grads[i].data = staging + plan.grad_copies[i]->offset;
    }
  }
  // The host writes device outputs into their staging slots.
  for (size_t i = 0; i < plan.out_copies.size() && i < bufs.outputs.size(); ++i) {
    for (const StagedCopy& c : plan.out_copies[i]) {
      SetOutputPointer(bufs.outputs[i], c.slot, staging + c.offset);
    }
  }
  bufs.hooks = std::make_shared<DeviceStepHooks>(
      &pipeline, staging, events, std::move(plan.grad_copies), std::move(plan.out_copies));
  return absl::OkStatus();
}

// The prepare function of a Step (optimizer::PrepareStepWithScratchFn): the
// step's buffers against the group as it is. Without `replay` every
// parameter's gradient is required; with `omit_outputs` no parameter is
// returned.
absl::StatusOr<optimizer::StepBuffers> PrepareStepBuffers(
    const optimizer::GroupInfo& info, bool replay, bool omit_outputs,
    const backend::CudaEvents& events, const OpContext& ctx, optimizer::StepScratchSlot& slot,
    StepPlan& plan, std::vector<ParameterResult>& results) {
  optimizer::StepBuffers bufs;
  plan.grad_copies.assign(info.params.size(), std::nullopt);
  plan.out_copies.assign(info.params.size(), {});
  QTX_RETURN_IF_ERROR(CheckNamesKnown(info, plan));
  if (!replay) QTX_RETURN_IF_ERROR(GatherGradients(info, plan, bufs));
  if (omit_outputs) {
    bufs.omit_outputs = true;
  } else {
    QTX_RETURN_IF_ERROR(PlaceParameterOutputs(info, ctx, plan, results, bufs));
  }
  if (plan.any_device || !events.empty()) {
    QTX_RETURN_IF_ERROR(UseTransferPipeline(plan, ctx, events, bufs, slot));
  }
  return bufs;
}

// DATA_LOSS when a gradient region shrank under step `step` (it was applied
// with zeros in place of the lost bytes), or an output region did.
absl::Status CheckStepRegionsIntact(const StepPlan& plan, const std::string& group, int64_t step) {
  for (const auto& [name, view] : plan.grads) {
    if (absl::Status intact = tensor::CheckIntact(view.pin); !intact.ok()) {
      return absl::DataLossError(absl::StrFormat(
          "%s Step %d of group '%s' was applied with zeros in place of the lost gradient bytes "
          "of '%s'; load the group's checkpoint (LoadCheckpoint) to undo it.",
          intact.message(), step, group, name));
    }
  }
  for (const tensor::OutputSlice& out : plan.pins)
    QTX_RETURN_IF_ERROR(tensor::CheckIntact(out.pin));
  return absl::OkStatus();
}

// ---- The owners' exchange of a data-parallel sharded step ----

// One rank's agreement record (host bytes, little-endian on every supported
// host).
struct ShardAgreeRecord {
  uint64_t magic = 0;
  uint32_t flags = 0;  // kAgreeFailed | kAgreeWantFp8
  uint32_t num_params = 0;
  int64_t step = 0;
  uint64_t digest = 0;  // parameter list and output settings
};
static_assert(sizeof(ShardAgreeRecord) == 32, "ShardAgreeRecord travels as 32 bytes");
constexpr uint64_t kAgreeMagic = 0x5148534f58544c51ull;
constexpr uint32_t kAgreeFailed = 1, kAgreeWantFp8 = 2;

// FNV-1a over what every owner must agree on: the parameters' names, shapes
// and order, and the FP8 output settings.
uint64_t AgreementDigest(const optimizer::GroupInfo& info) {
  uint64_t h = 1469598103934665603ull;
  auto mix = [&h](const void* p, size_t n) {
    const auto* b = static_cast<const unsigned char*>(p);
    for (size_t i = 0; i < n; ++i) h = (h ^ b[i]) * 1099511628211ull;
  };
  auto mix64 = [&mix](int64_t v) { mix(&v, sizeof(v)); };
  for (const optimizer::ParameterInfo& p : info.params) {
    mix(p.name.data(), p.name.size());
    mix64(static_cast<int64_t>(p.shape.size()));
    for (int64_t d : p.shape) mix64(d);
  }
  const optimizer::OutputConfig& o = info.config.output;
  mix64(o.fp8);
  mix64(static_cast<int64_t>(o.quant.format));
  mix64(o.quant.force_pow2_scales);
  mix64(o.quant.columnwise);
  mix(&o.quant.amax_epsilon, sizeof(float));
  mix64(o.bf16_copy);
  return h;
}

absl::Status CommFailure(const absl::Status& s, bool* broken) {
  if (s.code() != absl::StatusCode::kInvalidArgument) *broken = true;
  return s;
}

// Exchanges the agreement records: every rank's, in rank order.
absl::StatusOr<std::vector<ShardAgreeRecord>> ExchangeAgreement(const ShardAgreeRecord& mine,
                                                                backend::Communicator& comm,
                                                                const backend::CommCall& call,
                                                                bool* broken) {
  std::vector<ShardAgreeRecord> all(static_cast<size_t>(comm.world_size()));
  if (absl::Status s = comm.AllGatherHost(&mine, sizeof(mine), all.data(), call); !s.ok()) {
    return CommFailure(s, broken);
  }
  for (int r = 0; r < comm.world_size(); ++r) {
    if (all[r].magic != kAgreeMagic) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "sharded Step over %s: rank %d sent no sharded-step agreement (is it calling "
          "another collective with this sequence number?)",
          comm.name(), r));
    }
  }
  return all;
}

// optimizer::ShardExchange on a communicator: Agree = an all-gather of the
// records, then of the ranges (checked to partition every parameter);
// CombineAmax = an all-gather of [failed flag, tile amaxes...] and a max
// (host buffers, so that it works on a device communicator too; the vector
// is one float per 128x128 tile).
class CommShardExchange final : public optimizer::ShardExchange {
 public:
  CommShardExchange(backend::Communicator* comm, backend::CommCall call, bool* broken)
      : comm_(comm), call_(call), broken_(broken) {}

  absl::StatusOr<bool> Agree(const optimizer::GroupInfo& group, int64_t step,
                             bool want_outputs) override {
    agreed_called_ = true;
    ShardAgreeRecord mine;
    mine.magic = kAgreeMagic;
    mine.flags = want_outputs ? kAgreeWantFp8 : 0;
    mine.num_params = static_cast<uint32_t>(group.params.size());
    mine.step = step;
    mine.digest = AgreementDigest(group);
    QTX_ASSIGN_OR_RETURN(std::vector<ShardAgreeRecord> all,
                         ExchangeAgreement(mine, *comm_, call_, broken_));
    const std::string& name = comm_->name();
    bool any_fp8 = false;
    for (size_t r = 0; r < all.size(); ++r) {
      if (all[r].flags & kAgreeFailed) {
        return absl::FailedPreconditionError(absl::StrFormat(
            "sharded Step over %s: rank %d failed before the step (its own call says why); "
            "nothing was changed",
            name, r));
      }
      any_fp8 = any_fp8 || (all[r].flags & kAgreeWantFp8) != 0;
    }
    for (size_t r = 0; r < all.size(); ++r) {
      if (all[r].step != all[0].step) {
        return absl::FailedPreconditionError(absl::StrFormat(
            "sharded Step over %s: rank 0 steps to %d but rank %d to %d; every owner must apply "
            "the same step (nothing was changed)",
            name, all[0].step, r, all[r].step));
      }
      if (all[r].num_params != all[0].num_params) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "sharded Step over %s: rank 0's group has %d parameters but rank %d's has %d; every "
            "owner offloads every parameter of the sharded buffer (an empty shard range for one "
            "it owns nothing of); nothing was changed",
            name, all[0].num_params, r, all[r].num_params));
      }
      if (all[r].digest != all[0].digest) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "sharded Step over %s: rank %d's parameters (names, shapes, order) or FP8 output "
            "settings differ from rank 0's; nothing was changed",
            name, r));
      }
    }
    // Every rank has the same parameter list: exchange the ranges.
    const size_t np = group.params.size();
    std::vector<int64_t> my_ranges(2 * np);
    for (size_t i = 0; i < np; ++i) {
      const kernels::ElementRange rg = group.params[i].range();
      my_ranges[2 * i] = rg.begin;
      my_ranges[2 * i + 1] = rg.end;
    }
    std::vector<int64_t> all_ranges(2 * np * all.size());
    if (absl::Status s =
            comm_->AllGatherHost(my_ranges.data(), my_ranges.size() * 8, all_ranges.data(), call_);
        !s.ok()) {
      return CommFailure(s, broken_);
    }
    std::vector<std::string> names(np);
    std::vector<int64_t> totals(np);
    for (size_t i = 0; i < np; ++i) {
      names[i] = group.params[i].name;
      totals[i] = group.params[i].m * group.params[i].n;
    }
    std::vector<std::vector<kernels::ElementRange>> ranges(all.size(),
                                                           std::vector<kernels::ElementRange>(np));
    for (size_t r = 0; r < all.size(); ++r) {
      for (size_t i = 0; i < np; ++i) {
        ranges[r][i] = {all_ranges[(r * np + i) * 2], all_ranges[(r * np + i) * 2 + 1]};
      }
    }
    QTX_RETURN_IF_ERROR(CheckShardPartition(names, totals, ranges));
    agreed_ = true;
    combine_ = any_fp8;
    tiles_ = 0;
    for (const optimizer::ParameterInfo& p : group.params) {
      tiles_ += static_cast<uint64_t>(kernels::CeilDiv(p.m, kernels::kBlockLen) *
                                      kernels::CeilDiv(p.n, kernels::kBlockLen));
    }
    return any_fp8;
  }

  absl::Status CombineAmax(std::span<float> tile_amax) override {
    combined_ = true;
    if (tile_amax.size() != tiles_) {
      return absl::InternalError(absl::StrFormat(
          "sharded Step: %d tile amaxes, the agreement counted %d", tile_amax.size(), tiles_));
    }
    return Reduce(tile_amax, /*failed=*/false);
  }

  // Takes part in whatever the owners still wait for after this rank's Step
  // ended early (an error before Agree, or after Agree but before
  // CombineAmax), telling them that this rank failed.
  void Release() {
    if (!agreed_called_) {
      (void)JoinShardedStepAsFailed(*comm_, call_, broken_);
      return;
    }
    if (agreed_ && combine_ && !combined_) {
      std::vector<float> zeros(tiles_, 0.0f);
      (void)Reduce(zeros, /*failed=*/true);
    }
  }

 private:
  // [failed flag, tile amaxes...] from every rank through AllGatherHost (host
  // buffers for any communicator, Gloo or NCCL), then the element-wise max.
  absl::Status Reduce(std::span<float> tile_amax, bool failed) {
    const size_t len = tile_amax.size() + 1;
    std::vector<float> mine(len);
    mine[0] = failed ? 1.0f : 0.0f;
    std::copy(tile_amax.begin(), tile_amax.end(), mine.begin() + 1);
    std::vector<float> all(len * static_cast<size_t>(comm_->world_size()));
    if (absl::Status s = comm_->AllGatherHost(mine.data(), len * 4, all.data(), call_); !s.ok()) {
      return CommFailure(s, broken_);
    }
    for (int r = 0; r < comm_->world_size(); ++r) {
      const float* v = all.data() + len * static_cast<size_t>(r);
      if (v[0] != 0.0f) {
        return absl::AbortedError(absl::StrFormat(
            "sharded Step over %s: rank %d failed after the step was agreed (its own call says "
            "why); this owner's update is applied: retry the step on every owner",
            comm_->name(), r));
      }
      for (size_t t = 1; t < len; ++t) tile_amax[t - 1] = std::max(tile_amax[t - 1], v[t]);
    }
    return absl::OkStatus();
  }

  backend::Communicator* const comm_;
  const backend::CommCall call_;
  bool* const broken_;
  bool agreed_called_ = false;
  bool agreed_ = false;
  bool combine_ = false;
  bool combined_ = false;
  uint64_t tiles_ = 0;
};

}  // namespace

absl::Status JoinShardedStepAsFailed(backend::Communicator& comm, const backend::CommCall& call,
                                     bool* broken) {
  ShardAgreeRecord mine;
  mine.magic = kAgreeMagic;
  mine.flags = kAgreeFailed;
  return ExchangeAgreement(mine, comm, call, broken).status();
}

absl::Status CheckShardPartition(const std::vector<std::string>& names,
                                 const std::vector<int64_t>& totals,
                                 const std::vector<std::vector<kernels::ElementRange>>& ranges) {
  for (size_t i = 0; i < names.size(); ++i) {
    std::vector<std::pair<kernels::ElementRange, size_t>> owned;  // (range, rank)
    for (size_t r = 0; r < ranges.size(); ++r) {
      if (!ranges[r][i].empty()) owned.emplace_back(ranges[r][i], r);
    }
    std::sort(owned.begin(), owned.end(), [](const auto& a, const auto& b) {
      return a.first.begin != b.first.begin ? a.first.begin < b.first.begin : a.second < b.second;
    });
    const std::string what = absl::StrFormat("parameter '%s' (%d elements)", names[i], totals[i]);
    int64_t next = 0;
    for (size_t k = 0; k < owned.size(); ++k) {
      const auto& [rg, r] = owned[k];
      if (rg.begin > next) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "%s: elements [%d, %d) are owned by no rank (rank %d's shard starts at %d); the "
            "owners' ranges must cover every element exactly once",
            what, next, rg.begin, r, rg.begin));
      }
      if (rg.begin < next) {
        const auto& [prev, pr] = owned[k - 1];
        return absl::InvalidArgumentError(absl::StrFormat(
            "%s: rank %d's shard [%d, %d) and rank %d's shard [%d, %d) overlap; the owners' "
            "ranges must cover every element exactly once",
            what, pr, prev.begin, prev.end, r, rg.begin, rg.end));
      }
      next = rg.end;
    }
    if (next != totals[i]) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s: elements [%d, %d) are owned by no rank; the owners' ranges must cover every "
          "element exactly once",
          what, next, totals[i]));
    }
  }
  return absl::OkStatus();
}

namespace {}  // namespace

absl::StatusOr<optimizer::GroupInfo> OffloadOptimizerState(const OffloadRequestSpec& request,
                                                           const OpContext& ctx,
                                                           optimizer::OptimizerStore& store) {
  if (request.params.empty()) {
    return absl::InvalidArgumentError(
        "parameters: empty; an optimizer group needs at least one parameter");
  }
  std::vector<optimizer::ParameterInit> inits;
  std::vector<tensor::TensorView> views;  // keep pins alive until the copy is done
  int64_t total = 0;
  for (size_t i = 0; i < request.params.size(); ++i) {
    const OffloadParameterSpec& p = request.params[i];
    const std::string field = absl::StrFormat("parameters[%d]", i);
    QTX_ASSIGN_OR_RETURN(const int64_t elements,
                         tensor::ValidateShape(p.shape, field + ".shape", ctx.limits));
    QTX_ASSIGN_OR_RETURN(const Matrix2D mn, FlattenTo2D(p.shape, field + ".shape", ctx.limits));
    total += elements;
    if (total > ctx.limits.max_elements) {
      return absl::InvalidArgumentError(
          absl::StrFormat("parameters: %d elements in total exceed --max_tensor_elements=%d", total,
                          ctx.limits.max_elements));
    }
    optimizer::ParameterInit init;
    init.name = p.name;
    init.shape = p.shape;
    init.m = mn.m;
    init.n = mn.n;
    init.hyper = p.hyper;
    std::optional<int64_t> shard_count;
    if (p.shard.has_value()) {
      if (p.shard->begin < 0 || p.shard->begin > p.shard->end || p.shard->end > elements) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "%s ('%s').shard=[%d, %d): must satisfy 0 <= begin <= end <= %d (the parameter's "
            "elements, flattened row-major)",
            field, p.name, p.shard->begin, p.shard->end, elements));
      }
      init.shard = p.shard;
      shard_count = p.shard->count();
    }
    QTX_ASSIGN_OR_RETURN(
        tensor::TensorView master,
        ResolveHighPrecision(p.master, p.shape, field + ".master", ctx, false, shard_count));
    init.master = master.data;
    init.master_dtype = *tensor::ToInputDType(master.dtype);
    views.push_back(std::move(master));
    if (p.exp_avg.has_value() != p.exp_avg_sq.has_value()) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s ('%s'): give both exp_avg and exp_avg_sq or neither", field, p.name));
    }
    if (p.exp_avg.has_value()) {
      QTX_ASSIGN_OR_RETURN(
          tensor::TensorView m1,
          ResolveHighPrecision(*p.exp_avg, p.shape, field + ".exp_avg", ctx, false, shard_count));
      QTX_ASSIGN_OR_RETURN(tensor::TensorView m2,
                           ResolveHighPrecision(*p.exp_avg_sq, p.shape, field + ".exp_avg_sq", ctx,
                                                false, shard_count));
      if (m1.dtype != m2.dtype) {
        return absl::InvalidArgumentError(
            absl::StrFormat("%s: exp_avg is %s but exp_avg_sq is %s; give both in one dtype", field,
                            tensor::DTypeName(m1.dtype), tensor::DTypeName(m2.dtype)));
      }
      init.exp_avg = m1.data;
      init.exp_avg_sq = m2.data;
      init.moments_dtype = *tensor::ToInputDType(m1.dtype);
      views.push_back(std::move(m1));
      views.push_back(std::move(m2));
    }
    inits.push_back(std::move(init));
  }
  QTX_ASSIGN_OR_RETURN(optimizer::GroupInfo info,
                       store.CreateGroup(request.config, inits, request.replace));
  for (const tensor::TensorView& v : views) {
    if (absl::Status intact = tensor::CheckIntact(v.pin); !intact.ok()) {
      // The group was built from bytes that are not the client's: drop it.
      (void)store.ReleaseGroup(info.config.name);
      return absl::DataLossError(absl::StrFormat(
          "%s The group '%s' was not kept%s.", intact.message(), info.config.name,
          request.replace ? " (nor the group it replaced, or its checkpoints)" : ""));
    }
  }
  return info;
}

absl::StatusOr<StepResult> OptimizerStep(const StepRequestSpec& request, const OpContext& ctx,
                                         optimizer::OptimizerStore& store) {
  bool broken_unused = false;
  std::optional<CommShardExchange> exchange;
  if (request.comm != nullptr) {
    exchange.emplace(request.comm, request.comm_call,
                     request.comm_broken != nullptr ? request.comm_broken : &broken_unused);
  }
  StepPlan plan;
  // Resolve the gradients before taking the group's lock.
  absl::Status resolved = ValidateCudaEvents(request.events, ctx);
  if (resolved.ok()) {
    absl::StatusOr<GradientViews> grads = ResolveGradients(request.gradients, ctx);
    resolved = grads.status();
    if (grads.ok()) plan.grads = *std::move(grads);
  }
  if (resolved.ok()) {
    absl::StatusOr<DestinationIndex> dests = IndexDestinations(request.destinations);
    resolved = dests.status();
    if (dests.ok()) plan.dests = *std::move(dests);
  }
  if (!resolved.ok()) {
    if (exchange.has_value()) exchange->Release();  // the other owners fail at once
    return resolved;
  }
  StepResult result;
  auto prepare = [&](const optimizer::GroupInfo& info, bool replay,
                     optimizer::StepScratchSlot& slot) -> absl::StatusOr<optimizer::StepBuffers> {
    QTX_ASSIGN_OR_RETURN(optimizer::StepBuffers bufs,
                         PrepareStepBuffers(info, replay, request.omit_parameters, request.events,
                                            ctx, slot, plan, result.params));
    if (exchange.has_value()) bufs.exchange = &*exchange;
    return bufs;
  };
  absl::StatusOr<optimizer::StepStats> stats =
      store.Step(request.group, request.options, optimizer::PrepareStepWithScratchFn(prepare));
  if (exchange.has_value()) exchange->Release();
  QTX_ASSIGN_OR_RETURN(result.stats, std::move(stats));
  QTX_RETURN_IF_ERROR(CheckStepRegionsIntact(plan, request.group, result.stats.step));
  return result;
}

absl::StatusOr<optimizer::GradNormStats> OptimizerGradNorm(const GradNormRequestSpec& request,
                                                           const OpContext& ctx,
                                                           optimizer::OptimizerStore& store) {
  QTX_RETURN_IF_ERROR(ValidateCudaEvents(request.events, ctx));
  StepPlan plan;
  QTX_ASSIGN_OR_RETURN(plan.grads, ResolveGradients(request.gradients, ctx));
  std::vector<ParameterResult> unused;
  auto prepare = [&](const optimizer::GroupInfo& info, bool replay,
                     optimizer::StepScratchSlot& slot) {
    return PrepareStepBuffers(info, replay, /*omit_outputs=*/true, request.events, ctx, slot, plan,
                              unused);
  };
  QTX_ASSIGN_OR_RETURN(
      optimizer::GradNormStats stats,
      store.GradNorm(request.group, request.step, optimizer::PrepareStepWithScratchFn(prepare)));
  for (const auto& [name, view] : plan.grads) {
    if (absl::Status intact = tensor::CheckIntact(view.pin); !intact.ok()) {
      return absl::DataLossError(absl::StrFormat(
          "%s GradNorm of step %d of group '%s' read zeros in place of the lost gradient bytes "
          "of '%s' (nothing was changed); measure again with intact gradients.",
          intact.message(), request.step, request.group, name));
    }
  }
  return stats;
}

namespace {

// One rank's GradNorm contribution as it travels (host bytes, little-endian
// on every supported host).
struct GradNormRecord {
  int64_t step = 0;
  double sum_squares = 0.0;
  uint64_t flags = 0;  // kNonFinite | kFailed
};
constexpr uint64_t kNonFinite = 1, kFailed = 2;
static_assert(sizeof(GradNormRecord) == 24, "GradNormRecord travels as 24 bytes");

}  // namespace

absl::StatusOr<GradNormTotals> ReduceGradNorm(const optimizer::GradNormStats* local,
                                              backend::Communicator& comm,
                                              const backend::CommCall& call, bool* broken) {
  *broken = false;
  const int world = comm.world_size();
  GradNormRecord mine;
  if (local == nullptr) {
    mine.flags = kFailed;
  } else {
    mine.step = local->step;
    mine.sum_squares = local->sum_squares;
    mine.flags = local->non_finite ? kNonFinite : 0;
  }
  std::vector<GradNormRecord> all(static_cast<size_t>(world));
  if (absl::Status s = comm.AllGatherHost(&mine, sizeof(mine), all.data(), call); !s.ok()) {
    *broken = s.code() != absl::StatusCode::kInvalidArgument;
    return s;
  }
  GradNormTotals t;
  t.ranks = world;
  for (int r = 0; r < world; ++r) {
    if (all[r].flags & kFailed) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "GradNorm over %s: rank %d could not measure its gradients (its own call says why); "
          "nothing was changed",
          comm.name(), r));
    }
  }
  for (int r = 0; r < world; ++r) {
    if (all[r].step != all[0].step) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "GradNorm over %s: rank 0 measured step %d but rank %d measured step %d; every rank "
          "must measure the same step (nothing was changed)",
          comm.name(), all[0].step, r, all[r].step));
    }
    t.sum_squares += all[r].sum_squares;
    t.non_finite = t.non_finite || (all[r].flags & kNonFinite) != 0;
  }
  t.non_finite = t.non_finite || !std::isfinite(t.sum_squares);
  return t;
}

absl::StatusOr<GetStateResult> GetOptimizerState(
    const std::string& group, const std::vector<std::string>& names, bool include_moments,
    const OpContext& ctx, const optimizer::OptimizerStore& store,
    const std::vector<StateDestinationSpec>& destinations) {
  absl::flat_hash_map<std::string_view, const StateDestinationSpec*> dests;
  for (size_t i = 0; i < destinations.size(); ++i) {
    const StateDestinationSpec& d = destinations[i];
    if (!dests.emplace(d.name, &d).second) {
      return absl::InvalidArgumentError(
          absl::StrFormat("destinations[%d].name='%s': given twice", i, d.name));
    }
    if (!include_moments && (d.exp_avg.has_value() || d.exp_avg_sq.has_value())) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "destinations[%d] ('%s'): moment destinations need include_moments", i, d.name));
    }
  }
  GetStateResult result;
  std::vector<tensor::OutputSlice> pins;  // held until the copies are done
  QTX_RETURN_IF_ERROR(store.ReadState(
      group,
      [&](const optimizer::GroupInfo& info,
          std::span<const optimizer::ParameterStateView> views) -> absl::Status {
        result.group = info;
        std::vector<const optimizer::ParameterStateView*> chosen;
        if (names.empty()) {
          for (const auto& v : views) chosen.push_back(&v);
        } else {
          absl::flat_hash_map<std::string_view, size_t> seen;
          for (size_t i = 0; i < names.size(); ++i) {
            if (auto [it, fresh] = seen.emplace(names[i], i); !fresh) {
              return absl::InvalidArgumentError(absl::StrFormat(
                  "names[%d]='%s': given twice (also names[%d])", i, names[i], it->second));
            }
          }
          for (const std::string& n : names) {
            auto it = std::find_if(views.begin(), views.end(),
                                   [&](const auto& v) { return v.info->name == n; });
            if (it == views.end()) {
              return absl::NotFoundError(
                  absl::StrFormat("names: '%s' is not a parameter of group '%s'", n, group));
            }
            chosen.push_back(&*it);
          }
        }
        for (const auto& dest : dests) {
          // (clang 14 cannot capture a structured binding in a lambda)
          const auto& name = dest.first;
          if (std::none_of(chosen.begin(), chosen.end(),
                           [&](const auto* v) { return v->info->name == name; })) {
            return absl::InvalidArgumentError(absl::StrFormat(
                "destinations: '%s' is not among the parameters returned from group '%s'", name,
                group));
          }
        }
        const uint64_t mb = optimizer::MomentBytes(info.config.moment_dtype);
        const DType mdt = info.config.moment_dtype == kernels::MomentDType::kFloat32
                              ? DType::kFloat32
                              : DType::kBFloat16;
        result.params.resize(chosen.size());
        std::vector<Placement> ps;
        std::vector<const void*> sources;
        uint64_t inline_bytes = 0;
        for (size_t i = 0; i < chosen.size(); ++i) {
          const optimizer::ParameterStateView* v = chosen[i];
          const uint64_t count = static_cast<uint64_t>(v->info->count());
          // A sharded parameter's state is its owned slice, returned 1-D.
          const std::vector<int64_t> shape =
              v->info->shard.has_value() ? std::vector<int64_t>{v->info->count()} : v->info->shape;
          ParameterStateResult& r = result.params[i];
          r.name = v->info->name;
          const StateDestinationSpec* d = nullptr;
          if (auto it = dests.find(r.name); it != dests.end()) d = it->second;
          const std::string field = absl::StrFormat("destinations['%s']", r.name);
          auto add = [&](OutputTensor* t, const std::optional<tensor::RegionSliceSpec>& slice,
                         uint64_t bytes, uint64_t align, const void* src, const char* what) {
            if (!slice.has_value()) inline_bytes += bytes;
            ps.push_back({t, slice, bytes, align, absl::StrFormat("%s.%s", field, what)});
            sources.push_back(src);
          };
          r.master = MakeTensor(DType::kFloat32, shape);
          add(&r.master, d != nullptr ? d->master : std::nullopt, count * 4, 4, v->master,
              "master");
          if (include_moments) {
            r.exp_avg = MakeTensor(mdt, shape);
            r.exp_avg_sq = MakeTensor(mdt, shape);
            add(&*r.exp_avg, d != nullptr ? d->exp_avg : std::nullopt, count * mb, mb, v->exp_avg,
                "exp_avg");
            add(&*r.exp_avg_sq, d != nullptr ? d->exp_avg_sq : std::nullopt, count * mb, mb,
                v->exp_avg_sq, "exp_avg_sq");
          }
        }
        if (inline_bytes > ctx.max_inline_output_bytes) {
          return absl::ResourceExhaustedError(absl::StrFormat(
              "the requested state is %d bytes inline, above the %d-byte message budget; give "
              "region destinations or ask for fewer parameters per call (names)",
              inline_bytes, ctx.max_inline_output_bytes));
        }
        QTX_ASSIGN_OR_RETURN(std::vector<void*> ptrs, Place(ps, ctx, pins));
        for (size_t k = 0; k < ptrs.size(); ++k) {
          if (ps[k].bytes > 0) std::memcpy(ptrs[k], sources[k], ps[k].bytes);
        }
        return absl::OkStatus();
      }));
  for (const tensor::OutputSlice& out : pins) QTX_RETURN_IF_ERROR(tensor::CheckIntact(out.pin));
  return result;
}

}  // namespace qtx::server::ops
