// kernels/cuda QuantizeTensor / DequantizeTensor (per-tensor current scaling)
// vs the CPU reference kernels/cpu/quantize_tensor, bit for bit: both data
// copies and both scale_inv values, with sentinel-filled outputs on both sides
// (so a byte written outside the tensor, or not written, shows). Shapes with
// M, N not multiples of 128, one row, one column, empty, and 16384x7168; all
// three input dtypes, E4M3 / E5M2, pow2 on / off, eps; rowwise, columnwise and
// both; aligned and misaligned buffers (the vector and the checked paths);
// normal, NaN / tie / subnormal sprinkled, Inf, tiny-amax and all-zero data;
// the one-pass cooperative launch, the two-pass launch and a captured launch.
// TensorAmax and QuantizeTensorWithAmax (the all-gather's shard amax and cast)
// likewise against cpu::TensorAmax and cpu::QuantizeTensorWithAmax.
#include "kernels/cuda/quantize_tensor.h"

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/quantize_tensor.h"
#include "kernels/cuda/quantize_block.h"
#include "kernels/fp8.h"
#include "tests/kernels/cuda/kernel_test_util.h"

namespace qtx::kernels::cuda {
namespace {

using namespace test_util;  // NOLINT(build/namespaces): the tests' helpers
using test_util::Name;      // overloaded below

class DeviceMem {
 public:
  explicit DeviceMem(size_t bytes) {
    if (cudaMalloc(&p_, bytes < 64 ? 64 : bytes) != cudaSuccess) p_ = nullptr;
  }
  ~DeviceMem() { cudaFree(p_); }
  DeviceMem(const DeviceMem&) = delete;
  DeviceMem& operator=(const DeviceMem&) = delete;
  uint8_t* get() const { return static_cast<uint8_t*>(p_); }

 private:
  void* p_ = nullptr;
};

enum class Data { kNormal, kSpecials, kInf, kTiny, kZero };
const char* Name(Data d) {
  switch (d) {
    case Data::kNormal:
      return "normal";
    case Data::kSpecials:
      return "specials";
    case Data::kInf:
      return "inf";
    case Data::kTiny:
      return "tiny";
    default:
      return "zero";
  }
}

std::vector<uint8_t> MakeInput(InputDType t, int64_t count, Data kind, uint64_t seed) {
  std::vector<uint8_t> buf(static_cast<size_t>(count * ElemBytes(t)), 0);
  FastRng rng{seed};
  const float sub = t == InputDType::kFloat16 ? std::ldexp(1.0f, -24) : BitsToFloat(0x00010000u);
  const float ties[] = {1.0625f, 1.1875f, 300.0f, -17.0f, 0.75f, 3.0f, 448.0f, -1.125f, 2.5f};
  float mag = 1.0f;
  for (int64_t i = 0; i < count; ++i) {
    if (i % 64 == 0) mag = std::ldexp(1.0f, static_cast<int>(rng.Next() % 13) - 6);
    const float r =
        std::sqrt(-2.0f * std::log(rng.Uniform())) * std::cos(6.2831853f * rng.Uniform()) * mag;
    float x = r;
    switch (kind) {
      case Data::kNormal:
        break;
      case Data::kSpecials: {
        const uint64_t p = rng.Next() % 1000;
        if (p < 5)
          x = std::nanf("");
        else if (p < 15)
          x = sub * static_cast<float>(1 + rng.Next() % 3);
        else if (p < 40)
          x = std::ldexp(ties[rng.Next() % 9], static_cast<int>(rng.Next() % 7) - 3);
        else if (p < 50)
          x = (rng.Next() & 1) ? 0.0f : -0.0f;
        break;
      }
      case Data::kInf:
        if (i == count / 2)
          x = (seed & 1) ? std::numeric_limits<float>::infinity()
                         : -std::numeric_limits<float>::infinity();
        break;
      case Data::kTiny:  // amax in the subnormal range: 448 / amax overflows FP32 (not FP16)
        x = sub * static_cast<float>(rng.Next() % 5) * ((rng.Next() & 1) ? 1.0f : -1.0f);
        break;
      case Data::kZero:
        x = (rng.Next() & 1) ? 0.0f : -0.0f;
        break;
    }
    Store(buf, t, i, x);
  }
  return buf;
}

struct Case {
  int64_t m, n;
  InputDType dtype;
  Fp8Format format;
  bool pow2;
  float eps;
  bool row, col;
  Data data;
  int misalign;  // bytes added to every device pointer (0: 256-byte aligned)
};

std::string Describe(const Case& c) {
  std::ostringstream os;
  os << c.m << "x" << c.n << " " << Name(c.dtype) << " "
     << (c.format == Fp8Format::kE4M3 ? "e4m3" : "e5m2") << " pow2=" << c.pow2 << " eps=" << c.eps
     << " " << (c.row ? "row" : "") << (c.col ? "+col" : "") << " " << Name(c.data)
     << " misalign=" << c.misalign;
  return os.str();
}

// The device outputs of a tensor quantize (rowwise and columnwise data at
// `off` in buffers of count + 64 sentinel bytes; the two scale_inv at words 0
// and 4 of 16 sentinel words) against the CPU's, byte for byte, and nothing
// written outside them.
void ExpectOutputs(const DeviceMem& d_row, const DeviceMem& d_col, const DeviceMem& d_s,
                   int64_t count, int off, const std::vector<uint8_t>& want_row,
                   const std::vector<uint8_t>& want_col, const std::vector<float>& want_s) {
  std::vector<uint8_t> got_row(count + 64), got_col(count + 64);
  std::vector<float> got_s(16);
  QTX_CUDA_ASSERT(cudaMemcpy(got_row.data(), d_row.get(), count + 64, cudaMemcpyDeviceToHost));
  QTX_CUDA_ASSERT(cudaMemcpy(got_col.data(), d_col.get(), count + 64, cudaMemcpyDeviceToHost));
  QTX_CUDA_ASSERT(cudaMemcpy(got_s.data(), d_s.get(), 64, cudaMemcpyDeviceToHost));
  for (int64_t i = 0; i < count + 64; ++i) {
    if (i >= off && i < off + count) continue;
    ASSERT_EQ(got_row[i], kDataSentinel) << "rowwise byte outside the buffer at " << i;
    ASSERT_EQ(got_col[i], kDataSentinel) << "columnwise byte outside the buffer at " << i;
  }
  const std::vector<uint8_t> row(got_row.begin() + off, got_row.begin() + off + count);
  const std::vector<uint8_t> col(got_col.begin() + off, got_col.begin() + off + count);
  std::string d = Diff("rowwise_data", want_row, row);
  EXPECT_TRUE(d.empty()) << d;
  d = Diff("columnwise_data", want_col, col);
  EXPECT_TRUE(d.empty()) << d;
  d = Diff("scale_inv (row, col)", want_s, std::vector<float>{got_s[0], got_s[4]});
  EXPECT_TRUE(d.empty()) << d;
  for (int i : {1, 2, 3, 5, 6, 7}) {
    EXPECT_EQ(FloatBits(got_s[i]), kScaleSentinel) << "scale word " << i << " written";
  }
}

// Quantizes on the GPU (through QuantizeBlock, which forwards TENSOR) and on
// the CPU; compares every byte and both scales; then dequantizes each copy on
// the GPU and compares with the CPU's dequantization.
void Check(const Case& c) {
  SCOPED_TRACE(Describe(c));
  const int64_t count = c.m * c.n;
  const std::vector<uint8_t> in =
      MakeInput(c.dtype, count, c.data, 0x1234 + static_cast<uint64_t>(c.m * 31 + c.n));
  const QuantizeParams p{BlockScaling::kTensor, c.format, c.row, c.col, c.pow2, c.eps};

  // CPU reference.
  std::vector<uint8_t> want_row(count, kDataSentinel), want_col(count, kDataSentinel);
  std::vector<float> want_s(2, BitsToFloat(kScaleSentinel));
  cpu::QuantizeTensor(in.data(), c.dtype, c.m, c.n, p,
                      {want_row.data(), &want_s[0], want_col.data(), &want_s[1]});

  // GPU.
  const int off = c.misalign;
  const size_t in_bytes = in.size();
  DeviceMem d_in(in_bytes + 64), d_row(count + 64), d_col(count + 64), d_s(64);
  ASSERT_NE(d_in.get(), nullptr);
  ASSERT_NE(d_row.get(), nullptr);
  ASSERT_NE(d_col.get(), nullptr);
  QTX_CUDA_ASSERT(cudaMemcpy(d_in.get() + off, in.data(), in_bytes, cudaMemcpyHostToDevice));
  QTX_CUDA_ASSERT(cudaMemset(d_row.get(), kDataSentinel, count + 64));
  QTX_CUDA_ASSERT(cudaMemset(d_col.get(), kDataSentinel, count + 64));
  QTX_CUDA_ASSERT(cudaMemset(d_s.get(), 0xFF, 64));
  float* s = reinterpret_cast<float*>(d_s.get());
  QuantizedBuffers out{d_row.get() + off, s, d_col.get() + off, s + 4};
  if (!c.row) out.rowwise_data = nullptr, out.rowwise_scale_inv = nullptr;
  if (!c.col) out.columnwise_data = nullptr, out.columnwise_scale_inv = nullptr;
  QTX_CUDA_ASSERT(
      QuantizeBlock(count ? d_in.get() + off : nullptr, c.dtype, c.m, c.n, p, out, nullptr));
  QTX_CUDA_ASSERT(cudaDeviceSynchronize());
  ExpectOutputs(d_row, d_col, d_s, count, off, want_row, want_col, want_s);
  if (count == 0 || ::testing::Test::HasFailure()) return;

  // Dequantize each produced copy on both sides (FP32 output, and BF16 once).
  for (bool use_row : {true, false}) {
    if (use_row ? !c.row : !c.col) continue;
    const InputDType od = use_row ? InputDType::kFloat32 : InputDType::kBFloat16;
    const size_t ob = static_cast<size_t>(count * ElemBytes(od));
    std::vector<uint8_t> want_out(ob), got_out(ob);
    QuantizedConstBuffers hin{want_row.data(), &want_s[0], want_col.data(), &want_s[1]};
    cpu::DequantizeTensor(hin, c.format, c.m, c.n, use_row, od, want_out.data());
    DeviceMem d_out(ob);
    QuantizedConstBuffers din{d_row.get() + off, s, d_col.get() + off, s + 4};
    QTX_CUDA_ASSERT(DequantizeBlock(din, BlockScaling::kTensor, c.format, c.m, c.n, use_row, od,
                                    d_out.get(), nullptr));
    QTX_CUDA_ASSERT(cudaMemcpy(got_out.data(), d_out.get(), ob, cudaMemcpyDeviceToHost));
    const std::string d =
        Diff(use_row ? "dequantized rowwise" : "dequantized columnwise", want_out, got_out);
    EXPECT_TRUE(d.empty()) << d;
  }
}

TEST(QuantizeTensorCuda, MatchesCpuOnEdgeShapes) {
  struct Shape {
    int64_t m, n;
  };
  const Shape shapes[] = {{1, 1},     {1, 1000},  {1000, 1},   {7, 9},       {128, 128},
                          {130, 300}, {255, 257}, {256, 1024}, {1000, 1000}, {129, 16}};
  const struct { bool row, col; } usages[] = {{true, false}, {false, true}, {true, true}};
  int n_cases = 0;
  for (const Shape& s : shapes) {
    for (InputDType t : {InputDType::kBFloat16, InputDType::kFloat16, InputDType::kFloat32}) {
      for (auto u : usages) {
        for (int k = 0; k < 2; ++k) {
          const Fp8Format f = (n_cases % 2) ? Fp8Format::kE5M2 : Fp8Format::kE4M3;
          const bool pow2 = (n_cases / 2) % 2 == 0;
          const Data data = static_cast<Data>(n_cases % 5);
          const float eps = data == Data::kZero && k == 1 ? 1e-4f : 0.0f;
          Check({s.m, s.n, t, f, pow2, eps, u.row, u.col, data, k == 0 ? 0 : 4});
          ++n_cases;
        }
      }
    }
  }
}

TEST(QuantizeTensorCuda, MatchesCpuForEveryOptionOnAlignedShapes) {
  for (InputDType t : {InputDType::kBFloat16, InputDType::kFloat16, InputDType::kFloat32}) {
    for (Fp8Format f : {Fp8Format::kE4M3, Fp8Format::kE5M2}) {
      for (bool pow2 : {true, false}) {
        for (bool col : {false, true}) {
          Check({512, 768, t, f, pow2, 0.0f, true, col, Data::kSpecials, 0});
          Check({384, 256, t, f, pow2, 0.0f, true, col, Data::kTiny, 0});
        }
      }
    }
  }
}

TEST(QuantizeTensorCuda, EmptyTensorWritesTheScale) {
  for (auto [m, n] : {std::pair<int64_t, int64_t>{0, 7}, {5, 0}, {0, 0}}) {
    for (float eps : {0.0f, 1e-4f}) {
      Check({m, n, InputDType::kBFloat16, Fp8Format::kE4M3, true, eps, true, true, Data::kZero, 0});
      Check(
          {m, n, InputDType::kFloat32, Fp8Format::kE5M2, false, eps, false, true, Data::kZero, 0});
    }
  }
}

TEST(QuantizeTensorCuda, MatchesCpuOnLargeShapes) {
  Check({16384, 7168, InputDType::kBFloat16, Fp8Format::kE4M3, true, 0.0f, true, true,
         Data::kNormal, 0});
  Check({16384, 7168, InputDType::kBFloat16, Fp8Format::kE4M3, false, 0.0f, true, false,
         Data::kSpecials, 0});
  Check({8191, 8192, InputDType::kFloat32, Fp8Format::kE5M2, true, 0.0f, true, true, Data::kNormal,
         0});
  Check({4097, 4100, InputDType::kFloat16, Fp8Format::kE4M3, false, 0.0f, true, true,
         Data::kSpecials, 4});
}

// One tensor of whole 128x128 tiles quantized five ways: the CPU reference;
// the default launch (which must take the one cooperative launch for tensors
// of at most 256 tiles); the one launch forced (force_one_pass); the two-pass launch
// (detail::TensorTuning::two_pass); and the forced one launch captured into a
// graph, which must take the two-pass launch. Every copy's bytes and
// scale_inv must equal the CPU's. Then the forced one launch stopped after
// its amax phase (amax_phase_only, the bench's phase-1 timing): the scales
// must equal the CPU's and no data byte may be written.
void CheckLaunchPaths(int64_t m, int64_t n, InputDType t, Fp8Format f, bool pow2, bool row,
                      bool col, Data data) {
  std::ostringstream what;
  what << m << "x" << n << " " << Name(t) << " pow2=" << pow2 << " " << (row ? "row" : "")
       << (col ? "+col" : "") << " " << Name(data);
  SCOPED_TRACE(what.str());
  const int64_t count = m * n;
  const std::vector<uint8_t> in = MakeInput(t, count, data, 0x5150 + static_cast<uint64_t>(m + n));
  const QuantizeParams p{BlockScaling::kTensor, f, row, col, pow2, 0.0f};
  std::vector<uint8_t> want_row(count, kDataSentinel), want_col(count, kDataSentinel);
  std::vector<float> want_s(2, BitsToFloat(kScaleSentinel));
  cpu::QuantizeTensor(in.data(), t, m, n, p,
                      {want_row.data(), &want_s[0], want_col.data(), &want_s[1]});

  DeviceMem d_in(in.size()), d_row(count), d_col(count), d_s(64);
  ASSERT_NE(d_in.get(), nullptr);
  ASSERT_NE(d_row.get(), nullptr);
  ASSERT_NE(d_col.get(), nullptr);
  QTX_CUDA_ASSERT(cudaMemcpy(d_in.get(), in.data(), in.size(), cudaMemcpyHostToDevice));
  float* s = reinterpret_cast<float*>(d_s.get());
  const QuantizedBuffers out{row ? d_row.get() : nullptr, row ? s : nullptr,
                             col ? d_col.get() : nullptr, col ? s + 1 : nullptr};
  // The default takes one pass wherever it applies for tensors of at most 256
  // tiles (kOnePassMaxTilesPerKept allows 6 per kept tile, and any GPU keeps
  // one a CTA for more than 43 CTAs); for larger ones it depends on the GPU.
  const bool small = (m / 128) * (n / 128) <= 256;
  const struct {
    const char* name;
    bool two_pass, force, capture, check_path, want_one_pass, amax_only;
  } ways[] = {{"default", false, false, false, small, true, false},
              {"one pass", false, true, false, true, true, false},
              {"two passes", true, false, false, true, false, false},
              {"captured", false, true, true, true, false, false},
              {"amax phase only", false, true, false, true, true, true}};
  for (const auto& way : ways) {
    SCOPED_TRACE(way.name);
    QTX_CUDA_ASSERT(cudaMemset(d_row.get(), kDataSentinel, count));
    QTX_CUDA_ASSERT(cudaMemset(d_col.get(), kDataSentinel, count));
    QTX_CUDA_ASSERT(cudaMemset(d_s.get(), 0xFF, 64));
    bool taken = !way.want_one_pass;
    const detail::TensorTuning tuning{way.two_pass, &taken, way.force, way.amax_only};
    if (way.capture) {
      cudaStream_t st = nullptr;
      QTX_CUDA_ASSERT(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
      cudaGraph_t g = nullptr;
      cudaGraphExec_t ge = nullptr;
      QTX_CUDA_ASSERT(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
      const cudaError_t e = detail::QuantizeTensorTuned(d_in.get(), t, m, n, p, out, tuning, st);
      QTX_CUDA_ASSERT(cudaStreamEndCapture(st, &g));
      QTX_CUDA_ASSERT(e);
      QTX_CUDA_ASSERT(cudaGraphInstantiate(&ge, g, 0));
      QTX_CUDA_ASSERT(cudaGraphLaunch(ge, st));
      QTX_CUDA_ASSERT(cudaStreamSynchronize(st));
      QTX_CUDA_ASSERT(cudaGraphExecDestroy(ge));
      QTX_CUDA_ASSERT(cudaGraphDestroy(g));
      QTX_CUDA_ASSERT(cudaStreamDestroy(st));
    } else {
      QTX_CUDA_ASSERT(detail::QuantizeTensorTuned(d_in.get(), t, m, n, p, out, tuning, nullptr));
      QTX_CUDA_ASSERT(cudaDeviceSynchronize());
    }
    if (way.check_path) {
      EXPECT_EQ(taken, way.want_one_pass) << "launch path";
    }
    std::vector<uint8_t> got_row(count), got_col(count);
    std::vector<float> got_s(2);
    QTX_CUDA_ASSERT(cudaMemcpy(got_row.data(), d_row.get(), count, cudaMemcpyDeviceToHost));
    QTX_CUDA_ASSERT(cudaMemcpy(got_col.data(), d_col.get(), count, cudaMemcpyDeviceToHost));
    QTX_CUDA_ASSERT(cudaMemcpy(got_s.data(), s, 2 * sizeof(float), cudaMemcpyDeviceToHost));
    const std::vector<uint8_t> untouched(count, kDataSentinel);
    std::string d = Diff("rowwise_data", way.amax_only ? untouched : want_row, got_row);
    EXPECT_TRUE(d.empty()) << d;
    d = Diff("columnwise_data", way.amax_only ? untouched : want_col, got_col);
    EXPECT_TRUE(d.empty()) << d;
    d = Diff("scale_inv (row, col)", want_s, got_s);
    EXPECT_TRUE(d.empty()) << d;
  }
}

// Shapes with more tiles than the CTAs keep in shared memory (8192^2 BF16:
// 4096 tiles; FP32 keeps one tile a CTA), one tile, and one tile a CTA.
TEST(QuantizeTensorCuda, OnePassTwoPassAndCapturedLaunchesMatchCpu) {
  CheckLaunchPaths(8192, 8192, InputDType::kBFloat16, Fp8Format::kE4M3, true, true, true,
                   Data::kNormal);
  CheckLaunchPaths(4096, 4096, InputDType::kFloat16, Fp8Format::kE5M2, false, true, false,
                   Data::kSpecials);
  CheckLaunchPaths(2048, 6144, InputDType::kFloat32, Fp8Format::kE4M3, false, false, true,
                   Data::kNormal);
  CheckLaunchPaths(3072, 1024, InputDType::kFloat32, Fp8Format::kE4M3, true, true, true,
                   Data::kTiny);
  CheckLaunchPaths(128, 128, InputDType::kBFloat16, Fp8Format::kE4M3, true, true, true,
                   Data::kSpecials);
  CheckLaunchPaths(1024, 4096, InputDType::kBFloat16, Fp8Format::kE5M2, true, false, true,
                   Data::kInf);
}

// TensorAmax and QuantizeTensorWithAmax vs the CPU's, bit for bit. The cast is
// given 4x the tensor's own amax (1 for an all-zero tensor), as a shard of a
// larger tensor is, so a cast that used the amax of its own input would write
// other bytes and scales. Sentinels around every output, as in Check.
void CheckWithAmax(int64_t m, int64_t n, InputDType t, Fp8Format f, bool pow2, bool row, bool col,
                   Data data, int misalign) {
  std::ostringstream what;
  what << m << "x" << n << " " << Name(t) << " " << (f == Fp8Format::kE4M3 ? "e4m3" : "e5m2")
       << " pow2=" << pow2 << " " << (row ? "row" : "") << (col ? "+col" : "") << " " << Name(data)
       << " misalign=" << misalign;
  SCOPED_TRACE(what.str());
  const int64_t count = m * n;
  const std::vector<uint8_t> in =
      MakeInput(t, count, data, 0x7A3 + static_cast<uint64_t>(m * 5 + n));
  const int off = misalign;
  DeviceMem d_in(in.size() + 64), d_row(count + 64), d_col(count + 64), d_s(64), d_amax(64);
  ASSERT_NE(d_in.get(), nullptr);
  ASSERT_NE(d_row.get(), nullptr);
  ASSERT_NE(d_col.get(), nullptr);
  QTX_CUDA_ASSERT(cudaMemcpy(d_in.get() + off, in.data(), in.size(), cudaMemcpyHostToDevice));
  const void* input = count ? d_in.get() + off : nullptr;

  // The tensor's own amax.
  const float own = cpu::TensorAmax(in.data(), t, count);
  float* amax = reinterpret_cast<float*>(d_amax.get());
  QTX_CUDA_ASSERT(cudaMemset(amax, 0xFF, 64));
  QTX_CUDA_ASSERT(TensorAmax(input, t, count, amax, nullptr));
  float got_amax[2];
  QTX_CUDA_ASSERT(cudaMemcpy(got_amax, amax, 8, cudaMemcpyDeviceToHost));
  EXPECT_EQ(FloatBits(got_amax[0]), FloatBits(own)) << "TensorAmax";
  EXPECT_EQ(FloatBits(got_amax[1]), kScaleSentinel) << "TensorAmax wrote past amax[0]";

  // The cast with another amax.
  const float given = own == 0.0f ? 1.0f : 4.0f * own;
  const QuantizeParams p{BlockScaling::kTensor, f, row, col, pow2, 0.0f};
  std::vector<uint8_t> want_row(count, kDataSentinel), want_col(count, kDataSentinel);
  std::vector<float> want_s(2, BitsToFloat(kScaleSentinel));
  cpu::QuantizeTensorWithAmax(in.data(), t, m, n, given, p,
                              {want_row.data(), &want_s[0], want_col.data(), &want_s[1]});
  QTX_CUDA_ASSERT(cudaMemcpy(amax, &given, 4, cudaMemcpyHostToDevice));
  QTX_CUDA_ASSERT(cudaMemset(d_row.get(), kDataSentinel, count + 64));
  QTX_CUDA_ASSERT(cudaMemset(d_col.get(), kDataSentinel, count + 64));
  QTX_CUDA_ASSERT(cudaMemset(d_s.get(), 0xFF, 64));
  float* s = reinterpret_cast<float*>(d_s.get());
  const QuantizedBuffers out{row ? d_row.get() + off : nullptr, row ? s : nullptr,
                             col ? d_col.get() + off : nullptr, col ? s + 4 : nullptr};
  QTX_CUDA_ASSERT(QuantizeTensorWithAmax(input, t, m, n, amax, p, out, nullptr));
  QTX_CUDA_ASSERT(cudaDeviceSynchronize());
  ExpectOutputs(d_row, d_col, d_s, count, off, want_row, want_col, want_s);
}

TEST(QuantizeTensorCuda, AmaxAndCastWithGivenAmaxMatchCpu) {
  struct Shape {
    int64_t m, n;
  };
  // Edge shapes, whole tiles (which QuantizeTensor would cast in its one
  // cooperative launch), one large enough for many amax CTAs, empty ones, and
  // the largest count TensorAmax reduces in one CTA (8192) and one more.
  const Shape shapes[] = {{1, 1},       {7, 9}, {1000, 1}, {130, 300}, {255, 257}, {256, 384},
                          {1025, 2049}, {0, 7}, {5, 0},    {64, 128},  {8193, 1}};
  const struct { bool row, col; } usages[] = {{true, false}, {false, true}, {true, true}};
  int n_cases = 0;
  for (const Shape& sh : shapes) {
    for (InputDType t : {InputDType::kBFloat16, InputDType::kFloat16, InputDType::kFloat32}) {
      for (Fp8Format f : {Fp8Format::kE4M3, Fp8Format::kE5M2}) {
        for (bool pow2 : {true, false}) {
          for (auto u : usages) {
            const Data data = static_cast<Data>(n_cases % 5);
            CheckWithAmax(sh.m, sh.n, t, f, pow2, u.row, u.col, data, (n_cases / 5) % 2 ? 4 : 0);
            ++n_cases;
          }
        }
      }
    }
  }
}

TEST(QuantizeTensorCuda, RejectsBadArguments) {
  DeviceMem buf(1024);
  float* s = reinterpret_cast<float*>(buf.get());
  const QuantizeParams p{BlockScaling::kTensor, Fp8Format::kE4M3, true, true, true, 0.0f};
  const QuantizedBuffers out{buf.get() + 256, s, buf.get() + 512, s + 1};
  EXPECT_EQ(QuantizeTensor(buf.get() + 768, InputDType::kFloat32, -1, 4, p, out, nullptr),
            cudaErrorInvalidValue);
  QuantizeParams bad = p;
  bad.amax_epsilon = -1.0f;
  EXPECT_EQ(QuantizeTensor(buf.get() + 768, InputDType::kFloat32, 2, 4, bad, out, nullptr),
            cudaErrorInvalidValue);
  bad = p;
  bad.amax_epsilon = std::numeric_limits<float>::infinity();
  EXPECT_EQ(QuantizeTensor(buf.get() + 768, InputDType::kFloat32, 2, 4, bad, out, nullptr),
            cudaErrorInvalidValue);
  bad = p;
  bad.rowwise = bad.columnwise = false;
  EXPECT_EQ(QuantizeTensor(buf.get() + 768, InputDType::kFloat32, 2, 4, bad, out, nullptr),
            cudaErrorInvalidValue);
  bad = p;
  bad.format = static_cast<Fp8Format>(7);
  EXPECT_EQ(QuantizeTensor(buf.get() + 768, InputDType::kFloat32, 2, 4, bad, out, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(QuantizeTensor(buf.get() + 768, static_cast<InputDType>(9), 2, 4, p, out, nullptr),
            cudaErrorInvalidValue);
  QuantizedBuffers no_scale = out;
  no_scale.columnwise_scale_inv = nullptr;
  EXPECT_EQ(QuantizeTensor(buf.get() + 768, InputDType::kFloat32, 2, 4, p, no_scale, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(QuantizeTensor(nullptr, InputDType::kFloat32, 2, 4, p, out, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(QuantizeTensor(buf.get(), InputDType::kFloat32, int64_t{1} << 40, int64_t{1} << 40, p,
                           out, nullptr),
            cudaErrorInvalidValue);
  // A null amax, also for an empty tensor (whose scale_inv would read it).
  const float* amax = s + 2;
  EXPECT_EQ(
      QuantizeTensorWithAmax(buf.get() + 768, InputDType::kFloat32, 2, 4, nullptr, p, out, nullptr),
      cudaErrorInvalidValue);
  EXPECT_EQ(QuantizeTensorWithAmax(nullptr, InputDType::kFloat32, 0, 4, nullptr, p, out, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(QuantizeTensorWithAmax(buf.get() + 768, InputDType::kFloat32, 2, 4, amax, p, no_scale,
                                   nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(QuantizeTensorWithAmax(buf.get() + 768, static_cast<InputDType>(9), 2, 4, amax, p, out,
                                   nullptr),
            cudaErrorInvalidValue);
  // The bench's phase-1 timing exists only for the one cooperative launch.
  // (A buffer large enough for the 128x128 tensor, in case a launch is made.)
  DeviceMem tile(3 * 128 * 128 * 2);
  float* tile_s = reinterpret_cast<float*>(tile.get() + 4 * 128 * 128);
  const QuantizedBuffers tile_out{tile.get() + 2 * 128 * 128, tile_s, tile.get() + 3 * 128 * 128,
                                  tile_s + 1};
  detail::TensorTuning phase1;
  phase1.amax_phase_only = true;
  phase1.two_pass = true;
  EXPECT_EQ(detail::QuantizeTensorTuned(tile.get(), InputDType::kBFloat16, 128, 128, p, tile_out,
                                        phase1, nullptr),
            cudaErrorNotSupported);
  phase1.two_pass = false;
  EXPECT_EQ(detail::QuantizeTensorTuned(buf.get() + 768, InputDType::kFloat32, 2, 4, p, out, phase1,
                                        nullptr),
            cudaErrorNotSupported);
  EXPECT_EQ(TensorAmax(buf.get() + 768, InputDType::kFloat32, 8, nullptr, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(TensorAmax(nullptr, InputDType::kFloat32, 8, s + 2, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(TensorAmax(buf.get() + 768, InputDType::kFloat32, -1, s + 2, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(TensorAmax(buf.get() + 768, static_cast<InputDType>(9), 8, s + 2, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

}  // namespace
}  // namespace qtx::kernels::cuda
