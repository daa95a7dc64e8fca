// The one-round all-gather's slot check on the GPU (server/backend/device.h
// SlotHeaderCheck says what it checks): one CTA compares every slot's header
// with the expected one, copies the headers out, then writes the number of
// failing header words to *bad (0: every slot passes). Plain header: CUDA
// runtime types only.
#ifndef QTX_KERNELS_CUDA_SLOT_CHECK_H_
#define QTX_KERNELS_CUDA_SLOT_CHECK_H_

#include <cuda_runtime_api.h>

#include <cstdint>

namespace qtx::kernels::cuda {

// `slots`: device memory; `expected`, `headers_out`, `bad`: memory the GPU
// can address (mapped page-locked host memory or device memory). Enqueued
// on `stream`; nothing synchronizes. cudaErrorInvalidValue for a header
// size or offset that is not a multiple of 4, an offset outside the header
// or a negative count.
cudaError_t CheckSlotHeaders(const void* slots, uint64_t slot_stride, int count,
                             const void* expected, uint32_t header_bytes, uint32_t agreed_bytes,
                             uint32_t rank_offset, uint32_t status_offset, void* headers_out,
                             uint32_t* bad, cudaStream_t stream);

}  // namespace qtx::kernels::cuda

#endif  // QTX_KERNELS_CUDA_SLOT_CHECK_H_
