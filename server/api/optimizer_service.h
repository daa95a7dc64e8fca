// gRPC callback handlers for qtx.v1.Optimizer. Each handler converts the
// request to plain structs (defaults filled in), runs the op on the Executor
// (never on the reaction thread: a Step runs the host AdamW over the whole
// group), writes the response and finishes with ToGrpcStatus. No math here.
//
// Thread safety: used concurrently by gRPC; members are safe for concurrent
// use and outlive the grpc::Server.
#ifndef QTX_SERVER_API_OPTIMIZER_SERVICE_H_
#define QTX_SERVER_API_OPTIMIZER_SERVICE_H_

#include <grpcpp/grpcpp.h>

#include "qtx/v1/optimizer.grpc.pb.h"
#include "server/api/executor.h"
#include "server/collective/group_registry.h"
#include "server/ops/op_context.h"
#include "server/optimizer/optimizer_store.h"

namespace qtx::server::api {

class OptimizerService final : public v1::Optimizer::CallbackService {
 public:
  // `ctx` members, `store`, `executor` and `groups` (the Collective groups
  // a GradNorm may reduce over; null: none) are not owned and must outlive
  // the service.
  OptimizerService(ops::OpContext ctx, optimizer::OptimizerStore* store, Executor* executor,
                   collective::GroupRegistry* groups = nullptr)
      : ctx_(ctx), store_(store), executor_(executor), groups_(groups) {}

  grpc::ServerUnaryReactor* OffloadOptimizerState(
      grpc::CallbackServerContext* context, const v1::OffloadOptimizerStateRequest* request,
      v1::OffloadOptimizerStateResponse* response) override;
  grpc::ServerUnaryReactor* Step(grpc::CallbackServerContext* context,
                                 const v1::StepRequest* request,
                                 v1::StepResponse* response) override;
  grpc::ServerUnaryReactor* GradNorm(grpc::CallbackServerContext* context,
                                     const v1::GradNormRequest* request,
                                     v1::GradNormResponse* response) override;
  grpc::ServerUnaryReactor* GetState(grpc::CallbackServerContext* context,
                                     const v1::GetStateRequest* request,
                                     v1::GetStateResponse* response) override;
  grpc::ServerUnaryReactor* SaveCheckpoint(grpc::CallbackServerContext* context,
                                           const v1::SaveCheckpointRequest* request,
                                           v1::SaveCheckpointResponse* response) override;
  grpc::ServerUnaryReactor* LoadCheckpoint(grpc::CallbackServerContext* context,
                                           const v1::LoadCheckpointRequest* request,
                                           v1::LoadCheckpointResponse* response) override;
  grpc::ServerUnaryReactor* ReleaseGroup(grpc::CallbackServerContext* context,
                                         const v1::ReleaseGroupRequest* request,
                                         v1::ReleaseGroupResponse* response) override;
  grpc::ServerUnaryReactor* ListGroups(grpc::CallbackServerContext* context,
                                       const v1::ListOptimizerGroupsRequest* request,
                                       v1::ListOptimizerGroupsResponse* response) override;

 private:
  // The body of Step, on the executor: a local step, or with
  // collective_group a sharded group's collective step (run on the
  // Collective group's executor, waited for here) whose peers wait at most
  // until `deadline`.
  absl::Status StepOn(const v1::StepRequest& request, absl::Time deadline,
                      v1::StepResponse* response);

  // Constant after construction.
  const ops::OpContext ctx_;
  optimizer::OptimizerStore* const store_;
  Executor* const executor_;
  collective::GroupRegistry* const groups_;
};

}  // namespace qtx::server::api

#endif  // QTX_SERVER_API_OPTIMIZER_SERVICE_H_
