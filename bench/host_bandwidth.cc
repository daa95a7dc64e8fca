// See host_bandwidth.h.
#include "bench/host_bandwidth.h"

#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <new>

namespace qtx::bench {
namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// Thread t of nt: elements [lo, hi) of count.
inline void Slice(int64_t count, int t, int nt, int64_t* lo, int64_t* hi) {
  *lo = count * t / nt;
  *hi = count * (t + 1) / nt;
}

float* AlignedFloats(size_t elems) {
  void* p = nullptr;
  if (posix_memalign(&p, 64, std::max<size_t>(elems, 1) * sizeof(float)) != 0) {
    throw std::bad_alloc();
  }
  return static_cast<float*>(p);
}

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define QTX_BENCH_CLONES __attribute__((target_clones("arch=x86-64-v4", "default")))
#else
#define QTX_BENCH_CLONES
#endif

QTX_BENCH_CLONES void TriadSpan(float* __restrict a, const float* __restrict b,
                                const float* __restrict c, float s, int64_t lo, int64_t hi) {
  for (int64_t i = lo; i < hi; ++i) a[i] = b[i] + s * c[i];
}

QTX_BENCH_CLONES void TrafficSpan(float* __restrict p, float* __restrict m, float* __restrict v,
                                  const float* __restrict g, int64_t lo, int64_t hi) {
  for (int64_t i = lo; i < hi; ++i) {
    const float x = g[i];
    p[i] += x;
    m[i] += x;
    v[i] += x * x;  // stays >= 0: the moments remain valid for the steps timed after
  }
}

QTX_BENCH_CLONES void UpdateSpan(float* __restrict p, float* __restrict m, float* __restrict v,
                                 const float* __restrict g, int64_t lo, int64_t hi,
                                 const kernels::AdamWScalars& s) {
  const kernels::AdamWScalars c = s;
  for (int64_t i = lo; i < hi; ++i) {
    float pi = p[i], mi = m[i], vi = v[i];
    kernels::AdamWUpdate(pi, mi, vi, g[i], c);
    p[i] = pi;
    m[i] = mi;
    v[i] = vi;
  }
}

template <typename Body>
double BestOf(int threads, int reps, Body body) {
  double best = 1e30;
  for (int r = 0; r <= reps; ++r) {  // r == 0: warm-up (threads started, pages mapped)
    const auto t0 = Clock::now();
#pragma omp parallel num_threads(threads)
    body(omp_get_thread_num(), omp_get_num_threads());
    const double s = Seconds(t0, Clock::now());
    if (r > 0) best = std::min(best, s);
  }
  return best;
}

}  // namespace

TriadBuffers::TriadBuffers(size_t elems, int touch_threads)
    : elems_(elems), a_(AlignedFloats(elems)), b_(AlignedFloats(elems)), c_(AlignedFloats(elems)) {
  const int64_t count = static_cast<int64_t>(elems);
#pragma omp parallel num_threads(touch_threads)
  {
    int64_t lo, hi;
    Slice(count, omp_get_thread_num(), omp_get_num_threads(), &lo, &hi);
    for (int64_t i = lo; i < hi; ++i) {
      a_[i] = 0.0f;
      b_[i] = 1.0f;
      c_[i] = 2.0f;
    }
  }
}

TriadBuffers::~TriadBuffers() {
  std::free(a_);
  std::free(b_);
  std::free(c_);
}

TriadResult TriadGbps(TriadBuffers& buf, int threads, int reps) {
  const int64_t count = static_cast<int64_t>(buf.elems());
  float* a = buf.a();
  const float* b = buf.b();
  const float* c = buf.c();
  const double best = BestOf(threads, reps, [&](int t, int nt) {
    int64_t lo, hi;
    Slice(count, t, nt, &lo, &hi);
    TriadSpan(a, b, c, 3.0f, lo, hi);
  });
  TriadResult r;
  r.best_ms = best * 1e3;
  r.gbps = 12.0 * static_cast<double>(count) / best / 1e9;
  r.gbps_with_write_allocate = 16.0 * static_cast<double>(count) / best / 1e9;
  return r;
}

double UpdateTrafficFloor(float* p, float* m, float* v, const float* g, int64_t count, int threads,
                          int reps) {
  return BestOf(threads, reps, [&](int t, int nt) {
    int64_t lo, hi;
    Slice(count, t, nt, &lo, &hi);
    TrafficSpan(p, m, v, g, lo, hi);
  });
}

double FlatUpdate(float* p, float* m, float* v, const float* g, int64_t count,
                  const kernels::AdamWScalars& s, int threads, int reps) {
  return BestOf(threads, reps, [&](int t, int nt) {
    int64_t lo, hi;
    Slice(count, t, nt, &lo, &hi);
    UpdateSpan(p, m, v, g, lo, hi, s);
  });
}

double BandTrafficFloor(float* p, float* m, float* v, const float* g, int64_t rows, int64_t cols,
                        int64_t unit_cols, int threads, int reps) {
  constexpr int64_t kBand = 128;
  const int64_t bands = (rows + kBand - 1) / kBand;
  const int64_t chunks = (cols + unit_cols - 1) / unit_cols;
  const int64_t units = bands * chunks;
  return BestOf(threads, reps, [&](int t, int nt) {
    int64_t u0, u1;
    Slice(units, t, nt, &u0, &u1);
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t r0 = (u / chunks) * kBand, r1 = std::min(rows, r0 + kBand);
      const int64_t c0 = (u % chunks) * unit_cols, c1 = std::min(cols, c0 + unit_cols);
      for (int64_t r = r0; r < r1; ++r) TrafficSpan(p, m, v, g, r * cols + c0, r * cols + c1);
    }
  });
}

int64_t LastLevelCacheBytes() {
#if defined(_SC_LEVEL3_CACHE_SIZE)
  const long l3 = sysconf(_SC_LEVEL3_CACHE_SIZE);
  if (l3 > 0) return l3;
#endif
#if defined(_SC_LEVEL2_CACHE_SIZE)
  const long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
  if (l2 > 0) return l2;
#endif
  return 0;
}

}  // namespace qtx::bench
