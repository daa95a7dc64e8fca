// GroupState: one optimizer parameter group's complete state as plain owned
// buffers — what the store steps and what a checkpoint holds. One owner at a
// time (the store guards it with the group's mutex).
#ifndef QTX_SERVER_OPTIMIZER_GROUP_STATE_H_
#define QTX_SERVER_OPTIMIZER_GROUP_STATE_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "absl/status/statusor.h"
#include "server/optimizer/optimizer_store.h"

namespace qtx::server::optimizer {

struct ParamState {
  ParameterInfo info;
  std::unique_ptr<float[]> master;     // info.count() FP32 (the owned elements)
  std::unique_ptr<uint8_t[]> exp_avg;  // info.count() of the group's moment dtype
  std::unique_ptr<uint8_t[]> exp_avg_sq;
  // The FP8 scale of each 128x128 tile at the last fused step
  // (kernels::cpu::AdamWParamBuffers::tile_scales: the next step encodes a
  // tile whose scale did not move while updating it). A cache: not saved, and
  // never changes a result.
  std::vector<float> tile_scales;
};

struct GroupState {
  GroupConfig config;             // config.step: steps processed
  int64_t update_count = 0;       // steps applied (AdamW's t)
  std::optional<StepStats> last;  // result of step config.step, when known
  std::vector<ParamState> params;
};

inline uint64_t MomentBytes(kernels::MomentDType t) {
  return t == kernels::MomentDType::kFloat32 ? 4 : 2;
}

// Host bytes of a group's state: per element 4 (master) + 2 moments.
// REQUIRES: the element counts were validated (no overflow).
inline uint64_t StateBytes(int64_t elements, kernels::MomentDType t) {
  return static_cast<uint64_t>(elements) * (4 + 2 * MomentBytes(t));
}

// Allocates (uninitialized) buffers for `info`. RESOURCE_EXHAUSTED when the
// allocation fails.
absl::StatusOr<ParamState> AllocateParamState(const ParameterInfo& info,
                                              kernels::MomentDType moment_dtype);

}  // namespace qtx::server::optimizer

#endif  // QTX_SERVER_OPTIMIZER_GROUP_STATE_H_
