// kernels/cuda/quantize_shard vs kernels/cpu (ShardBoundaryAmax,
// CombineBoundaryAmax, QuantizeShard, AssembleShards), byte for byte: the whole exact all-gather
// pipeline run on one GPU for several ranks' shards, against QuantizeBlock of the whole
// (1-D, 2-D and TENSOR, which QuantizeBlock hands to QuantizeTensor).
#include "kernels/cpu/quantize_shard.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/block_geometry.h"
#include "kernels/cpu/quantize_block.h"
#include "kernels/cuda/quantize_shard.h"
#include "kernels/fp8.h"
#include "kernels/one_round_plan.h"
#include "kernels/shard_geometry.h"

namespace qtx::kernels {
namespace {

#define ASSERT_CUDA(x) ASSERT_EQ((x), cudaSuccess) << #x

template <typename T>
struct Dev {
  T* p = nullptr;
  explicit Dev(size_t n) {
    EXPECT_EQ(cudaMalloc(reinterpret_cast<void**>(&p), std::max<size_t>(n, 1) * sizeof(T)),
              cudaSuccess);
  }
  ~Dev() { cudaFree(p); }
};

struct Case {
  std::vector<int64_t> rows;
  int64_t n;
};

// cuda::AssembleShards of the pieces into fresh outputs (scale padding
// pre-filled with 0xFF: it must come out zeroed), compared byte for byte
// with the whole tensor's rowwise (rd, rs) and columnwise (cd, cs) outputs.
void ExpectAssembledEquals(const std::vector<ShardGeometry>& geoms,
                           const std::vector<QuantizedConstBuffers>& views, const QuantizeParams& p,
                           bool rowwise, bool columnwise, const std::vector<uint8_t>& rd,
                           const std::vector<float>& rs, const std::vector<uint8_t>& cd,
                           const std::vector<float>& cs) {
  Dev<uint8_t> ord(rd.size()), ocd(cd.size());
  Dev<float> ors(rs.size()), ocs(cs.size());
  ASSERT_CUDA(cudaMemset(ors.p, 0xFF, 4 * std::max<size_t>(rs.size(), 1)));
  ASSERT_CUDA(cudaMemset(ocs.p, 0xFF, 4 * std::max<size_t>(cs.size(), 1)));
  ASSERT_CUDA(cuda::AssembleShards(static_cast<int>(geoms.size()), geoms.data(), views.data(), p,
                                   {ord.p, ors.p, ocd.p, ocs.p}, nullptr));
  ASSERT_CUDA(cudaDeviceSynchronize());
  if (rowwise) {
    std::vector<uint8_t> a(rd.size());
    std::vector<float> as(rs.size());
    ASSERT_CUDA(cudaMemcpy(a.data(), ord.p, a.size(), cudaMemcpyDeviceToHost));
    ASSERT_CUDA(cudaMemcpy(as.data(), ors.p, 4 * as.size(), cudaMemcpyDeviceToHost));
    EXPECT_EQ(a, rd);
    EXPECT_EQ(0, std::memcmp(as.data(), rs.data(), 4 * as.size()));
  }
  if (columnwise) {
    std::vector<uint8_t> a(cd.size());
    std::vector<float> as(cs.size());
    ASSERT_CUDA(cudaMemcpy(a.data(), ocd.p, a.size(), cudaMemcpyDeviceToHost));
    ASSERT_CUDA(cudaMemcpy(as.data(), ocs.p, 4 * as.size(), cudaMemcpyDeviceToHost));
    EXPECT_EQ(a, cd);
    EXPECT_EQ(0, std::memcmp(as.data(), cs.data(), 4 * as.size()));
  }
}

void RunCase(const Case& c, BlockScaling scaling, bool rowwise, bool columnwise, Fp8Format fmt) {
  int64_t m = 0;
  for (int64_t r : c.rows) m += r;
  const int64_t n = c.n;
  const int w = static_cast<int>(c.rows.size());
  std::vector<uint16_t> x(m * n);
  std::mt19937 rng(static_cast<uint32_t>(m * 17 + n));
  std::normal_distribution<float> d(0, 1);
  int64_t row = 0;
  for (int r = 0; r < w; ++r) {
    const float mag = std::ldexp(1.0f, (r * 5) % 11 - 5);
    for (int64_t i = 0; i < c.rows[r] * n; ++i) x[row * n + i] = FloatToBf16(d(rng) * mag);
    row += c.rows[r];
  }
  if (m * n > 3) x[3] = 0x7FC0;  // a NaN: ignored by amax, encodes to 0x7F
  const QuantizeParams p{scaling, fmt, rowwise, columnwise, true, 0.0f};
  const QuantizedLayout l = ComputeLayout(scaling, m, n);
  std::vector<uint8_t> rd(l.RowwiseDataBytes()), cd(l.ColumnwiseDataBytes());
  std::vector<float> rs(l.RowwiseScaleCount()), cs(l.ColumnwiseScaleCount());
  cpu::QuantizeBlock(x.data(), InputDType::kBFloat16, m, n, p,
                     {rd.data(), rs.data(), cd.data(), cs.data()});

  Dev<uint16_t> dx(m * n);
  ASSERT_CUDA(cudaMemcpy(dx.p, x.data(), 2 * m * n, cudaMemcpyHostToDevice));
  std::vector<ShardGeometry> geoms(w);
  int64_t off = 0;
  for (int r = 0; r < w; ++r) {
    geoms[r] = {off, c.rows[r], n};
    off += c.rows[r];
  }
  // Boundary amaxes on the GPU, combined on the host (as the op does).
  std::vector<std::vector<float>> firsts(w), lasts(w);
  for (int r = 0; r < w; ++r) {
    const int64_t len = BoundaryAmaxLength(scaling, geoms[r]);
    firsts[r].assign(len, 0.0f);
    lasts[r].assign(len, 0.0f);
    std::vector<float> cf(len, 0.0f), cl(len, 0.0f);
    cpu::ShardBoundaryAmax(x.data() + geoms[r].row_offset * n, InputDType::kBFloat16, geoms[r],
                           scaling, cf.data(), cl.data());
    if (geoms[r].m == 0) continue;
    Dev<float> f(len), la(len);
    ASSERT_CUDA(cuda::ShardBoundaryAmax(dx.p + geoms[r].row_offset * n, InputDType::kBFloat16,
                                        geoms[r], scaling, f.p, la.p, nullptr));
    ASSERT_CUDA(cudaMemcpy(firsts[r].data(), f.p, 4 * len, cudaMemcpyDeviceToHost));
    ASSERT_CUDA(cudaMemcpy(lasts[r].data(), la.p, 4 * len, cudaMemcpyDeviceToHost));
    ASSERT_EQ(0, std::memcmp(firsts[r].data(), cf.data(), 4 * len)) << "first amax rank " << r;
    ASSERT_EQ(0, std::memcmp(lasts[r].data(), cl.data(), 4 * len)) << "last amax rank " << r;
  }
  std::vector<const float*> fp(w), lp(w);
  for (int r = 0; r < w; ++r) {
    fp[r] = firsts[r].data();
    lp[r] = lasts[r].data();
  }
  // Every rank's partial amaxes as the communicator gathers them on the
  // device, [w][first | last][len] (len is the same for every rank: same n).
  const int64_t glen = w > 0 ? BoundaryAmaxLength(scaling, geoms[0]) : 0;
  Dev<float> gathered(2 * w * glen);
  for (int r = 0; r < w; ++r) {
    if (geoms[r].m == 0) {
      // Unwritten on the device: poison it, it must not be read. FLT_MAX, not
      // NaN: the max of an amax and a NaN is the amax, both on the CPU and
      // with fmaxf, so a NaN read would not show.
      std::vector<float> poison(2 * glen, std::numeric_limits<float>::max());
      ASSERT_CUDA(
          cudaMemcpy(gathered.p + 2 * r * glen, poison.data(), 8 * glen, cudaMemcpyHostToDevice));
      continue;
    }
    ASSERT_CUDA(
        cudaMemcpy(gathered.p + 2 * r * glen, firsts[r].data(), 4 * glen, cudaMemcpyHostToDevice));
    ASSERT_CUDA(cudaMemcpy(gathered.p + (2 * r + 1) * glen, lasts[r].data(), 4 * glen,
                           cudaMemcpyHostToDevice));
  }
  std::vector<Dev<uint8_t>*> keep;
  std::vector<QuantizedConstBuffers> views(w);
  std::vector<Dev<float>*> keepf;
  for (int r = 0; r < w; ++r) {
    const ShardGeometry& g = geoms[r];
    const int64_t len = BoundaryAmaxLength(scaling, g);
    std::vector<float> f(len), la(len);
    cpu::CombineBoundaryAmax(w, geoms.data(), fp.data(), lp.data(), r, scaling, f.data(),
                             la.data());
    auto* df = new Dev<float>(2 * len);
    keepf.push_back(df);
    // The combine on the GPU (what a stream-ordered AllGather runs) equals
    // the CPU's bit for bit; the shard is then quantized with the GPU's.
    ASSERT_CUDA(cudaMemset(df->p, 0xFF, 8 * std::max<int64_t>(len, 1)));
    ASSERT_CUDA(cuda::CombineBoundaryAmax(w, geoms.data(), gathered.p, len, r, scaling, df->p,
                                          df->p + len, nullptr));
    if (g.m > 0) {
      std::vector<float> gf(len), gl(len);
      ASSERT_CUDA(cudaMemcpy(gf.data(), df->p, 4 * len, cudaMemcpyDeviceToHost));
      ASSERT_CUDA(cudaMemcpy(gl.data(), df->p + len, 4 * len, cudaMemcpyDeviceToHost));
      ASSERT_EQ(0, std::memcmp(gf.data(), f.data(), 4 * len)) << "combined first, rank " << r;
      ASSERT_EQ(0, std::memcmp(gl.data(), la.data(), 4 * len)) << "combined last, rank " << r;
    }
    auto* d = new Dev<uint8_t>(2 * g.m * n);
    keep.push_back(d);
    auto* s =
        new Dev<float>(ShardRowwiseScaleCount(scaling, g) + ShardColumnwiseScaleCount(scaling, g));
    keepf.push_back(s);
    QuantizedBuffers b;
    if (rowwise) {
      b.rowwise_data = d->p;
      b.rowwise_scale_inv = s->p;
    }
    if (columnwise) {
      b.columnwise_data = d->p + g.m * n;
      b.columnwise_scale_inv = s->p + ShardRowwiseScaleCount(scaling, g);
    }
    ASSERT_CUDA(cuda::QuantizeShard(dx.p + g.row_offset * n, InputDType::kBFloat16, g, p, df->p,
                                    df->p + len, b, nullptr));
    views[r] = {b.rowwise_data, b.rowwise_scale_inv, b.columnwise_data, b.columnwise_scale_inv};
  }
  ExpectAssembledEquals(geoms, views, p, rowwise, columnwise, rd, rs, cd, cs);
  for (auto* k : keep) delete k;
  for (auto* k : keepf) delete k;
}

TEST(QuantizeShardCuda, PipelineMatchesQuantizeOfConcatenation) {
  const std::vector<Case> cases = {{{64, 64}, 128},
                                   {{0, 300}, 100},
                                   {{100, 156, 1}, 300},
                                   {{129, 127, 256}, 1},
                                   {{1, 1, 1, 1}, 129},
                                   {{250, 250, 250, 250}, 300},
                                   {{4095, 4097}, 256},
                                   {{3, 0, 130}, 257},
                                   // 128 ranks share block row 0: the most
                                   // contributors one block can have.
                                   {std::vector<int64_t>(130, 1), 130}};
  for (const Case& c : cases) {
    for (auto s : {BlockScaling::kBlock1D, BlockScaling::kBlock2D, BlockScaling::kTensor}) {
      for (auto fmt : {Fp8Format::kE4M3, Fp8Format::kE5M2}) {
        for (int usage = 1; usage <= 3; ++usage) {
          SCOPED_TRACE(testing::Message()
                       << "ranks=" << c.rows.size() << " rows0=" << c.rows[0] << " n=" << c.n
                       << " scaling=" << static_cast<int>(s) << " usage=" << usage);
          RunCase(c, s, usage & 1, usage & 2, fmt);
        }
      }
    }
  }
}

// The shape class allgather_nccl_bench first failed on: 1-D (and 2-D) row+col
// shards of 4096 and 4095/4097 rows at N = 8192, whose kernel needs more than
// 48 KiB of shared memory. The opt-in is per device, so each visible device is
// run in turn in this process (the first test above already launched on
// device 0): a launch configured once per process fails on the second device
// with cudaErrorInvalidValue.
TEST(QuantizeShardCuda, LargeRowAndColumnShardsOnEveryDevice) {
  int devices = 0;
  ASSERT_CUDA(cudaGetDeviceCount(&devices));
  ASSERT_GE(devices, 1);
  for (int d = 0; d < devices; ++d) {
    ASSERT_CUDA(cudaSetDevice(d));
    for (const Case& c : std::vector<Case>{{{4096, 4096}, 8192}, {{4095, 4097}, 8192}}) {
      SCOPED_TRACE(testing::Message() << "device=" << d << " rows0=" << c.rows[0]);
      RunCase(c, BlockScaling::kBlock1D, true, true, Fp8Format::kE4M3);
    }
    for (auto s : {BlockScaling::kBlock2D, BlockScaling::kTensor}) {
      SCOPED_TRACE(testing::Message() << "device=" << d << " scaling=" << static_cast<int>(s));
      RunCase({{4095, 4097}, 8192}, s, true, true, Fp8Format::kE4M3);
    }
  }
  ASSERT_CUDA(cudaSetDevice(0));
}

// The one-round all-gather's device work (kernels/one_round_plan.h) on one
// GPU: each rank's interior block rows quantized with no boundary amaxes (null
// vectors), each straddling block row rebuilt from the rows its ranks send and
// quantized likewise, then AssembleShards of the pieces in row order: byte for
// byte QuantizeBlock of the whole on the CPU. Not TENSOR: its one block spans
// every rank, so no piece can be cast with the amax of its own rows.
void RunOneRound(const std::vector<int64_t>& rows, int64_t n, BlockScaling scaling, bool rowwise,
                 bool columnwise) {
  const bool split = columnwise || scaling == BlockScaling::kBlock2D;
  const OneRoundPlan plan = PlanOneRound(rows, n, split);
  const int64_t m = plan.m_total;
  std::vector<uint16_t> x(m * n);
  std::mt19937 rng(static_cast<uint32_t>(m * 29 + n));
  std::normal_distribution<float> d(0, 1);
  for (size_t r = 0; r < rows.size(); ++r) {
    const float mag = std::ldexp(1.0f, static_cast<int>(r * 5) % 11 - 5);
    const OneRoundShard& s = plan.shards[r];
    for (int64_t i = s.row_offset * n; i < (s.row_offset + s.m) * n; ++i)
      x[i] = FloatToBf16(d(rng) * mag);
  }
  const QuantizeParams p{scaling, Fp8Format::kE4M3, rowwise, columnwise, true, 0.0f};
  const QuantizedLayout l = ComputeLayout(scaling, m, n);
  std::vector<uint8_t> rd(l.RowwiseDataBytes()), cd(l.ColumnwiseDataBytes());
  std::vector<float> rs(l.RowwiseScaleCount()), cs(l.ColumnwiseScaleCount());
  cpu::QuantizeBlock(x.data(), InputDType::kBFloat16, m, n, p,
                     {rd.data(), rs.data(), cd.data(), cs.data()});
  Dev<uint16_t> dx(m * n);
  ASSERT_CUDA(cudaMemcpy(dx.p, x.data(), 2 * m * n, cudaMemcpyHostToDevice));
  struct Piece {
    ShardGeometry g;
    QuantizedConstBuffers v;
  };
  std::vector<Piece> pieces;
  std::vector<std::unique_ptr<Dev<uint8_t>>> keep;
  std::vector<std::unique_ptr<Dev<float>>> keepf;
  auto quantize = [&](const uint16_t* src, const ShardGeometry& g) {
    keep.push_back(std::make_unique<Dev<uint8_t>>(2 * g.m * n));
    keepf.push_back(std::make_unique<Dev<float>>(ShardRowwiseScaleCount(scaling, g) +
                                                 ShardColumnwiseScaleCount(scaling, g)));
    QuantizedBuffers b;
    if (rowwise) {
      b.rowwise_data = keep.back()->p;
      b.rowwise_scale_inv = keepf.back()->p;
    }
    if (columnwise) {
      b.columnwise_data = keep.back()->p + g.m * n;
      b.columnwise_scale_inv = keepf.back()->p + ShardRowwiseScaleCount(scaling, g);
    }
    ASSERT_CUDA(
        cuda::QuantizeShard(src, InputDType::kBFloat16, g, p, nullptr, nullptr, b, nullptr));
    pieces.push_back(
        {g, {b.rowwise_data, b.rowwise_scale_inv, b.columnwise_data, b.columnwise_scale_inv}});
  };
  for (const OneRoundShard& s : plan.shards) {
    if (s.interior.m > 0) quantize(dx.p + s.interior.row_offset * n, s.interior);
  }
  for (const StraddleBlock& b : plan.straddles) {
    // The block row's rows, gathered from the ranks' head/tail rows (device
    // to device, as the op copies them out of the gathered slots).
    Dev<uint16_t> blk(b.geom.m * n);
    int64_t at = 0;
    for (const auto& piece : b.pieces) {
      const OneRoundShard& s = plan.shards[piece.rank];
      const int64_t first = s.row_offset + (piece.tail ? s.m - s.tail_rows : 0);
      ASSERT_CUDA(cudaMemcpy(blk.p + at * n, dx.p + first * n, 2 * piece.rows * n,
                             cudaMemcpyDeviceToDevice));
      at += piece.rows;
    }
    quantize(blk.p, b.geom);
    ASSERT_CUDA(cudaDeviceSynchronize());  // `blk` is freed at the end of this scope
  }
  std::sort(pieces.begin(), pieces.end(),
            [](const Piece& a, const Piece& b) { return a.g.row_offset < b.g.row_offset; });
  std::vector<ShardGeometry> geoms;
  std::vector<QuantizedConstBuffers> views;
  for (const Piece& q : pieces) {
    geoms.push_back(q.g);
    views.push_back(q.v);
  }
  ExpectAssembledEquals(geoms, views, p, rowwise, columnwise, rd, rs, cd, cs);
}

// TENSOR with no combined amax (null first_amax, as for the one-round pieces
// of the block modes): the shard is cast with its own amax, computed on the
// device, byte for byte as kernels::cpu::QuantizeShard does; an empty shard
// gets the scale_inv of amax 0.
TEST(QuantizeShardCuda, TensorShardWithoutAmaxUsesItsOwn) {
  for (const auto& [m, n] :
       std::vector<std::pair<int64_t, int64_t>>{{300, 257}, {1, 1}, {256, 512}, {0, 64}}) {
    for (int usage = 1; usage <= 3; ++usage) {
      const bool rowwise = usage & 1, columnwise = usage & 2;
      SCOPED_TRACE(testing::Message() << m << "x" << n << " usage=" << usage);
      std::vector<uint16_t> x(m * n);
      std::mt19937 rng(static_cast<uint32_t>(m * 7 + n));
      std::normal_distribution<float> d(0, 1);
      for (auto& v : x) v = FloatToBf16(d(rng) * 8.0f);
      const ShardGeometry g{1000, m, n};  // TENSOR does not read the offset
      const QuantizeParams p{
          BlockScaling::kTensor, Fp8Format::kE4M3, rowwise, columnwise, false, 0.0f};
      std::vector<uint8_t> rd(m * n, 0xAA), cd(m * n, 0xAA);
      float rs = -1.0f, cs = -1.0f;
      cpu::QuantizeShard(x.data(), InputDType::kBFloat16, g, p, nullptr, nullptr,
                         {rd.data(), &rs, cd.data(), &cs});
      Dev<uint16_t> dx(m * n);
      Dev<uint8_t> dd(2 * m * n);
      Dev<float> ds(2);
      ASSERT_CUDA(cudaMemcpy(dx.p, x.data(), 2 * m * n, cudaMemcpyHostToDevice));
      ASSERT_CUDA(cudaMemset(dd.p, 0xAA, std::max<int64_t>(2 * m * n, 1)));
      ASSERT_CUDA(cudaMemset(ds.p, 0xFF, 8));
      QuantizedBuffers b;
      if (rowwise) {
        b.rowwise_data = dd.p;
        b.rowwise_scale_inv = ds.p;
      }
      if (columnwise) {
        b.columnwise_data = dd.p + m * n;
        b.columnwise_scale_inv = ds.p + 1;
      }
      ASSERT_CUDA(cuda::QuantizeShard(m > 0 ? dx.p : nullptr, InputDType::kBFloat16, g, p, nullptr,
                                      nullptr, b, nullptr));
      ASSERT_CUDA(cudaDeviceSynchronize());
      std::vector<uint8_t> got(2 * m * n);
      float got_s[2];
      ASSERT_CUDA(cudaMemcpy(got.data(), dd.p, got.size(), cudaMemcpyDeviceToHost));
      ASSERT_CUDA(cudaMemcpy(got_s, ds.p, 8, cudaMemcpyDeviceToHost));
      if (rowwise) {
        EXPECT_EQ(std::vector<uint8_t>(got.begin(), got.begin() + m * n), rd);
        EXPECT_EQ(FloatBits(got_s[0]), FloatBits(rs));
      }
      if (columnwise) {
        EXPECT_EQ(std::vector<uint8_t>(got.begin() + m * n, got.end()), cd);
        EXPECT_EQ(FloatBits(got_s[1]), FloatBits(cs));
      }
    }
  }
}

TEST(QuantizeShardCuda, OneRoundPiecesMatchQuantizeOfConcatenation) {
  const std::vector<std::vector<int64_t>> splits = {
      {64, 64},     {0, 300},      {100, 156, 1},       {129, 127, 256},
      {1, 1, 1, 1}, {200, 3, 300}, {250, 1, 2, 5, 300}, {128, 5, 123, 0, 128},
      {4095, 4097}};
  for (const auto& rows : splits) {
    for (int64_t n : {100, 300}) {
      for (auto s : {BlockScaling::kBlock1D, BlockScaling::kBlock2D}) {
        for (int usage = 1; usage <= 3; ++usage) {
          SCOPED_TRACE(testing::Message()
                       << "ranks=" << rows.size() << " rows0=" << rows[0] << " n=" << n
                       << " 2d=" << (s == BlockScaling::kBlock2D) << " usage=" << usage);
          RunOneRound(rows, n, s, usage & 1, usage & 2);
        }
      }
    }
  }
}

}  // namespace
}  // namespace qtx::kernels
