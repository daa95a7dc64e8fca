#include "server/api/metrics_interceptor.h"

#include <string>

#include "absl/status/status.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "google/protobuf/message_lite.h"

namespace qtx::server::api {
namespace {

using grpc::experimental::InterceptionHookPoints;

class MetricsInterceptor final : public grpc::experimental::Interceptor {
 public:
  MetricsInterceptor(metrics::Metrics* metrics, const char* method)
      : metrics_(metrics),
        method_(method == nullptr ? "" : method),
        // Only qtx.v1 messages are known to be protobuf messages here (the
        // health service's handler works on raw byte buffers).
        protobuf_(method_.rfind("/qtx.v1.", 0) == 0),
        start_(absl::Now()) {}

  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(InterceptionHookPoints::POST_RECV_MESSAGE) &&
        protobuf_) {
      if (const void* m = methods->GetRecvMessage(); m != nullptr) {
        bytes_in_ += static_cast<const google::protobuf::MessageLite*>(m)->ByteSizeLong();
      }
    }
    if (methods->QueryInterceptionHookPoint(InterceptionHookPoints::PRE_SEND_MESSAGE) &&
        protobuf_) {
      if (const void* m = methods->GetSendMessage(); m != nullptr) {
        bytes_out_ += static_cast<const google::protobuf::MessageLite*>(m)->ByteSizeLong();
      }
    }
    if (methods->QueryInterceptionHookPoint(InterceptionHookPoints::PRE_SEND_STATUS)) {
      const grpc::Status status = methods->GetSendStatus();
      metrics_->RecordRpc(
          method_, absl::StatusCodeToString(static_cast<absl::StatusCode>(status.error_code())),
          absl::ToDoubleSeconds(absl::Now() - start_), bytes_in_, bytes_out_);
    }
    methods->Proceed();
  }

 private:
  metrics::Metrics* const metrics_;
  const std::string method_;
  const bool protobuf_;
  const absl::Time start_;
  uint64_t bytes_in_ = 0;
  uint64_t bytes_out_ = 0;
};

}  // namespace

grpc::experimental::Interceptor* MetricsInterceptorFactory::CreateServerInterceptor(
    grpc::experimental::ServerRpcInfo* info) {
  return new MetricsInterceptor(metrics_, info->method());
}

}  // namespace qtx::server::api
