#include "server/api/grpc_status.h"

#include <string>

#include "absl/strings/str_format.h"
#include "spdlog/spdlog.h"

namespace qtx::server::api {
namespace {

// Keeps a log line on one line and its quoted value unambiguous.
std::string EscapeForLog(absl::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (char c : s) {
    if (c == '"' || c == '\\') {
      out.push_back('\\');
      out.push_back(c);
    } else if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) {
      out += absl::StrFormat("\\x%02x", static_cast<unsigned char>(c));
    } else {
      out.push_back(c);
    }
  }
  return out;
}

}  // namespace

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
              EscapeForLog(status.message()));
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(status.message()));
}

}  // namespace qtx::server::api
