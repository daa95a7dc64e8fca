#include "server/ops/quantize.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <utility>
#include <variant>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "kernels/block_geometry.h"
#include "server/ops/output_placement.h"

namespace qtx::server::ops {
namespace {

using tensor::DType;
using tensor::MemoryKind;

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

absl::StatusOr<uint64_t> CheckedBytes(int64_t count, int64_t elem_size, std::string_view what) {
  int64_t bytes = 0;
  if (count < 0 || __builtin_mul_overflow(count, elem_size, &bytes)) {
    return absl::InvalidArgumentError(absl::StrFormat("%s: byte count overflows", what));
  }
  return static_cast<uint64_t>(bytes);
}

bool ValidScaling(kernels::BlockScaling s) {
  return s == kernels::BlockScaling::kBlock1D || s == kernels::BlockScaling::kBlock2D ||
         s == kernels::BlockScaling::kTensor;
}

// Resolves one buffer of a quantized tensor and checks dtype and element count.
absl::StatusOr<tensor::TensorView> ResolveQuantizedBuffer(
    const std::optional<tensor::TensorRefSpec>& spec, std::string_view field, bool is_data,
    kernels::Fp8Format format, int64_t expected_elements, const std::string& layout_desc,
    const OpContext& ctx,
    std::optional<std::pair<int64_t, int64_t>> expected_shape = std::nullopt) {
  if (!spec.has_value()) {
    return absl::InvalidArgumentError(absl::StrFormat("%s: missing", field));
  }
  if (is_data) {
    const DType want = tensor::Fp8DataDType(format);
    if (spec->dtype != want && spec->dtype != DType::kUInt8) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s.dtype=%s: must be %s or UINT8 for format %s", field, tensor::DTypeName(spec->dtype),
          tensor::DTypeName(want), FormatName(format)));
    }
  } else if (spec->dtype != DType::kFloat32) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s.dtype=%s: must be FLOAT32", field, tensor::DTypeName(spec->dtype)));
  }
  QTX_ASSIGN_OR_RETURN(tensor::TensorView view,
                       tensor::ResolveInput(*spec, field, *ctx.regions, ctx.limits));
  if (view.elements != expected_elements) {
    return absl::InvalidArgumentError(absl::StrFormat("%s.shape=%s: %d elements, expected %d (%s)",
                                                      field, ShapeString(view.shape), view.elements,
                                                      expected_elements, layout_desc));
  }
  // The element count alone would let the transpose (or any other
  // arrangement) through and dequantize it silently wrong.
  if (expected_shape.has_value() &&
      (view.shape.size() != 2 || view.shape[0] != expected_shape->first ||
       view.shape[1] != expected_shape->second)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s.shape=%s: expected [%d, %d] (%s)", field, ShapeString(view.shape),
                        expected_shape->first, expected_shape->second, layout_desc));
  }
  return view;
}

// Host and device work of one op, for the *RunsShort predicates.
class WorkEstimate {
 public:
  explicit WorkEstimate(const OpContext& ctx) : ctx_(ctx) {}

  // A tensor the op reads: `bytes` in memory of kind `kind`.
  void Input(uint64_t bytes, MemoryKind kind) {
    if (ctx_.device->memory_kind() == MemoryKind::kHost) {
      Add(host_, bytes);  // the kernel runs on the host
      return;
    }
    Add(device_, bytes);
    if (kind != MemoryKind::kDevice) {
      Add(host_, bytes);  // staged through the host
      staged_ = true;
    }
  }
  // A buffer the op writes (kernel work counted with the inputs).
  void Output(uint64_t bytes, MemoryKind kind) {
    if (ctx_.device->memory_kind() == MemoryKind::kDevice && kind != MemoryKind::kDevice) {
      Add(host_, bytes);
      staged_ = true;
    }
  }

  bool Short(const backend::CudaEvents& events) const {
    if (ctx_.device->memory_kind() == MemoryKind::kHost) {
      return host_ <= ctx_.inline_limits.max_host_bytes;
    }
    // Without a signal event, or with a staged copy, the host waits for the
    // stream: the kernel and, first, the client's wait event.
    const bool host_waits = events.signal_event.empty() || staged_;
    if (host_waits && !events.wait_event.empty()) return false;
    return host_ <= ctx_.inline_limits.max_host_bytes &&
           (!host_waits || device_ <= ctx_.inline_limits.max_device_bytes);
  }

 private:
  static void Add(uint64_t& total, uint64_t bytes) {
    total = bytes > UINT64_MAX - total ? UINT64_MAX : total + bytes;
  }

  const OpContext& ctx_;
  uint64_t host_ = 0;
  uint64_t device_ = 0;
  bool staged_ = false;
};

// Where a region slice's bytes live; host for an unknown region (the op
// fails with NOT_FOUND before any work).
MemoryKind SliceMemory(const tensor::RegionSliceSpec& slice, const OpContext& ctx) {
  auto region = ctx.regions->Acquire(slice.region);
  return region.ok() ? (*region)->memory_kind() : MemoryKind::kHost;
}

MemoryKind RefMemory(const tensor::TensorRefSpec& ref, const OpContext& ctx) {
  if (const auto* slice = std::get_if<tensor::RegionSliceSpec>(&ref.data)) {
    return SliceMemory(*slice, ctx);
  }
  return MemoryKind::kHost;
}

MemoryKind OutputMemory(const std::optional<tensor::RegionSliceSpec>& spec, const OpContext& ctx) {
  return spec.has_value() ? SliceMemory(*spec, ctx) : MemoryKind::kHost;
}

// Elements of `shape`; nullopt for a negative dim or an overflow (such a
// request fails validation before any work).
std::optional<uint64_t> Elements(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) {
    if (d < 0 || __builtin_mul_overflow(n, d, &n)) return std::nullopt;
  }
  return static_cast<uint64_t>(n);
}

uint64_t SaturatingBytes(uint64_t elements, int64_t elem_size) {
  const uint64_t size = static_cast<uint64_t>(std::max<int64_t>(elem_size, 1));
  return elements > UINT64_MAX / size ? UINT64_MAX : elements * size;
}

}  // namespace

bool QuantizeRunsShort(const QuantizeRequestSpec& request, const OpContext& ctx) {
  const std::optional<uint64_t> elements = Elements(request.input.shape);
  if (!elements.has_value()) return true;
  WorkEstimate work(ctx);
  work.Input(SaturatingBytes(*elements, tensor::ElementSize(request.input.dtype)),
             RefMemory(request.input, ctx));
  // FP8 data is one byte per element; scales are 1/128 of that or less.
  const QuantizeOutputSpecs& o = request.outputs;
  if (request.params.rowwise) {
    work.Output(*elements, OutputMemory(o.rowwise_data, ctx));
    work.Output(*elements / 32, OutputMemory(o.rowwise_scale_inv, ctx));
  }
  if (request.params.columnwise) {
    work.Output(*elements, OutputMemory(o.columnwise_data, ctx));
    work.Output(*elements / 32, OutputMemory(o.columnwise_scale_inv, ctx));
  }
  return work.Short(request.events);
}

bool DequantizeRunsShort(const DequantizeRequestSpec& request, const OpContext& ctx) {
  const std::optional<uint64_t> elements = Elements(request.input.shape);
  if (!elements.has_value()) return true;
  const QuantizedTensorSpec& q = request.input;
  WorkEstimate work(ctx);
  const bool rowwise = q.rowwise_data.has_value();
  const auto& data = rowwise ? q.rowwise_data : q.columnwise_data;
  const auto& scale = rowwise ? q.rowwise_scale_inv : q.columnwise_scale_inv;
  if (data.has_value()) work.Input(*elements, RefMemory(*data, ctx));
  if (scale.has_value()) work.Input(*elements / 32, RefMemory(*scale, ctx));
  const DType out_dtype =
      request.output_dtype == DType::kUnspecified ? DType::kFloat32 : request.output_dtype;
  work.Output(SaturatingBytes(*elements, tensor::ElementSize(out_dtype)),
              OutputMemory(request.output, ctx));
  if (ctx.device->memory_kind() == MemoryKind::kHost) {
    // The kernel writes every output byte on the host.
    work.Input(SaturatingBytes(*elements, tensor::ElementSize(out_dtype)), MemoryKind::kHost);
  }
  return work.Short(request.events);
}

std::string_view ScalingName(kernels::BlockScaling s) {
  switch (s) {
    case kernels::BlockScaling::kBlock2D:
      return "BLOCK_2D";
    case kernels::BlockScaling::kTensor:
      return "TENSOR";
    default:
      return "BLOCK_1D";
  }
}

std::string_view FormatName(kernels::Fp8Format f) {
  return f == kernels::Fp8Format::kE5M2 ? "E5M2" : "E4M3";
}

absl::Status ValidateQuantizeParams(const kernels::QuantizeParams& params, std::string_view field) {
  if (!ValidScaling(params.scaling)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s.scaling_mode=%d: must be BLOCK_1D, BLOCK_2D or TENSOR", field,
                        static_cast<int>(params.scaling)));
  }
  if (params.format != kernels::Fp8Format::kE4M3 && params.format != kernels::Fp8Format::kE5M2) {
    return absl::InvalidArgumentError(absl::StrFormat("%s.format=%d: must be E4M3 or E5M2", field,
                                                      static_cast<int>(params.format)));
  }
  if (!params.rowwise && !params.columnwise) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: rowwise=false and columnwise=false: at least one copy must be requested", field));
  }
  if (!std::isfinite(params.amax_epsilon) || params.amax_epsilon < 0.0f) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s.amax_epsilon=%g: must be finite and >= 0", field, params.amax_epsilon));
  }
  return absl::OkStatus();
}

const std::optional<tensor::RegionSliceSpec>& OutputSpec(const QuantizeOutputSpecs& specs, int i) {
  switch (i) {
    case 0:
      return specs.rowwise_data;
    case 1:
      return specs.rowwise_scale_inv;
    case 2:
      return specs.columnwise_data;
    default:
      return specs.columnwise_scale_inv;
  }
}

absl::StatusOr<std::array<QuantizedBufferInfo, 4>> DescribeQuantizedOutputs(
    const kernels::QuantizeParams& params, const kernels::QuantizedLayout& layout) {
  const int64_t counts[4] = {layout.RowwiseDataBytes(), layout.RowwiseScaleCount(),
                             layout.ColumnwiseDataBytes(), layout.ColumnwiseScaleCount()};
  const DType data_dtype = tensor::Fp8DataDType(params.format);
  std::array<QuantizedBufferInfo, 4> b;
  b[0].shape = {layout.rowwise_data_rows, layout.rowwise_data_cols};
  b[1].shape = ScaleShape(params.scaling, layout.rowwise_scale_rows, layout.rowwise_scale_cols);
  b[2].shape = {layout.columnwise_data_rows, layout.columnwise_data_cols};
  b[3].shape =
      ScaleShape(params.scaling, layout.columnwise_scale_rows, layout.columnwise_scale_cols);
  for (int i = 0; i < 4; ++i) {
    b[i].requested = OutputRequested(params, i);
    b[i].dtype = i % 2 == 0 ? data_dtype : DType::kFloat32;
    QTX_ASSIGN_OR_RETURN(b[i].bytes, CheckedBytes(counts[i], kQuantizedOutputAlignment[i],
                                                  kQuantizedOutputFields[i]));
  }
  return b;
}

absl::Status PlaceQuantizedOutputs(const QuantizeOutputSpecs& specs,
                                   const std::array<QuantizedBufferInfo, 4>& buffers,
                                   const OpContext& ctx,
                                   std::array<std::optional<PlacedOutput>, 4>& outs) {
  for (int i = 0; i < 4; ++i) {
    const QuantizedBufferInfo& b = buffers[i];
    if (!b.requested) continue;
    QTX_RETURN_IF_ERROR(PlaceOutput(OutputSpec(specs, i), b.bytes, kQuantizedOutputAlignment[i],
                                    b.dtype, b.shape, kQuantizedOutputFields[i], ctx, outs[i]));
  }
  return absl::OkStatus();
}

absl::StatusOr<QuantizeResult> Quantize(const QuantizeRequestSpec& request, const OpContext& ctx) {
  const kernels::QuantizeParams& params = request.params;
  QTX_RETURN_IF_ERROR(ValidateQuantizeParams(params, "config"));
  QTX_RETURN_IF_ERROR(ValidateCudaEvents(request.events, ctx));
  QTX_RETURN_IF_ERROR(NoEventsOnChannel(request.events, request.queue));
  const auto input_dtype = tensor::ToInputDType(request.input.dtype);
  if (!input_dtype.has_value()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("input.dtype=%s: Quantize accepts FLOAT32, BFLOAT16 or FLOAT16",
                        tensor::DTypeName(request.input.dtype)));
  }
  struct {
    const std::optional<tensor::RegionSliceSpec>& spec;
    bool requested;
    std::string_view field;
    std::string_view usage;
  } const unrequested_checks[] = {
      {request.outputs.rowwise_data, params.rowwise, "outputs.rowwise_data", "rowwise"},
      {request.outputs.rowwise_scale_inv, params.rowwise, "outputs.rowwise_scale_inv", "rowwise"},
      {request.outputs.columnwise_data, params.columnwise, "outputs.columnwise_data", "columnwise"},
      {request.outputs.columnwise_scale_inv, params.columnwise, "outputs.columnwise_scale_inv",
       "columnwise"},
  };
  for (const auto& c : unrequested_checks) {
    if (c.spec.has_value() && !c.requested) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s is set but config.%s=false: that copy is not produced", c.field, c.usage));
    }
  }

  QTX_ASSIGN_OR_RETURN(tensor::TensorView input,
                       tensor::ResolveInput(request.input, "input", *ctx.regions, ctx.limits));
  QTX_ASSIGN_OR_RETURN(const Matrix2D mn, FlattenTo2D(input.shape, "input", ctx.limits));
  const kernels::QuantizedLayout layout = kernels::ComputeLayout(params.scaling, mn.m, mn.n);
  QTX_ASSIGN_OR_RETURN(const auto buffers, DescribeQuantizedOutputs(params, layout));
  std::array<std::optional<PlacedOutput>, 4> outs;  // rw data, rw scale, cw data, cw scale
  QTX_RETURN_IF_ERROR(PlaceQuantizedOutputs(request.outputs, buffers, ctx, outs));

  // Aliasing and inline budget, still before any work.
  std::vector<NamedRange> ranges;
  if (input.pin != nullptr) ranges.push_back({"input", input.data, input.byte_size});
  uint64_t inline_bytes = 0;
  for (size_t i = 0; i < outs.size(); ++i) {
    if (!outs[i].has_value()) continue;
    if (outs[i]->slice.has_value()) {
      ranges.push_back({kQuantizedOutputFields[i], outs[i]->slice->data, outs[i]->bytes});
    } else {
      inline_bytes += outs[i]->bytes;  // each <= 2^40 by the shape limits
    }
  }
  QTX_RETURN_IF_ERROR(CheckNoOverlap(ranges));
  QTX_RETURN_IF_ERROR(CheckInlineBudget(inline_bytes, ctx, "Quantize"));
  if (request.queue != nullptr) {
    QTX_RETURN_IF_ERROR(CheckChannelInput(input, "input", ctx));
    for (size_t i = 0; i < outs.size(); ++i) {
      if (!outs[i].has_value()) continue;
      QTX_RETURN_IF_ERROR(CheckChannelOutput(*outs[i], kQuantizedOutputFields[i], ctx));
    }
  }

  backend::DeviceBuffer input_staging;
  QTX_ASSIGN_OR_RETURN(const void* input_ptr, InputOnDevice(input, "input", ctx, input_staging));
  for (auto& o : outs) AllocateInline(o);

  backend::QuantizeArgs args;
  args.input = input_ptr;
  args.dtype = *input_dtype;
  args.m = mn.m;
  args.n = mn.n;
  args.params = params;
  args.events = request.events;
  args.queue = request.queue;
  if (outs[0]) args.out.rowwise_data = static_cast<uint8_t*>(outs[0]->KernelPointer());
  if (outs[1]) args.out.rowwise_scale_inv = static_cast<float*>(outs[1]->KernelPointer());
  if (outs[2]) args.out.columnwise_data = static_cast<uint8_t*>(outs[2]->KernelPointer());
  if (outs[3]) args.out.columnwise_scale_inv = static_cast<float*>(outs[3]->KernelPointer());
  QTX_RETURN_IF_ERROR(ctx.device->Quantize(args));
  for (auto& o : outs) QTX_RETURN_IF_ERROR(CopyBack(o, *ctx.device));
  QTX_RETURN_IF_ERROR(tensor::CheckIntact(input.pin));
  for (const auto& o : outs) {
    if (o.has_value() && o->slice.has_value()) {
      QTX_RETURN_IF_ERROR(tensor::CheckIntact(o->slice->pin));
    }
  }

  QuantizeResult result;
  result.shape = input.shape;
  result.source_dtype = input.dtype;
  result.params = params;
  if (outs[0]) result.rowwise_data = std::move(outs[0]->tensor);
  if (outs[1]) result.rowwise_scale_inv = std::move(outs[1]->tensor);
  if (outs[2]) result.columnwise_data = std::move(outs[2]->tensor);
  if (outs[3]) result.columnwise_scale_inv = std::move(outs[3]->tensor);
  return result;
}

absl::StatusOr<OutputTensor> Dequantize(const DequantizeRequestSpec& request,
                                        const OpContext& ctx) {
  const QuantizedTensorSpec& q = request.input;
  if (!ValidScaling(q.scaling)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("input.config.scaling_mode=%d: must be BLOCK_1D, BLOCK_2D or TENSOR",
                        static_cast<int>(q.scaling)));
  }
  if (q.format != kernels::Fp8Format::kE4M3 && q.format != kernels::Fp8Format::kE5M2) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "input.config.format=%d: must be E4M3 or E5M2", static_cast<int>(q.format)));
  }
  QTX_RETURN_IF_ERROR(ValidateCudaEvents(request.events, ctx));
  QTX_RETURN_IF_ERROR(NoEventsOnChannel(request.events, request.queue));
  const DType out_dtype =
      request.output_dtype == DType::kUnspecified ? DType::kFloat32 : request.output_dtype;
  const auto out_kernel_dtype = tensor::ToInputDType(out_dtype);
  if (!out_kernel_dtype.has_value()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "output_dtype=%s: must be FLOAT32, BFLOAT16 or FLOAT16", tensor::DTypeName(out_dtype)));
  }
  QTX_ASSIGN_OR_RETURN(int64_t elements, tensor::ValidateShape(q.shape, "input", ctx.limits));
  QTX_ASSIGN_OR_RETURN(const Matrix2D mn, FlattenTo2D(q.shape, "input", ctx.limits));
  const kernels::QuantizedLayout layout = kernels::ComputeLayout(q.scaling, mn.m, mn.n);

  const bool use_rowwise = q.rowwise_data.has_value();
  if (!use_rowwise && !q.columnwise_data.has_value()) {
    return absl::InvalidArgumentError(
        "input: neither rowwise_data nor columnwise_data is set: nothing to dequantize");
  }
  const std::string layout_desc =
      absl::StrFormat("%s layout of M=%d, N=%d", ScalingName(q.scaling), mn.m, mn.n);
  tensor::TensorView data;
  tensor::TensorView scale;
  if (use_rowwise) {
    QTX_ASSIGN_OR_RETURN(
        data, ResolveQuantizedBuffer(q.rowwise_data, "input.rowwise_data", true, q.format,
                                     layout.RowwiseDataBytes(), layout_desc, ctx));
    QTX_ASSIGN_OR_RETURN(
        scale, ResolveQuantizedBuffer(q.rowwise_scale_inv, "input.rowwise_scale_inv", false,
                                      q.format, layout.RowwiseScaleCount(), layout_desc, ctx));
  } else {
    QTX_ASSIGN_OR_RETURN(
        data, ResolveQuantizedBuffer(
                  q.columnwise_data, "input.columnwise_data", true, q.format,
                  layout.ColumnwiseDataBytes(), layout_desc, ctx,
                  std::make_pair(layout.columnwise_data_rows, layout.columnwise_data_cols)));
    // A per-tensor scale is one value: any shape of one element will do.
    std::optional<std::pair<int64_t, int64_t>> scale_shape;
    if (q.scaling != kernels::BlockScaling::kTensor) {
      scale_shape = std::make_pair(layout.columnwise_scale_rows, layout.columnwise_scale_cols);
    }
    QTX_ASSIGN_OR_RETURN(
        scale, ResolveQuantizedBuffer(q.columnwise_scale_inv, "input.columnwise_scale_inv", false,
                                      q.format, layout.ColumnwiseScaleCount(), layout_desc, ctx,
                                      scale_shape));
  }

  QTX_ASSIGN_OR_RETURN(uint64_t out_bytes,
                       CheckedBytes(elements, tensor::ElementSize(out_dtype), "output"));
  std::optional<PlacedOutput> out;
  QTX_RETURN_IF_ERROR(PlaceOutput(request.output, out_bytes,
                                  static_cast<uint64_t>(tensor::ElementSize(out_dtype)), out_dtype,
                                  q.shape, "output", ctx, out));
  if (out->slice.has_value()) {
    std::vector<NamedRange> ranges;
    if (data.pin != nullptr) ranges.push_back({"input data", data.data, data.byte_size});
    if (scale.pin != nullptr) ranges.push_back({"input scale_inv", scale.data, scale.byte_size});
    ranges.push_back({"output", out->slice->data, out->bytes});
    QTX_RETURN_IF_ERROR(CheckNoOverlap(ranges));
  } else {
    QTX_RETURN_IF_ERROR(CheckInlineBudget(out_bytes, ctx, "Dequantize"));
  }
  if (request.queue != nullptr) {
    QTX_RETURN_IF_ERROR(CheckChannelInput(data, "input data", ctx));
    QTX_RETURN_IF_ERROR(CheckChannelInput(scale, "input scale_inv", ctx));
    QTX_RETURN_IF_ERROR(CheckChannelOutput(*out, "output", ctx));
  }

  backend::DeviceBuffer data_staging;
  backend::DeviceBuffer scale_staging;
  QTX_ASSIGN_OR_RETURN(const void* data_ptr, InputOnDevice(data, "input data", ctx, data_staging));
  QTX_ASSIGN_OR_RETURN(const void* scale_ptr,
                       InputOnDevice(scale, "input scale_inv", ctx, scale_staging));
  AllocateInline(out);

  backend::DequantizeArgs args;
  if (use_rowwise) {
    args.in.rowwise_data = static_cast<const uint8_t*>(data_ptr);
    args.in.rowwise_scale_inv = static_cast<const float*>(scale_ptr);
  } else {
    args.in.columnwise_data = static_cast<const uint8_t*>(data_ptr);
    args.in.columnwise_scale_inv = static_cast<const float*>(scale_ptr);
  }
  args.scaling = q.scaling;
  args.format = q.format;
  args.m = mn.m;
  args.n = mn.n;
  args.use_rowwise = use_rowwise;
  args.out_dtype = *out_kernel_dtype;
  args.out = out->KernelPointer();
  args.events = request.events;
  args.queue = request.queue;
  QTX_RETURN_IF_ERROR(ctx.device->Dequantize(args));
  QTX_RETURN_IF_ERROR(CopyBack(out, *ctx.device));
  QTX_RETURN_IF_ERROR(tensor::CheckIntact(data.pin));
  QTX_RETURN_IF_ERROR(tensor::CheckIntact(scale.pin));
  if (out->slice.has_value()) QTX_RETURN_IF_ERROR(tensor::CheckIntact(out->slice->pin));
  return std::move(out->tensor);
}

}  // namespace qtx::server::ops
