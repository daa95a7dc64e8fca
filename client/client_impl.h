// Client::Impl: the channel, stubs, call preparation and unary calls shared
// by the .cc files that implement qtx::Client (client.cc, collective_client.cc,
// optimizer_client.cc). Internal to qtx_client (not installed).
//
// Thread safety: constant after construction except next_request (atomic);
// gRPC channels and stubs are safe for concurrent use.
#ifndef QTX_CLIENT_CLIENT_IMPL_H_
#define QTX_CLIENT_CLIENT_IMPL_H_

#include <grpcpp/channel.h>
#include <grpcpp/client_context.h>
#include <grpcpp/generic/generic_stub.h>

#include <atomic>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/proto_convert.h"
#include "qtx/client.h"
#include "qtx/v1/channel.grpc.pb.h"
#include "qtx/v1/collective.grpc.pb.h"
#include "qtx/v1/memory.grpc.pb.h"
#include "qtx/v1/optimizer.grpc.pb.h"
#include "qtx/v1/quantizer.grpc.pb.h"

namespace qtx {

struct Client::Impl {
  // Constant after construction; gRPC channels and stubs are thread-safe.
  std::string target;
  ClientOptions options;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::Quantizer::Stub> quantizer;
  std::unique_ptr<v1::Memory::Stub> memory;
  std::unique_ptr<v1::StreamChannel::Stub> stream_channel;
  std::unique_ptr<v1::Collective::Stub> collective;
  std::unique_ptr<v1::Optimizer::Stub> optimizer;
  std::unique_ptr<grpc::GenericStub> generic;
  std::string id_prefix;

  // Distinguishes the request ids of this client.
  std::atomic<uint64_t> next_request{1};

  void Prepare(grpc::ClientContext* ctx, const CallOptions& call) {
    const absl::Duration timeout = call.timeout.value_or(options.timeout);
    if (timeout != absl::InfiniteDuration()) {
      ctx->set_deadline(absl::ToChronoTime(absl::Now() + timeout));
    }
    if (options.wait_for_ready) ctx->set_wait_for_ready(true);
    if (!options.auth_token.empty()) {
      ctx->AddMetadata("authorization", absl::StrCat("Bearer ", options.auth_token));
    }
    ctx->AddMetadata("x-request-id", call.request_id.empty()
                                         ? absl::StrCat(id_prefix, "-", next_request.fetch_add(1))
                                         : call.request_id);
  }

  // One unary call of `method` on `stub` with a context made by Prepare; the
  // gRPC status as an absl::Status (FromGrpcStatus). For example
  // Call(*optimizer, &v1::Optimizer::Stub::Step, request, &response, call).
  template <typename Stub, typename Request, typename Response>
  absl::Status Call(Stub& stub,
                    grpc::Status (Stub::*method)(grpc::ClientContext*, const Request&, Response*),
                    const Request& request, Response* response, const CallOptions& call) {
    grpc::ClientContext ctx;
    Prepare(&ctx, call);
    return client_internal::FromGrpcStatus((stub.*method)(&ctx, request, response));
  }
};

}  // namespace qtx

#endif  // QTX_CLIENT_CLIENT_IMPL_H_
