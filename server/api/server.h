// QtxServer: a running qtxd — the device, the region table, the executor, the
// gRPC services (qtx.v1.Quantizer, qtx.v1.Memory, grpc.health.v1.Health,
// server reflection) and their listeners. main.cc and the in-process tests
// both build one from a ServerConfig.
//
// Listeners: a unix domain socket created with mode 0600 (a stale socket file
// left by a dead server is replaced; a live one is an error) and next to it
// the fd socket "<socket>.fd" (server/api/fd_inbox.h), optionally TCP
// (TLS, or plaintext on loopback), and optionally a health-only TCP port;
// with --auth_token_file every call but the health port's needs the bearer
// token (server/api/security.h).
//
// Thread safety: Shutdown may be called from any thread, once or more; the
// accessors are safe for concurrent use.
#ifndef QTX_SERVER_API_SERVER_H_
#define QTX_SERVER_API_SERVER_H_

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "server/api/channel_service.h"
#include "server/api/collective_service.h"
#include "server/api/executor.h"
#include "server/api/fd_inbox.h"
#include "server/api/optimizer_service.h"
#include "server/api/services.h"
#include "server/backend/device.h"
#include "server/collective/group_registry.h"
#include "server/collective/kv_store.h"
#include "server/config/server_config.h"
#include "server/metrics/http_exporter.h"
#include "server/metrics/metrics.h"
#include "server/tensor/region_table.h"

namespace qtx::server::api {

class QtxServer {
 public:
  // Validates `config`, creates the device and starts listening.
  // INVALID_ARGUMENT for a bad config; FAILED_PRECONDITION for an unusable
  // device or socket path (e.g. another server is listening there);
  // UNAVAILABLE if gRPC cannot bind.
  static absl::StatusOr<std::unique_ptr<QtxServer>> Create(const config::ServerConfig& config);

  // Shuts down (with a zero grace period) if Shutdown was not called.
  ~QtxServer();
  QtxServer(const QtxServer&) = delete;
  QtxServer& operator=(const QtxServer&) = delete;

  // Reports NOT_SERVING, stops accepting calls, lets in-flight calls finish
  // for up to `grace` (then cancels them), stops the workers, checkpoints the
  // optimizer state and removes the socket file. Returns true when done.
  // Bounded in every case: a call still running at grace +
  // config.shutdown_slack_ms (a wedged worker that ignores cancellation) is
  // abandoned; the groups it does not hold are checkpointed (each lock waited
  // for at most 1 s) and Shutdown returns false. The stuck calls keep running:
  // the process should then end (qtxd _exits with 1); destroying the server
  // waits for them. Later calls return the first call's result at once.
  bool Shutdown(absl::Duration grace);

  // Whether the worker pool is wedged at `now`: every worker has been running
  // one call for more than config.worker_stall_s (0: never). Sets the health
  // status of every service to NOT_SERVING while it is, SERVING again when it
  // is not. A watchdog thread calls it every second; tests call it with a
  // chosen `now`.
  bool CheckWorkers(absl::Time now);

  // The unix socket path ("" when none) and the bound TCP port (0 when none).
  const std::string& socket_path() const { return config_.socket_path; }
  int tcp_port() const { return tcp_port_; }
  // The bound health-only port (0 when none).
  int health_port() const { return health_port_; }
  // The Prometheus /metrics port (0 when none).
  int metrics_port() const { return metrics_exporter_ ? metrics_exporter_->port() : 0; }
  const config::ServerConfig& config() const { return config_; }
  tensor::RegionTable& regions() { return *regions_; }
  optimizer::OptimizerStore& optimizer_store() { return *optimizer_store_; }
  Executor& executor() { return *executor_; }

 private:
  explicit QtxServer(config::ServerConfig config) : config_(std::move(config)) {}
  absl::Status Start();
  // REQUIRES: metrics_, regions_, groups_ and optimizer_store_ exist.
  void AddGauges();

  // Constant after Create.
  const config::ServerConfig config_;
  std::unique_ptr<backend::Device> device_;
  std::unique_ptr<tensor::RegionTable> regions_;
  // The fd socket ("<socket_path>.fd"; null without a unix socket). Drops
  // regions from regions_ when a session closes: declared after it.
  std::unique_ptr<FdInbox> fd_inbox_;
  std::unique_ptr<Executor> executor_;
  std::unique_ptr<InlineSlots> inline_slots_;
  std::unique_ptr<QuantizerService> quantizer_;
  std::unique_ptr<StreamChannelService> channels_;
  std::unique_ptr<MemoryService> memory_;
  std::unique_ptr<optimizer::OptimizerStore> optimizer_store_;
  std::unique_ptr<OptimizerService> optimizer_;
  // Collectives: declared before server_ so that they outlive it.
  std::unique_ptr<collective::KvStore> rendezvous_store_;
  std::unique_ptr<collective::GroupRegistry> groups_;
  std::unique_ptr<CollectiveService> collective_;
  std::unique_ptr<RendezvousService> rendezvous_;
  // Outlives server_ (its interceptors record into it).
  std::unique_ptr<metrics::Metrics> metrics_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<grpc::Server> health_server_;
  // Reads the members above at each scrape: destroyed first.
  std::unique_ptr<metrics::HttpExporter> metrics_exporter_;
  int tcp_port_ = 0;
  int health_port_ = 0;

  absl::Mutex shutdown_mu_;
  bool shut_down_ ABSL_GUARDED_BY(shutdown_mu_) = false;
  bool shutdown_clean_ ABSL_GUARDED_BY(shutdown_mu_) = true;
  // Runs the gRPC and worker shutdown so that Shutdown can stop waiting for
  // it; joined by Shutdown when it ends in time, else by the destructor.
  std::thread drain_;

  // The wedge watchdog (CheckWorkers every second), stopped by Shutdown.
  absl::Notification stop_watchdog_;
  std::thread watchdog_;
  absl::Mutex health_mu_;
  bool wedged_ ABSL_GUARDED_BY(health_mu_) = false;
};

// Prepares `path` for a new listener: OK if it does not exist or is a stale
// socket (removed). FAILED_PRECONDITION if a server accepts connections there
// or the path is not a socket.
absl::Status PrepareSocketPath(const std::string& path);

}  // namespace qtx::server::api

#endif  // QTX_SERVER_API_SERVER_H_
