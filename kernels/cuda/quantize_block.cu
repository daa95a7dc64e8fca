// CUDA block-scaled FP8 quantize / dequantize (docs/numerics.md §2-§4), bit-exact
// with kernels/cpu/quantize_block.cc. Scale math comes from kernels/fp8.h
// (ComputeScale / ScaleInv: IEEE division, never fast-math; pow2 scales by
// ComputeScalePow2 / ScaleInvPow2, the same bits without a division); the FP32 -> FP8
// cast is the hardware cvt.rn.satfinite, which equals EncodeFp8 bit for bit
// (tests/kernels/cuda prove it over every BF16 and every FP32 pattern).
#include <cuda_runtime.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <mutex>
#include <type_traits>
#include <unordered_map>
#include <vector>

#include "kernels/block_geometry.h"
#include "kernels/cuda/device_fp8.cuh"
#include "kernels/cuda/quantize_block.h"
#include "kernels/cuda/quantize_tensor.h"
#include "kernels/fp8.h"
#include "kernels/quantize_params.h"

namespace qtx::kernels::cuda {
namespace {

constexpr int kTile = 128;  // block edge (docs/numerics.md §3)
// 16 x 16 threads, each owns an 8x8 sub-tile. More threads per SM measured
// slower on the H200: 4x8 sub-tiles in 512-thread CTAs, and 3 CTAs per SM at
// 80 registers, ran 47 % / 10 % more instructions with longer barrier waits
// (bench/results/session20_h200_2026-12-03.md).
constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
// A launch's unit of work is kRows x 128 input elements: whole 128x128 tiles
// (kRows = kTile), or for the 1-D rowwise copy alone optionally half tiles
// (kRows = 64, LaunchTuning::half_tiles), whose 1x128 blocks lie wholly inside
// them. A CTA has two threads per unit row (each owns an 8x8 sub-tile).
template <int kRows>
constexpr int kThreadsFor = 2 * kRows;
constexpr int kTBytes = kTile * kTile;  // transposed FP8 tile in shared memory

template <InputDType D>
constexpr int kElemBytes = (D == InputDType::kFloat32) ? 4 : 2;

// ---- small device helpers -----------------------------------------------------

__device__ __forceinline__ uint32_t SmemAddr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void CpAsync16(void* smem_dst, const void* gmem_src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(SmemAddr(smem_dst)),
               "l"(gmem_src));
}
__device__ __forceinline__ void CpAsyncCommit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// ---- the fused quantize kernel ------------------------------------------------

struct QuantizeArgs {
  const void* input;
  uint8_t* qr;  // rowwise data [M, N]
  float* sr;    // rowwise scale_inv
  uint8_t* qc;  // columnwise data [N, M]
  float* sc;    // columnwise scale_inv
  int64_t m, n;
  int64_t mb, nb, num_tiles;   // unit rows (kRows high), unit columns, units
  int64_t sr_pitch, sc_pitch;  // row pitch (elements) of the scale matrices
  float fp8_max, eps, value_for_inf;
  bool pow2;
  bool fast_pow2;            // pow2 scales by ComputeScalePow2 / ScaleInvPow2 (the same bits)
  bool stream_stores;        // st.global.cs (evict-first) for the FP8 outputs
  int64_t full_mb, full_nb;  // units [0, full_mb) x [0, full_nb) lie wholly inside
  bool col_vec;              // columnwise rows start 16-byte aligned (M % 16 == 0, aligned qc)
  uint32_t* tile_counter;    // this stream's tile counter (0 between launches), or null
};

// A block's scale and the stored scale_inv (docs/numerics.md §2). Pow2 scales
// take the exponent arithmetic of ComputeScalePow2 / ScaleInvPow2, which give
// ComputeScale's and ScaleInv's bits without a division or a reciprocal.
__device__ __forceinline__ float BlockScale(const QuantizeArgs& a, float amax) {
  return a.fast_pow2 ? ComputeScalePow2(amax, a.fp8_max, a.eps, a.value_for_inf)
                     : ComputeScale(amax, a.fp8_max, a.pow2, a.eps, a.value_for_inf);
}
__device__ __forceinline__ float BlockScaleInv(const QuantizeArgs& a, float scale) {
  return a.fast_pow2 ? ScaleInvPow2(scale) : ScaleInv(scale);
}

// How a launch loads and stores its tiles.
constexpr int kPathTail = 0;     // every tile bounds-checked, synchronous loads
constexpr int kPathAligned = 1;  // M, N multiples of 128: every tile pipelined
constexpr int kPathMixed = 2;    // whole tiles pipelined, the edge tiles checked

template <InputDType D, BlockScaling S, bool kRow, bool kCol, int kStages, int kRows = kTile>
struct SmemPlan {
  static constexpr int kStageBytes = kRows * kTile * kElemBytes<D>;
  // The transposed FP8 tile lives in the stage just consumed (see the kernel).
  static_assert(!kCol || kStageBytes >= kTBytes, "transposed tile must fit in a stage");
  static constexpr int kRedOffset = kStages * kStageBytes;
  static constexpr int kRedSize =
      (S == BlockScaling::kBlock2D) ? kWarps * 4 : (kCol ? kWarps * kTile * 4 : 0);
  static constexpr int kColScaleOffset = kRedOffset + kRedSize;
  static constexpr int kColScaleSize = (S == BlockScaling::kBlock1D && kCol) ? kTile * 4 : 0;
  static constexpr int kBytes = kColScaleOffset + kColScaleSize;
};

// Row-major tile order. Tile counts fit in 32 bits (checked by the launcher),
// so this is one 32-bit division.
__device__ __forceinline__ void TileCoords(const QuantizeArgs& a, uint32_t tile, int64_t* tm,
                                           int64_t* tn) {
  const uint32_t nb = static_cast<uint32_t>(a.nb);
  const uint32_t r = tile / nb;
  *tm = r;
  *tn = tile - r * nb;
}

template <typename T>
__device__ __forceinline__ void StoreFp8(T* p, T v, bool streaming) {
  if (streaming) {
    __stcs(p, v);
  } else {
    *p = v;
  }
}

// |x| folded into a running amax: fmaxf ignores a NaN operand, so this is
// exactly AmaxUpdate of kernels/fp8.h (docs/numerics.md §2 step 1) in one FMNMX.
__device__ __forceinline__ float AbsMax(float amax, float x) { return fmaxf(amax, fabsf(x)); }

// The larger of two packed pairs of BF16 / FP16 values, half by half. Like fmaxf,
// max.bf16x2 / max.f16x2 return the other operand when one is NaN (NaN only when
// both are); no flushing of subnormals. With the sign bits cleared (|x|) the
// pairs are two amax steps in one instruction.
template <InputDType D>
__device__ __forceinline__ uint32_t Max2(uint32_t p, uint32_t q) {
  static_assert(D != InputDType::kFloat32, "packed pairs are 16-bit elements");
  uint32_t r;
  if constexpr (D == InputDType::kBFloat16) {
    asm("max.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(p), "r"(q));
  } else {
    asm("max.f16x2 %0, %1, %2;" : "=r"(r) : "r"(p), "r"(q));
  }
  return r;
}

// The larger half of a packed pair as FP32, never NaN: a pair of NaNs (a row or
// column of NaNs only) gives 0, as AmaxUpdate's running amax from 0 does.
template <InputDType D>
__device__ __forceinline__ float PairMax(uint32_t p) {
  return fmaxf(0.0f, fmaxf(ElemToFloat<D>(p & 0xFFFFu), ElemToFloat<D>(p >> 16)));
}

// Aligned path: starts the asynchronous copy of one full input unit into a
// shared-memory stage (row-major, kRows rows of 128 elements; each warp copies
// two whole rows per step, 16 bytes a lane).
template <InputDType D, int kRows = kTile>
__device__ __forceinline__ void IssueTileCopy(uint8_t* stage, const QuantizeArgs& a,
                                              uint32_t tile) {
  constexpr int kCtaThreads = kThreadsFor<kRows>;
  constexpr int kRowBytes = kTile * kElemBytes<D>;
  constexpr int kChunksPerRow = kRowBytes / 16;
  constexpr int kChunks = kRows * kChunksPerRow;
  static_assert(kChunks % kCtaThreads == 0, "tile copy must divide evenly among threads");
  int64_t tm, tn;
  TileCoords(a, tile, &tm, &tn);
  const int64_t pitch = a.n * kElemBytes<D>;
  constexpr int kRowsPerStep = kCtaThreads / kChunksPerRow;
  const int r = static_cast<int>(threadIdx.x) / kChunksPerRow;
  const int ch = static_cast<int>(threadIdx.x) % kChunksPerRow;
  const uint8_t* src = static_cast<const uint8_t*>(a.input) + (tm * kRows + r) * pitch +
                       (tn * kTile) * kElemBytes<D> + ch * 16;
  uint8_t* dst = stage + r * kRowBytes + ch * 16;
#pragma unroll
  for (int k = 0; k < kChunks / kCtaThreads; ++k) {
    CpAsync16(dst + k * kRowsPerStep * kRowBytes, src + k * kRowsPerStep * pitch);
  }
}

// Tail path: loads one tile synchronously, element by element, zero-filling
// everything outside the tensor (docs/numerics.md §3: partial blocks).
template <InputDType D, int kRows = kTile>
__device__ __forceinline__ void LoadTileChecked(uint8_t* stage, const QuantizeArgs& a, int64_t m0,
                                                int64_t n0) {
  using Storage = std::conditional_t<kElemBytes<D> == 4, uint32_t, uint16_t>;
  const Storage* in = static_cast<const Storage*>(a.input);
  Storage* dst = reinterpret_cast<Storage*>(stage);
#pragma unroll 8
  for (int e = threadIdx.x; e < kRows * kTile; e += kThreadsFor<kRows>) {
    const int64_t gm = m0 + (e >> 7), gn = n0 + (e & 127);
    Storage v = 0;
    if (gm < a.m && gn < a.n) v = in[gm * a.n + gn];
    dst[e] = v;
  }
}

// Mixed path, a tile whose 128 columns lie inside the tensor but whose rows
// do not (the last tile row): 16-byte loads of the rows that exist, zeros
// for the others. REQUIRES: 16-byte aligned input rows.
template <InputDType D, int kRows = kTile>
__device__ __forceinline__ void LoadTileRowsChecked(uint8_t* stage, const QuantizeArgs& a,
                                                    int64_t m0, int64_t n0) {
  constexpr int kRowBytes = kTile * kElemBytes<D>;
  constexpr int kChunksPerRow = kRowBytes / 16;
  constexpr int kChunks = kRows * kChunksPerRow;
  const int64_t pitch = a.n * kElemBytes<D>;
  const uint8_t* src = static_cast<const uint8_t*>(a.input) + n0 * kElemBytes<D>;
#pragma unroll 4
  for (int c = threadIdx.x; c < kChunks; c += kThreadsFor<kRows>) {
    const int r = c / kChunksPerRow, ch = c % kChunksPerRow;
    uint4 w = make_uint4(0u, 0u, 0u, 0u);
    if (m0 + r < a.m) w = *reinterpret_cast<const uint4*>(src + (m0 + r) * pitch + ch * 16);
    *reinterpret_cast<uint4*>(stage + r * kRowBytes + ch * 16) = w;
  }
}

// One persistent kernel for every 1-D / 2-D, rowwise / columnwise combination.
//
// Grid: min(#tiles, resident CTAs); CTA b handles tiles b, b + grid, ... of the
// row-major grid of 128x128 input tiles. Aligned path (M, N multiples of 128,
// 16-byte aligned buffers): tiles stream into a kStages-deep ring of shared
// memory with cp.async, so the next tile's loads are in flight while this one
// is processed. Tail path: one synchronous, bounds-checked load per tile.
// Mixed path (any M, N with 16-byte aligned rows): the tiles wholly inside the
// tensor take the aligned path's loads and vector stores, the edge tiles the
// tail path's (a uniform branch per tile), so a tensor of 8191 rows runs at
// nearly the aligned speed.
//
// Thread t owns rows 8q..8q+7 and columns 8v..8v+7 of the tile (q = t / 16,
// v = t % 16), read from shared memory as 16-byte vectors (conflict-free: a
// quarter warp reads one 128-byte row segment).
// * 1-D rowwise (1x128 blocks): a row's 128 elements live in the 16 lanes of a
//   half warp; a butterfly over those lanes reduces the 8 row maxima in 8
//   shuffles, each lane computes the scale of one row, 8 shuffles broadcast
//   them back. Each lane stores 8 FP8 bytes per row (a half warp writes a
//   contiguous 128-byte row segment).
// * 1-D columnwise (128x1 blocks): per-thread column maxima over 8 rows, halves
//   exchanged between lanes l and l^16, then reduced across the 8 warps through
//   shared memory; threads 0..127 compute one column scale each. Each thread
//   quantizes its 8x8 sub-tile column by column into 8-byte runs along M, which
//   go into a 128x128-byte transposed tile in shared memory (16-byte units
//   XOR-swizzled by (n / 8) % 8: conflict-free both ways), then every warp
//   stores four whole 128-byte rows of the [N, M] output.
// * 2-D (128x128 tiles): block-wide amax, one scale; rowwise bytes as above and
//   the columnwise copy is the exact byte transpose (same multiply, same cast).
// Scale padding (pad4 columns) is written as 0 by the tile that owns the last
// real entry of that scale row.
//
// Tile order. The persistent grid's CTAs share the tiles one of two ways:
// * the fixed share: CTA b takes tiles b, b + grid, b + 2 grid, ...;
// * drawn tiles (a.tile_counter set; the pipelined paths): with A = kStages - 1
//   tiles loading ahead of the one being processed, CTA b starts with tiles
//   b, b + grid, ..., b + (A - 1) grid; every further tile is A grid + a
//   ticket that thread 0 draws from the counter (atomicAdd), so that a CTA on
//   an SM that runs faster (nearer its data's half of the L2, say) takes more
//   tiles and all finish together. Thread 0 draws the ticket of iteration
//   k + A + 1 at the top of iteration k, as soon as it knows that the tile of
//   iteration k + A exists, ahead of the iteration's loads, and publishes it
//   through tile_slot at the top of iteration k + 1, before the barrier that
//   makes it visible: the atomic has a whole tile's time to return. A CTA
//   stops drawing after its first ticket past the end, so a launch draws
//   exactly num_tiles - (A - 1) grid tickets; the draw of the last of them is
//   the launch's last draw and resets the counter to 0 for the next launch on
//   this stream (the launcher gives each stream its own counter).
//
// 1-D amaxes of BF16 / FP16 input with a columnwise copy are packed (unless
// kFloatAmax, the A/B variant): each thread takes |x| of its elements two at a
// time as 16-bit patterns (sign cleared) and keeps each row's and each column
// pair's maximum with Max2, then finishes the row butterfly on the pairs; the
// same maxima in about 90 instructions a tile instead of 140.
template <InputDType D, Fp8Format F, BlockScaling S, bool kRow, bool kCol, int kPath, int kStages,
          bool kFloatAmax = false, int kRows = kTile>
__global__ void __launch_bounds__(kThreadsFor<kRows>,
                                  (kElemBytes<D> == 2 ? 2 : 1) * (kTile / kRows))
    QuantizeBlockKernel(const QuantizeArgs a) {
  static_assert(kRow || kCol, "at least one copy must be requested");
  static_assert(kRows == kTile || (kRows == kTile / 2 && S == BlockScaling::kBlock1D && !kCol),
                "half tiles carry whole 1x128 blocks only: 1-D scaling, rowwise copy alone");
  constexpr bool kPipelined = kPath != kPathTail;
  static_assert(kPipelined ? (kStages >= 2 && kStages <= 4) : kStages == 1,
                "aligned path pipelines 2-4 stages, the tail path uses one");
  // Drawn tiles (uniform across the grid); the stage of iteration k is k % kStages either way.
  const bool dyn = kPipelined && a.tile_counter != nullptr;
  constexpr int kAhead = kStages > 1 ? kStages - 1 : 1;  // tiles loading ahead of the current one
  using Plan = SmemPlan<D, S, kRow, kCol, kStages, kRows>;
  constexpr int kRowBytes = kTile * kElemBytes<D>;
  constexpr bool k1D = (S == BlockScaling::kBlock1D);
  constexpr bool kPacked = k1D && kCol && kElemBytes<D> == 2 && !kFloatAmax;

  // 128-byte aligned stages: the static tile_slot below would otherwise put
  // the dynamic shared memory 16 bytes past a 128-byte boundary, and then the
  // L2 sees each 128-byte line of a warp's cp.async loads as three requests
  // for twice its sectors (ncu, 8192^2: 8.4 M read sectors instead of the
  // input's 4.2 M; bench/results/quantize_cuda_h200_session11_2026-12-02.md).
  extern __shared__ __align__(128) uint8_t smem[];
  float* const red = reinterpret_cast<float*>(smem + Plan::kRedOffset);
  float* const col_scale_sm = reinterpret_cast<float*>(smem + Plan::kColScaleOffset);

  const int tid = threadIdx.x;
  const int lane = tid & 31, warp = tid >> 5;
  const int q = tid >> 4, v = tid & 15;
  const uint32_t num_tiles = static_cast<uint32_t>(a.num_tiles);
  const uint32_t count = (num_tiles - blockIdx.x + gridDim.x - 1) / gridDim.x;
  __shared__ uint32_t tile_slot[2];  // dyn: the tile of iteration k + kAhead, in slot k % 2
  uint32_t ahead[kAhead];            // dyn: the tiles of iterations k + 1 ... k + kAhead
#pragma unroll
  for (int i = 0; i < kAhead; ++i) ahead[i] = blockIdx.x + (i + 1) * gridDim.x;
  uint32_t ticket = 0;   // dyn, thread 0: the last ticket drawn ...
  bool fetched = false;  // ... and not yet published (at most one)
  // dyn: the tile of ticket t is kAhead * grid + t; the launch's last draw.
  const uint32_t first_drawn = kAhead * gridDim.x;
  const uint32_t last_ticket = num_tiles - first_drawn + gridDim.x - 1;

  // Whether a tile lies wholly inside the tensor (constant but for kPathMixed).
  auto whole = [&a](uint32_t t) -> bool {
    if constexpr (kPath == kPathAligned) {
      return true;
    } else if constexpr (kPath == kPathTail) {
      return false;
    } else {
      int64_t tm, tn;
      TileCoords(a, t, &tm, &tn);
      return tm < a.full_mb && tn < a.full_nb;
    }
  };
  if (dyn && tid == 0) {  // the ticket of iteration kAhead, ahead of the loads of tile 0
    ticket = atomicAdd(a.tile_counter, 1u);
    fetched = true;
  }
  if constexpr (kPipelined) {
#pragma unroll
    for (uint32_t s = 0; s < kStages - 1; ++s) {
      const uint32_t t = blockIdx.x + s * gridDim.x;
      if (s < count && whole(t)) IssueTileCopy<D, kRows>(smem + s * Plan::kStageBytes, a, t);
      CpAsyncCommit();
    }
  }

  uint32_t tile = blockIdx.x;
  for (uint32_t k = 0; dyn || k < count; ++k) {
    if (dyn) {
      if (k > 0) {
        tile = ahead[0];  // uniform: every thread read it after a barrier
#pragma unroll
        for (int i = 0; i + 1 < kAhead; ++i) ahead[i] = ahead[i + 1];
        if (tile >= num_tiles) break;  // tiles only grow, so none of the later ones exists
      }
      if (tid == 0) {
        uint32_t t1 = num_tiles;  // the tile of iteration k + kAhead: none, once past the end
        if (fetched) {
          t1 = first_drawn + ticket;
          if (ticket == last_ticket) atomicExch(a.tile_counter, 0u);  // the launch's last draw
          fetched = t1 < num_tiles;
          if (fetched) ticket = atomicAdd(a.tile_counter, 1u);  // published at k + 1
        }
        tile_slot[k & 1] = t1;
      }
    } else {
      tile = blockIdx.x + k * gridDim.x;
    }
    int64_t tm, tn;
    TileCoords(a, tile, &tm, &tn);
    const int64_t m0 = tm * kRows, n0 = tn * kTile;
    uint8_t* stage;
    // Uniform across the CTA: vector loads/stores, no bounds checks.
    const bool full = whole(tile);
    if constexpr (kPipelined) {
      CpAsyncWait<kStages - 2>();
      __syncthreads();  // tile k visible; every thread is done with tile k-1
      if (dyn) {
        const uint32_t t = tile_slot[k & 1];
        ahead[kAhead - 1] = t;
        if (t < num_tiles && whole(t)) {
          IssueTileCopy<D, kRows>(smem + ((k + kAhead) % kStages) * Plan::kStageBytes, a, t);
        }
      } else if (k + kStages - 1 < count) {
        const uint32_t next = tile + (kStages - 1) * gridDim.x;
        if (whole(next)) {
          IssueTileCopy<D, kRows>(smem + ((k + kStages - 1) % kStages) * Plan::kStageBytes, a,
                                  next);
        }
      }
      CpAsyncCommit();
      stage = smem + (k % kStages) * Plan::kStageBytes;
      if constexpr (kPath == kPathMixed) {
        if (!full) {  // an edge tile: no copy was issued into its stage
          if (tn < a.full_nb) {
            LoadTileRowsChecked<D, kRows>(stage, a, m0, n0);
          } else {
            LoadTileChecked<D, kRows>(stage, a, m0, n0);
          }
          __syncthreads();
        }
      }
    } else {
      __syncthreads();  // every thread is done with the previous tile
      LoadTileChecked<D, kRows>(smem, a, m0, n0);
      __syncthreads();
      stage = smem;
    }

    // ---- this thread's 8x8 sub-tile, as FP32 (exact) ----
    float x[8][8];
    [[maybe_unused]] uint32_t row_pk[8];  // kPacked: each row's |x| maximum, as a pair
    [[maybe_unused]] uint32_t col_pk[4];  // kPacked: columns 2j, 2j + 1's, as a pair
    {
      const uint8_t* base = stage + (8 * q) * kRowBytes + v * 8 * kElemBytes<D>;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        if constexpr (kElemBytes<D> == 2) {
          const uint4 w = *reinterpret_cast<const uint4*>(base + i * kRowBytes);
          const uint32_t words[4] = {w.x, w.y, w.z, w.w};
          if constexpr (kPacked) {
            uint32_t ab[4];
#pragma unroll
            for (int j = 0; j < 4; ++j) ab[j] = words[j] & 0x7FFF7FFFu;
            row_pk[i] = Max2<D>(Max2<D>(ab[0], ab[1]), Max2<D>(ab[2], ab[3]));
#pragma unroll
            for (int j = 0; j < 4; ++j) col_pk[j] = i == 0 ? ab[j] : Max2<D>(col_pk[j], ab[j]);
          }
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            if constexpr (D == InputDType::kBFloat16) {
              x[i][2 * j] = __uint_as_float(words[j] << 16);
              x[i][2 * j + 1] = __uint_as_float(words[j] & 0xFFFF0000u);
            } else {
              x[i][2 * j] = ElemToFloat<D>(words[j] & 0xFFFFu);
              x[i][2 * j + 1] = ElemToFloat<D>(words[j] >> 16);
            }
          }
        } else {
          const uint4 w0 = *reinterpret_cast<const uint4*>(base + i * kRowBytes);
          const uint4 w1 = *reinterpret_cast<const uint4*>(base + i * kRowBytes + 16);
          const uint32_t words[8] = {w0.x, w0.y, w0.z, w0.w, w1.x, w1.y, w1.z, w1.w};
#pragma unroll
          for (int j = 0; j < 8; ++j) x[i][j] = ElemToFloat<D>(words[j]);
        }
      }
    }

    // ---- scales (docs/numerics.md §2) ----
    float row_scale[8];
    float col_scale[8];
    if constexpr (!k1D) {
      float am = 0.0f;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
#pragma unroll
        for (int j = 0; j < 8; ++j) am = AbsMax(am, x[i][j]);
      }
#pragma unroll
      for (int mask = 16; mask > 0; mask >>= 1) {
        am = fmaxf(am, __shfl_xor_sync(0xFFFFFFFFu, am, mask));
      }
      if (lane == 0) red[warp] = am;
      __syncthreads();
      float tile_amax = red[0];
#pragma unroll
      for (int w = 1; w < kWarps; ++w) tile_amax = fmaxf(tile_amax, red[w]);
      const float s = BlockScale(a, tile_amax);
      if (tid == 0) {
        const float s_inv = BlockScaleInv(a, s);
        if constexpr (kRow) {
          a.sr[tm * a.sr_pitch + tn] = s_inv;
          if (tn == a.nb - 1) {
            for (int64_t p = a.nb; p < a.sr_pitch; ++p) a.sr[tm * a.sr_pitch + p] = 0.0f;
          }
        }
        if constexpr (kCol) {
          a.sc[tn * a.sc_pitch + tm] = s_inv;
          if (tm == a.mb - 1) {
            for (int64_t p = a.mb; p < a.sc_pitch; ++p) a.sc[tn * a.sc_pitch + p] = 0.0f;
          }
        }
      }
#pragma unroll
      for (int i = 0; i < 8; ++i) row_scale[i] = col_scale[i] = s;
    } else {
      if constexpr (kRow) {
        // Row maxima as FP32, or (kPacked) as pairs until the end of the butterfly.
        using AmaxT = std::conditional_t<kPacked, uint32_t, float>;
        auto amax2 = [](AmaxT p, AmaxT q) -> AmaxT {
          if constexpr (kPacked) {
            return Max2<D>(p, q);
          } else {
            return fmaxf(p, q);
          }
        };
        AmaxT r[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          if constexpr (kPacked) {
            r[i] = row_pk[i];
          } else {
            r[i] = 0.0f;
#pragma unroll
            for (int j = 0; j < 8; ++j) r[i] = AbsMax(r[i], x[i][j]);
          }
        }
        // Butterfly over the 16 lanes of this half warp: after the steps with
        // masks 8, 4, 2, 1 the lane holds the amax of row (lane >> 1) & 7.
        {
          const bool hi = lane & 8;
#pragma unroll
          for (int t = 0; t < 4; ++t) {
            const AmaxT send = hi ? r[t] : r[t + 4];
            const AmaxT keep = hi ? r[t + 4] : r[t];
            r[t] = amax2(keep, __shfl_xor_sync(0xFFFFFFFFu, send, 8));
          }
        }
        {
          const bool hi = lane & 4;
#pragma unroll
          for (int t = 0; t < 2; ++t) {
            const AmaxT send = hi ? r[t] : r[t + 2];
            const AmaxT keep = hi ? r[t + 2] : r[t];
            r[t] = amax2(keep, __shfl_xor_sync(0xFFFFFFFFu, send, 4));
          }
        }
        {
          const bool hi = lane & 2;
          const AmaxT send = hi ? r[0] : r[1];
          const AmaxT keep = hi ? r[1] : r[0];
          r[0] = amax2(keep, __shfl_xor_sync(0xFFFFFFFFu, send, 2));
        }
        r[0] = amax2(r[0], __shfl_xor_sync(0xFFFFFFFFu, r[0], 1));
        float row_amax;
        if constexpr (kPacked) {
          row_amax = PairMax<D>(r[0]);
        } else {
          row_amax = r[0];
        }
        const float s = BlockScale(a, row_amax);
        if ((v & 1) == 0) {
          const int64_t gm = m0 + 8 * q + (v >> 1);
          if (full || gm < a.m) a.sr[tn * a.sr_pitch + gm] = BlockScaleInv(a, s);
        }
        if (tm == a.mb - 1 && tid < a.sr_pitch - a.m) a.sr[tn * a.sr_pitch + a.m + tid] = 0.0f;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          row_scale[i] = __shfl_sync(0xFFFFFFFFu, s, (lane & 16) | (i << 1));
        }
      }
      if constexpr (kCol) {
        // Lanes l and l^16 hold the same columns for rows 8q.. and 8(q+1)..:
        // exchange halves, then slot t holds column 8v + 4*(lane>>4) + t.
        const bool hi = lane & 16;
        float c[8];
        if constexpr (kPacked) {
#pragma unroll
          for (int t = 0; t < 2; ++t) {
            const uint32_t send = hi ? col_pk[t] : col_pk[t + 2];
            const uint32_t keep = hi ? col_pk[t + 2] : col_pk[t];
            const uint32_t m = Max2<D>(keep, __shfl_xor_sync(0xFFFFFFFFu, send, 16));
            c[2 * t] = ElemToFloat<D>(m & 0xFFFFu);  // NaN only for a column of NaNs
            c[2 * t + 1] = ElemToFloat<D>(m >> 16);
          }
        } else {
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            c[j] = 0.0f;
#pragma unroll
            for (int i = 0; i < 8; ++i) c[j] = AbsMax(c[j], x[i][j]);
          }
#pragma unroll
          for (int t = 0; t < 4; ++t) {
            const float send = hi ? c[t] : c[t + 4];
            const float keep = hi ? c[t + 4] : c[t];
            c[t] = fmaxf(keep, __shfl_xor_sync(0xFFFFFFFFu, send, 16));
          }
        }
        *reinterpret_cast<float4*>(red + warp * kTile + 8 * v + (hi ? 4 : 0)) =
            make_float4(c[0], c[1], c[2], c[3]);
        __syncthreads();
        if (tid < kTile) {
          float am = red[tid];
#pragma unroll
          for (int w = 1; w < kWarps; ++w) am = fmaxf(am, red[w * kTile + tid]);
          if constexpr (kPacked) am = fmaxf(0.0f, am);  // as PairMax: a NaN column's amax is 0
          const float s = BlockScale(a, am);
          col_scale_sm[tid] = s;
          const int64_t gn = n0 + tid;
          if (full || gn < a.n) a.sc[tm * a.sc_pitch + gn] = BlockScaleInv(a, s);
        } else if (tn == a.nb - 1 && tid - kTile < a.sc_pitch - a.n) {
          a.sc[tm * a.sc_pitch + a.n + (tid - kTile)] = 0.0f;
        }
        __syncthreads();
        const float4 c0 = *reinterpret_cast<const float4*>(col_scale_sm + 8 * v);
        const float4 c1 = *reinterpret_cast<const float4*>(col_scale_sm + 8 * v + 4);
        col_scale[0] = c0.x, col_scale[1] = c0.y, col_scale[2] = c0.z, col_scale[3] = c0.w;
        col_scale[4] = c1.x, col_scale[5] = c1.y, col_scale[6] = c1.z, col_scale[7] = c1.w;
      }
    }

    // ---- rowwise copy: [M, N] ----
    if constexpr (kRow) {
      const int64_t gm0 = m0 + 8 * q;
      const int64_t gn = n0 + 8 * v;
      uint8_t* row_ptr = a.qr + gm0 * a.n + gn;
      // Whole columns (the mixed path's last tile row too): 8-byte stores.
      const bool row_vec = full || (kPath == kPathMixed && tn < a.full_nb);
#pragma unroll
      for (int i = 0; i < 8; ++i, row_ptr += a.n) {
        const uint2 b = Quantize8<F>(x[i], row_scale[i]);
        if (row_vec) {
          if (full || gm0 + i < a.m) {
            StoreFp8(reinterpret_cast<uint2*>(row_ptr), b, a.stream_stores);
          }
        } else if (gm0 + i < a.m) {
          const uint32_t words[2] = {b.x, b.y};
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            if (gn + j < a.n) row_ptr[j] = static_cast<uint8_t>(words[j >> 2] >> (8 * (j & 3)));
          }
        }
      }
    }

    // ---- columnwise copy: [N, M], through the swizzled transposed tile ----
    // The tile reuses this iteration's input stage: every thread has read its
    // sub-tile out of it before the barrier above (red / column scales), and
    // the stage is refilled only after the next iteration's first barrier.
    if constexpr (kCol) {
      uint8_t* const tsm = stage;
      const int unit = q >> 1, half = q & 1;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        float col[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) col[i] = x[i][j];
        const uint2 b = Quantize8<F>(col, col_scale[j]);
        const int nl = 8 * v + j;
        *reinterpret_cast<uint2*>(tsm + nl * kTile + ((unit ^ (v & 7)) << 4) + (half << 3)) = b;
      }
      __syncthreads();
      if (kPath == kPathMixed && full && !a.col_vec) {
        // Whole tile, but the [N, M] rows do not start 16-byte aligned
        // (M % 16 != 0). A warp writes one 128-byte row segment per step as
        // aligned 4-byte words: lane l the word holding segment bytes
        // [4l - mis, 4l - mis + 4), where mis = the segment's start mod 4,
        // assembled from two aligned shared-memory words (funnel shift); the
        // partial words at both ends (mis != 0) go byte by byte (lane 0).
        for (int nl = warp; nl < kTile; nl += kWarps) {
          uint8_t* const seg = a.qc + (n0 + nl) * a.m + m0;
          const int mis = static_cast<int>(reinterpret_cast<uintptr_t>(seg) & 3);
          const uint8_t* const row = tsm + nl * kTile;
          const int sw = (nl >> 3) & 7;
          auto word_at = [&](int b) {  // the aligned 4 bytes holding segment byte b
            return *reinterpret_cast<const uint32_t*>(row + (((b >> 4) ^ sw) << 4) + (b & 12));
          };
          const int b0 = 4 * lane - mis;
          uint32_t* const dst = reinterpret_cast<uint32_t*>(seg - mis) + lane;
          if (mis == 0) {
            StoreFp8(dst, word_at(b0), a.stream_stores);
          } else {
            if (b0 >= 0) {
              const uint32_t lo = word_at(b0), hi = word_at(b0 + 4);
              StoreFp8(dst, __funnelshift_r(lo, hi, 8 * (b0 & 3)), a.stream_stores);
            }
            if (lane == 0) {
              for (int b = 0; b < 4 - mis; ++b) seg[b] = row[((b >> 4) ^ sw) << 4 | (b & 15)];
              for (int b = kTile - mis; b < kTile; ++b) {
                seg[b] = row[(((b >> 4) ^ sw) << 4) + (b & 15)];
              }
            }
          }
        }
        continue;
      }
      const int u = tid & 7;
      const int64_t gm = m0 + 16 * u;
      uint8_t* col_ptr = a.qc + (n0 + (tid >> 3)) * a.m + gm;
#pragma unroll
      for (int p = 0; p < kTile / 32; ++p, col_ptr += 32 * a.m) {
        const int nl = p * 32 + (tid >> 3);
        const uint4 val =
            *reinterpret_cast<const uint4*>(tsm + nl * kTile + ((u ^ ((nl >> 3) & 7)) << 4));
        if (full && (kPath == kPathAligned || a.col_vec)) {
          StoreFp8(reinterpret_cast<uint4*>(col_ptr), val, a.stream_stores);
        } else if (n0 + nl < a.n) {
          const uint32_t words[4] = {val.x, val.y, val.z, val.w};
#pragma unroll
          for (int b = 0; b < 16; ++b) {
            if (gm + b < a.m) col_ptr[b] = static_cast<uint8_t>(words[b >> 2] >> (8 * (b & 3)));
          }
        }
      }
    }
  }
  if constexpr (kPipelined) CpAsyncWait<0>();  // nothing may stay in flight at exit
}

// ---- launch helpers -------------------------------------------------------------

constexpr int kMaxDevices = 64;

// Resident CTAs per SM of `kernel` with `smem` bytes; `cache` (one per kernel
// instantiation, indexed by device) holds (per_sm << 16) | sms, 0 = unknown.
template <typename Kernel>
cudaError_t ResidentCtas(Kernel kernel, int threads, int smem, std::atomic<int>* cache, int* sms,
                         int* per_sm) {
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return err;
  if (dev >= 0 && dev < kMaxDevices) {
    const int c = cache[dev].load(std::memory_order_relaxed);
    if (c != 0) {
      *sms = c & 0xFFFF;
      *per_sm = c >> 16;
      return cudaSuccess;
    }
  }
  err = cudaDeviceGetAttribute(sms, cudaDevAttrMultiProcessorCount, dev);
  if (err != cudaSuccess) return err;
  err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess) return err;
  err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(per_sm, kernel, threads, smem);
  if (err != cudaSuccess) return err;
  if (*per_sm < 1) return cudaErrorLaunchOutOfResources;
  if (dev >= 0 && dev < kMaxDevices) {
    cache[dev].store((*per_sm << 16) | (*sms & 0xFFFF), std::memory_order_relaxed);
  }
  return cudaSuccess;
}

// 1-D rowwise launches of 16-bit input with at most this many 128x128 tiles
// per SM (12 per resident CTA of the 128x128 kernel) run half tiles by default.
constexpr int64_t kHalfTilesPerSm = 24;

// The tile counters of drawn tiles: one 4-byte device word per (device,
// stream), so that launches that may run at the same time never share one
// (each launch leaves its counter at 0). A stream is known by cudaStreamGetId;
// kCounterSlots streams per device hold a counter at a time, and
// ForgetStreamTileCounter frees a stream's. A launch that finds no free slot,
// or a stream under graph capture (a graph may be replayed on any stream),
// gets null and runs the fixed tile share instead: the same bytes, a few
// percent slower on large tensors.
constexpr int kCounterSlots = 1024;
struct CounterPool {
  std::mutex mu;
  uint32_t* counters = nullptr;                         // kCounterSlots device words
  std::unordered_map<unsigned long long, int> slot_of;  // stream id -> slot
  std::vector<int> free_slots;                          // freed slots, reused first
  int used = 0;                                         // slots handed out ever
};

CounterPool* DevicePool(int dev) {
  static CounterPool pools[kMaxDevices];
  return dev >= 0 && dev < kMaxDevices ? &pools[dev] : nullptr;
}

cudaError_t StreamTileCounter(cudaStream_t stream, uint32_t** counter) {
  *counter = nullptr;
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  cudaError_t err = cudaStreamIsCapturing(stream, &capture);
  if (err != cudaSuccess) return err;
  if (capture != cudaStreamCaptureStatusNone) return cudaSuccess;
  int dev = 0;
  err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return err;
  CounterPool* const pool = DevicePool(dev);
  if (pool == nullptr) return cudaSuccess;
  unsigned long long id = 0;
  if (cudaStreamGetId(stream, &id) != cudaSuccess) {
    (void)cudaGetLastError();  // not a sticky error: no id, no counter
    return cudaSuccess;
  }
  std::lock_guard<std::mutex> lock(pool->mu);
  if (const auto it = pool->slot_of.find(id); it != pool->slot_of.end()) {
    *counter = pool->counters + it->second;
    return cudaSuccess;
  }
  if (pool->free_slots.empty() && pool->used == kCounterSlots) return cudaSuccess;
  if (pool->counters == nullptr) {
    err = cudaMalloc(&pool->counters, kCounterSlots * sizeof(uint32_t));
    if (err != cudaSuccess) return err;
  }
  const bool reuse = !pool->free_slots.empty();
  const int slot = reuse ? pool->free_slots.back() : pool->used;
  uint32_t* const c = pool->counters + slot;
  // Zeroed in the stream's own order, before its first launch that uses it.
  err = cudaMemsetAsync(c, 0, sizeof(uint32_t), stream);
  if (err != cudaSuccess) return err;
  if (reuse) {
    pool->free_slots.pop_back();
  } else {
    ++pool->used;
  }
  pool->slot_of.emplace(id, slot);
  *counter = c;
  return cudaSuccess;
}

template <InputDType D, Fp8Format F, BlockScaling S, bool kRow, bool kCol, int kPath, int kStages,
          bool kFloatAmax = false, int kRows = kTile>
cudaError_t LaunchQuantize(const QuantizeArgs& args, int ctas_per_sm, bool draw_tiles,
                           cudaStream_t stream) {
  auto kernel = QuantizeBlockKernel<D, F, S, kRow, kCol, kPath, kStages, kFloatAmax, kRows>;
  constexpr int smem = SmemPlan<D, S, kRow, kCol, kStages, kRows>::kBytes;
  constexpr int threads = kThreadsFor<kRows>;
  static std::atomic<int> cache[kMaxDevices];
  int sms = 0, per_sm = 0;
  cudaError_t err = ResidentCtas(kernel, threads, smem, cache, &sms, &per_sm);
  if (err != cudaSuccess) return err;
  if (ctas_per_sm > 0 && ctas_per_sm < per_sm) per_sm = ctas_per_sm;
  const int64_t resident = static_cast<int64_t>(sms) * per_sm;
  QuantizeArgs a = args;
  if constexpr (kRows != kTile) {  // the launcher counted 128-row tiles
    a.mb = CeilDiv(a.m, int64_t{kRows});
    a.full_mb = a.m / kRows;
    a.num_tiles = a.mb * a.nb;
  }
  const int grid = static_cast<int>(a.num_tiles < resident ? a.num_tiles : resident);
  a.tile_counter = nullptr;
  // Drawn tiles where the kernel supports them and a CTA has more than its first
  // kStages - 1 (which it takes in the fixed order).
  if (draw_tiles && kPath != kPathTail && a.num_tiles > (kStages - 1) * resident) {
    err = StreamTileCounter(stream, &a.tile_counter);
    if (err != cudaSuccess) return err;
  }
  kernel<<<grid, threads, smem, stream>>>(a);
  return cudaGetLastError();
}

template <typename Fn>
cudaError_t WithScaling(BlockScaling s, Fn&& fn) {
  switch (s) {
    case BlockScaling::kBlock1D:
      return fn(std::integral_constant<BlockScaling, BlockScaling::kBlock1D>{});
    case BlockScaling::kBlock2D:
      return fn(std::integral_constant<BlockScaling, BlockScaling::kBlock2D>{});
    case BlockScaling::kTensor:
      break;  // kernels/cuda/quantize_tensor.cu, dispatched before this
  }
  return cudaErrorInvalidValue;  // not one of kBlock1D, kBlock2D
}

bool Aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

cudaError_t QuantizeImpl(const void* input, InputDType dtype, int64_t m, int64_t n,
                         const QuantizeParams& params, const QuantizedBuffers& out,
                         const detail::LaunchTuning& tuning, cudaStream_t stream) {
  if (params.scaling == BlockScaling::kTensor) {
    return QuantizeTensor(input, dtype, m, n, params, out, stream);  // no tuning knobs
  }
  if (m < 0 || n < 0) return cudaErrorInvalidValue;
  if (!(params.amax_epsilon >= 0.0f) || std::isinf(params.amax_epsilon)) {
    return cudaErrorInvalidValue;
  }
  if (params.rowwise && (out.rowwise_data == nullptr || out.rowwise_scale_inv == nullptr)) {
    return cudaErrorInvalidValue;
  }
  if (params.columnwise &&
      (out.columnwise_data == nullptr || out.columnwise_scale_inv == nullptr)) {
    return cudaErrorInvalidValue;
  }
  if (m == 0 || n == 0 || (!params.rowwise && !params.columnwise)) {
    // Validate the enums even when nothing runs.
    const bool ok_enums =
        (dtype == InputDType::kFloat32 || dtype == InputDType::kBFloat16 ||
         dtype == InputDType::kFloat16) &&
        (params.format == Fp8Format::kE4M3 || params.format == Fp8Format::kE5M2) &&
        (params.scaling == BlockScaling::kBlock1D || params.scaling == BlockScaling::kBlock2D);
    return ok_enums ? cudaSuccess : cudaErrorInvalidValue;
  }
  if (input == nullptr) return cudaErrorInvalidValue;

  const QuantizedLayout layout = ComputeLayout(params.scaling, m, n);
  QuantizeArgs args;
  args.input = input;
  args.qr = out.rowwise_data;
  args.sr = out.rowwise_scale_inv;
  args.qc = out.columnwise_data;
  args.sc = out.columnwise_scale_inv;
  args.m = m;
  args.n = n;
  args.mb = CeilDiv(m, kBlockLen);
  args.nb = CeilDiv(n, kBlockLen);
  args.num_tiles = args.mb * args.nb;
  // Tile indices are 32-bit in the kernel (2^31 tiles = 2^45 elements).
  if (args.num_tiles >= (int64_t{1} << 31)) return cudaErrorInvalidValue;
  args.sr_pitch = layout.rowwise_scale_cols;
  args.sc_pitch = layout.columnwise_scale_cols;
  args.fp8_max = Fp8Max(params.format);
  args.eps = params.amax_epsilon;
  args.value_for_inf = InputDTypeMax(dtype);
  args.pow2 = params.force_pow2_scales;
  args.fast_pow2 = params.force_pow2_scales && !tuning.division_scales;
  // Plain stores of the FP8 copies. Evict-first ones (st.global.cs) were about
  // 3% faster at 8192^2 on the H200 with the fixed tile share
  // (bench/results/quantize_cuda_h200_variants.jsonl); with drawn tiles plain
  // stores are 0.4-1.1% faster row+col and equal rowwise, on every shape and
  // with either L2 method (bench/results/quantize_cuda_h200_session14_2026-12-02.md),
  // and they leave the copies' last lines in L2 for the GEMM or all-gather
  // that reads them next.
  args.stream_stores = tuning.evict_first_outputs;
  args.tile_counter = nullptr;  // set per launch by LaunchQuantize

  const bool aligned = m % kTile == 0 && n % kTile == 0 && Aligned16(input) &&
                       (!params.rowwise || Aligned16(out.rowwise_data)) &&
                       (!params.columnwise || Aligned16(out.columnwise_data));
  // Whole tiles can use the aligned path's 16-byte loads and stores when every
  // row of the input and of each requested copy starts 16-byte aligned.
  const int64_t elem = dtype == InputDType::kFloat32 ? 4 : 2;
  args.full_mb = m / kTile;
  args.full_nb = n / kTile;
  // (The columnwise copy's rows are written byte by byte when M % 16 != 0.)
  const bool mixed = !aligned && args.full_mb > 0 && args.full_nb > 0 && Aligned16(input) &&
                     (n * elem) % 16 == 0 &&
                     (!params.rowwise || (Aligned16(out.rowwise_data) && n % 16 == 0));
  args.col_vec = params.columnwise && Aligned16(out.columnwise_data) && m % 16 == 0;
  const int usage = (params.rowwise ? 1 : 0) | (params.columnwise ? 2 : 0);

  return WithDType(dtype, [&](auto dt) {
    return WithFormat(params.format, [&](auto ft) {
      return WithScaling(params.scaling, [&](auto sc) {
        constexpr InputDType D = decltype(dt)::value;
        constexpr Fp8Format F = decltype(ft)::value;
        constexpr BlockScaling S = decltype(sc)::value;
        auto by_path = [&](auto row, auto col) -> cudaError_t {
          constexpr bool kRow = decltype(row)::value;
          constexpr bool kCol = decltype(col)::value;
          const int per_sm = tuning.ctas_per_sm;
          const bool draw = !tuning.fixed_tiles;
          if constexpr (S == BlockScaling::kBlock1D && kRow && !kCol) {
            if (tuning.half_tiles) {  // 64x128 units, 128-thread CTAs
              constexpr int kHalf = kTile / 2;
              if (mixed) {
                return LaunchQuantize<D, F, S, kRow, kCol, kPathMixed, 2, false, kHalf>(
                    args, per_sm, draw, stream);
              }
              if (!aligned) {
                return LaunchQuantize<D, F, S, kRow, kCol, kPathTail, 1, false, kHalf>(
                    args, 0, false, stream);
              }
              const int stages = tuning.stages == 3 ? 3 : 2;
              return stages == 3
                         ? LaunchQuantize<D, F, S, kRow, kCol, kPathAligned, 3, false, kHalf>(
                               args, per_sm, draw, stream)
                         : LaunchQuantize<D, F, S, kRow, kCol, kPathAligned, 2, false, kHalf>(
                               args, per_sm, draw, stream);
            }
          }
          if (mixed) {
            return LaunchQuantize<D, F, S, kRow, kCol, kPathMixed, 2>(args, per_sm, draw, stream);
          }
          if (!aligned) {
            return LaunchQuantize<D, F, S, kRow, kCol, kPathTail, 1>(args, 0, false, stream);
          }
          // Aligned path. The defaults for 16-bit input (FP32 has 64 KiB
          // stages, 1 CTA per SM: always 2 stages), measured on the H200 with
          // the L2 flushed (bench/results/session23_h200_2026-12-04.md):
          // * 1-D, the rowwise copy alone, at most kHalfTilesPerSm tiles per SM
          //   (each CTA has few): half tiles with 3 stages, 4 % faster than
          //   128x128 tiles with 2 at 4096^2 (6 of 6 rounds in rotated order),
          //   within +-0.3 % at 2048x4096 and 4096x12288; at 8192^2 within
          //   +-0.3 % too, and from there on the 128x128 tiles stay;
          // * 1-D with a columnwise copy (session 19) and 2-D row+col: 3 stages
          //   (two tiles loading ahead of the one being processed) when the
          //   launch then still draws its tiles, i.e. has more than 2 tiles per
          //   resident CTA (4 per SM); with fewer, 3 stages measured 4-8 % slower;
          // * otherwise 2 (2-D rowwise: 3 stages measured -1 to +4 %, no rule).
          constexpr bool k16 = D != InputDType::kFloat32;
          constexpr bool kHalfDefault = k16 && S == BlockScaling::kBlock1D && kRow && !kCol;
          constexpr bool k3Stages = k16 && kCol && (S == BlockScaling::kBlock1D || kRow);
          constexpr bool kExperiments = D == InputDType::kBFloat16 && F == Fp8Format::kE4M3;
          int stages = tuning.stages;
          if constexpr (kHalfDefault || k3Stages) {
            if (stages == 0) {
              int sms = 0;
              const cudaError_t err = CurrentDeviceSmCount(&sms);
              if (err != cudaSuccess) return err;
              if constexpr (kHalfDefault) {
                if (args.num_tiles <= kHalfTilesPerSm * int64_t{sms}) {
                  return LaunchQuantize<D, F, S, kRow, kCol, kPathAligned, 3, false, kTile / 2>(
                      args, per_sm, draw, stream);
                }
              }
              stages = k3Stages && args.num_tiles > 4 * int64_t{sms} ? 3 : 2;
            }
          }
          if (stages == 0) stages = 2;
          if constexpr (kExperiments && S == BlockScaling::kBlock1D && kCol) {
            if (tuning.float_amax) {
              return stages == 3 ? LaunchQuantize<D, F, S, kRow, kCol, kPathAligned, 3, true>(
                                       args, per_sm, draw, stream)
                                 : LaunchQuantize<D, F, S, kRow, kCol, kPathAligned, 2, true>(
                                       args, per_sm, draw, stream);
            }
          }
          if constexpr (k3Stages || kExperiments) {
            if (stages == 3) {
              return LaunchQuantize<D, F, S, kRow, kCol, kPathAligned, 3>(args, per_sm, draw,
                                                                          stream);
            }
          }
          return LaunchQuantize<D, F, S, kRow, kCol, kPathAligned, 2>(args, per_sm, draw, stream);
        };
        switch (usage) {
          case 1:
            return by_path(std::true_type{}, std::false_type{});
          case 2:
            return by_path(std::false_type{}, std::true_type{});
          case 3:
            return by_path(std::true_type{}, std::true_type{});
        }
        return cudaErrorInvalidValue;  // unreachable: usage 0 returned above
      });
    });
  });
}

// ---- dequantize -------------------------------------------------------------------

struct DequantArgs {
  const uint8_t* q;
  const float* s;
  void* out;
  int64_t m, n;
  int64_t s_pitch;
  bool two_d;
  Fp8Format format;
};

// Rowwise copy: grid-stride over the [M, N] output, one element per thread
// per step (coalesced 1-byte reads of Qr, coalesced writes).
template <InputDType OutD>
__global__ void __launch_bounds__(256) DequantizeRowwiseKernel(const DequantArgs a) {
  const int64_t total = a.m * a.n;
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t mm = idx / a.n, nn = idx % a.n;
    const float s =
        a.two_d ? a.s[(mm / kTile) * a.s_pitch + nn / kTile] : a.s[(nn / kTile) * a.s_pitch + mm];
    StoreOut<OutD>(a.out, idx, Dequant1(a.q[idx], s, a.format));
  }
}

// Columnwise copy ([N, M] bytes) back to [M, N] (DequantizeColumnwiseTiles).
template <InputDType OutD>
__global__ void __launch_bounds__(256) DequantizeColumnwiseKernel(const DequantArgs a) {
  DequantizeColumnwiseTiles<OutD>(a.q, a.m, a.n, a.format, a.out, [&](int64_t mm, int64_t nn) {
    return a.two_d ? a.s[(nn / kTile) * a.s_pitch + mm / kTile]
                   : a.s[(mm / kTile) * a.s_pitch + nn];
  });
}

}  // namespace

cudaError_t ForgetStreamTileCounter(cudaStream_t stream) {
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return err;
  CounterPool* const pool = DevicePool(dev);
  unsigned long long id = 0;
  if (pool == nullptr || cudaStreamGetId(stream, &id) != cudaSuccess) {
    (void)cudaGetLastError();  // not a sticky error: a stream without an id has no counter
    return cudaSuccess;
  }
  std::lock_guard<std::mutex> lock(pool->mu);
  if (const auto it = pool->slot_of.find(id); it != pool->slot_of.end()) {
    pool->free_slots.push_back(it->second);
    pool->slot_of.erase(it);
  }
  return cudaSuccess;
}

cudaError_t QuantizeBlock(const void* input, InputDType dtype, int64_t m, int64_t n,
                          const QuantizeParams& params, const QuantizedBuffers& out,
                          cudaStream_t stream) {
  return QuantizeImpl(input, dtype, m, n, params, out, detail::LaunchTuning{}, stream);
}

cudaError_t DequantizeBlock(const QuantizedConstBuffers& in, BlockScaling scaling, Fp8Format format,
                            int64_t m, int64_t n, bool use_rowwise, InputDType out_dtype, void* out,
                            cudaStream_t stream) {
  if (scaling == BlockScaling::kTensor) {
    return DequantizeTensor(in, format, m, n, use_rowwise, out_dtype, out, stream);
  }
  if (m < 0 || n < 0) return cudaErrorInvalidValue;
  if (format != Fp8Format::kE4M3 && format != Fp8Format::kE5M2) return cudaErrorInvalidValue;
  if (scaling != BlockScaling::kBlock1D && scaling != BlockScaling::kBlock2D) {
    return cudaErrorInvalidValue;
  }
  if (m == 0 || n == 0) {
    return WithDType(out_dtype, [](auto) { return cudaSuccess; });
  }
  DequantArgs a;
  a.q = use_rowwise ? in.rowwise_data : in.columnwise_data;
  a.s = use_rowwise ? in.rowwise_scale_inv : in.columnwise_scale_inv;
  if (a.q == nullptr || a.s == nullptr || out == nullptr) return cudaErrorInvalidValue;
  const QuantizedLayout layout = ComputeLayout(scaling, m, n);
  a.out = out;
  a.m = m;
  a.n = n;
  a.s_pitch = use_rowwise ? layout.rowwise_scale_cols : layout.columnwise_scale_cols;
  a.two_d = scaling == BlockScaling::kBlock2D;
  a.format = format;
  int sms = 0;
  const cudaError_t err = CurrentDeviceSmCount(&sms);
  if (err != cudaSuccess) return err;
  const int64_t max_grid = static_cast<int64_t>(sms) * 8;
  return WithDType(out_dtype, [&](auto dt) {
    constexpr InputDType OutD = decltype(dt)::value;
    if (use_rowwise) {
      const int64_t blocks = (m * n + 255) / 256;
      DequantizeRowwiseKernel<OutD>
          <<<static_cast<int>(blocks < max_grid ? blocks : max_grid), 256, 0, stream>>>(a);
    } else {
      const int64_t tiles = ((m + 31) / 32) * ((n + 31) / 32);
      DequantizeColumnwiseKernel<OutD>
          <<<static_cast<int>(tiles < max_grid ? tiles : max_grid), 256, 0, stream>>>(a);
    }
    return cudaGetLastError();
  });
}

namespace detail {
cudaError_t QuantizeBlockTuned(const void* input, InputDType dtype, int64_t m, int64_t n,
                               const QuantizeParams& params, const QuantizedBuffers& out,
                               const LaunchTuning& tuning, cudaStream_t stream) {
  return QuantizeImpl(input, dtype, m, n, params, out, tuning, stream);
}

int TileCountersHeld() {
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return 0;
  CounterPool* const pool = DevicePool(dev);
  if (pool == nullptr) return 0;
  std::lock_guard<std::mutex> lock(pool->mu);
  return static_cast<int>(pool->slot_of.size());
}
}  // namespace detail

}  // namespace qtx::kernels::cuda
