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
cudaError_t QuantizeBlock(const void* input, InputDType dtype, int64_t m, int64_t n,
                          const QuantizeParams& params, const QuantizedBuffers& out,
                          cudaStream_t stream);

// Dequantizes [m, n]: x = decode(q) * scale_inv in FP32, narrowed to
// `out_dtype` (round to nearest even). Reads the rowwise copy when
// `use_rowwise`, else the columnwise copy (transposed back to [m, n]).
// BlockScaling::kTensor goes to DequantizeTensor.
cudaError_t DequantizeBlock(const QuantizedConstBuffers& in, BlockScaling scaling, Fp8Format format,
                            int64_t m, int64_t n, bool use_rowwise, InputDType out_dtype, void* out,
                            cudaStream_t stream);

namespace detail {

// Launch-shape override for benchmarking the fused quantize kernel:
// `stages` = shared-memory pipeline depth of the aligned path (2 or 3; only
// BF16 input with E4M3 output honours 3), `ctas_per_sm` = resident CTAs per SM
// of the persistent grid; 0 = the default; `l2_outputs` = plain stores of the FP8 copies instead of
// the default evict-first (st.global.cs) ones; `dynamic_tiles` (issue 16's experiment; BF16 input,
// E4M3 output, the rowwise copy requested, the aligned path at 2 stages, ignored otherwise) = CTAs
// take their next tile from a per-stream atomic counter instead of the fixed share b, b + grid, ...
// (no tail of unequal finishing times); `balanced_grid` = the persistent grid shrunk to as few
// CTAs as give each the same number of tiles (every path); `bulk_loads` (issue 16's experiment,
// the same cases as dynamic_tiles, which wins when both are set) = the aligned path loads each
// input tile with Hopper's tensor copy engine (one cp.async.bulk.tensor of a 128 x 128 box per
// tile, completion on a shared-memory mbarrier) instead of 16-byte cp.async per thread;
// `three_ctas` (the same cases; after dynamic_tiles, before bulk_loads) = the kernel compiled
// for 3 resident CTAs per SM (at most 80 registers a thread) instead of 2; `dynamic_static_pct`
// (with dynamic_tiles) = the share of the tiles, in percent, that CTAs take in the fixed order
// b, b + grid, ... (whole rounds, at least the first) before they draw the rest from the counter.
// Results are
// identical for every setting. Not part of the stable API.
struct LaunchTuning {
  int stages = 0;
  int ctas_per_sm = 0;
  bool l2_outputs = false;
  bool dynamic_tiles = false;
  bool balanced_grid = false;
  bool bulk_loads = false;
  bool three_ctas = false;
  int dynamic_static_pct = 0;
};
cudaError_t QuantizeBlockTuned(const void* input, InputDType dtype, int64_t m, int64_t n,
                               const QuantizeParams& params, const QuantizedBuffers& out,
                               const LaunchTuning& tuning, cudaStream_t stream);

}  // namespace detail

}  // namespace qtx::kernels::cuda

#endif  // QTX_KERNELS_CUDA_QUANTIZE_BLOCK_H_
