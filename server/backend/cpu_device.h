// CpuDevice: the Device backed by the bit-exact CPU reference (kernels/cpu,
// OpenMP inside). Memory is ordinary host memory. Safe for concurrent use.
#ifndef QTX_SERVER_BACKEND_CPU_DEVICE_H_
#define QTX_SERVER_BACKEND_CPU_DEVICE_H_

#include <string>

#include "server/backend/device.h"

namespace qtx::server::backend {

class CpuDevice final : public Device {
 public:
  CpuDevice() = default;
  CpuDevice(const CpuDevice&) = delete;
  CpuDevice& operator=(const CpuDevice&) = delete;

  std::string name() const override { return "cpu"; }
  tensor::MemoryKind memory_kind() const override { return tensor::MemoryKind::kHost; }
  absl::StatusOr<DeviceBuffer> Allocate(uint64_t bytes) override;
  absl::Status CopyFromHost(void* device_dst, const void* host_src, uint64_t bytes) override;
  absl::Status CopyToHost(void* host_dst, const void* device_src, uint64_t bytes) override;
  absl::Status Quantize(const QuantizeArgs& args) override;
  absl::Status Dequantize(const DequantizeArgs& args) override;
};

}  // namespace qtx::server::backend

#endif  // QTX_SERVER_BACKEND_CPU_DEVICE_H_
