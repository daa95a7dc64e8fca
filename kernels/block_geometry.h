// Block geometry and GEMM-ready layout shapes of docs/numerics.md §4.1.
// Pure functions of (scaling, M, N); usable from host and device code.
#ifndef QTX_KERNELS_BLOCK_GEOMETRY_H_
#define QTX_KERNELS_BLOCK_GEOMETRY_H_

#include <cstdint>

#include "kernels/host_device.h"
#include "kernels/quantize_params.h"

namespace qtx::kernels {

constexpr int64_t kBlockLen = 128;

QTX_HD constexpr int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }
QTX_HD constexpr int64_t Pad4(int64_t x) { return (x + 3) / 4 * 4; }

// Shapes (rows, cols) of the four buffers of a quantized [M, N] tensor.
struct QuantizedLayout {
  int64_t m = 0, n = 0;
  int64_t rowwise_data_rows = 0, rowwise_data_cols = 0;  // [M, N]
  int64_t rowwise_scale_rows = 0, rowwise_scale_cols = 0;
  int64_t columnwise_data_rows = 0, columnwise_data_cols = 0;  // [N, M]
  int64_t columnwise_scale_rows = 0, columnwise_scale_cols = 0;

  QTX_HD constexpr int64_t RowwiseDataBytes() const {
    return rowwise_data_rows * rowwise_data_cols;
  }
  QTX_HD constexpr int64_t RowwiseScaleCount() const {
    return rowwise_scale_rows * rowwise_scale_cols;
  }
  QTX_HD constexpr int64_t ColumnwiseDataBytes() const {
    return columnwise_data_rows * columnwise_data_cols;
  }
  QTX_HD constexpr int64_t ColumnwiseScaleCount() const {
    return columnwise_scale_rows * columnwise_scale_cols;
  }
};

// REQUIRES: m >= 0, n >= 0, and m * n does not overflow (callers validate).
QTX_HD constexpr QuantizedLayout ComputeLayout(BlockScaling s, int64_t m, int64_t n) {
  QuantizedLayout l;
  l.m = m;
  l.n = n;
  l.rowwise_data_rows = m;
  l.rowwise_data_cols = n;
  l.columnwise_data_rows = n;
  l.columnwise_data_cols = m;
  const int64_t mb = CeilDiv(m, kBlockLen);
  const int64_t nb = CeilDiv(n, kBlockLen);
  if (s == BlockScaling::kTensor) {
    // One FP32 scale_inv per copy, also for an empty tensor.
    l.rowwise_scale_rows = l.rowwise_scale_cols = 1;
    l.columnwise_scale_rows = l.columnwise_scale_cols = 1;
  } else if (s == BlockScaling::kBlock1D) {
    l.rowwise_scale_rows = nb;
    l.rowwise_scale_cols = Pad4(m);
    l.columnwise_scale_rows = mb;
    l.columnwise_scale_cols = Pad4(n);
  } else {
    l.rowwise_scale_rows = mb;
    l.rowwise_scale_cols = Pad4(nb);
    l.columnwise_scale_rows = nb;
    l.columnwise_scale_cols = Pad4(mb);
  }
  return l;
}

}  // namespace qtx::kernels

#endif  // QTX_KERNELS_BLOCK_GEOMETRY_H_
