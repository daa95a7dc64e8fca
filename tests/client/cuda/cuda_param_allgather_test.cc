// The FP8 parameter all-gather (Collective.AllGatherParameter) on a CUDA qtxd
// (--device=cuda:0) in a one-rank NCCL group: the gathered rowwise copy is
// byte for byte the CPU reference's QuantizeBlock (BLOCK_2D) of the whole
// tensor, with the shard and outputs inline (staged through device memory),
// in CUDA IPC device regions (the NCCL gather writes device memory), in place
// (the shard already at its offset of the output slice), and ordered by
// interprocess events against the client's stream. Label gpu.
#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/block_geometry.h"
#include "kernels/cpu/quantize_block.h"
#include "qtx/client.h"
#include "qtx/cuda_ipc.h"
#include "tests/client/cuda/cuda_test_support.h"
#include "tests/testing/qtxd_process.h"
#include "tests/testing/status_matchers.h"

namespace qtx {
namespace {

using ::qtx::testing::DeviceArena;
using ::qtx::testing::QtxdProcess;
using ::qtx::testing::StatusIs;
using ::testing::HasSubstr;

std::string g_qtxd_path;

constexpr char kGroup[] = "solo";

struct Whole {
  std::vector<int64_t> shape;
  QuantizeConfig config;
  std::string data;
  std::string scale;
  int64_t scale_rows = 0, scale_cols = 0;
  int64_t total() const { return shape[0] * shape[1]; }
};

Whole QuantizeWhole(int64_t m, int64_t n, const QuantizeConfig& config, uint32_t seed) {
  Whole w;
  w.shape = {m, n};
  w.config = config;
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(m * n));
  for (int64_t i = 0; i < m * n; ++i) {
    x[i] = d(rng) * std::ldexp(1.0f, static_cast<int>((i / 911) % 9) - 4);
  }
  const kernels::QuantizedLayout layout =
      kernels::ComputeLayout(kernels::BlockScaling::kBlock2D, m, n);
  w.scale_rows = layout.rowwise_scale_rows;
  w.scale_cols = layout.rowwise_scale_cols;
  w.data.assign(static_cast<size_t>(m * n), '\0');
  std::vector<float> scale(static_cast<size_t>(layout.RowwiseScaleCount()));
  kernels::QuantizeParams p;
  p.scaling = kernels::BlockScaling::kBlock2D;
  p.format =
      config.format == Fp8Format::kE5M2 ? kernels::Fp8Format::kE5M2 : kernels::Fp8Format::kE4M3;
  p.force_pow2_scales = config.force_pow2_scales;
  kernels::QuantizedBuffers out;
  out.rowwise_data = reinterpret_cast<uint8_t*>(w.data.data());
  out.rowwise_scale_inv = scale.data();
  kernels::cpu::QuantizeBlock(x.data(), kernels::InputDType::kFloat32, m, n, p, out);
  w.scale.assign(reinterpret_cast<const char*>(scale.data()), scale.size() * 4);
  return w;
}

DType DataDType(const QuantizeConfig& c) {
  return c.format == Fp8Format::kE5M2 ? DType::kFloat8E5M2 : DType::kFloat8E4M3;
}

class CudaParamAllGatherTest : public ::testing::Test {
 protected:
  void SetUp() override {
    QTX_ASSERT_OK_AND_ASSIGN(server_, QtxdProcess::Start(g_qtxd_path, {"--device=cuda:0"}));
    QTX_ASSERT_OK_AND_ASSIGN(client_, Client::Connect(server_->target()));
    CUDA_OK(cudaSetDevice(0));
    CUDA_OK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    arena_.size = uint64_t{64} << 20;
    arena_.name = "pag-arena";
    CUDA_OK(cudaMalloc(&arena_.base, arena_.size));
    QTX_ASSERT_OK(
        qtx::cuda::RegisterDevicePointer(*client_, arena_.name, arena_.base, arena_.size));
    CollectiveGroupConfig group;
    group.name = kGroup;
    group.world_size = 1;
    group.backend = CommBackend::kNccl;
    group.timeout = absl::Seconds(60);
    QTX_ASSERT_OK(client_->CreateGroup(group).status());
  }
  void TearDown() override {
    if (stream_ != nullptr) (void)cudaStreamSynchronize(stream_);
    if (client_ != nullptr && server_ != nullptr) {
      (void)client_->DestroyGroup(kGroup);
      (void)client_->UnregisterRegion(arena_.name);
    }
    if (arena_.base != nullptr) (void)cudaFree(arena_.base);
    if (stream_ != nullptr) (void)cudaStreamDestroy(stream_);
  }

  std::string Download(const RegionSlice& s) {
    std::string out(s.size, '\0');
    EXPECT_EQ(cudaMemcpy(out.data(), arena_.At(s), s.size, cudaMemcpyDeviceToHost), cudaSuccess);
    return out;
  }
  RegionSlice Upload(const std::string& bytes) {
    const RegionSlice s = arena_.Take(bytes.size());
    EXPECT_EQ(cudaMemcpy(arena_.At(s), bytes.data(), bytes.size(), cudaMemcpyHostToDevice),
              cudaSuccess);
    return s;
  }

  std::unique_ptr<QtxdProcess> server_;
  std::unique_ptr<Client> client_;
  cudaStream_t stream_ = nullptr;
  DeviceArena arena_;
  uint64_t seq_ = 0;
};

TEST_F(CudaParamAllGatherTest, InlineShardsGiveTheReferenceBytes) {
  for (const QuantizeConfig& c : {QuantizeConfig{.scaling_mode = ScalingMode::kBlock2D},
                                  QuantizeConfig{.scaling_mode = ScalingMode::kBlock2D,
                                  .format = Fp8Format::kE5M2,
                                  .force_pow2_scales = false}}) {
    const Whole w = QuantizeWhole(300, 260, c, 1);
    QuantizedTensor q;
    q.shape = w.shape;
    q.config = c;
    q.rowwise_data = Tensor::Inline(DataDType(c), {w.total()}, w.data);
    q.rowwise_scale_inv = Tensor::Inline(DType::kFloat32, {w.scale_rows, w.scale_cols}, w.scale);
    auto g = client_->AllGatherParameter(kGroup, seq_++, q, {0, w.total()});
    ASSERT_TRUE(g.ok()) << g.status();
    ASSERT_TRUE(g->tensor.rowwise_data.has_value());
    EXPECT_TRUE(g->tensor.rowwise_data->data == w.data) << "bytes differ from QuantizeBlock's";
    EXPECT_TRUE(g->tensor.rowwise_scale_inv->data == w.scale);
    EXPECT_EQ(g->ranges, (std::vector<ShardRange>{{0, w.total()}}));
  }
  // A range that does not cover the parameter.
  const Whole w = QuantizeWhole(130, 129, {.scaling_mode = ScalingMode::kBlock2D}, 2);
  QuantizedTensor q;
  q.shape = w.shape;
  q.config = w.config;
  q.rowwise_data = Tensor::Inline(DType::kUInt8, {w.total() - 1}, w.data.substr(1));
  q.rowwise_scale_inv = Tensor::Inline(DType::kFloat32, {w.scale_rows, w.scale_cols}, w.scale);
  EXPECT_THAT(client_->AllGatherParameter(kGroup, seq_++, q, {1, w.total()}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("elements [0, 1) are owned by no rank")));
}

TEST_F(CudaParamAllGatherTest, DeviceRegionsInPlaceAndWithEvents) {
  const QuantizeConfig c{.scaling_mode = ScalingMode::kBlock2D};
  const Whole w = QuantizeWhole(257, 385, c, 3);
  const uint64_t total = static_cast<uint64_t>(w.total());
  auto shard_in = [&](const RegionSlice& data, const RegionSlice& scale) {
    QuantizedTensor q;
    q.shape = w.shape;
    q.config = c;
    q.rowwise_data = Tensor::InRegion(DType::kUInt8, {w.total()}, data);
    q.rowwise_scale_inv = Tensor::InRegion(DType::kFloat32, {w.scale_rows, w.scale_cols}, scale);
    return q;
  };
  // Shard and scales in device memory, outputs in other device slices
  // (pre-filled with garbage).
  {
    const RegionSlice data = Upload(w.data);
    const RegionSlice scale = Upload(w.scale);
    QuantizeOutputs outs;
    outs.rowwise_data = Upload(std::string(total, '\xCD'));
    outs.rowwise_scale_inv = Upload(std::string(w.scale.size(), '\xCD'));
    auto g =
        client_->AllGatherParameter(kGroup, seq_++, shard_in(data, scale), {0, w.total()}, outs);
    ASSERT_TRUE(g.ok()) << g.status();
    EXPECT_TRUE(g->tensor.rowwise_data->in_region());
    EXPECT_TRUE(Download(*outs.rowwise_data) == w.data) << "device output differs";
    EXPECT_TRUE(Download(*outs.rowwise_scale_inv) == w.scale);
  }
  // In place: the shard is the output slice itself, the scales the output's.
  {
    const RegionSlice data = Upload(w.data);
    const RegionSlice scale = Upload(w.scale);
    QuantizeOutputs outs;
    outs.rowwise_data = data;
    outs.rowwise_scale_inv = scale;
    auto g =
        client_->AllGatherParameter(kGroup, seq_++, shard_in(data, scale), {0, w.total()}, outs);
    ASSERT_TRUE(g.ok()) << g.status();
    EXPECT_TRUE(Download(data) == w.data) << "in-place output differs";
    EXPECT_TRUE(Download(scale) == w.scale);
  }
  // Ordered by events: the client's stream writes the shard, the sidecar
  // waits for it, the client's stream reads the output after the signal.
  {
    const RegionSlice data = arena_.Take(total);
    const RegionSlice scale = arena_.Take(w.scale.size());
    QuantizeOutputs outs;
    outs.rowwise_data = arena_.Take(total);
    outs.rowwise_scale_inv = arena_.Take(w.scale.size());
    void* pinned = nullptr;
    CUDA_OK(cudaMallocHost(&pinned, total + w.scale.size()));
    std::memcpy(pinned, w.data.data(), total);
    std::memcpy(static_cast<char*>(pinned) + total, w.scale.data(), w.scale.size());
    CUDA_OK(cudaMemsetAsync(arena_.At(*outs.rowwise_data), 0xCD, total, stream_));
    CUDA_OK(cudaMemcpyAsync(arena_.At(data), pinned, total, cudaMemcpyHostToDevice, stream_));
    CUDA_OK(cudaMemcpyAsync(arena_.At(scale), static_cast<char*>(pinned) + total, w.scale.size(),
                            cudaMemcpyHostToDevice, stream_));
    auto ready = qtx::cuda::IpcEvent::Create();
    auto done = qtx::cuda::IpcEvent::Create();
    ASSERT_TRUE(ready.ok() && done.ok());
    CUDA_OK(cudaEventRecord(ready->get(), stream_));
    CallOptions call;
    call.cuda_wait_event = ready->handle();
    call.cuda_signal_event = done->handle();
    auto g = client_->AllGatherParameter(kGroup, seq_++, shard_in(data, scale), {0, w.total()},
                                         outs, call);
    ASSERT_TRUE(g.ok()) << g.status();
    CUDA_OK(cudaStreamWaitEvent(stream_, done->get(), 0));
    std::string got(total, '\0');
    CUDA_OK(cudaMemcpyAsync(pinned, arena_.At(*outs.rowwise_data), total, cudaMemcpyDeviceToHost,
                            stream_));
    CUDA_OK(cudaStreamSynchronize(stream_));
    std::memcpy(got.data(), pinned, total);
    EXPECT_TRUE(got == w.data) << "event-ordered output differs";
    CUDA_OK(cudaFreeHost(pinned));
  }
}

}  // namespace
}  // namespace qtx

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  qtx::g_qtxd_path = qtx::testing::QtxdFlagOrExit(argc, argv);
  return RUN_ALL_TESTS();
}
