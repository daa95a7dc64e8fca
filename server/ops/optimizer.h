// Optimizer ops: validate requests expressed in plain structs, resolve their
// tensors (inline bytes or region slices, tensor/), and run them on the
// OptimizerStore (server/optimizer/). No gRPC, no protobuf: server/api
// converts. The AdamW math and the FP8 output live in kernels/; the state,
// step numbers and checkpoints in the store.
//
// Gradients and outputs may be in host memory (inline, shm) or, on a CUDA
// device, in device memory (CUDA IPC regions): the Step then pipelines per
// parameter through the group's backend::TransferPipeline — gradient i+1
// copies to page-locked staging (inbound stream) while the host steps
// parameter i, whose FP8/BF16 outputs then copy to their device slices
// (outbound stream) — with the same bytes as the host-only path. The
// staging is allocated once per group (counted against the memory cap) and
// reused. GetState still needs host destinations.
//
// Thread safety: the functions are safe for concurrent use.
#ifndef QTX_SERVER_OPS_OPTIMIZER_H_
#define QTX_SERVER_OPS_OPTIMIZER_H_

#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "server/backend/communicator.h"
#include "server/ops/quantize.h"
#include "server/optimizer/optimizer_store.h"
#include "server/tensor/tensor_ref.h"

namespace qtx::server::ops {

struct OffloadParameterSpec {
  std::string name;
  std::vector<int64_t> shape;
  tensor::TensorRefSpec master;                  // FLOAT32 or BFLOAT16
  std::optional<tensor::TensorRefSpec> exp_avg;  // FLOAT32 or BFLOAT16
  std::optional<tensor::TensorRefSpec> exp_avg_sq;
  optimizer::ParameterHyper hyper = {};  // its own weight decay / lr scale, if any
  // Data-parallel sharding: the elements [begin, end) of the flattened
  // parameter this sidecar owns; master and moments then hold end - begin
  // elements (any shape of that many).
  std::optional<kernels::ElementRange> shard = std::nullopt;
};

struct OffloadRequestSpec {
  optimizer::GroupConfig config;  // defaults filled in by the caller
  std::vector<OffloadParameterSpec> params;
  bool replace = false;
};

// INVALID_ARGUMENT for bad shapes, dtypes (naming "parameters[i].field"),
// byte counts or a master/moment shape differing from `shape`; NOT_FOUND for
// an unknown region; plus the store's errors (ALREADY_EXISTS,
// RESOURCE_EXHAUSTED, ...).
absl::StatusOr<optimizer::GroupInfo> OffloadOptimizerState(const OffloadRequestSpec& request,
                                                           const OpContext& ctx,
                                                           optimizer::OptimizerStore& store);

struct GradientSpec {
  std::string name;
  tensor::TensorRefSpec grad;
};

struct ParameterDestinationSpec {
  std::string name;
  QuantizeOutputSpecs fp8;
  std::optional<tensor::RegionSliceSpec> bf16;
};

struct StepRequestSpec {
  std::string group;
  optimizer::StepOptions options;
  std::vector<GradientSpec> gradients;
  std::vector<ParameterDestinationSpec> destinations;
  bool omit_parameters = false;
  // Interprocess CUDA events (CUDA device only): the device copies wait on
  // wait_event; signal_event is recorded once the device outputs are written
  // and the call then returns before they are.
  backend::CudaEvents events;
  // A data-parallel sharded group's Step is a collective call over the
  // owners' communicator (null: a local step; see optimizer::ShardExchange).
  // *comm_broken (if set) tells whether the ranks may be out of step after a
  // communicator failure.
  backend::Communicator* comm = nullptr;
  backend::CommCall comm_call;
  bool* comm_broken = nullptr;
};

struct ParameterResult {
  std::string name;
  std::optional<QuantizeResult> fp8;  // source_dtype FLOAT32 (the master)
  std::optional<OutputTensor> bf16;
};

struct StepResult {
  optimizer::StepStats stats;
  std::vector<ParameterResult> params;  // group order; empty with omit_parameters
};

// Runs one Step (with options.skip, the gradients may be omitted: they are
// not read). With request.comm, the Step is this rank's part of a sharded
// collective step: it takes part in the owners' exchange on every path, also
// when it fails before or after its own update, so that the other owners
// fail at once instead of at the deadline. INVALID_ARGUMENT: a gradient missing, duplicated,
// unknown, of the wrong dtype or shape; a destination naming an unknown parameter, a copy the group
// does not produce, or of the wrong size. RESOURCE_EXHAUSTED: inline outputs above
// ctx.max_inline_output_bytes. Plus the store's errors (FAILED_PRECONDITION for a wrong step
// number, ...).
absl::StatusOr<StepResult> OptimizerStep(const StepRequestSpec& request, const OpContext& ctx,
                                         optimizer::OptimizerStore& store);

// This rank's part of a sharded collective step whose request could not even
// be read: tells the other owners that this rank failed, so that they fail
// at once (nothing changes anywhere). Returns the communicator's status;
// *broken as for StepRequestSpec::comm_broken.
absl::Status JoinShardedStepAsFailed(backend::Communicator& comm, const backend::CommCall& call,
                                     bool* broken);

// INVALID_ARGUMENT (naming the parameter, the ranks and the elements) unless
// for every parameter the non-empty ranges of the ranks (ranges[r][i] is
// rank r's range of parameter i; totals[i] its element count) tile
// [0, totals[i]) exactly: no gap, no overlap. `names[i]` names parameter i.
absl::Status CheckShardPartition(const std::vector<std::string>& names,
                                 const std::vector<int64_t>& totals,
                                 const std::vector<std::vector<kernels::ElementRange>>& ranges);

struct GradNormRequestSpec {
  std::string group;
  int64_t step = 0;
  std::vector<GradientSpec> gradients;
  // As for a Step: device gradients are read after wait_event; signal_event
  // is recorded once they were read.
  backend::CudaEvents events;
};

// The first phase of a two-phase step (OptimizerStore::GradNorm): the
// group's squared-norm contribution and non-finite flag for the gradients
// given, nothing changed. INVALID_ARGUMENT: a gradient missing, duplicated,
// unknown, of the wrong dtype or shape. DATA_LOSS: a gradient region shrank
// while it was read (measure again). Plus the store's errors
// (FAILED_PRECONDITION for a step number that is neither the next one nor
// the last processed one, ...).
absl::StatusOr<optimizer::GradNormStats> OptimizerGradNorm(const GradNormRequestSpec& request,
                                                           const OpContext& ctx,
                                                           optimizer::OptimizerStore& store);

// The group-wide totals of a reduced GradNorm.
struct GradNormTotals {
  double sum_squares = 0.0;  // every rank's contribution, added in rank order
  bool non_finite = false;   // any rank's flag
  int ranks = 0;
};

// Exchanges this rank's contribution (`local`: its step, sum of squares and
// non-finite flag; null when this rank failed to measure it, so that the
// others fail at once instead of waiting for it) with every rank of `comm`
// (one AllGatherHost of a small record) and adds them up in rank order, so
// that every rank gets the same bits. FAILED_PRECONDITION when a rank failed
// to measure, or the ranks measured different step numbers (naming them);
// the communicator's errors otherwise, with *broken set when the ranks may
// be out of step (transport failure, missing peer).
absl::StatusOr<GradNormTotals> ReduceGradNorm(const optimizer::GradNormStats* local,
                                              backend::Communicator& comm,
                                              const backend::CommCall& call, bool* broken);

struct ParameterStateResult {
  std::string name;
  OutputTensor master;
  std::optional<OutputTensor> exp_avg;
  std::optional<OutputTensor> exp_avg_sq;
};

struct GetStateResult {
  optimizer::GroupInfo group;
  std::vector<ParameterStateResult> params;
};

// Where GetState copies one parameter's state; unset slices go inline.
struct StateDestinationSpec {
  std::string name;
  std::optional<tensor::RegionSliceSpec> master;
  std::optional<tensor::RegionSliceSpec> exp_avg;
  std::optional<tensor::RegionSliceSpec> exp_avg_sq;
};

// Copies master weights (and moments) out, into `destinations` (host
// regions; sizes must equal the tensors' bytes) or inline. NOT_FOUND for an
// unknown parameter name; INVALID_ARGUMENT for a destination naming a
// parameter not returned, given twice, for moments without include_moments,
// or of the wrong size; FAILED_PRECONDITION for a device (CUDA IPC) region;
// RESOURCE_EXHAUSTED when the inline part exceeds ctx.max_inline_output_bytes.
absl::StatusOr<GetStateResult> GetOptimizerState(
    const std::string& group, const std::vector<std::string>& names, bool include_moments,
    const OpContext& ctx, const optimizer::OptimizerStore& store,
    const std::vector<StateDestinationSpec>& destinations = {});

}  // namespace qtx::server::ops

#endif  // QTX_SERVER_OPS_OPTIMIZER_H_
