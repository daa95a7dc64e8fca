#include "client/proto_convert.h"

#include <cstdint>
#include <limits>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"

namespace qtx::client_internal {

absl::Status FromGrpcStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
}

void ToProto(const ShardRange& in, v1::ShardRange* out) {
  out->set_begin(in.begin);
  out->set_end(in.end);
}

ShardRange FromProto(const v1::ShardRange& in) { return ShardRange{in.begin(), in.end()}; }

void ToProto(const RegionSlice& in, v1::RegionSlice* out) {
  out->set_region(in.region);
  out->set_offset(in.offset);
  out->set_size(in.size);
}

RegionSlice FromProto(const v1::RegionSlice& in) {
  return RegionSlice{in.region(), in.offset(), in.size()};
}

void ToProto(const Tensor& in, v1::TensorRef* out) {
  out->set_dtype(static_cast<v1::DType>(in.dtype));
  out->mutable_shape()->Assign(in.shape.begin(), in.shape.end());
  if (in.region) {
    ToProto(*in.region, out->mutable_region());
  } else {
    out->set_inline_data(in.data);
  }
}

Tensor FromProto(v1::TensorRef&& in) {
  Tensor t;
  t.dtype = static_cast<DType>(in.dtype());
  t.shape.assign(in.shape().begin(), in.shape().end());
  if (in.has_region()) {
    t.region = FromProto(in.region());
  } else {
    t.data = std::move(*in.mutable_inline_data());
  }
  return t;
}

void ToProto(const QuantizeConfig& in, v1::QuantizeConfig* out) {
  out->set_scaling_mode(static_cast<v1::ScalingMode>(in.scaling_mode));
  out->set_format(static_cast<v1::Fp8Format>(in.format));
  out->set_rowwise(in.rowwise);
  out->set_columnwise(in.columnwise);
  out->set_force_pow2_scales(in.force_pow2_scales);
  out->set_amax_epsilon(in.amax_epsilon);
}

QuantizeConfig FromProto(const v1::QuantizeConfig& in) {
  QuantizeConfig c;
  switch (in.scaling_mode()) {
    case v1::BLOCK_2D:
      c.scaling_mode = ScalingMode::kBlock2D;
      break;
    case v1::TENSOR:
      c.scaling_mode = ScalingMode::kTensor;
      break;
    default:
      c.scaling_mode = ScalingMode::kBlock1D;
      break;
  }
  c.format = in.format() == v1::E5M2 ? Fp8Format::kE5M2 : Fp8Format::kE4M3;
  c.rowwise = in.has_rowwise() ? in.rowwise() : true;
  c.columnwise = in.has_columnwise() ? in.columnwise() : false;
  c.force_pow2_scales = in.has_force_pow2_scales() ? in.force_pow2_scales() : true;
  c.amax_epsilon = in.amax_epsilon();
  return c;
}

void ToProto(const QuantizedTensor& in, v1::QuantizedTensor* out) {
  out->mutable_shape()->Assign(in.shape.begin(), in.shape.end());
  out->set_source_dtype(static_cast<v1::DType>(in.source_dtype));
  ToProto(in.config, out->mutable_config());
  if (in.rowwise_data) ToProto(*in.rowwise_data, out->mutable_rowwise_data());
  if (in.rowwise_scale_inv) ToProto(*in.rowwise_scale_inv, out->mutable_rowwise_scale_inv());
  if (in.columnwise_data) ToProto(*in.columnwise_data, out->mutable_columnwise_data());
  if (in.columnwise_scale_inv) {
    ToProto(*in.columnwise_scale_inv, out->mutable_columnwise_scale_inv());
  }
}

QuantizedTensor FromProto(v1::QuantizedTensor&& in) {
  QuantizedTensor q;
  q.shape.assign(in.shape().begin(), in.shape().end());
  q.source_dtype = static_cast<DType>(in.source_dtype());
  q.config = FromProto(in.config());
  if (in.has_rowwise_data()) q.rowwise_data = FromProto(std::move(*in.mutable_rowwise_data()));
  if (in.has_rowwise_scale_inv()) {
    q.rowwise_scale_inv = FromProto(std::move(*in.mutable_rowwise_scale_inv()));
  }
  if (in.has_columnwise_data()) {
    q.columnwise_data = FromProto(std::move(*in.mutable_columnwise_data()));
  }
  if (in.has_columnwise_scale_inv()) {
    q.columnwise_scale_inv = FromProto(std::move(*in.mutable_columnwise_scale_inv()));
  }
  return q;
}

void ToProto(const QuantizeOutputs& in, v1::QuantizeOutputs* out) {
  if (in.rowwise_data) ToProto(*in.rowwise_data, out->mutable_rowwise_data());
  if (in.rowwise_scale_inv) ToProto(*in.rowwise_scale_inv, out->mutable_rowwise_scale_inv());
  if (in.columnwise_data) ToProto(*in.columnwise_data, out->mutable_columnwise_data());
  if (in.columnwise_scale_inv) {
    ToProto(*in.columnwise_scale_inv, out->mutable_columnwise_scale_inv());
  }
}

RegionInfo FromProto(const v1::RegionInfo& in) {
  RegionInfo r;
  r.name = in.name();
  r.kind = in.kind();
  r.byte_size = in.byte_size();
  r.shm_name = in.shm_name();
  r.device_id = in.device_id();
  r.in_use = in.in_use();
  return r;
}

absl::Status ToProto(const CollectiveGroupConfig& in, v1::CreateGroupRequest* out) {
  const absl::Duration max_timeout = absl::Milliseconds(std::numeric_limits<uint32_t>::max());
  if (in.timeout < absl::ZeroDuration() || in.timeout > max_timeout) {
    return absl::InvalidArgumentError(absl::StrCat(
        "timeout=", absl::FormatDuration(in.timeout),
        ": must be >= 0 and <= ", absl::FormatDuration(max_timeout), " (0 = the server default)"));
  }
  out->set_name(in.name);
  out->set_rank(in.rank);
  out->set_world_size(in.world_size);
  out->set_coordinator(in.coordinator);
  out->set_backend(static_cast<v1::CommBackend>(in.backend));
  // Rounded up, so that a positive sub-millisecond timeout does not become 0
  // (the server default).
  out->set_timeout_ms(static_cast<uint32_t>(
      absl::ToInt64Milliseconds(absl::Ceil(in.timeout, absl::Milliseconds(1)))));
  return absl::OkStatus();
}

CollectiveGroupInfo FromProto(const v1::GroupInfo& in) {
  CollectiveGroupInfo g;
  g.name = in.name();
  g.rank = in.rank();
  g.world_size = in.world_size();
  g.backend = static_cast<CommBackend>(in.backend());
  g.state = static_cast<GroupState>(in.state());
  g.next_sequence = in.next_sequence();
  g.error = in.error();
  return g;
}

}  // namespace qtx::client_internal
