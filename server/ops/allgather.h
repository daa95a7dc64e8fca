// AllGather op: the exact block-scaled FP8 all-gather of docs/numerics.md §5 over
// the Device and Communicator interfaces. No gRPC, no protobuf, no Gloo.
//
// Every rank of a group calls AllGather with its row shard [M_r, N] (M_r may
// be 0 and need not be a multiple of 128); every rank ends with the quantized
// [sum M_r, N] tensor, byte-identical to Quantize(concat(shards)).
//
// Protocol (each step on every rank, in this order, so that a failure on one
// rank is reported on all of them instead of leaving peers waiting):
//  1. local validation (config, dtype, shape, output slices named);
//  2. header exchange: (sequence, N, dtype, mode, scaling, format, usages,
//     pow2, epsilon, M_r, local status). A rank whose request was bad fails
//     every rank; a field that differs fails every rank with INVALID_ARGUMENT
//     naming the field and the first rank that disagrees with rank 0;
//  3. output placement against the agreed M = sum M_r, plus (EXACT_FP8) the
//     partial amaxes of the shard's boundary block rows; both exchanged in
//     one small all-gather, so an output error on one rank fails all ranks.
//     Skipped when every rank resolved its outputs before step 2 (tensors
//     in the device's memory, no staging): the slice sizes then travel in
//     the headers, and the amaxes are all-gathered on the device in step 4
//     and combined there (Device::CombineBoundaryAmax), never on the host;
//  4. EXACT_FP8: combine amaxes, quantize the shard into the shard layout
//     (its rowwise data straight into its rows of the output), all-gather
//     the rowwise data in place in the output, then the rest of the FP8
//     shards (scales, columnwise data; variable sizes); assemble the
//     GEMM-ready output. GATHER_HIGH_PRECISION: all-gather the high-precision shards and
//     quantize the whole tensor.
//
// One round (the request carries every rank's row count, shard_rows): steps
// 2-4 become a single all-gather of equal-size slots, one per rank, whose
// layout every rank computes from shard_rows alone (kernels/one_round_plan.h
// says why the bytes are those of Quantize(concat)):
//   slot r = [header: agreement fields + digest + rank r's own verdict]
//            [EXACT_FP8: rank r's interior block rows quantized (shard layout)
//             + the rows of r's shard in block rows it shares with other
//             ranks, in the input's precision (<= 127 at each end, or the
//             whole shard when it lies in one block row);
//             GATHER_HIGH_PRECISION: the whole shard in the input's precision]
// (EXACT_FP8 TENSOR: one small all-gather of every rank's shard amax comes
// first; every rank then casts its whole shard with the combined amax into
// its slot, and no rows travel in the input's precision.)
// After the gather every rank checks every header (a bad request of any rank,
// or any disagreement on sequence, N, dtype, mode, config or shard_rows, fails
// every rank naming the rank and the field; no output is written before), then
// quantizes the straddling block rows itself and assembles the output on the
// device. On a stream-ordered call (a channel) the host waits for none of
// it: the header goes to the slot and the check runs on the device (a
// kernel compares every header with this rank's and copies them to mapped
// host memory), the straddling block rows are quantized and assembled in
// stream order, and the verdict is read when the work has completed
// (AllGatherResult::completion_check). Every rank must then pass shard_rows (the choice between the
// paths is made from it). Ranks that issue all-gathers of different sizes (a mix of calls with and
// without shard_rows, or lists, N, dtype, mode or config that change the slot size) fail on every
// rank: over Gloo with INVALID_ARGUMENT, in step, the group usable (GlooCommunicator checks the
// sizes); over NCCL at the latest at the deadline, or at the slot check
// (header, slot size), the group then broken.
//
// Thread safety: runs on the group's executor; one call per communicator at
// a time.
#ifndef QTX_SERVER_OPS_ALLGATHER_H_
#define QTX_SERVER_OPS_ALLGATHER_H_

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "server/backend/communicator.h"
#include "server/ops/quantize.h"

namespace qtx::server::ops {

enum class AllGatherMode : int32_t { kExactFp8 = 1, kGatherHighPrecision = 2 };

std::string_view AllGatherModeName(AllGatherMode m);

struct AllGatherRequestSpec {
  std::string group;  // for messages
  uint64_t sequence = 0;
  tensor::TensorRefSpec input;     // this rank's shard [M_r, N] (leading dims flattened)
  kernels::QuantizeParams params;  // defaults applied by the caller
  AllGatherMode mode = AllGatherMode::kExactFp8;
  QuantizeOutputSpecs outputs;  // for the gathered [M, N] tensor
  // Optional interprocess events (CUDA device only): the shard is read only
  // after wait_event; signal_event is recorded once the outputs are written.
  // AllGather returns when its outputs are complete either way, except on a
  // stream-ordered channel (events.queue set): its device work (amax
  // exchange, quantize, gathers, assembly) is then only enqueued, ordered
  // after the queue and before it, with CommCall::enqueue_only collectives;
  // its tensors must be in the device's memory (FAILED_PRECONDITION).
  backend::CudaEvents events;
  // Optional: every rank's row count M_r, in rank order (the same list on
  // every rank). Set: the one-round protocol above (no header exchange).
  std::vector<int64_t> shard_rows;
  // Set by the caller when the request could not even be parsed; the op then
  // still takes part in the header exchange, so every rank fails with it.
  absl::Status request_error;
};

// Wall time of the steps of one AllGather on this rank (for benchmarks and
// metrics): local validation and the early enqueue; the header exchange
// (waits for the slowest rank); geometry, outputs, allocations, boundary
// amaxes and the status exchange; the data gather (including the shard
// quantize enqueued before it); assembly into the GEMM-ready layout and the
// copies back to host outputs.
struct AllGatherTiming {
  absl::Duration local, header, prepare, gather, assemble;
};

struct AllGatherResult {
  QuantizeResult result;            // shape [M, N]
  std::vector<int64_t> shard_rows;  // M_r of every rank, in rank order
  AllGatherTiming timing;
  // True when the one-round path ran (request.shard_rows set).
  bool one_round = false;
  // Set for a stream-ordered one-round call (events.queue set): the slot
  // check ran on the device, in stream order, and nothing waited for it.
  // Call it once the call's device work has completed (the channel does,
  // from its completion path): OK, or the error the synchronous path would
  // have returned (a peer's rejected request, a disagreement naming field
  // and rank, a malformed slot). On an error the outputs were overwritten
  // but must never be reported valid (docs/numerics.md §5.3).
  std::function<absl::Status()> completion_check;
};

// Runs one all-gather. Errors: as Quantize for this rank's own request; the
// same error (naming the rank) when another rank's request was rejected;
// INVALID_ARGUMENT when the ranks disagree (naming field and rank) or M * N
// exceeds the element limit; the communicator's errors (DEADLINE_EXCEEDED,
// UNAVAILABLE, ABORTED), after which `*group_broken` is set: the ranks may be
// out of step and the group must not be used again.
absl::StatusOr<AllGatherResult> AllGather(const AllGatherRequestSpec& request, const OpContext& ctx,
                                          backend::Communicator& comm,
                                          const backend::CommCall& call, bool* group_broken);

}  // namespace qtx::server::ops

#endif  // QTX_SERVER_OPS_ALLGATHER_H_
