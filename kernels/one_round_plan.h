// The plan of the one-round exact all-gather (docs/numerics.md §5, "one
// round"): which rows of each rank's shard are quantized by that rank, which
// travel in the input's precision, and which block rows every rank quantizes
// itself after the gather. Pure host functions of (shard_rows, n); every rank
// computes the same plan for every rank, so no sizes need to be exchanged.
//
// Why the result is byte-identical to quantizing the concatenation X:
//  1. Every block lies inside one 128-row block row k = rows [128k,
//     min(128k + 128, M)) of X on the global grid: a 1x128 rowwise block in
//     one row, a 128x1 columnwise block and a 128x128 tile in one block row.
//     A block's scale_inv and bytes are a function of that block's elements
//     only (amax over the block, scale from the amax, each element encoded
//     with the scale; the zero-fill of a partial block concerns only rows >= M
//     or columns >= N, the same on every rank).
//  2. A block row is either *interior* to one rank (all its rows lie in that
//     rank's shard) or *straddling* (its rows lie in two or more non-empty
//     shards). The interior block rows of a rank are contiguous and start and
//     end on block-row boundaries (or at M), so the rank quantizing them as a
//     shard at their global row offset computes every block of them from all
//     of its elements: the same bytes and scales as quantizing X.
//  3. A straddling block row's rows are sent by their ranks unchanged, in
//     the input's precision (a rank contributes at most its first 127 and its
//     last 127 rows; a shard inside one block row is sent whole). After the
//     gather every rank holds that block row's rows bit for bit and quantizes
//     them as a shard at row offset 128k: again every block from all of its
//     elements. Every rank runs the same deterministic code (the CPU
//     reference, or kernels that match it bit for bit) on the same bytes, so
//     all ranks write the same bytes.
//  4. The interior ranges and the straddling block rows partition [0, M), so
//     assembling them (kernels/cpu/quantize_shard.h AssembleShards) writes
//     every block of Q(X) exactly once (padding zeroed).
//  1-D rowwise-only requests need no boundary rows at all: a 1x128 block
//  never leaves its row, so every rank quantizes its whole shard
//  (split_boundaries = false).
#ifndef QTX_KERNELS_ONE_ROUND_PLAN_H_
#define QTX_KERNELS_ONE_ROUND_PLAN_H_

#include <algorithm>
#include <cstdint>
#include <span>
#include <vector>

#include "kernels/block_geometry.h"
#include "kernels/shard_geometry.h"

namespace qtx::kernels {

// One rank's part: global rows [row_offset, row_offset + m).
struct OneRoundShard {
  int64_t row_offset = 0;
  int64_t m = 0;
  // Local rows [0, head_rows) lie in a straddling block row (the shard's
  // first) and travel in the input's precision; likewise local rows
  // [m - tail_rows, m) (the shard's last block row, when it differs from the
  // first). head_rows + tail_rows <= m; each <= 127 unless the shard lies in
  // one block row (then head_rows = m, tail_rows = 0).
  int64_t head_rows = 0;
  int64_t tail_rows = 0;
  // The rows this rank quantizes itself: {row_offset + head_rows,
  // m - head_rows - tail_rows, n}; empty (m = 0) when there are none.
  ShardGeometry interior;
};

// A block row that two or more non-empty shards share.
struct StraddleBlock {
  int64_t block = 0;   // k
  ShardGeometry geom;  // {128k, min(128k + 128, M) - 128k, n}
  // Its rows in order: which rank sends them and whether they are that
  // rank's tail rows (else its head rows).
  struct Piece {
    int rank = 0;
    bool tail = false;
    int64_t rows = 0;
  };
  std::vector<Piece> pieces;
};

struct OneRoundPlan {
  int64_t m_total = 0;
  int64_t n = 0;
  std::vector<OneRoundShard> shards;     // one per rank, in rank order
  std::vector<StraddleBlock> straddles;  // in block order
};

// REQUIRES: every shard_rows[r] >= 0, their sum does not overflow, n >= 0.
inline OneRoundPlan PlanOneRound(std::span<const int64_t> shard_rows, int64_t n,
                                 bool split_boundaries) {
  OneRoundPlan plan;
  plan.n = n;
  for (int64_t m : shard_rows) plan.m_total += m;
  const int64_t total = plan.m_total;
  // End of block row k (exclusive): the tensor may end inside it.
  auto block_end = [total](int64_t k) { return std::min(k * kBlockLen + kBlockLen, total); };
  int64_t offset = 0;
  for (size_t r = 0; r < shard_rows.size(); ++r) {
    OneRoundShard s;
    s.row_offset = offset;
    s.m = shard_rows[r];
    offset += s.m;
    if (s.m > 0 && split_boundaries) {
      const int64_t o = s.row_offset, e = s.row_offset + s.m;
      const int64_t kf = o / kBlockLen, kl = (e - 1) / kBlockLen;
      // The first block row is shared iff rows of it lie before o (earlier
      // ranks) or after e (later ranks).
      if (o > kf * kBlockLen || e < block_end(kf)) s.head_rows = std::min(e, block_end(kf)) - o;
      // The last block row (a different one) starts at 128 kl > o, so it is
      // shared iff rows of it lie after e.
      if (kl != kf && e < block_end(kl)) s.tail_rows = e - kl * kBlockLen;
    }
    s.interior = ShardGeometry{s.row_offset + s.head_rows, s.m - s.head_rows - s.tail_rows, n};
    plan.shards.push_back(s);
  }
  // The straddling block rows, each with its pieces in rank (= row) order.
  for (size_t r = 0; r < plan.shards.size(); ++r) {
    const OneRoundShard& s = plan.shards[r];
    for (int which = 0; which < 2; ++which) {
      const int64_t rows = which == 0 ? s.head_rows : s.tail_rows;
      if (rows == 0) continue;
      const int64_t k =
          which == 0 ? s.row_offset / kBlockLen : (s.row_offset + s.m - 1) / kBlockLen;
      if (plan.straddles.empty() || plan.straddles.back().block != k) {
        StraddleBlock b;
        b.block = k;
        b.geom = ShardGeometry{k * kBlockLen, block_end(k) - k * kBlockLen, n};
        plan.straddles.push_back(b);
      }
      plan.straddles.back().pieces.push_back({static_cast<int>(r), which == 1, rows});
    }
  }
  return plan;
}

}  // namespace qtx::kernels

#endif  // QTX_KERNELS_ONE_ROUND_PLAN_H_
