// GPU end-to-end (label gpu): qtx::cuda::OpenChannel against qtxd
// --device=cuda:0 on the same GPU (--qtxd=<path>). The caller's stream
// produces the input behind a spin, the channel quantizes it, and a consumer
// kernel right behind the channel's wait compares every output byte with the
// CPU reference (kernels::cpu::QuantizeBlock), many times: outputs must be
// visible when the wait is released, and the input must be read only after
// the producer. Also: a failed op releases the caller's wait within 100 ms;
// qtxd dying releases the waits and later calls fail with UNAVAILABLE.
// Run with and without MPS (scripts/gpu_channel.sh).
#include "qtx/cuda_channel.h"

#include <cuda_runtime_api.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
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
#include "qtx/cuda_columnwise.h"
#include "qtx/cuda_ipc.h"
#include "tests/client/cuda/channel_test_kernels.h"
#include "tests/client/cuda/cuda_test_support.h"
#include "tests/testing/qtxd_process.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/subprocess.h"

namespace qtx {
namespace {

using ::qtx::testing::DeviceArena;
using ::qtx::testing::QtxdProcess;
using ::qtx::testing::StatusIs;
using ::qtx::testing::Subprocess;
using ::testing::HasSubstr;

std::string g_qtxd_path;
std::string g_self_path;  // this executable, for the child mode below

int Iterations() {
  const char* s = std::getenv("QTX_CHANNEL_TEST_ITERS");
  return s != nullptr ? std::atoi(s) : 500;
}

class CudaChannelTest : public ::testing::Test {
 protected:
  void SetUp() override {
    QTX_ASSERT_OK_AND_ASSIGN(
        server_, QtxdProcess::Start(g_qtxd_path, {"--device=cuda:0", "--allow_client_shm"}));
    QTX_ASSERT_OK_AND_ASSIGN(client_, Client::Connect(server_->target()));
    CUDA_OK(cudaSetDevice(0));
    CUDA_OK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    arena_.size = uint64_t{256} << 20;
    arena_.name = "chtest-arena";
    CUDA_OK(cudaMalloc(&arena_.base, arena_.size));
    QTX_ASSERT_OK(
        qtx::cuda::RegisterDevicePointer(*client_, arena_.name, arena_.base, arena_.size));
    CUDA_OK(cudaMalloc(reinterpret_cast<void**>(&mismatches_), sizeof(unsigned long long)));
    CUDA_OK(cudaMemset(mismatches_, 0, sizeof(unsigned long long)));
  }
  void TearDown() override {
    if (stream_ != nullptr) (void)cudaStreamSynchronize(stream_);
    if (client_ != nullptr && server_ != nullptr) (void)client_->UnregisterRegion(arena_.name);
    if (arena_.base != nullptr) (void)cudaFree(arena_.base);
    if (mismatches_ != nullptr) (void)cudaFree(mismatches_);
    if (stream_ != nullptr) (void)cudaStreamDestroy(stream_);
  }

  uint64_t Mismatches() {
    unsigned long long n = 0;
    EXPECT_EQ(cudaMemcpy(&n, mismatches_, sizeof(n), cudaMemcpyDeviceToHost), cudaSuccess);
    return n;
  }

  std::unique_ptr<QtxdProcess> server_;
  std::unique_ptr<Client> client_;
  cudaStream_t stream_ = nullptr;
  DeviceArena arena_;
  unsigned long long* mismatches_ = nullptr;
};

TEST_F(CudaChannelTest, ConsumerSeesEveryOutputByteRightAfterTheWait) {
  const int64_t m = 1000, n = 1024;  // M not a multiple of 128
  constexpr int kVariants = 4;
  QuantizeConfig config;
  config.columnwise = true;
  kernels::QuantizeParams p;
  p.rowwise = p.columnwise = true;
  const kernels::QuantizedLayout layout = kernels::ComputeLayout(p.scaling, m, n);
  const uint64_t in_bytes = m * n * 2;
  const uint64_t out_bytes[4] = {static_cast<uint64_t>(layout.RowwiseDataBytes()),
                                 static_cast<uint64_t>(layout.RowwiseScaleCount() * 4),
                                 static_cast<uint64_t>(layout.ColumnwiseDataBytes()),
                                 static_cast<uint64_t>(layout.ColumnwiseScaleCount() * 4)};

  // Sources and expected outputs of each variant, in the arena.
  std::vector<RegionSlice> sources, expected[4];
  std::mt19937_64 rng(42);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int v = 0; v < kVariants; ++v) {
    std::string input(in_bytes, '\0');
    for (int64_t i = 0; i < m * n; ++i) {
      const uint16_t h = kernels::FloatToBf16(normal(rng) * (i % 11 == v ? 50.0f : 1.0f));
      std::memcpy(input.data() + 2 * i, &h, 2);
    }
    std::string outs[4];
    for (int k = 0; k < 4; ++k) outs[k].assign(out_bytes[k], '\0');
    kernels::QuantizedBuffers b;
    b.rowwise_data = reinterpret_cast<uint8_t*>(outs[0].data());
    b.rowwise_scale_inv = reinterpret_cast<float*>(outs[1].data());
    b.columnwise_data = reinterpret_cast<uint8_t*>(outs[2].data());
    b.columnwise_scale_inv = reinterpret_cast<float*>(outs[3].data());
    kernels::cpu::QuantizeBlock(input.data(), kernels::InputDType::kBFloat16, m, n, p, b);
    sources.push_back(arena_.Take(in_bytes));
    CUDA_OK(cudaMemcpy(arena_.At(sources.back()), input.data(), in_bytes, cudaMemcpyHostToDevice));
    for (int k = 0; k < 4; ++k) {
      expected[k].push_back(arena_.Take(out_bytes[k]));
      CUDA_OK(cudaMemcpy(arena_.At(expected[k].back()), outs[k].data(), out_bytes[k],
                         cudaMemcpyHostToDevice));
    }
  }
  // One input and one set of outputs, reused by every iteration.
  const RegionSlice input = arena_.Take(in_bytes);
  QuantizeOutputs outputs;
  outputs.rowwise_data = arena_.Take(out_bytes[0]);
  outputs.rowwise_scale_inv = arena_.Take(out_bytes[1]);
  outputs.columnwise_data = arena_.Take(out_bytes[2]);
  outputs.columnwise_scale_inv = arena_.Take(out_bytes[3]);
  const RegionSlice* out_slices[4] = {&*outputs.rowwise_data, &*outputs.rowwise_scale_inv,
                                      &*outputs.columnwise_data, &*outputs.columnwise_scale_inv};

  QTX_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Channel> ch, qtx::cuda::OpenChannel(*client_, stream_));
  const int iters = Iterations();
  for (int it = 0; it < iters; ++it) {
    const int v = it % kVariants;
    // Poison the outputs, then produce the input late (after a spin).
    for (const RegionSlice* s : out_slices) {
      CUDA_OK(cudaMemsetAsync(arena_.At(*s), 0xCD, s->size, stream_));
    }
    CUDA_OK(qtx::testing::LaunchDelayedCopy(arena_.At(input), arena_.At(sources[v]), in_bytes,
                                            (it % 3) * 20000, stream_));
    QTX_ASSERT_OK(
        ch->Quantize(Tensor::InRegion(DType::kBFloat16, {m, n}, input), config, outputs).status());
    for (int k = 0; k < 4; ++k) {
      CUDA_OK(qtx::testing::LaunchCountMismatches(arena_.At(*out_slices[k]),
                                                  arena_.At(expected[k][v]), out_bytes[k],
                                                  mismatches_, stream_));
    }
  }
  CUDA_OK(cudaStreamSynchronize(stream_));
  QTX_ASSERT_OK(ch->Synchronize());
  EXPECT_EQ(ch->submitted(), static_cast<uint64_t>(iters));
  EXPECT_EQ(Mismatches(), 0u) << "bytes differing from the CPU reference right after the wait, "
                              << iters << " iterations";
  QTX_ASSERT_OK(ch->Close());
  std::printf("{\"test\":\"cuda_channel_consumer\",\"iterations\":%d,\"mismatched_bytes\":%llu}\n",
              iters, static_cast<unsigned long long>(Mismatches()));
}

// qtx::cuda::MakeColumnwiseCopy on the caller's GPU from qtxd's rowwise copy
// equals the columnwise copy qtxd's CUDA quantizer wrote, byte for byte, for
// 128x128 tiles and per-tensor scaling, on the vector and the checked path.
TEST_F(CudaChannelTest, ColumnwiseCopyMadeOnTheGpuEqualsQtxdsColumnwiseCopy) {
  std::mt19937_64 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (ScalingMode mode : {ScalingMode::kBlock2D, ScalingMode::kTensor}) {
    for (const auto& [m, n] : {std::pair<int64_t, int64_t>{1024, 2048}, {1000, 1030}}) {
      std::string input(m * n * 2, '\0');
      for (int64_t i = 0; i < m * n; ++i) {
        const uint16_t h = kernels::FloatToBf16(normal(rng) * ((i / n) % 128 == 3 ? 40.0f : 1.0f));
        std::memcpy(input.data() + 2 * i, &h, 2);
      }
      const RegionSlice in = arena_.Take(input.size());
      CUDA_OK(cudaMemcpy(arena_.At(in), input.data(), input.size(), cudaMemcpyHostToDevice));
      QuantizeConfig config;
      config.scaling_mode = mode;
      config.columnwise = true;
      QTX_ASSERT_OK_AND_ASSIGN(
          QuantizedTensor q,
          client_->Quantize(Tensor::InRegion(DType::kBFloat16, {m, n}, in), config));
      const std::string& row = q.rowwise_data->data;
      const std::string& row_scale = q.rowwise_scale_inv->data;
      const std::string& col = q.columnwise_data->data;
      const std::string& col_scale = q.columnwise_scale_inv->data;
      const RegionSlice d_row = arena_.Take(row.size()),
                        d_row_scale = arena_.Take(row_scale.size());
      const RegionSlice d_col = arena_.Take(col.size()),
                        d_col_scale = arena_.Take(col_scale.size());
      CUDA_OK(cudaMemcpy(arena_.At(d_row), row.data(), row.size(), cudaMemcpyHostToDevice));
      CUDA_OK(cudaMemcpy(arena_.At(d_row_scale), row_scale.data(), row_scale.size(),
                         cudaMemcpyHostToDevice));
      CUDA_OK(cudaMemset(arena_.At(d_col), 0xCD, col.size()));
      CUDA_OK(cudaMemset(arena_.At(d_col_scale), 0xCD, col_scale.size()));
      const int64_t shape[2] = {m, n};
      QTX_ASSERT_OK(qtx::cuda::MakeColumnwiseCopy(
          mode, shape, {arena_.At(d_row), static_cast<const float*>(arena_.At(d_row_scale))},
          {arena_.At(d_col), static_cast<float*>(arena_.At(d_col_scale))}, stream_));
      CUDA_OK(cudaStreamSynchronize(stream_));
      std::string got(col.size(), '\0'), got_scale(col_scale.size(), '\0');
      CUDA_OK(cudaMemcpy(got.data(), arena_.At(d_col), got.size(), cudaMemcpyDeviceToHost));
      CUDA_OK(cudaMemcpy(got_scale.data(), arena_.At(d_col_scale), got_scale.size(),
                         cudaMemcpyDeviceToHost));
      EXPECT_TRUE(got == col) << ScalingModeName(mode) << " " << m << "x" << n << " data";
      EXPECT_TRUE(got_scale == col_scale)
          << ScalingModeName(mode) << " " << m << "x" << n << " scale_inv";
    }
  }
  const int64_t shape[2] = {128, 128};
  EXPECT_THAT(qtx::cuda::MakeColumnwiseCopy(ScalingMode::kBlock1D, shape, {}, {}, stream_),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("quantize with columnwise")));
  EXPECT_THAT(qtx::cuda::MakeColumnwiseCopy(ScalingMode::kBlock2D, shape, {}, {}, stream_),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("null buffer")));
}

TEST_F(CudaChannelTest, AFailedOpReleasesTheWaitWithin100Ms) {
  QTX_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Channel> ch, qtx::cuda::OpenChannel(*client_, stream_));
  const RegionSlice bad{"no-such-region", 0, 1000 * 128 * 2};
  QuantizeOutputs outputs;
  outputs.rowwise_data = arena_.Take(1000 * 128);
  outputs.rowwise_scale_inv = arena_.Take(1000 * 4);
  const absl::Time start = absl::Now();
  QTX_ASSERT_OK(
      ch->Quantize(Tensor::InRegion(DType::kBFloat16, {1000, 128}, bad), {}, outputs).status());
  CUDA_OK(cudaStreamSynchronize(stream_));  // the wait on done must be released
  const absl::Duration released = absl::Now() - start;
  EXPECT_LT(released, absl::Milliseconds(100));
  EXPECT_THAT(
      ch->Synchronize(),
      StatusIs(absl::StatusCode::kNotFound,
               HasSubstr("channel operation 1 failed: input.region: region 'no-such-region'")));
  std::printf("{\"test\":\"cuda_channel_failure_release\",\"release_ms\":%.3f}\n",
              absl::ToDoubleMilliseconds(released));
}

TEST_F(CudaChannelTest, QtxdDyingReleasesTheWaits) {
  QTX_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Channel> ch, qtx::cuda::OpenChannel(*client_, stream_));
  QuantizeOutputs outputs;
  outputs.rowwise_data = arena_.Take(256 * 128);
  outputs.rowwise_scale_inv = arena_.Take(256 * 4);
  const RegionSlice input = arena_.Take(256 * 128 * 2);
  // The caller's stream is busy for 400 ms before it reaches "ready".
  CUDA_OK(qtx::testing::LaunchSpin(400'000'000, stream_));
  QTX_ASSERT_OK(
      ch->Quantize(Tensor::InRegion(DType::kBFloat16, {256, 128}, input), {}, outputs).status());
  absl::SleepFor(absl::Milliseconds(50));
  const absl::Time kill_time = absl::Now();
  ASSERT_EQ(::kill(server_->pid(), SIGKILL), 0);
  // The stream must drain (spin end + released wait), never hang.
  cudaError_t q = cudaErrorNotReady;
  while ((q = cudaStreamQuery(stream_)) == cudaErrorNotReady &&
         absl::Now() - kill_time < absl::Seconds(10)) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  EXPECT_EQ(q, cudaSuccess) << "the caller's stream still waits 10 s after qtxd died";
  const absl::Duration drained = absl::Now() - kill_time;
  EXPECT_LT(drained, absl::Seconds(1));
  EXPECT_THAT(ch->Quantize(Tensor::InRegion(DType::kBFloat16, {256, 128}, input), {}, outputs),
              StatusIs(absl::StatusCode::kUnavailable, ::testing::_));
  EXPECT_THAT(ch->Synchronize(), StatusIs(absl::StatusCode::kUnavailable, ::testing::_));
  std::printf("{\"test\":\"cuda_channel_qtxd_death\",\"drained_after_kill_ms\":%.3f}\n",
              absl::ToDoubleMilliseconds(drained));
  ch.reset();
  client_.reset();
  server_.reset();
}

// A one-rank NCCL group on this GPU: AllGather through the channel, ordered
// between a late producer and a consumer on the caller's stream, equals the
// quantization of the shard (the whole tensor), byte for byte, every time.
TEST_F(CudaChannelTest, AllGatherOnAOneRankNcclGroupIsOrderedAndExact) {
  CollectiveGroupConfig group;
  group.name = "solo";
  group.rank = 0;
  group.world_size = 1;
  group.backend = CommBackend::kNccl;
  group.timeout = absl::Seconds(60);
  QTX_ASSERT_OK(client_->CreateGroup(group).status());
  const int64_t m = 1000, n = 512;
  QuantizeConfig config;
  config.columnwise = true;
  kernels::QuantizeParams p;
  p.rowwise = p.columnwise = true;
  const kernels::QuantizedLayout layout = kernels::ComputeLayout(p.scaling, m, n);
  const uint64_t in_bytes = m * n * 2;
  const uint64_t out_bytes[4] = {static_cast<uint64_t>(layout.RowwiseDataBytes()),
                                 static_cast<uint64_t>(layout.RowwiseScaleCount() * 4),
                                 static_cast<uint64_t>(layout.ColumnwiseDataBytes()),
                                 static_cast<uint64_t>(layout.ColumnwiseScaleCount() * 4)};
  std::string input(in_bytes, '\0');
  std::mt19937_64 rng(9);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int64_t i = 0; i < m * n; ++i) {
    const uint16_t h = kernels::FloatToBf16(normal(rng) * (i % 13 == 0 ? 30.0f : 1.0f));
    std::memcpy(input.data() + 2 * i, &h, 2);
  }
  std::string outs[4];
  for (int k = 0; k < 4; ++k) outs[k].assign(out_bytes[k], '\0');
  kernels::QuantizedBuffers b;
  b.rowwise_data = reinterpret_cast<uint8_t*>(outs[0].data());
  b.rowwise_scale_inv = reinterpret_cast<float*>(outs[1].data());
  b.columnwise_data = reinterpret_cast<uint8_t*>(outs[2].data());
  b.columnwise_scale_inv = reinterpret_cast<float*>(outs[3].data());
  kernels::cpu::QuantizeBlock(input.data(), kernels::InputDType::kBFloat16, m, n, p, b);
  const RegionSlice source = arena_.Take(in_bytes), shard = arena_.Take(in_bytes);
  CUDA_OK(cudaMemcpy(arena_.At(source), input.data(), in_bytes, cudaMemcpyHostToDevice));
  RegionSlice expected[4];
  for (int k = 0; k < 4; ++k) {
    expected[k] = arena_.Take(out_bytes[k]);
    CUDA_OK(
        cudaMemcpy(arena_.At(expected[k]), outs[k].data(), out_bytes[k], cudaMemcpyHostToDevice));
  }
  QuantizeOutputs outputs;
  outputs.rowwise_data = arena_.Take(out_bytes[0]);
  outputs.rowwise_scale_inv = arena_.Take(out_bytes[1]);
  outputs.columnwise_data = arena_.Take(out_bytes[2]);
  outputs.columnwise_scale_inv = arena_.Take(out_bytes[3]);
  const RegionSlice* out_slices[4] = {&*outputs.rowwise_data, &*outputs.rowwise_scale_inv,
                                      &*outputs.columnwise_data, &*outputs.columnwise_scale_inv};
  QTX_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Channel> ch, qtx::cuda::OpenChannel(*client_, stream_));
  const int iters = 20;
  for (int it = 0; it < iters; ++it) {
    for (const RegionSlice* s : out_slices) {
      CUDA_OK(cudaMemsetAsync(arena_.At(*s), 0xCD, s->size, stream_));
    }
    CUDA_OK(cudaMemsetAsync(arena_.At(shard), 0, in_bytes, stream_));
    CUDA_OK(qtx::testing::LaunchDelayedCopy(arena_.At(shard), arena_.At(source), in_bytes,
                                            20'000'000, stream_));  // 20 ms late
    QTX_ASSERT_OK(ch->AllGather("solo", it, Tensor::InRegion(DType::kBFloat16, {m, n}, shard),
                                config, AllGatherMode::kExactFp8, outputs)
                      .status());
    for (int k = 0; k < 4; ++k) {
      CUDA_OK(qtx::testing::LaunchCountMismatches(arena_.At(*out_slices[k]), arena_.At(expected[k]),
                                                  out_bytes[k], mismatches_, stream_));
    }
  }
  CUDA_OK(cudaStreamSynchronize(stream_));
  QTX_ASSERT_OK(ch->Synchronize());
  EXPECT_EQ(Mismatches(), 0u);
  QTX_ASSERT_OK(ch->Close());
  QTX_ASSERT_OK(client_->DestroyGroup("solo"));
  std::printf(
      "{\"test\":\"cuda_channel_allgather_1rank\",\"iterations\":%d,"
      "\"mismatched_bytes\":%llu}\n",
      iters, static_cast<unsigned long long>(Mismatches()));
}

// The client dies (SIGKILL) while qtxd's channel stream is parked on the
// client's ready word: qtxd lets the parked work through, keeps serving, and
// a new channel works. The child is this executable in --park_child mode.
TEST_F(CudaChannelTest, AClientKilledWithParkedWorkLeavesQtxdServing) {
  Subprocess::Options pipe;
  pipe.pipe_stdout = true;
  QTX_ASSERT_OK_AND_ASSIGN(
      const std::unique_ptr<Subprocess> child,
      Subprocess::Start({g_self_path, "--park_child=" + server_->target()}, pipe));
  char buf[64] = {};
  const ssize_t n = ::read(child->stdout_fd(), buf, sizeof(buf) - 1);  // "parked\n" once submitted
  ASSERT_GT(n, 0);
  EXPECT_TRUE(absl::StartsWith(buf, "parked")) << buf;
  std::fprintf(stderr, "test: child parked, killing it\n");
  child->Kill();
  std::fprintf(stderr, "test: child reaped\n");
  // qtxd still serves, and channels work.
  QTX_ASSERT_OK_AND_ASSIGN(ServingStatus health, client_->Health());
  EXPECT_EQ(health, ServingStatus::kServing);
  std::fprintf(stderr, "test: qtxd healthy\n");
  QTX_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Channel> ch, qtx::cuda::OpenChannel(*client_, stream_));
  std::fprintf(stderr, "test: new channel open\n");
  QuantizeOutputs outputs;
  outputs.rowwise_data = arena_.Take(256 * 128);
  outputs.rowwise_scale_inv = arena_.Take(256 * 4);
  const RegionSlice input = arena_.Take(256 * 128 * 2);
  QTX_ASSERT_OK(
      ch->Quantize(Tensor::InRegion(DType::kBFloat16, {256, 128}, input), {}, outputs).status());
  QTX_ASSERT_OK(ch->Synchronize());
  std::fprintf(stderr, "test: new channel op done\n");
  QTX_ASSERT_OK(ch->Close());
  std::fprintf(stderr, "test: new channel closed\n");
  QTX_ASSERT_OK_AND_ASSIGN(health, client_->Health());
  EXPECT_EQ(health, ServingStatus::kServing);
}

TEST_F(CudaChannelTest, RegionCacheRegistersEachAllocationOnceAndNoticesReplacement) {
  const int64_t m = 4, n = 128;
  std::string input(m * n * 2, '\0');
  std::mt19937_64 rng(3);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int64_t i = 0; i < m * n; ++i) {
    const uint16_t h = kernels::FloatToBf16(normal(rng));
    std::memcpy(input.data() + 2 * i, &h, 2);
  }
  kernels::QuantizeParams p;
  const kernels::QuantizedLayout layout = kernels::ComputeLayout(p.scaling, m, n);
  std::string expected(layout.RowwiseDataBytes(), '\0'),
      scales(layout.RowwiseScaleCount() * 4, '\0');
  kernels::QuantizedBuffers b;
  b.rowwise_data = reinterpret_cast<uint8_t*>(expected.data());
  b.rowwise_scale_inv = reinterpret_cast<float*>(scales.data());
  kernels::cpu::QuantizeBlock(input.data(), kernels::InputDType::kBFloat16, m, n, p, b);

  qtx::cuda::RegionCache cache(*client_, "rc");
  char* a = nullptr;
  CUDA_OK(cudaMalloc(reinterpret_cast<void**>(&a), 1 << 20));
  CUDA_OK(cudaMemcpy(a + 4096, input.data(), input.size(), cudaMemcpyHostToDevice));
  QTX_ASSERT_OK_AND_ASSIGN(RegionSlice s1, cache.Slice(a + 4096, input.size()));
  EXPECT_EQ(s1.offset, 4096u);
  QTX_ASSERT_OK_AND_ASSIGN(RegionSlice s2, cache.Slice(a, 64));
  EXPECT_EQ(s2.region, s1.region);
  EXPECT_EQ(s2.offset, 0u);
  EXPECT_EQ(cache.registrations(), 1u);
  EXPECT_EQ(cache.fast_hits(), 1u);  // the second lookup: one driver call
  // The slice reaches the right bytes (the GPU by UUID on registration).
  QTX_ASSERT_OK_AND_ASSIGN(QuantizedTensor q,
                           client_->Quantize(Tensor::InRegion(DType::kBFloat16, {m, n}, s1), {}));
  EXPECT_TRUE(q.rowwise_data->data == expected) << "quantize through a cached slice differs";
  EXPECT_THAT(cache.Slice(a + (1 << 20) - 8, 64),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("leaves its allocation")));
  // Freed and replaced: a new registration, never the stale one.
  CUDA_OK(cudaFree(a));
  char* b2 = nullptr;
  CUDA_OK(cudaMalloc(reinterpret_cast<void**>(&b2), 1 << 20));
  const uint64_t hits = cache.fast_hits();
  QTX_ASSERT_OK_AND_ASSIGN(RegionSlice s3, cache.Slice(b2 + 4096, input.size()));
  EXPECT_EQ(cache.registrations(), 2u);
  EXPECT_EQ(cache.fast_hits(), hits);  // a new buffer id: the full path, never a stale hit
  EXPECT_NE(s3.region, s1.region);
  std::printf("{\"test\":\"region_cache\",\"address_reused\":%s,\"registrations\":%llu}\n",
              b2 == a ? "true" : "false", static_cast<unsigned long long>(cache.registrations()));
  // The new allocation's bytes are what qtxd reads.
  CUDA_OK(cudaMemcpy(b2 + 4096, input.data(), input.size(), cudaMemcpyHostToDevice));
  QTX_ASSERT_OK_AND_ASSIGN(q,
                           client_->Quantize(Tensor::InRegion(DType::kBFloat16, {m, n}, s3), {}));
  EXPECT_TRUE(q.rowwise_data->data == expected) << "quantize after replacement differs";
  // With the fast path off every lookup takes the full path (same answer).
  cache.set_fast_path(false);
  QTX_ASSERT_OK_AND_ASSIGN(RegionSlice s4, cache.Slice(b2 + 4096, input.size()));
  EXPECT_EQ(s4.region, s3.region);
  EXPECT_EQ(s4.offset, s3.offset);
  EXPECT_EQ(cache.fast_hits(), hits);
  cache.set_fast_path(true);
  QTX_ASSERT_OK_AND_ASSIGN(s4, cache.Slice(b2 + 4096, input.size()));
  EXPECT_EQ(cache.fast_hits(), hits + 1);
  // Memory CUDA IPC cannot export: an error naming the allocator setting.
  void* pooled = nullptr;
  CUDA_OK(cudaMallocAsync(&pooled, 1 << 20, stream_));
  CUDA_OK(cudaStreamSynchronize(stream_));
  EXPECT_THAT(cache.Slice(pooled, 64),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("expandable_segments")));
  CUDA_OK(cudaFreeAsync(pooled, stream_));
  CUDA_OK(cudaStreamSynchronize(stream_));
  CUDA_OK(cudaFree(b2));
}

// --park_child=<target>: open a channel, park an op behind a 30 s spin on
// the stream, say "parked", and wait to be killed.
int ParkChild(const std::string& target) {
  auto client = Client::Connect(target);
  if (!client.ok()) return 1;
  cudaStream_t stream;
  if (cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) != cudaSuccess) return 1;
  void* buf = nullptr;
  if (cudaMalloc(&buf, 1 << 20) != cudaSuccess) return 1;
  if (!qtx::cuda::RegisterDevicePointer(**client, "park-buf", buf, 1 << 20).ok()) return 1;
  auto ch = qtx::cuda::OpenChannel(**client, stream);
  if (!ch.ok()) return 1;
  if (qtx::testing::LaunchSpin(30'000'000'000ull, stream) != cudaSuccess) return 1;
  QuantizeOutputs outputs;
  outputs.rowwise_data = RegionSlice{"park-buf", 262144, 256 * 128};
  outputs.rowwise_scale_inv = RegionSlice{"park-buf", 524288, 256 * 4};
  auto op = (*ch)->Quantize(
      Tensor::InRegion(DType::kBFloat16, {256, 128}, RegionSlice{"park-buf", 0, 256 * 128 * 2}), {},
      outputs);
  if (!op.ok()) return 1;
  std::printf("parked\n");
  std::fflush(stdout);
  absl::SleepFor(absl::Seconds(60));
  return 0;
}

}  // namespace
}  // namespace qtx

int main(int argc, char** argv) {
  qtx::g_self_path = argv[0];
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (absl::StartsWith(arg, "--park_child=")) return qtx::ParkChild(arg.substr(13));
  }
  ::testing::InitGoogleTest(&argc, argv);
  qtx::g_qtxd_path = qtx::testing::QtxdFlagOrExit(argc, argv);
  return RUN_ALL_TESTS();
}
