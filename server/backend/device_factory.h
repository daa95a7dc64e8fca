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

// A parsed --device value.
struct DeviceSpec {
  enum class Kind { kAuto, kCpu, kCuda };
  Kind kind = Kind::kAuto;
  int ordinal = 0;  // kCuda only
};

// "auto" | "cpu" | "cuda" (= cuda:0) | "cuda:N" (N a decimal integer >= 0).
// INVALID_ARGUMENT for anything else; the message lists the accepted values.
absl::StatusOr<DeviceSpec> ParseDeviceSpec(std::string_view spec);

// "cpu" -> CpuDevice. "cuda" / "cuda:N" -> the CUDA device N, or
// FAILED_PRECONDITION "not built with CUDA" in a CPU-only build or when the
// host has no usable GPU/driver, NOT_FOUND when no such GPU is visible. "auto" -> cuda:0 when this
// is a CUDA build and a GPU is visible, else cpu (a cuda:0 that fails to start falls back to cpu
// with a warning). Logs which device was chosen and why. INVALID_ARGUMENT for anything else (the
// message lists the accepted values).
absl::StatusOr<std::unique_ptr<Device>> CreateDevice(std::string_view spec);

}  // namespace qtx::server::backend

#endif  // QTX_SERVER_BACKEND_DEVICE_FACTORY_H_
