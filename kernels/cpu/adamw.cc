// Host AdamW fused with the block-scaled FP8 parameter output. See adamw.h and
// kernels/adamw.h (operation order), docs/numerics.md §2 (scales), §4 (layouts).
//
// This file plans the call (work units of every parameter), runs the band
// kernel (adamw_band.cc: the update, amax, scales, encode and transpose of a
// unit) on contiguous runs of units per OpenMP thread, and picks the band
// kernel's instruction set at run time: AVX-512 where it is compiled in and
// the CPU has it, else the baseline build (AVX2 with the default
// QTX_CPU_ARCH, scalar without). Both produce the same bytes.
#include "kernels/cpu/adamw.h"

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "kernels/block_geometry.h"
#include "kernels/cpu/adamw_band.h"
#include "kernels/cpu/quantize_block.h"
#include "kernels/cpu/quantize_tensor.h"
#include "kernels/fp8.h"

namespace qtx::kernels::cpu {
namespace {

bool CpuHasAvx512() {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx512cd") && __builtin_cpu_supports("avx2") &&
         __builtin_cpu_supports("fma") && __builtin_cpu_supports("bmi2");
#else
  return false;
#endif
}

// The best available ISA, or QTX_ADAMW_ISA=baseline|avx512 from the
// environment when that one is available.
internal::BandIsa InitialIsa() {
  const char* env = std::getenv("QTX_ADAMW_ISA");
  if (env != nullptr && std::strcmp(env, "baseline") == 0) return internal::BandIsa::kBaseline;
  if (internal::BandIsaAvailable(internal::BandIsa::kAvx512)) return internal::BandIsa::kAvx512;
  return internal::BandIsa::kBaseline;
}

std::atomic<int>& ActiveIsaSlot() {
  static std::atomic<int> slot{static_cast<int>(InitialIsa())};
  return slot;
}

// The unit schedule of AdamWStepFused with more than one thread (see
// internal::SetUnitClaimChunk): 0 = contiguous runs. Claimed runs of 4 units
// by default: on the GPU machine's host (16 threads of a shared VM), static
// contiguous runs finish when the slowest thread does, and the step's time
// varied by +-20 % from call to call; claimed runs cut the median step by 5-23 %
// at 2-16 threads and the spread to a few percent (bench/results/
// optimizer_host_session14_2026-12-02.md).
constexpr int64_t kDefaultClaimUnits = 4;
std::atomic<int64_t>& UnitClaimSlot() {
  static std::atomic<int64_t> slot{kDefaultClaimUnits};
  return slot;
}

void ZeroScales(const AdamWParamBuffers& b, const QuantizedLayout& l) {
  if (!b.fp8_output) return;
  if (b.quant.rowwise && l.RowwiseScaleCount() > 0) {
    std::memset(b.fp8.rowwise_scale_inv, 0, sizeof(float) * l.RowwiseScaleCount());
  }
  if (b.quant.columnwise && l.ColumnwiseScaleCount() > 0) {
    std::memset(b.fp8.columnwise_scale_inv, 0, sizeof(float) * l.ColumnwiseScaleCount());
  }
}

constexpr int64_t kNormChunk = 4096;

template <InputDType kG>
double ChunkSumSquares(const void* g, int64_t begin, int64_t end) {
  // Eight independent lanes (vectorizable without reassociating a single
  // sum), folded in a fixed order: the result depends only on the data.
  double lane[8] = {};
  int64_t i = begin;
  for (; i + 8 <= end; i += 8) {
    for (int l = 0; l < 8; ++l) {
      const double x = LoadAs<kG>(g, i + l);
      lane[l] += x * x;
    }
  }
  for (int l = 0; i < end; ++i, ++l) {
    const double x = LoadAs<kG>(g, i);
    lane[l] += x * x;
  }
  return ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
}

double ChunkSumSquaresDispatch(const void* g, InputDType t, int64_t begin, int64_t end) {
  switch (t) {
    case InputDType::kFloat32:
      return ChunkSumSquares<InputDType::kFloat32>(g, begin, end);
    case InputDType::kBFloat16:
      return ChunkSumSquares<InputDType::kBFloat16>(g, begin, end);
    case InputDType::kFloat16:
      return ChunkSumSquares<InputDType::kFloat16>(g, begin, end);
  }
  return 0.0;
}

}  // namespace

void AdamWStepFused(std::span<const AdamWParamBuffers> params, const AdamWScalars& s,
                    int num_threads) {
  // Per-tensor scaling (TENSOR) needs the amax of the whole updated parameter
  // before any byte is cast, which one pass over tiles cannot give. The units
  // of such a parameter update it and fold its max |p| (ParamPlan::
  // tensor_amax); once every unit is done, a second pass over its units casts
  // every tile with the scale of that amax (EncodeTensorUnits: the band
  // kernel's encoder and transposes). That is QuantizeTensor of the updated
  // master weights byte for byte (docs/numerics.md §9, the very definition of
  // its FP8 output), with one read of the master for the cast instead of two.
  const auto per_tensor = [](const AdamWParamBuffers& b) {
    return b.fp8_output && b.quant.scaling == BlockScaling::kTensor;
  };
  // MagnitudeBits of each per-tensor parameter's amax (value-initialized: 0).
  std::vector<std::atomic<uint32_t>> tensor_amax(params.size());
  std::vector<band::ParamPlan> plans;  // non-empty parameters only
  plans.reserve(params.size());
  int64_t units = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    const AdamWParamBuffers& b = params[i];
    band::ParamPlan plan;
    plan.b = &b;
    plan.layout = ComputeLayout(b.quant.scaling, b.m, b.n);
    ZeroScales(b, plan.layout);  // padding entries stay 0, as QuantizeBlock writes them
    if (b.m == 0 || b.n == 0) continue;
    plan.mb = CeilDiv(b.m, kBlockLen);
    plan.nb = CeilDiv(b.n, kBlockLen);
    plan.chunks = CeilDiv(plan.nb, band::kUnitTiles);
    plan.first_unit = units;
    if (per_tensor(b)) plan.tensor_amax = &tensor_amax[i];
    units += plan.mb * plan.chunks;
    plans.push_back(plan);
  }
  const bool avx512 = internal::ActiveBandIsa() == internal::BandIsa::kAvx512;
#if !defined(QTX_ADAMW_HAVE_AVX512)
  (void)avx512;
#endif
  const int threads = static_cast<int>(std::min<int64_t>(
      num_threads > 0 ? num_threads : omp_get_max_threads(), std::max<int64_t>(units, 1)));
  // Runs `pass(plans, count, range)` over every unit on `threads` threads.
  const auto run_units = [&](auto&& pass) {
    if (threads <= 1) {
      pass(plans.data(), plans.size(), band::UnitRange{.u0 = 0, .u1 = units});
      return;
    }
    const int64_t chunk = internal::ClaimRunLength(units, threads);
    std::atomic<int64_t> claim{0};
#pragma omp parallel num_threads(threads)
    {
      if (chunk > 0) {
        pass(plans.data(), plans.size(),
             band::UnitRange{.u0 = 0, .u1 = units, .claim = &claim, .chunk = chunk});
      } else {
        // Contiguous runs of units, as even as possible (as schedule(static)).
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        pass(plans.data(), plans.size(),
             band::UnitRange{.u0 = units * t / nt, .u1 = units * (t + 1) / nt});
      }
    }
  };
  if (units > 0) {
    run_units([&](const band::ParamPlan* p, size_t count, const band::UnitRange& range) {
#if defined(QTX_ADAMW_HAVE_AVX512)
      if (avx512) return band::avx512::RunUnits(p, count, range, s);
#endif
      band::base::RunUnits(p, count, range, s);
    });
  }
  // Per-tensor parameters: the scale from the folded amax (as QuantizeTensor
  // computes it), then every tile cast with it.
  bool any_tensor = false;
  for (band::ParamPlan& plan : plans) {
    if (plan.tensor_amax == nullptr) continue;
    const AdamWParamBuffers& b = *plan.b;
    const float amax = std::bit_cast<float>(plan.tensor_amax->load(std::memory_order_relaxed));
    plan.tensor_scale =
        TensorScale(amax, b.quant.format, b.quant.force_pow2_scales, b.quant.amax_epsilon);
    const float scale_inv = ScaleInv(plan.tensor_scale);
    if (b.quant.rowwise) b.fp8.rowwise_scale_inv[0] = scale_inv;
    if (b.quant.columnwise) b.fp8.columnwise_scale_inv[0] = scale_inv;
    any_tensor = true;
  }
  if (any_tensor) {
    run_units([&](const band::ParamPlan* p, size_t count, const band::UnitRange& range) {
#if defined(QTX_ADAMW_HAVE_AVX512)
      if (avx512) return band::avx512::EncodeTensorUnits(p, count, range);
#endif
      band::base::EncodeTensorUnits(p, count, range);
    });
  }
  for (const AdamWParamBuffers& b : params) {
    // An empty per-tensor parameter has no units; it still gets the
    // scale_inv of amax 0.
    if (per_tensor(b) && (b.m == 0 || b.n == 0)) {
      QuantizeTensorWithAmax(b.master, InputDType::kFloat32, b.m, b.n, 0.0f, b.quant, b.fp8);
    }
  }
}

void AdamWReference(std::span<const AdamWParamBuffers> params, const AdamWScalars& call) {
  for (const AdamWParamBuffers& b : params) {
    const AdamWScalars& s = b.scalars != nullptr ? *b.scalars : call;
    const int64_t count = b.m * b.n;
    for (int64_t i = 0; i < count; ++i) {
      float g = LoadAsFloat(b.grad, b.grad_dtype, i);
      float p = b.master[i];
      float m, v;
      if (b.moment_dtype == MomentDType::kFloat32) {
        m = static_cast<const float*>(b.exp_avg)[i];
        v = static_cast<const float*>(b.exp_avg_sq)[i];
      } else {
        m = Bf16ToFloat(static_cast<const uint16_t*>(b.exp_avg)[i]);
        v = Bf16ToFloat(static_cast<const uint16_t*>(b.exp_avg_sq)[i]);
      }
      g = g * s.grad_scale;
      p = p * s.decay;
      m = s.beta1 * m;
      m = m + s.one_minus_beta1 * g;
      float gg = s.one_minus_beta2 * g;
      gg = gg * g;
      v = s.beta2 * v;
      v = v + gg;
      float denom = std::sqrt(v);
      denom = denom / s.bc2_sqrt;
      denom = denom + s.eps;
      float update = s.step_size * m;
      update = update / denom;
      p = p - update;
      b.master[i] = p;
      if (b.moment_dtype == MomentDType::kFloat32) {
        static_cast<float*>(b.exp_avg)[i] = m;
        static_cast<float*>(b.exp_avg_sq)[i] = v;
      } else {
        static_cast<uint16_t*>(b.exp_avg)[i] = FloatToBf16(m);
        static_cast<uint16_t*>(b.exp_avg_sq)[i] = FloatToBf16(v);
      }
    }
    if (b.fp8_output) QuantizeBlock(b.master, InputDType::kFloat32, b.m, b.n, b.quant, b.fp8);
    if (b.bf16 != nullptr) {
      for (int64_t i = 0; i < count; ++i) b.bf16[i] = FloatToBf16(b.master[i]);
    }
  }
}

GradNormResult GradSumSquares(std::span<const AdamWParamBuffers> params, int num_threads) {
  struct Chunk {
    const AdamWParamBuffers* b;
    int64_t begin, end;
  };
  std::vector<Chunk> chunks;
  for (const AdamWParamBuffers& b : params) {
    const int64_t count = b.m * b.n;
    for (int64_t i = 0; i < count; i += kNormChunk) {
      chunks.push_back({&b, i, std::min(count, i + kNormChunk)});
    }
  }
  std::vector<double> partial(chunks.size());
  const int threads = num_threads > 0 ? num_threads : omp_get_max_threads();
  const int64_t nchunks = static_cast<int64_t>(chunks.size());
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (int64_t c = 0; c < nchunks; ++c) {
    partial[c] = ChunkSumSquaresDispatch(chunks[c].b->grad, chunks[c].b->grad_dtype,
                                         chunks[c].begin, chunks[c].end);
  }
  GradNormResult r;
  for (double x : partial) r.sum_squares += x;
  r.all_finite = std::isfinite(r.sum_squares);
  return r;
}

std::vector<double> GradChunkSumSquares(const AdamWParamBuffers& b, int num_threads) {
  const int64_t count = b.m * b.n;
  const int64_t nchunks = (count + kNormChunk - 1) / kNormChunk;
  std::vector<double> partial(nchunks);
  const int threads = num_threads > 0 ? num_threads : omp_get_max_threads();
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (int64_t c = 0; c < nchunks; ++c) {
    partial[c] = ChunkSumSquaresDispatch(b.grad, b.grad_dtype, c * kNormChunk,
                                         std::min(count, (c + 1) * kNormChunk));
  }
  return partial;
}

namespace internal {
bool BandIsaAvailable(BandIsa isa) {
  if (isa == BandIsa::kBaseline) return true;
#if defined(QTX_ADAMW_HAVE_AVX512)
  static const bool cpu = CpuHasAvx512();
  return cpu;
#else
  return false;
#endif
}

BandIsa ActiveBandIsa() { return static_cast<BandIsa>(ActiveIsaSlot().load()); }

int64_t UnitClaimChunk() { return UnitClaimSlot().load(std::memory_order_relaxed); }

int64_t ClaimRunLength(int64_t units, int threads) {
  const int64_t chunk = UnitClaimChunk();
  if (chunk == 0) return 0;
  // Shortened for calls with few units per thread, so that every thread has
  // about four runs to claim (a call of 8 units on 8 threads in runs of 4
  // would leave 6 of them idle).
  return std::min<int64_t>(chunk, std::max<int64_t>(1, units / (4 * std::max(threads, 1))));
}

bool SetUnitClaimChunk(int64_t units) {
  if (units < 0) return false;
  UnitClaimSlot().store(units, std::memory_order_relaxed);
  return true;
}

bool SetBandIsa(BandIsa isa) {
  if (!BandIsaAvailable(isa)) return false;
  ActiveIsaSlot().store(static_cast<int>(isa));
  return true;
}

uint8_t EncodeFp8Branchless(float x, Fp8Format f) {
#if defined(QTX_ADAMW_HAVE_AVX512)
  if (ActiveBandIsa() == BandIsa::kAvx512) return band::avx512::EncodeFp8Branchless(x, f);
#endif
  return band::base::EncodeFp8Branchless(x, f);
}

void EncodeFp8Row(const float* p, float scale, uint8_t* out, int64_t len, Fp8Format f) {
#if defined(QTX_ADAMW_HAVE_AVX512)
  if (ActiveBandIsa() == BandIsa::kAvx512) return band::avx512::EncodeFp8Row(p, scale, out, len, f);
#endif
  band::base::EncodeFp8Row(p, scale, out, len, f);
}
}  // namespace internal

}  // namespace qtx::kernels::cpu
