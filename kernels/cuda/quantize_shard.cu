// CUDA exact all-gather building blocks (docs/numerics.md §5), bit-exact with
// kernels/cpu/quantize_shard.cc: the same block grid (global 128-row block
// rows), the same amax (kernels/fp8.h AmaxBitsUpdate: NaN ignored), scale
// (ComputeScale / ScaleInv: IEEE division) and the hardware cvt.rn.satfinite
// FP32 -> FP8 cast (proved equal to EncodeFp8 by tests/kernels/cuda).
// TENSOR (per-tensor current scaling) has one block, the whole tensor: its
// amax and cast are kernels/cuda/quantize_tensor.h's TensorAmax and
// QuantizeTensorWithAmax, and the assembly copies one scale_inv.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "kernels/block_geometry.h"
#include "kernels/cuda/quantize_block.h"
#include "kernels/cuda/quantize_shard.h"
#include "kernels/cuda/quantize_tensor.h"
#include "kernels/fp8.h"

namespace qtx::kernels::cuda {
namespace {

constexpr int kTile = 128;
constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kPitch = kTile + 1;  // staged tile row pitch (floats): conflict-free columns
constexpr int kSmemBytes = (kTile * kPitch + kTile + kWarps) * 4;

// fp8(RN_fp32(x * scale)): docs/numerics.md §2 step 8.
template <Fp8Format F>
__device__ __forceinline__ uint8_t Quant(float x, float scale) {
  const float v = __fmul_rn(x, scale);
  unsigned short r;
  if constexpr (F == Fp8Format::kE4M3) {
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(0.0f), "f"(v));
  } else {
    asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(r) : "f"(0.0f), "f"(v));
  }
  return static_cast<uint8_t>(r & 0xFF);
}

__device__ __forceinline__ uint32_t WarpMax(uint32_t v) { return __reduce_max_sync(~0u, v); }

struct ShardKernelArgs {
  const void* in;
  int64_t row_offset, m, n, nb, k0, first_block, last_block;
  uint8_t* qr;  // [m, n]
  float* sr;    // 1-D [nb, m]; 2-D [nk, nb]
  uint8_t* qc;  // [n, m]
  float* sc;    // 1-D [nk, n]; 2-D [nk, nb]
  const float* first;
  const float* last;
  float fp8_max, eps, value_for_inf;
  bool pow2, row, col;
};

__device__ __forceinline__ float Scale(uint32_t amax_bits, const ShardKernelArgs& a) {
  return ComputeScale(BitsToFloat(amax_bits), a.fp8_max, a.pow2, a.eps, a.value_for_inf);
}

// One CTA per (block row k0 + blockIdx.y, tile column blockIdx.x): the
// shard's rows of that global 128x128 tile are staged as FP32 in shared
// memory (zero beyond the tensor's columns), then
//  - 1-D rowwise: warp w takes rows w, w+8, ...; lane l columns l + 32t;
//  - 1-D columnwise: thread j < 128 reduces column j, then warp w writes
//    columns w, w+8, ... with lanes along the rows (contiguous in [n, m]);
//  - 2-D: one tile amax (block reduction), both copies written as above.
// Straddling block rows (the first and last) take the supplied amaxes.
template <InputDType D, Fp8Format F, BlockScaling S>
__global__ void __launch_bounds__(kThreads) QuantizeShardKernel(ShardKernelArgs a) {
  extern __shared__ float smem[];
  float* x = smem;                                                 // [kTile][kPitch]
  float* col_scale = smem + kTile * kPitch;                        // [kTile]
  uint32_t* red = reinterpret_cast<uint32_t*>(col_scale + kTile);  // [kWarps]
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t tj = blockIdx.x;
  const int64_t k = a.k0 + blockIdx.y;
  const int64_t lo = max(k * kTile, a.row_offset) - a.row_offset;
  const int64_t hi = min(k * kTile + kTile, a.row_offset + a.m) - a.row_offset;
  const int rows = static_cast<int>(hi - lo);
  const int64_t c0 = tj * kTile;
  const int cols = static_cast<int>(min(static_cast<int64_t>(kTile), a.n - c0));
  const float* ext = nullptr;
  if (k == a.first_block && a.first != nullptr) {
    ext = a.first;
  } else if (k == a.last_block && a.last != nullptr) {
    ext = a.last;
  }

  const int64_t base = lo * a.n + c0;
  for (int idx = tid; idx < rows * kTile; idx += kThreads) {
    const int i = idx >> 7, j = idx & (kTile - 1);
    x[i * kPitch + j] = j < cols ? LoadAs<D>(a.in, base + static_cast<int64_t>(i) * a.n + j) : 0.0f;
  }
  __syncthreads();

  float tile_scale = 1.0f;
  if constexpr (S == BlockScaling::kBlock2D) {
    uint32_t am = 0;
    for (int idx = tid; idx < rows * kTile; idx += kThreads) {
      am = AmaxBitsUpdate(am, x[(idx >> 7) * kPitch + (idx & (kTile - 1))]);
    }
    am = WarpMax(am);
    if (lane == 0) red[warp] = am;
    __syncthreads();
    am = red[0];
    for (int w = 1; w < kWarps; ++w) am = max(am, red[w]);
    if (ext != nullptr) am = FloatBits(ext[tj]);
    tile_scale = Scale(am, a);
    if (tid == 0) {
      const float inv = ScaleInv(tile_scale);
      const int64_t s = static_cast<int64_t>(blockIdx.y) * a.nb + tj;
      if (a.row) a.sr[s] = inv;
      if (a.col) a.sc[s] = inv;
    }
  }

  if (a.row) {
    for (int i = warp; i < rows; i += kWarps) {
      float scale = tile_scale;
      if constexpr (S == BlockScaling::kBlock1D) {
        uint32_t am = 0;
#pragma unroll
        for (int t = 0; t < 4; ++t) am = AmaxBitsUpdate(am, x[i * kPitch + lane + 32 * t]);
        am = WarpMax(am);
        scale = Scale(am, a);
        if (lane == 0) a.sr[tj * a.m + lo + i] = ScaleInv(scale);
      }
      uint8_t* out = a.qr + (lo + i) * a.n + c0;
#pragma unroll
      for (int t = 0; t < 4; ++t) {
        const int j = lane + 32 * t;
        if (j < cols) out[j] = Quant<F>(x[i * kPitch + j], scale);
      }
    }
  }

  if (a.col) {
    if constexpr (S == BlockScaling::kBlock1D) {
      if (tid < kTile) {
        uint32_t am = 0;
        for (int i = 0; i < rows; ++i) am = AmaxBitsUpdate(am, x[i * kPitch + tid]);
        if (ext != nullptr && tid < cols) am = FloatBits(ext[c0 + tid]);
        const float scale = Scale(am, a);
        col_scale[tid] = scale;
        if (tid < cols) a.sc[static_cast<int64_t>(blockIdx.y) * a.n + c0 + tid] = ScaleInv(scale);
      }
      __syncthreads();
    }
    for (int j = warp; j < cols; j += kWarps) {
      float scale = tile_scale;
      if constexpr (S == BlockScaling::kBlock1D) scale = col_scale[j];
      uint8_t* out = a.qc + (c0 + j) * a.m + lo;
      for (int i = lane; i < rows; i += 32) out[i] = Quant<F>(x[i * kPitch + j], scale);
    }
  }
}

// One CTA of 128 threads per (tile column blockIdx.x, boundary blockIdx.y:
// 0 = first block row, 1 = last); thread j reduces column 128 * x + j over
// the shard's rows of that block row.
template <InputDType D, BlockScaling S>
__global__ void __launch_bounds__(kTile)
    BoundaryAmaxKernel(const void* in, int64_t row_offset, int64_t m, int64_t n, float* first,
                       float* last) {
  __shared__ uint32_t red[kTile / 32];
  const int64_t k = blockIdx.y == 0 ? row_offset / kTile : (row_offset + m - 1) / kTile;
  const int64_t lo = max(k * kTile, row_offset) - row_offset;
  const int64_t hi = min(k * kTile + kTile, row_offset + m) - row_offset;
  const int64_t col = static_cast<int64_t>(blockIdx.x) * kTile + threadIdx.x;
  uint32_t am = 0;
  if (col < n) {
    for (int64_t i = lo; i < hi; ++i) am = AmaxBitsUpdate(am, LoadAs<D>(in, i * n + col));
  }
  float* out = blockIdx.y == 0 ? first : last;
  if constexpr (S == BlockScaling::kBlock1D) {
    if (col < n) out[col] = BitsToFloat(am);
  } else {
    am = WarpMax(am);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = am;
    __syncthreads();
    if (threadIdx.x == 0) {
      uint32_t v = red[0];
      for (int w = 1; w < kTile / 32; ++w) v = max(v, red[w]);
      out[blockIdx.x] = BitsToFloat(v);
    }
  }
}

// 2-D columnwise scales: out[tj * ld + k0 + kk] = s[kk * nb + tj]; one
// thread per shard tile.
__global__ void TransposeTileScalesKernel(const float* s, int64_t nk, int64_t nb, int64_t k0,
                                          int64_t ld, float* out) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= nk * nb) return;
  const int64_t kk = t / nb, tj = t - kk * nb;
  out[tj * ld + k0 + kk] = s[t];
}

// 1-D rowwise scales of the gathered tensor in one pass: out is [nb, pitch]
// (pitch = pad4(M)); rank r's shard scales are [nb, m_r], dense, and land in
// columns [begin[r], begin[r + 1]); the padding columns get 0. Replaces a
// memset plus one 2-D copy per rank (launch latency on the all-gather's
// critical path).
constexpr int kMaxAssembleRanks = 64;
struct RowScaleSources {
  const float* src[kMaxAssembleRanks];
  int64_t begin[kMaxAssembleRanks + 1];
};
__global__ void AssembleRowScales1DKernel(const RowScaleSources s, float* out, int64_t nb,
                                          int64_t pitch, int64_t m) {
  const int64_t total = nb * pitch;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t tn = i / pitch, col = i - tn * pitch;
    float v = 0.0f;
    if (col < m) {
      int r = 0;
      while (col >= s.begin[r + 1]) ++r;  // empty shards are skipped: begin[r] == begin[r + 1]
      const int64_t rows = s.begin[r + 1] - s.begin[r];
      v = s.src[r][tn * rows + (col - s.begin[r])];
    }
    out[i] = v;
  }
}

// CombineBoundaryAmax: which gathered vectors (2r: rank r's first, 2r + 1:
// its last) feed this rank's first (which = 0) and last (which = 1) block
// row; passed by value (about 1 KiB of kernel parameters).
struct AmaxSources {
  int count[2];
  int32_t vec[2][kMaxAmaxSources];
};
// One thread per column (1-D) or tile column (2-D): out = max over sources
// in the order of kernels/cpu CombineBoundaryAmax, starting from 0 and
// keeping std::max's (a < b ? b : a), so the bits match.
__global__ void CombineBoundaryAmaxKernel(const AmaxSources s, const float* __restrict__ gathered,
                                          int64_t len, float* __restrict__ first_out,
                                          float* __restrict__ last_out) {
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; j < len;
       j += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    for (int which = 0; which < 2; ++which) {
      float acc = 0.0f;
      for (int i = 0; i < s.count[which]; ++i) {
        const float v = gathered[static_cast<int64_t>(s.vec[which][i]) * len + j];
        acc = acc < v ? v : acc;
      }
      (which == 0 ? first_out : last_out)[j] = acc;
    }
  }
}

// CombineBoundaryAmax for TENSOR: the ranks whose shard is not empty (bit r
// of `nonempty`), whose one gathered "first" float (gathered[2r]) feeds the
// tensor's amax; passed by value (1 KiB of kernel parameters).
struct TensorAmaxRanks {
  uint32_t nonempty[kMaxTensorAmaxRanks / 32];
};
// One warp: out = max of those floats. They are amaxes (>= +0, not NaN), whose
// max does not depend on the order, so fmaxf in any order gives the bits of
// the CPU's std::max in rank order.
__global__ void __launch_bounds__(32)
    CombineTensorAmaxKernel(const TensorAmaxRanks s, int world_size,
                            const float* __restrict__ gathered, float* first_out, float* last_out) {
  float acc = 0.0f;
  for (int r = threadIdx.x; r < world_size; r += 32) {
    if ((s.nonempty[r >> 5] >> (r & 31)) & 1u) acc = fmaxf(acc, gathered[2 * r]);
  }
#pragma unroll
  for (int mask = 16; mask > 0; mask >>= 1) acc = fmaxf(acc, __shfl_xor_sync(~0u, acc, mask));
  if (threadIdx.x == 0) first_out[0] = last_out[0] = acc;
}

// AssembleShards for TENSOR: the [1] scale_inv of each requested copy (null:
// not requested) from the first non-empty shard's (null src: none, `empty`).
__global__ void TensorScaleInvKernel(const float* src_row, const float* src_col, float empty,
                                     float* row, float* col) {
  if (row != nullptr) row[0] = src_row != nullptr ? src_row[0] : empty;
  if (col != nullptr) col[0] = src_col != nullptr ? src_col[0] : empty;
}

template <InputDType D, Fp8Format F, BlockScaling S>
cudaError_t LaunchShard(const ShardKernelArgs& a, dim3 grid, cudaStream_t stream) {
  auto kernel = QuantizeShardKernel<D, F, S>;
  // kSmemBytes > 48 KiB needs the opt-in, which is per device (per context):
  // set it at every launch (a cheap host call), never once per process, so
  // that a process driving several GPUs (one thread per GPU) can launch on
  // each of them.
  const cudaError_t attr =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
  if (attr != cudaSuccess) return attr;
  kernel<<<grid, kThreads, kSmemBytes, stream>>>(a);
  return cudaGetLastError();
}

template <InputDType D>
cudaError_t DispatchShard(const ShardKernelArgs& a, Fp8Format f, BlockScaling s, dim3 grid,
                          cudaStream_t stream) {
  const bool e4m3 = f == Fp8Format::kE4M3;
  if (s == BlockScaling::kBlock1D) {
    return e4m3 ? LaunchShard<D, Fp8Format::kE4M3, BlockScaling::kBlock1D>(a, grid, stream)
                : LaunchShard<D, Fp8Format::kE5M2, BlockScaling::kBlock1D>(a, grid, stream);
  }
  return e4m3 ? LaunchShard<D, Fp8Format::kE4M3, BlockScaling::kBlock2D>(a, grid, stream)
              : LaunchShard<D, Fp8Format::kE5M2, BlockScaling::kBlock2D>(a, grid, stream);
}

template <InputDType D>
void LaunchBoundary(bool one_d, dim3 grid, const void* in, const ShardGeometry& g, float* first,
                    float* last, cudaStream_t stream) {
  if (one_d) {
    BoundaryAmaxKernel<D, BlockScaling::kBlock1D>
        <<<grid, kTile, 0, stream>>>(in, g.row_offset, g.m, g.n, first, last);
  } else {
    BoundaryAmaxKernel<D, BlockScaling::kBlock2D>
        <<<grid, kTile, 0, stream>>>(in, g.row_offset, g.m, g.n, first, last);
  }
}

bool ValidEnums(InputDType d, BlockScaling s) {
  const bool dt =
      d == InputDType::kFloat32 || d == InputDType::kBFloat16 || d == InputDType::kFloat16;
  return dt &&
         (s == BlockScaling::kBlock1D || s == BlockScaling::kBlock2D || s == BlockScaling::kTensor);
}

// QuantizeShard for TENSOR: the cast with the combined amax `amax`, or (null)
// with the shard's own, computed first into a stream-ordered temporary. As in
// the CPU reference, an empty shard still gets its scale_inv.
cudaError_t QuantizeTensorShard(const void* input, InputDType dtype, const ShardGeometry& g,
                                const QuantizeParams& p, const float* amax,
                                const QuantizedBuffers& out, cudaStream_t stream) {
  if (!p.rowwise && !p.columnwise) return cudaSuccess;
  if (amax != nullptr) return QuantizeTensorWithAmax(input, dtype, g.m, g.n, amax, p, out, stream);
  if (g.n > 0 && g.m > INT64_MAX / g.n) return cudaErrorInvalidValue;
  float* own = nullptr;
  cudaError_t e = cudaMallocAsync(reinterpret_cast<void**>(&own), sizeof(float), stream);
  if (e != cudaSuccess) return e;
  e = TensorAmax(input, dtype, g.m * g.n, own, stream);
  if (e == cudaSuccess) e = QuantizeTensorWithAmax(input, dtype, g.m, g.n, own, p, out, stream);
  const cudaError_t f = cudaFreeAsync(own, stream);
  return e != cudaSuccess ? e : f;
}

}  // namespace

cudaError_t ShardBoundaryAmax(const void* input, InputDType dtype, const ShardGeometry& g,
                              BlockScaling scaling, float* first, float* last,
                              cudaStream_t stream) {
  if (g.m < 0 || g.n < 0 || g.row_offset < 0 || !ValidEnums(dtype, scaling)) {
    return cudaErrorInvalidValue;
  }
  if (g.m == 0) return cudaSuccess;
  if (first == nullptr || last == nullptr || (g.n > 0 && input == nullptr)) {
    return cudaErrorInvalidValue;
  }
  if (scaling == BlockScaling::kTensor) {  // the whole shard's amax, twice
    if (g.n > 0 && g.m > INT64_MAX / g.n) return cudaErrorInvalidValue;
    const cudaError_t e = TensorAmax(input, dtype, g.m * g.n, first, stream);
    if (e != cudaSuccess) return e;
    return cudaMemcpyAsync(last, first, sizeof(float), cudaMemcpyDeviceToDevice, stream);
  }
  const int64_t nb = g.nb();
  if (nb == 0) return cudaSuccess;
  if (nb > INT32_MAX) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(nb), 2);
  const bool one_d = scaling == BlockScaling::kBlock1D;
  switch (dtype) {
    case InputDType::kFloat32:
      LaunchBoundary<InputDType::kFloat32>(one_d, grid, input, g, first, last, stream);
      break;
    case InputDType::kBFloat16:
      LaunchBoundary<InputDType::kBFloat16>(one_d, grid, input, g, first, last, stream);
      break;
    case InputDType::kFloat16:
      LaunchBoundary<InputDType::kFloat16>(one_d, grid, input, g, first, last, stream);
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

cudaError_t QuantizeShard(const void* input, InputDType dtype, const ShardGeometry& g,
                          const QuantizeParams& p, const float* first_amax, const float* last_amax,
                          const QuantizedBuffers& out, cudaStream_t stream) {
  if (g.m < 0 || g.n < 0 || g.row_offset < 0 || !ValidEnums(dtype, p.scaling) ||
      (p.format != Fp8Format::kE4M3 && p.format != Fp8Format::kE5M2) || !(p.amax_epsilon >= 0.0f) ||
      IsInf(p.amax_epsilon)) {
    return cudaErrorInvalidValue;
  }
  if (p.scaling == BlockScaling::kTensor) {
    return QuantizeTensorShard(input, dtype, g, p, first_amax, out, stream);
  }
  if (g.m == 0 || g.n == 0) return cudaSuccess;
  if (input == nullptr ||
      (p.rowwise && (out.rowwise_data == nullptr || out.rowwise_scale_inv == nullptr)) ||
      (p.columnwise && (out.columnwise_data == nullptr || out.columnwise_scale_inv == nullptr))) {
    return cudaErrorInvalidValue;
  }
  if (!p.rowwise && !p.columnwise) return cudaSuccess;
  const bool one_d = p.scaling == BlockScaling::kBlock1D;
  if (one_d && !p.columnwise) {
    // Rowwise 1x128 blocks never straddle ranks: the shard layout is the
    // fused kernel's [m, n] + [nb, pad4(m)] scales, with pitch m for the
    // scales. Equal pitches (m % 4 == 0) write in place; otherwise through a
    // stream-ordered temporary.
    const int64_t nb = g.nb();
    const int64_t pitch = Pad4(g.m);
    QuantizedBuffers o;
    o.rowwise_data = out.rowwise_data;
    if (pitch == g.m) {
      o.rowwise_scale_inv = out.rowwise_scale_inv;
      return QuantizeBlock(input, dtype, g.m, g.n, p, o, stream);
    }
    void* tmp = nullptr;
    cudaError_t e = cudaMallocAsync(&tmp, static_cast<size_t>(4 * nb * pitch), stream);
    if (e != cudaSuccess) return e;
    o.rowwise_scale_inv = static_cast<float*>(tmp);
    e = QuantizeBlock(input, dtype, g.m, g.n, p, o, stream);
    if (e == cudaSuccess) {
      e = cudaMemcpy2DAsync(out.rowwise_scale_inv, 4 * g.m, tmp, 4 * pitch, 4 * g.m, nb,
                            cudaMemcpyDeviceToDevice, stream);
    }
    const cudaError_t f = cudaFreeAsync(tmp, stream);
    return e != cudaSuccess ? e : f;
  }
  const int64_t nb = g.nb(), nk = g.num_block_rows();
  if (nb > INT32_MAX || nk > 65535) return cudaErrorInvalidValue;
  ShardKernelArgs a;
  a.in = input;
  a.row_offset = g.row_offset;
  a.m = g.m;
  a.n = g.n;
  a.nb = nb;
  a.k0 = g.first_block();
  a.first_block = g.first_block();
  a.last_block = g.last_block();
  a.qr = out.rowwise_data;
  a.sr = out.rowwise_scale_inv;
  a.qc = out.columnwise_data;
  a.sc = out.columnwise_scale_inv;
  a.first = first_amax;
  a.last = last_amax;
  a.fp8_max = Fp8Max(p.format);
  a.eps = p.amax_epsilon;
  a.value_for_inf = InputDTypeMax(dtype);
  a.pow2 = p.force_pow2_scales;
  a.row = p.rowwise;
  a.col = p.columnwise;
  const dim3 grid(static_cast<unsigned>(nb), static_cast<unsigned>(nk));
  switch (dtype) {
    case InputDType::kFloat32:
      return DispatchShard<InputDType::kFloat32>(a, p.format, p.scaling, grid, stream);
    case InputDType::kBFloat16:
      return DispatchShard<InputDType::kBFloat16>(a, p.format, p.scaling, grid, stream);
    case InputDType::kFloat16:
      return DispatchShard<InputDType::kFloat16>(a, p.format, p.scaling, grid, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t CombineBoundaryAmax(int world_size, const ShardGeometry* geoms, const float* gathered,
                                int64_t len, int rank, BlockScaling scaling, float* first_out,
                                float* last_out, cudaStream_t stream) {
  // 1-D and 2-D: the vectors' meaning (columns or tile columns) does not
  // change the max.
  const bool tensor = scaling == BlockScaling::kTensor;
  if (world_size < 1 || rank < 0 || rank >= world_size || len < 0 || geoms == nullptr ||
      (tensor && (len != 1 || world_size > kMaxTensorAmaxRanks))) {
    return cudaErrorInvalidValue;
  }
  const ShardGeometry& me = geoms[rank];
  if (me.m == 0 || len == 0) return cudaSuccess;
  if (gathered == nullptr || first_out == nullptr || last_out == nullptr) {
    return cudaErrorInvalidValue;
  }
  if (tensor) {  // one block, shared by every rank
    TensorAmaxRanks s{};
    for (int r = 0; r < world_size; ++r) {
      if (geoms[r].m > 0) s.nonempty[r / 32] |= 1u << (r % 32);
    }
    CombineTensorAmaxKernel<<<1, 32, 0, stream>>>(s, world_size, gathered, first_out, last_out);
    return cudaGetLastError();
  }
  AmaxSources s{};
  for (int which = 0; which < 2; ++which) {
    const int64_t k = which == 0 ? me.first_block() : me.last_block();
    for (int r = 0; r < world_size; ++r) {
      if (geoms[r].m == 0) continue;
      int32_t v = -1;
      if (geoms[r].first_block() == k) {
        v = 2 * r;
      } else if (geoms[r].last_block() == k) {
        v = 2 * r + 1;
      }
      if (v < 0) continue;
      if (s.count[which] == kMaxAmaxSources) return cudaErrorInvalidValue;
      s.vec[which][s.count[which]++] = v;
    }
  }
  constexpr int kCombineThreads = 256;
  const int64_t blocks = std::min<int64_t>((len + kCombineThreads - 1) / kCombineThreads, 1024);
  CombineBoundaryAmaxKernel<<<static_cast<unsigned>(blocks), kCombineThreads, 0, stream>>>(
      s, gathered, len, first_out, last_out);
  return cudaGetLastError();
}

cudaError_t AssembleShards(int world_size, const ShardGeometry* geoms,
                           const QuantizedConstBuffers* shards, const QuantizeParams& p,
                           const QuantizedBuffers& out, cudaStream_t stream) {
  const bool tensor = p.scaling == BlockScaling::kTensor;
  if (world_size < 0 || (world_size > 0 && (geoms == nullptr || shards == nullptr)) ||
      (p.scaling != BlockScaling::kBlock1D && p.scaling != BlockScaling::kBlock2D && !tensor) ||
      (tensor && p.format != Fp8Format::kE4M3 && p.format != Fp8Format::kE5M2)) {
    return cudaErrorInvalidValue;
  }
  int64_t m = 0;
  for (int r = 0; r < world_size; ++r) m += geoms[r].m;
  const int64_t n = world_size > 0 ? geoms[0].n : 0;
  const int64_t nb = CeilDiv(n, kTile);
  const QuantizedLayout l = ComputeLayout(p.scaling, m, n);
  const bool one_d = p.scaling == BlockScaling::kBlock1D;
  cudaError_t e = cudaSuccess;
  auto ok = [&](cudaError_t x) {
    if (e == cudaSuccess) e = x;
    return e == cudaSuccess;
  };
  // 1-D rowwise scales in one kernel (padding included) when the ranks fit in
  // its argument block; otherwise a memset and a 2-D copy per rank.
  const bool row_scales_in_one_pass =
      p.rowwise && one_d && world_size <= kMaxAssembleRanks && l.RowwiseScaleCount() > 0;
  if (tensor) {
    // [1] scales, no padding. Every non-empty shard was cast with the same
    // combined amax: its scale_inv is the tensor's. With none, the tensor's
    // amax is 0 (its scale_inv from the host, as a kernel argument).
    const QuantizedConstBuffers* src = nullptr;
    for (int r = 0; r < world_size && src == nullptr; ++r) {
      if (geoms[r].m > 0 && n > 0) src = &shards[r];
    }
    const float empty = ScaleInv(TensorScale(0.0f, p.format, p.force_pow2_scales, p.amax_epsilon));
    TensorScaleInvKernel<<<1, 1, 0, stream>>>(src != nullptr ? src->rowwise_scale_inv : nullptr,
                                              src != nullptr ? src->columnwise_scale_inv : nullptr,
                                              empty, p.rowwise ? out.rowwise_scale_inv : nullptr,
                                              p.columnwise ? out.columnwise_scale_inv : nullptr);
    if (!ok(cudaGetLastError())) return e;
  } else {
    if (p.rowwise && !row_scales_in_one_pass && l.RowwiseScaleCount() > 0 &&
        !ok(cudaMemsetAsync(out.rowwise_scale_inv, 0, 4 * l.RowwiseScaleCount(), stream))) {
      return e;
    }
    if (p.columnwise && l.ColumnwiseScaleCount() > 0 &&
        !ok(cudaMemsetAsync(out.columnwise_scale_inv, 0, 4 * l.ColumnwiseScaleCount(), stream))) {
      return e;
    }
  }
  for (int r = 0; r < world_size; ++r) {
    const ShardGeometry& g = geoms[r];
    const QuantizedConstBuffers& s = shards[r];
    if (g.m == 0 || n == 0) continue;
    const int64_t o = g.row_offset, k0 = g.first_block(), nk = g.num_block_rows();
    if (p.rowwise) {
      if (out.rowwise_data + o * n != s.rowwise_data &&
          !ok(cudaMemcpyAsync(out.rowwise_data + o * n, s.rowwise_data, g.m * n,
                              cudaMemcpyDeviceToDevice, stream))) {
        return e;
      }
      if (tensor) {
        // scale_inv[0]: above.
      } else if (one_d) {
        if (!row_scales_in_one_pass) {
          ok(cudaMemcpy2DAsync(out.rowwise_scale_inv + o, 4 * l.rowwise_scale_cols,
                               s.rowwise_scale_inv, 4 * g.m, 4 * g.m, nb, cudaMemcpyDeviceToDevice,
                               stream));
        }
      } else {
        ok(cudaMemcpy2DAsync(out.rowwise_scale_inv + k0 * l.rowwise_scale_cols,
                             4 * l.rowwise_scale_cols, s.rowwise_scale_inv, 4 * nb, 4 * nb, nk,
                             cudaMemcpyDeviceToDevice, stream));
      }
      if (e != cudaSuccess) return e;
    }
    if (p.columnwise) {
      if (!ok(cudaMemcpy2DAsync(out.columnwise_data + o, m, s.columnwise_data, g.m, g.m, n,
                                cudaMemcpyDeviceToDevice, stream))) {
        return e;
      }
      if (tensor) {
        // scale_inv[0]: above.
      } else if (one_d) {
        ok(cudaMemcpy2DAsync(out.columnwise_scale_inv + k0 * l.columnwise_scale_cols,
                             4 * l.columnwise_scale_cols, s.columnwise_scale_inv, 4 * n, 4 * n, nk,
                             cudaMemcpyDeviceToDevice, stream));
      } else {
        const int64_t count = nk * nb;
        const int threads = 256;
        TransposeTileScalesKernel<<<static_cast<unsigned>(CeilDiv(count, threads)), threads, 0,
                                    stream>>>(s.columnwise_scale_inv, nk, nb, k0,
                                              l.columnwise_scale_cols, out.columnwise_scale_inv);
        ok(cudaGetLastError());
      }
      if (e != cudaSuccess) return e;
    }
  }
  if (row_scales_in_one_pass) {
    RowScaleSources src = {};
    src.begin[0] = 0;
    for (int r = 0; r < world_size; ++r) {
      src.src[r] = shards[r].rowwise_scale_inv;
      src.begin[r + 1] = src.begin[r] + geoms[r].m;
    }
    const int64_t total = nb * l.rowwise_scale_cols;
    const int threads = 256;
    const int64_t blocks = std::min<int64_t>(CeilDiv(total, threads), 4096);
    AssembleRowScales1DKernel<<<static_cast<unsigned>(blocks), threads, 0, stream>>>(
        src, out.rowwise_scale_inv, nb, l.rowwise_scale_cols, m);
    ok(cudaGetLastError());
  }
  return e;
}

}  // namespace qtx::kernels::cuda
