// qtx::Client against a qtxd that requires a bearer token and TLS: the token
// and TLS options work, and every refusal has the right status.
#include <netinet/in.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "qtx/client.h"
#include "tests/testing/qtxd_process.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/test_pki.h"

ABSL_FLAG(std::string, qtxd, "", "path of the qtxd binary");

namespace qtx {
namespace {

using ::qtx::testing::QtxdProcess;
using ::qtx::testing::StatusIs;
using ::qtx::testing::TestPki;
using ::testing::HasSubstr;

constexpr char kToken[] = "tok-3f9a1c";

Tensor SmallTensor() {
  std::vector<float> v(4 * 130);
  for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>(i % 17) - 8.0f;
  return Tensor::FromFloat32({4, 130}, v);
}

class ClientSecurityTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    ASSERT_TRUE(TestPki::Get().ok()) << "openssl failed: see " << TestPki::Get().dir;
    char tmpl[] = "/tmp/qtx-csec-XXXXXX";
    dir_ = new std::string(::mkdtemp(tmpl));
    ::qtx::testing::WriteFile(*dir_ + "/token", std::string(kToken) + "\n");
    QtxdProcess::Options options;
    options.probe.auth_token = kToken;
    auto p = QtxdProcess::StartOnLoopbackPort(
        absl::GetFlag(FLAGS_qtxd),
        {"--device=cpu", "--tls_cert_file=" + TestPki::Get().server_cert,
         "--tls_key_file=" + TestPki::Get().server_key, "--auth_token_file=" + *dir_ + "/token"},
        options, &port_);
    ASSERT_TRUE(p.ok()) << p.status();
    server_ = p->release();
  }
  static void TearDownTestSuite() {
    delete server_;
    server_ = nullptr;
    if (dir_ != nullptr) std::system(("rm -rf " + *dir_).c_str());
    delete dir_;
    dir_ = nullptr;
  }
  void SetUp() override { ASSERT_NE(server_, nullptr); }

  static std::string TcpTarget() { return absl::StrCat("127.0.0.1:", port_); }
  static ClientOptions Tls(std::string token, const std::string& roots) {
    ClientOptions o;
    o.auth_token = std::move(token);
    o.tls = true;
    o.tls_root_certs_pem = roots;
    o.timeout = absl::Seconds(10);
    return o;
  }

  static inline QtxdProcess* server_ = nullptr;
  static inline std::string* dir_ = nullptr;
  static inline int port_ = 0;
};

TEST_F(ClientSecurityTest, TokenOnTheUnixSocket) {
  ClientOptions good;
  good.auth_token = kToken;
  QTX_ASSERT_OK_AND_ASSIGN(auto client, Client::Connect(server_->target(), good));
  QTX_ASSERT_OK_AND_ASSIGN(QuantizedTensor q, client->Quantize(SmallTensor(), {}));
  EXPECT_EQ(q.shape, (std::vector<int64_t>{4, 130}));

  QTX_ASSERT_OK_AND_ASSIGN(auto anonymous, Client::Connect(server_->target()));
  EXPECT_THAT(anonymous->Quantize(SmallTensor(), {}),
              StatusIs(absl::StatusCode::kUnauthenticated, HasSubstr("token")));
  ClientOptions wrong;
  wrong.auth_token = "not-the-token";
  QTX_ASSERT_OK_AND_ASSIGN(auto impostor, Client::Connect(server_->target(), wrong));
  EXPECT_THAT(impostor->ListRegions(), StatusIs(absl::StatusCode::kUnauthenticated, HasSubstr("")));
}

TEST_F(ClientSecurityTest, TlsAndTokenOverTcp) {
  QTX_ASSERT_OK_AND_ASSIGN(auto client,
                           Client::Connect(TcpTarget(), Tls(kToken, TestPki::Get().ca_pem)));
  QTX_ASSERT_OK_AND_ASSIGN(QuantizedTensor q, client->Quantize(SmallTensor(), {}));
  EXPECT_TRUE(q.rowwise_data.has_value());

  // TLS without the token.
  QTX_ASSERT_OK_AND_ASSIGN(auto no_token,
                           Client::Connect(TcpTarget(), Tls("", TestPki::Get().ca_pem)));
  EXPECT_THAT(no_token->ListRegions(), StatusIs(absl::StatusCode::kUnauthenticated, HasSubstr("")));
  // A server certificate the client does not trust.
  QTX_ASSERT_OK_AND_ASSIGN(auto untrusted,
                           Client::Connect(TcpTarget(), Tls(kToken, TestPki::Get().other_ca_pem)));
  EXPECT_THAT(untrusted->ListRegions(), StatusIs(absl::StatusCode::kUnavailable, HasSubstr("")));
  // Plaintext to the TLS port.
  ClientOptions plain;
  plain.auth_token = kToken;
  plain.timeout = absl::Seconds(10);
  QTX_ASSERT_OK_AND_ASSIGN(auto plaintext, Client::Connect(TcpTarget(), plain));
  EXPECT_THAT(plaintext->ListRegions(), StatusIs(absl::StatusCode::kUnavailable, HasSubstr("")));
}

TEST_F(ClientSecurityTest, MutualTlsNeedsTheClientCertificate) {
  int port = 0;
  auto mtls = QtxdProcess::StartOnLoopbackPort(
      absl::GetFlag(FLAGS_qtxd),
      {"--device=cpu", "--tls_cert_file=" + TestPki::Get().server_cert,
       "--tls_key_file=" + TestPki::Get().server_key,
       "--tls_client_ca_file=" + TestPki::Get().ca_file},
      {}, &port);
  ASSERT_TRUE(mtls.ok()) << mtls.status();
  const std::string target = absl::StrCat("127.0.0.1:", port);
  ClientOptions with_cert = Tls("", TestPki::Get().ca_pem);
  with_cert.tls_client_cert_pem = TestPki::Get().client_cert_pem;
  with_cert.tls_client_key_pem = TestPki::Get().client_key_pem;
  QTX_ASSERT_OK_AND_ASSIGN(auto client, Client::Connect(target, with_cert));
  QTX_EXPECT_OK(client->ListRegions());
  QTX_ASSERT_OK_AND_ASSIGN(auto no_cert, Client::Connect(target, Tls("", TestPki::Get().ca_pem)));
  EXPECT_THAT(no_cert->ListRegions(), StatusIs(absl::StatusCode::kUnavailable, HasSubstr("")));
  client.reset();
  no_cert.reset();
}

TEST_F(ClientSecurityTest, BadTlsOptionsAreRefusedAtConnect) {
  ClientOptions o = Tls(kToken, TestPki::Get().ca_pem);
  EXPECT_THAT(Client::Connect(server_->target(), o),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("unix socket")));
  o.tls_client_cert_pem = TestPki::Get().client_cert_pem;  // no key
  EXPECT_THAT(Client::Connect(TcpTarget(), o),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("tls_client_key_pem")));
  ClientOptions roots_without_tls;
  roots_without_tls.tls_root_certs_pem = TestPki::Get().ca_pem;
  EXPECT_THAT(Client::Connect(TcpTarget(), roots_without_tls),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("tls=false")));
  ClientOptions crlf;
  crlf.auth_token = "a\r\nx-evil: 1";
  EXPECT_THAT(Client::Connect(server_->target(), crlf),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("line breaks")));
}

}  // namespace
}  // namespace qtx

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  absl::ParseCommandLine(argc, argv);
  return RUN_ALL_TESTS();
}
