// HttpExporter: serves Metrics::RenderPrometheus() at GET /metrics on a TCP
// port, by default on loopback only (--metrics_host).
//
// One thread multiplexes every connection with poll(2), so that no client can
// hold the exporter: each connection gets `request_timeout` from accept to
// send its request and read the answer, then it is closed; at most
// `max_connections` are open at once, and a new one past that closes the
// oldest. Each response is "Connection: close". (cpp-httplib, used before,
// gave every connection a pool thread until its read timeout, so two
// clients sending a partial request blocked /metrics for everyone.)
//
// Thread safety: Create/destroy from one thread; the exporter's thread calls
// Metrics::RenderPrometheus (safe for concurrent use).
#ifndef QTX_SERVER_METRICS_HTTP_EXPORTER_H_
#define QTX_SERVER_METRICS_HTTP_EXPORTER_H_

#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "server/metrics/metrics.h"

namespace qtx::server::metrics {

struct HttpExporterOptions {
  // Address to listen on ("127.0.0.1", "::1", "0.0.0.0", an interface address
  // or a host name) and port (1..65535).
  std::string host = "127.0.0.1";
  int port = 0;
  // Time a connection gets from accept to the end of its response.
  absl::Duration request_timeout = absl::Seconds(5);
  // Connections open at once; a new one past this closes the oldest.
  int max_connections = 64;
};

class HttpExporter {
 public:
  // Listens on options.host:options.port. INVALID_ARGUMENT for a bad port or
  // host; UNAVAILABLE when it cannot bind. `metrics` must outlive the
  // exporter.
  static absl::StatusOr<std::unique_ptr<HttpExporter>> Create(const HttpExporterOptions& options,
                                                              const Metrics* metrics);
  ~HttpExporter();  // stops the server; returns when its thread is done
  HttpExporter(const HttpExporter&) = delete;
  HttpExporter& operator=(const HttpExporter&) = delete;

  int port() const { return options_.port; }
  // The numeric address the socket is bound to ("127.0.0.1", "::").
  const std::string& bound_address() const { return bound_address_; }

 private:
  HttpExporter(HttpExporterOptions options, const Metrics* metrics);
  void Loop();

  // Constant after Create.
  const HttpExporterOptions options_;
  const Metrics* const metrics_;
  std::string bound_address_;
  int listen_fd_ = -1;
  int wake_fds_[2] = {-1, -1};  // a pipe: the destructor writes to stop Loop
  std::thread thread_;
};

}  // namespace qtx::server::metrics

#endif  // QTX_SERVER_METRICS_HTTP_EXPORTER_H_
