// ServerConfig: everything qtxd is told at startup, as a plain struct, so that
// tests can start an in-process server without flags. flags.h fills one from
// the command line.
#ifndef QTX_SERVER_CONFIG_SERVER_CONFIG_H_
#define QTX_SERVER_CONFIG_SERVER_CONFIG_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace qtx::server::config {

// The largest --optimizer_memory_limit_mb: 2^40 MiB (1 EiB).
inline constexpr int64_t kMaxOptimizerMemoryLimitMb = int64_t{1} << 40;

struct ServerConfig {
  // Unix domain socket to listen on (mode 0600). Empty: no unix socket.
  std::string socket_path = "/tmp/qtxd.sock";
  // "host:port" for TCP. Empty: no TCP. Port 0 picks a free port. Plaintext
  // only on a loopback host; any other host needs TLS (tls_cert_file +
  // tls_key_file) and client authentication (auth_token_file and/or
  // tls_client_ca_file).
  std::string listen_tcp;
  // TLS for the TCP listener and for calls to other sidecars: PEM server
  // certificate chain and its private key (both or neither).
  std::string tls_cert_file;
  std::string tls_key_file;
  // PEM CA bundle: TCP clients must present a certificate it signs (mTLS).
  std::string tls_client_ca_file;
  // PEM roots that verify other sidecars' certificates (rendezvous calls).
  // Empty: tls_client_ca_file, else the system roots.
  std::string peer_tls_ca_file;
  // File holding a bearer token: every call on every listener (except the
  // health-only port) must carry "authorization: Bearer <token>"; this
  // sidecar sends it to the other sidecars too. Empty: no token.
  std::string auth_token_file;
  // TCP port (all interfaces) serving only grpc.health.v1, plaintext and
  // without the token: for Kubernetes gRPC probes. 0: none.
  int health_port = 0;
  // TCP port serving Prometheus text metrics at /metrics. 0: none.
  int metrics_port = 0;
  // Address the metrics port listens on: loopback unless asked ("0.0.0.0" or
  // "::" for all interfaces, or one interface's address).
  std::string metrics_host = "127.0.0.1";
  // Host whose interface collective peers (Gloo TCP pairs) listen on and
  // that is advertised to them: a concrete address or name, never a wildcard
  // (0.0.0.0, ::). Off loopback the rendezvous with the other sidecars
  // carries group membership, so it needs TLS and authentication, as
  // listen_tcp does.
  std::string peer_host = "127.0.0.1";
  // gRPC send and receive limits, MiB (1..2047).
  int max_message_mb = 1024;
  // Allow Memory.RegisterRegion with client POSIX shm.
  bool allow_client_shm = false;
  // "auto" (cuda:0 if a GPU is visible, else cpu), "cpu", or "cuda:N" in a
  // CUDA build. qtxd's --device defaults to "auto".
  std::string device = "cpu";
  // Worker threads that run requests (1..1024).
  int threads = 4;
  // Requests waiting for a worker beyond this are refused with UNAVAILABLE.
  int max_queued_requests = 1024;
  // Short calls run on the gRPC thread that received them instead of a
  // worker (no thread hand-off), at most inline_max_concurrent at a time (0:
  // never). Short: at most inline_max_bytes of host work (CPU kernel input,
  // or bytes staged between host and GPU) and, when the host waits for a GPU
  // kernel, at most inline_max_device_bytes of kernel input (server/ops
  // QuantizeRunsShort).
  int inline_max_concurrent = 2;
  int64_t inline_max_bytes = int64_t{64} << 10;
  int64_t inline_max_device_bytes = int64_t{64} << 20;
  // Largest tensor, in elements.
  int64_t max_tensor_elements = int64_t{1} << 34;
  // How long SIGTERM waits for in-flight calls before cancelling them.
  int shutdown_grace_s = 30;
  // Calls stuck beyond the grace period (a wedged worker) are waited for at
  // most this much longer; shutdown then checkpoints what it can and
  // reports them (qtxd exits 1). Not a flag: tests shorten it.
  int shutdown_slack_ms = 5000;
  // Health reports NOT_SERVING while every worker thread has been running
  // one call for longer than this (the pool is wedged: queued calls cannot
  // start), SERVING again once one is free. 0: never. 0..86400.
  int worker_stall_s = 300;
  // Optimizer state store (server/optimizer): host-memory cap for master
  // weights + moments in MiB (0..kMaxOptimizerMemoryLimitMb), checkpoint
  // directory (empty: none), periodic checkpoints every K >= 0 steps (0: only
  // on request and at shutdown), host AdamW threads (0..1024; 0: OpenMP
  // default).
  int64_t optimizer_memory_limit_mb = 65536;
  std::string checkpoint_dir;
  // Directories LoadCheckpoint(sources=...) may read other sidecars'
  // checkpoints from (resharding), besides checkpoint_dir.
  std::vector<std::string> checkpoint_import_dirs;
  int64_t checkpoint_every_steps = 0;
  int optimizer_threads = 0;
};

// OK if every field is in range, and listen_tcp (if set) and peer_host name a
// loopback host or come with TLS and client authentication, and peer_host is
// no wildcard address. INVALID_ARGUMENT naming the flag and value otherwise.
absl::Status ValidateConfig(const ServerConfig& config);

struct HostPort {
  std::string host;  // without brackets
  int port = 0;
};

// Parses "host:port" or "[v6]:port". INVALID_ARGUMENT if malformed.
absl::StatusOr<HostPort> ParseHostPort(std::string_view s);

// True for "localhost", 127.0.0.0/8 and ::1.
bool IsLoopbackHost(std::string_view host);

// True for the wildcard addresses 0.0.0.0 and :: (any spelling).
bool IsUnspecifiedHost(std::string_view host);

}  // namespace qtx::server::config

#endif  // QTX_SERVER_CONFIG_SERVER_CONFIG_H_
