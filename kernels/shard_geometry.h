// Geometry of one rank's row shard of a global [M, N] tensor, for the exact
// all-gather of docs/numerics.md §5. Pure functions; host and device.
//
// A rank holds global rows [row_offset, row_offset + m). Column blocks (1-D,
// 128x1) and tile rows (2-D, 128x128) lie on the *global* 128-row grid, so the
// shard touches block rows [first_block, last_block]; only those two can be
// shared with other ranks ("straddling"), and only they need amaxes from peers.
// Per-tensor scaling (TENSOR) has one block, the whole tensor, which every
// rank shares: its amax is the max of every rank's shard amax.
#ifndef QTX_KERNELS_SHARD_GEOMETRY_H_
#define QTX_KERNELS_SHARD_GEOMETRY_H_

#include <cstdint>

#include "kernels/block_geometry.h"
#include "kernels/host_device.h"
#include "kernels/quantize_params.h"

namespace qtx::kernels {

struct ShardGeometry {
  int64_t row_offset = 0;  // global row of local row 0
  int64_t m = 0;           // local rows (may be 0)
  int64_t n = 0;           // columns (same on every rank)

  // Block rows touched, or first_block = 0, num_block_rows() = 0 when m == 0.
  QTX_HD constexpr int64_t first_block() const { return m == 0 ? 0 : row_offset / kBlockLen; }
  QTX_HD constexpr int64_t last_block() const {
    return m == 0 ? -1 : (row_offset + m - 1) / kBlockLen;
  }
  QTX_HD constexpr int64_t num_block_rows() const { return last_block() - first_block() + 1; }
  QTX_HD constexpr int64_t nb() const { return CeilDiv(n, kBlockLen); }
};

// Shapes of the per-rank "shard layout" buffers (what each rank contributes to
// the gather; AssembleShards turns the concatenation into the GEMM-ready layout):
//   rowwise_data          [m, n]
//   rowwise_scale_inv     1-D: [nb, m]                 2-D: [num_block_rows, nb]
//   columnwise_data       [n, m]
//   columnwise_scale_inv  1-D: [num_block_rows, n]     2-D: [num_block_rows, nb]
// (2-D stores the tile scales once per copy, in tile-row-major order.)
// TENSOR (per-tensor current scaling): the whole gathered tensor is one block,
// shared by every rank: each scale_inv is [1] (the shard is quantized with the
// amax combined over all ranks, so every non-empty shard holds the same one).
QTX_HD constexpr int64_t ShardRowwiseScaleCount(BlockScaling s, const ShardGeometry& g) {
  if (s == BlockScaling::kTensor) return 1;
  return s == BlockScaling::kBlock1D ? g.nb() * g.m : g.num_block_rows() * g.nb();
}
QTX_HD constexpr int64_t ShardColumnwiseScaleCount(BlockScaling s, const ShardGeometry& g) {
  if (s == BlockScaling::kTensor) return 1;
  return s == BlockScaling::kBlock1D ? g.num_block_rows() * g.n : g.num_block_rows() * g.nb();
}
// Length of each boundary amax vector: per column (1-D), per tile column
// (2-D), or one float, the amax of the whole shard (TENSOR; first == last).
QTX_HD constexpr int64_t BoundaryAmaxLength(BlockScaling s, const ShardGeometry& g) {
  if (s == BlockScaling::kTensor) return 1;
  return s == BlockScaling::kBlock1D ? g.n : g.nb();
}

}  // namespace qtx::kernels

#endif  // QTX_KERNELS_SHARD_GEOMETRY_H_
