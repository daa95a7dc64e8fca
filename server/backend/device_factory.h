// Creates the Device named by qtxd's --device flag.
#ifndef QTX_SERVER_BACKEND_DEVICE_FACTORY_H_
#define QTX_SERVER_BACKEND_DEVICE_FACTORY_H_

#include <memory>
#include <string_view>

#include "absl/status/statusor.h"
#include "server/backend/device.h"

namespace qtx::server::backend {

// True when this binary was built with the CUDA backend.
bool BuiltWithCuda();

// "cpu" -> CpuDevice. "cuda" / "cuda:N" -> the CUDA device N (default 0), or
// FAILED_PRECONDITION "not built with CUDA" in a CPU-only build.
// INVALID_ARGUMENT for anything else (the message lists the accepted values).
absl::StatusOr<std::unique_ptr<Device>> CreateDevice(std::string_view spec);

}  // namespace qtx::server::backend

#endif  // QTX_SERVER_BACKEND_DEVICE_FACTORY_H_
