// Quantize / Dequantize ops: validate a request expressed in plain structs,
// compute the GEMM-ready layouts (kernels::ComputeLayout, docs/numerics.md §4),
// locate or allocate the outputs, run the Device, and return where the
// results went. No gRPC, no protobuf: server/api converts.
//
// Every check happens before any work; messages name the field and value.
// Thread safety: the functions are safe for concurrent use; the OpContext's
// members must be.
#ifndef QTX_SERVER_OPS_QUANTIZE_H_
#define QTX_SERVER_OPS_QUANTIZE_H_

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/block_geometry.h"
#include "kernels/quantize_params.h"
#include "server/backend/device.h"
#include "server/ops/op_context.h"
#include "server/ops/output_placement.h"
#include "server/tensor/dtype.h"
#include "server/tensor/tensor_ref.h"

namespace qtx::server::ops {

// Client-chosen destinations; an unset slice means "return inline".
struct QuantizeOutputSpecs {
  std::optional<tensor::RegionSliceSpec> rowwise_data;
  std::optional<tensor::RegionSliceSpec> rowwise_scale_inv;
  std::optional<tensor::RegionSliceSpec> columnwise_data;
  std::optional<tensor::RegionSliceSpec> columnwise_scale_inv;
};

// The four buffers of a quantized tensor, in the order of the ops' output
// arrays: rowwise data, rowwise scale_inv, columnwise data, columnwise
// scale_inv. Their request fields, and their element sizes (the alignment of
// a region slice).
inline constexpr std::string_view kQuantizedOutputFields[4] = {
    "outputs.rowwise_data", "outputs.rowwise_scale_inv", "outputs.columnwise_data",
    "outputs.columnwise_scale_inv"};
inline constexpr uint64_t kQuantizedOutputAlignment[4] = {1, 4, 1, 4};
// Buffer i's name without the request field's "outputs." ("rowwise_data", ...).
inline constexpr std::string_view QuantizedOutputName(int i) {
  return kQuantizedOutputFields[i].substr(sizeof("outputs.") - 1);
}

// `specs`' destination of buffer i (0..3, in the order above).
const std::optional<tensor::RegionSliceSpec>& OutputSpec(const QuantizeOutputSpecs& specs, int i);

// Whether `params` asks for buffer i (the rowwise pair or the columnwise one).
inline bool OutputRequested(const kernels::QuantizeParams& params, int i) {
  return i < 2 ? params.rowwise : params.columnwise;
}

// One buffer of a quantized tensor: whether it is requested, its bytes, dtype
// (FLOAT8_E4M3 / FLOAT8_E5M2 data, FLOAT32 scale_inv) and shape ([rows, cols];
// ScaleShape for the scale_inv).
struct QuantizedBufferInfo {
  bool requested = false;
  uint64_t bytes = 0;
  tensor::DType dtype = tensor::DType::kUnspecified;
  std::vector<int64_t> shape;
};

// The four buffers of a tensor quantized with `params` into `layout`
// (kernels::ComputeLayout(params.scaling, m, n)). INVALID_ARGUMENT naming the
// field when a byte count overflows.
absl::StatusOr<std::array<QuantizedBufferInfo, 4>> DescribeQuantizedOutputs(
    const kernels::QuantizeParams& params, const kernels::QuantizedLayout& layout);

// Places each requested buffer with PlaceOutput (the client's slice in
// `specs`, else an inline buffer); outs[i] stays unset for a buffer not
// requested. PlaceOutput's errors, naming kQuantizedOutputFields[i].
absl::Status PlaceQuantizedOutputs(const QuantizeOutputSpecs& specs,
                                   const std::array<QuantizedBufferInfo, 4>& buffers,
                                   const OpContext& ctx,
                                   std::array<std::optional<PlacedOutput>, 4>& outs);

struct QuantizeRequestSpec {
  tensor::TensorRefSpec input;
  kernels::QuantizeParams params;  // defaults already applied by the caller
  QuantizeOutputSpecs outputs;
  // Interprocess CUDA events (see backend::CudaEvents); CUDA device only.
  // With a signal event the op may return before the outputs are written.
  backend::CudaEvents events;
  // Set by a stream-ordered channel (server/ops/channel.h): the op is
  // enqueued on it and returns at once. Then every tensor must be a region
  // slice in the device's memory (no inline bytes, no staging) and `events`
  // empty, else INVALID_ARGUMENT / FAILED_PRECONDITION before any work.
  backend::ChannelQueue* queue = nullptr;
};

struct QuantizeResult {
  std::vector<int64_t> shape;  // the input's logical shape
  tensor::DType source_dtype = tensor::DType::kUnspecified;
  kernels::QuantizeParams params;
  // Present for the requested copies. Data: [M, N] / [N, M] of FLOAT8_E4M3 or
  // FLOAT8_E5M2; scales: FLOAT32 with the layout's [rows, cols] ([1] for
  // BlockScaling::kTensor).
  std::optional<OutputTensor> rowwise_data;
  std::optional<OutputTensor> rowwise_scale_inv;
  std::optional<OutputTensor> columnwise_data;
  std::optional<OutputTensor> columnwise_scale_inv;
};

// A quantized tensor handed back for dequantization. A copy is present when
// its data ref is set.
struct QuantizedTensorSpec {
  std::vector<int64_t> shape;
  kernels::BlockScaling scaling = kernels::BlockScaling::kBlock1D;
  kernels::Fp8Format format = kernels::Fp8Format::kE4M3;
  std::optional<tensor::TensorRefSpec> rowwise_data;
  std::optional<tensor::TensorRefSpec> rowwise_scale_inv;
  std::optional<tensor::TensorRefSpec> columnwise_data;
  std::optional<tensor::TensorRefSpec> columnwise_scale_inv;
};

struct DequantizeRequestSpec {
  QuantizedTensorSpec input;
  tensor::DType output_dtype = tensor::DType::kUnspecified;  // unspecified: FLOAT32
  std::optional<tensor::RegionSliceSpec> output;             // unset: inline
  backend::CudaEvents events;                                // as for Quantize
  backend::ChannelQueue* queue = nullptr;                    // as for Quantize
};

// INVALID_ARGUMENT unless at least one of rowwise/columnwise is set and
// amax_epsilon is finite and >= 0. `field` prefixes messages ("config").
absl::Status ValidateQuantizeParams(const kernels::QuantizeParams& params, std::string_view field);

// Quantizes `request.input`. Errors: INVALID_ARGUMENT for any bad field
// (dtype not FLOAT32/BFLOAT16/FLOAT16, shape, byte counts, usages, epsilon,
// an output slice for a copy that was not requested, wrong output slice size,
// overlapping buffers); NOT_FOUND for an unknown region; RESOURCE_EXHAUSTED
// when inline outputs exceed ctx.max_inline_output_bytes; FAILED_PRECONDITION
// when a region's memory kind cannot be used by the device or events are
// given to a host device; device errors. Returns when the outputs are
// written, or, with request.events.signal_event on a CUDA device, possibly
// once the work is enqueued (outputs staged to host are always complete).
absl::StatusOr<QuantizeResult> Quantize(const QuantizeRequestSpec& request, const OpContext& ctx);

// Dequantizes the rowwise copy when present, else the columnwise copy.
// Errors as Quantize; additionally INVALID_ARGUMENT when neither copy is
// present, a data/scale buffer's dtype is wrong or its size differs from
// the layout of (scaling, M, N).
absl::StatusOr<OutputTensor> Dequantize(const DequantizeRequestSpec& request, const OpContext& ctx);

// True when Quantize(request, ctx) / Dequantize(request, ctx) would do little
// host work: at most ctx.inline_limits.max_host_bytes bytes computed on or
// copied by the host, and, when the host waits for a device kernel, at most
// max_device_bytes of kernel input. Never short when the host would wait on a
// client's cuda_events.wait_event (its GPU work may take any time): that is,
// a wait event without a signal event, or with outputs or inputs staged
// through the host. A request that fails validation counts as short (it fails
// before any work). Cheap (region lookups only); never fails.
bool QuantizeRunsShort(const QuantizeRequestSpec& request, const OpContext& ctx);
bool DequantizeRunsShort(const DequantizeRequestSpec& request, const OpContext& ctx);

std::string_view ScalingName(kernels::BlockScaling s);
std::string_view FormatName(kernels::Fp8Format f);

}  // namespace qtx::server::ops

#endif  // QTX_SERVER_OPS_QUANTIZE_H_
