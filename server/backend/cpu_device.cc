#include "server/backend/cpu_device.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <thread>

#include "absl/strings/str_format.h"
#include "kernels/cpu/quantize_block.h"
#include "kernels/cpu/quantize_shard.h"

namespace qtx::server::backend {
namespace {

// The flag words are shared with another process (shm): accessed only as
// lock-free 64-bit atomics.
static_assert(std::atomic_ref<uint64_t>::is_always_lock_free);

class CpuChannelQueue final : public ChannelQueue {
 public:
  explicit CpuChannelQueue(std::byte* flags)
      : ready_(reinterpret_cast<uint64_t*>(flags)), done_(reinterpret_cast<uint64_t*>(flags) + 1) {}

  absl::Status WaitReady(uint64_t seq) override {
    // Spin briefly (a client that submits right after its ready store), then
    // back off to sleeps of up to 200 us (a client whose work runs later).
    auto sleep = std::chrono::microseconds(1);
    for (int spins = 0;; ++spins) {
      const uint64_t ready = std::atomic_ref<uint64_t>(*ready_).load(std::memory_order_acquire);
      if (static_cast<int64_t>(ready - seq) >= 0) break;
      if (released_.load(std::memory_order_acquire)) break;
      if (spins < 64) {
        std::this_thread::yield();
      } else {
        std::this_thread::sleep_for(sleep);
        sleep = std::min(sleep * 2, std::chrono::microseconds(200));
      }
    }
    return absl::OkStatus();
  }

  absl::Status WriteDone(uint64_t value) override {
    std::atomic_ref<uint64_t>(*done_).store(value, std::memory_order_release);
    return absl::OkStatus();
  }

  absl::Status OnDrained(std::function<void()> drained) override {
    drained();  // the work ran on the calling thread: it is done
    return absl::OkStatus();
  }

  void Release() override { released_.store(true, std::memory_order_release); }

  void ReleaseClientWaits(uint64_t value) override {
    std::atomic_ref<uint64_t>(*done_).store(value, std::memory_order_release);
  }

  std::string DescribeState() override {
    return absl::StrFormat("ready=%d done=%d released=%s",
                           std::atomic_ref<uint64_t>(*ready_).load(std::memory_order_acquire),
                           std::atomic_ref<uint64_t>(*done_).load(std::memory_order_acquire),
                           released_.load(std::memory_order_acquire) ? "yes" : "no");
  }

 private:
  uint64_t* const ready_;
  uint64_t* const done_;
  std::atomic<bool> released_{false};
};

}  // namespace

absl::StatusOr<std::unique_ptr<ChannelQueue>> CpuDevice::OpenChannelQueue(
    std::byte* flags, tensor::MemoryKind flags_kind) {
  if (flags_kind != tensor::MemoryKind::kHost) {
    return absl::FailedPreconditionError(
        "open.flags: channels on the cpu device need their flags in host memory (a shm region)");
  }
  return std::make_unique<CpuChannelQueue>(flags);
}

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
  kernels::cpu::QuantizeShard(args.input, args.dtype, args.geom, args.params, first_amax, last_amax,
                              out);
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
