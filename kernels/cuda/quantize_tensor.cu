// CUDA per-tensor current scaling (docs/numerics.md "Per-tensor current
// scaling"), bit-exact with kernels/cpu/quantize_tensor.cc. The scale needs
// the amax of the whole input, so the input is read twice; two launch paths:
// - OnePassTensorKernel (tensors of whole aligned 128x128 tiles; see
//   LaunchOnePass for when it applies): one cooperative launch. Phase 1 reads
//   every tile for the amax and keeps each CTA's first tiles in shared
//   memory; a grid barrier; phase 2 casts the tiles newest first (what the L2
//   still holds), the kept ones last, so that much of the second read never
//   reaches DRAM.
// - Two launches otherwise:
//   1. TensorAmaxKernel: a grid-stride max |x| (fmaxf ignores NaN, exactly
//      kernels/fp8.h AmaxUpdate); each CTA writes its partial amax to a
//      stream-ordered temporary. Max is order-independent, so the result does
//      not depend on the grid or the reduction tree.
//   2. A cast kernel: every CTA reduces the partials to the same amax,
//      computes the same scale with kernels/fp8.h TensorScale, and casts with
//      the shared cvt.rn.satfinite code (kernels/cuda/device_fp8.cuh); CTA 0
//      writes the scale_inv of each requested copy. Rowwise only:
//      RowCastKernel, a flat 8-elements-per-step pass (the layout of [M, N]
//      does not matter). With the columnwise copy: TileCastKernel, 128x128
//      tiles whose transposed bytes go through shared memory
//      (StoreTileCopies, shared with the one-pass kernel). The cast pass walks
//      the tensor from its end to its start while the amax pass walks it from
//      the start, so the cast first reads what the amax pass left in L2.
// The exact all-gather (kernels/cuda/quantize_shard.h) splits the two: its
// TensorAmax is pass 1 then ReduceAmaxKernel (one float on the device; pass 1
// alone, into that float, for a count one CTA covers), and
// its QuantizeTensorWithAmax is pass 2 with that (combined) amax as the one
// partial.
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "kernels/cuda/device_fp8.cuh"
#include "kernels/cuda/quantize_tensor.h"
#include "kernels/fp8.h"
#include "kernels/quantize_params.h"

namespace qtx::kernels::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kTile = 128;

template <InputDType D>
constexpr int kElemBytes = (D == InputDType::kFloat32) ? 4 : 2;

bool Aligned(const void* p, uintptr_t a) { return (reinterpret_cast<uintptr_t>(p) % a) == 0; }

// Max of non-negative `v` over the CTA, returned to every thread. `red` is
// kWarps floats of shared memory, free again on return.
__device__ __forceinline__ float BlockMax(float v, float* red) {
#pragma unroll
  for (int mask = 16; mask > 0; mask >>= 1) v = fmaxf(v, __shfl_xor_sync(0xFFFFFFFFu, v, mask));
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) red[warp] = v;
  __syncthreads();
  float r = red[0];
#pragma unroll
  for (int w = 1; w < kWarps; ++w) r = fmaxf(r, red[w]);
  __syncthreads();
  return r;
}

// |x| folded into a running amax; NaN ignored (fmaxf returns the other operand).
__device__ __forceinline__ float AbsMax(float amax, float x) { return fmaxf(amax, fabsf(x)); }

template <InputDType D>
__device__ __forceinline__ float LoadElem(const void* in, int64_t i) {
  if constexpr (D == InputDType::kFloat32) {
    return static_cast<const float*>(in)[i];
  } else {
    return ElemToFloat<D>(static_cast<const uint16_t*>(in)[i]);
  }
}

// The 16 / kElemBytes elements of one 16-byte word, as FP32.
template <InputDType D>
__device__ __forceinline__ void Unpack16(const uint4 w, float* x) {
  const uint32_t words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    if constexpr (D == InputDType::kFloat32) {
      x[j] = __uint_as_float(words[j]);
    } else if constexpr (D == InputDType::kBFloat16) {
      x[2 * j] = __uint_as_float(words[j] << 16);
      x[2 * j + 1] = __uint_as_float(words[j] & 0xFFFF0000u);
    } else {
      x[2 * j] = ElemToFloat<D>(words[j] & 0xFFFFu);
      x[2 * j + 1] = ElemToFloat<D>(words[j] >> 16);
    }
  }
}

// Eight consecutive elements starting at `p` (16-byte aligned) as FP32.
template <InputDType D>
__device__ __forceinline__ void Load8(const uint8_t* p, float (&x)[8]) {
  Unpack16<D>(*reinterpret_cast<const uint4*>(p), x);
  if constexpr (D == InputDType::kFloat32) {
    Unpack16<D>(*reinterpret_cast<const uint4*>(p + 16), x + 4);
  }
}

// ---- pass 1: amax ---------------------------------------------------------------

// Grid-stride over the input as 16-byte words (`vec`: input 16-byte aligned),
// then the elements past the last whole word; one partial amax per CTA.
template <InputDType D>
__global__ void __launch_bounds__(kThreads)
    TensorAmaxKernel(const void* in, int64_t count, bool vec, float* partials) {
  __shared__ float red[kWarps];
  constexpr int kPer = 16 / kElemBytes<D>;  // elements per 16-byte word
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  const int64_t g = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  float am = 0.0f;
  int64_t scalar_from = 0;
  if (vec) {
    const uint4* w = static_cast<const uint4*>(in);
    const int64_t words = count / kPer;
    int64_t i = g;
    for (; i + 3 * stride < words; i += 4 * stride) {
      uint4 v[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) v[u] = __ldg(w + i + u * stride);
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        float x[kPer];
        Unpack16<D>(v[u], x);
#pragma unroll
        for (int k = 0; k < kPer; ++k) am = AbsMax(am, x[k]);
      }
    }
    for (; i < words; i += stride) {
      float x[kPer];
      Unpack16<D>(__ldg(w + i), x);
#pragma unroll
      for (int k = 0; k < kPer; ++k) am = AbsMax(am, x[k]);
    }
    scalar_from = words * kPer;
  }
  for (int64_t e = scalar_from + g; e < count; e += stride) am = AbsMax(am, LoadElem<D>(in, e));
  am = BlockMax(am, red);
  if (threadIdx.x == 0) partials[blockIdx.x] = am;
}

// TensorAmax's last step: one CTA writes the max of the partial amaxes.
__global__ void __launch_bounds__(kThreads)
    ReduceAmaxKernel(const float* partials, int num_partials, float* amax) {
  __shared__ float red[kWarps];
  float am = 0.0f;
  for (int i = threadIdx.x; i < num_partials; i += kThreads) am = fmaxf(am, partials[i]);
  am = BlockMax(am, red);
  if (threadIdx.x == 0) amax[0] = am;
}

// ---- pass 2: cast ---------------------------------------------------------------

struct CastArgs {
  const void* input;
  uint8_t* qr;  // rowwise data [M, N] (null: not requested)
  float* sr;    // rowwise scale_inv[0] (null: not requested)
  uint8_t* qc;  // columnwise data [N, M] (null: not requested)
  float* sc;    // columnwise scale_inv[0] (null: not requested)
  int64_t m, n;
  const float* partials;
  int num_partials;
  bool pow2;
  float eps;
  // RowCastKernel: input 16-byte and qr 8-byte aligned (vector steps).
  bool vec;
  // TileCastKernel, for whole tiles: input rows start 16-byte aligned (16-byte
  // loads), qr rows 8-byte aligned (8-byte stores), qc rows 16-byte aligned
  // (16-byte stores).
  bool vec_in, vec_row, vec_col;
  int64_t full_mb, full_nb, mb, nb;  // TileCastKernel: tile grid, wholly-inside tiles
  // OnePassTensorKernel (benchmarks, TensorTuning::amax_phase_only): stop
  // after the scale, before phase 2.
  bool amax_only;
};

// Every CTA: the tensor's scale from the partial amaxes (identical in every
// CTA); CTA 0 stores scale_inv for each requested copy.
template <Fp8Format F>
__device__ __forceinline__ float TensorScaleFromPartials(const CastArgs& a, float* red) {
  float am = 0.0f;
  // Through the L2: the one-pass kernel wrote them during its own launch.
  for (int i = threadIdx.x; i < a.num_partials; i += kThreads) {
    am = fmaxf(am, __ldcg(a.partials + i));
  }
  am = BlockMax(am, red);
  const float scale = TensorScale(am, F, a.pow2, a.eps);
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    const float scale_inv = ScaleInv(scale);
    if (a.sr != nullptr) a.sr[0] = scale_inv;
    if (a.sc != nullptr) a.sc[0] = scale_inv;
  }
  return scale;
}

// Rowwise copy only: the [M, N] bytes are the elementwise cast of the flat
// input. Thread g takes 8-element chunks nchunks-1-g, nchunks-1-g-stride, ...
// (from the end); the elements after the last whole chunk go to CTA 0.
// Also launched (one CTA) for an empty tensor, to write the scale_inv.
template <InputDType D, Fp8Format F>
__global__ void __launch_bounds__(kThreads) RowCastKernel(const CastArgs a) {
  __shared__ float red[kWarps];
  const float scale = TensorScaleFromPartials<F>(a, red);
  if (a.qr == nullptr) return;
  const int64_t count = a.m * a.n;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  const int64_t g = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const uint8_t* in = static_cast<const uint8_t*>(a.input);
  int64_t scalar_from = 0;
  if (a.vec) {
    const int64_t chunks = count / 8;
    int64_t i = g;
    for (; i + 3 * stride < chunks; i += 4 * stride) {
      float x[4][8];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        Load8<D>(in + (chunks - 1 - (i + u * stride)) * 8 * kElemBytes<D>, x[u]);
      }
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        __stcs(reinterpret_cast<uint2*>(a.qr) + (chunks - 1 - (i + u * stride)),
               Quantize8<F>(x[u], scale));
      }
    }
    for (; i < chunks; i += stride) {
      float x[8];
      Load8<D>(in + (chunks - 1 - i) * 8 * kElemBytes<D>, x);
      __stcs(reinterpret_cast<uint2*>(a.qr) + (chunks - 1 - i), Quantize8<F>(x, scale));
    }
    scalar_from = chunks * 8;
  }
  for (int64_t e = scalar_from + g; e < count; e += stride) {
    a.qr[e] =
        static_cast<uint8_t>(Cvt2<F>(__fmul_rn(LoadElem<D>(a.input, e), scale), 0.0f) & 0xFFu);
  }
}

// The copies of one 128x128 tile at (m0, n0) from its elements `x` (thread
// (q, v) = (tid / 16, tid % 16) holds rows 8q..8q+7, columns 8v..8v+7): the
// rowwise bytes when kRow (each half warp writes its row's 128 bytes
// contiguously) and the columnwise bytes when kCol. Those go into a
// 128x128-byte transposed tile in shared memory `tsm` (16-byte units
// XOR-swizzled by (column / 8) % 8), from which every warp stores whole
// 128-byte rows of the [N, M] copy; the CTA synchronizes twice, so `tsm` is
// free again on return. `full`: the tile lies wholly inside the tensor (vector
// stores where vec_row / vec_col allow); edge tiles store element by element
// with bounds checks.
template <Fp8Format F, bool kRow, bool kCol>
__device__ __forceinline__ void StoreTileCopies(const CastArgs& a, const float (&x)[8][8],
                                                int64_t m0, int64_t n0, bool full, float scale,
                                                uint8_t* tsm) {
  const int tid = threadIdx.x;
  const int q = tid >> 4, v = tid & 15;
  const int64_t gm0 = m0 + 8 * q, gn0 = n0 + 8 * v;
  if constexpr (kRow) {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const uint2 b = Quantize8<F>(x[i], scale);
      uint8_t* row = a.qr + (gm0 + i) * a.n + gn0;
      if (full && a.vec_row) {
        __stcs(reinterpret_cast<uint2*>(row), b);
      } else if (gm0 + i < a.m) {
        const uint32_t words[2] = {b.x, b.y};
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          if (gn0 + j < a.n) row[j] = static_cast<uint8_t>(words[j >> 2] >> (8 * (j & 3)));
        }
      }
    }
  }
  if constexpr (kCol) {
    // Columnwise: column nl = 8v + j of the tile, bytes of rows 8q..8q+7.
    const int unit = q >> 1, half = q & 1;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      float col[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) col[i] = x[i][j];
      const int nl = 8 * v + j;
      *reinterpret_cast<uint2*>(tsm + nl * kTile + ((unit ^ (v & 7)) << 4) + (half << 3)) =
          Quantize8<F>(col, scale);
    }
    __syncthreads();
    const int u = tid & 7;  // 16-byte unit of the M run
#pragma unroll
    for (int p = 0; p < kTile / 32; ++p) {
      const int nl = p * 32 + (tid >> 3);
      const uint4 val =
          *reinterpret_cast<const uint4*>(tsm + nl * kTile + ((u ^ ((nl >> 3) & 7)) << 4));
      uint8_t* dst = a.qc + (n0 + nl) * a.m + m0 + 16 * u;
      if (full && a.vec_col) {
        __stcs(reinterpret_cast<uint4*>(dst), val);
      } else if (n0 + nl < a.n) {
        const uint32_t words[4] = {val.x, val.y, val.z, val.w};
#pragma unroll
        for (int b = 0; b < 16; ++b) {
          if (m0 + 16 * u + b < a.m) dst[b] = static_cast<uint8_t>(words[b >> 2] >> (8 * (b & 3)));
        }
      }
    }
    __syncthreads();  // tsm is rewritten by the next tile
  }
}

// With the columnwise copy (and the rowwise one when kRow): persistent CTAs
// over 128x128 tiles, tile t = T-1-blockIdx.x, T-1-blockIdx.x-gridDim.x, ...
// (from the end), each stored by StoreTileCopies. Whole tiles use vector loads
// where the rows are aligned for them (vec_in); edge tiles load element by
// element with bounds checks.
template <InputDType D, Fp8Format F, bool kRow>
__global__ void __launch_bounds__(kThreads, 3) TileCastKernel(const CastArgs a) {
  __shared__ float red[kWarps];
  __shared__ __align__(16) uint8_t tsm[kTile * kTile];
  const float scale = TensorScaleFromPartials<F>(a, red);
  const int tid = threadIdx.x;
  const int q = tid >> 4, v = tid & 15;
  const int64_t num_tiles = a.mb * a.nb;
  const uint8_t* in = static_cast<const uint8_t*>(a.input);
  for (int64_t k = blockIdx.x; k < num_tiles; k += gridDim.x) {
    const int64_t tile = num_tiles - 1 - k;
    const int64_t tm = tile / a.nb, tn = tile - tm * a.nb;
    const int64_t m0 = tm * kTile, n0 = tn * kTile;
    const bool full = tm < a.full_mb && tn < a.full_nb;
    const int64_t gm0 = m0 + 8 * q, gn0 = n0 + 8 * v;

    float x[8][8];
    if (full && a.vec_in) {
#pragma unroll
      for (int i = 0; i < 8; ++i) Load8<D>(in + ((gm0 + i) * a.n + gn0) * kElemBytes<D>, x[i]);
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) {
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const bool inside = gm0 + i < a.m && gn0 + j < a.n;
          x[i][j] = inside ? LoadElem<D>(a.input, (gm0 + i) * a.n + gn0 + j) : 0.0f;
        }
      }
    }
    StoreTileCopies<F, kRow, true>(a, x, m0, n0, full, scale, tsm);
  }
}

// ---- one pass over DRAM: amax and cast in one cooperative launch -------------

// For tensors of whole tiles (m and n multiples of 128, every row aligned for
// vector access): one cooperative launch of resident CTAs. Phase 1: CTA b
// reads its tiles b, b + G, ... (G = gridDim.x) for the amax and keeps the
// raw bytes of its first `keep` tiles in shared memory (the L2 holds the last
// ones read, so the two hold different tiles); partial amax, grid barrier, the
// tensor's scale. Phase 2: the CTA casts its tiles from the last to the
// first, the kept ones from shared memory, so that of the second read of the
// input only what neither holds comes from DRAM. Thread (q, v) keeps its own
// 16-byte words, at offset ((slot * kWords + w) * kThreads + tid) * 16: the
// thread that stores a word loads it back, so no barrier is needed there, and
// a warp's 32 words are contiguous (no bank conflicts).
// Each thread's words of a tile: 8 rows of 8 elements.
template <InputDType D>
constexpr int kTileWords = 8 * 8 * kElemBytes<D> / 16;

// Loads through the L2 only (`last_use`: marked to leave the L2 first).
template <InputDType D>
__device__ __forceinline__ void LoadTileWords(const uint8_t* in, const CastArgs& a, int64_t tile,
                                              bool last_use, uint4 (&w)[kTileWords<D>]) {
  constexpr int kPerRow = kTileWords<D> / 8;
  const int q = threadIdx.x >> 4, v = threadIdx.x & 15;
  const int64_t tm = tile / a.nb, tn = tile - tm * a.nb;
  const uint8_t* p = in + ((tm * kTile + 8 * q) * a.n + tn * kTile + 8 * v) * kElemBytes<D>;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
#pragma unroll
    for (int h = 0; h < kPerRow; ++h) {
      const uint4* src = reinterpret_cast<const uint4*>(p + i * a.n * kElemBytes<D>) + h;
      w[i * kPerRow + h] = last_use ? __ldcs(src) : __ldcg(src);
    }
  }
}

template <InputDType D>
__device__ __forceinline__ float TileWordsAmax(const uint4 (&w)[kTileWords<D>], float am) {
  constexpr int kPer = 16 / kElemBytes<D>;
#pragma unroll
  for (int k = 0; k < kTileWords<D>; ++k) {
    float x[kPer];
    Unpack16<D>(w[k], x);
#pragma unroll
    for (int e = 0; e < kPer; ++e) am = AbsMax(am, x[e]);
  }
  return am;
}

template <InputDType D, Fp8Format F, bool kRow, bool kCol>
__global__ void __launch_bounds__(kThreads, 2)
    OnePassTensorKernel(const CastArgs a, float* partials, int keep) {
  extern __shared__ __align__(16) uint8_t dyn[];  // keep tiles' words, then tsm (kCol)
  __shared__ float red[kWarps];
  constexpr int kW = kTileWords<D>;
  uint4* kept = reinterpret_cast<uint4*>(dyn);
  uint8_t* tsm = dyn + static_cast<size_t>(keep) * kW * kThreads * 16;
  const int tid = threadIdx.x;
  const int64_t tiles = a.mb * a.nb, G = gridDim.x, b = blockIdx.x;
  const int64_t cnt = b < tiles ? (tiles - 1 - b) / G + 1 : 0;
  const int64_t kept_n = cnt < keep ? cnt : keep;  // tiles 0 .. kept_n-1 of the CTA are kept
  const uint8_t* in = static_cast<const uint8_t*>(a.input);

  // Phase 1. Two tiles a step (2-byte input) for twice the loads in flight.
  constexpr int kStep = kElemBytes<D> == 2 ? 2 : 1;
  auto keep_tile = [&](int64_t k, const uint4(&w)[kW]) {
    if (k < kept_n) {
      uint4* slot = kept + k * kW * kThreads + tid;
#pragma unroll
      for (int i = 0; i < kW; ++i) slot[i * kThreads] = w[i];
    }
  };
  float am = 0.0f;
  int64_t k = 0;
  for (; k + kStep <= cnt; k += kStep) {
    uint4 w[kStep][kW];
#pragma unroll
    for (int u = 0; u < kStep; ++u) LoadTileWords<D>(in, a, b + (k + u) * G, false, w[u]);
#pragma unroll
    for (int u = 0; u < kStep; ++u) {
      am = TileWordsAmax<D>(w[u], am);
      keep_tile(k + u, w[u]);
    }
  }
  for (; k < cnt; ++k) {
    uint4 w[kW];
    LoadTileWords<D>(in, a, b + k * G, false, w);
    am = TileWordsAmax<D>(w, am);
    keep_tile(k, w);
  }
  am = BlockMax(am, red);
  if (tid == 0) partials[b] = am;
  cooperative_groups::this_grid().sync();
  const float scale = TensorScaleFromPartials<F>(a, red);
  if (a.amax_only) return;

  // Phase 2, from the CTA's last tile to its first: the tiles read most
  // recently first (the L2 may still hold them; they are read for the last
  // time, so marked to leave it first), the kept ones last. With 2-byte
  // input, the words of the next tile that comes from the input are loaded
  // before the current tile is stored, so that its loads overlap the stores
  // (FP32: too many registers).
  constexpr bool kPre = kElemBytes<D> == 2;
  uint4 pre[kPre ? kW : 1];
  if constexpr (kPre) {
    if (cnt - 1 >= kept_n) LoadTileWords<D>(in, a, b + (cnt - 1) * G, true, pre);
  }
  for (int64_t j = cnt - 1; j >= 0; --j) {
    const int64_t tile = b + j * G;
    const int64_t tm = tile / a.nb, tn = tile - tm * a.nb;
    uint4 w[kW];
    if (j < kept_n) {
      const uint4* slot = kept + j * kW * kThreads + tid;
#pragma unroll
      for (int i = 0; i < kW; ++i) w[i] = slot[i * kThreads];
    } else if constexpr (kPre) {
#pragma unroll
      for (int i = 0; i < kW; ++i) w[i] = pre[i];
    } else {
      LoadTileWords<D>(in, a, tile, true, w);
    }
    if constexpr (kPre) {
      if (j - 1 >= kept_n) LoadTileWords<D>(in, a, tile - G, true, pre);
    }
    float x[8][8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
#pragma unroll
      for (int h = 0; h < kW / 8; ++h) {
        Unpack16<D>(w[i * (kW / 8) + h], x[i] + h * (16 / kElemBytes<D>));
      }
    }
    StoreTileCopies<F, kRow, kCol>(a, x, tm * kTile, tn * kTile, true, scale, tsm);
  }
}

// ---- launch helpers -------------------------------------------------------------

constexpr int kMaxDevices = 64;

// CTAs of `kernel` (kThreads threads, static shared memory only) that fit on
// the device at once: sms * blocks per SM, cached in `cache` (one array per
// kernel instantiation, indexed by device). The cast passes launch exactly
// this many (or fewer), so that every CTA is resident and the pass sweeps the
// tensor in one front, from its end.
template <typename Kernel>
cudaError_t ResidentCtas(Kernel kernel, int sms, std::atomic<int>* cache, int64_t* resident) {
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return err;
  const bool cached = dev >= 0 && dev < kMaxDevices;
  int per_sm = cached ? cache[dev].load(std::memory_order_relaxed) : 0;
  if (per_sm == 0) {
    err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, 0);
    if (err != cudaSuccess) return err;
    if (per_sm < 1) per_sm = 1;
    if (cached) cache[dev].store(per_sm, std::memory_order_relaxed);
  }
  *resident = int64_t{sms} * per_sm;
  return cudaSuccess;
}

int GridFor(int64_t work, int64_t resident) {
  return static_cast<int>(work < resident ? (work > 0 ? work : 1) : resident);
}

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// ---- dequantize -------------------------------------------------------------------

struct DequantArgs {
  const uint8_t* q;
  const float* s;  // the one scale_inv
  void* out;
  int64_t m, n;
  Fp8Format format;
};

template <InputDType OutD>
__global__ void __launch_bounds__(256) DequantizeTensorRowwiseKernel(const DequantArgs a) {
  const float s = a.s[0];
  const int64_t total = a.m * a.n;
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    StoreOut<OutD>(a.out, idx, Dequant1(a.q[idx], s, a.format));
  }
}

// [N, M] bytes back to [M, N] (DequantizeColumnwiseTiles), with the one scale.
template <InputDType OutD>
__global__ void __launch_bounds__(256) DequantizeTensorColumnwiseKernel(const DequantArgs a) {
  const float s = a.s[0];
  DequantizeColumnwiseTiles<OutD>(a.q, a.m, a.n, a.format, a.out,
                                  [s](int64_t, int64_t) { return s; });
}

}  // namespace

namespace {

// The one-pass launch of OnePassTensorKernel<D, F, kRow, kCol> for `a` (whole
// tiles, vector-aligned), or *launched = false (and no error) when it does not
// apply: the device has no cooperative launch, the stream is being captured (a
// graph may be replayed on any stream; the two-pass launch has no such
// limit), shared memory holds no tile next to the transpose buffer, the
// columnwise copy is requested for more than kOnePassMaxTilesPerKept tiles per
// tile that shared memory keeps (unless `force`), or the cooperative launch is
// refused as too large (fewer SMs than the occupancy query counted, as under
// an MPS limit).
//
// kOnePassMaxTilesPerKept: with the columnwise copy, the one launch (two CTAs
// an SM) moves its bytes at a lower rate than the two launches do (the amax
// pass runs 8 CTAs an SM, the cast pass 3), which the reuse of the input
// repays only while shared memory and the L2 hold a large enough part of it.
// On the H200 (BF16, 3 tiles kept a CTA, 264 CTAs), session 12's run 3
// (bench/results/current_scaling_h200_session12_2026-12-02.md) measured the one
// launch at 1.23x the two at 4096^2 (1024 tiles), 1.05x at 8192^2 (4096
// tiles, 5.2 per kept tile) and 0.98x at 16384x7168 and 32768x4096 (7168 and
// 8192 tiles: 9.1 and 10.3 per kept tile). The rowwise-only launch was faster
// on every shape (1.03-1.30x), so it has no limit.
constexpr int64_t kOnePassMaxTilesPerKept = 6;

// The one launch's dynamic shared memory: `keep` tiles of input, then the
// transposed byte tile when the columnwise copy is written.
template <InputDType D>
constexpr int64_t kOnePassTileBytes = int64_t{kTile} * kTile* kElemBytes<D>;
template <bool kCol>
constexpr int64_t kOnePassTsm = kCol ? int64_t{kTile} * kTile : 0;
template <InputDType D, bool kCol>
size_t OnePassSmem(int64_t keep) {
  return static_cast<size_t>(keep * kOnePassTileBytes<D> + kOnePassTsm<kCol>);
}

template <InputDType D, Fp8Format F, bool kRow, bool kCol>
cudaError_t LaunchOnePass(CastArgs a, int sms, bool force, cudaStream_t stream, bool* launched) {
  *launched = false;
  auto kernel = OnePassTensorKernel<D, F, kRow, kCol>;
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return e;
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  e = cudaStreamIsCapturing(stream, &capture);
  if (e != cudaSuccess || capture != cudaStreamCaptureStatusNone) return e;
  // Per device, found once: keep (tiles kept a CTA) and per_sm (resident CTAs
  // an SM with that shared memory), packed as keep * 65536 + per_sm; -1: the
  // one launch does not apply on the device.
  static std::atomic<int64_t> plans[kMaxDevices];
  const bool cached = dev >= 0 && dev < kMaxDevices;
  int64_t plan = cached ? plans[dev].load(std::memory_order_relaxed) : 0;
  if (plan == 0) {
    int coop = 0, smem_sm = 0, smem_optin = 0, reserved = 0;
    e = cudaDeviceGetAttribute(&coop, cudaDevAttrCooperativeLaunch, dev);
    if (e == cudaSuccess) {
      e = cudaDeviceGetAttribute(&smem_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, dev);
    }
    if (e == cudaSuccess) {
      e = cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
    }
    if (e == cudaSuccess) {
      e = cudaDeviceGetAttribute(&reserved, cudaDevAttrReservedSharedMemoryPerBlock, dev);
    }
    if (e != cudaSuccess) return e;
    // Two CTAs an SM: each gets half the SM's shared memory, less the per-CTA
    // reserve and the static part.
    int64_t budget = smem_sm / 2 - reserved - 64;
    if (budget > smem_optin) budget = smem_optin;
    const int64_t keep = (budget - kOnePassTsm<kCol>) / kOnePassTileBytes<D>;
    int per_sm = 0;
    if (coop != 0 && keep >= 1) {
      e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               static_cast<int>(OnePassSmem<D, kCol>(keep)));
      if (e == cudaSuccess) {
        e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads,
                                                          OnePassSmem<D, kCol>(keep));
      }
      if (e != cudaSuccess) return e;
    }
    plan = (coop != 0 && keep >= 1 && per_sm >= 1) ? keep * 65536 + per_sm : -1;
    if (cached) plans[dev].store(plan, std::memory_order_relaxed);
  }
  if (plan < 0) return cudaSuccess;
  const int keep = static_cast<int>(plan / 65536), per_sm = static_cast<int>(plan % 65536);
  const size_t dyn = OnePassSmem<D, kCol>(keep);
  const int64_t resident = int64_t{sms} * per_sm;
  if (kCol && !force && a.mb * a.nb > kOnePassMaxTilesPerKept * resident * keep) {
    return cudaSuccess;
  }
  const int grid = GridFor(a.mb * a.nb, resident);
  float* partials = nullptr;
  e = cudaMallocAsync(reinterpret_cast<void**>(&partials), sizeof(float) * grid, stream);
  if (e != cudaSuccess) return e;
  a.partials = partials;
  a.num_partials = grid;
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(grid);
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = dyn;
  cfg.stream = stream;
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeCooperative;
  attr.val.cooperative = 1;
  cfg.attrs = &attr;
  cfg.numAttrs = 1;
  e = cudaLaunchKernelEx(&cfg, kernel, a, partials, keep);
  if (e == cudaErrorCooperativeLaunchTooLarge) {
    (void)cudaGetLastError();  // not sticky: clear it and take the two-pass launch
    e = cudaSuccess;
  } else if (e == cudaSuccess) {
    *launched = true;
  }
  const cudaError_t f = cudaFreeAsync(partials, stream);
  return e != cudaSuccess ? e : f;
}

// The checks of QuantizeTensor's arguments (quantize_tensor.h) and the
// CastArgs of the requested copies, less the amax source and the launch path's
// alignment flags; *sms = the current device's SM count.
cudaError_t PrepareCast(const void* input, int64_t m, int64_t n, const QuantizeParams& params,
                        const QuantizedBuffers& out, CastArgs* a, int* sms) {
  if (m < 0 || n < 0) return cudaErrorInvalidValue;
  if (n > 0 && m > INT64_MAX / n) return cudaErrorInvalidValue;
  if (!(params.amax_epsilon >= 0.0f) || std::isinf(params.amax_epsilon)) {
    return cudaErrorInvalidValue;
  }
  if (!params.rowwise && !params.columnwise) return cudaErrorInvalidValue;
  const int64_t count = m * n;
  if (params.rowwise &&
      (out.rowwise_scale_inv == nullptr || (count > 0 && out.rowwise_data == nullptr))) {
    return cudaErrorInvalidValue;
  }
  if (params.columnwise &&
      (out.columnwise_scale_inv == nullptr || (count > 0 && out.columnwise_data == nullptr))) {
    return cudaErrorInvalidValue;
  }
  if (count > 0 && input == nullptr) return cudaErrorInvalidValue;
  *a = CastArgs{};
  a->input = input;
  a->qr = params.rowwise ? out.rowwise_data : nullptr;
  a->sr = params.rowwise ? out.rowwise_scale_inv : nullptr;
  a->qc = params.columnwise ? out.columnwise_data : nullptr;
  a->sc = params.columnwise ? out.columnwise_scale_inv : nullptr;
  a->m = m;
  a->n = n;
  a->pow2 = params.force_pow2_scales;
  a->eps = params.amax_epsilon;
  a->mb = CeilDiv(m, kTile);
  a->nb = CeilDiv(n, kTile);
  a->full_mb = m / kTile;
  a->full_nb = n / kTile;
  return CurrentDeviceSmCount(sms);
}

// Pass 1 gives each thread at least this many elements: a count of at most
// kThreads * kAmaxPerThread is one CTA's.
constexpr int64_t kAmaxPerThread = 32;

// ResidentCtas's cache for TensorAmaxKernel<D>.
template <InputDType D>
std::atomic<int> amax_resident[kMaxDevices];

// Pass 1 (TensorAmaxKernel, at least about kAmaxPerThread elements a thread, every CTA
// resident) into a stream-ordered temporary of per-CTA partial amaxes, then
// next(partials, num_partials) (the launches that read them), then the
// temporary's release on the stream. Returns the first error.
template <InputDType D, typename Next>
cudaError_t WithPartialAmaxes(const void* input, int64_t count, int sms, cudaStream_t stream,
                              Next&& next) {
  int64_t resident = 0;
  cudaError_t e = ResidentCtas(TensorAmaxKernel<D>, sms, amax_resident<D>, &resident);
  if (e != cudaSuccess) return e;
  const int grid = GridFor(CeilDiv(count, kThreads * kAmaxPerThread), resident);
  float* partials = nullptr;
  e = cudaMallocAsync(reinterpret_cast<void**>(&partials), sizeof(float) * grid, stream);
  if (e != cudaSuccess) return e;
  TensorAmaxKernel<D><<<grid, kThreads, 0, stream>>>(input, count, Aligned(input, 16), partials);
  e = cudaGetLastError();
  if (e == cudaSuccess) e = next(static_cast<const float*>(partials), grid);
  const cudaError_t f = cudaFreeAsync(partials, stream);
  return e != cudaSuccess ? e : f;
}

// Pass 2 for `a`, whose partials / num_partials are set: the one-CTA
// RowCastKernel that only writes the scale_inv for an empty tensor;
// RowCastKernel for the rowwise copy alone; TileCastKernel with the columnwise
// copy. The vector paths are taken where the pointers (and, for the tiles,
// the row pitches) are aligned for them.
template <InputDType D, Fp8Format F>
cudaError_t LaunchCast(CastArgs a, int sms, cudaStream_t stream) {
  static std::atomic<int> row_cache[kMaxDevices];
  static std::atomic<int> tile_cache[2][kMaxDevices];
  const int64_t count = a.m * a.n;
  int64_t resident = 0;
  cudaError_t e = cudaSuccess;
  if (count == 0) {
    a.vec = false;
    RowCastKernel<D, F><<<1, kThreads, 0, stream>>>(a);
  } else if (a.qc == nullptr) {
    a.vec = Aligned(a.input, 16) && Aligned(a.qr, 8);
    e = ResidentCtas(RowCastKernel<D, F>, sms, row_cache, &resident);
    if (e != cudaSuccess) return e;
    const int grid = GridFor(CeilDiv(count, int64_t{kThreads} * 8 * 4), resident);
    RowCastKernel<D, F><<<grid, kThreads, 0, stream>>>(a);
  } else {
    a.vec_in = Aligned(a.input, 16) && (a.n * kElemBytes<D>) % 16 == 0;
    a.vec_row = a.qr != nullptr && Aligned(a.qr, 8) && a.n % 8 == 0;
    a.vec_col = Aligned(a.qc, 16) && a.m % 16 == 0;
    const int64_t tiles = a.mb * a.nb;
    if (a.qr != nullptr) {
      e = ResidentCtas(TileCastKernel<D, F, true>, sms, tile_cache[1], &resident);
      if (e != cudaSuccess) return e;
      TileCastKernel<D, F, true><<<GridFor(tiles, resident), kThreads, 0, stream>>>(a);
    } else {
      e = ResidentCtas(TileCastKernel<D, F, false>, sms, tile_cache[0], &resident);
      if (e != cudaSuccess) return e;
      TileCastKernel<D, F, false><<<GridFor(tiles, resident), kThreads, 0, stream>>>(a);
    }
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t QuantizeTensor(const void* input, InputDType dtype, int64_t m, int64_t n,
                           const QuantizeParams& params, const QuantizedBuffers& out,
                           cudaStream_t stream) {
  return detail::QuantizeTensorTuned(input, dtype, m, n, params, out, {}, stream);
}

cudaError_t TensorAmax(const void* input, InputDType dtype, int64_t count, float* amax,
                       cudaStream_t stream) {
  if (count < 0 || amax == nullptr || (count > 0 && input == nullptr)) {
    return cudaErrorInvalidValue;
  }
  int sms = 0;
  const cudaError_t err = CurrentDeviceSmCount(&sms);
  if (err != cudaSuccess) return err;
  return WithDType(dtype, [&](auto dt) {
    constexpr InputDType D = decltype(dt)::value;
    if (count <= kThreads * kAmaxPerThread) {
      // WithPartialAmaxes would launch one CTA: its one partial is the amax,
      // with no temporary and no reduction (a small shard's TENSOR AllGather).
      TensorAmaxKernel<D><<<1, kThreads, 0, stream>>>(input, count, Aligned(input, 16), amax);
      return cudaGetLastError();
    }
    return WithPartialAmaxes<D>(input, count, sms, stream, [&](const float* partials, int num) {
      ReduceAmaxKernel<<<1, kThreads, 0, stream>>>(partials, num, amax);
      return cudaGetLastError();
    });
  });
}

cudaError_t QuantizeTensorWithAmax(const void* input, InputDType dtype, int64_t m, int64_t n,
                                   const float* amax, const QuantizeParams& params,
                                   const QuantizedBuffers& out, cudaStream_t stream) {
  if (amax == nullptr) return cudaErrorInvalidValue;
  CastArgs a;
  int sms = 0;
  if (const cudaError_t err = PrepareCast(input, m, n, params, out, &a, &sms); err != cudaSuccess) {
    return err;
  }
  a.partials = amax;
  a.num_partials = 1;
  return WithDType(dtype, [&](auto dt) {
    return WithFormat(params.format, [&](auto ft) {
      return LaunchCast<decltype(dt)::value, decltype(ft)::value>(a, sms, stream);
    });
  });
}

namespace detail {

cudaError_t QuantizeTensorTuned(const void* input, InputDType dtype, int64_t m, int64_t n,
                                const QuantizeParams& params, const QuantizedBuffers& out,
                                const TensorTuning& tuning, cudaStream_t stream) {
  if (tuning.one_pass_taken != nullptr) *tuning.one_pass_taken = false;
  CastArgs a;
  int sms = 0;
  if (const cudaError_t err = PrepareCast(input, m, n, params, out, &a, &sms); err != cudaSuccess) {
    return err;
  }
  const int64_t count = m * n;

  return WithDType(dtype, [&](auto dt) {
    return WithFormat(params.format, [&](auto ft) -> cudaError_t {
      constexpr InputDType D = decltype(dt)::value;
      constexpr Fp8Format F = decltype(ft)::value;
      // One pass over DRAM where the tensor is whole, aligned tiles.
      const bool whole_tiles = m % kTile == 0 && n % kTile == 0 && Aligned(input, 16) &&
                               (!params.rowwise || Aligned(a.qr, 8)) &&
                               (!params.columnwise || Aligned(a.qc, 16));
      if (tuning.amax_phase_only && (count == 0 || !whole_tiles || tuning.two_pass)) {
        return cudaErrorNotSupported;
      }
      if (count == 0) {  // nothing to cast: the scale_inv of amax 0
        a.partials = nullptr;
        a.num_partials = 0;
        return LaunchCast<D, F>(a, sms, stream);
      }
      if (whole_tiles && !tuning.two_pass) {
        a.vec_in = a.vec_row = a.vec_col = true;
        a.amax_only = tuning.amax_phase_only;
        bool launched = false;
        cudaError_t e1 = cudaSuccess;
        const bool force = tuning.force_one_pass;
        if (params.rowwise && params.columnwise) {
          e1 = LaunchOnePass<D, F, true, true>(a, sms, force, stream, &launched);
        } else if (params.rowwise) {
          e1 = LaunchOnePass<D, F, true, false>(a, sms, force, stream, &launched);
        } else {
          e1 = LaunchOnePass<D, F, false, true>(a, sms, force, stream, &launched);
        }
        if (tuning.one_pass_taken != nullptr) *tuning.one_pass_taken = launched;
        if (e1 != cudaSuccess || launched) return e1;
        if (tuning.amax_phase_only) return cudaErrorNotSupported;
      }
      return WithPartialAmaxes<D>(input, count, sms, stream,
                                  [&](const float* partials, int num_partials) {
                                    a.partials = partials;
                                    a.num_partials = num_partials;
                                    return LaunchCast<D, F>(a, sms, stream);
                                  });
    });
  });
}

}  // namespace detail

cudaError_t DequantizeTensor(const QuantizedConstBuffers& in, Fp8Format format, int64_t m,
                             int64_t n, bool use_rowwise, InputDType out_dtype, void* out,
                             cudaStream_t stream) {
  if (m < 0 || n < 0) return cudaErrorInvalidValue;
  if (n > 0 && m > INT64_MAX / n) return cudaErrorInvalidValue;
  if (format != Fp8Format::kE4M3 && format != Fp8Format::kE5M2) return cudaErrorInvalidValue;
  if (m == 0 || n == 0) {
    return WithDType(out_dtype, [](auto) { return cudaSuccess; });
  }
  DequantArgs a;
  a.q = use_rowwise ? in.rowwise_data : in.columnwise_data;
  a.s = use_rowwise ? in.rowwise_scale_inv : in.columnwise_scale_inv;
  if (a.q == nullptr || a.s == nullptr || out == nullptr) return cudaErrorInvalidValue;
  a.out = out;
  a.m = m;
  a.n = n;
  a.format = format;
  int sms = 0;
  cudaError_t err = CurrentDeviceSmCount(&sms);
  if (err != cudaSuccess) return err;
  const int64_t max_grid = static_cast<int64_t>(sms) * 8;
  return WithDType(out_dtype, [&](auto dt) {
    constexpr InputDType OutD = decltype(dt)::value;
    if (use_rowwise) {
      const int64_t blocks = CeilDiv(m * n, 256);
      DequantizeTensorRowwiseKernel<OutD>
          <<<static_cast<int>(blocks < max_grid ? blocks : max_grid), 256, 0, stream>>>(a);
    } else {
      const int64_t tiles = CeilDiv(m, 32) * CeilDiv(n, 32);
      DequantizeTensorColumnwiseKernel<OutD>
          <<<static_cast<int>(tiles < max_grid ? tiles : max_grid), 256, 0, stream>>>(a);
    }
    return cudaGetLastError();
  });
}

}  // namespace qtx::kernels::cuda
