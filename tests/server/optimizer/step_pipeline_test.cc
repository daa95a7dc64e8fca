// OptimizerStore's pipelined Step (StepHooks, the GPU path's store half) on the
// CPU: "device" tensors are host buffers the fake hooks copy in and out of the
// staging, so CI checks what the GPU path relies on — the same bits as the
// unpipelined step (outputs, state, grad norm), the per-parameter order of
// the hooks, clipping and skipping that need every gradient first, replays,
// failures before/after a partial update, undelivered outputs, and staging
// counted against the memory cap.
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "common/status_macros.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/block_geometry.h"
#include "server/optimizer/optimizer_store.h"
#include "tests/testing/status_matchers.h"

namespace qtx::server::optimizer {
namespace {

using ::qtx::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

struct Shape {
  int64_t m, n;
};

const std::vector<Shape> kShapes = {{256, 384}, {130, 200}, {1, 77}};

GroupConfig Config() {
  GroupConfig c;
  c.name = "g";
  c.hyper.lr = 1e-2;
  c.hyper.weight_decay = 0.1;
  c.output.quant.scaling = kernels::BlockScaling::kBlock2D;
  c.output.quant.rowwise = true;
  c.output.quant.columnwise = true;
  c.output.quant.force_pow2_scales = true;
  c.output.bf16_copy = true;
  return c;
}

// Every output byte of one step, per parameter: 4 FP8 buffers + BF16.
struct Outputs {
  std::vector<std::vector<uint8_t>> buf[5];
  bool operator==(const Outputs& o) const {
    for (int k = 0; k < 5; ++k) {
      if (buf[k] != o.buf[k]) return false;
    }
    return true;
  }
};

uint64_t PartBytes(const kernels::QuantizedLayout& l, const Shape& s, int k) {
  switch (k) {
    case 0:
      return l.RowwiseDataBytes();
    case 1:
      return l.RowwiseScaleCount() * 4;
    case 2:
      return l.ColumnwiseDataBytes();
    case 3:
      return l.ColumnwiseScaleCount() * 4;
    default:
      return s.m * s.n * 2;
  }
}

// Hooks over host buffers: the "device" gradients are copied into the staging
// at GradientArrived, the staged outputs into the "device" outputs at
// OutputsWritten. Records the call order; can fail one call.
class FakeHooks final : public StepHooks {
 public:
  std::vector<std::string>* log = nullptr;
  std::vector<std::pair<void*, const void*>> grad_copies;  // staging <- device
  std::vector<uint64_t> grad_bytes;
  std::vector<std::vector<std::pair<void*, const void*>>> out_copies;  // device <- staging
  std::vector<std::vector<uint64_t>> out_bytes;
  std::string fail_at;  // e.g. "G1", "O0", "F"

  absl::Status Begin(bool gradients) override { return Record(gradients ? "B" : "Br"); }
  absl::Status GradientArrived(size_t i) override {
    QTX_RETURN_IF_ERROR(Record("G" + std::to_string(i)));
    std::memcpy(grad_copies[i].first, grad_copies[i].second, grad_bytes[i]);
    return absl::OkStatus();
  }
  absl::Status OutputsWritten(size_t i) override {
    QTX_RETURN_IF_ERROR(Record("O" + std::to_string(i)));
    for (size_t k = 0; k < out_copies[i].size(); ++k) {
      std::memcpy(out_copies[i][k].first, out_copies[i][k].second, out_bytes[i][k]);
    }
    return absl::OkStatus();
  }
  absl::Status Finish() override { return Record("F"); }
  void Abort() override { log->push_back("A"); }

 private:
  absl::Status Record(const std::string& what) {
    log->push_back(what);
    if (what == fail_at) return absl::InternalError("injected failure at " + what);
    return absl::OkStatus();
  }
};

class StepPipelineTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::mt19937 rng(5);
    std::normal_distribution<float> nd(0.0f, 0.1f);
    for (const Shape& s : kShapes) {
      std::vector<float> w(s.m * s.n);
      for (float& x : w) x = nd(rng);
      masters_.push_back(std::move(w));
    }
  }

  std::unique_ptr<OptimizerStore> NewStore(uint64_t limit = uint64_t{1} << 30) {
    OptimizerStore::Options o;
    o.memory_limit_bytes = limit;
    auto store = OptimizerStore::Create(o);
    EXPECT_TRUE(store.ok());
    std::vector<ParameterInit> inits;
    for (size_t i = 0; i < kShapes.size(); ++i) {
      ParameterInit p;
      p.name = "p" + std::to_string(i);
      p.shape = {kShapes[i].m, kShapes[i].n};
      p.m = kShapes[i].m;
      p.n = kShapes[i].n;
      p.master = masters_[i].data();
      inits.push_back(p);
    }
    EXPECT_TRUE((*store)->CreateGroup(Config(), inits, false).ok());
    return *std::move(store);
  }

  std::vector<std::vector<float>> Grads(uint32_t seed, float scale = 1.0f) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::vector<std::vector<float>> g;
    for (const Shape& s : kShapes) {
      std::vector<float> v(s.m * s.n);
      for (float& x : v) x = nd(rng) * scale;
      g.push_back(std::move(v));
    }
    return g;
  }

  // Plain host step (no hooks).
  PrepareStepFn Plain(const std::vector<std::vector<float>>& grads, Outputs* out) {
    return [&grads, out](const GroupInfo& info, bool) -> absl::StatusOr<StepBuffers> {
      StepBuffers b;
      for (size_t i = 0; i < info.params.size(); ++i) {
        b.outputs.push_back(Allocate(info, i, out));
        if (i < grads.size()) b.grads.push_back({grads[i].data(), kernels::InputDType::kFloat32});
      }
      return b;
    };
  }

  // Pipelined step: grads/outputs point at staging; the hooks move the bytes.
  PrepareStepWithScratchFn Piped(const std::vector<std::vector<float>>& grads, Outputs* out,
                                 std::vector<std::string>* log, std::string fail_at = "",
                                 uint64_t scratch_bytes = 0) {
    return [&grads, out, log, fail_at, scratch_bytes, this](
               const GroupInfo& info, bool replay,
               StepScratchSlot& slot) -> absl::StatusOr<StepBuffers> {
      if (scratch_bytes > 0 && slot.bytes() < scratch_bytes) {
        QTX_RETURN_IF_ERROR(slot.Replace(scratch_bytes,
                                         [] {
                                           return absl::StatusOr<std::unique_ptr<StepScratch>>(
                                               std::make_unique<StepScratch>());
                                         })
                                .status());
      }
      auto hooks = std::make_shared<FakeHooks>();
      hooks->log = log;
      hooks->fail_at = fail_at;
      StepBuffers b;
      staging_grads_.assign(info.params.size(), {});
      staging_out_.assign(info.params.size(), Outputs{});
      for (size_t i = 0; i < info.params.size(); ++i) {
        // Outputs: staged, then copied into `out` (the "device").
        ParameterOutputBuffers dev = Allocate(info, i, out);
        ParameterOutputBuffers st = Allocate(info, i, &staging_out_[i]);
        void* d[5] = {dev.fp8.rowwise_data, dev.fp8.rowwise_scale_inv, dev.fp8.columnwise_data,
                      dev.fp8.columnwise_scale_inv, dev.bf16};
        void* s[5] = {st.fp8.rowwise_data, st.fp8.rowwise_scale_inv, st.fp8.columnwise_data,
                      st.fp8.columnwise_scale_inv, st.bf16};
        hooks->out_copies.emplace_back();
        hooks->out_bytes.emplace_back();
        for (int k = 0; k < 5; ++k) {
          hooks->out_copies.back().push_back({d[k], s[k]});
          hooks->out_bytes.back().push_back(out->buf[k][i].size());
        }
        b.outputs.push_back(st);
        if (!replay) {
          staging_grads_[i].assign(grads[i].size(), -7.0f);  // garbage until "arrived"
          hooks->grad_copies.push_back({staging_grads_[i].data(), grads[i].data()});
          hooks->grad_bytes.push_back(grads[i].size() * 4);
          b.grads.push_back({staging_grads_[i].data(), kernels::InputDType::kFloat32});
        }
      }
      b.hooks = hooks;
      return b;
    };
  }

  static ParameterOutputBuffers Allocate(const GroupInfo& info, size_t i, Outputs* out) {
    const ParameterInfo& p = info.params[i];
    const kernels::QuantizedLayout l =
        kernels::ComputeLayout(info.config.output.quant.scaling, p.m, p.n);
    for (int k = 0; k < 5; ++k) {
      out->buf[k].resize(info.params.size());
      out->buf[k][i].assign(PartBytes(l, {p.m, p.n}, k), 0xCD);
    }
    ParameterOutputBuffers o;
    o.fp8.rowwise_data = out->buf[0][i].data();
    o.fp8.rowwise_scale_inv = reinterpret_cast<float*>(out->buf[1][i].data());
    o.fp8.columnwise_data = out->buf[2][i].data();
    o.fp8.columnwise_scale_inv = reinterpret_cast<float*>(out->buf[3][i].data());
    o.bf16 = reinterpret_cast<uint16_t*>(out->buf[4][i].data());
    return o;
  }

  std::vector<std::vector<float>> masters_;
  std::vector<std::vector<float>> staging_grads_;
  std::vector<Outputs> staging_out_;
};

TEST_F(StepPipelineTest, SameBitsAsTheHostStepInParameterOrder) {
  auto plain = NewStore();
  auto piped = NewStore();
  for (int t = 1; t <= 3; ++t) {
    const auto g = Grads(t);
    StepOptions opt{.step = t};
    if (t == 2) opt.max_grad_norm = 1.0;  // clipping: every gradient first
    Outputs want, got;
    std::vector<std::string> log;
    QTX_ASSERT_OK_AND_ASSIGN(StepStats a, plain->Step("g", opt, Plain(g, &want)));
    QTX_ASSERT_OK_AND_ASSIGN(StepStats b, piped->Step("g", opt, Piped(g, &got, &log)));
    EXPECT_TRUE(got == want) << "step " << t << ": pipelined outputs differ";
    EXPECT_EQ(b.grad_norm, a.grad_norm) << "step " << t;  // bit for bit
    EXPECT_EQ(b.clip_coef, a.clip_coef);
    EXPECT_EQ(b.non_finite, a.non_finite);
    if (t == 2) {
      EXPECT_LT(b.clip_coef, 1.0);
      EXPECT_THAT(log, ElementsAre("B", "G0", "G1", "G2", "O0", "O1", "O2", "F"));
    } else {
      EXPECT_THAT(log, ElementsAre("B", "G0", "O0", "G1", "O1", "G2", "O2", "F"));
    }
  }
  // The master weights are identical too.
  std::vector<std::vector<float>> ma, mb;
  auto read = [](std::vector<std::vector<float>>* out) {
    return [out](const GroupInfo&, std::span<const ParameterStateView> v) {
      for (const auto& p : v) out->emplace_back(p.master, p.master + p.info->m * p.info->n);
      return absl::OkStatus();
    };
  };
  QTX_ASSERT_OK(plain->ReadState("g", read(&ma)));
  QTX_ASSERT_OK(piped->ReadState("g", read(&mb)));
  EXPECT_EQ(ma, mb);
}

TEST_F(StepPipelineTest, SkipAndReplayGoThroughTheHooks) {
  auto plain = NewStore();
  auto piped = NewStore();
  auto g = Grads(1);
  g[2][5] = std::numeric_limits<float>::quiet_NaN();
  const StepOptions opt{.step = 1, .skip_if_non_finite = true};
  Outputs want, got;
  std::vector<std::string> log;
  QTX_ASSERT_OK(plain->Step("g", opt, Plain(g, &want)));
  QTX_ASSERT_OK_AND_ASSIGN(StepStats s, piped->Step("g", opt, Piped(g, &got, &log)));
  EXPECT_TRUE(s.skipped);
  EXPECT_TRUE(got == want);
  EXPECT_THAT(log, ElementsAre("B", "G0", "G1", "G2", "O0", "O1", "O2", "F"));

  // A retry of step 1: outputs from the state, through the hooks, no gradients.
  Outputs again;
  log.clear();
  const std::vector<std::vector<float>> none;
  QTX_ASSERT_OK_AND_ASSIGN(StepStats r, piped->Step("g", {.step = 1}, Piped(none, &again, &log)));
  EXPECT_TRUE(r.replayed);
  EXPECT_TRUE(again == want);
  EXPECT_THAT(log, ElementsAre("Br", "O0", "O1", "O2", "F"));
}

TEST_F(StepPipelineTest, TwoPhaseStepsGoThroughTheHooksWithTheSameBits) {
  auto plain = NewStore();
  auto piped = NewStore();
  const auto g = Grads(3);
  Outputs unused;
  std::vector<std::string> log;
  // GradNorm: every gradient arrives, nothing is written back.
  QTX_ASSERT_OK_AND_ASSIGN(
      GradNormStats a, plain->GradNorm("g", 1, [&](const GroupInfo& i, bool r, StepScratchSlot&) {
        return Plain(g, &unused)(i, r);
      }));
  QTX_ASSERT_OK_AND_ASSIGN(GradNormStats b, piped->GradNorm("g", 1, Piped(g, &unused, &log)));
  EXPECT_EQ(b.sum_squares, a.sum_squares);  // bit for bit
  EXPECT_FALSE(b.non_finite);
  EXPECT_THAT(log, ElementsAre("B", "G0", "G1", "G2", "F"));
  // The caller's clip factor: each parameter is stepped as its gradient arrives.
  const StepOptions opt{.step = 1, .clip_factor = 0.375};
  Outputs want, got;
  log.clear();
  QTX_ASSERT_OK(plain->Step("g", opt, Plain(g, &want)));
  QTX_ASSERT_OK_AND_ASSIGN(StepStats s, piped->Step("g", opt, Piped(g, &got, &log)));
  EXPECT_EQ(s.clip_coef, 0.375);
  EXPECT_TRUE(got == want);
  EXPECT_THAT(log, ElementsAre("B", "G0", "O0", "G1", "O1", "G2", "O2", "F"));
  // skip: no gradient travels; the current parameters do.
  const std::vector<std::vector<float>> none;
  Outputs skipped;
  log.clear();
  QTX_ASSERT_OK_AND_ASSIGN(
      StepStats k, piped->Step("g", {.step = 2, .skip = true}, Piped(none, &skipped, &log)));
  EXPECT_TRUE(k.skipped);
  EXPECT_TRUE(skipped == want);
  EXPECT_THAT(log, ElementsAre("Br", "O0", "O1", "O2", "F"));
}

TEST_F(StepPipelineTest, FailureBeforeAnyUpdateLeavesTheStateUnchanged) {
  auto plain = NewStore();
  auto piped = NewStore();
  const auto g = Grads(1);
  Outputs want, got;
  std::vector<std::string> log;
  EXPECT_THAT(piped->Step("g", {.step = 1}, Piped(g, &got, &log, "G0")),
              StatusIs(absl::StatusCode::kInternal, HasSubstr("injected failure at G0")));
  EXPECT_EQ(log.back(), "A");
  // The same step again succeeds and equals a clean store's.
  log.clear();
  QTX_ASSERT_OK(plain->Step("g", {.step = 1}, Plain(g, &want)));
  QTX_ASSERT_OK(piped->Step("g", {.step = 1}, Piped(g, &got, &log)));
  EXPECT_TRUE(got == want);
}

TEST_F(StepPipelineTest, FailureAfterAPartialUpdateMarksTheGroupFailed) {
  auto piped = NewStore();
  const auto g = Grads(1);
  Outputs got;
  std::vector<std::string> log;
  EXPECT_THAT(piped->Step("g", {.step = 1}, Piped(g, &got, &log, "G1")),
              StatusIs(absl::StatusCode::kDataLoss,
                       HasSubstr("step 1 failed after 1 of 3 parameters were updated")));
  // Never a silent half-stepped state: every later call says so.
  EXPECT_THAT(piped->Step("g", {.step = 1}, Piped(g, &got, &log)),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("unusable")));
  EXPECT_THAT(piped->Describe("g"),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("half a step")));
}

TEST_F(StepPipelineTest, UndeliveredOutputsKeepTheStepAndARetryDeliversThem) {
  auto plain = NewStore();
  auto piped = NewStore();
  const auto g = Grads(1);
  Outputs want, got;
  std::vector<std::string> log;
  QTX_ASSERT_OK(plain->Step("g", {.step = 1}, Plain(g, &want)));
  EXPECT_THAT(piped->Step("g", {.step = 1}, Piped(g, &got, &log, "O1")),
              StatusIs(absl::StatusCode::kInternal,
                       HasSubstr("step 1 was applied, but its parameters were not delivered")));
  // Every parameter was still updated (no half step), then the retry replays.
  EXPECT_THAT(log, ElementsAre("B", "G0", "O0", "G1", "O1", "G2", "A"));
  log.clear();
  QTX_ASSERT_OK_AND_ASSIGN(StepStats r, piped->Step("g", {.step = 1}, Piped(g, &got, &log)));
  EXPECT_TRUE(r.replayed);
  EXPECT_TRUE(got == want);
  // And the next step goes on from the right state.
  const auto g2 = Grads(2);
  Outputs want2, got2;
  QTX_ASSERT_OK(plain->Step("g", {.step = 2}, Plain(g2, &want2)));
  QTX_ASSERT_OK(piped->Step("g", {.step = 2}, Piped(g2, &got2, &log)));
  EXPECT_TRUE(got2 == want2);
}

TEST_F(StepPipelineTest, ScratchCountsAgainstTheMemoryCap) {
  uint64_t state = 0;
  for (const Shape& s : kShapes) state += s.m * s.n * 12;
  auto store = NewStore(state + 1000);
  EXPECT_EQ(store->memory_used_bytes(), state);
  const auto g = Grads(1);
  Outputs got;
  std::vector<std::string> log;
  EXPECT_THAT(store->Step("g", {.step = 1}, Piped(g, &got, &log, "", 1001)),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("transfer staging")));
  EXPECT_EQ(store->memory_used_bytes(), state);
  QTX_ASSERT_OK(store->Step("g", {.step = 1}, Piped(g, &got, &log, "", 800)));
  EXPECT_EQ(store->memory_used_bytes(), state + 800);
  // Kept across steps (not reallocated when large enough).
  QTX_ASSERT_OK(store->Step("g", {.step = 2}, Piped(Grads(2), &got, &log, "", 500)));
  EXPECT_EQ(store->memory_used_bytes(), state + 800);
  QTX_ASSERT_OK(store->ReleaseGroup("g"));
  EXPECT_EQ(store->memory_used_bytes(), 0u);
}

}  // namespace
}  // namespace qtx::server::optimizer
