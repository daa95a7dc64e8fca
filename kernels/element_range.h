// Data-parallel element ranges of a 128x128-tiled matrix (docs/numerics.md
// §10): which tiles of the row-major [m, n] matrix a contiguous range
// [begin, end) of its flattened elements touches, and which of them it cuts
// (touches without owning every element). Pure functions; usable from host
// and device code.
//
// A distributed optimizer (Megatron-LM's DistributedOptimizer, ZeRO-1/2)
// gives each data-parallel rank a contiguous slice of a flattened parameter
// buffer at an arbitrary offset, so a slice boundary may cut tiles anywhere:
// mid-row, inside one tile, or with a slice smaller than a tile. A cut tile's
// FP8 bytes need the amax of the whole tile, so its owners combine their
// partial amaxes (max) before quantizing.
#ifndef QTX_KERNELS_ELEMENT_RANGE_H_
#define QTX_KERNELS_ELEMENT_RANGE_H_

#include <cstdint>

#include "kernels/block_geometry.h"
#include "kernels/host_device.h"

namespace qtx::kernels {

// Elements [begin, end) of the row-major flattened [m, n] matrix: element
// (r, c) has index r * n + c. Empty when begin == end.
struct ElementRange {
  int64_t begin = 0;
  int64_t end = 0;
  QTX_HD constexpr int64_t count() const { return end - begin; }
  QTX_HD constexpr bool empty() const { return end <= begin; }
  friend constexpr bool operator==(const ElementRange&, const ElementRange&) = default;
};

// Rows and columns of tile (ti, tj) of [m, n]: rows [r0, r1), columns [c0, c1).
struct TileBounds {
  int64_t r0 = 0, r1 = 0, c0 = 0, c1 = 0;
};

QTX_HD constexpr TileBounds TileBoundsOf(int64_t m, int64_t n, int64_t ti, int64_t tj) {
  TileBounds b;
  b.r0 = ti * kBlockLen;
  b.r1 = (b.r0 + kBlockLen < m) ? b.r0 + kBlockLen : m;
  b.c0 = tj * kBlockLen;
  b.c1 = (b.c0 + kBlockLen < n) ? b.c0 + kBlockLen : n;
  return b;
}

// Whether `r` holds every element of tile (ti, tj). The tile's first and
// last elements bound every index of the tile, and the range is contiguous.
// REQUIRES: the tile exists (ti < ceil(m/128), tj < ceil(n/128)).
QTX_HD constexpr bool TileOwned(const ElementRange& r, int64_t m, int64_t n, int64_t ti,
                                int64_t tj) {
  const TileBounds t = TileBoundsOf(m, n, ti, tj);
  return t.r0 * n + t.c0 >= r.begin && (t.r1 - 1) * n + (t.c1 - 1) < r.end;
}

// Whether `r` holds at least one element of tile (ti, tj): only the range's
// first and last rows can hold part of a row; rows between them are whole.
// REQUIRES: as TileOwned.
QTX_HD constexpr bool TileTouched(const ElementRange& r, int64_t m, int64_t n, int64_t ti,
                                  int64_t tj) {
  if (r.empty() || n == 0) return false;
  const TileBounds t = TileBoundsOf(m, n, ti, tj);
  const int64_t first_row = r.begin / n, last_row = (r.end - 1) / n;
  const int64_t lo = t.r0 > first_row ? t.r0 : first_row;
  const int64_t hi = t.r1 - 1 < last_row ? t.r1 - 1 : last_row;  // inclusive
  if (lo > hi) return false;                                     // no common row
  if (hi - lo >= 2) return true;  // a row strictly between first_row and last_row
  for (int64_t row = lo; row <= hi; ++row) {
    const int64_t a = row * n + t.c0, b = row * n + t.c1;  // the tile's part of the row
    if (a < r.end && b > r.begin) return true;
  }
  return false;
}

// A tile the range touches without owning it: its amax needs the other
// owners' partial amaxes.
QTX_HD constexpr bool TileCut(const ElementRange& r, int64_t m, int64_t n, int64_t ti, int64_t tj) {
  return TileTouched(r, m, n, ti, tj) && !TileOwned(r, m, n, ti, tj);
}

}  // namespace qtx::kernels

#endif  // QTX_KERNELS_ELEMENT_RANGE_H_
