// Output placement, shared by the ops that return tensors (Quantize,
// Dequantize, AllGather): where each result buffer goes (the client's region
// slice, or an inline string sized once every check passed), staging through
// device memory when the device cannot write the destination, and the checks
// such an op makes before any work (aliasing, the inline budget, what a
// stream-ordered channel allows); then input staging and the copy back of
// staged outputs. No gRPC, no protobuf.
//
// Thread safety: the functions are safe for concurrent use; a PlacedOutput
// belongs to one op.
#ifndef QTX_SERVER_OPS_OUTPUT_PLACEMENT_H_
#define QTX_SERVER_OPS_OUTPUT_PLACEMENT_H_

#include <cstdint>
#include <optional>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/quantize_params.h"
#include "server/backend/device.h"
#include "server/ops/op_context.h"
#include "server/tensor/dtype.h"
#include "server/tensor/tensor_ref.h"

namespace qtx::server::ops {

// One output buffer: where the kernel writes it, and where it ends up.
// Not movable once kernel pointers have been taken (inline strings may use
// their small-string buffer).
struct PlacedOutput {
  OutputTensor tensor;
  std::optional<tensor::OutputSlice> slice;  // client region destination
  backend::DeviceBuffer staging;             // set when the device cannot write the destination
  uint64_t bytes = 0;

  void* Destination() {
    if (slice.has_value()) return slice->data;
    return tensor.inline_data.data();
  }
  void* KernelPointer() { return staging.data() != nullptr ? staging.data() : Destination(); }
};

// Places one output of `bytes` bytes: the client's slice `spec` when given
// (resolved at `alignment`; NOT_FOUND / INVALID_ARGUMENT naming `field`), else
// an inline buffer (sized later by AllocateInline). FAILED_PRECONDITION for a
// device-memory slice on a host device. Allocates device staging when the
// device cannot write the destination directly.
absl::Status PlaceOutput(const std::optional<tensor::RegionSliceSpec>& spec, uint64_t bytes,
                         uint64_t alignment, tensor::DType dtype, std::vector<int64_t> shape,
                         std::string_view field, const OpContext& ctx,
                         std::optional<PlacedOutput>& out);

// Sizes an inline output (no-op for an unset or region output). Call once
// every check passed.
void AllocateInline(std::optional<PlacedOutput>& out);

// Copies a staged output to its destination (no-op when not staged).
absl::Status CopyBack(std::optional<PlacedOutput>& out, backend::Device& device);

// A device-readable pointer to `view`'s bytes, staging a copy in `staging`
// when the device cannot read them where they are. FAILED_PRECONDITION for
// device memory on a host device.
absl::StatusOr<const void*> InputOnDevice(const tensor::TensorView& view, std::string_view field,
                                          const OpContext& ctx, backend::DeviceBuffer& staging);

// INVALID_ARGUMENT when `events` is set on a stream-ordered channel op.
absl::Status NoEventsOnChannel(const backend::CudaEvents& events, backend::ChannelQueue* queue);

// A channel op enqueues its kernel and returns: its tensors must be region
// slices where the device computes, with nothing for the host to copy or
// wait for. INVALID_ARGUMENT for inline bytes / an inline output,
// FAILED_PRECONDITION for memory the device does not compute on.
absl::Status CheckChannelInput(const tensor::TensorView& view, std::string_view field,
                               const OpContext& ctx);
absl::Status CheckChannelOutput(const PlacedOutput& out, std::string_view field,
                                const OpContext& ctx);

// A named byte range of an op's input or output, for CheckNoOverlap.
struct NamedRange {
  std::string_view field;
  const void* data;
  uint64_t size;
};

// INVALID_ARGUMENT naming the later of the first two ranges that share a
// byte: outputs may not alias each other or an input.
absl::Status CheckNoOverlap(const std::vector<NamedRange>& ranges);

// RESOURCE_EXHAUSTED (prefixed with `what`, the op) when the inline outputs
// exceed ctx.max_inline_output_bytes.
absl::Status CheckInlineBudget(uint64_t inline_bytes, const OpContext& ctx, std::string_view what);

// The shape reported for a scale_inv buffer of `rows` x `cols` entries
// (kernels::ComputeLayout's): [1] for the one scale of per-tensor scaling
// (TransformerEngine's shape, docs/numerics.md §9), else [rows, cols].
std::vector<int64_t> ScaleShape(kernels::BlockScaling scaling, int64_t rows, int64_t cols);

}  // namespace qtx::server::ops

#endif  // QTX_SERVER_OPS_OUTPUT_PLACEMENT_H_
