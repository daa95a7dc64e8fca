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
// forces the baseline AVX2 kernel). "band" is the band kernel's configuration
// (kernels/cpu/adamw.h BandConfig: unit width, update order, prefetch rows,
// encode schedule), also split into "unit_cols", "update", "prefetch_rows",
// "encode"; "default" says whether it is the starting configuration (the
// built-in default, or QTX_ADAMW_* from the environment, then --band).
// Usage: optimizer_cpu_bench [m n] [max_threads] [reps] [bf16|fp32 (gradient dtype)]
//            [--band=SPEC] [--sweep[=SPEC;SPEC;...]]
//   --band=SPEC  run with this configuration (ParseBandConfig syntax, e.g.
//                cols=1024,update=row,prefetch=0,encode=deferred; unset keys keep
//                the active configuration, i.e. the defaults or QTX_ADAMW_* env)
//   --sweep      at each thread count, one "adamw_cpu" line per configuration of
//                DefaultSweep() (64: cols 512|1024|2048|full x update tile|row x
//                prefetch 0|1|2|4 x encode deferred|immediate), in that order, each
//                the best of `reps` steps after one warm-up step; --sweep=A;B;...
//                sweeps the given ones (each applied on top of the starting
//                configuration).
// bench/optimizer_vs_torch.py runs it next to torch's CPU AdamW.
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
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

// Every unit width x update order x prefetch x encode schedule that the
// GPU-host sweep compares (the library default, kernels/cpu/adamw.h
// BandConfig, is cols=full,update=tile,prefetch=2,encode=immediate).
std::vector<std::string> DefaultSweep() {
  std::vector<std::string> out;
  for (const char* cols : {"512", "1024", "2048", "full"}) {
    for (const char* update : {"tile", "row"}) {
      for (const char* pf : {"0", "1", "2", "4"}) {
        for (const char* enc : {"deferred", "immediate"}) {
          out.push_back(std::string("cols=") + cols + ",update=" + update + ",prefetch=" + pf +
                        ",encode=" + enc);
        }
      }
    }
  }
  return out;
}

std::vector<std::string> SplitSemicolons(const std::string& s) {
  std::vector<std::string> out;
  size_t a = 0;
  while (a <= s.size()) {
    const size_t b = std::min(s.find(';', a), s.size());
    if (b > a) out.push_back(s.substr(a, b - a));
    a = b + 1;
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace qtx::kernels;
  namespace ci = cpu::internal;
  // Flags out of argv, the positional arguments stay.
  std::vector<std::string> configs;  // empty: the active configuration only
  bool sweep = false;
  {
    int out = 1;
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      if (a.rfind("--band=", 0) == 0) {
        ci::BandConfig c = ci::ActiveBandConfig();
        if (!ci::ParseBandConfig(a.substr(7), &c) || !ci::SetBandConfig(c)) {
          std::fprintf(stderr, "bad --band '%s' (kernels/cpu/adamw.h ParseBandConfig)\n",
                       a.c_str() + 7);
          return 2;
        }
      } else if (a == "--sweep") {
        sweep = true;
        configs = DefaultSweep();
      } else if (a.rfind("--sweep=", 0) == 0) {
        sweep = true;
        configs = SplitSemicolons(a.substr(8));
      } else if (a.rfind("--", 0) == 0) {
        std::fprintf(stderr, "unknown flag '%s'\n", a.c_str());
        return 2;
      } else {
        argv[out++] = argv[i];
      }
    }
    argc = out;
  }
  // Each swept configuration applied on top of the starting one (validated
  // before anything runs).
  const ci::BandConfig base_config = ci::ActiveBandConfig();
  std::vector<ci::BandConfig> parsed;
  for (const std::string& spec : configs) {
    ci::BandConfig c = base_config;
    if (!ci::ParseBandConfig(spec, &c)) {
      std::fprintf(stderr, "bad sweep entry '%s'\n", spec.c_str());
      return 2;
    }
    parsed.push_back(c);
  }
  if (sweep && parsed.empty()) {
    std::fprintf(stderr, "empty --sweep list\n");
    return 2;
  }
  if (!sweep) parsed.push_back(base_config);
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
    for (const ci::BandConfig& config : parsed) {
      ci::SetBandConfig(config);
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
          "\"bytes_moved_gbps\":%.3f,\"isa\":\"%s\",\"band\":\"%s\",\"unit_cols\":%lld,"
          "\"update\":\"%s\",\"prefetch_rows\":%d,\"encode\":\"%s\",\"sweep\":%s,"
          "\"default\":%s}\n",
          static_cast<long long>(m), static_cast<long long>(n), threads,
          grad_fp32 ? "fp32" : "bf16", best * 1e3, count / best, bytes_moved / best / 1e9,
          ci::ActiveBandIsa() == ci::BandIsa::kAvx512 ? "avx512" : "baseline",
          ci::BandConfigString(config).c_str(),
          static_cast<long long>(config.unit_tiles == 0 ? n : std::min(n, config.unit_tiles * kBlockLen)),
          config.row_update ? "row" : "tile", config.prefetch_rows,
          config.deferred_encode ? "deferred" : "immediate", sweep ? "true" : "false",
          ci::BandConfigString(config) == ci::BandConfigString(base_config) ? "true" : "false");
      std::fflush(stdout);
    }
    ci::SetBandConfig(base_config);
    std::printf("{\"bench\":\"memcpy\",\"bytes\":%lld,\"threads\":%d,\"gbps\":%.3f}\n",
                static_cast<long long>(count * 4), threads,
                MemcpyGbps(static_cast<size_t>(count) * 4, threads, reps));
    std::fflush(stdout);
    if (threads < max_threads && threads * 2 > max_threads) threads = max_threads / 2;
  }
  return 0;
}
