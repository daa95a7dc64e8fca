// Host memory-speed references for the host AdamW benchmark
// (bench/optimizer_cpu_bench.cc), measured in the same process and run:
//
//   TriadGbps: the STREAM-style triad a[i] = b[i] + s * c[i] over three FP32
//     arrays far larger than the last-level cache, `threads` OpenMP threads
//     each on a contiguous slice (the same slice its first touch used), best
//     of `reps`. Reported as 3 streams (12 B per element: the usual triad
//     figure) and 4 streams (16 B: the write-allocate read of a[] that cached
//     stores also cause).
//   UpdateTrafficFloor / FlatUpdate: AdamW's own streams over flat arrays
//     (gradient read, master and both moments read and written in place:
//     28 B per element with FP32 gradients), once with trivial arithmetic
//     (the memory time of those streams) and once with the kernels/adamw.h
//     update (what torch's fused CPU AdamW does: flat, no FP8 output).
//
// The loops are compiled for x86-64-v4 (AVX-512) as well as the baseline and
// the better one is picked at load time (GCC target_clones), like the band
// kernel they are compared with.
#ifndef QTX_BENCH_HOST_BANDWIDTH_H_
#define QTX_BENCH_HOST_BANDWIDTH_H_

#include <cstddef>
#include <cstdint>

#include "kernels/adamw.h"

namespace qtx::bench {

// Owns three 64-byte aligned FP32 arrays of `elems` elements each, first
// touched in parallel by `touch_threads` threads (static partition).
class TriadBuffers {
 public:
  TriadBuffers(size_t elems, int touch_threads);
  ~TriadBuffers();
  TriadBuffers(const TriadBuffers&) = delete;
  TriadBuffers& operator=(const TriadBuffers&) = delete;
  size_t elems() const { return elems_; }
  float* a() { return a_; }
  float* b() { return b_; }
  float* c() { return c_; }

 private:
  size_t elems_;
  float* a_;
  float* b_;
  float* c_;
};

struct TriadResult {
  double gbps = 0;                      // 3 streams (12 B per element) / best time
  double gbps_with_write_allocate = 0;  // 4 streams (16 B per element) / best time
  double best_ms = 0;
};
TriadResult TriadGbps(TriadBuffers& buf, int threads, int reps);

// Best time in seconds of `reps` passes over [0, count) with `threads`
// threads (contiguous slices). FP32 gradient. UpdateTrafficFloor adds the
// gradient to the three in-place arrays; FlatUpdate applies AdamWUpdate.
double UpdateTrafficFloor(float* p, float* m, float* v, const float* g, int64_t count, int threads,
                          int reps);
double FlatUpdate(float* p, float* m, float* v, const float* g, int64_t count,
                  const kernels::AdamWScalars& s, int threads, int reps);

// UpdateTrafficFloor's arithmetic in the band kernel's order (kernels/cpu/
// adamw_band.cc): [rows, cols] arrays cut into units of 128 rows x
// `unit_cols` columns, contiguous runs of units per thread, each unit row by
// row. Its time against UpdateTrafficFloor's is the cost of the access
// pattern alone.
double BandTrafficFloor(float* p, float* m, float* v, const float* g, int64_t rows, int64_t cols,
                        int64_t unit_cols, int threads, int reps);

// Last-level cache size in bytes as the C library reports it (0: unknown).
int64_t LastLevelCacheBytes();

}  // namespace qtx::bench

#endif  // QTX_BENCH_HOST_BANDWIDTH_H_
