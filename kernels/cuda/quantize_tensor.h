// CUDA per-tensor current scaling (BlockScaling::kTensor, docs/numerics.md
// "Per-tensor current scaling"), bit-exact with kernels/cpu/quantize_tensor.h.
// Plain header: CUDA runtime types only, so that host code can call it
// without nvcc.
//
// All pointers are device pointers. Work is enqueued on `stream`; the
// functions do not synchronize. Two launch paths give the same bytes:
// - One cooperative launch, for a tensor of whole 128x128 tiles (m and n
//   multiples of 128; input 16-byte, rowwise data 8-byte, columnwise data
//   16-byte aligned), except a columnwise copy of a tensor much larger than
//   what shared memory keeps (on an H200 with BF16 input: above 4752 tiles,
//   about 150 MiB): an amax phase that keeps the first tiles of each CTA in
//   shared memory, a grid barrier, then a cast phase that reads the other
//   tiles again from the input, newest first (the L2 may still hold them),
//   and the kept ones from shared memory.
// - Two launches otherwise, and under stream capture or on a device without
//   cooperative launch: an amax pass, then one cast pass that writes every
//   requested copy.
// A stream-ordered temporary of at most a few KiB comes from the device's
// current memory pool (cudaMallocAsync) and is freed on the stream. An empty
// tensor launches one tiny kernel, which writes the scale_inv of amax 0.
#ifndef QTX_KERNELS_CUDA_QUANTIZE_TENSOR_H_
#define QTX_KERNELS_CUDA_QUANTIZE_TENSOR_H_

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/quantize_params.h"

namespace qtx::kernels::cuda {

// Quantizes the row-major [m, n] `input` with one scale for the whole tensor:
// rowwise_data [m, n] + rowwise_scale_inv[0] when params.rowwise,
// columnwise_data [n, m] + columnwise_scale_inv[0] when params.columnwise.
// params.scaling is not read. Returns cudaErrorInvalidValue for m < 0, n < 0,
// m * n overflowing, an unknown enum value, no copy requested, a null scale
// buffer of a requested copy, a null data buffer or input of a non-empty
// tensor, or a negative / non-finite amax_epsilon; otherwise the first
// allocation or launch error, if any.
cudaError_t QuantizeTensor(const void* input, InputDType dtype, int64_t m, int64_t n,
                           const QuantizeParams& params, const QuantizedBuffers& out,
                           cudaStream_t stream);

// max |x| over the `count` elements of `input` (NaN ignored, 0 when empty)
// into the device float amax[0], bit-equal to kernels::cpu::TensorAmax: the
// amax pass of the two launches, whose per-CTA partials (in a stream-ordered
// temporary) one small kernel reduces; a count of at most 8192 is one CTA's,
// which writes amax[0] itself (no temporary, one launch). Returns cudaErrorInvalidValue for
// count < 0, an unknown dtype, a null amax, or a null input when count > 0;
// otherwise the first allocation or launch error, if any.
cudaError_t TensorAmax(const void* input, InputDType dtype, int64_t count, float* amax,
                       cudaStream_t stream);

// QuantizeTensor with the amax read from the device float amax[0] instead of
// computed from `input`, bit-exact with kernels::cpu::QuantizeTensorWithAmax:
// the cast of a shard of a larger tensor whose amax was combined over every
// shard (kernels/cuda/quantize_shard.h, TENSOR). It is the cast launch of the
// two launches alone (never the cooperative one, which needs the amax of its
// own input); an empty tensor still gets the scale_inv of amax[0]. Returns
// cudaErrorInvalidValue as QuantizeTensor does, and for a null amax.
// REQUIRES: amax[0] >= 0 (or +Inf), written before the launch in stream order.
cudaError_t QuantizeTensorWithAmax(const void* input, InputDType dtype, int64_t m, int64_t n,
                                   const float* amax, const QuantizeParams& params,
                                   const QuantizedBuffers& out, cudaStream_t stream);

namespace detail {

// Launch choices of QuantizeTensor, for benchmarks and tests; the defaults
// are QuantizeTensor's. two_pass: always the amax launch then the cast launch
// (the path of tensors that are not whole, aligned 128x128 tiles), instead of
// the one cooperative launch that reads most of the input from DRAM once.
// one_pass_taken (tests): set to whether the one cooperative launch was made.
// force_one_pass: the one launch also for a columnwise copy of a tensor too
// large for it to pay (where it still applies: whole aligned tiles, no
// capture, cooperative launch).
// amax_phase_only (benchmarks): the one cooperative launch stops after its
// amax phase, grid barrier and scale_inv stores, and writes no data: the time
// of phase 1 alone. cudaErrorNotSupported, with nothing launched, where the
// one launch is not made (two_pass, or it does not apply).
struct TensorTuning {
  bool two_pass = false;
  bool* one_pass_taken = nullptr;
  bool force_one_pass = false;
  bool amax_phase_only = false;
};
cudaError_t QuantizeTensorTuned(const void* input, InputDType dtype, int64_t m, int64_t n,
                                const QuantizeParams& params, const QuantizedBuffers& out,
                                const TensorTuning& tuning, cudaStream_t stream);

}  // namespace detail

// x = decode(q) * scale_inv[0] in FP32, narrowed to `out_dtype`; reads the
// rowwise copy when `use_rowwise`, else the columnwise copy (transposed back).
cudaError_t DequantizeTensor(const QuantizedConstBuffers& in, Fp8Format format, int64_t m,
                             int64_t n, bool use_rowwise, InputDType out_dtype, void* out,
                             cudaStream_t stream);

}  // namespace qtx::kernels::cuda

#endif  // QTX_KERNELS_CUDA_QUANTIZE_TENSOR_H_
