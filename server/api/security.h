// Transport security of qtxd: the credentials of each listener, the bearer
// token check, and the credentials this sidecar uses to call other sidecars.
//
//   unix socket        plaintext (mode 0600 is its access control); with a
//                      token, gRPC "local" credentials so the token check runs
//   TCP on loopback    plaintext, or TLS when --tls_cert_file is set
//   TCP elsewhere      TLS only (ValidateConfig refuses anything else), plus a
//                      bearer token and/or client certificates (mTLS)
//   --health_port      plaintext grpc.health.v1 only, no token (probes)
//
// The token is compared in constant time; the failure says what is missing
// but never echoes what was sent.
//
// Thread safety: everything here is immutable after creation and safe for
// concurrent use.
#ifndef QTX_SERVER_API_SECURITY_H_
#define QTX_SERVER_API_SECURITY_H_

#include <grpcpp/grpcpp.h>
#include <grpcpp/security/auth_metadata_processor.h>

#include <memory>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "server/config/server_config.h"

namespace qtx::server::api {

inline constexpr std::string_view kAuthorizationHeader = "authorization";

// Reads the token in `path` (surrounding whitespace removed).
// NOT_FOUND / PERMISSION_DENIED when the file cannot be read (naming the
// flag); INVALID_ARGUMENT when it is empty.
absl::StatusOr<std::string> ReadTokenFile(const std::string& path);

// Checks "authorization: Bearer <token>" on every call it sees;
// UNAUTHENTICATED otherwise.
class BearerTokenProcessor final : public grpc::AuthMetadataProcessor {
 public:
  explicit BearerTokenProcessor(std::string token) : token_(std::move(token)) {}
  bool IsBlocking() const override { return false; }
  grpc::Status Process(const InputMetadata& auth_metadata, grpc::AuthContext* context,
                       OutputMetadata* consumed_auth_metadata,
                       OutputMetadata* response_metadata) override;

 private:
  const std::string token_;
};

// The credentials of qtxd's listeners, built from the config's files.
struct ServerSecurity {
  std::shared_ptr<grpc::ServerCredentials> unix_socket;
  std::shared_ptr<grpc::ServerCredentials> tcp;
  bool tls = false;
  bool mtls = false;
  bool token = false;
};

// Reads the TLS and token files. FAILED_PRECONDITION naming the flag when a
// file cannot be read; INVALID_ARGUMENT for an empty token.
absl::StatusOr<ServerSecurity> MakeServerSecurity(const config::ServerConfig& config);

// How this sidecar calls other sidecars (the collective rendezvous).
struct PeerSecurity {
  // For "host:port" targets: TLS (own certificate as the client certificate,
  // peer roots) when this sidecar has TLS, else plaintext.
  std::shared_ptr<grpc::ChannelCredentials> tcp = grpc::InsecureChannelCredentials();
  // Sent as "authorization: Bearer <token>" when not empty.
  std::string token;
};

// Reads the files named by the config. FAILED_PRECONDITION naming the flag
// when one cannot be read.
absl::StatusOr<PeerSecurity> MakePeerSecurity(const config::ServerConfig& config);

// Channel credentials for `target` under `security` (unix targets are always
// plaintext: the socket's mode is their access control).
std::shared_ptr<grpc::ChannelCredentials> PeerChannelCredentials(const PeerSecurity& security,
                                                                 std::string_view target);

}  // namespace qtx::server::api

#endif  // QTX_SERVER_API_SECURITY_H_
