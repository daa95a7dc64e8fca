// AllGatherParameter op: the all-gather of an FP8 parameter that is already
// quantized with 128x128 blocks and split across the ranks at arbitrary
// element offsets (docs/numerics.md §10, "The FP8 parameter all-gather"), over
// the Device and Communicator interfaces. No gRPC, no protobuf, no Gloo.
//
// Rank r holds the FP8 bytes of elements [b_r, e_r) of the row-major
// flattened [M, N] rowwise data (as a data-parallel sharded Optimizer.Step
// returns them: tiles cut by a range boundary already carry the scale of the
// whole tile) and the whole parameter's rowwise scale_inv. Every rank ends
// with the whole rowwise copy: data [M, N] (rank r's bytes at [b_r, e_r)) and
// the scale_inv, byte-identical to quantizing the whole parameter with
// BLOCK_2D. Nothing is quantized here: the bytes are moved, never recomputed.
//
// Protocol (each step on every rank, in this order, so that a failure on one
// rank is reported on all of them instead of leaving peers waiting):
//  1. local validation: config (BLOCK_2D), shape, range within [0, M*N), the
//     data's dtype and size, the scale tensor's dtype and shape, outputs
//     (rowwise only), events; then the 64-bit FNV-1a digest of the scale
//     bytes (after the client's wait event);
//  2. one small all-gather of a fixed-size header per rank: sequence,
//     shape, config, scale digest, range and this rank's verdict;
//  3. the verdict, the same on every rank: a rank whose request was bad
//     fails every rank with its error (naming it); then any field in which
//     a rank differs from rank 0 (sequence, shape, config.scaling_mode,
//     config.format, config.force_pow2_scales, config.amax_epsilon,
//     shard.rowwise_scale_inv) fails every rank with INVALID_ARGUMENT naming
//     the field and the rank; then ranges that do not cover [0, M*N) exactly
//     once (a gap, an overlap) likewise. No output is written before;
//  4. one variable-size all-gather of the data bytes (e_r - b_r per rank):
//     straight into the output when the ranges follow rank order (in place
//     when this rank's shard already lies at its place in the output), else
//     into a temporary buffer, whose rank pieces are then copied to their
//     offsets; the scales are copied from this rank's (agreed) tensor.
//
// Thread safety: runs on the group's executor; one call per communicator at
// a time.
#ifndef QTX_SERVER_OPS_PARAM_ALLGATHER_H_
#define QTX_SERVER_OPS_PARAM_ALLGATHER_H_

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/element_range.h"
#include "server/backend/communicator.h"
#include "server/ops/quantize.h"

namespace qtx::server::ops {

struct ParamAllGatherRequestSpec {
  std::string group;  // for messages
  uint64_t sequence = 0;
  std::string name;  // the parameter's name, for messages only (may be empty)
  // The whole parameter's shape (leading dims flattened into M).
  std::vector<int64_t> shape;
  // scaling (must be kBlock2D), format, force_pow2_scales, amax_epsilon:
  // compared across ranks. rowwise / columnwise are not read.
  kernels::QuantizeParams params;
  kernels::ElementRange range;                     // this rank's elements [begin, end)
  std::optional<tensor::TensorRefSpec> data;       // end - begin FP8 bytes
  std::optional<tensor::TensorRefSpec> scale_inv;  // the whole rowwise scale_inv
  bool has_columnwise_data = false;                // refused: rowwise only
  QuantizeOutputSpecs outputs;                     // rowwise slices only
  // Optional interprocess events (CUDA device only): the shard is read after
  // wait_event; signal_event is recorded once the outputs are written.
  backend::CudaEvents events;
  // Set by the caller when the request could not even be parsed; the op then
  // still takes part in the header exchange, so every rank fails with it.
  absl::Status request_error;
};

struct ParamAllGatherResult {
  // The whole parameter, rowwise copy only: data [M, N], scale_inv
  // [ceil(M/128), pad4(ceil(N/128))]; source_dtype FLOAT32; params as the
  // request's with rowwise = true, columnwise = false.
  QuantizeResult result;
  std::vector<kernels::ElementRange> ranges;  // every rank's, in rank order
  // How the data moved (for tests and logs): straight into the output, and
  // with this rank's shard already at its place there.
  bool direct = false;
  bool in_place = false;
};

// Runs one parameter all-gather. Errors: INVALID_ARGUMENT for this rank's bad
// request (naming the field) and for any disagreement between the ranks
// (naming the field and the rank) or ranges that do not tile [0, M*N);
// NOT_FOUND for an unknown region; FAILED_PRECONDITION for memory or events
// the device cannot use; another rank's error (naming the rank) when its
// request was rejected; RESOURCE_EXHAUSTED for inline outputs above the
// budget; the communicator's errors (DEADLINE_EXCEEDED, UNAVAILABLE,
// ABORTED), after which `*group_broken` is set: the ranks may be out of step
// and the group must not be used again.
absl::StatusOr<ParamAllGatherResult> AllGatherParameter(const ParamAllGatherRequestSpec& request,
                                                        const OpContext& ctx,
                                                        backend::Communicator& comm,
                                                        const backend::CommCall& call,
                                                        bool* group_broken);

// 64-bit FNV-1a of `bytes` (a fixed function: the same on every rank and
// build), the digest the ranks compare their scale tensors by.
uint64_t ScaleDigest(std::span<const std::byte> bytes);

}  // namespace qtx::server::ops

#endif  // QTX_SERVER_OPS_PARAM_ALLGATHER_H_
