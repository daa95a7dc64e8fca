// Per-tensor current scaling (TENSOR) through an in-process qtxd on a unix
// socket, CPU device: Quantize / Dequantize round trips against the CPU
// reference (kernels/cpu/quantize_tensor.h), the [1] scale_inv shape, empty
// tensors, NaN / Inf inputs, shm regions, and the errors a client can act on.
#include <grpcpp/grpcpp.h>
#include <stdlib.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/cpu/quantize_tensor.h"
#include "kernels/fp8.h"
#include "qtx/v1/memory.grpc.pb.h"
#include "qtx/v1/quantizer.grpc.pb.h"
#include "server/api/server.h"
#include "tests/server/testing/shm_object.h"
#include "tests/testing/status_matchers.h"

namespace qtx::server::api {
namespace {

using ::qtx::testing::ShmObject;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

class QuantizeTensorServiceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/qtxd-tensor-test-XXXXXX";
    const char* d = ::mkdtemp(tmpl);
    ASSERT_NE(d, nullptr);
    dir_ = d;
    config_.socket_path = dir_ + "/qtxd.sock";
    config_.allow_client_shm = true;
    config_.threads = 2;
    QTX_ASSERT_OK_AND_ASSIGN(server_, QtxServer::Create(config_));
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(-1);
    args.SetMaxSendMessageSize(-1);
    auto channel = grpc::CreateCustomChannel("unix:" + config_.socket_path,
                                             grpc::InsecureChannelCredentials(), args);
    quantizer_ = v1::Quantizer::NewStub(channel);
    memory_ = v1::Memory::NewStub(channel);
  }
  void TearDown() override {
    if (server_) server_->Shutdown(absl::Seconds(5));
    server_.reset();
    ::rmdir(dir_.c_str());
  }

  grpc::Status Quantize(const v1::QuantizeRequest& req, v1::QuantizeResponse* resp) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    return quantizer_->Quantize(&ctx, req, resp);
  }
  grpc::Status Dequantize(const v1::DequantizeRequest& req, v1::DequantizeResponse* resp) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    return quantizer_->Dequantize(&ctx, req, resp);
  }

  std::string dir_;
  config::ServerConfig config_;
  std::unique_ptr<QtxServer> server_;
  std::unique_ptr<v1::Quantizer::Stub> quantizer_;
  std::unique_ptr<v1::Memory::Stub> memory_;
};

struct Input {
  v1::DType dtype;
  kernels::InputDType kdtype;
  std::string bytes;
};

// Normal values of varied magnitude in `dtype`, with `specials` placed first.
Input MakeInput(v1::DType dtype, int64_t count, uint32_t seed, std::vector<float> specials = {}) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, 2.0f);
  Input in;
  in.dtype = dtype;
  in.kdtype = dtype == v1::FLOAT32    ? kernels::InputDType::kFloat32
              : dtype == v1::BFLOAT16 ? kernels::InputDType::kBFloat16
                                      : kernels::InputDType::kFloat16;
  const int eb = dtype == v1::FLOAT32 ? 4 : 2;
  in.bytes.assign(static_cast<size_t>(count * eb), '\0');
  for (int64_t i = 0; i < count; ++i) {
    float x = std::ldexp(dist(rng), static_cast<int>(rng() % 7) - 3);
    if (static_cast<size_t>(i) < specials.size()) x = specials[i];
    if (eb == 4) {
      std::memcpy(&in.bytes[4 * i], &x, 4);
    } else {
      const uint16_t h = dtype == v1::BFLOAT16 ? kernels::FloatToBf16(x) : kernels::FloatToHalf(x);
      std::memcpy(&in.bytes[2 * i], &h, 2);
    }
  }
  return in;
}

v1::QuantizeRequest TensorRequest(const Input& in, std::vector<int64_t> shape, bool rowwise,
                                  bool columnwise, bool pow2, v1::Fp8Format format = v1::E4M3) {
  v1::QuantizeRequest req;
  req.mutable_input()->set_dtype(in.dtype);
  for (int64_t d : shape) req.mutable_input()->add_shape(d);
  req.mutable_input()->set_inline_data(in.bytes);
  req.mutable_config()->set_scaling_mode(v1::TENSOR);
  req.mutable_config()->set_format(format);
  req.mutable_config()->set_rowwise(rowwise);
  req.mutable_config()->set_columnwise(columnwise);
  req.mutable_config()->set_force_pow2_scales(pow2);
  return req;
}

struct Expected {
  std::string row, col;
  float scale_inv[2];
};

Expected Reference(const Input& in, int64_t m, int64_t n, bool pow2, kernels::Fp8Format f,
                   float eps = 0.0f) {
  Expected e;
  e.row.assign(static_cast<size_t>(m * n), '\0');
  e.col.assign(static_cast<size_t>(m * n), '\0');
  kernels::QuantizeParams p{kernels::BlockScaling::kTensor, f, true, true, pow2, eps};
  kernels::cpu::QuantizeTensor(in.bytes.data(), in.kdtype, m, n, p,
                               {reinterpret_cast<uint8_t*>(e.row.data()), &e.scale_inv[0],
                                reinterpret_cast<uint8_t*>(e.col.data()), &e.scale_inv[1]});
  return e;
}

std::string FloatBytes(float f) { return std::string(reinterpret_cast<const char*>(&f), 4); }

TEST_F(QuantizeTensorServiceTest, RoundTripMatchesTheReferenceForEveryInputDtype) {
  const std::vector<int64_t> shape = {3, 70, 130};  // M = 210 rows of N = 130
  const int64_t m = 210, n = 130;
  for (v1::DType dt : {v1::FLOAT32, v1::BFLOAT16, v1::FLOAT16}) {
    for (bool pow2 : {true, false}) {
      SCOPED_TRACE(::testing::Message() << "dtype " << dt << " pow2 " << pow2);
      const Input in = MakeInput(dt, m * n, 7 + dt);
      v1::QuantizeResponse resp;
      grpc::Status s = Quantize(TensorRequest(in, shape, true, true, pow2, v1::E5M2), &resp);
      ASSERT_TRUE(s.ok()) << s.error_message();
      const v1::QuantizedTensor& q = resp.result();
      EXPECT_EQ(q.config().scaling_mode(), v1::TENSOR);
      EXPECT_EQ(q.config().force_pow2_scales(), pow2);
      EXPECT_THAT(q.shape(), ElementsAre(3, 70, 130));
      const Expected e = Reference(in, m, n, pow2, kernels::Fp8Format::kE5M2);
      EXPECT_EQ(q.rowwise_data().dtype(), v1::FLOAT8_E5M2);
      EXPECT_THAT(q.rowwise_data().shape(), ElementsAre(m, n));
      EXPECT_EQ(q.rowwise_data().inline_data(), e.row);
      EXPECT_THAT(q.columnwise_data().shape(), ElementsAre(n, m));
      EXPECT_EQ(q.columnwise_data().inline_data(), e.col);
      EXPECT_EQ(q.rowwise_scale_inv().dtype(), v1::FLOAT32);
      EXPECT_THAT(q.rowwise_scale_inv().shape(), ElementsAre(1));
      EXPECT_THAT(q.columnwise_scale_inv().shape(), ElementsAre(1));
      EXPECT_EQ(q.rowwise_scale_inv().inline_data(), FloatBytes(e.scale_inv[0]));
      EXPECT_EQ(q.columnwise_scale_inv().inline_data(), FloatBytes(e.scale_inv[1]));

      // Dequantize the response as is (rowwise), and its columnwise copy alone.
      for (bool use_row : {true, false}) {
        v1::DequantizeRequest dreq;
        *dreq.mutable_input() = q;
        if (!use_row) dreq.mutable_input()->clear_rowwise_data();
        dreq.set_output_dtype(v1::FLOAT32);
        v1::DequantizeResponse dresp;
        s = Dequantize(dreq, &dresp);
        ASSERT_TRUE(s.ok()) << s.error_message();
        std::string want(static_cast<size_t>(m * n * 4), '\0');
        kernels::QuantizedConstBuffers qb{
            reinterpret_cast<const uint8_t*>(e.row.data()), &e.scale_inv[0],
            reinterpret_cast<const uint8_t*>(e.col.data()), &e.scale_inv[1]};
        kernels::cpu::DequantizeTensor(qb, kernels::Fp8Format::kE5M2, m, n, use_row,
                                       kernels::InputDType::kFloat32, want.data());
        EXPECT_THAT(dresp.output().shape(), ElementsAre(3, 70, 130));
        EXPECT_EQ(dresp.output().inline_data(), want) << (use_row ? "rowwise" : "columnwise");
      }
    }
  }
}

TEST_F(QuantizeTensorServiceTest, OneScaleForTheWholeTensor) {
  // Row 0 holds 1.0 (alone it would get scale 448 -> pow2 256); the tensor's
  // amax is 100 in row 1, so the one scale is 4 and 1.0 -> 4.0 (0x48).
  Input in = MakeInput(v1::FLOAT32, 4, 1, {1.0f, 0.5f, 100.0f, -2.0f});
  v1::QuantizeResponse resp;
  ASSERT_TRUE(Quantize(TensorRequest(in, {2, 2}, true, false, true), &resp).ok());
  EXPECT_EQ(resp.result().rowwise_scale_inv().inline_data(), FloatBytes(0.25f));
  EXPECT_EQ(resp.result().rowwise_data().inline_data(), std::string("\x48\x40\x7c\xd0", 4));
  EXPECT_FALSE(resp.result().has_columnwise_data());
  EXPECT_FALSE(resp.result().has_columnwise_scale_inv());
}

TEST_F(QuantizeTensorServiceTest, NanAndInfInputsFollowTheNumerics) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  // NaN is ignored by the amax and encodes as 0x7F.
  Input in = MakeInput(v1::BFLOAT16, 6, 2, {nan, 2.0f, -0.5f, 0.0f, 0.0f, 0.0f});
  v1::QuantizeResponse resp;
  ASSERT_TRUE(Quantize(TensorRequest(in, {2, 3}, true, true, true), &resp).ok());
  EXPECT_EQ(resp.result().rowwise_scale_inv().inline_data(), FloatBytes(1.0f / 128));
  EXPECT_EQ(resp.result().rowwise_data().inline_data(), std::string("\x7f\x78\xe8\x00\x00\x00", 6));
  // Inf: amax Inf -> scale 1; Inf saturates to max, -600 too.
  in = MakeInput(v1::FLOAT32, 4, 3, {inf, 1.0f, -600.0f, 0.25f});
  ASSERT_TRUE(Quantize(TensorRequest(in, {4}, true, false, true), &resp).ok());
  EXPECT_EQ(resp.result().rowwise_scale_inv().inline_data(), FloatBytes(1.0f));
  EXPECT_EQ(resp.result().rowwise_data().inline_data(), std::string("\x7e\x38\xfe\x28", 4));
  const Expected e = Reference(in, 1, 4, true, kernels::Fp8Format::kE4M3);
  EXPECT_EQ(resp.result().rowwise_data().inline_data(), e.row);
}

TEST_F(QuantizeTensorServiceTest, EmptyAndAllZeroTensorsGetTheScaleOfAmaxZero) {
  for (std::vector<int64_t> shape : {std::vector<int64_t>{0, 8}, {8, 0}, {0}}) {
    Input in = MakeInput(v1::FLOAT32, 0, 1);
    v1::QuantizeRequest req = TensorRequest(in, shape, true, true, true);
    v1::QuantizeResponse resp;
    grpc::Status s = Quantize(req, &resp);
    ASSERT_TRUE(s.ok()) << s.error_message();
    EXPECT_EQ(resp.result().rowwise_data().inline_data(), "");
    EXPECT_THAT(resp.result().rowwise_scale_inv().shape(), ElementsAre(1));
    EXPECT_EQ(resp.result().rowwise_scale_inv().inline_data(), FloatBytes(1.0f));
    EXPECT_EQ(resp.result().columnwise_scale_inv().inline_data(), FloatBytes(1.0f));
    // amax_epsilon applies as for a zero-amax block: 448 / 1e-4 -> pow2 2^22.
    req.mutable_config()->set_amax_epsilon(1e-4f);
    ASSERT_TRUE(Quantize(req, &resp).ok());
    EXPECT_EQ(resp.result().rowwise_scale_inv().inline_data(), FloatBytes(std::ldexp(1.0f, -22)));
    v1::DequantizeRequest dreq;
    *dreq.mutable_input() = resp.result();
    v1::DequantizeResponse dresp;
    s = Dequantize(dreq, &dresp);
    ASSERT_TRUE(s.ok()) << s.error_message();
    EXPECT_EQ(dresp.output().inline_data(), "");
  }
  Input zeros = MakeInput(v1::FLOAT16, 6, 1, {0, 0, 0, 0, 0, -0.0f});
  v1::QuantizeResponse resp;
  ASSERT_TRUE(Quantize(TensorRequest(zeros, {3, 2}, true, false, false), &resp).ok());
  EXPECT_EQ(resp.result().rowwise_scale_inv().inline_data(), FloatBytes(1.0f));
  EXPECT_EQ(resp.result().rowwise_data().inline_data(), std::string("\0\0\0\0\0\x80", 6));
}

TEST_F(QuantizeTensorServiceTest, IntoShmRegionsAndBack) {
  const int64_t m = 129, n = 200;
  const Input in = MakeInput(v1::BFLOAT16, m * n, 9);
  ShmObject src(in.bytes.size()), dst(1 << 20);
  ASSERT_TRUE(src.ok() && dst.ok());
  std::memcpy(src.data(), in.bytes.data(), in.bytes.size());
  for (auto [name, shm] : {std::pair<const char*, ShmObject*>{"in", &src}, {"out", &dst}}) {
    v1::RegisterRegionRequest r;
    r.set_name(name);
    r.mutable_shm()->set_shm_name(shm->name());
    r.mutable_shm()->set_byte_size(shm->size());
    v1::RegisterRegionResponse rr;
    grpc::ClientContext ctx;
    ASSERT_TRUE(memory_->RegisterRegion(&ctx, r, &rr).ok());
  }
  v1::QuantizeRequest req = TensorRequest(in, {m, n}, true, true, false);
  req.mutable_input()->mutable_region()->set_region("in");
  req.mutable_input()->mutable_region()->set_size(in.bytes.size());
  uint64_t off = 0;
  auto place = [&](v1::RegionSlice* s, uint64_t size) {
    s->set_region("out");
    s->set_offset(off);
    s->set_size(size);
    off += (size + 255) / 256 * 256;
  };
  place(req.mutable_outputs()->mutable_rowwise_data(), m * n);
  place(req.mutable_outputs()->mutable_rowwise_scale_inv(), 4);
  place(req.mutable_outputs()->mutable_columnwise_data(), m * n);
  place(req.mutable_outputs()->mutable_columnwise_scale_inv(), 4);
  v1::QuantizeResponse resp;
  grpc::Status s = Quantize(req, &resp);
  ASSERT_TRUE(s.ok()) << s.error_message();
  const Expected e = Reference(in, m, n, false, kernels::Fp8Format::kE4M3);
  auto at = [&](const v1::TensorRef& t) {
    return std::string(reinterpret_cast<const char*>(dst.data()) + t.region().offset(),
                       t.region().size());
  };
  EXPECT_EQ(at(resp.result().rowwise_data()), e.row);
  EXPECT_EQ(at(resp.result().columnwise_data()), e.col);
  EXPECT_EQ(at(resp.result().rowwise_scale_inv()), FloatBytes(e.scale_inv[0]));
  EXPECT_EQ(at(resp.result().columnwise_scale_inv()), FloatBytes(e.scale_inv[1]));

  // A scale slice of the wrong size is refused before any work.
  req.mutable_outputs()->mutable_rowwise_scale_inv()->set_size(8);
  s = Quantize(req, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("rowwise_scale_inv"));
}

TEST_F(QuantizeTensorServiceTest, BadRequestsFailWithActionableMessages) {
  const Input in = MakeInput(v1::FLOAT32, 12, 4);
  v1::QuantizeResponse resp;
  // Byte count that does not match the shape.
  v1::QuantizeRequest req = TensorRequest(in, {5, 3}, true, false, true);
  grpc::Status s = Quantize(req, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("input"));
  // Negative dim.
  req = TensorRequest(in, {-4, 3}, true, false, true);
  s = Quantize(req, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  // No copy requested.
  req = TensorRequest(in, {4, 3}, false, false, true);
  s = Quantize(req, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("at least one copy"));
  // Bad epsilon.
  req = TensorRequest(in, {4, 3}, true, false, true);
  req.mutable_config()->set_amax_epsilon(-1.0f);
  s = Quantize(req, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("amax_epsilon"));
  // Unknown scaling mode names the valid ones, TENSOR included.
  req = TensorRequest(in, {4, 3}, true, false, true);
  req.mutable_config()->set_scaling_mode(static_cast<v1::ScalingMode>(9));
  s = Quantize(req, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("TENSOR=3"));

  // Dequantize: a scale_inv of two values, and a columnwise copy with the
  // rowwise shape, are refused.
  req = TensorRequest(in, {4, 3}, true, true, true);
  ASSERT_TRUE(Quantize(req, &resp).ok());
  v1::DequantizeRequest dreq;
  *dreq.mutable_input() = resp.result();
  dreq.mutable_input()->mutable_rowwise_scale_inv()->set_inline_data(std::string(8, '\0'));
  dreq.mutable_input()->mutable_rowwise_scale_inv()->clear_shape();
  dreq.mutable_input()->mutable_rowwise_scale_inv()->add_shape(2);
  v1::DequantizeResponse dresp;
  s = Dequantize(dreq, &dresp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("TENSOR layout"));
  *dreq.mutable_input() = resp.result();
  dreq.mutable_input()->clear_rowwise_data();
  dreq.mutable_input()->mutable_columnwise_data()->clear_shape();
  dreq.mutable_input()->mutable_columnwise_data()->add_shape(4);
  dreq.mutable_input()->mutable_columnwise_data()->add_shape(3);
  s = Dequantize(dreq, &dresp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("expected [3, 4]"));
}

}  // namespace
}  // namespace qtx::server::api
