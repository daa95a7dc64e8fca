// Internal to qtx_client_cuda: the kernel behind qtx::cuda::Plan::Enqueue.
#ifndef QTX_CLIENT_CUDA_PLAN_KERNEL_H_
#define QTX_CLIENT_CUDA_PLAN_KERNEL_H_

#include <cuda_runtime_api.h>

namespace qtx::cuda::internal {

// Launches one plan step on `stream`: ready = ++counter, then wait until
// done >= counter. `words` (device-visible): ready, done, counter (uint64
// each). Returns the launch's error.
cudaError_t LaunchPlanStep(cudaStream_t stream, unsigned long long* words);

}  // namespace qtx::cuda::internal

#endif  // QTX_CLIENT_CUDA_PLAN_KERNEL_H_
