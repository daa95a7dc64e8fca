// Host AdamW step throughput (kernels/cpu/adamw.h) with FP8 BLOCK_2D output
// (rowwise + columnwise), at 1..N OpenMP threads, against the host's streaming
// bandwidth measured in the same run (bench/host_bandwidth.h). Plain main; one
// JSON object per line (formulas in bench/README.md):
//   {"bench":"host_triad","threads":..,"gbps":..,"gbps_with_write_allocate":..}
//   {"bench":"adamw_cpu","threads":..,"time_ms":..,"params_per_s":..,
//    "bytes_per_param":..,"bytes_moved_gbps":..,"triad_gbps":..,"fraction_of_triad":..}
//   {"bench":"adamw_phase","phase":..,"threads":..,"time_ms":..,"gbps":..,
//    "fraction_of_triad":..}                          (with --phases)
//   {"bench":"adamw_encode_l2","ns_per_param":..}     (with --phases)
//   {"bench":"memcpy","bytes":..,"threads":..,"gbps":..}
// bytes_per_param counts what the step must move: read+write master (8 B),
// read+write both moments (4*mb B), read the gradient (2 or 4 B), write FP8
// row+col (2 B) and their scales (2 x 4 B per 128x128 tile).
// "isa" is the band kernel's instruction set (kernels/cpu/adamw.h BandIsa:
// "avx512" where the CPU has it, else "baseline"; QTX_ADAMW_ISA=baseline
// forces the baseline AVX2 kernel).
// Usage: optimizer_cpu_bench [m n] [max_threads] [reps] [bf16|fp32 (gradient dtype)]
//            [--threads=1,2,4] [--phases] [--thp] [--triad_mib=N] [--label=NAME]
//            [--no_tile_scales] [--output=row+col|row] [--scaling=2d|tensor]
//            [--claim_units=N]
// --no_tile_scales: the step keeps no tile scales between steps
// (AdamWParamBuffers::tile_scales; qtxd's optimizer keeps them), so every
// tile is encoded from a re-read of its updated master.
// --scaling=tensor: the FP8 copies with one scale for the whole parameter
// (BlockScaling::kTensor, current scaling) instead of 128x128 tiles (2d, the
// default); bytes_per_param counts the same compulsory bytes.
// --output=row: the step writes the rowwise FP8 copy only (the columnwise one
// is then made on the GPU from it: qtx::cuda::MakeColumnwiseCopy); row+col,
// the default, writes both.
// --claim_units=N: threads claim runs of N work units from a shared counter
// (kernels/cpu/adamw.h SetUnitClaimChunk; 4, the default); 0: one contiguous
// run each.
// bench/optimizer_vs_torch.py runs it next to torch's CPU AdamW.
#include <omp.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "bench/host_bandwidth.h"
#include "kernels/block_geometry.h"
#include "kernels/cpu/adamw.h"
#include "kernels/fp8.h"

namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

double MemcpyGbps(size_t bytes, int threads, int reps) {
  std::vector<char> src(bytes, 1), dst(bytes, 0);
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = Clock::now();
#pragma omp parallel num_threads(threads)
    {
      const int t = omp_get_thread_num(), nt = omp_get_num_threads();
      const size_t chunk = (bytes + nt - 1) / nt;
      const size_t lo = std::min(bytes, chunk * t), hi = std::min(bytes, lo + chunk);
      std::memcpy(dst.data() + lo, src.data() + lo, hi - lo);
    }
    best = std::min(best, Seconds(t0, Clock::now()));
  }
  return 2.0 * bytes / best / 1e9;  // read + write
}

// --thp: the step's arrays 2 MiB aligned and madvise(MADV_HUGEPAGE)d.
bool g_thp = false;

// A 64-byte aligned array (as torch's allocator gives; with --thp on 2 MiB
// transparent huge pages where the kernel grants them), first touched by
// `threads` threads in contiguous slices.
template <typename T>
struct Aligned {
  T* p = nullptr;
  Aligned(int64_t count, int threads) {
    void* v = nullptr;
    constexpr size_t kHuge = size_t{2} << 20;
    size_t bytes = std::max<int64_t>(count, 1) * sizeof(T);
    if (g_thp) bytes = (bytes + kHuge - 1) / kHuge * kHuge;
    if (posix_memalign(&v, g_thp ? kHuge : 64, bytes) != 0) std::abort();
    if (g_thp) madvise(v, bytes, MADV_HUGEPAGE);  // advice: failure leaves 4 KiB pages
    p = static_cast<T*>(v);
#pragma omp parallel num_threads(threads)
    {
      const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
      std::memset(p + count * t / nt, 0, (count * (t + 1) / nt - count * t / nt) * sizeof(T));
    }
  }
  ~Aligned() { std::free(p); }
  Aligned(const Aligned&) = delete;
  Aligned& operator=(const Aligned&) = delete;
};

std::vector<int> ThreadCounts(int max_threads) {
  std::vector<int> out;
  for (int t = 1; t <= max_threads; t *= 2) {
    out.push_back(t);
    if (t < max_threads && t * 2 > max_threads) t = max_threads / 2;
  }
  return out;
}

std::vector<int> ParseList(const char* s) {
  std::vector<int> out;
  while (*s != '\0') {
    char* end = nullptr;
    const long v = std::strtol(s, &end, 10);
    if (end == s || v <= 0) {
      std::fprintf(stderr, "--threads: '%s' is not a list of positive integers\n", s);
      std::exit(2);
    }
    out.push_back(static_cast<int>(v));
    s = *end == ',' ? end + 1 : end;
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace qtx::kernels;
  std::vector<const char*> pos;
  std::vector<int> thread_list;
  bool phases = false;
  bool tile_scales = true;
  bool columnwise_out = true;
  bool tensor_scaling = false;
  int64_t triad_mib = 0;  // 0: 4 x last-level cache per array, within [256 MiB, 2 GiB]
  std::string label;
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], "--threads=", 10) == 0) {
      thread_list = ParseList(argv[i] + 10);
    } else if (std::strcmp(argv[i], "--thp") == 0) {
      g_thp = true;
    } else if (std::strcmp(argv[i], "--phases") == 0) {
      phases = true;
    } else if (std::strcmp(argv[i], "--no_tile_scales") == 0) {
      tile_scales = false;
    } else if (std::strcmp(argv[i], "--output=row") == 0) {
      columnwise_out = false;
    } else if (std::strcmp(argv[i], "--output=row+col") == 0) {
      columnwise_out = true;
    } else if (std::strcmp(argv[i], "--scaling=tensor") == 0) {
      tensor_scaling = true;
    } else if (std::strcmp(argv[i], "--scaling=2d") == 0) {
      tensor_scaling = false;
    } else if (std::strncmp(argv[i], "--triad_mib=", 12) == 0) {
      triad_mib = std::atoll(argv[i] + 12);
    } else if (std::strncmp(argv[i], "--claim_units=", 14) == 0) {
      char* end = nullptr;
      const long long units = std::strtoll(argv[i] + 14, &end, 10);
      if (end == argv[i] + 14 || *end != '\0' ||
          !qtx::kernels::cpu::internal::SetUnitClaimChunk(units)) {
        std::fprintf(stderr, "--claim_units: '%s' is not a count >= 0\n", argv[i] + 14);
        return 2;
      }
    } else if (std::strncmp(argv[i], "--label=", 8) == 0) {
      label = argv[i] + 8;
    } else if (std::strncmp(argv[i], "--", 2) == 0) {
      std::fprintf(stderr, "unknown flag '%s'\n", argv[i]);
      return 2;
    } else {
      pos.push_back(argv[i]);
    }
  }
  const size_t np = pos.size();
  const int64_t m = np >= 2 ? std::atoll(pos[0]) : 4096;
  const int64_t n = np >= 2 ? std::atoll(pos[1]) : 4096;
  const int max_threads = np >= 3 ? std::atoi(pos[2]) : omp_get_max_threads();
  const int reps = np >= 4 ? std::atoi(pos[3]) : 5;
  const bool grad_fp32 = np >= 5 && std::strcmp(pos[4], "fp32") == 0;
  if (np >= 5 && !grad_fp32 && std::strcmp(pos[4], "bf16") != 0) {
    std::fprintf(stderr, "gradient dtype '%s': must be bf16 or fp32\n", pos[4]);
    return 2;
  }
  if (m <= 0 || n <= 0 || max_threads <= 0 || reps <= 0) {
    std::fprintf(stderr, "m, n, max_threads and reps must be positive\n");
    return 2;
  }
  if (thread_list.empty()) thread_list = ThreadCounts(max_threads);
  const int touch_threads = *std::max_element(thread_list.begin(), thread_list.end());
  const std::string label_json = label.empty() ? "" : ",\"label\":\"" + label + "\"";

  const int64_t count = m * n;
  Aligned<float> master(count, touch_threads), m1(count, touch_threads), m2(count, touch_threads);
  Aligned<float> grad32(count, touch_threads);
  Aligned<uint16_t> grad(count, touch_threads);
  std::mt19937 rng(1);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (int64_t i = 0; i < count; ++i) {
    master.p[i] = nd(rng) * 0.02f;
    grad32.p[i] = nd(rng) * 1e-3f;
    grad.p[i] = FloatToBf16(grad32.p[i]);
  }
  QuantizeParams q;
  q.scaling = tensor_scaling ? BlockScaling::kTensor : BlockScaling::kBlock2D;
  q.rowwise = true;
  q.columnwise = columnwise_out;
  const QuantizedLayout l = ComputeLayout(q.scaling, m, n);
  Aligned<uint8_t> row(l.RowwiseDataBytes(), touch_threads),
      col(l.ColumnwiseDataBytes(), touch_threads);
  Aligned<float> rs(l.RowwiseScaleCount(), 1), cs(l.ColumnwiseScaleCount(), 1);
  cpu::AdamWParamBuffers b;
  b.m = m;
  b.n = n;
  b.master = master.p;
  b.exp_avg = m1.p;
  b.exp_avg_sq = m2.p;
  b.grad = grad_fp32 ? static_cast<const void*>(grad32.p) : grad.p;
  b.grad_dtype = grad_fp32 ? InputDType::kFloat32 : InputDType::kBFloat16;
  b.quant = q;
  b.fp8 = {row.p, rs.p, col.p, cs.p};
  std::vector<float> scales_kept(
      static_cast<size_t>(CeilDiv(m, kBlockLen) * CeilDiv(n, kBlockLen)));
  if (tile_scales) b.tile_scales = scales_kept.data();
  const double grad_bytes = grad_fp32 ? 4.0 : 2.0;
  const double update_bytes = 8.0 + 2 * 8.0 + grad_bytes;  // per parameter
  const double scale_bytes =
      4.0 *
      static_cast<double>(l.RowwiseScaleCount() + (columnwise_out ? l.ColumnwiseScaleCount() : 0)) /
      count;
  const double step_bytes = update_bytes + (columnwise_out ? 2.0 : 1.0) + scale_bytes;

  // Triad arrays: far beyond the last-level cache.
  const int64_t llc = qtx::bench::LastLevelCacheBytes();
  const int64_t triad_bytes =
      triad_mib > 0 ? triad_mib << 20
                    : std::clamp<int64_t>(4 * llc, int64_t{256} << 20, int64_t{2048} << 20);
  qtx::bench::TriadBuffers triad(static_cast<size_t>(triad_bytes / 4), touch_threads);
  const char* isa =
      cpu::internal::ActiveBandIsa() == cpu::internal::BandIsa::kAvx512 ? "avx512" : "baseline";

  int64_t step = 0;
  auto time_step = [&](const cpu::AdamWParamBuffers& pb, int threads) {
    cpu::AdamWStepFused({&pb, 1}, MakeAdamWScalars(AdamWHyperParams{}, ++step, 1.0), threads);
    double best = 1e30;
    for (int r = 0; r < reps; ++r) {
      const auto t0 = Clock::now();
      cpu::AdamWStepFused({&pb, 1}, MakeAdamWScalars(AdamWHyperParams{}, ++step, 1.0), threads);
      best = std::min(best, Seconds(t0, Clock::now()));
    }
    return best;
  };
  for (const int threads : thread_list) {
    const qtx::bench::TriadResult tr = qtx::bench::TriadGbps(triad, threads, reps);
    std::printf(
        "{\"bench\":\"host_triad\",\"threads\":%d,\"array_mib\":%lld,\"llc_mib\":%.1f,"
        "\"time_ms\":%.3f,\"gbps\":%.3f,\"gbps_with_write_allocate\":%.3f%s}\n",
        threads, static_cast<long long>(triad_bytes >> 20), llc / 1048576.0, tr.best_ms, tr.gbps,
        tr.gbps_with_write_allocate, label_json.c_str());
    const double best = time_step(b, threads);
    const double gbps = step_bytes * count / best / 1e9;
    std::printf(
        "{\"bench\":\"adamw_cpu\",\"m\":%lld,\"n\":%lld,\"threads\":%d,\"moments\":\"fp32\","
        "\"grad\":\"%s\",\"output\":\"%s\",\"time_ms\":%.3f,\"params_per_s\":%.4g,"
        "\"bytes_per_param\":%.4f,\"bytes_moved_gbps\":%.3f,\"triad_gbps\":%.3f,"
        "\"fraction_of_triad\":%.3f,\"isa\":\"%s\",\"thp\":%s,\"tile_scales\":%s,"
        "\"claim_units\":%lld%s}\n",
        static_cast<long long>(m), static_cast<long long>(n), threads, grad_fp32 ? "fp32" : "bf16",
        tensor_scaling ? (columnwise_out ? "fp8_tensor_row_col" : "fp8_tensor_row")
                       : (columnwise_out ? "fp8_2d_row_col" : "fp8_2d_row"),
        best * 1e3, count / best, step_bytes, gbps, tr.gbps, gbps / tr.gbps, isa,
        g_thp ? "true" : "false", tile_scales ? "true" : "false",
        static_cast<long long>(qtx::kernels::cpu::internal::UnitClaimChunk()), label_json.c_str());
    std::fflush(stdout);
    if (phases) {
      auto phase = [&](const char* name, double seconds, double bytes_per_param) {
        const double g = bytes_per_param * count / seconds / 1e9;
        std::printf(
            "{\"bench\":\"adamw_phase\",\"phase\":\"%s\",\"threads\":%d,\"time_ms\":%.3f,"
            "\"bytes_per_param\":%.4f,\"gbps\":%.3f,\"fraction_of_triad\":%.3f%s}\n",
            name, threads, seconds * 1e3, bytes_per_param, g, g / tr.gbps, label_json.c_str());
      };
      cpu::AdamWParamBuffers rowwise_only = b;
      rowwise_only.quant.columnwise = false;
      phase("step_rowwise_only", time_step(rowwise_only, threads),
            update_bytes + 1.0 + 4.0 * l.RowwiseScaleCount() / count);
      cpu::AdamWParamBuffers no_fp8 = b;
      no_fp8.fp8_output = false;
      phase("band_update_no_fp8", time_step(no_fp8, threads), update_bytes);
      if (grad_fp32) {
        phase("flat_update",
              qtx::bench::FlatUpdate(master.p, m1.p, m2.p, grad32.p, count,
                                     MakeAdamWScalars(AdamWHyperParams{}, ++step, 1.0), threads,
                                     reps),
              update_bytes);
        phase("flat_traffic_floor",
              qtx::bench::UpdateTrafficFloor(master.p, m1.p, m2.p, grad32.p, count, threads, reps),
              update_bytes);
        phase(
            "band_traffic_floor",
            qtx::bench::BandTrafficFloor(master.p, m1.p, m2.p, grad32.p, m, n, 512, threads, reps),
            update_bytes);
      }
      std::fflush(stdout);
    }
    std::printf("{\"bench\":\"memcpy\",\"bytes\":%lld,\"threads\":%d,\"gbps\":%.3f%s}\n",
                static_cast<long long>(count * 4), threads,
                MemcpyGbps(static_cast<size_t>(count) * 4, threads, reps), label_json.c_str());
    std::fflush(stdout);
  }
  if (phases) {
    // The FP8 encode's arithmetic alone: one thread, a 128 x 512 FP32 block
    // (256 KiB: in L2) encoded row by row, best of 20 passes.
    constexpr int64_t kRows = 128, kCols = 512;
    std::vector<float> blk(master.p, master.p + std::min(count, kRows * kCols));
    blk.resize(kRows * kCols, 0.01f);
    std::vector<uint8_t> out(kRows * kCols);
    double best = 1e30;
    for (int r = 0; r < 21; ++r) {
      const auto t0 = Clock::now();
      for (int64_t i = 0; i < kRows; ++i) {
        cpu::internal::EncodeFp8Row(blk.data() + i * kCols, 448.0f / 0.05f, out.data() + i * kCols,
                                    kCols, Fp8Format::kE4M3);
      }
      const double s = Seconds(t0, Clock::now());
      if (r > 0) best = std::min(best, s);
    }
    std::printf(
        "{\"bench\":\"adamw_encode_l2\",\"threads\":1,\"ns_per_param\":%.4f,\"isa\":\"%s\"%s}\n",
        best * 1e9 / (kRows * kCols), isa, label_json.c_str());
  }
  return 0;
}
