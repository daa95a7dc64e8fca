// CUDA twin of kernels/cpu/columnwise_copy.h, bit-exact with it: the
// columnwise copy of a BLOCK_2D or TENSOR quantized [m, n] tensor made from its
// rowwise copy (byte transpose of the data, transpose of the tile scales with
// zero padding, or the one per-tensor scale copied), byte-identical to the
// columnwise copy that Quantize and the Optimizer's Step write.
// Plain header: CUDA runtime types only, callable from host code without nvcc.
//
// All pointers are device pointers; the work is enqueued on `stream` (one
// kernel) and nothing synchronizes. The data transpose goes through shared
// memory in 128x128-byte tiles with 16-byte loads and stores when m and n are
// multiples of 16 and the data pointers 16-byte aligned, and through a
// byte-wise tile path otherwise.
#ifndef QTX_KERNELS_CUDA_COLUMNWISE_COPY_H_
#define QTX_KERNELS_CUDA_COLUMNWISE_COPY_H_

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/quantize_params.h"

namespace qtx::kernels::cuda {

// Writes out.columnwise_data [n, m] and out.columnwise_scale_inv from
// in.rowwise_data [m, n] and in.rowwise_scale_inv (layouts of
// kernels/block_geometry.h). The other fields of `in` and `out` are not read.
// Returns cudaErrorInvalidValue for BlockScaling::kBlock1D or an unknown
// scaling, m < 0, n < 0, m * n overflowing, or a null buffer (data buffers may
// be null when m * n == 0, scale buffers when the 2-D scale matrix is empty);
// otherwise the launch error, if any.
cudaError_t ColumnwiseFromRowwise(BlockScaling scaling, const QuantizedConstBuffers& in, int64_t m,
                                  int64_t n, const QuantizedBuffers& out, cudaStream_t stream);

}  // namespace qtx::kernels::cuda

#endif  // QTX_KERNELS_CUDA_COLUMNWISE_COPY_H_
