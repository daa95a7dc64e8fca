// The CPU reference against docs/numerics.md §6 (worked examples), §4.3 (layouts),
// §7 (edge cases) and structural properties.
#include "kernels/cpu/quantize_block.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/fp8.h"

namespace qtx::kernels::cpu {
namespace {

// A quantized tensor with owned buffers pre-filled with sentinels.
struct Quantized {
  QuantizedLayout layout;
  std::vector<uint8_t> row_data, col_data;
  std::vector<float> row_scale, col_scale;
};

Quantized RunQuantize(const void* input, InputDType dtype, int64_t m, int64_t n, QuantizeParams p,
                      uint8_t data_sentinel = 0xAA, uint32_t scale_sentinel = 0xFFFFFFFFu) {
  Quantized q;
  q.layout = ComputeLayout(p.scaling, m, n);
  const float s = BitsToFloat(scale_sentinel);
  q.row_data.assign(q.layout.RowwiseDataBytes(), data_sentinel);
  q.col_data.assign(q.layout.ColumnwiseDataBytes(), data_sentinel);
  q.row_scale.assign(q.layout.RowwiseScaleCount(), s);
  q.col_scale.assign(q.layout.ColumnwiseScaleCount(), s);
  QuantizedBuffers out{q.row_data.data(), q.row_scale.data(), q.col_data.data(),
                       q.col_scale.data()};
  QuantizeBlock(input, dtype, m, n, p, out);
  return q;
}

std::vector<uint16_t> ToBf16(const std::vector<float>& v) {
  std::vector<uint16_t> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = FloatToBf16(v[i]);
  return out;
}

// ---- docs/numerics.md §6: scale and byte vectors

struct Vector11 {
  int id;
  std::vector<float> values;  // placed at row 0, columns 0..k-1 of a 128x128 tensor
  Fp8Format format;
  bool pow2;
  float eps;
  bool fp32_input;
  uint32_t scale_inv_bits;
  std::vector<uint8_t> bytes;
};

const float kInf = std::numeric_limits<float>::infinity();
const float kNan = std::numeric_limits<float>::quiet_NaN();
const float kBf16Max = BitsToFloat(0x7F7F0000u);

std::vector<Vector11> Table11() {
  const std::vector<float> v1 = {1.0f, -3.5f, 100.0f, 0.001f};
  return {
      {1, v1, Fp8Format::kE4M3, true, 0, false, 0x3e800000u, {0x48, 0xd6, 0x7c, 0x02}},
      {2, v1, Fp8Format::kE4M3, false, 0, false, 0x3e649249u, {0x49, 0xd8, 0x7e, 0x02}},
      {3, v1, Fp8Format::kE5M2, true, 0, false, 0x3b000000u, {0x60, 0xe7, 0x7a, 0x38}},
      {4, {0, 0}, Fp8Format::kE4M3, true, 0, false, 0x3f800000u, {0x00, 0x00}},
      {5, {0, 0}, Fp8Format::kE4M3, true, 1e-4f, false, 0x34800000u, {0x00, 0x00}},
      {6, {kNan, 2.0f, -0.5f}, Fp8Format::kE4M3, true, 0, false, 0x3c000000u, {0x7f, 0x78, 0xe8}},
      {7, {kInf, 1.0f, -600.0f}, Fp8Format::kE4M3, true, 0, false, 0x3f800000u, {0x7e, 0x38, 0xfe}},
      {8, {-kInf, 1.0f}, Fp8Format::kE5M2, true, 0, false, 0x3f800000u, {0xfb, 0x3c}},
      {9, {kBf16Max, 1.0f}, Fp8Format::kE4M3, true, 0, false, 0x7b800000u, {0x78, 0x00}},
      {10, {kBf16Max, 1.0f}, Fp8Format::kE5M2, true, 0, false, 0x78000000u, {0x78, 0x00}},
      {11, {kBf16Max, 1.0f}, Fp8Format::kE4M3, false, 0, false, 0x7b11b6dbu, {0x7e, 0x00}},
      {12, {1e-40f, -5e-41f}, Fp8Format::kE4M3, true, 0, true, 0x00400000u, {0x09, 0x84}},
      {13, {1e-40f, -5e-41f}, Fp8Format::kE4M3, false, 0, true, 0x00200000u, {0x11, 0x89}},
      {14,
       {448.0f, 0.75f, 3.0f},
       Fp8Format::kE4M3,
       true,
       0,
       false,
       0x3f800000u,
       {0x7e, 0x34, 0x44}},
      {15,
       {1.0f, 0.1f, -0.3f, 1.0f / 1024},
       Fp8Format::kE4M3,
       true,
       0,
       false,
       0x3b800000u,
       {0x78, 0x5d, 0xea, 0x28}},
      {16,
       {300.0f, 1.0f, 1.0625f, 1.1875f, -17.0f},
       Fp8Format::kE4M3,
       true,
       0,
       false,
       0x3f800000u,
       {0x79, 0x38, 0x38, 0x3a, 0xd8}},
  };
}

class Table11Test : public ::testing::TestWithParam<Vector11> {};

TEST_P(Table11Test, RowwiseBytesAndScaleIn1DAnd2D) {
  const Vector11& v = GetParam();
  constexpr int64_t kM = 128, kN = 128;
  std::vector<float> x(kM * kN, 0.0f);
  for (size_t k = 0; k < v.values.size(); ++k) x[k] = v.values[k];
  std::vector<uint16_t> xb = ToBf16(x);
  const void* in = v.fp32_input ? static_cast<const void*>(x.data()) : xb.data();
  const InputDType dt = v.fp32_input ? InputDType::kFloat32 : InputDType::kBFloat16;
  for (BlockScaling s : {BlockScaling::kBlock1D, BlockScaling::kBlock2D}) {
    SCOPED_TRACE(s == BlockScaling::kBlock1D ? "1D" : "2D");
    QuantizeParams p{s, v.format, true, true, v.pow2, v.eps};
    Quantized q = RunQuantize(in, dt, kM, kN, p);
    EXPECT_EQ(FloatBits(q.row_scale[0]), v.scale_inv_bits) << "vector #" << v.id;
    for (size_t k = 0; k < v.bytes.size(); ++k) {
      EXPECT_EQ(q.row_data[k], v.bytes[k]) << "vector #" << v.id << " byte " << k;
    }
    if (s == BlockScaling::kBlock2D) {
      // The columnwise copy is the exact byte transpose with the same scale.
      EXPECT_EQ(FloatBits(q.col_scale[0]), v.scale_inv_bits);
      for (size_t k = 0; k < v.bytes.size(); ++k) EXPECT_EQ(q.col_data[k * kM], v.bytes[k]);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Numerics11, Table11Test, ::testing::ValuesIn(Table11()),
                         [](const auto& info) { return "Vector" + std::to_string(info.param.id); });

// 1-D columnwise copy of vectors #1, #6, #7: each column is its own 128x1 block.
TEST(Numerics11, ColumnwiseCopyOfVectors) {
  struct Case {
    std::vector<float> values;
    std::vector<uint8_t> bytes;
    uint32_t col0_scale_inv;
  };
  const std::vector<Case> cases = {
      {{1.0f, -3.5f, 100.0f, 0.001f}, {0x78, 0xfe, 0x7c, 0x78}, 0x3b800000u},  // 2^-8
      {{kNan, 2.0f, -0.5f}, {0x7f, 0x78, 0xf8}, 0x3f800000u},
      {{kInf, 1.0f, -600.0f}, {0x7e, 0x78, 0xf9}, 0x3f800000u},
  };
  for (const Case& c : cases) {
    std::vector<float> x(128 * 128, 0.0f);
    for (size_t k = 0; k < c.values.size(); ++k) x[k] = c.values[k];
    std::vector<uint16_t> xb = ToBf16(x);
    QuantizeParams p{BlockScaling::kBlock1D, Fp8Format::kE4M3, false, true, true, 0};
    Quantized q = RunQuantize(xb.data(), InputDType::kBFloat16, 128, 128, p);
    EXPECT_EQ(FloatBits(q.col_scale[0]), c.col0_scale_inv);
    for (size_t k = 0; k < c.bytes.size(); ++k) {
      EXPECT_EQ(q.col_data[k * 128 + 0], c.bytes[k]) << "column " << k;
    }
  }
}

// The 2-D-only vector: one tile scale vs. per-row 1-D scales.
TEST(Numerics11, TwoDTileSharesOneScale) {
  std::vector<float> x(128 * 128, 0.0f);
  x[0] = 1.0f;
  x[128] = 100.0f;  // row 1, column 0
  std::vector<uint16_t> xb = ToBf16(x);
  Quantized q2 = RunQuantize(xb.data(), InputDType::kBFloat16, 128, 128,
                             {BlockScaling::kBlock2D, Fp8Format::kE4M3, true, false, true, 0});
  Quantized q1 = RunQuantize(xb.data(), InputDType::kBFloat16, 128, 128,
                             {BlockScaling::kBlock1D, Fp8Format::kE4M3, true, false, true, 0});
  EXPECT_EQ(q2.row_data[0], 0x48);
  EXPECT_EQ(q1.row_data[0], 0x78);
}

// ---- docs/numerics.md §4.3: layout checks

struct LayoutCase {
  int64_t m, n;
  BlockScaling s;
  int64_t row_scale_rows, row_scale_cols, row_padding;
  int64_t col_scale_rows, col_scale_cols, col_padding;
};

class LayoutTest : public ::testing::TestWithParam<LayoutCase> {};

std::vector<uint16_t> RandomBf16(int64_t count, uint32_t seed, float stddev = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, stddev);
  std::vector<uint16_t> v(count);
  for (auto& e : v) e = FloatToBf16(dist(rng));
  return v;
}

TEST_P(LayoutTest, ShapesPaddingZeroedEverythingElseWritten) {
  const LayoutCase& c = GetParam();
  std::vector<uint16_t> x = RandomBf16(c.m * c.n, 7);
  QuantizeParams p{c.s, Fp8Format::kE4M3, true, true, true, 0};
  Quantized a = RunQuantize(x.data(), InputDType::kBFloat16, c.m, c.n, p, 0xAA, 0xFFFFFFFFu);
  Quantized b = RunQuantize(x.data(), InputDType::kBFloat16, c.m, c.n, p, 0x55, 0x7FC01234u);
  EXPECT_EQ(a.layout.rowwise_scale_rows, c.row_scale_rows);
  EXPECT_EQ(a.layout.rowwise_scale_cols, c.row_scale_cols);
  EXPECT_EQ(a.layout.columnwise_scale_rows, c.col_scale_rows);
  EXPECT_EQ(a.layout.columnwise_scale_cols, c.col_scale_cols);
  // Two different sentinels give identical outputs: every byte and scale was written.
  EXPECT_EQ(a.row_data, b.row_data);
  EXPECT_EQ(a.col_data, b.col_data);
  ASSERT_EQ(a.row_scale.size(), b.row_scale.size());
  int64_t row_zero = 0, col_zero = 0;
  for (size_t i = 0; i < a.row_scale.size(); ++i) {
    EXPECT_EQ(FloatBits(a.row_scale[i]), FloatBits(b.row_scale[i])) << i;
    row_zero += a.row_scale[i] == 0.0f;
  }
  for (size_t i = 0; i < a.col_scale.size(); ++i) {
    EXPECT_EQ(FloatBits(a.col_scale[i]), FloatBits(b.col_scale[i])) << i;
    col_zero += a.col_scale[i] == 0.0f;
  }
  // Real scales are never 0, so the zero entries are exactly the padding.
  EXPECT_EQ(row_zero, c.row_padding);
  EXPECT_EQ(col_zero, c.col_padding);
  if (c.s == BlockScaling::kBlock2D) {
    const auto& l = a.layout;
    for (int64_t i = 0; i < l.rowwise_scale_rows; ++i) {
      for (int64_t j = 0; j < CeilDiv(c.n, kBlockLen); ++j) {
        EXPECT_EQ(a.row_scale[i * l.rowwise_scale_cols + j],
                  a.col_scale[j * l.columnwise_scale_cols + i]);
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Numerics11_2, LayoutTest,
    ::testing::Values(LayoutCase{200, 300, BlockScaling::kBlock1D, 3, 200, 0, 2, 300, 0},
                      LayoutCase{200, 300, BlockScaling::kBlock2D, 2, 4, 2, 3, 4, 6},
                      LayoutCase{130, 130, BlockScaling::kBlock1D, 2, 132, 4, 2, 132, 4},
                      LayoutCase{130, 130, BlockScaling::kBlock2D, 2, 4, 4, 2, 4, 4},
                      LayoutCase{256, 1024, BlockScaling::kBlock1D, 8, 256, 0, 2, 1024, 0},
                      LayoutCase{256, 1024, BlockScaling::kBlock2D, 2, 8, 0, 8, 4, 16}));

// ---- properties ---------------------------------------------------------------

// The 1-D columnwise copy of X is the 1-D rowwise quantization of X^T (docs/numerics.md §3).
TEST(Properties, ColumnwiseIsRowwiseOfTranspose) {
  for (auto [m, n] : std::vector<std::pair<int64_t, int64_t>>{{200, 300}, {1, 129}, {257, 3}}) {
    std::vector<uint16_t> x = RandomBf16(m * n, 11);
    std::vector<uint16_t> xt(m * n);
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) xt[j * m + i] = x[i * n + j];
    Quantized a = RunQuantize(x.data(), InputDType::kBFloat16, m, n,
                              {BlockScaling::kBlock1D, Fp8Format::kE5M2, false, true, false, 0});
    Quantized b = RunQuantize(xt.data(), InputDType::kBFloat16, n, m,
                              {BlockScaling::kBlock1D, Fp8Format::kE5M2, true, false, false, 0});
    EXPECT_EQ(a.col_data, b.row_data);
    EXPECT_EQ(a.col_scale.size(), b.row_scale.size());
    for (size_t i = 0; i < a.col_scale.size(); ++i)
      EXPECT_EQ(FloatBits(a.col_scale[i]), FloatBits(b.row_scale[i]));
  }
}

TEST(Properties, TwoDColumnwiseIsTransposeOfRowwise) {
  const int64_t m = 300, n = 200;
  std::vector<float> x(m * n);
  std::mt19937 rng(3);
  std::normal_distribution<float> d(0, 10);
  for (auto& e : x) e = d(rng);
  Quantized q = RunQuantize(x.data(), InputDType::kFloat32, m, n,
                            {BlockScaling::kBlock2D, Fp8Format::kE4M3, true, true, true, 0});
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) ASSERT_EQ(q.row_data[i * n + j], q.col_data[j * m + i]);
}

// Dequantizing gives back each element within half an FP8 step of its block.
void CheckDequantError(Fp8Format f, BlockScaling s, bool pow2) {
  const int64_t m = 260, n = 390;
  std::vector<float> x(m * n);
  std::mt19937 rng(5);
  std::normal_distribution<float> d(0, 1);
  std::uniform_int_distribution<int> e(-20, 20);
  for (auto& v : x) v = std::ldexp(d(rng), e(rng) / 4);  // a spread of magnitudes
  QuantizeParams p{s, f, true, true, pow2, 0};
  Quantized q = RunQuantize(x.data(), InputDType::kFloat32, m, n, p);
  const int mant = f == Fp8Format::kE4M3 ? 3 : 2;
  const int min_exp = f == Fp8Format::kE4M3 ? -6 : -14;
  for (bool use_row : {true, false}) {
    std::vector<float> y(m * n);
    QuantizedConstBuffers in{q.row_data.data(), q.row_scale.data(), q.col_data.data(),
                             q.col_scale.data()};
    DequantizeBlock(in, s, f, m, n, use_row, InputDType::kFloat32, y.data());
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t j = 0; j < n; ++j) {
        const float xi = x[i * n + j];
        float scale_inv;
        const auto& l = q.layout;
        if (s == BlockScaling::kBlock2D) {
          scale_inv = q.row_scale[(i / 128) * l.rowwise_scale_cols + j / 128];
        } else if (use_row) {
          scale_inv = q.row_scale[(j / 128) * l.rowwise_scale_cols + i];
        } else {
          scale_inv = q.col_scale[(i / 128) * l.columnwise_scale_cols + j];
        }
        // Half a step of the FP8 grid at |x| (in scaled units), or of the subnormal grid.
        const float scaled = std::fabs(xi) / scale_inv;
        const int ex =
            std::max(static_cast<int>(std::floor(std::log2(std::max(scaled, 1e-30f)))), min_exp);
        const double half_step = std::ldexp(1.0, ex - mant - 1) * scale_inv;
        ASSERT_LE(std::fabs(static_cast<double>(y[i * n + j]) - xi), half_step * (1 + 1e-6))
            << "at (" << i << "," << j << ") x=" << xi << " y=" << y[i * n + j];
      }
    }
  }
}

TEST(Properties, DequantErrorWithinHalfStep) {
  for (Fp8Format f : {Fp8Format::kE4M3, Fp8Format::kE5M2})
    for (BlockScaling s : {BlockScaling::kBlock1D, BlockScaling::kBlock2D})
      for (bool pow2 : {true, false}) CheckDequantError(f, s, pow2);
}

// pow2 scales keep every block's amax * scale in (fp8_max / 2, fp8_max] (docs/numerics.md §2).
TEST(Properties, Pow2ScalesUseTopBinade) {
  const int64_t m = 256, n = 512;
  std::vector<uint16_t> x = RandomBf16(m * n, 9, 3.0f);
  Quantized q = RunQuantize(x.data(), InputDType::kBFloat16, m, n,
                            {BlockScaling::kBlock1D, Fp8Format::kE4M3, true, false, true, 0});
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t b = 0; b < n / 128; ++b) {
      float amax = 0;
      for (int64_t k = 0; k < 128; ++k)
        amax = std::max(amax, std::fabs(Bf16ToFloat(x[r * n + b * 128 + k])));
      const float inv = q.row_scale[b * q.layout.rowwise_scale_cols + r];
      int e;
      EXPECT_EQ(std::frexp(inv, &e), 0.5f) << "scale_inv not a power of two";
      const float scaled = amax / inv;
      EXPECT_GT(scaled, 224.0f);
      EXPECT_LE(scaled, 448.0f);
    }
  }
}

// ---- docs/numerics.md §7: edge cases

TEST(EdgeCases, ZeroElementTensorsWriteOnlyPadding) {
  for (auto [m, n] : std::vector<std::pair<int64_t, int64_t>>{{0, 5}, {5, 0}, {0, 0}}) {
    for (BlockScaling s : {BlockScaling::kBlock1D, BlockScaling::kBlock2D}) {
      Quantized q = RunQuantize(nullptr, InputDType::kFloat32, m, n,
                                {s, Fp8Format::kE4M3, true, true, true, 0});
      for (float v : q.row_scale) EXPECT_EQ(v, 0.0f);
      for (float v : q.col_scale) EXPECT_EQ(v, 0.0f);
      EXPECT_TRUE(q.row_data.empty());
    }
  }
}

TEST(EdgeCases, PartialBlocksIgnoreOutOfRangeAndFp16Input) {
  // One row of 129 FP16 values: block 0 has amax 2, block 1 (1 element) has 0.5.
  std::vector<uint16_t> x(129, FloatToHalf(0.25f));
  x[3] = FloatToHalf(-2.0f);
  x[128] = FloatToHalf(0.5f);
  Quantized q = RunQuantize(x.data(), InputDType::kFloat16, 1, 129,
                            {BlockScaling::kBlock1D, Fp8Format::kE4M3, true, true, true, 0});
  ASSERT_EQ(q.layout.rowwise_scale_cols, 4);
  EXPECT_EQ(q.row_scale[0], 1.0f / 128);  // 448/2 = 224 -> 128
  EXPECT_EQ(q.row_scale[4], 1.0f / 512);  // 448/0.5 = 896 -> 512
  EXPECT_EQ(q.row_scale[1], 0.0f);        // padding
  EXPECT_EQ(q.row_data[128], 0x78);       // 0.5 * 512 = 256
  EXPECT_EQ(q.row_data[3], 0xF8);         // -2 * 128 = -256
  // Columnwise: every column is its own block of one row.
  EXPECT_EQ(q.col_scale[128], 1.0f / 512);
  EXPECT_EQ(q.col_data[128], 0x78);
}

}  // namespace
}  // namespace qtx::kernels::cpu
