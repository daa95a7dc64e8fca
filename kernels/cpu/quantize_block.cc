// CPU reference of docs/numerics.md §2-§4 (§5's shard steps are in
// quantize_shard.cc, over the same workers). Written to be read against the
// spec: every block's amax, scale, scale_inv and bytes are computed literally
// with the shared arithmetic of kernels/fp8.h. OpenMP splits independent blocks.
//
// The workers are written for a shard of rows [row_offset, row_offset + m) of
// a global tensor (the whole tensor is the shard with row_offset 0): block rows
// follow the global 128-row grid, and the amaxes of the two boundary block rows
// may be supplied from outside (the all-gather's combined amaxes).
#include "kernels/cpu/quantize_block.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "kernels/cpu/quantize_tensor.h"
#include "kernels/cpu/quantize_workers.h"
#include "kernels/fp8.h"

namespace qtx::kernels::cpu {
namespace {

using internal::BoundaryAmax;
using internal::LocalRows;
using internal::Outputs;
using internal::RowRange;

struct ScaleConfig {
  float fp8_max;
  bool pow2;
  float eps;
  float value_for_inf;
};

ScaleConfig MakeScaleConfig(const QuantizeParams& p, InputDType t) {
  return {Fp8Max(p.format), p.force_pow2_scales, p.amax_epsilon, InputDTypeMax(t)};
}

inline float BlockScale(float amax, const ScaleConfig& c) {
  return ComputeScale(amax, c.fp8_max, c.pow2, c.eps, c.value_for_inf);
}

// 1-D rowwise: block (i, b) covers local row i, columns [128b, min(128b+128, n)).
template <InputDType kT, Fp8Format kF>
void Rowwise1D(const void* in, const ShardGeometry& g, const ScaleConfig& c, const Outputs& o) {
  const int64_t n = g.n, nb = g.nb();
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < g.m; ++r) {
    float x[kBlockLen];
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t c0 = b * kBlockLen;
      const int64_t len = std::min(kBlockLen, n - c0);
      uint32_t amax = 0;
      for (int64_t k = 0; k < len; ++k) {
        x[k] = LoadAs<kT>(in, r * n + c0 + k);
        amax = AmaxBitsUpdate(amax, x[k]);
      }
      const float scale = BlockScale(BitsToFloat(amax), c);
      o.row_scale[b * o.row_scale_ld + r] = ScaleInv(scale);
      uint8_t* out = o.row_data + r * n + c0;
      for (int64_t k = 0; k < len; ++k) out[k] = EncodeFp8As<kF>(x[k] * scale);
    }
  }
}

// 1-D columnwise: block (k, col) covers column col, global rows [128k, 128k+128).
template <InputDType kT, Fp8Format kF>
void Columnwise1D(const void* in, const ShardGeometry& g, const BoundaryAmax& ext,
                  const ScaleConfig& c, const Outputs& o) {
  constexpr int64_t kColChunk = 64;
  const int64_t n = g.n;
  const int64_t k0 = g.first_block(), nk = g.num_block_rows();
  const int64_t nchunks = CeilDiv(n, kColChunk);
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t kk = 0; kk < nk; ++kk) {
    for (int64_t ch = 0; ch < nchunks; ++ch) {
      const int64_t k = k0 + kk;
      const RowRange rr = LocalRows(g, k);
      const int64_t col0 = ch * kColChunk;
      const int64_t cols = std::min(kColChunk, n - col0);
      float x[kBlockLen][kColChunk];
      uint32_t amax[kColChunk] = {};
      for (int64_t i = rr.lo; i < rr.hi; ++i) {
        for (int64_t j = 0; j < cols; ++j) {
          x[i - rr.lo][j] = LoadAs<kT>(in, i * n + col0 + j);
          amax[j] = AmaxBitsUpdate(amax[j], x[i - rr.lo][j]);
        }
      }
      if (const float* e = ext.For(g, k)) {
        for (int64_t j = 0; j < cols; ++j) amax[j] = FloatBits(e[col0 + j]);
      }
      for (int64_t j = 0; j < cols; ++j) {
        const float scale = BlockScale(BitsToFloat(amax[j]), c);
        o.col_scale[kk * o.col_scale_ld + col0 + j] = ScaleInv(scale);
        uint8_t* out = o.col_data + (col0 + j) * o.col_data_ld;
        for (int64_t i = rr.lo; i < rr.hi; ++i) {
          out[i] = EncodeFp8As<kF>(x[i - rr.lo][j] * scale);
        }
      }
    }
  }
}

// 2-D: tile (k, tj) covers global rows [128k, 128k+128), columns [128tj, ...).
// The tile is staged (FP32 in, FP8 out) so the transposed copy is written in
// contiguous runs.
template <InputDType kT, Fp8Format kF>
void Tiles2D(const void* in, const ShardGeometry& g, const BoundaryAmax& ext, const ScaleConfig& c,
             const Outputs& o) {
  const int64_t n = g.n, nb = g.nb();
  const int64_t k0 = g.first_block(), nk = g.num_block_rows();
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t kk = 0; kk < nk; ++kk) {
    for (int64_t tj = 0; tj < nb; ++tj) {
      const int64_t k = k0 + kk;
      const RowRange rr = LocalRows(g, k);
      const int64_t rows = rr.hi - rr.lo;
      const int64_t c0 = tj * kBlockLen;
      const int64_t cols = std::min(kBlockLen, n - c0);
      static thread_local float x[kBlockLen][kBlockLen];
      static thread_local uint8_t q[kBlockLen][kBlockLen];
      uint32_t amax = 0;
      for (int64_t i = 0; i < rows; ++i) {
        for (int64_t j = 0; j < cols; ++j) {
          x[i][j] = LoadAs<kT>(in, (rr.lo + i) * n + c0 + j);
          amax = AmaxBitsUpdate(amax, x[i][j]);
        }
      }
      if (const float* e = ext.For(g, k)) amax = FloatBits(e[tj]);
      const float scale = BlockScale(BitsToFloat(amax), c);
      const float scale_inv = ScaleInv(scale);
      if (o.row_data) o.row_scale[kk * o.row_k_stride + tj * o.row_j_stride] = scale_inv;
      if (o.col_data) o.col_scale[kk * o.col_k_stride + tj * o.col_j_stride] = scale_inv;
      for (int64_t i = 0; i < rows; ++i) {
        for (int64_t j = 0; j < cols; ++j) q[i][j] = EncodeFp8As<kF>(x[i][j] * scale);
      }
      if (o.row_data) {
        for (int64_t i = 0; i < rows; ++i)
          std::memcpy(o.row_data + (rr.lo + i) * n + c0, q[i], cols);
      }
      if (o.col_data) {
        for (int64_t j = 0; j < cols; ++j) {
          uint8_t* out = o.col_data + (c0 + j) * o.col_data_ld + rr.lo;
          for (int64_t i = 0; i < rows; ++i) out[i] = q[i][j];
        }
      }
    }
  }
}

template <InputDType kT, Fp8Format kF>
void RunWorkersFor(const void* in, const ShardGeometry& g, const QuantizeParams& p,
                   const BoundaryAmax& ext, const Outputs& o) {
  const ScaleConfig c = MakeScaleConfig(p, kT);
  if (p.scaling == BlockScaling::kBlock1D) {
    if (p.rowwise) Rowwise1D<kT, kF>(in, g, c, o);
    if (p.columnwise) Columnwise1D<kT, kF>(in, g, ext, c, o);
  } else {
    Tiles2D<kT, kF>(in, g, ext, c, o);
  }
}

template <InputDType kT>
void RunWorkers(const void* in, const ShardGeometry& g, const QuantizeParams& p,
                const BoundaryAmax& ext, const Outputs& o) {
  if (p.format == Fp8Format::kE4M3) {
    RunWorkersFor<kT, Fp8Format::kE4M3>(in, g, p, ext, o);
  } else {
    RunWorkersFor<kT, Fp8Format::kE5M2>(in, g, p, ext, o);
  }
}

}  // namespace

namespace internal {

void QuantizeWorkers(const void* in, InputDType dtype, const ShardGeometry& g,
                     const QuantizeParams& p, const BoundaryAmax& ext, const Outputs& o) {
  if (g.m == 0 || g.n == 0) return;
  switch (dtype) {
    case InputDType::kFloat32:
      return RunWorkers<InputDType::kFloat32>(in, g, p, ext, o);
    case InputDType::kBFloat16:
      return RunWorkers<InputDType::kBFloat16>(in, g, p, ext, o);
    case InputDType::kFloat16:
      return RunWorkers<InputDType::kFloat16>(in, g, p, ext, o);
  }
}

void ZeroScales(const QuantizeParams& p, const QuantizedLayout& l, const QuantizedBuffers& out) {
  if (p.rowwise && l.RowwiseScaleCount() > 0) {
    std::memset(out.rowwise_scale_inv, 0, sizeof(float) * l.RowwiseScaleCount());
  }
  if (p.columnwise && l.ColumnwiseScaleCount() > 0) {
    std::memset(out.columnwise_scale_inv, 0, sizeof(float) * l.ColumnwiseScaleCount());
  }
}

}  // namespace internal

void QuantizeBlock(const void* input, InputDType dtype, int64_t m, int64_t n,
                   const QuantizeParams& params, const QuantizedBuffers& out) {
  if (params.scaling == BlockScaling::kTensor) {
    return QuantizeTensor(input, dtype, m, n, params, out);
  }
  const QuantizedLayout l = ComputeLayout(params.scaling, m, n);
  internal::ZeroScales(params, l, out);  // padding is 0 (TE leaves it uninitialized)
  Outputs o;
  if (params.rowwise) {
    o.row_data = out.rowwise_data;
    o.row_scale = out.rowwise_scale_inv;
    o.row_scale_ld = l.rowwise_scale_cols;
    o.row_k_stride = l.rowwise_scale_cols;
    o.row_j_stride = 1;
  }
  if (params.columnwise) {
    o.col_data = out.columnwise_data;
    o.col_data_ld = m;
    o.col_scale = out.columnwise_scale_inv;
    o.col_scale_ld = l.columnwise_scale_cols;
    o.col_k_stride = 1;
    o.col_j_stride = l.columnwise_scale_cols;
  }
  internal::QuantizeWorkers(input, dtype, ShardGeometry{0, m, n}, params, BoundaryAmax{}, o);
}

void DequantizeBlock(const QuantizedConstBuffers& in, BlockScaling scaling, Fp8Format format,
                     int64_t m, int64_t n, bool use_rowwise, InputDType out_dtype, void* out) {
  if (scaling == BlockScaling::kTensor) {
    return DequantizeTensor(in, format, m, n, use_rowwise, out_dtype, out);
  }
  if (m == 0 || n == 0) return;
  const QuantizedLayout l = ComputeLayout(scaling, m, n);
  const bool one_d = scaling == BlockScaling::kBlock1D;
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t col = 0; col < n; ++col) {
      uint8_t q;
      float scale_inv;
      if (use_rowwise) {
        q = in.rowwise_data[r * n + col];
        scale_inv =
            one_d ? in.rowwise_scale_inv[(col / kBlockLen) * l.rowwise_scale_cols + r]
                  : in.rowwise_scale_inv[(r / kBlockLen) * l.rowwise_scale_cols + col / kBlockLen];
      } else {
        q = in.columnwise_data[col * m + r];
        scale_inv = one_d ? in.columnwise_scale_inv[(r / kBlockLen) * l.columnwise_scale_cols + col]
                          : in.columnwise_scale_inv[(col / kBlockLen) * l.columnwise_scale_cols +
                                                    r / kBlockLen];
      }
      StoreFromFloat(out, out_dtype, r * n + col, DecodeFp8(q, format) * scale_inv);
    }
  }
}

}  // namespace qtx::kernels::cpu
