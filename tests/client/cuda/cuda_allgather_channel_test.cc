// GPU end-to-end (label gpu): AllGather on a one-rank NCCL group of qtxd
// --device=cuda:0 (--qtxd=<path>), through a stream-ordered channel
// (qtx::cuda::OpenChannel) and through the synchronous call.
//  - Every output byte equals the CPU reference (kernels::cpu::QuantizeBlock
//    of the whole tensor, which a one-rank gather is), for shard row counts
//    that are and are not multiples of 128, 1-D and 2-D scaling, rowwise,
//    columnwise and both, EXACT_FP8 and GATHER_HIGH_PRECISION.
//  - The server only enqueues a channel AllGather (issue 12 item 4): with the
//    caller's stream held by a kernel that waits for a host flag, several
//    channel AllGathers are submitted, then a synchronous AllGather on the
//    same group, which its group thread runs only after it has handled every
//    one of them, must come back while the GPU is still held. Then the flag
//    is released and every byte is checked on the caller's stream.
// Nothing here can hold the GPU for good: the holding kernel gives up after
// 60 s on its own (and the test then fails), and the host releases it on
// every exit path.
#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/block_geometry.h"
#include "kernels/cpu/quantize_block.h"
#include "kernels/fp8.h"
#include "qtx/channel.h"
#include "qtx/client.h"
#include "qtx/cuda_channel.h"
#include "qtx/cuda_ipc.h"
#include "tests/client/cuda/channel_test_kernels.h"
#include "tests/client/cuda/cuda_test_support.h"
#include "tests/testing/qtxd_process.h"
#include "tests/testing/status_matchers.h"

namespace qtx {
namespace {

using ::qtx::testing::SoloNcclGroupTest;
using ::qtx::testing::StatusIs;
using ::testing::HasSubstr;

std::string g_qtxd_path;

struct Case {
  int64_t m = 0, n = 0;
  QuantizeConfig config;
  AllGatherMode mode = AllGatherMode::kExactFp8;
  bool one_round = false;  // pass shard_rows = {m}
  std::vector<int64_t> ShardRows() const {
    return one_round ? std::vector<int64_t>{m} : std::vector<int64_t>{};
  }
  std::string Name() const {
    return absl::StrFormat("m=%d n=%d %s row=%d col=%d %s%s", m, n,
                           ScalingModeName(config.scaling_mode), config.rowwise, config.columnwise,
                           mode == AllGatherMode::kExactFp8 ? "EXACT_FP8" : "GATHER_HP",
                           one_round ? " one-round" : "");
  }
};

kernels::QuantizeParams ParamsOf(const QuantizeConfig& c) {
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

// A case's input in the arena, its CPU reference (on the host and in the
// arena, for comparisons on the caller's stream) and its output slices.
struct Prepared {
  RegionSlice input;
  QuantizeOutputs outputs;
  std::string expected[4];  // empty where the copy is not requested
  RegionSlice expected_dev[4];
  const RegionSlice* out[4] = {};  // null where the copy is not requested
};

class CudaAllGatherChannelTest : public SoloNcclGroupTest {
 protected:
  void SetUp() override {
    // Debug logs: qtxd prints each AllGather's host time per step
    // (event=allgather_steps), which shows where a wait would be.
    ASSERT_NO_FATAL_FAILURE(
        StartSolo(g_qtxd_path, {"--device=cuda:0", "--allow_client_shm", "--log_level=debug"},
                  uint64_t{256} << 20, "agtest-arena"));
    CUDA_OK(cudaMalloc(reinterpret_cast<void**>(&mismatches_), sizeof(unsigned long long)));
    CUDA_OK(cudaMemset(mismatches_, 0, sizeof(unsigned long long)));
  }
  void TearDown() override {
    SyncStream();
    if (mismatches_ != nullptr) (void)cudaFree(mismatches_);
    SoloNcclGroupTest::TearDown();
  }

  // Uploads a random BF16 [m, n] input (row magnitudes spread over 2^-4..2^4,
  // so that the blocks straddling 128-row boundaries have unequal halves)
  // and its CPU reference; takes output slices.
  void Prepare(const Case& c, uint32_t seed, Prepared& out) {
    const kernels::QuantizeParams p = ParamsOf(c.config);
    const int64_t m = c.m, n = c.n;
    std::string input(static_cast<size_t>(m * n * 2), '\0');
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (int64_t i = 0; i < m * n; ++i) {
      const int64_t row = i / n;
      const float mag = std::ldexp(1.0f, static_cast<int>((row / 37) % 9) - 4);
      const uint16_t h = kernels::FloatToBf16(normal(rng) * mag * (i % 101 == 0 ? 40.0f : 1.0f));
      std::memcpy(input.data() + 2 * i, &h, 2);
    }
    const kernels::QuantizedLayout l = kernels::ComputeLayout(p.scaling, m, n);
    const uint64_t bytes[4] = {
        p.rowwise ? static_cast<uint64_t>(l.RowwiseDataBytes()) : 0,
        p.rowwise ? 4 * static_cast<uint64_t>(l.RowwiseScaleCount()) : 0,
        p.columnwise ? static_cast<uint64_t>(l.ColumnwiseDataBytes()) : 0,
        p.columnwise ? 4 * static_cast<uint64_t>(l.ColumnwiseScaleCount()) : 0};
    for (int k = 0; k < 4; ++k) out.expected[k].assign(bytes[k], '\0');
    kernels::QuantizedBuffers b;
    if (p.rowwise) {
      b.rowwise_data = reinterpret_cast<uint8_t*>(out.expected[0].data());
      b.rowwise_scale_inv = reinterpret_cast<float*>(out.expected[1].data());
    }
    if (p.columnwise) {
      b.columnwise_data = reinterpret_cast<uint8_t*>(out.expected[2].data());
      b.columnwise_scale_inv = reinterpret_cast<float*>(out.expected[3].data());
    }
    kernels::cpu::QuantizeBlock(input.data(), kernels::InputDType::kBFloat16, m, n, p, b);
    out.input = arena_.Take(input.size());
    CUDA_OK(cudaMemcpy(arena_.At(out.input), input.data(), input.size(), cudaMemcpyHostToDevice));
    std::optional<RegionSlice>* slots[4] = {
        &out.outputs.rowwise_data, &out.outputs.rowwise_scale_inv, &out.outputs.columnwise_data,
        &out.outputs.columnwise_scale_inv};
    for (int k = 0; k < 4; ++k) {
      if ((k < 2 && !p.rowwise) || (k >= 2 && !p.columnwise)) continue;
      *slots[k] = arena_.Take(bytes[k]);
      out.out[k] = &**slots[k];
      out.expected_dev[k] = arena_.Take(bytes[k]);
      CUDA_OK(cudaMemcpy(arena_.At(out.expected_dev[k]), out.expected[k].data(), bytes[k],
                         cudaMemcpyHostToDevice));
    }
  }

  // Compares every requested output with the reference (host copies).
  void ExpectOutputsExact(const Prepared& pr, const std::string& what) {
    static constexpr const char* kNames[4] = {"rowwise_data", "rowwise_scale_inv",
                                              "columnwise_data", "columnwise_scale_inv"};
    for (int k = 0; k < 4; ++k) {
      if (pr.out[k] == nullptr) continue;
      std::string got(pr.out[k]->size, '\0');
      CUDA_OK(cudaMemcpy(got.data(), arena_.At(*pr.out[k]), got.size(), cudaMemcpyDeviceToHost));
      size_t first = got.size();
      for (size_t i = 0; i < got.size(); ++i) {
        if (got[i] != pr.expected[k][i]) {
          first = i;
          break;
        }
      }
      EXPECT_EQ(first, got.size()) << what << ": " << kNames[k] << " differs from the CPU "
                                   << "reference first at byte " << first << " of " << got.size();
    }
  }

  void FillOutputs(const Prepared& pr, cudaStream_t stream) {
    for (const RegionSlice* s : pr.out) {
      if (s != nullptr) CUDA_OK(cudaMemsetAsync(arena_.At(*s), 0xCD, s->size, stream));
    }
  }

  void RunHeldAllGathers(const std::vector<Case>& kinds, const char* label);

  uint64_t Mismatches() {
    unsigned long long n = 0;
    EXPECT_EQ(cudaMemcpy(&n, mismatches_, sizeof(n), cudaMemcpyDeviceToHost), cudaSuccess);
    return n;
  }

  unsigned long long* mismatches_ = nullptr;
  uint64_t next_sequence_ = 0;  // the group's AllGather counter
};

std::vector<Case> Cases() {
  std::vector<Case> cases;
  for (int64_t m : {1000, 1024}) {
    for (ScalingMode s : {ScalingMode::kBlock1D, ScalingMode::kBlock2D, ScalingMode::kTensor}) {
      for (int usage = 1; usage <= 3; ++usage) {
        Case c;
        c.m = m;
        c.n = 320;
        c.config.scaling_mode = s;
        c.config.rowwise = usage & 1;
        c.config.columnwise = usage & 2;
        cases.push_back(c);
      }
    }
  }
  for (ScalingMode s : {ScalingMode::kBlock1D, ScalingMode::kBlock2D, ScalingMode::kTensor}) {
    Case c;
    c.m = 1000;
    c.n = 320;
    c.config.scaling_mode = s;
    c.config.columnwise = true;
    c.mode = AllGatherMode::kGatherHighPrecision;
    cases.push_back(c);
  }
  return cases;
}

TEST_F(CudaAllGatherChannelTest, ChannelAndSynchronousAllGatherEqualTheCpuReference) {
  QTX_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Channel> ch, qtx::cuda::OpenChannel(*client_, stream_));
  int checked = 0;
  uint32_t seed = 1;
  for (const Case& c : Cases()) {
    SCOPED_TRACE(c.Name());
    arena_.used = 0;  // the previous case has finished on every stream
    Prepared pr;
    ASSERT_NO_FATAL_FAILURE(Prepare(c, seed++, pr));
    const Tensor input = Tensor::InRegion(DType::kBFloat16, {c.m, c.n}, pr.input);

    // Through the channel: ordered on the caller's stream.
    ASSERT_NO_FATAL_FAILURE(FillOutputs(pr, stream_));
    QTX_ASSERT_OK(
        ch->AllGather(kSoloGroup, next_sequence_++, input, c.config, c.mode, pr.outputs).status());
    CUDA_OK(cudaStreamSynchronize(stream_));
    QTX_ASSERT_OK(ch->Synchronize());
    ExpectOutputsExact(pr, "channel");

    // The synchronous call: outputs complete when it returns.
    ASSERT_NO_FATAL_FAILURE(FillOutputs(pr, stream_));
    CUDA_OK(cudaStreamSynchronize(stream_));
    QTX_ASSERT_OK_AND_ASSIGN(
        AllGatherResult r,
        client_->AllGather(kSoloGroup, next_sequence_++, input, c.config, c.mode, pr.outputs));
    EXPECT_EQ(r.shard_rows, std::vector<int64_t>{c.m});
    ExpectOutputsExact(pr, "synchronous");

    // The one-round path (shard_rows given: one all-gather of slots, the
    // header and digest carried in it, assembly on the device).
    ASSERT_NO_FATAL_FAILURE(FillOutputs(pr, stream_));
    CUDA_OK(cudaStreamSynchronize(stream_));
    QTX_ASSERT_OK_AND_ASSIGN(r, client_->AllGather(kSoloGroup, next_sequence_++, input, c.config,
                                                   c.mode, pr.outputs, {}, {c.m}));
    EXPECT_EQ(r.shard_rows, std::vector<int64_t>{c.m});
    ExpectOutputsExact(pr, "one round");

    // The one-round path through the channel: the slot check on the device,
    // its verdict read on completion.
    ASSERT_NO_FATAL_FAILURE(FillOutputs(pr, stream_));
    QTX_ASSERT_OK(
        ch->AllGather(kSoloGroup, next_sequence_++, input, c.config, c.mode, pr.outputs, {c.m})
            .status());
    CUDA_OK(cudaStreamSynchronize(stream_));
    QTX_ASSERT_OK(ch->Synchronize());
    ExpectOutputsExact(pr, "channel one round");
    checked += 4;
  }
  QTX_ASSERT_OK(ch->Close());
  std::printf("{\"test\":\"cuda_allgather_1rank_exact\",\"calls_checked\":%d,\"failures\":%d}\n",
              checked, ::testing::Test::HasFailure() ? 1 : 0);
}

// Mapped page-locked flag the holding kernel polls; released (set) and freed
// on every exit path, after the stream has drained.
class HostFlag {
 public:
  HostFlag() {
    void* host = nullptr;
    if (cudaHostAlloc(&host, 4, cudaHostAllocMapped) != cudaSuccess) return;
    host_ = static_cast<volatile uint32_t*>(host);
    *host_ = 0;
    void* dev = nullptr;
    if (cudaHostGetDevicePointer(&dev, host, 0) == cudaSuccess) {
      dev_ = static_cast<const volatile uint32_t*>(dev);
    }
    void* t = nullptr;
    if (cudaMalloc(&t, 4) == cudaSuccess && cudaMemset(t, 0, 4) == cudaSuccess) {
      timed_out_ = static_cast<unsigned*>(t);
    }
  }
  ~HostFlag() {
    Release();
    if (stream_ != nullptr) (void)cudaStreamSynchronize(stream_);
    if (host_ != nullptr) (void)cudaFreeHost(const_cast<uint32_t*>(host_));
    if (timed_out_ != nullptr) (void)cudaFree(timed_out_);
  }
  bool ok() const { return host_ != nullptr && dev_ != nullptr && timed_out_ != nullptr; }
  cudaError_t Hold(cudaStream_t stream, absl::Duration limit) {
    stream_ = stream;
    return qtx::testing::LaunchWaitHostFlag(dev_, absl::ToInt64Nanoseconds(limit), timed_out_,
                                            stream);
  }
  void Release() {
    if (host_ != nullptr) *host_ = 1;
  }
  unsigned TimedOut() const {
    unsigned v = 0;
    if (cudaMemcpy(&v, timed_out_, 4, cudaMemcpyDeviceToHost) != cudaSuccess) return ~0u;
    return v;
  }

 private:
  volatile uint32_t* host_ = nullptr;
  const volatile uint32_t* dev_ = nullptr;
  unsigned* timed_out_ = nullptr;
  cudaStream_t stream_ = nullptr;
};

// Holds the caller's stream, submits two rounds of `kinds` through a channel,
// then the probe (see the file comment); releases, checks every byte.
void CudaAllGatherChannelTest::RunHeldAllGathers(const std::vector<Case>& kinds,
                                                 const char* label) {
  std::vector<Prepared> prepared(kinds.size());
  for (size_t i = 0; i < kinds.size(); ++i) {
    ASSERT_NO_FATAL_FAILURE(Prepare(kinds[i], 100 + static_cast<uint32_t>(i), prepared[i]));
  }
  QTX_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Channel> ch, qtx::cuda::OpenChannel(*client_, stream_));
  // Warm-up (first-use costs of the group and the channel), checked too.
  for (size_t i = 0; i < kinds.size(); ++i) {
    const Tensor input =
        Tensor::InRegion(DType::kBFloat16, {kinds[i].m, kinds[i].n}, prepared[i].input);
    QTX_ASSERT_OK(ch->AllGather(kSoloGroup, next_sequence_++, input, kinds[i].config, kinds[i].mode,
                                prepared[i].outputs, kinds[i].ShardRows())
                      .status());
  }
  CUDA_OK(cudaStreamSynchronize(stream_));
  QTX_ASSERT_OK(ch->Synchronize());

  HostFlag flag;
  ASSERT_TRUE(flag.ok());
  CUDA_OK(flag.Hold(stream_, absl::Seconds(60)));
  constexpr int kRounds = 2;
  uint64_t last_op = 0;
  for (int round = 0; round < kRounds; ++round) {
    for (size_t i = 0; i < kinds.size(); ++i) {
      const Prepared& pr = prepared[i];
      ASSERT_NO_FATAL_FAILURE(FillOutputs(pr, stream_));
      const Tensor input = Tensor::InRegion(DType::kBFloat16, {kinds[i].m, kinds[i].n}, pr.input);
      QTX_ASSERT_OK_AND_ASSIGN(last_op,
                               ch->AllGather(kSoloGroup, next_sequence_++, input, kinds[i].config,
                                             kinds[i].mode, pr.outputs, kinds[i].ShardRows()));
      for (int k = 0; k < 4; ++k) {
        if (pr.out[k] == nullptr) continue;
        CUDA_OK(qtx::testing::LaunchCountMismatches(arena_.At(*pr.out[k]),
                                                    arena_.At(pr.expected_dev[k]), pr.out[k]->size,
                                                    mismatches_, stream_));
      }
    }
  }
  // The probe: a synchronous AllGather on the same group that its group
  // thread rejects (no copy requested). The group runs calls in sequence
  // order on one thread, so its answer means that thread has handled every
  // channel AllGather above; had any of them waited for the GPU, it could
  // not come back before the flag is released.
  QuantizeConfig none;
  none.rowwise = false;
  none.columnwise = false;
  CallOptions probe_call;
  probe_call.timeout = absl::Seconds(10);
  const absl::Time start = absl::Now();
  const absl::StatusOr<AllGatherResult> probe = client_->AllGather(
      kSoloGroup, next_sequence_++,
      Tensor::InRegion(DType::kBFloat16, {kinds[0].m, kinds[0].n}, prepared[0].input), none,
      AllGatherMode::kExactFp8, {}, probe_call);
  const absl::Duration probe_time = absl::Now() - start;
  EXPECT_THAT(probe.status(), StatusIs(absl::StatusCode::kInvalidArgument,
                                       HasSubstr("at least one copy must be requested")));
  // Still held: the caller's stream has not passed the holding kernel, and
  // qtxd has completed none of the held operations.
  const cudaError_t held = cudaStreamQuery(stream_);
  EXPECT_EQ(held, cudaErrorNotReady) << cudaGetErrorString(held);
  QTX_ASSERT_OK_AND_ASSIGN(const bool done, ch->Query(last_op));
  EXPECT_FALSE(done);
  flag.Release();
  CUDA_OK(cudaStreamSynchronize(stream_));
  QTX_ASSERT_OK(ch->Synchronize());
  EXPECT_EQ(flag.TimedOut(), 0u) << "the holding kernel gave up: the flag came too late";
  EXPECT_EQ(Mismatches(), 0u);
  // And the outputs as the host sees them (the last round's).
  for (size_t i = 0; i < kinds.size(); ++i) ExpectOutputsExact(prepared[i], kinds[i].Name());
  QTX_ASSERT_OK(ch->Close());
  std::printf(
      "{\"test\":\"cuda_allgather_enqueue_only\",\"kinds\":\"%s\",\"held_allgathers\":%d,"
      "\"probe_ms\":%.3f,\"gpu_held_at_probe\":%s,\"mismatched_bytes\":%llu}\n",
      label, static_cast<int>(kRounds * kinds.size()), absl::ToDoubleMilliseconds(probe_time),
      held == cudaErrorNotReady ? "true" : "false", static_cast<unsigned long long>(Mismatches()));
}

// Exact kinds: 2-D row+col (amaxes exchanged on the device, per tile
// column), 1-D columnwise (the same, per column), 1-D rowwise (no amax),
// TENSOR row+col (the shard amaxes reduced on the device).
std::vector<Case> ExactKinds() {
  std::vector<Case> kinds(4);
  for (Case& c : kinds) {
    c.m = 1000;
    c.n = 512;
  }
  kinds[0].config.scaling_mode = ScalingMode::kBlock2D;
  kinds[0].config.columnwise = true;
  kinds[1].config.rowwise = false;
  kinds[1].config.columnwise = true;
  kinds[3].config.scaling_mode = ScalingMode::kTensor;
  kinds[3].config.columnwise = true;
  return kinds;
}

TEST_F(CudaAllGatherChannelTest, ExactChannelAllGathersOnlyEnqueueWhileTheCallersStreamIsHeld) {
  RunHeldAllGathers(ExactKinds(), "exact");
}

// ExactKinds and a GATHER_HIGH_PRECISION one.
std::vector<Case> MixedKinds() {
  std::vector<Case> kinds = ExactKinds();
  Case hp = kinds[0];
  hp.config.scaling_mode = ScalingMode::kBlock1D;
  hp.mode = AllGatherMode::kGatherHighPrecision;
  kinds.push_back(hp);
  return kinds;
}

TEST_F(CudaAllGatherChannelTest, MixedChannelAllGathersOnlyEnqueueWhileTheCallersStreamIsHeld) {
  RunHeldAllGathers(MixedKinds(), "exact+high_precision");
}

// The one-round path (shard_rows) through the channel: no header exchange,
// the slot check a kernel whose verdict the channel reads on completion, so
// nothing of it may wait for the held stream either. Exact kinds (m = 1000:
// straddling block rows quantized on the device) and a high-precision one.
TEST_F(CudaAllGatherChannelTest, OneRoundChannelAllGathersOnlyEnqueueWhileTheCallersStreamIsHeld) {
  std::vector<Case> kinds = MixedKinds();
  for (Case& c : kinds) c.one_round = true;
  RunHeldAllGathers(kinds, "one_round");
}

// A one-round channel AllGather whose own shard_rows entry contradicts its
// input fails at once (no output reported, the channel failed), and a
// channel opened after it runs the next one-round call exactly.
TEST_F(CudaAllGatherChannelTest, OneRoundChannelRejectsABadListAndRecovers) {
  Case c;
  c.m = 1000;
  c.n = 512;
  c.config.columnwise = true;
  c.one_round = true;
  Prepared pr;
  ASSERT_NO_FATAL_FAILURE(Prepare(c, 42, pr));
  const Tensor input = Tensor::InRegion(DType::kBFloat16, {c.m, c.n}, pr.input);
  {
    QTX_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Channel> ch,
                             qtx::cuda::OpenChannel(*client_, stream_));
    QTX_ASSERT_OK_AND_ASSIGN(const uint64_t op,
                             ch->AllGather(kSoloGroup, next_sequence_++, input, c.config, c.mode,
                                           pr.outputs, {c.m + 1}));
    CUDA_OK(cudaStreamSynchronize(stream_));
    EXPECT_THAT(ch->Synchronize(),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr("shard_rows[0]=1001 but this rank's input has 1000")));
    EXPECT_THAT(ch->Query(op),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("shard_rows[0]=1001")));
    EXPECT_EQ(ch->completed(), 0u);
  }
  QTX_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Channel> ch, qtx::cuda::OpenChannel(*client_, stream_));
  ASSERT_NO_FATAL_FAILURE(FillOutputs(pr, stream_));
  QTX_ASSERT_OK(
      ch->AllGather(kSoloGroup, next_sequence_++, input, c.config, c.mode, pr.outputs, {c.m})
          .status());
  CUDA_OK(cudaStreamSynchronize(stream_));
  QTX_ASSERT_OK(ch->Synchronize());
  ExpectOutputsExact(pr, "after a rejected list");
  QTX_ASSERT_OK(ch->Close());
}

}  // namespace
}  // namespace qtx

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  qtx::g_qtxd_path = qtx::testing::QtxdFlagOrExit(argc, argv);
  return RUN_ALL_TESTS();
}
