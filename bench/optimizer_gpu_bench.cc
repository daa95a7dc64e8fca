// Optimizer.Step end to end on a GPU: qtxd --device=cuda:0 holds a parameter
// group's FP32 master weights and FP32 moments in host memory; this process
// (the training process) keeps the FP32 gradients and the FP8 parameters
// (BLOCK_2D E4M3, rowwise + columnwise, scales) in device memory, registered by
// CUDA IPC. Measures the Step latency as the client sees it, and, each alone
// on the same machine, the three stages the sidecar pipelines:
//   d2h_ms : every gradient, device -> page-locked host (cudaMemcpyAsync)
//   host_ms: kernels::cpu GradSumSquares + AdamWStepFused with FP8 output over
//            the whole group in this process, at qtxd's thread count
//   h2d_ms : every FP8 output buffer, page-locked host -> device
// and the overlap: step / max(stages) (target <= 1.25) and step / sum(stages).
// One JSON line per (events) case on stdout; a table on stderr.
//
//   optimizer_gpu_bench --qtxd=PATH [--params=8 --m=8192 --n=16384 --steps=5]
#include <cuda_runtime_api.h>
#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "bench/bench_util.h"
#include "kernels/adamw.h"
#include "kernels/block_geometry.h"
#include "kernels/cpu/adamw.h"
#include "qtx/client.h"
#include "qtx/cuda_ipc.h"
#include "qtx/shm_region.h"
#include "tests/testing/qtxd_process.h"

ABSL_FLAG(std::string, qtxd, "", "qtxd binary to start on cuda:0");
ABSL_FLAG(int, params, 8, "parameters in the group");
ABSL_FLAG(int64_t, m, 8192, "rows of each parameter");
ABSL_FLAG(int64_t, n, 16384, "columns of each parameter");
ABSL_FLAG(int, steps, 5, "timed steps");

namespace {

using Clock = std::chrono::steady_clock;

struct Flags {
  std::string qtxd;
  int params = 8;
  int64_t m = 8192, n = 16384;
  int steps = 5;
};

Flags ParseFlags(int argc, char** argv) {
  qtx::bench::ParseBenchFlags(argc, argv,
                              "optimizer_gpu_bench --qtxd=PATH [--params=N --m=M --n=N --steps=S]: "
                              "offloaded AdamW steps with device gradients and FP8 outputs");
  Flags f;
  f.qtxd = absl::GetFlag(FLAGS_qtxd);
  f.params = absl::GetFlag(FLAGS_params);
  f.m = absl::GetFlag(FLAGS_m);
  f.n = absl::GetFlag(FLAGS_n);
  f.steps = absl::GetFlag(FLAGS_steps);
  if (f.qtxd.empty() || f.params < 1 || f.m < 1 || f.n < 1 || f.steps < 1) {
    std::fprintf(stderr, "usage: --qtxd=PATH [--params=N --m=M --n=N --steps=S], all >= 1\n");
    std::exit(2);
  }
  return f;
}

double Ms(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

// A deterministic gradient-like value for element i of parameter p, step t.
inline float GradValue(int p, int64_t i, int t) {
  const uint32_t h = static_cast<uint32_t>(i * 2654435761u + p * 40503u + t * 9176u);
  return (static_cast<float>(h & 0xffff) - 32768.0f) * 1e-6f;
}

}  // namespace

int main(int argc, char** argv) {
  const Flags f = ParseFlags(argc, argv);
  namespace k = qtx::kernels;
  const int np = f.params;
  const int64_t count = f.m * f.n;
  const uint64_t grad_bytes = static_cast<uint64_t>(count) * 4;
  const k::QuantizedLayout layout = k::ComputeLayout(k::BlockScaling::kBlock2D, f.m, f.n);
  const uint64_t out_sizes[4] = {static_cast<uint64_t>(layout.RowwiseDataBytes()),
                                 static_cast<uint64_t>(layout.RowwiseScaleCount() * 4),
                                 static_cast<uint64_t>(layout.ColumnwiseDataBytes()),
                                 static_cast<uint64_t>(layout.ColumnwiseScaleCount() * 4)};
  uint64_t out_bytes_per = 0;
  uint64_t out_off[4];
  for (int i = 0; i < 4; ++i) {
    out_off[i] = out_bytes_per;
    out_bytes_per += (out_sizes[i] + 255) / 256 * 256;
  }
  QTX_BENCH_CHECK_CUDA(cudaSetDevice(0));
  QTX_BENCH_CHECK_CUDA(cudaFree(nullptr));

  // ---- Device buffers of the training process: gradients and FP8 params ----
  void* grads_dev = nullptr;
  void* out_dev = nullptr;
  QTX_BENCH_CHECK_CUDA(cudaMalloc(&grads_dev, grad_bytes * np));
  QTX_BENCH_CHECK_CUDA(cudaMalloc(&out_dev, out_bytes_per * np));
  // Page-locked host buffers for the gradient upload and the stage timings.
  float* host_grads = nullptr;
  uint8_t* host_out = nullptr;
  QTX_BENCH_CHECK_CUDA(
      cudaHostAlloc(reinterpret_cast<void**>(&host_grads), grad_bytes * np, cudaHostAllocDefault));
  QTX_BENCH_CHECK_CUDA(
      cudaHostAlloc(reinterpret_cast<void**>(&host_out), out_bytes_per * np, cudaHostAllocDefault));
  cudaStream_t stream = nullptr;
  QTX_BENCH_CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  auto upload_grads = [&](int t) {
#pragma omp parallel for schedule(static)
    for (int64_t j = 0; j < count * np; ++j)
      host_grads[j] = GradValue(int(j / count), j % count, t);
    QTX_BENCH_CHECK_CUDA(
        cudaMemcpy(grads_dev, host_grads, grad_bytes * np, cudaMemcpyHostToDevice));
  };

  // ---- qtxd ----
  auto server_or = qtx::testing::QtxdProcess::Start(
      f.qtxd, {"--device=cuda:0", "--allow_client_shm", "--optimizer_memory_limit_mb=65536"},
      absl::Seconds(60));
  QTX_BENCH_CHECK_OK(server_or.status());
  std::unique_ptr<qtx::testing::QtxdProcess> server = *std::move(server_or);
  auto stop_server = [&] { server.reset(); };
  auto client_or = qtx::Client::Connect(server->target());
  QTX_BENCH_CHECK_OK(client_or.status());
  std::unique_ptr<qtx::Client> client = *std::move(client_or);

  // Initial master weights: BF16 in a shm region (widened exactly by qtxd).
  auto t_off0 = Clock::now();
  auto shm_or = qtx::ShmRegion::Create("init", static_cast<uint64_t>(count) * 2 * np);
  QTX_BENCH_CHECK_OK(shm_or.status());
  std::unique_ptr<qtx::ShmRegion> shm = *std::move(shm_or);
  auto* bf = reinterpret_cast<uint16_t*>(shm->data());
#pragma omp parallel for schedule(static)
  for (int64_t j = 0; j < count * np; ++j) {
    const float v = GradValue(7, j, 0) * 100.0f;
    uint32_t u;
    std::memcpy(&u, &v, 4);
    bf[j] = static_cast<uint16_t>(u >> 16);
  }
  QTX_BENCH_CHECK_OK(client->RegisterShmRegion(*shm));
  qtx::OptimizerGroupConfig config;
  config.group = "bench";
  std::vector<qtx::OptimizerParameterInit> inits;
  for (int p = 0; p < np; ++p) {
    const uint64_t off = static_cast<uint64_t>(count) * 2 * p;
    inits.push_back({"p" + std::to_string(p),
                     {f.m, f.n},
                     qtx::Tensor::InRegion(qtx::DType::kBFloat16, {f.m, f.n},
                                           qtx::RegionSlice{"init", off, uint64_t(count) * 2}),
                     {},
                     {}});
  }
  QTX_BENCH_CHECK_OK(client->OffloadOptimizerState(config, inits).status());
  QTX_BENCH_CHECK_OK(client->UnregisterRegion("init"));
  shm.reset();
  const double offload_ms = Ms(t_off0, Clock::now());
  QTX_BENCH_CHECK_OK(
      qtx::cuda::RegisterDevicePointer(*client, "grads", grads_dev, grad_bytes * np));
  QTX_BENCH_CHECK_OK(
      qtx::cuda::RegisterDevicePointer(*client, "params", out_dev, out_bytes_per * np));

  std::vector<qtx::OptimizerGradient> grads;
  qtx::StepOptions options;
  for (int p = 0; p < np; ++p) {
    const std::string name = "p" + std::to_string(p);
    grads.push_back(
        {name, qtx::Tensor::InRegion(qtx::DType::kFloat32, {f.m, f.n},
                                     qtx::RegionSlice{"grads", grad_bytes * p, grad_bytes})});
    qtx::ParameterDestination d;
    d.name = name;
    const uint64_t base = out_bytes_per * p;
    d.fp8.rowwise_data = qtx::RegionSlice{"params", base + out_off[0], out_sizes[0]};
    d.fp8.rowwise_scale_inv = qtx::RegionSlice{"params", base + out_off[1], out_sizes[1]};
    d.fp8.columnwise_data = qtx::RegionSlice{"params", base + out_off[2], out_sizes[2]};
    d.fp8.columnwise_scale_inv = qtx::RegionSlice{"params", base + out_off[3], out_sizes[3]};
    options.destinations.push_back(std::move(d));
  }
  auto ready = qtx::cuda::IpcEvent::Create();
  auto done = qtx::cuda::IpcEvent::Create();
  QTX_BENCH_CHECK_OK(ready.status());
  QTX_BENCH_CHECK_OK(done.status());

  // ---- Steps through qtxd: step 1 warms up (page-locked staging, once per
  // group); then `steps` timed steps without events and `steps` with. ----
  int64_t t = 0;
  double first_ms = 0;
  std::vector<double> plain, evented;
  for (int i = 0; i < 1 + 2 * f.steps; ++i) {
    ++t;
    upload_grads(static_cast<int>(t));
    const bool events = i > f.steps;
    qtx::CallOptions call;
    if (events) {
      QTX_BENCH_CHECK_CUDA(cudaEventRecord(ready->get(), stream));
      call.cuda_wait_event = ready->handle();
      call.cuda_signal_event = done->handle();
    }
    const auto t0 = Clock::now();
    auto r = client->Step("bench", t, grads, options, call);
    if (!r.ok()) {
      std::fprintf(stderr, "step %ld: %s\n", static_cast<long>(t), r.status().ToString().c_str());
      stop_server();
      return 1;
    }
    if (events) {
      // The outputs are ready for the training stream once it has waited on
      // the sidecar's event; the latency is until that point.
      QTX_BENCH_CHECK_CUDA(cudaStreamWaitEvent(stream, done->get(), 0));
      QTX_BENCH_CHECK_CUDA(cudaStreamSynchronize(stream));
    }
    const double ms = Ms(t0, Clock::now());
    if (i == 0) {
      first_ms = ms;
    } else {
      (events ? evented : plain).push_back(ms);
    }
    std::fprintf(stderr, "step %ld%s: %.1f ms (grad_norm %.6g)\n", static_cast<long>(t),
                 events ? " (events)" : "", ms, r->stats.grad_norm);
  }
  client.reset();
  stop_server();

  // ---- The three stages alone ----
  cudaEvent_t e0, e1;
  QTX_BENCH_CHECK_CUDA(cudaEventCreate(&e0));
  QTX_BENCH_CHECK_CUDA(cudaEventCreate(&e1));
  std::vector<double> d2h, h2d;
  for (int r = 0; r < 3; ++r) {
    QTX_BENCH_CHECK_CUDA(cudaEventRecord(e0, stream));
    for (int p = 0; p < np; ++p) {
      QTX_BENCH_CHECK_CUDA(cudaMemcpyAsync(host_grads + count * p,
                                           static_cast<char*>(grads_dev) + grad_bytes * p,
                                           grad_bytes, cudaMemcpyDeviceToHost, stream));
    }
    QTX_BENCH_CHECK_CUDA(cudaEventRecord(e1, stream));
    QTX_BENCH_CHECK_CUDA(cudaEventSynchronize(e1));
    float ms = 0;
    QTX_BENCH_CHECK_CUDA(cudaEventElapsedTime(&ms, e0, e1));
    d2h.push_back(ms);
    QTX_BENCH_CHECK_CUDA(cudaEventRecord(e0, stream));
    for (int p = 0; p < np; ++p) {
      for (int b = 0; b < 4; ++b) {
        const uint64_t off = out_bytes_per * p + out_off[b];
        QTX_BENCH_CHECK_CUDA(cudaMemcpyAsync(static_cast<char*>(out_dev) + off, host_out + off,
                                             out_sizes[b], cudaMemcpyHostToDevice, stream));
      }
    }
    QTX_BENCH_CHECK_CUDA(cudaEventRecord(e1, stream));
    QTX_BENCH_CHECK_CUDA(cudaEventSynchronize(e1));
    QTX_BENCH_CHECK_CUDA(cudaEventElapsedTime(&ms, e0, e1));
    h2d.push_back(ms);
  }
  // Host: the same kernels on the same shapes, here (qtxd has exited).
  std::vector<std::unique_ptr<float[]>> master(np), m1(np), m2(np);
  std::vector<k::cpu::AdamWParamBuffers> kb(np);
  for (int p = 0; p < np; ++p) {
    master[p].reset(new float[count]);
    m1[p].reset(new float[count]);
    m2[p].reset(new float[count]);
    float* a = master[p].get();
    float* b = m1[p].get();
    float* c = m2[p].get();
#pragma omp parallel for schedule(static)
    for (int64_t j = 0; j < count; ++j) {
      a[j] = GradValue(7, j, 0) * 100.0f;
      b[j] = 0.0f;
      c[j] = 0.0f;
    }
    k::cpu::AdamWParamBuffers& x = kb[p];
    x.m = f.m;
    x.n = f.n;
    x.master = a;
    x.exp_avg = b;
    x.exp_avg_sq = c;
    x.grad = host_grads + count * p;
    x.quant.scaling = k::BlockScaling::kBlock2D;
    x.quant.rowwise = true;
    x.quant.columnwise = true;
    x.quant.force_pow2_scales = true;
    uint8_t* o = host_out + out_bytes_per * p;
    x.fp8.rowwise_data = o + out_off[0];
    x.fp8.rowwise_scale_inv = reinterpret_cast<float*>(o + out_off[1]);
    x.fp8.columnwise_data = o + out_off[2];
    x.fp8.columnwise_scale_inv = reinterpret_cast<float*>(o + out_off[3]);
  }
  std::vector<double> host;
  for (int r = 0; r < 3; ++r) {
    const auto h0 = Clock::now();
    const k::cpu::GradNormResult norm = k::cpu::GradSumSquares(kb);
    k::cpu::AdamWStepFused(kb, k::MakeAdamWScalars(k::AdamWHyperParams{}, r + 1, 1.0));
    host.push_back(Ms(h0, Clock::now()));
    (void)norm;
  }

  const double d2h_ms = qtx::bench::Percentile(d2h, 0.5), h2d_ms = qtx::bench::Percentile(h2d, 0.5),
               host_ms = qtx::bench::Percentile(host, 0.5);
  const double slowest = std::max({d2h_ms, h2d_ms, host_ms});
  const double sum = d2h_ms + h2d_ms + host_ms;
  std::fprintf(stderr,
               "offload %.0f ms, first step %.0f ms (page-locked staging allocated)\n"
               "stages alone: d2h %.1f ms (%.1f GB/s), host %.1f ms (%d threads), h2d %.1f ms "
               "(%.1f GB/s)\n",
               offload_ms, first_ms, d2h_ms, grad_bytes * np / d2h_ms / 1e6, host_ms,
               omp_get_max_threads(), h2d_ms, out_bytes_per * np / h2d_ms / 1e6);
  for (int ev = 0; ev < 2; ++ev) {
    const std::vector<double>& v = ev ? evented : plain;
    const double step = qtx::bench::Percentile(v, 0.5);
    const double best = *std::min_element(v.begin(), v.end());
    std::printf(
        "{\"bench\":\"optimizer_step_gpu\",\"events\":%s,\"params\":%d,\"m\":%ld,\"n\":%ld,"
        "\"elements\":%ld,\"grad_dtype\":\"FLOAT32\",\"moments\":\"FLOAT32\","
        "\"output\":\"FP8_BLOCK_2D_E4M3_row+col\",\"steps\":%zu,\"step_ms\":%.2f,"
        "\"step_min_ms\":%.2f,\"first_step_ms\":%.2f,\"d2h_ms\":%.2f,\"host_ms\":%.2f,"
        "\"h2d_ms\":%.2f,\"host_threads\":%d,\"d2h_bytes\":%lu,\"h2d_bytes\":%lu,"
        "\"step_over_slowest\":%.3f,\"step_over_sum\":%.3f,\"target_over_slowest\":1.25,"
        "\"met\":%s}\n",
        ev ? "true" : "false", np, static_cast<long>(f.m), static_cast<long>(f.n),
        static_cast<long>(count * np), v.size(), step, best, first_ms, d2h_ms, host_ms, h2d_ms,
        omp_get_max_threads(), static_cast<unsigned long>(grad_bytes * np),
        static_cast<unsigned long>(out_bytes_per * np), step / slowest, step / sum,
        step / slowest <= 1.25 ? "true" : "false");
    std::fprintf(stderr, "events=%d: step %.1f ms (min %.1f) = %.2fx slowest stage, %.2fx sum\n",
                 ev, step, best, step / slowest, step / sum);
  }
  std::fflush(stdout);
  return 0;
}
