// bench/stream_copy.h: a plain 16-byte-word copy kernel, the bench's own
// measure of the device's streaming rate.
#include <algorithm>

#include "bench/stream_copy.h"

namespace qtx::bench {
namespace {

template <int kUnroll, bool kStreaming>
__global__ void StreamCopyKernel(const int4* __restrict__ src, int4* __restrict__ dst,
                                 int64_t words) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x * kUnroll;
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * blockDim.x * kUnroll + threadIdx.x;
       base < words; base += step) {
    int4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + static_cast<int64_t>(u) * blockDim.x;
      if (i < words) v[u] = kStreaming ? __ldcs(src + i) : src[i];
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + static_cast<int64_t>(u) * blockDim.x;
      if (i < words) {
        if constexpr (kStreaming) {
          __stcs(dst + i, v[u]);
        } else {
          dst[i] = v[u];
        }
      }
    }
  }
}

template <int kUnroll, bool kStreaming>
cudaError_t Launch(const void* src, void* dst, int64_t words, const StreamCopyShape& s,
                   cudaStream_t stream) {
  const int64_t per_cta = static_cast<int64_t>(s.threads) * kUnroll;
  int64_t grid = (words + per_cta - 1) / per_cta;  // one step per thread
  if (s.ctas_per_sm > 0) {
    int dev = 0, sms = 0;
    cudaError_t err = cudaGetDevice(&dev);
    if (err != cudaSuccess) return err;
    err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
    if (err != cudaSuccess) return err;
    grid = std::min(grid, static_cast<int64_t>(sms) * s.ctas_per_sm);
  }
  if (grid < 1 || grid > 0x7FFFFFFF) return cudaErrorInvalidValue;
  StreamCopyKernel<kUnroll, kStreaming><<<static_cast<unsigned>(grid), s.threads, 0, stream>>>(
      static_cast<const int4*>(src), static_cast<int4*>(dst), words);
  return cudaGetLastError();
}

template <bool kStreaming>
cudaError_t ByUnroll(const void* src, void* dst, int64_t words, const StreamCopyShape& s,
                     cudaStream_t stream) {
  switch (s.unroll) {
    case 1:
      return Launch<1, kStreaming>(src, dst, words, s, stream);
    case 4:
      return Launch<4, kStreaming>(src, dst, words, s, stream);
    case 8:
      return Launch<8, kStreaming>(src, dst, words, s, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace

cudaError_t StreamCopy(const void* src, void* dst, int64_t bytes, const StreamCopyShape& shape,
                       cudaStream_t stream) {
  const auto misaligned = [](const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) != 0; };
  if (bytes < 0 || bytes % 16 != 0 || misaligned(src) || misaligned(dst) || shape.threads < 32 ||
      shape.threads > 1024 || shape.ctas_per_sm < 0) {
    return cudaErrorInvalidValue;
  }
  if (bytes == 0) return cudaSuccess;
  return shape.streaming ? ByUnroll<true>(src, dst, bytes / 16, shape, stream)
                         : ByUnroll<false>(src, dst, bytes / 16, shape, stream);
}

}  // namespace qtx::bench
