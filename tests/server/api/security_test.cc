// TLS, bearer token and health-port behaviour of an in-process QtxServer:
// every refusal (no token, wrong token, plaintext to a TLS port, a client
// certificate missing under mTLS, non-loopback TCP without TLS or client
// authentication) and the accepted paths, with certificates made by the
// openssl command in a temporary directory.
#include "server/api/security.h"

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <future>
#include <sstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "qtx/v1/collective.grpc.pb.h"
#include "qtx/v1/memory.grpc.pb.h"
#include "server/api/collective_service.h"
#include "server/api/server.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/test_pki.h"

namespace qtx::server::api {
namespace {

using ::qtx::testing::StatusIs;
using ::testing::HasSubstr;

using ::qtx::testing::TestPki;

// The shared test PKI, through the name this file always used.
struct Pki {
  static const TestPki* Get() { return &TestPki::Get(); }
};

void WriteAll(const std::string& path, const std::string& text) {
  ::qtx::testing::WriteFile(path, text);
}

class SecurityTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(Pki::Get()->ok()) << "openssl failed: see " << Pki::Get()->dir << "/openssl.log";
    char tmpl[] = "/tmp/qtxd-sec-XXXXXX";
    dir_ = ::mkdtemp(tmpl);
    config_.socket_path = dir_ + "/qtxd.sock";
    config_.threads = 2;
    token_file_ = dir_ + "/token";
    WriteAll(token_file_, "s3cret-token\n");
  }
  void TearDown() override {
    if (server_) server_->Shutdown(absl::Seconds(2));
    server_.reset();
    std::system(("rm -rf " + dir_).c_str());
  }

  void Start() { QTX_ASSERT_OK_AND_ASSIGN(server_, QtxServer::Create(config_)); }

  // ListRegions on `channel`, with `token` ("" = no authorization header).
  grpc::Status Call(const std::shared_ptr<grpc::Channel>& channel, const std::string& token,
                    std::string_view authorization = "") {
    auto stub = v1::Memory::NewStub(channel);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    if (!token.empty()) ctx.AddMetadata("authorization", "Bearer " + token);
    if (!authorization.empty()) ctx.AddMetadata("authorization", std::string(authorization));
    v1::ListRegionsRequest req;
    v1::ListRegionsResponse resp;
    return stub->ListRegions(&ctx, req, &resp);
  }

  std::shared_ptr<grpc::Channel> Unix() {
    return grpc::CreateChannel("unix:" + config_.socket_path, grpc::InsecureChannelCredentials());
  }
  std::shared_ptr<grpc::Channel> Tls(bool client_cert, const std::string& roots) {
    grpc::SslCredentialsOptions o;
    o.pem_root_certs = roots;
    if (client_cert) {
      o.pem_cert_chain = Pki::Get()->client_cert_pem;
      o.pem_private_key = Pki::Get()->client_key_pem;
    }
    return grpc::CreateChannel(absl::StrCat("localhost:", server_->tcp_port()),
                               grpc::SslCredentials(o));
  }
  std::shared_ptr<grpc::Channel> PlainTcp() {
    return grpc::CreateChannel(absl::StrCat("127.0.0.1:", server_->tcp_port()),
                               grpc::InsecureChannelCredentials());
  }

  std::string dir_;
  std::string token_file_;
  config::ServerConfig config_;
  std::unique_ptr<QtxServer> server_;
};

TEST_F(SecurityTest, NoTokenConfiguredAcceptsPlainCalls) {
  Start();
  EXPECT_TRUE(Call(Unix(), "").ok());
}

TEST_F(SecurityTest, TokenOnUnixSocket) {
  config_.auth_token_file = token_file_;
  Start();
  struct stat st;
  ASSERT_EQ(::stat(config_.socket_path.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  grpc::Status none = Call(Unix(), "");
  EXPECT_EQ(none.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_THAT(none.error_message(), HasSubstr("requires a bearer token"));
  grpc::Status wrong = Call(Unix(), "s3cret-tokeN");
  EXPECT_EQ(wrong.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_THAT(wrong.error_message(), HasSubstr("does not carry this qtxd's bearer token"));
  EXPECT_THAT(wrong.error_message(), ::testing::Not(HasSubstr("tokeN")));
  EXPECT_EQ(Call(Unix(), "", "Basic s3cret-token").error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(Call(Unix(), "s3cret-token").error_code(), grpc::StatusCode::OK);
}

TEST_F(SecurityTest, TokenOnLoopbackPlaintextTcp) {
  config_.auth_token_file = token_file_;
  config_.listen_tcp = "127.0.0.1:0";
  Start();
  ASSERT_GT(server_->tcp_port(), 0);
  EXPECT_EQ(Call(PlainTcp(), "").error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(Call(PlainTcp(), "nope").error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(Call(PlainTcp(), "s3cret-token").error_code(), grpc::StatusCode::OK);
}

TEST_F(SecurityTest, TlsWithToken) {
  config_.auth_token_file = token_file_;
  config_.listen_tcp = "127.0.0.1:0";
  config_.tls_cert_file = Pki::Get()->server_cert;
  config_.tls_key_file = Pki::Get()->server_key;
  Start();
  ASSERT_GT(server_->tcp_port(), 0);
  // Plaintext to the TLS port: the handshake fails, the call never runs.
  EXPECT_EQ(Call(PlainTcp(), "s3cret-token").error_code(), grpc::StatusCode::UNAVAILABLE);
  // A client that does not trust the server's CA.
  EXPECT_EQ(Call(Tls(false, Pki::Get()->other_ca_pem), "s3cret-token").error_code(),
            grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(Call(Tls(false, Pki::Get()->ca_pem), "").error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(Call(Tls(false, Pki::Get()->ca_pem), "wrong").error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(Call(Tls(false, Pki::Get()->ca_pem), "s3cret-token").error_code(),
            grpc::StatusCode::OK);
}

TEST_F(SecurityTest, MutualTlsNeedsAClientCertificate) {
  config_.listen_tcp = "127.0.0.1:0";
  config_.tls_cert_file = Pki::Get()->server_cert;
  config_.tls_key_file = Pki::Get()->server_key;
  config_.tls_client_ca_file = Pki::Get()->ca_file;
  Start();
  EXPECT_EQ(Call(Tls(false, Pki::Get()->ca_pem), "").error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(Call(Tls(true, Pki::Get()->ca_pem), "").error_code(), grpc::StatusCode::OK);
}

TEST_F(SecurityTest, NonLoopbackTcpIsRefusedAtStartup) {
  config_.listen_tcp = "0.0.0.0:0";
  EXPECT_THAT(QtxServer::Create(config_).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("set --tls_cert_file and --tls_key_file")));
  config_.tls_cert_file = Pki::Get()->server_cert;
  config_.tls_key_file = Pki::Get()->server_key;
  EXPECT_THAT(QtxServer::Create(config_).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--auth_token_file")));
  config_.auth_token_file = token_file_;
  Start();
  EXPECT_GT(server_->tcp_port(), 0);
}

TEST_F(SecurityTest, BadFilesAreRefusedAtStartup) {
  config_.auth_token_file = dir_ + "/missing";
  EXPECT_THAT(QtxServer::Create(config_).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("--auth_token_file=" + dir_ + "/missing: cannot read")));
  WriteAll(dir_ + "/empty", " \n");
  config_.auth_token_file = dir_ + "/empty";
  EXPECT_THAT(QtxServer::Create(config_).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("holds no token")));
  config_.auth_token_file = "";
  config_.tls_cert_file = Pki::Get()->server_cert;
  EXPECT_THAT(QtxServer::Create(config_).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("set both or neither")));
}

TEST_F(SecurityTest, HealthPortNeedsNoToken) {
  config_.auth_token_file = token_file_;
  config_.health_port = 0;
  // Find a free port: bind a listener on port 0 through a throwaway server.
  {
    config::ServerConfig probe;
    probe.socket_path = "";
    probe.listen_tcp = "127.0.0.1:0";
    QTX_ASSERT_OK_AND_ASSIGN(auto s, QtxServer::Create(probe));
    config_.health_port = s->tcp_port();
    s->Shutdown(absl::ZeroDuration());
  }
  Start();
  ASSERT_EQ(server_->health_port(), config_.health_port);
  auto channel = grpc::CreateChannel(absl::StrCat("127.0.0.1:", server_->health_port()),
                                     grpc::InsecureChannelCredentials());
  grpc::GenericStub generic(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  grpc::Slice empty("");  // an empty HealthCheckRequest: the whole server
  grpc::ByteBuffer req(&empty, 1);
  grpc::ByteBuffer resp;
  std::promise<grpc::Status> done;
  generic.UnaryCall(&ctx, "/grpc.health.v1.Health/Check", grpc::StubOptions(), &req, &resp,
                    [&done](grpc::Status st) { done.set_value(st); });
  grpc::Status s = done.get_future().get();
  ASSERT_TRUE(s.ok()) << s.error_message();
  std::vector<grpc::Slice> slices;
  ASSERT_TRUE(resp.Dump(&slices).ok());
  std::string bytes;
  for (const auto& sl : slices) bytes.append(reinterpret_cast<const char*>(sl.begin()), sl.size());
  EXPECT_EQ(bytes, std::string("\x08\x01", 2));  // status: SERVING
  // Only health is served there.
  auto memory = grpc::CreateChannel(absl::StrCat("127.0.0.1:", server_->health_port()),
                                    grpc::InsecureChannelCredentials());
  EXPECT_EQ(Call(memory, "s3cret-token").error_code(), grpc::StatusCode::UNIMPLEMENTED);
}

// The rendezvous client (sidecar to sidecar) carries the same credentials.
TEST_F(SecurityTest, RendezvousClientUsesTlsAndToken) {
  config_.auth_token_file = token_file_;
  config_.listen_tcp = "127.0.0.1:0";
  config_.tls_cert_file = Pki::Get()->server_cert;
  config_.tls_key_file = Pki::Get()->server_key;
  config_.peer_tls_ca_file = Pki::Get()->ca_file;
  Start();
  const std::string target = absl::StrCat("localhost:", server_->tcp_port());
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  QTX_ASSERT_OK_AND_ASSIGN(PeerSecurity security, MakePeerSecurity(config_));
  GrpcRendezvousClient good(target, security);
  // Through TLS and the token, the calls reach the store, which answers them:
  // no group of this sidecar takes keys, and the key is missing.
  EXPECT_THAT(good.Set("k", "v", deadline),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("no group is forming")));
  std::vector<std::string> keys = {"k"};
  EXPECT_THAT(good.Get(keys, absl::Now() + absl::Milliseconds(100)),
              StatusIs(absl::StatusCode::kDeadlineExceeded,
                       HasSubstr("rendezvous keys not set before the deadline: k")));

  PeerSecurity no_token = security;
  no_token.token.clear();
  GrpcRendezvousClient anonymous(target, no_token);
  EXPECT_THAT(anonymous.Set("k2", "v", deadline),
              StatusIs(absl::StatusCode::kUnauthenticated, HasSubstr("bearer token")));
}

}  // namespace
}  // namespace qtx::server::api
