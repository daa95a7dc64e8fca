#include "server/ops/output_placement.h"

#include <utility>

#include "absl/strings/str_format.h"
#include "common/status_macros.h"

namespace qtx::server::ops {

using tensor::DType;
using tensor::MemoryKind;

// Places one output of `bytes` bytes: the client's slice when given, else an
// inline buffer. Stages through device memory when the device cannot write
// the destination directly.
absl::Status PlaceOutput(const std::optional<tensor::RegionSliceSpec>& spec, uint64_t bytes,
                         uint64_t alignment, DType dtype, std::vector<int64_t> shape,
                         std::string_view field, const OpContext& ctx,
                         std::optional<PlacedOutput>& out) {
  out.emplace();
  PlacedOutput& p = *out;
  p.bytes = bytes;
  p.tensor.dtype = dtype;
  p.tensor.shape = std::move(shape);
  MemoryKind dst_kind = MemoryKind::kHost;
  if (spec.has_value()) {
    QTX_ASSIGN_OR_RETURN(p.slice,
                         tensor::ResolveOutputSlice(*spec, bytes, alignment, field, *ctx.regions));
    p.tensor.region = *spec;
    dst_kind = p.slice->memory;
  }
  if (dst_kind == MemoryKind::kDevice && ctx.device->memory_kind() == MemoryKind::kHost) {
    return absl::FailedPreconditionError(
        absl::StrFormat("%s: region '%s' is device memory, but this server computes on %s", field,
                        spec->region, ctx.device->name()));
  }
  if (dst_kind != ctx.device->memory_kind() && bytes > 0) {
    QTX_ASSIGN_OR_RETURN(p.staging, ctx.device->Allocate(bytes));
  }
  return absl::OkStatus();
}

// Inline buffers are sized only after every check passed.
void AllocateInline(std::optional<PlacedOutput>& out) {
  if (out.has_value() && !out->slice.has_value()) out->tensor.inline_data.resize(out->bytes);
}

absl::Status CopyBack(std::optional<PlacedOutput>& out, backend::Device& device) {
  if (!out.has_value() || out->staging.data() == nullptr) return absl::OkStatus();
  return device.CopyToHost(out->Destination(), out->staging.data(), out->bytes);
}

// A device-readable pointer to `view`'s bytes, staging a copy if needed.
absl::StatusOr<const void*> InputOnDevice(const tensor::TensorView& view, std::string_view field,
                                          const OpContext& ctx, backend::DeviceBuffer& staging) {
  if (view.byte_size == 0 || view.memory == ctx.device->memory_kind()) return view.data;
  if (view.memory == MemoryKind::kDevice) {
    return absl::FailedPreconditionError(
        absl::StrFormat("%s: the region is device memory, but this server computes on %s", field,
                        ctx.device->name()));
  }
  QTX_ASSIGN_OR_RETURN(staging, ctx.device->Allocate(view.byte_size));
  QTX_RETURN_IF_ERROR(ctx.device->CopyFromHost(staging.data(), view.data, view.byte_size));
  return static_cast<const void*>(staging.data());
}

absl::Status NoEventsOnChannel(const backend::CudaEvents& events, backend::ChannelQueue* queue) {
  if (queue == nullptr || events.empty()) return absl::OkStatus();
  return absl::InvalidArgumentError(
      "cuda_events: must be empty on a channel (the channel orders the op after the caller's "
      "stream)");
}

// A channel op enqueues its kernel and returns: its tensors must be where the
// device computes, with nothing for the host to copy or wait for.
absl::Status CheckChannelInput(const tensor::TensorView& view, std::string_view field,
                               const OpContext& ctx) {
  if (view.byte_size == 0) return absl::OkStatus();
  if (view.pin == nullptr) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: inline bytes on a channel: channel ops take slices of registered regions only",
        field));
  }
  if (view.memory != ctx.device->memory_kind()) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "%s: region '%s' is %s memory, but channel ops on %s need %s memory (register a %s "
        "region)",
        field, view.pin->name(), view.memory == MemoryKind::kHost ? "host" : "device",
        ctx.device->name(), ctx.device->memory_kind() == MemoryKind::kHost ? "host" : "device",
        ctx.device->memory_kind() == MemoryKind::kHost ? "shm" : "cuda_ipc"));
  }
  return absl::OkStatus();
}

absl::Status CheckChannelOutput(const PlacedOutput& out, std::string_view field,
                                const OpContext& ctx) {
  if (out.bytes == 0) return absl::OkStatus();
  if (!out.slice.has_value()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: not set: channel ops write into slices of registered regions only (inline results "
        "are not returned on a channel)",
        field));
  }
  if (out.staging.data() != nullptr || out.slice->memory != ctx.device->memory_kind()) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "%s: region '%s' is not %s's memory: channel ops never stage through the host (register "
        "a %s region)",
        field, out.slice->spec.region, ctx.device->name(),
        ctx.device->memory_kind() == MemoryKind::kHost ? "shm" : "cuda_ipc"));
  }
  return absl::OkStatus();
}

absl::Status CheckNoOverlap(const std::vector<NamedRange>& ranges) {
  for (size_t i = 0; i < ranges.size(); ++i) {
    for (size_t j = i + 1; j < ranges.size(); ++j) {
      if (tensor::RangesOverlap(ranges[i].data, ranges[i].size, ranges[j].data, ranges[j].size)) {
        return absl::InvalidArgumentError(
            absl::StrFormat("%s overlaps %s: outputs may not alias each other or an input",
                            ranges[j].field, ranges[i].field));
      }
    }
  }
  return absl::OkStatus();
}

absl::Status CheckInlineBudget(uint64_t inline_bytes, const OpContext& ctx, std::string_view what) {
  if (inline_bytes > ctx.max_inline_output_bytes) {
    return absl::ResourceExhaustedError(
        absl::StrFormat("%s: %d bytes of inline output exceed the server's limit of %d bytes "
                        "(--max_message_mb); write the outputs into a registered region instead",
                        what, inline_bytes, ctx.max_inline_output_bytes));
  }
  return absl::OkStatus();
}

std::vector<int64_t> ScaleShape(kernels::BlockScaling scaling, int64_t rows, int64_t cols) {
  if (scaling == kernels::BlockScaling::kTensor) return {1};
  return {rows, cols};
}

}  // namespace qtx::server::ops
