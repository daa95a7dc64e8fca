// RPC overhead of qtxd without a GPU: the latency that the service adds to a
// small Quantize on a CPU device (qtxd --device=cpu, input and outputs in
// POSIX shm regions, unix socket), next to its baselines measured in the same
// run: a bare gRPC health call over the same channel and the bare CPU kernel
// (kernels::cpu::QuantizeBlock) in this process. The server's own cost is
//   quantize_rpc_p50 - kernel_p50 - health_rpc_p50,
// the part of the overhead that is not the transport floor. JSON lines on
// stdout, a table on stderr; see bench/README.md.
//
//   rpc_overhead_bench --qtxd=build/server/qtxd [--shapes=1x128,128x128,128x4096]
//                      [--iters=2000] [--rounds=5] [--threads=4] [--label=TEXT]
//                      [--qtxd_arg=--flag=value ...] [--cases=health,health_cq,quantize,kernel]
//   rpc_overhead_bench --target=unix:///tmp/qtxd.sock   (a running qtxd with
//                                                        --allow_client_shm)
//
// The CPU kernel runs single-threaded in both places (OMP_NUM_THREADS=1 for
// the spawned qtxd, omp_set_num_threads(1) here) so that the difference is
// the service path, not OpenMP team wake-ups. The cases alternate in rounds
// so that a noisy moment of a shared machine hits all of them alike.
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "bench/bench_util.h"
#include "kernels/block_geometry.h"
#include "kernels/cpu/quantize_block.h"
#include "qtx/client.h"
#include "qtx/shm_region.h"
#include "tests/testing/qtxd_process.h"

ABSL_FLAG(std::string, qtxd, "", "qtxd binary to start with --device=cpu (or give --target)");
ABSL_FLAG(std::string, target, "", "a running CPU qtxd (unix:///path)");
ABSL_FLAG(std::vector<std::string>, shapes,
          std::vector<std::string>({"1x128", "128x128", "128x4096"}),
          "input shapes MxN, comma-separated");
ABSL_FLAG(int, iters, 2000, "calls per case and round (>= 10)");
ABSL_FLAG(int, rounds, 5, "rounds of every case (>= 1)");
ABSL_FLAG(int, threads, 4, "qtxd --threads");
ABSL_FLAG(std::vector<std::string>, qtxd_arg, {}, "extra qtxd flags, comma-separated");
ABSL_FLAG(std::vector<std::string>, cases,
          std::vector<std::string>({"health", "health_cq", "quantize", "kernel"}),
          "cases to run (to trace one of them)");
ABSL_FLAG(std::string, label, "", "free text copied into the JSON lines");

namespace {

using Clock = std::chrono::steady_clock;

struct Shape {
  int64_t m = 0;
  int64_t n = 0;
};

struct Flags {
  std::string qtxd;
  std::string target;
  std::vector<Shape> shapes;
  int iters = 2000;
  int rounds = 5;
  int threads = 4;
  std::vector<std::string> qtxd_args;
  std::string label;
  // Cases to run (for tracing one of them): health, health_cq, quantize, kernel.
  std::string cases = "health,health_cq,quantize,kernel";
  bool Runs(const char* c) const {
    return ("," + cases + ",").find(std::string(",") + c + ",") != std::string::npos;
  }
};

Flags ParseFlags(int argc, char** argv) {
  qtx::bench::ParseBenchFlags(argc, argv,
                              "rpc_overhead_bench (--qtxd=PATH | --target=unix:///...): the "
                              "service path on a CPU device (shm regions) vs a health call and "
                              "the bare kernel");
  Flags f;
  f.qtxd = absl::GetFlag(FLAGS_qtxd);
  f.target = absl::GetFlag(FLAGS_target);
  f.iters = absl::GetFlag(FLAGS_iters);
  f.rounds = absl::GetFlag(FLAGS_rounds);
  f.threads = absl::GetFlag(FLAGS_threads);
  f.qtxd_args = absl::GetFlag(FLAGS_qtxd_arg);
  f.cases = absl::StrJoin(absl::GetFlag(FLAGS_cases), ",");
  f.label = absl::GetFlag(FLAGS_label);
  f.shapes.clear();
  for (const std::string& item : absl::GetFlag(FLAGS_shapes)) {
    const std::vector<std::string> mn = absl::StrSplit(item, 'x');
    Shape s;
    if (mn.size() != 2 || !absl::SimpleAtoi(mn[0], &s.m) || !absl::SimpleAtoi(mn[1], &s.n)) {
      std::fprintf(stderr, "--shapes: expected MxN[,MxN...], got '%s'\n", item.c_str());
      std::exit(2);
    }
    f.shapes.push_back(s);
  }
  if (f.qtxd.empty() == f.target.empty()) {
    std::fprintf(stderr, "give exactly one of --qtxd=PATH or --target=unix:///...\n");
    std::exit(2);
  }
  if (f.iters < 10 || f.rounds < 1) {
    std::fprintf(stderr, "--iters must be >= 10 and --rounds >= 1\n");
    std::exit(2);
  }
  return f;
}

double Us(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::micro>(b - a).count();
}

struct Stats {
  double p50 = 0, p90 = 0, p99 = 0;
};
Stats Summarize(const std::vector<double>& v) {
  return {qtx::bench::Percentile(v, 0.5), qtx::bench::Percentile(v, 0.9),
          qtx::bench::Percentile(v, 0.99)};
}

// A health check through a completion queue polled by this thread: the
// transport floor without the callback-to-caller thread hop that
// qtx::Client::Health pays.
class CqHealth {
 public:
  explicit CqHealth(std::shared_ptr<grpc::Channel> channel) : stub_(std::move(channel)) {}
  void Call() {
    grpc::ClientContext ctx;
    grpc::ByteBuffer request;  // HealthCheckRequest{} encodes to zero bytes
    grpc::Slice empty;
    request = grpc::ByteBuffer(&empty, 1);
    std::unique_ptr<grpc::GenericClientAsyncResponseReader> call =
        stub_.PrepareUnaryCall(&ctx, "/grpc.health.v1.Health/Check", request, &cq_);
    call->StartCall();
    grpc::ByteBuffer response;
    grpc::Status status;
    call->Finish(&response, &status, this);
    void* tag = nullptr;
    bool ok = false;
    if (!cq_.Next(&tag, &ok) || !ok || tag != this || !status.ok()) {
      std::fprintf(stderr, "health (cq): %s\n", status.error_message().c_str());
      std::exit(1);
    }
  }
  ~CqHealth() {
    cq_.Shutdown();
    void* tag;
    bool ok;
    while (cq_.Next(&tag, &ok)) {
    }
  }

 private:
  grpc::GenericStub stub_;
  grpc::CompletionQueue cq_;
};

// CPU time (user + system) the process `pid` has used so far, in
// microseconds; 0 when unknown (pid <= 0 or /proc unreadable).
double ProcessCpuUs(pid_t pid) {
  if (pid <= 0) return 0;
  const std::string path = "/proc/" + std::to_string(pid) + "/stat";
  FILE* f = std::fopen(path.c_str(), "r");
  if (f == nullptr) return 0;
  char buf[2048];
  const size_t len = std::fread(buf, 1, sizeof(buf) - 1, f);
  std::fclose(f);
  buf[len] = '\0';
  // Fields after the ")" that ends the command name: state is field 3,
  // utime and stime are fields 14 and 15.
  const char* p = std::strrchr(buf, ')');
  if (p == nullptr) return 0;
  unsigned long long utime = 0, stime = 0;
  if (std::sscanf(p + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %llu %llu", &utime, &stime) !=
      2) {
    return 0;
  }
  return static_cast<double>(utime + stime) * 1e6 / static_cast<double>(::sysconf(_SC_CLK_TCK));
}

}  // namespace

int main(int argc, char** argv) {
  const Flags flags = ParseFlags(argc, argv);
  omp_set_num_threads(1);

  std::unique_ptr<qtx::testing::QtxdProcess> server;
  std::string target = flags.target;
  if (!flags.qtxd.empty()) {
    std::vector<std::string> args = {"--device=cpu", "--allow_client_shm",
                                     "--threads=" + std::to_string(flags.threads)};
    args.insert(args.end(), flags.qtxd_args.begin(), flags.qtxd_args.end());
    ::setenv("OMP_NUM_THREADS", "1", 1);  // for the child (see the top comment)
    auto server_or = qtx::testing::QtxdProcess::Start(flags.qtxd, args, absl::Seconds(60));
    QTX_BENCH_CHECK_OK(server_or.status());
    server = *std::move(server_or);
    target = server->target();
  }
  const pid_t server_pid = server != nullptr ? server->pid() : -1;
  auto client_or = qtx::Client::Connect(target);
  QTX_BENCH_CHECK_OK(client_or.status());
  std::unique_ptr<qtx::Client> client = *std::move(client_or);
  QTX_BENCH_CHECK_OK(client->WaitUntilServing(absl::Seconds(60)));
  // The same socket through a plain channel for the completion-queue floor.
  CqHealth cq_health(grpc::CreateChannel(target, grpc::InsecureChannelCredentials()));

  std::string label_json;
  if (!flags.label.empty()) label_json = ",\"label\":\"" + flags.label + "\"";

  std::fprintf(stderr, "%-10s %-22s %10s %10s %10s\n", "shape", "case", "p50_us", "p90_us",
               "p99_us");
  for (const Shape& shape : flags.shapes) {
    const int64_t m = shape.m, n = shape.n;
    const uint64_t in_bytes = static_cast<uint64_t>(m * n * 2);  // BF16
    const std::string region_name = "rpc_overhead_" + std::to_string(m) + "x" + std::to_string(n);
    qtx::QuantizeConfig config;
    config.rowwise = true;
    config.columnwise = true;
    const qtx::kernels::QuantizedLayout layout =
        qtx::kernels::ComputeLayout(qtx::kernels::BlockScaling::kBlock1D, m, n);
    const uint64_t out_bytes = layout.RowwiseDataBytes() + layout.ColumnwiseDataBytes() +
                               4 * (layout.RowwiseScaleCount() + layout.ColumnwiseScaleCount());
    auto region_or = qtx::ShmRegion::Create(region_name, in_bytes + out_bytes + 4096);
    QTX_BENCH_CHECK_OK(region_or.status());
    std::unique_ptr<qtx::ShmRegion> region = *std::move(region_or);
    auto in_slice = region->Allocate(in_bytes);
    QTX_BENCH_CHECK_OK(in_slice.status());
    {
      std::mt19937 rng(static_cast<uint32_t>(m * 131 + n));
      std::normal_distribution<float> dist(0.0f, 1.0f);
      auto* p = reinterpret_cast<uint16_t*>(region->data() + in_slice->offset);
      for (int64_t i = 0; i < m * n; ++i) {
        float f = dist(rng);
        uint32_t u;
        std::memcpy(&u, &f, 4);
        p[i] = static_cast<uint16_t>(u >> 16);
      }
    }
    const std::vector<int64_t> dims = {m, n};
    auto outs = region->AllocateQuantizeOutputs(dims, config);
    QTX_BENCH_CHECK_OK(outs.status());
    QTX_BENCH_CHECK_OK(client->RegisterShmRegion(*region));
    const qtx::Tensor input = qtx::Tensor::InRegion(qtx::DType::kBFloat16, dims, *in_slice);

    // The bare kernel reads and writes the same shm bytes.
    qtx::kernels::QuantizeParams params;
    params.rowwise = true;
    params.columnwise = true;
    auto at = [&](const std::optional<qtx::RegionSlice>& s) {
      return reinterpret_cast<uint8_t*>(region->data() + s->offset);
    };
    qtx::kernels::QuantizedBuffers kb;
    kb.rowwise_data = at(outs->rowwise_data);
    kb.rowwise_scale_inv = reinterpret_cast<float*>(at(outs->rowwise_scale_inv));
    kb.columnwise_data = at(outs->columnwise_data);
    kb.columnwise_scale_inv = reinterpret_cast<float*>(at(outs->columnwise_scale_inv));
    const void* kin = region->data() + in_slice->offset;

    std::vector<double> health, health_cq, quantize, kernel;
    // qtxd's CPU time spent in the health_cq and quantize loops (spawned
    // qtxd only): the server's work per call, less noisy than latency.
    double health_cq_cpu_us = 0, quantize_cpu_us = 0;
    const int per_round = std::max(1, flags.iters / flags.rounds);
    for (int round = 0; round < flags.rounds; ++round) {
      const int warm = round == 0 ? 50 : 5;
      for (int i = 0; flags.Runs("health") && i < per_round + warm; ++i) {
        const auto t0 = Clock::now();
        QTX_BENCH_CHECK_OK(client->Health().status());
        if (i >= warm) health.push_back(Us(t0, Clock::now()));
      }
      double cpu0 = ProcessCpuUs(server_pid);
      for (int i = 0; flags.Runs("health_cq") && i < per_round + warm; ++i) {
        const auto t0 = Clock::now();
        cq_health.Call();
        if (i >= warm) health_cq.push_back(Us(t0, Clock::now()));
      }
      health_cq_cpu_us += ProcessCpuUs(server_pid) - cpu0;
      cpu0 = ProcessCpuUs(server_pid);
      for (int i = 0; flags.Runs("quantize") && i < per_round + warm; ++i) {
        const auto t0 = Clock::now();
        auto q = client->Quantize(input, config, *outs);
        QTX_BENCH_CHECK_OK(q.status());
        if (i >= warm) quantize.push_back(Us(t0, Clock::now()));
      }
      quantize_cpu_us += ProcessCpuUs(server_pid) - cpu0;
      for (int i = 0; flags.Runs("kernel") && i < per_round + warm; ++i) {
        const auto t0 = Clock::now();
        qtx::kernels::cpu::QuantizeBlock(kin, qtx::kernels::InputDType::kBFloat16, m, n, params,
                                         kb);
        if (i >= warm) kernel.push_back(Us(t0, Clock::now()));
      }
    }
    for (std::vector<double>* v : {&health, &health_cq, &quantize, &kernel}) {
      if (v->empty()) v->push_back(0.0);  // a case not run reports 0
    }
    // Warm-up calls are included in the CPU time: per_round + warm per round.
    const double calls_per_case =
        static_cast<double>(flags.rounds * per_round + 50 + 5 * (flags.rounds - 1));
    const Stats hs = Summarize(health), hq = Summarize(health_cq), qs = Summarize(quantize),
                ks = Summarize(kernel);
    const struct {
      const char* name;
      const Stats& s;
    } rows[] = {
        {"health_rpc", hs}, {"health_rpc_cq", hq}, {"quantize_shm_rpc", qs}, {"kernel_cpu", ks}};
    for (const auto& r : rows) {
      std::printf(
          "{\"bench\":\"rpc_overhead\",\"case\":\"%s\",\"m\":%lld,\"n\":%lld,\"iters\":%zu,"
          "\"p50_us\":%.2f,\"p90_us\":%.2f,\"p99_us\":%.2f%s}\n",
          r.name, static_cast<long long>(m), static_cast<long long>(n), quantize.size(), r.s.p50,
          r.s.p90, r.s.p99, label_json.c_str());
      std::fprintf(stderr, "%-10s %-22s %10.1f %10.1f %10.1f\n",
                   (std::to_string(m) + "x" + std::to_string(n)).c_str(), r.name, r.s.p50, r.s.p90,
                   r.s.p99);
    }
    std::printf(
        "{\"bench\":\"rpc_overhead\",\"case\":\"summary\",\"m\":%lld,\"n\":%lld,"
        "\"overhead_p50_us\":%.2f,\"server_added_p50_us\":%.2f,"
        "\"qtxd_cpu_us_per_health\":%.2f,\"qtxd_cpu_us_per_quantize\":%.2f,"
        "\"target_overhead_p50_us\":40%s}\n",
        static_cast<long long>(m), static_cast<long long>(n), qs.p50 - ks.p50,
        qs.p50 - ks.p50 - hq.p50, health_cq_cpu_us / calls_per_case,
        quantize_cpu_us / calls_per_case, label_json.c_str());
    std::fprintf(stderr,
                 "%-10s %-22s %10.1f   (over the cq health floor: %.1f; qtxd cpu us/call: "
                 "health %.1f, quantize %.1f)\n",
                 (std::to_string(m) + "x" + std::to_string(n)).c_str(), "overhead", qs.p50 - ks.p50,
                 qs.p50 - ks.p50 - hq.p50, health_cq_cpu_us / calls_per_case,
                 quantize_cpu_us / calls_per_case);
    std::fflush(stdout);
    QTX_BENCH_CHECK_OK(client->UnregisterRegion(region->name()));
  }
  client.reset();
  server.reset();
  return 0;
}
