// The one-round all-gather plan (kernels/one_round_plan.h) without any
// network: each rank quantizes its interior rows, the straddling block rows
// are rebuilt from the rows the ranks would send in their input precision and
// quantized, and AssembleShards of all pieces must equal QuantizeBlock of the
// concatenated tensor, byte for byte, for any shard sizes.
#include "kernels/one_round_plan.h"

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/quantize_block.h"
#include "kernels/cpu/quantize_shard.h"
#include "kernels/fp8.h"

namespace qtx::kernels {
namespace {

std::string Name(const std::vector<int64_t>& shards, int64_t n) {
  std::string s;
  for (int64_t m : shards) s += std::to_string(m) + "_";
  return s + "n" + std::to_string(n);
}

// The plan's own promises: the pieces partition [0, M); head/tail rows are
// at most 127 unless the shard lies in one block row; each straddling block
// row is shared by two or more ranks and its pieces add up to it.
void CheckPlanInvariants(const OneRoundPlan& plan, bool split) {
  std::vector<int> cover(plan.m_total, 0);
  for (const OneRoundShard& s : plan.shards) {
    EXPECT_LE(s.head_rows + s.tail_rows, s.m);
    if (!split) {
      EXPECT_EQ(s.head_rows + s.tail_rows, 0);
    }
    const bool one_block =
        s.m > 0 && s.row_offset / kBlockLen == (s.row_offset + s.m - 1) / kBlockLen;
    if (!one_block) {
      EXPECT_LE(s.head_rows, kBlockLen - 1);
      EXPECT_LE(s.tail_rows, kBlockLen - 1);
    } else {
      EXPECT_TRUE(s.head_rows == 0 || s.head_rows == s.m);
      EXPECT_EQ(s.tail_rows, 0);
    }
    const ShardGeometry& i = s.interior;
    if (i.m > 0 && split) {  // (1-D rowwise only: whole shards, anywhere)
      EXPECT_EQ(i.row_offset % kBlockLen, 0) << "interior must start on a block row";
      EXPECT_TRUE((i.row_offset + i.m) % kBlockLen == 0 || i.row_offset + i.m == plan.m_total);
    }
    for (int64_t r = i.row_offset; r < i.row_offset + i.m; ++r) ++cover[r];
  }
  for (const StraddleBlock& b : plan.straddles) {
    EXPECT_GE(b.pieces.size(), 2u);
    int64_t rows = 0;
    for (const auto& p : b.pieces) rows += p.rows;
    EXPECT_EQ(rows, b.geom.m);
    for (int64_t r = b.geom.row_offset; r < b.geom.row_offset + b.geom.m; ++r) ++cover[r];
  }
  for (int64_t r = 0; r < plan.m_total; ++r) ASSERT_EQ(cover[r], 1) << "row " << r;
}

void CheckOneRound(const std::vector<int64_t>& shards, int64_t n, BlockScaling scaling,
                   bool rowwise, bool columnwise, Fp8Format fmt) {
  SCOPED_TRACE(Name(shards, n) + (scaling == BlockScaling::kBlock1D ? " 1D" : " 2D") +
               (rowwise ? " row" : "") + (columnwise ? " col" : ""));
  const bool split = columnwise || scaling == BlockScaling::kBlock2D;
  const OneRoundPlan plan = PlanOneRound(shards, n, split);
  CheckPlanInvariants(plan, split);
  const int64_t m = plan.m_total;
  const int w = static_cast<int>(shards.size());
  // Neighbouring shards have very different magnitudes, so a block
  // quantized from only part of its rows would get a different scale.
  std::vector<uint16_t> x(m * n);
  std::mt19937 rng(static_cast<uint32_t>(m * 131 + n));
  std::normal_distribution<float> d(0, 1);
  for (int r = 0; r < w; ++r) {
    const float mag = std::ldexp(1.0f, (r * 7) % 13 - 6);
    const OneRoundShard& s = plan.shards[r];
    for (int64_t i = s.row_offset * n; i < (s.row_offset + s.m) * n; ++i)
      x[i] = FloatToBf16(d(rng) * mag);
  }
  const QuantizeParams p{scaling, fmt, rowwise, columnwise, true, 0.0f};
  const QuantizedLayout l = ComputeLayout(scaling, m, n);
  std::vector<uint8_t> rd(l.RowwiseDataBytes()), cd(l.ColumnwiseDataBytes());
  std::vector<float> rs(l.RowwiseScaleCount()), cs(l.ColumnwiseScaleCount());
  cpu::QuantizeBlock(x.data(), InputDType::kBFloat16, m, n, p,
                     {rd.data(), rs.data(), cd.data(), cs.data()});

  // Pieces: every rank's interior (quantized by that rank alone, from its own
  // rows), then every straddling block row (from the sent rows only).
  struct Piece {
    ShardGeometry g;
    std::vector<uint8_t> rd, cd;
    std::vector<float> rs, cs;
  };
  std::vector<Piece> pieces;
  auto quantize = [&](const uint16_t* rows, const ShardGeometry& g) {
    Piece q;
    q.g = g;
    q.rd.assign(g.m * n, 0xAA);
    q.cd.assign(g.m * n, 0xAA);
    q.rs.assign(ShardRowwiseScaleCount(scaling, g), -1.0f);
    q.cs.assign(ShardColumnwiseScaleCount(scaling, g), -1.0f);
    cpu::QuantizeShard(rows, InputDType::kBFloat16, g, p, nullptr, nullptr,
                       {q.rd.data(), q.rs.data(), q.cd.data(), q.cs.data()});
    pieces.push_back(std::move(q));
  };
  for (int r = 0; r < w; ++r) {
    const OneRoundShard& s = plan.shards[r];
    // Only this rank's rows are visible: copy them out first.
    std::vector<uint16_t> mine(x.begin() + s.row_offset * n, x.begin() + (s.row_offset + s.m) * n);
    if (s.interior.m > 0) quantize(mine.data() + s.head_rows * n, s.interior);
  }
  for (const StraddleBlock& b : plan.straddles) {
    std::vector<uint16_t> rows;
    for (const auto& piece : b.pieces) {
      const OneRoundShard& s = plan.shards[piece.rank];
      const int64_t first = piece.tail ? s.m - s.tail_rows : 0;
      const uint16_t* src = x.data() + (s.row_offset + first) * n;
      rows.insert(rows.end(), src, src + piece.rows * n);
    }
    quantize(rows.data(), b.geom);
  }
  std::vector<ShardGeometry> geoms;
  std::vector<cpu::ShardConstBuffers> views;
  for (const Piece& q : pieces) {
    geoms.push_back(q.g);
    views.push_back({q.rd.data(), q.rs.data(), q.cd.data(), q.cs.data()});
  }
  std::vector<uint8_t> ard(rd.size(), 0x55), acd(cd.size(), 0x55);
  std::vector<float> ars(rs.size(), -2.0f), acs(cs.size(), -2.0f);
  cpu::AssembleShards(static_cast<int>(pieces.size()), geoms.data(), views.data(), p,
                      {ard.data(), ars.data(), acd.data(), acs.data()});
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

// Every split of the existing all-gather suites, plus shards smaller than a
// block in the middle of the group, shards inside one block row shared by
// many ranks, and tensors ending inside a straddling block row.
std::vector<std::vector<int64_t>> Splits() {
  return {{64, 64},
          {100, 156, 1},
          {0, 300},
          {250, 250, 250, 250},
          {128, 128},
          {1, 1, 1, 1},
          {129, 127, 256},
          {300, 0},
          {0, 0},
          {5, 200, 3, 60, 0, 129},
          {200, 3, 300},
          {250, 1, 2, 0, 5, 300},
          {128, 5, 123, 128},
          {127, 1, 128, 256, 1},
          {10, 20, 30, 40, 50},
          {256, 0, 256, 7},
          {384, 384}};
}

class OneRoundPlanTest
    : public ::testing::TestWithParam<std::tuple<std::vector<int64_t>, int64_t>> {};

TEST_P(OneRoundPlanTest, BitIdenticalToWholeTensor) {
  const auto& [shards, n] = GetParam();
  for (BlockScaling s : {BlockScaling::kBlock1D, BlockScaling::kBlock2D}) {
    CheckOneRound(shards, n, s, true, true, Fp8Format::kE4M3);
    CheckOneRound(shards, n, s, true, false, Fp8Format::kE5M2);
    CheckOneRound(shards, n, s, false, true, Fp8Format::kE4M3);
  }
}

INSTANTIATE_TEST_SUITE_P(Splits, OneRoundPlanTest,
                         ::testing::Combine(::testing::ValuesIn(Splits()),
                                            ::testing::Values<int64_t>(1, 100, 128, 300)),
                         [](const auto& info) {
                           return Name(std::get<0>(info.param), std::get<1>(info.param));
                         });

TEST(OneRoundPlan, RandomSplits) {
  std::mt19937 rng(15);
  for (int t = 0; t < 60; ++t) {
    const int w = 1 + static_cast<int>(rng() % 7);
    std::vector<int64_t> shards(w);
    for (auto& m : shards) m = rng() % 4 == 0 ? static_cast<int64_t>(rng() % 4) : rng() % 400;
    const BlockScaling s = t % 2 ? BlockScaling::kBlock1D : BlockScaling::kBlock2D;
    CheckOneRound(shards, 1 + rng() % 260, s, t % 3 != 1, t % 3 != 2, Fp8Format::kE4M3);
  }
}

// The rows each rank sends, by hand for one split: [200, 3, 300] has block
// rows 0 (rank 0 alone), 1 (ranks 0, 1, 2), 2 and 3 (rank 2), 4 (rank 2 only:
// the tensor ends in it), so rank 0 sends its last 72 rows, rank 1 all 3, and
// rank 2 its first 53; every other row is quantized where it lives.
TEST(OneRoundPlan, RowsSentByHand) {
  const std::vector<int64_t> shards = {200, 3, 300};
  const OneRoundPlan p = PlanOneRound(shards, 64, true);
  ASSERT_EQ(p.shards.size(), 3u);
  EXPECT_EQ(p.shards[0].head_rows, 0);
  EXPECT_EQ(p.shards[0].tail_rows, 72);
  EXPECT_EQ(p.shards[0].interior.row_offset, 0);
  EXPECT_EQ(p.shards[0].interior.m, 128);
  EXPECT_EQ(p.shards[1].head_rows, 3);
  EXPECT_EQ(p.shards[1].interior.m, 0);
  EXPECT_EQ(p.shards[2].head_rows, 53);
  EXPECT_EQ(p.shards[2].tail_rows, 0);
  EXPECT_EQ(p.shards[2].interior.row_offset, 256);
  EXPECT_EQ(p.shards[2].interior.m, 247);
  ASSERT_EQ(p.straddles.size(), 1u);
  EXPECT_EQ(p.straddles[0].block, 1);
  ASSERT_EQ(p.straddles[0].pieces.size(), 3u);
  EXPECT_TRUE(p.straddles[0].pieces[0].tail);
  EXPECT_FALSE(p.straddles[0].pieces[2].tail);
  // 1-D rowwise only: nothing is sent in the input's precision.
  const OneRoundPlan r = PlanOneRound(shards, 64, false);
  for (const auto& s : r.shards) EXPECT_EQ(s.head_rows + s.tail_rows, 0);
  EXPECT_TRUE(r.straddles.empty());
}

}  // namespace
}  // namespace qtx::kernels
