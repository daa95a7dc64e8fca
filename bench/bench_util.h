// What every benchmark needs: fail-fast checks (a benchmark that cannot do
// what it measures prints where and why and exits 1, so a broken run never
// prints numbers) and percentiles. QTX_BENCH_CHECK_CUDA expands to
// cudaGetErrorString: use it only in files that include the CUDA runtime.
//
// QTX_BENCH_CHECK_* exit the process (std::exit, which unwinds no stack):
// use them only on the main thread, and only where nothing has to be undone
// (child processes, shm regions). Worker threads, and code that owns child
// processes, hand the error up instead with QTX_BENCH_RETURN_IF_ERROR /
// QTX_BENCH_ASSIGN_OR_RETURN (the error names the file, line and expression,
// like a check's message) to where the workers are joined; main then returns
// non-zero and the destructors stop the children and free the regions.
// std::exit from a worker races the threads still running (static
// destructors under live threads: a crash) and leaves the children running.
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
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "common/status_macros.h"

namespace qtx::bench {

[[noreturn]] inline void CheckFailed(const char* file, int line, const char* expr,
                                     const std::string& why) {
  std::fprintf(stderr, "%s:%d %s: %s\n", file, line, expr, why.c_str());
  std::exit(1);
}

// `status` with "file:line expr: " in front of its message (OK stays OK).
inline absl::Status AtCheck(const absl::Status& status, const char* file, int line,
                            const char* expr) {
  if (status.ok()) return status;
  return absl::Status(status.code(),
                      absl::StrCat(file, ":", line, " ", expr, ": ", status.message()));
}
template <typename T>
absl::StatusOr<T> AtCheck(absl::StatusOr<T> v, const char* file, int line, const char* expr) {
  if (v.ok()) return v;
  return AtCheck(v.status(), file, line, expr);
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

// Return the error of `expr` (absl::Status, or the status of an
// absl::StatusOr for the _ASSIGN_ form) from the enclosing function, which
// returns absl::Status or absl::StatusOr, marked with where it failed.
#define QTX_BENCH_RETURN_IF_ERROR(expr) \
  QTX_RETURN_IF_ERROR(::qtx::bench::AtCheck((expr), __FILE__, __LINE__, #expr))
#define QTX_BENCH_ASSIGN_OR_RETURN(lhs, expr) \
  QTX_ASSIGN_OR_RETURN(lhs, ::qtx::bench::AtCheck((expr), __FILE__, __LINE__, #expr))

#endif  // QTX_BENCH_BENCH_UTIL_H_
