// In-process qtxd: a QtxServer on a temporary unix socket, driven through the
// generated qtx.v1 stubs.
#include "server/api/server.h"

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <future>
#include <random>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/block_geometry.h"
#include "kernels/cpu/quantize_block.h"
#include "qtx/v1/collective.grpc.pb.h"
#include "qtx/v1/memory.grpc.pb.h"
#include "qtx/v1/quantizer.grpc.pb.h"
#include "server/backend/device_factory.h"
#include "server/optimizer/optimizer_store.h"
#include "tests/server/testing/shm_object.h"
#include "tests/testing/status_matchers.h"

namespace qtx::server::api {
namespace {

using ::qtx::testing::ShmObject;
using ::testing::HasSubstr;

std::string TempDir() {
  char tmpl[] = "/tmp/qtxd-test-XXXXXX";
  const char* d = ::mkdtemp(tmpl);
  return d == nullptr ? "" : d;
}

std::vector<float> RandomFloats(int64_t count, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, 3.0f);
  std::vector<float> v(count);
  for (auto& x : v) x = dist(rng);
  return v;
}

std::string Bytes(const std::vector<float>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float));
}

class ServerTest : public ::testing::Test {
 protected:
  void SetUp() override { StartServer(/*allow_client_shm=*/true); }
  void TearDown() override {
    if (server_) server_->Shutdown(absl::Seconds(5));
    server_.reset();
    ::rmdir(dir_.c_str());
  }

  void StartServer(bool allow_client_shm) {
    dir_ = TempDir();
    ASSERT_FALSE(dir_.empty());
    config_.socket_path = dir_ + "/qtxd.sock";
    config_.allow_client_shm = allow_client_shm;
    config_.threads = 2;
    QTX_ASSERT_OK_AND_ASSIGN(server_, QtxServer::Create(config_));
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(-1);
    args.SetMaxSendMessageSize(-1);
    channel_ = grpc::CreateCustomChannel("unix:" + config_.socket_path,
                                         grpc::InsecureChannelCredentials(), args);
    quantizer_ = v1::Quantizer::NewStub(channel_);
    memory_ = v1::Memory::NewStub(channel_);
  }

  grpc::Status Quantize(const v1::QuantizeRequest& req, v1::QuantizeResponse* resp) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    return quantizer_->Quantize(&ctx, req, resp);
  }

  grpc::Status Register(const std::string& name, const ShmObject& shm) {
    v1::RegisterRegionRequest req;
    req.set_name(name);
    req.mutable_shm()->set_shm_name(shm.name());
    req.mutable_shm()->set_byte_size(shm.size());
    v1::RegisterRegionResponse resp;
    grpc::ClientContext ctx;
    return memory_->RegisterRegion(&ctx, req, &resp);
  }

  // grpc.health.v1.Health/Check through a generic stub: the request is
  // HealthCheckRequest{service} and the answer's field 1 is the status enum.
  grpc::Status HealthCheck(const std::string& service, int* serving_status) {
    std::string req;
    if (!service.empty()) {
      req.push_back(0x0A);
      req.push_back(static_cast<char>(service.size()));
      req += service;
    }
    grpc::Slice slice(req);
    grpc::ByteBuffer request(&slice, 1);
    grpc::ByteBuffer response;
    grpc::GenericStub stub(channel_);
    grpc::ClientContext ctx;
    std::promise<grpc::Status> done;
    stub.UnaryCall(&ctx, "/grpc.health.v1.Health/Check", grpc::StubOptions(), &request, &response,
                   [&done](grpc::Status s) { done.set_value(s); });
    grpc::Status s = done.get_future().get();
    if (s.ok()) {
      std::vector<grpc::Slice> slices;
      (void)response.Dump(&slices);
      std::string bytes;
      for (const auto& sl : slices)
        bytes.append(reinterpret_cast<const char*>(sl.begin()), sl.size());
      *serving_status = (bytes.size() == 2 && bytes[0] == 0x08) ? bytes[1] : 0;
    }
    return s;
  }

  std::string dir_;
  config::ServerConfig config_;
  std::unique_ptr<QtxServer> server_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Quantizer::Stub> quantizer_;
  std::unique_ptr<v1::Memory::Stub> memory_;
};

TEST_F(ServerTest, SocketIsOwnerOnly) {
  struct stat st;
  ASSERT_EQ(::lstat(config_.socket_path.c_str(), &st), 0);
  EXPECT_TRUE(S_ISSOCK(st.st_mode));
  EXPECT_EQ(st.st_mode & 0777, 0600);
}

TEST_F(ServerTest, HealthCheckReportsServing) {
  int status = -1;
  ASSERT_TRUE(HealthCheck("", &status).ok());
  EXPECT_EQ(status, 1);  // SERVING
  ASSERT_TRUE(HealthCheck("qtx.v1.Quantizer", &status).ok());
  EXPECT_EQ(status, 1);
  EXPECT_EQ(HealthCheck("no.such.Service", &status).error_code(), grpc::StatusCode::NOT_FOUND);
}

TEST_F(ServerTest, QuantizeInlineMatchesTheReferenceAndEchoesDefaults) {
  const int64_t m = 5, n = 300;
  const std::vector<float> x = RandomFloats(m * n, 1);
  v1::QuantizeRequest req;
  req.mutable_input()->set_dtype(v1::FLOAT32);
  req.mutable_input()->add_shape(m);
  req.mutable_input()->add_shape(n);
  req.mutable_input()->set_inline_data(Bytes(x));
  req.mutable_config()->set_columnwise(true);
  v1::QuantizeResponse resp;
  grpc::ClientContext ctx;
  ctx.AddMetadata("x-request-id", "test-req-42");
  grpc::Status s = quantizer_->Quantize(&ctx, req, &resp);
  ASSERT_TRUE(s.ok()) << s.error_message();
  auto rid = ctx.GetServerInitialMetadata().find("x-request-id");
  ASSERT_NE(rid, ctx.GetServerInitialMetadata().end());
  EXPECT_EQ(std::string(rid->second.data(), rid->second.size()), "test-req-42");

  const v1::QuantizedTensor& q = resp.result();
  EXPECT_THAT(q.shape(), ::testing::ElementsAre(m, n));
  EXPECT_EQ(q.source_dtype(), v1::FLOAT32);
  EXPECT_EQ(q.config().scaling_mode(), v1::BLOCK_1D);
  EXPECT_EQ(q.config().format(), v1::E4M3);
  EXPECT_TRUE(q.config().has_rowwise() && q.config().rowwise());
  EXPECT_TRUE(q.config().has_columnwise() && q.config().columnwise());
  EXPECT_TRUE(q.config().has_force_pow2_scales() && q.config().force_pow2_scales());

  const kernels::QuantizedLayout l = kernels::ComputeLayout(kernels::BlockScaling::kBlock1D, m, n);
  std::string rd(l.RowwiseDataBytes(), '\0'), rs(l.RowwiseScaleCount() * 4, '\0');
  std::string cd(l.ColumnwiseDataBytes(), '\0'), cs(l.ColumnwiseScaleCount() * 4, '\0');
  kernels::QuantizeParams p;
  p.columnwise = true;
  kernels::cpu::QuantizeBlock(
      x.data(), kernels::InputDType::kFloat32, m, n, p,
      {reinterpret_cast<uint8_t*>(rd.data()), reinterpret_cast<float*>(rs.data()),
       reinterpret_cast<uint8_t*>(cd.data()), reinterpret_cast<float*>(cs.data())});
  EXPECT_EQ(q.rowwise_data().dtype(), v1::FLOAT8_E4M3);
  EXPECT_THAT(q.rowwise_data().shape(), ::testing::ElementsAre(m, n));
  EXPECT_EQ(q.rowwise_data().inline_data(), rd);
  EXPECT_EQ(q.rowwise_scale_inv().dtype(), v1::FLOAT32);
  EXPECT_THAT(q.rowwise_scale_inv().shape(),
              ::testing::ElementsAre(l.rowwise_scale_rows, l.rowwise_scale_cols));
  EXPECT_EQ(q.rowwise_scale_inv().inline_data(), rs);
  EXPECT_THAT(q.columnwise_data().shape(), ::testing::ElementsAre(n, m));
  EXPECT_EQ(q.columnwise_data().inline_data(), cd);
  EXPECT_EQ(q.columnwise_scale_inv().inline_data(), cs);

  // Dequantize the response as is.
  v1::DequantizeRequest dreq;
  *dreq.mutable_input() = q;
  v1::DequantizeResponse dresp;
  grpc::ClientContext dctx;
  s = quantizer_->Dequantize(&dctx, dreq, &dresp);
  ASSERT_TRUE(s.ok()) << s.error_message();
  std::string expected(m * n * 4, '\0');
  kernels::QuantizedConstBuffers in;
  in.rowwise_data = reinterpret_cast<const uint8_t*>(rd.data());
  in.rowwise_scale_inv = reinterpret_cast<const float*>(rs.data());
  kernels::cpu::DequantizeBlock(in, kernels::BlockScaling::kBlock1D, kernels::Fp8Format::kE4M3, m,
                                n, true, kernels::InputDType::kFloat32, expected.data());
  EXPECT_EQ(dresp.output().dtype(), v1::FLOAT32);
  EXPECT_THAT(dresp.output().shape(), ::testing::ElementsAre(m, n));
  EXPECT_EQ(dresp.output().inline_data(), expected);
}

TEST_F(ServerTest, LargeInlineTensorsPassTheRaisedMessageLimit) {
  // 8 MiB in, 2 MiB out: above gRPC's 4 MiB default receive limit.
  const int64_t m = 1024, n = 2048;
  const std::vector<float> x = RandomFloats(m * n, 2);
  v1::QuantizeRequest req;
  req.mutable_input()->set_dtype(v1::FLOAT32);
  req.mutable_input()->add_shape(m);
  req.mutable_input()->add_shape(n);
  req.mutable_input()->set_inline_data(Bytes(x));
  req.mutable_config()->set_scaling_mode(v1::BLOCK_2D);
  v1::QuantizeResponse resp;
  grpc::Status s = Quantize(req, &resp);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(resp.result().rowwise_data().inline_data().size(), static_cast<size_t>(m * n));
}

TEST_F(ServerTest, QuantizeIntoShmRegions) {
  const int64_t m = 129, n = 256;
  const std::vector<float> x = RandomFloats(m * n, 3);
  const kernels::QuantizedLayout l = kernels::ComputeLayout(kernels::BlockScaling::kBlock2D, m, n);
  ShmObject in(x.size() * 4), out(1 << 20);
  ASSERT_TRUE(in.ok() && out.ok());
  std::memcpy(in.data(), x.data(), x.size() * 4);
  ASSERT_TRUE(Register("in", in).ok());
  ASSERT_TRUE(Register("out", out).ok());

  v1::QuantizeRequest req;
  req.mutable_input()->set_dtype(v1::FLOAT32);
  req.mutable_input()->add_shape(m);
  req.mutable_input()->add_shape(n);
  req.mutable_input()->mutable_region()->set_region("in");
  req.mutable_input()->mutable_region()->set_size(x.size() * 4);
  req.mutable_config()->set_scaling_mode(v1::BLOCK_2D);
  req.mutable_config()->set_columnwise(true);
  uint64_t off = 0;
  auto place = [&](v1::RegionSlice* s, uint64_t size) {
    s->set_region("out");
    s->set_offset(off);
    s->set_size(size);
    off += (size + 255) / 256 * 256;
  };
  place(req.mutable_outputs()->mutable_rowwise_data(), l.RowwiseDataBytes());
  place(req.mutable_outputs()->mutable_rowwise_scale_inv(), l.RowwiseScaleCount() * 4);
  place(req.mutable_outputs()->mutable_columnwise_data(), l.ColumnwiseDataBytes());
  place(req.mutable_outputs()->mutable_columnwise_scale_inv(), l.ColumnwiseScaleCount() * 4);
  v1::QuantizeResponse resp;
  grpc::Status s = Quantize(req, &resp);
  ASSERT_TRUE(s.ok()) << s.error_message();

  std::string rd(l.RowwiseDataBytes(), '\0'), rs(l.RowwiseScaleCount() * 4, '\0');
  std::string cd(l.ColumnwiseDataBytes(), '\0'), cs(l.ColumnwiseScaleCount() * 4, '\0');
  kernels::QuantizeParams p;
  p.scaling = kernels::BlockScaling::kBlock2D;
  p.columnwise = true;
  kernels::cpu::QuantizeBlock(
      x.data(), kernels::InputDType::kFloat32, m, n, p,
      {reinterpret_cast<uint8_t*>(rd.data()), reinterpret_cast<float*>(rs.data()),
       reinterpret_cast<uint8_t*>(cd.data()), reinterpret_cast<float*>(cs.data())});
  auto at = [&](const v1::TensorRef& t) {
    EXPECT_EQ(t.data_case(), v1::TensorRef::kRegion);
    EXPECT_EQ(t.region().region(), "out");
    return std::string(reinterpret_cast<const char*>(out.data()) + t.region().offset(),
                       t.region().size());
  };
  EXPECT_EQ(at(resp.result().rowwise_data()), rd);
  EXPECT_EQ(at(resp.result().rowwise_scale_inv()), rs);
  EXPECT_EQ(at(resp.result().columnwise_data()), cd);
  EXPECT_EQ(at(resp.result().columnwise_scale_inv()), cs);

  // The quantized copy in the region dequantizes in place into the region.
  v1::DequantizeRequest dreq;
  *dreq.mutable_input() = resp.result();
  dreq.mutable_input()->clear_rowwise_data();  // use the columnwise copy
  dreq.set_output_dtype(v1::FLOAT16);
  dreq.mutable_output()->set_region("out");
  dreq.mutable_output()->set_offset(off);
  dreq.mutable_output()->set_size(m * n * 2);
  v1::DequantizeResponse dresp;
  grpc::ClientContext dctx;
  s = quantizer_->Dequantize(&dctx, dreq, &dresp);
  ASSERT_TRUE(s.ok()) << s.error_message();
  std::string expected(m * n * 2, '\0');
  kernels::QuantizedConstBuffers qin;
  qin.columnwise_data = reinterpret_cast<const uint8_t*>(cd.data());
  qin.columnwise_scale_inv = reinterpret_cast<const float*>(cs.data());
  kernels::cpu::DequantizeBlock(qin, kernels::BlockScaling::kBlock2D, kernels::Fp8Format::kE4M3, m,
                                n, false, kernels::InputDType::kFloat16, expected.data());
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(out.data()) + off, m * n * 2), expected);

  v1::ListRegionsResponse list;
  grpc::ClientContext lctx;
  ASSERT_TRUE(memory_->ListRegions(&lctx, v1::ListRegionsRequest(), &list).ok());
  ASSERT_EQ(list.regions_size(), 2);
  EXPECT_EQ(list.regions(0).name(), "in");
  EXPECT_EQ(list.regions(0).kind(), "shm");
  EXPECT_EQ(list.regions(0).byte_size(), x.size() * 4);
  EXPECT_EQ(list.regions(0).in_use(), 0u);

  v1::UnregisterRegionRequest ureq;
  ureq.set_name("in");
  v1::UnregisterRegionResponse uresp;
  grpc::ClientContext uctx;
  ASSERT_TRUE(memory_->UnregisterRegion(&uctx, ureq, &uresp).ok());
  v1::QuantizeResponse again;
  s = Quantize(req, &again);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_THAT(s.error_message(), HasSubstr("input.region: region 'in' is not registered"));
}

TEST_F(ServerTest, BadInputsGetPreciseStatuses) {
  struct Case {
    std::string name;
    std::function<void(v1::QuantizeRequest&)> mutate;
    grpc::StatusCode code;
    std::string message;
  };
  const std::vector<Case> cases = {
      {"negative dim", [](auto& r) { r.mutable_input()->set_shape(1, -3); },
       grpc::StatusCode::INVALID_ARGUMENT, "input.shape[1]=-3: dims must be >= 0"},
      {"unknown scaling enum",
       [](auto& r) { r.mutable_config()->set_scaling_mode(static_cast<v1::ScalingMode>(7)); },
       grpc::StatusCode::INVALID_ARGUMENT, "config.scaling_mode=7: unknown ScalingMode"},
      {"unknown dtype enum",
       [](auto& r) { r.mutable_input()->set_dtype(static_cast<v1::DType>(99)); },
       grpc::StatusCode::INVALID_ARGUMENT, "input.dtype=99: unknown DType"},
      {"no input", [](auto& r) { r.clear_input(); }, grpc::StatusCode::INVALID_ARGUMENT,
       "input: missing"},
      {"inline size", [](auto& r) { r.mutable_input()->mutable_inline_data()->pop_back(); },
       grpc::StatusCode::INVALID_ARGUMENT, "input.inline_data: 1023 bytes, expected 1024"},
      {"rank 9",
       [](auto& r) {
         for (int i = 0; i < 7; ++i) r.mutable_input()->add_shape(1);
       },
       grpc::StatusCode::INVALID_ARGUMENT, "rank 9, must be 1..8"},
      {"no usage",
       [](auto& r) {
         r.mutable_config()->set_rowwise(false);
         r.mutable_config()->set_columnwise(false);
       },
       grpc::StatusCode::INVALID_ARGUMENT, "at least one copy"},
      {"nan epsilon", [](auto& r) { r.mutable_config()->set_amax_epsilon(std::nanf("")); },
       grpc::StatusCode::INVALID_ARGUMENT, "config.amax_epsilon=nan"},
      {"unknown region",
       [](auto& r) {
         r.mutable_input()->mutable_region()->set_region("ghost");
         r.mutable_input()->mutable_region()->set_size(1024);
       },
       grpc::StatusCode::NOT_FOUND, "region 'ghost' is not registered"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    v1::QuantizeRequest req;
    req.mutable_input()->set_dtype(v1::FLOAT32);
    req.mutable_input()->add_shape(2);
    req.mutable_input()->add_shape(128);
    req.mutable_input()->set_inline_data(std::string(1024, '\0'));
    c.mutate(req);
    v1::QuantizeResponse resp;
    grpc::Status s = Quantize(req, &resp);
    EXPECT_EQ(s.error_code(), c.code) << s.error_message();
    EXPECT_THAT(s.error_message(), HasSubstr(c.message));
  }
  // The server is still healthy after all of that.
  int status = 0;
  ASSERT_TRUE(HealthCheck("", &status).ok());
  EXPECT_EQ(status, 1);
}

TEST_F(ServerTest, RegisterRegionErrors) {
  v1::RegisterRegionRequest req;
  req.set_name("gpu");
  req.mutable_cuda_ipc()->set_ipc_handle(std::string(10, 'x'));
  req.mutable_cuda_ipc()->set_byte_size(100);
  v1::RegisterRegionResponse resp;
  {
    grpc::ClientContext ctx;
    grpc::Status s = memory_->RegisterRegion(&ctx, req, &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_THAT(s.error_message(), HasSubstr("10 bytes, must be exactly 64"));
  }
  req.mutable_cuda_ipc()->set_ipc_handle(std::string(64, 'x'));
  {
    grpc::ClientContext ctx;
    grpc::Status s = memory_->RegisterRegion(&ctx, req, &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
    EXPECT_THAT(s.error_message(), HasSubstr("cuda_ipc regions need --device=cuda:N"));
  }
  req.clear_cuda_ipc();
  {
    grpc::ClientContext ctx;
    grpc::Status s = memory_->RegisterRegion(&ctx, req, &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_THAT(s.error_message(), HasSubstr("kind: set shm, cuda_ipc or cuda_vmm"));
  }
  v1::UnregisterRegionRequest ureq;
  ureq.set_name("never");
  v1::UnregisterRegionResponse uresp;
  grpc::ClientContext uctx;
  EXPECT_EQ(memory_->UnregisterRegion(&uctx, ureq, &uresp).error_code(),
            grpc::StatusCode::NOT_FOUND);
}

TEST_F(ServerTest, ClientShmIsRefusedWithoutTheFlag) {
  server_->Shutdown(absl::Seconds(1));
  server_.reset();
  StartServer(/*allow_client_shm=*/false);
  ShmObject shm(4096);
  ASSERT_TRUE(shm.ok()) << shm.error();
  grpc::Status s = Register("r", shm);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(s.error_message(), HasSubstr("--allow_client_shm"));
}

TEST_F(ServerTest, ASecondServerOnTheSameSocketIsRefused) {
  EXPECT_THAT(QtxServer::Create(config_),
              qtx::testing::StatusIs(absl::StatusCode::kFailedPrecondition,
                                     HasSubstr("another server is already listening")));
  // The first server still answers.
  int status = 0;
  EXPECT_TRUE(HealthCheck("", &status).ok());
}

TEST_F(ServerTest, ShutdownRemovesTheSocketAndAStaleSocketIsReplaced) {
  server_->Shutdown(absl::Seconds(1));
  struct stat st;
  EXPECT_NE(::lstat(config_.socket_path.c_str(), &st), 0);
  server_.reset();
  // Leave a stale socket file behind (bound, never listening).
  {
    QTX_ASSERT_OK(PrepareSocketPath(config_.socket_path));
    const int fd = ::socket(AF_UNIX, SOCK_STREAM, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::strncpy(addr.sun_path, config_.socket_path.c_str(), sizeof(addr.sun_path) - 1);
    ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
    ::close(fd);
  }
  QTX_ASSERT_OK_AND_ASSIGN(server_, QtxServer::Create(config_));
  int status = 0;
  channel_ = grpc::CreateChannel("unix:" + config_.socket_path, grpc::InsecureChannelCredentials());
  EXPECT_TRUE(HealthCheck("", &status).ok());
}

// Issue 18 item 5: when every worker is stuck in one call, health says
// NOT_SERVING (it said SERVING while a FIFO checkpoint hung the workers), and
// SERVING again once a worker is free. The watchdog's clock is injected.
TEST_F(ServerTest, HealthReportsNotServingWhileEveryWorkerIsWedged) {
  absl::Notification release;
  std::atomic<int> started{0};
  for (int i = 0; i < config_.threads; ++i) {
    ASSERT_TRUE(server_->executor().Submit([&] {
      started.fetch_add(1);
      release.WaitForNotification();
    }));
  }
  while (started.load() < config_.threads) absl::SleepFor(absl::Milliseconds(1));
  const absl::Duration stall = absl::Seconds(config_.worker_stall_s);
  int status = -1;
  EXPECT_FALSE(server_->CheckWorkers(absl::Now()));  // busy, not yet for long
  ASSERT_TRUE(HealthCheck("", &status).ok());
  EXPECT_EQ(status, 1);  // SERVING
  EXPECT_TRUE(server_->CheckWorkers(absl::Now() + stall + absl::Seconds(1)));
  for (const char* service : {"", "qtx.v1.Quantizer", "qtx.v1.Optimizer"}) {
    ASSERT_TRUE(HealthCheck(service, &status).ok());
    EXPECT_EQ(status, 2) << service;  // NOT_SERVING
  }
  release.Notify();
  // Both workers go back to idle; then the pool is not wedged at any time.
  for (int i = 0; i < 1000 && server_->CheckWorkers(absl::InfiniteFuture()); ++i) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  EXPECT_FALSE(server_->CheckWorkers(absl::InfiniteFuture()));
  ASSERT_TRUE(HealthCheck("", &status).ok());
  EXPECT_EQ(status, 1);
}

// Issue 18 item 5: a wedged call no longer makes shutdown hang: it ends at
// grace + slack, checkpoints the optimizer groups the stuck call does not
// hold, and says it was not clean.
TEST(ServerShutdownTest, EndsAndCheckpointsWhatItCanWhenACallIsWedged) {
  const std::string dir = TempDir();
  ASSERT_FALSE(dir.empty());
  config::ServerConfig config;
  config.socket_path = dir + "/qtxd.sock";
  config.threads = 1;
  config.shutdown_slack_ms = 50;
  config.checkpoint_dir = dir + "/ckpt";
  QTX_ASSERT_OK_AND_ASSIGN(std::unique_ptr<QtxServer> server, QtxServer::Create(config));
  optimizer::OptimizerStore& store = server->optimizer_store();
  std::vector<float> master(16, 0.5f);
  for (const char* name : {"stuck", "free"}) {
    optimizer::GroupConfig g;
    g.name = name;
    optimizer::ParameterInit p;
    p.name = "w";
    p.shape = {4, 4};
    p.m = 4;
    p.n = 4;
    p.master = master.data();
    QTX_ASSERT_OK(
        store.CreateGroup(g, std::span<const optimizer::ParameterInit>(&p, 1), false).status());
  }
  // A Step of "stuck" whose prepare never returns until released: it holds
  // the group's lock and the only worker.
  absl::Notification started, release;
  ASSERT_TRUE(server->executor().Submit([&] {
    (void)store.Step(
        "stuck", {.step = 1},
        [&](const optimizer::GroupInfo&, bool) -> absl::StatusOr<optimizer::StepBuffers> {
          started.Notify();
          release.WaitForNotification();
          return absl::CancelledError("released");
        });
  }));
  started.WaitForNotification();
  EXPECT_FALSE(server->Shutdown(absl::ZeroDuration()));  // returns: bounded
  EXPECT_FALSE(server->Shutdown(absl::ZeroDuration()));  // and says so again
  struct stat st;
  EXPECT_EQ(::stat((config.checkpoint_dir + "/free.qtxopt").c_str(), &st), 0);
  EXPECT_NE(::stat((config.checkpoint_dir + "/stuck.qtxopt").c_str(), &st), 0);
  EXPECT_NE(::lstat(config.socket_path.c_str(), &st), 0);  // the socket is gone
  release.Notify();
  server.reset();  // joins what the wedge left running
  std::system(("rm -rf '" + dir + "'").c_str());
}

// Issue 18 item 2: a CreateGroup waiting for ranks that never come ends with
// the call: at the client's deadline, when the client cancels, and when the
// server shuts down; the group does not live on.
class CreateGroupLifetimeTest : public ServerTest {
 protected:
  std::unique_ptr<v1::Collective::Stub> Collective() { return v1::Collective::NewStub(channel_); }

  static v1::CreateGroupRequest Absent(const std::string& name) {
    v1::CreateGroupRequest req;
    req.set_name(name);
    req.set_rank(0);
    req.set_world_size(4);  // ranks 1..3 never come
    req.set_backend(v1::GLOO);
    req.set_timeout_ms(600000);
    return req;
  }

  int NumGroups() {
    v1::ListGroupsResponse resp;
    grpc::ClientContext ctx;
    if (!Collective()->ListGroups(&ctx, v1::ListGroupsRequest(), &resp).ok()) return -1;
    return resp.groups_size();
  }
  // Polls until the server lists `n` groups (bounded).
  bool WaitForGroups(int n) {
    for (int i = 0; i < 6000 && NumGroups() != n; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return NumGroups() == n;
  }
};

TEST_F(CreateGroupLifetimeTest, JoinEndsAtTheCallsDeadline) {
  auto stub = Collective();
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(1500));
  v1::CreateGroupResponse resp;
  grpc::Status s = stub->CreateGroup(&ctx, Absent("late"), &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << s.error_message();
  // The server gave up with the call: the group is gone and the name free.
  EXPECT_TRUE(WaitForGroups(0));
  v1::CreateGroupRequest solo = Absent("late");
  solo.set_world_size(1);
  grpc::ClientContext ctx2;
  s = stub->CreateGroup(&ctx2, solo, &resp);
  EXPECT_TRUE(s.ok()) << s.error_message();
}

TEST_F(CreateGroupLifetimeTest, ClientCancellationEndsTheJoin) {
  auto stub = Collective();
  grpc::ClientContext ctx;
  v1::CreateGroupResponse resp;
  std::promise<grpc::Status> done;
  const v1::CreateGroupRequest req = Absent("cancelled");
  stub->async()->CreateGroup(&ctx, &req, &resp, [&done](grpc::Status s) { done.set_value(s); });
  ASSERT_TRUE(WaitForGroups(1));
  ctx.TryCancel();
  EXPECT_EQ(done.get_future().get().error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_TRUE(WaitForGroups(0));
}

TEST_F(CreateGroupLifetimeTest, ShutdownEndsAJoiningCreateGroup) {
  auto stub = Collective();
  grpc::ClientContext ctx;
  v1::CreateGroupResponse resp;
  std::promise<grpc::Status> done;
  const v1::CreateGroupRequest req = Absent("sigterm");
  stub->async()->CreateGroup(&ctx, &req, &resp, [&done](grpc::Status s) { done.set_value(s); });
  ASSERT_TRUE(WaitForGroups(1));
  std::future<void> shutdown =
      std::async(std::launch::async, [this] { server_->Shutdown(absl::ZeroDuration()); });
  // Without the fix, Shutdown waits for the 10-minute join.
  ASSERT_EQ(shutdown.wait_for(std::chrono::seconds(60)), std::future_status::ready);
  EXPECT_NE(done.get_future().get().error_code(), grpc::StatusCode::OK);
}

TEST(ServerConfigTest, RejectsBadConfigs) {
  config::ServerConfig c;
  c.listen_tcp = "0.0.0.0:5000";
  EXPECT_THAT(QtxServer::Create(c), qtx::testing::StatusIs(absl::StatusCode::kInvalidArgument,
                                                           HasSubstr("is not a loopback address")));
  c = config::ServerConfig();
  c.device = "cuda:0";
  c.socket_path = "/tmp/qtxd-unused-" + std::to_string(::getpid()) + ".sock";
  if (!backend::BuiltWithCuda()) {
    EXPECT_THAT(QtxServer::Create(c), qtx::testing::StatusIs(absl::StatusCode::kFailedPrecondition,
                                                             HasSubstr("not built with CUDA")));
  } else if (!backend::CreateDevice("cuda:0").ok()) {
    // A CUDA build on a host without a usable GPU (CI).
    EXPECT_THAT(QtxServer::Create(c), qtx::testing::StatusIs(absl::StatusCode::kFailedPrecondition,
                                                             HasSubstr("--device=cuda:0")));
  }
  c.device = "tpu";
  EXPECT_THAT(QtxServer::Create(c), qtx::testing::StatusIs(absl::StatusCode::kInvalidArgument,
                                                           HasSubstr("--device=tpu")));
}

TEST(ServerTcpTest, LoopbackTcpServes) {
  config::ServerConfig c;
  c.socket_path = "";
  c.listen_tcp = "127.0.0.1:0";
  QTX_ASSERT_OK_AND_ASSIGN(auto server, QtxServer::Create(c));
  ASSERT_GT(server->tcp_port(), 0);
  auto channel = grpc::CreateChannel("127.0.0.1:" + std::to_string(server->tcp_port()),
                                     grpc::InsecureChannelCredentials());
  auto memory = v1::Memory::NewStub(channel);
  v1::ListRegionsResponse resp;
  grpc::ClientContext ctx;
  EXPECT_TRUE(memory->ListRegions(&ctx, v1::ListRegionsRequest(), &resp).ok());
  server->Shutdown(absl::Seconds(1));
}

}  // namespace
}  // namespace qtx::server::api
