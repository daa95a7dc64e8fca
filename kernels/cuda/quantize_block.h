// CUDA block-scaled FP8 quantization (docs/numerics.md §2-§4), bit-exact with
// kernels/cpu/quantize_block.h. Plain header: CUDA runtime types only, so that
// host code (server/, tests, bench) can call it without nvcc.
//
// All pointers are device pointers. Buffers are laid out per
// kernels/block_geometry.h ComputeLayout(params.scaling, m, n); scale padding
// entries (the pad4 columns) are written as 0. Work is enqueued on `stream`;
// the functions do not synchronize. Zero-element tensors launch nothing.
#ifndef QTX_KERNELS_CUDA_QUANTIZE_BLOCK_H_
#define QTX_KERNELS_CUDA_QUANTIZE_BLOCK_H_

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/quantize_params.h"

namespace qtx::kernels::cuda {

// Quantizes the row-major [m, n] tensor `input` of element type `dtype` into
// the copies requested by params.rowwise / params.columnwise.
// BlockScaling::kTensor goes to QuantizeTensor (kernels/cuda/quantize_tensor.h),
// with its own error rules.
// Returns cudaErrorInvalidValue for m < 0, n < 0, 2^31 or more 128x128 tiles,
// an unknown enum value, a
// null buffer of a requested copy, or a negative / non-finite amax_epsilon;
// otherwise the launch error, if any.
//
// Tensors of more 128x128 tiles than the GPU holds CTAs at once (twice as many
// for 1-D scaling of BF16 / FP16 input with a columnwise copy, whose CTAs load
// two tiles ahead) are spread
// over the CTAs through a tile counter of `stream`'s own (4 bytes of device
// memory, zeroed in the stream's order on its first use): a CTA that finishes
// early takes the next tile. Up to 1024 streams per device hold a counter at a
// time; later streams, and launches captured into a CUDA graph, share the
// tiles in a fixed order instead (the same bytes, a few percent slower).
cudaError_t QuantizeBlock(const void* input, InputDType dtype, int64_t m, int64_t n,
                          const QuantizeParams& params, const QuantizedBuffers& out,
                          cudaStream_t stream);

// Frees `stream`'s tile counter (see QuantizeBlock) for another stream, on the
// current device. Call it before destroying a stream that QuantizeBlock (or a
// call built on it) used, once the stream's work has completed (e.g. after
// cudaStreamSynchronize): a launch still queued on it would share the counter
// with the next stream's and could skip tiles. A stream without a counter is
// left alone.
cudaError_t ForgetStreamTileCounter(cudaStream_t stream);

// Dequantizes [m, n]: x = decode(q) * scale_inv in FP32, narrowed to
// `out_dtype` (round to nearest even). Reads the rowwise copy when
// `use_rowwise`, else the columnwise copy (transposed back to [m, n]).
// BlockScaling::kTensor goes to DequantizeTensor.
cudaError_t DequantizeBlock(const QuantizedConstBuffers& in, BlockScaling scaling, Fp8Format format,
                            int64_t m, int64_t n, bool use_rowwise, InputDType out_dtype, void* out,
                            cudaStream_t stream);

namespace detail {

// Launch-shape override for benchmarking the fused quantize kernel:
// `stages` = shared-memory pipeline depth of the aligned path (2 or 3; 0 = the default, for BF16 /
// FP16 input: 1-D rowwise alone with at most 24 tiles per SM runs half tiles with 3 stages; 1-D
// with a columnwise copy and 2-D row+col take 3 stages with more than 4 tiles per SM; else 2; an
// explicit 2 or 3 runs 128x128 tiles unless `half_tiles`; of the others only BF16 input with E4M3
// output honours 3), `ctas_per_sm` = resident CTAs per SM
// of the persistent grid; 0 = the default; `evict_first_outputs` = evict-first (st.global.cs)
// stores of the FP8 copies instead of the default plain ones; `fixed_tiles` = CTA b takes tiles b,
// b + grid, ... instead of drawing them from the stream's tile counter (the default);
// `division_scales` = pow2 scales by ComputeScale's division and ScaleInv's reciprocal instead of
// the exponent arithmetic of ComputeScalePow2 / ScaleInvPow2 (kernels/fp8.h); `float_amax` = 1-D
// amaxes with a columnwise copy one FP32 element at a time instead of in packed pairs (BF16 input,
// E4M3 output, aligned path); `half_tiles` = for 1-D scaling with the rowwise copy alone, units of
// 64x128 elements in 128-thread CTAs (4 resident per SM for 16-bit input) instead of 128x128 tiles
// in 256-thread CTAs (stages 2 or 3; every path; see `stages` for when the default takes them).
// Results are identical for every setting. Not part of the stable API.
struct LaunchTuning {
  int stages = 0;
  int ctas_per_sm = 0;
  bool evict_first_outputs = false;
  bool fixed_tiles = false;
  bool division_scales = false;
  bool float_amax = false;
  bool half_tiles = false;
};
cudaError_t QuantizeBlockTuned(const void* input, InputDType dtype, int64_t m, int64_t n,
                               const QuantizeParams& params, const QuantizedBuffers& out,
                               const LaunchTuning& tuning, cudaStream_t stream);

// How many streams of the current device hold a tile counter (see QuantizeBlock), for tests.
int TileCountersHeld();

}  // namespace detail

}  // namespace qtx::kernels::cuda

#endif  // QTX_KERNELS_CUDA_QUANTIZE_BLOCK_H_
