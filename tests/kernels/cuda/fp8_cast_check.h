// Test-only CUDA helpers: the hardware FP32 -> FP8 cast (cvt.rn.satfinite)
// that kernels/cuda uses, and an exhaustive device-side comparison of it with
// kernels/fp8.h EncodeFp8.
#ifndef QTX_TESTS_KERNELS_CUDA_FP8_CAST_CHECK_H_
#define QTX_TESTS_KERNELS_CUDA_FP8_CAST_CHECK_H_

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/quantize_params.h"

namespace qtx::kernels::cuda::testing {

// out[i] = hardware cast of in[i] (device pointers).
cudaError_t HardwareCastFp8(const float* in, int64_t count, Fp8Format format, uint8_t* out,
                            cudaStream_t stream);

// For every FP32 bit pattern in [first, first + count) (count <= 2^32),
// compares the hardware cast with EncodeFp8 compiled for the device. Adds the
// number of mismatches to *mismatches and records the smallest mismatching
// pattern in *first_bad (atomicMin; initialise it to 0xFFFFFFFF).
// Device pointers.
cudaError_t CountCastMismatches(uint64_t first, uint64_t count, Fp8Format format,
                                unsigned long long* mismatches, unsigned int* first_bad,
                                cudaStream_t stream);

// For every FP32 bit pattern x in [first, first + count) (count <= 2^32), compares
// ComputeScalePow2(x, fp8_max, eps, value_for_inf) with ComputeScale(x, fp8_max,
// true, eps, value_for_inf) and ScaleInvPow2(x) with ScaleInv(x), both compiled for
// the device; counts the patterns where either differs, as CountCastMismatches.
cudaError_t CountPow2ScaleMismatches(uint64_t first, uint64_t count, float fp8_max, float eps,
                                     float value_for_inf, unsigned long long* mismatches,
                                     unsigned int* first_bad, cudaStream_t stream);

}  // namespace qtx::kernels::cuda::testing

#endif  // QTX_TESTS_KERNELS_CUDA_FP8_CAST_CHECK_H_
