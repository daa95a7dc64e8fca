// What every op shares: the server context it runs in (OpContext: regions,
// device, limits), when its work counts as short (InlineLimits), the result
// buffer it returns (OutputTensor), and the checks every op makes on its
// CUDA events and on a tensor's 2-D view. No gRPC, no protobuf.
//
// Thread safety: plain structs; the functions are safe for concurrent use.
#ifndef QTX_SERVER_OPS_OP_CONTEXT_H_
#define QTX_SERVER_OPS_OP_CONTEXT_H_

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "server/backend/device.h"
#include "server/tensor/dtype.h"
#include "server/tensor/region_table.h"
#include "server/tensor/tensor_ref.h"

namespace qtx::server::ops {

// Length of a cudaIpcEventHandle_t.
inline constexpr size_t kCudaIpcEventHandleBytes = 64;

// When an op's work is short enough for server/api to run it on the gRPC
// thread that received the call (no hand-off to a worker thread).
struct InlineLimits {
  // Bytes the host computes on or copies (the kernel's input on a host
  // device; staged inputs and outputs on a CUDA device).
  uint64_t max_host_bytes = uint64_t{64} << 10;
  // Input bytes of a device kernel that the host waits for (on the order of
  // 50 us of an H200's bandwidth at 64 MiB).
  uint64_t max_device_bytes = uint64_t{64} << 20;
};

// What an op needs from the server. Not owned.
struct OpContext {
  const tensor::RegionTable* regions = nullptr;
  backend::Device* device = nullptr;
  tensor::ShapeLimits limits;
  // Total bytes an op may return inline (the gRPC send limit, less headroom).
  uint64_t max_inline_output_bytes = uint64_t{1} << 30;
  InlineLimits inline_limits;
};

// One result buffer: written into the client's region slice, or returned in
// `inline_data`.
struct OutputTensor {
  tensor::DType dtype = tensor::DType::kUnspecified;
  std::vector<int64_t> shape;
  std::optional<tensor::RegionSliceSpec> region;  // set: written there
  std::string inline_data;                        // else: the bytes
};

// OK if `events` is empty, or each set handle is exactly 64 bytes and the
// device computes on device memory. INVALID_ARGUMENT for a wrong length
// (naming "cuda_events.wait_event" / "cuda_events.signal_event"),
// FAILED_PRECONDITION on a host device.
absl::Status ValidateCudaEvents(const backend::CudaEvents& events, const OpContext& ctx);

// (M, N) of a validated shape: N = last dim, M = product of the others.
struct Matrix2D {
  int64_t m = 0;
  int64_t n = 0;
};
// REQUIRES: `shape` passed tensor::ValidateShape. INVALID_ARGUMENT if M
// exceeds limits.max_elements (possible only when N == 0).
absl::StatusOr<Matrix2D> FlattenTo2D(const std::vector<int64_t>& shape, std::string_view field,
                                     const tensor::ShapeLimits& limits);

}  // namespace qtx::server::ops

#endif  // QTX_SERVER_OPS_OP_CONTEXT_H_
