#include "server/api/security.h"

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/str_format.h"
#include "common/status_macros.h"

namespace qtx::server::api {
namespace {

absl::StatusOr<std::string> ReadFile(const std::string& path, std::string_view flag) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::FailedPreconditionError(
        absl::StrFormat("--%s=%s: cannot read: %s", flag, path, std::strerror(errno)));
  }
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Constant-time equality (the time depends on the lengths only).
bool SecureEquals(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff |= static_cast<unsigned char>(a[i]) ^ static_cast<unsigned char>(b[i]);
  }
  return diff == 0;
}

}  // namespace

absl::StatusOr<std::string> ReadTokenFile(const std::string& path) {
  QTX_ASSIGN_OR_RETURN(std::string raw, ReadFile(path, "auth_token_file"));
  std::string token(absl::StripAsciiWhitespace(raw));
  if (token.empty()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("--auth_token_file=%s: the file holds no token", path));
  }
  for (char ch : token) {
    if (ch < 0x21 || ch > 0x7e) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "--auth_token_file=%s: the token must be printable ASCII without spaces", path));
    }
  }
  return token;
}

grpc::Status BearerTokenProcessor::Process(const InputMetadata& auth_metadata,
                                           grpc::AuthContext* /*context*/,
                                           OutputMetadata* consumed_auth_metadata,
                                           OutputMetadata* /*response_metadata*/) {
  auto it = auth_metadata.find(
      grpc::string_ref(kAuthorizationHeader.data(), kAuthorizationHeader.size()));
  if (it == auth_metadata.end()) {
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                        "this qtxd requires a bearer token: send metadata 'authorization: "
                        "Bearer <token>' (the token of qtxd --auth_token_file)");
  }
  const std::string_view value(it->second.data(), it->second.size());
  constexpr std::string_view kBearer = "Bearer ";
  if (!value.starts_with(kBearer) || !SecureEquals(value.substr(kBearer.size()), token_)) {
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                        "the 'authorization' metadata does not carry this qtxd's bearer token "
                        "(expected 'Bearer <token of --auth_token_file>')");
  }
  consumed_auth_metadata->insert({std::string(kAuthorizationHeader), std::string(value)});
  return grpc::Status::OK;
}

absl::StatusOr<ServerSecurity> MakeServerSecurity(const config::ServerConfig& config) {
  ServerSecurity s;
  std::shared_ptr<BearerTokenProcessor> processor;
  if (!config.auth_token_file.empty()) {
    QTX_ASSIGN_OR_RETURN(std::string token, ReadTokenFile(config.auth_token_file));
    processor = std::make_shared<BearerTokenProcessor>(std::move(token));
    s.token = true;
  }
  // The unix socket: an auth metadata processor only runs on a secure
  // transport, and "local" credentials are gRPC's secure transport for UDS
  // (no handshake bytes: plaintext clients still connect).
  if (processor != nullptr) {
    s.unix_socket = grpc::experimental::LocalServerCredentials(UDS);
    s.unix_socket->SetAuthMetadataProcessor(processor);
  } else {
    s.unix_socket = grpc::InsecureServerCredentials();
  }
  if (!config.tls_cert_file.empty()) {
    grpc::SslServerCredentialsOptions opts;
    grpc::SslServerCredentialsOptions::PemKeyCertPair pair;
    QTX_ASSIGN_OR_RETURN(pair.cert_chain, ReadFile(config.tls_cert_file, "tls_cert_file"));
    QTX_ASSIGN_OR_RETURN(pair.private_key, ReadFile(config.tls_key_file, "tls_key_file"));
    opts.pem_key_cert_pairs.push_back(std::move(pair));
    if (!config.tls_client_ca_file.empty()) {
      QTX_ASSIGN_OR_RETURN(opts.pem_root_certs,
                           ReadFile(config.tls_client_ca_file, "tls_client_ca_file"));
      opts.client_certificate_request = GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY;
      s.mtls = true;
    }
    s.tcp = grpc::SslServerCredentials(opts);
    s.tls = true;
  } else if (processor != nullptr) {
    // Plaintext loopback TCP (ValidateConfig allows nothing else) with a token.
    s.tcp = grpc::experimental::LocalServerCredentials(LOCAL_TCP);
  } else {
    s.tcp = grpc::InsecureServerCredentials();
  }
  if (processor != nullptr && s.tcp != nullptr) s.tcp->SetAuthMetadataProcessor(processor);
  return s;
}

absl::StatusOr<PeerSecurity> MakePeerSecurity(const config::ServerConfig& config) {
  PeerSecurity p;
  if (!config.auth_token_file.empty()) {
    QTX_ASSIGN_OR_RETURN(p.token, ReadTokenFile(config.auth_token_file));
  }
  if (!config.tls_cert_file.empty()) {
    grpc::SslCredentialsOptions opts;
    if (!config.peer_tls_ca_file.empty()) {
      QTX_ASSIGN_OR_RETURN(opts.pem_root_certs,
                           ReadFile(config.peer_tls_ca_file, "peer_tls_ca_file"));
    } else if (!config.tls_client_ca_file.empty()) {
      QTX_ASSIGN_OR_RETURN(opts.pem_root_certs,
                           ReadFile(config.tls_client_ca_file, "tls_client_ca_file"));
    }
    QTX_ASSIGN_OR_RETURN(opts.pem_cert_chain, ReadFile(config.tls_cert_file, "tls_cert_file"));
    QTX_ASSIGN_OR_RETURN(opts.pem_private_key, ReadFile(config.tls_key_file, "tls_key_file"));
    p.tcp = grpc::SslCredentials(opts);
  }
  return p;
}

std::shared_ptr<grpc::ChannelCredentials> PeerChannelCredentials(const PeerSecurity& security,
                                                                 std::string_view target) {
  if (target.starts_with("unix:")) return grpc::InsecureChannelCredentials();
  return security.tcp;
}

}  // namespace qtx::server::api
