// Internal to kernels/cpu: the quantize workers that QuantizeBlock
// (quantize_block.cc) and the all-gather's QuantizeShard (quantize_shard.cc)
// share. The workers are written for a shard of rows [row_offset,
// row_offset + m) of a global tensor (the whole tensor is the shard with
// row_offset 0): block rows follow the global 128-row grid, and the amaxes of
// the two boundary block rows may be supplied from outside (the all-gather's
// combined amaxes). Not a public API.
#ifndef QTX_KERNELS_CPU_QUANTIZE_WORKERS_H_
#define QTX_KERNELS_CPU_QUANTIZE_WORKERS_H_

#include <algorithm>
#include <cstdint>

#include "kernels/block_geometry.h"
#include "kernels/fp8.h"
#include "kernels/quantize_params.h"
#include "kernels/shard_geometry.h"

namespace qtx::kernels::cpu::internal {

// Local rows [lo, hi) of global block row k of shard g.
struct RowRange {
  int64_t lo, hi;
};
inline RowRange LocalRows(const ShardGeometry& g, int64_t k) {
  const int64_t lo = std::max(k * kBlockLen, g.row_offset) - g.row_offset;
  const int64_t hi = std::min(k * kBlockLen + kBlockLen, g.row_offset + g.m) - g.row_offset;
  return {lo, hi};
}

// Externally supplied amax vector for block row k, or null when k is interior.
struct BoundaryAmax {
  const float* first = nullptr;
  const float* last = nullptr;
  const float* For(const ShardGeometry& g, int64_t k) const {
    if (k == g.first_block() && first != nullptr) return first;
    if (k == g.last_block() && last != nullptr) return last;
    return nullptr;
  }
};

// Where the workers write. Scale (k, j) of a 2-D copy goes to
// scale[(k - first_block) * k_stride + j * j_stride].
struct Outputs {
  uint8_t* row_data = nullptr;  // [m, n]
  float* row_scale = nullptr;
  int64_t row_scale_ld = 0;                    // 1-D: scale (b, i) at b * ld + i
  int64_t row_k_stride = 0, row_j_stride = 0;  // 2-D
  uint8_t* col_data = nullptr;                 // col_data[col * col_data_ld + i]
  int64_t col_data_ld = 0;
  float* col_scale = nullptr;
  int64_t col_scale_ld = 0;                    // 1-D: scale (k, col) at (k - first) * ld + col
  int64_t col_k_stride = 0, col_j_stride = 0;  // 2-D
};

// Runs the workers of params (1-D rowwise / columnwise, 2-D tiles) over shard
// `g` of `in`, writing through `o`; nothing for an empty shard.
void QuantizeWorkers(const void* in, InputDType dtype, const ShardGeometry& g,
                     const QuantizeParams& p, const BoundaryAmax& ext, const Outputs& o);

// Zeroes the scale buffers of the requested copies of layout `l` (padding is 0).
void ZeroScales(const QuantizeParams& p, const QuantizedLayout& l, const QuantizedBuffers& out);

}  // namespace qtx::kernels::cpu::internal

#endif  // QTX_KERNELS_CPU_QUANTIZE_WORKERS_H_
