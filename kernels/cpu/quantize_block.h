// CPU reference implementation of block-scaled FP8 quantization
// (docs/numerics.md §2-§4): the definition of correct for every other backend.
// The exact all-gather's shard steps (§5) are in quantize_shard.h.
// Functions are reentrant; OpenMP parallelism is internal.
#ifndef QTX_KERNELS_CPU_QUANTIZE_BLOCK_H_
#define QTX_KERNELS_CPU_QUANTIZE_BLOCK_H_

#include <cstdint>

#include "kernels/block_geometry.h"
#include "kernels/quantize_params.h"

namespace qtx::kernels::cpu {

// Quantizes the row-major [m, n] tensor `input` of element type `dtype`.
// Writes the requested copies (params.rowwise / params.columnwise) into `out`
// in the GEMM-ready layouts of ComputeLayout(params.scaling, m, n); scale
// padding entries are written as 0. m == 0 or n == 0 writes only padding.
// BlockScaling::kTensor goes to QuantizeTensor (kernels/cpu/quantize_tensor.h).
// REQUIRES: m, n >= 0; buffers of the requested copies non-null and sized per
// ComputeLayout; params.amax_epsilon finite and >= 0.
void QuantizeBlock(const void* input, InputDType dtype, int64_t m, int64_t n,
                   const QuantizeParams& params, const QuantizedBuffers& out);

// Dequantizes [m, n]: x = decode(q) * scale_inv in FP32, then narrowed to
// `out_dtype` (round to nearest even). Reads the rowwise copy when
// `use_rowwise`, else the columnwise copy (transposed back to [m, n]).
// REQUIRES: the chosen copy's buffers non-null and sized per ComputeLayout.
// BlockScaling::kTensor goes to DequantizeTensor.
void DequantizeBlock(const QuantizedConstBuffers& in, BlockScaling scaling, Fp8Format format,
                     int64_t m, int64_t n, bool use_rowwise, InputDType out_dtype, void* out);

}  // namespace qtx::kernels::cpu

#endif  // QTX_KERNELS_CPU_QUANTIZE_BLOCK_H_
