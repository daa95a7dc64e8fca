// Internal to qtx_client_cuda (not installed): CUDA runtime errors as
// absl::Status. The driver functions the client calls are found through
// common/cuda_driver.h.
#ifndef QTX_CLIENT_CUDA_CUDA_STATUS_H_
#define QTX_CLIENT_CUDA_CUDA_STATUS_H_

#include <cuda_runtime_api.h>

#include <string_view>

#include "absl/status/status.h"

namespace qtx::cuda::internal {

// INTERNAL naming `what` and the CUDA error; clears the non-sticky error.
absl::Status CudaStatus(cudaError_t err, std::string_view what);

}  // namespace qtx::cuda::internal

#endif  // QTX_CLIENT_CUDA_CUDA_STATUS_H_
