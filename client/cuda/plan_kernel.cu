// The caller's side of a plan execution (qtx/cuda_plan.h): one thread moves
// the plan's ready word to the next execution number and waits for qtxd's
// done word to reach it.
#include <cuda/atomic>

#include "plan_kernel.h"

namespace qtx::cuda::internal {
namespace {

using SystemWord = ::cuda::atomic_ref<unsigned long long, ::cuda::thread_scope_system>;

// words[0] ready (qtxd waits on it), words[1] done (qtxd writes it),
// words[2] this process's execution counter (only this kernel touches it,
// one launch at a time in stream order).
__global__ void PlanStepKernel(unsigned long long* words) {
  const unsigned long long n = words[2] + 1;
  words[2] = n;
  // Release: the stream's earlier work (finished before this kernel began)
  // and this thread's writes are visible system-wide before qtxd, which
  // waits for ready >= n, can see the new value.
  SystemWord(words[0]).store(n, ::cuda::memory_order_release);
  // Acquire: once done >= n (qtxd writes done = n after its outputs, behind
  // a system-scope fence: cuStreamWriteValue64's default), the outputs are
  // visible to this thread and, after this kernel ends, to the stream's later
  // work. A failure value (2^62 + n) or qtx's release-all value (2^63 - 1)
  // passes too. Compared as CU_STREAM_WAIT_VALUE_GEQ does.
  SystemWord done(words[1]);
  unsigned int backoff = 32;
  while (static_cast<long long>(done.load(::cuda::memory_order_acquire) - n) < 0) {
    __nanosleep(backoff);
    if (backoff < 1024) backoff *= 2;
  }
}

}  // namespace

cudaError_t LaunchPlanStep(cudaStream_t stream, unsigned long long* words) {
  PlanStepKernel<<<1, 1, 0, stream>>>(words);
  return cudaGetLastError();
}

}  // namespace qtx::cuda::internal
