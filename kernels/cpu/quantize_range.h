// CPU reference of the data-parallel sharded parameter output
// (docs/numerics.md §10), the definition of correct for any other backend.
//
// An owner holds elements [r.begin, r.end) of the row-major FP32 [m, n]
// matrix (kernels/element_range.h). The BLOCK_2D (128x128) quantization of
// the whole matrix is reproduced, byte for byte, from the owners' slices:
//   1. each owner: RangeTileAmax over its slice -> partial tile amaxes;
//   2. the owners combine them with an element-wise max (any order: max is
//      exact and order-independent);
//   3. each owner: QuantizeRange2D with the combined amaxes -> the FP8 bytes
//      of its elements (those of QuantizeBlock(whole matrix) at indices
//      [begin, end) of the rowwise data) and every tile's scale_inv.
// Functions are reentrant; OpenMP parallelism is internal and does not
// change any result.
#ifndef QTX_KERNELS_CPU_QUANTIZE_RANGE_H_
#define QTX_KERNELS_CPU_QUANTIZE_RANGE_H_

#include <cstdint>

#include "kernels/element_range.h"
#include "kernels/quantize_params.h"

namespace qtx::kernels::cpu {

// Number of 128x128 tiles of [m, n]: ceil(m/128) * ceil(n/128).
int64_t TileCount(int64_t m, int64_t n);

// Raises tile_amax[ti * ceil(n/128) + tj] to the max |x| of the slice's
// elements in tile (ti, tj) (NaN ignored, as in QuantizeBlock); tiles the
// slice does not touch are left as they are. `x[k]` is element r.begin + k.
// Start from zeros: the partial amax of a slice; a max over every owner's
// partial vectors is the whole matrix's tile amaxes.
// REQUIRES: 0 <= r.begin <= r.end <= m * n; tile_amax holds TileCount(m, n).
void RangeTileAmax(const float* x, int64_t m, int64_t n, const ElementRange& r, float* tile_amax);

// Quantizes the slice with the combined tile amaxes `tile_amax` (as from
// step 2 above) in BLOCK_2D: data[k] is the FP8 byte of element r.begin + k
// in the rowwise copy; rowwise_scale_inv ([ceil(m/128), pad4(ceil(n/128))],
// padding 0) and, when non-null, columnwise_scale_inv ([ceil(n/128),
// pad4(ceil(m/128))], its transpose) get every tile's scale_inv. Any of the
// three may be null to skip it. params.scaling must be kBlock2D; the input
// is FP32 (the master weights), so the overflow scale is FLT_MAX.
// REQUIRES: as RangeTileAmax; params.amax_epsilon finite and >= 0.
void QuantizeRange2D(const float* x, int64_t m, int64_t n, const ElementRange& r,
                     const float* tile_amax, const QuantizeParams& params, uint8_t* data,
                     float* rowwise_scale_inv, float* columnwise_scale_inv);

}  // namespace qtx::kernels::cpu

#endif  // QTX_KERNELS_CPU_QUANTIZE_RANGE_H_
