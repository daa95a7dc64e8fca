// The one place where an absl::Status becomes a grpc::Status. The codes are
// the same numbers (both follow google.rpc.Code); the message is copied.
// A failure is logged here, once, with the request id and method.
// Thread-safe.
#ifndef QTX_SERVER_API_GRPC_STATUS_H_
#define QTX_SERVER_API_GRPC_STATUS_H_

#include <grpcpp/support/status.h>

#include <string_view>

#include "absl/status/status.h"

namespace qtx::server::api {

grpc::Status ToGrpcStatus(const absl::Status& status, std::string_view request_id,
                          std::string_view method);

}  // namespace qtx::server::api

#endif  // QTX_SERVER_API_GRPC_STATUS_H_
