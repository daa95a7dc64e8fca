#include "server/api/convert.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status_macros.h"

namespace qtx::server::api {

absl::StatusOr<tensor::DType> DTypeFromProto(int value, std::string_view field) {
  switch (value) {
    case v1::DTYPE_UNSPECIFIED:
      return tensor::DType::kUnspecified;
    case v1::FLOAT32:
      return tensor::DType::kFloat32;
    case v1::BFLOAT16:
      return tensor::DType::kBFloat16;
    case v1::FLOAT16:
      return tensor::DType::kFloat16;
    case v1::FLOAT8_E4M3:
      return tensor::DType::kFloat8E4M3;
    case v1::FLOAT8_E5M2:
      return tensor::DType::kFloat8E5M2;
    case v1::UINT8:
      return tensor::DType::kUInt8;
    default:
      return absl::InvalidArgumentError(
          absl::StrFormat("%s=%d: unknown DType value", field, value));
  }
}

v1::DType DTypeToProto(tensor::DType dtype) {
  switch (dtype) {
    case tensor::DType::kFloat32:
      return v1::FLOAT32;
    case tensor::DType::kBFloat16:
      return v1::BFLOAT16;
    case tensor::DType::kFloat16:
      return v1::FLOAT16;
    case tensor::DType::kFloat8E4M3:
      return v1::FLOAT8_E4M3;
    case tensor::DType::kFloat8E5M2:
      return v1::FLOAT8_E5M2;
    case tensor::DType::kUInt8:
      return v1::UINT8;
    case tensor::DType::kUnspecified:
      return v1::DTYPE_UNSPECIFIED;
  }
  return v1::DTYPE_UNSPECIFIED;
}

tensor::RegionSliceSpec SliceFromProto(const v1::RegionSlice& slice) {
  return tensor::RegionSliceSpec{slice.region(), slice.offset(), slice.size()};
}

absl::StatusOr<tensor::TensorRefSpec> TensorRefFromProto(const v1::TensorRef& ref,
                                                         std::string_view field) {
  tensor::TensorRefSpec spec;
  QTX_ASSIGN_OR_RETURN(spec.dtype, DTypeFromProto(ref.dtype(), absl::StrFormat("%s.dtype", field)));
  spec.shape.assign(ref.shape().begin(), ref.shape().end());
  switch (ref.data_case()) {
    case v1::TensorRef::kInlineData:
      spec.data = std::string_view(ref.inline_data());
      break;
    case v1::TensorRef::kRegion:
      spec.data = SliceFromProto(ref.region());
      break;
    case v1::TensorRef::DATA_NOT_SET:
      break;
  }
  return spec;
}

absl::StatusOr<kernels::QuantizeParams> ParamsFromProto(const v1::QuantizeConfig& config,
                                                        std::string_view field) {
  kernels::QuantizeParams p;
  switch (config.scaling_mode()) {
    case v1::SCALING_MODE_UNSPECIFIED:
    case v1::BLOCK_1D:
      p.scaling = kernels::BlockScaling::kBlock1D;
      break;
    case v1::BLOCK_2D:
      p.scaling = kernels::BlockScaling::kBlock2D;
      break;
    case v1::TENSOR:
      p.scaling = kernels::BlockScaling::kTensor;
      break;
    default:
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s.scaling_mode=%d: unknown ScalingMode (BLOCK_1D=1, BLOCK_2D=2, TENSOR=3)", field,
          static_cast<int>(config.scaling_mode())));
  }
  switch (config.format()) {
    case v1::FP8_FORMAT_UNSPECIFIED:
    case v1::E4M3:
      p.format = kernels::Fp8Format::kE4M3;
      break;
    case v1::E5M2:
      p.format = kernels::Fp8Format::kE5M2;
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrFormat("%s.format=%d: unknown Fp8Format (E4M3=1, E5M2=2)", field,
                          static_cast<int>(config.format())));
  }
  p.rowwise = config.has_rowwise() ? config.rowwise() : true;
  p.columnwise = config.has_columnwise() ? config.columnwise() : false;
  p.force_pow2_scales = config.has_force_pow2_scales() ? config.force_pow2_scales() : true;
  p.amax_epsilon = config.amax_epsilon();
  return p;
}

void ParamsToProto(const kernels::QuantizeParams& p, v1::QuantizeConfig* config) {
  switch (p.scaling) {
    case kernels::BlockScaling::kBlock2D:
      config->set_scaling_mode(v1::BLOCK_2D);
      break;
    case kernels::BlockScaling::kTensor:
      config->set_scaling_mode(v1::TENSOR);
      break;
    default:
      config->set_scaling_mode(v1::BLOCK_1D);
      break;
  }
  config->set_format(p.format == kernels::Fp8Format::kE5M2 ? v1::E5M2 : v1::E4M3);
  config->set_rowwise(p.rowwise);
  config->set_columnwise(p.columnwise);
  config->set_force_pow2_scales(p.force_pow2_scales);
  config->set_amax_epsilon(p.amax_epsilon);
}

backend::CudaEvents CudaEventsFromProto(const v1::CudaEvents& events) {
  backend::CudaEvents out;
  out.wait_event = events.wait_event();
  out.signal_event = events.signal_event();
  return out;
}

absl::StatusOr<ops::QuantizeRequestSpec> QuantizeRequestFromProto(const v1::QuantizeRequest& req) {
  ops::QuantizeRequestSpec spec;
  if (!req.has_input()) {
    return absl::InvalidArgumentError("input: missing");
  }
  QTX_ASSIGN_OR_RETURN(spec.input, TensorRefFromProto(req.input(), "input"));
  QTX_ASSIGN_OR_RETURN(spec.params, ParamsFromProto(req.config(), "config"));
  QuantizeOutputsFromProto(req.outputs(), &spec.outputs);
  spec.events = CudaEventsFromProto(req.cuda_events());
  return spec;
}

void OutputTensorToProto(ops::OutputTensor&& t, v1::TensorRef* ref) {
  ref->set_dtype(DTypeToProto(t.dtype));
  for (int64_t d : t.shape) ref->add_shape(d);
  if (t.region.has_value()) {
    v1::RegionSlice* s = ref->mutable_region();
    s->set_region(t.region->region);
    s->set_offset(t.region->offset);
    s->set_size(t.region->size);
  } else {
    ref->set_inline_data(std::move(t.inline_data));
  }
}

void QuantizeResultToProto(ops::QuantizeResult&& r, v1::QuantizeResponse* response) {
  QuantizedTensorToProto(std::move(r), response->mutable_result());
}

void QuantizeOutputsFromProto(const v1::QuantizeOutputs& o, ops::QuantizeOutputSpecs* s) {
  if (o.has_rowwise_data()) s->rowwise_data = SliceFromProto(o.rowwise_data());
  if (o.has_rowwise_scale_inv()) s->rowwise_scale_inv = SliceFromProto(o.rowwise_scale_inv());
  if (o.has_columnwise_data()) s->columnwise_data = SliceFromProto(o.columnwise_data());
  if (o.has_columnwise_scale_inv()) {
    s->columnwise_scale_inv = SliceFromProto(o.columnwise_scale_inv());
  }
}

void QuantizedTensorToProto(ops::QuantizeResult&& r, v1::QuantizedTensor* q) {
  for (int64_t d : r.shape) q->add_shape(d);
  q->set_source_dtype(DTypeToProto(r.source_dtype));
  ParamsToProto(r.params, q->mutable_config());
  if (r.rowwise_data) OutputTensorToProto(std::move(*r.rowwise_data), q->mutable_rowwise_data());
  if (r.rowwise_scale_inv) {
    OutputTensorToProto(std::move(*r.rowwise_scale_inv), q->mutable_rowwise_scale_inv());
  }
  if (r.columnwise_data) {
    OutputTensorToProto(std::move(*r.columnwise_data), q->mutable_columnwise_data());
  }
  if (r.columnwise_scale_inv) {
    OutputTensorToProto(std::move(*r.columnwise_scale_inv), q->mutable_columnwise_scale_inv());
  }
}

absl::StatusOr<ops::DequantizeRequestSpec> DequantizeRequestFromProto(
    const v1::DequantizeRequest& req) {
  ops::DequantizeRequestSpec spec;
  if (!req.has_input()) {
    return absl::InvalidArgumentError("input: missing");
  }
  const v1::QuantizedTensor& q = req.input();
  spec.input.shape.assign(q.shape().begin(), q.shape().end());
  QTX_ASSIGN_OR_RETURN(kernels::QuantizeParams params, ParamsFromProto(q.config(), "input.config"));
  spec.input.scaling = params.scaling;
  spec.input.format = params.format;
  if (q.has_rowwise_data()) {
    QTX_ASSIGN_OR_RETURN(spec.input.rowwise_data,
                         TensorRefFromProto(q.rowwise_data(), "input.rowwise_data"));
  }
  if (q.has_rowwise_scale_inv()) {
    QTX_ASSIGN_OR_RETURN(spec.input.rowwise_scale_inv,
                         TensorRefFromProto(q.rowwise_scale_inv(), "input.rowwise_scale_inv"));
  }
  if (q.has_columnwise_data()) {
    QTX_ASSIGN_OR_RETURN(spec.input.columnwise_data,
                         TensorRefFromProto(q.columnwise_data(), "input.columnwise_data"));
  }
  if (q.has_columnwise_scale_inv()) {
    QTX_ASSIGN_OR_RETURN(
        spec.input.columnwise_scale_inv,
        TensorRefFromProto(q.columnwise_scale_inv(), "input.columnwise_scale_inv"));
  }
  QTX_ASSIGN_OR_RETURN(spec.output_dtype, DTypeFromProto(req.output_dtype(), "output_dtype"));
  spec.events = CudaEventsFromProto(req.cuda_events());
  if (req.has_output()) spec.output = SliceFromProto(req.output());
  return spec;
}

void RegionInfoToProto(const tensor::RegionInfo& info, v1::RegionInfo* out) {
  out->set_name(info.name);
  out->set_kind(info.kind == tensor::RegionKind::kShm       ? "shm"
                : info.kind == tensor::RegionKind::kCudaIpc ? "cuda_ipc"
                                                            : "cuda_vmm");
  out->set_byte_size(info.byte_size);
  out->set_shm_name(info.shm_name);
  out->set_device_id(info.device_id);
  out->set_in_use(info.in_use);
}

}  // namespace qtx::server::api
