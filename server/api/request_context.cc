#include "server/api/request_context.h"

#include <atomic>
#include <random>

#include "absl/strings/str_format.h"
#include "server/api/grpc_status.h"
#include "spdlog/spdlog.h"

namespace qtx::server::api {
namespace {

bool IsIdChar(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' ||
         c == '.' || c == ':' || c == '-';
}

bool IsValidRequestId(std::string_view id) {
  if (id.empty() || id.size() > 64) return false;
  for (char c : id) {
    if (!IsIdChar(c)) return false;
  }
  return true;
}

}  // namespace

std::string NewRequestId() {
  // A random per-process prefix plus a counter: unique and cheap.
  static const uint32_t prefix = [] {
    std::random_device rd;
    return static_cast<uint32_t>(rd());
  }();
  static std::atomic<uint32_t> counter{0};
  return absl::StrFormat("%08x%08x", prefix, counter.fetch_add(1, std::memory_order_relaxed));
}

std::string RequestIdFor(const grpc::CallbackServerContext& context) {
  const auto& md = context.client_metadata();
  auto it = md.find(grpc::string_ref(kRequestIdHeader.data(), kRequestIdHeader.size()));
  if (it != md.end()) {
    std::string_view id(it->second.data(), it->second.size());
    if (IsValidRequestId(id)) return std::string(id);
  }
  return NewRequestId();
}

RequestLog StartRequest(grpc::CallbackServerContext* context, std::string_view method) {
  RequestLog log{RequestIdFor(*context), std::string(method), absl::Now()};
  context->AddInitialMetadata(std::string(kRequestIdHeader), log.request_id);
  spdlog::debug("rid={} method={} peer={} event=start", log.request_id, log.method,
                context->peer());
  return log;
}

grpc::Status EndRequest(const RequestLog& log, const absl::Status& status) {
  if (status.ok()) {
    spdlog::info("rid={} method={} code=OK ms={:.3f}", log.request_id, log.method,
                 absl::ToDoubleMilliseconds(absl::Now() - log.start));
  }
  return ToGrpcStatus(status, log.request_id, log.method);
}

}  // namespace qtx::server::api
