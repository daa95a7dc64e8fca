// End-to-end: starts qtxd (--qtxd=<path>) on a temporary unix socket and
// drives it through qtx::Client, inline and through shm regions, comparing
// every byte with the CPU reference kernels::cpu::QuantizeBlock.
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <iostream>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/block_geometry.h"
#include "kernels/cpu/quantize_block.h"
#include "kernels/fp8.h"
#include "qtx/client.h"
#include "qtx/fd_passing.h"
#include "qtx/shm_region.h"
#include "tests/testing/qtxd_process.h"
#include "tests/testing/status_matchers.h"

namespace qtx {
namespace {

using ::qtx::testing::QtxdProcess;
using ::qtx::testing::StatusIs;
using ::testing::HasSubstr;

std::string g_qtxd_path;  // from --qtxd=

// Random N(0, sigma) values with a few exact zeros and outliers, as `dtype`.
std::string RandomInput(DType dtype, int64_t count, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> pick(0, 199);
  std::string out(count * DTypeSize(dtype), '\0');
  for (int64_t i = 0; i < count; ++i) {
    float v = normal(rng) * (i % 300 < 150 ? 1.0f : 1e-3f);
    const int p = pick(rng);
    if (p == 0) v = 0.0f;
    if (p == 1) v *= 1000.0f;
    if (dtype == DType::kFloat32) {
      std::memcpy(out.data() + 4 * i, &v, 4);
    } else {
      const uint16_t h =
          dtype == DType::kBFloat16 ? kernels::FloatToBf16(v) : kernels::FloatToHalf(v);
      std::memcpy(out.data() + 2 * i, &h, 2);
    }
  }
  return out;
}

kernels::InputDType KernelDType(DType d) {
  return d == DType::kBFloat16  ? kernels::InputDType::kBFloat16
         : d == DType::kFloat16 ? kernels::InputDType::kFloat16
                                : kernels::InputDType::kFloat32;
}

kernels::QuantizeParams KernelParams(const QuantizeConfig& c) {
  kernels::QuantizeParams p;
  p.scaling = c.scaling_mode == ScalingMode::kBlock2D  ? kernels::BlockScaling::kBlock2D
              : c.scaling_mode == ScalingMode::kTensor ? kernels::BlockScaling::kTensor
                                                       : kernels::BlockScaling::kBlock1D;
  p.format = c.format == Fp8Format::kE5M2 ? kernels::Fp8Format::kE5M2 : kernels::Fp8Format::kE4M3;
  p.rowwise = c.rowwise;
  p.columnwise = c.columnwise;
  p.force_pow2_scales = c.force_pow2_scales;
  p.amax_epsilon = c.amax_epsilon;
  return p;
}

// The reference outputs as raw bytes (empty strings for copies not requested).
struct Reference {
  std::string rowwise_data, rowwise_scale_inv, columnwise_data, columnwise_scale_inv;
  kernels::QuantizedLayout layout;
};

Reference QuantizeOnCpu(const std::string& input, DType dtype, int64_t m, int64_t n,
                        const QuantizeConfig& config) {
  const kernels::QuantizeParams p = KernelParams(config);
  Reference r;
  r.layout = kernels::ComputeLayout(p.scaling, m, n);
  kernels::QuantizedBuffers out;
  if (config.rowwise) {
    r.rowwise_data.assign(r.layout.RowwiseDataBytes(), '\xAA');
    r.rowwise_scale_inv.assign(r.layout.RowwiseScaleCount() * 4, '\xAA');
    out.rowwise_data = reinterpret_cast<uint8_t*>(r.rowwise_data.data());
    out.rowwise_scale_inv = reinterpret_cast<float*>(r.rowwise_scale_inv.data());
  }
  if (config.columnwise) {
    r.columnwise_data.assign(r.layout.ColumnwiseDataBytes(), '\xAA');
    r.columnwise_scale_inv.assign(r.layout.ColumnwiseScaleCount() * 4, '\xAA');
    out.columnwise_data = reinterpret_cast<uint8_t*>(r.columnwise_data.data());
    out.columnwise_scale_inv = reinterpret_cast<float*>(r.columnwise_scale_inv.data());
  }
  kernels::cpu::QuantizeBlock(input.data(), KernelDType(dtype), m, n, p, out);
  return r;
}

// Bytes of `t`, inline or read from `region`.
std::string BytesOf(const Tensor& t, const ShmRegion* region = nullptr) {
  if (!t.in_region()) return t.data;
  EXPECT_NE(region, nullptr) << "region tensor without a region";
  if (region == nullptr) return {};
  absl::StatusOr<std::span<std::byte>> view = region->View(*t.region);
  EXPECT_TRUE(view.ok()) << view.status();
  if (!view.ok()) return {};
  return std::string(reinterpret_cast<const char*>(view->data()), view->size());
}

void ExpectMatchesReference(const QuantizedTensor& q, const Reference& ref,
                            const QuantizeConfig& config, const ShmRegion* region = nullptr) {
  const DType fp8 = config.format == Fp8Format::kE5M2 ? DType::kFloat8E5M2 : DType::kFloat8E4M3;
  EXPECT_EQ(q.config, config);
  ASSERT_EQ(q.rowwise_data.has_value(), config.rowwise);
  ASSERT_EQ(q.rowwise_scale_inv.has_value(), config.rowwise);
  ASSERT_EQ(q.columnwise_data.has_value(), config.columnwise);
  ASSERT_EQ(q.columnwise_scale_inv.has_value(), config.columnwise);
  if (config.rowwise) {
    EXPECT_EQ(q.rowwise_data->dtype, fp8);
    EXPECT_EQ(q.rowwise_scale_inv->dtype, DType::kFloat32);
    EXPECT_EQ(
        q.rowwise_scale_inv->shape,
        config.scaling_mode == ScalingMode::kTensor
            ? std::vector<int64_t>{1}
            : (std::vector<int64_t>{ref.layout.rowwise_scale_rows, ref.layout.rowwise_scale_cols}));
    EXPECT_TRUE(BytesOf(*q.rowwise_data, region) == ref.rowwise_data) << "rowwise data differs";
    EXPECT_TRUE(BytesOf(*q.rowwise_scale_inv, region) == ref.rowwise_scale_inv)
        << "rowwise scale_inv differs";
  }
  if (config.columnwise) {
    EXPECT_EQ(q.columnwise_data->dtype, fp8);
    EXPECT_EQ(q.columnwise_scale_inv->dtype, DType::kFloat32);
    EXPECT_EQ(q.columnwise_scale_inv->shape,
              config.scaling_mode == ScalingMode::kTensor
                  ? std::vector<int64_t>{1}
                  : (std::vector<int64_t>{ref.layout.columnwise_scale_rows,
                                          ref.layout.columnwise_scale_cols}));
    EXPECT_TRUE(BytesOf(*q.columnwise_data, region) == ref.columnwise_data)
        << "columnwise data differs";
    EXPECT_TRUE(BytesOf(*q.columnwise_scale_inv, region) == ref.columnwise_scale_inv)
        << "columnwise scale_inv differs";
  }
}

std::string DequantizeOnCpu(const Reference& ref, const QuantizeConfig& config, int64_t m,
                            int64_t n, DType out_dtype) {
  kernels::QuantizedConstBuffers in;
  in.rowwise_data = reinterpret_cast<const uint8_t*>(ref.rowwise_data.data());
  in.rowwise_scale_inv = reinterpret_cast<const float*>(ref.rowwise_scale_inv.data());
  in.columnwise_data = reinterpret_cast<const uint8_t*>(ref.columnwise_data.data());
  in.columnwise_scale_inv = reinterpret_cast<const float*>(ref.columnwise_scale_inv.data());
  const kernels::QuantizeParams p = KernelParams(config);
  std::string out(m * n * DTypeSize(out_dtype), '\0');
  kernels::cpu::DequantizeBlock(in, p.scaling, p.format, m, n, config.rowwise,
                                KernelDType(out_dtype), out.data());
  return out;
}

class ClientE2eTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto server = QtxdProcess::Start(g_qtxd_path, {"--allow_client_shm", "--device=cpu"});
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = server->release();
  }
  static void TearDownTestSuite() {
    if (server_ != nullptr) {
      absl::StatusOr<int> code = server_->Stop();
      EXPECT_TRUE(code.ok()) << code.status();
      if (code.ok()) {
        EXPECT_EQ(*code, 0) << "qtxd exit status after SIGTERM";
      }
    }
    delete server_;
    server_ = nullptr;
  }
  void SetUp() override {
    ASSERT_NE(server_, nullptr);
    auto client = Client::Connect(server_->target());
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = *std::move(client);
  }

  static QtxdProcess* server_;
  std::unique_ptr<Client> client_;
};
QtxdProcess* ClientE2eTest::server_ = nullptr;

TEST_F(ClientE2eTest, HealthIsServing) {
  QTX_ASSERT_OK_AND_ASSIGN(ServingStatus s, client_->Health());
  EXPECT_EQ(s, ServingStatus::kServing);
  QTX_ASSERT_OK_AND_ASSIGN(s, client_->Health("no.such.Service"));
  EXPECT_EQ(s, ServingStatus::kServiceUnknown);
}

TEST_F(ClientE2eTest, QuantizeInlineMatchesReferenceBitForBit) {
  const int64_t m = 200, n = 300;  // partial blocks in both dims
  for (DType dtype : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    const std::string input = RandomInput(dtype, m * n, 17 + static_cast<int>(dtype));
    for (ScalingMode mode : {ScalingMode::kBlock1D, ScalingMode::kBlock2D, ScalingMode::kTensor}) {
      for (Fp8Format format : {Fp8Format::kE4M3, Fp8Format::kE5M2}) {
        for (bool pow2 : {true, false}) {
          QuantizeConfig c;
          c.scaling_mode = mode;
          c.format = format;
          c.rowwise = true;
          c.columnwise = true;
          c.force_pow2_scales = pow2;
          SCOPED_TRACE(absl::StrCat(DTypeName(dtype), " ", ScalingModeName(mode), " ",
                                    Fp8FormatName(format), " pow2=", pow2));
          QTX_ASSERT_OK_AND_ASSIGN(QuantizedTensor q,
                                   client_->Quantize(Tensor::Inline(dtype, {m, n}, input), c));
          EXPECT_EQ(q.shape, (std::vector<int64_t>{m, n}));
          EXPECT_EQ(q.source_dtype, dtype);
          ExpectMatchesReference(q, QuantizeOnCpu(input, dtype, m, n, c), c);
        }
      }
    }
  }
}

TEST_F(ClientE2eTest, QuantizeSingleCopiesAndHigherRank) {
  const std::vector<int64_t> shape = {3, 50, 130};  // flattened to [150, 130]
  const std::string input = RandomInput(DType::kFloat32, 3 * 50 * 130, 5);
  QuantizeConfig c;
  c.rowwise = false;
  c.columnwise = true;
  c.amax_epsilon = 1e-3f;
  QTX_ASSERT_OK_AND_ASSIGN(QuantizedTensor q,
                           client_->Quantize(Tensor::Inline(DType::kFloat32, shape, input), c));
  EXPECT_EQ(q.shape, shape);
  ExpectMatchesReference(q, QuantizeOnCpu(input, DType::kFloat32, 150, 130, c), c);
  // Defaults: rowwise only.
  QTX_ASSERT_OK_AND_ASSIGN(
      q, client_->Quantize(Tensor::Inline(DType::kFloat32, shape, input), QuantizeConfig{}));
  ExpectMatchesReference(q, QuantizeOnCpu(input, DType::kFloat32, 150, 130, QuantizeConfig{}),
                         QuantizeConfig{});
}

TEST_F(ClientE2eTest, DequantizeMatchesReference) {
  const int64_t m = 129, n = 257;
  const std::string input = RandomInput(DType::kFloat32, m * n, 9);
  for (bool rowwise : {true, false}) {
    QuantizeConfig c;
    c.scaling_mode = ScalingMode::kBlock1D;
    c.rowwise = rowwise;
    c.columnwise = !rowwise;
    const Reference ref = QuantizeOnCpu(input, DType::kFloat32, m, n, c);
    QTX_ASSERT_OK_AND_ASSIGN(QuantizedTensor q,
                             client_->Quantize(Tensor::Inline(DType::kFloat32, {m, n}, input), c));
    for (DType out : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
      SCOPED_TRACE(absl::StrCat("rowwise=", rowwise, " out=", DTypeName(out)));
      QTX_ASSERT_OK_AND_ASSIGN(Tensor dq, client_->Dequantize(q, out));
      EXPECT_EQ(dq.dtype, out);
      EXPECT_EQ(dq.shape, (std::vector<int64_t>{m, n}));
      EXPECT_TRUE(dq.data == DequantizeOnCpu(ref, c, m, n, out)) << "dequantized bytes differ";
    }
  }
}

TEST_F(ClientE2eTest, QuantizeThroughShmRegion) {
  const int64_t m = 256, n = 384;
  const std::string input = RandomInput(DType::kBFloat16, m * n, 21);
  QTX_ASSERT_OK_AND_ASSIGN(std::unique_ptr<ShmRegion> region,
                           ShmRegion::Create("e2e-shm", 4 << 20));
  QTX_ASSERT_OK(client_->RegisterShmRegion(*region));
  QuantizeConfig c;
  c.scaling_mode = ScalingMode::kBlock2D;
  c.columnwise = true;
  const Reference ref = QuantizeOnCpu(input, DType::kBFloat16, m, n, c);

  // Input and all outputs in the region.
  QTX_ASSERT_OK_AND_ASSIGN(Tensor in,
                           region->Place(Tensor::Inline(DType::kBFloat16, {m, n}, input)));
  const std::vector<int64_t> shape = {m, n};
  QTX_ASSERT_OK_AND_ASSIGN(QuantizeOutputs outs, region->AllocateQuantizeOutputs(shape, c));
  // Pre-fill the outputs with a sentinel: the server must overwrite every byte.
  for (const auto* s : {&outs.rowwise_data, &outs.rowwise_scale_inv, &outs.columnwise_data,
                        &outs.columnwise_scale_inv}) {
    QTX_ASSERT_OK_AND_ASSIGN(std::span<std::byte> v, region->View(**s));
    std::memset(v.data(), 0xCD, v.size());
  }
  QTX_ASSERT_OK_AND_ASSIGN(QuantizedTensor q, client_->Quantize(in, c, outs));
  ASSERT_TRUE(q.rowwise_data && q.rowwise_data->in_region());
  EXPECT_EQ(*q.rowwise_data->region, *outs.rowwise_data);
  ASSERT_TRUE(q.columnwise_scale_inv && q.columnwise_scale_inv->in_region());
  EXPECT_EQ(*q.columnwise_scale_inv->region, *outs.columnwise_scale_inv);
  ExpectMatchesReference(q, ref, c, region.get());

  // Dequantize from the region tensors into the region.
  QTX_ASSERT_OK_AND_ASSIGN(Tensor dq_slot, region->AllocateTensor(DType::kFloat32, {m, n}));
  QTX_ASSERT_OK_AND_ASSIGN(Tensor dq, client_->Dequantize(q, DType::kFloat32, dq_slot.region));
  ASSERT_TRUE(dq.in_region());
  EXPECT_TRUE(BytesOf(dq, region.get()) == DequantizeOnCpu(ref, c, m, n, DType::kFloat32));

  // Region input, inline outputs.
  QTX_ASSERT_OK_AND_ASSIGN(QuantizedTensor q2, client_->Quantize(in, c));
  EXPECT_FALSE(q2.rowwise_data->in_region());
  ExpectMatchesReference(q2, ref, c);

  // Listed while registered, gone after unregistering.
  QTX_ASSERT_OK_AND_ASSIGN(std::vector<RegionInfo> regions, client_->ListRegions());
  bool found = false;
  for (const RegionInfo& r : regions) {
    if (r.name != "e2e-shm") continue;
    found = true;
    EXPECT_EQ(r.kind, "shm");
    EXPECT_EQ(r.shm_name, region->shm_name());
    EXPECT_EQ(r.byte_size, region->size());
    // in_use is not checked: the server unpins a region when the request's
    // reactor is done, which may be just after the client has the response.
  }
  EXPECT_TRUE(found) << "e2e-shm not listed";
  QTX_ASSERT_OK(client_->UnregisterRegion("e2e-shm"));
  QTX_ASSERT_OK_AND_ASSIGN(regions, client_->ListRegions());
  for (const RegionInfo& r : regions) EXPECT_NE(r.name, "e2e-shm");
  EXPECT_THAT(client_->Quantize(in, c),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("e2e-shm")));
  EXPECT_THAT(client_->UnregisterRegion("e2e-shm"),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("e2e-shm")));
}

TEST_F(ClientE2eTest, RegionErrors) {
  QTX_ASSERT_OK_AND_ASSIGN(std::unique_ptr<ShmRegion> region, ShmRegion::Create("e2e-err", 4096));
  QTX_ASSERT_OK(client_->RegisterShmRegion(*region));
  EXPECT_THAT(client_->RegisterShmRegion(*region),
              StatusIs(absl::StatusCode::kAlreadyExists, HasSubstr("e2e-err")));
  EXPECT_THAT(client_->RegisterShmRegion("e2e-missing", "/qtx-e2e-no-such-shm", 0, 64),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("qtx-e2e-no-such-shm")));
  EXPECT_THAT(client_->RegisterShmRegion("e2e-big", region->shm_name(), 0, 8192),
              StatusIs(absl::StatusCode::kInvalidArgument, ::testing::_));
  // A slice past the end of the region.
  const Tensor past_end =
      Tensor::InRegion(DType::kFloat32, {16, 64}, RegionSlice{"e2e-err", 1024, 4096});
  EXPECT_THAT(client_->Quantize(past_end, {}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("e2e-err")));
  const Tensor unknown =
      Tensor::InRegion(DType::kFloat32, {1, 128}, RegionSlice{"no-such-region", 0, 512});
  EXPECT_THAT(client_->Quantize(unknown, {}),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("no-such-region")));
  QTX_ASSERT_OK(client_->UnregisterRegion("e2e-err"));
}

// cuda_vmm registration through qtxd's fd socket: on a CPU qtxd the
// descriptors arrive and are claimed, and the request then fails saying a
// CUDA device is needed; a claimed or unknown token is NOT_FOUND.
TEST_F(ClientE2eTest, VmmRegionDescriptorsTravelOverTheFdSocket) {
  QTX_ASSERT_OK_AND_ASSIGN(std::shared_ptr<FdPassingConnection> conn,
                           SharedFdPassingConnection(server_->target()));
  const int fd = ::memfd_create("e2e-vmm", MFD_CLOEXEC);
  ASSERT_GE(fd, 0);
  QTX_ASSERT_OK_AND_ASSIGN(std::string token, conn->Send(std::vector<int>{fd, fd}));
  ::close(fd);  // qtxd holds its own copies
  const std::string uuid(16, '\x01');
  EXPECT_THAT(client_->RegisterCudaVmmRegion("e2e-vmm", {token}, {2 << 20}, 0, 2 << 20, uuid),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("1 chunks but the fd tokens carry 2 descriptors")));
  // The token was claimed by that request.
  EXPECT_THAT(
      client_->RegisterCudaVmmRegion("e2e-vmm", {token}, {2 << 20, 2 << 20}, 0, 4 << 20, uuid),
      StatusIs(absl::StatusCode::kNotFound, HasSubstr("no descriptors wait")));
  QTX_ASSERT_OK_AND_ASSIGN(std::string t2, conn->Send(std::vector<int>{0}));
  EXPECT_THAT(client_->RegisterCudaVmmRegion("e2e-vmm", {t2}, {2 << 20}, 0, 2 << 20, uuid),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("--device=cuda")));
  EXPECT_THAT(client_->RegisterCudaVmmRegion("e2e-vmm", {std::string(16, 'n')}, {2 << 20}, 0,
                                             2 << 20, uuid),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("fd_tokens[0]")));
  EXPECT_THAT(client_->RegisterCudaVmmRegion("e2e-vmm", {}, {2 << 20}, 0, 2 << 20, uuid),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("fd_tokens: empty")));
  QTX_ASSERT_OK_AND_ASSIGN(std::vector<RegionInfo> regions, client_->ListRegions());
  for (const RegionInfo& r : regions) EXPECT_NE(r.name, "e2e-vmm");
}

TEST_F(ClientE2eTest, BadInputsAreInvalidArgument) {
  const std::string four_floats(16, '\0');
  // Byte count disagrees with the shape.
  EXPECT_THAT(client_->Quantize(Tensor::Inline(DType::kFloat32, {2, 3}, four_floats), {}),
              StatusIs(absl::StatusCode::kInvalidArgument, ::testing::_));
  // Negative dim.
  EXPECT_THAT(client_->Quantize(Tensor::Inline(DType::kFloat32, {-2, 2}, four_floats), {}),
              StatusIs(absl::StatusCode::kInvalidArgument, ::testing::_));
  // FP8 is not a quantization input.
  EXPECT_THAT(client_->Quantize(Tensor::Inline(DType::kFloat8E4M3, {4, 4}, four_floats), {}),
              StatusIs(absl::StatusCode::kInvalidArgument, ::testing::_));
  // No copy requested.
  QuantizeConfig none;
  none.rowwise = false;
  none.columnwise = false;
  EXPECT_THAT(client_->Quantize(Tensor::Inline(DType::kFloat32, {2, 2}, four_floats), none),
              StatusIs(absl::StatusCode::kInvalidArgument, ::testing::_));
  // Negative epsilon.
  QuantizeConfig eps;
  eps.amax_epsilon = -1.0f;
  EXPECT_THAT(client_->Quantize(Tensor::Inline(DType::kFloat32, {2, 2}, four_floats), eps),
              StatusIs(absl::StatusCode::kInvalidArgument, ::testing::_));
  // Dequantize of an empty quantized tensor.
  EXPECT_THAT(client_->Dequantize(QuantizedTensor{}),
              StatusIs(absl::StatusCode::kInvalidArgument, ::testing::_));
}

TEST_F(ClientE2eTest, DeadlineAndRequestIdOptions) {
  const int64_t m = 512, n = 1024;
  const Tensor t = Tensor::Inline(DType::kFloat32, {m, n}, RandomInput(DType::kFloat32, m * n, 3));
  CallOptions call;
  call.timeout = absl::Microseconds(1);
  EXPECT_THAT(client_->Quantize(t, {}, {}, call),
              StatusIs(absl::StatusCode::kDeadlineExceeded, ::testing::_));
  call.timeout = absl::Seconds(30);
  call.request_id = "e2e-request-42";
  QTX_EXPECT_OK(client_->Quantize(t, {}, {}, call));
}

TEST_F(ClientE2eTest, ConcurrentCallsFromOneClient) {
  const int64_t m = 130, n = 260;
  constexpr int kThreads = 4;
  std::vector<std::thread> threads;
  std::vector<int> ok(kThreads, 0);
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      const std::string input = RandomInput(DType::kFloat32, m * n, 100 + t);
      QuantizeConfig c;
      c.columnwise = true;
      const Reference ref = QuantizeOnCpu(input, DType::kFloat32, m, n, c);
      for (int i = 0; i < 5; ++i) {
        auto q = client_->Quantize(Tensor::Inline(DType::kFloat32, {m, n}, input), c);
        if (q.ok() && q->rowwise_data->data == ref.rowwise_data &&
            q->columnwise_scale_inv->data == ref.columnwise_scale_inv) {
          ++ok[t];
        }
      }
    });
  }
  for (std::thread& th : threads) th.join();
  for (int t = 0; t < kThreads; ++t) EXPECT_EQ(ok[t], 5) << "thread " << t;
}

TEST(ClientE2eNoShmTest, ShmNeedsServerFlag) {
  QTX_ASSERT_OK_AND_ASSIGN(auto server, QtxdProcess::Start(g_qtxd_path, {"--device=cpu"}));
  QTX_ASSERT_OK_AND_ASSIGN(auto client, Client::Connect(server->target()));
  QTX_ASSERT_OK_AND_ASSIGN(std::unique_ptr<ShmRegion> region, ShmRegion::Create("noshm", 4096));
  EXPECT_THAT(client->RegisterShmRegion(*region),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("allow_client_shm")));
  client.reset();  // qtxd's shutdown waits ~5 s for a connected client to go away
  QTX_ASSERT_OK_AND_ASSIGN(int code, server->Stop());
  EXPECT_EQ(code, 0);
}

}  // namespace
}  // namespace qtx

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  qtx::g_qtxd_path = qtx::testing::QtxdFlagOrExit(argc, argv);
  return RUN_ALL_TESTS();
}
