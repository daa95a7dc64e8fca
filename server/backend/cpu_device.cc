#include "server/backend/cpu_device.h"

#include <cstdlib>
#include <cstring>
#include <new>

#include "absl/strings/str_format.h"
#include "kernels/cpu/quantize_block.h"

namespace qtx::server::backend {

absl::StatusOr<DeviceBuffer> CpuDevice::Allocate(uint64_t bytes) {
  if (bytes == 0) return DeviceBuffer();
  // 64-byte alignment suits every element type and vector width.
  const uint64_t rounded = (bytes + 63) / 64 * 64;
  if (rounded < bytes) {
    return absl::ResourceExhaustedError(absl::StrFormat("cpu: cannot allocate %d bytes", bytes));
  }
  void* p = std::aligned_alloc(64, rounded);
  if (p == nullptr) {
    return absl::ResourceExhaustedError(
        absl::StrFormat("cpu: out of host memory allocating %d bytes", bytes));
  }
  return DeviceBuffer(p, bytes, [](void* q) { std::free(q); });
}

absl::Status CpuDevice::CopyFromHost(void* device_dst, const void* host_src, uint64_t bytes) {
  if (bytes != 0) std::memcpy(device_dst, host_src, bytes);
  return absl::OkStatus();
}

absl::Status CpuDevice::CopyToHost(void* host_dst, const void* device_src, uint64_t bytes) {
  if (bytes != 0) std::memcpy(host_dst, device_src, bytes);
  return absl::OkStatus();
}

absl::Status CpuDevice::Quantize(const QuantizeArgs& args) {
  kernels::cpu::QuantizeBlock(args.input, args.dtype, args.m, args.n, args.params, args.out);
  return absl::OkStatus();
}

absl::Status CpuDevice::Dequantize(const DequantizeArgs& args) {
  kernels::cpu::DequantizeBlock(args.in, args.scaling, args.format, args.m, args.n,
                                args.use_rowwise, args.out_dtype, args.out);
  return absl::OkStatus();
}

absl::Status CpuDevice::ShardBoundaryAmax(const ShardArgs& args, float* first, float* last) {
  kernels::cpu::ShardBoundaryAmax(args.input, args.dtype, args.geom, args.params.scaling, first,
                                  last);
  return absl::OkStatus();
}

absl::Status CpuDevice::QuantizeShard(const ShardArgs& args, const float* first_amax,
                                      const float* last_amax,
                                      const kernels::QuantizedBuffers& out) {
  kernels::cpu::QuantizeShard(args.input, args.dtype, args.geom, args.params, first_amax,
                              last_amax, out);
  return absl::OkStatus();
}

absl::Status CpuDevice::AssembleShards(int world_size, const kernels::ShardGeometry* geoms,
                                       const kernels::QuantizedConstBuffers* shards,
                                       const kernels::QuantizeParams& params,
                                       const kernels::QuantizedBuffers& out) {
  kernels::cpu::AssembleShards(world_size, geoms, shards, params, out);
  return absl::OkStatus();
}

}  // namespace qtx::server::backend
