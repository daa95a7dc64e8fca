// Prometheus metrics: an in-process QtxServer with --metrics_port, a few
// calls (OK and failing), then GET /metrics over a plain socket and checks
// of the counters, histogram, byte counters and gauges; plus the text
// rendering of metrics::Metrics on its own.
#include "server/metrics/metrics.h"

#include <arpa/inet.h>
#include <grpcpp/grpcpp.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <unistd.h>

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "qtx/v1/memory.grpc.pb.h"
#include "qtx/v1/quantizer.grpc.pb.h"
#include "server/api/server.h"
#include "server/metrics/http_exporter.h"
#include "tests/server/testing/shm_object.h"
#include "tests/testing/free_port.h"
#include "tests/testing/status_matchers.h"

namespace qtx::server::api {
namespace {

using ::qtx::testing::FreeLoopbackPort;
using ::testing::HasSubstr;
using ::testing::Not;

// A minimal HTTP/1.0 GET; returns the whole response ("" on error).
std::string HttpGet(int port, const std::string& path, int timeout_s = 30) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  timeval tv{timeout_s, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    ::close(fd);
    return "";
  }
  const std::string req = absl::StrCat("GET ", path, " HTTP/1.0\r\nHost: localhost\r\n\r\n");
  (void)!::write(fd, req.data(), req.size());
  std::string out;
  char buf[4096];
  ssize_t n;
  while ((n = ::read(fd, buf, sizeof(buf))) > 0) out.append(buf, n);
  ::close(fd);
  return out;
}

// Opens a TCP connection to loopback `port` and sends `bytes` (a partial
// request); returns the fd (-1 on error).
int SendPartial(int port, const std::string& bytes) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    ::close(fd);
    return -1;
  }
  (void)!::write(fd, bytes.data(), bytes.size());
  return fd;
}

// Issue 18 item 7: clients that send a partial request and stay connected
// must not stop /metrics for everyone else.
TEST(MetricsTest, PartialRequestsDoNotBlockOtherScrapes) {
  char tmpl[] = "/tmp/qtxd-metrics-XXXXXX";
  const std::string dir = ::mkdtemp(tmpl);
  config::ServerConfig config;
  config.socket_path = dir + "/qtxd.sock";
  config.threads = 2;
  config.metrics_port = FreeLoopbackPort();
  QTX_ASSERT_OK_AND_ASSIGN(std::unique_ptr<QtxServer> server, QtxServer::Create(config));
  std::vector<int> stuck;
  for (int i = 0; i < 8; ++i) {
    stuck.push_back(SendPartial(server->metrics_port(), "GET /metrics HTTP/1.1\r\nHost: x\r\n"));
    ASSERT_GE(stuck.back(), 0);
  }
  // A scrape still gets its answer. (The client gives up after 4 s, less than
  // any per-connection timeout a blocking server would wait out first.)
  const std::string r = HttpGet(server->metrics_port(), "/metrics", /*timeout_s=*/4);
  EXPECT_THAT(r, HasSubstr("200 OK"));
  EXPECT_THAT(r, HasSubstr("qtx_regions"));
  for (int fd : stuck) ::close(fd);
  server->Shutdown(absl::Seconds(2));
  server.reset();
  std::system(("rm -rf " + dir).c_str());
}

// Issue 18 item 7: a connection that never completes its request is closed
// at its deadline, and the port listens on loopback unless asked otherwise.
TEST(MetricsTest, ExporterClosesSlowConnectionsAndDefaultsToLoopback) {
  metrics::Metrics m;
  metrics::HttpExporterOptions o;
  o.port = FreeLoopbackPort();
  o.request_timeout = absl::Milliseconds(200);
  o.max_connections = 2;
  QTX_ASSERT_OK_AND_ASSIGN(auto exporter, metrics::HttpExporter::Create(o, &m));
  EXPECT_EQ(exporter->bound_address(), "127.0.0.1");
  const int fd = SendPartial(o.port, "GET /metr");
  ASSERT_GE(fd, 0);
  timeval tv{30, 0};  // a safety net only; the server closes after 200 ms
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  char c;
  EXPECT_EQ(::read(fd, &c, 1), 0);  // EOF: closed by the server
  ::close(fd);
  // Past max_connections the oldest goes; a full request is still served.
  const int a = SendPartial(o.port, "GET /");
  const int b = SendPartial(o.port, "GET /");
  EXPECT_THAT(HttpGet(o.port, "/metrics"), HasSubstr("200 OK"));
  ::close(a);
  ::close(b);
  metrics::HttpExporterOptions all = o;
  all.host = "0.0.0.0";
  all.port = FreeLoopbackPort();
  QTX_ASSERT_OK_AND_ASSIGN(auto everywhere, metrics::HttpExporter::Create(all, &m));
  EXPECT_EQ(everywhere->bound_address(), "0.0.0.0");
  config::ServerConfig defaults;
  EXPECT_EQ(defaults.metrics_host, "127.0.0.1");
}

TEST(MetricsTest, RendersCountersHistogramAndGauges) {
  metrics::Metrics m;
  m.AddGauge("qtx_test_gauge", "A test gauge.", [] { return 42.0; });
  m.RecordRpc("/qtx.v1.Quantizer/Quantize", "OK", 0.0003, 100, 50);
  m.RecordRpc("/qtx.v1.Quantizer/Quantize", "OK", 2.0, 10, 5);
  m.RecordRpc("/qtx.v1.Quantizer/Quantize", "INVALID_ARGUMENT", 0.00001, 7, 0);
  const std::string t = m.RenderPrometheus();
  EXPECT_THAT(t, HasSubstr("qtx_grpc_requests_total{method=\"/qtx.v1.Quantizer/Quantize\","
                           "code=\"OK\"} 2\n"));
  EXPECT_THAT(t, HasSubstr("code=\"INVALID_ARGUMENT\"} 1\n"));
  EXPECT_THAT(t, HasSubstr("# TYPE qtx_grpc_request_duration_seconds histogram\n"));
  // Cumulative buckets: 1e-5 and 3e-4 are <= 0.0005; 2.0 only in 5 and +Inf.
  EXPECT_THAT(t, HasSubstr("le=\"0.0001\"} 1\n"));
  EXPECT_THAT(t, HasSubstr("le=\"0.00050000000000000001\"} 2\n"));
  EXPECT_THAT(t, HasSubstr("le=\"1\"} 2\n"));
  EXPECT_THAT(t, HasSubstr("le=\"5\"} 3\n"));
  EXPECT_THAT(t, HasSubstr("le=\"+Inf\"} 3\n"));
  EXPECT_THAT(t, HasSubstr("qtx_grpc_request_duration_seconds_count{method=\"/qtx.v1.Quantizer/"
                           "Quantize\"} 3\n"));
  EXPECT_THAT(t, HasSubstr("qtx_grpc_received_bytes_total{method=\"/qtx.v1.Quantizer/Quantize\"}"
                           " 117\n"));
  EXPECT_THAT(t,
              HasSubstr("qtx_grpc_sent_bytes_total{method=\"/qtx.v1.Quantizer/Quantize\"} 55\n"));
  EXPECT_THAT(t, HasSubstr("# TYPE qtx_test_gauge gauge\nqtx_test_gauge 42\n"));
}

TEST(MetricsTest, ServerExportsRpcMetricsOverHttp) {
  char tmpl[] = "/tmp/qtxd-metrics-XXXXXX";
  const std::string dir = ::mkdtemp(tmpl);
  config::ServerConfig config;
  config.socket_path = dir + "/qtxd.sock";
  config.allow_client_shm = true;
  config.threads = 2;
  config.metrics_port = FreeLoopbackPort();
  QTX_ASSERT_OK_AND_ASSIGN(std::unique_ptr<QtxServer> server, QtxServer::Create(config));
  ASSERT_EQ(server->metrics_port(), config.metrics_port);

  auto channel =
      grpc::CreateChannel("unix:" + config.socket_path, grpc::InsecureChannelCredentials());
  auto memory = v1::Memory::NewStub(channel);
  auto quantizer = v1::Quantizer::NewStub(channel);
  {
    testing::ShmObject shm(1 << 16);
    grpc::ClientContext ctx;
    v1::RegisterRegionRequest req;
    req.set_name("metrics-region");
    req.mutable_shm()->set_shm_name(shm.name());
    req.mutable_shm()->set_byte_size(1 << 16);
    v1::RegisterRegionResponse resp;
    ASSERT_TRUE(memory->RegisterRegion(&ctx, req, &resp).ok());
  }
  for (int i = 0; i < 2; ++i) {
    grpc::ClientContext ctx;
    v1::QuantizeRequest req;
    req.mutable_input()->set_dtype(v1::FLOAT32);
    req.mutable_input()->add_shape(2);
    req.mutable_input()->add_shape(128);
    req.mutable_input()->set_inline_data(std::string(2 * 128 * 4, '\0'));
    v1::QuantizeResponse resp;
    ASSERT_TRUE(quantizer->Quantize(&ctx, req, &resp).ok());
  }
  {
    grpc::ClientContext ctx;
    v1::QuantizeRequest req;  // no input: INVALID_ARGUMENT
    v1::QuantizeResponse resp;
    EXPECT_EQ(quantizer->Quantize(&ctx, req, &resp).error_code(),
              grpc::StatusCode::INVALID_ARGUMENT);
  }
  const std::string r = HttpGet(server->metrics_port(), "/metrics");
  ASSERT_THAT(r, HasSubstr("200 OK"));
  EXPECT_THAT(r, HasSubstr("Content-Type: text/plain; version=0.0.4"));
  EXPECT_THAT(r, HasSubstr("qtx_grpc_requests_total{method=\"/qtx.v1.Quantizer/Quantize\","
                           "code=\"OK\"} 2\n"));
  EXPECT_THAT(r, HasSubstr("qtx_grpc_requests_total{method=\"/qtx.v1.Quantizer/Quantize\","
                           "code=\"INVALID_ARGUMENT\"} 1\n"));
  EXPECT_THAT(r, HasSubstr("qtx_grpc_requests_total{method=\"/qtx.v1.Memory/RegisterRegion\","
                           "code=\"OK\"} 1\n"));
  EXPECT_THAT(r, HasSubstr("qtx_grpc_request_duration_seconds_count{method=\"/qtx.v1.Quantizer/"
                           "Quantize\"} 3\n"));
  // Request bytes: at least the two 1 KiB inline inputs. Response: 2 x (256
  // FP8 bytes + scales).
  const std::string in_key =
      "qtx_grpc_received_bytes_total{method=\"/qtx.v1.Quantizer/Quantize\"} ";
  const size_t in_at = r.find(in_key);
  ASSERT_NE(in_at, std::string::npos);
  EXPECT_GE(std::stoll(r.substr(in_at + in_key.size())), 2 * 1024);
  const std::string out_key = "qtx_grpc_sent_bytes_total{method=\"/qtx.v1.Quantizer/Quantize\"} ";
  const size_t out_at = r.find(out_key);
  ASSERT_NE(out_at, std::string::npos);
  EXPECT_GE(std::stoll(r.substr(out_at + out_key.size())), 2 * 256);
  // The two small Quantize calls and the invalid one ran inline; RegisterRegion
  // went to a worker.
  EXPECT_THAT(r, HasSubstr("\nqtx_requests_inline_total 3\n"));
  EXPECT_THAT(r, HasSubstr("\nqtx_regions 1\n"));
  EXPECT_THAT(r, HasSubstr("\nqtx_region_bytes 65536\n"));
  EXPECT_THAT(r, HasSubstr("\nqtx_collective_groups 0\n"));
  EXPECT_THAT(r, HasSubstr("\nqtx_optimizer_state_bytes 0\n"));
  EXPECT_THAT(r, Not(HasSubstr("Health")));
  EXPECT_THAT(HttpGet(server->metrics_port(), "/other"), HasSubstr("404"));

  // A taken port is refused at startup.
  config::ServerConfig second = config;
  second.socket_path = dir + "/second.sock";
  EXPECT_THAT(
      QtxServer::Create(second).status(),
      ::qtx::testing::StatusIs(absl::StatusCode::kUnavailable, HasSubstr("--metrics_port")));
  server->Shutdown(absl::Seconds(2));
  server.reset();
  std::system(("rm -rf " + dir).c_str());
}

// Short calls run inline up to --inline_max_bytes; none with
// --inline_max_concurrent=0. Both paths answer alike.
TEST(MetricsTest, ShortCallsRunInlineWithinTheLimits) {
  for (const int max_concurrent : {2, 0}) {
    SCOPED_TRACE(max_concurrent);
    char tmpl[] = "/tmp/qtxd-inline-XXXXXX";
    const std::string dir = ::mkdtemp(tmpl);
    config::ServerConfig config;
    config.socket_path = dir + "/qtxd.sock";
    config.threads = 1;
    config.metrics_port = FreeLoopbackPort();
    config.inline_max_bytes = 1024;
    config.inline_max_concurrent = max_concurrent;
    QTX_ASSERT_OK_AND_ASSIGN(std::unique_ptr<QtxServer> server, QtxServer::Create(config));
    auto channel =
        grpc::CreateChannel("unix:" + config.socket_path, grpc::InsecureChannelCredentials());
    auto quantizer = v1::Quantizer::NewStub(channel);
    auto memory = v1::Memory::NewStub(channel);
    for (const int rows : {2, 3, 2}) {  // 1024 bytes of FP32 (short), 1536 (long), 1024
      grpc::ClientContext ctx;
      v1::QuantizeRequest req;
      req.mutable_input()->set_dtype(v1::FLOAT32);
      req.mutable_input()->add_shape(rows);
      req.mutable_input()->add_shape(128);
      req.mutable_input()->set_inline_data(std::string(rows * 128 * 4, '\0'));
      req.mutable_config()->set_rowwise(true);
      v1::QuantizeResponse resp;
      ASSERT_TRUE(quantizer->Quantize(&ctx, req, &resp).ok());
      EXPECT_EQ(resp.result().rowwise_data().inline_data().size(), rows * 128);
      EXPECT_FALSE(ctx.GetServerInitialMetadata().find("x-request-id") ==
                   ctx.GetServerInitialMetadata().end());
    }
    {
      grpc::ClientContext ctx;
      v1::ListRegionsRequest req;
      v1::ListRegionsResponse resp;
      ASSERT_TRUE(memory->ListRegions(&ctx, req, &resp).ok());
    }
    const std::string r = HttpGet(server->metrics_port(), "/metrics");
    EXPECT_THAT(r, HasSubstr(max_concurrent == 0 ? "\nqtx_requests_inline_total 0\n"
                                                 : "\nqtx_requests_inline_total 3\n"));
    server->Shutdown(absl::Seconds(2));
    server.reset();
    std::system(("rm -rf " + dir).c_str());
  }
}

}  // namespace
}  // namespace qtx::server::api
