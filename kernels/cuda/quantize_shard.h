// CUDA building blocks of the exact all-gather (docs/numerics.md §5), bit-exact
// with kernels/cpu/quantize_shard.h (ShardBoundaryAmax, QuantizeShard,
// AssembleShards). Plain header: CUDA runtime types only.
//
// All pointers are device pointers, except `geoms` / `shards` of
// AssembleShards, which are host arrays (of device pointers). Shard buffers
// use the shard layout of kernels/shard_geometry.h. Work is enqueued on
// `stream`; nothing synchronizes. Empty shards launch nothing.
#ifndef QTX_KERNELS_CUDA_QUANTIZE_SHARD_H_
#define QTX_KERNELS_CUDA_QUANTIZE_SHARD_H_

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/quantize_params.h"
#include "kernels/shard_geometry.h"

namespace qtx::kernels::cuda {

// Partial amaxes of the shard's first and last block rows (per column for
// 1-D, per tile column for 2-D), BoundaryAmaxLength(scaling, g) floats each.
// cudaErrorInvalidValue for a negative size, an unknown enum or null outputs.
cudaError_t ShardBoundaryAmax(const void* input, InputDType dtype, const ShardGeometry& g,
                              BlockScaling scaling, float* first, float* last, cudaStream_t stream);

// Quantizes the shard with the combined boundary amaxes (device vectors, as
// for kernels::cpu::QuantizeShard; ignored by 1-D rowwise). A null vector
// means the shard's own rows are the whole boundary block row (the one-round
// all-gather's interiors and rebuilt block rows, kernels/one_round_plan.h):
// its amaxes are the local ones, as in the CPU reference. The 1-D
// rowwise-only case runs the fused kernels/cuda QuantizeBlock kernel (a
// rowwise block never straddles ranks).
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
// cudaErrorInvalidValue for a bad rank, negative len, null pointers, or more
// than kMaxAmaxSources contributors to one block row (impossible for
// contiguous shards: each contributor owns >= 1 of the block's 128 rows).
inline constexpr int kMaxAmaxSources = 128;
cudaError_t CombineBoundaryAmax(int world_size, const ShardGeometry* geoms, const float* gathered,
                                int64_t len, int rank, BlockScaling scaling, float* first_out,
                                float* last_out, cudaStream_t stream);

// Writes the GEMM-ready [sum m, N] tensor from every rank's shard buffers
// (stream-ordered copies and one small transpose kernel); scale padding is
// zeroed. A shard whose rowwise data already lies at its place in
// out.rowwise_data (an in-place gather) is not copied.
// REQUIRES: geoms in rank order with contiguous row offsets.
cudaError_t AssembleShards(int world_size, const ShardGeometry* geoms,
                           const QuantizedConstBuffers* shards, const QuantizeParams& params,
                           const QuantizedBuffers& out, cudaStream_t stream);

}  // namespace qtx::kernels::cuda

#endif  // QTX_KERNELS_CUDA_QUANTIZE_SHARD_H_
