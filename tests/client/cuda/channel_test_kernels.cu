#include "tests/client/cuda/channel_test_kernels.h"

namespace qtx::testing {
namespace {

__device__ void SpinNs(uint64_t spin_ns) {
  uint64_t start;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  for (;;) {
    uint64_t now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    if (now - start >= spin_ns) break;
  }
}

__global__ void DelayedCopyKernel(uint8_t* dst, const uint8_t* src, uint64_t bytes,
                                  uint64_t spin_ns) {
  if (spin_ns > 0) {
    if (threadIdx.x == 0) SpinNs(spin_ns);
    __syncthreads();
  }
  for (uint64_t i = threadIdx.x; i < bytes; i += blockDim.x) dst[i] = src[i];
}

__global__ void CountMismatchesKernel(const uint8_t* a, const uint8_t* b, uint64_t bytes,
                                      unsigned long long* mismatches) {
  unsigned long long local = 0;
  for (uint64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < bytes;
       i += uint64_t{gridDim.x} * blockDim.x) {
    local += a[i] != b[i];
  }
  if (local != 0) atomicAdd(mismatches, local);
}

__global__ void SpinKernel(uint64_t spin_ns) { SpinNs(spin_ns); }

__global__ void WaitHostFlagKernel(const volatile uint32_t* flag, uint64_t timeout_ns,
                                   unsigned int* timed_out) {
  uint64_t start;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  for (;;) {
    if (*flag != 0) return;  // volatile: re-read from host memory every time
    uint64_t now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    if (now - start >= timeout_ns) {
      atomicAdd(timed_out, 1u);
      return;
    }
    __nanosleep(1000);
  }
}

}  // namespace

cudaError_t LaunchDelayedCopy(void* dst, const void* src, uint64_t bytes, uint64_t spin_ns,
                              cudaStream_t stream) {
  // One block: the spin delays every byte of the copy.
  DelayedCopyKernel<<<1, 1024, 0, stream>>>(static_cast<uint8_t*>(dst),
                                            static_cast<const uint8_t*>(src), bytes, spin_ns);
  return cudaGetLastError();
}

cudaError_t LaunchCountMismatches(const void* a, const void* b, uint64_t bytes,
                                  unsigned long long* mismatches, cudaStream_t stream) {
  CountMismatchesKernel<<<264, 256, 0, stream>>>(static_cast<const uint8_t*>(a),
                                                 static_cast<const uint8_t*>(b), bytes, mismatches);
  return cudaGetLastError();
}

cudaError_t LaunchSpin(uint64_t spin_ns, cudaStream_t stream) {
  SpinKernel<<<1, 1, 0, stream>>>(spin_ns);
  return cudaGetLastError();
}

cudaError_t LaunchWaitHostFlag(const volatile uint32_t* flag, uint64_t timeout_ns,
                               unsigned int* timed_out, cudaStream_t stream) {
  WaitHostFlagKernel<<<1, 1, 0, stream>>>(flag, timeout_ns, timed_out);
  return cudaGetLastError();
}

}  // namespace qtx::testing
