#include "kernels/cuda/slot_check.h"

namespace qtx::kernels::cuda {
namespace {

constexpr int kThreads = 256;

// One CTA for all slots (a group has few ranks and a header is a few
// hundred bytes): thread t handles words t, t + kThreads, ... of the
// [count][words] headers; a slot fails when any of its words does.
__global__ void __launch_bounds__(kThreads)
    CheckSlotHeadersKernel(const unsigned char* __restrict__ slots, uint64_t stride,
                           const uint32_t* __restrict__ expected, uint32_t words,
                           uint32_t agreed_words, uint32_t rank_word, uint32_t status_word,
                           uint32_t* __restrict__ out, uint32_t* bad, int count) {
  __shared__ uint32_t failing;
  if (threadIdx.x == 0) failing = 0;
  __syncthreads();
  const uint64_t total = static_cast<uint64_t>(count) * words;
  for (uint64_t k = threadIdx.x; k < total; k += kThreads) {
    const uint64_t r = k / words;
    const uint32_t i = static_cast<uint32_t>(k % words);
    const uint32_t v = reinterpret_cast<const uint32_t*>(slots + stride * r)[i];
    out[k] = v;
    bool wrong = false;
    if (i < agreed_words) wrong = v != expected[i];
    if (i == rank_word) wrong = v != static_cast<uint32_t>(r);
    if (i == status_word) wrong = v != 0u;
    // One bit per slot would need count <= 32; a count of failing words is
    // enough to tell "all pass" from "some fail" (the host names the slot).
    if (wrong) atomicAdd(&failing, 1u);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence_system();  // the copies before the verdict
    *reinterpret_cast<volatile uint32_t*>(bad) = failing;
    __threadfence_system();
  }
}

}  // namespace

cudaError_t CheckSlotHeaders(const void* slots, uint64_t slot_stride, int count,
                             const void* expected, uint32_t header_bytes, uint32_t agreed_bytes,
                             uint32_t rank_offset, uint32_t status_offset, void* headers_out,
                             uint32_t* bad, cudaStream_t stream) {
  if (count < 0 || header_bytes % 4 != 0 || agreed_bytes % 4 != 0 || rank_offset % 4 != 0 ||
      status_offset % 4 != 0 || agreed_bytes > header_bytes || rank_offset >= header_bytes ||
      status_offset >= header_bytes || slot_stride % 4 != 0) {
    return cudaErrorInvalidValue;
  }
  CheckSlotHeadersKernel<<<1, kThreads, 0, stream>>>(
      static_cast<const unsigned char*>(slots), slot_stride, static_cast<const uint32_t*>(expected),
      header_bytes / 4, agreed_bytes / 4, rank_offset / 4, status_offset / 4,
      static_cast<uint32_t*>(headers_out), bad, count);
  return cudaGetLastError();
}

}  // namespace qtx::kernels::cuda
