// CPU reference of NUMERICS.md §2-§4. Written to be read against the spec:
// every block's amax, scale, scale_inv and bytes are computed literally with
// the shared arithmetic of kernels/fp8.h. OpenMP splits independent blocks.
#include "kernels/cpu/quantize_block.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "kernels/fp8.h"

namespace qtx::kernels::cpu {
namespace {

// Loads input elements as FP32; `T` is the storage type selected at dispatch.
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
  Fp8Format format;
};

inline float BlockScale(float amax, const ScaleConfig& c) {
  return ComputeScale(amax, c.fp8_max, c.pow2, c.eps, c.value_for_inf);
}

// 1-D rowwise: block (m, b) covers row m, columns [128b, min(128b+128, n)).
// Scale at Sr[b, m] (flat b * pad4(M) + m).
template <InputDType kT>
void Rowwise1D(const void* in, int64_t m, int64_t n, const ScaleConfig& c, uint8_t* q,
               float* s, int64_t s_cols) {
  const int64_t nb = CeilDiv(n, kBlockLen);
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < m; ++r) {
    float x[kBlockLen];
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t c0 = b * kBlockLen;
      const int64_t len = std::min(kBlockLen, n - c0);
      float amax = 0.0f;
      for (int64_t k = 0; k < len; ++k) {
        x[k] = Load<kT>(in, r * n + c0 + k);
        amax = AmaxUpdate(amax, x[k]);
      }
      const float scale = BlockScale(amax, c);
      s[b * s_cols + r] = ScaleInv(scale);
      uint8_t* out = q + r * n + c0;
      for (int64_t k = 0; k < len; ++k) out[k] = EncodeFp8(x[k] * scale, c.format);
    }
  }
}

// 1-D columnwise: block (c, col) covers column col, rows [128c, min(128c+128, m)).
// Data stored transposed: Qc[col, row]; scale at Sc[c, col] (flat c * pad4(N) + col).
template <InputDType kT>
void Columnwise1D(const void* in, int64_t m, int64_t n, const ScaleConfig& c, uint8_t* q,
                  float* s, int64_t s_cols) {
  const int64_t mb = CeilDiv(m, kBlockLen);
  constexpr int64_t kColChunk = 64;
  const int64_t nchunks = CeilDiv(n, kColChunk);
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t cb = 0; cb < mb; ++cb) {
    for (int64_t ch = 0; ch < nchunks; ++ch) {
      const int64_t r0 = cb * kBlockLen;
      const int64_t rows = std::min(kBlockLen, m - r0);
      const int64_t col0 = ch * kColChunk;
      const int64_t cols = std::min(kColChunk, n - col0);
      float x[kBlockLen][kColChunk];
      float amax[kColChunk] = {};
      for (int64_t i = 0; i < rows; ++i) {
        for (int64_t j = 0; j < cols; ++j) {
          x[i][j] = Load<kT>(in, (r0 + i) * n + col0 + j);
          amax[j] = AmaxUpdate(amax[j], x[i][j]);
        }
      }
      for (int64_t j = 0; j < cols; ++j) {
        const float scale = BlockScale(amax[j], c);
        s[cb * s_cols + col0 + j] = ScaleInv(scale);
        uint8_t* out = q + (col0 + j) * m + r0;
        for (int64_t i = 0; i < rows; ++i) out[i] = EncodeFp8(x[i][j] * scale, c.format);
      }
    }
  }
}

// 2-D: tile (ti, tj) covers rows [128ti, ...), columns [128tj, ...); one scale,
// stored at Sr[ti, tj] and Sc[tj, ti]; columnwise bytes are the transpose.
template <InputDType kT>
void Tiles2D(const void* in, int64_t m, int64_t n, const ScaleConfig& c, bool rowwise,
             bool columnwise, const QuantizedBuffers& out, const QuantizedLayout& l) {
  const int64_t mb = CeilDiv(m, kBlockLen);
  const int64_t nb = CeilDiv(n, kBlockLen);
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t ti = 0; ti < mb; ++ti) {
    for (int64_t tj = 0; tj < nb; ++tj) {
      const int64_t r0 = ti * kBlockLen, c0 = tj * kBlockLen;
      const int64_t rows = std::min(kBlockLen, m - r0);
      const int64_t cols = std::min(kBlockLen, n - c0);
      float amax = 0.0f;
      for (int64_t i = 0; i < rows; ++i) {
        for (int64_t j = 0; j < cols; ++j) {
          amax = AmaxUpdate(amax, Load<kT>(in, (r0 + i) * n + c0 + j));
        }
      }
      const float scale = BlockScale(amax, c);
      const float scale_inv = ScaleInv(scale);
      if (rowwise) out.rowwise_scale_inv[ti * l.rowwise_scale_cols + tj] = scale_inv;
      if (columnwise) out.columnwise_scale_inv[tj * l.columnwise_scale_cols + ti] = scale_inv;
      for (int64_t i = 0; i < rows; ++i) {
        for (int64_t j = 0; j < cols; ++j) {
          const uint8_t v = EncodeFp8(Load<kT>(in, (r0 + i) * n + c0 + j) * scale, c.format);
          if (rowwise) out.rowwise_data[(r0 + i) * n + c0 + j] = v;
          if (columnwise) out.columnwise_data[(c0 + j) * m + r0 + i] = v;
        }
      }
    }
  }
}

template <InputDType kT>
void QuantizeTyped(const void* input, int64_t m, int64_t n, const QuantizeParams& p,
                   const QuantizedBuffers& out, const QuantizedLayout& l) {
  const ScaleConfig c{Fp8Max(p.format), p.force_pow2_scales, p.amax_epsilon,
                      InputDTypeMax(kT), p.format};
  if (p.scaling == BlockScaling::kBlock1D) {
    if (p.rowwise) {
      Rowwise1D<kT>(input, m, n, c, out.rowwise_data, out.rowwise_scale_inv,
                    l.rowwise_scale_cols);
    }
    if (p.columnwise) {
      Columnwise1D<kT>(input, m, n, c, out.columnwise_data, out.columnwise_scale_inv,
                       l.columnwise_scale_cols);
    }
  } else {
    Tiles2D<kT>(input, m, n, c, p.rowwise, p.columnwise, out, l);
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

}  // namespace

void QuantizeBlock(const void* input, InputDType dtype, int64_t m, int64_t n,
                   const QuantizeParams& params, const QuantizedBuffers& out) {
  const QuantizedLayout l = ComputeLayout(params.scaling, m, n);
  // Padding entries are 0 (NUMERICS.md: TE leaves them uninitialized).
  if (params.rowwise && l.RowwiseScaleCount() > 0) {
    std::memset(out.rowwise_scale_inv, 0, sizeof(float) * l.RowwiseScaleCount());
  }
  if (params.columnwise && l.ColumnwiseScaleCount() > 0) {
    std::memset(out.columnwise_scale_inv, 0, sizeof(float) * l.ColumnwiseScaleCount());
  }
  if (m == 0 || n == 0) return;
  switch (dtype) {
    case InputDType::kFloat32:
      QuantizeTyped<InputDType::kFloat32>(input, m, n, params, out, l);
      break;
    case InputDType::kBFloat16:
      QuantizeTyped<InputDType::kBFloat16>(input, m, n, params, out, l);
      break;
    case InputDType::kFloat16:
      QuantizeTyped<InputDType::kFloat16>(input, m, n, params, out, l);
      break;
  }
}

void DequantizeBlock(const QuantizedConstBuffers& in, BlockScaling scaling, Fp8Format format,
                     int64_t m, int64_t n, bool use_rowwise, InputDType out_dtype, void* out) {
  if (m == 0 || n == 0) return;
  const QuantizedLayout l = ComputeLayout(scaling, m, n);
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t col = 0; col < n; ++col) {
      uint8_t q;
      float scale_inv;
      if (use_rowwise) {
        q = in.rowwise_data[r * n + col];
        scale_inv = scaling == BlockScaling::kBlock1D
                        ? in.rowwise_scale_inv[(col / kBlockLen) * l.rowwise_scale_cols + r]
                        : in.rowwise_scale_inv[(r / kBlockLen) * l.rowwise_scale_cols +
                                               col / kBlockLen];
      } else {
        q = in.columnwise_data[col * m + r];
        scale_inv = scaling == BlockScaling::kBlock1D
                        ? in.columnwise_scale_inv[(r / kBlockLen) * l.columnwise_scale_cols + col]
                        : in.columnwise_scale_inv[(col / kBlockLen) * l.columnwise_scale_cols +
                                                  r / kBlockLen];
      }
      StoreAs(out, out_dtype, r * n + col, DecodeFp8(q, format) * scale_inv);
    }
  }
}

}  // namespace qtx::kernels::cpu
