#include "kernels/cpu/quantize_range.h"

#include <algorithm>
#include <vector>

#include "kernels/block_geometry.h"
#include "kernels/fp8.h"

namespace qtx::kernels::cpu {
namespace {

// The slice's part of row `row`: columns [c_lo, c_hi), and the index in the
// slice of column c_lo.
struct RowPart {
  int64_t c_lo = 0, c_hi = 0, k0 = 0;
};

RowPart PartOfRow(int64_t row, int64_t n, const ElementRange& r) {
  RowPart p;
  const int64_t row_begin = row * n;
  p.c_lo = std::max<int64_t>(r.begin - row_begin, 0);
  p.c_hi = std::min<int64_t>(r.end - row_begin, n);
  p.k0 = row_begin + p.c_lo - r.begin;
  return p;
}

}  // namespace

int64_t TileCount(int64_t m, int64_t n) { return CeilDiv(m, kBlockLen) * CeilDiv(n, kBlockLen); }

void RangeTileAmax(const float* x, int64_t m, int64_t n, const ElementRange& r, float* tile_amax) {
  if (r.empty() || n == 0 || m == 0) return;
  const int64_t nb = CeilDiv(n, kBlockLen);
  const int64_t first_row = r.begin / n, last_row = (r.end - 1) / n;
  const int64_t first_band = first_row / kBlockLen, last_band = last_row / kBlockLen;
  // One 128-row band per iteration: each writes only its own tile row.
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t band = first_band; band <= last_band; ++band) {
    std::vector<uint32_t> amax(static_cast<size_t>(nb), 0u);
    std::vector<bool> touched(static_cast<size_t>(nb), false);
    const int64_t row0 = std::max(band * kBlockLen, first_row);
    const int64_t row1 = std::min((band + 1) * kBlockLen - 1, last_row);
    for (int64_t row = row0; row <= row1; ++row) {
      const RowPart p = PartOfRow(row, n, r);
      for (int64_t c = p.c_lo; c < p.c_hi;) {
        const int64_t tj = c / kBlockLen;
        const int64_t c_end = std::min((tj + 1) * kBlockLen, p.c_hi);
        const float* xs = x + p.k0 + (c - p.c_lo);
        uint32_t a = amax[tj];
        for (int64_t j = 0; j < c_end - c; ++j) a = AmaxBitsUpdate(a, xs[j]);
        amax[tj] = a;
        touched[tj] = true;
        c = c_end;
      }
    }
    for (int64_t tj = 0; tj < nb; ++tj) {
      if (!touched[tj]) continue;
      float& t = tile_amax[band * nb + tj];
      t = std::max(t, BitsToFloat(amax[tj]));
    }
  }
}

void QuantizeRange2D(const float* x, int64_t m, int64_t n, const ElementRange& r,
                     const float* tile_amax, const QuantizeParams& params, uint8_t* data,
                     float* rowwise_scale_inv, float* columnwise_scale_inv) {
  const int64_t mb = CeilDiv(m, kBlockLen), nb = CeilDiv(n, kBlockLen);
  const float fp8_max = Fp8Max(params.format);
  const float value_for_inf = InputDTypeMax(InputDType::kFloat32);
  std::vector<float> scale(static_cast<size_t>(mb * nb));
  for (int64_t t = 0; t < mb * nb; ++t) {
    scale[t] = ComputeScale(tile_amax[t], fp8_max, params.force_pow2_scales, params.amax_epsilon,
                            value_for_inf);
  }
  if (rowwise_scale_inv != nullptr) {
    const int64_t ld = Pad4(nb);
    for (int64_t ti = 0; ti < mb; ++ti) {
      for (int64_t tj = 0; tj < ld; ++tj) {
        rowwise_scale_inv[ti * ld + tj] = tj < nb ? ScaleInv(scale[ti * nb + tj]) : 0.0f;
      }
    }
  }
  if (columnwise_scale_inv != nullptr) {
    const int64_t ld = Pad4(mb);
    for (int64_t tj = 0; tj < nb; ++tj) {
      for (int64_t ti = 0; ti < ld; ++ti) {
        columnwise_scale_inv[tj * ld + ti] = ti < mb ? ScaleInv(scale[ti * nb + tj]) : 0.0f;
      }
    }
  }
  if (data == nullptr || r.empty() || n == 0 || m == 0) return;
  const int64_t first_row = r.begin / n, last_row = (r.end - 1) / n;
  const Fp8Format f = params.format;
#pragma omp parallel for schedule(static)
  for (int64_t row = first_row; row <= last_row; ++row) {
    const RowPart p = PartOfRow(row, n, r);
    const float* s = scale.data() + (row / kBlockLen) * nb;
    for (int64_t c = p.c_lo; c < p.c_hi; ++c) {
      const int64_t k = p.k0 + (c - p.c_lo);
      data[k] = EncodeFp8(x[k] * s[c / kBlockLen], f);
    }
  }
}

}  // namespace qtx::kernels::cpu
