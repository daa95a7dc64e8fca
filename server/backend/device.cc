#include "server/backend/device.h"

#include <cstring>
#include <new>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/cpu/quantize_shard.h"

namespace qtx::server::backend {

absl::Status Device::CombineBoundaryAmax(int world_size, const kernels::ShardGeometry* geoms,
                                         const float* gathered, int64_t len, int rank,
                                         kernels::BlockScaling scaling, float* first_out,
                                         float* last_out) {
  if (geoms[rank].m == 0 || len == 0) return absl::OkStatus();
  const uint64_t per_rank = 2 * static_cast<uint64_t>(len);
  std::vector<float> all(per_rank * static_cast<uint64_t>(world_size));
  QTX_RETURN_IF_ERROR(CopyToHost(all.data(), gathered, 4 * all.size()));
  std::vector<const float*> firsts(world_size), lasts(world_size);
  for (int r = 0; r < world_size; ++r) {
    firsts[r] = all.data() + per_rank * r;
    lasts[r] = firsts[r] + len;
  }
  return CombineHostBoundaryAmax(world_size, geoms, firsts.data(), lasts.data(), len, rank, scaling,
                                 first_out, last_out);
}

absl::Status Device::CombineHostBoundaryAmax(int world_size, const kernels::ShardGeometry* geoms,
                                             const float* const* firsts, const float* const* lasts,
                                             int64_t len, int rank, kernels::BlockScaling scaling,
                                             float* first_out, float* last_out) {
  if (len == 0) return absl::OkStatus();
  std::vector<float> combined(2 * static_cast<uint64_t>(len), 0.0f);
  // Writes nothing for an empty shard of this rank: the zeros are copied.
  kernels::cpu::CombineBoundaryAmax(world_size, geoms, firsts, lasts, rank, scaling,
                                    combined.data(), combined.data() + len);
  QTX_RETURN_IF_ERROR(CopyFromHost(first_out, combined.data(), 4 * static_cast<uint64_t>(len)));
  return CopyFromHost(last_out, combined.data() + len, 4 * static_cast<uint64_t>(len));
}

absl::StatusOr<DeviceBuffer> Device::AllocateHostVisible(uint64_t bytes) {
  if (bytes == 0) return DeviceBuffer();
  auto* p = new (std::nothrow) std::byte[bytes]();
  if (p == nullptr) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot allocate ", bytes, " bytes of host memory"));
  }
  return DeviceBuffer(p, bytes, [](void* q) { delete[] static_cast<std::byte*>(q); });
}

absl::Status Device::CheckSlotHeaders(const SlotHeaderCheck& a) {
  if (memory_kind() != tensor::MemoryKind::kHost) {
    return absl::FailedPreconditionError("device '" + name() +
                                         "' cannot check slot headers (CheckSlotHeaders)");
  }
  const auto* slots = static_cast<const std::byte*>(a.slots);
  auto* out = static_cast<std::byte*>(a.headers_out);
  uint32_t bad = 0;
  for (int r = 0; r < a.count; ++r) {
    const std::byte* h = slots + a.slot_stride * static_cast<uint64_t>(r);
    std::memcpy(out + static_cast<uint64_t>(a.header_bytes) * r, h, a.header_bytes);
    int32_t rank = 0, status = 0;
    std::memcpy(&rank, h + a.rank_offset, 4);
    std::memcpy(&status, h + a.status_offset, 4);
    if (std::memcmp(h, a.expected, a.agreed_bytes) != 0 || rank != r || status != 0) ++bad;
  }
  *a.bad = bad;
  return absl::OkStatus();
}

absl::Status Device::CopyOnDevice(void* dst, const void* src, uint64_t bytes) {
  if (memory_kind() != tensor::MemoryKind::kHost) {
    return absl::FailedPreconditionError("device '" + name() +
                                         "' cannot copy within its memory (CopyOnDevice)");
  }
  if (bytes > 0) std::memcpy(dst, src, bytes);
  return absl::OkStatus();
}

}  // namespace qtx::server::backend
