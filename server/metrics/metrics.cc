#include "server/metrics/metrics.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace qtx::server::metrics {
namespace {

// Label values: escape backslash, quote and newline.
std::string Label(std::string_view v) {
  std::string out;
  for (char c : v) {
    if (c == '\\' || c == '"') out.push_back('\\');
    if (c == '\n') {
      out += "\\n";
      continue;
    }
    out.push_back(c);
  }
  return out;
}

std::string Number(double v) { return absl::StrFormat("%.17g", v); }

}  // namespace

void Metrics::RecordRpc(std::string_view method, std::string_view code, double seconds,
                        uint64_t bytes_in, uint64_t bytes_out) {
  absl::MutexLock lock(&mu_);
  auto it = methods_.find(method);
  if (it == methods_.end()) it = methods_.emplace(std::string(method), MethodStats{}).first;
  MethodStats& m = it->second;
  ++m.by_code[std::string(code)];
  size_t b = 0;
  while (b < kLatencyBuckets.size() && seconds > kLatencyBuckets[b]) ++b;
  ++m.buckets[b];
  m.seconds_sum += seconds;
  ++m.count;
  m.bytes_in += bytes_in;
  m.bytes_out += bytes_out;
}

void Metrics::AddGauge(std::string name, std::string help, std::function<double()> read) {
  gauges_.push_back({std::move(name), std::move(help), std::move(read)});
}

std::string Metrics::RenderPrometheus() const {
  std::string out;
  {
    absl::MutexLock lock(&mu_);
    absl::StrAppend(&out,
                    "# HELP qtx_grpc_requests_total Finished gRPC calls by method and status "
                    "code.\n# TYPE qtx_grpc_requests_total counter\n");
    for (const auto& [method, m] : methods_) {
      for (const auto& [code, n] : m.by_code) {
        absl::StrAppend(&out, "qtx_grpc_requests_total{method=\"", Label(method), "\",code=\"",
                        Label(code), "\"} ", n, "\n");
      }
    }
    absl::StrAppend(&out,
                    "# HELP qtx_grpc_request_duration_seconds gRPC call latency, from the "
                    "request's arrival to its status.\n"
                    "# TYPE qtx_grpc_request_duration_seconds histogram\n");
    for (const auto& [method, m] : methods_) {
      uint64_t cumulative = 0;
      const std::string l = Label(method);
      for (size_t b = 0; b <= kLatencyBuckets.size(); ++b) {
        cumulative += m.buckets[b];
        const std::string le = b < kLatencyBuckets.size() ? Number(kLatencyBuckets[b]) : "+Inf";
        absl::StrAppend(&out, "qtx_grpc_request_duration_seconds_bucket{method=\"", l, "\",le=\"",
                        le, "\"} ", cumulative, "\n");
      }
      absl::StrAppend(&out, "qtx_grpc_request_duration_seconds_sum{method=\"", l, "\"} ",
                      Number(m.seconds_sum), "\n");
      absl::StrAppend(&out, "qtx_grpc_request_duration_seconds_count{method=\"", l, "\"} ", m.count,
                      "\n");
    }
    absl::StrAppend(&out,
                    "# HELP qtx_grpc_received_bytes_total Request payload bytes by method.\n"
                    "# TYPE qtx_grpc_received_bytes_total counter\n");
    for (const auto& [method, m] : methods_) {
      absl::StrAppend(&out, "qtx_grpc_received_bytes_total{method=\"", Label(method), "\"} ",
                      m.bytes_in, "\n");
    }
    absl::StrAppend(&out,
                    "# HELP qtx_grpc_sent_bytes_total Response payload bytes by method.\n"
                    "# TYPE qtx_grpc_sent_bytes_total counter\n");
    for (const auto& [method, m] : methods_) {
      absl::StrAppend(&out, "qtx_grpc_sent_bytes_total{method=\"", Label(method), "\"} ",
                      m.bytes_out, "\n");
    }
  }
  for (const Gauge& g : gauges_) {
    absl::StrAppend(&out, "# HELP ", g.name, " ", g.help, "\n# TYPE ", g.name, " gauge\n", g.name,
                    " ", Number(g.read()), "\n");
  }
  return out;
}

}  // namespace qtx::server::metrics
