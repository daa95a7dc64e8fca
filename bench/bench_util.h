// What every benchmark needs: fail-fast checks (a benchmark that cannot do
// what it measures prints where and why and exits 1, so a broken run never
// prints numbers) and percentiles. QTX_BENCH_CHECK_CUDA expands to cudaGetErrorString: use it only
// in files that include the CUDA runtime.
#ifndef QTX_BENCH_BENCH_UTIL_H_
#define QTX_BENCH_BENCH_UTIL_H_

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <span>
#include <string>
#include <vector>

#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/string_view.h"

namespace qtx::bench {

[[noreturn]] inline void CheckFailed(const char* file, int line, const char* expr,
                                     const std::string& why) {
  std::fprintf(stderr, "%s:%d %s: %s\n", file, line, expr, why.c_str());
  std::exit(1);
}

// Parses the command line into the benchmark's ABSL_FLAGs (`usage` is what
// --help prints first); a misspelt flag or a stray argument exits 2.
inline void ParseBenchFlags(int argc, char** argv, absl::string_view usage) {
  absl::SetProgramUsageMessage(usage);
  const std::vector<char*> rest = absl::ParseCommandLine(argc, argv);
  if (rest.size() > 1) {
    std::fprintf(stderr, "%s: unexpected argument '%s' (flags are --name=value)\n", rest[0],
                 rest[1]);
    std::exit(2);
  }
}

// The integers of a list flag ("1,4,16"); a bad item exits 2 naming it.
inline std::vector<int64_t> IntList(const char* flag, const std::vector<std::string>& items) {
  std::vector<int64_t> out;
  for (const std::string& item : items) {
    int64_t v = 0;
    if (!absl::SimpleAtoi(item, &v)) {
      std::fprintf(stderr, "--%s: '%s' is not an integer\n", flag, item.c_str());
      std::exit(2);
    }
    out.push_back(v);
  }
  return out;
}

// The q-quantile (0 <= q <= 1) of `v` by the nearest-rank rule; 0 when empty.
inline double Percentile(std::span<const double> samples, double q) {
  if (samples.empty()) return 0;
  std::vector<double> v(samples.begin(), samples.end());
  const size_t k =
      std::min(v.size() - 1, static_cast<size_t>(q * static_cast<double>(v.size() - 1) + 0.5));
  std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(k), v.end());
  return v[k];
}

}  // namespace qtx::bench

#define QTX_BENCH_CHECK_OK(expr)                                                     \
  do {                                                                               \
    const absl::Status qtx_bench_s_ = (expr);                                        \
    if (!qtx_bench_s_.ok()) {                                                        \
      ::qtx::bench::CheckFailed(__FILE__, __LINE__, #expr, qtx_bench_s_.ToString()); \
    }                                                                                \
  } while (0)

#define QTX_BENCH_CHECK_CUDA(expr)                                                            \
  do {                                                                                        \
    const cudaError_t qtx_bench_e_ = (expr);                                                  \
    if (qtx_bench_e_ != cudaSuccess) {                                                        \
      ::qtx::bench::CheckFailed(__FILE__, __LINE__, #expr, cudaGetErrorString(qtx_bench_e_)); \
    }                                                                                         \
  } while (0)

#endif  // QTX_BENCH_BENCH_UTIL_H_
