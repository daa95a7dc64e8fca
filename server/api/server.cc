#include "server/api/server.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/health_check_service_interface.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_format.h"
#include "common/status_macros.h"
#include "server/api/metrics_interceptor.h"
#include "server/api/security.h"
#include "server/backend/device_factory.h"
#include "server/collective/communicators.h"
#include "server/tensor/shm_fault_guard.h"
#include "spdlog/spdlog.h"

namespace qtx::server::api {
namespace {

// Restores the process umask on scope exit.
class ScopedUmask {
 public:
  explicit ScopedUmask(mode_t mask) : old_(::umask(mask)) {}
  ~ScopedUmask() { ::umask(old_); }
  ScopedUmask(const ScopedUmask&) = delete;
  ScopedUmask& operator=(const ScopedUmask&) = delete;

 private:
  mode_t old_;
};

// Serving-status names reported by grpc.health.v1.
constexpr const char* kHealthServices[] = {"",
                                           "qtx.v1.Quantizer",
                                           "qtx.v1.Memory",
                                           "qtx.v1.StreamChannel",
                                           "qtx.v1.Collective",
                                           "qtx.v1.Rendezvous",
                                           "qtx.v1.Optimizer"};

}  // namespace

absl::Status PrepareSocketPath(const std::string& path) {
  struct stat st;
  if (::lstat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) return absl::OkStatus();
    return absl::FailedPreconditionError(
        absl::StrFormat("--socket=%s: cannot stat: %s", path, std::strerror(errno)));
  }
  if (!S_ISSOCK(st.st_mode)) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "--socket=%s: the path exists and is not a socket; remove it or pick another path", path));
  }
  // A socket file: is anybody listening?
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    return absl::InternalError(absl::StrFormat("socket(AF_UNIX): %s", std::strerror(errno)));
  }
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
  const int rc = ::connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr));
  const int err = errno;
  ::close(fd);
  if (rc == 0) {
    return absl::FailedPreconditionError(
        absl::StrFormat("--socket=%s: another server is already listening there", path));
  }
  if (err != ECONNREFUSED && err != ENOENT) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "--socket=%s: cannot tell whether the socket is in use: %s", path, std::strerror(err)));
  }
  if (::unlink(path.c_str()) != 0 && errno != ENOENT) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "--socket=%s: cannot remove the stale socket: %s", path, std::strerror(errno)));
  }
  spdlog::info("event=stale_socket_removed path={}", path);
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<QtxServer>> QtxServer::Create(const config::ServerConfig& config) {
  QTX_RETURN_IF_ERROR(config::ValidateConfig(config));
  std::unique_ptr<QtxServer> server(new QtxServer(config));
  QTX_RETURN_IF_ERROR(server->Start());
  return server;
}

absl::Status QtxServer::Start() {
  QTX_ASSIGN_OR_RETURN(device_, backend::CreateDevice(config_.device));

  tensor::RegionTableOptions region_options;
  region_options.allow_client_shm = config_.allow_client_shm;
  region_options.cuda_ipc_opener = device_->cuda_ipc_opener();
  region_options.cuda_vmm_opener = device_->cuda_vmm_opener();
  region_options.cuda_uuid_resolver = device_->cuda_uuid_resolver();
  region_options.cuda_ipc_unavailable_reason = absl::StrFormat(
      "cuda_ipc regions need --device=cuda:N (this qtxd runs --device=%s)", device_->name());
  regions_ = std::make_unique<tensor::RegionTable>(std::move(region_options));

  executor_ =
      std::make_unique<Executor>(config_.threads, static_cast<size_t>(config_.max_queued_requests));
  const uint64_t max_message_bytes = static_cast<uint64_t>(config_.max_message_mb) << 20;
  ops::OpContext ctx;
  ctx.regions = regions_.get();
  ctx.device = device_.get();
  ctx.limits.max_elements = config_.max_tensor_elements;
  // Leave room for the response's non-data fields.
  ctx.max_inline_output_bytes = max_message_bytes - (max_message_bytes >> 6);
  ctx.inline_limits.max_host_bytes = static_cast<uint64_t>(config_.inline_max_bytes);
  ctx.inline_limits.max_device_bytes = static_cast<uint64_t>(config_.inline_max_device_bytes);
  inline_slots_ = std::make_unique<InlineSlots>(config_.inline_max_concurrent);
  quantizer_ = std::make_unique<QuantizerService>(ctx, executor_.get(), inline_slots_.get());
  if (!config_.socket_path.empty()) {
    // Descriptors for cuda_vmm regions (client/qtx/fd_passing.h). A client's
    // connection is its session: when it closes, its regions go.
    FdInboxOptions fd_options;
    fd_options.socket_path = config_.socket_path + ".fd";
    tensor::RegionTable* const regions = regions_.get();
    fd_options.on_session_closed = [regions](uint64_t session) {
      const size_t n = regions->UnregisterSession(session);
      if (n > 0) spdlog::info("event=fd_session_regions_dropped session={} regions={}", session, n);
    };
    // Without it qtxd still serves everything but cuda_vmm regions
    // (FAILED_PRECONDITION naming the fd socket).
    absl::StatusOr<std::unique_ptr<FdInbox>> inbox = FdInbox::Create(std::move(fd_options));
    if (inbox.ok()) {
      fd_inbox_ = *std::move(inbox);
    } else {
      spdlog::warn("event=fd_socket_unavailable msg=\"{}\" (cuda_vmm regions are refused)",
                   std::string(inbox.status().message()));
    }
  }
  memory_ = std::make_unique<MemoryService>(regions_.get(), executor_.get(), inline_slots_.get(),
                                            fd_inbox_.get());
  optimizer::OptimizerStore::Options optimizer_options;
  optimizer_options.memory_limit_bytes = static_cast<uint64_t>(config_.optimizer_memory_limit_mb)
                                         << 20;
  optimizer_options.checkpoint_dir = config_.checkpoint_dir;
  optimizer_options.checkpoint_every_steps = config_.checkpoint_every_steps;
  optimizer_options.import_dirs = config_.checkpoint_import_dirs;
  optimizer_options.num_threads = config_.optimizer_threads;
  QTX_ASSIGN_OR_RETURN(optimizer_store_, optimizer::OptimizerStore::Create(optimizer_options));
  QTX_ASSIGN_OR_RETURN(ServerSecurity security, MakeServerSecurity(config_));
  QTX_ASSIGN_OR_RETURN(PeerSecurity peer_security, MakePeerSecurity(config_));
  collective::KvStoreLimits store_limits;
  store_limits.require_namespace = true;  // keys only under this sidecar's rank-0 groups
  rendezvous_store_ = std::make_unique<collective::KvStore>(store_limits);
  groups_ = std::make_unique<collective::GroupRegistry>(collective::WithNcclCommunicator(
      MakeGroupRegistryOptions(rendezvous_store_.get(), config_.peer_host, peer_security),
      device_.get()));
  collective_ = std::make_unique<CollectiveService>(ctx, groups_.get());
  optimizer_ = std::make_unique<OptimizerService>(ctx, optimizer_store_.get(), executor_.get(),
                                                  groups_.get());
  channels_ = std::make_unique<StreamChannelService>(ctx, executor_.get(), collective_.get());
  rendezvous_ = std::make_unique<RendezvousService>(rendezvous_store_.get());

  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  builder.SetMaxReceiveMessageSize(static_cast<int>(max_message_bytes));
  builder.SetMaxSendMessageSize(static_cast<int>(max_message_bytes));
  builder.RegisterService(quantizer_.get());
  builder.RegisterService(memory_.get());
  builder.RegisterService(channels_.get());
  builder.RegisterService(optimizer_.get());
  builder.RegisterService(collective_.get());
  builder.RegisterService(rendezvous_.get());
  if (config_.metrics_port != 0) {
    metrics_ = std::make_unique<metrics::Metrics>();
    AddGauges();
    std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> creators;
    creators.push_back(std::make_unique<MetricsInterceptorFactory>(metrics_.get()));
    builder.experimental().SetInterceptorCreators(std::move(creators));
  }
  if (!config_.socket_path.empty()) {
    QTX_RETURN_IF_ERROR(PrepareSocketPath(config_.socket_path));
    builder.AddListeningPort("unix:" + config_.socket_path, security.unix_socket);
  }
  if (!config_.listen_tcp.empty()) {
    builder.AddListeningPort(config_.listen_tcp, security.tcp, &tcp_port_);
  }
  {
    // The socket file is created 0600 (and chmod-ed below in case the
    // filesystem ignores the umask).
    ScopedUmask umask(0177);
    server_ = builder.BuildAndStart();
  }
  if (server_ == nullptr) {
    return absl::UnavailableError(absl::StrFormat(
        "cannot listen on %s%s%s (see the gRPC log line above)",
        config_.socket_path.empty() ? "" : "unix:" + config_.socket_path,
        (!config_.socket_path.empty() && !config_.listen_tcp.empty()) ? " and " : "",
        config_.listen_tcp));
  }
  if (!config_.socket_path.empty() && ::chmod(config_.socket_path.c_str(), 0600) != 0) {
    const std::string err = std::strerror(errno);
    server_->Shutdown(std::chrono::system_clock::now());
    return absl::FailedPreconditionError(
        absl::StrFormat("--socket=%s: cannot set mode 0600: %s", config_.socket_path, err));
  }
  if (!config_.listen_tcp.empty() && tcp_port_ == 0) {
    server_->Shutdown(std::chrono::system_clock::now());
    return absl::UnavailableError(
        absl::StrFormat("--listen_tcp=%s: cannot bind", config_.listen_tcp));
  }
  if (config_.health_port != 0) {
    // A second server with nothing but grpc.health.v1 (its own default
    // health service): plaintext and without the token, for probes.
    grpc::ServerBuilder health_builder;
    health_builder.AddListeningPort(absl::StrFormat("[::]:%d", config_.health_port),
                                    grpc::InsecureServerCredentials(), &health_port_);
    health_server_ = health_builder.BuildAndStart();
    if (health_server_ == nullptr || health_port_ == 0) {
      server_->Shutdown(std::chrono::system_clock::now());
      return absl::UnavailableError(
          absl::StrFormat("--health_port=%d: cannot listen (in use?)", config_.health_port));
    }
  }
  if (metrics_ != nullptr) {
    metrics::HttpExporterOptions exporter_options;
    exporter_options.host = config_.metrics_host;
    exporter_options.port = config_.metrics_port;
    auto exporter = metrics::HttpExporter::Create(exporter_options, metrics_.get());
    if (!exporter.ok()) {
      server_->Shutdown(std::chrono::system_clock::now());
      return exporter.status();
    }
    metrics_exporter_ = *std::move(exporter);
  }
  for (grpc::Server* s : {server_.get(), health_server_.get()}) {
    if (s == nullptr) continue;
    if (auto* health = s->GetHealthCheckService()) {
      for (const char* name : kHealthServices) health->SetServingStatus(name, true);
    }
  }
  if (config_.worker_stall_s > 0) {
    watchdog_ = std::thread([this] {
      while (!stop_watchdog_.WaitForNotificationWithTimeout(absl::Seconds(1))) {
        CheckWorkers(absl::Now());
      }
    });
  }
  spdlog::info(
      "event=listening socket={} tcp_port={} tls={} mtls={} token={} health_port={} "
      "metrics_host={} metrics_port={} device={} threads={} inline_max_concurrent={} "
      "inline_max_bytes={} "
      "inline_max_device_bytes={} max_message_mb={} allow_client_shm={}",
      config_.socket_path.empty() ? "-" : config_.socket_path, tcp_port_, security.tls,
      security.mtls, security.token, health_port_, config_.metrics_host, metrics_port(),
      device_->name(), config_.threads, config_.inline_max_concurrent, config_.inline_max_bytes,
      config_.inline_max_device_bytes, config_.max_message_mb, config_.allow_client_shm);
  return absl::OkStatus();
}

void QtxServer::AddGauges() {
  metrics_->AddGauge("qtx_requests_inline_total",
                     "Requests run on the gRPC thread that received them (short ops), since start.",
                     [this] { return static_cast<double>(inline_slots_->runs()); });
  metrics_->AddGauge("qtx_channels", "Stream-ordered channels open now.",
                     [this] { return static_cast<double>(channels_->open_channels()); });
  metrics_->AddGauge("qtx_regions", "Registered memory regions.",
                     [this] { return static_cast<double>(regions_->size()); });
  metrics_->AddGauge("qtx_shm_faults_total",
                     "SIGBUS faults absorbed because a client truncated a registered shm object "
                     "while a request used it, since start.",
                     [] { return static_cast<double>(tensor::ShmFaultGuard::faults_total()); });
  metrics_->AddGauge("qtx_region_bytes", "Bytes of all registered memory regions.", [this] {
    double bytes = 0;
    for (const tensor::RegionInfo& r : regions_->List()) bytes += static_cast<double>(r.byte_size);
    return bytes;
  });
  metrics_->AddGauge("qtx_collective_groups", "Collective groups this sidecar is a member of.",
                     [this] { return static_cast<double>(groups_->ListGroups().size()); });
  metrics_->AddGauge("qtx_optimizer_groups", "Offloaded optimizer parameter groups.",
                     [this] { return static_cast<double>(optimizer_store_->ListGroups().size()); });
  metrics_->AddGauge("qtx_optimizer_state_bytes",
                     "Host bytes of optimizer state (master weights + moments).",
                     [this] { return static_cast<double>(optimizer_store_->memory_used_bytes()); });
  metrics_->AddGauge(
      "qtx_optimizer_state_limit_bytes", "The optimizer state cap (--optimizer_memory_limit_mb).",
      [this] { return static_cast<double>(optimizer_store_->memory_limit_bytes()); });
}

bool QtxServer::CheckWorkers(absl::Time now) {
  if (config_.worker_stall_s <= 0 || executor_ == nullptr) return false;
  const absl::Duration stall = absl::Seconds(config_.worker_stall_s);
  const bool wedged = executor_->AllWorkersBusySince(now - stall);
  absl::MutexLock lock(&health_mu_);
  if (wedged == wedged_) return wedged;
  wedged_ = wedged;
  if (wedged) {
    spdlog::error(
        "event=workers_wedged threads={} stall_s={} queued={} (health reports NOT_SERVING until "
        "a worker is free)",
        config_.threads, config_.worker_stall_s, executor_->queued());
  } else {
    spdlog::info("event=workers_recovered");
  }
  for (grpc::Server* s : {server_.get(), health_server_.get()}) {
    if (s == nullptr) continue;
    if (auto* health = s->GetHealthCheckService()) {
      for (const char* name : kHealthServices) health->SetServingStatus(name, !wedged);
    }
  }
  return wedged;
}

bool QtxServer::Shutdown(absl::Duration grace) {
  {
    absl::MutexLock lock(&shutdown_mu_);
    if (shut_down_) return shutdown_clean_;
    shut_down_ = true;
  }
  stop_watchdog_.Notify();
  if (watchdog_.joinable()) watchdog_.join();
  if (server_ != nullptr) {
    spdlog::info("event=shutdown_begin grace_s={}", absl::ToDoubleSeconds(grace));
    if (auto* health = server_->GetHealthCheckService()) health->Shutdown();
    if (health_server_ != nullptr) {
      if (auto* health = health_server_->GetHealthCheckService()) health->Shutdown();
    }
  }
  // gRPC's Shutdown waits for every handler to finish even after it cancels
  // them, and the executor for its running tasks: a wedged call would hold
  // either forever. Run both on a thread and stop waiting at grace + slack.
  auto drained = std::make_shared<absl::Notification>();
  drain_ = std::thread([this, grace, drained] {
    if (server_ != nullptr) {
      server_->Shutdown(absl::ToChronoTime(absl::Now() + grace));
      if (health_server_ != nullptr) health_server_->Shutdown(std::chrono::system_clock::now());
    }
    if (executor_ != nullptr) executor_->Shutdown();
    drained->Notify();
  });
  const absl::Duration slack = absl::Milliseconds(config_.shutdown_slack_ms);
  const bool clean = drained->WaitForNotificationWithTimeout(grace + slack);
  if (clean) {
    drain_.join();
  } else {
    spdlog::error(
        "event=shutdown_wedged grace_s={} slack_ms={} queued={} (calls still running after the "
        "grace period are abandoned; checkpointing the optimizer groups they do not hold)",
        absl::ToDoubleSeconds(grace), config_.shutdown_slack_ms,
        executor_ != nullptr ? executor_->queued() : 0);
  }
  // In-flight steps are done (or abandoned): checkpoint the optimizer state
  // (SIGTERM path). After a wedge, a group held by a stuck call is skipped.
  if (optimizer_store_ != nullptr) {
    const absl::Duration lock_wait = clean ? absl::InfiniteDuration() : absl::Seconds(1);
    if (absl::Status s = optimizer_store_->CheckpointAll(lock_wait); !s.ok()) {
      spdlog::error("event=optimizer_checkpoint_on_shutdown_failed msg=\"{}\"",
                    std::string(s.message()));
    }
  }
  if (server_ != nullptr && !config_.socket_path.empty()) {
    if (::unlink(config_.socket_path.c_str()) != 0 && errno != ENOENT) {
      spdlog::warn("event=socket_unlink_failed path={} error=\"{}\"", config_.socket_path,
                   std::strerror(errno));
    }
  }
  if (server_ != nullptr) spdlog::info("event=shutdown_done clean={}", clean);
  absl::MutexLock lock(&shutdown_mu_);
  shutdown_clean_ = clean;
  return clean;
}

QtxServer::~QtxServer() {
  Shutdown(absl::ZeroDuration());
  if (drain_.joinable()) drain_.join();  // waits for calls a wedge left running
  if (server_ != nullptr) server_->Wait();
  if (health_server_ != nullptr) health_server_->Wait();
}

}  // namespace qtx::server::api
