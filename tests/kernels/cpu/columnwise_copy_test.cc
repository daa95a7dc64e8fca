// kernels/cpu/columnwise_copy: the columnwise copy made from the rowwise one
// equals, byte for byte, the columnwise copy that the quantizers write
// (QuantizeBlock with BLOCK_2D, QuantizeTensor) and that the fused AdamW step
// writes, scale padding included; outputs are sentinel-filled first, so an
// entry not written shows. BLOCK_1D and bad arguments are refused.
#include "kernels/cpu/columnwise_copy.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/adamw.h"
#include "kernels/block_geometry.h"
#include "kernels/cpu/adamw.h"
#include "kernels/cpu/quantize_block.h"
#include "kernels/cpu/quantize_tensor.h"

namespace qtx::kernels::cpu {
namespace {

struct Copies {
  std::vector<uint8_t> row_data, col_data;
  std::vector<float> row_scale, col_scale;
  Copies(BlockScaling s, int64_t m, int64_t n) {
    const QuantizedLayout l = ComputeLayout(s, m, n);
    row_data.assign(l.RowwiseDataBytes(), 0xAA);
    col_data.assign(l.ColumnwiseDataBytes(), 0xAA);
    row_scale.assign(l.RowwiseScaleCount(), -7.0f);
    col_scale.assign(l.ColumnwiseScaleCount(), -7.0f);
  }
  QuantizedBuffers Buffers() {
    return {row_data.data(), row_scale.data(), col_data.data(), col_scale.data()};
  }
  QuantizedConstBuffers Const() const {
    return {row_data.data(), row_scale.data(), col_data.data(), col_scale.data()};
  }
};

std::vector<float> RandomInput(int64_t count, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> mag(-8.0f, 8.0f);
  std::vector<float> x(count);
  for (auto& v : x) v = normal(rng) * std::exp2(mag(rng));  // tiles with different amaxes
  return x;
}

void ExpectSameColumnwise(const Copies& want, const Copies& got, const std::string& label) {
  ASSERT_EQ(want.col_data.size(), got.col_data.size()) << label;
  for (size_t i = 0; i < want.col_data.size(); ++i) {
    ASSERT_EQ(want.col_data[i], got.col_data[i]) << label << " columnwise byte " << i;
  }
  ASSERT_EQ(want.col_scale.size(), got.col_scale.size()) << label;
  for (size_t i = 0; i < want.col_scale.size(); ++i) {
    uint32_t a, b;
    std::memcpy(&a, &want.col_scale[i], 4);
    std::memcpy(&b, &got.col_scale[i], 4);
    ASSERT_EQ(a, b) << label << " columnwise scale_inv " << i;
  }
}

struct Shape {
  int64_t m, n;
};
const Shape kShapes[] = {{1, 1},   {3, 5},     {128, 128}, {130, 130}, {200, 300}, {1, 129},
                         {129, 1}, {256, 384}, {384, 256}, {520, 129}, {0, 7},     {7, 0}};

std::string Label(BlockScaling s, const Shape& sh) {
  return std::string(s == BlockScaling::kTensor ? "TENSOR " : "2D ") + std::to_string(sh.m) + "x" +
         std::to_string(sh.n);
}

TEST(ColumnwiseFromRowwise, EqualsTheQuantizersColumnwiseCopy) {
  for (BlockScaling s : {BlockScaling::kBlock2D, BlockScaling::kTensor}) {
    for (const Shape& sh : kShapes) {
      for (Fp8Format f : {Fp8Format::kE4M3, Fp8Format::kE5M2}) {
        const std::vector<float> x =
            RandomInput(sh.m * sh.n, static_cast<uint32_t>(sh.m * 31 + sh.n));
        QuantizeParams p;
        p.scaling = s;
        p.format = f;
        p.rowwise = p.columnwise = true;
        Copies q(s, sh.m, sh.n);
        if (s == BlockScaling::kTensor) {
          QuantizeTensor(x.data(), InputDType::kFloat32, sh.m, sh.n, p, q.Buffers());
        } else {
          QuantizeBlock(x.data(), InputDType::kFloat32, sh.m, sh.n, p, q.Buffers());
        }
        Copies made(s, sh.m, sh.n);
        made.row_data = q.row_data;
        made.row_scale = q.row_scale;
        ASSERT_TRUE(ColumnwiseFromRowwise(s, made.Const(), sh.m, sh.n, made.Buffers()));
        ExpectSameColumnwise(q, made, Label(s, sh));
      }
    }
  }
}

TEST(ColumnwiseFromRowwise, EqualsTheFusedAdamWStepsColumnwiseCopy) {
  for (const Shape& sh : kShapes) {
    const int64_t count = sh.m * sh.n;
    std::vector<float> master = RandomInput(count, 7), grad = RandomInput(count, 8);
    std::vector<float> m1(count, 0.0f), m2(count, 0.0f);
    Copies out(BlockScaling::kBlock2D, sh.m, sh.n);
    AdamWParamBuffers b;
    b.m = sh.m;
    b.n = sh.n;
    b.master = master.data();
    b.exp_avg = m1.data();
    b.exp_avg_sq = m2.data();
    b.grad = grad.data();
    b.quant.scaling = BlockScaling::kBlock2D;
    b.quant.rowwise = b.quant.columnwise = true;
    b.fp8 = out.Buffers();
    AdamWHyperParams h;
    h.lr = 1e-2;
    AdamWStepFused({&b, 1}, MakeAdamWScalars(h, 1, 1.0), 2);
    Copies made(BlockScaling::kBlock2D, sh.m, sh.n);
    made.row_data = out.row_data;
    made.row_scale = out.row_scale;
    ASSERT_TRUE(
        ColumnwiseFromRowwise(BlockScaling::kBlock2D, made.Const(), sh.m, sh.n, made.Buffers()));
    ExpectSameColumnwise(out, made, "AdamW " + Label(BlockScaling::kBlock2D, sh));
  }
}

TEST(ColumnwiseFromRowwise, RefusesBlock1DAndBadArgumentsWithoutWriting) {
  Copies c(BlockScaling::kBlock2D, 4, 4);
  const std::vector<float> before = c.col_scale;
  EXPECT_FALSE(ColumnwiseFromRowwise(BlockScaling::kBlock1D, c.Const(), 4, 4, c.Buffers()));
  EXPECT_FALSE(ColumnwiseFromRowwise(BlockScaling::kBlock2D, c.Const(), -1, 4, c.Buffers()));
  EXPECT_FALSE(ColumnwiseFromRowwise(BlockScaling::kBlock2D, c.Const(), 4, -1, c.Buffers()));
  QuantizedBuffers no_data = c.Buffers();
  no_data.columnwise_data = nullptr;
  EXPECT_FALSE(ColumnwiseFromRowwise(BlockScaling::kBlock2D, c.Const(), 4, 4, no_data));
  QuantizedConstBuffers no_scale = c.Const();
  no_scale.rowwise_scale_inv = nullptr;
  EXPECT_FALSE(ColumnwiseFromRowwise(BlockScaling::kTensor, no_scale, 4, 4, c.Buffers()));
  EXPECT_EQ(c.col_scale, before);
  EXPECT_EQ(c.col_data, std::vector<uint8_t>(16, 0xAA));
  // An empty tensor needs no data buffers; TENSOR still copies its one scale.
  Copies e(BlockScaling::kTensor, 0, 5);
  e.row_scale[0] = 0.5f;
  QuantizedBuffers out = e.Buffers();
  out.columnwise_data = nullptr;
  ASSERT_TRUE(
      ColumnwiseFromRowwise(BlockScaling::kTensor, {nullptr, e.row_scale.data()}, 0, 5, out));
  EXPECT_EQ(e.col_scale[0], 0.5f);
}

}  // namespace
}  // namespace qtx::kernels::cpu
