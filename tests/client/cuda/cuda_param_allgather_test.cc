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
#include "tests/testing/sharded_params.h"
#include "tests/testing/status_matchers.h"

namespace qtx {
namespace {

using ::qtx::testing::DataDType;
using ::qtx::testing::QuantizedWhole;
using ::qtx::testing::QuantizeWhole;
using ::qtx::testing::SoloNcclGroupTest;
using ::qtx::testing::StatusIs;
using ::testing::HasSubstr;

std::string g_qtxd_path;

class CudaParamAllGatherTest : public SoloNcclGroupTest {
 protected:
  void SetUp() override {
    StartSolo(g_qtxd_path, {"--device=cuda:0"}, uint64_t{64} << 20, "pag-arena");
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

  uint64_t seq_ = 0;
};

TEST_F(CudaParamAllGatherTest, InlineShardsGiveTheReferenceBytes) {
  for (const QuantizeConfig& c : {QuantizeConfig{.scaling_mode = ScalingMode::kBlock2D},
                                  QuantizeConfig{.scaling_mode = ScalingMode::kBlock2D,
                                  .format = Fp8Format::kE5M2,
                                  .force_pow2_scales = false}}) {
    const QuantizedWhole w = QuantizeWhole(300, 260, c, 1, 1.0f);
    QuantizedTensor q;
    q.shape = w.shape;
    q.config = c;
    q.rowwise_data = Tensor::Inline(DataDType(c), {w.total()}, w.data);
    q.rowwise_scale_inv = Tensor::Inline(DType::kFloat32, {w.scale_rows, w.scale_cols}, w.scale);
    auto g = client_->AllGatherParameter(kSoloGroup, seq_++, q, {0, w.total()});
    ASSERT_TRUE(g.ok()) << g.status();
    ASSERT_TRUE(g->tensor.rowwise_data.has_value());
    EXPECT_TRUE(g->tensor.rowwise_data->data == w.data) << "bytes differ from QuantizeBlock's";
    EXPECT_TRUE(g->tensor.rowwise_scale_inv->data == w.scale);
    EXPECT_EQ(g->ranges, (std::vector<ShardRange>{{0, w.total()}}));
  }
  // A range that does not cover the parameter.
  const QuantizedWhole w =
      QuantizeWhole(130, 129, {.scaling_mode = ScalingMode::kBlock2D}, 2, 1.0f);
  QuantizedTensor q;
  q.shape = w.shape;
  q.config = w.config;
  q.rowwise_data = Tensor::Inline(DType::kUInt8, {w.total() - 1}, w.data.substr(1));
  q.rowwise_scale_inv = Tensor::Inline(DType::kFloat32, {w.scale_rows, w.scale_cols}, w.scale);
  EXPECT_THAT(client_->AllGatherParameter(kSoloGroup, seq_++, q, {1, w.total()}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("elements [0, 1) are owned by no rank")));
}

TEST_F(CudaParamAllGatherTest, DeviceRegionsInPlaceAndWithEvents) {
  const QuantizeConfig c{.scaling_mode = ScalingMode::kBlock2D};
  const QuantizedWhole w = QuantizeWhole(257, 385, c, 3, 1.0f);
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
    auto g = client_->AllGatherParameter(kSoloGroup, seq_++, shard_in(data, scale), {0, w.total()},
                                         outs);
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
    auto g = client_->AllGatherParameter(kSoloGroup, seq_++, shard_in(data, scale), {0, w.total()},
                                         outs);
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
    auto g = client_->AllGatherParameter(kSoloGroup, seq_++, shard_in(data, scale), {0, w.total()},
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
