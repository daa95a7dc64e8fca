// GPU (label gpu): qtx::cuda::Plan against qtxd --device=cuda:0 (--qtxd=...).
// A CUDA graph captured once (poison the outputs, produce the input late,
// Plan::Enqueue, compare the outputs with the CPU reference on the device) is
// replayed many times with a new input each time: every replay must see
// qtxd's outputs for its own input, bit for bit. The same graph without the
// plan's kernel must see stale bytes (so the check can fail).
#include "qtx/cuda_plan.h"

#include <cuda_runtime_api.h>
#include <signal.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/block_geometry.h"
#include "kernels/cpu/quantize_block.h"
#include "kernels/fp8.h"
#include "qtx/channel.h"
#include "qtx/client.h"
#include "qtx/cuda_ipc.h"
#include "tests/client/cuda/channel_test_kernels.h"
#include "tests/client/cuda/cuda_test_support.h"
#include "tests/testing/qtxd_process.h"
#include "tests/testing/status_matchers.h"

namespace qtx {
namespace {

using ::qtx::testing::QtxdProcess;
using ::qtx::testing::StatusIs;
using ::testing::HasSubstr;

std::string g_qtxd_path;

int Replays() {
  const char* s = std::getenv("QTX_PLAN_TEST_REPLAYS");
  return s != nullptr ? std::atoi(s) : 300;
}

// Waits for `stream` at most `limit`: a test must fail, not hang, when a
// wait on the GPU is never released.
bool StreamDrains(cudaStream_t stream, absl::Duration limit) {
  const absl::Time end = absl::Now() + limit;
  cudaError_t e;
  while ((e = cudaStreamQuery(stream)) == cudaErrorNotReady && absl::Now() < end) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  return e == cudaSuccess;
}

class CudaPlanTest : public ::testing::Test {
 protected:
  static constexpr int64_t kM = 1000, kN = 1024;  // M not a multiple of 128
  static constexpr int kVariants = 4;

  void SetUp() override {
    QTX_ASSERT_OK_AND_ASSIGN(
        server_, QtxdProcess::Start(g_qtxd_path, {"--device=cuda:0", "--allow_client_shm"}));
    QTX_ASSERT_OK_AND_ASSIGN(client_, Client::Connect(server_->target()));
    CUDA_OK(cudaSetDevice(0));
    CUDA_OK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    kernels::QuantizeParams p;
    p.rowwise = p.columnwise = true;
    const kernels::QuantizedLayout layout = kernels::ComputeLayout(p.scaling, kM, kN);
    out_bytes_[0] = layout.RowwiseDataBytes();
    out_bytes_[1] = layout.RowwiseScaleCount() * 4;
    out_bytes_[2] = layout.ColumnwiseDataBytes();
    out_bytes_[3] = layout.ColumnwiseScaleCount() * 4;
    // The plan's tensors: one registered allocation.
    uint64_t total = Round(in_bytes_);
    for (uint64_t b : out_bytes_) total += Round(b);
    CUDA_OK(cudaMalloc(&arena_, total));
    QTX_ASSERT_OK(qtx::cuda::RegisterDevicePointer(*client_, "plan-arena", arena_, total));
    uint64_t off = Round(in_bytes_);
    input_ = RegionSlice{"plan-arena", 0, in_bytes_};
    RegionSlice* outs[4] = {&rw_, &rws_, &cw_, &cws_};
    for (int k = 0; k < 4; ++k) {
      *outs[k] = RegionSlice{"plan-arena", off, out_bytes_[k]};
      off += Round(out_bytes_[k]);
    }
    // Per variant: its input and expected outputs (CPU reference), and the
    // graph's fixed "current variant" staging buffers.
    std::mt19937_64 rng(7);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (int v = 0; v < kVariants; ++v) {
      std::string in(in_bytes_, '\0');
      for (int64_t i = 0; i < kM * kN; ++i) {
        const uint16_t h = kernels::FloatToBf16(normal(rng) * (i % 13 == v ? 40.0f : 1.0f));
        std::memcpy(in.data() + 2 * i, &h, 2);
      }
      std::string outs_host[4];
      for (int k = 0; k < 4; ++k) outs_host[k].assign(out_bytes_[k], '\0');
      kernels::QuantizedBuffers b;
      b.rowwise_data = reinterpret_cast<uint8_t*>(outs_host[0].data());
      b.rowwise_scale_inv = reinterpret_cast<float*>(outs_host[1].data());
      b.columnwise_data = reinterpret_cast<uint8_t*>(outs_host[2].data());
      b.columnwise_scale_inv = reinterpret_cast<float*>(outs_host[3].data());
      kernels::cpu::QuantizeBlock(in.data(), kernels::InputDType::kBFloat16, kM, kN, p, b);
      sources_.push_back(Upload(in));
      for (int k = 0; k < 4; ++k) expected_[k].push_back(Upload(outs_host[k]));
    }
    CUDA_OK(cudaMalloc(&staging_in_, in_bytes_));
    for (int k = 0; k < 4; ++k) CUDA_OK(cudaMalloc(&staging_expected_[k], out_bytes_[k]));
    CUDA_OK(cudaMalloc(reinterpret_cast<void**>(&mismatches_), sizeof(unsigned long long)));
    CUDA_OK(cudaMemset(mismatches_, 0, sizeof(unsigned long long)));
  }

  void TearDown() override {
    if (stream_ != nullptr && !StreamDrains(stream_, absl::Seconds(10))) {
      // A wait that is never released: end the process rather than hang.
      std::fprintf(stderr, "the test's stream did not drain within 10 s\n");
      std::_Exit(3);
    }
    if (client_ != nullptr) (void)client_->UnregisterRegion("plan-arena");
    for (void* p : owned_) (void)cudaFree(p);
    (void)cudaFree(arena_);
    (void)cudaFree(staging_in_);
    for (void* p : staging_expected_) (void)cudaFree(p);
    (void)cudaFree(mismatches_);
    if (stream_ != nullptr) (void)cudaStreamDestroy(stream_);
  }

  static uint64_t Round(uint64_t b) { return (b + 255) / 256 * 256; }
  void* Upload(const std::string& bytes) {
    void* p = nullptr;
    EXPECT_EQ(cudaMalloc(&p, bytes.size()), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(p, bytes.data(), bytes.size(), cudaMemcpyHostToDevice), cudaSuccess);
    owned_.push_back(p);
    return p;
  }
  void* At(const RegionSlice& s) const { return static_cast<char*>(arena_) + s.offset; }
  uint64_t Mismatches() {
    unsigned long long n = 0;
    EXPECT_EQ(cudaMemcpy(&n, mismatches_, sizeof(n), cudaMemcpyDeviceToHost), cudaSuccess);
    return n;
  }

  QuantizePlan Op() const {
    QuantizePlan op;
    op.input = Tensor::InRegion(DType::kBFloat16, {kM, kN}, input_);
    op.config.columnwise = true;
    op.outputs.rowwise_data = rw_;
    op.outputs.rowwise_scale_inv = rws_;
    op.outputs.columnwise_data = cw_;
    op.outputs.columnwise_scale_inv = cws_;
    return op;
  }

  // Captures: poison the outputs; copy the staged input in, late (a spin);
  // [the plan's kernel]; count output bytes that differ from the staged
  // expected ones.
  void Capture(qtx::cuda::Plan* plan, cudaGraphExec_t* exec) {
    cudaGraph_t graph = nullptr;
    CUDA_OK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
    const RegionSlice* outs[4] = {&rw_, &rws_, &cw_, &cws_};
    for (const RegionSlice* s : outs) CUDA_OK(cudaMemsetAsync(At(*s), 0xCD, s->size, stream_));
    CUDA_OK(qtx::testing::LaunchDelayedCopy(At(input_), staging_in_, in_bytes_, 20000, stream_));
    if (plan != nullptr) QTX_ASSERT_OK(plan->Enqueue(stream_));
    for (int k = 0; k < 4; ++k) {
      CUDA_OK(qtx::testing::LaunchCountMismatches(At(*outs[k]), staging_expected_[k], out_bytes_[k],
                                                  mismatches_, stream_));
    }
    CUDA_OK(cudaStreamEndCapture(stream_, &graph));
    CUDA_OK(cudaGraphInstantiate(exec, graph, 0));
    CUDA_OK(cudaGraphDestroy(graph));
  }

  // Stages variant v (outside the graph, on the stream), then replays.
  void Replay(cudaGraphExec_t exec, int v) {
    CUDA_OK(
        cudaMemcpyAsync(staging_in_, sources_[v], in_bytes_, cudaMemcpyDeviceToDevice, stream_));
    for (int k = 0; k < 4; ++k) {
      CUDA_OK(cudaMemcpyAsync(staging_expected_[k], expected_[k][v], out_bytes_[k],
                              cudaMemcpyDeviceToDevice, stream_));
    }
    CUDA_OK(cudaGraphLaunch(exec, stream_));
  }

  std::unique_ptr<QtxdProcess> server_;
  std::unique_ptr<Client> client_;
  cudaStream_t stream_ = nullptr;
  const uint64_t in_bytes_ = kM * kN * 2;
  uint64_t out_bytes_[4] = {};
  void* arena_ = nullptr;
  RegionSlice input_, rw_, rws_, cw_, cws_;
  std::vector<void*> sources_, expected_[4], owned_;
  void* staging_in_ = nullptr;
  void* staging_expected_[4] = {};
  unsigned long long* mismatches_ = nullptr;
};

TEST_F(CudaPlanTest, ReplaysOfACapturedGraphSeeEveryOutputOfTheirOwnInput) {
  for (qtx::cuda::FlagMemory memory :
       {qtx::cuda::FlagMemory::kHostShm, qtx::cuda::FlagMemory::kDevice}) {
    SCOPED_TRACE(memory == qtx::cuda::FlagMemory::kHostShm ? "host flags" : "device flags");
    CUDA_OK(cudaMemset(mismatches_, 0, sizeof(unsigned long long)));
    qtx::cuda::PlanOptions options;
    options.memory = memory;
    QTX_ASSERT_OK_AND_ASSIGN(std::unique_ptr<qtx::cuda::Plan> plan,
                             qtx::cuda::Plan::Open(*client_, Op(), options));
    cudaGraphExec_t exec = nullptr;
    Capture(plan.get(), &exec);
    const int replays = Replays();
    for (int r = 0; r < replays; ++r) Replay(exec, r % kVariants);
    CUDA_OK(cudaStreamSynchronize(stream_));
    EXPECT_EQ(Mismatches(), 0u) << "bytes differing from the CPU reference after " << replays
                                << " replays";
    QTX_EXPECT_OK(plan->status());
    EXPECT_GE(plan->completed() + 1, static_cast<uint64_t>(replays));  // reports may trail
    QTX_EXPECT_OK(plan->Close());
    CUDA_OK(cudaGraphExecDestroy(exec));
    std::printf(
        "{\"test\":\"cuda_plan_graph_replays\",\"flags\":\"%s\",\"replays\":%d,"
        "\"mismatched_bytes\":%llu}\n",
        memory == qtx::cuda::FlagMemory::kHostShm ? "host" : "device", replays,
        static_cast<unsigned long long>(Mismatches()));
  }
}

// Without the plan's kernel in the graph nothing orders the consumer after
// qtxd: the same check must see poisoned bytes (proves the test can fail).
TEST_F(CudaPlanTest, WithoutThePlanTheSameGraphSeesStaleBytes) {
  cudaGraphExec_t exec = nullptr;
  Capture(nullptr, &exec);
  for (int r = 0; r < 8; ++r) Replay(exec, r % kVariants);
  CUDA_OK(cudaStreamSynchronize(stream_));
  EXPECT_GT(Mismatches(), 0u);
  CUDA_OK(cudaGraphExecDestroy(exec));
}

TEST_F(CudaPlanTest, ABadPlanReleasesItsReplayAndReportsTheFailure) {
  QuantizePlan op = Op();
  op.input.region->region = "no-such-region";
  QTX_ASSERT_OK_AND_ASSIGN(std::unique_ptr<qtx::cuda::Plan> plan,
                           qtx::cuda::Plan::Open(*client_, op));
  // qtxd checks the op when it enqueues execution 1, which may be before or
  // after this call: the first Enqueue either launches (and the kernel is
  // released by the failure value: no hang) or already reports the failure.
  const absl::Status first = plan->Enqueue(stream_);
  EXPECT_TRUE(first.ok() || absl::IsNotFound(first)) << first;
  CUDA_OK(cudaStreamSynchronize(stream_));
  for (int i = 0; i < 200 && plan->status().ok(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_THAT(plan->status(), StatusIs(absl::StatusCode::kNotFound, HasSubstr("no-such-region")));
  EXPECT_THAT(plan->Enqueue(stream_), StatusIs(absl::StatusCode::kNotFound, ::testing::_));
}

TEST_F(CudaPlanTest, QtxdDyingReleasesReplaysForGood) {
  QTX_ASSERT_OK_AND_ASSIGN(std::unique_ptr<qtx::cuda::Plan> plan,
                           qtx::cuda::Plan::Open(*client_, Op()));
  cudaGraphExec_t exec = nullptr;
  Capture(plan.get(), &exec);
  Replay(exec, 0);
  ASSERT_TRUE(StreamDrains(stream_, absl::Seconds(10))) << "the first replay did not finish";
  std::fprintf(stderr, "plan death: first replay done; killing qtxd\n");
  const absl::Time kill_time = absl::Now();
  ASSERT_EQ(::kill(server_->pid(), SIGKILL), 0);
  while (plan->status().ok() && absl::Now() - kill_time < absl::Seconds(5)) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  const double noticed_ms = absl::ToDoubleMilliseconds(absl::Now() - kill_time);
  std::fprintf(stderr, "plan death: status after %.1f ms: %s\n", noticed_ms,
               plan->status().ToString().c_str());
  EXPECT_THAT(plan->status(), StatusIs(absl::StatusCode::kUnavailable, ::testing::_));
  // Replays captured before still run to the end (their waits pass).
  for (int r = 0; r < 3; ++r) Replay(exec, r);
  const bool drained = StreamDrains(stream_, absl::Seconds(10));
  std::printf(
      "{\"test\":\"cuda_plan_qtxd_death\",\"status_after_kill_ms\":%.3f,"
      "\"replays_after_kill_drained\":%s}\n",
      noticed_ms, drained ? "true" : "false");
  std::fflush(stdout);
  ASSERT_TRUE(drained) << "replays after qtxd died did not finish within 10 s";
  CUDA_OK(cudaGraphExecDestroy(exec));
  plan.reset();
  client_.reset();
  server_.reset();
}

}  // namespace
}  // namespace qtx

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  qtx::g_qtxd_path = qtx::testing::QtxdFlagOrExit(argc, argv);
  return RUN_ALL_TESTS();
}
