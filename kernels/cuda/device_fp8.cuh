// Device-side element conversions shared by the CUDA kernels of kernels/cuda,
// so that every kernel casts with the same code: FP32 -> FP8 is the hardware cvt.rn.satfinite,
// which equals kernels/fp8.h EncodeFp8 bit for bit (tests/kernels/cuda/fp8_cast_test.cc checks
// every BF16 and every FP32 pattern). Include from .cu files only.
#ifndef QTX_KERNELS_CUDA_DEVICE_FP8_CUH_
#define QTX_KERNELS_CUDA_DEVICE_FP8_CUH_

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>

#include "kernels/fp8.h"
#include "kernels/quantize_params.h"

namespace qtx::kernels::cuda {

// One input element's bits (the low 16 bits for BF16 / FP16) as FP32, exact.
template <InputDType D>
__device__ __forceinline__ float ElemToFloat(uint32_t bits) {
  if constexpr (D == InputDType::kBFloat16) {
    return __uint_as_float(bits << 16);
  } else if constexpr (D == InputDType::kFloat16) {
    float f;
    const unsigned short h = static_cast<unsigned short>(bits);
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));  // exact widening
    return f;
  } else {
    return __uint_as_float(bits);
  }
}

// Two FP32 values -> two FP8 bytes (lo in bits 0-7), round to nearest even,
// saturating, NaN -> 0x7F: docs/numerics.md §1.
template <Fp8Format F>
__device__ __forceinline__ uint32_t Cvt2(float lo, float hi) {
  unsigned short r;
  if constexpr (F == Fp8Format::kE4M3) {
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
  } else {
    asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
  }
  return r;
}

// q = fp8(RN_fp32(x * scale)) for 8 values, packed little-endian.
template <Fp8Format F>
__device__ __forceinline__ uint2 Quantize8(const float (&x)[8], float scale) {
  uint2 r;
  r.x = Cvt2<F>(__fmul_rn(x[0], scale), __fmul_rn(x[1], scale)) |
        (Cvt2<F>(__fmul_rn(x[2], scale), __fmul_rn(x[3], scale)) << 16);
  r.y = Cvt2<F>(__fmul_rn(x[4], scale), __fmul_rn(x[5], scale)) |
        (Cvt2<F>(__fmul_rn(x[6], scale), __fmul_rn(x[7], scale)) << 16);
  return r;
}

// decode(q) * scale_inv in FP32. A NaN code keeps the decoded NaN (the GPU's
// multiply would return its own canonical NaN instead of the operand).
__device__ __forceinline__ float Dequant1(uint8_t q, float scale_inv, Fp8Format f) {
  const float d = DecodeFp8(q, f);
  return IsNan(d) ? d : __fmul_rn(d, scale_inv);
}

// Element idx of a high-precision output, narrowed from FP32 (round to
// nearest even).
template <InputDType OutD>
__device__ __forceinline__ void StoreOut(void* out, int64_t idx, float x) {
  if constexpr (OutD == InputDType::kBFloat16) {
    static_cast<uint16_t*>(out)[idx] = FloatToBf16(x);
  } else if constexpr (OutD == InputDType::kFloat16) {
    static_cast<uint16_t*>(out)[idx] = FloatToHalf(x);
  } else {
    static_cast<float*>(out)[idx] = x;
  }
}

// The [m, n] output of a columnwise copy `q` ([n, m] bytes): 32x32 tiles,
// grid-stride, transposed through shared memory by a 256-thread CTA (32x8
// threads, 4 elements each per tile); element (mm, nn) is
// decode(q) * scale_inv(mm, nn). The body of the columnwise dequantize
// kernels of every scaling (scale_inv: the element's block scale, or the one
// per-tensor scale).
template <InputDType OutD, typename ScaleInv>
__device__ __forceinline__ void DequantizeColumnwiseTiles(const uint8_t* q, int64_t m, int64_t n,
                                                          Fp8Format format, void* out,
                                                          ScaleInv&& scale_inv) {
  __shared__ uint8_t tbuf[32][33];
  const int64_t tiles_m = (m + 31) / 32, tiles_n = (n + 31) / 32;
  const int tx = threadIdx.x & 31, ty = threadIdx.x >> 5;
  for (int64_t t = blockIdx.x; t < tiles_m * tiles_n; t += gridDim.x) {
    const int64_t m0 = (t % tiles_m) * 32, n0 = (t / tiles_m) * 32;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int64_t nn = n0 + ty + 8 * k, mm = m0 + tx;
      tbuf[ty + 8 * k][tx] = (nn < n && mm < m) ? q[nn * m + mm] : 0;
    }
    __syncthreads();
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int64_t mm = m0 + ty + 8 * k, nn = n0 + tx;
      if (mm < m && nn < n) {
        StoreOut<OutD>(out, mm * n + nn, Dequant1(tbuf[tx][ty + 8 * k], scale_inv(mm, nn), format));
      }
    }
    __syncthreads();
  }
}

// Host side: turns runtime enums into template arguments for a kernel
// launch; unknown values are rejected with cudaErrorInvalidValue.
template <typename Fn>
cudaError_t WithDType(InputDType d, Fn&& fn) {
  switch (d) {
    case InputDType::kBFloat16:
      return fn(std::integral_constant<InputDType, InputDType::kBFloat16>{});
    case InputDType::kFloat16:
      return fn(std::integral_constant<InputDType, InputDType::kFloat16>{});
    case InputDType::kFloat32:
      return fn(std::integral_constant<InputDType, InputDType::kFloat32>{});
  }
  return cudaErrorInvalidValue;  // not one of kFloat32, kBFloat16, kFloat16
}
template <typename Fn>
cudaError_t WithFormat(Fp8Format f, Fn&& fn) {
  switch (f) {
    case Fp8Format::kE4M3:
      return fn(std::integral_constant<Fp8Format, Fp8Format::kE4M3>{});
    case Fp8Format::kE5M2:
      return fn(std::integral_constant<Fp8Format, Fp8Format::kE5M2>{});
  }
  return cudaErrorInvalidValue;  // not one of kE4M3, kE5M2
}

// Multiprocessors of the current device, cached per device (host code).
inline cudaError_t CurrentDeviceSmCount(int* sms) {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> cache[kMaxDevices];
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return err;
  if (dev >= 0 && dev < kMaxDevices) {
    const int c = cache[dev].load(std::memory_order_relaxed);
    if (c > 0) {
      *sms = c;
      return cudaSuccess;
    }
  }
  err = cudaDeviceGetAttribute(sms, cudaDevAttrMultiProcessorCount, dev);
  if (err != cudaSuccess) return err;
  if (dev >= 0 && dev < kMaxDevices) cache[dev].store(*sms, std::memory_order_relaxed);
  return cudaSuccess;
}

}  // namespace qtx::kernels::cuda

#endif  // QTX_KERNELS_CUDA_DEVICE_FP8_CUH_
