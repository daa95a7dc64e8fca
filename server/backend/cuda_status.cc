#include "server/backend/cuda_status.h"

#include "absl/strings/str_format.h"

namespace qtx::server::backend {

absl::Status CudaErrorToStatus(cudaError_t err, std::string_view expr, std::string_view file,
                               int line) {
  if (err == cudaSuccess) return absl::OkStatus();
  // Clear the (non-sticky) last error so the next call on this thread starts
  // clean; a sticky error (a kernel fault) keeps failing every later call.
  (void)cudaGetLastError();
  const size_t slash = file.rfind('/');
  const std::string_view base = slash == std::string_view::npos ? file : file.substr(slash + 1);
  const std::string message =
      absl::StrFormat("CUDA error %s (%s) in %s at %s:%d", cudaGetErrorName(err),
                      cudaGetErrorString(err), expr, base, line);
  if (err == cudaErrorMemoryAllocation) return absl::ResourceExhaustedError(message);
  return absl::InternalError(message);
}

}  // namespace qtx::server::backend
