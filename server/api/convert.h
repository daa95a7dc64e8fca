// Conversion between qtx.v1 protobuf messages and the plain structs of
// server/tensor and server/ops. Proto defaults are applied here (the proto
// comments are the contract): scaling_mode unspecified -> BLOCK_1D, format
// unspecified -> E4M3, rowwise unset -> true, columnwise unset -> false,
// force_pow2_scales unset -> true. Unknown enum values -> INVALID_ARGUMENT.
//
// Specs borrow inline bytes from the request message: the message must
// outlive them. Pure functions; thread-safe.
#ifndef QTX_SERVER_API_CONVERT_H_
#define QTX_SERVER_API_CONVERT_H_

#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/quantize_params.h"
#include "qtx/v1/memory.pb.h"
#include "qtx/v1/quantizer.pb.h"
#include "qtx/v1/tensor.pb.h"
#include "server/ops/quantize.h"
#include "server/tensor/dtype.h"
#include "server/tensor/region_table.h"
#include "server/tensor/tensor_ref.h"

namespace qtx::server::api {

absl::StatusOr<tensor::DType> DTypeFromProto(int value, std::string_view field);
v1::DType DTypeToProto(tensor::DType dtype);

tensor::RegionSliceSpec SliceFromProto(const v1::RegionSlice& slice);
absl::StatusOr<tensor::TensorRefSpec> TensorRefFromProto(const v1::TensorRef& ref,
                                                         std::string_view field);

// Config with the defaults filled in, then validated by ops.
absl::StatusOr<kernels::QuantizeParams> ParamsFromProto(const v1::QuantizeConfig& config,
                                                        std::string_view field);
void ParamsToProto(const kernels::QuantizeParams& params, v1::QuantizeConfig* config);

// Copies the (up to 64-byte) handles; lengths are checked by ops.
backend::CudaEvents CudaEventsFromProto(const v1::CudaEvents& events);

// The output placement of a quantized tensor (Quantize, AllGather, Step):
// set slices become region outputs, unset ones mean "inline".
void QuantizeOutputsFromProto(const v1::QuantizeOutputs& outputs, ops::QuantizeOutputSpecs* specs);
// A quantized tensor (shape, source dtype, config, up to four buffers). Moves
// inline bytes out of `result`.
void QuantizedTensorToProto(ops::QuantizeResult&& result, v1::QuantizedTensor* out);

absl::StatusOr<ops::QuantizeRequestSpec> QuantizeRequestFromProto(const v1::QuantizeRequest& req);
// Moves inline bytes out of `result`.
void QuantizeResultToProto(ops::QuantizeResult&& result, v1::QuantizeResponse* response);

absl::StatusOr<ops::DequantizeRequestSpec> DequantizeRequestFromProto(
    const v1::DequantizeRequest& req);
// Moves inline bytes out of `tensor`.
void OutputTensorToProto(ops::OutputTensor&& tensor, v1::TensorRef* ref);

void RegionInfoToProto(const tensor::RegionInfo& info, v1::RegionInfo* out);

}  // namespace qtx::server::api

#endif  // QTX_SERVER_API_CONVERT_H_
