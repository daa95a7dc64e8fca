// CudaDevice in-process on cuda:0 (label gpu): staging copies across chunk
// boundaries, kernels vs the CPU reference, error mapping of bad handles and
// allocations, and the staged all-gather building blocks vs CpuDevice.
#include "server/backend/cuda_device.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kernels/block_geometry.h"
#include "kernels/cpu/quantize_block.h"
#include "kernels/shard_geometry.h"
#include "server/backend/cpu_device.h"
#include "server/backend/cuda_status.h"
#include "tests/testing/status_matchers.h"

namespace qtx::server::backend {
namespace {

using ::qtx::testing::StatusIs;
using ::testing::HasSubstr;

std::vector<uint8_t> RandomBytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint8_t> out(n);
  for (auto& b : out) b = static_cast<uint8_t>(rng());
  return out;
}

// BF16 values of normal(0, 3) plus a few large ones.
std::vector<uint16_t> RandomBf16(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, 3.0f);
  std::vector<uint16_t> out(n);
  for (size_t i = 0; i < n; ++i) {
    float f = dist(rng) * (i % 97 == 0 ? 1000.0f : 1.0f);
    uint32_t u;
    std::memcpy(&u, &f, 4);
    out[i] = static_cast<uint16_t>(u >> 16);
  }
  return out;
}

class CudaDeviceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_GT(VisibleCudaDevices(), 0) << "gpu-labelled test: needs a visible CUDA device";
    CudaDeviceOptions options;
    options.staging_chunk_bytes = 4096;  // many chunks even for small copies
    options.streams = 2;
    auto device = CudaDevice::Create(0, options);
    QTX_ASSERT_OK(device.status());
    device_ = *std::move(device);
  }
  std::unique_ptr<CudaDevice> device_;
};

TEST_F(CudaDeviceTest, CopiesRoundTripAcrossStagingChunks) {
  for (uint64_t size : {uint64_t{1}, uint64_t{4095}, uint64_t{4096}, uint64_t{4097},
                        uint64_t{3 * 4096 + 5}, uint64_t{1} << 20}) {
    const std::vector<uint8_t> src = RandomBytes(size, static_cast<uint32_t>(size));
    QTX_ASSERT_OK_AND_ASSIGN(DeviceBuffer buf, device_->Allocate(size));
    ASSERT_NE(buf.data(), nullptr);
    QTX_ASSERT_OK(device_->CopyFromHost(buf.data(), src.data(), size));
    std::vector<uint8_t> back(size, 0);
    QTX_ASSERT_OK(device_->CopyToHost(back.data(), buf.data(), size));
    EXPECT_EQ(back, src) << "size " << size;
  }
}

TEST_F(CudaDeviceTest, EmptyAllocationAndCopiesAreNoOps) {
  QTX_ASSERT_OK_AND_ASSIGN(DeviceBuffer buf, device_->Allocate(0));
  EXPECT_EQ(buf.data(), nullptr);
  QTX_EXPECT_OK(device_->CopyFromHost(nullptr, nullptr, 0));
  QTX_EXPECT_OK(device_->CopyToHost(nullptr, nullptr, 0));
}

TEST_F(CudaDeviceTest, ImpossibleAllocationIsResourceExhausted) {
  EXPECT_THAT(device_->Allocate(uint64_t{1} << 52),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("cannot allocate")));
  // The device keeps working afterwards (the error was cleared).
  QTX_ASSERT_OK_AND_ASSIGN(DeviceBuffer buf, device_->Allocate(64));
  EXPECT_NE(buf.data(), nullptr);
}

TEST_F(CudaDeviceTest, QuantizeAndDequantizeMatchTheCpuReference) {
  const int64_t m = 257, n = 300;
  const std::vector<uint16_t> input = RandomBf16(m * n, 7);
  for (auto scaling : {kernels::BlockScaling::kBlock1D, kernels::BlockScaling::kBlock2D}) {
    kernels::QuantizeParams p;
    p.scaling = scaling;
    p.rowwise = true;
    p.columnwise = true;
    const kernels::QuantizedLayout L = kernels::ComputeLayout(scaling, m, n);
    const uint64_t sizes[4] = {static_cast<uint64_t>(L.RowwiseDataBytes()),
                               static_cast<uint64_t>(L.RowwiseScaleCount()) * 4,
                               static_cast<uint64_t>(L.ColumnwiseDataBytes()),
                               static_cast<uint64_t>(L.ColumnwiseScaleCount()) * 4};
    std::vector<std::vector<uint8_t>> want(4), got(4);
    for (int i = 0; i < 4; ++i) {
      want[i].assign(sizes[i], 0xAB);
      got[i].assign(sizes[i], 0xCD);
    }
    kernels::QuantizedBuffers host_out{want[0].data(), reinterpret_cast<float*>(want[1].data()),
                                       want[2].data(), reinterpret_cast<float*>(want[3].data())};
    kernels::cpu::QuantizeBlock(input.data(), kernels::InputDType::kBFloat16, m, n, p, host_out);

    QTX_ASSERT_OK_AND_ASSIGN(DeviceBuffer in, device_->Allocate(input.size() * 2));
    QTX_ASSERT_OK(device_->CopyFromHost(in.data(), input.data(), input.size() * 2));
    std::vector<DeviceBuffer> outs;
    for (int i = 0; i < 4; ++i) {
      QTX_ASSERT_OK_AND_ASSIGN(DeviceBuffer b, device_->Allocate(sizes[i]));
      outs.push_back(std::move(b));
    }
    QuantizeArgs args;
    args.input = in.data();
    args.dtype = kernels::InputDType::kBFloat16;
    args.m = m;
    args.n = n;
    args.params = p;
    args.out = {static_cast<uint8_t*>(outs[0].data()), static_cast<float*>(outs[1].data()),
                static_cast<uint8_t*>(outs[2].data()), static_cast<float*>(outs[3].data())};
    QTX_ASSERT_OK(device_->Quantize(args));
    for (int i = 0; i < 4; ++i) {
      QTX_ASSERT_OK(device_->CopyToHost(got[i].data(), outs[i].data(), sizes[i]));
      EXPECT_EQ(got[i], want[i]) << "buffer " << i << " scaling " << static_cast<int>(scaling);
    }

    // Dequantize the columnwise copy back to FP32 on both devices.
    std::vector<float> want_x(m * n), got_x(m * n, -1.0f);
    kernels::QuantizedConstBuffers host_in{};
    host_in.columnwise_data = want[2].data();
    host_in.columnwise_scale_inv = reinterpret_cast<const float*>(want[3].data());
    kernels::cpu::DequantizeBlock(host_in, scaling, p.format, m, n, false,
                                  kernels::InputDType::kFloat32, want_x.data());
    QTX_ASSERT_OK_AND_ASSIGN(DeviceBuffer x, device_->Allocate(m * n * 4));
    DequantizeArgs d;
    d.in.columnwise_data = static_cast<const uint8_t*>(outs[2].data());
    d.in.columnwise_scale_inv = static_cast<const float*>(outs[3].data());
    d.scaling = scaling;
    d.format = p.format;
    d.m = m;
    d.n = n;
    d.use_rowwise = false;
    d.out_dtype = kernels::InputDType::kFloat32;
    d.out = x.data();
    QTX_ASSERT_OK(device_->Dequantize(d));
    QTX_ASSERT_OK(device_->CopyToHost(got_x.data(), x.data(), m * n * 4));
    EXPECT_EQ(std::memcmp(got_x.data(), want_x.data(), m * n * 4), 0);
  }
}

TEST_F(CudaDeviceTest, BadIpcMemHandlesAreInvalidArgument) {
  EXPECT_THAT(device_->OpenIpcMemory(std::string(63, '\1'), 0, 1024),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("must be exactly 64")));
  EXPECT_THAT(device_->OpenIpcMemory(std::string(64, '\0'), 1000, 1024),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("cuda_ipc.device_id=1000")));
  const std::vector<uint8_t> junk = RandomBytes(64, 99);
  EXPECT_THAT(device_->OpenIpcMemory(std::string(junk.begin(), junk.end()), 0, 1024),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("cannot open")));
  // A later call on this thread is unaffected by the failed open.
  QTX_ASSERT_OK_AND_ASSIGN(DeviceBuffer buf, device_->Allocate(64));
  EXPECT_NE(buf.data(), nullptr);
}

TEST_F(CudaDeviceTest, BadEventHandlesFailBeforeTheKernel) {
  const int64_t m = 4, n = 128;
  QTX_ASSERT_OK_AND_ASSIGN(DeviceBuffer in, device_->Allocate(m * n * 4));
  QTX_ASSERT_OK_AND_ASSIGN(DeviceBuffer out, device_->Allocate(m * n));
  QTX_ASSERT_OK_AND_ASSIGN(DeviceBuffer scale, device_->Allocate(4 * 4));
  QuantizeArgs args;
  args.input = in.data();
  args.m = m;
  args.n = n;
  args.out.rowwise_data = static_cast<uint8_t*>(out.data());
  args.out.rowwise_scale_inv = static_cast<float*>(scale.data());
  args.events.signal_event = std::string(12, 'x');
  EXPECT_THAT(device_->Quantize(args),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("must be exactly 64")));
  const std::vector<uint8_t> junk = RandomBytes(64, 5);
  args.events.signal_event.clear();
  args.events.wait_event.assign(junk.begin(), junk.end());
  EXPECT_THAT(device_->Quantize(args),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("cuda_events.wait_event")));
}

TEST_F(CudaDeviceTest, StagedShardBuildingBlocksMatchCpuDevice) {
  CpuDevice cpu;
  kernels::ShardGeometry g;
  g.row_offset = 100;
  g.m = 200;
  g.n = 260;
  const std::vector<uint16_t> input = RandomBf16(g.m * g.n, 11);
  ShardArgs args;
  args.dtype = kernels::InputDType::kBFloat16;
  args.geom = g;
  args.params.rowwise = true;
  args.params.columnwise = true;
  const int64_t len = kernels::BoundaryAmaxLength(args.params.scaling, g);
  std::vector<float> cf(len), cl(len), gf(len), gl(len);
  args.input = input.data();
  QTX_ASSERT_OK(cpu.ShardBoundaryAmax(args, cf.data(), cl.data()));
  QTX_ASSERT_OK_AND_ASSIGN(DeviceBuffer in, device_->Allocate(input.size() * 2));
  QTX_ASSERT_OK(device_->CopyFromHost(in.data(), input.data(), input.size() * 2));
  QTX_ASSERT_OK_AND_ASSIGN(DeviceBuffer df, device_->Allocate(len * 4));
  QTX_ASSERT_OK_AND_ASSIGN(DeviceBuffer dl, device_->Allocate(len * 4));
  args.input = in.data();
  QTX_ASSERT_OK(device_->ShardBoundaryAmax(args, static_cast<float*>(df.data()),
                                           static_cast<float*>(dl.data())));
  QTX_ASSERT_OK(device_->CopyToHost(gf.data(), df.data(), len * 4));
  QTX_ASSERT_OK(device_->CopyToHost(gl.data(), dl.data(), len * 4));
  EXPECT_EQ(gf, cf);
  EXPECT_EQ(gl, cl);
}

TEST(CudaStatus, ClearsTheLastErrorSoTheNextCallStartsClean) {
  ASSERT_GT(VisibleCudaDevices(), 0) << "gpu-labelled test: needs a visible CUDA device";
  // An invalid device ordinal raises a non-sticky error.
  int value = 0;
  const cudaError_t err = cudaDeviceGetAttribute(&value, cudaDevAttrMaxThreadsPerBlock, -1);
  ASSERT_NE(err, cudaSuccess);
  (void)CudaErrorToStatus(err, "cudaDeviceGetAttribute", __FILE__, __LINE__);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

}  // namespace
}  // namespace qtx::server::backend
