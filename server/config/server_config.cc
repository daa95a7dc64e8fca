#include "server/config/server_config.h"

#include <arpa/inet.h>

#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "common/status_macros.h"

namespace qtx::server::config {

absl::StatusOr<HostPort> ParseHostPort(std::string_view s) {
  HostPort hp;
  std::string_view port;
  if (!s.empty() && s.front() == '[') {
    const size_t close = s.find(']');
    if (close == std::string_view::npos || close + 1 >= s.size() || s[close + 1] != ':') {
      return absl::InvalidArgumentError(absl::StrFormat("'%s': expected [ipv6]:port", s));
    }
    hp.host = std::string(s.substr(1, close - 1));
    port = s.substr(close + 2);
  } else {
    const size_t colon = s.rfind(':');
    if (colon == std::string_view::npos || s.find(':') != colon) {
      return absl::InvalidArgumentError(
          absl::StrFormat("'%s': expected host:port (IPv6 as [addr]:port)", s));
    }
    hp.host = std::string(s.substr(0, colon));
    port = s.substr(colon + 1);
  }
  if (hp.host.empty() || !absl::SimpleAtoi(std::string(port), &hp.port) || hp.port < 0 ||
      hp.port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrFormat("'%s': expected host:port with a port in 0..65535", s));
  }
  return hp;
}

bool IsLoopbackHost(std::string_view host) {
  if (host == "localhost") return true;
  const std::string h(host);
  in_addr v4;
  if (inet_pton(AF_INET, h.c_str(), &v4) == 1) {
    return (ntohl(v4.s_addr) >> 24) == 127;
  }
  in6_addr v6;
  if (inet_pton(AF_INET6, h.c_str(), &v6) == 1) {
    return IN6_IS_ADDR_LOOPBACK(&v6);
  }
  return false;
}

bool IsUnspecifiedHost(std::string_view host) {
  const std::string h(host);
  in_addr v4;
  if (inet_pton(AF_INET, h.c_str(), &v4) == 1) return v4.s_addr == htonl(INADDR_ANY);
  in6_addr v6;
  if (inet_pton(AF_INET6, h.c_str(), &v6) == 1) return IN6_IS_ADDR_UNSPECIFIED(&v6);
  return false;
}

namespace {

// The peer rule: a concrete host, and off loopback TLS plus authentication
// (what --listen_tcp asks of a non-loopback listener).
absl::Status ValidatePeerHost(const ServerConfig& c) {
  std::string_view host = c.peer_host;
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  if (host.empty()) {
    return absl::InvalidArgumentError(
        "--peer_host is empty: name this host's address that the other sidecars can reach "
        "(127.0.0.1 when every rank runs on this machine)");
  }
  if (IsUnspecifiedHost(host)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "--peer_host=%s: a wildcard address cannot be advertised to the other sidecars; name "
        "this host's address on the network they share (e.g. the pod IP), or 127.0.0.1 when "
        "every rank runs on this machine",
        c.peer_host));
  }
  if (IsLoopbackHost(host)) return absl::OkStatus();
  if (c.tls_cert_file.empty()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "--peer_host=%s: not a loopback address; the rendezvous with other sidecars would be "
        "plaintext: set --tls_cert_file and --tls_key_file (and --auth_token_file), or use "
        "127.0.0.1 when every rank runs on this machine",
        c.peer_host));
  }
  if (c.auth_token_file.empty() && c.tls_client_ca_file.empty()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "--peer_host=%s: not a loopback address; sidecars must authenticate each other: set "
        "--auth_token_file (bearer token) and/or --tls_client_ca_file (client certificates)",
        c.peer_host));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateConfig(const ServerConfig& c) {
  if (c.socket_path.empty() && c.listen_tcp.empty()) {
    return absl::InvalidArgumentError(
        "--socket and --listen_tcp are both empty: the server would listen nowhere");
  }
  // sockaddr_un.sun_path holds 108 bytes including the terminating NUL.
  if (c.socket_path.size() > 107) {
    return absl::InvalidArgumentError(
        absl::StrFormat("--socket=%s: %d bytes, a unix socket path may have at most 107",
                        c.socket_path, c.socket_path.size()));
  }
  if (!c.listen_tcp.empty()) {
    auto hp = ParseHostPort(c.listen_tcp);
    if (!hp.ok()) {
      return absl::InvalidArgumentError(
          absl::StrFormat("--listen_tcp=%s: %s", c.listen_tcp, hp.status().message()));
    }
    const bool tls = !c.tls_cert_file.empty();
    if (!IsLoopbackHost(hp->host) && !tls) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "--listen_tcp=%s: host '%s' is not a loopback address; plaintext TCP is only allowed "
          "on loopback (localhost, 127.0.0.0/8, [::1]): set --tls_cert_file and --tls_key_file",
          c.listen_tcp, hp->host));
    }
    if (!IsLoopbackHost(hp->host) && c.auth_token_file.empty() && c.tls_client_ca_file.empty()) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "--listen_tcp=%s: host '%s' is not a loopback address; clients must authenticate: set "
          "--auth_token_file (bearer token) and/or --tls_client_ca_file (client certificates)",
          c.listen_tcp, hp->host));
    }
  }
  QTX_RETURN_IF_ERROR(ValidatePeerHost(c));
  if (c.metrics_host.empty()) {
    return absl::InvalidArgumentError(
        "--metrics_host is empty: use 127.0.0.1 (the default), an interface address, or 0.0.0.0");
  }
  if (c.tls_cert_file.empty() != c.tls_key_file.empty()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("--tls_cert_file='%s' --tls_key_file='%s': set both or neither",
                        c.tls_cert_file, c.tls_key_file));
  }
  if (!c.tls_client_ca_file.empty() && c.tls_cert_file.empty()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "--tls_client_ca_file=%s: client certificates need TLS: set --tls_cert_file and "
        "--tls_key_file",
        c.tls_client_ca_file));
  }
  for (const auto& [flag, port] : {std::pair<const char*, int>{"health_port", c.health_port},
                                   std::pair<const char*, int>{"metrics_port", c.metrics_port}}) {
    if (port < 0 || port > 65535) {
      return absl::InvalidArgumentError(
          absl::StrFormat("--%s=%d: must be 0 (off) or 1..65535", flag, port));
    }
  }
  if (c.max_message_mb < 1 || c.max_message_mb > 2047) {
    return absl::InvalidArgumentError(
        absl::StrFormat("--max_message_mb=%d: must be 1..2047", c.max_message_mb));
  }
  if (c.threads < 1 || c.threads > 1024) {
    return absl::InvalidArgumentError(absl::StrFormat("--threads=%d: must be 1..1024", c.threads));
  }
  if (c.inline_max_concurrent < 0 || c.inline_max_concurrent > 1024) {
    return absl::InvalidArgumentError(
        absl::StrFormat("--inline_max_concurrent=%d: must be 0..1024", c.inline_max_concurrent));
  }
  if (c.inline_max_bytes < 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("--inline_max_bytes=%d: must be >= 0", c.inline_max_bytes));
  }
  if (c.inline_max_device_bytes < 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("--inline_max_device_bytes=%d: must be >= 0", c.inline_max_device_bytes));
  }
  if (c.max_queued_requests < 1) {
    return absl::InvalidArgumentError(
        absl::StrFormat("--max_queued_requests=%d: must be >= 1", c.max_queued_requests));
  }
  if (c.max_tensor_elements < 1 || c.max_tensor_elements > (int64_t{1} << 40)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("--max_tensor_elements=%d: must be 1..2^40", c.max_tensor_elements));
  }
  // Converted to bytes with << 20: bounded well below 2^64 bytes, and never
  // negative (a negative value used to wrap to "unlimited").
  if (c.optimizer_memory_limit_mb < 0 || c.optimizer_memory_limit_mb > kMaxOptimizerMemoryLimitMb) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "--optimizer_memory_limit_mb=%d: must be 0..%d (MiB; 0 refuses every optimizer group)",
        c.optimizer_memory_limit_mb, kMaxOptimizerMemoryLimitMb));
  }
  if (c.optimizer_threads < 0 || c.optimizer_threads > 1024) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "--optimizer_threads=%d: must be 0..1024 (0: one per core)", c.optimizer_threads));
  }
  if (c.checkpoint_every_steps < 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "--checkpoint_every_steps=%d: must be >= 0 (0: only on request and at shutdown)",
        c.checkpoint_every_steps));
  }
  for (const std::string& d : c.checkpoint_import_dirs) {
    if (d.empty() || d.front() != '/') {
      return absl::InvalidArgumentError(absl::StrFormat(
          "--checkpoint_import_dirs entry '%s': must be an absolute directory path", d));
    }
  }
  if (c.shutdown_grace_s < 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("--shutdown_grace_s=%d: must be >= 0", c.shutdown_grace_s));
  }
  if (c.shutdown_slack_ms < 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("shutdown_slack_ms=%d: must be >= 0", c.shutdown_slack_ms));
  }
  if (c.worker_stall_s < 0 || c.worker_stall_s > 86400) {
    return absl::InvalidArgumentError(
        absl::StrFormat("--worker_stall_s=%d: must be 0 (off) ..86400", c.worker_stall_s));
  }
  return absl::OkStatus();
}

}  // namespace qtx::server::config
