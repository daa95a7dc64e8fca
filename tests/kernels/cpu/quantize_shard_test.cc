// The exact all-gather building blocks (docs/numerics.md §5) without any network:
// per-rank boundary amaxes -> combine -> shard quantize -> assemble must equal
// QuantizeBlock of the concatenated tensor, byte for byte, for any shard sizes,
// 1-D, 2-D and per-tensor (TENSOR: one block shared by every rank).
#include "kernels/cpu/quantize_shard.h"

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/quantize_block.h"
#include "kernels/fp8.h"

namespace qtx::kernels::cpu {
namespace {

struct Case {
  std::vector<int64_t> shards;
  int64_t n;
};

std::string Name(const Case& c) {
  std::string s;
  for (int64_t m : c.shards) s += std::to_string(m) + "_";
  return s + "n" + std::to_string(c.n);
}

// Quantizes the shards as the all-gather does and compares with the whole.
void CheckSplit(const Case& c, BlockScaling scaling, bool rowwise, bool columnwise, Fp8Format fmt) {
  SCOPED_TRACE(Name(c) +
               (scaling == BlockScaling::kBlock1D   ? " 1D"
                : scaling == BlockScaling::kBlock2D ? " 2D"
                                                    : " TENSOR") +
               (rowwise ? " row" : "") + (columnwise ? " col" : ""));
  const int w = static_cast<int>(c.shards.size());
  int64_t m = 0;
  std::vector<ShardGeometry> g(w);
  for (int r = 0; r < w; ++r) {
    g[r] = ShardGeometry{m, c.shards[r], c.n};
    m += c.shards[r];
  }
  const int64_t n = c.n;
  // Data where neighbouring shards have very different magnitudes, so a wrong
  // (local-only) amax of a straddling block changes scales.
  std::vector<uint16_t> x(m * n);
  std::mt19937 rng(static_cast<uint32_t>(m * 131 + n));
  std::normal_distribution<float> d(0, 1);
  for (int r = 0; r < w; ++r) {
    const float mag = std::ldexp(1.0f, (r * 7) % 13 - 6);
    for (int64_t i = g[r].row_offset; i < g[r].row_offset + g[r].m; ++i)
      for (int64_t j = 0; j < n; ++j) x[i * n + j] = FloatToBf16(d(rng) * mag);
  }
  const QuantizeParams p{scaling, fmt, rowwise, columnwise, true, 0.0f};
  const QuantizedLayout l = ComputeLayout(scaling, m, n);

  // Reference: the whole tensor on one device.
  std::vector<uint8_t> rd(l.RowwiseDataBytes()), cd(l.ColumnwiseDataBytes());
  std::vector<float> rs(l.RowwiseScaleCount()), cs(l.ColumnwiseScaleCount());
  QuantizeBlock(x.data(), InputDType::kBFloat16, m, n, p,
                {rd.data(), rs.data(), cd.data(), cs.data()});

  // Per rank: partial amaxes, combine, quantize the shard.
  std::vector<std::vector<float>> firsts(w), lasts(w);
  std::vector<const float*> fp(w), lp(w);
  for (int r = 0; r < w; ++r) {
    const int64_t len = BoundaryAmaxLength(scaling, g[r]);
    firsts[r].assign(len, -1.0f);
    lasts[r].assign(len, -1.0f);
    ShardBoundaryAmax(x.data() + g[r].row_offset * n, InputDType::kBFloat16, g[r], scaling,
                      firsts[r].data(), lasts[r].data());
    fp[r] = firsts[r].data();
    lp[r] = lasts[r].data();
  }
  std::vector<std::vector<uint8_t>> srd(w), scd(w);
  std::vector<std::vector<float>> srs(w), scs(w);
  std::vector<ShardConstBuffers> views(w);
  for (int r = 0; r < w; ++r) {
    const int64_t len = BoundaryAmaxLength(scaling, g[r]);
    std::vector<float> f(len), la(len);
    CombineBoundaryAmax(w, g.data(), fp.data(), lp.data(), r, scaling, f.data(), la.data());
    srd[r].assign(g[r].m * n, 0xAA);
    scd[r].assign(g[r].m * n, 0xAA);
    srs[r].assign(ShardRowwiseScaleCount(scaling, g[r]), -1.0f);
    scs[r].assign(ShardColumnwiseScaleCount(scaling, g[r]), -1.0f);
    QuantizeShard(x.data() + g[r].row_offset * n, InputDType::kBFloat16, g[r], p, f.data(),
                  la.data(), {srd[r].data(), srs[r].data(), scd[r].data(), scs[r].data()});
    views[r] = {srd[r].data(), srs[r].data(), scd[r].data(), scs[r].data()};
  }
  std::vector<uint8_t> ard(rd.size(), 0x55), acd(cd.size(), 0x55);
  std::vector<float> ars(rs.size(), -2.0f), acs(cs.size(), -2.0f);
  AssembleShards(w, g.data(), views.data(), p, {ard.data(), ars.data(), acd.data(), acs.data()});

  if (rowwise) {
    EXPECT_EQ(ard, rd);
    ASSERT_EQ(ars.size(), rs.size());
    EXPECT_EQ(0, std::memcmp(ars.data(), rs.data(), rs.size() * sizeof(float)));
  }
  if (columnwise) {
    EXPECT_EQ(acd, cd);
    ASSERT_EQ(acs.size(), cs.size());
    EXPECT_EQ(0, std::memcmp(acs.data(), cs.data(), cs.size() * sizeof(float)));
  }
}

class ShardSplitTest : public ::testing::TestWithParam<Case> {};

TEST_P(ShardSplitTest, BitIdenticalToWholeTensor) {
  for (BlockScaling s : {BlockScaling::kBlock1D, BlockScaling::kBlock2D, BlockScaling::kTensor}) {
    CheckSplit(GetParam(), s, true, true, Fp8Format::kE4M3);
    CheckSplit(GetParam(), s, true, false, Fp8Format::kE5M2);
    CheckSplit(GetParam(), s, false, true, Fp8Format::kE4M3);
  }
}

std::vector<Case> Cases() {
  std::vector<Case> out;
  const std::vector<std::vector<int64_t>> splits = {
      {64, 64},        {100, 156, 1}, {0, 300}, {250, 250, 250, 250},   {128, 128}, {1, 1, 1, 1},
      {129, 127, 256}, {300, 0},      {0, 0},   {5, 200, 3, 60, 0, 129}};
  for (const auto& s : splits)
    for (int64_t n : {1, 100, 128, 300}) out.push_back({s, n});
  return out;
}

INSTANTIATE_TEST_SUITE_P(AllGatherSplits, ShardSplitTest, ::testing::ValuesIn(Cases()),
                         [](const auto& info) { return Name(info.param); });

// Without the combined amaxes (each rank alone, the pre-2.8 TE behaviour) the
// result differs: the test above would catch a protocol that skipped the exchange.
TEST(ShardSplit, LocalOnlyAmaxIsWrong) {
  const int64_t n = 128;
  const ShardGeometry g0{0, 64, n}, g1{64, 64, n};
  std::vector<uint16_t> x(128 * n);
  for (int64_t i = 0; i < 128; ++i)
    for (int64_t j = 0; j < n; ++j) x[i * n + j] = FloatToBf16(i < 64 ? 1.0f : 100.0f);
  const QuantizeParams p{BlockScaling::kBlock1D, Fp8Format::kE4M3, false, true, true, 0};
  std::vector<float> f(n), l(n);
  ShardBoundaryAmax(x.data(), InputDType::kBFloat16, g0, p.scaling, f.data(), l.data());
  std::vector<uint8_t> cd(n * 64);
  std::vector<float> cs(n);
  QuantizeShard(x.data(), InputDType::kBFloat16, g0, p, f.data(), l.data(),
                {nullptr, nullptr, cd.data(), cs.data()});
  EXPECT_EQ(cs[0], 1.0f / 256);  // local amax 1 -> scale 256
  const ShardGeometry gs[2] = {g0, g1};
  std::vector<float> f1(n), l1(n);
  ShardBoundaryAmax(x.data() + 64 * n, InputDType::kBFloat16, g1, p.scaling, f1.data(), l1.data());
  const float* firsts[2] = {f.data(), f1.data()};
  const float* lasts[2] = {l.data(), l1.data()};
  std::vector<float> cf(n), cl(n);
  CombineBoundaryAmax(2, gs, firsts, lasts, 0, p.scaling, cf.data(), cl.data());
  EXPECT_EQ(cf[0], 100.0f);
  QuantizeShard(x.data(), InputDType::kBFloat16, g0, p, cf.data(), cl.data(),
                {nullptr, nullptr, cd.data(), cs.data()});
  EXPECT_EQ(cs[0], 1.0f / 4);  // combined amax 100 -> scale 4
}

// TENSOR: a rank whose shard holds small values must take the scale of the
// whole tensor's amax, held by another rank, not its own.
TEST(ShardSplit, TensorScaleComesFromTheWholeTensor) {
  const int64_t n = 8;
  const ShardGeometry g[2] = {{0, 3, n}, {3, 5, n}};
  std::vector<uint16_t> x(8 * n);
  for (int64_t i = 0; i < 8 * n; ++i) x[i] = FloatToBf16(i < 3 * n ? 0.5f : -200.0f);
  const QuantizeParams p{BlockScaling::kTensor, Fp8Format::kE4M3, true, true, true, 0};
  float f[2][1] = {{-1.0f}, {-1.0f}}, l[2][1] = {{-1.0f}, {-1.0f}};
  for (int r = 0; r < 2; ++r) {
    ShardBoundaryAmax(x.data() + g[r].row_offset * n, InputDType::kBFloat16, g[r], p.scaling, f[r],
                      l[r]);
  }
  EXPECT_EQ(f[0][0], 0.5f);
  EXPECT_EQ(f[1][0], 200.0f);
  const float* firsts[2] = {f[0], f[1]};
  const float* lasts[2] = {l[0], l[1]};
  float cf = -1.0f, cl = -1.0f;
  CombineBoundaryAmax(2, g, firsts, lasts, 0, p.scaling, &cf, &cl);
  EXPECT_EQ(cf, 200.0f);
  EXPECT_EQ(cl, 200.0f);
  std::vector<uint8_t> rd(3 * n), cd(3 * n);
  float rs = -1.0f, cs = -1.0f;
  QuantizeShard(x.data(), InputDType::kBFloat16, g[0], p, &cf, &cl,
                {rd.data(), &rs, cd.data(), &cs});
  EXPECT_EQ(rs, 0.5f);  // amax 200 -> pow2 scale 2 (448 / 200 = 2.24)
  EXPECT_EQ(cs, 0.5f);
  EXPECT_EQ(rd[0], EncodeE4M3(1.0f));
  // Its own amax (0.5) would have given scale 512 and other bytes.
  QuantizeShard(x.data(), InputDType::kBFloat16, g[0], p, nullptr, nullptr,
                {rd.data(), &rs, cd.data(), &cs});
  EXPECT_EQ(rs, 1.0f / 512);
}

}  // namespace
}  // namespace qtx::kernels::cpu
