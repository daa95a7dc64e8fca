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
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "bench/bench_util.h"
#include "common/status_macros.h"
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

// A failed call returns its error, marked with where it failed, up to main
// (bench_util.h: no exit while owner threads run or children live); OnEach
// and Run hand on their callees' errors as they are (QTX_RETURN_IF_ERROR).
#define RETURN_IF_ERROR(expr) QTX_BENCH_RETURN_IF_ERROR(expr)
#define ASSIGN_OR_RETURN(lhs, expr) QTX_BENCH_ASSIGN_OR_RETURN(lhs, expr)

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

// Runs fn(r) for r in [0, k) on one thread each and joins them all; the
// first owner's error (in owner order), naming the owner. An owner whose
// call failed ends its thread; the others end when their calls return
// (a collective call fails within its group's timeout once a peer is gone).
absl::Status OnEach(int k, const std::function<absl::Status(int)>& fn) {
  std::vector<absl::Status> status(k);
  std::vector<std::thread> t;
  for (int r = 0; r < k; ++r) t.emplace_back([&, r] { status[r] = fn(r); });
  for (std::thread& x : t) x.join();
  for (int r = 0; r < k; ++r) {
    if (!status[r].ok()) {
      return absl::Status(status[r].code(), absl::StrCat("owner ", r, ": ", status[r].message()));
    }
  }
  return absl::OkStatus();
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
// shards (0 when every owner's bytes are its part of the unsharded ones), or
// the first failed call's error.
absl::StatusOr<int> Run(const std::vector<std::unique_ptr<qtx::testing::QtxdProcess>>& procs,
                        const std::vector<std::unique_ptr<qtx::Client>>& clients,
                        const std::string& set, int k, int steps, int rounds, bool columnwise,
                        const std::string& label, uint64_t& sequence) {
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
  ASSIGN_OR_RETURN(std::unique_ptr<qtx::ShmRegion> ref_shm,
                   qtx::ShmRegion::Create("ref_" + tag, ref_bytes));
  RETURN_IF_ERROR(clients[0]->RegisterShmRegion(*ref_shm));
  std::vector<qtx::OptimizerGradient> ref_grads;
  qtx::StepOptions ref_opts;
  {
    std::vector<qtx::OptimizerParameterInit> inits;
    std::vector<qtx::Tensor> gt;
    for (size_t i = 0; i < params.size(); ++i) {
      const Param& p = params[i];
      ASSIGN_OR_RETURN(qtx::Tensor t,
                       ref_shm->Place(qtx::Tensor::FromFloat32({p.m, p.n}, master[i])));
      gt.push_back(t);
      inits.push_back({.name = p.name,
                       .shape = {p.m, p.n},
                       .master = t,
                       .exp_avg = std::nullopt,
                       .exp_avg_sq = std::nullopt});
    }
    cfg.group = "unsharded_" + tag;
    RETURN_IF_ERROR(clients[0]->OffloadOptimizerState(cfg, inits).status());
    for (size_t i = 0; i < params.size(); ++i) {
      ASSIGN_OR_RETURN(const auto bytes, ref_shm->View(*gt[i].region));
      std::memcpy(bytes.data(), grad[i].data(), grad[i].size() * 4);
      ref_grads.push_back({params[i].name, gt[i]});
      qtx::ParameterDestination d;
      d.name = params[i].name;
      ASSIGN_OR_RETURN(d.fp8, ref_shm->AllocateQuantizeOutputs(
                                  std::vector<int64_t>{params[i].m, params[i].n}, cfg.output.fp8));
      ref_opts.destinations.push_back(std::move(d));
    }
  }

  // Sharded and local groups on every owner.
  std::vector<OwnerBufs> owners(k);
  QTX_RETURN_IF_ERROR(OnEach(k, [&](int r) -> absl::Status {
    OwnerBufs& o = owners[r];
    int64_t bytes = 0;
    for (const Piece& pc : pieces[r]) {
      const Param& p = params[pc.param];
      bytes += pc.count() * 4 + 2 * pc.count() + Pad4(Div128(p.n)) * Div128(p.m) * 4 + 64 +
               Pad4(Div128(pc.count())) * 4 + 512;
      if (columnwise)
        bytes += Pad4(Div128(p.m)) * Div128(p.n) * 4 + pc.count() + 16 * Div128(pc.count()) + 192;
    }
    ASSIGN_OR_RETURN(o.shm, qtx::ShmRegion::Create(absl::StrCat("own", r, "_", tag), bytes));
    RETURN_IF_ERROR(clients[r]->RegisterShmRegion(*o.shm));
    std::vector<qtx::OptimizerParameterInit> sharded, local;
    std::vector<qtx::Tensor> gt;
    for (const Piece& pc : pieces[r]) {
      const Param& p = params[pc.param];
      ASSIGN_OR_RETURN(
          qtx::Tensor t,
          o.shm->Place(qtx::Tensor::FromFloat32(
              {pc.count()},
              std::span<const float>(master[pc.param]).subspan(pc.begin, pc.count()))));
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
    RETURN_IF_ERROR(clients[r]->OffloadOptimizerState(c, sharded).status());
    c.group = "local_" + tag;
    if (!local.empty()) RETURN_IF_ERROR(clients[r]->OffloadOptimizerState(c, local).status());
    for (size_t j = 0; j < pieces[r].size(); ++j) {
      const Piece& pc = pieces[r][j];
      const Param& p = params[pc.param];
      ASSIGN_OR_RETURN(const auto view, o.shm->View(*gt[j].region));
      std::memcpy(view.data(), grad[pc.param].data() + pc.begin, pc.count() * 4);
      o.sharded_grads.push_back({p.name, gt[j]});
      o.shard_rowwise.push_back({});
      if (pc.count() == 0) continue;  // an empty slice: its scales come back inline
      qtx::ParameterDestination d;
      d.name = p.name;
      ASSIGN_OR_RETURN(d.fp8.rowwise_data, o.shm->Allocate(pc.count()));
      ASSIGN_OR_RETURN(d.fp8.rowwise_scale_inv,
                       o.shm->Allocate(Div128(p.m) * Pad4(Div128(p.n)) * 4));
      if (columnwise) {
        ASSIGN_OR_RETURN(d.fp8.columnwise_scale_inv,
                         o.shm->Allocate(Div128(p.n) * Pad4(Div128(p.m)) * 4));
      }
      o.shard_rowwise.back() = *d.fp8.rowwise_data;
      o.sharded_opts.destinations.push_back(d);
      {
        qtx::Tensor t2 = gt[j];
        t2.shape = {1, pc.count()};
        o.local_grads.push_back({p.name, t2});
        qtx::ParameterDestination dl;
        dl.name = p.name;
        ASSIGN_OR_RETURN(dl.fp8.rowwise_data, o.shm->Allocate(pc.count()));
        ASSIGN_OR_RETURN(dl.fp8.rowwise_scale_inv, o.shm->Allocate(Pad4(Div128(pc.count())) * 4));
        if (columnwise) {
          ASSIGN_OR_RETURN(dl.fp8.columnwise_data, o.shm->Allocate(pc.count()));
          ASSIGN_OR_RETURN(dl.fp8.columnwise_scale_inv,
                           o.shm->Allocate(Div128(pc.count()) * 4 * 4));
        }
        o.local_opts.destinations.push_back(dl);
      }
    }
    o.sharded_opts.collective_group = "dp" + std::to_string(k);
    o.local_opts.omit_parameters = false;
    return absl::OkStatus();
  }));
  (void)procs;

  int64_t step_ref = 0, step_sharded = 0, step_local = 0;
  // Each returns the step's wall time in ms.
  auto unsharded_step = [&]() -> absl::StatusOr<double> {
    const auto t0 = Clock::now();
    RETURN_IF_ERROR(clients[0]->Step("unsharded_" + tag, ++step_ref, ref_grads, ref_opts).status());
    return Ms(t0, Clock::now());
  };
  auto sharded_step = [&]() -> absl::StatusOr<double> {
    const int64_t step = ++step_sharded;
    const uint64_t seq = sequence++;
    const auto t0 = Clock::now();
    QTX_RETURN_IF_ERROR(OnEach(k, [&](int r) -> absl::Status {
      qtx::StepOptions o = owners[r].sharded_opts;
      o.sequence = seq;
      RETURN_IF_ERROR(
          clients[r]->Step("sharded_" + tag, step, owners[r].sharded_grads, o).status());
      return absl::OkStatus();
    }));
    return Ms(t0, Clock::now());
  };
  auto local_step = [&]() -> absl::StatusOr<double> {
    const int64_t step = ++step_local;
    const auto t0 = Clock::now();
    QTX_RETURN_IF_ERROR(OnEach(k, [&](int r) -> absl::Status {
      if (owners[r].local_grads.empty()) return absl::OkStatus();
      RETURN_IF_ERROR(clients[r]
                          ->Step("local_" + tag, step, owners[r].local_grads, owners[r].local_opts)
                          .status());
      return absl::OkStatus();
    }));
    return Ms(t0, Clock::now());
  };
  // The sharded bytes against the unsharded ones (same step number).
  int errors = 0;
  auto compare = [&]() -> absl::Status {
    for (int r = 0; r < k; ++r) {
      for (size_t j = 0; j < pieces[r].size(); ++j) {
        const Piece& pc = pieces[r][j];
        if (pc.count() == 0) continue;
        ASSIGN_OR_RETURN(const auto got, owners[r].shm->View(owners[r].shard_rowwise[j]));
        ASSIGN_OR_RETURN(const auto want,
                         ref_shm->View(*ref_opts.destinations[pc.param].fp8.rowwise_data));
        if (std::memcmp(got.data(), want.data() + pc.begin, pc.count()) != 0) ++errors;
      }
    }
    return absl::OkStatus();
  };
  // Warm-up (first touch of the state), checked.
  RETURN_IF_ERROR(unsharded_step().status());
  RETURN_IF_ERROR(sharded_step().status());
  RETURN_IF_ERROR(compare());
  RETURN_IF_ERROR(local_step().status());
  std::vector<double> tu, ts, tl;
  for (int round = 0; round < rounds; ++round) {
    for (int s = 0; s < steps; ++s) {
      ASSIGN_OR_RETURN(const double ms, unsharded_step());
      tu.push_back(ms);
    }
    for (int s = 0; s < steps; ++s) {
      ASSIGN_OR_RETURN(const double ms, sharded_step());
      ts.push_back(ms);
    }
    for (int s = 0; s < steps; ++s) {
      ASSIGN_OR_RETURN(const double ms, local_step());
      tl.push_back(ms);
    }
  }
  RETURN_IF_ERROR(compare());  // both at the same step again
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
  RETURN_IF_ERROR(clients[0]->ReleaseGroup("unsharded_" + tag));
  QTX_RETURN_IF_ERROR(OnEach(k, [&](int r) -> absl::Status {
    RETURN_IF_ERROR(clients[r]->ReleaseGroup("sharded_" + tag));
    if (!owners[r].local_grads.empty()) {
      RETURN_IF_ERROR(clients[r]->ReleaseGroup("local_" + tag));
    }
    RETURN_IF_ERROR(clients[r]->UnregisterRegion(owners[r].shm->name()));
    return absl::OkStatus();
  }));
  RETURN_IF_ERROR(clients[0]->UnregisterRegion(ref_shm->name()));
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
  // On any failure: say where, return 1; procs and clients go out of scope
  // here (every owner thread joined), which stops and reaps the qtxd children.
  std::vector<std::unique_ptr<qtx::testing::QtxdProcess>> procs;
  std::vector<std::unique_ptr<qtx::Client>> clients;
  const absl::StatusOr<int> errors = [&]() -> absl::StatusOr<int> {
    for (int r = 0; r < max_k; ++r) {
      ASSIGN_OR_RETURN(std::unique_ptr<qtx::testing::QtxdProcess> proc,
                       qtx::testing::QtxdProcess::Start(
                           qtxd, {"--device=cpu", "--allow_client_shm", "--threads=4",
                                  absl::StrCat("--optimizer_threads=", threads)}));
      procs.push_back(std::move(proc));
      ASSIGN_OR_RETURN(std::unique_ptr<qtx::Client> client,
                       qtx::Client::Connect(procs.back()->target()));
      clients.push_back(std::move(client));
    }
    for (int64_t k : ks) {
      QTX_RETURN_IF_ERROR(OnEach(static_cast<int>(k), [&](int r) -> absl::Status {
        qtx::CollectiveGroupConfig c;
        c.name = "dp" + std::to_string(k);
        c.rank = r;
        c.world_size = static_cast<int>(k);
        c.coordinator = r == 0 ? "" : procs[0]->target();
        c.backend = qtx::CommBackend::kGloo;
        c.timeout = absl::Seconds(120);
        RETURN_IF_ERROR(clients[r]->CreateGroup(c).status());
        return absl::OkStatus();
      }));
    }
    int mismatches = 0;
    std::map<int64_t, uint64_t> sequence;  // each Gloo group's next sequence (sharded steps)
    for (const std::string& set : absl::GetFlag(FLAGS_sets)) {
      for (int64_t k : ks) {
        QTX_ASSIGN_OR_RETURN(const int e, Run(procs, clients, set, static_cast<int>(k), steps,
                                              rounds, absl::GetFlag(FLAGS_columnwise),
                                              absl::GetFlag(FLAGS_label), sequence[k]));
        mismatches += e;
      }
    }
    return mismatches;
  }();
  if (!errors.ok()) {
    std::fprintf(stderr, "optimizer_shard_bench: %s\n", errors.status().ToString().c_str());
    return 1;
  }
  return *errors == 0 ? 0 : 1;
}
