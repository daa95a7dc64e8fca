// CPU reference of the columnwise copy made from a rowwise one
// (docs/numerics.md §4.5): the definition of correct for
// kernels/cuda/columnwise_copy.h.
//
// With one scale per 128x128 tile (BLOCK_2D) or per tensor (TENSOR), both
// copies of a quantized [m, n] tensor hold the same FP8 bytes, transposed, and
// the same scale values: Qc[j, i] = Qr[i, j]; for 2-D tiles Sc[tj, ti] =
// Sr[ti, tj] with Sc's padding columns (>= Mb) written as 0; for TENSOR the
// one scale_inv is copied. So a holder of the rowwise copy can make the
// columnwise one when a GEMM needs it, byte-identical to what Quantize and the
// Optimizer's Step write for the columnwise copy. BLOCK_1D has no such
// relation (its two copies are quantized from different blocks).
// Reentrant; no allocation.
#ifndef QTX_KERNELS_CPU_COLUMNWISE_COPY_H_
#define QTX_KERNELS_CPU_COLUMNWISE_COPY_H_

#include <cstdint>

#include "kernels/quantize_params.h"

namespace qtx::kernels::cpu {

// Writes out.columnwise_data [n, m] and out.columnwise_scale_inv (layout of
// kernels/block_geometry.h) from in.rowwise_data [m, n] and
// in.rowwise_scale_inv. Returns false (writing nothing) for
// BlockScaling::kBlock1D, m < 0 or n < 0, or a null buffer (data buffers may
// be null when m * n == 0, scale buffers when the 2-D scale matrix is empty).
bool ColumnwiseFromRowwise(BlockScaling scaling, const QuantizedConstBuffers& in, int64_t m,
                           int64_t n, const QuantizedBuffers& out);

}  // namespace qtx::kernels::cpu

#endif  // QTX_KERNELS_CPU_COLUMNWISE_COPY_H_
