// CPU reference quantizer throughput, next to a memcpy of the same byte count
// measured in the same run. JSON lines on stdout (bench/README.md).
//   quantize_cpu_bench [--benchmark_filter=...] [--benchmark_min_time=0.2]
#include <benchmark/benchmark.h>
#include <omp.h>

#include <cstring>
#include <random>
#include <vector>

#include "bench/json_lines_reporter.h"
#include "kernels/cpu/quantize_block.h"
#include "kernels/fp8.h"

namespace qtx::bench {
namespace {

using kernels::BlockScaling;
using kernels::InputDType;

struct Shape {
  int64_t m, n;
};

std::vector<uint16_t> RandomBf16(int64_t count) {
  std::mt19937 rng(1);
  std::normal_distribution<float> d(0, 1);
  std::vector<uint16_t> v(count);
  for (auto& e : v) e = kernels::FloatToBf16(d(rng));
  return v;
}

// Bytes moved by one quantization: input read + every output written.
int64_t BytesMoved(const kernels::QuantizedLayout& l, const kernels::QuantizeParams& p,
                   int64_t in_bytes) {
  int64_t b = in_bytes;
  if (p.rowwise) b += l.RowwiseDataBytes() + 4 * l.RowwiseScaleCount();
  if (p.columnwise) b += l.ColumnwiseDataBytes() + 4 * l.ColumnwiseScaleCount();
  return b;
}

void BM_Quantize(benchmark::State& state, Shape s, BlockScaling scaling, bool row, bool col) {
  const auto x = RandomBf16(s.m * s.n);
  const kernels::QuantizeParams p{scaling, kernels::Fp8Format::kE4M3, row, col, true, 0.0f};
  const auto l = kernels::ComputeLayout(scaling, s.m, s.n);
  std::vector<uint8_t> rd(l.RowwiseDataBytes()), cd(l.ColumnwiseDataBytes());
  std::vector<float> rs(l.RowwiseScaleCount()), cs(l.ColumnwiseScaleCount());
  for (auto _ : state) {
    kernels::cpu::QuantizeBlock(x.data(), InputDType::kBFloat16, s.m, s.n, p,
                                {rd.data(), rs.data(), cd.data(), cs.data()});
    benchmark::DoNotOptimize(rd.data());
    benchmark::DoNotOptimize(cd.data());
  }
  const int64_t bytes = BytesMoved(l, p, 2 * s.m * s.n);
  state.counters["m"] = static_cast<double>(s.m);
  state.counters["n"] = static_cast<double>(s.n);
  state.counters["threads"] = omp_get_max_threads();
  state.counters["bytes"] = static_cast<double>(bytes);
  state.counters["gbps"] = benchmark::Counter(static_cast<double>(bytes) * 1e-9,
                                              benchmark::Counter::kIsIterationInvariantRate);
  state.SetLabel(std::string(scaling == BlockScaling::kBlock1D ? "1d" : "2d") + "/" +
                 (row && col ? "row+col"
                  : row      ? "row"
                             : "col"));
}

// The baseline: memcpy of (input + output) bytes / 2 each way, i.e. the same
// number of bytes read and written as the quantization above at row+col.
void BM_Memcpy(benchmark::State& state, Shape s) {
  const int64_t bytes = 2 * s.m * s.n;  // read 2 B/elem, write 2 B/elem (row+col FP8)
  std::vector<uint8_t> a(bytes, 1), b(bytes);
  for (auto _ : state) {
    std::memcpy(b.data(), a.data(), bytes);
    benchmark::DoNotOptimize(b.data());
  }
  state.counters["m"] = static_cast<double>(s.m);
  state.counters["n"] = static_cast<double>(s.n);
  state.counters["bytes"] = static_cast<double>(2 * bytes);
  state.counters["gbps"] =
      benchmark::Counter(2.0 * bytes * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.SetLabel("memcpy");
}

void Register() {
  for (Shape s : {Shape{1024, 1024}, Shape{4096, 4096}, Shape{2000, 7168}}) {
    const std::string shape = std::to_string(s.m) + "x" + std::to_string(s.n);
    benchmark::RegisterBenchmark(("memcpy/" + shape).c_str(), BM_Memcpy, s)
        ->Unit(benchmark::kMicrosecond)
        ->UseRealTime();
    for (BlockScaling sc : {BlockScaling::kBlock1D, BlockScaling::kBlock2D}) {
      const std::string mode = sc == BlockScaling::kBlock1D ? "1d" : "2d";
      for (auto [row, col, usage] :
           {std::tuple{true, true, "row+col"}, std::tuple{true, false, "row"},
            std::tuple{false, true, "col"}}) {
        benchmark::RegisterBenchmark(("quantize/" + mode + "/" + usage + "/" + shape).c_str(),
                                     BM_Quantize, s, sc, row, col)
            ->Unit(benchmark::kMicrosecond)
            ->UseRealTime();
      }
    }
  }
}

}  // namespace
}  // namespace qtx::bench

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  qtx::bench::Register();
  qtx::bench::JsonLinesReporter reporter("quantize_cpu");
  benchmark::RunSpecifiedBenchmarks(&reporter);
  benchmark::Shutdown();
  return 0;
}
