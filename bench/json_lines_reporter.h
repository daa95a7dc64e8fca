// A Google Benchmark reporter that prints one JSON object per run (JSON
// lines) on stdout, with units in the key names; see bench/README.md.
#ifndef QTX_BENCH_JSON_LINES_REPORTER_H_
#define QTX_BENCH_JSON_LINES_REPORTER_H_

#include <benchmark/benchmark.h>

#include <cstdio>
#include <string>
#include <vector>

namespace qtx::bench {

class JsonLinesReporter : public benchmark::BenchmarkReporter {
 public:
  // `bench` names the family; every counter of a run becomes a key.
  explicit JsonLinesReporter(std::string bench) : bench_(std::move(bench)) {}

  bool ReportContext(const Context&) override { return true; }

  void ReportRuns(const std::vector<Run>& runs) override {
    for (const Run& r : runs) {
      if (r.error_occurred) {
        std::printf("{\"bench\":\"%s\",\"name\":\"%s\",\"error\":\"%s\"}\n", bench_.c_str(),
                    r.benchmark_name().c_str(), r.error_message.c_str());
        continue;
      }
      const double time_us =
          r.GetAdjustedRealTime() * (r.time_unit == benchmark::kNanosecond    ? 1e-3
                                     : r.time_unit == benchmark::kMicrosecond ? 1.0
                                     : r.time_unit == benchmark::kMillisecond ? 1e3
                                                                              : 1e6);
      std::printf("{\"bench\":\"%s\",\"name\":\"%s\",\"time_us\":%.3f,\"iterations\":%lld",
                  bench_.c_str(), r.benchmark_name().c_str(), time_us,
                  static_cast<long long>(r.iterations));
      if (!r.report_label.empty()) std::printf(",\"label\":\"%s\"", r.report_label.c_str());
      for (const auto& [key, counter] : r.counters) {
        std::printf(",\"%s\":%.6g", key.c_str(), static_cast<double>(counter.value));
      }
      std::printf("}\n");
    }
    std::fflush(stdout);
  }

 private:
  std::string bench_;
};

}  // namespace qtx::bench

#endif  // QTX_BENCH_JSON_LINES_REPORTER_H_
