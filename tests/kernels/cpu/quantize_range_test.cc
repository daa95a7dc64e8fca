// Data-parallel sharded parameter output (docs/numerics.md §10) without any
// network: the tile geometry of element ranges against a brute-force count,
// and per-owner partial amaxes -> max -> QuantizeRange2D against QuantizeBlock
// of the whole matrix, byte for byte, for ranges at offsets that cut tiles.
#include "kernels/cpu/quantize_range.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/block_geometry.h"
#include "kernels/cpu/quantize_block.h"
#include "kernels/element_range.h"
#include "kernels/fp8.h"

namespace qtx::kernels::cpu {
namespace {

// Counts the range's elements in tile (ti, tj) by enumerating the tile.
int64_t OwnedInTile(const ElementRange& r, int64_t m, int64_t n, int64_t ti, int64_t tj) {
  int64_t count = 0;
  for (int64_t i = ti * kBlockLen; i < std::min(m, (ti + 1) * kBlockLen); ++i) {
    for (int64_t j = tj * kBlockLen; j < std::min(n, (tj + 1) * kBlockLen); ++j) {
      const int64_t k = i * n + j;
      count += (k >= r.begin && k < r.end) ? 1 : 0;
    }
  }
  return count;
}

int64_t TileSize(int64_t m, int64_t n, int64_t ti, int64_t tj) {
  const TileBounds t = TileBoundsOf(m, n, ti, tj);
  return (t.r1 - t.r0) * (t.c1 - t.c0);
}

void CheckGeometry(int64_t m, int64_t n, const ElementRange& r) {
  SCOPED_TRACE(::testing::Message()
               << "[" << m << "," << n << "] range [" << r.begin << "," << r.end << ")");
  for (int64_t ti = 0; ti < CeilDiv(m, kBlockLen); ++ti) {
    for (int64_t tj = 0; tj < CeilDiv(n, kBlockLen); ++tj) {
      const int64_t owned = OwnedInTile(r, m, n, ti, tj);
      EXPECT_EQ(TileTouched(r, m, n, ti, tj), owned > 0) << "tile " << ti << "," << tj;
      EXPECT_EQ(TileOwned(r, m, n, ti, tj), owned == TileSize(m, n, ti, tj))
          << "tile " << ti << "," << tj;
      EXPECT_EQ(TileCut(r, m, n, ti, tj), owned > 0 && owned < TileSize(m, n, ti, tj))
          << "tile " << ti << "," << tj;
    }
  }
}

TEST(ElementRangeGeometry, MatchesBruteForceOnEdgeRanges) {
  const int64_t m = 300, n = 260;  // 3 x 3 tiles, partial last tile row and column
  const int64_t total = m * n;
  const std::vector<ElementRange> ranges = {
      {0, total},                      // everything
      {0, 0},                          // empty
      {5, 5},                          // empty, mid-matrix
      {0, 128},                        // one row's first tile only
      {10, 20},                        // smaller than one tile, inside one row
      {250, 270},                      // crosses a row end (n = 260)
      {128 * n - 3, 128 * n + 3},      // crosses a tile-row boundary
      {0, 128 * n},                    // exactly the first tile row
      {128 * n, total},                // the rest
      {7 * n + 100, 200 * n + 131},    // starts and ends mid-row, cuts many tiles
      {total - 1, total},              // the last element
      {256 * n + 256, total},          // only the last (partial) tile
      {n * 127 + 255, n * 127 + 257},  // two elements across tiles (1,?)
  };
  for (const ElementRange& r : ranges) CheckGeometry(m, n, r);
}

TEST(ElementRangeGeometry, MatchesBruteForceOnRandomRanges) {
  std::mt19937 rng(7);
  for (int it = 0; it < 60; ++it) {
    const int64_t m = 1 + rng() % 400, n = 1 + rng() % 400;
    const int64_t total = m * n;
    int64_t a = rng() % (total + 1), b = rng() % (total + 1);
    if (a > b) std::swap(a, b);
    CheckGeometry(m, n, {a, b});
  }
}

TEST(ElementRangeGeometry, OneRowMatrixAndNarrowColumns) {
  CheckGeometry(1, 1000, {100, 700});
  CheckGeometry(1000, 1, {100, 700});
  CheckGeometry(129, 129, {128, 129 * 128 + 1});
}

// Whole-matrix reference vs owners' slices.
struct Split {
  int64_t m, n;
  std::vector<int64_t> cuts;  // owner r holds [cuts[r], cuts[r+1])
};

std::vector<float> MakeInput(int64_t m, int64_t n, uint32_t seed, bool specials) {
  std::vector<float> x(static_cast<size_t>(m * n));
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0, 1);
  for (int64_t i = 0; i < m * n; ++i) {
    // Magnitudes that change along the flattened index, so that a slice's
    // local amax of a cut tile usually differs from the tile's amax.
    const float mag = std::ldexp(1.0f, static_cast<int>((i / 997) % 17) - 8);
    x[i] = d(rng) * mag;
  }
  if (specials && m * n > 40) {
    x[3] = std::numeric_limits<float>::quiet_NaN();
    x[m * n / 2] = std::numeric_limits<float>::infinity();
    x[m * n / 3] = -0.0f;
    x[m * n - 7] = 1e-40f;  // subnormal
    x[m * n / 5] = -3e38f;
  }
  return x;
}

void CheckSplit(const Split& s, const QuantizeParams& q, bool specials) {
  SCOPED_TRACE(::testing::Message()
               << "[" << s.m << "," << s.n << "] owners " << s.cuts.size() - 1
               << " e5m2=" << (q.format == Fp8Format::kE5M2) << " pow2=" << q.force_pow2_scales
               << " eps=" << q.amax_epsilon << " specials=" << specials);
  const int64_t m = s.m, n = s.n;
  const std::vector<float> x = MakeInput(m, n, static_cast<uint32_t>(m * 31 + n), specials);
  QuantizeParams whole = q;
  whole.rowwise = true;
  whole.columnwise = true;
  const QuantizedLayout l = ComputeLayout(BlockScaling::kBlock2D, m, n);
  std::vector<uint8_t> ref_data(l.RowwiseDataBytes()), ref_col(l.ColumnwiseDataBytes());
  std::vector<float> ref_rs(l.RowwiseScaleCount()), ref_cs(l.ColumnwiseScaleCount());
  QuantizeBlock(x.data(), InputDType::kFloat32, m, n, whole,
                {ref_data.data(), ref_rs.data(), ref_col.data(), ref_cs.data()});

  const int owners = static_cast<int>(s.cuts.size()) - 1;
  const int64_t tiles = TileCount(m, n);
  std::vector<std::vector<float>> partial(owners, std::vector<float>(tiles, 0.0f));
  for (int o = 0; o < owners; ++o) {
    const ElementRange r{s.cuts[o], s.cuts[o + 1]};
    RangeTileAmax(x.data() + r.begin, m, n, r, partial[o].data());
  }
  std::vector<float> combined(tiles, 0.0f);
  for (int o = 0; o < owners; ++o) {
    for (int64_t t = 0; t < tiles; ++t) combined[t] = std::max(combined[t], partial[o][t]);
  }
  std::vector<uint8_t> gathered(static_cast<size_t>(m * n), 0xAA);
  bool some_local_amax_differs = false;
  for (int o = 0; o < owners; ++o) {
    const ElementRange r{s.cuts[o], s.cuts[o + 1]};
    std::vector<float> rs(l.RowwiseScaleCount(), -1.0f), cs(l.ColumnwiseScaleCount(), -1.0f);
    QuantizeRange2D(x.data() + r.begin, m, n, r, combined.data(), q, gathered.data() + r.begin,
                    rs.data(), cs.data());
    EXPECT_EQ(0, std::memcmp(rs.data(), ref_rs.data(), rs.size() * 4)) << "owner " << o;
    EXPECT_EQ(0, std::memcmp(cs.data(), ref_cs.data(), cs.size() * 4)) << "owner " << o;
    for (int64_t t = 0; t < tiles; ++t) {
      if (partial[o][t] != 0.0f && partial[o][t] != combined[t]) some_local_amax_differs = true;
    }
  }
  for (int64_t k = 0; k < m * n; ++k) {
    ASSERT_EQ(gathered[k], ref_data[k])
        << "element " << k << " (row " << k / n << ", col " << k % n << ")";
  }
  if (owners > 1 && !specials) {
    // The data is built so that cut tiles need the combine: without this the
    // test could pass with local amaxes only.
    EXPECT_TRUE(some_local_amax_differs);
  }
}

QuantizeParams Params2D(Fp8Format f = Fp8Format::kE4M3, bool pow2 = true, float eps = 0.0f) {
  QuantizeParams q;
  q.scaling = BlockScaling::kBlock2D;
  q.format = f;
  q.rowwise = true;
  q.columnwise = true;
  q.force_pow2_scales = pow2;
  q.amax_epsilon = eps;
  return q;
}

TEST(QuantizeRange2D, TwoAndThreeOwnersAtTileCuttingOffsetsMatchWholeMatrix) {
  const int64_t m = 300, n = 260, total = m * n;
  const std::vector<Split> splits = {
      {m, n, {0, total}},
      {m, n, {0, 40000, total}},                      // mid-row, mid-tile
      {m, n, {0, 128 * n + 77, total}},               // ends mid-row just past a tile row
      {m, n, {0, 100, 100 + 50, total}},              // middle owner smaller than a tile
      {m, n, {0, 33 * n + 131, 250 * n + 5, total}},  // three owners, all cuts mid-row
      {m, n, {0, 0, 7 * n, total}},                   // an empty owner
      {m, n, {0, total - 3, total, total}},           // tiny last owner, empty one after
  };
  for (const Split& s : splits) {
    CheckSplit(s, Params2D(), false);
    CheckSplit(s, Params2D(), true);
  }
}

TEST(QuantizeRange2D, FormatsScalesAndEpsilon) {
  const Split s{257, 385, {0, 1000, 129 * 385 + 200, 257 * 385}};
  CheckSplit(s, Params2D(Fp8Format::kE5M2), false);
  CheckSplit(s, Params2D(Fp8Format::kE4M3, /*pow2=*/false), false);
  CheckSplit(s, Params2D(Fp8Format::kE4M3, true, /*eps=*/1e-3f), true);
}

TEST(QuantizeRange2D, RandomSplits) {
  std::mt19937 rng(11);
  for (int it = 0; it < 20; ++it) {
    const int64_t m = 1 + rng() % 300, n = 1 + rng() % 300;
    const int owners = 2 + static_cast<int>(rng() % 3);
    std::vector<int64_t> cuts = {0};
    for (int o = 1; o < owners; ++o) cuts.push_back(rng() % (m * n + 1));
    cuts.push_back(m * n);
    std::sort(cuts.begin(), cuts.end());
    // Small random matrices may have no cut tile whose local amax differs:
    // only the bytes are checked here (specials on).
    SCOPED_TRACE(it);
    CheckSplit(Split{m, n, cuts}, Params2D(), true);
  }
}

TEST(QuantizeRange2D, NullOutputsAreSkippedAndPaddingIsZero) {
  const int64_t m = 130, n = 10;  // mb = 2, nb = 1: both scale matrices padded
  const std::vector<float> x = MakeInput(m, n, 3, false);
  std::vector<float> amax(TileCount(m, n), 0.0f);
  RangeTileAmax(x.data(), m, n, {0, m * n}, amax.data());
  std::vector<float> rs(2 * 4, -1.0f), cs(1 * 4, -1.0f);
  QuantizeRange2D(x.data(), m, n, {0, m * n}, amax.data(), Params2D(), nullptr, rs.data(),
                  cs.data());
  for (int i = 0; i < 2; ++i) {
    EXPECT_GT(rs[i * 4], 0.0f);
    for (int j = 1; j < 4; ++j) EXPECT_EQ(rs[i * 4 + j], 0.0f);
  }
  EXPECT_EQ(cs[0], rs[0]);
  EXPECT_EQ(cs[1], rs[4]);
  EXPECT_EQ(cs[2], 0.0f);
  EXPECT_EQ(cs[3], 0.0f);
}

}  // namespace
}  // namespace qtx::kernels::cpu
