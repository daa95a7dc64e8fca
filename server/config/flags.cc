#include "server/config/flags.h"

#include <cstdint>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/string_view.h"

ABSL_FLAG(std::string, socket, "/tmp/qtxd.sock",
          "Unix domain socket to listen on (created with mode 0600). Empty: none.");
ABSL_FLAG(std::string, listen_tcp, "",
          "Also listen on TCP host:port. Plaintext only on loopback; other hosts need "
          "--tls_cert_file/--tls_key_file and --auth_token_file or --tls_client_ca_file.");
ABSL_FLAG(std::string, tls_cert_file, "",
          "PEM certificate chain for TLS on --listen_tcp (and presented to other sidecars).");
ABSL_FLAG(std::string, tls_key_file, "", "PEM private key of --tls_cert_file.");
ABSL_FLAG(std::string, tls_client_ca_file, "",
          "PEM CA bundle: TCP clients must present a certificate it signs (mutual TLS).");
ABSL_FLAG(std::string, peer_tls_ca_file, "",
          "PEM roots that verify other sidecars' certificates (collective rendezvous). "
          "Default: --tls_client_ca_file, else the system roots.");
ABSL_FLAG(std::string, auth_token_file, "",
          "File with a bearer token: every call must send 'authorization: Bearer <token>' "
          "(UNAUTHENTICATED otherwise); also sent to other sidecars.");
ABSL_FLAG(int32_t, health_port, 0,
          "TCP port (all interfaces) serving only grpc.health.v1, plaintext, no token: for "
          "Kubernetes gRPC probes. 0: off.");
ABSL_FLAG(int32_t, metrics_port, 0,
          "TCP port serving Prometheus text metrics at /metrics (on --metrics_host). 0: off.");
ABSL_FLAG(std::string, metrics_host, "127.0.0.1",
          "Address the metrics port listens on: loopback by default; an interface address, or "
          "0.0.0.0 / :: for all interfaces.");
ABSL_FLAG(std::string, peer_host, "127.0.0.1",
          "Host (name or address) whose interface collective peers listen on (Gloo TCP) and "
          "that is advertised to them. Not a wildcard (0.0.0.0); off loopback it needs "
          "--tls_cert_file/--tls_key_file and --auth_token_file or --tls_client_ca_file.");
ABSL_FLAG(int32_t, max_message_mb, 1024,
          "gRPC send and receive message limit in MiB (1..2047); bounds inline tensors.");
ABSL_FLAG(bool, allow_client_shm, false,
          "Allow clients to register POSIX shared-memory regions (Memory.RegisterRegion).");
ABSL_FLAG(std::string, device, "auto",
          "Compute device: auto (cuda:0 when a GPU is visible, else cpu), cpu, or cuda:N in a "
          "CUDA build.");
ABSL_FLAG(int32_t, threads, 4, "Worker threads that run requests.");
ABSL_FLAG(int32_t, max_queued_requests, 1024,
          "Requests waiting for a worker beyond this are refused with UNAVAILABLE.");
ABSL_FLAG(int32_t, inline_max_concurrent, 2,
          "Short calls (see --inline_max_bytes) run on the gRPC thread that received them, at "
          "most this many at a time; 0: every call goes to a worker thread.");
ABSL_FLAG(int64_t, inline_max_bytes, int64_t{64} << 10,
          "Short-call bound: bytes the host computes on or copies (the CPU kernel's input; "
          "bytes staged between host and GPU).");
ABSL_FLAG(int64_t, inline_max_device_bytes, int64_t{64} << 20,
          "Short-call bound: input bytes of a GPU kernel the host waits for. A call whose host "
          "would wait on a client CUDA event is never short.");
ABSL_FLAG(int64_t, max_tensor_elements, int64_t{1} << 34, "Largest tensor, in elements.");
ABSL_FLAG(int32_t, shutdown_grace_s, 30,
          "On SIGTERM/SIGINT, seconds to let in-flight calls finish before cancelling them; a "
          "call still stuck 5 s later is abandoned (state checkpointed where possible, exit 1).");
ABSL_FLAG(int32_t, worker_stall_s, 300,
          "Health reports NOT_SERVING while every worker thread has run one call for longer "
          "than this many seconds (wedged); 0: never.");
ABSL_FLAG(int64_t, optimizer_memory_limit_mb, 65536,
          "Host memory cap for optimizer state (master weights + moments), MiB, 0..2^40; going "
          "over fails with RESOURCE_EXHAUSTED.");
ABSL_FLAG(std::string, checkpoint_dir, "",
          "Directory for optimizer checkpoints; loaded at start (regular files only; links, "
          "FIFOs and other files named like a checkpoint are refused). Empty: no checkpoints.");
ABSL_FLAG(std::vector<std::string>, checkpoint_import_dirs, {},
          "Comma-separated directories (with their subdirectories) from which LoadCheckpoint may "
          "read other sidecars' checkpoints to reshard a group (e.g. a shared filesystem with "
          "every data-parallel owner's --checkpoint_dir); --checkpoint_dir is always allowed.");
ABSL_FLAG(int64_t, checkpoint_every_steps, 0,
          "Checkpoint each optimizer group every K >= 0 steps (0: only on request and at "
          "shutdown).");
ABSL_FLAG(int32_t, optimizer_threads, 0, "Host AdamW threads, 0..1024 (0: all cores).");
ABSL_FLAG(std::string, log_level, "info", "trace, debug, info, warn, error or off.");

namespace qtx::server::config {
namespace {

// Where the flags above are defined, as the compiler spelled __FILE__ (an
// absolute path, or one relative to the build folder under ccache).
constexpr absl::string_view kFlagsFile = "server/config/flags.cc";

bool IsQtxdFlagsFile(absl::string_view file) { return absl::EndsWith(file, kFlagsFile); }

}  // namespace

void InstallFlagsUsageConfig() {
  absl::FlagsUsageConfig config;
  config.contains_help_flags = IsQtxdFlagsFile;
  config.contains_helpshort_flags = IsQtxdFlagsFile;
  // "Flags from server/config/flags.cc:" rather than the build machine's path.
  config.normalize_filename = [](absl::string_view file) -> std::string {
    const size_t pos = file.rfind(kFlagsFile);
    if (pos != absl::string_view::npos) return std::string(file.substr(pos));
    const size_t start = file.find_first_not_of("/.");
    return std::string(start == absl::string_view::npos ? file : file.substr(start));
  };
  absl::SetFlagsUsageConfig(config);
}

ServerConfig ServerConfigFromFlags() {
  ServerConfig c;
  c.socket_path = absl::GetFlag(FLAGS_socket);
  c.listen_tcp = absl::GetFlag(FLAGS_listen_tcp);
  c.peer_host = absl::GetFlag(FLAGS_peer_host);
  c.tls_cert_file = absl::GetFlag(FLAGS_tls_cert_file);
  c.tls_key_file = absl::GetFlag(FLAGS_tls_key_file);
  c.tls_client_ca_file = absl::GetFlag(FLAGS_tls_client_ca_file);
  c.peer_tls_ca_file = absl::GetFlag(FLAGS_peer_tls_ca_file);
  c.auth_token_file = absl::GetFlag(FLAGS_auth_token_file);
  c.health_port = absl::GetFlag(FLAGS_health_port);
  c.metrics_port = absl::GetFlag(FLAGS_metrics_port);
  c.metrics_host = absl::GetFlag(FLAGS_metrics_host);
  c.max_message_mb = absl::GetFlag(FLAGS_max_message_mb);
  c.allow_client_shm = absl::GetFlag(FLAGS_allow_client_shm);
  c.device = absl::GetFlag(FLAGS_device);
  c.threads = absl::GetFlag(FLAGS_threads);
  c.max_queued_requests = absl::GetFlag(FLAGS_max_queued_requests);
  c.inline_max_concurrent = absl::GetFlag(FLAGS_inline_max_concurrent);
  c.inline_max_bytes = absl::GetFlag(FLAGS_inline_max_bytes);
  c.inline_max_device_bytes = absl::GetFlag(FLAGS_inline_max_device_bytes);
  c.max_tensor_elements = absl::GetFlag(FLAGS_max_tensor_elements);
  c.shutdown_grace_s = absl::GetFlag(FLAGS_shutdown_grace_s);
  c.worker_stall_s = absl::GetFlag(FLAGS_worker_stall_s);
  c.optimizer_memory_limit_mb = absl::GetFlag(FLAGS_optimizer_memory_limit_mb);
  c.checkpoint_dir = absl::GetFlag(FLAGS_checkpoint_dir);
  c.checkpoint_import_dirs = absl::GetFlag(FLAGS_checkpoint_import_dirs);
  c.checkpoint_every_steps = absl::GetFlag(FLAGS_checkpoint_every_steps);
  c.optimizer_threads = absl::GetFlag(FLAGS_optimizer_threads);
  return c;
}

std::string LogLevelFromFlags() { return absl::GetFlag(FLAGS_log_level); }

}  // namespace qtx::server::config
