// CPU reference of per-tensor current scaling (docs/numerics.md "Per-tensor
// current scaling"), written to be read against the spec: one amax over the
// tensor, one scale from kernels/fp8.h TensorScale, every element cast with
// the shared FP8 encoder. OpenMP splits rows (amax: a max reduction, which is
// order-independent, so the result does not depend on the thread count).
#include "kernels/cpu/quantize_tensor.h"

#include <algorithm>

#include "kernels/fp8.h"

namespace qtx::kernels::cpu {
namespace {

template <InputDType kT>
float AmaxTyped(const void* in, int64_t count) {
  uint32_t amax = 0;  // FP32 bits of a non-negative float (fp8.h AmaxBitsUpdate)
#pragma omp parallel for reduction(max : amax) schedule(static)
  for (int64_t i = 0; i < count; ++i) amax = AmaxBitsUpdate(amax, LoadAs<kT>(in, i));
  return BitsToFloat(amax);
}

// Rowwise bytes row by row; the columnwise copy in 64x64 blocks so that both
// the reads and the transposed writes stay in cache.
template <InputDType kT, Fp8Format kF>
void Cast(const void* in, int64_t m, int64_t n, float scale, uint8_t* row, uint8_t* col) {
  if (row != nullptr) {
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < m; ++r) {
      for (int64_t c = 0; c < n; ++c)
        row[r * n + c] = EncodeFp8As<kF>(LoadAs<kT>(in, r * n + c) * scale);
    }
  }
  if (col != nullptr) {
    constexpr int64_t kB = 64;
    const int64_t mb = (m + kB - 1) / kB, nb = (n + kB - 1) / kB;
#pragma omp parallel for collapse(2) schedule(static)
    for (int64_t bi = 0; bi < mb; ++bi) {
      for (int64_t bj = 0; bj < nb; ++bj) {
        const int64_t r1 = std::min(m, bi * kB + kB), c1 = std::min(n, bj * kB + kB);
        for (int64_t c = bj * kB; c < c1; ++c) {
          for (int64_t r = bi * kB; r < r1; ++r) {
            col[c * m + r] = EncodeFp8As<kF>(LoadAs<kT>(in, r * n + c) * scale);
          }
        }
      }
    }
  }
}

template <InputDType kT>
void CastFormat(const void* in, int64_t m, int64_t n, Fp8Format f, float scale, uint8_t* row,
                uint8_t* col) {
  if (f == Fp8Format::kE4M3) {
    Cast<kT, Fp8Format::kE4M3>(in, m, n, scale, row, col);
  } else {
    Cast<kT, Fp8Format::kE5M2>(in, m, n, scale, row, col);
  }
}

}  // namespace

float TensorAmax(const void* input, InputDType dtype, int64_t count) {
  if (count <= 0) return 0.0f;
  switch (dtype) {
    case InputDType::kFloat32:
      return AmaxTyped<InputDType::kFloat32>(input, count);
    case InputDType::kBFloat16:
      return AmaxTyped<InputDType::kBFloat16>(input, count);
    case InputDType::kFloat16:
      return AmaxTyped<InputDType::kFloat16>(input, count);
  }
  return 0.0f;
}

void QuantizeTensor(const void* input, InputDType dtype, int64_t m, int64_t n,
                    const QuantizeParams& params, const QuantizedBuffers& out) {
  QuantizeTensorWithAmax(input, dtype, m, n, TensorAmax(input, dtype, m * n), params, out);
}

void QuantizeTensorWithAmax(const void* input, InputDType dtype, int64_t m, int64_t n, float amax,
                            const QuantizeParams& params, const QuantizedBuffers& out) {
  const float scale =
      TensorScale(amax, params.format, params.force_pow2_scales, params.amax_epsilon);
  const float scale_inv = ScaleInv(scale);
  if (params.rowwise) out.rowwise_scale_inv[0] = scale_inv;
  if (params.columnwise) out.columnwise_scale_inv[0] = scale_inv;
  if (m == 0 || n == 0) return;
  uint8_t* row = params.rowwise ? out.rowwise_data : nullptr;
  uint8_t* col = params.columnwise ? out.columnwise_data : nullptr;
  switch (dtype) {
    case InputDType::kFloat32:
      return CastFormat<InputDType::kFloat32>(input, m, n, params.format, scale, row, col);
    case InputDType::kBFloat16:
      return CastFormat<InputDType::kBFloat16>(input, m, n, params.format, scale, row, col);
    case InputDType::kFloat16:
      return CastFormat<InputDType::kFloat16>(input, m, n, params.format, scale, row, col);
  }
}

void DequantizeTensor(const QuantizedConstBuffers& in, Fp8Format format, int64_t m, int64_t n,
                      bool use_rowwise, InputDType out_dtype, void* out) {
  if (m == 0 || n == 0) return;
  const uint8_t* q = use_rowwise ? in.rowwise_data : in.columnwise_data;
  const float scale_inv = use_rowwise ? in.rowwise_scale_inv[0] : in.columnwise_scale_inv[0];
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t c = 0; c < n; ++c) {
      const uint8_t b = use_rowwise ? q[r * n + c] : q[c * m + r];
      StoreFromFloat(out, out_dtype, r * n + c, DecodeFp8(b, format) * scale_inv);
    }
  }
}

}  // namespace qtx::kernels::cpu
