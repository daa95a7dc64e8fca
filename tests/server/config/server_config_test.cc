#include "server/config/server_config.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace qtx::server::config {
namespace {

using ::qtx::testing::StatusIs;
using ::testing::HasSubstr;

TEST(ServerConfig, DefaultsAreValid) { QTX_EXPECT_OK(ValidateConfig(ServerConfig())); }

TEST(ServerConfig, TcpOnlyOnLoopback) {
  ServerConfig c;
  for (const char* ok : {"127.0.0.1:50051", "localhost:0", "[::1]:7000", "127.1.2.3:1"}) {
    c.listen_tcp = ok;
    SCOPED_TRACE(ok);
    QTX_EXPECT_OK(ValidateConfig(c));
  }
  c.listen_tcp = "10.0.0.1:50051";
  EXPECT_THAT(ValidateConfig(c), StatusIs(absl::StatusCode::kInvalidArgument,
                                          HasSubstr("host '10.0.0.1' is not a loopback")));
  c.listen_tcp = "[::]:50051";
  EXPECT_THAT(ValidateConfig(c),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not a loopback")));
  c.listen_tcp = "localhost";
  EXPECT_THAT(ValidateConfig(c),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("expected host:port")));
  c.listen_tcp = "localhost:70000";
  EXPECT_THAT(ValidateConfig(c),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("0..65535")));
}

TEST(ServerConfig, RangesAreChecked) {
  ServerConfig c;
  c.max_message_mb = 2048;
  EXPECT_THAT(ValidateConfig(c), StatusIs(absl::StatusCode::kInvalidArgument,
                                          HasSubstr("--max_message_mb=2048: must be 1..2047")));
  c = ServerConfig();
  c.threads = 0;
  EXPECT_THAT(ValidateConfig(c),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--threads=0")));
  c = ServerConfig();
  c.inline_max_concurrent = -1;
  EXPECT_THAT(ValidateConfig(c),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("--inline_max_concurrent=-1: must be 0..1024")));
  c = ServerConfig();
  c.inline_max_bytes = -5;
  EXPECT_THAT(ValidateConfig(c),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--inline_max_bytes=-5")));
  c = ServerConfig();
  c.inline_max_device_bytes = -5;
  EXPECT_THAT(ValidateConfig(c), StatusIs(absl::StatusCode::kInvalidArgument,
                                          HasSubstr("--inline_max_device_bytes=-5")));
  c = ServerConfig();
  c.inline_max_concurrent = 0;  // never inline: valid
  QTX_EXPECT_OK(ValidateConfig(c));
}

// Issue 18 item 9: --optimizer_memory_limit_mb=-1 wrapped to unlimited and
// --optimizer_threads=-3 was accepted.
TEST(ServerConfig, OptimizerFlagsAreChecked) {
  ServerConfig c;
  c.optimizer_memory_limit_mb = -1;
  EXPECT_THAT(ValidateConfig(c),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("--optimizer_memory_limit_mb=-1: must be 0..")));
  c.optimizer_memory_limit_mb = kMaxOptimizerMemoryLimitMb + 1;
  EXPECT_THAT(ValidateConfig(c), StatusIs(absl::StatusCode::kInvalidArgument,
                                          HasSubstr("--optimizer_memory_limit_mb=1099511627777")));
  c.optimizer_memory_limit_mb = kMaxOptimizerMemoryLimitMb;
  QTX_EXPECT_OK(ValidateConfig(c));
  c.optimizer_memory_limit_mb = 0;
  QTX_EXPECT_OK(ValidateConfig(c));
  c = ServerConfig();
  c.optimizer_threads = -3;
  EXPECT_THAT(ValidateConfig(c), StatusIs(absl::StatusCode::kInvalidArgument,
                                          HasSubstr("--optimizer_threads=-3: must be 0..1024")));
  c.optimizer_threads = 1025;
  EXPECT_THAT(ValidateConfig(c),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--optimizer_threads=1025")));
  c.optimizer_threads = 0;
  QTX_EXPECT_OK(ValidateConfig(c));
  c = ServerConfig();
  c.checkpoint_every_steps = -1;
  EXPECT_THAT(ValidateConfig(c), StatusIs(absl::StatusCode::kInvalidArgument,
                                          HasSubstr("--checkpoint_every_steps=-1")));
}

TEST(ServerConfig, SocketPathIsChecked) {
  ServerConfig c;
  c.socket_path = std::string(108, 's');
  EXPECT_THAT(ValidateConfig(c),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("at most 107")));
  c = ServerConfig();
  c.socket_path = "";
  EXPECT_THAT(ValidateConfig(c),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("listen nowhere")));
}

// Issue 18 item 10: --peer_host is checked at startup like --listen_tcp: no
// wildcard, and off loopback only with TLS and authentication.
TEST(ServerConfig, PeerHostFollowsTheListenerRule) {
  ServerConfig c;
  for (const char* ok : {"127.0.0.1", "localhost", "::1", "[::1]", "127.0.0.2"}) {
    c.peer_host = ok;
    SCOPED_TRACE(ok);
    QTX_EXPECT_OK(ValidateConfig(c));
  }
  for (const char* wildcard : {"0.0.0.0", "::", "[::]", "0:0::0"}) {
    c.peer_host = wildcard;
    SCOPED_TRACE(wildcard);
    EXPECT_THAT(ValidateConfig(c), StatusIs(absl::StatusCode::kInvalidArgument,
                                            HasSubstr("a wildcard address cannot be advertised")));
  }
  c.peer_host = "";
  EXPECT_THAT(ValidateConfig(c),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--peer_host is empty")));
  c.peer_host = "10.1.2.3";
  EXPECT_THAT(ValidateConfig(c), StatusIs(absl::StatusCode::kInvalidArgument,
                                          HasSubstr("--peer_host=10.1.2.3: not a loopback "
                                                    "address; the rendezvous with other "
                                                    "sidecars would be plaintext")));
  c.tls_cert_file = "cert.pem";
  c.tls_key_file = "key.pem";
  EXPECT_THAT(ValidateConfig(c), StatusIs(absl::StatusCode::kInvalidArgument,
                                          HasSubstr("sidecars must authenticate each other")));
  c.auth_token_file = "token";
  QTX_EXPECT_OK(ValidateConfig(c));
  c.peer_host = "node-7.example";  // a name that is not localhost counts as off loopback
  QTX_EXPECT_OK(ValidateConfig(c));
  c.tls_cert_file = c.tls_key_file = "";
  EXPECT_THAT(ValidateConfig(c),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("would be plaintext")));
}

}  // namespace
}  // namespace qtx::server::config
