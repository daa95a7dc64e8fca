// A gRPC server interceptor that records every call in a metrics::Metrics:
// method, status code, latency (arrival of the initial metadata to the
// status), and the payload bytes of qtx.v1 requests and responses.
//
// Thread safety: the factory is immutable; each interceptor belongs to one
// call; Metrics is safe for concurrent use and must outlive the server.
#ifndef QTX_SERVER_API_METRICS_INTERCEPTOR_H_
#define QTX_SERVER_API_METRICS_INTERCEPTOR_H_

#include <grpcpp/support/server_interceptor.h>

#include <memory>

#include "server/metrics/metrics.h"

namespace qtx::server::api {

class MetricsInterceptorFactory final
    : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  explicit MetricsInterceptorFactory(metrics::Metrics* metrics) : metrics_(metrics) {}
  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override;

 private:
  metrics::Metrics* const metrics_;
};

}  // namespace qtx::server::api

#endif  // QTX_SERVER_API_METRICS_INTERCEPTOR_H_
