// Data-parallel sharded Optimizer.Step (docs/numerics.md §10) on CPU qtxd
// processes over Gloo, next to the unsharded step of the same parameters
// measured in the same run. A "set" of parameters is laid end to end in one
// flat buffer (as Megatron-LM's DistributedOptimizer lays out a bucket) and
// owner r of k gets the slice [r*L, (r+1)*L), L = ceil(total / k): the cuts
// fall at arbitrary element offsets, inside rows and 128x128 tiles. Cases,
// interleaved in rounds so a noisy moment hits all alike:
//   unsharded  the whole parameters as one ordinary group on owner 0's qtxd
//   sharded    k owners, each with its slices (ParameterInit.shard), one
//              collective Step over a Gloo group (update, tile amaxes
//              combined across the owners, each owner's FP8 shard)
//   local      the same k slices as ordinary groups of 1-D parameters
//              ([1, count] each), stepped on the k qtxds at once without any
//              exchange: the same AdamW work split the same way, with no
//              tile geometry across the cut and no collective
// Every buffer (masters, gradients, outputs) is in POSIX shm regions, so no
// tensor bytes travel over gRPC. Outputs: FP8 128x128 rowwise (+ columnwise
// scales with --columnwise; the sharded step never returns columnwise data,
// so the unsharded case makes none either unless --columnwise). A step's
// time is the wall time from starting the k calls until the last returns.
// Before timing, the sharded bytes are checked against the unsharded ones
// (the shard of each owner = its part of the whole rowwise data), and again
// after the last step; a mismatch counts in "errors".
//
//   optimizer_shard_bench --qtxd=build/server/qtxd [--owners=2,3]
//       [--sets=8192x8192,megatron] [--steps=5] [--rounds=1]
//       [--optimizer_threads=1] [--columnwise] [--label=TEXT]
//
// JSON lines on stdout, one per (set, owners, case) plus a "ratio" line:
//   {"bench":"optimizer_shard","set":"8192x8192","owners":2,"case":"sharded",
//    "elements":67108864,"step_ms_p50":...,"step_ms_min":...,"errors":0}
//   {"bench":"optimizer_shard","set":...,"owners":2,"case":"ratio",
//    "sharded_vs_unsharded":...,"sharded_vs_local":...}
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "bench/bench_util.h"
#include "qtx/client.h"
#include "qtx/shm_region.h"
#include "tests/testing/qtxd_process.h"

ABSL_FLAG(std::string, qtxd, "", "qtxd binary (started with --device=cpu)");
ABSL_FLAG(std::vector<std::string>, owners, std::vector<std::string>({"2", "3"}),
          "owner counts (qtxd processes in the data-parallel group)");
ABSL_FLAG(std::vector<std::string>, sets, std::vector<std::string>({"8192x8192", "megatron"}),
          "parameter sets: MxN (one parameter) or 'megatron' (one transformer layer at hidden "
          "2048: qkv, proj, fc1, fc2, two norms and biases)");
ABSL_FLAG(int, steps, 5, "timed steps per case and round (>= 1)");
ABSL_FLAG(int, rounds, 1, "rounds of every case (>= 1)");
ABSL_FLAG(int, optimizer_threads, 1, "each qtxd's --optimizer_threads (host AdamW threads)");
ABSL_FLAG(bool, columnwise, false, "also the columnwise scales (and, unsharded, columnwise data)");
ABSL_FLAG(std::string, label, "", "free text copied into the JSON lines");

namespace {

using Clock = std::chrono::steady_clock;

#define CHECK_OK(expr) QTX_BENCH_CHECK_OK(expr)

template <typename T>
T Value(absl::StatusOr<T> v, const char* what) {
  if (!v.ok()) qtx::bench::CheckFailed(__FILE__, __LINE__, what, v.status().ToString());
  return *std::move(v);
}

struct Param {
  std::string name;
  int64_t m = 0, n = 0;
  int64_t total() const { return m * n; }
};

std::vector<Param> SetOf(const std::string& set) {
  if (set == "megatron") {
    const int64_t h = 2048;
    return {{"qkv.weight", 3 * h, h}, {"qkv.bias", 1, 3 * h}, {"proj.weight", h, h},
            {"proj.bias", 1, h},      {"ln1.weight", 1, h},   {"ln1.bias", 1, h},
            {"fc1.weight", 4 * h, h}, {"fc1.bias", 1, 4 * h}, {"fc2.weight", h, 4 * h},
            {"fc2.bias", 1, h},       {"ln2.weight", 1, h},   {"ln2.bias", 1, h}};
  }
  const std::vector<std::string> mn = absl::StrSplit(set, 'x');
  Param p{"w", 0, 0};
  if (mn.size() != 2 || !absl::SimpleAtoi(mn[0], &p.m) || !absl::SimpleAtoi(mn[1], &p.n) ||
      p.m <= 0 || p.n <= 0) {
    std::fprintf(stderr, "--sets: '%s' is neither MxN nor 'megatron'\n", set.c_str());
    std::exit(2);
  }
  return {p};
}

int64_t Div128(int64_t x) { return (x + 127) / 128; }
int64_t Pad4(int64_t x) { return (x + 3) / 4 * 4; }

double Ms(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

void OnEach(int k, const std::function<void(int)>& fn) {
  std::vector<std::thread> t;
  for (int r = 0; r < k; ++r) t.emplace_back(fn, r);
  for (std::thread& x : t) x.join();
}

// One owner's piece of one parameter.
struct Piece {
  size_t param = 0;
  int64_t begin = 0, end = 0;
  int64_t count() const { return end - begin; }
};

struct OwnerBufs {
  std::unique_ptr<qtx::ShmRegion> shm;
  std::vector<qtx::OptimizerGradient> sharded_grads, local_grads;
  qtx::StepOptions sharded_opts, local_opts;
  std::vector<qtx::RegionSlice> shard_rowwise;  // per parameter
};

// Runs one (set, k) and prints its lines; returns the number of mismatching
// shards (0 when every owner's bytes are its part of the unsharded ones).
int Run(const std::vector<std::unique_ptr<qtx::testing::QtxdProcess>>& procs,
        const std::vector<std::unique_ptr<qtx::Client>>& clients, const std::string& set, int k,
        int steps, int rounds, bool columnwise, const std::string& label, uint64_t& sequence) {
  const std::vector<Param> params = SetOf(set);
  int64_t flat_total = 0;
  for (const Param& p : params) flat_total += p.total();
  const int64_t slice = (flat_total + k - 1) / k;
  // pieces[r][i]: owner r's range of parameter i.
  std::vector<std::vector<Piece>> pieces(k);
  {
    int64_t at = 0;
    for (size_t i = 0; i < params.size(); ++i) {
      for (int r = 0; r < k; ++r) {
        const int64_t lo = std::clamp(r * slice - at, int64_t{0}, params[i].total());
        const int64_t hi = std::clamp((r + 1) * slice - at, int64_t{0}, params[i].total());
        pieces[r].push_back({i, lo, hi});
      }
      at += params[i].total();
    }
  }
  std::mt19937 rng(7);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<std::vector<float>> master(params.size()), grad(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    master[i].resize(params[i].total());
    grad[i].resize(params[i].total());
    for (float& v : master[i]) v = 0.02f * dist(rng);
    for (float& v : grad[i]) v = 1e-3f * dist(rng);
  }
  qtx::OptimizerGroupConfig cfg;
  cfg.hyper_params.lr = 1e-4;
  cfg.output.fp8.columnwise = columnwise;
  const std::string tag = absl::StrCat("k", k, "_", set);

  // Unsharded: owner 0's qtxd, whole parameters.
  int64_t ref_bytes = 0;
  for (const Param& p : params) {
    ref_bytes += p.total() * 4 + p.total() + Pad4(Div128(p.n)) * Div128(p.m) * 4 + 256;
    if (columnwise) ref_bytes += p.total() + Pad4(Div128(p.m)) * Div128(p.n) * 4 + 128;
  }
  auto ref_shm = Value(qtx::ShmRegion::Create("ref_" + tag, ref_bytes), "ref shm");
  CHECK_OK(clients[0]->RegisterShmRegion(*ref_shm));
  std::vector<qtx::OptimizerGradient> ref_grads;
  qtx::StepOptions ref_opts;
  {
    std::vector<qtx::OptimizerParameterInit> inits;
    std::vector<qtx::Tensor> gt;
    for (size_t i = 0; i < params.size(); ++i) {
      const Param& p = params[i];
      qtx::Tensor t =
          Value(ref_shm->Place(qtx::Tensor::FromFloat32({p.m, p.n}, master[i])), "place master");
      gt.push_back(t);
      inits.push_back({.name = p.name,
                       .shape = {p.m, p.n},
                       .master = t,
                       .exp_avg = std::nullopt,
                       .exp_avg_sq = std::nullopt});
    }
    cfg.group = "unsharded_" + tag;
    CHECK_OK(clients[0]->OffloadOptimizerState(cfg, inits).status());
    for (size_t i = 0; i < params.size(); ++i) {
      const auto bytes = Value(ref_shm->View(*gt[i].region), "view");
      std::memcpy(bytes.data(), grad[i].data(), grad[i].size() * 4);
      ref_grads.push_back({params[i].name, gt[i]});
      qtx::ParameterDestination d;
      d.name = params[i].name;
      d.fp8 = Value(ref_shm->AllocateQuantizeOutputs(std::vector<int64_t>{params[i].m, params[i].n},
                                                     cfg.output.fp8),
                    "ref outputs");
      ref_opts.destinations.push_back(std::move(d));
    }
  }

  // Sharded and local groups on every owner.
  std::vector<OwnerBufs> owners(k);
  OnEach(k, [&](int r) {
    OwnerBufs& o = owners[r];
    int64_t bytes = 0;
    for (const Piece& pc : pieces[r]) {
      const Param& p = params[pc.param];
      bytes += pc.count() * 4 + 2 * pc.count() + Pad4(Div128(p.n)) * Div128(p.m) * 4 + 64 +
               Pad4(Div128(pc.count())) * 4 + 512;
      if (columnwise)
        bytes += Pad4(Div128(p.m)) * Div128(p.n) * 4 + pc.count() + 16 * Div128(pc.count()) + 192;
    }
    o.shm = Value(qtx::ShmRegion::Create(absl::StrCat("own", r, "_", tag), bytes), "owner shm");
    CHECK_OK(clients[r]->RegisterShmRegion(*o.shm));
    std::vector<qtx::OptimizerParameterInit> sharded, local;
    std::vector<qtx::Tensor> gt;
    for (const Piece& pc : pieces[r]) {
      const Param& p = params[pc.param];
      qtx::Tensor t =
          Value(o.shm->Place(qtx::Tensor::FromFloat32(
                    {pc.count()},
                    std::span<const float>(master[pc.param]).subspan(pc.begin, pc.count()))),
                "place slice");
      gt.push_back(t);
      sharded.push_back({.name = p.name,
                         .shape = {p.m, p.n},
                         .master = t,
                         .exp_avg = std::nullopt,
                         .exp_avg_sq = std::nullopt,
                         .shard = qtx::ShardRange{pc.begin, pc.end}});
      if (pc.count() > 0) {
        qtx::Tensor t2 = t;
        t2.shape = {1, pc.count()};
        local.push_back({.name = p.name,
                         .shape = {1, pc.count()},
                         .master = t2,
                         .exp_avg = std::nullopt,
                         .exp_avg_sq = std::nullopt});
      }
    }
    qtx::OptimizerGroupConfig c = cfg;
    c.group = "sharded_" + tag;
    CHECK_OK(clients[r]->OffloadOptimizerState(c, sharded).status());
    c.group = "local_" + tag;
    if (!local.empty()) CHECK_OK(clients[r]->OffloadOptimizerState(c, local).status());
    for (size_t j = 0; j < pieces[r].size(); ++j) {
      const Piece& pc = pieces[r][j];
      const Param& p = params[pc.param];
      const auto view = Value(o.shm->View(*gt[j].region), "view");
      std::memcpy(view.data(), grad[pc.param].data() + pc.begin, pc.count() * 4);
      o.sharded_grads.push_back({p.name, gt[j]});
      o.shard_rowwise.push_back({});
      if (pc.count() == 0) continue;  // an empty slice: its scales come back inline
      qtx::ParameterDestination d;
      d.name = p.name;
      d.fp8.rowwise_data = Value(o.shm->Allocate(pc.count()), "alloc");
      d.fp8.rowwise_scale_inv =
          Value(o.shm->Allocate(Div128(p.m) * Pad4(Div128(p.n)) * 4), "alloc");
      if (columnwise) {
        d.fp8.columnwise_scale_inv =
            Value(o.shm->Allocate(Div128(p.n) * Pad4(Div128(p.m)) * 4), "alloc");
      }
      o.shard_rowwise.back() = *d.fp8.rowwise_data;
      o.sharded_opts.destinations.push_back(d);
      {
        qtx::Tensor t2 = gt[j];
        t2.shape = {1, pc.count()};
        o.local_grads.push_back({p.name, t2});
        qtx::ParameterDestination dl;
        dl.name = p.name;
        dl.fp8.rowwise_data = Value(o.shm->Allocate(pc.count()), "alloc");
        dl.fp8.rowwise_scale_inv = Value(o.shm->Allocate(Pad4(Div128(pc.count())) * 4), "alloc");
        if (columnwise) {
          dl.fp8.columnwise_data = Value(o.shm->Allocate(pc.count()), "alloc");
          dl.fp8.columnwise_scale_inv = Value(o.shm->Allocate(Div128(pc.count()) * 4 * 4), "alloc");
        }
        o.local_opts.destinations.push_back(dl);
      }
    }
    o.sharded_opts.collective_group = "dp" + std::to_string(k);
    o.local_opts.omit_parameters = false;
  });
  (void)procs;

  int64_t step_ref = 0, step_sharded = 0, step_local = 0;
  auto unsharded_step = [&] {
    const auto t0 = Clock::now();
    CHECK_OK(clients[0]->Step("unsharded_" + tag, ++step_ref, ref_grads, ref_opts).status());
    return Ms(t0, Clock::now());
  };
  auto sharded_step = [&] {
    const int64_t step = ++step_sharded;
    const uint64_t seq = sequence++;
    const auto t0 = Clock::now();
    OnEach(k, [&](int r) {
      qtx::StepOptions o = owners[r].sharded_opts;
      o.sequence = seq;
      CHECK_OK(clients[r]->Step("sharded_" + tag, step, owners[r].sharded_grads, o).status());
    });
    return Ms(t0, Clock::now());
  };
  auto local_step = [&] {
    const int64_t step = ++step_local;
    const auto t0 = Clock::now();
    OnEach(k, [&](int r) {
      if (owners[r].local_grads.empty()) return;
      CHECK_OK(clients[r]
                   ->Step("local_" + tag, step, owners[r].local_grads, owners[r].local_opts)
                   .status());
    });
    return Ms(t0, Clock::now());
  };
  // The sharded bytes against the unsharded ones (same step number).
  int errors = 0;
  auto compare = [&] {
    for (int r = 0; r < k; ++r) {
      for (size_t j = 0; j < pieces[r].size(); ++j) {
        const Piece& pc = pieces[r][j];
        if (pc.count() == 0) continue;
        const auto got = Value(owners[r].shm->View(owners[r].shard_rowwise[j]), "view");
        const auto want =
            Value(ref_shm->View(*ref_opts.destinations[pc.param].fp8.rowwise_data), "view");
        if (std::memcmp(got.data(), want.data() + pc.begin, pc.count()) != 0) ++errors;
      }
    }
  };
  unsharded_step();  // warm-up (first touch of the state)
  sharded_step();
  compare();
  local_step();
  std::vector<double> tu, ts, tl;
  for (int round = 0; round < rounds; ++round) {
    for (int s = 0; s < steps; ++s) tu.push_back(unsharded_step());
    for (int s = 0; s < steps; ++s) ts.push_back(sharded_step());
    for (int s = 0; s < steps; ++s) tl.push_back(local_step());
  }
  compare();  // both at the same step again
  auto line = [&](const char* c, const std::vector<double>& t) {
    std::printf(
        "{\"bench\":\"optimizer_shard\",\"set\":\"%s\",\"owners\":%d,\"case\":\"%s\","
        "\"elements\":%lld,\"parameters\":%zu,\"columnwise\":%s,\"step_ms_p50\":%.3f,"
        "\"step_ms_min\":%.3f,\"steps\":%zu,\"errors\":%d,\"label\":\"%s\"}\n",
        set.c_str(), k, c, static_cast<long long>(flat_total), params.size(),
        columnwise ? "true" : "false", qtx::bench::Percentile(t, 0.5),
        *std::min_element(t.begin(), t.end()), t.size(), errors, label.c_str());
  };
  line("unsharded", tu);
  line("sharded", ts);
  line("local", tl);
  const double u = qtx::bench::Percentile(tu, 0.5), s = qtx::bench::Percentile(ts, 0.5),
               l = qtx::bench::Percentile(tl, 0.5);
  std::printf(
      "{\"bench\":\"optimizer_shard\",\"set\":\"%s\",\"owners\":%d,\"case\":\"ratio\","
      "\"sharded_vs_unsharded\":%.3f,\"sharded_vs_local\":%.3f,\"errors\":%d,\"label\":\"%s\"}\n",
      set.c_str(), k, s / u, s / l, errors, label.c_str());
  std::fflush(stdout);
  std::fprintf(stderr,
               "%-10s k=%d unsharded %9.2f ms  sharded %9.2f ms (%.2fx)  local %9.2f ms"
               "  (sharded/local %.2fx)  errors %d\n",
               set.c_str(), k, u, s, s / u, l, s / l, errors);
  // Free the state before the next set.
  CHECK_OK(clients[0]->ReleaseGroup("unsharded_" + tag));
  OnEach(k, [&](int r) {
    CHECK_OK(clients[r]->ReleaseGroup("sharded_" + tag));
    if (!owners[r].local_grads.empty()) CHECK_OK(clients[r]->ReleaseGroup("local_" + tag));
    CHECK_OK(clients[r]->UnregisterRegion(owners[r].shm->name()));
  });
  CHECK_OK(clients[0]->UnregisterRegion(ref_shm->name()));
  return errors;
}

}  // namespace

int main(int argc, char** argv) {
  qtx::bench::ParseBenchFlags(argc, argv,
                              "optimizer_shard_bench --qtxd=PATH: the data-parallel sharded "
                              "Optimizer.Step over k CPU qtxd (Gloo) vs the unsharded step");
  const std::string qtxd = absl::GetFlag(FLAGS_qtxd);
  const std::vector<int64_t> ks = qtx::bench::IntList("owners", absl::GetFlag(FLAGS_owners));
  const int steps = absl::GetFlag(FLAGS_steps), rounds = absl::GetFlag(FLAGS_rounds);
  const int threads = absl::GetFlag(FLAGS_optimizer_threads);
  if (qtxd.empty() || steps < 1 || rounds < 1 || threads < 1 || ks.empty()) {
    std::fprintf(stderr,
                 "need --qtxd=PATH, --steps >= 1, --rounds >= 1, --optimizer_threads "
                 ">= 1 and --owners\n");
    return 2;
  }
  int64_t max_k = 0;
  for (int64_t k : ks) {
    if (k < 2 || k > 16) {
      std::fprintf(stderr, "--owners: %lld must be 2..16\n", static_cast<long long>(k));
      return 2;
    }
    max_k = std::max(max_k, k);
  }
  std::vector<std::unique_ptr<qtx::testing::QtxdProcess>> procs;
  std::vector<std::unique_ptr<qtx::Client>> clients;
  for (int r = 0; r < max_k; ++r) {
    procs.push_back(Value(
        qtx::testing::QtxdProcess::Start(qtxd, {"--device=cpu", "--allow_client_shm", "--threads=4",
                                                absl::StrCat("--optimizer_threads=", threads)}),
        "start qtxd"));
    clients.push_back(Value(qtx::Client::Connect(procs.back()->target()), "connect"));
  }
  for (int64_t k : ks) {
    std::vector<absl::Status> st(k);
    OnEach(static_cast<int>(k), [&](int r) {
      qtx::CollectiveGroupConfig c;
      c.name = "dp" + std::to_string(k);
      c.rank = r;
      c.world_size = static_cast<int>(k);
      c.coordinator = r == 0 ? "" : procs[0]->target();
      c.backend = qtx::CommBackend::kGloo;
      c.timeout = absl::Seconds(120);
      st[r] = clients[r]->CreateGroup(c).status();
    });
    for (const absl::Status& s : st) CHECK_OK(s);
  }
  int errors = 0;
  std::map<int64_t, uint64_t> sequence;  // each Gloo group's next sequence (sharded steps)
  for (const std::string& set : absl::GetFlag(FLAGS_sets)) {
    for (int64_t k : ks) {
      errors += Run(procs, clients, set, static_cast<int>(k), steps, rounds,
                    absl::GetFlag(FLAGS_columnwise), absl::GetFlag(FLAGS_label), sequence[k]);
    }
  }
  return errors == 0 ? 0 : 1;
}
