// qtx::Client's Collective calls: plain types (qtx/collective_types.h) <->
// qtx.v1.Collective messages, one unary RPC each.
#include <string>
#include <utility>
#include <vector>

#include "client/client_impl.h"
#include "client/proto_convert.h"
#include "common/status_macros.h"
#include "qtx/client.h"
#include "qtx/v1/collective.grpc.pb.h"

namespace qtx {

using client_internal::FromProto;
using client_internal::SetCudaEvents;
using client_internal::ToProto;

const char* CommBackendName(CommBackend backend) {
  switch (backend) {
    case CommBackend::kUnspecified:
      return "unspecified";
    case CommBackend::kGloo:
      return "gloo";
    case CommBackend::kNccl:
      return "nccl";
  }
  return "unknown";
}

const char* AllGatherModeName(AllGatherMode mode) {
  switch (mode) {
    case AllGatherMode::kExactFp8:
      return "exact_fp8";
    case AllGatherMode::kGatherHighPrecision:
      return "gather_high_precision";
  }
  return "unknown";
}

const char* GroupStateName(GroupState state) {
  switch (state) {
    case GroupState::kUnspecified:
      return "unspecified";
    case GroupState::kReady:
      return "ready";
    case GroupState::kBroken:
      return "broken";
  }
  return "unknown";
}

absl::StatusOr<CollectiveGroupInfo> Client::CreateGroup(const CollectiveGroupConfig& config,
                                                        const CallOptions& call) {
  v1::CreateGroupRequest request;
  if (absl::Status s = ToProto(config, &request); !s.ok()) return s;
  v1::CreateGroupResponse response;
  QTX_RETURN_IF_ERROR(impl_->Call(*impl_->collective, &v1::Collective::Stub::CreateGroup, request,
                                  &response, call));
  return FromProto(response.group());
}

absl::StatusOr<AllGatherResult> Client::AllGather(std::string_view group, uint64_t sequence,
                                                  const Tensor& input, const QuantizeConfig& config,
                                                  AllGatherMode mode,
                                                  const QuantizeOutputs& outputs,
                                                  const CallOptions& call,
                                                  const std::vector<int64_t>& shard_rows) {
  v1::AllGatherRequest request;
  request.set_group(std::string(group));
  request.set_sequence(sequence);
  ToProto(input, request.mutable_input());
  ToProto(config, request.mutable_config());
  request.set_mode(static_cast<v1::AllGatherMode>(mode));
  ToProto(outputs, request.mutable_outputs());
  SetCudaEvents(call, &request);
  for (int64_t m : shard_rows) request.add_shard_rows(m);
  v1::AllGatherResponse response;
  QTX_RETURN_IF_ERROR(
      impl_->Call(*impl_->collective, &v1::Collective::Stub::AllGather, request, &response, call));
  AllGatherResult result;
  result.tensor = FromProto(std::move(*response.mutable_result()));
  result.shard_rows.assign(response.shard_rows().begin(), response.shard_rows().end());
  return result;
}

absl::StatusOr<ParameterAllGatherResult> Client::AllGatherParameter(
    std::string_view group, uint64_t sequence, const QuantizedTensor& shard, ShardRange range,
    const QuantizeOutputs& outputs, const CallOptions& call, std::string_view name) {
  v1::AllGatherParameterRequest request;
  request.set_group(std::string(group));
  request.set_sequence(sequence);
  request.set_name(std::string(name));
  ToProto(shard, request.mutable_shard());
  ToProto(range, request.mutable_range());
  ToProto(outputs, request.mutable_outputs());
  SetCudaEvents(call, &request);
  v1::AllGatherParameterResponse response;
  QTX_RETURN_IF_ERROR(impl_->Call(*impl_->collective, &v1::Collective::Stub::AllGatherParameter,
                                  request, &response, call));
  ParameterAllGatherResult result;
  result.tensor = FromProto(std::move(*response.mutable_result()));
  for (const v1::ShardRange& r : response.ranges()) result.ranges.push_back(FromProto(r));
  return result;
}

absl::Status Client::DestroyGroup(std::string_view name, const CallOptions& call) {
  v1::DestroyGroupRequest request;
  request.set_name(std::string(name));
  v1::DestroyGroupResponse response;
  return impl_->Call(*impl_->collective, &v1::Collective::Stub::DestroyGroup, request, &response,
                     call);
}

absl::StatusOr<std::vector<CollectiveGroupInfo>> Client::ListGroups(const CallOptions& call) {
  v1::ListGroupsRequest request;
  v1::ListGroupsResponse response;
  QTX_RETURN_IF_ERROR(
      impl_->Call(*impl_->collective, &v1::Collective::Stub::ListGroups, request, &response, call));
  std::vector<CollectiveGroupInfo> out;
  out.reserve(response.groups_size());
  for (const v1::GroupInfo& g : response.groups()) out.push_back(FromProto(g));
  return out;
}

}  // namespace qtx
