// Metrics: qtxd's counters, latency histograms and gauges, rendered in the
// Prometheus text exposition format (version 0.0.4). Debian 12 has no
// Prometheus C++ client library, so the format is written here; the HTTP
// side is civetweb (http_exporter.h). No gRPC here: server/api records RPCs.
//
// Thread safety: RecordRpc and RenderPrometheus are safe for concurrent
// use; AddGauge must happen before the first RenderPrometheus (setup).
#ifndef QTX_SERVER_METRICS_METRICS_H_
#define QTX_SERVER_METRICS_METRICS_H_

#include <array>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace qtx::server::metrics {

class Metrics {
 public:
  // Upper bounds (seconds) of the latency histogram buckets; +Inf follows.
  static constexpr std::array<double, 14> kLatencyBuckets = {
      0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0};

  Metrics() = default;
  Metrics(const Metrics&) = delete;
  Metrics& operator=(const Metrics&) = delete;

  // One finished RPC: full method name ("/qtx.v1.Quantizer/Quantize"), its
  // status code name ("OK", "INVALID_ARGUMENT", ...), wall time, and the
  // request and response payload bytes.
  void RecordRpc(std::string_view method, std::string_view code, double seconds, uint64_t bytes_in,
                 uint64_t bytes_out);

  // A gauge read at each scrape. `name` must be a valid metric name.
  // REQUIRES: called before the first RenderPrometheus.
  void AddGauge(std::string name, std::string help, std::function<double()> read);

  // Every metric, in the Prometheus text format.
  std::string RenderPrometheus() const;

 private:
  struct MethodStats {
    std::map<std::string, uint64_t> by_code;
    std::array<uint64_t, kLatencyBuckets.size() + 1> buckets{};  // last: +Inf
    double seconds_sum = 0;
    uint64_t count = 0;
    uint64_t bytes_in = 0;
    uint64_t bytes_out = 0;
  };
  struct Gauge {
    std::string name;
    std::string help;
    std::function<double()> read;
  };

  // Set during setup only.
  std::vector<Gauge> gauges_;

  mutable absl::Mutex mu_;
  std::map<std::string, MethodStats, std::less<>> methods_ ABSL_GUARDED_BY(mu_);
};

}  // namespace qtx::server::metrics

#endif  // QTX_SERVER_METRICS_METRICS_H_
