// CpuDevice: the Device backed by the bit-exact CPU reference (kernels/cpu,
// OpenMP inside). Memory is ordinary host memory. Safe for concurrent use.
#ifndef QTX_SERVER_BACKEND_CPU_DEVICE_H_
#define QTX_SERVER_BACKEND_CPU_DEVICE_H_

#include <string>

#include "server/backend/device.h"

namespace qtx::server::backend {

class CpuDevice : public Device {
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
  absl::Status ShardBoundaryAmax(const ShardArgs& args, float* first, float* last) override;
  absl::Status QuantizeShard(const ShardArgs& args, const float* first_amax, const float* last_amax,
                             const kernels::QuantizedBuffers& out) override;
  // A queue that is the calling thread: WaitReady blocks until the ready
  // word (host memory, e.g. a client's shm) reaches the value, or Release();
  // WriteDone stores with release order; OnDrained calls back at once.
  absl::StatusOr<std::unique_ptr<ChannelQueue>> OpenChannelQueue(
      std::byte* flags, tensor::MemoryKind flags_kind) override;
  absl::Status AssembleShards(int world_size, const kernels::ShardGeometry* geoms,
                              const kernels::QuantizedConstBuffers* shards,
                              const kernels::QuantizeParams& params,
                              const kernels::QuantizedBuffers& out) override;
};

}  // namespace qtx::server::backend

#endif  // QTX_SERVER_BACKEND_CPU_DEVICE_H_
