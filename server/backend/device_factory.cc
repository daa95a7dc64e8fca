#include "server/backend/device_factory.h"

#include <string>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "server/backend/cpu_device.h"
#include "spdlog/spdlog.h"
#if defined(QTX_HAVE_CUDA_DEVICE)
#include "server/backend/cuda_device.h"
#endif

namespace qtx::server::backend {

bool BuiltWithCuda() {
#if defined(QTX_HAVE_CUDA_DEVICE)
  return true;
#else
  return false;
#endif
}

absl::StatusOr<DeviceSpec> ParseDeviceSpec(std::string_view spec) {
  DeviceSpec out;
  if (spec == "auto") return out;
  if (spec == "cpu") {
    out.kind = DeviceSpec::Kind::kCpu;
    return out;
  }
  if (spec == "cuda") {
    out.kind = DeviceSpec::Kind::kCuda;
    return out;
  }
  if (spec.starts_with("cuda:")) {
    const std::string_view digits = spec.substr(5);
    bool all_digits = !digits.empty() && digits.size() <= 6;
    for (char c : digits) all_digits = all_digits && absl::ascii_isdigit(c);
    int ordinal = 0;
    if (!all_digits || !absl::SimpleAtoi(std::string(digits), &ordinal)) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "--device=%s: the CUDA ordinal must be a decimal integer >= 0 (e.g. cuda:0)", spec));
    }
    out.kind = DeviceSpec::Kind::kCuda;
    out.ordinal = ordinal;
    return out;
  }
  return absl::InvalidArgumentError(
      absl::StrFormat("--device=%s: must be auto, cpu, cuda or cuda:N", spec));
}

absl::StatusOr<std::unique_ptr<Device>> CreateDevice(std::string_view spec) {
  auto parsed = ParseDeviceSpec(spec);
  if (!parsed.ok()) return parsed.status();
  switch (parsed->kind) {
    case DeviceSpec::Kind::kCpu:
      return std::make_unique<CpuDevice>();
    case DeviceSpec::Kind::kCuda: {
#if defined(QTX_HAVE_CUDA_DEVICE)
      auto device = CudaDevice::Create(parsed->ordinal);
      if (!device.ok()) {
        return absl::Status(device.status().code(),
                            absl::StrFormat("--device=%s: %s", spec, device.status().message()));
      }
      return std::unique_ptr<Device>(std::move(*device));
#else
      return absl::FailedPreconditionError(absl::StrFormat(
          "--device=%s: this qtxd was not built with CUDA (rebuild with -DQTX_WITH_CUDA=ON on a "
          "machine with the CUDA toolkit, or use --device=cpu)",
          spec));
#endif
    }
    case DeviceSpec::Kind::kAuto:
      break;
  }
#if defined(QTX_HAVE_CUDA_DEVICE)
  const int visible = VisibleCudaDevices();
  if (visible > 0) {
    auto device = CudaDevice::Create(0);
    if (device.ok()) {
      spdlog::info(
          "event=device_selected device=cuda:0 reason=\"--device=auto: {} CUDA device(s) "
          "visible\"",
          visible);
      return std::unique_ptr<Device>(std::move(*device));
    }
    spdlog::warn(
        "event=device_selected device=cpu reason=\"--device=auto: cuda:0 failed to "
        "start: {}\"",
        std::string(device.status().message()));
    return std::make_unique<CpuDevice>();
  }
  spdlog::info("event=device_selected device=cpu reason=\"--device=auto: no CUDA device visible\"");
#else
  spdlog::info("event=device_selected device=cpu reason=\"--device=auto: built without CUDA\"");
#endif
  return std::make_unique<CpuDevice>();
}

}  // namespace qtx::server::backend
