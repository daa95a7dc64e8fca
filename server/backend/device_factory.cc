#include "server/backend/device_factory.h"

#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "server/backend/cpu_device.h"

namespace qtx::server::backend {

bool BuiltWithCuda() {
#if defined(QTX_HAVE_CUDA_DEVICE)
  return true;
#else
  return false;
#endif
}

absl::StatusOr<std::unique_ptr<Device>> CreateDevice(std::string_view spec) {
  if (spec == "cpu") return std::make_unique<CpuDevice>();
  if (spec == "cuda" || spec.starts_with("cuda:")) {
    int ordinal = 0;
    if (spec.size() > 5 &&
        (!absl::SimpleAtoi(std::string(spec.substr(5)), &ordinal) || ordinal < 0)) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "--device=%s: the CUDA ordinal must be an integer >= 0 (e.g. cuda:0)", spec));
    }
    if (spec == "cuda:") {
      return absl::InvalidArgumentError("--device=cuda:: missing CUDA ordinal (e.g. cuda:0)");
    }
#if defined(QTX_HAVE_CUDA_DEVICE)
    // Hook: return CreateCudaDevice(ordinal) once server/backend has one.
#endif
    return absl::FailedPreconditionError(absl::StrFormat(
        "--device=%s: this qtxd was not built with CUDA (rebuild with -DQTX_WITH_CUDA=ON on a "
        "machine with the CUDA toolkit, or use --device=cpu)",
        spec));
  }
  return absl::InvalidArgumentError(
      absl::StrFormat("--device=%s: must be cpu, cuda or cuda:N", spec));
}

}  // namespace qtx::server::backend
