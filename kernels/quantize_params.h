// Plain parameter types shared by the CPU reference and the CUDA kernels.
// No dependencies beyond <cstdint>; safe to include from .cu files.
#ifndef QTX_KERNELS_QUANTIZE_PARAMS_H_
#define QTX_KERNELS_QUANTIZE_PARAMS_H_

#include <cstdint>

namespace qtx::kernels {

// High-precision element types that can be quantized.
enum class InputDType : int32_t { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

enum class Fp8Format : int32_t { kE4M3 = 0, kE5M2 = 1 };

// kBlock1D: 1x128 rowwise blocks and 128x1 columnwise blocks.
// kBlock2D: 128x128 tiles (columnwise copy = exact transpose of rowwise).
// kTensor: per-tensor current scaling: the block is the whole tensor (one
//   amax, one scale; columnwise copy = exact transpose of rowwise), see
//   kernels/cpu/quantize_tensor.h.
enum class BlockScaling : int32_t { kBlock1D = 0, kBlock2D = 1, kTensor = 2 };

struct QuantizeParams {
  BlockScaling scaling = BlockScaling::kBlock1D;
  Fp8Format format = Fp8Format::kE4M3;
  bool rowwise = true;
  bool columnwise = false;
  bool force_pow2_scales = true;
  float amax_epsilon = 0.0f;
};

// Output buffers of one quantization, sized per block_geometry.h. A pointer
// is ignored (may be null) when its copy is not requested.
struct QuantizedBuffers {
  uint8_t* rowwise_data = nullptr;     // [M, N]
  float* rowwise_scale_inv = nullptr;  // see QuantizedLayout
  uint8_t* columnwise_data = nullptr;  // [N, M]
  float* columnwise_scale_inv = nullptr;
};

// Read-only view of a quantized tensor (for dequantization).
struct QuantizedConstBuffers {
  const uint8_t* rowwise_data = nullptr;
  const float* rowwise_scale_inv = nullptr;
  const uint8_t* columnwise_data = nullptr;
  const float* columnwise_scale_inv = nullptr;
};

}  // namespace qtx::kernels

#endif  // QTX_KERNELS_QUANTIZE_PARAMS_H_
