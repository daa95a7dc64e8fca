// HttpExporter: serves Metrics::RenderPrometheus() at GET /metrics on a TCP
// port (all interfaces), with cpp-httplib (Debian: libcpp-httplib-dev).
// (civetweb was tried first: Debian's build gives its worker threads a fixed
// small stack, smaller than qtxd's static TLS, so they cannot start.)
//
// Thread safety: Create/destroy from one thread; the HTTP threads call the
// handler, which only reads `metrics` (safe for concurrent use).
#ifndef QTX_SERVER_METRICS_HTTP_EXPORTER_H_
#define QTX_SERVER_METRICS_HTTP_EXPORTER_H_

#include <memory>
#include <thread>

#include "absl/status/statusor.h"
#include "server/metrics/metrics.h"

namespace httplib {
class Server;
}

namespace qtx::server::metrics {

class HttpExporter {
 public:
  // Listens on `port` (1..65535) on all interfaces. UNAVAILABLE when it
  // cannot bind. `metrics` must outlive the exporter.
  static absl::StatusOr<std::unique_ptr<HttpExporter>> Create(int port, const Metrics* metrics);
  ~HttpExporter();  // stops the server; returns when its threads are done
  HttpExporter(const HttpExporter&) = delete;
  HttpExporter& operator=(const HttpExporter&) = delete;

  int port() const { return port_; }

 private:
  explicit HttpExporter(int port);

  const int port_;
  std::unique_ptr<httplib::Server> server_;
  std::thread thread_;
};

}  // namespace qtx::server::metrics

#endif  // QTX_SERVER_METRICS_HTTP_EXPORTER_H_
