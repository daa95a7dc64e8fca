// CPU reference of docs/numerics.md §2-§5. Written to be read against the
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
#include "kernels/fp8.h"

namespace qtx::kernels::cpu {
namespace {

template <InputDType kT>
inline float Load(const void* data, int64_t i) {
  if constexpr (kT == InputDType::kFloat32) {
    return static_cast<const float*>(data)[i];
  } else if constexpr (kT == InputDType::kBFloat16) {
    return Bf16ToFloat(static_cast<const uint16_t*>(data)[i]);
  } else {
    return HalfToFloat(static_cast<const uint16_t*>(data)[i]);
  }
}

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
  int64_t row_scale_ld = 0;  // 1-D: scale (b, i) at b * ld + i
  int64_t row_k_stride = 0, row_j_stride = 0;  // 2-D
  uint8_t* col_data = nullptr;  // col_data[col * col_data_ld + i]
  int64_t col_data_ld = 0;
  float* col_scale = nullptr;
  int64_t col_scale_ld = 0;  // 1-D: scale (k, col) at (k - first) * ld + col
  int64_t col_k_stride = 0, col_j_stride = 0;  // 2-D
};

// 1-D rowwise: block (i, b) covers local row i, columns [128b, min(128b+128, n)).
template <Fp8Format kF>
inline uint8_t Encode(float v) {
  if constexpr (kF == Fp8Format::kE4M3) {
    return EncodeE4M3(v);
  } else {
    return EncodeE5M2(v);
  }
}

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
        x[k] = Load<kT>(in, r * n + c0 + k);
        amax = AmaxBitsUpdate(amax, x[k]);
      }
      const float scale = BlockScale(BitsToFloat(amax), c);
      o.row_scale[b * o.row_scale_ld + r] = ScaleInv(scale);
      uint8_t* out = o.row_data + r * n + c0;
      for (int64_t k = 0; k < len; ++k) out[k] = Encode<kF>(x[k] * scale);
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
          x[i - rr.lo][j] = Load<kT>(in, i * n + col0 + j);
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
          out[i] = Encode<kF>(x[i - rr.lo][j] * scale);
        }
      }
    }
  }
}

// 2-D: tile (k, tj) covers global rows [128k, 128k+128), columns [128tj, ...).
// The tile is staged (FP32 in, FP8 out) so the transposed copy is written in
// contiguous runs.
template <InputDType kT, Fp8Format kF>
void Tiles2D(const void* in, const ShardGeometry& g, const BoundaryAmax& ext,
             const ScaleConfig& c, const Outputs& o) {
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
          x[i][j] = Load<kT>(in, (rr.lo + i) * n + c0 + j);
          amax = AmaxBitsUpdate(amax, x[i][j]);
        }
      }
      if (const float* e = ext.For(g, k)) amax = FloatBits(e[tj]);
      const float scale = BlockScale(BitsToFloat(amax), c);
      const float scale_inv = ScaleInv(scale);
      if (o.row_data) o.row_scale[kk * o.row_k_stride + tj * o.row_j_stride] = scale_inv;
      if (o.col_data) o.col_scale[kk * o.col_k_stride + tj * o.col_j_stride] = scale_inv;
      for (int64_t i = 0; i < rows; ++i) {
        for (int64_t j = 0; j < cols; ++j) q[i][j] = Encode<kF>(x[i][j] * scale);
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

void Dispatch(const void* in, InputDType dtype, const ShardGeometry& g, const QuantizeParams& p,
              const BoundaryAmax& ext, const Outputs& o) {
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

template <InputDType kT>
void BoundaryAmaxTyped(const void* in, const ShardGeometry& g, BlockScaling s, float* first,
                       float* last) {
  const int64_t len = BoundaryAmaxLength(s, g);
  for (int which = 0; which < 2; ++which) {
    const int64_t k = which == 0 ? g.first_block() : g.last_block();
    float* out = which == 0 ? first : last;
    const RowRange rr = LocalRows(g, k);
    std::fill(out, out + len, 0.0f);
    for (int64_t i = rr.lo; i < rr.hi; ++i) {
      for (int64_t col = 0; col < g.n; ++col) {
        const int64_t idx = s == BlockScaling::kBlock1D ? col : col / kBlockLen;
        out[idx] = AmaxUpdate(out[idx], Load<kT>(in, i * g.n + col));
      }
    }
  }
}

inline void StoreAs(void* out, InputDType t, int64_t i, float v) {
  switch (t) {
    case InputDType::kFloat32:
      static_cast<float*>(out)[i] = v;
      break;
    case InputDType::kBFloat16:
      static_cast<uint16_t*>(out)[i] = FloatToBf16(v);
      break;
    case InputDType::kFloat16:
      static_cast<uint16_t*>(out)[i] = FloatToHalf(v);
      break;
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

}  // namespace

void QuantizeBlock(const void* input, InputDType dtype, int64_t m, int64_t n,
                   const QuantizeParams& params, const QuantizedBuffers& out) {
  if (params.scaling == BlockScaling::kTensor) {
    return QuantizeTensor(input, dtype, m, n, params, out);
  }
  const QuantizedLayout l = ComputeLayout(params.scaling, m, n);
  ZeroScales(params, l, out);  // padding is 0 (TE leaves it uninitialized)
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
  Dispatch(input, dtype, ShardGeometry{0, m, n}, params, BoundaryAmax{}, o);
}

void ShardBoundaryAmax(const void* input, InputDType dtype, const ShardGeometry& g,
                       BlockScaling scaling, float* first, float* last) {
  if (g.m == 0) return;
  switch (dtype) {
    case InputDType::kFloat32:
      return BoundaryAmaxTyped<InputDType::kFloat32>(input, g, scaling, first, last);
    case InputDType::kBFloat16:
      return BoundaryAmaxTyped<InputDType::kBFloat16>(input, g, scaling, first, last);
    case InputDType::kFloat16:
      return BoundaryAmaxTyped<InputDType::kFloat16>(input, g, scaling, first, last);
  }
}

void CombineBoundaryAmax(int world_size, const ShardGeometry* geoms, const float* const* firsts,
                         const float* const* lasts, int rank, BlockScaling scaling,
                         float* first_out, float* last_out) {
  const ShardGeometry& me = geoms[rank];
  if (me.m == 0) return;
  const int64_t len = BoundaryAmaxLength(scaling, me);
  for (int which = 0; which < 2; ++which) {
    const int64_t k = which == 0 ? me.first_block() : me.last_block();
    float* out = which == 0 ? first_out : last_out;
    std::fill(out, out + len, 0.0f);
    for (int r = 0; r < world_size; ++r) {
      if (geoms[r].m == 0) continue;
      const float* v = nullptr;
      if (geoms[r].first_block() == k) v = firsts[r];
      else if (geoms[r].last_block() == k) v = lasts[r];
      if (v == nullptr) continue;
      for (int64_t j = 0; j < len; ++j) out[j] = std::max(out[j], v[j]);
    }
  }
}

void QuantizeShard(const void* input, InputDType dtype, const ShardGeometry& g,
                   const QuantizeParams& params, const float* first_amax, const float* last_amax,
                   const ShardBuffers& out) {
  Outputs o;
  const int64_t nb = g.nb();
  if (params.rowwise) {
    o.row_data = out.rowwise_data;
    o.row_scale = out.rowwise_scale_inv;
    o.row_scale_ld = g.m;  // 1-D [nb, m]
    o.row_k_stride = nb;   // 2-D [num_block_rows, nb]
    o.row_j_stride = 1;
  }
  if (params.columnwise) {
    o.col_data = out.columnwise_data;
    o.col_data_ld = g.m;
    o.col_scale = out.columnwise_scale_inv;
    o.col_scale_ld = g.n;  // 1-D [num_block_rows, n]
    o.col_k_stride = nb;   // 2-D [num_block_rows, nb]
    o.col_j_stride = 1;
  }
  Dispatch(input, dtype, g, params, BoundaryAmax{first_amax, last_amax}, o);
}

void AssembleShards(int world_size, const ShardGeometry* geoms, const ShardConstBuffers* shards,
                    const QuantizeParams& p, const QuantizedBuffers& out) {
  int64_t m = 0;
  for (int r = 0; r < world_size; ++r) m += geoms[r].m;
  const int64_t n = world_size > 0 ? geoms[0].n : 0;
  const int64_t nb = CeilDiv(n, kBlockLen);
  const QuantizedLayout l = ComputeLayout(p.scaling, m, n);
  ZeroScales(p, l, out);
  for (int r = 0; r < world_size; ++r) {
    const ShardGeometry& g = geoms[r];
    const ShardConstBuffers& s = shards[r];
    if (g.m == 0 || n == 0) continue;
    const int64_t o = g.row_offset, k0 = g.first_block(), nk = g.num_block_rows();
    if (p.rowwise) {
      if (out.rowwise_data + o * n != s.rowwise_data) {
        std::memmove(out.rowwise_data + o * n, s.rowwise_data, g.m * n);
      }
      if (p.scaling == BlockScaling::kBlock1D) {
        for (int64_t b = 0; b < nb; ++b) {
          std::memcpy(out.rowwise_scale_inv + b * l.rowwise_scale_cols + o,
                      s.rowwise_scale_inv + b * g.m, sizeof(float) * g.m);
        }
      } else {
        for (int64_t kk = 0; kk < nk; ++kk) {
          std::memcpy(out.rowwise_scale_inv + (k0 + kk) * l.rowwise_scale_cols,
                      s.rowwise_scale_inv + kk * nb, sizeof(float) * nb);
        }
      }
    }
    if (p.columnwise) {
      for (int64_t col = 0; col < n; ++col) {
        std::memcpy(out.columnwise_data + col * m + o, s.columnwise_data + col * g.m, g.m);
      }
      if (p.scaling == BlockScaling::kBlock1D) {
        for (int64_t kk = 0; kk < nk; ++kk) {
          std::memcpy(out.columnwise_scale_inv + (k0 + kk) * l.columnwise_scale_cols,
                      s.columnwise_scale_inv + kk * n, sizeof(float) * n);
        }
      } else {
        for (int64_t kk = 0; kk < nk; ++kk) {
          for (int64_t tj = 0; tj < nb; ++tj) {
            out.columnwise_scale_inv[tj * l.columnwise_scale_cols + k0 + kk] =
                s.columnwise_scale_inv[kk * nb + tj];
          }
        }
      }
    }
  }
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
        scale_inv = one_d ? in.rowwise_scale_inv[(col / kBlockLen) * l.rowwise_scale_cols + r]
                          : in.rowwise_scale_inv[(r / kBlockLen) * l.rowwise_scale_cols +
                                                 col / kBlockLen];
      } else {
        q = in.columnwise_data[col * m + r];
        scale_inv = one_d ? in.columnwise_scale_inv[(r / kBlockLen) * l.columnwise_scale_cols + col]
                          : in.columnwise_scale_inv[(col / kBlockLen) * l.columnwise_scale_cols +
                                                    r / kBlockLen];
      }
      StoreAs(out, out_dtype, r * n + col, DecodeFp8(q, format) * scale_inv);
    }
  }
}

}  // namespace qtx::kernels::cpu
