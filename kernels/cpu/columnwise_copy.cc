#include "kernels/cpu/columnwise_copy.h"

#include <algorithm>
#include <cstring>

#include "kernels/block_geometry.h"

namespace qtx::kernels::cpu {

bool ColumnwiseFromRowwise(BlockScaling scaling, const QuantizedConstBuffers& in, int64_t m,
                           int64_t n, const QuantizedBuffers& out) {
  if (scaling != BlockScaling::kBlock2D && scaling != BlockScaling::kTensor) return false;
  if (m < 0 || n < 0) return false;
  const QuantizedLayout l = ComputeLayout(scaling, m, n);
  if (l.ColumnwiseScaleCount() > 0 &&
      (in.rowwise_scale_inv == nullptr || out.columnwise_scale_inv == nullptr)) {
    return false;
  }
  if (m > 0 && n > 0 && (in.rowwise_data == nullptr || out.columnwise_data == nullptr)) {
    return false;
  }
  // Data: Qc[j, i] = Qr[i, j], in 64x64 tiles so that both sides stay in cache.
  constexpr int64_t kTile = 64;
#pragma omp parallel for collapse(2) schedule(static) if (m * n >= (int64_t{1} << 22))
  for (int64_t i0 = 0; i0 < m; i0 += kTile) {
    for (int64_t j0 = 0; j0 < n; j0 += kTile) {
      const int64_t i1 = std::min(m, i0 + kTile), j1 = std::min(n, j0 + kTile);
      for (int64_t j = j0; j < j1; ++j) {
        for (int64_t i = i0; i < i1; ++i)
          out.columnwise_data[j * m + i] = in.rowwise_data[i * n + j];
      }
    }
  }
  if (scaling == BlockScaling::kTensor) {
    out.columnwise_scale_inv[0] = in.rowwise_scale_inv[0];
    return true;
  }
  // Sr is [Mb, pad4(Nb)], Sc is [Nb, pad4(Mb)]: Sc[tj, ti] = Sr[ti, tj], padding 0.
  const int64_t mb = CeilDiv(m, kBlockLen), nb = CeilDiv(n, kBlockLen);
  for (int64_t tj = 0; tj < l.columnwise_scale_rows; ++tj) {
    for (int64_t ti = 0; ti < l.columnwise_scale_cols; ++ti) {
      out.columnwise_scale_inv[tj * l.columnwise_scale_cols + ti] =
          ti < mb && tj < nb ? in.rowwise_scale_inv[ti * l.rowwise_scale_cols + tj] : 0.0f;
    }
  }
  return true;
}

}  // namespace qtx::kernels::cpu
