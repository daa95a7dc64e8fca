// CUDA building blocks of the exact all-gather (docs/numerics.md §5), bit-exact
// with kernels/cpu/quantize_shard.h (ShardBoundaryAmax, QuantizeShard,
// AssembleShards). Plain header: CUDA runtime types only.
//
// All pointers are device pointers, except `geoms` / `shards` of
// AssembleShards, which are host arrays (of device pointers). Shard buffers
// use the shard layout of kernels/shard_geometry.h. Work is enqueued on
// `stream`; nothing synchronizes. Empty shards launch nothing, except in
// TENSOR's QuantizeShard, which writes their scale_inv as the CPU does.
//
// TENSOR (per-tensor current scaling) follows the same protocol with one
// block, the whole tensor: each boundary "vector" is one float, the amax of
// the whole shard (first == last), every non-empty rank combines all of them,
// and each shard is cast with the scale of that combined amax
// (kernels/cuda/quantize_tensor.h QuantizeTensorWithAmax).
#ifndef QTX_KERNELS_CUDA_QUANTIZE_SHARD_H_
#define QTX_KERNELS_CUDA_QUANTIZE_SHARD_H_

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/quantize_params.h"
#include "kernels/shard_geometry.h"

namespace qtx::kernels::cuda {

// Partial amaxes of the shard's first and last block rows (per column for
// 1-D, per tile column for 2-D), BoundaryAmaxLength(scaling, g) floats each.
// TENSOR: first[0] = last[0] = the amax of the whole shard (TensorAmax, then a
// 4-byte device copy; stream-ordered temporaries as quantize_tensor.h says).
// cudaErrorInvalidValue for a negative size, an unknown enum or null outputs.
cudaError_t ShardBoundaryAmax(const void* input, InputDType dtype, const ShardGeometry& g,
                              BlockScaling scaling, float* first, float* last, cudaStream_t stream);

// Quantizes the shard with the combined boundary amaxes (device vectors, as
// for kernels::cpu::QuantizeShard; ignored by 1-D rowwise). A null vector
// means the shard's own rows are the whole boundary block row (the one-round
// all-gather's interiors and rebuilt block rows, kernels/one_round_plan.h):
// its amaxes are the local ones, as in the CPU reference. The 1-D
// rowwise-only case runs the fused kernels/cuda QuantizeBlock kernel (a
// rowwise block never straddles ranks). TENSOR: first_amax[0] is the whole
// tensor's amax (last_amax is not read; null first_amax: the shard's own,
// computed first with TensorAmax) and QuantizeTensorWithAmax casts the shard;
// it writes the [1] scale_inv of each requested copy, also for an empty shard
// (whose scale_inv buffers must then be non-null; AssembleShards ignores it).
// cudaErrorInvalidValue for bad arguments (null requested buffer, unknown
// enums, too many tiles).
cudaError_t QuantizeShard(const void* input, InputDType dtype, const ShardGeometry& g,
                          const QuantizeParams& params, const float* first_amax,
                          const float* last_amax, const QuantizedBuffers& out, cudaStream_t stream);

// This rank's combined boundary amaxes from every rank's partial ones, on
// the device, bit-exact with kernels::cpu::CombineBoundaryAmax: `gathered`
// holds per rank r (rank order) r's first then last vector of `len` floats
// ([world_size][2][len], as gathered by the communicator); first_out /
// last_out get `len` floats each (0 where no rank contributes). `geoms` is a
// host array. Nothing is launched for an empty shard of this rank.
// TENSOR: len is 1 and both outputs get the max of every non-empty rank's
// first float (one warp; any number of contributors up to
// kMaxTensorAmaxRanks ranks).
// cudaErrorInvalidValue for a bad rank, negative len, null pointers, or more
// than kMaxAmaxSources contributors to one block row (impossible for
// contiguous shards: each contributor owns >= 1 of the block's 128 rows);
// TENSOR: also for len != 1 or world_size > kMaxTensorAmaxRanks.
inline constexpr int kMaxAmaxSources = 128;
inline constexpr int kMaxTensorAmaxRanks = 8192;
cudaError_t CombineBoundaryAmax(int world_size, const ShardGeometry* geoms, const float* gathered,
                                int64_t len, int rank, BlockScaling scaling, float* first_out,
                                float* last_out, cudaStream_t stream);

// Writes the GEMM-ready [sum m, N] tensor from every rank's shard buffers
// (stream-ordered copies and one small transpose kernel); scale padding is
// zeroed. A shard whose rowwise data already lies at its place in
// out.rowwise_data (an in-place gather) is not copied. TENSOR: the data as
// for the blocks; scale_inv[0] of each requested copy from the first shard
// with m > 0 and n > 0 (all non-empty shards hold the same one), or with none
// that of amax 0 (one one-thread kernel either way).
// REQUIRES: geoms in rank order with contiguous row offsets.
cudaError_t AssembleShards(int world_size, const ShardGeometry* geoms,
                           const QuantizedConstBuffers* shards, const QuantizeParams& params,
                           const QuantizedBuffers& out, cudaStream_t stream);

}  // namespace qtx::kernels::cuda

#endif  // QTX_KERNELS_CUDA_QUANTIZE_SHARD_H_
