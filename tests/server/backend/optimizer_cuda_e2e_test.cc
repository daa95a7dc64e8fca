// The GPU path of Optimizer.Step end to end (label gpu): qtxd --device=cuda:0
// runs as its own process; this test is the training process. Its gradients
// and its FP8 (+ BF16) parameter buffers live in device memory, registered by
// CUDA IPC. Every byte the sidecar writes into device memory must equal what
// the CPU reference computes for the same inputs (kernels::cpu::AdamWReference
// = the scalar AdamW then QuantizeBlock), over several steps: without events,
// with interprocess wait/signal events, with clipping (every gradient before
// any update) and a host gradient mixed in, and on a retried step.
//
// The qtxd binary: $QTXD if set, else the one this build made.
#include <cuda_runtime_api.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
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

extern char** environ;

namespace qtx {
namespace {

#define CUDA_ASSERT(expr) \
  ASSERT_EQ((expr), cudaSuccess) << #expr << ": " << cudaGetErrorString(cudaGetLastError())

using ::qtx::testing::QtxdPath;
using ::qtx::testing::QtxdProcess;

uint16_t Bf16Bits(float f) {  // truncation: any BF16 value is a valid gradient
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>(u >> 16);
}

struct Param {
  std::string name;
  int64_t m, n;
  kernels::InputDType grad_dtype;
  // The reference state (host), stepped with kernels::cpu::AdamWReference.
  std::vector<float> master, exp_avg, exp_avg_sq;
  // Output layout in the device region: 4 FP8 buffers + BF16, 256-aligned.
  kernels::QuantizedLayout layout;
  uint64_t offset[5] = {};
  uint64_t size[5] = {};
  uint64_t grad_offset = 0, grad_bytes = 0;
};

uint64_t Align(uint64_t x) { return (x + 255) / 256 * 256; }

class OptimizerCudaE2ETest : public ::testing::Test {
 protected:
  void SetUp() override {
    int count = 0;
    ASSERT_EQ(cudaGetDeviceCount(&count), cudaSuccess) << "gpu-labelled test: needs a GPU";
    ASSERT_GT(count, 0) << "gpu-labelled test: needs a visible CUDA device";
    CUDA_ASSERT(cudaSetDevice(0));
    auto server = QtxdProcess::Start(QtxdPath(), {"--device=cuda:0"}, absl::Seconds(60));
    ASSERT_TRUE(server.ok()) << "qtxd (" << QtxdPath() << "): " << server.status();
    server_ = *std::move(server);
    auto client = Client::Connect(server_->target());
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = *std::move(client);
    CUDA_ASSERT(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  }
  void TearDown() override {
    client_.reset();
    server_.reset();
    if (grads_dev_ != nullptr) cudaFree(grads_dev_);
    if (out_dev_ != nullptr) cudaFree(out_dev_);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  // Three parameters: tile-aligned, ragged (M, N not multiples of 128), tiny.
  void MakeGroup() {
    const struct {
      const char* name;
      int64_t m, n;
      kernels::InputDType g;
    } specs[] = {{"w_aligned", 256, 384, kernels::InputDType::kFloat32},
                 {"w_ragged", 130, 200, kernels::InputDType::kBFloat16},
                 {"bias", 1, 77, kernels::InputDType::kFloat32}};
    std::mt19937 rng(11);
    std::normal_distribution<float> dist(0.0f, 0.05f);
    uint64_t goff = 0, ooff = 0;
    for (const auto& s : specs) {
      Param p;
      p.name = s.name;
      p.m = s.m;
      p.n = s.n;
      p.grad_dtype = s.g;
      const int64_t count = s.m * s.n;
      p.master.resize(count);
      for (float& x : p.master) x = dist(rng);
      p.master[0] = 3.0f;  // a large value in the first tile
      p.exp_avg.assign(count, 0.0f);
      p.exp_avg_sq.assign(count, 0.0f);
      p.layout = kernels::ComputeLayout(kernels::BlockScaling::kBlock2D, s.m, s.n);
      p.size[0] = p.layout.RowwiseDataBytes();
      p.size[1] = p.layout.RowwiseScaleCount() * 4;
      p.size[2] = p.layout.ColumnwiseDataBytes();
      p.size[3] = p.layout.ColumnwiseScaleCount() * 4;
      p.size[4] = count * 2;
      for (int k = 0; k < 5; ++k) {
        p.offset[k] = ooff;
        ooff += Align(p.size[k]);
      }
      p.grad_bytes = count * (s.g == kernels::InputDType::kFloat32 ? 4 : 2);
      p.grad_offset = goff;
      goff += Align(p.grad_bytes);
      params_.push_back(std::move(p));
    }
    grads_bytes_ = goff;
    out_bytes_ = ooff;
    ASSERT_EQ(cudaMalloc(&grads_dev_, grads_bytes_), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&out_dev_, out_bytes_), cudaSuccess);
    QTX_ASSERT_OK(cuda::RegisterDevicePointer(*client_, "grads", grads_dev_, grads_bytes_));
    QTX_ASSERT_OK(cuda::RegisterDevicePointer(*client_, "params", out_dev_, out_bytes_));

    OptimizerGroupConfig c;
    c.group = "gpu";
    c.hyper_params.lr = 1e-2;
    c.hyper_params.weight_decay = 0.1;
    c.output.bf16_copy = true;
    hyper_.lr = c.hyper_params.lr;
    hyper_.beta1 = c.hyper_params.beta1;
    hyper_.beta2 = c.hyper_params.beta2;
    hyper_.eps = c.hyper_params.eps;
    hyper_.weight_decay = c.hyper_params.weight_decay;
    hyper_.bias_correction = c.hyper_params.bias_correction;
    quant_.scaling = kernels::BlockScaling::kBlock2D;
    quant_.format = kernels::Fp8Format::kE4M3;
    quant_.rowwise = true;
    quant_.columnwise = true;
    quant_.force_pow2_scales = true;
    quant_.amax_epsilon = 0.0f;
    std::vector<OptimizerParameterInit> inits;
    for (const Param& p : params_) {
      inits.push_back({p.name, {p.m, p.n}, Tensor::FromFloat32({p.m, p.n}, p.master), {}, {}});
    }
    QTX_ASSERT_OK(client_->OffloadOptimizerState(c, inits).status());
  }

  // Step t's gradients as raw bytes per parameter (seeded by t), with one
  // non-finite-free large element per parameter.
  std::vector<std::string> Gradients(int t) {
    std::vector<std::string> out;
    std::mt19937 rng(100 + t);
    std::normal_distribution<float> dist(0.0f, 1.0f);
    for (const Param& p : params_) {
      const int64_t count = p.m * p.n;
      std::string bytes(p.grad_bytes, '\0');
      for (int64_t i = 0; i < count; ++i) {
        float g = dist(rng) * (i % 97 == 0 ? 40.0f : 1.0f);
        if (p.grad_dtype == kernels::InputDType::kFloat32) {
          std::memcpy(&bytes[i * 4], &g, 4);
        } else {
          const uint16_t h = Bf16Bits(g);
          std::memcpy(&bytes[i * 2], &h, 2);
        }
      }
      out.push_back(std::move(bytes));
    }
    return out;
  }

  // Applies step t to the reference state; returns the expected output bytes
  // (laid out like the device region) and the expected grad norm.
  std::vector<uint8_t> ReferenceStep(const std::vector<std::string>& grads, int64_t t,
                                     std::optional<double> max_norm, double* norm_out) {
    std::vector<uint8_t> want(out_bytes_, 0);
    std::vector<kernels::cpu::AdamWParamBuffers> bufs(params_.size());
    for (size_t i = 0; i < params_.size(); ++i) {
      Param& p = params_[i];
      kernels::cpu::AdamWParamBuffers& b = bufs[i];
      b.m = p.m;
      b.n = p.n;
      b.master = p.master.data();
      b.exp_avg = p.exp_avg.data();
      b.exp_avg_sq = p.exp_avg_sq.data();
      b.grad = grads[i].data();
      b.grad_dtype = p.grad_dtype;
      b.quant = quant_;
      b.fp8.rowwise_data = want.data() + p.offset[0];
      b.fp8.rowwise_scale_inv = reinterpret_cast<float*>(want.data() + p.offset[1]);
      b.fp8.columnwise_data = want.data() + p.offset[2];
      b.fp8.columnwise_scale_inv = reinterpret_cast<float*>(want.data() + p.offset[3]);
      b.bf16 = reinterpret_cast<uint16_t*>(want.data() + p.offset[4]);
    }
    const double norm = std::sqrt(kernels::cpu::GradSumSquares(bufs, 1).sum_squares);
    double coef = 1.0;
    if (max_norm.has_value()) coef = std::min(1.0, *max_norm / (norm + 1e-6));
    kernels::cpu::AdamWReference(bufs, kernels::MakeAdamWScalars(hyper_, t, coef));
    *norm_out = norm;
    return want;
  }

  std::vector<uint8_t> DeviceOutputs() {
    std::vector<uint8_t> got(out_bytes_);
    EXPECT_EQ(cudaMemcpy(got.data(), out_dev_, out_bytes_, cudaMemcpyDeviceToHost), cudaSuccess);
    return got;
  }

  void ExpectSame(const std::vector<uint8_t>& got, const std::vector<uint8_t>& want,
                  const std::string& what) {
    static const char* kNames[5] = {"rowwise_data", "rowwise_scale_inv", "columnwise_data",
                                    "columnwise_scale_inv", "bf16"};
    for (const Param& p : params_) {
      for (int k = 0; k < 5; ++k) {
        EXPECT_EQ(std::memcmp(got.data() + p.offset[k], want.data() + p.offset[k], p.size[k]), 0)
            << what << ": " << p.name << "." << kNames[k] << " differs from kernels::cpu";
      }
    }
  }

  // Destinations of every parameter's outputs in the device region.
  StepOptions DeviceDestinations() {
    StepOptions o;
    for (const Param& p : params_) {
      ParameterDestination d;
      d.name = p.name;
      d.fp8.rowwise_data = RegionSlice{"params", p.offset[0], p.size[0]};
      d.fp8.rowwise_scale_inv = RegionSlice{"params", p.offset[1], p.size[1]};
      d.fp8.columnwise_data = RegionSlice{"params", p.offset[2], p.size[2]};
      d.fp8.columnwise_scale_inv = RegionSlice{"params", p.offset[3], p.size[3]};
      d.bf16 = RegionSlice{"params", p.offset[4], p.size[4]};
      o.destinations.push_back(std::move(d));
    }
    return o;
  }

  // Gradients in the device region (parameter `host_index`, if >= 0, inline).
  std::vector<OptimizerGradient> GradientRefs(const std::vector<std::string>& grads,
                                              int host_index = -1) {
    std::vector<OptimizerGradient> out;
    for (size_t i = 0; i < params_.size(); ++i) {
      const Param& p = params_[i];
      const DType dt =
          p.grad_dtype == kernels::InputDType::kFloat32 ? DType::kFloat32 : DType::kBFloat16;
      if (static_cast<int>(i) == host_index) {
        out.push_back({p.name, Tensor::Inline(dt, {p.m, p.n}, grads[i])});
      } else {
        out.push_back(
            {p.name,
             Tensor::InRegion(dt, {p.m, p.n}, RegionSlice{"grads", p.grad_offset, p.grad_bytes})});
      }
    }
    return out;
  }

  void UploadGradients(const std::vector<std::string>& grads, bool async) {
    for (size_t i = 0; i < params_.size(); ++i) {
      auto* dst = static_cast<char*>(grads_dev_) + params_[i].grad_offset;
      if (async) {
        ASSERT_EQ(
            cudaMemcpyAsync(dst, grads[i].data(), grads[i].size(), cudaMemcpyHostToDevice, stream_),
            cudaSuccess);
      } else {
        ASSERT_EQ(cudaMemcpy(dst, grads[i].data(), grads[i].size(), cudaMemcpyHostToDevice),
                  cudaSuccess);
      }
    }
  }

  void ClearOutputs() { ASSERT_EQ(cudaMemset(out_dev_, 0xAB, out_bytes_), cudaSuccess); }

  std::unique_ptr<QtxdProcess> server_;
  std::unique_ptr<Client> client_;
  cudaStream_t stream_ = nullptr;
  std::vector<Param> params_;
  void* grads_dev_ = nullptr;
  void* out_dev_ = nullptr;
  uint64_t grads_bytes_ = 0, out_bytes_ = 0;
  kernels::AdamWHyperParams hyper_;
  kernels::QuantizeParams quant_;
};

TEST_F(OptimizerCudaE2ETest, DeviceStepsEqualTheCpuReferenceByteForByte) {
  MakeGroup();
  if (HasFatalFailure()) return;

  // Step 1: synchronous (no events); every gradient and output on the device.
  {
    const std::vector<std::string> g = Gradients(1);
    UploadGradients(g, /*async=*/false);
    ClearOutputs();
    double norm = 0;
    const std::vector<uint8_t> want = ReferenceStep(g, 1, std::nullopt, &norm);
    auto r = client_->Step("gpu", 1, GradientRefs(g), DeviceDestinations());
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->stats.step, 1);
    EXPECT_FALSE(r->stats.replayed);
    EXPECT_EQ(r->stats.grad_norm, norm);  // the same chunk sums in the same order
    ExpectSame(DeviceOutputs(), want, "step 1 (no events)");
  }

  // Step 2: the gradients are written asynchronously on our stream and only
  // an interprocess event says when; the outputs are read on our stream after
  // the sidecar's signal event, with no host synchronization in between.
  {
    auto ready = cuda::IpcEvent::Create();
    auto done = cuda::IpcEvent::Create();
    ASSERT_TRUE(ready.ok() && done.ok());
    const std::vector<std::string> g = Gradients(2);
    ClearOutputs();
    // Delay the gradients behind a large memset, so that a sidecar that did
    // not wait on the event would read stale gradients.
    void* big = nullptr;
    const size_t big_bytes = size_t{1} << 30;
    CUDA_ASSERT(cudaMalloc(&big, big_bytes));
    for (int i = 0; i < 8; ++i) CUDA_ASSERT(cudaMemsetAsync(big, i, big_bytes, stream_));
    UploadGradients(g, /*async=*/true);
    CUDA_ASSERT(cudaEventRecord(ready->get(), stream_));
    double norm = 0;
    const std::vector<uint8_t> want = ReferenceStep(g, 2, std::nullopt, &norm);
    CallOptions call;
    call.cuda_wait_event = ready->handle();
    call.cuda_signal_event = done->handle();
    auto r = client_->Step("gpu", 2, GradientRefs(g), DeviceDestinations(), call);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->stats.grad_norm, norm);
    CUDA_ASSERT(cudaStreamWaitEvent(stream_, done->get(), 0));
    std::vector<uint8_t> got(out_bytes_);
    CUDA_ASSERT(cudaMemcpyAsync(got.data(), out_dev_, out_bytes_, cudaMemcpyDeviceToHost, stream_));
    CUDA_ASSERT(cudaStreamSynchronize(stream_));
    ExpectSame(got, want, "step 2 (wait + signal events)");
    CUDA_ASSERT(cudaFree(big));
  }

  // Step 3: clipping (the norm is needed before any update) and one gradient
  // inline (host) among device ones.
  std::vector<uint8_t> want3;
  {
    const std::vector<std::string> g = Gradients(3);
    UploadGradients(g, /*async=*/false);
    ClearOutputs();
    double norm = 0;
    want3 = ReferenceStep(g, 3, 5.0, &norm);
    StepOptions o = DeviceDestinations();
    o.max_grad_norm = 5.0;
    auto r = client_->Step("gpu", 3, GradientRefs(g, /*host_index=*/1), o);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->stats.grad_norm, norm);
    EXPECT_LT(r->stats.clip_coef, 1.0);
    ExpectSame(DeviceOutputs(), want3, "step 3 (clipping, mixed host/device gradients)");
  }

  // A retry of step 3 (with a signal event this time): answered from the
  // state, written into device memory again, never applied twice.
  {
    auto done = cuda::IpcEvent::Create();
    ASSERT_TRUE(done.ok());
    ClearOutputs();
    CallOptions call;
    call.cuda_signal_event = done->handle();
    auto r = client_->Step("gpu", 3, {}, DeviceDestinations(), call);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_TRUE(r->stats.replayed);
    CUDA_ASSERT(cudaEventSynchronize(done->get()));
    ExpectSame(DeviceOutputs(), want3, "retried step 3");
  }

  // Step 4 applies on top of step 3 exactly once.
  {
    const std::vector<std::string> g = Gradients(4);
    UploadGradients(g, /*async=*/false);
    ClearOutputs();
    double norm = 0;
    const std::vector<uint8_t> want = ReferenceStep(g, 4, std::nullopt, &norm);
    auto r = client_->Step("gpu", 4, GradientRefs(g), DeviceDestinations());
    ASSERT_TRUE(r.ok()) << r.status();
    ExpectSame(DeviceOutputs(), want, "step 4 (after a retry)");
  }

  // The master weights the sidecar holds equal the reference's.
  auto state = client_->GetState("gpu");
  ASSERT_TRUE(state.ok()) << state.status();
  ASSERT_EQ(state->parameters.size(), params_.size());
  for (size_t i = 0; i < params_.size(); ++i) {
    const std::string& bytes = state->parameters[i].master.data;
    ASSERT_EQ(bytes.size(), params_[i].master.size() * 4);
    EXPECT_EQ(std::memcmp(bytes.data(), params_[i].master.data(), bytes.size()), 0)
        << params_[i].name << ": master weights differ";
  }
}

// Device outputs with the host gradients only, and the gradients on the device
// with the parameters returned inline: both mixes give the reference bytes.
TEST_F(OptimizerCudaE2ETest, MixedHostAndDeviceTensors) {
  MakeGroup();
  if (HasFatalFailure()) return;
  const std::vector<std::string> g = Gradients(1);
  UploadGradients(g, false);
  double norm = 0;
  const std::vector<uint8_t> want = ReferenceStep(g, 1, std::nullopt, &norm);
  auto r = client_->Step("gpu", 1, GradientRefs(g), StepOptions{});  // outputs inline
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->parameters.size(), params_.size());
  for (size_t i = 0; i < params_.size(); ++i) {
    const Param& p = params_[i];
    const ParameterOutput& o = r->parameters[i];
    ASSERT_TRUE(o.fp8.has_value() && o.bf16.has_value());
    const std::string* parts[5] = {&o.fp8->rowwise_data->data, &o.fp8->rowwise_scale_inv->data,
                                   &o.fp8->columnwise_data->data,
                                   &o.fp8->columnwise_scale_inv->data, &o.bf16->data};
    for (int k = 0; k < 5; ++k) {
      ASSERT_EQ(parts[k]->size(), p.size[k]);
      EXPECT_EQ(std::memcmp(parts[k]->data(), want.data() + p.offset[k], p.size[k]), 0)
          << p.name << " part " << k;
    }
  }
  // Step 2: every gradient inline, outputs on the device.
  const std::vector<std::string> g2 = Gradients(2);
  std::vector<OptimizerGradient> inline_grads;
  for (size_t i = 0; i < params_.size(); ++i) {
    const Param& p = params_[i];
    inline_grads.push_back(
        {p.name, Tensor::Inline(p.grad_dtype == kernels::InputDType::kFloat32 ? DType::kFloat32
                                                                              : DType::kBFloat16,
                                {p.m, p.n}, g2[i])});
  }
  ClearOutputs();
  const std::vector<uint8_t> want2 = ReferenceStep(g2, 2, std::nullopt, &norm);
  auto r2 = client_->Step("gpu", 2, inline_grads, DeviceDestinations());
  ASSERT_TRUE(r2.ok()) << r2.status();
  ExpectSame(DeviceOutputs(), want2, "inline gradients, device outputs");
}

}  // namespace
}  // namespace qtx
