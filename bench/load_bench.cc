// load_bench: many concurrent clients with mixed RPCs against one qtxd on a
// unix socket, for a bounded time. Each client has its own channel (as a
// separate training process would) and loops over: Quantize inline (1x128),
// Quantize from a shm region into the region (128x128, both usages),
// Dequantize, ListRegions, an optimizer Step of its own group (step numbers
// in order, every 8th step retried) and GetState.
//
// Prints JSON lines: one per RPC kind and one summary with throughput,
// p50/p99 latency, errors and qtxd's resident memory after the warm-up and at
// the end. With --check, exits 1 when errors > 0 or RSS grew by more than
// --max_rss_growth_mb.
//
//   load_bench --qtxd=build/server/qtxd --clients=16 --seconds=20
//   load_bench --target=unix:/tmp/qtxd.sock --pid=1234 ...   (a running qtxd)
#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "bench/bench_util.h"
#include "qtx/v1/memory.grpc.pb.h"
#include "qtx/v1/optimizer.grpc.pb.h"
#include "qtx/v1/quantizer.grpc.pb.h"

ABSL_FLAG(std::string, qtxd, "", "qtxd binary to start (or give --target)");
ABSL_FLAG(std::string, target, "", "a running qtxd (unix:SOCK)");
ABSL_FLAG(int, pid, 0, "the running qtxd's pid, for its resident memory");
ABSL_FLAG(int, clients, 16, "concurrent clients");
ABSL_FLAG(double, seconds, 20, "measured seconds");
ABSL_FLAG(double, warmup_seconds, 3, "seconds before measuring");
ABSL_FLAG(int64_t, m, 256, "rows of the Quantize inputs");
ABSL_FLAG(int64_t, n, 1024, "columns of the Quantize inputs");
ABSL_FLAG(int, qtxd_threads, 4, "qtxd --threads of a started qtxd");
ABSL_FLAG(bool, check, false, "exit 1 on errors, RSS growth or an unhealthy qtxd");
ABSL_FLAG(double, max_rss_growth_mb, 64, "with --check: allowed RSS growth after the warm-up");
ABSL_FLAG(std::string, label, "", "free text copied into the summary");

namespace {

namespace v1 = ::qtx::v1;
using Clock = std::chrono::steady_clock;

struct Options {
  std::string qtxd;    // spawn this qtxd
  std::string target;  // or use a running one
  int pid = 0;         // its pid (for RSS)
  int clients = 16;
  double seconds = 20;
  double warmup_seconds = 3;
  int64_t m = 256, n = 1024;  // tensor size of the quantize calls
  int qtxd_threads = 4;
  bool check = false;
  double max_rss_growth_mb = 64;
  std::string label;  // free text copied into the summary
};

Options Parse(int argc, char** argv) {
  qtx::bench::ParseBenchFlags(
      argc, argv,
      "load_bench (--qtxd=PATH | --target=unix:SOCK [--pid=PID]): many clients mixing every RPC "
      "against one qtxd; latency, errors and qtxd's resident memory");
  Options o;
  o.qtxd = absl::GetFlag(FLAGS_qtxd);
  o.target = absl::GetFlag(FLAGS_target);
  o.pid = absl::GetFlag(FLAGS_pid);
  o.clients = absl::GetFlag(FLAGS_clients);
  o.seconds = absl::GetFlag(FLAGS_seconds);
  o.warmup_seconds = absl::GetFlag(FLAGS_warmup_seconds);
  o.m = absl::GetFlag(FLAGS_m);
  o.n = absl::GetFlag(FLAGS_n);
  o.qtxd_threads = absl::GetFlag(FLAGS_qtxd_threads);
  o.check = absl::GetFlag(FLAGS_check);
  o.max_rss_growth_mb = absl::GetFlag(FLAGS_max_rss_growth_mb);
  o.label = absl::GetFlag(FLAGS_label);
  return o;
}

// Resident set of `pid` in MiB (VmRSS), or -1.
double RssMb(int pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::atof(line.c_str() + 6) / 1024.0;
  }
  return -1;
}

// CPU seconds (user + system) used by `pid` so far, or -1.
double CpuSeconds(int pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  std::string s((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  const size_t close = s.rfind(')');
  if (close == std::string::npos) return -1;
  std::vector<std::string> fields;
  size_t pos = close + 2;
  while (pos < s.size()) {
    size_t next = s.find(' ', pos);
    if (next == std::string::npos) next = s.size();
    fields.push_back(s.substr(pos, next - pos));
    pos = next + 1;
  }
  if (fields.size() < 13) return -1;  // utime, stime are fields 14, 15 of stat
  return (std::atof(fields[11].c_str()) + std::atof(fields[12].c_str())) /
         static_cast<double>(::sysconf(_SC_CLK_TCK));
}

v1::TensorRef F32(int64_t m, int64_t n, uint32_t seed) {
  v1::TensorRef t;
  t.set_dtype(v1::FLOAT32);
  t.add_shape(m);
  t.add_shape(n);
  std::vector<float> v(m * n);
  uint32_t x = seed * 2654435761u + 1;
  for (auto& f : v) {
    x ^= x << 13;
    x ^= x >> 17;
    x ^= x << 5;
    f = static_cast<float>(static_cast<int32_t>(x)) / 2147483648.0f;
  }
  t.set_inline_data(std::string(reinterpret_cast<const char*>(v.data()), v.size() * 4));
  return t;
}

enum Rpc { kQuantizeInline, kQuantizeRegion, kDequantize, kListRegions, kStep, kGetState, kRpcs };
const char* kRpcNames[] = {
    "Quantize/inline", "Quantize/region", "Dequantize", "ListRegions", "Step", "GetState"};

struct Stats {
  std::vector<double> latency_us[kRpcs];
  int64_t errors[kRpcs] = {};
  std::vector<std::string> error_samples;
};

class Client {
 public:
  Client(int id, const Options& o, const std::string& target) : id_(id), o_(o) {
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(-1);
    args.SetMaxSendMessageSize(-1);
    args.SetInt("qtx.load_bench.client", id);  // a channel of its own
    channel_ = grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), args);
    quantizer_ = v1::Quantizer::NewStub(channel_);
    memory_ = v1::Memory::NewStub(channel_);
    optimizer_ = v1::Optimizer::NewStub(channel_);
    input_ = F32(o.m, o.n, id);
    grad_ = F32(64, 256, id + 1000);
  }

  // Registers this client's shm region and optimizer group.
  bool Setup(std::string* error) {
    const uint64_t in_bytes = o_.m * o_.n * 4;
    region_bytes_ = in_bytes * 3;
    shm_name_ = "/qtx-load-" + std::to_string(::getpid()) + "-" + std::to_string(id_);
    const int fd = ::shm_open(shm_name_.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0 || ::ftruncate(fd, region_bytes_) != 0) {
      *error = "shm_open/ftruncate failed";
      return false;
    }
    void* p = ::mmap(nullptr, region_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    ::close(fd);
    if (p == MAP_FAILED) {
      *error = "mmap failed";
      return false;
    }
    std::memcpy(p, input_.inline_data().data(), in_bytes);
    ::munmap(p, region_bytes_);
    v1::RegisterRegionRequest reg;
    reg.set_name("load-" + std::to_string(id_));
    reg.mutable_shm()->set_shm_name(shm_name_);
    reg.mutable_shm()->set_byte_size(region_bytes_);
    v1::RegisterRegionResponse rr;
    grpc::ClientContext c1;
    grpc::Status s = memory_->RegisterRegion(&c1, reg, &rr);
    if (!s.ok()) {
      *error = "RegisterRegion: " + s.error_message();
      return false;
    }
    v1::OffloadOptimizerStateRequest off;
    off.set_group("load-" + std::to_string(id_));
    off.set_replace(true);
    v1::ParameterInit* param = off.add_parameters();
    param->set_name("w");
    param->add_shape(64);
    param->add_shape(256);
    *param->mutable_master() = F32(64, 256, id_ + 2000);
    v1::OffloadOptimizerStateResponse orr;
    grpc::ClientContext c2;
    s = optimizer_->OffloadOptimizerState(&c2, off, &orr);
    if (!s.ok()) {
      *error = "OffloadOptimizerState: " + s.error_message();
      return false;
    }
    return true;
  }

  void Teardown() {
    v1::UnregisterRegionRequest un;
    un.set_name("load-" + std::to_string(id_));
    v1::UnregisterRegionResponse ur;
    grpc::ClientContext c1;
    (void)memory_->UnregisterRegion(&c1, un, &ur);
    v1::ReleaseGroupRequest rel;
    rel.set_group("load-" + std::to_string(id_));
    v1::ReleaseGroupResponse rr;
    grpc::ClientContext c2;
    (void)optimizer_->ReleaseGroup(&c2, rel, &rr);
    ::shm_unlink(shm_name_.c_str());
  }

  // Runs calls until `stop`; records into `stats` only while `record`.
  void Run(const std::atomic<bool>& stop, const std::atomic<bool>& record, Stats* stats) {
    const std::string region = "load-" + std::to_string(id_);
    const uint64_t in_bytes = o_.m * o_.n * 4;
    for (int64_t i = 0; !stop.load(std::memory_order_relaxed); ++i) {
      const Rpc rpc = static_cast<Rpc>((i + id_) % kRpcs);
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
      grpc::Status s;
      const auto t0 = Clock::now();
      switch (rpc) {
        case kQuantizeInline: {
          v1::QuantizeRequest req;
          *req.mutable_input() = input_;
          v1::QuantizeResponse resp;
          s = quantizer_->Quantize(&ctx, req, &resp);
          if (s.ok()) last_ = std::move(*resp.mutable_result());
          break;
        }
        case kQuantizeRegion: {
          v1::QuantizeRequest req;
          v1::TensorRef* in = req.mutable_input();
          in->set_dtype(v1::FLOAT32);
          in->add_shape(o_.m);
          in->add_shape(o_.n);
          in->mutable_region()->set_region(region);
          in->mutable_region()->set_size(in_bytes);
          req.mutable_config()->set_scaling_mode(v1::BLOCK_2D);
          req.mutable_config()->set_columnwise(true);
          v1::RegionSlice* row = req.mutable_outputs()->mutable_rowwise_data();
          row->set_region(region);
          row->set_offset(in_bytes);
          row->set_size(o_.m * o_.n);
          v1::RegionSlice* col = req.mutable_outputs()->mutable_columnwise_data();
          col->set_region(region);
          col->set_offset(in_bytes + o_.m * o_.n);
          col->set_size(o_.m * o_.n);
          v1::QuantizeResponse resp;
          s = quantizer_->Quantize(&ctx, req, &resp);
          break;
        }
        case kDequantize: {
          if (!last_.has_rowwise_data()) continue;
          v1::DequantizeRequest req;
          *req.mutable_input() = last_;
          v1::DequantizeResponse resp;
          s = quantizer_->Dequantize(&ctx, req, &resp);
          break;
        }
        case kListRegions: {
          v1::ListRegionsResponse resp;
          s = memory_->ListRegions(&ctx, v1::ListRegionsRequest(), &resp);
          break;
        }
        case kStep: {
          // Every 8th step is sent twice (a retry, answered from its result).
          const bool retry = step_ > 0 && step_ % 8 == 0 && !retried_;
          const int64_t step = retry ? step_ : step_ + 1;
          v1::StepRequest req;
          req.set_group(region);
          req.set_step(step);
          v1::Gradient* g = req.add_gradients();
          g->set_name("w");
          *g->mutable_grad() = grad_;
          v1::StepResponse resp;
          s = optimizer_->Step(&ctx, req, &resp);
          if (s.ok()) {
            if (resp.stats().replayed() != retry) {
              s = grpc::Status(grpc::StatusCode::INTERNAL, "replayed flag wrong");
            }
            retried_ = retry;
            step_ = step;
          }
          break;
        }
        case kGetState: {
          v1::GetStateRequest req;
          req.set_group(region);
          v1::GetStateResponse resp;
          s = optimizer_->GetState(&ctx, req, &resp);
          if (s.ok() && resp.group().step() != step_) {
            s = grpc::Status(grpc::StatusCode::INTERNAL, "step number drifted");
          }
          break;
        }
        case kRpcs:
          break;
      }
      const double us = std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
      if (!record.load(std::memory_order_relaxed)) continue;
      stats->latency_us[rpc].push_back(us);
      if (!s.ok()) {
        ++stats->errors[rpc];
        if (stats->error_samples.size() < 5) {
          stats->error_samples.push_back(std::string(kRpcNames[rpc]) + ": " +
                                         std::to_string(s.error_code()) + " " + s.error_message());
        }
      }
    }
  }

 private:
  const int id_;
  const Options& o_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Quantizer::Stub> quantizer_;
  std::unique_ptr<v1::Memory::Stub> memory_;
  std::unique_ptr<v1::Optimizer::Stub> optimizer_;
  v1::TensorRef input_, grad_;
  v1::QuantizedTensor last_;
  std::string shm_name_;
  uint64_t region_bytes_ = 0;
  int64_t step_ = 0;
  bool retried_ = false;
};

}  // namespace

int main(int argc, char** argv) {
  Options o = Parse(argc, argv);
  pid_t child = -1;
  std::string dir;
  if (!o.qtxd.empty()) {
    char tmpl[] = "/tmp/qtx-load-XXXXXX";
    if (::mkdtemp(tmpl) == nullptr) return 2;
    dir = tmpl;
    const std::string socket = dir + "/qtxd.sock";
    o.target = "unix:" + socket;
    const std::string threads = "--threads=" + std::to_string(o.qtxd_threads);
    const std::string sock_flag = "--socket=" + socket;
    child = ::fork();
    if (child == 0) {
      const int devnull = ::open("/dev/null", O_WRONLY);
      ::dup2(devnull, 1);
      ::dup2(devnull, 2);
      ::execl(o.qtxd.c_str(), o.qtxd.c_str(), "--device=cpu", sock_flag.c_str(),
              "--allow_client_shm", threads.c_str(), "--log_level=warn", "--shutdown_grace_s=1",
              static_cast<char*>(nullptr));
      ::_exit(127);
    }
    o.pid = child;
  }
  if (o.target.empty()) {
    std::fprintf(stderr, "load_bench: give --qtxd or --target\n");
    return 2;
  }
  int rc = 0;
  {
    // Wait for the server.
    {
      auto ch = grpc::CreateChannel(o.target, grpc::InsecureChannelCredentials());
      auto mem = v1::Memory::NewStub(ch);
      bool up = false;
      for (int i = 0; i < 300 && !up; ++i) {
        grpc::ClientContext ctx;
        ctx.set_wait_for_ready(true);
        ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(200));
        v1::ListRegionsResponse r;
        up = mem->ListRegions(&ctx, v1::ListRegionsRequest(), &r).ok();
      }
      if (!up) {
        std::fprintf(stderr, "load_bench: qtxd at %s does not answer\n", o.target.c_str());
        if (child > 0) ::kill(child, SIGKILL);
        return 2;
      }
    }
    std::vector<std::unique_ptr<Client>> clients;
    for (int i = 0; i < o.clients; ++i) {
      clients.push_back(std::make_unique<Client>(i, o, o.target));
      std::string error;
      if (!clients.back()->Setup(&error)) {
        std::fprintf(stderr, "load_bench: client %d setup: %s\n", i, error.c_str());
        if (child > 0) ::kill(child, SIGKILL);
        return 2;
      }
    }
    std::atomic<bool> stop{false}, record{false};
    std::vector<Stats> stats(o.clients);
    std::vector<std::thread> threads;
    for (int i = 0; i < o.clients; ++i) {
      threads.emplace_back([&, i] { clients[i]->Run(stop, record, &stats[i]); });
    }
    std::this_thread::sleep_for(std::chrono::duration<double>(o.warmup_seconds));
    const double rss_before = o.pid > 0 ? RssMb(o.pid) : -1;
    const double cpu_before = o.pid > 0 ? CpuSeconds(o.pid) : -1;
    record = true;
    const auto t0 = Clock::now();
    std::this_thread::sleep_for(std::chrono::duration<double>(o.seconds));
    record = false;
    const double elapsed = std::chrono::duration<double>(Clock::now() - t0).count();
    const double cpu_after = o.pid > 0 ? CpuSeconds(o.pid) : -1;
    stop = true;
    for (auto& t : threads) t.join();
    for (auto& c : clients) c->Teardown();
    const double rss_after = o.pid > 0 ? RssMb(o.pid) : -1;

    int64_t total = 0, errors = 0;
    std::vector<double> all;
    for (int r = 0; r < kRpcs; ++r) {
      std::vector<double> lat;
      int64_t err = 0;
      for (auto& s : stats) {
        lat.insert(lat.end(), s.latency_us[r].begin(), s.latency_us[r].end());
        err += s.errors[r];
      }
      total += lat.size();
      errors += err;
      all.insert(all.end(), lat.begin(), lat.end());
      const double p50 = qtx::bench::Percentile(lat, 0.50), p99 = qtx::bench::Percentile(lat, 0.99);
      std::printf(
          "{\"bench\":\"load\",\"rpc\":\"%s\",\"calls\":%zu,\"calls_per_s\":%.1f,"
          "\"p50_us\":%.1f,\"p99_us\":%.1f,\"errors\":%lld}\n",
          kRpcNames[r], lat.size(), lat.size() / elapsed, p50, p99, static_cast<long long>(err));
    }
    const double p50 = qtx::bench::Percentile(all, 0.50), p99 = qtx::bench::Percentile(all, 0.99);
    const double growth = rss_after - rss_before;
    std::printf(
        "{\"bench\":\"load\",\"rpc\":\"all\",\"label\":\"%s\",\"clients\":%d,"
        "\"qtxd_threads\":%d,\"m\":%lld,\"n\":%lld,\"seconds\":%.1f,\"calls\":%lld,"
        "\"calls_per_s\":%.1f,\"p50_us\":%.1f,\"p99_us\":%.1f,\"errors\":%lld,"
        "\"qtxd_cpu_s_per_1k_calls\":%.3f,\"rss_before_mb\":%.1f,\"rss_after_mb\":%.1f,"
        "\"rss_growth_mb\":%.1f}\n",
        o.label.c_str(), o.clients, o.qtxd_threads, static_cast<long long>(o.m),
        static_cast<long long>(o.n), elapsed, static_cast<long long>(total), total / elapsed, p50,
        p99, static_cast<long long>(errors),
        total > 0 && cpu_before >= 0 ? (cpu_after - cpu_before) / total * 1000.0 : -1.0, rss_before,
        rss_after, growth);
    for (auto& s : stats) {
      for (const auto& e : s.error_samples) std::fprintf(stderr, "error: %s\n", e.c_str());
    }
    if (o.check) {
      if (errors > 0) {
        std::fprintf(stderr, "load_bench: FAIL: %lld errors\n", static_cast<long long>(errors));
        rc = 1;
      }
      if (total == 0) {
        std::fprintf(stderr, "load_bench: FAIL: no calls completed\n");
        rc = 1;
      }
      if (rss_before > 0 && growth > o.max_rss_growth_mb) {
        std::fprintf(stderr, "load_bench: FAIL: qtxd RSS grew %.1f MiB (limit %.1f)\n", growth,
                     o.max_rss_growth_mb);
        rc = 1;
      }
    }
  }
  if (child > 0) {
    ::kill(child, SIGTERM);
    int status = 0;
    ::waitpid(child, &status, 0);
    if (o.check && !(WIFEXITED(status) && WEXITSTATUS(status) == 0)) {
      std::fprintf(stderr, "load_bench: FAIL: qtxd exited with status %d\n", status);
      rc = 1;
    }
    std::system(("rm -rf '" + dir + "'").c_str());
  }
  return rc;
}
