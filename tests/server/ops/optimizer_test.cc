// ops/optimizer.cc on the CPU device, without gRPC: the argument checks of
// OffloadOptimizerState, OptimizerStep and GetOptimizerState (each failure with
// its status code and a message naming the field, the group's state unchanged),
// and the happy path byte for byte against the CPU reference: AdamWReference
// for the update, then QuantizeBlock of the updated master weights for the FP8
// parameters.
#include "server/ops/optimizer.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/adamw.h"
#include "kernels/block_geometry.h"
#include "kernels/cpu/adamw.h"
#include "kernels/cpu/quantize_block.h"
#include "server/backend/cpu_device.h"
#include "server/optimizer/optimizer_store.h"
#include "tests/server/testing/op_test.h"
#include "tests/testing/status_matchers.h"

namespace qtx::server::ops {
namespace {

using ::qtx::testing::OpTest;
using ::qtx::testing::QuantizedBytes;
using ::qtx::testing::QuantizeReference;
using ::qtx::testing::StatusIs;
using tensor::DType;
using tensor::RegionSliceSpec;
using tensor::TensorRefSpec;
using ::testing::HasSubstr;

std::string Bytes(const void* p, size_t n) { return std::string(static_cast<const char*>(p), n); }

std::vector<float> RandomFloats(int64_t count, uint32_t seed, float scale) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> v(count);
  for (float& x : v) x = d(rng) * scale;
  return v;
}

// FP32 -> BF16 by truncation (any BF16 bit pattern is a valid gradient).
std::vector<uint16_t> ToBf16(const std::vector<float>& f) {
  std::vector<uint16_t> out(f.size());
  for (size_t i = 0; i < f.size(); ++i) {
    uint32_t bits;
    std::memcpy(&bits, &f[i], 4);
    out[i] = static_cast<uint16_t>(bits >> 16);
  }
  return out;
}

TensorRefSpec Inline(DType dtype, std::vector<int64_t> shape, const std::string& bytes) {
  TensorRefSpec t;
  t.dtype = dtype;
  t.shape = std::move(shape);
  t.data = std::string_view(bytes);
  return t;
}

RegionSliceSpec Slice(uint64_t offset, uint64_t size) { return RegionSliceSpec{"r", offset, size}; }

// The expected outputs of one parameter after one step.
struct Expected {
  QuantizedBytes fp8;
  std::string bf16;
};

// One parameter as the reference sees it: the master weights and moments,
// stepped by the kernels directly.
struct RefParam {
  std::string name;
  std::vector<int64_t> shape;
  int64_t m = 0, n = 0;
  std::vector<float> master, m1, m2;

  // One AdamW step (AdamWReference, FP8 output off), then the FP8 copies as
  // QuantizeBlock of the updated master weights.
  Expected Step(const void* grad, kernels::InputDType grad_dtype,
                const optimizer::GroupConfig& config, int64_t t) {
    std::vector<uint16_t> bf16(m * n, 0xCDCD);
    kernels::cpu::AdamWParamBuffers b;
    b.m = m;
    b.n = n;
    b.master = master.data();
    b.exp_avg = m1.data();
    b.exp_avg_sq = m2.data();
    b.grad = grad;
    b.grad_dtype = grad_dtype;
    b.fp8_output = false;
    b.quant = config.output.quant;
    b.bf16 = bf16.data();
    kernels::cpu::AdamWReference({&b, 1}, kernels::MakeAdamWScalars(config.hyper, t, 1.0));
    Expected e;
    e.fp8 =
        QuantizeReference(master.data(), kernels::InputDType::kFloat32, m, n, config.output.quant);
    e.bf16 = Bytes(bf16.data(), bf16.size() * 2);
    return e;
  }
};

class OptimizerOpTest : public OpTest {
 protected:
  OptimizerOpTest() : OpTest(4 << 20) {}
  void SetUp() override {
    ASSERT_NO_FATAL_FAILURE(OpTest::SetUp());
    QTX_ASSERT_OK_AND_ASSIGN(store_, optimizer::OptimizerStore::Create({}));
    // "w": [130, 200] (2-D blocks cut at both edges); "b": [7] (one row).
    params_ = {MakeParam("w", {130, 200}, 130, 200, 1), MakeParam("b", {7}, 1, 7, 2)};
    for (const RefParam& p : params_)
      master_bytes_.push_back(Bytes(p.master.data(), p.m * p.n * 4));
  }

  static RefParam MakeParam(const std::string& name, std::vector<int64_t> shape, int64_t m,
                            int64_t n, uint32_t seed) {
    RefParam p;
    p.name = name;
    p.shape = std::move(shape);
    p.m = m;
    p.n = n;
    p.master = RandomFloats(m * n, seed, 0.5f);
    p.m1.assign(m * n, 0.0f);
    p.m2.assign(m * n, 0.0f);
    return p;
  }

  static optimizer::GroupConfig Config(bool bf16_copy) {
    optimizer::GroupConfig c;
    c.name = "g";
    c.hyper.lr = 1e-2;
    c.hyper.weight_decay = 0.1;
    c.output.quant.scaling = kernels::BlockScaling::kBlock2D;
    c.output.quant.rowwise = true;
    c.output.quant.columnwise = true;
    c.output.bf16_copy = bf16_copy;
    return c;
  }

  // The request offloading params_ (FP32 masters inline, no moments).
  OffloadRequestSpec OffloadRequest(bool bf16_copy = false) {
    OffloadRequestSpec r;
    r.config = Config(bf16_copy);
    for (size_t i = 0; i < params_.size(); ++i) {
      OffloadParameterSpec p;
      p.name = params_[i].name;
      p.shape = params_[i].shape;
      p.master = Inline(DType::kFloat32, params_[i].shape, master_bytes_[i]);
      r.params.push_back(std::move(p));
    }
    return r;
  }

  void Offload(bool bf16_copy = false) {
    QTX_ASSERT_OK_AND_ASSIGN(optimizer::GroupInfo info,
                             OffloadOptimizerState(OffloadRequest(bf16_copy), ctx_, *store_));
    ASSERT_EQ(info.params.size(), params_.size());
    EXPECT_EQ(info.config.step, 0);
  }

  // Step `step` of "g" with fresh FP32 gradients (grads_ keeps their bytes), all outputs inline.
  StepRequestSpec StepRequest(int64_t step = 1) {
    grads_.clear();
    StepRequestSpec r;
    r.group = "g";
    r.options.step = step;
    for (size_t i = 0; i < params_.size(); ++i) {
      const std::vector<float> g = RandomFloats(params_[i].m * params_[i].n, 100 + i, 1.0f);
      grads_.push_back(Bytes(g.data(), g.size() * 4));
    }
    for (size_t i = 0; i < params_.size(); ++i) {
      r.gradients.push_back(
          {params_[i].name, Inline(DType::kFloat32, params_[i].shape, grads_[i])});
    }
    return r;
  }

  // The group is still at step 0 with its initial master weights.
  void ExpectUnchanged() {
    OpContext ctx = ctx_;
    ctx.max_inline_output_bytes = uint64_t{1} << 30;
    QTX_ASSERT_OK_AND_ASSIGN(GetStateResult s, GetOptimizerState("g", {}, false, ctx, *store_));
    EXPECT_EQ(s.group.config.step, 0);
    EXPECT_EQ(s.group.update_count, 0);
    ASSERT_EQ(s.params.size(), params_.size());
    for (size_t i = 0; i < params_.size(); ++i) {
      EXPECT_TRUE(s.params[i].master.inline_data == master_bytes_[i]) << params_[i].name;
    }
  }

  std::string ShmBytes(const RegionSliceSpec& s) const {
    return Bytes(shm_.data() + s.offset, s.size);
  }

  std::unique_ptr<optimizer::OptimizerStore> store_;
  std::vector<RefParam> params_;
  std::vector<std::string> master_bytes_;
  std::vector<std::string> grads_;
};

// ---- OffloadOptimizerState ----

TEST_F(OptimizerOpTest, OffloadRejectsBadParametersNamingTheField) {
  {
    OffloadRequestSpec r = OffloadRequest();
    r.params.clear();
    EXPECT_THAT(OffloadOptimizerState(r, ctx_, *store_),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("parameters: empty")));
  }
  {
    OffloadRequestSpec r = OffloadRequest();
    r.params[0].master.shape = {200, 130};  // same bytes, other shape
    EXPECT_THAT(OffloadOptimizerState(r, ctx_, *store_),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr("parameters[0].master.shape=[200,130]: must equal the "
                                   "parameter's shape [130,200]")));
  }
  {
    OffloadRequestSpec r = OffloadRequest();
    const std::string half(130 * 200 * 2, '\0');
    r.params[0].master = Inline(DType::kFloat16, {130, 200}, half);
    EXPECT_THAT(OffloadOptimizerState(r, ctx_, *store_),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr("parameters[0].master.dtype=FLOAT16: must be FLOAT32 or "
                                   "BFLOAT16")));
  }
  {
    OffloadRequestSpec r = OffloadRequest();
    r.params[1].master = Inline(DType::kFloat32, {7}, master_bytes_[0]);  // too many bytes
    EXPECT_THAT(OffloadOptimizerState(r, ctx_, *store_),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr("parameters[1].master.inline_data")));
  }
  {
    OffloadRequestSpec r = OffloadRequest();
    r.params[1].exp_avg = Inline(DType::kFloat32, {7}, master_bytes_[1]);
    EXPECT_THAT(OffloadOptimizerState(r, ctx_, *store_),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr("give both exp_avg and exp_avg_sq or neither")));
  }
  {
    OffloadRequestSpec r = OffloadRequest();
    const std::string bf16(7 * 2, '\0');
    r.params[1].exp_avg = Inline(DType::kFloat32, {7}, master_bytes_[1]);
    r.params[1].exp_avg_sq = Inline(DType::kBFloat16, {7}, bf16);
    EXPECT_THAT(OffloadOptimizerState(r, ctx_, *store_),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr("exp_avg is FLOAT32 but exp_avg_sq is BFLOAT16")));
  }
  {
    OffloadRequestSpec r = OffloadRequest();
    r.params[1].shard = kernels::ElementRange{3, 8};
    EXPECT_THAT(OffloadOptimizerState(r, ctx_, *store_),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr("parameters[1] ('b').shard=[3, 8): must satisfy 0 <= begin "
                                   "<= end <= 7")));
  }
  {
    OffloadRequestSpec r = OffloadRequest();
    r.params[0].master.data = RegionSliceSpec{"nope", 0, 130 * 200 * 4};
    EXPECT_THAT(OffloadOptimizerState(r, ctx_, *store_),
                StatusIs(absl::StatusCode::kNotFound, HasSubstr("nope")));
  }
  // None of them created the group.
  EXPECT_THAT(GetOptimizerState("g", {}, false, ctx_, *store_),
              StatusIs(absl::StatusCode::kNotFound, ::testing::_));
}

TEST_F(OptimizerOpTest, OffloadTakesMastersAndMomentsFromARegion) {
  OffloadRequestSpec r = OffloadRequest();
  // "w" from the shm region: master, then moments (FP32).
  const uint64_t bytes = 130 * 200 * 4;
  const std::vector<float> m1 = RandomFloats(130 * 200, 7, 0.1f);
  const std::vector<float> m2 = RandomFloats(130 * 200, 8, 0.1f);
  std::vector<float> m2_abs(m2.size());
  for (size_t i = 0; i < m2.size(); ++i) m2_abs[i] = std::fabs(m2[i]);
  std::memcpy(shm_.data(), master_bytes_[0].data(), bytes);
  std::memcpy(shm_.data() + bytes, m1.data(), bytes);
  std::memcpy(shm_.data() + 2 * bytes, m2_abs.data(), bytes);
  r.params[0].master.data = Slice(0, bytes);
  r.params[0].exp_avg = TensorRefSpec{DType::kFloat32, {130, 200}, Slice(bytes, bytes)};
  r.params[0].exp_avg_sq = TensorRefSpec{DType::kFloat32, {130, 200}, Slice(2 * bytes, bytes)};
  QTX_ASSERT_OK(OffloadOptimizerState(r, ctx_, *store_));
  QTX_ASSERT_OK_AND_ASSIGN(GetStateResult s, GetOptimizerState("g", {"w"}, true, ctx_, *store_));
  ASSERT_EQ(s.params.size(), 1u);
  EXPECT_TRUE(s.params[0].master.inline_data == master_bytes_[0]);
  ASSERT_TRUE(s.params[0].exp_avg.has_value());
  ASSERT_TRUE(s.params[0].exp_avg_sq.has_value());
  EXPECT_TRUE(s.params[0].exp_avg->inline_data == Bytes(m1.data(), bytes));
  EXPECT_TRUE(s.params[0].exp_avg_sq->inline_data == Bytes(m2_abs.data(), bytes));
}

// ---- OptimizerStep: argument checks (nothing is applied) ----

TEST_F(OptimizerOpTest, StepRejectsBadGradients) {
  Offload();
  {
    StepRequestSpec r = StepRequest();
    r.gradients.pop_back();
    EXPECT_THAT(OptimizerStep(r, ctx_, *store_),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr("gradients: missing the gradient of parameter 'b'")));
  }
  {
    StepRequestSpec r = StepRequest();
    r.gradients.push_back(r.gradients[0]);
    EXPECT_THAT(OptimizerStep(r, ctx_, *store_),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr("gradients[2].name='w': a gradient for this parameter was "
                                   "already given")));
  }
  {
    StepRequestSpec r = StepRequest();
    r.gradients[1].name = "x";
    EXPECT_THAT(OptimizerStep(r, ctx_, *store_),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr("gradients: 'x' is not a parameter of group 'g'")));
  }
  {
    StepRequestSpec r = StepRequest();
    r.gradients[0].grad.shape = {200, 130};
    EXPECT_THAT(OptimizerStep(r, ctx_, *store_),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr("gradients['w'].grad.shape=[200,130]: must equal the "
                                   "parameter's shape [130,200]")));
  }
  {
    StepRequestSpec r = StepRequest();
    const std::string fp8(7, '\0');
    r.gradients[1].grad = Inline(DType::kFloat8E4M3, {7}, fp8);
    EXPECT_THAT(OptimizerStep(r, ctx_, *store_),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr("gradients['b'].grad.dtype=FLOAT8_E4M3: must be FLOAT32 or "
                                   "BFLOAT16 (or FLOAT16)")));
  }
  {
    StepRequestSpec r = StepRequest();
    r.gradients[1].grad.data = std::string_view(grads_[0]);  // the bytes of another size
    EXPECT_THAT(
        OptimizerStep(r, ctx_, *store_),
        StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("gradients[1].grad.inline_data")));
  }
  {
    StepRequestSpec r = StepRequest();
    r.events.wait_event = std::string(63, '\0');
    EXPECT_THAT(OptimizerStep(r, ctx_, *store_),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr("cuda_events.wait_event: 63 bytes, must be exactly 64")));
    r.events.wait_event = std::string(64, '\0');
    EXPECT_THAT(OptimizerStep(r, ctx_, *store_),
                StatusIs(absl::StatusCode::kFailedPrecondition,
                         HasSubstr("interprocess CUDA events need a CUDA device")));
  }
  {
    StepRequestSpec r = StepRequest(/*step=*/2);
    EXPECT_THAT(OptimizerStep(r, ctx_, *store_),
                StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("is at step 0")));
  }
  {
    StepRequestSpec r = StepRequest();
    r.group = "h";
    EXPECT_THAT(OptimizerStep(r, ctx_, *store_),
                StatusIs(absl::StatusCode::kNotFound, HasSubstr("'h'")));
  }
  ExpectUnchanged();
}

TEST_F(OptimizerOpTest, StepRejectsBadDestinations) {
  Offload();
  const kernels::QuantizedLayout l =
      kernels::ComputeLayout(kernels::BlockScaling::kBlock2D, 130, 200);
  {
    StepRequestSpec r = StepRequest();
    r.destinations.push_back({"w", {}, std::nullopt});
    r.destinations.push_back({"w", {}, std::nullopt});
    EXPECT_THAT(OptimizerStep(r, ctx_, *store_),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr("destinations[1].name='w': given twice")));
  }
  {
    StepRequestSpec r = StepRequest();
    r.destinations.push_back({"x", {}, std::nullopt});
    EXPECT_THAT(OptimizerStep(r, ctx_, *store_),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr("destinations: 'x' is not a parameter of group 'g'")));
  }
  {
    StepRequestSpec r = StepRequest();
    r.destinations.push_back({"w", {}, Slice(0, 130 * 200 * 2)});
    EXPECT_THAT(OptimizerStep(r, ctx_, *store_),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr("destinations['w'].bf16: group 'g' returns no BF16 copy")));
  }
  {
    StepRequestSpec r = StepRequest();
    ParameterDestinationSpec d{"w", {}, std::nullopt};
    d.fp8.rowwise_data = Slice(0, l.RowwiseDataBytes() - 1);
    r.destinations.push_back(d);
    EXPECT_THAT(OptimizerStep(r, ctx_, *store_),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr("destinations['w'].fp8.rowwise_data")));
  }
  {
    StepRequestSpec r = StepRequest();
    ParameterDestinationSpec d{"w", {}, std::nullopt};
    d.fp8.rowwise_data = Slice(0, l.RowwiseDataBytes());
    d.fp8.columnwise_data = Slice(l.RowwiseDataBytes() - 16, l.ColumnwiseDataBytes());
    r.destinations.push_back(d);
    EXPECT_THAT(OptimizerStep(r, ctx_, *store_),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr("destinations['w'].fp8.columnwise_data (region 'r' offset "
                                   "25984, 26000 bytes) overlaps destinations['w'].fp8."
                                   "rowwise_data")));
  }
  {
    StepRequestSpec r = StepRequest();
    ParameterDestinationSpec d{"b", {}, std::nullopt};
    const uint64_t scale_bytes =
        4 * kernels::ComputeLayout(kernels::BlockScaling::kBlock2D, 1, 7).RowwiseScaleCount();
    d.fp8.rowwise_scale_inv = Slice(2, scale_bytes);  // FLOAT32 at offset 2
    r.destinations.push_back(d);
    EXPECT_THAT(OptimizerStep(r, ctx_, *store_),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr("destinations['b'].fp8.rowwise_scale_inv: region 'r': offset "
                                   "2 is not aligned")));
  }
  ExpectUnchanged();
}

// The inline outputs of a step have a budget (the gRPC message limit): all
// inline, FP8 data of 26000 + 7 bytes twice plus the scales, is above 30000
// bytes and nothing is applied; with the data of "w" in region slices the
// rest fits, and the step is applied.
TEST_F(OptimizerOpTest, InlineOutputsAboveTheBudgetAreRefusedBeforeTheStep) {
  Offload();
  const kernels::QuantizedLayout l =
      kernels::ComputeLayout(kernels::BlockScaling::kBlock2D, 130, 200);
  ctx_.max_inline_output_bytes = 30000;
  StepRequestSpec r = StepRequest();
  EXPECT_THAT(OptimizerStep(r, ctx_, *store_),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       HasSubstr("above the 30000-byte message budget (--max_message_mb): give "
                                 "region destinations or set omit_parameters")));
  ExpectUnchanged();
  ParameterDestinationSpec d{"w", {}, std::nullopt};
  d.fp8.rowwise_data = Slice(0, l.RowwiseDataBytes());
  d.fp8.columnwise_data = Slice(32768, l.ColumnwiseDataBytes());
  r.destinations.push_back(d);
  QTX_ASSERT_OK_AND_ASSIGN(StepResult res, OptimizerStep(r, ctx_, *store_));
  EXPECT_EQ(res.stats.step, 1);
  ASSERT_EQ(res.params.size(), 2u);
  EXPECT_TRUE(res.params[0].fp8->rowwise_data->region.has_value());
  EXPECT_FALSE(res.params[0].fp8->rowwise_scale_inv->region.has_value());
  EXPECT_EQ(res.params[1].fp8->rowwise_data->inline_data.size(), 7u);
}

TEST_F(OptimizerOpTest, ASkippedStepReadsNoGradientAndChangesNothing) {
  Offload();
  StepRequestSpec r = StepRequest();
  r.gradients.clear();
  r.options.skip = true;
  QTX_ASSERT_OK_AND_ASSIGN(StepResult res, OptimizerStep(r, ctx_, *store_));
  EXPECT_TRUE(res.stats.skipped);
  ASSERT_EQ(res.params.size(), 2u);
  // The FP8 parameters are those of the unchanged master weights.
  const QuantizedBytes want =
      QuantizeReference(params_[0].master.data(), kernels::InputDType::kFloat32, 130, 200,
                        Config(false).output.quant);
  ASSERT_TRUE(res.params[0].fp8.has_value());
  ASSERT_TRUE(res.params[0].fp8->rowwise_data.has_value());
  EXPECT_TRUE(res.params[0].fp8->rowwise_data->inline_data == want.rowwise_data);
  EXPECT_TRUE(res.params[0].fp8->columnwise_scale_inv->inline_data == want.columnwise_scale);
  QTX_ASSERT_OK_AND_ASSIGN(GetStateResult s, GetOptimizerState("g", {}, false, ctx_, *store_));
  EXPECT_EQ(s.group.config.step, 1);
  EXPECT_EQ(s.group.update_count, 0);
  EXPECT_TRUE(s.params[0].master.inline_data == master_bytes_[0]);
}

// ---- OptimizerStep: the happy path against the CPU reference ----

// Two steps, gradients FP32 / BF16 inline or in the region, the outputs of
// "w" in region slices and those of "b" inline, with a BF16 copy: every byte
// equals AdamWReference + QuantizeBlock, and so do the state and a replay.
TEST_F(OptimizerOpTest, StepsEqualTheCpuReferenceByteForByte) {
  Offload(/*bf16_copy=*/true);
  const optimizer::GroupConfig config = Config(true);
  const kernels::QuantizedLayout l =
      kernels::ComputeLayout(kernels::BlockScaling::kBlock2D, 130, 200);
  // Destinations of "w" in the region, 16-byte aligned, after 1 MiB of
  // gradient space.
  uint64_t at = 1 << 20;
  auto take = [&](uint64_t bytes) {
    const RegionSliceSpec s = Slice(at, bytes);
    at += (bytes + 15) / 16 * 16;
    return s;
  };
  ParameterDestinationSpec dw{"w", {}, std::nullopt};
  dw.fp8.rowwise_data = take(l.RowwiseDataBytes());
  dw.fp8.rowwise_scale_inv = take(4 * l.RowwiseScaleCount());
  dw.fp8.columnwise_data = take(l.ColumnwiseDataBytes());
  dw.fp8.columnwise_scale_inv = take(4 * l.ColumnwiseScaleCount());
  dw.bf16 = take(130 * 200 * 2);
  std::memset(shm_.data() + (1 << 20), 0xEE, at - (1 << 20));

  Expected last_w, last_b;
  for (int64_t t = 1; t <= 2; ++t) {
    SCOPED_TRACE(::testing::Message() << "step " << t);
    const std::vector<float> gw = RandomFloats(130 * 200, 10 * t, 1.0f);
    const std::vector<float> gb = RandomFloats(7, 10 * t + 1, 3.0f);
    std::vector<uint16_t> gw16 = ToBf16(gw);
    const std::string gb_bytes = Bytes(gb.data(), gb.size() * 4);
    StepRequestSpec r;
    r.group = "g";
    r.options.step = t;
    r.destinations = {dw};
    std::string gw_inline;
    if (t == 1) {
      // "w": BF16 inline.
      gw_inline = Bytes(gw16.data(), gw16.size() * 2);
      r.gradients.push_back({"w", Inline(DType::kBFloat16, {130, 200}, gw_inline)});
    } else {
      // "w": BF16 in the region.
      std::memcpy(shm_.data(), gw16.data(), gw16.size() * 2);
      r.gradients.push_back(
          {"w", TensorRefSpec{DType::kBFloat16, {130, 200}, Slice(0, gw16.size() * 2)}});
    }
    r.gradients.push_back({"b", Inline(DType::kFloat32, {7}, gb_bytes)});
    QTX_ASSERT_OK_AND_ASSIGN(StepResult res, OptimizerStep(r, ctx_, *store_));

    last_w = params_[0].Step(gw16.data(), kernels::InputDType::kBFloat16, config, t);
    last_b = params_[1].Step(gb.data(), kernels::InputDType::kFloat32, config, t);
    EXPECT_EQ(res.stats.step, t);
    EXPECT_FALSE(res.stats.skipped);
    EXPECT_FALSE(res.stats.replayed);
    EXPECT_EQ(res.stats.clip_coef, 1.0);
    EXPECT_EQ(res.stats.lr, config.hyper.lr);
    ASSERT_EQ(res.params.size(), 2u);

    // "w": in the region; the results say where.
    const ParameterResult& w = res.params[0];
    EXPECT_EQ(w.name, "w");
    ASSERT_TRUE(w.fp8.has_value());
    EXPECT_EQ(w.fp8->shape, (std::vector<int64_t>{130, 200}));
    EXPECT_EQ(w.fp8->source_dtype, DType::kFloat32);
    ASSERT_TRUE(w.fp8->rowwise_data.has_value() && w.fp8->rowwise_data->region.has_value());
    EXPECT_TRUE(w.fp8->rowwise_data->inline_data.empty());
    EXPECT_EQ(w.fp8->rowwise_data->dtype, DType::kFloat8E4M3);
    EXPECT_EQ(w.fp8->rowwise_data->shape, (std::vector<int64_t>{130, 200}));
    EXPECT_EQ(w.fp8->columnwise_data->shape, (std::vector<int64_t>{200, 130}));
    EXPECT_EQ(w.fp8->rowwise_scale_inv->shape,
              (std::vector<int64_t>{l.rowwise_scale_rows, l.rowwise_scale_cols}));
    EXPECT_TRUE(ShmBytes(*dw.fp8.rowwise_data) == last_w.fp8.rowwise_data);
    EXPECT_TRUE(ShmBytes(*dw.fp8.rowwise_scale_inv) == last_w.fp8.rowwise_scale);
    EXPECT_TRUE(ShmBytes(*dw.fp8.columnwise_data) == last_w.fp8.columnwise_data);
    EXPECT_TRUE(ShmBytes(*dw.fp8.columnwise_scale_inv) == last_w.fp8.columnwise_scale);
    EXPECT_TRUE(ShmBytes(*dw.bf16) == last_w.bf16);

    // "b": inline.
    const ParameterResult& b = res.params[1];
    EXPECT_EQ(b.name, "b");
    ASSERT_TRUE(b.fp8.has_value() && b.bf16.has_value());
    EXPECT_FALSE(b.fp8->rowwise_data->region.has_value());
    EXPECT_TRUE(b.fp8->rowwise_data->inline_data == last_b.fp8.rowwise_data);
    EXPECT_TRUE(b.fp8->rowwise_scale_inv->inline_data == last_b.fp8.rowwise_scale);
    EXPECT_TRUE(b.fp8->columnwise_data->inline_data == last_b.fp8.columnwise_data);
    EXPECT_TRUE(b.fp8->columnwise_scale_inv->inline_data == last_b.fp8.columnwise_scale);
    EXPECT_TRUE(b.bf16->inline_data == last_b.bf16);
    EXPECT_EQ(b.bf16->shape, (std::vector<int64_t>{7}));
  }

  // The state: master weights and moments equal the reference's.
  QTX_ASSERT_OK_AND_ASSIGN(GetStateResult s, GetOptimizerState("g", {}, true, ctx_, *store_));
  EXPECT_EQ(s.group.config.step, 2);
  EXPECT_EQ(s.group.update_count, 2);
  ASSERT_EQ(s.params.size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    const RefParam& p = params_[i];
    const size_t bytes = p.m * p.n * 4;
    EXPECT_TRUE(s.params[i].master.inline_data == Bytes(p.master.data(), bytes)) << p.name;
    EXPECT_TRUE(s.params[i].exp_avg->inline_data == Bytes(p.m1.data(), bytes)) << p.name;
    EXPECT_TRUE(s.params[i].exp_avg_sq->inline_data == Bytes(p.m2.data(), bytes)) << p.name;
  }

  // A retry of step 2 is answered from the current master weights, all inline.
  StepRequestSpec retry = StepRequest(/*step=*/2);
  QTX_ASSERT_OK_AND_ASSIGN(StepResult again, OptimizerStep(retry, ctx_, *store_));
  EXPECT_TRUE(again.stats.replayed);
  EXPECT_TRUE(again.params[0].fp8->rowwise_data->inline_data == last_w.fp8.rowwise_data);
  EXPECT_TRUE(again.params[0].fp8->columnwise_scale_inv->inline_data ==
              last_w.fp8.columnwise_scale);
  EXPECT_TRUE(again.params[0].bf16->inline_data == last_w.bf16);
  EXPECT_TRUE(again.params[1].fp8->columnwise_data->inline_data == last_b.fp8.columnwise_data);
}

TEST_F(OptimizerOpTest, OmitParametersReturnsNoneAndStillSteps) {
  Offload();
  StepRequestSpec r = StepRequest();
  r.omit_parameters = true;
  ctx_.max_inline_output_bytes = 0;  // nothing is returned, so nothing is over budget
  QTX_ASSERT_OK_AND_ASSIGN(StepResult res, OptimizerStep(r, ctx_, *store_));
  EXPECT_TRUE(res.params.empty());
  ctx_.max_inline_output_bytes = uint64_t{1} << 30;
  const optimizer::GroupConfig config = Config(false);
  params_[0].Step(grads_[0].data(), kernels::InputDType::kFloat32, config, 1);
  QTX_ASSERT_OK_AND_ASSIGN(GetStateResult s, GetOptimizerState("g", {"w"}, false, ctx_, *store_));
  EXPECT_TRUE(s.params[0].master.inline_data ==
              Bytes(params_[0].master.data(), params_[0].master.size() * 4));
}

// ---- GetOptimizerState ----

TEST_F(OptimizerOpTest, GetStateRejectsBadNamesAndDestinations) {
  Offload();
  EXPECT_THAT(GetOptimizerState("g", {"w", "w"}, false, ctx_, *store_),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("names[1]='w': given twice (also names[0])")));
  EXPECT_THAT(GetOptimizerState("g", {"x"}, false, ctx_, *store_),
              StatusIs(absl::StatusCode::kNotFound,
                       HasSubstr("names: 'x' is not a parameter of group 'g'")));
  EXPECT_THAT(GetOptimizerState("g", {}, false, ctx_, *store_,
                                {{"w", std::nullopt, Slice(0, 130 * 200 * 4), std::nullopt}}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("destinations[0] ('w'): moment destinations need "
                                 "include_moments")));
  EXPECT_THAT(GetOptimizerState("g", {"b"}, false, ctx_, *store_,
                                {{"w", Slice(0, 130 * 200 * 4), std::nullopt, std::nullopt}}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("destinations: 'w' is not among the parameters returned")));
  EXPECT_THAT(GetOptimizerState("g", {}, false, ctx_, *store_,
                                {{"w", Slice(0, 100), std::nullopt, std::nullopt}}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("destinations['w'].master.size=100: expected 104000")));
  EXPECT_THAT(GetOptimizerState("g", {}, false, ctx_, *store_,
                                {{"w", Slice(0, 104000), std::nullopt, std::nullopt},
                                 {"w", Slice(0, 104000), std::nullopt, std::nullopt}}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("destinations[1].name='w': given twice")));
  ctx_.max_inline_output_bytes = 130 * 200 * 4;  // "w" alone fits, with "b" not
  EXPECT_THAT(GetOptimizerState("g", {}, false, ctx_, *store_),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       HasSubstr("the requested state is 104028 bytes inline")));
  QTX_EXPECT_OK(GetOptimizerState("g", {"w"}, false, ctx_, *store_));
}

TEST_F(OptimizerOpTest, GetStateWritesRegionDestinations) {
  Offload();
  std::memset(shm_.data(), 0xEE, 130 * 200 * 4);
  QTX_ASSERT_OK_AND_ASSIGN(
      GetStateResult s,
      GetOptimizerState("g", {}, false, ctx_, *store_,
                        {{"w", Slice(0, 130 * 200 * 4), std::nullopt, std::nullopt}}));
  ASSERT_EQ(s.params.size(), 2u);
  EXPECT_TRUE(s.params[0].master.region.has_value());
  EXPECT_TRUE(s.params[0].master.inline_data.empty());
  EXPECT_TRUE(ShmBytes(Slice(0, 130 * 200 * 4)) == master_bytes_[0]);
  EXPECT_TRUE(s.params[1].master.inline_data == master_bytes_[1]);
}

}  // namespace
}  // namespace qtx::server::ops
