#include "server/backend/device.h"

#include <cstring>
#include <vector>

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

absl::Status Device::CopyOnDevice(void* dst, const void* src, uint64_t bytes) {
  if (memory_kind() != tensor::MemoryKind::kHost) {
    return absl::FailedPreconditionError("device '" + name() +
                                         "' cannot copy within its memory (CopyOnDevice)");
  }
  if (bytes > 0) std::memcpy(dst, src, bytes);
  return absl::OkStatus();
}

}  // namespace qtx::server::backend
