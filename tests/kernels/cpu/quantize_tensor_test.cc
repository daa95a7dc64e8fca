// The CPU reference of per-tensor current scaling (kernels/cpu/quantize_tensor.h,
// docs/numerics.md "Per-tensor current scaling") against hand-computed values
// and against an independent formulation written here from the spec: double
// arithmetic for the scale (one division rounded to FP32 equals IEEE FP32
// division) and a nearest-value search over the FP8 grid for the cast.
#include "kernels/cpu/quantize_tensor.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/block_geometry.h"
#include "kernels/cpu/quantize_block.h"
#include "kernels/fp8.h"

namespace qtx::kernels::cpu {
namespace {

const float kInf = std::numeric_limits<float>::infinity();
const float kNan = std::numeric_limits<float>::quiet_NaN();

uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

struct Result {
  std::vector<uint8_t> row, col;
  float row_scale_inv = 0, col_scale_inv = 0;
};

// Quantizes with TENSOR through the public entry (QuantizeBlock forwards),
// sentinel-filled outputs.
Result RunTensor(const void* in, InputDType dt, int64_t m, int64_t n, Fp8Format f, bool pow2,
                 float eps, bool row = true, bool col = true) {
  Result r;
  r.row.assign(static_cast<size_t>(m * n), 0xAA);
  r.col.assign(static_cast<size_t>(m * n), 0xAA);
  r.row_scale_inv = r.col_scale_inv = BitsToFloat(0xFFFFFFFFu);
  QuantizeParams p{BlockScaling::kTensor, f, row, col, pow2, eps};
  QuantizedBuffers out{r.row.data(), &r.row_scale_inv, r.col.data(), &r.col_scale_inv};
  QuantizeBlock(in, dt, m, n, p, out);
  return r;
}

std::vector<uint16_t> Bf16(const std::vector<float>& v) {
  std::vector<uint16_t> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = FloatToBf16(v[i]);
  return out;
}

// ---- hand-computed vectors ------------------------------------------------------

struct HandCase {
  std::string name;
  int64_t m, n;
  std::vector<float> x;  // row-major, BF16-rounded before use
  Fp8Format f;
  bool pow2;
  float eps;
  uint32_t scale_inv_bits;
  std::vector<uint8_t> row_bytes;
};

// One scale for the whole tensor: in row 0 below, a 1x128 block would get
// amax 3.5 (scale 128); the tensor's amax is 100 (row 1).
std::vector<HandCase> HandCases() {
  const std::vector<float> a = {1.0f, -3.5f, 0.001f, 100.0f, 0.0f, 0.0f};
  return {
      // 448/100 = 4.48 -> 4; 400 ties 384/416 -> 384 (0x7c); 0.00099945*4 -> 2*2^-9.
      {"pow2_e4m3",
       2,
       3,
       a,
       Fp8Format::kE4M3,
       true,
       0,
       0x3e800000u,
       {0x48, 0xd6, 0x02, 0x7c, 0x00, 0x00}},
      // scale RN(4.48); 4.48 -> 4.5 (0x49), -15.68 -> -16 (0xd8), 448 -> 0x7e.
      {"fp32scale_e4m3",
       2,
       3,
       a,
       Fp8Format::kE4M3,
       false,
       0,
       0x3e649249u,
       {0x49, 0xd8, 0x02, 0x7e, 0x00, 0x00}},
      // 57344/100 -> 512; 512 (0x60), -1792 (0xe7), 0.5117 -> 0.5 (0x38), 51200 -> 0x7a.
      {"pow2_e5m2",
       2,
       3,
       a,
       Fp8Format::kE5M2,
       true,
       0,
       0x3b000000u,
       {0x60, 0xe7, 0x38, 0x7a, 0x00, 0x00}},
      {"all_zero", 3, 1, {0, 0, 0}, Fp8Format::kE4M3, true, 0, 0x3f800000u, {0, 0, 0}},
      // eps 1e-4 -> 448e4 -> 2^22; scale_inv 2^-22.
      {"all_zero_eps", 1, 2, {0, 0}, Fp8Format::kE4M3, true, 1e-4f, 0x34800000u, {0, 0}},
      // NaN ignored: amax 2 -> 128; NaN -> 0x7f.
      {"nan",
       2,
       2,
       {kNan, 2.0f, -0.5f, 0},
       Fp8Format::kE4M3,
       true,
       0,
       0x3c000000u,
       {0x7f, 0x78, 0xe8, 0x00}},
      // Inf: scale 1 for everything; Inf -> max, -600 saturates.
      {"inf",
       2,
       2,
       {kInf, 1.0f, -600.0f, 0},
       Fp8Format::kE4M3,
       true,
       0,
       0x3f800000u,
       {0x7e, 0x38, 0xfe, 0x00}},
      {"neg_inf_e5m2", 1, 2, {-kInf, 1.0f}, Fp8Format::kE5M2, true, 0, 0x3f800000u, {0xfb, 0x3c}},
      // BF16 2^-133 (bits 0x0001): 448 / amax overflows -> FLT_MAX (for every
      // input dtype, unlike the block modes' BF16 max); x * FLT_MAX rounds to
      // 2^-5 (0x10). Pow2: 2^127, x -> 2^-6 (0x08).
      {"tiny_bf16_fp32scale",
       1,
       1,
       {BitsToFloat(0x00010000u)},
       Fp8Format::kE4M3,
       false,
       0,
       0x00200000u,
       {0x10}},
      {"tiny_bf16_pow2",
       1,
       1,
       {BitsToFloat(0x00010000u)},
       Fp8Format::kE4M3,
       true,
       0,
       0x00000001u << 22,
       {0x08}},
      // Ties: 300 -> 288, 1.0625 -> 1.0, 1.1875 -> 1.25, -17 -> -16 (scale 1: amax 300).
      {"ties",
       1,
       5,
       {300.0f, 1.0f, 1.0625f, 1.1875f, -17.0f},
       Fp8Format::kE4M3,
       true,
       0,
       0x3f800000u,
       {0x79, 0x38, 0x38, 0x3a, 0xd8}},
  };
}

class HandTest : public ::testing::TestWithParam<HandCase> {};

TEST_P(HandTest, ScaleInvAndBytes) {
  const HandCase& c = GetParam();
  const std::vector<uint16_t> in = Bf16(c.x);
  const Result r = RunTensor(in.data(), InputDType::kBFloat16, c.m, c.n, c.f, c.pow2, c.eps);
  EXPECT_EQ(Bits(r.row_scale_inv), c.scale_inv_bits);
  EXPECT_EQ(Bits(r.col_scale_inv), c.scale_inv_bits);
  ASSERT_EQ(r.row.size(), c.row_bytes.size());
  for (size_t i = 0; i < c.row_bytes.size(); ++i) {
    EXPECT_EQ(r.row[i], c.row_bytes[i]) << "element " << i;
  }
  for (int64_t i = 0; i < c.m; ++i) {
    for (int64_t j = 0; j < c.n; ++j) {
      EXPECT_EQ(r.col[j * c.m + i], r.row[i * c.n + j]) << "transpose at " << i << "," << j;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Vectors, HandTest, ::testing::ValuesIn(HandCases()),
                         [](const auto& info) { return info.param.name; });

TEST(QuantizeTensor, DiffersFromBlock1DWhereBlocksDiffer) {
  // Row 0 alone has amax 3.5: the 1x128 block scales it by 128 (1.0 -> 0x70),
  // the tensor by 4 (1.0 -> 0x48).
  const std::vector<uint16_t> in = Bf16({1.0f, -3.5f, 0.001f, 100.0f, 0.0f, 0.0f});
  const Result t = RunTensor(in.data(), InputDType::kBFloat16, 2, 3, Fp8Format::kE4M3, true, 0);
  std::vector<uint8_t> row(6, 0xAA);
  const QuantizedLayout l = ComputeLayout(BlockScaling::kBlock1D, 2, 3);
  std::vector<float> scale(l.RowwiseScaleCount());
  QuantizeBlock(in.data(), InputDType::kBFloat16, 2, 3,
                {BlockScaling::kBlock1D, Fp8Format::kE4M3, true, false, true, 0},
                {row.data(), scale.data(), nullptr, nullptr});
  EXPECT_EQ(row[0], 0x70);
  EXPECT_EQ(t.row[0], 0x48);
}

TEST(QuantizeTensor, EmptyTensorWritesTheScaleOfAmaxZero) {
  for (auto [m, n] : {std::pair<int64_t, int64_t>{0, 5}, {7, 0}, {0, 0}}) {
    SCOPED_TRACE(std::to_string(m) + "x" + std::to_string(n));
    float s_row = -1.0f, s_col = -1.0f;
    QuantizeParams p{BlockScaling::kTensor, Fp8Format::kE4M3, true, true, true, 0};
    QuantizeBlock(nullptr, InputDType::kFloat32, m, n, p, {nullptr, &s_row, nullptr, &s_col});
    EXPECT_EQ(Bits(s_row), 0x3f800000u);
    EXPECT_EQ(Bits(s_col), 0x3f800000u);
    p.amax_epsilon = 1e-4f;
    QuantizeBlock(nullptr, InputDType::kFloat32, m, n, p, {nullptr, &s_row, nullptr, &s_col});
    EXPECT_EQ(Bits(s_row), 0x34800000u);  // eps applies as for a zero-amax block
  }
}

TEST(QuantizeTensor, LayoutIsOneScalePerCopy) {
  for (auto [m, n] : {std::pair<int64_t, int64_t>{0, 0}, {1, 1}, {300, 200}}) {
    const QuantizedLayout l = ComputeLayout(BlockScaling::kTensor, m, n);
    EXPECT_EQ(l.RowwiseScaleCount(), 1);
    EXPECT_EQ(l.ColumnwiseScaleCount(), 1);
    EXPECT_EQ(l.RowwiseDataBytes(), m * n);
    EXPECT_EQ(l.columnwise_data_rows, n);
    EXPECT_EQ(l.columnwise_data_cols, m);
  }
}

TEST(QuantizeTensor, OnlyTheRequestedCopyIsWritten) {
  const std::vector<float> x = {1.0f, 2.0f, 3.0f, 4.0f};
  Result r =
      RunTensor(x.data(), InputDType::kFloat32, 2, 2, Fp8Format::kE4M3, true, 0, false, true);
  EXPECT_EQ(r.row, std::vector<uint8_t>(4, 0xAA));
  EXPECT_EQ(Bits(r.row_scale_inv), 0xFFFFFFFFu);
  EXPECT_NE(r.col, std::vector<uint8_t>(4, 0xAA));
  r = RunTensor(x.data(), InputDType::kFloat32, 2, 2, Fp8Format::kE4M3, true, 0, true, false);
  EXPECT_EQ(r.col, std::vector<uint8_t>(4, 0xAA));
  EXPECT_EQ(Bits(r.col_scale_inv), 0xFFFFFFFFu);
}

// ---- an independent formulation ------------------------------------------------

// FP8 magnitudes of codes 0..max_code, from the format definition.
std::vector<double> Fp8Grid(Fp8Format f) {
  const int e_bits = f == Fp8Format::kE4M3 ? 4 : 5;
  const int m_bits = f == Fp8Format::kE4M3 ? 3 : 2;
  const int bias = (1 << (e_bits - 1)) - 1;
  const int max_code = f == Fp8Format::kE4M3 ? 0x7E : 0x7B;
  std::vector<double> g;
  for (int c = 0; c <= max_code; ++c) {
    const int e = c >> m_bits, man = c & ((1 << m_bits) - 1);
    g.push_back(e == 0 ? std::ldexp(man, 1 - bias - m_bits)
                       : std::ldexp((1 << m_bits) + man, e - bias - m_bits));
  }
  return g;
}

// Nearest grid value, ties to the even code, saturating; NaN -> 0x7F.
uint8_t ModelEncode(float v, const std::vector<double>& grid) {
  if (std::isnan(v)) return 0x7F;
  const uint8_t sign = std::signbit(v) ? 0x80 : 0x00;
  const double a = std::fabs(static_cast<double>(v));
  if (a >= grid.back()) return sign | static_cast<uint8_t>(grid.size() - 1);
  const size_t hi =
      static_cast<size_t>(std::lower_bound(grid.begin(), grid.end(), a) - grid.begin());
  if (grid[hi] == a) return sign | static_cast<uint8_t>(hi);
  const size_t lo = hi - 1;
  const double dl = a - grid[lo], dh = grid[hi] - a;
  const size_t c = dl < dh ? lo : dh < dl ? hi : (lo % 2 == 0 ? lo : hi);
  return sign | static_cast<uint8_t>(c);
}

// Input element as double, decoded from its bits by the format definition.
double ModelLoad(const std::vector<uint8_t>& buf, InputDType t, int64_t i) {
  if (t == InputDType::kFloat32) {
    float f;
    std::memcpy(&f, buf.data() + 4 * i, 4);
    return f;
  }
  uint16_t h;
  std::memcpy(&h, buf.data() + 2 * i, 2);
  if (t == InputDType::kBFloat16) {
    float f;
    const uint32_t u = static_cast<uint32_t>(h) << 16;
    std::memcpy(&f, &u, 4);
    return f;
  }
  const int s = h >> 15, e = (h >> 10) & 31, man = h & 1023;
  double v;
  if (e == 31) {
    v = man ? std::numeric_limits<double>::quiet_NaN() : std::numeric_limits<double>::infinity();
  } else if (e == 0) {
    v = std::ldexp(man, -24);
  } else {
    v = std::ldexp(1024 + man, e - 25);
  }
  return s ? -v : v;
}

struct Model {
  float scale_inv;
  std::vector<uint8_t> row;
};

Model ModelQuantize(const std::vector<uint8_t>& buf, InputDType t, int64_t m, int64_t n,
                    Fp8Format f, bool pow2, float eps) {
  double amax = 0;
  for (int64_t i = 0; i < m * n; ++i) {
    const double a = std::fabs(ModelLoad(buf, t, i));
    if (!std::isnan(a)) amax = std::max(amax, a);
  }
  const double fmax = f == Fp8Format::kE4M3 ? 448.0 : 57344.0;
  const float famax = static_cast<float>(amax);  // exact: amax is an input value
  float scale;
  const float clamped = famax < eps ? eps : famax;
  if (std::isinf(clamped) || clamped == 0.0f) {
    scale = 1.0f;
  } else {
    scale = static_cast<float>(fmax / static_cast<double>(clamped));
    if (std::isinf(scale)) scale = std::numeric_limits<float>::max();
    if (pow2) {
      int e;
      std::frexp(scale, &e);  // scale = frac * 2^e, frac in [0.5, 1)
      scale = static_cast<float>(std::ldexp(1.0, e - 1));
    }
  }
  Model r;
  r.scale_inv = static_cast<float>(1.0 / static_cast<double>(scale));
  const std::vector<double> grid = Fp8Grid(f);
  r.row.resize(static_cast<size_t>(m * n));
  for (int64_t i = 0; i < m * n; ++i) {
    // One FP32 rounding of the exact product (double holds it exactly).
    const float prod = static_cast<float>(ModelLoad(buf, t, i) * static_cast<double>(scale));
    r.row[i] = ModelEncode(prod, grid);
  }
  return r;
}

std::vector<uint8_t> MakeInput(InputDType t, int64_t count, uint64_t seed, bool adversarial) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const int eb = t == InputDType::kFloat32 ? 4 : 2;
  std::vector<uint8_t> buf(static_cast<size_t>(count * eb));
  for (int64_t i = 0; i < count; ++i) {
    float x = normal(rng) * std::ldexp(1.0f, static_cast<int>(rng() % 9) - 4);
    if (adversarial) {
      switch (rng() % 16) {
        case 0:
          x = kNan;
          break;
        case 1:
          x = -0.0f;
          break;
        case 2:
          x = 0.0f;
          break;
        case 3:
          x = std::ldexp(1.0f, -20) * (rng() % 7);
          break;  // tiny / subnormal after scale
        default:
          break;
      }
    }
    if (t == InputDType::kFloat32) {
      std::memcpy(buf.data() + 4 * i, &x, 4);
    } else {
      const uint16_t h = t == InputDType::kBFloat16 ? FloatToBf16(x) : FloatToHalf(x);
      std::memcpy(buf.data() + 2 * i, &h, 2);
    }
  }
  return buf;
}

TEST(QuantizeTensor, MatchesIndependentModel) {
  struct Shape {
    int64_t m, n;
  };
  int cases = 0;
  for (InputDType t : {InputDType::kBFloat16, InputDType::kFloat16, InputDType::kFloat32}) {
    for (Fp8Format f : {Fp8Format::kE4M3, Fp8Format::kE5M2}) {
      for (bool pow2 : {true, false}) {
        for (float eps : {0.0f, 1e-3f}) {
          for (Shape s : {Shape{1, 1}, Shape{1, 300}, Shape{257, 1}, Shape{130, 129}}) {
            for (bool adversarial : {false, true}) {
              SCOPED_TRACE(::testing::Message()
                           << "dtype " << static_cast<int>(t) << " fmt " << static_cast<int>(f)
                           << " pow2 " << pow2 << " eps " << eps << " " << s.m << "x" << s.n
                           << " adversarial " << adversarial);
              const auto buf = MakeInput(t, s.m * s.n, 17 + cases, adversarial);
              const Model want = ModelQuantize(buf, t, s.m, s.n, f, pow2, eps);
              const Result got = RunTensor(buf.data(), t, s.m, s.n, f, pow2, eps);
              ASSERT_EQ(Bits(got.row_scale_inv), Bits(want.scale_inv));
              ASSERT_EQ(Bits(got.col_scale_inv), Bits(want.scale_inv));
              ASSERT_EQ(got.row, want.row);
              for (int64_t i = 0; i < s.m; ++i) {
                for (int64_t j = 0; j < s.n; ++j) {
                  ASSERT_EQ(got.col[j * s.m + i], want.row[i * s.n + j]);
                }
              }
              ++cases;
            }
          }
        }
      }
    }
  }
  EXPECT_EQ(cases, 3 * 2 * 2 * 2 * 4 * 2);
}

TEST(QuantizeTensor, InfAmaxMatchesModelAndDtypeMaxDoesNotSaturate) {
  // +-Inf anywhere gives scale 1; the largest finite BF16 gets 2^-120 (pow2).
  for (float special : {kInf, -kInf, BitsToFloat(0x7F7F0000u)}) {
    std::vector<float> x = {special, 1.0f, -300.0f, 0.25f};
    std::vector<uint8_t> buf(8);
    const auto h = Bf16(x);
    std::memcpy(buf.data(), h.data(), 8);
    const Model want = ModelQuantize(buf, InputDType::kBFloat16, 2, 2, Fp8Format::kE4M3, true, 0);
    const Result got = RunTensor(h.data(), InputDType::kBFloat16, 2, 2, Fp8Format::kE4M3, true, 0);
    EXPECT_EQ(Bits(got.row_scale_inv), Bits(want.scale_inv));
    EXPECT_EQ(got.row, want.row);
  }
}

TEST(QuantizeTensor, DequantizeRoundTrip) {
  const auto buf = MakeInput(InputDType::kFloat32, 37 * 53, 5, false);
  const Result q = RunTensor(buf.data(), InputDType::kFloat32, 37, 53, Fp8Format::kE4M3, false, 0);
  std::vector<float> from_row(37 * 53), from_col(37 * 53);
  QuantizedConstBuffers in{q.row.data(), &q.row_scale_inv, q.col.data(), &q.col_scale_inv};
  DequantizeBlock(in, BlockScaling::kTensor, Fp8Format::kE4M3, 37, 53, true, InputDType::kFloat32,
                  from_row.data());
  DequantizeBlock(in, BlockScaling::kTensor, Fp8Format::kE4M3, 37, 53, false, InputDType::kFloat32,
                  from_col.data());
  const std::vector<double> grid = Fp8Grid(Fp8Format::kE4M3);
  for (int64_t i = 0; i < 37 * 53; ++i) {
    const uint8_t b = q.row[i];
    const double mag = grid[b & 0x7F];
    const float want = static_cast<float>((b & 0x80 ? -mag : mag) * q.row_scale_inv);
    ASSERT_EQ(Bits(from_row[i]), Bits(want)) << i;
    ASSERT_EQ(Bits(from_col[i]), Bits(want)) << i;
    // E4M3 keeps 3 mantissa bits: |x - x_hat| <= 2^-4 |x| for normal values.
    const double x = ModelLoad(buf, InputDType::kFloat32, i);
    // Below the smallest normal the step is 2^-9 of the scaled value.
    EXPECT_LE(std::fabs(x - want), std::fabs(x) / 16 + std::ldexp(q.row_scale_inv, -10)) << i;
  }
}

}  // namespace
}  // namespace qtx::kernels::cpu
