#include "qtx/cuda_columnwise.h"

#include <cuda_runtime_api.h>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/cuda/columnwise_copy.h"

namespace qtx::cuda {

absl::Status MakeColumnwiseCopy(ScalingMode mode, std::span<const int64_t> shape,
                                const RowwiseCopy& in, const ColumnwiseCopy& out,
                                cudaStream_t stream) {
  if (mode != ScalingMode::kBlock2D && mode != ScalingMode::kTensor) {
    return absl::InvalidArgumentError(
        absl::StrCat("MakeColumnwiseCopy: scaling mode ", ScalingModeName(mode),
                     " has no columnwise copy equal to the transposed rowwise one (only "
                     "block2d and tensor do); quantize with columnwise=true instead"));
  }
  QTX_ASSIGN_OR_RETURN(const QuantizedLayout l, ComputeQuantizedLayout(mode, shape));
  const bool empty = l.m == 0 || l.n == 0;
  const bool no_scales = l.columnwise_scale_rows * l.columnwise_scale_cols == 0;
  if ((!no_scales && (in.scale_inv == nullptr || out.scale_inv == nullptr)) ||
      (!empty && (in.data == nullptr || out.data == nullptr))) {
    return absl::InvalidArgumentError(
        "MakeColumnwiseCopy: a null buffer (both scale_inv buffers are required, and both "
        "data buffers unless the tensor is empty)");
  }
  const kernels::BlockScaling scaling = mode == ScalingMode::kBlock2D
                                            ? kernels::BlockScaling::kBlock2D
                                            : kernels::BlockScaling::kTensor;
  const cudaError_t err = kernels::cuda::ColumnwiseFromRowwise(
      scaling, {static_cast<const uint8_t*>(in.data), in.scale_inv}, l.m, l.n,
      {nullptr, nullptr, static_cast<uint8_t*>(out.data), out.scale_inv}, stream);
  if (err != cudaSuccess) {
    return absl::InternalError(absl::StrCat("MakeColumnwiseCopy: CUDA error ",
                                            cudaGetErrorName(err), ": ", cudaGetErrorString(err)));
  }
  return absl::OkStatus();
}

}  // namespace qtx::cuda
