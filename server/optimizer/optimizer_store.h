// OptimizerStore: the sidecar's AdamW optimizer state — named parameter groups
// of FP32 master weights and moments in host memory — and everything that
// must hold for it: a memory cap checked before allocating, steps that are
// idempotent by step number, gradient-norm clipping and non-finite skipping,
// and durable checkpoints (checkpoint.h) written on request, every K steps and
// on shutdown, loaded at start.
//
// The store runs the host AdamW kernel (kernels/cpu/adamw.h) itself: the state
// lives in host memory whatever the device, so the step is a host operation.
// It takes plain pointers; resolving request tensors is server/ops' job.
//
// Thread safety: safe for concurrent use. Calls on one group are serialized
// by the group's mutex (a Step holds it for its duration); calls on different
// groups run in parallel. Lock order: the store's mu_ is never held while
// waiting for a group's mutex except in Create/replace paths that hold no
// group lock.
#ifndef QTX_SERVER_OPTIMIZER_OPTIMIZER_STORE_H_
#define QTX_SERVER_OPTIMIZER_OPTIMIZER_STORE_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "kernels/adamw.h"
#include "kernels/element_range.h"
#include "kernels/quantize_params.h"

namespace qtx::server::optimizer {

struct GroupState;  // group_state.h

// How the updated parameters are returned.
struct OutputConfig {
  bool fp8 = true;                // false: BF16 only
  kernels::QuantizeParams quant;  // for fp8; callers fill the group defaults
  bool bf16_copy = false;         // with fp8: also a BF16 copy
  bool bf16() const { return !fp8 || bf16_copy; }
};

struct GroupConfig {
  std::string name;
  kernels::AdamWHyperParams hyper;
  kernels::MomentDType moment_dtype = kernels::MomentDType::kFloat32;
  OutputConfig output;
  int64_t step = 0;  // steps already applied to the initial state
};

// A parameter's own AdamW settings within its group; unset: the group's
// weight decay and learning rate. The parameter is stepped exactly as if it
// were alone in a group with lr = (the step's lr) * lr_scale, in double, and
// this weight decay.
struct ParameterHyper {
  std::optional<double> weight_decay = std::nullopt;  // finite, >= 0
  std::optional<double> lr_scale = std::nullopt;      // finite, >= 0
  bool empty() const { return !weight_decay.has_value() && !lr_scale.has_value(); }
  friend bool operator==(const ParameterHyper&, const ParameterHyper&) = default;
};

// One parameter's initial state, read from host memory during CreateGroup.
struct ParameterInit {
  std::string name;
  std::vector<int64_t> shape;
  int64_t m = 0, n = 0;  // the [M, N] matrix of `shape`
  ParameterHyper hyper = {};
  // Data-parallel sharding: this sidecar owns only elements [begin, end) of
  // the flattened [M, N] matrix (its state, gradients and outputs hold
  // end - begin elements); unset: the whole parameter. See ShardExchange.
  std::optional<kernels::ElementRange> shard = std::nullopt;
  const void* master = nullptr;  // count() of master_dtype (kFloat32 or kBFloat16)
  kernels::InputDType master_dtype = kernels::InputDType::kFloat32;
  const void* exp_avg = nullptr;     // optional, m*n of moments_dtype
  const void* exp_avg_sq = nullptr;  // optional (both or neither)
  kernels::InputDType moments_dtype = kernels::InputDType::kFloat32;
  int64_t count() const { return shard.has_value() ? shard->count() : m * n; }
};

struct ParameterInfo {
  std::string name;
  std::vector<int64_t> shape;
  int64_t m = 0, n = 0;
  ParameterHyper hyper = {};
  std::optional<kernels::ElementRange> shard = std::nullopt;  // see ParameterInit
  // The elements this sidecar owns (the whole matrix when not sharded).
  kernels::ElementRange range() const { return shard.value_or(kernels::ElementRange{0, m * n}); }
  // How many: the size of its state, gradient and outputs.
  int64_t count() const { return range().count(); }
};

// Whether any parameter of `params` was offloaded with a shard range: the
// group is then data-parallel sharded (every parameter, with or without a
// range, takes part in the owners' exchange; see ShardExchange).
bool IsSharded(std::span<const ParameterInfo> params);

struct GroupInfo {
  GroupConfig config;  // config.step = steps processed
  int64_t update_count = 0;
  std::vector<ParameterInfo> params;
  int64_t num_elements = 0;
  uint64_t state_bytes = 0;
  int64_t last_checkpoint_step = -1;
  std::string error;  // non-empty: the group is unusable
};

struct StepOptions {
  int64_t step = 0;
  std::optional<double> lr = std::nullopt;
  // The group's own decisions (one-phase step).
  std::optional<double> max_grad_norm = std::nullopt;
  bool skip_if_non_finite = false;
  // The caller's decisions over several groups (second phase of a two-phase
  // step, after GradNorm); not combined with the two above. clip_factor
  // multiplies every gradient (finite, > 0); skip skips the update without
  // reading the gradients.
  std::optional<double> clip_factor = std::nullopt;
  bool skip = false;
  bool external() const { return clip_factor.has_value() || skip; }
};

struct StepStats {
  int64_t step = 0;
  double grad_norm = 0.0;
  bool skipped = false;
  bool non_finite = false;
  double clip_coef = 1.0;
  double lr = 0.0;
  bool replayed = false;
};

// One group's share of the gradient norm of a step (OptimizerStore::GradNorm).
struct GradNormStats {
  int64_t step = 0;
  double sum_squares = 0.0;     // every gradient element squared, summed as Step sums them
  bool non_finite = false;      // an element is NaN or Inf, or the sum overflowed
  bool step_processed = false;  // the step was already processed (a retry)
};

// Host buffers of one step, in the group's parameter order.
struct GradientView {
  const void* data = nullptr;  // m*n elements
  kernels::InputDType dtype = kernels::InputDType::kFloat32;
};
struct ParameterOutputBuffers {
  kernels::QuantizedBuffers fp8;  // per ComputeLayout(quant.scaling, m, n); when fp8
  uint16_t* bf16 = nullptr;       // m*n; when the group returns BF16; null to skip
  bool skip = false;              // write nothing for this parameter
};
// Moves a step's tensors that live where the host cannot address them (device
// memory; server/ops implements it on a backend::TransferPipeline). With hooks
// set, StepBuffers' grads and outputs point into host staging, and the store
// steps one parameter at a time: it waits for gradient i (GradientArrived),
// steps parameter i on the host, writes its outputs and hands them back
// (OutputsWritten) while later gradients are still arriving and earlier
// outputs are still travelling. Called on the Step's thread, in this order:
// Begin, then GradientArrived(i) / OutputsWritten(i) for increasing i, then
// Finish; Abort instead of Finish after a failure.
class StepHooks {
 public:
  virtual ~StepHooks() = default;
  // Starts the transfers; with `gradients`, every gradient starts travelling
  // to its staging in parameter order (a replay needs none).
  virtual absl::Status Begin(bool gradients) = 0;
  // Blocks until grads[i] holds parameter i's gradient.
  virtual absl::Status GradientArrived(size_t i) = 0;
  // outputs[i] is complete: sends it on (may return before it arrives).
  virtual absl::Status OutputsWritten(size_t i) = 0;
  // Every output was handed over: returns when they have arrived, or once
  // their arrival is ordered before a completion signal (interprocess event).
  virtual absl::Status Finish() = 0;
  // Waits for whatever is in flight, after a failure.
  virtual void Abort() = 0;
};

// The collective half of a data-parallel sharded step (docs/numerics.md §10).
// Every owner's sidecar holds the same parameter list (names, shapes, order)
// with its own element range of each; the ranges of one parameter over the
// owners partition its elements. A Step of such a group is one collective
// call over the owners: Agree before any state changes, then, after the
// update, CombineAmax of the per-tile partial amaxes so that every owner
// quantizes its slice with the whole tiles' amaxes. server/ops implements it
// on a backend::Communicator; the store calls it under the group's lock, on
// the Step's thread, at most once each, Agree first.
class ShardExchange {
 public:
  virtual ~ShardExchange() = default;
  // Agrees with every owner on the step: the same step number, parameter
  // list and output settings, ranges that partition every parameter. Returns
  // whether any owner wants FP8 parameters back (then CombineAmax must
  // follow). INVALID_ARGUMENT (ranges that overlap or leave gaps, different
  // parameter lists) or FAILED_PRECONDITION (different step numbers, an owner
  // that failed before agreeing) naming the owners; the communicator's
  // errors. On error nothing was changed on any owner.
  virtual absl::StatusOr<bool> Agree(const GroupInfo& group, int64_t step, bool want_outputs) = 0;
  // Replaces `tile_amax` (every parameter's tile amaxes, concatenated in group
  // order; this owner's partial maxima) by the element-wise max over the
  // owners. ABORTED when another owner failed after agreeing.
  virtual absl::Status CombineAmax(std::span<float> tile_amax) = 0;
};

struct StepBuffers {
  std::vector<GradientView> grads;  // may be empty on a replay
  std::vector<ParameterOutputBuffers> outputs;
  bool omit_outputs = false;
  std::shared_ptr<StepHooks> hooks;  // null: every buffer is host memory, ready
  // Required for a sharded group (IsSharded) that returns FP8 parameters;
  // not owned. Null: the step is local.
  ShardExchange* exchange = nullptr;
};

// Called under the group's lock with the group as it is, to resolve the
// request's gradients and output destinations against it. With `replay` no
// gradient is read (a replayed step, or one the caller skips), so
// StepBuffers::grads may stay empty.
using PrepareStepFn =
    std::function<absl::StatusOr<StepBuffers>(const GroupInfo& group, bool replay)>;

// Something an op keeps with a group across steps (the GPU path's transfer
// pipeline and its page-locked staging), freed with the group.
class StepScratch {
 public:
  virtual ~StepScratch() = default;
};

// The group's scratch, reachable from a prepare function (under the group's
// lock). Its bytes count against the store's memory cap.
class StepScratchSlot {
 public:
  using MakeFn = std::function<absl::StatusOr<std::unique_ptr<StepScratch>>()>;
  virtual ~StepScratchSlot() = default;
  // The scratch an earlier step installed, or null.
  virtual StepScratch* get() const = 0;
  // Bytes accounted for it.
  virtual uint64_t bytes() const = 0;
  // Frees the current scratch, reserves `bytes` against the memory cap and
  // installs make()'s result. RESOURCE_EXHAUSTED (naming the group) over the
  // cap; FAILED_PRECONDITION when the group was released or replaced
  // meanwhile; make()'s error (the slot is then empty).
  virtual absl::StatusOr<StepScratch*> Replace(uint64_t bytes, const MakeFn& make) = 0;
};

using PrepareStepWithScratchFn = std::function<absl::StatusOr<StepBuffers>(
    const GroupInfo& group, bool replay, StepScratchSlot& scratch)>;

// A read-only view of one parameter's state, valid during a ReadState callback.
struct ParameterStateView {
  const ParameterInfo* info = nullptr;
  const float* master = nullptr;
  const void* exp_avg = nullptr;  // moment dtype of the group
  const void* exp_avg_sq = nullptr;
};

struct CheckpointResult {
  std::string group;
  int64_t step = 0;
  std::string path;
  uint64_t bytes = 0;
};

class OptimizerStore {
 public:
  struct Options {
    uint64_t memory_limit_bytes = uint64_t{64} << 30;
    std::string checkpoint_dir;          // empty: no checkpoints
    int64_t checkpoint_every_steps = 0;  // 0: only on request and at shutdown
    int num_threads = 0;                 // host AdamW threads; 0: OpenMP default
    // Directories (with their subdirectories) LoadResharded may read other
    // sidecars' checkpoints from, besides checkpoint_dir.
    std::vector<std::string> import_dirs;
  };

  // Creates the store. With a checkpoint directory, creates it if missing and
  // loads every group checkpoint found there; a group whose checkpoint is
  // corrupted or over the memory cap is registered as failed (every call on
  // it returns that error, which says whether a previous checkpoint exists to
  // fall back to with LoadCheckpoint(previous=true); OffloadOptimizerState
  // with replace, ReleaseGroup, or a successful LoadCheckpoint clears it). INVALID_ARGUMENT for bad
  // options; INTERNAL if the directory cannot be created or listed.
  static absl::StatusOr<std::unique_ptr<OptimizerStore>> Create(Options options);
  ~OptimizerStore();
  OptimizerStore(const OptimizerStore&) = delete;
  OptimizerStore& operator=(const OptimizerStore&) = delete;

  // Creates (or with `replace`, replaces) a group from `params`.
  // INVALID_ARGUMENT: bad name, hyper-parameters, duplicate parameter names,
  //   step outside 0..kMaxStepNumber (ValidateGroupConfig); ALREADY_EXISTS:
  //   the group exists and !replace;
  // RESOURCE_EXHAUSTED: the state would exceed the memory cap (checked before
  //   allocating).
  absl::StatusOr<GroupInfo> CreateGroup(const GroupConfig& config,
                                        std::span<const ParameterInit> params, bool replace);

  // Applies step `options.step` (or replays it; see optimizer.proto).
  // With checkpoint_every_steps = K, the step whose number is a multiple of K
  // also writes the group's checkpoint before it returns, under the group's
  // lock: that Step's latency grows by state_bytes / disk bandwidth plus an
  // fsync (12 B per parameter with FP32 moments: ~12 GB for 1 B parameters).
  // Known limitation, kept because it is simple and always consistent; to
  // keep it off the training loop's critical path, leave K = 0 and call
  // SaveCheckpoint from the client when a pause is acceptable (e.g. next to
  // the training framework's own checkpoint). A failed periodic write is
  // logged and does not fail the step (the previous checkpoint is intact).
  // NOT_FOUND: no such group; FAILED_PRECONDITION: wrong step number (the
  // message names the step the group is at); DATA_LOSS: failed group; errors
  // of `prepare`; INVALID_ARGUMENT for a bad lr / max_grad_norm /
  // clip_factor, clip_factor or skip combined with max_grad_norm or
  // skip_if_non_finite, or a step number above kMaxStepNumber.
  // With clip_factor the gradients are scaled by it and the norm is not
  // measured (stats.grad_norm 0); with skip the update is skipped without
  // reading the gradients (prepare gets replay = true).
  absl::StatusOr<StepStats> Step(std::string_view group, const StepOptions& options,
                                 const PrepareStepFn& prepare);
  // As above, with the group's scratch slot for `prepare`. When the buffers
  // come with hooks (StepHooks), the step is pipelined per parameter; the
  // results are bit for bit those of the unpipelined step. A hook failure
  // before any parameter was updated fails the step with the state unchanged;
  // one after some were updated marks the group failed (every later call gets
  // DATA_LOSS until LoadCheckpoint or a replacing OffloadOptimizerState),
  // since half a step cannot be undone; a failure to deliver the outputs
  // after the update keeps the step applied and returns the error (retrying
  // the step number then delivers them).
  absl::StatusOr<StepStats> Step(std::string_view group, const StepOptions& options,
                                 const PrepareStepWithScratchFn& prepare);

  // The first phase of a two-phase step: measures the group's share of the
  // gradient norm of step `step` (sum of squares in the order Step adds them,
  // so that sqrt(sum_squares) is bit for bit the grad_norm a one-phase Step
  // reports) without changing anything. `step` is the group's step + 1, or
  // the group's step when its result is held (a retry: step_processed).
  // `prepare` is called with replay = false and must return every gradient
  // and omit the outputs; with hooks, the gradients arrive through them.
  // NOT_FOUND: no such group; FAILED_PRECONDITION: any other step number
  // (naming the group's step); DATA_LOSS: failed group; INVALID_ARGUMENT:
  // a step number above kMaxStepNumber; errors of `prepare` and the hooks.
  absl::StatusOr<GradNormStats> GradNorm(std::string_view group, int64_t step,
                                         const PrepareStepWithScratchFn& prepare);

  absl::StatusOr<GroupInfo> Describe(std::string_view group) const;

  // Calls `read` under the group's lock with every parameter's state.
  absl::Status ReadState(
      std::string_view group,
      const std::function<absl::Status(const GroupInfo&, std::span<const ParameterStateView>)>&
          read) const;

  // Writes the group's checkpoint (empty name: every usable group). The
  // checkpoint it replaces is kept as <group>.qtxopt.prev when it holds an
  // older step (not after a LoadCheckpoint(previous) fallback).
  // FAILED_PRECONDITION without a checkpoint directory; INTERNAL on I/O errors.
  absl::StatusOr<std::vector<CheckpointResult>> SaveCheckpoint(std::string_view group);

  // Replaces the group's state with its checkpoint — with `previous`, with
  // the one before the newest (<group>.qtxopt.prev: the explicit fallback when
  // the newest is corrupted; the next checkpoint write then replaces the
  // newest without rotating it into .prev, so the good .prev survives).
  // FAILED_PRECONDITION without a checkpoint directory; NOT_FOUND: no such
  // checkpoint; DATA_LOSS: corrupted; RESOURCE_EXHAUSTED: over the cap.
  absl::StatusOr<GroupInfo> LoadCheckpoint(std::string_view group, bool previous = false);

  // Resharding (docs/numerics.md §10.1): replaces (or creates) group
  // `group` with the state ReadResharded builds from `sources` (every old
  // owner's checkpoint file of the group, written at any data-parallel size)
  // at this sidecar's new ranges `shards` (parameters not named: whole). Each
  // source must be an absolute path to a "*.qtxopt" (or ".qtxopt.prev") file
  // whose directory, links resolved, lies in checkpoint_dir or an
  // import_dirs entry. The loaded state is not written to checkpoint_dir
  // (other owners may still be reading the sources): SaveCheckpoint once
  // every owner has loaded. INVALID_ARGUMENT: a bad path or group name,
  // ReadResharded's; PERMISSION_DENIED: a source outside those directories;
  // FAILED_PRECONDITION: neither directory configured, ReadResharded's;
  // NOT_FOUND, DATA_LOSS: a missing or corrupted source; RESOURCE_EXHAUSTED:
  // over the cap. On error the group (if any) is unchanged.
  absl::StatusOr<GroupInfo> LoadResharded(
      std::string_view group, std::span<const std::string> sources,
      const std::vector<std::pair<std::string, kernels::ElementRange>>& shards);

  // Checkpoints every usable group (the shutdown path). Returns the first
  // error; tries every group. OK without a checkpoint directory. A group
  // whose lock is not free within `lock_wait` (a call holding it is stuck) is
  // skipped with DEADLINE_EXCEEDED naming it; its previous checkpoint stays.
  absl::Status CheckpointAll(absl::Duration lock_wait = absl::InfiniteDuration());

  // Frees the group's memory and deletes its checkpoints (<group>.qtxopt and
  // <group>.qtxopt.prev), so that a restart does not bring it back. Waits
  // for a Step or checkpoint write on the group in flight. NOT_FOUND if
  // absent; INTERNAL (naming the file and errno text) when the checkpoint
  // cannot be deleted: the group then stays, unchanged.
  absl::Status ReleaseGroup(std::string_view group);

  std::vector<GroupInfo> ListGroups() const;
  uint64_t memory_used_bytes() const;
  uint64_t memory_limit_bytes() const { return options_.memory_limit_bytes; }
  const Options& options() const { return options_; }

  struct Group;  // defined in optimizer_store.cc

 private:
  explicit OptimizerStore(Options options) : options_(std::move(options)) {}
  absl::StatusOr<std::shared_ptr<Group>> Find(std::string_view name) const;
  // Writes the group's checkpoint when its step is a multiple of
  // checkpoint_every_steps (a failure is logged: the step stands). REQUIRES:
  // g.mu held.
  void MaybeCheckpointPeriodically(Group& g, std::string_view name);
  // Step of a data-parallel sharded group (IsSharded): agree through
  // bufs.exchange, update the owned slices, combine the tile amaxes and write
  // the FP8 shards. REQUIRES: g.mu held; the step number was checked.
  absl::StatusOr<StepStats> StepSharded(Group& g, std::string_view name, const StepOptions& options,
                                        bool replay, const GroupInfo& info,
                                        const StepBuffers& bufs);
  // The scratch slot of group `g` (named `name`) for one call that holds
  // g->mu.
  std::unique_ptr<StepScratchSlot> ScratchSlotOf(const std::shared_ptr<Group>& g,
                                                 std::string_view name);
  absl::Status LoadAllCheckpoints();
  // Loads `path` into a new group and installs it (replacing any).
  // `previous`: `path` is the .prev checkpoint (see LoadCheckpoint).
  absl::StatusOr<GroupInfo> InstallFromCheckpoint(const std::string& name, const std::string& path,
                                                  bool previous);
  // Installs the state `read` returns as group `name` (replacing any);
  // `read` reserves its bytes through the callback before allocating.
  // `checkpointed`: the state is the newest checkpoint on disk.
  absl::StatusOr<GroupInfo> Install(
      const std::string& name,
      const std::function<
          absl::StatusOr<GroupState>(const std::function<absl::Status(uint64_t)>& reserve)>& read,
      bool checkpointed, bool rotate_on_write);
  // The real path of resharding source `path` (see LoadResharded).
  absl::StatusOr<std::string> ResolveSource(const std::string& path) const;
  // Reserves `bytes` against the cap, given that `freed` bytes go away when
  // the new state replaces the old. RESOURCE_EXHAUSTED naming `what`.
  absl::Status Reserve(uint64_t bytes, uint64_t freed, std::string_view what)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Constant after construction.
  const Options options_;

  // State below is protected by mu_.
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<Group>> groups_ ABSL_GUARDED_BY(mu_);
  uint64_t used_bytes_ ABSL_GUARDED_BY(mu_) = 0;
};

// INVALID_ARGUMENT unless `name` is 1..128 chars of [A-Za-z0-9_.-] and does
// not start with '.' (it names checkpoint files).
absl::Status ValidateGroupName(std::string_view name);

// INVALID_ARGUMENT naming the field unless lr, eps, weight_decay are finite
// and >= 0 and beta1, beta2 are in [0, 1).
absl::Status ValidateHyperParams(const kernels::AdamWHyperParams& h);

// INVALID_ARGUMENT naming `field` (e.g. "parameters[2] ('ln.bias')") unless
// the set values are finite and >= 0.
absl::Status ValidateParameterHyper(const ParameterHyper& h, std::string_view field);

// The AdamW hyper-parameters parameter `p` is stepped with when the group's
// (with this step's lr) are `group`: lr * lr_scale and its own weight decay.
kernels::AdamWHyperParams EffectiveHyper(const kernels::AdamWHyperParams& group,
                                         const ParameterHyper& p);

// The largest step number: 2^53, exact in a double (AdamW's bias correction
// raises the betas to it; JSON and JavaScript clients see it unchanged), and
// far from int64 overflow, so the "next step" is always representable.
inline constexpr int64_t kMaxStepNumber = int64_t{1} << 53;

// The rules OffloadOptimizerState applies to a group's configuration, also
// applied to every loaded checkpoint: ValidateGroupName, ValidateHyperParams,
// 0 <= step <= kMaxStepNumber, and for FP8 output at least one of rowwise /
// columnwise with a finite amax_epsilon >= 0. INVALID_ARGUMENT naming the
// field and value.
absl::Status ValidateGroupConfig(const GroupConfig& config);

// The rules for a sharded group (IsSharded), also applied to checkpoints:
// every range within its parameter (0 <= begin <= end <= M*N) and, for FP8
// output, BLOCK_2D scaling with the rowwise copy (the shard's bytes are its
// elements of the rowwise data). INVALID_ARGUMENT naming the parameter.
absl::Status ValidateShards(const GroupConfig& config, std::span<const ParameterInfo> params);

}  // namespace qtx::server::optimizer

#endif  // QTX_SERVER_OPTIMIZER_OPTIMIZER_STORE_H_
