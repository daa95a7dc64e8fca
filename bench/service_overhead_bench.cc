// Service overhead of qtxd on a CUDA device: latency of Quantize calls
// through the sidecar (unix socket, inputs and outputs in CUDA IPC regions)
// next to the bare kernel (kernels::cuda::QuantizeBlock launched and
// synchronized in this process), per tensor size. JSON lines on stdout, a
// table on stderr. See bench/README.md.
//
//   service_overhead_bench --qtxd=build/server/qtxd [--sizes_mib=1,4,16,64,256]
//                          [--iters=300] [--mps=0|1] [--threads=4] [--label=TEXT]
//                          [--qtxd_arg=--flag=value ...]   (extra qtxd flags, e.g. for A/B:
//                                                           --qtxd_arg=--inline_max_concurrent=0)
//   service_overhead_bench --target=unix:///tmp/qtxd.sock   (an already running qtxd)
#include <cuda_runtime_api.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "bench/bench_util.h"
#include "kernels/block_geometry.h"
#include "kernels/cuda/quantize_block.h"
#include "qtx/client.h"
#include "qtx/cuda_ipc.h"
#include "tests/testing/qtxd_process.h"

ABSL_FLAG(std::string, qtxd, "", "qtxd binary to start on cuda:0 (or give --target)");
ABSL_FLAG(std::string, target, "", "a running qtxd (unix:///path)");
ABSL_FLAG(std::vector<std::string>, sizes_mib,
          std::vector<std::string>({"1", "4", "16", "64", "256"}),
          "input sizes in MiB, comma-separated");
ABSL_FLAG(int, iters, 300, "calls per size (a third of it from 64 MiB up, at least 50)");
ABSL_FLAG(int, mps, 0, "whether MPS runs (copied into the JSON lines)");
ABSL_FLAG(int, threads, 4, "qtxd --threads");
ABSL_FLAG(int64_t, n, 4096, "columns of the input");
ABSL_FLAG(std::vector<std::string>, qtxd_arg, {}, "extra qtxd flags, comma-separated");
ABSL_FLAG(std::string, label, "", "free text copied into the JSON lines");

namespace {

using Clock = std::chrono::steady_clock;

struct Flags {
  std::string qtxd;
  std::string target;
  std::vector<int64_t> sizes_mib;
  int iters = 300;
  int mps = 0;
  int threads = 4;
  int64_t n = 4096;
  std::vector<std::string> qtxd_args;
  std::string label;
};

Flags ParseFlags(int argc, char** argv) {
  qtx::bench::ParseBenchFlags(argc, argv,
                              "service_overhead_bench (--qtxd=PATH | --target=unix:///...): "
                              "Quantize through qtxd (CUDA IPC regions) vs the bare kernel");
  Flags f;
  f.qtxd = absl::GetFlag(FLAGS_qtxd);
  f.target = absl::GetFlag(FLAGS_target);
  f.sizes_mib = qtx::bench::IntList("sizes_mib", absl::GetFlag(FLAGS_sizes_mib));
  f.iters = absl::GetFlag(FLAGS_iters);
  f.mps = absl::GetFlag(FLAGS_mps);
  f.threads = absl::GetFlag(FLAGS_threads);
  f.n = absl::GetFlag(FLAGS_n);
  f.qtxd_args = absl::GetFlag(FLAGS_qtxd_arg);
  f.label = absl::GetFlag(FLAGS_label);
  if (f.qtxd.empty() == f.target.empty()) {
    std::fprintf(stderr, "give exactly one of --qtxd=PATH or --target=unix:///...\n");
    std::exit(2);
  }
  return f;
}

double Us(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::micro>(b - a).count();
}

struct Stats {
  double p50 = 0, p99 = 0;
};
Stats Summarize(const std::vector<double>& v) {
  return {qtx::bench::Percentile(v, 0.5), qtx::bench::Percentile(v, 0.99)};
}

}  // namespace

int main(int argc, char** argv) {
  const Flags flags = ParseFlags(argc, argv);
  QTX_BENCH_CHECK_CUDA(cudaSetDevice(0));
  QTX_BENCH_CHECK_CUDA(cudaFree(nullptr));

  std::unique_ptr<qtx::testing::QtxdProcess> server;
  std::string target = flags.target;
  if (!flags.qtxd.empty()) {
    std::vector<std::string> args = {"--device=cuda:0",
                                     "--threads=" + std::to_string(flags.threads)};
    args.insert(args.end(), flags.qtxd_args.begin(), flags.qtxd_args.end());
    auto server_or = qtx::testing::QtxdProcess::Start(flags.qtxd, args, absl::Seconds(60));
    QTX_BENCH_CHECK_OK(server_or.status());
    server = *std::move(server_or);
    target = server->target();
  }
  auto client_or = qtx::Client::Connect(target);
  QTX_BENCH_CHECK_OK(client_or.status());
  std::unique_ptr<qtx::Client> client = *std::move(client_or);
  QTX_BENCH_CHECK_OK(client->WaitUntilServing(absl::Seconds(60)));

  // The floor: a unary RPC answered by gRPC's health service (no executor,
  // no device), over the same channel.
  std::vector<double> health;
  for (int i = 0; i < flags.iters + 20; ++i) {
    const auto t0 = Clock::now();
    QTX_BENCH_CHECK_OK(client->Health().status());
    if (i >= 20) health.push_back(Us(t0, Clock::now()));
  }
  const Stats hs = Summarize(health);
  std::printf(
      "{\"bench\":\"service_overhead\",\"case\":\"health_rpc\",\"mps\":%d,\"iters\":%d,"
      "\"rpc_p50_us\":%.2f,\"rpc_p99_us\":%.2f,\"label\":\"%s\"}\n",
      flags.mps, flags.iters, hs.p50, hs.p99, flags.label.c_str());
  std::fflush(stdout);

  cudaStream_t stream = nullptr;
  QTX_BENCH_CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaEvent_t ev0, ev1;
  QTX_BENCH_CHECK_CUDA(cudaEventCreate(&ev0));
  QTX_BENCH_CHECK_CUDA(cudaEventCreate(&ev1));
  auto ready = qtx::cuda::IpcEvent::Create();
  auto done = qtx::cuda::IpcEvent::Create();
  QTX_BENCH_CHECK_OK(ready.status());
  QTX_BENCH_CHECK_OK(done.status());

  std::fprintf(stderr, "%-6s %-7s %10s %10s %10s %10s %12s %12s %12s\n", "MiB", "events", "rpc_p50",
               "rpc_p99", "kern_p50", "kern_p99", "kern_gpu_p50", "ovh_p50", "ovh_p99");
  for (int64_t mib : flags.sizes_mib) {
    const int64_t n = flags.n;
    const int64_t bytes = int64_t{mib} << 20;
    const int64_t m = bytes / 2 / n;  // BF16
    const qtx::kernels::QuantizedLayout L =
        qtx::kernels::ComputeLayout(qtx::kernels::BlockScaling::kBlock1D, m, n);
    const uint64_t sizes[4] = {static_cast<uint64_t>(L.RowwiseDataBytes()),
                               static_cast<uint64_t>(L.RowwiseScaleCount()) * 4,
                               static_cast<uint64_t>(L.ColumnwiseDataBytes()),
                               static_cast<uint64_t>(L.ColumnwiseScaleCount()) * 4};
    uint64_t offsets[4], total = 0;
    for (int i = 0; i < 4; ++i) {
      offsets[i] = total;
      total += (sizes[i] + 255) / 256 * 256;
    }
    void* d_in = nullptr;
    void* d_out = nullptr;
    QTX_BENCH_CHECK_CUDA(cudaMalloc(&d_in, bytes));
    QTX_BENCH_CHECK_CUDA(cudaMalloc(&d_out, total));
    {
      std::vector<uint16_t> host(m * n);
      std::mt19937 rng(mib);
      std::normal_distribution<float> dist(0.0f, 1.0f);
      for (auto& h : host) {
        float f = dist(rng);
        uint32_t u;
        std::memcpy(&u, &f, 4);
        h = static_cast<uint16_t>(u >> 16);
      }
      QTX_BENCH_CHECK_CUDA(cudaMemcpy(d_in, host.data(), bytes, cudaMemcpyHostToDevice));
    }
    const std::string in_name = "bench_in_" + std::to_string(mib);
    const std::string out_name = "bench_out_" + std::to_string(mib);
    QTX_BENCH_CHECK_OK(qtx::cuda::RegisterDevicePointer(*client, in_name, d_in, bytes));
    QTX_BENCH_CHECK_OK(qtx::cuda::RegisterDevicePointer(*client, out_name, d_out, total));

    qtx::QuantizeConfig config;
    config.rowwise = true;
    config.columnwise = true;
    qtx::QuantizeOutputs outs;
    outs.rowwise_data = qtx::RegionSlice{out_name, offsets[0], sizes[0]};
    outs.rowwise_scale_inv = qtx::RegionSlice{out_name, offsets[1], sizes[1]};
    outs.columnwise_data = qtx::RegionSlice{out_name, offsets[2], sizes[2]};
    outs.columnwise_scale_inv = qtx::RegionSlice{out_name, offsets[3], sizes[3]};
    const qtx::Tensor input = qtx::Tensor::InRegion(
        qtx::DType::kBFloat16, {m, n}, qtx::RegionSlice{in_name, 0, static_cast<uint64_t>(bytes)});

    // Bare kernel in this process: host wall time of launch + synchronize,
    // and the GPU time between two events.
    qtx::kernels::QuantizeParams params;
    params.rowwise = true;
    params.columnwise = true;
    qtx::kernels::QuantizedBuffers kb;
    kb.rowwise_data = static_cast<uint8_t*>(d_out) + offsets[0];
    kb.rowwise_scale_inv = reinterpret_cast<float*>(static_cast<uint8_t*>(d_out) + offsets[1]);
    kb.columnwise_data = static_cast<uint8_t*>(d_out) + offsets[2];
    kb.columnwise_scale_inv = reinterpret_cast<float*>(static_cast<uint8_t*>(d_out) + offsets[3]);
    const int iters = mib >= 64 ? std::max(50, flags.iters / 3) : flags.iters;
    std::vector<double> kern_host, kern_gpu;
    for (int i = 0; i < iters + 10; ++i) {
      const auto t0 = Clock::now();
      QTX_BENCH_CHECK_CUDA(cudaEventRecord(ev0, stream));
      QTX_BENCH_CHECK_CUDA(qtx::kernels::cuda::QuantizeBlock(
          d_in, qtx::kernels::InputDType::kBFloat16, m, n, params, kb, stream));
      QTX_BENCH_CHECK_CUDA(cudaEventRecord(ev1, stream));
      QTX_BENCH_CHECK_CUDA(cudaStreamSynchronize(stream));
      const auto t1 = Clock::now();
      float ms = 0;
      QTX_BENCH_CHECK_CUDA(cudaEventElapsedTime(&ms, ev0, ev1));
      if (i >= 10) {
        kern_host.push_back(Us(t0, t1));
        kern_gpu.push_back(ms * 1000.0);
      }
    }
    const Stats ks = Summarize(kern_host);
    const Stats kg = Summarize(kern_gpu);

    for (int with_events = 0; with_events < 2; ++with_events) {
      qtx::CallOptions call;
      if (with_events) {
        call.cuda_wait_event = ready->handle();
        call.cuda_signal_event = done->handle();
      }
      std::vector<double> rpc;
      for (int i = 0; i < iters + 10; ++i) {
        const auto t0 = Clock::now();
        if (with_events) QTX_BENCH_CHECK_CUDA(cudaEventRecord(ready->get(), stream));
        auto q = client->Quantize(input, config, outs, call);
        QTX_BENCH_CHECK_OK(q.status());
        if (with_events) {
          // Complete when the client's stream has seen the sidecar's event.
          QTX_BENCH_CHECK_CUDA(cudaStreamWaitEvent(stream, done->get(), 0));
          QTX_BENCH_CHECK_CUDA(cudaStreamSynchronize(stream));
        }
        if (i >= 10) rpc.push_back(Us(t0, Clock::now()));
      }
      const Stats rs = Summarize(rpc);
      std::printf(
          "{\"bench\":\"service_overhead\",\"case\":\"quantize_1d_row+col_bf16\",\"mps\":%d,"
          "\"events\":%s,\"bytes\":%lld,\"m\":%lld,\"n\":%lld,\"iters\":%d,"
          "\"rpc_p50_us\":%.2f,\"rpc_p99_us\":%.2f,\"kernel_p50_us\":%.2f,"
          "\"kernel_p99_us\":%.2f,\"kernel_gpu_p50_us\":%.2f,\"overhead_p50_us\":%.2f,"
          "\"overhead_p99_us\":%.2f,\"target_overhead_p50_us\":40,\"label\":\"%s\"}\n",
          flags.mps, with_events ? "true" : "false", static_cast<long long>(bytes),
          static_cast<long long>(m), static_cast<long long>(n), iters, rs.p50, rs.p99, ks.p50,
          ks.p99, kg.p50, rs.p50 - ks.p50, rs.p99 - ks.p99, flags.label.c_str());
      std::fflush(stdout);
      std::fprintf(stderr, "%-6lld %-7s %10.1f %10.1f %10.1f %10.1f %12.1f %12.1f %12.1f\n",
                   static_cast<long long>(mib), with_events ? "yes" : "no", rs.p50, rs.p99, ks.p50,
                   ks.p99, kg.p50, rs.p50 - ks.p50, rs.p99 - ks.p99);
    }
    QTX_BENCH_CHECK_OK(client->UnregisterRegion(in_name));
    QTX_BENCH_CHECK_OK(client->UnregisterRegion(out_name));
    QTX_BENCH_CHECK_CUDA(cudaFree(d_in));
    QTX_BENCH_CHECK_CUDA(cudaFree(d_out));
  }
  client.reset();
  server.reset();
  return 0;
}
