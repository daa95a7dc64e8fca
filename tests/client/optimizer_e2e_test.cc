// End-to-end: qtx::Client's Optimizer calls against a qtxd it starts
// (--qtxd=<path>). The updated master weights must equal the scalar AdamW
// reference (kernels::cpu::AdamWReference) bit for bit and the FP8 parameters
// must equal its QuantizeBlock output byte for byte; plus idempotent steps,
// GetState inline and into a shm region, checkpoints, release/load, and the
// explicit fallback to the previous checkpoint after the newest is corrupted.
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/adamw.h"
#include "kernels/block_geometry.h"
#include "kernels/cpu/adamw.h"
#include "kernels/cpu/quantize_tensor.h"
#include "qtx/client.h"
#include "qtx/shm_region.h"
#include "tests/testing/qtxd_process.h"
#include "tests/testing/status_matchers.h"

namespace qtx {
namespace {

using ::qtx::testing::QtxdProcess;
using ::qtx::testing::StatusIs;
using ::testing::HasSubstr;

std::string g_qtxd_path;  // from --qtxd=

std::string Bytes(const void* p, size_t n) { return std::string(static_cast<const char*>(p), n); }

// One parameter's reference state, stepped with kernels::cpu::AdamWReference.
struct RefParam {
  std::string name;
  std::vector<int64_t> shape;
  int64_t m = 0, n = 0;
  std::vector<float> master, exp_avg, exp_avg_sq;
  kernels::QuantizedLayout layout;
  std::string row, row_scale, col, col_scale;  // last FP8 outputs
};

RefParam MakeParam(std::string name, std::vector<int64_t> shape, uint64_t seed) {
  RefParam p;
  p.name = std::move(name);
  p.shape = std::move(shape);
  p.n = p.shape.back();
  p.m = 1;
  for (size_t i = 0; i + 1 < p.shape.size(); ++i) p.m *= p.shape[i];
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.0f, 0.1f);
  p.master.resize(p.m * p.n);
  for (float& x : p.master) x = nd(rng);
  p.exp_avg.assign(p.m * p.n, 0.0f);
  p.exp_avg_sq.assign(p.m * p.n, 0.0f);
  p.layout = kernels::ComputeLayout(kernels::BlockScaling::kBlock2D, p.m, p.n);
  return p;
}

std::vector<float> RandomGrad(int64_t count, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> g(count);
  for (float& x : g) x = nd(rng);
  return g;
}

// Applies one reference step (gradients times grad_scale) and records the
// FP8 outputs.
void ReferenceStep(std::vector<RefParam>& ps, const std::vector<std::vector<float>>& grads,
                   const kernels::AdamWHyperParams& h, int64_t t, double grad_scale = 1.0) {
  for (size_t i = 0; i < ps.size(); ++i) {
    RefParam& p = ps[i];
    const kernels::QuantizedLayout& l = p.layout;
    p.row.assign(l.RowwiseDataBytes(), '\0');
    p.row_scale.assign(4 * l.RowwiseScaleCount(), '\0');
    p.col.assign(l.ColumnwiseDataBytes(), '\0');
    p.col_scale.assign(4 * l.ColumnwiseScaleCount(), '\0');
    kernels::cpu::AdamWParamBuffers b;
    b.m = p.m;
    b.n = p.n;
    b.master = p.master.data();
    b.exp_avg = p.exp_avg.data();
    b.exp_avg_sq = p.exp_avg_sq.data();
    b.grad = grads[i].data();
    b.quant.scaling = kernels::BlockScaling::kBlock2D;
    b.quant.rowwise = true;
    b.quant.columnwise = true;
    b.fp8 = {reinterpret_cast<uint8_t*>(p.row.data()), reinterpret_cast<float*>(p.row_scale.data()),
             reinterpret_cast<uint8_t*>(p.col.data()),
             reinterpret_cast<float*>(p.col_scale.data())};
    kernels::cpu::AdamWReference({&b, 1}, kernels::MakeAdamWScalars(h, t, grad_scale));
  }
}

class OptimizerE2eTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/qtx-opt-e2e-XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
    StartServer();
    hyper_.lr = 1e-2;
    hyper_.weight_decay = 0.1;
    params_.push_back(MakeParam("w1", {200, 96}, 1));    // partial 128x128 tiles
    params_.push_back(MakeParam("b1", {130}, 2));        // 1-D: [1, 130]
    params_.push_back(MakeParam("w2", {2, 3, 129}, 3));  // rank 3: [6, 129]
  }
  void TearDown() override {
    StopServer();
    std::filesystem::remove_all(dir_);
  }
  void StartServer() {
    auto server =
        QtxdProcess::Start(g_qtxd_path, {"--allow_client_shm", "--device=cpu",
                                         "--checkpoint_dir=" + dir_ + "/ckpt", "--log_level=warn"});
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    auto client = Client::Connect(server_->target());
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = *std::move(client);
  }
  void StopServer() {
    client_.reset();
    if (server_ != nullptr) {
      absl::StatusOr<int> code = server_->Stop();
      ASSERT_TRUE(code.ok()) << code.status();
      EXPECT_EQ(*code, 0);
      server_.reset();
    }
  }

  absl::StatusOr<OptimizerGroupInfo> Offload() {
    OptimizerGroupConfig c;
    c.group = "mlp";
    c.hyper_params.lr = hyper_.lr;
    c.hyper_params.weight_decay = hyper_.weight_decay;
    std::vector<OptimizerParameterInit> inits;
    for (const RefParam& p : params_) {
      inits.push_back({p.name, p.shape, Tensor::FromFloat32(p.shape, p.master), {}, {}});
    }
    return client_->OffloadOptimizerState(c, inits);
  }

  // Sends step t's gradients to qtxd and applies them to the reference.
  absl::StatusOr<OptimizerStepResult> StepBoth(int64_t t, bool reference = true) {
    std::vector<std::vector<float>> grads;
    std::vector<OptimizerGradient> gs;
    for (size_t i = 0; i < params_.size(); ++i) {
      grads.push_back(RandomGrad(params_[i].m * params_[i].n, 100 * t + i));
      gs.push_back({params_[i].name, Tensor::FromFloat32(params_[i].shape, grads.back())});
    }
    absl::StatusOr<OptimizerStepResult> r = client_->Step("mlp", t, gs);
    if (r.ok() && reference) ReferenceStep(params_, grads, hyper_, t);
    return r;
  }

  void ExpectMatchesReference(const OptimizerStepResult& r) {
    std::vector<size_t> all;
    for (size_t i = 0; i < params_.size(); ++i) all.push_back(i);
    ExpectMatchesReference(r, all);
  }
  // The result of a group holding params_[which[0]], params_[which[1]], ...
  void ExpectMatchesReference(const OptimizerStepResult& r, const std::vector<size_t>& which) {
    ASSERT_EQ(r.parameters.size(), which.size());
    for (size_t k = 0; k < which.size(); ++k) {
      const ParameterOutput& out = r.parameters[k];
      const RefParam& p = params_[which[k]];
      EXPECT_EQ(out.name, p.name);
      ASSERT_TRUE(out.fp8.has_value());
      EXPECT_FALSE(out.bf16.has_value());
      EXPECT_EQ(out.fp8->shape, p.shape);
      EXPECT_EQ(out.fp8->config.scaling_mode, ScalingMode::kBlock2D);
      ASSERT_TRUE(out.fp8->rowwise_data && out.fp8->columnwise_data);
      EXPECT_EQ(out.fp8->rowwise_data->dtype, DType::kFloat8E4M3);
      EXPECT_TRUE(out.fp8->rowwise_data->data == p.row) << p.name << " rowwise data";
      EXPECT_TRUE(out.fp8->rowwise_scale_inv->data == p.row_scale) << p.name;
      EXPECT_TRUE(out.fp8->columnwise_data->data == p.col) << p.name << " columnwise data";
      EXPECT_TRUE(out.fp8->columnwise_scale_inv->data == p.col_scale) << p.name;
    }
  }

  std::string dir_;
  std::unique_ptr<QtxdProcess> server_;
  std::unique_ptr<Client> client_;
  kernels::AdamWHyperParams hyper_;
  std::vector<RefParam> params_;
};

TEST_F(OptimizerE2eTest, StepsMatchTheReferenceBitForBitAndRetriesReplay) {
  QTX_ASSERT_OK_AND_ASSIGN(OptimizerGroupInfo info, Offload());
  EXPECT_EQ(info.name, "mlp");
  EXPECT_EQ(info.step, 0);
  EXPECT_EQ(info.num_parameters, 3);
  EXPECT_EQ(info.num_elements, 200 * 96 + 130 + 6 * 129);
  EXPECT_EQ(info.state_bytes, static_cast<uint64_t>(info.num_elements) * 12);
  EXPECT_EQ(info.hyper_params.lr, 1e-2);
  EXPECT_EQ(info.output.fp8.scaling_mode, ScalingMode::kBlock2D);
  EXPECT_TRUE(info.output.fp8.columnwise);
  EXPECT_EQ(info.last_checkpoint_step, -1);

  OptimizerStepResult last;
  for (int64_t t = 1; t <= 3; ++t) {
    QTX_ASSERT_OK_AND_ASSIGN(last, StepBoth(t));
    EXPECT_EQ(last.stats.step, t);
    EXPECT_FALSE(last.stats.skipped);
    EXPECT_FALSE(last.stats.replayed);
    EXPECT_EQ(last.stats.clip_coef, 1.0);
    EXPECT_GT(last.stats.grad_norm, 0.0);
    ExpectMatchesReference(last);
  }
  // The master weights and moments, bit for bit.
  GetStateOptions gopt;
  gopt.include_moments = true;
  QTX_ASSERT_OK_AND_ASSIGN(OptimizerState st, client_->GetState("mlp", gopt));
  EXPECT_EQ(st.group.step, 3);
  EXPECT_EQ(st.group.update_count, 3);
  ASSERT_EQ(st.parameters.size(), params_.size());
  for (size_t i = 0; i < params_.size(); ++i) {
    const RefParam& p = params_[i];
    EXPECT_EQ(st.parameters[i].master.shape, p.shape);
    EXPECT_TRUE(st.parameters[i].master.data == Bytes(p.master.data(), 4 * p.master.size()))
        << p.name;
    ASSERT_TRUE(st.parameters[i].exp_avg && st.parameters[i].exp_avg_sq);
    EXPECT_TRUE(st.parameters[i].exp_avg->data == Bytes(p.exp_avg.data(), 4 * p.exp_avg.size()));
    EXPECT_TRUE(st.parameters[i].exp_avg_sq->data ==
                Bytes(p.exp_avg_sq.data(), 4 * p.exp_avg_sq.size()));
  }
  // A retry of step 3 (different gradients) is answered from its result.
  QTX_ASSERT_OK_AND_ASSIGN(OptimizerStepResult again, StepBoth(3, /*reference=*/false));
  EXPECT_TRUE(again.stats.replayed);
  EXPECT_EQ(again.stats.grad_norm, last.stats.grad_norm);
  ExpectMatchesReference(again);
  // A step from the future or the past fails naming the group's step.
  EXPECT_THAT(StepBoth(5, false),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("is at step 3")));
  EXPECT_THAT(StepBoth(1, false),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("the next step is 4")));
  // Options: an lr override and clipping are reported; omit_parameters.
  StepOptions so;
  so.lr = 5e-3;
  so.max_grad_norm = 1.0;
  so.omit_parameters = true;
  std::vector<OptimizerGradient> gs;
  for (const RefParam& p : params_) {
    gs.push_back({p.name, Tensor::FromFloat32(p.shape, RandomGrad(p.m * p.n, 7))});
  }
  QTX_ASSERT_OK_AND_ASSIGN(OptimizerStepResult r4, client_->Step("mlp", 4, gs, so));
  EXPECT_EQ(r4.stats.lr, 5e-3);
  EXPECT_LT(r4.stats.clip_coef, 1.0);
  EXPECT_TRUE(r4.parameters.empty());
  // Errors keep their codes.
  gs.pop_back();
  EXPECT_THAT(client_->Step("mlp", 5, gs),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("missing the gradient")));
  EXPECT_THAT(client_->Step("nope", 1, gs),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("nope")));
  EXPECT_THAT(Offload(), StatusIs(absl::StatusCode::kAlreadyExists, HasSubstr("mlp")));
}

// Two-phase steps over two groups (as two ranks' shares of one model): the
// global clip factor from the GradNorm contributions, the update equal to
// the reference AdamW with that factor; a NaN on one group skips both.
TEST_F(OptimizerE2eTest, TwoPhaseStepsAcrossGroupsMatchTheReferenceWithTheGlobalClip) {
  const std::vector<std::vector<size_t>> groups = {{0, 1}, {2}};
  const char* names[2] = {"rank0", "rank1"};
  for (int k = 0; k < 2; ++k) {
    OptimizerGroupConfig c;
    c.group = names[k];
    c.hyper_params.lr = hyper_.lr;
    c.hyper_params.weight_decay = hyper_.weight_decay;
    std::vector<OptimizerParameterInit> inits;
    for (size_t i : groups[k]) {
      const RefParam& p = params_[i];
      inits.push_back({p.name, p.shape, Tensor::FromFloat32(p.shape, p.master), {}, {}});
    }
    QTX_ASSERT_OK(client_->OffloadOptimizerState(c, inits).status());
  }
  constexpr double kMaxNorm = 40.0;
  for (int64_t t = 1; t <= 3; ++t) {
    std::vector<std::vector<float>> grads;
    std::vector<OptimizerGradient> gs[2];
    double sum = 0.0;  // computed here, independently
    for (int k = 0; k < 2; ++k) {
      for (size_t i : groups[k]) {
        grads.push_back(RandomGrad(params_[i].m * params_[i].n, 1000 * t + i));
        for (float x : grads.back()) sum += static_cast<double>(x) * x;
        gs[k].push_back({params_[i].name, Tensor::FromFloat32(params_[i].shape, grads.back())});
      }
    }
    double total = 0.0;
    bool non_finite = false;
    for (int k = 0; k < 2; ++k) {
      QTX_ASSERT_OK_AND_ASSIGN(GradNormResult n, client_->GradNorm(names[k], t, gs[k]));
      EXPECT_EQ(n.step, t);
      EXPECT_FALSE(n.step_processed);
      EXPECT_EQ(n.grad_norm, std::sqrt(n.sum_squares));
      total += n.sum_squares;
      non_finite = non_finite || n.non_finite;
    }
    EXPECT_FALSE(non_finite);
    EXPECT_NEAR(total, sum, 1e-12 * sum);
    const double clip = ClipFactor(total, kMaxNorm);
    EXPECT_EQ(clip, std::min(1.0, kMaxNorm / (std::sqrt(total) + 1e-6)));
    EXPECT_LT(clip, 1.0) << "the test means to clip (norm " << std::sqrt(total) << ")";
    ReferenceStep(params_, grads, hyper_, t, clip);
    StepOptions so;
    so.clip_factor = clip;
    for (int k = 0; k < 2; ++k) {
      QTX_ASSERT_OK_AND_ASSIGN(OptimizerStepResult r, client_->Step(names[k], t, gs[k], so));
      EXPECT_EQ(r.stats.clip_coef, clip);
      EXPECT_EQ(r.stats.grad_norm, 0.0);
      EXPECT_FALSE(r.stats.skipped);
      ExpectMatchesReference(r, groups[k]);
    }
  }
  // Step 4: an Inf in rank1's gradients; both ranks skip, unchanged.
  std::vector<OptimizerGradient> gs[2];
  for (int k = 0; k < 2; ++k) {
    for (size_t i : groups[k]) {
      std::vector<float> g = RandomGrad(params_[i].m * params_[i].n, 4000 + i);
      if (k == 1) g[3] = std::numeric_limits<float>::infinity();
      gs[k].push_back({params_[i].name, Tensor::FromFloat32(params_[i].shape, g)});
    }
  }
  QTX_ASSERT_OK_AND_ASSIGN(GradNormResult n0, client_->GradNorm(names[0], 4, gs[0]));
  QTX_ASSERT_OK_AND_ASSIGN(GradNormResult n1, client_->GradNorm(names[1], 4, gs[1]));
  EXPECT_FALSE(n0.non_finite);
  EXPECT_TRUE(n1.non_finite);
  StepOptions skip;
  skip.skip = true;
  for (int k = 0; k < 2; ++k) {
    // The gradients are not needed to skip.
    QTX_ASSERT_OK_AND_ASSIGN(OptimizerStepResult r, client_->Step(names[k], 4, {}, skip));
    EXPECT_TRUE(r.stats.skipped);
    ExpectMatchesReference(r, groups[k]);  // the parameters of step 3
    QTX_ASSERT_OK_AND_ASSIGN(OptimizerStepResult again, client_->Step(names[k], 4, {}, skip));
    EXPECT_TRUE(again.stats.replayed);
    EXPECT_TRUE(again.stats.skipped);
  }
  GetStateOptions gopt;
  gopt.include_moments = true;
  for (int k = 0; k < 2; ++k) {
    QTX_ASSERT_OK_AND_ASSIGN(OptimizerState st, client_->GetState(names[k], gopt));
    EXPECT_EQ(st.group.step, 4);
    EXPECT_EQ(st.group.update_count, 3);
    for (size_t j = 0; j < groups[k].size(); ++j) {
      const RefParam& p = params_[groups[k][j]];
      EXPECT_TRUE(st.parameters[j].master.data == Bytes(p.master.data(), 4 * p.master.size()));
      EXPECT_TRUE(st.parameters[j].exp_avg_sq->data ==
                  Bytes(p.exp_avg_sq.data(), 4 * p.exp_avg_sq.size()));
    }
  }
  // Bad input: a person can act on each message.
  StepOptions bad;
  bad.clip_factor = 0.0;
  EXPECT_THAT(client_->Step(names[0], 5, gs[0], bad),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("clip_factor=0: must be finite and > 0")));
  bad.clip_factor = std::nan("");
  EXPECT_THAT(client_->Step(names[0], 5, gs[0], bad),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("clip_factor=nan")));
  bad.clip_factor = 0.5;
  bad.max_grad_norm = 1.0;
  EXPECT_THAT(
      client_->Step(names[0], 5, gs[0], bad),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("clip_factor with max_grad_norm")));
  EXPECT_THAT(client_->GradNorm(names[0], 9, gs[0]),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("'rank0' is at step 4: GradNorm measures the gradients of its "
                                 "next step 5")));
  EXPECT_THAT(client_->GradNorm("nope", 1, gs[0]),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("'nope' does not exist")));
  EXPECT_THAT(client_->GradNorm(names[0], 5, {gs[0][0]}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("missing the gradient of parameter 'b1'")));
  QTX_ASSERT_OK_AND_ASSIGN(OptimizerGroupList list, client_->ListOptimizerGroups());
  ASSERT_EQ(list.groups.size(), 2u);
  EXPECT_EQ(list.groups[0].name, "rank0");
  EXPECT_EQ(list.groups[0].step, 4);  // the failed calls changed nothing
}

// Per-parameter weight decay and learning-rate scale through the client:
// each parameter equals the reference stepped with its own settings; the
// group reports them; bad values are INVALID_ARGUMENT naming the parameter.
TEST_F(OptimizerE2eTest, PerParameterSettingsMatchTheReference) {
  OptimizerGroupConfig c;
  c.group = "mlp";
  c.hyper_params.lr = hyper_.lr;
  c.hyper_params.weight_decay = hyper_.weight_decay;
  std::vector<OptimizerParameterInit> inits;
  for (const RefParam& p : params_) {
    inits.push_back({p.name, p.shape, Tensor::FromFloat32(p.shape, p.master), {}, {}});
  }
  inits[1].weight_decay = 0.0;  // the bias
  inits[2].lr_scale = 0.5;
  inits[2].weight_decay = 0.2;
  std::vector<OptimizerParameterInit> bad = inits;
  bad[1].weight_decay = -1.0;
  EXPECT_THAT(client_->OffloadOptimizerState(c, bad),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("parameters[1] ('b1').weight_decay=-1: must be finite and >= 0")));
  bad = inits;
  bad[2].lr_scale = std::nan("");
  EXPECT_THAT(
      client_->OffloadOptimizerState(c, bad),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("parameters[2] ('w2').lr_scale=nan")));
  QTX_ASSERT_OK_AND_ASSIGN(OptimizerGroupInfo info, client_->OffloadOptimizerState(c, inits));
  ASSERT_EQ(info.parameter_hyper_params.size(), 2u);
  EXPECT_EQ(info.parameter_hyper_params[0], (ParameterHyperParams{"b1", 0.0, 1.0}));
  EXPECT_EQ(info.parameter_hyper_params[1], (ParameterHyperParams{"w2", 0.2, 0.5}));
  for (int64_t t = 1; t <= 2; ++t) {
    std::vector<std::vector<float>> grads;
    std::vector<OptimizerGradient> gs;
    for (size_t i = 0; i < params_.size(); ++i) {
      grads.push_back(RandomGrad(params_[i].m * params_[i].n, 500 * t + i));
      gs.push_back({params_[i].name, Tensor::FromFloat32(params_[i].shape, grads.back())});
    }
    StepOptions so;
    so.lr = 4e-3;  // this step's lr: w2 gets half of it
    QTX_ASSERT_OK_AND_ASSIGN(OptimizerStepResult r, client_->Step("mlp", t, gs, so));
    for (size_t i = 0; i < params_.size(); ++i) {
      kernels::AdamWHyperParams h = hyper_;
      h.lr = 4e-3;
      if (i == 1) h.weight_decay = 0.0;
      if (i == 2) {
        h.lr = 4e-3 * 0.5;
        h.weight_decay = 0.2;
      }
      std::vector<RefParam> one = {params_[i]};
      ReferenceStep(one, {grads[i]}, h, t);
      params_[i] = one[0];
    }
    ExpectMatchesReference(r);
  }
  QTX_ASSERT_OK_AND_ASSIGN(OptimizerGroupList list, client_->ListOptimizerGroups());
  ASSERT_EQ(list.groups.size(), 1u);
  EXPECT_EQ(list.groups[0].parameter_hyper_params, info.parameter_hyper_params);
}

TEST_F(OptimizerE2eTest, GetStateIntoAShmRegion) {
  QTX_ASSERT_OK(Offload().status());
  QTX_ASSERT_OK(StepBoth(1).status());
  const RefParam& w1 = params_[0];
  const uint64_t bytes = 4 * w1.master.size();
  QTX_ASSERT_OK_AND_ASSIGN(std::unique_ptr<ShmRegion> shm,
                           ShmRegion::Create("state", 3 * bytes + 64));
  QTX_ASSERT_OK(client_->RegisterShmRegion(*shm));
  GetStateOptions o;
  o.names = {"w1", "b1"};
  o.include_moments = true;
  o.destinations.push_back({"w1", RegionSlice{"state", 0, bytes},
                            RegionSlice{"state", bytes, bytes},
                            RegionSlice{"state", 2 * bytes, bytes}});
  QTX_ASSERT_OK_AND_ASSIGN(OptimizerState st, client_->GetState("mlp", o));
  ASSERT_EQ(st.parameters.size(), 2u);
  EXPECT_EQ(st.parameters[0].name, "w1");
  ASSERT_TRUE(st.parameters[0].master.in_region());
  EXPECT_EQ(*st.parameters[0].master.region, (RegionSlice{"state", 0, bytes}));
  EXPECT_TRUE(st.parameters[0].master.data.empty());
  EXPECT_EQ(std::memcmp(shm->data(), w1.master.data(), bytes), 0);
  EXPECT_EQ(std::memcmp(shm->data() + bytes, w1.exp_avg.data(), bytes), 0);
  EXPECT_EQ(std::memcmp(shm->data() + 2 * bytes, w1.exp_avg_sq.data(), bytes), 0);
  // b1 had no destination: inline.
  EXPECT_FALSE(st.parameters[1].master.in_region());
  EXPECT_TRUE(st.parameters[1].master.data ==
              Bytes(params_[1].master.data(), 4 * params_[1].master.size()));

  o.destinations[0].master->size = bytes - 4;
  EXPECT_THAT(client_->GetState("mlp", o),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("destinations['w1'].master")));
  o.destinations[0].master->size = bytes;
  o.include_moments = false;
  EXPECT_THAT(client_->GetState("mlp", o),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("need include_moments")));
  o.destinations = {{"w2", RegionSlice{"state", 0, 4 * 6 * 129}, {}, {}}};
  EXPECT_THAT(client_->GetState("mlp", o),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("'w2' is not among")));
  o.destinations.clear();
  o.names = {"zzz"};
  EXPECT_THAT(client_->GetState("mlp", o), StatusIs(absl::StatusCode::kNotFound, HasSubstr("zzz")));
  QTX_ASSERT_OK(client_->UnregisterRegion("state"));
}

// Per-tensor current scaling as the parameter format (output.fp8.scaling_mode
// = TENSOR): after every step each parameter's FP8 copies are QuantizeTensor
// of its updated master (one [1] scale_inv per copy); the format survives a
// checkpoint; a data-parallel sharded group would refuse it (§10).
TEST_F(OptimizerE2eTest, PerTensorScaledParametersAreQuantizeTensorOfTheUpdatedMaster) {
  OptimizerGroupConfig c;
  c.group = "cur";
  c.hyper_params.lr = hyper_.lr;
  c.output.fp8.scaling_mode = ScalingMode::kTensor;
  c.output.fp8.force_pow2_scales = false;  // TransformerEngine's current-scaling default
  std::vector<OptimizerParameterInit> inits;
  for (const RefParam& p : params_) {
    inits.push_back({p.name, p.shape, Tensor::FromFloat32(p.shape, p.master), {}, {}});
  }
  QTX_ASSERT_OK_AND_ASSIGN(OptimizerGroupInfo info, client_->OffloadOptimizerState(c, inits));
  EXPECT_EQ(info.output.fp8.scaling_mode, ScalingMode::kTensor);
  auto check = [&](const OptimizerStepResult& r, int64_t t) {
    QTX_ASSERT_OK_AND_ASSIGN(OptimizerState st, client_->GetState("cur"));
    ASSERT_EQ(r.parameters.size(), params_.size());
    for (size_t i = 0; i < params_.size(); ++i) {
      const RefParam& p = params_[i];
      const std::string& master = st.parameters[i].master.data;
      std::string row(p.m * p.n, '\0'), col(p.m * p.n, '\0');
      float row_scale = 0, col_scale = 0;
      kernels::QuantizeParams q;
      q.scaling = kernels::BlockScaling::kTensor;
      q.rowwise = q.columnwise = true;
      q.force_pow2_scales = false;
      kernels::cpu::QuantizeTensor(master.data(), kernels::InputDType::kFloat32, p.m, p.n, q,
                                   {reinterpret_cast<uint8_t*>(row.data()), &row_scale,
                                    reinterpret_cast<uint8_t*>(col.data()), &col_scale});
      ASSERT_TRUE(r.parameters[i].fp8.has_value()) << p.name;
      const QuantizedTensor& f = *r.parameters[i].fp8;
      EXPECT_EQ(f.rowwise_scale_inv->shape, std::vector<int64_t>{1}) << p.name;
      EXPECT_TRUE(f.rowwise_data->data == row) << p.name << " step " << t;
      EXPECT_TRUE(f.columnwise_data->data == col) << p.name << " step " << t;
      EXPECT_TRUE(f.rowwise_scale_inv->data == Bytes(&row_scale, 4)) << p.name << " step " << t;
      EXPECT_TRUE(f.columnwise_scale_inv->data == Bytes(&col_scale, 4)) << p.name;
    }
  };
  auto step = [&](int64_t t) {
    std::vector<OptimizerGradient> gs;
    for (size_t i = 0; i < params_.size(); ++i) {
      gs.push_back({params_[i].name,
                    Tensor::FromFloat32(params_[i].shape,
                                        RandomGrad(params_[i].m * params_[i].n, 300 * t + i))});
    }
    QTX_ASSERT_OK_AND_ASSIGN(OptimizerStepResult r, client_->Step("cur", t, gs));
    ASSERT_NO_FATAL_FAILURE(check(r, t));
  };
  ASSERT_NO_FATAL_FAILURE(step(1));
  ASSERT_NO_FATAL_FAILURE(step(2));
  // Through a checkpoint and a restart: the format comes back with the state.
  QTX_ASSERT_OK(client_->SaveCheckpoint("cur").status());
  StopServer();
  StartServer();
  QTX_ASSERT_OK_AND_ASSIGN(info, client_->LoadCheckpoint("cur"));
  EXPECT_EQ(info.output.fp8.scaling_mode, ScalingMode::kTensor);
  EXPECT_FALSE(info.output.fp8.force_pow2_scales);
  ASSERT_NO_FATAL_FAILURE(step(3));
}

TEST_F(OptimizerE2eTest, CheckpointsReleaseLoadAndList) {
  QTX_ASSERT_OK(Offload().status());
  QTX_ASSERT_OK(StepBoth(1).status());
  QTX_ASSERT_OK(StepBoth(2).status());
  QTX_ASSERT_OK_AND_ASSIGN(std::vector<CheckpointInfo> saved, client_->SaveCheckpoint());
  ASSERT_EQ(saved.size(), 1u);
  EXPECT_EQ(saved[0].group, "mlp");
  EXPECT_EQ(saved[0].step, 2);
  EXPECT_EQ(saved[0].path, dir_ + "/ckpt/mlp.qtxopt");
  EXPECT_EQ(saved[0].bytes, std::filesystem::file_size(saved[0].path));

  QTX_ASSERT_OK_AND_ASSIGN(OptimizerGroupList list, client_->ListOptimizerGroups());
  ASSERT_EQ(list.groups.size(), 1u);
  EXPECT_EQ(list.groups[0].last_checkpoint_step, 2);
  EXPECT_EQ(list.memory_used_bytes, list.groups[0].state_bytes);
  EXPECT_GT(list.memory_limit_bytes, list.memory_used_bytes);

  QTX_ASSERT_OK(client_->ReleaseGroup("mlp"));
  EXPECT_THAT(client_->ReleaseGroup("mlp"),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("mlp")));
  EXPECT_THAT(StepBoth(3, false), StatusIs(absl::StatusCode::kNotFound, HasSubstr("mlp")));
  QTX_ASSERT_OK_AND_ASSIGN(list, client_->ListOptimizerGroups());
  EXPECT_TRUE(list.groups.empty());
  EXPECT_EQ(list.memory_used_bytes, 0u);

  // Releasing is final (issue 18 item 13): the group's checkpoints went with
  // it, so it cannot come back after a restart.
  EXPECT_THAT(client_->LoadCheckpoint("mlp"),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("mlp.qtxopt")));
  EXPECT_FALSE(std::filesystem::exists(saved[0].path));
  EXPECT_THAT(client_->LoadCheckpoint("other"),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("other.qtxopt")));
}

TEST_F(OptimizerE2eTest, CorruptedNewestCheckpointFallsBackToPreviousOnlyWhenAsked) {
  QTX_ASSERT_OK(Offload().status());
  QTX_ASSERT_OK(StepBoth(1).status());
  QTX_ASSERT_OK(client_->SaveCheckpoint("mlp").status());  // step 1
  const std::vector<RefParam> at_step1 = params_;
  QTX_ASSERT_OK(StepBoth(2).status());
  QTX_ASSERT_OK(client_->SaveCheckpoint("mlp").status());  // step 2; step 1 -> .prev
  const std::string newest = dir_ + "/ckpt/mlp.qtxopt";
  const std::string prev = newest + ".prev";
  ASSERT_TRUE(std::filesystem::exists(prev));
  StopServer();
  {  // flip one bit in the middle of the newest checkpoint
    std::fstream f(newest, std::ios::in | std::ios::out | std::ios::binary);
    const auto mid = static_cast<std::streamoff>(std::filesystem::file_size(newest) / 2);
    f.seekg(mid);
    char c = 0;
    f.read(&c, 1);
    c ^= 0x10;
    f.seekp(mid);
    f.write(&c, 1);
  }
  StartServer();
  // Never a silent fallback: the group is unusable and says what exists.
  QTX_ASSERT_OK_AND_ASSIGN(OptimizerGroupList list, client_->ListOptimizerGroups());
  ASSERT_EQ(list.groups.size(), 1u);
  EXPECT_THAT(list.groups[0].error, HasSubstr("checksum mismatch"));
  EXPECT_THAT(list.groups[0].error, HasSubstr("previous=true"));
  EXPECT_THAT(StepBoth(3, false),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("mlp.qtxopt.prev' exists")));
  EXPECT_THAT(client_->LoadCheckpoint("mlp"), StatusIs(absl::StatusCode::kDataLoss, ::testing::_));
  // The explicit fallback restores step 1.
  QTX_ASSERT_OK_AND_ASSIGN(OptimizerGroupInfo info, client_->LoadCheckpoint("mlp", true));
  EXPECT_EQ(info.step, 1);
  EXPECT_TRUE(info.error.empty());
  params_ = at_step1;
  QTX_ASSERT_OK_AND_ASSIGN(OptimizerStepResult r, StepBoth(2));
  ExpectMatchesReference(r);
  // The next save replaces the corrupted newest without rotating it into
  // .prev: the good previous checkpoint (step 1) is kept.
  QTX_ASSERT_OK(client_->SaveCheckpoint("mlp").status());
  QTX_ASSERT_OK_AND_ASSIGN(info, client_->LoadCheckpoint("mlp", true));
  EXPECT_EQ(info.step, 1);
  QTX_ASSERT_OK_AND_ASSIGN(info, client_->LoadCheckpoint("mlp"));
  EXPECT_EQ(info.step, 2);
}

}  // namespace
}  // namespace qtx

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  qtx::g_qtxd_path = qtx::testing::QtxdFlagOrExit(argc, argv);
  return RUN_ALL_TESTS();
}
