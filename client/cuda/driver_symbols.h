// Internal to qtx_client_cuda (not installed): CUDA status conversion and
// the driver functions the client calls, found through the runtime so that
// nothing links against libcuda.
#ifndef QTX_CLIENT_CUDA_DRIVER_SYMBOLS_H_
#define QTX_CLIENT_CUDA_DRIVER_SYMBOLS_H_

#include <cuda_runtime_api.h>

#include <span>
#include <string_view>
#include <utility>

#include "absl/status/status.h"

namespace qtx::cuda::internal {

// INTERNAL naming `what` and the CUDA error; clears the non-sticky error.
absl::Status CudaStatus(cudaError_t err, std::string_view what);

// Sets each slot to the driver function of that name (CUDA 12 ABI).
// FAILED_PRECONDITION naming the first one the driver lacks.
absl::Status LoadDriverSymbols(std::span<const std::pair<const char*, void**>> wanted);

}  // namespace qtx::cuda::internal

#endif  // QTX_CLIENT_CUDA_DRIVER_SYMBOLS_H_
