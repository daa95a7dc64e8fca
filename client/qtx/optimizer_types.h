// Plain C++ value types of the qtx client's Optimizer calls
// (Client::OffloadOptimizerState, Step, GetState, checkpoints, groups). They
// mirror proto/qtx/v1/optimizer.proto without exposing protobuf; the
// semantics (AdamW as torch.optim.AdamW, idempotent step numbers, atomic
// checkpoints) are documented there.
//
// All types are regular values, like those of qtx/types.h.
#ifndef QTX_CLIENT_QTX_OPTIMIZER_TYPES_H_
#define QTX_CLIENT_QTX_OPTIMIZER_TYPES_H_

#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "qtx/types.h"

namespace qtx {

// Storage of the moments exp_avg and exp_avg_sq (always computed in FP32).
// The numeric values equal qtx.v1.MomentDType.
enum class MomentDType : int32_t {
  kFloat32 = 1,
  kBFloat16 = 2,  // rounded to nearest even after each step
};

// torch.optim.AdamW's hyper-parameters and defaults. Always sent in full.
struct AdamWHyperParams {
  double lr = 1e-3;            // finite, >= 0
  double beta1 = 0.9;          // in [0, 1)
  double beta2 = 0.999;        // in [0, 1)
  double eps = 1e-8;           // finite, >= 0
  double weight_decay = 1e-2;  // finite, >= 0
  bool bias_correction = true;

  friend bool operator==(const AdamWHyperParams&, const AdamWHyperParams&) = default;
};

// How Step returns the updated parameters.
struct ParameterOutputConfig {
  enum class Format : int32_t {
    kFp8 = 1,   // block-scaled FP8 per `fp8`
    kBf16 = 2,  // BF16 only
  };
  Format format = Format::kFp8;
  // The Optimizer's FP8 defaults (the weight recipe): 128x128 tiles, E4M3,
  // both the rowwise and the columnwise copy, pow2 scales.
  QuantizeConfig fp8 = {.scaling_mode = ScalingMode::kBlock2D, .columnwise = true};
  // With kFp8: also return a BF16 copy.
  bool bf16_copy = false;

  friend bool operator==(const ParameterOutputConfig&, const ParameterOutputConfig&) = default;
};

// A parameter group as handed to OffloadOptimizerState.
struct OptimizerGroupConfig {
  std::string group;  // 1..128 characters of [A-Za-z0-9_.-], not starting with '.'
  AdamWHyperParams hyper_params;
  MomentDType moment_dtype = MomentDType::kFloat32;
  ParameterOutputConfig output;
  // Steps already applied to the given state (torch's state["step"]); the
  // first Step must carry step + 1.
  int64_t step = 0;
  // Replace an existing group of that name (else ALREADY_EXISTS).
  bool replace = false;
};

// Elements [begin, end) of a parameter's flattened (row-major) [M, N] matrix.
struct ShardRange {
  int64_t begin = 0;
  int64_t end = 0;
  friend bool operator==(const ShardRange&, const ShardRange&) = default;
};

// One parameter: its [M, N] matrix is `shape` with the leading dims flattened.
struct OptimizerParameterInit {
  std::string name;  // unique within the group
  std::vector<int64_t> shape;
  Tensor master;  // FLOAT32, or BFLOAT16 (widened exactly); shape == `shape`
  // Optional moments of a running job (FLOAT32 or BFLOAT16; both or neither).
  std::optional<Tensor> exp_avg;
  std::optional<Tensor> exp_avg_sq;
  // This parameter's own weight decay and learning-rate scale (its lr is the
  // step's times lr_scale); unset: the group's weight decay, scale 1. Both
  // finite and >= 0 (e.g. weight_decay = 0 for norms and biases).
  std::optional<double> weight_decay = std::nullopt;
  std::optional<double> lr_scale = std::nullopt;
  // Data-parallel sharding: this sidecar owns elements [begin, end) of the
  // flattened [M, N] parameter (`shape` stays the whole one; master, moments,
  // gradients and outputs hold end - begin elements). Every owner offloads
  // the same parameters with its own ranges; their FP8 Steps are collective
  // (StepOptions::collective_group). See the README's optimizer section.
  std::optional<ShardRange> shard = std::nullopt;
};

// A parameter offloaded with a shard range, as the server reports it.
struct ParameterShard {
  std::string name;
  ShardRange range;
  friend bool operator==(const ParameterShard&, const ParameterShard&) = default;
};

// A parameter offloaded with its own settings, as the server reports it.
struct ParameterHyperParams {
  std::string name;
  double weight_decay = 0.0;
  double lr_scale = 1.0;
  friend bool operator==(const ParameterHyperParams&, const ParameterHyperParams&) = default;
};

// A group as the server describes it (every field filled in).
struct OptimizerGroupInfo {
  std::string name;
  int64_t step = 0;          // steps processed
  int64_t update_count = 0;  // steps applied (AdamW's t); <= step
  int32_t num_parameters = 0;
  int64_t num_elements = 0;
  uint64_t state_bytes = 0;  // host bytes of master weights + moments
  MomentDType moment_dtype = MomentDType::kFloat32;
  AdamWHyperParams hyper_params;
  ParameterOutputConfig output;
  int64_t last_checkpoint_step = -1;  // -1 when never checkpointed
  std::string error;  // non-empty: the group is unusable (e.g. corrupted checkpoint)
  // The parameters with their own weight_decay / lr_scale (group order).
  std::vector<ParameterHyperParams> parameter_hyper_params;
  // The parameters offloaded with a shard range (group order).
  std::vector<ParameterShard> parameter_shards;
};

struct OptimizerGroupList {
  std::vector<OptimizerGroupInfo> groups;  // sorted by name
  uint64_t memory_limit_bytes = 0;
  uint64_t memory_used_bytes = 0;
};

// One parameter's gradient: FLOAT32, BFLOAT16 or FLOAT16, inline or in a
// registered region, shape equal to the parameter's.
struct OptimizerGradient {
  std::string name;
  Tensor grad;
};

// Where Step writes one parameter's outputs; unset slices come back inline.
struct ParameterDestination {
  std::string name;
  QuantizeOutputs fp8;
  std::optional<RegionSlice> bf16;
};

struct StepOptions {
  std::optional<double> lr;             // this step only; else the group's
  std::optional<double> max_grad_norm;  // global L2 clipping (> 0), as clip_grad_norm_
  bool skip_if_non_finite = false;      // NaN/Inf gradient: skip, report, advance
  // The second phase of a two-phase step (after GradNorm on every group of
  // every rank): the caller's decisions, not combined with the two above.
  // clip_factor multiplies every gradient (finite, > 0; see ClipFactor);
  // skip skips the update without reading the gradients (they may be empty).
  std::optional<double> clip_factor = std::nullopt;
  bool skip = false;
  std::vector<ParameterDestination> destinations;
  bool omit_parameters = false;  // statistics only
  // A data-parallel sharded group's FP8 Step is a collective call of this
  // Collective group over the owners' sidecars, with its next `sequence`
  // (shared with AllGather and GradNorm); every owner steps the same step
  // number. Each owner's FP8 output is then its FP8 shard: rowwise_data holds
  // its elements' bytes (1-D), the scale_inv tensors are whole.
  std::string collective_group = {};
  uint64_t sequence = 0;
};

struct OptimizerStepStats {
  int64_t step = 0;        // the step this result belongs to
  double grad_norm = 0.0;  // the group's L2 norm before clipping (0 with clip_factor / skip)
  bool skipped = false;
  bool non_finite = false;
  double clip_coef = 1.0;
  double lr = 0.0;
  bool replayed = false;  // answered from a previous application of this step
};

// One group's share of the gradient norm of a step (Client::GradNorm).
struct GradNormResult {
  int64_t step = 0;
  // Every gradient element squared, summed in double in the order a
  // one-phase Step sums them: add these over every group of every rank.
  double sum_squares = 0.0;
  bool non_finite = false;      // NaN/Inf in a gradient (or the sum overflowed)
  double grad_norm = 0.0;       // sqrt(sum_squares), this group alone
  bool step_processed = false;  // a retry of a processed step: its Step replays
  // With GradNormOptions::collective_group: the totals over every rank of
  // that group (the same bits on every rank), and its size.
  double total_sum_squares = 0.0;
  bool total_non_finite = false;
  int32_t ranks = 0;
};

struct GradNormOptions {
  // Reduce over this Collective group (Client::CreateGroup): every rank calls
  // GradNorm with its own optimizer group, the same step and the same
  // `sequence`, the group's call counter shared with AllGather. Empty: this
  // group's contribution only.
  std::string collective_group = {};
  uint64_t sequence = 0;
};

// The clip factor torch.nn.utils.clip_grad_norm_ applies for a total norm of
// sqrt(total_sum_squares): min(1, max_grad_norm / (norm + 1e-6)), computed in
// double exactly as a one-phase Step with max_grad_norm computes it.
inline double ClipFactor(double total_sum_squares, double max_grad_norm) {
  const double coef = max_grad_norm / (std::sqrt(total_sum_squares) + 1e-6);
  return coef < 1.0 ? coef : 1.0;
}

struct ParameterOutput {
  std::string name;
  std::optional<QuantizedTensor> fp8;  // with Format::kFp8
  std::optional<Tensor> bf16;          // with Format::kBf16, or bf16_copy
};

struct OptimizerStepResult {
  OptimizerStepStats stats;
  std::vector<ParameterOutput> parameters;  // group order; empty with omit_parameters
};

// Where GetState writes one parameter's state; unset slices come back inline.
struct StateDestination {
  std::string name;
  std::optional<RegionSlice> master;   // m*n*4 bytes
  std::optional<RegionSlice> exp_avg;  // m*n*moment bytes (with include_moments)
  std::optional<RegionSlice> exp_avg_sq;
};

struct GetStateOptions {
  std::vector<std::string> names;  // empty: every parameter
  bool include_moments = false;
  std::vector<StateDestination> destinations;
};

struct OptimizerParameterState {
  std::string name;
  Tensor master;                  // FLOAT32
  std::optional<Tensor> exp_avg;  // moment dtype (with include_moments)
  std::optional<Tensor> exp_avg_sq;
};

struct OptimizerState {
  OptimizerGroupInfo group;
  std::vector<OptimizerParameterState> parameters;
};

struct CheckpointInfo {
  std::string group;
  int64_t step = 0;
  std::string path;
  uint64_t bytes = 0;
};

}  // namespace qtx

#endif  // QTX_CLIENT_QTX_OPTIMIZER_TYPES_H_
