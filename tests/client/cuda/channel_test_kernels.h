// Small CUDA kernels for the GPU channel tests and benchmark: a producer that
// writes a tensor after a spin (so that a sidecar reading too early would see
// stale bytes), and a consumer that compares bytes right after a channel wait
// and counts mismatches on the device.
#ifndef QTX_TESTS_CLIENT_CUDA_CHANNEL_TEST_KERNELS_H_
#define QTX_TESTS_CLIENT_CUDA_CHANNEL_TEST_KERNELS_H_

#include <cuda_runtime_api.h>

#include <cstdint>

namespace qtx::testing {

// Spins ~`spin_ns` on the GPU (one block), then copies `bytes` from src to dst.
cudaError_t LaunchDelayedCopy(void* dst, const void* src, uint64_t bytes, uint64_t spin_ns,
                              cudaStream_t stream);

// Adds to *mismatches the number of bytes where a[i] != b[i].
cudaError_t LaunchCountMismatches(const void* a, const void* b, uint64_t bytes,
                                  unsigned long long* mismatches, cudaStream_t stream);

// Spins ~`spin_ns` on the GPU.
cudaError_t LaunchSpin(uint64_t spin_ns, cudaStream_t stream);

// Holds `stream` (one thread) until the host sets *flag != 0 (`flag`: the
// device address of mapped page-locked host memory, cudaHostAllocMapped),
// or until `timeout_ns` has passed, whichever comes first; on the timeout it
// adds 1 to *timed_out (device memory). Never holds the GPU forever.
cudaError_t LaunchWaitHostFlag(const volatile uint32_t* flag, uint64_t timeout_ns,
                               unsigned int* timed_out, cudaStream_t stream);

}  // namespace qtx::testing

#endif  // QTX_TESTS_CLIENT_CUDA_CHANNEL_TEST_KERNELS_H_
