// gRPC callback handlers for qtx.v1.Quantizer and qtx.v1.Memory. Each handler
// converts the request to plain structs, runs an op, writes the response and
// finishes with ToGrpcStatus. Handlers hold no math. A short op (bounded host
// work: ops::QuantizeRunsShort / DequantizeRunsShort, ListRegions) runs on
// the reaction thread when an InlineSlots slot is free; every other op runs
// on the Executor, never blocking the reaction thread.
//
// Thread safety: the services are used concurrently by gRPC; their members
// are safe for concurrent use and outlive the grpc::Server.
#ifndef QTX_SERVER_API_SERVICES_H_
#define QTX_SERVER_API_SERVICES_H_

#include <grpcpp/grpcpp.h>

#include "qtx/v1/memory.grpc.pb.h"
#include "qtx/v1/quantizer.grpc.pb.h"
#include "server/api/executor.h"
#include "server/api/fd_inbox.h"
#include "server/ops/quantize.h"
#include "server/tensor/region_table.h"

namespace qtx::server::api {

class QuantizerService final : public v1::Quantizer::CallbackService {
 public:
  // `ctx` members, `executor` and `inline_slots` are not owned and must
  // outlive the service.
  QuantizerService(ops::OpContext ctx, Executor* executor, InlineSlots* inline_slots)
      : ctx_(ctx), executor_(executor), inline_slots_(inline_slots) {}

  grpc::ServerUnaryReactor* Quantize(grpc::CallbackServerContext* context,
                                     const v1::QuantizeRequest* request,
                                     v1::QuantizeResponse* response) override;
  grpc::ServerUnaryReactor* Dequantize(grpc::CallbackServerContext* context,
                                       const v1::DequantizeRequest* request,
                                       v1::DequantizeResponse* response) override;

 private:
  // Constant after construction.
  const ops::OpContext ctx_;
  Executor* const executor_;
  InlineSlots* const inline_slots_;
};

class MemoryService final : public v1::Memory::CallbackService {
 public:
  // `fd_inbox` (may be null: no unix socket) supplies the descriptors of
  // cuda_vmm registrations.
  MemoryService(tensor::RegionTable* regions, Executor* executor, InlineSlots* inline_slots,
                FdInbox* fd_inbox = nullptr)
      : regions_(regions), executor_(executor), inline_slots_(inline_slots), fd_inbox_(fd_inbox) {}

  grpc::ServerUnaryReactor* RegisterRegion(grpc::CallbackServerContext* context,
                                           const v1::RegisterRegionRequest* request,
                                           v1::RegisterRegionResponse* response) override;
  grpc::ServerUnaryReactor* UnregisterRegion(grpc::CallbackServerContext* context,
                                             const v1::UnregisterRegionRequest* request,
                                             v1::UnregisterRegionResponse* response) override;
  grpc::ServerUnaryReactor* ListRegions(grpc::CallbackServerContext* context,
                                        const v1::ListRegionsRequest* request,
                                        v1::ListRegionsResponse* response) override;

 private:
  // Constant after construction.
  tensor::RegionTable* const regions_;
  Executor* const executor_;
  InlineSlots* const inline_slots_;
  FdInbox* const fd_inbox_;
};

}  // namespace qtx::server::api

#endif  // QTX_SERVER_API_SERVICES_H_
