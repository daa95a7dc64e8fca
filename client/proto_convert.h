// Conversions between the client's plain types (qtx/types.h) and the qtx.v1
// messages, and from grpc::Status to absl::Status. Internal to qtx_client
// (not installed); pure functions, safe from any thread.
#ifndef QTX_CLIENT_PROTO_CONVERT_H_
#define QTX_CLIENT_PROTO_CONVERT_H_

#include <grpcpp/support/status.h>

#include "absl/status/status.h"
#include "qtx/client.h"
#include "qtx/collective_types.h"
#include "qtx/optimizer_types.h"
#include "qtx/types.h"
#include "qtx/v1/collective.pb.h"
#include "qtx/v1/memory.pb.h"
#include "qtx/v1/optimizer.pb.h"
#include "qtx/v1/quantizer.pb.h"
#include "qtx/v1/tensor.pb.h"

namespace qtx::client_internal {

// Keeps the code (gRPC and Abseil codes are the same numbers) and message.
absl::Status FromGrpcStatus(const grpc::Status& status);

void ToProto(const ShardRange& in, v1::ShardRange* out);
ShardRange FromProto(const v1::ShardRange& in);

void ToProto(const RegionSlice& in, v1::RegionSlice* out);
RegionSlice FromProto(const v1::RegionSlice& in);

// Copies inline bytes into `out`.
void ToProto(const Tensor& in, v1::TensorRef* out);
// Moves inline bytes out of `in` (which is left with empty data).
Tensor FromProto(v1::TensorRef&& in);

// Always sets the optional fields explicitly.
void ToProto(const QuantizeConfig& in, v1::QuantizeConfig* out);
// Unset fields get the documented defaults (rowwise true, columnwise false,
// pow2 true, BLOCK_1D, E4M3).
QuantizeConfig FromProto(const v1::QuantizeConfig& in);

void ToProto(const QuantizedTensor& in, v1::QuantizedTensor* out);
QuantizedTensor FromProto(v1::QuantizedTensor&& in);

void ToProto(const QuantizeOutputs& in, v1::QuantizeOutputs* out);
RegionInfo FromProto(const v1::RegionInfo& in);

// Fills name, rank, world_size, coordinator, backend and timeout_ms (the
// timeout rounded up to whole milliseconds). Fails with INVALID_ARGUMENT for
// a negative timeout or one that does not fit in uint32 milliseconds; the
// server checks everything else.
absl::Status ToProto(const CollectiveGroupConfig& in, v1::CreateGroupRequest* out);
CollectiveGroupInfo FromProto(const v1::GroupInfo& in);

// Sets request->cuda_events from call.cuda_wait_event / cuda_signal_event
// (each only when given; the field stays unset when neither is). For every
// request with a cuda_events field (Quantize, Dequantize, AllGather,
// AllGatherParameter, Step, GradNorm).
template <typename Request>
void SetCudaEvents(const CallOptions& call, Request* request) {
  if (!call.cuda_wait_event.empty()) {
    request->mutable_cuda_events()->set_wait_event(call.cuda_wait_event);
  }
  if (!call.cuda_signal_event.empty()) {
    request->mutable_cuda_events()->set_signal_event(call.cuda_signal_event);
  }
}

}  // namespace qtx::client_internal

#endif  // QTX_CLIENT_PROTO_CONVERT_H_
