// The GPU path of a data-parallel sharded Optimizer.Step end to end (label
// gpu): two qtxd --device=cuda:0 processes, each owning slices of the same
// parameters at offsets that cut 128x128 tiles, form a Gloo Collective group
// and step their slices collectively; this test is the training process of
// both data-parallel ranks. Each rank's gradient slices and its FP8 shard
// (+ BF16 slice) destinations live in device memory, registered by CUDA IPC,
// so the sidecars take the pipelined device path (gradients to the host, the
// host step, the outputs back). Every byte they write must equal the CPU
// reference of the whole parameters (kernels::cpu::AdamWReference = the
// scalar AdamW then QuantizeBlock) at the rank's range: the FP8 bytes of its
// elements, the whole scale_inv tensors, its BF16 elements. Over two steps
// (the second with a clip factor) and a retried step.
//
// The qtxd binary: $QTXD if set, else the one this build made.
#include <cuda_runtime_api.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_format.h"
#include "kernels/adamw.h"
#include "kernels/block_geometry.h"
#include "kernels/cpu/adamw.h"
#include "qtx/client.h"
#include "qtx/cuda_ipc.h"
#include "tests/testing/qtxd_process.h"
#include "tests/testing/status_matchers.h"

namespace qtx {
namespace {

#define CUDA_ASSERT(expr) \
  ASSERT_EQ((expr), cudaSuccess) << #expr << ": " << cudaGetErrorString(cudaGetLastError())

using ::qtx::testing::QtxdPath;
using ::qtx::testing::QtxdProcess;

constexpr int kWorld = 2;
constexpr absl::Duration kGroupTimeout = absl::Seconds(30);

uint64_t Align(uint64_t x) { return (x + 255) / 256 * 256; }

struct Param {
  std::string name;
  int64_t m, n;
  std::vector<int64_t> cuts;  // rank r owns [cuts[r], cuts[r + 1])
  // The reference state of the whole parameter (host).
  std::vector<float> master, exp_avg, exp_avg_sq;
  kernels::QuantizedLayout layout;
  int64_t total() const { return m * n; }
};

// One rank's device buffers: gradient slices, then per parameter its FP8
// shard data, the two scale_inv tensors and its BF16 slice, 256-aligned.
struct RankBuffers {
  void* grads = nullptr;
  void* outs = nullptr;
  uint64_t grads_bytes = 0, outs_bytes = 0;
  std::vector<uint64_t> grad_offset;
  std::vector<std::array<uint64_t, 4>> out_offset, out_size;
};

class OptimizerShardCudaE2ETest : public ::testing::Test {
 protected:
  void SetUp() override {
    int count = 0;
    ASSERT_EQ(cudaGetDeviceCount(&count), cudaSuccess) << "gpu-labelled test: needs a GPU";
    ASSERT_GT(count, 0) << "gpu-labelled test: needs a visible CUDA device";
    CUDA_ASSERT(cudaSetDevice(0));
    for (int r = 0; r < kWorld; ++r) {
      auto server = QtxdProcess::Start(QtxdPath(), {"--device=cuda:0"}, absl::Seconds(60));
      ASSERT_TRUE(server.ok()) << "qtxd (" << QtxdPath() << "): " << server.status();
      auto client = Client::Connect((*server)->target());
      ASSERT_TRUE(client.ok()) << client.status();
      servers_.push_back(*std::move(server));
      clients_.push_back(*std::move(client));
    }
    std::vector<absl::Status> st(kWorld);
    OnEveryRank([&](int r) {
      CollectiveGroupConfig config;
      config.name = "dp";
      config.rank = r;
      config.world_size = kWorld;
      config.coordinator = r == 0 ? "" : servers_[0]->target();
      config.backend = CommBackend::kGloo;  // two ranks on one GPU: NCCL would refuse
      config.timeout = kGroupTimeout;
      CallOptions call;
      call.timeout = kGroupTimeout + absl::Seconds(10);
      st[r] = clients_[r]->CreateGroup(config, call).status();
    });
    for (int r = 0; r < kWorld; ++r) ASSERT_TRUE(st[r].ok()) << "rank " << r << ": " << st[r];
  }
  void TearDown() override {
    clients_.clear();
    servers_.clear();
    for (RankBuffers& b : ranks_) {
      if (b.grads != nullptr) cudaFree(b.grads);
      if (b.outs != nullptr) cudaFree(b.outs);
    }
  }

  void OnEveryRank(const std::function<void(int)>& fn) {
    std::vector<std::thread> threads;
    for (int r = 0; r < kWorld; ++r) threads.emplace_back(fn, r);
    for (std::thread& t : threads) t.join();
  }

  void MakeGroups() {
    const auto param = [](std::string name, int64_t m, int64_t n, std::vector<int64_t> cuts) {
      Param p;
      p.name = std::move(name);
      p.m = m;
      p.n = n;
      p.cuts = std::move(cuts);
      return p;
    };
    params_ = {
        param("w", 300, 260, {0, 128 * 260 + 77, 300 * 260}),  // cut mid-row, mid-tile
        param("b", 1, 200, {0, 77, 200}),                      // smaller than one tile each
        param("e", 130, 129, {0, 0, 130 * 129}),               // rank 0 owns nothing of it
    };
    std::mt19937 rng(11);
    std::normal_distribution<float> dist(0.0f, 0.05f);
    for (Param& p : params_) {
      p.master.resize(p.total());
      for (int64_t i = 0; i < p.total(); ++i) {
        p.master[i] = dist(rng) * std::ldexp(1.0f, static_cast<int>((i / 911) % 9) - 4);
      }
      p.exp_avg.assign(p.total(), 0.0f);
      p.exp_avg_sq.assign(p.total(), 0.0f);
      p.layout = kernels::ComputeLayout(kernels::BlockScaling::kBlock2D, p.m, p.n);
    }
    ranks_.resize(kWorld);
    for (int r = 0; r < kWorld; ++r) {
      RankBuffers& b = ranks_[r];
      for (const Param& p : params_) {
        const int64_t count = p.cuts[r + 1] - p.cuts[r];
        b.grad_offset.push_back(b.grads_bytes);
        b.grads_bytes += Align(count * 4 + 1);
        std::array<uint64_t, 4> size = {static_cast<uint64_t>(count),
                                        static_cast<uint64_t>(p.layout.RowwiseScaleCount() * 4),
                                        static_cast<uint64_t>(p.layout.ColumnwiseScaleCount() * 4),
                                        static_cast<uint64_t>(count * 2)};
        std::array<uint64_t, 4> off;
        for (int k = 0; k < 4; ++k) {
          off[k] = b.outs_bytes;
          b.outs_bytes += Align(size[k] + 1);
        }
        b.out_offset.push_back(off);
        b.out_size.push_back(size);
      }
      CUDA_ASSERT(cudaMalloc(&b.grads, b.grads_bytes));
      CUDA_ASSERT(cudaMalloc(&b.outs, b.outs_bytes));
      QTX_ASSERT_OK(cuda::RegisterDevicePointer(*clients_[r], "grads", b.grads, b.grads_bytes));
      QTX_ASSERT_OK(cuda::RegisterDevicePointer(*clients_[r], "params", b.outs, b.outs_bytes));
    }
    hyper_.lr = 1e-2;
    hyper_.weight_decay = 0.1;
    quant_.scaling = kernels::BlockScaling::kBlock2D;
    quant_.rowwise = true;
    quant_.columnwise = true;
    quant_.force_pow2_scales = true;
    for (int r = 0; r < kWorld; ++r) {
      OptimizerGroupConfig c;
      c.group = "opt";
      c.hyper_params.lr = hyper_.lr;
      c.hyper_params.weight_decay = hyper_.weight_decay;
      c.output.bf16_copy = true;
      std::vector<OptimizerParameterInit> inits;
      for (const Param& p : params_) {
        const int64_t b = p.cuts[r], e = p.cuts[r + 1];
        OptimizerParameterInit init;
        init.name = p.name;
        init.shape = {p.m, p.n};
        init.master =
            Tensor::FromFloat32({e - b}, std::span<const float>(p.master).subspan(b, e - b));
        init.shard = ShardRange{b, e};
        inits.push_back(std::move(init));
      }
      QTX_ASSERT_OK(clients_[r]->OffloadOptimizerState(c, inits).status());
    }
  }

  // Step t's whole gradients (seeded by t), FP32.
  std::vector<std::vector<float>> Gradients(int t) {
    std::vector<std::vector<float>> out;
    std::mt19937 rng(100 + t);
    std::normal_distribution<float> dist(0.0f, 1.0f);
    for (const Param& p : params_) {
      std::vector<float> g(p.total());
      for (int64_t i = 0; i < p.total(); ++i) g[i] = dist(rng) * (i % 97 == 0 ? 40.0f : 1.0f);
      out.push_back(std::move(g));
    }
    return out;
  }

  // Applies step t to the whole reference state; the expected outputs of the
  // whole parameters: [param][rowwise data, rowwise scale_inv bytes,
  // columnwise scale_inv bytes, bf16 bytes].
  std::vector<std::array<std::vector<uint8_t>, 4>> ReferenceStep(
      const std::vector<std::vector<float>>& grads, int64_t t, double clip) {
    std::vector<std::array<std::vector<uint8_t>, 4>> want(params_.size());
    std::vector<std::vector<uint8_t>> col(params_.size());
    std::vector<kernels::cpu::AdamWParamBuffers> bufs(params_.size());
    for (size_t i = 0; i < params_.size(); ++i) {
      Param& p = params_[i];
      want[i][0].resize(p.layout.RowwiseDataBytes());
      want[i][1].resize(p.layout.RowwiseScaleCount() * 4);
      want[i][2].resize(p.layout.ColumnwiseScaleCount() * 4);
      want[i][3].resize(p.total() * 2);
      col[i].resize(p.layout.ColumnwiseDataBytes());
      kernels::cpu::AdamWParamBuffers& b = bufs[i];
      b.m = p.m;
      b.n = p.n;
      b.master = p.master.data();
      b.exp_avg = p.exp_avg.data();
      b.exp_avg_sq = p.exp_avg_sq.data();
      b.grad = grads[i].data();
      b.quant = quant_;
      b.fp8.rowwise_data = want[i][0].data();
      b.fp8.rowwise_scale_inv = reinterpret_cast<float*>(want[i][1].data());
      b.fp8.columnwise_data = col[i].data();
      b.fp8.columnwise_scale_inv = reinterpret_cast<float*>(want[i][2].data());
      b.bf16 = reinterpret_cast<uint16_t*>(want[i][3].data());
    }
    kernels::cpu::AdamWReference(bufs, kernels::MakeAdamWScalars(hyper_, t, clip));
    return want;
  }

  // Uploads rank r's gradient slices and clears its outputs.
  void Upload(int r, const std::vector<std::vector<float>>& grads) {
    RankBuffers& b = ranks_[r];
    CUDA_ASSERT(cudaMemset(b.outs, 0xAB, b.outs_bytes));
    for (size_t i = 0; i < params_.size(); ++i) {
      const Param& p = params_[i];
      const int64_t lo = p.cuts[r], count = p.cuts[r + 1] - lo;
      CUDA_ASSERT(cudaMemcpy(static_cast<char*>(b.grads) + b.grad_offset[i], grads[i].data() + lo,
                             count * 4, cudaMemcpyHostToDevice));
    }
  }

  StepOptions Options(int r, uint64_t sequence, std::optional<double> clip) {
    StepOptions o;
    o.clip_factor = clip;
    o.collective_group = "dp";
    o.sequence = sequence;
    const RankBuffers& b = ranks_[r];
    for (size_t i = 0; i < params_.size(); ++i) {
      ParameterDestination d;
      d.name = params_[i].name;
      d.fp8.rowwise_scale_inv = RegionSlice{"params", b.out_offset[i][1], b.out_size[i][1]};
      d.fp8.columnwise_scale_inv = RegionSlice{"params", b.out_offset[i][2], b.out_size[i][2]};
      if (b.out_size[i][0] > 0) {  // an empty slice comes back inline (0 bytes)
        d.fp8.rowwise_data = RegionSlice{"params", b.out_offset[i][0], b.out_size[i][0]};
        d.bf16 = RegionSlice{"params", b.out_offset[i][3], b.out_size[i][3]};
      }
      o.destinations.push_back(std::move(d));
    }
    return o;
  }

  std::vector<OptimizerGradient> GradientRefs(int r) {
    std::vector<OptimizerGradient> out;
    for (size_t i = 0; i < params_.size(); ++i) {
      const int64_t count = params_[i].cuts[r + 1] - params_[i].cuts[r];
      if (count == 0) {  // nothing owned: an empty inline gradient
        out.push_back({params_[i].name, Tensor::FromFloat32({0}, std::span<const float>())});
        continue;
      }
      out.push_back(
          {params_[i].name, Tensor::InRegion(DType::kFloat32, {count},
                                             RegionSlice{"grads", ranks_[r].grad_offset[i],
                                                         static_cast<uint64_t>(count * 4)})});
    }
    return out;
  }

  // Rank r's device outputs against the reference at its ranges.
  void ExpectShards(const std::vector<std::array<std::vector<uint8_t>, 4>>& want,
                    const std::string& what) {
    static const char* kNames[4] = {"FP8 shard data", "rowwise_scale_inv", "columnwise_scale_inv",
                                    "bf16 slice"};
    for (int r = 0; r < kWorld; ++r) {
      const RankBuffers& b = ranks_[r];
      std::vector<uint8_t> got(b.outs_bytes);
      ASSERT_EQ(cudaMemcpy(got.data(), b.outs, b.outs_bytes, cudaMemcpyDeviceToHost), cudaSuccess);
      for (size_t i = 0; i < params_.size(); ++i) {
        const int64_t lo = params_[i].cuts[r];
        const uint64_t from[4] = {static_cast<uint64_t>(lo), 0, 0, static_cast<uint64_t>(2 * lo)};
        for (int k = 0; k < 4; ++k) {
          EXPECT_EQ(0, std::memcmp(got.data() + b.out_offset[i][k], want[i][k].data() + from[k],
                                   b.out_size[i][k]))
              << what << ": rank " << r << " " << params_[i].name << " " << kNames[k]
              << " differs from kernels::cpu of the whole parameter";
        }
      }
    }
  }

  void StepEveryRank(int64_t step, uint64_t sequence, std::optional<double> clip, bool replay) {
    std::vector<absl::StatusOr<OptimizerStepResult>> out(kWorld);
    OnEveryRank([&](int r) {
      CallOptions call;
      call.timeout = kGroupTimeout;
      out[r] = clients_[r]->Step("opt", step, GradientRefs(r), Options(r, sequence, clip), call);
    });
    for (int r = 0; r < kWorld; ++r) {
      ASSERT_TRUE(out[r].ok()) << "rank " << r << ": " << out[r].status();
      EXPECT_EQ(out[r]->stats.replayed, replay);
    }
  }

  std::vector<std::unique_ptr<QtxdProcess>> servers_;
  std::vector<std::unique_ptr<Client>> clients_;
  std::vector<Param> params_;
  std::vector<RankBuffers> ranks_;
  kernels::AdamWHyperParams hyper_;
  kernels::QuantizeParams quant_;
};

TEST_F(OptimizerShardCudaE2ETest, DeviceShardsEqualTheCpuReferenceOfTheWholeParameters) {
  ASSERT_NO_FATAL_FAILURE(MakeGroups());
  // Step 1.
  std::vector<std::vector<float>> g = Gradients(1);
  for (int r = 0; r < kWorld; ++r) ASSERT_NO_FATAL_FAILURE(Upload(r, g));
  auto want = ReferenceStep(g, 1, 1.0);
  ASSERT_NO_FATAL_FAILURE(StepEveryRank(1, 0, std::nullopt, false));
  ExpectShards(want, "step 1");
  // Step 2 with a clip factor.
  g = Gradients(2);
  for (int r = 0; r < kWorld; ++r) ASSERT_NO_FATAL_FAILURE(Upload(r, g));
  want = ReferenceStep(g, 2, 0.25);
  ASSERT_NO_FATAL_FAILURE(StepEveryRank(2, 1, 0.25, false));
  ExpectShards(want, "step 2");
  // A retried step 2: replayed into the device buffers from the masters.
  for (int r = 0; r < kWorld; ++r) ASSERT_NO_FATAL_FAILURE(Upload(r, g));
  ASSERT_NO_FATAL_FAILURE(StepEveryRank(2, 2, 0.25, true));
  ExpectShards(want, "replayed step 2");
}

}  // namespace
}  // namespace qtx
