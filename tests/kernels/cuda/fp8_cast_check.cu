#include <cuda_runtime.h>

#include "kernels/fp8.h"
#include "tests/kernels/cuda/fp8_cast_check.h"

namespace qtx::kernels::cuda::testing {
namespace {

template <Fp8Format F>
__device__ __forceinline__ uint8_t HwCast(float x) {
  unsigned short r;
  if constexpr (F == Fp8Format::kE4M3) {
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(0.0f), "f"(x));
  } else {
    asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(r) : "f"(0.0f), "f"(x));
  }
  return static_cast<uint8_t>(r & 0xFF);
}

template <Fp8Format F>
__global__ void CastKernel(const float* in, int64_t count, uint8_t* out) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    out[i] = HwCast<F>(in[i]);
  }
}

// Counts the patterns first + i (i < count) for which `matches` is false.
template <typename Matches>
__global__ void CountMismatchesKernel(uint64_t first, uint64_t count, Matches matches,
                                      unsigned long long* mismatches, unsigned int* first_bad) {
  unsigned long long local = 0;
  for (uint64_t i = blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<uint64_t>(gridDim.x) * blockDim.x) {
    const uint32_t bits = static_cast<uint32_t>(first + i);
    if (!matches(__uint_as_float(bits))) {
      ++local;
      atomicMin(first_bad, bits);
    }
  }
  if (local != 0) atomicAdd(mismatches, local);
}

// The hardware cast against EncodeFp8.
template <Fp8Format F>
struct CastMatches {
  __device__ bool operator()(float x) const { return HwCast<F>(x) == EncodeFp8(x, F); }
};

// ComputeScalePow2 against ComputeScale(force_pow2) for x as the amax, and
// ScaleInvPow2 against ScaleInv for x as the scale.
struct Pow2ScaleMatches {
  float fp8_max, eps, value_for_inf;
  __device__ bool operator()(float x) const {
    return __float_as_uint(ComputeScalePow2(x, fp8_max, eps, value_for_inf)) ==
               __float_as_uint(ComputeScale(x, fp8_max, true, eps, value_for_inf)) &&
           __float_as_uint(ScaleInvPow2(x)) == __float_as_uint(ScaleInv(x));
  }
};

constexpr int kCountGrid = 132 * 16;

}  // namespace

cudaError_t CountPow2ScaleMismatches(uint64_t first, uint64_t count, float fp8_max, float eps,
                                     float value_for_inf, unsigned long long* mismatches,
                                     unsigned int* first_bad, cudaStream_t stream) {
  CountMismatchesKernel<<<kCountGrid, 256, 0, stream>>>(
      first, count, Pow2ScaleMatches{fp8_max, eps, value_for_inf}, mismatches, first_bad);
  return cudaGetLastError();
}

cudaError_t HardwareCastFp8(const float* in, int64_t count, Fp8Format format, uint8_t* out,
                            cudaStream_t stream) {
  if (count <= 0) return cudaSuccess;
  const int grid = 1024;
  if (format == Fp8Format::kE4M3) {
    CastKernel<Fp8Format::kE4M3><<<grid, 256, 0, stream>>>(in, count, out);
  } else {
    CastKernel<Fp8Format::kE5M2><<<grid, 256, 0, stream>>>(in, count, out);
  }
  return cudaGetLastError();
}

cudaError_t CountCastMismatches(uint64_t first, uint64_t count, Fp8Format format,
                                unsigned long long* mismatches, unsigned int* first_bad,
                                cudaStream_t stream) {
  if (format == Fp8Format::kE4M3) {
    CountMismatchesKernel<<<kCountGrid, 256, 0, stream>>>(
        first, count, CastMatches<Fp8Format::kE4M3>{}, mismatches, first_bad);
  } else {
    CountMismatchesKernel<<<kCountGrid, 256, 0, stream>>>(
        first, count, CastMatches<Fp8Format::kE5M2>{}, mismatches, first_bad);
  }
  return cudaGetLastError();
}

}  // namespace qtx::kernels::cuda::testing
