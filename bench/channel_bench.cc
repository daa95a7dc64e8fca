// channel_bench: what a stream-ordered qtx::Channel costs a training process
// on one GPU (issue "Stream-ordered asynchronous calls"). Starts qtxd
// --device=cuda:0 (--qtxd=<path>) and prints JSON lines:
//   {"bench":"channel_call", ...}   host time of one asynchronous Quantize
//                                    call (p50/p99 over the chain's calls)
//   {"bench":"channel_chain", ...}  GPU time of `layers` x (a [m, k] BF16
//                                    1-D row+col Quantize, then a [m x k] x
//                                    [k x k] BF16 cuBLAS GEMM that reads
//                                    nothing from it) on the caller's stream,
//                                    three ways in the same run: the quantize
//                                    launched in-process (baseline), through
//                                    the channel, through today's synchronous
//                                    Quantize with interprocess events; with
//                                    ratios against the baseline.
//   {"bench":"channel_allgather", ...}  with --allgather=1: host time of one
//                                    channel AllGather call (one-rank NCCL
//                                    group, [m, k] BF16 1-D row+col, EXACT_FP8)
//                                    and the wall time of `layers` of them to
//                                    Synchronize(), next to the same number of
//                                    synchronous AllGather calls.
// MPS is the caller's business (scripts/gpu_channel.sh runs it both ways and
// says which in "mps").
//   channel_bench --qtxd=PATH [--layers=200] [--m=8192] [--k=4096] [--mps=0|1]
//                 [--flags=host|device]   (where the channel's flag words live)
//                 [--allgather=0|1]
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "kernels/block_geometry.h"
#include "kernels/cuda/quantize_block.h"
#include "qtx/channel.h"
#include "qtx/client.h"
#include "qtx/cuda_channel.h"
#include "qtx/cuda_ipc.h"
#include "tests/testing/qtxd_process.h"

namespace {

#define CHECK_CUDA(expr)                                               \
  do {                                                                 \
    const cudaError_t e_ = (expr);                                     \
    if (e_ != cudaSuccess) {                                           \
      std::fprintf(stderr, "%s: %s\n", #expr, cudaGetErrorString(e_)); \
      std::exit(1);                                                    \
    }                                                                  \
  } while (0)
#define CHECK_OK(expr)                                                \
  do {                                                                \
    const absl::Status s_ = (expr);                                   \
    if (!s_.ok()) {                                                   \
      std::fprintf(stderr, "%s: %s\n", #expr, s_.ToString().c_str()); \
      std::exit(1);                                                   \
    }                                                                 \
  } while (0)

double Percentile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(q * (v.size() - 1) + 0.5))];
}

}  // namespace

int main(int argc, char** argv) {
  std::string qtxd;
  int layers = 200;
  int64_t m = 8192, k = 4096;
  int mps = -1;
  std::string flag_memory = "host";
  bool allgather = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (absl::StartsWith(a, "--qtxd=")) qtxd = a.substr(7);
    if (absl::StartsWith(a, "--layers=")) layers = std::atoi(a.c_str() + 9);
    if (absl::StartsWith(a, "--m=")) m = std::atoll(a.c_str() + 4);
    if (absl::StartsWith(a, "--k=")) k = std::atoll(a.c_str() + 4);
    if (absl::StartsWith(a, "--mps=")) mps = std::atoi(a.c_str() + 6);
    if (absl::StartsWith(a, "--flags=")) flag_memory = a.substr(8);
    if (absl::StartsWith(a, "--allgather=")) allgather = std::atoi(a.c_str() + 12) != 0;
  }
  if (qtxd.empty()) {
    std::fprintf(stderr, "usage: channel_bench --qtxd=PATH [--layers=N] [--m=M] [--k=K]\n");
    return 2;
  }
  auto server = qtx::testing::QtxdProcess::Start(qtxd, {"--device=cuda:0", "--allow_client_shm"});
  CHECK_OK(server.status());
  auto client = qtx::Client::Connect((*server)->target());
  CHECK_OK(client.status());

  CHECK_CUDA(cudaSetDevice(0));
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cublasHandle_t blas;
  if (cublasCreate(&blas) != CUBLAS_STATUS_SUCCESS) return 1;
  cublasSetStream(blas, stream);

  // Quantize operands in one registered allocation; GEMM operands apart.
  qtx::kernels::QuantizeParams params;
  params.rowwise = params.columnwise = true;
  const qtx::kernels::QuantizedLayout layout = qtx::kernels::ComputeLayout(params.scaling, m, k);
  const uint64_t sizes[5] = {static_cast<uint64_t>(m * k * 2),
                             static_cast<uint64_t>(layout.RowwiseDataBytes()),
                             static_cast<uint64_t>(layout.RowwiseScaleCount() * 4),
                             static_cast<uint64_t>(layout.ColumnwiseDataBytes()),
                             static_cast<uint64_t>(layout.ColumnwiseScaleCount() * 4)};
  uint64_t offsets[5], total = 0;
  for (int i = 0; i < 5; ++i) {
    offsets[i] = total;
    total += (sizes[i] + 255) / 256 * 256;
  }
  char* arena = nullptr;
  CHECK_CUDA(cudaMalloc(reinterpret_cast<void**>(&arena), total));
  CHECK_CUDA(cudaMemset(arena, 0x11, total));
  CHECK_OK(qtx::cuda::RegisterDevicePointer(**client, "bench-arena", arena, total));
  auto slice = [&](int i) { return qtx::RegionSlice{"bench-arena", offsets[i], sizes[i]}; };
  const qtx::Tensor input = qtx::Tensor::InRegion(qtx::DType::kBFloat16, {m, k}, slice(0));
  qtx::QuantizeOutputs outputs;
  outputs.rowwise_data = slice(1);
  outputs.rowwise_scale_inv = slice(2);
  outputs.columnwise_data = slice(3);
  outputs.columnwise_scale_inv = slice(4);
  qtx::QuantizeConfig config;
  config.columnwise = true;
  qtx::kernels::QuantizedBuffers out_buffers;
  out_buffers.rowwise_data = reinterpret_cast<uint8_t*>(arena + offsets[1]);
  out_buffers.rowwise_scale_inv = reinterpret_cast<float*>(arena + offsets[2]);
  out_buffers.columnwise_data = reinterpret_cast<uint8_t*>(arena + offsets[3]);
  out_buffers.columnwise_scale_inv = reinterpret_cast<float*>(arena + offsets[4]);

  void *ga, *gb, *gc;
  CHECK_CUDA(cudaMalloc(&ga, m * k * 2));
  CHECK_CUDA(cudaMalloc(&gb, k * k * 2));
  CHECK_CUDA(cudaMalloc(&gc, m * k * 2));
  CHECK_CUDA(cudaMemset(ga, 0x3c, m * k * 2));
  CHECK_CUDA(cudaMemset(gb, 0x3c, k * k * 2));
  const float alpha = 1.0f, beta = 0.0f;
  auto gemm = [&] {
    if (cublasGemmEx(blas, CUBLAS_OP_N, CUBLAS_OP_N, static_cast<int>(k), static_cast<int>(m),
                     static_cast<int>(k), &alpha, gb, CUDA_R_16BF, static_cast<int>(k), ga,
                     CUDA_R_16BF, static_cast<int>(k), &beta, gc, CUDA_R_16BF, static_cast<int>(k),
                     CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT) != CUBLAS_STATUS_SUCCESS) {
      std::fprintf(stderr, "cublasGemmEx failed\n");
      std::exit(1);
    }
  };
  auto in_process = [&] {
    CHECK_CUDA(qtx::kernels::cuda::QuantizeBlock(arena + offsets[0],
                                                 qtx::kernels::InputDType::kBFloat16, m, k, params,
                                                 out_buffers, stream));
  };

  auto channel = qtx::cuda::OpenChannel(
      **client, stream, {.label = "channel_bench"},
      flag_memory == "device" ? qtx::cuda::FlagMemory::kDevice : qtx::cuda::FlagMemory::kHostShm);
  CHECK_OK(channel.status());
  auto ready = qtx::cuda::IpcEvent::Create();
  auto done = qtx::cuda::IpcEvent::Create();
  CHECK_OK(ready.status());
  CHECK_OK(done.status());

  cudaEvent_t t0, t1;
  CHECK_CUDA(cudaEventCreate(&t0));
  CHECK_CUDA(cudaEventCreate(&t1));
  std::vector<double> call_us;
  // Runs `layers` x (quantize(mode), gemm) and returns the GPU ms.
  auto chain = [&](int mode, bool record_calls) -> double {
    CHECK_CUDA(cudaStreamSynchronize(stream));
    CHECK_CUDA(cudaEventRecord(t0, stream));
    for (int l = 0; l < layers; ++l) {
      if (mode == 0) {
        in_process();
      } else if (mode == 1) {
        const absl::Time c0 = absl::Now();
        auto op = (*channel)->Quantize(input, config, outputs);
        const absl::Time c1 = absl::Now();
        CHECK_OK(op.status());
        if (record_calls) call_us.push_back(absl::ToDoubleMicroseconds(c1 - c0));
      } else {
        CHECK_CUDA(cudaEventRecord(ready->get(), stream));
        qtx::CallOptions call;
        call.cuda_wait_event = ready->handle();
        call.cuda_signal_event = done->handle();
        const absl::Time c0 = absl::Now();
        CHECK_OK((*client)->Quantize(input, config, outputs, call).status());
        if (record_calls) call_us.push_back(absl::ToDoubleMicroseconds(absl::Now() - c0));
        CHECK_CUDA(cudaStreamWaitEvent(stream, done->get(), 0));
      }
      gemm();
    }
    CHECK_CUDA(cudaEventRecord(t1, stream));
    CHECK_CUDA(cudaEventSynchronize(t1));
    if (mode == 1) CHECK_OK((*channel)->Synchronize());
    float ms = 0;
    CHECK_CUDA(cudaEventElapsedTime(&ms, t0, t1));
    return ms;
  };

  const char* mode_names[3] = {"in_process", "channel", "sync_events"};
  // Warm-up of every path, then alternating rounds.
  for (int mode = 0; mode < 3; ++mode) chain(mode, false);
  const int rounds = 3;
  std::vector<double> best(3, 1e30);
  std::vector<double> channel_calls, sync_calls;
  for (int r = 0; r < rounds; ++r) {
    for (int mode = 0; mode < 3; ++mode) {
      call_us.clear();
      const double ms = chain(mode, true);
      best[mode] = std::min(best[mode], ms);
      if (mode == 1) channel_calls.insert(channel_calls.end(), call_us.begin(), call_us.end());
      if (mode == 2) sync_calls.insert(sync_calls.end(), call_us.begin(), call_us.end());
    }
  }
  std::printf(
      "{\"bench\":\"channel_call\",\"flags\":\"%s\",\"mps\":%d,\"m\":%lld,\"k\":%lld,\"calls\":%zu,"
      "\"host_us_p50\":%.2f,\"host_us_p99\":%.2f,\"sync_call_host_us_p50\":%.2f,"
      "\"sync_call_host_us_p99\":%.2f}\n",
      flag_memory.c_str(), mps, static_cast<long long>(m), static_cast<long long>(k),
      channel_calls.size(), Percentile(channel_calls, 0.5), Percentile(channel_calls, 0.99),
      Percentile(sync_calls, 0.5), Percentile(sync_calls, 0.99));
  for (int mode = 0; mode < 3; ++mode) {
    std::printf(
        "{\"bench\":\"channel_chain\",\"mode\":\"%s\",\"flags\":\"%s\",\"mps\":%d,\"layers\":%d,"
        "\"m\":%lld,"
        "\"k\":%lld,\"gpu_ms\":%.3f,\"per_layer_us\":%.2f,\"ratio_vs_in_process\":%.4f}\n",
        mode_names[mode], flag_memory.c_str(), mps, layers, static_cast<long long>(m),
        static_cast<long long>(k), best[mode], best[mode] * 1000.0 / layers, best[mode] / best[0]);
  }
  if (allgather) {
    // One-rank NCCL group on this GPU: the channel's AllGather only enqueues
    // on the server, so the host time per call is the submission's, and the
    // calls overlap; the synchronous call returns when its outputs exist.
    qtx::CollectiveGroupConfig group;
    group.name = "bench-solo";
    group.world_size = 1;
    group.backend = qtx::CommBackend::kNccl;
    CHECK_OK((*client)->CreateGroup(group).status());
    uint64_t sequence = 0;
    std::vector<double> ag_calls, ag_sync_calls;
    double ag_wall_ms[2] = {1e30, 1e30};
    for (int r = 0; r < rounds + 1; ++r) {  // round 0 warms up
      CHECK_CUDA(cudaStreamSynchronize(stream));
      const absl::Time w0 = absl::Now();
      for (int l = 0; l < layers; ++l) {
        const absl::Time c0 = absl::Now();
        auto op = (*channel)->AllGather("bench-solo", sequence++, input, config,
                                        qtx::AllGatherMode::kExactFp8, outputs);
        const absl::Time c1 = absl::Now();
        CHECK_OK(op.status());
        if (r > 0) ag_calls.push_back(absl::ToDoubleMicroseconds(c1 - c0));
      }
      CHECK_OK((*channel)->Synchronize());
      if (r > 0)
        ag_wall_ms[0] = std::min(ag_wall_ms[0], absl::ToDoubleMilliseconds(absl::Now() - w0));
      CHECK_CUDA(cudaStreamSynchronize(stream));
      const absl::Time s0 = absl::Now();
      for (int l = 0; l < layers; ++l) {
        const absl::Time c0 = absl::Now();
        CHECK_OK((*client)
                     ->AllGather("bench-solo", sequence++, input, config,
                                 qtx::AllGatherMode::kExactFp8, outputs)
                     .status());
        if (r > 0) ag_sync_calls.push_back(absl::ToDoubleMicroseconds(absl::Now() - c0));
      }
      if (r > 0)
        ag_wall_ms[1] = std::min(ag_wall_ms[1], absl::ToDoubleMilliseconds(absl::Now() - s0));
    }
    std::printf(
        "{\"bench\":\"channel_allgather\",\"flags\":\"%s\",\"mps\":%d,\"ranks\":1,\"m\":%lld,"
        "\"k\":%lld,\"calls\":%d,\"host_us_p50\":%.2f,\"host_us_p99\":%.2f,"
        "\"wall_ms\":%.3f,\"sync_call_host_us_p50\":%.2f,\"sync_call_host_us_p99\":%.2f,"
        "\"sync_wall_ms\":%.3f,\"wall_ratio_channel_vs_sync\":%.4f}\n",
        flag_memory.c_str(), mps, static_cast<long long>(m), static_cast<long long>(k), layers,
        Percentile(ag_calls, 0.5), Percentile(ag_calls, 0.99), ag_wall_ms[0],
        Percentile(ag_sync_calls, 0.5), Percentile(ag_sync_calls, 0.99), ag_wall_ms[1],
        ag_wall_ms[0] / ag_wall_ms[1]);
    CHECK_OK((*client)->DestroyGroup("bench-solo"));
  }
  CHECK_OK((*channel)->Close());
  channel->reset();
  (void)(*client)->UnregisterRegion("bench-arena");
  cublasDestroy(blas);
  return 0;
}
