// OptimizerStore: the step equals the kernel reference, step numbers are
// idempotent, the memory cap holds, non-finite skips and clipping (one-phase
// and two-phase: GradNorm, then Step with the caller's clip factor or skip),
// and checkpoints round-trip, are refused when corrupted, and survive a
// restart.
#include "server/optimizer/optimizer_store.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/block_geometry.h"
#include "kernels/cpu/adamw.h"
#include "kernels/cpu/quantize_block.h"
#include "kernels/fp8.h"
#include "server/optimizer/checkpoint.h"
#include "tests/testing/status_matchers.h"

namespace qtx::server::optimizer {
namespace {

using ::qtx::testing::StatusIs;
using ::testing::HasSubstr;

struct Shape {
  int64_t m, n;
};

// A temp directory removed at the end of the test.
class TempDir {
 public:
  TempDir() {
    std::string tmpl = ::testing::TempDir() + "qtx_opt_XXXXXX";
    path_ = ::mkdtemp(tmpl.data());
  }
  ~TempDir() { std::filesystem::remove_all(path_); }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// Owned outputs of one step for every parameter.
struct Outputs {
  std::vector<std::vector<uint8_t>> row, col;
  std::vector<std::vector<float>> row_scale, col_scale;
  std::vector<std::vector<uint16_t>> bf16;
};

class Fixture {
 public:
  Fixture(std::vector<Shape> shapes, uint32_t seed,
          kernels::MomentDType md = kernels::MomentDType::kFloat32)
      : shapes_(std::move(shapes)), rng_(seed) {
    config_.name = "g";
    config_.hyper.lr = 1e-2;
    config_.hyper.weight_decay = 0.1;
    config_.moment_dtype = md;
    config_.output.quant.scaling = kernels::BlockScaling::kBlock2D;
    config_.output.quant.rowwise = true;
    config_.output.quant.columnwise = true;
    config_.output.bf16_copy = true;
    std::normal_distribution<float> nd(0.0f, 0.1f);
    for (const Shape& s : shapes_) {
      std::vector<float> w(s.m * s.n);
      for (float& x : w) x = nd(rng_);
      masters_.push_back(std::move(w));
    }
  }

  std::vector<ParameterInit> Inits() const {
    std::vector<ParameterInit> inits;
    for (size_t i = 0; i < shapes_.size(); ++i) {
      ParameterInit p;
      p.name = "p" + std::to_string(i);
      p.shape = {shapes_[i].m, shapes_[i].n};
      p.m = shapes_[i].m;
      p.n = shapes_[i].n;
      p.master = masters_[i].data();
      inits.push_back(p);
    }
    return inits;
  }

  // Fresh random gradients for every parameter (FP32).
  std::vector<std::vector<float>> Grads(float scale = 1.0f) {
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::vector<std::vector<float>> g;
    for (const Shape& s : shapes_) {
      std::vector<float> v(s.m * s.n);
      for (float& x : v) x = nd(rng_) * scale;
      g.push_back(std::move(v));
    }
    return g;
  }

  PrepareStepFn Prepare(const std::vector<std::vector<float>>& grads, Outputs* out) const {
    return [&grads, out](const GroupInfo& info, bool) -> absl::StatusOr<StepBuffers> {
      StepBuffers b;
      const size_t np = info.params.size();
      out->row.resize(np);
      out->col.resize(np);
      out->row_scale.resize(np);
      out->col_scale.resize(np);
      out->bf16.resize(np);
      for (size_t i = 0; i < np; ++i) {
        const ParameterInfo& p = info.params[i];
        const kernels::QuantizedLayout l =
            kernels::ComputeLayout(info.config.output.quant.scaling, p.m, p.n);
        out->row[i].assign(l.RowwiseDataBytes(), 0xCD);
        out->col[i].assign(l.ColumnwiseDataBytes(), 0xCD);
        out->row_scale[i].assign(l.RowwiseScaleCount(), -1.0f);
        out->col_scale[i].assign(l.ColumnwiseScaleCount(), -1.0f);
        out->bf16[i].assign(p.m * p.n, 0xCDCD);
        ParameterOutputBuffers o;
        o.fp8 = {out->row[i].data(), out->row_scale[i].data(), out->col[i].data(),
                 out->col_scale[i].data()};
        o.bf16 = out->bf16[i].data();
        b.outputs.push_back(o);
        if (i < grads.size()) b.grads.push_back({grads[i].data(), kernels::InputDType::kFloat32});
      }
      return b;
    };
  }

  GroupConfig& config() { return config_; }
  const std::vector<Shape>& shapes() const { return shapes_; }
  const std::vector<std::vector<float>>& masters() const { return masters_; }

 private:
  std::vector<Shape> shapes_;
  std::mt19937 rng_;
  GroupConfig config_;
  std::vector<std::vector<float>> masters_;
};

// The same steps with the kernels directly: AdamWReference on plain vectors.
class ReferenceModel {
 public:
  ReferenceModel(const Fixture& f) : config_(const_cast<Fixture&>(f).config()) {
    for (size_t i = 0; i < f.shapes().size(); ++i) {
      const Shape s = f.shapes()[i];
      shapes_.push_back(s);
      master_.push_back(f.masters()[i]);
      m1_.emplace_back(s.m * s.n, 0.0f);
      m2_.emplace_back(s.m * s.n, 0.0f);
    }
  }
  Outputs Step(const std::vector<std::vector<float>>& grads, int64_t t, double grad_scale,
               double lr) {
    Outputs out;
    std::vector<kernels::cpu::AdamWParamBuffers> bs;
    for (size_t i = 0; i < shapes_.size(); ++i) {
      const Shape s = shapes_[i];
      const kernels::QuantizedLayout l =
          kernels::ComputeLayout(config_.output.quant.scaling, s.m, s.n);
      out.row.emplace_back(l.RowwiseDataBytes());
      out.col.emplace_back(l.ColumnwiseDataBytes());
      out.row_scale.emplace_back(l.RowwiseScaleCount());
      out.col_scale.emplace_back(l.ColumnwiseScaleCount());
      out.bf16.emplace_back(s.m * s.n);
    }
    for (size_t i = 0; i < shapes_.size(); ++i) {
      kernels::cpu::AdamWParamBuffers b;
      b.m = shapes_[i].m;
      b.n = shapes_[i].n;
      b.master = master_[i].data();
      b.exp_avg = m1_[i].data();
      b.exp_avg_sq = m2_[i].data();
      b.grad = grads[i].data();
      b.quant = config_.output.quant;
      b.fp8 = {out.row[i].data(), out.row_scale[i].data(), out.col[i].data(),
               out.col_scale[i].data()};
      b.bf16 = out.bf16[i].data();
      bs.push_back(b);
    }
    kernels::AdamWHyperParams h = config_.hyper;
    h.lr = lr;
    kernels::cpu::AdamWReference(bs, kernels::MakeAdamWScalars(h, t, grad_scale));
    return out;
  }
  const std::vector<std::vector<float>>& master() const { return master_; }

 private:
  GroupConfig config_;
  std::vector<Shape> shapes_;
  std::vector<std::vector<float>> master_, m1_, m2_;
};

void ExpectSameOutputs(const Outputs& a, const Outputs& b) {
  ASSERT_EQ(a.row.size(), b.row.size());
  for (size_t i = 0; i < a.row.size(); ++i) {
    EXPECT_EQ(a.row[i], b.row[i]) << "param " << i;
    EXPECT_EQ(a.col[i], b.col[i]) << "param " << i;
    EXPECT_EQ(0,
              std::memcmp(a.row_scale[i].data(), b.row_scale[i].data(), a.row_scale[i].size() * 4));
    EXPECT_EQ(0,
              std::memcmp(a.col_scale[i].data(), b.col_scale[i].data(), a.col_scale[i].size() * 4));
    EXPECT_EQ(a.bf16[i], b.bf16[i]) << "param " << i;
  }
}

std::vector<std::vector<float>> ReadMasters(const OptimizerStore& store, const std::string& g) {
  std::vector<std::vector<float>> out;
  EXPECT_TRUE(store
                  .ReadState(g,
                             [&](const GroupInfo&, std::span<const ParameterStateView> views) {
                               for (const auto& v : views) {
                                 out.emplace_back(v.master, v.master + v.info->m * v.info->n);
                               }
                               return absl::OkStatus();
                             })
                  .ok());
  return out;
}

std::unique_ptr<OptimizerStore> MakeStore(OptimizerStore::Options o = {}) {
  auto s = OptimizerStore::Create(std::move(o));
  EXPECT_TRUE(s.ok()) << s.status();
  return s.ok() ? *std::move(s) : nullptr;
}

TEST(OptimizerStore, StepsEqualTheKernelReference) {
  Fixture f({{130, 200}, {1, 7}, {256, 128}}, 1);
  auto store = MakeStore();
  QTX_ASSERT_OK(store->CreateGroup(f.config(), f.Inits(), false));
  ReferenceModel ref(f);
  for (int64_t t = 1; t <= 3; ++t) {
    const auto grads = f.Grads();
    Outputs got;
    QTX_ASSERT_OK_AND_ASSIGN(StepStats stats,
                             store->Step("g", {.step = t}, f.Prepare(grads, &got)));
    EXPECT_EQ(stats.step, t);
    EXPECT_FALSE(stats.skipped);
    EXPECT_FALSE(stats.replayed);
    double sum = 0;
    for (const auto& g : grads) {
      for (float x : g) sum += static_cast<double>(x) * x;
    }
    EXPECT_NEAR(stats.grad_norm, std::sqrt(sum), 1e-9 * std::sqrt(sum));
    const Outputs want = ref.Step(grads, t, 1.0, f.config().hyper.lr);
    ExpectSameOutputs(got, want);
  }
  EXPECT_EQ(ReadMasters(*store, "g"), ref.master());
}

TEST(OptimizerStore, RetryIsAnsweredFromTheResultAndNeverAppliedTwice) {
  Fixture f({{200, 300}}, 2);
  auto store = MakeStore();
  QTX_ASSERT_OK(store->CreateGroup(f.config(), f.Inits(), false));
  const auto grads = f.Grads();
  Outputs first, retry;
  QTX_ASSERT_OK_AND_ASSIGN(StepStats s1, store->Step("g", {.step = 1}, f.Prepare(grads, &first)));
  const auto after_first = ReadMasters(*store, "g");
  // The retry carries different gradients: they must be ignored.
  const auto other = f.Grads(100.0f);
  QTX_ASSERT_OK_AND_ASSIGN(StepStats s2, store->Step("g", {.step = 1}, f.Prepare(other, &retry)));
  EXPECT_TRUE(s2.replayed);
  EXPECT_EQ(s2.grad_norm, s1.grad_norm);
  ExpectSameOutputs(first, retry);
  EXPECT_EQ(ReadMasters(*store, "g"), after_first);
  QTX_ASSERT_OK_AND_ASSIGN(GroupInfo info, store->Describe("g"));
  EXPECT_EQ(info.config.step, 1);
  EXPECT_EQ(info.update_count, 1);
}

TEST(OptimizerStore, StepFromTheFutureOrThePastFailsNamingTheCurrentStep) {
  Fixture f({{3, 4}}, 3);
  auto store = MakeStore();
  QTX_ASSERT_OK(store->CreateGroup(f.config(), f.Inits(), false));
  const auto grads = f.Grads();
  Outputs o;
  EXPECT_THAT(store->Step("g", {.step = 0}, f.Prepare(grads, &o)),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("is at step 0")));
  EXPECT_THAT(store->Step("g", {.step = 2}, f.Prepare(grads, &o)),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("next step is 1")));
  QTX_ASSERT_OK(store->Step("g", {.step = 1}, f.Prepare(grads, &o)));
  QTX_ASSERT_OK(store->Step("g", {.step = 2}, f.Prepare(grads, &o)));
  EXPECT_THAT(store->Step("g", {.step = 1}, f.Prepare(grads, &o)),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("is at step 2")));
  EXPECT_THAT(store->Step("g", {.step = 5}, f.Prepare(grads, &o)),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("is at step 2")));
  EXPECT_THAT(store->Step("nope", {.step = 1}, f.Prepare(grads, &o)),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("'nope'")));
}

TEST(OptimizerStore, TakingOverARunningJobStartsAtItsStep) {
  Fixture f({{4, 4}}, 4);
  f.config().step = 41;
  auto store = MakeStore();
  QTX_ASSERT_OK(store->CreateGroup(f.config(), f.Inits(), false));
  const auto grads = f.Grads();
  Outputs o;
  EXPECT_THAT(store->Step("g", {.step = 1}, f.Prepare(grads, &o)),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("is at step 41")));
  QTX_ASSERT_OK(store->Step("g", {.step = 42}, f.Prepare(grads, &o)));
}

TEST(OptimizerStore, MemoryCapRefusesBeforeAllocating) {
  Fixture f({{100, 100}}, 5);
  OptimizerStore::Options o;
  o.memory_limit_bytes = 100 * 100 * 12 - 1;  // one byte short of FP32 master + 2 moments
  auto store = MakeStore(o);
  EXPECT_THAT(
      store->CreateGroup(f.config(), f.Inits(), false),
      StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("optimizer_memory_limit_mb")));
  EXPECT_EQ(store->memory_used_bytes(), 0u);
  EXPECT_TRUE(store->ListGroups().empty());
  // BF16 moments need 8 bytes per element: fits.
  f.config().moment_dtype = kernels::MomentDType::kBFloat16;
  QTX_ASSERT_OK(store->CreateGroup(f.config(), f.Inits(), false));
  EXPECT_EQ(store->memory_used_bytes(), 100u * 100u * 8u);
  // A second group does not fit; releasing the first frees its bytes.
  GroupConfig c2 = f.config();
  c2.name = "g2";
  EXPECT_THAT(store->CreateGroup(c2, f.Inits(), false),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("'g2'")));
  QTX_ASSERT_OK(store->ReleaseGroup("g"));
  EXPECT_EQ(store->memory_used_bytes(), 0u);
  QTX_ASSERT_OK(store->CreateGroup(c2, f.Inits(), false));
}

TEST(OptimizerStore, RejectsDuplicateGroupsAndBadInput) {
  Fixture f({{2, 2}}, 6);
  auto store = MakeStore();
  QTX_ASSERT_OK(store->CreateGroup(f.config(), f.Inits(), false));
  EXPECT_THAT(store->CreateGroup(f.config(), f.Inits(), false),
              StatusIs(absl::StatusCode::kAlreadyExists, HasSubstr("replace")));
  QTX_ASSERT_OK(store->CreateGroup(f.config(), f.Inits(), true));
  GroupConfig bad = f.config();
  bad.name = "a/b";
  EXPECT_THAT(store->CreateGroup(bad, f.Inits(), false),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not allowed")));
  bad = f.config();
  bad.hyper.beta2 = 1.0;
  EXPECT_THAT(store->CreateGroup(bad, f.Inits(), true),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("beta2")));
  auto inits = f.Inits();
  inits.push_back(inits[0]);
  EXPECT_THAT(store->CreateGroup(f.config(), inits, true),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("duplicate")));
}

TEST(OptimizerStore, NonFiniteGradientsAreSkippedAndReported) {
  Fixture f({{130, 130}}, 7);
  auto store = MakeStore();
  QTX_ASSERT_OK(store->CreateGroup(f.config(), f.Inits(), false));
  auto grads = f.Grads();
  grads[0][777] = std::numeric_limits<float>::quiet_NaN();
  Outputs o;
  QTX_ASSERT_OK_AND_ASSIGN(
      StepStats s, store->Step("g", {.step = 1, .skip_if_non_finite = true}, f.Prepare(grads, &o)));
  EXPECT_TRUE(s.skipped);
  EXPECT_TRUE(s.non_finite);
  EXPECT_EQ(ReadMasters(*store, "g"), f.masters());  // unchanged
  QTX_ASSERT_OK_AND_ASSIGN(GroupInfo info, store->Describe("g"));
  EXPECT_EQ(info.config.step, 1);
  EXPECT_EQ(info.update_count, 0);
  // The returned parameters are the (unchanged) master, quantized.
  ReferenceModel ref(f);
  std::vector<float> master = f.masters()[0];
  std::vector<uint8_t> row(master.size());
  std::vector<float> scale(
      kernels::ComputeLayout(kernels::BlockScaling::kBlock2D, 130, 130).RowwiseScaleCount());
  kernels::QuantizeParams q = f.config().output.quant;
  q.columnwise = false;
  kernels::cpu::QuantizeBlock(master.data(), kernels::InputDType::kFloat32, 130, 130, q,
                              {row.data(), scale.data(), nullptr, nullptr});
  EXPECT_EQ(o.row[0], row);
  // The next step applies AdamW with t = 1 (bias correction of a first step).
  const auto good = f.Grads();
  Outputs o2;
  QTX_ASSERT_OK(store->Step("g", {.step = 2}, f.Prepare(good, &o2)));
  ExpectSameOutputs(o2, ref.Step(good, 1, 1.0, f.config().hyper.lr));
}

TEST(OptimizerStore, ClipsTheGlobalGradientNormLikeTorch) {
  Fixture f({{64, 64}, {10, 3}}, 8);
  auto store = MakeStore();
  QTX_ASSERT_OK(store->CreateGroup(f.config(), f.Inits(), false));
  ReferenceModel ref(f);
  const auto grads = f.Grads();
  Outputs o;
  QTX_ASSERT_OK_AND_ASSIGN(
      StepStats s,
      store->Step("g", {.step = 1, .lr = 0.5, .max_grad_norm = 1.0}, f.Prepare(grads, &o)));
  EXPECT_GT(s.grad_norm, 1.0);
  EXPECT_DOUBLE_EQ(s.clip_coef, 1.0 / (s.grad_norm + 1e-6));
  EXPECT_EQ(s.lr, 0.5);
  ExpectSameOutputs(o, ref.Step(grads, 1, s.clip_coef, 0.5));
  // A max norm above the norm does not clip.
  const auto g2 = f.Grads();
  Outputs o2;
  QTX_ASSERT_OK_AND_ASSIGN(StepStats s2,
                           store->Step("g", {.step = 2, .max_grad_norm = 1e9}, f.Prepare(g2, &o2)));
  EXPECT_EQ(s2.clip_coef, 1.0);
  ExpectSameOutputs(o2, ref.Step(g2, 2, 1.0, f.config().hyper.lr));
}

TEST(OptimizerStore, CheckpointRoundTripAndRestartContinuesIdentically) {
  TempDir dir;
  OptimizerStore::Options o;
  o.checkpoint_dir = dir.path();
  Fixture f({{130, 257}, {5, 5}}, 9, kernels::MomentDType::kBFloat16);
  auto a = MakeStore(o);
  QTX_ASSERT_OK(a->CreateGroup(f.config(), f.Inits(), false));
  Outputs out;
  for (int64_t t = 1; t <= 2; ++t) {
    const auto g = f.Grads();
    QTX_ASSERT_OK(a->Step("g", {.step = t}, f.Prepare(g, &out)));
  }
  QTX_ASSERT_OK_AND_ASSIGN(auto saved, a->SaveCheckpoint("g"));
  ASSERT_EQ(saved.size(), 1u);
  EXPECT_EQ(saved[0].step, 2);

  auto b = MakeStore(o);  // a restarted sidecar on the same directory
  QTX_ASSERT_OK_AND_ASSIGN(GroupInfo info, b->Describe("g"));
  EXPECT_EQ(info.config.step, 2);
  EXPECT_EQ(info.update_count, 2);
  EXPECT_EQ(info.config.moment_dtype, kernels::MomentDType::kBFloat16);
  EXPECT_EQ(ReadMasters(*a, "g"), ReadMasters(*b, "g"));
  // A retry of step 2 after the restart is answered from the checkpoint.
  Outputs replay;
  QTX_ASSERT_OK_AND_ASSIGN(StepStats r, b->Step("g", {.step = 2}, f.Prepare({}, &replay)));
  EXPECT_TRUE(r.replayed);
  ExpectSameOutputs(out, replay);
  // Both continue identically.
  for (int64_t t = 3; t <= 4; ++t) {
    const auto g = f.Grads();
    Outputs oa, ob;
    QTX_ASSERT_OK(a->Step("g", {.step = t}, f.Prepare(g, &oa)));
    QTX_ASSERT_OK(b->Step("g", {.step = t}, f.Prepare(g, &ob)));
    ExpectSameOutputs(oa, ob);
  }
  EXPECT_EQ(ReadMasters(*a, "g"), ReadMasters(*b, "g"));
}

TEST(OptimizerStore, CorruptedCheckpointIsRefusedNeverServedFresh) {
  TempDir dir;
  OptimizerStore::Options o;
  o.checkpoint_dir = dir.path();
  Fixture f({{64, 64}}, 10);
  {
    auto a = MakeStore(o);
    QTX_ASSERT_OK(a->CreateGroup(f.config(), f.Inits(), false));
    const auto g = f.Grads();
    Outputs out;
    QTX_ASSERT_OK(a->Step("g", {.step = 1}, f.Prepare(g, &out)));
    QTX_ASSERT_OK(a->CheckpointAll());
  }
  const std::string path = CheckpointPath(dir.path(), "g");
  {
    std::fstream file(path, std::ios::in | std::ios::out | std::ios::binary);
    file.seekp(200);
    char c;
    file.seekg(200);
    file.read(&c, 1);
    c ^= 0x01;  // one flipped bit in the data
    file.seekp(200);
    file.write(&c, 1);
  }
  auto b = MakeStore(o);
  const auto g = f.Grads();
  Outputs out;
  EXPECT_THAT(b->Step("g", {.step = 2}, f.Prepare(g, &out)),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("checksum mismatch")));
  EXPECT_THAT(b->Describe("g"), StatusIs(absl::StatusCode::kDataLoss, HasSubstr(path)));
  const auto list = b->ListGroups();
  ASSERT_EQ(list.size(), 1u);
  EXPECT_THAT(list[0].error, HasSubstr("checksum"));
  EXPECT_THAT(b->LoadCheckpoint("g"), StatusIs(absl::StatusCode::kDataLoss, ::testing::_));
  EXPECT_EQ(b->memory_used_bytes(), 0u);
  // CheckpointAll on shutdown must not overwrite the evidence.
  QTX_ASSERT_OK(b->CheckpointAll());
  // Truncation is detected too.
  std::filesystem::resize_file(path, std::filesystem::file_size(path) - 10);
  auto c = MakeStore(o);
  EXPECT_THAT(c->Describe("g"), StatusIs(absl::StatusCode::kDataLoss, HasSubstr("truncated")));
  // An explicit replace clears the failed group.
  QTX_ASSERT_OK(c->CreateGroup(f.config(), f.Inits(), true));
  QTX_ASSERT_OK(c->Step("g", {.step = 1}, f.Prepare(g, &out)));
}

TEST(OptimizerStore, CheckpointsEveryKStepsAndIgnoresTornTempFiles) {
  TempDir dir;
  OptimizerStore::Options o;
  o.checkpoint_dir = dir.path();
  o.checkpoint_every_steps = 2;
  Fixture f({{8, 8}}, 11);
  {
    std::ofstream torn(dir.path() + "/g.qtxopt.tmp.12345");
    torn << "partial";
  }
  auto a = MakeStore(o);
  EXPECT_FALSE(std::filesystem::exists(dir.path() + "/g.qtxopt.tmp.12345"));
  QTX_ASSERT_OK(a->CreateGroup(f.config(), f.Inits(), false));
  for (int64_t t = 1; t <= 3; ++t) {
    const auto g = f.Grads();
    Outputs out;
    QTX_ASSERT_OK(a->Step("g", {.step = t}, f.Prepare(g, &out)));
  }
  auto b = MakeStore(o);
  QTX_ASSERT_OK_AND_ASSIGN(GroupInfo info, b->Describe("g"));
  EXPECT_EQ(info.config.step, 2);  // the last multiple of 2
  OptimizerStore::Options bad = o;
  bad.checkpoint_dir = "";
  EXPECT_THAT(OptimizerStore::Create(bad),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--checkpoint_dir")));
  auto none = MakeStore();
  EXPECT_THAT(none->SaveCheckpoint("g"),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("--checkpoint_dir")));
}

TEST(OptimizerStore, CorruptedNewestFallsBackToPreviousOnlyWhenAskedAndKeepsIt) {
  TempDir dir;
  OptimizerStore::Options o;
  o.checkpoint_dir = dir.path();
  Fixture f({{40, 30}}, 13);
  const std::string path = CheckpointPath(dir.path(), "g");
  const std::string prev = PreviousCheckpointPath(dir.path(), "g");
  EXPECT_EQ(prev, path + ".prev");
  std::vector<std::vector<float>> masters_at_1;
  {
    auto a = MakeStore(o);
    QTX_ASSERT_OK(a->CreateGroup(f.config(), f.Inits(), false));
    for (int64_t t = 1; t <= 2; ++t) {
      const auto g = f.Grads();
      Outputs out;
      QTX_ASSERT_OK(a->Step("g", {.step = t}, f.Prepare(g, &out)));
      QTX_ASSERT_OK(a->SaveCheckpoint("g").status());
      if (t == 1) {
        masters_at_1 = ReadMasters(*a, "g");
        EXPECT_FALSE(std::filesystem::exists(prev));  // nothing replaced yet
      }
    }
    EXPECT_TRUE(std::filesystem::exists(prev));
  }
  std::filesystem::resize_file(path, std::filesystem::file_size(path) - 1);  // torn newest
  auto b = MakeStore(o);
  // Never a silent fallback: the group is unusable, and says a previous exists.
  EXPECT_THAT(b->Describe("g"),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("previous=true restores it")));
  QTX_ASSERT_OK_AND_ASSIGN(GroupInfo info, b->LoadCheckpoint("g", /*previous=*/true));
  EXPECT_EQ(info.config.step, 1);
  EXPECT_EQ(ReadMasters(*b, "g"), masters_at_1);
  // The next write replaces the bad newest and keeps the good previous.
  QTX_ASSERT_OK(b->SaveCheckpoint("g").status());
  QTX_ASSERT_OK_AND_ASSIGN(info, b->LoadCheckpoint("g", true));
  EXPECT_EQ(info.config.step, 1);
  QTX_ASSERT_OK_AND_ASSIGN(info, b->LoadCheckpoint("g"));
  EXPECT_EQ(info.config.step, 1);
  // Without a previous checkpoint the error says so.
  std::filesystem::remove(prev);
  std::filesystem::resize_file(path, 10);
  auto c = MakeStore(o);
  EXPECT_THAT(c->Describe("g"),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("no previous checkpoint exists")));
  EXPECT_THAT(c->LoadCheckpoint("g", true),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr(".qtxopt.prev")));
}

TEST(OptimizerStore, CheckpointOverTheMemoryCapIsRefused) {
  TempDir dir;
  OptimizerStore::Options o;
  o.checkpoint_dir = dir.path();
  Fixture f({{50, 50}}, 12);
  {
    auto a = MakeStore(o);
    QTX_ASSERT_OK(a->CreateGroup(f.config(), f.Inits(), false));
    QTX_ASSERT_OK(a->CheckpointAll());
  }
  o.memory_limit_bytes = 1000;
  auto b = MakeStore(o);
  EXPECT_THAT(b->Describe("g"), StatusIs(absl::StatusCode::kResourceExhausted, ::testing::_));
  EXPECT_EQ(b->memory_used_bytes(), 0u);
}

// Issue 18 item 4: the temp file of a checkpoint write had a predictable name
// (<group>.qtxopt.tmp.<pid>) and was opened following links, so a symlink
// planted there made SaveCheckpoint overwrite its target.
TEST(OptimizerStore, CheckpointWriteNeverFollowsAPlantedSymlink) {
  TempDir dir, elsewhere;
  const std::string victim = elsewhere.path() + "/victim";
  {
    std::ofstream v(victim);
    v << "precious";
  }
  const std::string planted =
      CheckpointPath(dir.path(), "g") + ".tmp." + std::to_string(::getpid());
  ASSERT_EQ(::symlink(victim.c_str(), planted.c_str()), 0);
  OptimizerStore::Options o;
  o.checkpoint_dir = dir.path();
  Fixture f({{8, 8}}, 21);
  auto a = MakeStore(o);  // removes stale temp entries: plant again after
  ASSERT_EQ(::symlink(victim.c_str(), planted.c_str()), 0);
  QTX_ASSERT_OK(a->CreateGroup(f.config(), f.Inits(), false));
  QTX_ASSERT_OK(a->SaveCheckpoint("g").status());
  QTX_ASSERT_OK(a->SaveCheckpoint("g").status());
  std::ifstream v(victim);
  std::string content((std::istreambuf_iterator<char>(v)), std::istreambuf_iterator<char>());
  EXPECT_EQ(content, "precious");
  // The planted link is still a link (never replaced, never followed).
  struct stat st;
  ASSERT_EQ(::lstat(planted.c_str(), &st), 0);
  EXPECT_TRUE(S_ISLNK(st.st_mode));
  // No other temp file is left behind, and the checkpoint reads back.
  int temps = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir.path())) {
    if (e.path().filename().string().find(".tmp.") != std::string::npos) ++temps;
  }
  EXPECT_EQ(temps, 1);
  auto b = MakeStore(o);
  QTX_ASSERT_OK_AND_ASSIGN(GroupInfo info, b->Describe("g"));
  EXPECT_EQ(info.params.size(), 1u);
  EXPECT_FALSE(std::filesystem::exists(std::filesystem::symlink_status(planted)));
}

// Issue 18 item 5: a FIFO named like a checkpoint blocked startup (and
// LoadCheckpoint) forever in open(); links and other non-regular files are
// refused too, with an error the operator can act on.
TEST(OptimizerStore, NonRegularCheckpointFilesAreRefusedWithoutBlocking) {
  TempDir dir, elsewhere;
  OptimizerStore::Options o;
  o.checkpoint_dir = elsewhere.path();
  Fixture f({{4, 4}}, 22);
  {
    auto a = MakeStore(o);
    f.config().name = "lnk";
    QTX_ASSERT_OK(a->CreateGroup(f.config(), f.Inits(), false));
    QTX_ASSERT_OK(a->CheckpointAll());
  }
  ASSERT_EQ(::mkfifo(CheckpointPath(dir.path(), "fifo").c_str(), 0600), 0);
  ASSERT_EQ(::symlink(CheckpointPath(elsewhere.path(), "lnk").c_str(),
                      CheckpointPath(dir.path(), "lnk").c_str()),
            0);
  ASSERT_EQ(::mkdir(CheckpointPath(dir.path(), "dir").c_str(), 0700), 0);
  o.checkpoint_dir = dir.path();
  auto b = MakeStore(o);  // returns: nothing blocks
  ASSERT_NE(b, nullptr);
  EXPECT_THAT(b->Describe("fifo"), StatusIs(absl::StatusCode::kFailedPrecondition,
                                            HasSubstr("is a FIFO, not a regular file")));
  EXPECT_THAT(b->Describe("lnk"),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("is a symbolic link")));
  EXPECT_THAT(b->Describe("dir"),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("is a directory")));
  EXPECT_THAT(b->LoadCheckpoint("fifo"),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("remove or replace it")));
  EXPECT_THAT(b->LoadCheckpoint("lnk"),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("follows no links")));
  EXPECT_EQ(b->memory_used_bytes(), 0u);
}

// Issue 18 item 6: a checkpoint edited by hand, with its checksum
// recomputed, loaded impossible hyper-parameters. Every loaded value is
// checked with OffloadOptimizerState's rules.
TEST(OptimizerStore, HandEditedCheckpointWithImpossibleValuesIsRefused) {
  TempDir dir;
  OptimizerStore::Options o;
  o.checkpoint_dir = dir.path();
  Fixture f({{4, 4}, {2, 3}}, 23);
  auto a = MakeStore(o);
  QTX_ASSERT_OK(a->CreateGroup(f.config(), f.Inits(), false));
  {
    const auto g = f.Grads();
    Outputs out;
    QTX_ASSERT_OK(a->Step("g", {.step = 1}, f.Prepare(g, &out)));
  }
  QTX_ASSERT_OK(a->SaveCheckpoint("g").status());
  const auto no_reserve = [](uint64_t) { return absl::OkStatus(); };
  struct Edit {
    const char* what;
    std::function<void(GroupState&)> edit;
  };
  const std::vector<Edit> edits = {
      {"hyper_params.lr=nan", [](GroupState& s) { s.config.hyper.lr = std::nan(""); }},
      {"hyper_params.lr=-1", [](GroupState& s) { s.config.hyper.lr = -1; }},
      {"hyper_params.eps=-1e-08", [](GroupState& s) { s.config.hyper.eps = -1e-8; }},
      {"hyper_params.beta1=1", [](GroupState& s) { s.config.hyper.beta1 = 1.0; }},
      {"hyper_params.beta2=-0.5", [](GroupState& s) { s.config.hyper.beta2 = -0.5; }},
      {"hyper_params.weight_decay=inf",
       [](GroupState& s) { s.config.hyper.weight_decay = INFINITY; }},
      {"step=-3", [](GroupState& s) { s.config.step = -3; }},
      {"step=9223372036854775807",
       [](GroupState& s) { s.config.step = std::numeric_limits<int64_t>::max(); }},
      {"update_count=5: must be 0..step (1)", [](GroupState& s) { s.update_count = 5; }},
      {"output.fp8.amax_epsilon=nan",
       [](GroupState& s) { s.config.output.quant.amax_epsilon = std::nanf(""); }},
      {"at least one of rowwise, columnwise",
       [](GroupState& s) {
         s.config.output.quant.rowwise = false;
         s.config.output.quant.columnwise = false;
       }},
      {"duplicate parameter name", [](GroupState& s) { s.params[1].info.name = "p0"; }},
      {"parameters[0].name='': must be 1..256", [](GroupState& s) { s.params[0].info.name = ""; }},
      {"last step's lr=inf", [](GroupState& s) { s.last->lr = INFINITY; }},
  };
  for (size_t i = 0; i < edits.size(); ++i) {
    SCOPED_TRACE(edits[i].what);
    QTX_ASSERT_OK_AND_ASSIGN(GroupState s,
                             ReadCheckpoint(CheckpointPath(dir.path(), "g"), no_reserve));
    ASSERT_TRUE(s.last.has_value());
    const std::string name = "e" + std::to_string(i);
    s.config.name = name;
    edits[i].edit(s);
    QTX_ASSERT_OK(WriteCheckpoint(dir.path(), s).status());  // a valid checksum
    EXPECT_THAT(a->LoadCheckpoint(name),
                StatusIs(absl::StatusCode::kDataLoss, HasSubstr(edits[i].what)));
    EXPECT_THAT(a->Describe(name), StatusIs(absl::StatusCode::kNotFound, ::testing::_));
  }
  // At startup the group is registered as failed, never served.
  auto b = MakeStore(o);
  EXPECT_THAT(b->Describe("e0"), StatusIs(absl::StatusCode::kDataLoss,
                                          HasSubstr("impossible value: hyper_params.lr=nan")));
  QTX_ASSERT_OK(b->Describe("g").status());
}

// Issue 18 item 8: step 2^63-1 was accepted and the next number wrapped
// negative. Step numbers stop at kMaxStepNumber (2^53).
TEST(OptimizerStore, StepNumbersStopAtTheDocumentedMaximum) {
  Fixture f({{4, 4}}, 24);
  auto store = MakeStore();
  f.config().step = std::numeric_limits<int64_t>::max() - 1;
  EXPECT_THAT(store->CreateGroup(f.config(), f.Inits(), false),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("step=9223372036854775806: must be at most 9007199254740992")));
  f.config().step = kMaxStepNumber + 1;
  EXPECT_THAT(store->CreateGroup(f.config(), f.Inits(), false),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("(2^53")));
  f.config().step = kMaxStepNumber - 1;
  QTX_ASSERT_OK(store->CreateGroup(f.config(), f.Inits(), false));
  const auto grads = f.Grads();
  Outputs out;
  QTX_ASSERT_OK(store->Step("g", {.step = kMaxStepNumber}, f.Prepare(grads, &out)));
  for (int64_t step : {kMaxStepNumber + 1, std::numeric_limits<int64_t>::max()}) {
    EXPECT_THAT(store->Step("g", {.step = step}, f.Prepare(grads, &out)),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("must be at most")));
  }
  // The last step can still be retried; the weights stayed finite.
  QTX_ASSERT_OK_AND_ASSIGN(StepStats r,
                           store->Step("g", {.step = kMaxStepNumber}, f.Prepare({}, &out)));
  EXPECT_TRUE(r.replayed);
  const std::vector<std::vector<float>> masters = ReadMasters(*store, "g");
  ASSERT_EQ(masters.size(), 1u);
  for (float w : masters[0]) EXPECT_TRUE(std::isfinite(w));
}

// Issue 18 item 13: a released group came back at the next start from its
// checkpoint. ReleaseGroup deletes the checkpoint and its .prev.
TEST(OptimizerStore, ReleaseGroupDeletesItsCheckpoints) {
  TempDir dir;
  OptimizerStore::Options o;
  o.checkpoint_dir = dir.path();
  Fixture f({{8, 8}}, 25);
  auto a = MakeStore(o);
  QTX_ASSERT_OK(a->CreateGroup(f.config(), f.Inits(), false));
  GroupConfig other = f.config();
  other.name = "keep";
  QTX_ASSERT_OK(a->CreateGroup(other, f.Inits(), false));
  for (int64_t t = 1; t <= 2; ++t) {
    const auto g = f.Grads();
    Outputs out;
    QTX_ASSERT_OK(a->Step("g", {.step = t}, f.Prepare(g, &out)));
    QTX_ASSERT_OK(a->SaveCheckpoint("").status());
  }
  ASSERT_TRUE(std::filesystem::exists(PreviousCheckpointPath(dir.path(), "g")));
  QTX_ASSERT_OK(a->ReleaseGroup("g"));
  EXPECT_FALSE(std::filesystem::exists(CheckpointPath(dir.path(), "g")));
  EXPECT_FALSE(std::filesystem::exists(PreviousCheckpointPath(dir.path(), "g")));
  EXPECT_TRUE(std::filesystem::exists(CheckpointPath(dir.path(), "keep")));
  EXPECT_THAT(a->ReleaseGroup("g"), StatusIs(absl::StatusCode::kNotFound, HasSubstr("'g'")));
  // Shutdown's CheckpointAll does not write it back either.
  QTX_ASSERT_OK(a->CheckpointAll());
  EXPECT_FALSE(std::filesystem::exists(CheckpointPath(dir.path(), "g")));
  auto b = MakeStore(o);  // a restart
  EXPECT_THAT(b->Describe("g"), StatusIs(absl::StatusCode::kNotFound, HasSubstr("'g'")));
  ASSERT_EQ(b->ListGroups().size(), 1u);
  EXPECT_EQ(b->ListGroups()[0].config.name, "keep");
}

// ---- Two-phase steps: GradNorm, then Step with the caller's decisions ----

// Every FP32 value of the group's state: master weights, then both moments,
// per parameter.
std::vector<std::vector<float>> ReadFullState(const OptimizerStore& store, const std::string& g) {
  std::vector<std::vector<float>> out;
  EXPECT_TRUE(store
                  .ReadState(g,
                             [&](const GroupInfo& info, std::span<const ParameterStateView> views) {
                               EXPECT_EQ(info.config.moment_dtype, kernels::MomentDType::kFloat32);
                               for (const auto& v : views) {
                                 const int64_t n = v.info->m * v.info->n;
                                 const auto* m1 = static_cast<const float*>(v.exp_avg);
                                 const auto* m2 = static_cast<const float*>(v.exp_avg_sq);
                                 out.emplace_back(v.master, v.master + n);
                                 out.emplace_back(m1, m1 + n);
                                 out.emplace_back(m2, m2 + n);
                               }
                               return absl::OkStatus();
                             })
                  .ok());
  return out;
}

PrepareStepWithScratchFn WithSlot(PrepareStepFn p) {
  return [p = std::move(p)](const GroupInfo& info, bool replay, StepScratchSlot&) {
    return p(info, replay);
  };
}

// clip_grad_norm_'s coefficient, written out here from its definition.
double TorchClip(double sum_squares, double max_norm) {
  return std::min(1.0, max_norm / (std::sqrt(sum_squares) + 1e-6));
}

TEST(OptimizerStoreTwoPhase, StepWithClipFactorEqualsTheOnePhaseStepBitForBit) {
  Fixture f({{130, 200}, {1, 7}, {256, 128}}, 31);
  auto one = MakeStore();
  auto two = MakeStore();
  QTX_ASSERT_OK(one->CreateGroup(f.config(), f.Inits(), false));
  QTX_ASSERT_OK(two->CreateGroup(f.config(), f.Inits(), false));
  ReferenceModel ref(f);
  for (int64_t t = 1; t <= 3; ++t) {
    const auto grads = f.Grads(t == 2 ? 1e-4f : 1.0f);  // step 2 is not clipped
    Outputs o1, o2, scratch;
    QTX_ASSERT_OK_AND_ASSIGN(
        StepStats s1, one->Step("g", {.step = t, .max_grad_norm = 5.0}, f.Prepare(grads, &o1)));
    const auto before = ReadFullState(*two, "g");
    QTX_ASSERT_OK_AND_ASSIGN(GradNormStats n,
                             two->GradNorm("g", t, WithSlot(f.Prepare(grads, &scratch))));
    EXPECT_EQ(ReadFullState(*two, "g"), before) << "GradNorm changed the state";
    QTX_ASSERT_OK_AND_ASSIGN(GroupInfo info, two->Describe("g"));
    EXPECT_EQ(info.config.step, t - 1);
    EXPECT_EQ(n.step, t);
    EXPECT_FALSE(n.non_finite);
    EXPECT_FALSE(n.step_processed);
    // The contribution is the one-phase step's norm, bit for bit...
    EXPECT_EQ(std::sqrt(n.sum_squares), s1.grad_norm);
    double sum = 0;  // ...and the plain sum of squares up to rounding order.
    for (const auto& g : grads) {
      for (float x : g) sum += static_cast<double>(x) * x;
    }
    EXPECT_NEAR(n.sum_squares, sum, 1e-12 * sum);
    const double clip = TorchClip(n.sum_squares, 5.0);
    EXPECT_EQ(clip, s1.clip_coef);
    if (t == 2) {
      EXPECT_EQ(clip, 1.0);
    } else {
      EXPECT_LT(clip, 1.0);
    }
    QTX_ASSERT_OK_AND_ASSIGN(
        StepStats s2, two->Step("g", {.step = t, .clip_factor = clip}, f.Prepare(grads, &o2)));
    EXPECT_EQ(s2.clip_coef, clip);
    EXPECT_EQ(s2.grad_norm, 0.0);  // not measured again
    EXPECT_FALSE(s2.skipped);
    ExpectSameOutputs(o2, o1);
    ExpectSameOutputs(o2, ref.Step(grads, t, clip, f.config().hyper.lr));
    EXPECT_EQ(ReadFullState(*two, "g"), ReadFullState(*one, "g"));
  }
}

TEST(OptimizerStoreTwoPhase, GroupsClippedByTheirCombinedNormEqualOneGroupOfEveryParameter) {
  Fixture f({{64, 300}, {129, 5}, {200, 200}}, 32);
  auto store = MakeStore();
  QTX_ASSERT_OK(store->CreateGroup(f.config(), f.Inits(), false));  // "g": every parameter
  const std::vector<ParameterInit> inits = f.Inits();
  GroupConfig ca = f.config(), cb = f.config();
  ca.name = "a";
  cb.name = "b";
  QTX_ASSERT_OK(store->CreateGroup(ca, std::vector<ParameterInit>{inits[0], inits[1]}, false));
  QTX_ASSERT_OK(store->CreateGroup(cb, std::vector<ParameterInit>{inits[2]}, false));
  for (int64_t t = 1; t <= 2; ++t) {
    const auto grads = f.Grads();
    const std::vector<std::vector<float>> ga = {grads[0], grads[1]}, gb = {grads[2]};
    Outputs o, oa, ob, scratch;
    QTX_ASSERT_OK_AND_ASSIGN(
        StepStats s, store->Step("g", {.step = t, .max_grad_norm = 3.0}, f.Prepare(grads, &o)));
    QTX_ASSERT_OK_AND_ASSIGN(GradNormStats na,
                             store->GradNorm("a", t, WithSlot(f.Prepare(ga, &scratch))));
    QTX_ASSERT_OK_AND_ASSIGN(GradNormStats nb,
                             store->GradNorm("b", t, WithSlot(f.Prepare(gb, &scratch))));
    // The caller's reduction: the sum of the contributions.
    const double clip = TorchClip(na.sum_squares + nb.sum_squares, 3.0);
    EXPECT_LT(clip, 1.0);
    EXPECT_NEAR(clip, s.clip_coef, 1e-12 * s.clip_coef);
    // With the same factor, the two groups step exactly as the one group.
    QTX_ASSERT_OK(store->Step("a", {.step = t, .clip_factor = s.clip_coef}, f.Prepare(ga, &oa)));
    QTX_ASSERT_OK(store->Step("b", {.step = t, .clip_factor = s.clip_coef}, f.Prepare(gb, &ob)));
    const auto all = ReadFullState(*store, "g");
    const auto a = ReadFullState(*store, "a");
    const auto b = ReadFullState(*store, "b");
    ASSERT_EQ(all.size(), 9u);
    for (size_t k = 0; k < 6; ++k) EXPECT_EQ(a[k], all[k]) << "state vector " << k;
    for (size_t k = 0; k < 3; ++k) EXPECT_EQ(b[k], all[6 + k]) << "state vector " << 6 + k;
    EXPECT_EQ(oa.row[1], o.row[1]);
    EXPECT_EQ(ob.col[0], o.col[2]);
  }
}

TEST(OptimizerStoreTwoPhase, SkipLeavesTheStateUnchangedAndIsIdempotent) {
  Fixture f({{130, 130}, {3, 200}}, 33);
  auto store = MakeStore();
  QTX_ASSERT_OK(store->CreateGroup(f.config(), f.Inits(), false));
  ReferenceModel ref(f);
  const auto g1 = f.Grads();
  Outputs o1;
  QTX_ASSERT_OK(store->Step("g", {.step = 1}, f.Prepare(g1, &o1)));
  ref.Step(g1, 1, 1.0, f.config().hyper.lr);
  const auto before = ReadFullState(*store, "g");
  // A NaN on this rank (or any other): every rank skips step 2.
  auto bad = f.Grads();
  bad[1][5] = std::numeric_limits<float>::infinity();
  Outputs scratch;
  QTX_ASSERT_OK_AND_ASSIGN(GradNormStats n,
                           store->GradNorm("g", 2, WithSlot(f.Prepare(bad, &scratch))));
  EXPECT_TRUE(n.non_finite);
  // skip: the gradients are not read (none given).
  Outputs o2;
  QTX_ASSERT_OK_AND_ASSIGN(StepStats s,
                           store->Step("g", {.step = 2, .skip = true}, f.Prepare({}, &o2)));
  EXPECT_EQ(s.step, 2);
  EXPECT_TRUE(s.skipped);
  EXPECT_FALSE(s.replayed);
  EXPECT_EQ(s.clip_coef, 1.0);
  EXPECT_EQ(ReadFullState(*store, "g"), before);
  QTX_ASSERT_OK_AND_ASSIGN(GroupInfo info, store->Describe("g"));
  EXPECT_EQ(info.config.step, 2);
  EXPECT_EQ(info.update_count, 1);
  // The parameters returned are those of step 1, unchanged.
  ExpectSameOutputs(o2, o1);
  // Retries of step 2, whatever they carry, replay the skip.
  Outputs o3;
  QTX_ASSERT_OK_AND_ASSIGN(StepStats r1,
                           store->Step("g", {.step = 2, .skip = true}, f.Prepare({}, &o3)));
  EXPECT_TRUE(r1.replayed);
  EXPECT_TRUE(r1.skipped);
  ExpectSameOutputs(o3, o1);
  const auto g2 = f.Grads();
  QTX_ASSERT_OK_AND_ASSIGN(StepStats r2,
                           store->Step("g", {.step = 2, .clip_factor = 0.5}, f.Prepare(g2, &o3)));
  EXPECT_TRUE(r2.replayed);
  EXPECT_TRUE(r2.skipped);
  EXPECT_EQ(ReadFullState(*store, "g"), before);
  // Step 3 is AdamW's second update (t = 2).
  Outputs o4;
  QTX_ASSERT_OK(store->Step("g", {.step = 3, .clip_factor = 0.25}, f.Prepare(g2, &o4)));
  ExpectSameOutputs(o4, ref.Step(g2, 2, 0.25, f.config().hyper.lr));
}

TEST(OptimizerStoreTwoPhase, GradNormOfAProcessedStepMeasuresAgainAndTheStepReplays) {
  Fixture f({{128, 256}}, 34);
  auto store = MakeStore();
  QTX_ASSERT_OK(store->CreateGroup(f.config(), f.Inits(), false));
  Outputs scratch, o1, o2;
  const auto g = f.Grads();
  // No step processed yet: only step 1 is known.
  EXPECT_THAT(store->GradNorm("g", 0, WithSlot(f.Prepare(g, &scratch))),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("is at step 0: GradNorm measures the gradients of its next "
                                 "step 1; got step 0")));
  QTX_ASSERT_OK_AND_ASSIGN(GradNormStats n1,
                           store->GradNorm("g", 1, WithSlot(f.Prepare(g, &scratch))));
  QTX_ASSERT_OK(store->Step("g", {.step = 1, .clip_factor = 0.5}, f.Prepare(g, &o1)));
  const auto after = ReadFullState(*store, "g");
  // The iteration is retried on every rank: this group already processed it.
  QTX_ASSERT_OK_AND_ASSIGN(GradNormStats n2,
                           store->GradNorm("g", 1, WithSlot(f.Prepare(g, &scratch))));
  EXPECT_TRUE(n2.step_processed);
  EXPECT_EQ(n2.sum_squares, n1.sum_squares);
  QTX_ASSERT_OK_AND_ASSIGN(StepStats r,
                           store->Step("g", {.step = 1, .clip_factor = 0.5}, f.Prepare(g, &o2)));
  EXPECT_TRUE(r.replayed);
  EXPECT_EQ(r.clip_coef, 0.5);
  ExpectSameOutputs(o2, o1);
  EXPECT_EQ(ReadFullState(*store, "g"), after);
  // Steps from the future or the past name the group's step.
  for (int64_t bad : {0, 3, 100}) {
    EXPECT_THAT(store->GradNorm("g", bad, WithSlot(f.Prepare(g, &scratch))),
                StatusIs(absl::StatusCode::kFailedPrecondition,
                         HasSubstr("is at step 1: GradNorm measures the gradients of its next "
                                   "step 2 (or of step 1, the last one, for a retry)")));
  }
}

TEST(OptimizerStoreTwoPhase, AClipFactorAboveOneIsCheckpointedAndReplayedAfterARestart) {
  TempDir dir;
  OptimizerStore::Options o;
  o.checkpoint_dir = dir.path();
  Fixture f({{40, 130}}, 36);
  auto a = MakeStore(o);
  QTX_ASSERT_OK(a->CreateGroup(f.config(), f.Inits(), false));
  ReferenceModel ref(f);
  const auto g = f.Grads();
  Outputs o1;
  // E.g. a loss-scale unscaling factor folded into the clip factor.
  QTX_ASSERT_OK(a->Step("g", {.step = 1, .clip_factor = 2.5}, f.Prepare(g, &o1)));
  ExpectSameOutputs(o1, ref.Step(g, 1, 2.5, f.config().hyper.lr));
  QTX_ASSERT_OK(a->SaveCheckpoint("g").status());
  auto b = MakeStore(o);  // a restart: the checkpoint is accepted
  QTX_ASSERT_OK_AND_ASSIGN(GroupInfo info, b->Describe("g"));
  EXPECT_EQ(info.config.step, 1);
  Outputs o2;
  QTX_ASSERT_OK_AND_ASSIGN(StepStats r,
                           b->Step("g", {.step = 1, .clip_factor = 2.5}, f.Prepare(g, &o2)));
  EXPECT_TRUE(r.replayed);
  EXPECT_EQ(r.clip_coef, 2.5);
  ExpectSameOutputs(o2, o1);
}

TEST(OptimizerStoreTwoPhase, BadDecisionsFailWithActionableErrorsAndChangeNothing) {
  Fixture f({{16, 16}}, 35);
  auto store = MakeStore();
  QTX_ASSERT_OK(store->CreateGroup(f.config(), f.Inits(), false));
  const auto before = ReadFullState(*store, "g");
  const auto g = f.Grads();
  Outputs o;
  for (double c : {0.0, -1.0, std::nan(""), std::numeric_limits<double>::infinity()}) {
    EXPECT_THAT(store->Step("g", {.step = 1, .clip_factor = c}, f.Prepare(g, &o)),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr("must be finite and > 0 (the factor every gradient is "
                                   "multiplied by; to leave the step out, set skip instead)")))
        << c;
  }
  EXPECT_THAT(
      store->Step("g", {.step = 1, .max_grad_norm = 1.0, .clip_factor = 0.5}, f.Prepare(g, &o)),
      StatusIs(absl::StatusCode::kInvalidArgument,
               HasSubstr("clip_factor with max_grad_norm: clip_factor and skip carry "
                         "the caller's decisions")));
  EXPECT_THAT(
      store->Step("g", {.step = 1, .skip_if_non_finite = true, .skip = true}, f.Prepare(g, &o)),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("skip with skip_if_non_finite")));
  EXPECT_THAT(store->GradNorm("nope", 1, WithSlot(f.Prepare(g, &o))),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("'nope' does not exist")));
  EXPECT_THAT(store->GradNorm("g", kMaxStepNumber + 1, WithSlot(f.Prepare(g, &o))),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("must be at most")));
  EXPECT_EQ(ReadFullState(*store, "g"), before);
  QTX_ASSERT_OK_AND_ASSIGN(GroupInfo info, store->Describe("g"));
  EXPECT_EQ(info.config.step, 0);
}

// ---- Per-parameter weight decay and learning-rate scale ----

// AdamW on one element written out from torch.optim.AdamW's definition
// (decoupled weight decay, bias correction) in FP32 with the constants
// rounded once from double, as kernels/adamw.h specifies.
void HandAdamW(float& p, float& m, float& v, float g, double lr, double wd, int64_t t) {
  const double b1 = 0.9, b2 = 0.999, eps = 1e-8;
  const float decay = static_cast<float>(1.0 - lr * wd);
  const float step_size = static_cast<float>(lr / (1.0 - std::pow(b1, t)));
  const float bc2_sqrt = static_cast<float>(std::sqrt(1.0 - std::pow(b2, t)));
  p = p * decay;
  m = static_cast<float>(b1) * m + static_cast<float>(1.0 - b1) * g;
  v = static_cast<float>(b2) * v + (static_cast<float>(1.0 - b2) * g) * g;
  const float denom = std::sqrt(v) / bc2_sqrt + static_cast<float>(eps);
  p = p - (step_size * m) / denom;
}

TEST(OptimizerStorePerParameter, WeightDecayAndLrScaleEqualAHandComputedAdamW) {
  Fixture f({{3, 5}, {1, 4}, {2, 129}}, 41);
  auto store = MakeStore();
  std::vector<ParameterInit> inits = f.Inits();
  inits[0].hyper.weight_decay = 0.0;  // a norm or bias: no weight decay
  inits[2].hyper.weight_decay = 0.5;
  inits[2].hyper.lr_scale = 0.25;  // inits[1]: the group's
  QTX_ASSERT_OK_AND_ASSIGN(GroupInfo info, store->CreateGroup(f.config(), inits, false));
  EXPECT_EQ(info.params[0].hyper, (ParameterHyper{0.0, std::nullopt}));
  EXPECT_TRUE(info.params[1].hyper.empty());
  const double lr[] = {f.config().hyper.lr, f.config().hyper.lr, f.config().hyper.lr * 0.25};
  const double wd[] = {0.0, f.config().hyper.weight_decay, 0.5};
  std::vector<std::vector<float>> p = f.masters(), m, v;
  for (const auto& x : p) {
    m.emplace_back(x.size(), 0.0f);
    v.emplace_back(x.size(), 0.0f);
  }
  for (int64_t t = 1; t <= 3; ++t) {
    const auto grads = f.Grads();
    Outputs o;
    // Step 2 clips with the caller's factor: every parameter's gradient scaled.
    const float scale = t == 2 ? 0.5f : 1.0f;
    if (t == 2) {
      QTX_ASSERT_OK(store->Step("g", {.step = t, .clip_factor = 0.5}, f.Prepare(grads, &o)));
    } else {
      QTX_ASSERT_OK(store->Step("g", {.step = t}, f.Prepare(grads, &o)));
    }
    for (size_t i = 0; i < p.size(); ++i) {
      for (size_t k = 0; k < p[i].size(); ++k) {
        HandAdamW(p[i][k], m[i][k], v[i][k], grads[i][k] * scale, lr[i], wd[i], t);
      }
    }
    const auto state = ReadFullState(*store, "g");
    for (size_t i = 0; i < p.size(); ++i) {
      EXPECT_EQ(state[3 * i], p[i]) << "master " << i << " step " << t;
      EXPECT_EQ(state[3 * i + 1], m[i]) << "exp_avg " << i << " step " << t;
      EXPECT_EQ(state[3 * i + 2], v[i]) << "exp_avg_sq " << i << " step " << t;
    }
  }
  // The settings did matter: parameter 0 without weight decay differs from
  // the same weights stepped with the group's.
  Fixture same({{3, 5}, {1, 4}, {2, 129}}, 41);
  auto plain = MakeStore();
  QTX_ASSERT_OK(plain->CreateGroup(same.config(), same.Inits(), false));
  Outputs o;
  const auto g1 = same.Grads();
  QTX_ASSERT_OK(plain->Step("g", {.step = 1}, same.Prepare(g1, &o)));
  auto fresh = MakeStore();
  QTX_ASSERT_OK(fresh->CreateGroup(same.config(), inits, false));
  QTX_ASSERT_OK(fresh->Step("g", {.step = 1}, same.Prepare(g1, &o)));
  const auto a = ReadFullState(*plain, "g"), b = ReadFullState(*fresh, "g");
  EXPECT_NE(a[0], b[0]);
  EXPECT_EQ(a[3], b[3]);  // parameter 1 has the group's settings in both
}

TEST(OptimizerStorePerParameter, DefaultsLeaveTheStepUnchanged) {
  Fixture f({{130, 200}, {1, 7}}, 42);
  auto with = MakeStore();
  auto without = MakeStore();
  std::vector<ParameterInit> inits = f.Inits();
  inits[0].hyper.weight_decay = f.config().hyper.weight_decay;  // same as the group's
  inits[1].hyper.lr_scale = 1.0;
  QTX_ASSERT_OK(with->CreateGroup(f.config(), inits, false));
  QTX_ASSERT_OK(without->CreateGroup(f.config(), f.Inits(), false));
  for (int64_t t = 1; t <= 2; ++t) {
    const auto grads = f.Grads();
    Outputs a, b;
    QTX_ASSERT_OK(with->Step("g", {.step = t, .max_grad_norm = 1.0}, f.Prepare(grads, &a)));
    QTX_ASSERT_OK(without->Step("g", {.step = t, .max_grad_norm = 1.0}, f.Prepare(grads, &b)));
    ExpectSameOutputs(a, b);
  }
  EXPECT_EQ(ReadFullState(*with, "g"), ReadFullState(*without, "g"));
}

TEST(OptimizerStorePerParameter, BadSettingsAreRefusedNamingTheParameter) {
  Fixture f({{4, 4}, {2, 2}}, 43);
  auto store = MakeStore();
  struct Case {
    std::optional<double> wd, scale;
    const char* want;
  } cases[] = {
      {-1.0, std::nullopt, "parameters[1] ('p1').weight_decay=-1: must be finite and >= 0"},
      {std::nan(""), std::nullopt, "parameters[1] ('p1').weight_decay=nan"},
      {std::nullopt, std::numeric_limits<double>::infinity(),
       "parameters[1] ('p1').lr_scale=inf: must be finite and >= 0"},
      {std::nullopt, -0.5, "parameters[1] ('p1').lr_scale=-0.5"},
  };
  for (const Case& c : cases) {
    std::vector<ParameterInit> inits = f.Inits();
    inits[1].hyper.weight_decay = c.wd;
    inits[1].hyper.lr_scale = c.scale;
    EXPECT_THAT(store->CreateGroup(f.config(), inits, false),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(c.want)));
  }
  EXPECT_TRUE(store->ListGroups().empty());
  EXPECT_EQ(store->memory_used_bytes(), 0u);
}

// Reads a checkpoint's format version (bytes 8..11).
uint32_t CheckpointVersion(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  char header[12] = {};
  in.read(header, sizeof(header));
  uint32_t v = 0;
  std::memcpy(&v, header + 8, 4);
  return v;
}

TEST(OptimizerStorePerParameter, CheckpointsKeepTheSettingsAndStayVersion1Without) {
  TempDir dir;
  OptimizerStore::Options o;
  o.checkpoint_dir = dir.path();
  Fixture f({{130, 130}, {1, 9}}, 44);
  std::vector<ParameterInit> inits = f.Inits();
  inits[1].hyper.weight_decay = 0.0;
  inits[1].hyper.lr_scale = 3.0;
  GroupConfig plain_config = f.config();
  plain_config.name = "plain";
  auto a = MakeStore(o);
  QTX_ASSERT_OK(a->CreateGroup(f.config(), inits, false));
  QTX_ASSERT_OK(a->CreateGroup(plain_config, f.Inits(), false));
  Outputs out;
  const auto g1 = f.Grads();
  QTX_ASSERT_OK(a->Step("g", {.step = 1}, f.Prepare(g1, &out)));
  QTX_ASSERT_OK(a->SaveCheckpoint("").status());
  EXPECT_EQ(CheckpointVersion(CheckpointPath(dir.path(), "g")), 2u);
  EXPECT_EQ(CheckpointVersion(CheckpointPath(dir.path(), "plain")), 1u);  // older qtxd read it
  auto b = MakeStore(o);                                                  // a restart
  QTX_ASSERT_OK_AND_ASSIGN(GroupInfo info, b->Describe("g"));
  EXPECT_TRUE(info.params[0].hyper.empty());
  EXPECT_EQ(info.params[1].hyper, (ParameterHyper{0.0, 3.0}));
  EXPECT_EQ(ReadFullState(*b, "g"), ReadFullState(*a, "g"));
  // Both continue identically.
  const auto g2 = f.Grads();
  Outputs oa, ob;
  QTX_ASSERT_OK(a->Step("g", {.step = 2}, f.Prepare(g2, &oa)));
  QTX_ASSERT_OK(b->Step("g", {.step = 2}, f.Prepare(g2, &ob)));
  ExpectSameOutputs(oa, ob);
  EXPECT_EQ(ReadFullState(*b, "g"), ReadFullState(*a, "g"));
}

}  // namespace
}  // namespace qtx::server::optimizer
