// CPU reference of the exact all-gather's building blocks (docs/numerics.md
// §5), the definition of correct for kernels/cuda/quantize_shard.h.
// Functions are reentrant; OpenMP parallelism is internal.
#ifndef QTX_KERNELS_CPU_QUANTIZE_SHARD_H_
#define QTX_KERNELS_CPU_QUANTIZE_SHARD_H_

#include <cstdint>

#include "kernels/block_geometry.h"
#include "kernels/quantize_params.h"
#include "kernels/shard_geometry.h"

namespace qtx::kernels::cpu {

// A rank quantizing its shard of rows [g.row_offset, g.row_offset + g.m) of a
// global tensor produces bytes and scales identical to quantizing the whole
// tensor, provided the amaxes of its two boundary block rows are the global
// ones. Protocol: ShardBoundaryAmax on every rank -> exchange -> each rank
// CombineBoundaryAmax -> QuantizeShard -> gather -> AssembleShards.
// TENSOR (per-tensor current scaling) follows the same protocol with one
// block, the whole tensor: each "boundary amax" is one float, the amax of the
// whole shard, every non-empty rank combines all of them, and each shard is
// cast with the scale of that combined amax (kernels/shard_geometry.h).

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
// 1-D rowwise blocks never straddle and ignore them. TENSOR: first_amax[0] is
// the whole tensor's amax (null: the shard's own, as if it were the whole
// tensor); writes the [1] scale_inv of each requested copy, also for an empty
// shard.
// REQUIRES: buffers sized per the shard layout; amax vectors of
// BoundaryAmaxLength(scaling, g) floats when columnwise or 2-D.
void QuantizeShard(const void* input, InputDType dtype, const ShardGeometry& g,
                   const QuantizeParams& params, const float* first_amax, const float* last_amax,
                   const ShardBuffers& out);

// Writes the GEMM-ready [M, N] tensor (M = sum of shard rows, shards in rank
// order, contiguous) from every rank's shard buffers; padding zeroed. Straddling
// blocks appear in several shards with identical values and are written once.
// TENSOR: scale_inv[0] comes from the first shard with m > 0 and n > 0 (all
// non-empty shards hold the same one); with none, it is that of amax 0.
void AssembleShards(int world_size, const ShardGeometry* geoms, const ShardConstBuffers* shards,
                    const QuantizeParams& params, const QuantizedBuffers& out);

}  // namespace qtx::kernels::cpu

#endif  // QTX_KERNELS_CPU_QUANTIZE_SHARD_H_
