// Host AdamW step throughput (kernels/cpu/adamw.h) with FP8 BLOCK_2D output
// (rowwise + columnwise), at 1..N OpenMP threads, next to a plain memcpy
// bandwidth measured in the same run. Plain main; one JSON object per line:
//   {"bench":"adamw_cpu","m":..,"n":..,"threads":..,"moments":"fp32","grad":"bf16",
//    "time_ms":..,"params_per_s":..,"bytes_moved_gbps":..}
//   {"bench":"memcpy","bytes":..,"threads":..,"gbps":..}
// bytes_moved counts the step's compulsory traffic: read+write master (8 B),
// read+write both moments (4*mb B), read the gradient (2 or 4 B), write FP8
// row+col (2 B).
// "isa" is the band kernel's instruction set (kernels/cpu/adamw.h BandIsa:
// "avx512" where the CPU has it, else "baseline"; QTX_ADAMW_ISA=baseline
// forces the baseline AVX2 kernel).
// Usage: optimizer_cpu_bench [m n] [max_threads] [reps] [bf16|fp32 (gradient dtype)]
// bench/optimizer_vs_torch.py runs it next to torch's CPU AdamW.
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "kernels/block_geometry.h"
#include "kernels/cpu/adamw.h"
#include "kernels/fp8.h"

namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

double MemcpyGbps(size_t bytes, int threads, int reps) {
  std::vector<char> src(bytes, 1), dst(bytes, 0);
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = Clock::now();
#pragma omp parallel num_threads(threads)
    {
      const int t = omp_get_thread_num(), nt = omp_get_num_threads();
      const size_t chunk = (bytes + nt - 1) / nt;
      const size_t lo = std::min(bytes, chunk * t), hi = std::min(bytes, lo + chunk);
      std::memcpy(dst.data() + lo, src.data() + lo, hi - lo);
    }
    best = std::min(best, Seconds(t0, Clock::now()));
  }
  return 2.0 * bytes / best / 1e9;  // read + write
}

}  // namespace

int main(int argc, char** argv) {
  using namespace qtx::kernels;
  const int64_t m = argc > 2 ? std::atoll(argv[1]) : 4096;
  const int64_t n = argc > 2 ? std::atoll(argv[2]) : 4096;
  const int max_threads = argc > 3 ? std::atoi(argv[3]) : omp_get_max_threads();
  const int reps = argc > 4 ? std::atoi(argv[4]) : 5;
  const bool grad_fp32 = argc > 5 && std::strcmp(argv[5], "fp32") == 0;
  if (argc > 5 && !grad_fp32 && std::strcmp(argv[5], "bf16") != 0) {
    std::fprintf(stderr, "gradient dtype '%s': must be bf16 or fp32\n", argv[5]);
    return 2;
  }
  const int64_t count = m * n;
  std::vector<float> master(count), m1(count, 0.0f), m2(count, 0.0f);
  std::vector<uint16_t> grad(count);
  std::vector<float> grad32(count);
  std::mt19937 rng(1);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (int64_t i = 0; i < count; ++i) {
    master[i] = nd(rng) * 0.02f;
    grad32[i] = nd(rng) * 1e-3f;
    grad[i] = FloatToBf16(grad32[i]);
  }
  QuantizeParams q;
  q.scaling = BlockScaling::kBlock2D;
  q.rowwise = true;
  q.columnwise = true;
  const QuantizedLayout l = ComputeLayout(q.scaling, m, n);
  std::vector<uint8_t> row(l.RowwiseDataBytes()), col(l.ColumnwiseDataBytes());
  std::vector<float> rs(l.RowwiseScaleCount()), cs(l.ColumnwiseScaleCount());
  cpu::AdamWParamBuffers b;
  b.m = m;
  b.n = n;
  b.master = master.data();
  b.exp_avg = m1.data();
  b.exp_avg_sq = m2.data();
  b.grad = grad_fp32 ? static_cast<const void*>(grad32.data()) : grad.data();
  b.grad_dtype = grad_fp32 ? InputDType::kFloat32 : InputDType::kBFloat16;
  b.quant = q;
  b.fp8 = {row.data(), rs.data(), col.data(), cs.data()};
  const double bytes_moved = count * (8.0 + 2 * 8.0 + (grad_fp32 ? 4.0 : 2.0) + 2.0);
  int64_t step = 0;
  for (int threads = 1; threads <= max_threads; threads *= 2) {
    cpu::AdamWStepFused({&b, 1}, MakeAdamWScalars(AdamWHyperParams{}, ++step, 1.0), threads);
    double best = 1e30;
    for (int r = 0; r < reps; ++r) {
      const auto t0 = Clock::now();
      cpu::AdamWStepFused({&b, 1}, MakeAdamWScalars(AdamWHyperParams{}, ++step, 1.0), threads);
      best = std::min(best, Seconds(t0, Clock::now()));
    }
    std::printf(
        "{\"bench\":\"adamw_cpu\",\"m\":%lld,\"n\":%lld,\"threads\":%d,\"moments\":\"fp32\","
        "\"grad\":\"%s\",\"output\":\"fp8_2d_row_col\",\"time_ms\":%.3f,\"params_per_s\":%.4g,"
        "\"bytes_moved_gbps\":%.3f,\"isa\":\"%s\"}\n",
        static_cast<long long>(m), static_cast<long long>(n), threads, grad_fp32 ? "fp32" : "bf16",
        best * 1e3, count / best, bytes_moved / best / 1e9,
        cpu::internal::ActiveBandIsa() == cpu::internal::BandIsa::kAvx512 ? "avx512" : "baseline");
    std::printf("{\"bench\":\"memcpy\",\"bytes\":%lld,\"threads\":%d,\"gbps\":%.3f}\n",
                static_cast<long long>(count * 4), threads,
                MemcpyGbps(static_cast<size_t>(count) * 4, threads, reps));
    std::fflush(stdout);
    if (threads < max_threads && threads * 2 > max_threads) threads = max_threads / 2;
  }
  return 0;
}
