#include "server/optimizer/optimizer_store.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "kernels/block_geometry.h"
#include "kernels/cpu/adamw.h"
#include "kernels/cpu/quantize_block.h"
#include "kernels/cpu/quantize_range.h"
#include "kernels/fp8.h"
#include "server/optimizer/checkpoint.h"
#include "server/optimizer/group_state.h"
#include "spdlog/spdlog.h"

namespace qtx::server::optimizer {

struct OptimizerStore::Group {
  // Constant after the group is installed.
  uint64_t bytes = 0;  // accounted against the cap while the group is in the map
  // Bytes of `scratch`, accounted against the cap too. Guarded by the store's
  // mu_ (written with both locks held).
  uint64_t scratch_bytes = 0;
  uint64_t HeldBytes() const { return bytes + scratch_bytes; }

  mutable absl::Mutex mu;
  GroupState state ABSL_GUARDED_BY(mu);
  absl::Status error ABSL_GUARDED_BY(mu);  // not OK: unusable (e.g. corrupted checkpoint)
  int64_t last_checkpoint_step ABSL_GUARDED_BY(mu) = -1;
  // False after a fallback to the .prev checkpoint: the newest file on disk is
  // not trusted, so the next write must not rotate it into .prev.
  bool rotate_on_write ABSL_GUARDED_BY(mu) = true;
  std::unique_ptr<StepScratch> scratch ABSL_GUARDED_BY(mu);  // see StepScratchSlot
  // Set by ReleaseGroup: a call that found the group before it was released
  // and waited for its lock must neither step it nor write its checkpoint.
  bool released ABSL_GUARDED_BY(mu) = false;

  // Whether the next checkpoint write keeps the newest file as .prev: not
  // after a fallback, and not when the newest already holds this very step
  // (a rewrite, e.g. at shutdown, must not push the older .prev out).
  bool KeepPrevious() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    return rotate_on_write && last_checkpoint_step != state.config.step;
  }
};

namespace {

using kernels::InputDType;
using kernels::MomentDType;

bool FiniteNonNegative(double x) { return std::isfinite(x) && x >= 0.0; }

GroupInfo InfoOf(const GroupState& s, int64_t last_checkpoint_step, const absl::Status& error) {
  GroupInfo info;
  info.config = s.config;
  info.update_count = s.update_count;
  info.last_checkpoint_step = last_checkpoint_step;
  for (const ParamState& p : s.params) {
    info.params.push_back(p.info);
    info.num_elements += p.info.count();
  }
  info.state_bytes = StateBytes(info.num_elements, s.config.moment_dtype);
  if (!error.ok()) info.error = std::string(error.message());
  return info;
}

absl::Status Unusable(std::string_view name, const absl::Status& error) {
  return absl::Status(error.code(),
                      absl::StrFormat("optimizer group '%s' is unusable: %s (replace it with "
                                      "OffloadOptimizerState(replace=true) or ReleaseGroup)",
                                      name, error.message()));
}

absl::Status Released(std::string_view name) {
  return absl::NotFoundError(
      absl::StrFormat("optimizer group '%s' was released while this call waited for it", name));
}

void StoreMoment(uint8_t* dst, MomentDType t, int64_t i, float v) {
  if (t == MomentDType::kFloat32) {
    std::memcpy(dst + 4 * i, &v, 4);
  } else {
    const uint16_t h = kernels::FloatToBf16(v);
    std::memcpy(dst + 2 * i, &h, 2);
  }
}

// Makes deletions in `dir` durable; best effort (logged).
void SyncDirectory(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0 || ::fsync(fd) != 0) {
    spdlog::warn("event=checkpoint_dir_fsync_failed dir={} error=\"{}\"", dir,
                 std::strerror(errno));
  }
  if (fd >= 0) ::close(fd);
}

// Writes a parameter's outputs from its current master weights (skipped
// steps and replays): the same bytes the fused step wrote, because the FP8
// copies are QuantizeBlock(master) by definition.
void WriteOutputsFromMaster(const ParamState& p, const OutputConfig& out,
                            const ParameterOutputBuffers& b) {
  if (b.skip) return;
  const int64_t count = p.info.m * p.info.n;
  if (out.fp8) {
    kernels::cpu::QuantizeBlock(p.master.get(), InputDType::kFloat32, p.info.m, p.info.n, out.quant,
                                b.fp8);
  }
  if (out.bf16() && b.bf16 != nullptr) {
    for (int64_t i = 0; i < count; ++i) b.bf16[i] = kernels::FloatToBf16(p.master[i]);
  }
}

// Points kb[i].scalars at the constants of every parameter with its own
// weight decay or lr scale (`own` holds them; the others use the call's).
// `h`: the group's hyper-parameters with this step's lr.
void AttachOwnScalars(const GroupState& s, const kernels::AdamWHyperParams& h, int64_t t,
                      double grad_scale, std::span<kernels::cpu::AdamWParamBuffers> kb,
                      std::vector<kernels::AdamWScalars>& own) {
  own.clear();
  own.reserve(kb.size());  // no reallocation: kb keeps pointers into it
  for (size_t i = 0; i < kb.size(); ++i) {
    const ParameterHyper& p = s.params[i].info.hyper;
    if (p.empty()) continue;
    own.push_back(kernels::MakeAdamWScalars(EffectiveHyper(h, p), t, grad_scale));
    kb[i].scalars = &own.back();
  }
}

// The constants of the next step of `s` (update s.update_count + 1): the
// group's hyper-parameters with this step's `lr`, gradients scaled by
// `grad_scale`. Returns the call's constants; those of parameters with their
// own weight decay or lr scale are attached to kb (AttachOwnScalars, `own`).
kernels::AdamWScalars NextStepScalars(const GroupState& s, double lr, double grad_scale,
                                      std::span<kernels::cpu::AdamWParamBuffers> kb,
                                      std::vector<kernels::AdamWScalars>& own) {
  kernels::AdamWHyperParams h = s.config.hyper;
  h.lr = lr;
  const kernels::AdamWScalars scalars =
      kernels::MakeAdamWScalars(h, s.update_count + 1, grad_scale);
  AttachOwnScalars(s, h, s.update_count + 1, grad_scale, kb, own);
  return scalars;
}

// One fused AdamW step of every parameter of `s` (NextStepScalars), then
// s.update_count advanced.
void FusedStep(GroupState& s, double lr, double grad_scale,
               std::span<kernels::cpu::AdamWParamBuffers> kb, int threads) {
  std::vector<kernels::AdamWScalars> own;
  const kernels::AdamWScalars scalars = NextStepScalars(s, lr, grad_scale, kb, own);
  kernels::cpu::AdamWStepFused(kb, scalars, threads);
  ++s.update_count;
}

// The kernel buffers of every parameter of `s` for one AdamW step over the
// gradients and outputs of `bufs`. `owned_slices` (a data-parallel sharded
// group): the update is element-wise, so each owned slice is stepped as a
// [1, count] matrix with the FP8 output off (it needs the owners' combined
// amaxes); else each parameter is its [m, n] matrix, with the FP8 output when
// the group makes one and the call takes this parameter's outputs.
// REQUIRES: bufs.grads has one entry per parameter, and so has bufs.outputs
// unless bufs.omit_outputs.
std::vector<kernels::cpu::AdamWParamBuffers> ParamBuffersFor(GroupState& s, const StepBuffers& bufs,
                                                             bool owned_slices) {
  const OutputConfig& out = s.config.output;
  std::vector<kernels::cpu::AdamWParamBuffers> kb(s.params.size());
  for (size_t i = 0; i < kb.size(); ++i) {
    ParamState& p = s.params[i];
    kernels::cpu::AdamWParamBuffers& b = kb[i];
    if (owned_slices) {
      const int64_t count = p.info.count();
      b.m = count > 0 ? 1 : 0;
      b.n = count;
    } else {
      b.m = p.info.m;
      b.n = p.info.n;
    }
    b.master = p.master.get();
    b.exp_avg = p.exp_avg.get();
    b.exp_avg_sq = p.exp_avg_sq.get();
    b.moment_dtype = s.config.moment_dtype;
    b.grad = bufs.grads[i].data;
    b.grad_dtype = bufs.grads[i].dtype;
    const bool write = !bufs.omit_outputs && !bufs.outputs[i].skip;
    b.fp8_output = !owned_slices && write && out.fp8;
    b.quant = out.quant;
    if (b.fp8_output) {
      b.fp8 = bufs.outputs[i].fp8;
      if (kernels::cpu::UsesTileScales(b.quant)) {
        p.tile_scales.resize(static_cast<size_t>(kernels::CeilDiv(b.m, kernels::kBlockLen) *
                                                 kernels::CeilDiv(b.n, kernels::kBlockLen)));
        b.tile_scales = p.tile_scales.data();
      }
    }
    b.bf16 = write && out.bf16() ? bufs.outputs[i].bf16 : nullptr;
  }
  return kb;
}

// Writes every parameter's outputs from its current master weights (a
// replayed or skipped step), through the hooks when there are some.
absl::Status WriteCurrentOutputs(const GroupState& s, const StepBuffers& bufs) {
  if (bufs.omit_outputs) return absl::OkStatus();
  const OutputConfig& out = s.config.output;
  const size_t np = s.params.size();
  StepHooks* const hooks = bufs.hooks.get();
  if (hooks == nullptr) {
    for (size_t i = 0; i < np; ++i) WriteOutputsFromMaster(s.params[i], out, bufs.outputs[i]);
    return absl::OkStatus();
  }
  absl::Status st = hooks->Begin(/*gradients=*/false);
  for (size_t i = 0; i < np && st.ok(); ++i) {
    WriteOutputsFromMaster(s.params[i], out, bufs.outputs[i]);
    st = hooks->OutputsWritten(i);
  }
  if (st.ok()) st = hooks->Finish();
  if (!st.ok()) hooks->Abort();
  return st;
}

}  // namespace

absl::Status ValidateGroupName(std::string_view name) {
  if (name.empty() || name.size() > 128) {
    return absl::InvalidArgumentError(
        absl::StrFormat("group='%s': must be 1..128 characters (got %d)", name, name.size()));
  }
  if (name[0] == '.') {
    return absl::InvalidArgumentError(absl::StrFormat("group='%s': must not start with '.'", name));
  }
  for (char c : name) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '_' || c == '-' || c == '.';
    if (!ok) {
      return absl::InvalidArgumentError(
          absl::StrFormat("group='%s': character '%c' not allowed (use [A-Za-z0-9_.-])", name, c));
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateHyperParams(const kernels::AdamWHyperParams& h) {
  if (!FiniteNonNegative(h.lr)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("hyper_params.lr=%g: must be finite and >= 0", h.lr));
  }
  if (!(h.beta1 >= 0.0 && h.beta1 < 1.0)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("hyper_params.beta1=%g: must be in [0, 1)", h.beta1));
  }
  if (!(h.beta2 >= 0.0 && h.beta2 < 1.0)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("hyper_params.beta2=%g: must be in [0, 1)", h.beta2));
  }
  if (!FiniteNonNegative(h.eps)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("hyper_params.eps=%g: must be finite and >= 0", h.eps));
  }
  if (!FiniteNonNegative(h.weight_decay)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("hyper_params.weight_decay=%g: must be finite and >= 0", h.weight_decay));
  }
  return absl::OkStatus();
}

absl::Status ValidateParameterHyper(const ParameterHyper& h, std::string_view field) {
  if (h.weight_decay.has_value() && !FiniteNonNegative(*h.weight_decay)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s.weight_decay=%g: must be finite and >= 0 (unset: the group's)", field,
                        *h.weight_decay));
  }
  if (h.lr_scale.has_value() && !FiniteNonNegative(*h.lr_scale)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s.lr_scale=%g: must be finite and >= 0 (the parameter's lr is the group's times this; "
        "unset: 1)",
        field, *h.lr_scale));
  }
  return absl::OkStatus();
}

kernels::AdamWHyperParams EffectiveHyper(const kernels::AdamWHyperParams& group,
                                         const ParameterHyper& p) {
  kernels::AdamWHyperParams h = group;
  if (p.weight_decay.has_value()) h.weight_decay = *p.weight_decay;
  if (p.lr_scale.has_value()) h.lr = group.lr * *p.lr_scale;
  return h;
}

absl::Status ValidateGroupConfig(const GroupConfig& c) {
  QTX_RETURN_IF_ERROR(ValidateGroupName(c.name));
  QTX_RETURN_IF_ERROR(ValidateHyperParams(c.hyper));
  if (c.step < 0) {
    return absl::InvalidArgumentError(absl::StrFormat("step=%d: must be >= 0", c.step));
  }
  if (c.step > kMaxStepNumber) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "step=%d: must be at most %d (2^53, the largest step number)", c.step, kMaxStepNumber));
  }
  if (c.output.fp8) {
    if (!c.output.quant.rowwise && !c.output.quant.columnwise) {
      return absl::InvalidArgumentError(
          "output.fp8: at least one of rowwise, columnwise must be set");
    }
    if (!std::isfinite(c.output.quant.amax_epsilon) || c.output.quant.amax_epsilon < 0.0f) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "output.fp8.amax_epsilon=%g: must be finite and >= 0", c.output.quant.amax_epsilon));
    }
  }
  return absl::OkStatus();
}

bool IsSharded(std::span<const ParameterInfo> params) {
  return std::any_of(params.begin(), params.end(),
                     [](const ParameterInfo& p) { return p.shard.has_value(); });
}

absl::Status ValidateShards(const GroupConfig& config, std::span<const ParameterInfo> params) {
  if (!IsSharded(params)) return absl::OkStatus();
  for (size_t i = 0; i < params.size(); ++i) {
    const ParameterInfo& p = params[i];
    if (!p.shard.has_value()) continue;
    const int64_t total = p.m * p.n;
    if (p.shard->begin < 0 || p.shard->begin > p.shard->end || p.shard->end > total) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "parameters[%d] ('%s').shard=[%d, %d): must satisfy 0 <= begin <= end <= %d (the "
          "parameter's [%d, %d] elements, flattened row-major)",
          i, p.name, p.shard->begin, p.shard->end, total, p.m, p.n));
    }
  }
  if (config.output.fp8) {
    if (config.output.quant.scaling != kernels::BlockScaling::kBlock2D) {
      return absl::InvalidArgumentError(
          "output.fp8.scaling_mode: a data-parallel sharded group (parameters with a shard range) "
          "returns FP8 parameters as BLOCK_2D (128x128) only; use BLOCK_2D or BF16 output");
    }
    if (!config.output.quant.rowwise) {
      return absl::InvalidArgumentError(
          "output.fp8.rowwise=false: a data-parallel sharded group returns each owner's FP8 bytes "
          "as its elements of the rowwise copy; keep rowwise (the columnwise copy is the byte "
          "transpose of the gathered rowwise one)");
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<OptimizerStore>> OptimizerStore::Create(Options options) {
  if (options.checkpoint_every_steps < 0) {
    return absl::InvalidArgumentError(absl::StrFormat("--checkpoint_every_steps=%d: must be >= 0",
                                                      options.checkpoint_every_steps));
  }
  if (options.checkpoint_every_steps > 0 && options.checkpoint_dir.empty()) {
    return absl::InvalidArgumentError("--checkpoint_every_steps needs --checkpoint_dir");
  }
  std::unique_ptr<OptimizerStore> store(new OptimizerStore(std::move(options)));
  if (!store->options_.checkpoint_dir.empty()) {
    const std::string& dir = store->options_.checkpoint_dir;
    if (::mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST) {
      return absl::InternalError(
          absl::StrFormat("--checkpoint_dir=%s: cannot create: %s", dir, std::strerror(errno)));
    }
    QTX_RETURN_IF_ERROR(store->LoadAllCheckpoints());
  }
  return store;
}

OptimizerStore::~OptimizerStore() = default;

absl::Status OptimizerStore::LoadAllCheckpoints() {
  QTX_ASSIGN_OR_RETURN(std::vector<std::string> names, ListCheckpoints(options_.checkpoint_dir));
  for (const std::string& name : names) {
    if (absl::Status s = ValidateGroupName(name); !s.ok()) {
      spdlog::warn("event=optimizer_checkpoint_ignored file={} reason=\"{}\"",
                   CheckpointPath(options_.checkpoint_dir, name), std::string(s.message()));
      continue;
    }
    absl::StatusOr<GroupInfo> info =
        InstallFromCheckpoint(name, CheckpointPath(options_.checkpoint_dir, name), false);
    if (info.ok()) {
      spdlog::info("event=optimizer_group_restored group={} step={} params={} bytes={}", name,
                   info->config.step, info->params.size(), info->state_bytes);
      continue;
    }
    // Never fall back silently: say whether a previous checkpoint exists and
    // how to restore it, and leave the choice to the client.
    const std::string prev = PreviousCheckpointPath(options_.checkpoint_dir, name);
    struct stat st;
    const bool has_prev = ::stat(prev.c_str(), &st) == 0;
    const absl::Status error(
        info.status().code(),
        absl::StrFormat("%s; %s", info.status().message(),
                        has_prev ? absl::StrFormat("the previous checkpoint '%s' exists: "
                                                   "LoadCheckpoint with previous=true restores "
                                                   "it (it is one checkpoint older)",
                                                   prev)
                                 : std::string("no previous checkpoint exists")));
    spdlog::error("event=optimizer_group_restore_failed group={} code={} previous={} msg=\"{}\"",
                  name, absl::StatusCodeToString(error.code()), has_prev,
                  std::string(error.message()));
    auto g = std::make_shared<Group>();
    {
      absl::MutexLock glock(&g->mu);
      g->state.config.name = name;
      g->error = error;
    }
    absl::MutexLock lock(&mu_);
    groups_[name] = std::move(g);
  }
  return absl::OkStatus();
}

absl::Status OptimizerStore::Reserve(uint64_t bytes, uint64_t freed, std::string_view what) {
  const uint64_t base = used_bytes_ - std::min(used_bytes_, freed);
  if (bytes > options_.memory_limit_bytes || base > options_.memory_limit_bytes - bytes) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "%s needs %d bytes of optimizer state but only %d of the %d-byte limit "
        "(--optimizer_memory_limit_mb) are free",
        what, bytes, options_.memory_limit_bytes - std::min(options_.memory_limit_bytes, base),
        options_.memory_limit_bytes));
  }
  used_bytes_ += bytes;
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<OptimizerStore::Group>> OptimizerStore::Find(
    std::string_view name) const {
  absl::MutexLock lock(&mu_);
  auto it = groups_.find(std::string(name));
  if (it == groups_.end()) {
    return absl::NotFoundError(absl::StrFormat(
        "optimizer group '%s' does not exist (create it with OffloadOptimizerState)", name));
  }
  return it->second;
}

absl::StatusOr<GroupInfo> OptimizerStore::CreateGroup(const GroupConfig& config,
                                                      std::span<const ParameterInit> params,
                                                      bool replace) {
  QTX_RETURN_IF_ERROR(ValidateGroupConfig(config));
  absl::flat_hash_set<std::string_view> names;
  int64_t elements = 0;
  std::vector<ParameterInfo> infos;
  infos.reserve(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    const ParameterInit& p = params[i];
    if (p.name.empty() || p.name.size() > 256) {
      return absl::InvalidArgumentError(
          absl::StrFormat("parameters[%d].name='%s': must be 1..256 characters", i, p.name));
    }
    if (!names.insert(p.name).second) {
      return absl::InvalidArgumentError(
          absl::StrFormat("parameters[%d].name='%s': duplicate parameter name", i, p.name));
    }
    if ((p.exp_avg == nullptr) != (p.exp_avg_sq == nullptr)) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "parameters[%d] ('%s'): give both exp_avg and exp_avg_sq or neither", i, p.name));
    }
    QTX_RETURN_IF_ERROR(
        ValidateParameterHyper(p.hyper, absl::StrFormat("parameters[%d] ('%s')", i, p.name)));
    infos.push_back({p.name, p.shape, p.m, p.n, p.hyper, p.shard});
  }
  QTX_RETURN_IF_ERROR(ValidateShards(config, infos));
  for (const ParameterInfo& p : infos) elements += p.count();
  const uint64_t bytes = StateBytes(elements, config.moment_dtype);

  std::shared_ptr<Group> existing;
  {
    absl::MutexLock lock(&mu_);
    auto it = groups_.find(config.name);
    if (it != groups_.end()) {
      if (!replace) {
        return absl::AlreadyExistsError(absl::StrFormat(
            "optimizer group '%s' already exists (set replace to overwrite it)", config.name));
      }
      existing = it->second;
    }
    QTX_RETURN_IF_ERROR(Reserve(bytes, existing ? existing->HeldBytes() : 0,
                                absl::StrFormat("optimizer group '%s'", config.name)));
  }
  auto unreserve = [&] {
    absl::MutexLock lock(&mu_);
    used_bytes_ -= bytes;
  };

  auto g = std::make_shared<Group>();
  g->bytes = bytes;
  {
    absl::MutexLock glock(&g->mu);
    GroupState& s = g->state;
    s.config = config;
    s.update_count = config.step;
    for (size_t k = 0; k < params.size(); ++k) {
      const ParameterInit& init = params[k];
      absl::StatusOr<ParamState> ps = AllocateParamState(infos[k], config.moment_dtype);
      if (!ps.ok()) {
        unreserve();
        return ps.status();
      }
      const int64_t count = init.count();
      for (int64_t i = 0; i < count; ++i) {
        ps->master[i] = kernels::LoadAsFloat(init.master, init.master_dtype, i);
      }
      for (int64_t i = 0; i < count; ++i) {
        const float m1 =
            init.exp_avg ? kernels::LoadAsFloat(init.exp_avg, init.moments_dtype, i) : 0.0f;
        const float m2 =
            init.exp_avg_sq ? kernels::LoadAsFloat(init.exp_avg_sq, init.moments_dtype, i) : 0.0f;
        StoreMoment(ps->exp_avg.get(), config.moment_dtype, i, m1);
        StoreMoment(ps->exp_avg_sq.get(), config.moment_dtype, i, m2);
      }
      s.params.push_back(*std::move(ps));
    }
  }
  GroupInfo info;
  {
    absl::MutexLock glock(&g->mu);
    info = InfoOf(g->state, -1, absl::OkStatus());
  }
  absl::MutexLock lock(&mu_);
  auto it = groups_.find(config.name);
  if (it != groups_.end() && it->second != existing) {
    used_bytes_ -= bytes;
    return absl::AlreadyExistsError(absl::StrFormat(
        "optimizer group '%s' was created concurrently by another call", config.name));
  }
  if (existing) used_bytes_ -= existing->HeldBytes();
  groups_[config.name] = std::move(g);
  return info;
}

namespace {

// The group's scratch slot during one Step (the group's lock held).
class GroupScratchSlot final : public StepScratchSlot {
 public:
  using ReplaceFn = std::function<absl::StatusOr<StepScratch*>(uint64_t, const MakeFn&)>;
  GroupScratchSlot(const std::unique_ptr<StepScratch>* scratch, uint64_t bytes, ReplaceFn replace)
      : scratch_(scratch), bytes_(bytes), replace_(std::move(replace)) {}
  StepScratch* get() const override { return scratch_->get(); }
  uint64_t bytes() const override { return bytes_; }
  absl::StatusOr<StepScratch*> Replace(uint64_t bytes, const MakeFn& make) override {
    QTX_ASSIGN_OR_RETURN(StepScratch * p, replace_(bytes, make));
    bytes_ = bytes;
    return p;
  }

 private:
  const std::unique_ptr<StepScratch>* scratch_;
  uint64_t bytes_;
  ReplaceFn replace_;
};

// What a pipelined step did, for Step to commit or report.
struct PipelineOutcome {
  absl::Status failure;   // the update did not complete
  size_t updated = 0;     // parameters updated before `failure`
  absl::Status delivery;  // the update completed; the outputs did not arrive
};

// Runs a step whose buffers come with hooks (StepHooks), one parameter at a
// time; the same arithmetic as the unpipelined step (tiles are independent,
// the norm adds the same chunk sums in the same order), so the same bits.
// Without clipping or skipping by the group (or with the caller's clip
// factor), parameter i is stepped as soon as its own
// gradient arrived and the norm is only reported; with either, the norm must
// be known before any update, so every gradient arrives first (the copies
// back still overlap the host steps).
PipelineOutcome RunPipelinedStep(GroupState& s, std::span<kernels::cpu::AdamWParamBuffers> kb,
                                 const StepBuffers& bufs, const StepOptions& options, int threads,
                                 StepStats& stats) {
  StepHooks& h = *bufs.hooks;
  const size_t np = kb.size();
  const OutputConfig& out = s.config.output;
  PipelineOutcome r;
  auto fail = [&](absl::Status st, size_t updated) {
    h.Abort();
    r.failure = std::move(st);
    r.updated = updated;
    return r;
  };
  if (absl::Status st = h.Begin(/*gradients=*/true); !st.ok()) return fail(st, 0);
  std::vector<std::vector<double>> partial(np);
  // With the caller's clip factor (two-phase step) the norm is not measured.
  const bool measure = !options.clip_factor.has_value();
  auto arrive = [&](size_t i) -> absl::Status {
    QTX_RETURN_IF_ERROR(h.GradientArrived(i));
    if (measure) partial[i] = kernels::cpu::GradChunkSumSquares(kb[i], threads);
    return absl::OkStatus();
  };
  auto set_norm = [&] {
    double sum = 0.0;
    for (const std::vector<double>& p : partial) {
      for (double x : p) sum += x;
    }
    stats.grad_norm = std::sqrt(sum);
    stats.non_finite = !std::isfinite(sum);
  };
  auto deliver = [&](size_t i) {
    if (bufs.omit_outputs || !r.delivery.ok()) return;
    r.delivery = h.OutputsWritten(i);
  };
  const bool norm_first = options.max_grad_norm.has_value() || options.skip_if_non_finite;
  if (norm_first) {
    for (size_t i = 0; i < np; ++i) {
      if (absl::Status st = arrive(i); !st.ok()) return fail(st, 0);
    }
    set_norm();
    if (stats.non_finite && options.skip_if_non_finite) {
      stats.skipped = true;
      for (size_t i = 0; i < np && !bufs.omit_outputs; ++i) {
        WriteOutputsFromMaster(s.params[i], out, bufs.outputs[i]);
        deliver(i);
      }
    } else {
      if (options.max_grad_norm.has_value() && !stats.non_finite) {
        const double coef = *options.max_grad_norm / (stats.grad_norm + 1e-6);
        if (coef < 1.0) stats.clip_coef = coef;
      }
      std::vector<kernels::AdamWScalars> own;
      const kernels::AdamWScalars scalars = NextStepScalars(s, stats.lr, stats.clip_coef, kb, own);
      for (size_t i = 0; i < np; ++i) {
        kernels::cpu::AdamWStepFused(kb.subspan(i, 1), scalars, threads);
        deliver(i);
      }
      ++s.update_count;
    }
  } else {
    stats.clip_coef = options.clip_factor.value_or(1.0);
    std::vector<kernels::AdamWScalars> own;
    const kernels::AdamWScalars scalars = NextStepScalars(s, stats.lr, stats.clip_coef, kb, own);
    for (size_t i = 0; i < np; ++i) {
      if (absl::Status st = arrive(i); !st.ok()) return fail(st, i);
      kernels::cpu::AdamWStepFused(kb.subspan(i, 1), scalars, threads);
      deliver(i);
    }
    if (measure) set_norm();
    ++s.update_count;
  }
  if (r.delivery.ok()) r.delivery = h.Finish();
  if (!r.delivery.ok()) h.Abort();
  return r;
}

// The outputs of a sharded group's parameters from their current master
// weights (docs/numerics.md §10): the partial tile amaxes of every owned
// slice, combined over the owners by `ex` when `combine` (Agree said some
// owner wants FP8 parameters), then each slice quantized with the whole
// tiles' amaxes. `bf16_written`: the update already wrote the BF16 copies.
// `begun`: the hooks (if any) were begun by the update. Every path ends the
// hooks (Finish, or Abort on failure).
absl::Status WriteShardedOutputs(const GroupState& s, const StepBuffers& bufs, ShardExchange* ex,
                                 bool combine, bool bf16_written, bool begun) {
  const OutputConfig& out = s.config.output;
  StepHooks* const hooks = bufs.hooks.get();
  const size_t np = s.params.size();
  absl::Status st;
  std::vector<float> amax;
  std::vector<int64_t> offset(np + 1, 0);
  for (size_t i = 0; i < np; ++i) {
    offset[i + 1] = offset[i] + kernels::cpu::TileCount(s.params[i].info.m, s.params[i].info.n);
  }
  if (out.fp8 && combine) {
    amax.assign(static_cast<size_t>(offset[np]), 0.0f);
    for (size_t i = 0; i < np; ++i) {
      const ParamState& p = s.params[i];
      kernels::cpu::RangeTileAmax(p.master.get(), p.info.m, p.info.n, p.info.range(),
                                  amax.data() + offset[i]);
    }
    st = ex->CombineAmax(amax);
  }
  const bool write = !bufs.omit_outputs;
  if (st.ok() && write && out.fp8 && amax.empty()) {
    st = absl::InternalError("sharded step: FP8 outputs without combined amaxes");
  }
  if (st.ok() && write && hooks != nullptr && !begun) {
    st = hooks->Begin(/*gradients=*/false);
    begun = st.ok();
  }
  for (size_t i = 0; i < np && st.ok() && write; ++i) {
    const ParamState& p = s.params[i];
    const ParameterOutputBuffers& b = bufs.outputs[i];
    if (!b.skip) {
      if (out.fp8) {
        kernels::cpu::QuantizeRange2D(p.master.get(), p.info.m, p.info.n, p.info.range(),
                                      amax.data() + offset[i], out.quant, b.fp8.rowwise_data,
                                      b.fp8.rowwise_scale_inv,
                                      out.quant.columnwise ? b.fp8.columnwise_scale_inv : nullptr);
      }
      if (out.bf16() && b.bf16 != nullptr && !bf16_written) {
        const int64_t count = p.info.count();
        for (int64_t k = 0; k < count; ++k) b.bf16[k] = kernels::FloatToBf16(p.master[k]);
      }
    }
    if (hooks != nullptr) st = hooks->OutputsWritten(i);
  }
  if (hooks != nullptr && begun) {
    if (st.ok()) st = hooks->Finish();
    if (!st.ok()) hooks->Abort();
  }
  return st;
}

}  // namespace

std::unique_ptr<StepScratchSlot> OptimizerStore::ScratchSlotOf(const std::shared_ptr<Group>& g,
                                                               std::string_view name) {
  g->mu.AssertHeld();
  uint64_t scratch_bytes = 0;
  {
    absl::MutexLock lock(&mu_);
    scratch_bytes = g->scratch_bytes;
  }
  return std::make_unique<GroupScratchSlot>(
      &g->scratch, scratch_bytes,
      [this, g, name](uint64_t bytes,
                      const StepScratchSlot::MakeFn& make) -> absl::StatusOr<StepScratch*> {
        g->mu.AssertHeld();
        g->scratch.reset();  // its destructor waits for its transfers
        {
          absl::MutexLock lock(&mu_);
          used_bytes_ -= g->scratch_bytes;
          g->scratch_bytes = 0;
          auto it = groups_.find(std::string(name));
          if (it == groups_.end() || it->second != g) {
            return absl::FailedPreconditionError(absl::StrFormat(
                "optimizer group '%s' was released or replaced during this step", name));
          }
          QTX_RETURN_IF_ERROR(Reserve(
              bytes, 0, absl::StrFormat("the transfer staging of optimizer group '%s'", name)));
          g->scratch_bytes = bytes;
        }
        absl::StatusOr<std::unique_ptr<StepScratch>> made = make();
        if (!made.ok()) {
          absl::MutexLock lock(&mu_);
          used_bytes_ -= g->scratch_bytes;
          g->scratch_bytes = 0;
          return made.status();
        }
        g->scratch = *std::move(made);
        return g->scratch.get();
      });
}

void OptimizerStore::MaybeCheckpointPeriodically(Group& g, std::string_view name) {
  g.mu.AssertHeld();
  if (options_.checkpoint_every_steps <= 0 ||
      g.state.config.step % options_.checkpoint_every_steps != 0) {
    return;
  }
  absl::StatusOr<uint64_t> written =
      WriteCheckpoint(options_.checkpoint_dir, g.state, g.KeepPrevious());
  if (written.ok()) {
    g.last_checkpoint_step = g.state.config.step;
    g.rotate_on_write = true;
    spdlog::info("event=optimizer_checkpoint group={} step={} bytes={} reason=periodic", name,
                 g.state.config.step, *written);
  } else {
    // The step itself succeeded; the previous checkpoint is intact.
    spdlog::error("event=optimizer_checkpoint_failed group={} step={} msg=\"{}\"", name,
                  g.state.config.step, std::string(written.status().message()));
  }
}

absl::StatusOr<StepStats> OptimizerStore::Step(std::string_view name, const StepOptions& options,
                                               const PrepareStepFn& prepare) {
  return Step(
      name, options,
      PrepareStepWithScratchFn([&prepare](const GroupInfo& info, bool replay, StepScratchSlot&) {
        return prepare(info, replay);
      }));
}

absl::StatusOr<StepStats> OptimizerStore::Step(std::string_view name, const StepOptions& options,
                                               const PrepareStepWithScratchFn& prepare) {
  if (options.lr.has_value() && !FiniteNonNegative(*options.lr)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("lr=%g: must be finite and >= 0", *options.lr));
  }
  if (options.max_grad_norm.has_value() &&
      !(std::isfinite(*options.max_grad_norm) && *options.max_grad_norm > 0.0)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("max_grad_norm=%g: must be finite and > 0", *options.max_grad_norm));
  }
  if (options.clip_factor.has_value() &&
      !(std::isfinite(*options.clip_factor) && *options.clip_factor > 0.0)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "clip_factor=%g: must be finite and > 0 (the factor every gradient is multiplied by; "
        "to leave the step out, set skip instead)",
        *options.clip_factor));
  }
  if (options.external() && (options.max_grad_norm.has_value() || options.skip_if_non_finite)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s with %s: clip_factor and skip carry the caller's decisions over every group (after "
        "GradNorm); max_grad_norm and skip_if_non_finite let this group decide alone. Use one "
        "pair or the other",
        options.clip_factor.has_value() ? "clip_factor" : "skip",
        options.max_grad_norm.has_value() ? "max_grad_norm" : "skip_if_non_finite"));
  }
  if (options.step > kMaxStepNumber) {
    return absl::InvalidArgumentError(
        absl::StrFormat("step=%d: must be at most %d (2^53, the largest step number)", options.step,
                        kMaxStepNumber));
  }
  QTX_ASSIGN_OR_RETURN(std::shared_ptr<Group> g, Find(name));
  absl::MutexLock glock(&g->mu);
  if (g->released) return Released(name);
  if (!g->error.ok()) return Unusable(name, g->error);
  GroupState& s = g->state;
  const int64_t at = s.config.step;
  const bool replay = options.step == at && s.last.has_value() && s.last->step == at;
  if (options.step != at + 1 && !replay) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "optimizer group '%s' is at step %d: the next step is %d%s; got step %d", name, at, at + 1,
        s.last.has_value() ? absl::StrFormat(" (or %d to retry the last one)", at) : "",
        options.step));
  }
  const GroupInfo info = InfoOf(s, g->last_checkpoint_step, absl::OkStatus());
  const bool sharded = IsSharded(info.params);
  if (sharded && (options.max_grad_norm.has_value() || options.skip_if_non_finite)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: optimizer group '%s' is data-parallel sharded, so its own gradients are only a "
        "slice of the model's and cannot decide clipping or skipping alone; measure with "
        "GradNorm (collective_group reduces over the owners) and pass clip_factor / skip",
        options.max_grad_norm.has_value() ? "max_grad_norm" : "skip_if_non_finite", name));
  }
  std::unique_ptr<StepScratchSlot> slot = ScratchSlotOf(g, name);
  QTX_ASSIGN_OR_RETURN(StepBuffers bufs, prepare(info, replay || options.skip, *slot));
  StepHooks* const hooks = bufs.hooks.get();
  const size_t np = s.params.size();
  if (!bufs.omit_outputs && bufs.outputs.size() != np) {
    return absl::InternalError(
        absl::StrFormat("step: %d output buffers for %d parameters", bufs.outputs.size(), np));
  }
  if (sharded) return StepSharded(*g, name, options, replay, info, bufs);
  if (bufs.exchange != nullptr) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "collective_group: optimizer group '%s' is not data-parallel sharded (no parameter was "
        "offloaded with a shard range), so its Step is not a collective call; leave "
        "collective_group empty",
        name));
  }
  const OutputConfig& out = s.config.output;
  if (replay) {
    QTX_RETURN_IF_ERROR(WriteCurrentOutputs(s, bufs));
    StepStats r = *s.last;
    r.replayed = true;
    return r;
  }
  if (options.skip) {
    // The caller's decision: nothing is read or updated. A failure to deliver
    // the outputs leaves the step unprocessed (nothing changed), to be retried.
    QTX_RETURN_IF_ERROR(WriteCurrentOutputs(s, bufs));
    StepStats stats;
    stats.step = options.step;
    stats.lr = options.lr.value_or(s.config.hyper.lr);
    stats.skipped = true;
    s.config.step = options.step;
    s.last = stats;
    MaybeCheckpointPeriodically(*g, name);
    return stats;
  }
  if (bufs.grads.size() != np) {
    return absl::InternalError(
        absl::StrFormat("step: %d gradients for %d parameters", bufs.grads.size(), np));
  }

  std::vector<kernels::cpu::AdamWParamBuffers> kb =
      ParamBuffersFor(s, bufs, /*owned_slices=*/false);
  StepStats stats;
  stats.step = options.step;
  stats.lr = options.lr.value_or(s.config.hyper.lr);
  absl::Status delivery;
  if (hooks != nullptr) {
    PipelineOutcome o = RunPipelinedStep(s, kb, bufs, options, options_.num_threads, stats);
    if (!o.failure.ok()) {
      if (o.updated == 0) return o.failure;  // nothing changed
      g->error = absl::DataLossError(absl::StrFormat(
          "step %d failed after %d of %d parameters were updated (%s), so its state is half a "
          "step ahead",
          options.step, o.updated, np, o.failure.message()));
      spdlog::error("event=optimizer_step_partial group={} step={} updated={} params={} msg=\"{}\"",
                    name, options.step, o.updated, np, std::string(o.failure.message()));
      return Unusable(name, g->error);
    }
    delivery = std::move(o.delivery);
  } else if (options.clip_factor.has_value()) {
    // The caller's clip factor (two-phase step): the norm was measured by
    // GradNorm; the update is the one-phase one with this coefficient.
    stats.clip_coef = *options.clip_factor;
    FusedStep(s, stats.lr, stats.clip_coef, kb, options_.num_threads);
  } else {
    const kernels::cpu::GradNormResult norm =
        kernels::cpu::GradSumSquares(kb, options_.num_threads);
    stats.grad_norm = std::sqrt(norm.sum_squares);
    stats.non_finite = !norm.all_finite;
    if (stats.non_finite && options.skip_if_non_finite) {
      stats.skipped = true;
      if (!bufs.omit_outputs) {
        for (size_t i = 0; i < np; ++i) WriteOutputsFromMaster(s.params[i], out, bufs.outputs[i]);
      }
    } else {
      // torch.nn.utils.clip_grad_norm_: coef = max_norm / (norm + 1e-6), applied
      // when < 1. Not applied when the norm is not finite.
      if (options.max_grad_norm.has_value() && norm.all_finite) {
        const double coef = *options.max_grad_norm / (stats.grad_norm + 1e-6);
        if (coef < 1.0) stats.clip_coef = coef;
      }
      FusedStep(s, stats.lr, stats.clip_coef, kb, options_.num_threads);
    }
  }
  s.config.step = options.step;
  s.last = stats;
  MaybeCheckpointPeriodically(*g, name);
  if (!delivery.ok()) {
    return absl::Status(delivery.code(),
                        absl::StrFormat("step %d was applied, but its parameters were not "
                                        "delivered: %s; retry step %d to receive them",
                                        options.step, delivery.message(), options.step));
  }
  return stats;
}

absl::StatusOr<StepStats> OptimizerStore::StepSharded(Group& g, std::string_view name,
                                                      const StepOptions& options, bool replay,
                                                      const GroupInfo& info,
                                                      const StepBuffers& bufs) {
  g.mu.AssertHeld();
  GroupState& s = g.state;
  const OutputConfig& out = s.config.output;
  ShardExchange* const ex = bufs.exchange;
  const bool want_fp8 = out.fp8 && !bufs.omit_outputs;
  if (ex == nullptr && want_fp8) {
    const ParameterInfo* cut = nullptr;
    for (const ParameterInfo& p : info.params) {
      if (p.shard.has_value()) {
        cut = &p;
        break;
      }
    }
    return absl::FailedPreconditionError(absl::StrFormat(
        "optimizer group '%s' is data-parallel sharded (parameter '%s' owns elements [%d, %d) "
        "of %d): its FP8 parameters need the tile amaxes of the other owners, so its Step is a "
        "collective call; give collective_group (a Collective group of the owners' sidecars) and "
        "its next sequence, or set omit_parameters",
        name, cut->name, cut->shard->begin, cut->shard->end, cut->m * cut->n));
  }
  bool combine = false;
  if (ex != nullptr) {
    QTX_ASSIGN_OR_RETURN(combine, ex->Agree(info, options.step, want_fp8));
  }
  if (replay || options.skip) {
    // The outputs from the current master weights; nothing is read or
    // updated. A failure leaves a skipped step unprocessed, to be retried.
    QTX_RETURN_IF_ERROR(WriteShardedOutputs(s, bufs, ex, combine, /*bf16_written=*/false,
                                            /*begun=*/false));
    if (replay) {
      StepStats r = *s.last;
      r.replayed = true;
      return r;
    }
    StepStats stats;
    stats.step = options.step;
    stats.lr = options.lr.value_or(s.config.hyper.lr);
    stats.skipped = true;
    s.config.step = options.step;
    s.last = stats;
    MaybeCheckpointPeriodically(g, name);
    return stats;
  }
  const size_t np = s.params.size();
  if (bufs.grads.size() != np) {
    return absl::InternalError(
        absl::StrFormat("step: %d gradients for %d parameters", bufs.grads.size(), np));
  }
  // The update is element-wise: each owned slice is stepped as a [1, count]
  // matrix with the FP8 output off (it needs the combined amaxes).
  std::vector<kernels::cpu::AdamWParamBuffers> kb = ParamBuffersFor(s, bufs, /*owned_slices=*/true);
  StepStats stats;
  stats.step = options.step;
  stats.lr = options.lr.value_or(s.config.hyper.lr);
  stats.clip_coef = options.clip_factor.value_or(1.0);
  const bool measure = !options.clip_factor.has_value();
  std::vector<kernels::AdamWScalars> own;
  const kernels::AdamWScalars scalars = NextStepScalars(s, stats.lr, stats.clip_coef, kb, own);
  StepHooks* const hooks = bufs.hooks.get();
  if (hooks != nullptr) {
    if (absl::Status st = hooks->Begin(/*gradients=*/true); !st.ok()) {
      hooks->Abort();
      return st;
    }
  }
  double sum = 0.0;
  for (size_t i = 0; i < np; ++i) {
    if (hooks != nullptr) {
      if (absl::Status st = hooks->GradientArrived(i); !st.ok()) {
        hooks->Abort();
        if (i == 0) return st;  // nothing changed
        g.error = absl::DataLossError(absl::StrFormat(
            "step %d failed after %d of %d parameters were updated (%s), so its state is half a "
            "step ahead",
            options.step, i, np, st.message()));
        spdlog::error(
            "event=optimizer_step_partial group={} step={} updated={} params={} msg=\"{}\"", name,
            options.step, i, np, std::string(st.message()));
        return Unusable(name, g.error);
      }
    }
    if (measure && kb[i].n > 0) {
      for (double x : kernels::cpu::GradChunkSumSquares(kb[i], options_.num_threads)) sum += x;
    }
    if (kb[i].n > 0) {
      kernels::cpu::AdamWStepFused(std::span(kb).subspan(i, 1), scalars, options_.num_threads);
    }
  }
  if (measure) {
    stats.grad_norm = std::sqrt(sum);
    stats.non_finite = !std::isfinite(sum);
  }
  ++s.update_count;
  s.config.step = options.step;
  s.last = stats;
  const absl::Status delivery =
      WriteShardedOutputs(s, bufs, ex, combine, /*bf16_written=*/true, /*begun=*/hooks != nullptr);
  MaybeCheckpointPeriodically(g, name);
  if (!delivery.ok()) {
    return absl::Status(delivery.code(),
                        absl::StrFormat("step %d was applied, but its parameters were not "
                                        "delivered: %s; retry step %d on every owner to receive "
                                        "them",
                                        options.step, delivery.message(), options.step));
  }
  return stats;
}

absl::StatusOr<GradNormStats> OptimizerStore::GradNorm(std::string_view name, int64_t step,
                                                       const PrepareStepWithScratchFn& prepare) {
  if (step > kMaxStepNumber) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "step=%d: must be at most %d (2^53, the largest step number)", step, kMaxStepNumber));
  }
  QTX_ASSIGN_OR_RETURN(std::shared_ptr<Group> g, Find(name));
  absl::MutexLock glock(&g->mu);
  if (g->released) return Released(name);
  if (!g->error.ok()) return Unusable(name, g->error);
  const int64_t at = g->state.config.step;
  const bool processed = step == at && g->state.last.has_value() && g->state.last->step == at;
  if (step != at + 1 && !processed) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "optimizer group '%s' is at step %d: GradNorm measures the gradients of its next step "
        "%d%s; got step %d",
        name, at, at + 1,
        g->state.last.has_value()
            ? absl::StrFormat(" (or of step %d, the last one, for a retry)", at)
            : "",
        step));
  }
  const GroupInfo info = InfoOf(g->state, g->last_checkpoint_step, absl::OkStatus());
  std::unique_ptr<StepScratchSlot> slot = ScratchSlotOf(g, name);
  QTX_ASSIGN_OR_RETURN(StepBuffers bufs, prepare(info, /*replay=*/false, *slot));
  const size_t np = g->state.params.size();
  if (bufs.grads.size() != np) {
    return absl::InternalError(
        absl::StrFormat("GradNorm: %d gradients for %d parameters", bufs.grads.size(), np));
  }
  std::vector<kernels::cpu::AdamWParamBuffers> kb(np);
  for (size_t i = 0; i < np; ++i) {
    // A sharded parameter's gradient is its owned slice, [1, count].
    const ParameterInfo& pi = g->state.params[i].info;
    kb[i].m = pi.shard.has_value() ? (pi.count() > 0 ? 1 : 0) : pi.m;
    kb[i].n = pi.shard.has_value() ? pi.count() : pi.n;
    kb[i].grad = bufs.grads[i].data;
    kb[i].grad_dtype = bufs.grads[i].dtype;
  }
  GradNormStats r;
  r.step = step;
  r.step_processed = processed;
  if (StepHooks* const hooks = bufs.hooks.get(); hooks != nullptr) {
    // One parameter at a time, as it arrives; the chunk sums added in the
    // order GradSumSquares adds them (see GradChunkSumSquares).
    absl::Status st = hooks->Begin(/*gradients=*/true);
    double sum = 0.0;
    for (size_t i = 0; i < np && st.ok(); ++i) {
      st = hooks->GradientArrived(i);
      if (!st.ok()) break;
      for (double x : kernels::cpu::GradChunkSumSquares(kb[i], options_.num_threads)) sum += x;
    }
    if (st.ok()) st = hooks->Finish();
    if (!st.ok()) {
      hooks->Abort();
      return st;
    }
    r.sum_squares = sum;
    r.non_finite = !std::isfinite(sum);
  } else {
    const kernels::cpu::GradNormResult norm =
        kernels::cpu::GradSumSquares(kb, options_.num_threads);
    r.sum_squares = norm.sum_squares;
    r.non_finite = !norm.all_finite || !std::isfinite(norm.sum_squares);
  }
  return r;
}

absl::StatusOr<GroupInfo> OptimizerStore::Describe(std::string_view name) const {
  QTX_ASSIGN_OR_RETURN(std::shared_ptr<Group> g, Find(name));
  absl::MutexLock glock(&g->mu);
  if (!g->error.ok()) return Unusable(name, g->error);
  return InfoOf(g->state, g->last_checkpoint_step, absl::OkStatus());
}

absl::Status OptimizerStore::ReadState(
    std::string_view name,
    const std::function<absl::Status(const GroupInfo&, std::span<const ParameterStateView>)>& read)
    const {
  QTX_ASSIGN_OR_RETURN(std::shared_ptr<Group> g, Find(name));
  absl::MutexLock glock(&g->mu);
  if (!g->error.ok()) return Unusable(name, g->error);
  const GroupInfo info = InfoOf(g->state, g->last_checkpoint_step, absl::OkStatus());
  std::vector<ParameterStateView> views;
  views.reserve(g->state.params.size());
  for (size_t i = 0; i < g->state.params.size(); ++i) {
    const ParamState& p = g->state.params[i];
    views.push_back({&info.params[i], p.master.get(), p.exp_avg.get(), p.exp_avg_sq.get()});
  }
  return read(info, views);
}

absl::StatusOr<std::vector<CheckpointResult>> OptimizerStore::SaveCheckpoint(
    std::string_view name) {
  if (options_.checkpoint_dir.empty()) {
    return absl::FailedPreconditionError(
        "checkpoints need a checkpoint directory (start qtxd with --checkpoint_dir)");
  }
  std::vector<std::pair<std::string, std::shared_ptr<Group>>> targets;
  if (name.empty()) {
    absl::MutexLock lock(&mu_);
    for (const auto& [n, g] : groups_) targets.emplace_back(n, g);
  } else {
    QTX_ASSIGN_OR_RETURN(std::shared_ptr<Group> g, Find(name));
    targets.emplace_back(std::string(name), std::move(g));
  }
  std::vector<CheckpointResult> results;
  for (auto& [n, g] : targets) {
    absl::MutexLock glock(&g->mu);
    if (g->released) {
      if (!name.empty()) return Released(n);
      continue;
    }
    if (!g->error.ok()) {
      if (!name.empty()) return Unusable(n, g->error);
      continue;  // never overwrite the evidence of a failed group
    }
    QTX_ASSIGN_OR_RETURN(uint64_t bytes,
                         WriteCheckpoint(options_.checkpoint_dir, g->state, g->KeepPrevious()));
    g->last_checkpoint_step = g->state.config.step;
    g->rotate_on_write = true;
    spdlog::info("event=optimizer_checkpoint group={} step={} bytes={}", n, g->state.config.step,
                 bytes);
    results.push_back({n, g->state.config.step, CheckpointPath(options_.checkpoint_dir, n), bytes});
  }
  return results;
}

absl::StatusOr<GroupInfo> OptimizerStore::InstallFromCheckpoint(const std::string& name,
                                                                const std::string& path,
                                                                bool previous) {
  return Install(
      name,
      [&](const std::function<absl::Status(uint64_t)>& reserve) -> absl::StatusOr<GroupState> {
        QTX_ASSIGN_OR_RETURN(GroupState state, ReadCheckpoint(path, reserve));
        if (state.config.name != name) {
          return absl::DataLossError(absl::StrFormat("checkpoint '%s' holds group '%s', not '%s'",
                                                     path, state.config.name, name));
        }
        return state;
      },
      /*checkpointed=*/true, /*rotate_on_write=*/!previous);
}

absl::StatusOr<GroupInfo> OptimizerStore::Install(
    const std::string& name,
    const std::function<
        absl::StatusOr<GroupState>(const std::function<absl::Status(uint64_t)>& reserve)>& read,
    bool checkpointed, bool rotate_on_write) {
  std::shared_ptr<Group> existing;
  {
    absl::MutexLock lock(&mu_);
    auto it = groups_.find(std::string(name));
    if (it != groups_.end()) existing = it->second;
  }
  uint64_t freed = 0;
  {
    absl::MutexLock lock(&mu_);
    if (existing) freed = existing->HeldBytes();
  }
  uint64_t reserved = 0;
  absl::StatusOr<GroupState> state = read([&](uint64_t bytes) -> absl::Status {
    absl::MutexLock lock(&mu_);
    QTX_RETURN_IF_ERROR(
        Reserve(bytes, freed, absl::StrFormat("checkpoint of optimizer group '%s'", name)));
    reserved = bytes;
    return absl::OkStatus();
  });
  if (!state.ok()) {
    absl::MutexLock lock(&mu_);
    used_bytes_ -= reserved;
    return state.status();
  }
  auto g = std::make_shared<Group>();
  g->bytes = reserved;
  GroupInfo info;
  {
    absl::MutexLock glock(&g->mu);
    g->state = *std::move(state);
    g->last_checkpoint_step = checkpointed ? g->state.config.step : -1;
    g->rotate_on_write = rotate_on_write;
    info = InfoOf(g->state, g->last_checkpoint_step, absl::OkStatus());
  }
  absl::MutexLock lock(&mu_);
  auto it = groups_.find(std::string(name));
  if (it != groups_.end() && it->second == existing && existing) {
    used_bytes_ -= existing->HeldBytes();
  }
  groups_[name] = std::move(g);
  return info;
}

absl::StatusOr<std::string> OptimizerStore::ResolveSource(const std::string& path) const {
  if (path.empty() || path.front() != '/') {
    return absl::InvalidArgumentError(absl::StrFormat(
        "resharding source '%s': must be an absolute path to a checkpoint file", path));
  }
  const size_t slash = path.rfind('/');
  const std::string base = path.substr(slash + 1);
  const std::string suffix(kCheckpointSuffix);
  if (!(base.size() > suffix.size() &&
        (base.ends_with(suffix) || base.ends_with(suffix + std::string(kPreviousSuffix))))) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "resharding source '%s': not a checkpoint file (its name must end in %s or %s%s)", path,
        suffix, suffix, kPreviousSuffix));
  }
  std::vector<std::string> roots;
  if (!options_.checkpoint_dir.empty()) roots.push_back(options_.checkpoint_dir);
  for (const std::string& d : options_.import_dirs) roots.push_back(d);
  if (roots.empty()) {
    return absl::FailedPreconditionError(
        "loading another sidecar's checkpoints needs --checkpoint_import_dirs (the directories "
        "qtxd may read them from) or --checkpoint_dir");
  }
  // The directory with every link resolved; the file itself is opened
  // without following a link.
  const std::string dir = slash == 0 ? "/" : path.substr(0, slash);
  char buf[PATH_MAX];
  if (::realpath(dir.c_str(), buf) == nullptr) {
    if (errno == ENOENT || errno == ENOTDIR) {
      return absl::NotFoundError(
          absl::StrFormat("resharding source '%s': directory '%s' does not exist", path, dir));
    }
    return absl::InternalError(absl::StrFormat("resharding source '%s': resolving '%s': %s", path,
                                               dir, std::strerror(errno)));
  }
  const std::string real_dir = buf;
  for (const std::string& root : roots) {
    if (::realpath(root.c_str(), buf) == nullptr) continue;
    const std::string r = buf;
    if (real_dir == r || (real_dir.size() > r.size() && real_dir.starts_with(r) &&
                          (r == "/" || real_dir[r.size()] == '/'))) {
      return real_dir + "/" + base;
    }
  }
  return absl::PermissionDeniedError(absl::StrFormat(
      "resharding source '%s' is outside the directories this qtxd may read checkpoints from "
      "(--checkpoint_dir and --checkpoint_import_dirs: %s)",
      path, absl::StrJoin(roots, ", ")));
}

absl::StatusOr<GroupInfo> OptimizerStore::LoadResharded(
    std::string_view name, std::span<const std::string> sources,
    const std::vector<std::pair<std::string, kernels::ElementRange>>& shards) {
  QTX_RETURN_IF_ERROR(ValidateGroupName(name));
  if (sources.empty()) {
    return absl::InvalidArgumentError(
        "resharding needs the checkpoint of every old owner in `sources` (none given)");
  }
  std::vector<std::string> paths;
  for (const std::string& s : sources) {
    QTX_ASSIGN_OR_RETURN(std::string p, ResolveSource(s));
    paths.push_back(std::move(p));
  }
  const std::string n(name);
  QTX_ASSIGN_OR_RETURN(GroupInfo info,
                       Install(
                           n,
                           [&](const std::function<absl::Status(uint64_t)>& reserve) {
                             return ReadResharded(paths, n, shards, reserve);
                           },
                           /*checkpointed=*/false, /*rotate_on_write=*/true));
  spdlog::info("event=optimizer_group_resharded group={} step={} sources={} elements={}", n,
               info.config.step, paths.size(), info.num_elements);
  return info;
}

absl::StatusOr<GroupInfo> OptimizerStore::LoadCheckpoint(std::string_view name, bool previous) {
  if (options_.checkpoint_dir.empty()) {
    return absl::FailedPreconditionError(
        "checkpoints need a checkpoint directory (start qtxd with --checkpoint_dir)");
  }
  QTX_RETURN_IF_ERROR(ValidateGroupName(name));
  const std::string n(name);
  const std::string path = previous ? PreviousCheckpointPath(options_.checkpoint_dir, n)
                                    : CheckpointPath(options_.checkpoint_dir, n);
  QTX_ASSIGN_OR_RETURN(GroupInfo info, InstallFromCheckpoint(n, path, previous));
  if (previous) {
    spdlog::warn(
        "event=optimizer_group_restored_previous group={} step={} path={} (fallback requested "
        "by the client; the newest checkpoint is not used and will be replaced without "
        "rotation)",
        n, info.config.step, path);
  }
  return info;
}

absl::Status OptimizerStore::CheckpointAll(absl::Duration lock_wait) {
  if (options_.checkpoint_dir.empty()) return absl::OkStatus();
  if (lock_wait == absl::InfiniteDuration()) return SaveCheckpoint("").status();
  std::vector<std::pair<std::string, std::shared_ptr<Group>>> targets;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [n, g] : groups_) targets.emplace_back(n, g);
  }
  absl::Status first;
  const absl::Time deadline = absl::Now() + lock_wait;
  for (auto& [n, g] : targets) {
    bool locked = g->mu.TryLock();
    while (!locked && absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(5));
      locked = g->mu.TryLock();
    }
    if (!locked) {
      absl::Status e = absl::DeadlineExceededError(absl::StrFormat(
          "optimizer group '%s' was not checkpointed: a call holding it did not finish; its "
          "previous checkpoint on disk (if any) is kept",
          n));
      spdlog::error("event=optimizer_checkpoint_skipped group={} reason=locked", n);
      if (first.ok()) first = e;
      continue;
    }
    g->mu.AssertHeld();
    absl::Status s;
    if (!g->released && g->error.ok()) {
      absl::StatusOr<uint64_t> bytes =
          WriteCheckpoint(options_.checkpoint_dir, g->state, g->KeepPrevious());
      if (bytes.ok()) {
        g->last_checkpoint_step = g->state.config.step;
        g->rotate_on_write = true;
        spdlog::info("event=optimizer_checkpoint group={} step={} bytes={}", n,
                     g->state.config.step, *bytes);
      } else {
        s = bytes.status();
      }
    }
    g->mu.Unlock();
    if (first.ok() && !s.ok()) first = s;
  }
  return first;
}

absl::Status OptimizerStore::ReleaseGroup(std::string_view name) {
  std::shared_ptr<Group> g;
  {
    absl::MutexLock lock(&mu_);
    auto it = groups_.find(std::string(name));
    if (it == groups_.end()) {
      return absl::NotFoundError(absl::StrFormat("optimizer group '%s' does not exist", name));
    }
    g = it->second;
  }
  // Under the group's lock (lock order: a group's mu, then the store's mu_),
  // so that no Step or checkpoint write of this group runs meanwhile or after.
  absl::MutexLock glock(&g->mu);
  if (g->released) {
    return absl::NotFoundError(absl::StrFormat("optimizer group '%s' does not exist", name));
  }
  if (!options_.checkpoint_dir.empty() && ValidateGroupName(name).ok()) {
    // The newest first: once it is gone a restart no longer restores the
    // group, whatever happens to .prev.
    const std::string path = CheckpointPath(options_.checkpoint_dir, name);
    if (::unlink(path.c_str()) != 0 && errno != ENOENT) {
      return absl::InternalError(absl::StrFormat(
          "ReleaseGroup('%s'): cannot delete its checkpoint '%s': %s; the group is kept", name,
          path, std::strerror(errno)));
    }
    const std::string prev = PreviousCheckpointPath(options_.checkpoint_dir, name);
    if (::unlink(prev.c_str()) != 0 && errno != ENOENT) {
      spdlog::warn("event=optimizer_checkpoint_delete_failed group={} path={} error=\"{}\"", name,
                   prev, std::strerror(errno));
    }
    SyncDirectory(options_.checkpoint_dir);
  }
  g->released = true;
  absl::MutexLock lock(&mu_);
  auto it = groups_.find(std::string(name));
  if (it != groups_.end() && it->second == g) {
    used_bytes_ -= g->HeldBytes();
    groups_.erase(it);
  }
  spdlog::info("event=optimizer_group_released group={}", name);
  return absl::OkStatus();
}

std::vector<GroupInfo> OptimizerStore::ListGroups() const {
  std::vector<std::shared_ptr<Group>> gs;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [n, g] : groups_) gs.push_back(g);
  }
  std::vector<GroupInfo> out;
  for (const auto& g : gs) {
    absl::MutexLock glock(&g->mu);
    out.push_back(InfoOf(g->state, g->last_checkpoint_step, g->error));
  }
  std::sort(out.begin(), out.end(),
            [](const GroupInfo& a, const GroupInfo& b) { return a.config.name < b.config.name; });
  return out;
}

uint64_t OptimizerStore::memory_used_bytes() const {
  absl::MutexLock lock(&mu_);
  return used_bytes_;
}

}  // namespace qtx::server::optimizer
