// qtx::cuda::MakeColumnwiseCopy: the columnwise (transposed) copy of a
// BLOCK_2D or TENSOR quantized tensor, made on the caller's GPU from the
// rowwise copy, without qtxd.
//
// With one scale per 128x128 tile (or per tensor) the two copies hold the same
// FP8 bytes, transposed, and the same scales (docs/numerics.md §4.5), so a
// trainer can keep only the rowwise FP8 parameters that the Optimizer's Step
// writes and make the columnwise copy when a backward GEMM needs it; the
// result is byte-identical to the columnwise copy Step or Quantize would have
// written. One kernel on `stream`, no host wait, no allocation:
//
//   qtx::cuda::MakeColumnwiseCopy(qtx::ScalingMode::kBlock2D, {4096, 4096},
//                                 {w_fp8, w_scale_inv}, {w_t_fp8, w_t_scale_inv}, stream);
//
// Buffers are device pointers (or anything the kernel can address, e.g.
// managed memory) sized per ComputeQuantizedLayout (qtx/types.h); the
// columnwise scale matrix gets its zero padding.
#ifndef QTX_CLIENT_CUDA_QTX_CUDA_COLUMNWISE_H_
#define QTX_CLIENT_CUDA_QTX_CUDA_COLUMNWISE_H_

#include <cuda_runtime_api.h>

#include <cstdint>
#include <span>

#include "absl/status/status.h"
#include "qtx/types.h"

namespace qtx::cuda {

struct RowwiseCopy {
  const void* data = nullptr;  // FP8 [M, N]
  const float* scale_inv = nullptr;
};
struct ColumnwiseCopy {
  void* data = nullptr;  // FP8 [N, M]
  float* scale_inv = nullptr;
};

// `shape` is the high-precision tensor's (flattened to [M, N] as Quantize does).
// INVALID_ARGUMENT for BLOCK_1D (its copies come from different blocks: quantize
// again instead), a bad shape, or a null buffer (data may be null when the
// tensor is empty); INTERNAL with the CUDA error if the launch fails.
absl::Status MakeColumnwiseCopy(ScalingMode mode, std::span<const int64_t> shape,
                                const RowwiseCopy& in, const ColumnwiseCopy& out,
                                cudaStream_t stream);

}  // namespace qtx::cuda

#endif  // QTX_CLIENT_CUDA_QTX_CUDA_COLUMNWISE_H_
