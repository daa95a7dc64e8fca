#include "qtx/types.h"

#include <cstring>
#include <limits>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "kernels/block_geometry.h"

namespace qtx {

int64_t DTypeSize(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return 4;
    case DType::kBFloat16:
    case DType::kFloat16:
      return 2;
    case DType::kFloat8E4M3:
    case DType::kFloat8E5M2:
    case DType::kUInt8:
      return 1;
    case DType::kUnspecified:
      break;
  }
  return 0;
}

const char* DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return "float32";
    case DType::kBFloat16:
      return "bfloat16";
    case DType::kFloat16:
      return "float16";
    case DType::kFloat8E4M3:
      return "float8_e4m3";
    case DType::kFloat8E5M2:
      return "float8_e5m2";
    case DType::kUInt8:
      return "uint8";
    case DType::kUnspecified:
      break;
  }
  return "unspecified";
}

const char* ScalingModeName(ScalingMode mode) {
  switch (mode) {
    case ScalingMode::kBlock2D:
      return "block2d";
    case ScalingMode::kTensor:
      return "tensor";
    default:
      return "block1d";
  }
}

const char* Fp8FormatName(Fp8Format format) { return format == Fp8Format::kE5M2 ? "e5m2" : "e4m3"; }

absl::StatusOr<int64_t> NumElements(std::span<const int64_t> shape) {
  int64_t count = 1;
  for (size_t i = 0; i < shape.size(); ++i) {
    const int64_t d = shape[i];
    if (d < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("shape [", absl::StrJoin(shape, ","), "]: dim ", i, " is negative"));
    }
    if (d != 0 && count > std::numeric_limits<int64_t>::max() / d) {
      return absl::InvalidArgumentError(
          absl::StrCat("shape [", absl::StrJoin(shape, ","), "]: element count overflows int64"));
    }
    count *= d;
  }
  return count;
}

Tensor Tensor::Inline(DType dtype, std::vector<int64_t> shape, std::string bytes) {
  Tensor t;
  t.dtype = dtype;
  t.shape = std::move(shape);
  t.data = std::move(bytes);
  return t;
}

Tensor Tensor::FromFloat32(std::vector<int64_t> shape, std::span<const float> values) {
  std::string bytes(values.size_bytes(), '\0');
  if (!values.empty()) std::memcpy(bytes.data(), values.data(), values.size_bytes());
  return Inline(DType::kFloat32, std::move(shape), std::move(bytes));
}

Tensor Tensor::InRegion(DType dtype, std::vector<int64_t> shape, RegionSlice slice) {
  Tensor t;
  t.dtype = dtype;
  t.shape = std::move(shape);
  t.region = std::move(slice);
  return t;
}

absl::StatusOr<int64_t> Tensor::ByteSize() const {
  QTX_ASSIGN_OR_RETURN(const int64_t count, NumElements(shape));
  const int64_t size = DTypeSize(dtype);
  if (size == 0) return absl::InvalidArgumentError("tensor dtype is unspecified");
  if (count > std::numeric_limits<int64_t>::max() / size) {
    return absl::InvalidArgumentError(
        absl::StrCat("shape [", absl::StrJoin(shape, ","), "]: byte size overflows int64"));
  }
  return count * size;
}

absl::StatusOr<QuantizedLayout> ComputeQuantizedLayout(ScalingMode mode,
                                                       std::span<const int64_t> shape) {
  if (shape.empty()) {
    return absl::InvalidArgumentError("shape []: quantization needs rank >= 1");
  }
  QTX_ASSIGN_OR_RETURN(const int64_t m, NumElements(shape.first(shape.size() - 1)));
  QTX_RETURN_IF_ERROR(NumElements(shape).status());  // the whole tensor must fit too
  const int64_t n = shape.back();
  // The geometry is the kernels' (docs/numerics.md §3, §4), not a copy of it.
  kernels::BlockScaling scaling = kernels::BlockScaling::kBlock1D;
  if (mode == ScalingMode::kBlock2D) scaling = kernels::BlockScaling::kBlock2D;
  if (mode == ScalingMode::kTensor) scaling = kernels::BlockScaling::kTensor;
  const kernels::QuantizedLayout k = kernels::ComputeLayout(scaling, m, n);
  QuantizedLayout l;
  l.m = k.m;
  l.n = k.n;
  l.rowwise_data_rows = k.rowwise_data_rows;
  l.rowwise_data_cols = k.rowwise_data_cols;
  l.rowwise_scale_rows = k.rowwise_scale_rows;
  l.rowwise_scale_cols = k.rowwise_scale_cols;
  l.columnwise_data_rows = k.columnwise_data_rows;
  l.columnwise_data_cols = k.columnwise_data_cols;
  l.columnwise_scale_rows = k.columnwise_scale_rows;
  l.columnwise_scale_cols = k.columnwise_scale_cols;
  return l;
}

}  // namespace qtx
