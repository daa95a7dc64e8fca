#include "server/ops/op_context.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace qtx::server::ops {

using tensor::MemoryKind;

absl::Status ValidateCudaEvents(const backend::CudaEvents& events, const OpContext& ctx) {
  if (events.empty()) return absl::OkStatus();
  const struct {
    const std::string& handle;
    std::string_view field;
  } handles[] = {{events.wait_event, "cuda_events.wait_event"},
                 {events.signal_event, "cuda_events.signal_event"}};
  for (const auto& h : handles) {
    if (!h.handle.empty() && h.handle.size() != kCudaIpcEventHandleBytes) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s: %d bytes, must be exactly %d (a cudaIpcEventHandle_t)", h.field,
                          h.handle.size(), kCudaIpcEventHandleBytes));
    }
  }
  if (ctx.device->memory_kind() != MemoryKind::kDevice) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "cuda_events: interprocess CUDA events need a CUDA device, but this server computes on "
        "%s (start qtxd with --device=cuda:N)",
        ctx.device->name()));
  }
  return absl::OkStatus();
}

absl::StatusOr<Matrix2D> FlattenTo2D(const std::vector<int64_t>& shape, std::string_view field,
                                     const tensor::ShapeLimits& limits) {
  Matrix2D mn;
  if (shape.empty()) {
    return absl::InvalidArgumentError(absl::StrFormat("%s.shape: rank 0, must be >= 1", field));
  }
  mn.n = shape.back();
  mn.m = 1;
  for (size_t i = 0; i + 1 < shape.size(); ++i) {
    // Only reachable past the element limit when N == 0.
    if (__builtin_mul_overflow(mn.m, shape[i], &mn.m) || mn.m > limits.max_elements) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s.shape=%s: the row count prod(shape[:-1]) exceeds the element limit %d", field,
          absl::StrCat("[", absl::StrJoin(shape, ", "), "]"), limits.max_elements));
    }
  }
  return mn;
}

}  // namespace qtx::server::ops
