// Kernel benchmark of kernels/cuda QuantizeBlock (1d, 2d and per-tensor
// current scaling) against a device-to-device copy of the same byte count,
// measured in the same run; and, for 2d and tensor, the columnwise copy made
// from the rowwise one (usage "col_from_row", kernels/cuda/columnwise_copy.h).
// JSON lines on stdout (one object per measurement),
// a summary table on stderr. See bench/README.md.
//
//   quantize_cuda_bench [--iters N] [--warmup N] [--quick] [--l2 rotate|flush|both]
//                       [--modes 1d,2d,tensor] [--shapes 8192x8192,...]
//                       [--variants default,stages3,...] [--usages row+col,row,...]
//
// --l2 rotate (default): inputs and outputs rotate over >= 1 GiB of buffer sets.
// --l2 flush: one buffer set; a 256 MiB cudaMemsetAsync before every timed
// launch (outside the timed events) evicts L2, as TransformerEngine's figures
// in issue 16 were taken. The copy baseline is timed the same way.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "bench/stream_copy.h"
#include "kernels/block_geometry.h"
#include "kernels/cuda/columnwise_copy.h"
#include "kernels/cuda/quantize_block.h"
#include "kernels/cuda/quantize_tensor.h"
#include "kernels/fp8.h"

namespace {

using qtx::kernels::BlockScaling;
using qtx::kernels::ComputeLayout;
using qtx::kernels::Fp8Format;
using qtx::kernels::InputDType;
using qtx::kernels::QuantizedBuffers;
using qtx::kernels::QuantizedLayout;
using qtx::kernels::QuantizeParams;
namespace qcuda = qtx::kernels::cuda;

#define CHECK_CUDA(expr)                                                                         \
  do {                                                                                           \
    const cudaError_t e_ = (expr);                                                               \
    if (e_ != cudaSuccess) {                                                                     \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #expr, cudaGetErrorString(e_)); \
      std::exit(1);                                                                              \
    }                                                                                            \
  } while (0)

// Median of per-launch times (µs) of `launch(i)` over `iters` launches after
// `warmup`, each bracketed by its own pair of CUDA events; `prepare(i)` is
// enqueued before each launch, outside its events (the L2 flush). With
// `next_prepare_us`, also the median time of the prepare that follows each
// timed launch: with --l2 flush, the memset that must first write back what
// the launch left dirty in the L2 (the launch's carry-over to the next work).
template <typename Prep, typename Fn>
double MedianUs(int warmup, int iters, Prep&& prepare, Fn&& launch,
                double* next_prepare_us = nullptr) {
  for (int i = 0; i < warmup; ++i) {
    prepare(i);
    launch(i);
  }
  // ev[2i], ev[2i+1] bracket launch i; ev[2i+1], ev[2i+2] the prepare after it.
  std::vector<cudaEvent_t> ev(2 * iters + 1);
  for (auto& e : ev) CHECK_CUDA(cudaEventCreate(&e));
  for (int i = 0; i < iters; ++i) {
    prepare(warmup + i);
    CHECK_CUDA(cudaEventRecord(ev[2 * i], nullptr));
    launch(warmup + i);
    CHECK_CUDA(cudaEventRecord(ev[2 * i + 1], nullptr));
  }
  prepare(warmup + iters);
  CHECK_CUDA(cudaEventRecord(ev[2 * iters], nullptr));
  CHECK_CUDA(cudaEventSynchronize(ev.back()));
  CHECK_CUDA(cudaGetLastError());
  auto median_between = [&](int first) {
    std::vector<double> t(iters);
    for (int i = 0; i < iters; ++i) {
      float ms = 0;
      CHECK_CUDA(cudaEventElapsedTime(&ms, ev[2 * i + first], ev[2 * i + first + 1]));
      t[i] = ms * 1e3;
    }
    std::nth_element(t.begin(), t.begin() + iters / 2, t.end());
    return t[iters / 2];
  };
  const double us = median_between(0);
  if (next_prepare_us != nullptr) *next_prepare_us = median_between(1);
  for (auto& e : ev) cudaEventDestroy(e);
  return us;
}

struct Set {
  void* in = nullptr;
  QuantizedBuffers out;
};

// "8192x8192,16384x7168" -> shapes; false on a malformed list.
template <typename Shape>
bool ParseShapes(const char* arg, std::vector<Shape>* out) {
  out->clear();
  std::string list(arg);
  size_t pos = 0;
  while (pos <= list.size()) {
    const size_t end = std::min(list.find(',', pos), list.size());
    const std::string item = list.substr(pos, end - pos);
    long long m = 0, n = 0;
    char extra = 0;
    if (std::sscanf(item.c_str(), "%lldx%lld%c", &m, &n, &extra) != 2 || m <= 0 || n <= 0) {
      return false;
    }
    out->push_back({m, n});
    pos = end + 1;
  }
  return !out->empty();
}

// --probe_memcpy BYTES: does a device-to-device cudaMemcpyAsync run on the
// SMs or on a copy engine? Each round times the copy alone, then the copy
// enqueued on a second stream while bench::LaunchSmHog holds every SM for
// 2 ms: on the SMs the copy cannot start before the hog ends (its time then
// includes the rest of the 2 ms), on a copy engine it takes its usual time.
// The bench's own copy kernel is probed the same way as a control. One JSON
// line per copy: the medians over `rounds` rounds.
void ProbeMemcpy(int64_t bytes, int rounds, const char* device) {
  bytes = bytes / 16 * 16;
  void *a = nullptr, *b = nullptr;
  CHECK_CUDA(cudaMalloc(&a, bytes));
  CHECK_CUDA(cudaMalloc(&b, bytes));
  CHECK_CUDA(cudaMemset(a, 1, bytes));
  cudaStream_t hog_stream = nullptr, copy_stream = nullptr;
  CHECK_CUDA(cudaStreamCreateWithFlags(&hog_stream, cudaStreamNonBlocking));
  CHECK_CUDA(cudaStreamCreateWithFlags(&copy_stream, cudaStreamNonBlocking));
  cudaEvent_t e0, e1, h0, h1;
  for (cudaEvent_t* e : {&e0, &e1, &h0, &h1}) CHECK_CUDA(cudaEventCreate(e));
  constexpr int64_t kHogNs = 2'000'000;
  const qtx::bench::StreamCopyShape& kernel_copy = *std::find_if(
      std::begin(qtx::bench::kStreamCopyShapes), std::end(qtx::bench::kStreamCopyShapes),
      [](const qtx::bench::StreamCopyShape& k) {
        return !std::strcmp(k.name, "t512_c4_u4_plain");
      });
  for (int which = 0; which < 2; ++which) {
    const char* name = which == 0 ? "memcpy" : kernel_copy.name;
    auto copy = [&] {
      if (which == 0) {
        CHECK_CUDA(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, copy_stream));
      } else {
        CHECK_CUDA(qtx::bench::StreamCopy(a, b, bytes, kernel_copy, copy_stream));
      }
    };
    std::vector<double> alone, beside, hog;
    for (int r = 0; r < rounds; ++r) {
      float ms = 0;
      CHECK_CUDA(cudaEventRecord(e0, copy_stream));
      copy();
      CHECK_CUDA(cudaEventRecord(e1, copy_stream));
      CHECK_CUDA(cudaEventSynchronize(e1));
      CHECK_CUDA(cudaEventElapsedTime(&ms, e0, e1));
      alone.push_back(ms * 1e3);
      CHECK_CUDA(cudaEventRecord(h0, hog_stream));
      CHECK_CUDA(qtx::bench::LaunchSmHog(kHogNs, hog_stream));
      CHECK_CUDA(cudaEventRecord(h1, hog_stream));
      // Let the hog's CTAs take the SMs before the copy is enqueued.
      const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(300);
      while (std::chrono::steady_clock::now() < until) {
      }
      CHECK_CUDA(cudaEventRecord(e0, copy_stream));
      copy();
      CHECK_CUDA(cudaEventRecord(e1, copy_stream));
      CHECK_CUDA(cudaDeviceSynchronize());
      CHECK_CUDA(cudaEventElapsedTime(&ms, e0, e1));
      beside.push_back(ms * 1e3);
      CHECK_CUDA(cudaEventElapsedTime(&ms, h0, h1));
      hog.push_back(ms * 1e3);
    }
    auto median = [](std::vector<double> v) {
      std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
      return v[v.size() / 2];
    };
    std::printf(
        "{\"bench\":\"memcpy_probe\",\"copy\":\"%s\",\"bytes\":%lld,\"alone_us\":%.2f,"
        "\"beside_sm_hog_us\":%.2f,\"sm_hog_us\":%.2f,\"rounds\":%d,\"device\":\"%s\"}\n",
        name, static_cast<long long>(bytes), median(alone), median(beside), median(hog), rounds,
        device);
    std::fflush(stdout);
  }
  for (cudaEvent_t e : {e0, e1, h0, h1}) cudaEventDestroy(e);
  cudaStreamDestroy(hog_stream);
  cudaStreamDestroy(copy_stream);
  cudaFree(a);
  cudaFree(b);
}

}  // namespace

int main(int argc, char** argv) {
  int iters = 200;
  int warmup = 10;  // untimed launches before the timed ones (0: e.g. one launch under ncu)
  bool quick = false;
  bool l2_rotate = true, l2_flush = false;
  std::string modes = "1d,2d,tensor";
  std::string variant_filter, usage_filter;  // empty: all
  const char* shapes_arg = nullptr;
  int64_t probe_bytes = 0;  // --probe_memcpy BYTES: see ProbeMemcpy
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--iters") && i + 1 < argc) {
      iters = std::atoi(argv[++i]);
    } else if (!std::strcmp(argv[i], "--warmup") && i + 1 < argc) {
      warmup = std::max(0, std::atoi(argv[++i]));
    } else if (!std::strcmp(argv[i], "--quick")) {
      quick = true;
    } else if (!std::strcmp(argv[i], "--l2") && i + 1 < argc) {
      const std::string v = argv[++i];
      l2_rotate = v == "rotate" || v == "both";
      l2_flush = v == "flush" || v == "both";
      if (!l2_rotate && !l2_flush) {
        std::fprintf(stderr, "--l2 %s: must be rotate, flush or both\n", v.c_str());
        return 2;
      }
    } else if (!std::strcmp(argv[i], "--modes") && i + 1 < argc) {
      modes = argv[++i];
    } else if (!std::strcmp(argv[i], "--variants") && i + 1 < argc) {
      variant_filter = argv[++i];
    } else if (!std::strcmp(argv[i], "--usages") && i + 1 < argc) {
      usage_filter = argv[++i];
    } else if (!std::strcmp(argv[i], "--shapes") && i + 1 < argc) {
      shapes_arg = argv[++i];
    } else if (!std::strcmp(argv[i], "--probe_memcpy") && i + 1 < argc) {
      probe_bytes = std::atoll(argv[++i]);
    } else {
      std::fprintf(
          stderr,
          "unknown argument %s\nusage: quantize_cuda_bench [--iters N] [--warmup N] [--quick] "
          "[--l2 rotate|flush|both] [--modes 1d,2d,tensor] [--shapes MxN,...] "
          "[--variants default,stages3,...] [--usages row+col,row,...] [--probe_memcpy BYTES]\n",
          argv[i]);
      return 2;
    }
  }
  if (iters < 1) {
    std::fprintf(stderr, "--iters %d: must be >= 1\n", iters);
    return 2;
  }
  cudaDeviceProp prop{};
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  std::fprintf(stderr, "device %s, %d SMs, L2 %d MB\n", prop.name, prop.multiProcessorCount,
               prop.l2CacheSize >> 20);
  if (probe_bytes > 0) {
    ProbeMemcpy(probe_bytes, iters, prop.name);
    return 0;
  }

  // The copy kernel's figures count only if it copies: each launch shape once
  // over an odd number of 16-byte words, compared on the host; likewise the
  // read kernel's fold (the XOR of every word) and the write kernel's words.
  {
    const int64_t bytes = (int64_t{3} << 20) + 16 * 7;
    std::vector<uint8_t> src(bytes), back(bytes);
    std::mt19937 bytes_rng(7);
    for (auto& b : src) b = static_cast<uint8_t>(bytes_rng());
    void *d_src = nullptr, *d_dst = nullptr;
    CHECK_CUDA(cudaMalloc(&d_src, bytes));
    CHECK_CUDA(cudaMalloc(&d_dst, bytes));
    CHECK_CUDA(cudaMemcpy(d_src, src.data(), bytes, cudaMemcpyHostToDevice));
    for (const qtx::bench::StreamCopyShape& k : qtx::bench::kStreamCopyShapes) {
      CHECK_CUDA(cudaMemset(d_dst, 0, bytes));
      CHECK_CUDA(qtx::bench::StreamCopy(d_src, d_dst, bytes, k, nullptr));
      CHECK_CUDA(cudaMemcpy(back.data(), d_dst, bytes, cudaMemcpyDeviceToHost));
      if (back != src) {
        std::fprintf(stderr, "copy kernel %s: the copy differs from its source\n", k.name);
        return 1;
      }
      if (k.bulk_chunk > 0) continue;  // no read / write kernels
      // The sink (bench/stream_copy.h StreamRead), zeroed: the XOR of all of
      // it is the XOR of every word read.
      const int64_t sink_bytes = bytes / 32 + 16 * 8 * prop.multiProcessorCount;
      std::vector<uint32_t> sink(sink_bytes / 4);
      void* d_sink = nullptr;
      CHECK_CUDA(cudaMalloc(&d_sink, sink_bytes));
      CHECK_CUDA(cudaMemset(d_sink, 0, sink_bytes));
      CHECK_CUDA(qtx::bench::StreamRead(d_src, bytes, d_sink, k, nullptr));
      CHECK_CUDA(cudaMemcpy(sink.data(), d_sink, sink_bytes, cudaMemcpyDeviceToHost));
      CHECK_CUDA(cudaFree(d_sink));
      uint32_t got[4] = {0, 0, 0, 0}, want[4] = {0, 0, 0, 0};
      for (size_t i = 0; i < sink.size(); ++i) got[i % 4] ^= sink[i];
      for (int64_t i = 0; i < bytes / 4; ++i) {
        uint32_t w = 0;
        std::memcpy(&w, src.data() + 4 * i, 4);
        want[i % 4] ^= w;
      }
      if (std::memcmp(got, want, sizeof(got)) != 0) {
        std::fprintf(stderr, "read kernel %s: its fold differs from the source's\n", k.name);
        return 1;
      }
      CHECK_CUDA(qtx::bench::StreamWrite(d_dst, bytes, 5, k, nullptr));
      CHECK_CUDA(cudaMemcpy(back.data(), d_dst, bytes, cudaMemcpyDeviceToHost));
      for (int64_t i = 0; i < bytes / 16; ++i) {
        const uint32_t w[4] = {5, static_cast<uint32_t>(i), 0, 0};
        if (std::memcmp(back.data() + 16 * i, w, 16) != 0) {
          std::fprintf(stderr, "write kernel %s: word %lld is wrong\n", k.name,
                       static_cast<long long>(i));
          return 1;
        }
      }
    }
    CHECK_CUDA(cudaFree(d_src));
    CHECK_CUDA(cudaFree(d_dst));
  }

  struct Shape {
    int64_t m, n;
  };
  // 8191 / 8208 rows: the mixed path (whole tiles vectorized, the last tile
  // row checked; 8191 keeps the columnwise copy on the tail path).
  std::vector<Shape> shapes = {{4096, 4096}, {8192, 8192},  {8191, 8192},
                               {8208, 8192}, {16384, 7168}, {32768, 4096}};
  if (quick) shapes = {{8192, 8192}, {8191, 8192}, {8208, 8192}};
  if (shapes_arg != nullptr && !ParseShapes(shapes_arg, &shapes)) {
    std::fprintf(stderr, "--shapes %s: expected MxN[,MxN...]\n", shapes_arg);
    return 2;
  }
  struct Mode {
    const char* name;
    BlockScaling scaling;
  };
  std::vector<Mode> mode_list;
  for (const Mode& m : {Mode{"1d", BlockScaling::kBlock1D}, Mode{"2d", BlockScaling::kBlock2D},
                        Mode{"tensor", BlockScaling::kTensor}}) {
    if (("," + modes + ",").find(std::string(",") + m.name + ",") != std::string::npos) {
      mode_list.push_back(m);
    }
  }
  if (mode_list.empty()) {
    std::fprintf(stderr, "--modes %s: expected a list of 1d, 2d, tensor\n", modes.c_str());
    return 2;
  }
  struct Usage {
    const char* name;
    bool row, col;
    bool from_rowwise;
  };
  // "col_from_row": the columnwise copy made from the rowwise one
  // (kernels/cuda/columnwise_copy.h; 2-D and tensor only); it reads the
  // rowwise copy instead of the input.
  const Usage usages[] = {{"row+col", true, true, false},
                          {"row", true, false, false},
                          {"col", false, true, false},
                          {"col_from_row", false, true, true}};
  struct Variant {
    const char* name;
    qcuda::detail::LaunchTuning tuning;
    bool tensor_two_pass = false;  // tensor mode only
    bool amax_phase = false;       // tensor mode only
    bool amax_pass = false;        // tensor mode only
  };
  // fixed: kernels/cuda/quantize_block.h LaunchTuning::fixed_tiles (CTA b takes tiles b,
  // b + grid, ... instead of drawing them from the stream's tile counter).
  // two_pass: kernels/cuda/quantize_tensor.h TensorTuning::two_pass (the amax launch, then
  // the cast launch, instead of the one cooperative launch).
  // amax_phase: TensorTuning::amax_phase_only (with force_one_pass): the one
  // cooperative launch's phase 1 alone (amax, grid barrier, scale), no data
  // written. amax_pass: TensorAmax, the two launches' amax pass (and its
  // one-CTA reduction). Both read the input once and write no data: their
  // tbps is the input's bytes over their time.
  const Variant variants[] = {{"default", {}},
                              {"stages2", {2, 0}},
                              {"stages3", {3, 0}},
                              {"stages2_1cta", {2, 1}},
                              {"evict_first", {0, 0, true}},
                              {"fixed", {0, 0, false, true}},
                              {"stages3_fixed", {3, 0, false, true}},
                              {"division_scales", {0, 0, false, false, true}},
                              {"float_amax", {0, 0, false, false, false, true}},
                              {"half", {0, 0, false, false, false, false, true}},
                              {"half_stages3", {3, 0, false, false, false, false, true}},
                              {"two_pass", {}, true},
                              {"amax_phase", {}, false, true},
                              {"amax_pass", {}, false, false, true}};

  // The variants in the order of --variants (a name may repeat: e.g. a first,
  // discarded measurement of each block), else all in the table's order.
  std::vector<const Variant*> order;
  if (variant_filter.empty()) {
    for (const Variant& v : variants) order.push_back(&v);
  } else {
    size_t at = 0;
    while (at <= variant_filter.size()) {
      size_t end = variant_filter.find(',', at);
      if (end == std::string::npos) end = variant_filter.size();
      const std::string name = variant_filter.substr(at, end - at);
      for (const Variant& v : variants) {
        if (name == v.name) order.push_back(&v);
      }
      at = end + 1;
    }
  }

  const InputDType dtype = InputDType::kBFloat16;
  constexpr int64_t kRingBytes = int64_t{1} << 30;     // rotate buffers: >> 60 MB L2
  constexpr int64_t kFlushBytes = int64_t{256} << 20;  // the L2 flush of --l2 flush
  void* flush_buf = nullptr;
  if (l2_flush) CHECK_CUDA(cudaMalloc(&flush_buf, kFlushBytes));
  float* amax_out = nullptr;  // amax_pass's result
  CHECK_CUDA(cudaMalloc(&amax_out, 64));
  std::mt19937 rng(1);
  std::normal_distribution<float> normal(0.0f, 1.0f);

  std::fprintf(stderr, "%-6s %-7s %-8s %-12s %-12s %9s %7s %9s %7s %6s\n", "mode", "l2", "usage",
               "shape", "variant", "time_us", "TB/s", "copy_us", "TB/s", "ratio");
  for (const Shape& s : shapes) {
    const int64_t in_bytes = s.m * s.n * 2;
    // Host input: normal values, one upload, copied to every ring slot.
    std::vector<uint16_t> host(s.m * s.n);
    for (auto& h : host) h = qtx::kernels::FloatToBf16(normal(rng));
    for (const Mode& mode : mode_list) {
      const QuantizedLayout l = ComputeLayout(mode.scaling, s.m, s.n);
      const int64_t set_bytes = in_bytes + l.RowwiseDataBytes() + l.ColumnwiseDataBytes() +
                                4 * (l.RowwiseScaleCount() + l.ColumnwiseScaleCount());
      const int ring =
          l2_rotate ? static_cast<int>(std::max<int64_t>(2, kRingBytes / set_bytes)) : 1;
      std::vector<Set> sets(ring);
      for (auto& st : sets) {
        CHECK_CUDA(cudaMalloc(&st.in, in_bytes));
        CHECK_CUDA(cudaMemcpy(st.in, host.data(), in_bytes, cudaMemcpyHostToDevice));
        CHECK_CUDA(cudaMalloc(&st.out.rowwise_data, l.RowwiseDataBytes()));
        CHECK_CUDA(cudaMalloc(&st.out.columnwise_data, l.ColumnwiseDataBytes()));
        CHECK_CUDA(cudaMalloc(&st.out.rowwise_scale_inv, 4 * l.RowwiseScaleCount()));
        CHECK_CUDA(cudaMalloc(&st.out.columnwise_scale_inv, 4 * l.ColumnwiseScaleCount()));
      }
      // Copy buffers, rotated like the sets: each holds the largest copy
      // (row+col: half the set) and the largest write of kwrite_* (every
      // output, scales included: more than half the set when the scales
      // outweigh the input's share, as 1-D's do).
      const int64_t slot_bytes = std::max(set_bytes / 2, set_bytes - in_bytes) + 16;
      const size_t copy_slots =
          l2_rotate ? static_cast<size_t>(std::max<int64_t>(3, kRingBytes / slot_bytes)) : 2;
      std::vector<void*> copy_ring(copy_slots);
      for (auto& c : copy_ring) CHECK_CUDA(cudaMalloc(&c, slot_bytes));
      // The read kernels' sink (bench/stream_copy.h StreamRead): 16 bytes a
      // CTA; a flat grid has at most one CTA per 32 threads' words of the
      // input, a persistent one at most 8 an SM.
      void* sink = nullptr;
      CHECK_CUDA(cudaMalloc(&sink, in_bytes / 32 + 16 * 8 * prop.multiProcessorCount));
      for (int pass = 0; pass < 2; ++pass) {
        const bool flush = pass == 1;
        if (flush ? !l2_flush : !l2_rotate) continue;
        const char* l2_name = flush ? "flush" : "rotate";
        // Flush: sets.size() == 1 when only flushing; with both, set 0 is reused.
        const size_t nsets = flush ? 1 : sets.size();
        const size_t ncopy = flush ? 2 : copy_ring.size();
        auto prepare = [&](int i) {
          if (flush) CHECK_CUDA(cudaMemsetAsync(flush_buf, i & 0xFF, kFlushBytes, nullptr));
        };
        auto listed = [](const std::string& list, const char* name) {
          return list.empty() ||
                 ("," + list + ",").find(std::string(",") + name + ",") != std::string::npos;
        };
        for (const Usage& u : usages) {
          if (u.from_rowwise && mode.scaling == BlockScaling::kBlock1D) continue;
          if (!listed(usage_filter, u.name)) continue;
          const int64_t written =
              (u.row ? l.RowwiseDataBytes() + 4 * l.RowwiseScaleCount() : 0) +
              (u.col ? l.ColumnwiseDataBytes() + 4 * l.ColumnwiseScaleCount() : 0);
          const int64_t read =
              u.from_rowwise ? l.RowwiseDataBytes() + 4 * l.RowwiseScaleCount() : in_bytes;
          const int64_t total = read + written;
          // Copy of total / 2 bytes: it reads and writes that many, `total` in all.
          const int64_t copy_bytes = total / 2;
          double copy_next = 0;
          const double copy_us = MedianUs(
              warmup, iters, prepare,
              [&](int i) {
                CHECK_CUDA(cudaMemcpyAsync(copy_ring[(i + 1) % ncopy], copy_ring[i % ncopy],
                                           copy_bytes, cudaMemcpyDeviceToDevice, nullptr));
              },
              &copy_next);
          const double copy_tbps = total / (copy_us * 1e-6) / 1e12;
          // With --l2 flush: the flush after a launch and after the copy (see MedianUs).
          auto carry = [&](double next) {
            if (!flush) return std::string();
            char buf[96];
            std::snprintf(buf, sizeof(buf), ",\"next_flush_us\":%.2f,\"copy_next_flush_us\":%.2f",
                          next, copy_next);
            return std::string(buf);
          };
          char shape[32];
          std::snprintf(shape, sizeof(shape), "%lldx%lld", static_cast<long long>(s.m),
                        static_cast<long long>(s.n));
          // One measurement: a JSON line on stdout and a table row on stderr;
          // `pos` 0: not one of the quantize variants (no place in their block).
          auto report = [&](const char* variant, int pos, int64_t bytes, double us, double cus,
                            double ctbps, const std::string& extra) {
            const double tbps = bytes / (us * 1e-6) / 1e12;
            char posf[24] = "";
            if (pos > 0) std::snprintf(posf, sizeof(posf), "\"pos\":%d,", pos);
            std::printf(
                "{\"bench\":\"quantize_cuda\",\"mode\":\"%s\",\"l2\":\"%s\",\"usage\":\"%s\","
                "\"dtype\":\"bf16\",\"format\":\"e4m3\",\"m\":%lld,\"n\":%lld,\"variant\":\"%s\","
                "%s\"bytes\":%lld,\"time_us\":%.2f,\"tbps\":%.3f,\"copy_bytes\":%lld,"
                "\"copy_time_us\":%.2f,\"copy_tbps\":%.3f,\"ratio_vs_copy\":%.3f%s,\"iters\":%d,"
                "\"device\":\"%s\"}\n",
                mode.name, l2_name, u.name, static_cast<long long>(s.m),
                static_cast<long long>(s.n), variant, posf, static_cast<long long>(bytes), us, tbps,
                static_cast<long long>(copy_bytes), cus, ctbps, tbps / ctbps, extra.c_str(), iters,
                prop.name);
            std::fflush(stdout);
            std::fprintf(stderr, "%-6s %-7s %-8s %-12s %-12s %9.2f %7.3f %9.2f %7.3f %6.3f\n",
                         mode.name, l2_name, u.name, shape, variant, us, tbps, cus, ctbps,
                         tbps / ctbps);
          };
          // The bench's own copy kernel in each of its launch shapes, over the
          // same buffers: how fast a kernel streams these bytes here; and its
          // read-only and write-only halves over the bytes the quantize reads
          // (the input: what an amax pass must read) and writes.
          for (const qtx::bench::StreamCopyShape& k : qtx::bench::kStreamCopyShapes) {
            for (const char* op : {"kcopy_", "kread_", "kwrite_"}) {
              const std::string name = op + std::string(k.name);
              if (!listed(variant_filter, name.c_str())) continue;
              const bool reads = op[1] == 'r', writes = op[1] == 'w';
              if ((reads || writes) && k.bulk_chunk > 0) continue;
              const int64_t kbytes = (reads ? read : writes ? written : copy_bytes) / 16 * 16;
              double next = 0;
              const double us = MedianUs(
                  warmup, iters, prepare,
                  [&](int i) {
                    if (reads) {
                      CHECK_CUDA(
                          qtx::bench::StreamRead(sets[i % nsets].in, kbytes, sink, k, nullptr));
                    } else if (writes) {
                      CHECK_CUDA(qtx::bench::StreamWrite(copy_ring[i % ncopy], kbytes,
                                                         static_cast<uint32_t>(i), k, nullptr));
                    } else {
                      CHECK_CUDA(qtx::bench::StreamCopy(
                          copy_ring[i % ncopy], copy_ring[(i + 1) % ncopy], kbytes, k, nullptr));
                    }
                  },
                  &next);
              // Bytes moved: a copy reads and writes kbytes.
              const int64_t moved = (reads || writes) ? kbytes : 2 * kbytes;
              report(name.c_str(), 0, moved, us, copy_us, copy_tbps, carry(next));
            }
          }
          int pos = 0;  // the measurement's place in this block of variants
          for (const Variant* vp : order) {
            const Variant& v = *vp;
            const qcuda::detail::LaunchTuning& t = v.tuning;
            const bool is_default = t.stages == 0 && t.ctas_per_sm == 0 && !t.evict_first_outputs &&
                                    !t.fixed_tiles && !t.division_scales && !t.float_amax &&
                                    !t.half_tiles && !v.tensor_two_pass && !v.amax_phase &&
                                    !v.amax_pass;
            // Variants: row+col, row and col; the block kernels' knobs for 1d / 2d,
            // two_pass for tensor.
            const bool tensor = mode.scaling == BlockScaling::kTensor;
            const bool tensor_only = v.tensor_two_pass || v.amax_phase || v.amax_pass;
            if (!is_default && (u.from_rowwise || tensor != tensor_only)) {
              continue;
            }
            // Half tiles exist for the 1-D rowwise copy alone (else the default runs).
            if (t.half_tiles && (mode.scaling != BlockScaling::kBlock1D || u.col)) continue;
            QuantizeParams p;
            p.scaling = mode.scaling;
            p.format = Fp8Format::kE4M3;
            p.rowwise = u.row;
            p.columnwise = u.col;
            p.force_pow2_scales = true;
            double next = 0;
            ++pos;
            const double us = MedianUs(
                warmup, iters, prepare,
                [&](int i) {
                  const Set& st = sets[i % nsets];
                  QuantizedBuffers o = st.out;
                  if (!u.row) o.rowwise_data = nullptr, o.rowwise_scale_inv = nullptr;
                  if (!u.col) o.columnwise_data = nullptr, o.columnwise_scale_inv = nullptr;
                  if (u.from_rowwise) {
                    CHECK_CUDA(qcuda::ColumnwiseFromRowwise(
                        mode.scaling, {st.out.rowwise_data, st.out.rowwise_scale_inv}, s.m, s.n, o,
                        nullptr));
                    return;
                  }
                  if (v.amax_phase) {
                    qcuda::detail::TensorTuning phase1;
                    phase1.force_one_pass = true;
                    phase1.amax_phase_only = true;
                    CHECK_CUDA(qcuda::detail::QuantizeTensorTuned(st.in, dtype, s.m, s.n, p, o,
                                                                  phase1, nullptr));
                    return;
                  }
                  if (v.amax_pass) {
                    CHECK_CUDA(qcuda::TensorAmax(st.in, dtype, s.m * s.n, amax_out, nullptr));
                    return;
                  }
                  if (v.tensor_two_pass) {
                    CHECK_CUDA(qcuda::detail::QuantizeTensorTuned(st.in, dtype, s.m, s.n, p, o,
                                                                  {.two_pass = true}, nullptr));
                    return;
                  }
                  CHECK_CUDA(qcuda::detail::QuantizeBlockTuned(st.in, dtype, s.m, s.n, p, o,
                                                               v.tuning, nullptr));
                },
                &next);
            // The amax variants read the input and write no data.
            report(v.name, pos, v.amax_phase || v.amax_pass ? in_bytes : total, us, copy_us,
                   copy_tbps, carry(next));
          }
        }
      }
      for (void* c : copy_ring) cudaFree(c);
      cudaFree(sink);
      for (auto& st : sets) {
        cudaFree(st.in);
        cudaFree(st.out.rowwise_data);
        cudaFree(st.out.columnwise_data);
        cudaFree(st.out.rowwise_scale_inv);
        cudaFree(st.out.columnwise_scale_inv);
      }
    }
  }
  if (flush_buf != nullptr) cudaFree(flush_buf);
  cudaFree(amax_out);
  return 0;
}
