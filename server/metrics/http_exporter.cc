#include "server/metrics/http_exporter.h"

#include <sys/socket.h>

#include <string>
#include <utility>

#include "absl/strings/str_format.h"
#include "httplib.h"

namespace qtx::server::metrics {

HttpExporter::HttpExporter(int port) : port_(port), server_(std::make_unique<httplib::Server>()) {}

absl::StatusOr<std::unique_ptr<HttpExporter>> HttpExporter::Create(int port,
                                                                   const Metrics* metrics) {
  if (port < 1 || port > 65535) {
    return absl::InvalidArgumentError(absl::StrFormat("--metrics_port=%d: must be 1..65535", port));
  }
  std::unique_ptr<HttpExporter> e(new HttpExporter(port));
  // SO_REUSEADDR only: cpp-httplib's default adds SO_REUSEPORT, which would
  // let a second qtxd share (and silently split) a taken port.
  e->server_->set_socket_options([](socket_t sock) {
    int yes = 1;
    ::setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
  });
  e->server_->new_task_queue = [] { return new httplib::ThreadPool(2); };
  e->server_->Get("/metrics", [metrics](const httplib::Request&, httplib::Response& res) {
    res.set_content(metrics->RenderPrometheus(), "text/plain; version=0.0.4; charset=utf-8");
  });
  if (!e->server_->bind_to_port("0.0.0.0", port)) {
    return absl::UnavailableError(
        absl::StrFormat("--metrics_port=%d: cannot listen (port in use?)", port));
  }
  httplib::Server* server = e->server_.get();
  e->thread_ = std::thread([server] { server->listen_after_bind(); });
  return e;
}

HttpExporter::~HttpExporter() {
  server_->stop();
  if (thread_.joinable()) thread_.join();
}

}  // namespace qtx::server::metrics
