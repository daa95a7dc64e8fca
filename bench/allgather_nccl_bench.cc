// Exact FP8 all-gather on 2 GPUs below the gRPC layer: two ranks as threads
// of one process (rank r on cuda:r), each with its own CudaDevice and
// NcclCommunicator, driving server/ops AllGather with inputs and outputs in
// device memory (registered in a RegionTable as device regions). Compared in
// the same run with
//   raw_fp8_gather_plus_quantize: kernels/cuda QuantizeBlock of the local
//     shard + one NCCL all-gather of its FP8 bytes and scales (what a
//     non-exact FP8 gather costs; the 1.15x target's baseline),
//   raw_fp8_gather: that NCCL all-gather alone,
//   bf16_gather_then_quantize: NCCL all-gather of the BF16 shards + a full
//     QuantizeBlock of [M, N] (the 0.5x target's baseline).
// exact_fp8_one_round is the op with AllGatherRequestSpec::shard_rows (one
// collective round, no header exchange; docs/numerics.md §5.3).
// One JSON object per line on stdout (bench/README.md); a table on stderr.
//
//   allgather_nccl_bench [--iters 20] [--n 8192] [--quick]
#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/barrier.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "bench/bench_util.h"
#include "kernels/block_geometry.h"
#include "kernels/cuda/quantize_block.h"
#include "kernels/fp8.h"
#include "server/backend/cuda_device.h"
#include "server/backend/nccl_communicator.h"
#include "server/ops/allgather.h"
#include "server/tensor/region_table.h"

ABSL_FLAG(int, iters, 20, "timed iterations per configuration");
ABSL_FLAG(int64_t, n, 8192, "columns of the gathered tensor");
ABSL_FLAG(bool, quick, false, "only M = 8192");

namespace qtx {
namespace {

using server::backend::CommCall;
using server::backend::CudaDevice;
using server::backend::NcclCommunicator;

// The rendezvous store of the two in-process ranks.
class LocalStore final : public server::backend::RendezvousClient {
 public:
  absl::Status Set(std::string_view key, std::string_view value, absl::Time) override {
    absl::MutexLock lock(&mu_);
    kv_[std::string(key)] = std::string(value);
    return absl::OkStatus();
  }
  absl::StatusOr<std::vector<std::string>> Get(std::span<const std::string> keys,
                                               absl::Time deadline) override {
    absl::MutexLock lock(&mu_);
    auto all = [&] {
      for (const auto& k : keys)
        if (!kv_.contains(k)) return false;
      return true;
    };
    if (!mu_.AwaitWithDeadline(absl::Condition(&all), deadline)) {
      return absl::DeadlineExceededError("local store: key missing");
    }
    std::vector<std::string> out;
    for (const auto& k : keys) out.push_back(kv_[k]);
    return out;
  }

 private:
  absl::Mutex mu_;
  std::map<std::string, std::string> kv_;
};

// Device memory registered as a region without IPC: the opener maps the
// 64-byte "handle" (which carries the pointer) to the pointer itself.
std::string PointerHandle(void* p) {
  std::string h(server::tensor::kCudaIpcHandleBytes, '\0');
  std::memcpy(h.data(), &p, sizeof p);
  return h;
}

struct Rank {
  int rank = 0;
  std::unique_ptr<CudaDevice> device;
  std::unique_ptr<NcclCommunicator> comm;
  std::unique_ptr<server::tensor::RegionTable> regions;
  server::ops::OpContext ctx;
  std::vector<void*> allocations;
  void* Alloc(uint64_t bytes, const std::string& region) {
    void* p = nullptr;
    QTX_BENCH_CHECK_CUDA(cudaSetDevice(rank));
    QTX_BENCH_CHECK_CUDA(cudaMalloc(&p, std::max<uint64_t>(bytes, 256)));
    allocations.push_back(p);
    if (!region.empty()) {
      QTX_BENCH_CHECK_OK(
          regions->RegisterCudaIpc(region, PointerHandle(p), rank, std::max<uint64_t>(bytes, 256)));
    }
    return p;
  }
  void FreeAll() {
    QTX_BENCH_CHECK_CUDA(cudaSetDevice(rank));
    for (const char* r : {"in", "rd", "rs", "cd", "cs"}) (void)regions->Unregister(r);
    for (void* p : allocations) QTX_BENCH_CHECK_CUDA(cudaFree(p));
    allocations.clear();
  }
};

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct Config {
  int64_t m0, m1, n;
  bool columnwise;
};

}  // namespace
}  // namespace qtx

int main(int argc, char** argv) {
  using namespace qtx;  // NOLINT: a benchmark's main
  bench::ParseBenchFlags(argc, argv,
                         "allgather_nccl_bench: exact FP8 AllGather over NCCL on 2 GPUs vs raw "
                         "NCCL gathers of FP8 / BF16 bytes");
  const int iters = absl::GetFlag(FLAGS_iters);
  const int64_t n = absl::GetFlag(FLAGS_n);
  const bool quick = absl::GetFlag(FLAGS_quick);
  if (iters < 1 || n < 1) {
    std::fprintf(stderr, "--iters and --n must be >= 1\n");
    return 2;
  }
  int devices = 0;
  QTX_BENCH_CHECK_CUDA(cudaGetDeviceCount(&devices));
  if (devices < 2) {
    std::fprintf(stderr, "needs 2 GPUs, found %d\n", devices);
    return 2;
  }
  std::vector<Config> configs;
  for (int64_t m : {8192, 16384, 32768}) {
    if (quick && m > 8192) break;
    for (bool col : {false, true}) {
      configs.push_back({m / 2, m / 2, n, col});
      configs.push_back({m / 2 - 1, m / 2 + 1, n, col});
    }
  }

  LocalStore store;
  Rank ranks[2];
  absl::Barrier* ready = new absl::Barrier(2);
  std::vector<std::thread> init;
  for (int r = 0; r < 2; ++r) {
    init.emplace_back([&, r] {
      Rank& k = ranks[r];
      k.rank = r;
      auto dev = CudaDevice::Create(r);
      QTX_BENCH_CHECK_OK(dev.status());
      k.device = std::move(*dev);
      server::tensor::RegionTableOptions ro;
      ro.cuda_ipc_opener = [](std::string_view h, int32_t,
                              uint64_t) -> absl::StatusOr<server::tensor::MappedMemory> {
        void* p = nullptr;
        std::memcpy(&p, h.data(), sizeof p);
        server::tensor::MappedMemory mapped;
        mapped.data = static_cast<std::byte*>(p);
        mapped.release = [] {};
        return mapped;
      };
      k.regions = std::make_unique<server::tensor::RegionTable>(ro);
      k.ctx.regions = k.regions.get();
      k.ctx.device = k.device.get();
      server::backend::NcclCommunicatorOptions o;
      o.group = "bench";
      o.rank = r;
      o.world_size = 2;
      o.device_ordinal = r;
      o.key_prefix = "bench/";
      o.store = &store;
      o.deadline = absl::Now() + absl::Seconds(120);
      CudaDevice* d = k.device.get();
      o.default_stream = [d]() -> absl::StatusOr<void*> {
        auto s = d->CurrentThreadStream();
        if (!s.ok()) return s.status();
        return static_cast<void*>(*s);
      };
      auto c = NcclCommunicator::Create(o);
      QTX_BENCH_CHECK_OK(c.status());
      k.comm = std::move(*c);
      if (ready->Block()) delete ready;
    });
  }
  for (auto& t : init) t.join();

  std::fprintf(stderr, "%-28s %6s %6s %4s %9s %12s\n", "method", "m0", "m1", "col", "time_us",
               "vs_raw_fp8");
  for (const Config& cfg : configs) {
    const int64_t m_total = cfg.m0 + cfg.m1;
    const kernels::QuantizeParams p{kernels::BlockScaling::kBlock1D,
                                    kernels::Fp8Format::kE4M3,
                                    true,
                                    cfg.columnwise,
                                    true,
                                    0.0f};
    const kernels::QuantizedLayout lay = kernels::ComputeLayout(p.scaling, m_total, cfg.n);
    // Method -> per-rank median time (us); errors counted.
    std::map<std::string, double> times[2];
    std::array<double, 5> phases[2] = {};  // exact_fp8 steps, per rank (median us)
    std::atomic<int> errors{0};
    std::vector<std::thread> th;
    for (int r = 0; r < 2; ++r) {
      th.emplace_back([&, r] {
        Rank& k = ranks[r];
        QTX_BENCH_CHECK_CUDA(cudaSetDevice(r));
        auto stream_or = k.device->CurrentThreadStream();
        QTX_BENCH_CHECK_OK(stream_or.status());
        cudaStream_t stream = *stream_or;
        const int64_t mr = r == 0 ? cfg.m0 : cfg.m1;
        const int64_t off = r == 0 ? 0 : cfg.m0;
        const uint64_t in_bytes = static_cast<uint64_t>(mr * cfg.n * 2);
        void* in = k.Alloc(in_bytes, "in");
        {
          std::vector<uint16_t> h(mr * cfg.n);
          std::mt19937 rng(static_cast<uint32_t>(r * 7 + 1));
          std::normal_distribution<float> dist(0, 1);
          for (auto& v : h) v = kernels::FloatToBf16(dist(rng));
          QTX_BENCH_CHECK_CUDA(cudaMemcpy(in, h.data(), in_bytes, cudaMemcpyHostToDevice));
        }
        auto* rd = static_cast<uint8_t*>(k.Alloc(lay.RowwiseDataBytes(), "rd"));
        auto* rs = static_cast<float*>(k.Alloc(4 * lay.RowwiseScaleCount(), "rs"));
        uint8_t* cd = nullptr;
        float* cs = nullptr;
        if (cfg.columnwise) {
          cd = static_cast<uint8_t*>(k.Alloc(lay.ColumnwiseDataBytes(), "cd"));
          cs = static_cast<float*>(k.Alloc(4 * lay.ColumnwiseScaleCount(), "cs"));
        }
        // Baseline buffers: local quantized shard (packed data+scales), the
        // gathered BF16 tensor.
        const kernels::QuantizedLayout local = kernels::ComputeLayout(p.scaling, mr, cfg.n);
        const uint64_t local_q =
            local.RowwiseDataBytes() + 4 * local.RowwiseScaleCount() +
            (cfg.columnwise ? local.ColumnwiseDataBytes() + 4 * local.ColumnwiseScaleCount() : 0);
        const kernels::QuantizedLayout other =
            kernels::ComputeLayout(p.scaling, r == 0 ? cfg.m1 : cfg.m0, cfg.n);
        const uint64_t other_q =
            other.RowwiseDataBytes() + 4 * other.RowwiseScaleCount() +
            (cfg.columnwise ? other.ColumnwiseDataBytes() + 4 * other.ColumnwiseScaleCount() : 0);
        const uint64_t q_sizes[2] = {r == 0 ? local_q : other_q, r == 0 ? other_q : local_q};
        auto* qgather = static_cast<uint8_t*>(k.Alloc(q_sizes[0] + q_sizes[1], ""));
        auto* bf16 = static_cast<uint8_t*>(k.Alloc(static_cast<uint64_t>(m_total * cfg.n * 2), ""));
        const uint64_t b_sizes[2] = {static_cast<uint64_t>(cfg.m0 * cfg.n * 2),
                                     static_cast<uint64_t>(cfg.m1 * cfg.n * 2)};

        std::vector<server::ops::AllGatherTiming> exact_timing;
        auto op = [&](server::ops::AllGatherMode mode, uint64_t seq,
                      std::vector<server::ops::AllGatherTiming>* timing = nullptr,
                      bool one_round = false) {
          server::ops::AllGatherRequestSpec req;
          req.group = "bench";
          req.sequence = seq;
          req.input.dtype = server::tensor::DType::kBFloat16;
          req.input.shape = {mr, cfg.n};
          req.input.data = server::tensor::RegionSliceSpec{"in", 0, in_bytes};
          req.params = p;
          req.mode = mode;
          if (one_round) req.shard_rows = {cfg.m0, cfg.m1};  // one collective round
          req.outputs.rowwise_data = server::tensor::RegionSliceSpec{
              "rd", 0, static_cast<uint64_t>(lay.RowwiseDataBytes())};
          req.outputs.rowwise_scale_inv = server::tensor::RegionSliceSpec{
              "rs", 0, static_cast<uint64_t>(4 * lay.RowwiseScaleCount())};
          if (cfg.columnwise) {
            req.outputs.columnwise_data = server::tensor::RegionSliceSpec{
                "cd", 0, static_cast<uint64_t>(lay.ColumnwiseDataBytes())};
            req.outputs.columnwise_scale_inv = server::tensor::RegionSliceSpec{
                "cs", 0, static_cast<uint64_t>(4 * lay.ColumnwiseScaleCount())};
          }
          bool broken = false;
          auto res = server::ops::AllGather(req, k.ctx, *k.comm,
                                            CommCall{absl::Now() + absl::Seconds(60)}, &broken);
          QTX_BENCH_CHECK_OK(res.status());
          if (timing != nullptr) timing->push_back(res->timing);
        };
        auto raw_gather = [&] {
          QTX_BENCH_CHECK_OK(k.comm->AllGatherV(qgather + (r == 0 ? 0 : q_sizes[0]), q_sizes,
                                                qgather,
                                                CommCall{absl::Now() + absl::Seconds(60)}));
        };
        auto raw_quantize_local = [&] {
          uint8_t* base = qgather + (r == 0 ? 0 : q_sizes[0]);
          kernels::QuantizedBuffers b;
          b.rowwise_data = base;
          b.rowwise_scale_inv = reinterpret_cast<float*>(base + local.RowwiseDataBytes());
          if (cfg.columnwise) {
            b.columnwise_data = base + local.RowwiseDataBytes() + 4 * local.RowwiseScaleCount();
            b.columnwise_scale_inv =
                reinterpret_cast<float*>(b.columnwise_data + local.ColumnwiseDataBytes());
          }
          QTX_BENCH_CHECK_CUDA(kernels::cuda::QuantizeBlock(in, kernels::InputDType::kBFloat16, mr,
                                                            cfg.n, p, b, stream));
        };
        auto bf16_then_quantize = [&] {
          QTX_BENCH_CHECK_CUDA(cudaMemcpyAsync(bf16 + off * cfg.n * 2, in, in_bytes,
                                               cudaMemcpyDeviceToDevice, stream));
          QTX_BENCH_CHECK_OK(k.comm->AllGatherV(bf16 + off * cfg.n * 2, b_sizes, bf16,
                                                CommCall{absl::Now() + absl::Seconds(60)}));
          QTX_BENCH_CHECK_CUDA(kernels::cuda::QuantizeBlock(
              bf16, kernels::InputDType::kBFloat16, m_total, cfg.n, p, {rd, rs, cd, cs}, stream));
          QTX_BENCH_CHECK_CUDA(cudaStreamSynchronize(stream));
        };
        static uint64_t seq_base[2] = {0, 0};
        auto time_it = [&](const std::string& name, auto&& fn) {
          std::vector<double> t;
          for (int i = 0; i < iters + 3; ++i) {
            QTX_BENCH_CHECK_CUDA(cudaStreamSynchronize(stream));
            QTX_BENCH_CHECK_OK(k.comm->Barrier(CommCall{absl::Now() + absl::Seconds(60)}));
            const absl::Time t0 = absl::Now();
            fn();
            QTX_BENCH_CHECK_CUDA(cudaStreamSynchronize(stream));
            if (i >= 3) t.push_back(absl::ToDoubleMicroseconds(absl::Now() - t0));
          }
          times[r][name] = Median(t);
        };
        time_it("exact_fp8",
                [&] { op(server::ops::AllGatherMode::kExactFp8, seq_base[r]++, &exact_timing); });
        {
          // Median of each step of the op on this rank (server/ops AllGatherTiming).
          auto med = [&](absl::Duration server::ops::AllGatherTiming::*f) {
            std::vector<double> v;
            for (const auto& t : exact_timing) v.push_back(absl::ToDoubleMicroseconds(t.*f));
            return Median(v);
          };
          using T = server::ops::AllGatherTiming;
          phases[r] = {med(&T::local), med(&T::header), med(&T::prepare), med(&T::gather),
                       med(&T::assemble)};
        }
        time_it("exact_fp8_one_round",
                [&] { op(server::ops::AllGatherMode::kExactFp8, seq_base[r]++, nullptr, true); });
        time_it("gather_high_precision",
                [&] { op(server::ops::AllGatherMode::kGatherHighPrecision, seq_base[r]++); });
        time_it("raw_fp8_gather_plus_quantize", [&] {
          raw_quantize_local();
          raw_gather();
        });
        time_it("raw_fp8_gather", raw_gather);
        time_it("bf16_gather_then_quantize", bf16_then_quantize);
        // Bit identity of the op's output on this rank vs the BF16 path
        // (which quantizes the concatenation with the same kernel).
        op(server::ops::AllGatherMode::kExactFp8, seq_base[r]++);
        std::vector<uint8_t> a(lay.RowwiseDataBytes()), b(lay.RowwiseDataBytes());
        QTX_BENCH_CHECK_CUDA(cudaMemcpy(a.data(), rd, a.size(), cudaMemcpyDeviceToHost));
        std::vector<float> as(lay.RowwiseScaleCount()), bs(lay.RowwiseScaleCount());
        QTX_BENCH_CHECK_CUDA(cudaMemcpy(as.data(), rs, 4 * as.size(), cudaMemcpyDeviceToHost));
        bf16_then_quantize();
        QTX_BENCH_CHECK_CUDA(cudaMemcpy(b.data(), rd, b.size(), cudaMemcpyDeviceToHost));
        QTX_BENCH_CHECK_CUDA(cudaMemcpy(bs.data(), rs, 4 * bs.size(), cudaMemcpyDeviceToHost));
        if (a != b || std::memcmp(as.data(), bs.data(), 4 * as.size()) != 0) ++errors;
        // The same for the one-round path.
        op(server::ops::AllGatherMode::kExactFp8, seq_base[r]++, nullptr, true);
        QTX_BENCH_CHECK_CUDA(cudaMemcpy(a.data(), rd, a.size(), cudaMemcpyDeviceToHost));
        QTX_BENCH_CHECK_CUDA(cudaMemcpy(as.data(), rs, 4 * as.size(), cudaMemcpyDeviceToHost));
        if (a != b || std::memcmp(as.data(), bs.data(), 4 * as.size()) != 0) ++errors;
        k.FreeAll();
      });
    }
    for (auto& t : th) t.join();
    const char* usage = cfg.columnwise ? "row+col" : "row";
    auto t = [&](const std::string& k) { return std::max(times[0][k], times[1][k]); };
    const double raw = t("raw_fp8_gather_plus_quantize");
    const double bf = t("bf16_gather_then_quantize");
    for (const char* method :
         {"exact_fp8", "exact_fp8_one_round", "gather_high_precision",
          "raw_fp8_gather_plus_quantize", "raw_fp8_gather", "bf16_gather_then_quantize"}) {
      const double us = t(method);
      const double out_bytes = static_cast<double>(m_total * cfg.n) * (cfg.columnwise ? 2 : 1);
      std::printf(
          "{\"bench\":\"allgather_nccl\",\"method\":\"%s\",\"ranks\":2,\"m\":%lld,\"m0\":%lld,"
          "\"m1\":%lld,\"n\":%lld,\"mode\":\"1d\",\"usage\":\"%s\",\"time_us\":%.1f,"
          "\"fp8_out_gbps\":%.1f,\"vs_raw_fp8_plus_quantize\":%.3f,\"vs_bf16_then_quantize\":%.3f,"
          "\"errors\":%d}\n",
          method, static_cast<long long>(m_total), static_cast<long long>(cfg.m0),
          static_cast<long long>(cfg.m1), static_cast<long long>(cfg.n), usage, us,
          out_bytes / us / 1e3, us / raw, us / bf, errors.load());
      if (std::string(method) == "exact_fp8") {
        for (int r = 0; r < 2; ++r) {
          std::printf(
              "{\"bench\":\"allgather_nccl_steps\",\"rank\":%d,\"m0\":%lld,\"m1\":%lld,"
              "\"n\":%lld,\"usage\":\"%s\",\"local_us\":%.1f,\"header_us\":%.1f,"
              "\"prepare_us\":%.1f,\"gather_us\":%.1f,\"assemble_us\":%.1f}\n",
              r, static_cast<long long>(cfg.m0), static_cast<long long>(cfg.m1),
              static_cast<long long>(cfg.n), usage, phases[r][0], phases[r][1], phases[r][2],
              phases[r][3], phases[r][4]);
          std::fprintf(stderr,
                       "  steps rank %d: local %.1f header %.1f prepare %.1f gather %.1f "
                       "assemble %.1f us\n",
                       r, phases[r][0], phases[r][1], phases[r][2], phases[r][3], phases[r][4]);
        }
      }
      std::fprintf(stderr, "%-28s %6lld %6lld %4s %9.1f %12.3f\n", method,
                   static_cast<long long>(cfg.m0), static_cast<long long>(cfg.m1),
                   cfg.columnwise ? "y" : "n", us, us / raw);
    }
    std::fflush(stdout);
  }
  for (auto& k : ranks) {
    k.comm.reset();
  }
  return 0;
}
