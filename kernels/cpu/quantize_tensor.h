// CPU reference of per-tensor current scaling (BlockScaling::kTensor,
// docs/numerics.md "Per-tensor current scaling"): the definition of correct
// for the CUDA kernels of kernels/cuda/quantize_tensor.h.
//
// The block is the whole [m, n] tensor: amax = max |x| over every element
// (NaN ignored), scale = TensorScale(amax, ...) (kernels/fp8.h), one FP32
// scale_inv = RN(1 / scale) per requested copy, q = fp8(RN(x * scale)).
// The columnwise copy [n, m] is the exact byte transpose of the rowwise one.
// An empty tensor (m == 0 or n == 0) has amax 0 and still gets its scale_inv.
// Functions are reentrant; OpenMP parallelism is internal.
#ifndef QTX_KERNELS_CPU_QUANTIZE_TENSOR_H_
#define QTX_KERNELS_CPU_QUANTIZE_TENSOR_H_

#include <cstdint>

#include "kernels/quantize_params.h"

namespace qtx::kernels::cpu {

// max |x| over the `count` elements of `input` (NaN ignored, 0 when empty).
float TensorAmax(const void* input, InputDType dtype, int64_t count);

// Quantizes the row-major [m, n] `input` with one scale for the whole tensor.
// Writes rowwise_data [m, n] and rowwise_scale_inv[0] when params.rowwise,
// columnwise_data [n, m] and columnwise_scale_inv[0] when params.columnwise.
// params.scaling is not read (the caller chose this mode).
// REQUIRES: m, n >= 0; buffers of the requested copies non-null (data may be
// null when m * n == 0); params.amax_epsilon finite and >= 0.
void QuantizeTensor(const void* input, InputDType dtype, int64_t m, int64_t n,
                    const QuantizeParams& params, const QuantizedBuffers& out);

// QuantizeTensor with the amax given instead of computed from `input`: the
// cast of a shard of a larger tensor whose amax was combined over every
// shard (kernels/cpu/quantize_shard.h, TENSOR). QuantizeTensor(...) is
// QuantizeTensorWithAmax(..., TensorAmax(input, dtype, m * n), ...).
// REQUIRES: as QuantizeTensor; amax >= 0 (or +Inf).
void QuantizeTensorWithAmax(const void* input, InputDType dtype, int64_t m, int64_t n, float amax,
                            const QuantizeParams& params, const QuantizedBuffers& out);

// x = decode(q) * scale_inv[0] in FP32, narrowed to `out_dtype`; reads the
// rowwise copy when `use_rowwise`, else the columnwise copy (transposed back).
// REQUIRES: the chosen copy's buffers non-null (data unless m * n == 0).
void DequantizeTensor(const QuantizedConstBuffers& in, Fp8Format format, int64_t m, int64_t n,
                      bool use_rowwise, InputDType out_dtype, void* out);

}  // namespace qtx::kernels::cpu

#endif  // QTX_KERNELS_CPU_QUANTIZE_TENSOR_H_
