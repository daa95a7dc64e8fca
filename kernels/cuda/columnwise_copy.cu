// The columnwise copy from the rowwise one (kernels/cuda/columnwise_copy.h).
//
// One CTA of 256 threads moves one 128x128-byte tile at a time (grid-stride
// over the tiles), so with BLOCK_2D a CTA's tile is exactly one scale tile and
// the CTA also writes that tile's columnwise scale (and, on the last tile row,
// the zero padding of its scale row): one launch for data and scales.
//
// Vector path (m, n multiples of 16, data 16-byte aligned): each thread loads
// 4 x 16 bytes of the tile's rows into shared memory, a [128][32] array of
// 32-bit words whose 4-word groups are XOR-swizzled by row / 16 so that the
// column reads below hit 32 distinct banks. Then thread (c, w) = (t % 8, t / 8)
// reads the 16 words of rows 16c..16c+15 at word column w, transposes that
// 16x4-byte block in registers (__byte_perm) and stores 4 x 16 bytes: output
// rows 4w..4w+3, bytes [16c, 16c + 16) of each; a warp writes 4 whole
// 128-byte output row segments.
// Checked path (any m, n, alignment): the same tiles, one byte per load and
// store, through a [128][129]-byte shared array.
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/block_geometry.h"
#include "kernels/cuda/columnwise_copy.h"
#include "kernels/cuda/device_fp8.cuh"
#include "kernels/quantize_params.h"

namespace qtx::kernels::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kTile = 128;  // == kBlockLen: one CTA tile is one 2-D scale tile

struct Args {
  const uint8_t* qr;
  const float* sr;
  uint8_t* qc;
  float* sc;
  int64_t m, n;
  int64_t mb, nb;            // tiles along m and n
  int64_t sr_cols, sc_cols;  // pitches of the scale matrices
  bool tensor;               // TENSOR: one scale, copied by tile 0
};

// The scales of tile (ti, tj): Sc[tj, ti] = Sr[ti, tj]; the last tile row also
// zeroes the padding columns [mb, sc_cols) of scale row tj.
__device__ __forceinline__ void CopyTileScale(const Args& a, int64_t ti, int64_t tj) {
  if (a.tensor) {
    if (ti == 0 && tj == 0 && threadIdx.x == 0) a.sc[0] = a.sr[0];
    return;
  }
  if (threadIdx.x == 0) a.sc[tj * a.sc_cols + ti] = a.sr[ti * a.sr_cols + tj];
  if (ti == a.mb - 1 && threadIdx.x >= 1 && threadIdx.x <= 3) {  // at most 3 padding entries
    const int64_t col = a.mb + threadIdx.x - 1;
    if (col < a.sc_cols) a.sc[tj * a.sc_cols + col] = 0.0f;
  }
}

__global__ void __launch_bounds__(kThreads) VectorKernel(Args a) {
  // Row r's 16-byte group q lives at words [4 * (q ^ (r / 16 % 8)), +4).
  __shared__ uint4 tile[kTile][kTile / 16];
  const int t = threadIdx.x;
  const int64_t tiles = a.mb * a.nb;
  for (int64_t id = blockIdx.x; id < tiles; id += gridDim.x) {
    const int64_t ti = id / a.nb, tj = id % a.nb;
    const int64_t m0 = ti * kTile, n0 = tj * kTile;
    // Load: 128 rows x 8 groups = 1024 groups, 4 per thread; a quarter warp reads one row.
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int g = k * kThreads + t;
      const int r = g / 8, q = g % 8;
      const int64_t row = m0 + r, col = n0 + 16 * q;
      uint4 v = make_uint4(0, 0, 0, 0);
      if (row < a.m && col < a.n) {
        v = *reinterpret_cast<const uint4*>(a.qr + row * a.n + col);
      }
      tile[r][q ^ ((r / 16) % 8)] = v;
    }
    __syncthreads();
    const int c = t % 8, w = t / 8;  // rows 16c..16c+15, word column w (bytes 4w..4w+3)
    const int64_t row_out = n0 + 4 * w, col_out = m0 + 16 * c;
    if (col_out < a.m) {
      uint32_t x[16];
#pragma unroll
      for (int k = 0; k < 16; ++k) {
        const int r = 16 * c + k;
        const uint32_t* words = reinterpret_cast<const uint32_t*>(&tile[r][(w / 4) ^ c]);
        x[k] = words[w % 4];
      }
      // out[b][kk]: byte b of x[4kk..4kk+3], i.e. output row 4w + b, bytes 4kk..4kk+3.
      uint32_t out[4][4];
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        const uint32_t t0 = __byte_perm(x[4 * kk], x[4 * kk + 1], 0x5140);
        const uint32_t t1 = __byte_perm(x[4 * kk + 2], x[4 * kk + 3], 0x5140);
        const uint32_t t2 = __byte_perm(x[4 * kk], x[4 * kk + 1], 0x7362);
        const uint32_t t3 = __byte_perm(x[4 * kk + 2], x[4 * kk + 3], 0x7362);
        out[0][kk] = __byte_perm(t0, t1, 0x5410);
        out[1][kk] = __byte_perm(t0, t1, 0x7632);
        out[2][kk] = __byte_perm(t2, t3, 0x5410);
        out[3][kk] = __byte_perm(t2, t3, 0x7632);
      }
#pragma unroll
      for (int b = 0; b < 4; ++b) {
        if (row_out + b < a.n) {
          *reinterpret_cast<uint4*>(a.qc + (row_out + b) * a.m + col_out) =
              make_uint4(out[b][0], out[b][1], out[b][2], out[b][3]);
        }
      }
    }
    CopyTileScale(a, ti, tj);
    __syncthreads();  // the tile is reused by the next iteration
  }
  if (tiles == 0 && blockIdx.x == 0) CopyTileScale(a, 0, 0);  // TENSOR of an empty tensor
}

__global__ void __launch_bounds__(kThreads) CheckedKernel(Args a) {
  __shared__ uint8_t tile[kTile][kTile + 1];
  const int t = threadIdx.x;
  const int64_t tiles = a.mb * a.nb;
  for (int64_t id = blockIdx.x; id < tiles; id += gridDim.x) {
    const int64_t ti = id / a.nb, tj = id % a.nb;
    const int64_t m0 = ti * kTile, n0 = tj * kTile;
    // A warp reads 32 consecutive bytes of one row, and writes 32 of one output row.
    for (int g = t; g < kTile * kTile; g += kThreads) {
      const int r = g / kTile, col = g % kTile;
      if (m0 + r < a.m && n0 + col < a.n) tile[r][col] = a.qr[(m0 + r) * a.n + n0 + col];
    }
    __syncthreads();
    for (int g = t; g < kTile * kTile; g += kThreads) {
      const int r = g / kTile, col = g % kTile;  // output row n0 + r, byte m0 + col
      if (n0 + r < a.n && m0 + col < a.m) a.qc[(n0 + r) * a.m + m0 + col] = tile[col][r];
    }
    CopyTileScale(a, ti, tj);
    __syncthreads();
  }
  if (tiles == 0 && blockIdx.x == 0) CopyTileScale(a, 0, 0);
}

bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

cudaError_t ColumnwiseFromRowwise(BlockScaling scaling, const QuantizedConstBuffers& in, int64_t m,
                                  int64_t n, const QuantizedBuffers& out, cudaStream_t stream) {
  if (scaling != BlockScaling::kBlock2D && scaling != BlockScaling::kTensor) {
    return cudaErrorInvalidValue;
  }
  if (m < 0 || n < 0 || (n > 0 && m > INT64_MAX / n)) return cudaErrorInvalidValue;
  const QuantizedLayout l = ComputeLayout(scaling, m, n);
  if (l.ColumnwiseScaleCount() > 0 &&
      (in.rowwise_scale_inv == nullptr || out.columnwise_scale_inv == nullptr)) {
    return cudaErrorInvalidValue;
  }
  const bool empty = m == 0 || n == 0;
  if (!empty && (in.rowwise_data == nullptr || out.columnwise_data == nullptr)) {
    return cudaErrorInvalidValue;
  }
  Args a;
  a.qr = in.rowwise_data;
  a.sr = in.rowwise_scale_inv;
  a.qc = out.columnwise_data;
  a.sc = out.columnwise_scale_inv;
  a.m = m;
  a.n = n;
  a.mb = CeilDiv(m, kTile);
  a.nb = CeilDiv(n, kTile);
  a.sr_cols = l.rowwise_scale_cols;
  a.sc_cols = l.columnwise_scale_cols;
  a.tensor = scaling == BlockScaling::kTensor;
  if (empty && !a.tensor) return cudaSuccess;  // 2-D: no tile, no scale entry
  int sms = 0;
  cudaError_t err = CurrentDeviceSmCount(&sms);
  if (err != cudaSuccess) return err;
  const int64_t tiles = a.mb * a.nb;
  const int64_t max_grid = static_cast<int64_t>(sms) * 8;
  const unsigned grid =
      static_cast<unsigned>(tiles == 0 ? 1 : (tiles < max_grid ? tiles : max_grid));
  const bool vector = m % 16 == 0 && n % 16 == 0 && Aligned16(a.qr) && Aligned16(a.qc);
  if (vector) {
    VectorKernel<<<grid, kThreads, 0, stream>>>(a);
  } else {
    CheckedKernel<<<grid, kThreads, 0, stream>>>(a);
  }
  return cudaGetLastError();
}

}  // namespace qtx::kernels::cuda
