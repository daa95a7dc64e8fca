// CPU reference implementation of block-scaled FP8 quantization
// (docs/numerics.md §2-§4): the definition of correct for every other backend.
// Functions are reentrant; OpenMP parallelism is internal.
#ifndef QTX_KERNELS_CPU_QUANTIZE_BLOCK_H_
#define QTX_KERNELS_CPU_QUANTIZE_BLOCK_H_

#include <cstdint>

#include "kernels/block_geometry.h"
#include "kernels/quantize_params.h"
#include "kernels/shard_geometry.h"

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

// ---- Exact all-gather building blocks (docs/numerics.md §5) -------------------
// A rank quantizing its shard of rows [g.row_offset, g.row_offset + g.m) of a
// global tensor produces bytes and scales identical to quantizing the whole
// tensor, provided the amaxes of its two boundary block rows are the global
// ones. Protocol: ShardBoundaryAmax on every rank -> exchange -> each rank
// CombineBoundaryAmax -> QuantizeShard -> gather -> AssembleShards.

// Partial amaxes of this shard's rows in block rows g.first_block() (`first`)
// and g.last_block() (`last`); each of BoundaryAmaxLength(scaling, g) floats
// (per column for 1-D, per tile column for 2-D). Equal when the shard touches
// one block row. Writes nothing when g.m == 0.
void ShardBoundaryAmax(const void* input, InputDType dtype, const ShardGeometry& g,
                       BlockScaling scaling, float* first, float* last);

// The amaxes rank `rank` must use for its first and last block rows: the max
// over every rank whose first or last block row is the same block row.
// `geoms[r]`, `firsts[r]`, `lasts[r]` are rank r's geometry and partial
// vectors (as from ShardBoundaryAmax; ignored for ranks with m == 0).
void CombineBoundaryAmax(int world_size, const ShardGeometry* geoms, const float* const* firsts,
                         const float* const* lasts, int rank, BlockScaling scaling,
                         float* first_out, float* last_out);

// Buffers of one shard in the shard layout of kernels/shard_geometry.h.
using ShardBuffers = QuantizedBuffers;
using ShardConstBuffers = QuantizedConstBuffers;

// Quantizes the shard using `first_amax` / `last_amax` (full, combined
// amaxes) for its boundary block rows; interior blocks use local amaxes.
// 1-D rowwise blocks never straddle and ignore them.
// REQUIRES: buffers sized per the shard layout; amax vectors of
// BoundaryAmaxLength(scaling, g) floats when columnwise or 2-D.
void QuantizeShard(const void* input, InputDType dtype, const ShardGeometry& g,
                   const QuantizeParams& params, const float* first_amax, const float* last_amax,
                   const ShardBuffers& out);

// Writes the GEMM-ready [M, N] tensor (M = sum of shard rows, shards in rank
// order, contiguous) from every rank's shard buffers; padding zeroed. Straddling
// blocks appear in several shards with identical values and are written once.
void AssembleShards(int world_size, const ShardGeometry* geoms, const ShardConstBuffers* shards,
                    const QuantizeParams& params, const QuantizedBuffers& out);

}  // namespace qtx::kernels::cpu

#endif  // QTX_KERNELS_CPU_QUANTIZE_BLOCK_H_
