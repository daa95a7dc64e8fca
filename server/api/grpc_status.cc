#include "server/api/grpc_status.h"

#include <string>

#include "absl/strings/escaping.h"
#include "spdlog/spdlog.h"

namespace qtx::server::api {

grpc::Status ToGrpcStatus(const absl::Status& status, std::string_view request_id,
                          std::string_view method) {
  if (status.ok()) return grpc::Status::OK;
  const std::string code = absl::StatusCodeToString(status.code());
  // Client mistakes are warnings; server-side failures are errors.
  const bool server_fault = status.code() == absl::StatusCode::kInternal ||
                            status.code() == absl::StatusCode::kUnknown ||
                            status.code() == absl::StatusCode::kDataLoss;
  spdlog::log(server_fault ? spdlog::level::err : spdlog::level::warn,
              "rid={} method={} code={} msg=\"{}\"", request_id, method, code,
              absl::CEscape(status.message()));
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(status.message()));
}

}  // namespace qtx::server::api
