// kernels/cuda QuantizeBlock / DequantizeBlock vs the CPU reference
// (kernels/cpu), byte for byte: every buffer, scale padding included, with
// sentinel-filled outputs on both sides. Shapes per issue 8; random normal and
// adversarial data (NaN, +-Inf, subnormals, dtype max, all-zero blocks, tiny
// amax, exact FP8 ties); all input dtypes, both formats, pow2 on/off, eps;
// 1-D and 2-D; rowwise-only, columnwise-only and both.
#include "kernels/cuda/quantize_block.h"

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/block_geometry.h"
#include "kernels/cpu/quantize_block.h"
#include "kernels/fp8.h"
#include "tests/kernels/cuda/kernel_test_util.h"

namespace qtx::kernels::cuda {
namespace {

using namespace test_util;  // NOLINT(build/namespaces): the tests' helpers

// Device allocation that frees itself.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t bytes) { Resize(bytes); }
  ~DeviceBuffer() { cudaFree(p_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  void Resize(size_t bytes) {
    if (bytes <= bytes_) return;
    cudaFree(p_);
    p_ = nullptr;
    bytes_ = 0;
    if (cudaMalloc(&p_, bytes < 16 ? 16 : bytes) == cudaSuccess) bytes_ = bytes;
  }
  template <typename T = void>
  T* get() const {
    return static_cast<T*>(p_);
  }

 private:
  void* p_ = nullptr;
  size_t bytes_ = 0;
};

void StoreBits16(std::vector<uint8_t>& buf, int64_t i, uint16_t h) {
  std::memcpy(buf.data() + 2 * i, &h, 2);
}

enum class DataKind { kNormal, kAdversarial };

// Random normal data (Box-Muller) whose magnitude varies by a power of two per
// 64-element run, so that neighbouring blocks get different scales.
std::vector<uint8_t> MakeInput(InputDType t, int64_t m, int64_t n, DataKind kind, uint64_t seed) {
  std::vector<uint8_t> buf(static_cast<size_t>(m * n * ElemBytes(t)));
  FastRng fast{seed};
  std::mt19937_64 rng(seed);
  const int64_t total = m * n;
  float mag = 1.0f;
  for (int64_t i = 0; i < total; i += 2) {
    if (i % 64 == 0) mag = std::ldexp(1.0f, static_cast<int>(fast.Next() % 13) - 6);
    const float r = std::sqrt(-2.0f * std::log(fast.Uniform()));
    const float a = 6.2831853f * fast.Uniform();
    Store(buf, t, i, r * std::cos(a) * mag);
    if (i + 1 < total) Store(buf, t, i + 1, r * std::sin(a) * mag);
  }
  if (kind == DataKind::kNormal) return buf;

  const float kInf = std::numeric_limits<float>::infinity();
  const float dtype_max = InputDTypeMax(t);
  // Smallest positive subnormal of the dtype, and a tiny value whose
  // fp8_max / amax overflows FP32 (scale := dtype max, docs/numerics.md §7).
  const float sub = t == InputDType::kFloat16 ? std::ldexp(1.0f, -24) : BitsToFloat(0x00010000u);
  const float tiny = BitsToFloat(0x00123400u);
  // FP8 ties after a power-of-two scale (docs/numerics.md §6.1, §6.2) and values
  // on the E5M2 grid's halfway points.
  const float ties[] = {1.0625f, 1.1875f, 300.0f, -17.0f,        0.75f,    3.0f,      448.0f,
                        100.0f,  -1.125f, 2.5f,   0.0009765625f, 57344.0f, -40960.0f, 1.0f};
  std::uniform_int_distribution<int> pick(0, 999);
  std::uniform_int_distribution<int> tie_pick(0, sizeof(ties) / sizeof(ties[0]) - 1);
  std::uniform_int_distribution<int> tie_exp(-3, 3);

  // Per 128x128 tile: a kind of content.
  const int64_t mb = CeilDiv(m, 128), nb = CeilDiv(n, 128);
  for (int64_t tm = 0; tm < mb; ++tm) {
    for (int64_t tn = 0; tn < nb; ++tn) {
      const int tile_kind = static_cast<int>(rng() % 8);
      for (int64_t r = tm * 128; r < std::min(m, tm * 128 + 128); ++r) {
        for (int64_t c = tn * 128; c < std::min(n, tn * 128 + 128); ++c) {
          const int64_t i = r * n + c;
          switch (tile_kind) {
            case 0:  // all zero (amax 0; with eps > 0, scale from eps)
              Store(buf, t, i, (rng() & 1) ? 0.0f : -0.0f);
              break;
            case 1:  // tiny amax: subnormal inputs
              Store(buf, t, i,
                    t == InputDType::kFloat16
                        ? sub * static_cast<float>(rng() % 8)
                        : tiny * static_cast<float>(rng() % 5) * ((rng() & 1) ? 1.0f : -1.0f));
              break;
            case 2:  // exact ties on the FP8 grid
              Store(buf, t, i, std::ldexp(ties[tie_pick(rng)], tie_exp(rng)));
              break;
            case 3:  // dtype max present
              if (pick(rng) < 20) Store(buf, t, i, (rng() & 1) ? dtype_max : -dtype_max);
              break;
            case 4:  // NaN only in some rows/columns
              if (r % 3 == 0 || c % 5 == 0) {
                if (t == InputDType::kFloat32) {
                  Store(buf, t, i,
                        BitsToFloat(0x7F800001u | static_cast<uint32_t>(rng() & 0x7FFFFF) |
                                    ((rng() & 1) ? 0x80000000u : 0u)));
                } else {
                  StoreBits16(
                      buf, i,
                      static_cast<uint16_t>((t == InputDType::kBFloat16 ? 0x7F81u : 0x7C01u) |
                                            (rng() & 0x3Fu) | ((rng() & 1) ? 0x8000u : 0u)));
                }
              }
              break;
            default: {  // sprinkled specials over normal data
              const int p = pick(rng);
              if (p < 4)
                Store(buf, t, i, std::nanf(""));
              else if (p < 6)
                Store(buf, t, i, kInf);
              else if (p < 8)
                Store(buf, t, i, -kInf);
              else if (p < 16)
                Store(buf, t, i, sub * static_cast<float>(1 + rng() % 3));
              else if (p < 18)
                Store(buf, t, i, -dtype_max);
              else if (p < 40)
                Store(buf, t, i, std::ldexp(ties[tie_pick(rng)], tie_exp(rng)));
              break;
            }
          }
        }
      }
    }
  }
  return buf;
}

struct Case {
  Fp8Format format;
  bool pow2;
  float eps;
  BlockScaling scaling;
  bool rowwise, columnwise;
  std::string Describe() const {
    std::ostringstream os;
    os << (scaling == BlockScaling::kBlock1D ? "1d" : "2d") << " "
       << (format == Fp8Format::kE4M3 ? "e4m3" : "e5m2") << " pow2=" << pow2 << " eps=" << eps
       << " " << (rowwise ? "row" : "") << (columnwise ? "col" : "");
    return os.str();
  }
};

// The device-side fixture: one input upload, outputs reused across cases.
class Runner {
 public:
  Runner(const std::vector<uint8_t>& input, InputDType t, int64_t m, int64_t n)
      : input_(input), t_(t), m_(m), n_(n), d_in_(input.size()) {
    if (!input.empty()) {
      cudaMemcpy(d_in_.get(), input.data(), input.size(), cudaMemcpyHostToDevice);
    }
  }

  // Quantizes on both backends and compares every buffer; optionally also
  // dequantizes both copies into every dtype and compares. With `tunings`, the
  // GPU runs once per tuned launch (QuantizeBlockTuned) instead of QuantizeBlock's
  // default, each compared with the one CPU reference.
  void Check(const Case& c, bool dequantize,
             const std::vector<detail::LaunchTuning>& tunings = {}) {
    SCOPED_TRACE(std::string(Name(t_)) + " " + std::to_string(m_) + "x" + std::to_string(n_) + " " +
                 c.Describe());
    QuantizeParams p;
    p.scaling = c.scaling;
    p.format = c.format;
    p.rowwise = c.rowwise;
    p.columnwise = c.columnwise;
    p.force_pow2_scales = c.pow2;
    p.amax_epsilon = c.eps;
    const QuantizedLayout l = ComputeLayout(c.scaling, m_, n_);

    // CPU reference.
    std::vector<uint8_t> want_qr(c.rowwise ? l.RowwiseDataBytes() : 0, kDataSentinel);
    std::vector<uint8_t> want_qc(c.columnwise ? l.ColumnwiseDataBytes() : 0, kDataSentinel);
    std::vector<uint32_t> want_sr(c.rowwise ? l.RowwiseScaleCount() : 0, kScaleSentinel);
    std::vector<uint32_t> want_sc(c.columnwise ? l.ColumnwiseScaleCount() : 0, kScaleSentinel);
    QuantizedBuffers cpu_out{c.rowwise ? want_qr.data() : nullptr,
                             c.rowwise ? reinterpret_cast<float*>(want_sr.data()) : nullptr,
                             c.columnwise ? want_qc.data() : nullptr,
                             c.columnwise ? reinterpret_cast<float*>(want_sc.data()) : nullptr};
    cpu::QuantizeBlock(input_.data(), t_, m_, n_, p, cpu_out);
    if (tunings.empty()) {
      CheckGpu(c, p, want_qr, want_qc, want_sr, want_sc, nullptr);
    } else {
      for (const detail::LaunchTuning& tuning : tunings) {
        SCOPED_TRACE(Describe(tuning));
        CheckGpu(c, p, want_qr, want_qc, want_sr, want_sc, &tuning);
        if (::testing::Test::HasFailure()) return;
      }
    }
    if (!dequantize || ::testing::Test::HasFailure()) return;
    CheckDequantize(c, want_qr, want_qc, want_sr, want_sc);
  }

  static std::string Describe(const detail::LaunchTuning& t) {
    std::ostringstream os;
    os << "stages " << t.stages << " ctas/SM " << t.ctas_per_sm << " fixed tiles " << t.fixed_tiles
       << " half tiles " << t.half_tiles;
    return os.str();
  }

 private:
  // The GPU side of Check: sentinel-filled outputs, one launch, every buffer
  // compared (the GPU outputs stay in qr_ .. sc_ for CheckDequantize).
  void CheckGpu(const Case& c, const QuantizeParams& p, const std::vector<uint8_t>& want_qr,
                const std::vector<uint8_t>& want_qc, const std::vector<uint32_t>& want_sr,
                const std::vector<uint32_t>& want_sc, const detail::LaunchTuning* tuning) {
    qr_.Resize(want_qr.size());
    qc_.Resize(want_qc.size());
    sr_.Resize(want_sr.size() * 4);
    sc_.Resize(want_sc.size() * 4);
    QTX_CUDA_ASSERT(cudaMemset(qr_.get(), kDataSentinel, want_qr.size()));
    QTX_CUDA_ASSERT(cudaMemset(qc_.get(), kDataSentinel, want_qc.size()));
    QTX_CUDA_ASSERT(cudaMemset(sr_.get(), 0xFF, want_sr.size() * 4));
    QTX_CUDA_ASSERT(cudaMemset(sc_.get(), 0xFF, want_sc.size() * 4));
    QuantizedBuffers gpu_out{
        c.rowwise ? qr_.get<uint8_t>() : nullptr, c.rowwise ? sr_.get<float>() : nullptr,
        c.columnwise ? qc_.get<uint8_t>() : nullptr, c.columnwise ? sc_.get<float>() : nullptr};
    if (tuning == nullptr) {
      QTX_CUDA_ASSERT(QuantizeBlock(d_in_.get(), t_, m_, n_, p, gpu_out, nullptr));
    } else {
      QTX_CUDA_ASSERT(
          detail::QuantizeBlockTuned(d_in_.get(), t_, m_, n_, p, gpu_out, *tuning, nullptr));
    }
    QTX_CUDA_ASSERT(cudaDeviceSynchronize());
    std::vector<uint8_t> got_qr(want_qr.size()), got_qc(want_qc.size());
    std::vector<uint32_t> got_sr(want_sr.size()), got_sc(want_sc.size());
    QTX_CUDA_ASSERT(cudaMemcpy(got_qr.data(), qr_.get(), got_qr.size(), cudaMemcpyDeviceToHost));
    QTX_CUDA_ASSERT(cudaMemcpy(got_qc.data(), qc_.get(), got_qc.size(), cudaMemcpyDeviceToHost));
    QTX_CUDA_ASSERT(
        cudaMemcpy(got_sr.data(), sr_.get(), got_sr.size() * 4, cudaMemcpyDeviceToHost));
    QTX_CUDA_ASSERT(
        cudaMemcpy(got_sc.data(), sc_.get(), got_sc.size() * 4, cudaMemcpyDeviceToHost));

    for (const std::string& d :
         {Diff("rowwise data", want_qr, got_qr), Diff("rowwise scale_inv", want_sr, got_sr),
          Diff("columnwise data", want_qc, got_qc),
          Diff("columnwise scale_inv", want_sc, got_sc)}) {
      if (!d.empty()) ADD_FAILURE() << d;
    }
    // Every scale entry (padding included) must have been written.
    for (const auto* s : {&got_sr, &got_sc}) {
      for (size_t i = 0; i < s->size(); ++i) {
        if ((*s)[i] == kScaleSentinel) {
          ADD_FAILURE() << "scale entry " << i << " left unwritten";
          break;
        }
      }
    }
  }

  // Dequantizes the CPU's and the GPU's copies (the last CheckGpu's) into every
  // dtype on both backends and compares.
  void CheckDequantize(const Case& c, const std::vector<uint8_t>& want_qr,
                       const std::vector<uint8_t>& want_qc, const std::vector<uint32_t>& want_sr,
                       const std::vector<uint32_t>& want_sc) {
    QuantizedConstBuffers cpu_in{want_qr.data(), reinterpret_cast<const float*>(want_sr.data()),
                                 want_qc.data(), reinterpret_cast<const float*>(want_sc.data())};
    QuantizedConstBuffers gpu_in{qr_.get<uint8_t>(), sr_.get<float>(), qc_.get<uint8_t>(),
                                 sc_.get<float>()};
    for (bool use_rowwise : {true, false}) {
      if (use_rowwise ? !c.rowwise : !c.columnwise) continue;
      for (InputDType od : {InputDType::kFloat32, InputDType::kBFloat16, InputDType::kFloat16}) {
        SCOPED_TRACE(std::string("dequantize ") + (use_rowwise ? "rowwise" : "columnwise") +
                     " -> " + Name(od));
        const size_t bytes = static_cast<size_t>(m_ * n_ * ElemBytes(od));
        std::vector<uint8_t> want(bytes, 0xCD), got(bytes);
        cpu::DequantizeBlock(cpu_in, c.scaling, c.format, m_, n_, use_rowwise, od, want.data());
        deq_.Resize(bytes);
        QTX_CUDA_ASSERT(cudaMemset(deq_.get(), 0xCD, bytes));
        QTX_CUDA_ASSERT(DequantizeBlock(gpu_in, c.scaling, c.format, m_, n_, use_rowwise, od,
                                        deq_.get(), nullptr));
        QTX_CUDA_ASSERT(cudaMemcpy(got.data(), deq_.get(), bytes, cudaMemcpyDeviceToHost));
        const std::string d = Diff("dequantized bytes", want, got);
        if (!d.empty()) ADD_FAILURE() << d;
      }
    }
  }

  const std::vector<uint8_t>& input_;
  InputDType t_;
  int64_t m_, n_;
  DeviceBuffer d_in_, qr_, qc_, sr_, sc_, deq_;
};

std::vector<Case> AllCases() {
  std::vector<Case> cases;
  for (BlockScaling s : {BlockScaling::kBlock1D, BlockScaling::kBlock2D}) {
    for (Fp8Format f : {Fp8Format::kE4M3, Fp8Format::kE5M2}) {
      for (bool pow2 : {true, false}) {
        for (float eps : {0.0f, 1e-4f}) {
          for (int usage : {3, 1, 2}) {
            cases.push_back({f, pow2, eps, s, (usage & 1) != 0, (usage & 2) != 0});
          }
        }
      }
    }
  }
  return cases;
}

struct Shape {
  int64_t m, n;
};

class QuantizeBlockCudaSmall : public ::testing::TestWithParam<Shape> {};

// Every dtype x format x pow2 x eps x 1-D/2-D x usage, both data kinds,
// dequantization included.
TEST_P(QuantizeBlockCudaSmall, MatchesCpuReferenceForEveryConfiguration) {
  const Shape s = GetParam();
  uint64_t seed = 1000 + s.m * 7919 + s.n;
  for (InputDType t : {InputDType::kBFloat16, InputDType::kFloat16, InputDType::kFloat32}) {
    for (DataKind kind : {DataKind::kNormal, DataKind::kAdversarial}) {
      SCOPED_TRACE(kind == DataKind::kNormal ? "normal data" : "adversarial data");
      const std::vector<uint8_t> input = MakeInput(t, s.m, s.n, kind, seed++);
      Runner runner(input, t, s.m, s.n);
      for (const Case& c : AllCases()) {
        runner.Check(c, /*dequantize=*/c.rowwise && c.columnwise);
        if (::testing::Test::HasFailure()) return;  // one readable failure
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, QuantizeBlockCudaSmall,
                         ::testing::Values(Shape{1, 1}, Shape{1, 129}, Shape{127, 129},
                                           Shape{128, 128}, Shape{130, 130}, Shape{200, 300},
                                           Shape{256, 1024}, Shape{3, 100000}, Shape{129, 1},
                                           Shape{384, 256},
                                           // The mixed path: whole tiles vectorized, edge
                                           // tiles checked (M % 16 == 0: columnwise too;
                                           // M % 16 != 0: rowwise-only).
                                           Shape{272, 400}, Shape{300, 256}, Shape{129, 384}),
                         [](const auto& info) {
                           return std::to_string(info.param.m) + "x" + std::to_string(info.param.n);
                         });

class QuantizeBlockCudaLarge : public ::testing::TestWithParam<Shape> {};

// Large tensors: the aligned, pipelined path over many tiles per CTA. A
// selection of configurations (the full cross product runs on small shapes).
TEST_P(QuantizeBlockCudaLarge, MatchesCpuReference) {
  const Shape s = GetParam();
  struct Config {
    InputDType t;
    DataKind kind;
    Case c;
    bool dequantize;
  };
  const Config configs[] = {
      {InputDType::kBFloat16,
       DataKind::kNormal,
       {Fp8Format::kE4M3, true, 0.0f, BlockScaling::kBlock1D, true, true},
       true},
      {InputDType::kBFloat16,
       DataKind::kNormal,
       {Fp8Format::kE4M3, true, 0.0f, BlockScaling::kBlock2D, true, true},
       true},
      {InputDType::kBFloat16,
       DataKind::kNormal,
       {Fp8Format::kE4M3, true, 0.0f, BlockScaling::kBlock1D, true, false},
       false},
      {InputDType::kBFloat16,
       DataKind::kNormal,
       {Fp8Format::kE4M3, true, 0.0f, BlockScaling::kBlock1D, false, true},
       false},
      {InputDType::kBFloat16,
       DataKind::kAdversarial,
       {Fp8Format::kE5M2, false, 1e-4f, BlockScaling::kBlock1D, true, true},
       false},
      {InputDType::kBFloat16,
       DataKind::kAdversarial,
       {Fp8Format::kE4M3, true, 0.0f, BlockScaling::kBlock2D, true, true},
       false},
      {InputDType::kFloat16,
       DataKind::kAdversarial,
       {Fp8Format::kE4M3, false, 0.0f, BlockScaling::kBlock1D, true, true},
       false},
      {InputDType::kFloat32,
       DataKind::kAdversarial,
       {Fp8Format::kE4M3, true, 0.0f, BlockScaling::kBlock1D, true, true},
       false},
      {InputDType::kFloat32,
       DataKind::kNormal,
       {Fp8Format::kE5M2, true, 0.0f, BlockScaling::kBlock2D, true, true},
       false},
  };
  uint64_t seed = 77 + s.m + s.n;
  for (const Config& cfg : configs) {
    const std::vector<uint8_t> input = MakeInput(cfg.t, s.m, s.n, cfg.kind, seed++);
    Runner runner(input, cfg.t, s.m, s.n);
    runner.Check(cfg.c, cfg.dequantize);
    if (::testing::Test::HasFailure()) return;
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, QuantizeBlockCudaLarge,
                         ::testing::Values(Shape{4096, 4096}, Shape{8192, 8192}, Shape{16384, 7168},
                                           Shape{1000, 4000}, Shape{8191, 8192}, Shape{8208, 4096},
                                           Shape{4100, 1040}),
                         [](const auto& info) {
                           return std::to_string(info.param.m) + "x" + std::to_string(info.param.n);
                         });

// Half tiles (LaunchTuning::half_tiles: 64x128 units in 128-thread CTAs, 1-D
// scaling with the rowwise copy alone) equal the CPU reference byte for byte,
// scale padding included, on every path: aligned (M, N multiples of 128, with 2
// and 3 stages, drawn and fixed tiles, 1-4 CTAs per SM; 8192x4096 wraps each
// CTA's stage ring many times), mixed (4160 rows: every 64-row unit whole, the
// last 128-row tile not; 4001 and 129 rows: a partial last unit; 4033: a last
// unit of one row) and tail (N % 16 != 0, M < 64, M = 65), for every input
// dtype, both formats, pow2 on and off, and eps.
TEST(QuantizeBlockCuda, HalfTilesMatchCpuReferenceOnEveryPath) {
  std::vector<detail::LaunchTuning> tunings;
  for (const auto& [stages, ctas, fixed] :
       {std::tuple{0, 0, false}, std::tuple{3, 0, false}, std::tuple{2, 1, false},
        std::tuple{3, 2, false}, std::tuple{0, 0, true}, std::tuple{3, 3, true}}) {
    detail::LaunchTuning t;
    t.stages = stages;
    t.ctas_per_sm = ctas;
    t.fixed_tiles = fixed;
    t.half_tiles = true;
    tunings.push_back(t);
  }
  struct Dims {
    int64_t m, n;
    bool all_cases;  // every format x pow2 x eps (else one case a dtype)
  };
  uint64_t seed = 4242;
  for (const Dims d : {Dims{37, 300, true}, Dims{65, 1000, true}, Dims{129, 384, true},
                       Dims{256, 1024, true}, Dims{4160, 1024, true}, Dims{4033, 2048, false},
                       Dims{4001, 6096, false}, Dims{2048, 1536, false}, Dims{8192, 4096, false}}) {
    for (InputDType t : {InputDType::kBFloat16, InputDType::kFloat16, InputDType::kFloat32}) {
      const DataKind kind = (seed & 1) ? DataKind::kAdversarial : DataKind::kNormal;
      const std::vector<uint8_t> input = MakeInput(t, d.m, d.n, kind, seed++);
      Runner runner(input, t, d.m, d.n);
      for (const Case& c : AllCases()) {
        if (c.scaling != BlockScaling::kBlock1D || !c.rowwise || c.columnwise) continue;
        runner.Check(c, /*dequantize=*/false, tunings);
        if (::testing::Test::HasFailure()) return;  // one readable failure
        if (!d.all_cases) break;
      }
    }
  }
}

// One buffer holding every output of a layout: rowwise data, columnwise
// data, rowwise scales, columnwise scales.
struct PackedOutputs {
  explicit PackedOutputs(const QuantizedLayout& layout)
      : l(layout),
        bytes(l.RowwiseDataBytes() + l.ColumnwiseDataBytes() +
              4 * (l.RowwiseScaleCount() + l.ColumnwiseScaleCount())) {}
  QuantizedBuffers At(uint8_t* base) const {
    uint8_t* scales = base + l.RowwiseDataBytes() + l.ColumnwiseDataBytes();
    return QuantizedBuffers{base, reinterpret_cast<float*>(scales), base + l.RowwiseDataBytes(),
                            reinterpret_cast<float*>(scales + 4 * l.RowwiseScaleCount())};
  }
  const QuantizedLayout l;
  const size_t bytes;
};

// The same results whatever the launch shape: every tuned launch (2 or 3 stages,
// 1 CTA per SM, plain instead of evict-first stores, the fixed tile share,
// pow2 scales by division, unpacked 1-D amaxes) equals the CPU reference
// byte for byte, rowwise + columnwise and rowwise only. 8192x4096 gives every
// CTA of the persistent grid many tiles, so the shared-memory stage ring wraps
// several times.
TEST(QuantizeBlockCuda, TunedLaunchesMatchCpuReference) {
  struct Dims {
    int64_t m, n;
  };
  for (const Dims d : {Dims{2048, 1536}, Dims{8192, 4096}}) {
    const int64_t m = d.m, n = d.n;
    const std::vector<uint8_t> input =
        MakeInput(InputDType::kBFloat16, m, n, DataKind::kAdversarial, 5);
    DeviceBuffer d_in(input.size());
    QTX_CUDA_ASSERT(cudaMemcpy(d_in.get(), input.data(), input.size(), cudaMemcpyHostToDevice));
    for (const bool col : {true, false})
      for (BlockScaling s : {BlockScaling::kBlock1D, BlockScaling::kBlock2D}) {
        QuantizeParams p;
        p.scaling = s;
        p.rowwise = true;
        p.columnwise = col;
        const PackedOutputs packed(ComputeLayout(s, m, n));
        const size_t bytes = packed.bytes;
        auto pack = [&packed](uint8_t* base) { return packed.At(base); };
        std::vector<uint8_t> ref(bytes, 0x55);
        cpu::QuantizeBlock(input.data(), InputDType::kBFloat16, m, n, p, pack(ref.data()));
        for (detail::LaunchTuning tuning :
             {detail::LaunchTuning{}, detail::LaunchTuning{3, 1}, detail::LaunchTuning{2, 1},
              detail::LaunchTuning{3, 0}, detail::LaunchTuning{2, 2},
              detail::LaunchTuning{0, 0, true}, detail::LaunchTuning{3, 1, true},
              detail::LaunchTuning{0, 0, false, true}, detail::LaunchTuning{0, 1, false, true},
              detail::LaunchTuning{0, 0, true, true}, detail::LaunchTuning{3, 0, false, true},
              detail::LaunchTuning{0, 0, false, false, true},
              detail::LaunchTuning{3, 0, false, false, true},
              detail::LaunchTuning{0, 0, false, false, false, true},
              detail::LaunchTuning{2, 0, false, false, false, true}, detail::LaunchTuning{2, 0}}) {
          DeviceBuffer out(bytes);
          QTX_CUDA_ASSERT(cudaMemset(out.get(), 0x55, bytes));
          QTX_CUDA_ASSERT(detail::QuantizeBlockTuned(d_in.get(), InputDType::kBFloat16, m, n, p,
                                                     pack(out.get<uint8_t>()), tuning, nullptr));
          std::vector<uint8_t> got(bytes);
          QTX_CUDA_ASSERT(cudaMemcpy(got.data(), out.get(), bytes, cudaMemcpyDeviceToHost));
          EXPECT_TRUE(got == ref) << m << "x" << n << (s == BlockScaling::kBlock1D ? " 1d" : " 2d")
                                  << (col ? " row+col" : " row") << " stages " << tuning.stages
                                  << " ctas/SM " << tuning.ctas_per_sm << " evict-first outputs "
                                  << tuning.evict_first_outputs << " fixed tiles "
                                  << tuning.fixed_tiles << " division scales "
                                  << tuning.division_scales << " FP32 amaxes " << tuning.float_amax;
        }
      }
  }
}

// The stream's tile counter (drawn tiles, the default) is left at 0 by every
// launch and is per stream: three launches in a row on each of two streams,
// enqueued together so that they can overlap, and a launch captured into a graph
// (which falls back to the fixed tile share) all equal the CPU reference, on the
// aligned path and on the mixed one (edge tiles: 4001 x 6096). A counter that
// was not reset, or shared by the two streams, would skip tiles and leave the
// 0x55 fill in the output.
TEST(QuantizeBlockCuda, TileCounterRepeatsStreamsAndGraphsMatchCpuReference) {
  struct Dims {
    int64_t m, n;
  };
  cudaStream_t streams[2];
  for (auto& st : streams) QTX_CUDA_ASSERT(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  for (const Dims d : {Dims{4096, 6144}, Dims{4001, 6096}}) {
    const int64_t m = d.m, n = d.n;
    const std::vector<uint8_t> input =
        MakeInput(InputDType::kBFloat16, m, n, DataKind::kAdversarial, 11);
    DeviceBuffer d_in(input.size());
    QTX_CUDA_ASSERT(cudaMemcpy(d_in.get(), input.data(), input.size(), cudaMemcpyHostToDevice));
    for (BlockScaling s : {BlockScaling::kBlock1D, BlockScaling::kBlock2D}) {
      QuantizeParams p;
      p.scaling = s;
      p.rowwise = p.columnwise = true;
      const PackedOutputs packed(ComputeLayout(s, m, n));
      const size_t bytes = packed.bytes;
      auto pack = [&packed](uint8_t* base) { return packed.At(base); };
      std::vector<uint8_t> ref(bytes, 0x55);
      cpu::QuantizeBlock(input.data(), InputDType::kBFloat16, m, n, p, pack(ref.data()));
      // The default (3 stages: two tiles loading ahead), 1 CTA per SM (twice the
      // tiles per CTA) and 2 stages (one tile ahead).
      for (const auto& [ctas_per_sm, stages] :
           {std::pair{0, 0}, std::pair{1, 0}, std::pair{0, 2}}) {
        detail::LaunchTuning tuning;
        tuning.ctas_per_sm = ctas_per_sm;
        tuning.stages = stages;
        constexpr int kRepeats = 3;
        std::vector<DeviceBuffer> outs(2 * kRepeats + 1);
        for (auto& o : outs) {
          o.Resize(bytes);
          QTX_CUDA_ASSERT(cudaMemset(o.get(), 0x55, bytes));
        }
        for (int r = 0; r < kRepeats; ++r) {
          for (int k = 0; k < 2; ++k) {
            QTX_CUDA_ASSERT(detail::QuantizeBlockTuned(d_in.get(), InputDType::kBFloat16, m, n, p,
                                                       pack(outs[2 * r + k].get<uint8_t>()), tuning,
                                                       streams[k]));
          }
        }
        cudaGraph_t graph = nullptr;
        QTX_CUDA_ASSERT(cudaStreamBeginCapture(streams[0], cudaStreamCaptureModeThreadLocal));
        QTX_CUDA_ASSERT(detail::QuantizeBlockTuned(d_in.get(), InputDType::kBFloat16, m, n, p,
                                                   pack(outs.back().get<uint8_t>()), tuning,
                                                   streams[0]));
        QTX_CUDA_ASSERT(cudaStreamEndCapture(streams[0], &graph));
        cudaGraphExec_t exec = nullptr;
        QTX_CUDA_ASSERT(cudaGraphInstantiate(&exec, graph, 0));
        QTX_CUDA_ASSERT(cudaGraphLaunch(exec, streams[1]));
        QTX_CUDA_ASSERT(cudaDeviceSynchronize());
        cudaGraphExecDestroy(exec);
        cudaGraphDestroy(graph);
        for (size_t i = 0; i < outs.size(); ++i) {
          std::vector<uint8_t> got(bytes);
          QTX_CUDA_ASSERT(cudaMemcpy(got.data(), outs[i].get(), bytes, cudaMemcpyDeviceToHost));
          EXPECT_TRUE(got == ref) << m << "x" << n << (s == BlockScaling::kBlock1D ? " 1d" : " 2d")
                                  << " ctas/SM " << ctas_per_sm << " stages " << stages
                                  << " output " << i
                                  << (i + 1 == outs.size() ? " (graph)" : " (stream launch)");
        }
      }
    }
  }
  for (auto& st : streams) {
    QTX_CUDA_ASSERT(ForgetStreamTileCounter(st));
    QTX_CUDA_ASSERT(cudaStreamDestroy(st));
  }
}

// More streams than there are tile counters (1024 per device): the streams
// past the last free counter share their tiles in the fixed order, with the
// same bytes; once forgotten, the counters serve new streams, again with the
// same bytes, and the number of streams holding a counter says which did.
// M x 2048 with one tile row more than 2 tiles per SM is more tiles
// than the GPU holds CTAs at once (2 per SM), so every launch draws tiles where
// it has a counter (on an H200: 2176 x 2048, 272 tiles for 264 CTAs).
TEST(QuantizeBlockCuda, MoreStreamsThanTileCountersAndForgottenCountersMatchCpuReference) {
  int dev = 0, sms = 0;
  QTX_CUDA_ASSERT(cudaGetDevice(&dev));
  QTX_CUDA_ASSERT(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  const int64_t n = 2048;                      // 16 tile columns
  const int64_t m = 128 * (2 * sms / 16 + 1);  // 16 tiles a row: > 2 tiles per SM
  const std::vector<uint8_t> input =
      MakeInput(InputDType::kBFloat16, m, n, DataKind::kAdversarial, 17);
  DeviceBuffer d_in(input.size());
  QTX_CUDA_ASSERT(cudaMemcpy(d_in.get(), input.data(), input.size(), cudaMemcpyHostToDevice));
  // 2-D rowwise: 2 stages of 128x128 tiles, 2 CTAs per SM by default, so the
  // launch draws its tiles (1-D rowwise alone may run half tiles, 4 CTAs per SM).
  QuantizeParams p;
  p.scaling = BlockScaling::kBlock2D;
  p.rowwise = true;
  p.columnwise = false;
  const PackedOutputs packed(ComputeLayout(p.scaling, m, n));
  const size_t bytes = packed.bytes;
  auto pack = [&packed](uint8_t* base) { return packed.At(base); };
  std::vector<uint8_t> ref(bytes, 0x55);
  cpu::QuantizeBlock(input.data(), InputDType::kBFloat16, m, n, p, pack(ref.data()));
  DeviceBuffer out(bytes);
  std::vector<uint8_t> got(bytes);
  constexpr int kStreams = 1100;
  std::vector<cudaStream_t> streams(kStreams);
  const int held_before = detail::TileCountersHeld();  // other tests' streams (stream 0)
  for (int round = 0; round < 2; ++round) {
    for (int i = 0; i < kStreams; ++i) {
      QTX_CUDA_ASSERT(cudaStreamCreateWithFlags(&streams[i], cudaStreamNonBlocking));
      QTX_CUDA_ASSERT(cudaMemsetAsync(out.get(), 0x55, bytes, streams[i]));
      QTX_CUDA_ASSERT(QuantizeBlock(d_in.get(), InputDType::kBFloat16, m, n, p,
                                    pack(out.get<uint8_t>()), streams[i]));
      QTX_CUDA_ASSERT(
          cudaMemcpyAsync(got.data(), out.get(), bytes, cudaMemcpyDeviceToHost, streams[i]));
      QTX_CUDA_ASSERT(cudaStreamSynchronize(streams[i]));
      ASSERT_TRUE(got == ref) << "round " << round << " stream " << i;
    }
    // Every counter is held (by the first streams), none twice; forgetting frees them all.
    EXPECT_EQ(detail::TileCountersHeld(), 1024) << "round " << round;
    for (cudaStream_t st : streams) {
      QTX_CUDA_ASSERT(ForgetStreamTileCounter(st));
      QTX_CUDA_ASSERT(cudaStreamDestroy(st));
    }
    EXPECT_EQ(detail::TileCountersHeld(), held_before) << "round " << round;
  }
}

TEST(QuantizeBlockCuda, ZeroElementTensorsLaunchNothingAndSucceed) {
  QuantizeParams p;
  p.rowwise = p.columnwise = true;
  QuantizedBuffers b{reinterpret_cast<uint8_t*>(16), reinterpret_cast<float*>(16),
                     reinterpret_cast<uint8_t*>(16), reinterpret_cast<float*>(16)};
  // Bogus (never dereferenced) pointers: a launch would fault.
  EXPECT_EQ(QuantizeBlock(nullptr, InputDType::kBFloat16, 0, 128, p, b, nullptr), cudaSuccess);
  EXPECT_EQ(QuantizeBlock(nullptr, InputDType::kBFloat16, 128, 0, p, b, nullptr), cudaSuccess);
  QuantizedConstBuffers cb{b.rowwise_data, b.rowwise_scale_inv, b.columnwise_data,
                           b.columnwise_scale_inv};
  EXPECT_EQ(DequantizeBlock(cb, BlockScaling::kBlock1D, Fp8Format::kE4M3, 0, 7, true,
                            InputDType::kFloat32, nullptr, nullptr),
            cudaSuccess);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

TEST(QuantizeBlockCuda, RejectsInvalidArguments) {
  DeviceBuffer buf(1 << 20);
  QuantizeParams p;
  p.rowwise = true;
  QuantizedBuffers b{buf.get<uint8_t>(), buf.get<float>(), nullptr, nullptr};
  EXPECT_EQ(QuantizeBlock(buf.get(), InputDType::kBFloat16, -1, 4, p, b, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(QuantizeBlock(buf.get(), static_cast<InputDType>(7), 4, 4, p, b, nullptr),
            cudaErrorInvalidValue);
  p.columnwise = true;  // requested without buffers
  EXPECT_EQ(QuantizeBlock(buf.get(), InputDType::kBFloat16, 4, 4, p, b, nullptr),
            cudaErrorInvalidValue);
  p.columnwise = false;
  p.amax_epsilon = -1.0f;
  EXPECT_EQ(QuantizeBlock(buf.get(), InputDType::kBFloat16, 4, 4, p, b, nullptr),
            cudaErrorInvalidValue);
  p.amax_epsilon = std::nanf("");
  EXPECT_EQ(QuantizeBlock(buf.get(), InputDType::kBFloat16, 4, 4, p, b, nullptr),
            cudaErrorInvalidValue);
}

}  // namespace
}  // namespace qtx::kernels::cuda
