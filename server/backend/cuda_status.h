// CUDA runtime errors as absl::Status, and QTX_CUDA_RETURN_IF_ERROR.
//
//   QTX_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
//
// returns, on failure, kInternal (kResourceExhausted for an out-of-memory
// error) with the expression, file:line, cudaGetErrorName and
// cudaGetErrorString, and clears the thread's last CUDA error
// (cudaGetLastError) so it does not leak into the next request.
// Thread-safe; CUDA builds only.
#ifndef QTX_SERVER_BACKEND_CUDA_STATUS_H_
#define QTX_SERVER_BACKEND_CUDA_STATUS_H_

#include <cuda_runtime_api.h>

#include <string_view>

#include "absl/status/status.h"

namespace qtx::server::backend {

// The status for `err` raised by `expr` at file:line. OK for cudaSuccess.
// Clears the thread's last CUDA error.
absl::Status CudaErrorToStatus(cudaError_t err, std::string_view expr, std::string_view file,
                               int line);

}  // namespace qtx::server::backend

#define QTX_CUDA_RETURN_IF_ERROR(expr)                                                            \
  do {                                                                                            \
    const cudaError_t qtx_cuda_err_ = (expr);                                                     \
    if (qtx_cuda_err_ != cudaSuccess) {                                                           \
      return ::qtx::server::backend::CudaErrorToStatus(qtx_cuda_err_, #expr, __FILE__, __LINE__); \
    }                                                                                             \
  } while (false)

#endif  // QTX_SERVER_BACKEND_CUDA_STATUS_H_
