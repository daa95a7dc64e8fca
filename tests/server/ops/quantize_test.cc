#include "server/ops/quantize.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/block_geometry.h"
#include "kernels/cpu/quantize_block.h"
#include "server/backend/cpu_device.h"
#include "tests/server/testing/op_test.h"
#include "tests/server/testing/shm_object.h"
#include "tests/testing/status_matchers.h"

namespace qtx::server::ops {
namespace {

using ::qtx::testing::OpTest;
using ::qtx::testing::QuantizedBytes;
using ::qtx::testing::QuantizeReference;
using ::qtx::testing::ShmObject;
using ::qtx::testing::StatusIs;
using tensor::DType;
using tensor::RegionSliceSpec;
using ::testing::HasSubstr;

// Random FP32 values of varied magnitude, as raw bytes.
std::string RandomFloat32(int64_t count, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::uniform_int_distribution<int> exp(-20, 20);
  std::vector<float> v(count);
  for (auto& x : v) x = std::ldexp(dist(rng), exp(rng));
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float));
}

// FP32 -> BF16 by truncation (any BF16 bit pattern is a valid input).
std::string ToBf16(const std::string& f32) {
  std::string out(f32.size() / 2, '\0');
  for (size_t i = 0; i < f32.size() / 4; ++i) std::memcpy(&out[2 * i], &f32[4 * i + 2], 2);
  return out;
}

class QuantizeOpTest : public OpTest {
 protected:
  QuantizeOpTest() : OpTest(1 << 20) {}

  QuantizeRequestSpec InlineRequest(DType dtype, std::vector<int64_t> shape,
                                    const std::string& bytes) {
    QuantizeRequestSpec r;
    r.input.dtype = dtype;
    r.input.shape = std::move(shape);
    r.input.data = std::string_view(bytes);
    return r;
  }
};

struct ShapeCase {
  std::vector<int64_t> shape;
  kernels::BlockScaling scaling;
  bool rowwise;
  bool columnwise;
  DType dtype;
};

TEST_F(QuantizeOpTest, InlineOutputsMatchTheReferenceKernel) {
  const ShapeCase cases[] = {
      {{3, 300}, kernels::BlockScaling::kBlock1D, true, true, DType::kFloat32},
      {{130, 129}, kernels::BlockScaling::kBlock2D, true, true, DType::kFloat32},
      {{2, 5, 128}, kernels::BlockScaling::kBlock1D, true, false, DType::kBFloat16},
      {{257}, kernels::BlockScaling::kBlock1D, false, true, DType::kBFloat16},
      {{1, 1}, kernels::BlockScaling::kBlock2D, true, false, DType::kFloat32},
      {{0, 4}, kernels::BlockScaling::kBlock1D, true, true, DType::kFloat32},
  };
  uint32_t seed = 1;
  for (const ShapeCase& c : cases) {
    SCOPED_TRACE(::testing::PrintToString(c.shape));
    int64_t elements = 1;
    for (int64_t d : c.shape) elements *= d;
    const int64_t n = c.shape.back();
    const int64_t m = n == 0 ? 0 : elements / n;
    std::string bytes = RandomFloat32(elements, seed++);
    if (c.dtype == DType::kBFloat16) bytes = ToBf16(bytes);
    QuantizeRequestSpec req = InlineRequest(c.dtype, c.shape, bytes);
    req.params.scaling = c.scaling;
    req.params.rowwise = c.rowwise;
    req.params.columnwise = c.columnwise;
    QTX_ASSERT_OK_AND_ASSIGN(QuantizeResult res, Quantize(req, ctx_));
    const QuantizedBytes ref =
        QuantizeReference(bytes.data(), *tensor::ToInputDType(c.dtype), m, n, req.params);
    const kernels::QuantizedLayout l = kernels::ComputeLayout(c.scaling, m, n);
    EXPECT_EQ(res.shape, c.shape);
    EXPECT_EQ(res.source_dtype, c.dtype);
    ASSERT_EQ(res.rowwise_data.has_value(), c.rowwise);
    ASSERT_EQ(res.columnwise_data.has_value(), c.columnwise);
    if (c.rowwise) {
      EXPECT_EQ(res.rowwise_data->dtype, DType::kFloat8E4M3);
      EXPECT_EQ(res.rowwise_data->shape, (std::vector<int64_t>{m, n}));
      EXPECT_EQ(res.rowwise_data->inline_data, ref.rowwise_data);
      EXPECT_EQ(res.rowwise_scale_inv->dtype, DType::kFloat32);
      EXPECT_EQ(res.rowwise_scale_inv->shape,
                (std::vector<int64_t>{l.rowwise_scale_rows, l.rowwise_scale_cols}));
      EXPECT_EQ(res.rowwise_scale_inv->inline_data, ref.rowwise_scale);
    }
    if (c.columnwise) {
      EXPECT_EQ(res.columnwise_data->shape, (std::vector<int64_t>{n, m}));
      EXPECT_EQ(res.columnwise_data->inline_data, ref.columnwise_data);
      EXPECT_EQ(res.columnwise_scale_inv->inline_data, ref.columnwise_scale);
    }
  }
}

TEST_F(QuantizeOpTest, E5M2AndFp32ScalesReachTheKernel) {
  const std::string bytes = RandomFloat32(4 * 256, 7);
  QuantizeRequestSpec req = InlineRequest(DType::kFloat32, {4, 256}, bytes);
  req.params.format = kernels::Fp8Format::kE5M2;
  req.params.force_pow2_scales = false;
  req.params.amax_epsilon = 1e-3f;
  QTX_ASSERT_OK_AND_ASSIGN(QuantizeResult res, Quantize(req, ctx_));
  const QuantizedBytes ref =
      QuantizeReference(bytes.data(), kernels::InputDType::kFloat32, 4, 256, req.params);
  EXPECT_EQ(res.rowwise_data->dtype, DType::kFloat8E5M2);
  EXPECT_EQ(res.rowwise_data->inline_data, ref.rowwise_data);
  EXPECT_EQ(res.rowwise_scale_inv->inline_data, ref.rowwise_scale);
}

TEST_F(QuantizeOpTest, RegionInputAndOutputsMatchInline) {
  const int64_t m = 200, n = 384;
  const std::string bytes = RandomFloat32(m * n, 3);
  std::memcpy(shm_.data(), bytes.data(), bytes.size());
  const kernels::QuantizedLayout l = kernels::ComputeLayout(kernels::BlockScaling::kBlock1D, m, n);
  QuantizeRequestSpec req;
  req.input.dtype = DType::kFloat32;
  req.input.shape = {m, n};
  req.input.data = RegionSliceSpec{"r", 0, bytes.size()};
  req.params.columnwise = true;
  uint64_t off = 1 << 19;
  auto next = [&](uint64_t size) {
    RegionSliceSpec s{"r", off, size};
    off += (size + 63) / 64 * 64;
    return s;
  };
  req.outputs.rowwise_data = next(l.RowwiseDataBytes());
  req.outputs.rowwise_scale_inv = next(l.RowwiseScaleCount() * 4);
  req.outputs.columnwise_data = next(l.ColumnwiseDataBytes());
  req.outputs.columnwise_scale_inv = next(l.ColumnwiseScaleCount() * 4);
  QTX_ASSERT_OK_AND_ASSIGN(QuantizeResult res, Quantize(req, ctx_));
  const QuantizedBytes ref =
      QuantizeReference(bytes.data(), kernels::InputDType::kFloat32, m, n, req.params);
  auto region_bytes = [&](const std::optional<OutputTensor>& t) {
    EXPECT_TRUE(t->region.has_value());
    EXPECT_TRUE(t->inline_data.empty());
    return std::string(reinterpret_cast<const char*>(shm_.data()) + t->region->offset,
                       t->region->size);
  };
  EXPECT_EQ(region_bytes(res.rowwise_data), ref.rowwise_data);
  EXPECT_EQ(region_bytes(res.rowwise_scale_inv), ref.rowwise_scale);
  EXPECT_EQ(region_bytes(res.columnwise_data), ref.columnwise_data);
  EXPECT_EQ(region_bytes(res.columnwise_scale_inv), ref.columnwise_scale);
  EXPECT_EQ(regions_.List().at(0).in_use, 0u) << "pins must be dropped after the op";
}

// One row of the validation table: a mutation of a valid request and the
// status it must produce.
struct ValidationCase {
  std::string name;
  std::function<void(QuantizeRequestSpec&)> mutate;
  absl::StatusCode code;
  std::string message;
};

TEST_F(QuantizeOpTest, ValidationTable) {
  const std::string bytes = RandomFloat32(2 * 256, 5);
  const std::vector<ValidationCase> cases = {
      {"fp8 input", [](auto& r) { r.input.dtype = DType::kFloat8E4M3; },
       absl::StatusCode::kInvalidArgument,
       "input.dtype=FLOAT8_E4M3: Quantize accepts FLOAT32, BFLOAT16 or FLOAT16"},
      {"uint8 input", [](auto& r) { r.input.dtype = DType::kUInt8; },
       absl::StatusCode::kInvalidArgument, "input.dtype=UINT8"},
      {"no usage",
       [](auto& r) {
         r.params.rowwise = false;
         r.params.columnwise = false;
       },
       absl::StatusCode::kInvalidArgument, "at least one copy must be requested"},
      {"nan epsilon", [](auto& r) { r.params.amax_epsilon = std::nanf(""); },
       absl::StatusCode::kInvalidArgument, "config.amax_epsilon=nan: must be finite and >= 0"},
      {"inf epsilon",
       [](auto& r) { r.params.amax_epsilon = std::numeric_limits<float>::infinity(); },
       absl::StatusCode::kInvalidArgument, "config.amax_epsilon=inf"},
      {"negative epsilon", [](auto& r) { r.params.amax_epsilon = -1.0f; },
       absl::StatusCode::kInvalidArgument, "config.amax_epsilon=-1"},
      {"bad scaling enum",
       [](auto& r) { r.params.scaling = static_cast<kernels::BlockScaling>(9); },
       absl::StatusCode::kInvalidArgument, "config.scaling_mode=9"},
      {"bad format enum", [](auto& r) { r.params.format = static_cast<kernels::Fp8Format>(5); },
       absl::StatusCode::kInvalidArgument, "config.format=5"},
      {"negative dim",
       [](auto& r) {
         r.input.shape = {2, -256};
       },
       absl::StatusCode::kInvalidArgument, "input.shape[1]=-256: dims must be >= 0"},
      {"byte count",
       [](auto& r) {
         r.input.shape = {2, 255};
       },
       absl::StatusCode::kInvalidArgument, "input.inline_data: 2048 bytes, expected 2040"},
      {"output for unrequested copy",
       [](auto& r) {
         r.outputs.columnwise_data = RegionSliceSpec{"r", 0, 512};
       },
       absl::StatusCode::kInvalidArgument,
       "outputs.columnwise_data is set but config.columnwise=false"},
      {"output slice size",
       [](auto& r) {
         r.outputs.rowwise_data = RegionSliceSpec{"r", 0, 511};
       },
       absl::StatusCode::kInvalidArgument, "outputs.rowwise_data.size=511: expected 512"},
      {"output unknown region",
       [](auto& r) {
         r.outputs.rowwise_data = RegionSliceSpec{"zz", 0, 512};
       },
       absl::StatusCode::kNotFound, "outputs.rowwise_data: region 'zz' is not registered"},
      {"output beyond region",
       [](auto& r) {
         r.outputs.rowwise_data = RegionSliceSpec{"r", (1 << 20) - 100, 512};
       },
       absl::StatusCode::kInvalidArgument, "exceeds region size 1048576"},
      {"misaligned scale output",
       [](auto& r) {
         r.outputs.rowwise_scale_inv = RegionSliceSpec{"r", 2, 32};
       },
       absl::StatusCode::kInvalidArgument, "offset 2 is not aligned to the 4-byte"},
      {"overlapping outputs",
       [](auto& r) {
         r.outputs.rowwise_data = RegionSliceSpec{"r", 0, 512};
         r.outputs.rowwise_scale_inv = RegionSliceSpec{"r", 256, 32};
       },
       absl::StatusCode::kInvalidArgument,
       "outputs.rowwise_scale_inv overlaps outputs.rowwise_data"},
      {"output overlaps input",
       [](auto& r) {
         r.input.data = RegionSliceSpec{"r", 4096, 2048};
         r.outputs.rowwise_data = RegionSliceSpec{"r", 4096 + 2000, 512};
       },
       absl::StatusCode::kInvalidArgument, "outputs.rowwise_data overlaps input"},
  };
  for (const ValidationCase& c : cases) {
    SCOPED_TRACE(c.name);
    QuantizeRequestSpec req = InlineRequest(DType::kFloat32, {2, 256}, bytes);
    c.mutate(req);
    EXPECT_THAT(Quantize(req, ctx_), StatusIs(c.code, HasSubstr(c.message)));
  }
}

TEST_F(QuantizeOpTest, InlineOutputsBeyondTheBudgetAreResourceExhausted) {
  const std::string bytes = RandomFloat32(2 * 256, 5);
  ctx_.max_inline_output_bytes = 511;
  QuantizeRequestSpec req = InlineRequest(DType::kFloat32, {2, 256}, bytes);
  EXPECT_THAT(Quantize(req, ctx_),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       HasSubstr("write the outputs into a registered region")));
  // Outputs written into a region do not count.
  req.outputs.rowwise_data = RegionSliceSpec{"r", 0, 512};
  QTX_EXPECT_OK(Quantize(req, ctx_));
}

// Dequantizing the reference bytes equals kernels::cpu::DequantizeBlock.
TEST_F(QuantizeOpTest, DequantizeMatchesTheReferenceKernel) {
  for (bool rowwise : {true, false}) {
    for (auto scaling : {kernels::BlockScaling::kBlock1D, kernels::BlockScaling::kBlock2D}) {
      const int64_t m = 131, n = 260;
      const std::string bytes = RandomFloat32(m * n, 11);
      QuantizeRequestSpec qreq = InlineRequest(DType::kFloat32, {m, n}, bytes);
      qreq.params.scaling = scaling;
      qreq.params.rowwise = rowwise;
      qreq.params.columnwise = !rowwise;
      QTX_ASSERT_OK_AND_ASSIGN(QuantizeResult q, Quantize(qreq, ctx_));

      DequantizeRequestSpec dreq;
      dreq.input.shape = {m, n};
      dreq.input.scaling = scaling;
      auto ref_of = [](const OutputTensor& t) {
        tensor::TensorRefSpec s;
        s.dtype = t.dtype;
        s.shape = t.shape;
        s.data = std::string_view(t.inline_data);
        return s;
      };
      if (rowwise) {
        dreq.input.rowwise_data = ref_of(*q.rowwise_data);
        dreq.input.rowwise_scale_inv = ref_of(*q.rowwise_scale_inv);
      } else {
        dreq.input.columnwise_data = ref_of(*q.columnwise_data);
        dreq.input.columnwise_scale_inv = ref_of(*q.columnwise_scale_inv);
      }
      dreq.output_dtype = DType::kBFloat16;
      QTX_ASSERT_OK_AND_ASSIGN(OutputTensor out, Dequantize(dreq, ctx_));
      EXPECT_EQ(out.dtype, DType::kBFloat16);
      EXPECT_EQ(out.shape, (std::vector<int64_t>{m, n}));

      std::string expected(m * n * 2, '\0');
      kernels::QuantizedConstBuffers in;
      const OutputTensor& d = rowwise ? *q.rowwise_data : *q.columnwise_data;
      const OutputTensor& s = rowwise ? *q.rowwise_scale_inv : *q.columnwise_scale_inv;
      (rowwise ? in.rowwise_data : in.columnwise_data) =
          reinterpret_cast<const uint8_t*>(d.inline_data.data());
      (rowwise ? in.rowwise_scale_inv : in.columnwise_scale_inv) =
          reinterpret_cast<const float*>(s.inline_data.data());
      kernels::cpu::DequantizeBlock(in, scaling, kernels::Fp8Format::kE4M3, m, n, rowwise,
                                    kernels::InputDType::kBFloat16, expected.data());
      EXPECT_EQ(out.inline_data, expected);
    }
  }
}

TEST_F(QuantizeOpTest, DequantizeValidatesLayoutSizes) {
  const int64_t m = 3, n = 200;
  const std::string bytes = RandomFloat32(m * n, 13);
  QTX_ASSERT_OK_AND_ASSIGN(QuantizeResult q,
                           Quantize(InlineRequest(DType::kFloat32, {m, n}, bytes), ctx_));
  auto base = [&] {
    DequantizeRequestSpec d;
    d.input.shape = {m, n};
    tensor::TensorRefSpec data;
    data.dtype = DType::kFloat8E4M3;
    data.shape = q.rowwise_data->shape;
    data.data = std::string_view(q.rowwise_data->inline_data);
    tensor::TensorRefSpec scale;
    scale.dtype = DType::kFloat32;
    scale.shape = q.rowwise_scale_inv->shape;
    scale.data = std::string_view(q.rowwise_scale_inv->inline_data);
    d.input.rowwise_data = data;
    d.input.rowwise_scale_inv = scale;
    return d;
  };
  QTX_ASSERT_OK(Dequantize(base(), ctx_));

  DequantizeRequestSpec d = base();
  d.input.shape = {m, n + 1};
  EXPECT_THAT(Dequantize(d, ctx_),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("input.rowwise_data.shape=[3, 200]: 600 elements, expected 603")));
  d = base();
  d.input.rowwise_scale_inv->shape = {2, 3};
  EXPECT_THAT(Dequantize(d, ctx_), StatusIs(absl::StatusCode::kInvalidArgument,
                                            HasSubstr("input.rowwise_scale_inv.inline_data")));
  d = base();
  d.input.rowwise_scale_inv->dtype = DType::kBFloat16;
  EXPECT_THAT(Dequantize(d, ctx_),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("input.rowwise_scale_inv.dtype=BFLOAT16: must be FLOAT32")));
  d = base();
  d.input.rowwise_data->dtype = DType::kFloat8E5M2;
  EXPECT_THAT(
      Dequantize(d, ctx_),
      StatusIs(absl::StatusCode::kInvalidArgument,
               HasSubstr("input.rowwise_data.dtype=FLOAT8_E5M2: must be FLOAT8_E4M3 or UINT8")));
  d = base();
  d.input.rowwise_data->dtype = DType::kUInt8;
  QTX_EXPECT_OK(Dequantize(d, ctx_));
  d = base();
  d.input.rowwise_scale_inv.reset();
  EXPECT_THAT(Dequantize(d, ctx_), StatusIs(absl::StatusCode::kInvalidArgument,
                                            HasSubstr("input.rowwise_scale_inv: missing")));
  d = base();
  d.input.rowwise_data.reset();
  d.input.rowwise_scale_inv.reset();
  EXPECT_THAT(Dequantize(d, ctx_),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("neither rowwise_data nor columnwise_data is set")));
  d = base();
  d.output_dtype = DType::kFloat8E4M3;
  EXPECT_THAT(
      Dequantize(d, ctx_),
      StatusIs(absl::StatusCode::kInvalidArgument,
               HasSubstr("output_dtype=FLOAT8_E4M3: must be FLOAT32, BFLOAT16 or FLOAT16")));
  d = base();
  d.output = RegionSliceSpec{"r", 0, m * n * 4 - 4};
  EXPECT_THAT(Dequantize(d, ctx_), StatusIs(absl::StatusCode::kInvalidArgument,
                                            HasSubstr("output.size=2396: expected 2400")));
  d.output = RegionSliceSpec{"r", 64, m * n * 4};
  QTX_ASSERT_OK_AND_ASSIGN(OutputTensor out, Dequantize(d, ctx_));
  ASSERT_TRUE(out.region.has_value());
  EXPECT_EQ(out.dtype, DType::kFloat32);
}

// A device whose memory is "not host": the op must stage inputs and outputs
// through Allocate/CopyFromHost/CopyToHost, as it will for a CUDA device.
class StagingDevice final : public backend::Device {
 public:
  std::string name() const override { return "staging"; }
  tensor::MemoryKind memory_kind() const override { return tensor::MemoryKind::kDevice; }
  absl::StatusOr<backend::DeviceBuffer> Allocate(uint64_t bytes) override {
    ++allocations;
    return cpu_.Allocate(bytes);
  }
  absl::Status CopyFromHost(void* d, const void* s, uint64_t b) override {
    ++to_device;
    return cpu_.CopyFromHost(d, s, b);
  }
  absl::Status CopyToHost(void* d, const void* s, uint64_t b) override {
    ++to_host;
    return cpu_.CopyToHost(d, s, b);
  }
  absl::Status Quantize(const backend::QuantizeArgs& a) override { return cpu_.Quantize(a); }
  absl::Status Dequantize(const backend::DequantizeArgs& a) override { return cpu_.Dequantize(a); }
  absl::Status ShardBoundaryAmax(const backend::ShardArgs& a, float* first, float* last) override {
    return cpu_.ShardBoundaryAmax(a, first, last);
  }
  absl::Status QuantizeShard(const backend::ShardArgs& a, const float* first_amax,
                             const float* last_amax,
                             const kernels::QuantizedBuffers& out) override {
    return cpu_.QuantizeShard(a, first_amax, last_amax, out);
  }
  absl::Status AssembleShards(int world_size, const kernels::ShardGeometry* geoms,
                              const kernels::QuantizedConstBuffers* shards,
                              const kernels::QuantizeParams& params,
                              const kernels::QuantizedBuffers& out) override {
    return cpu_.AssembleShards(world_size, geoms, shards, params, out);
  }
  int allocations = 0, to_device = 0, to_host = 0;

 private:
  backend::CpuDevice cpu_;
};

TEST_F(QuantizeOpTest, NonHostDeviceStagesThroughDeviceMemory) {
  StagingDevice staging;
  OpContext ctx = ctx_;
  ctx.device = &staging;
  const std::string bytes = RandomFloat32(5 * 300, 17);
  QuantizeRequestSpec req = InlineRequest(DType::kFloat32, {5, 300}, bytes);
  req.params.columnwise = true;
  QTX_ASSERT_OK_AND_ASSIGN(QuantizeResult res, Quantize(req, ctx));
  EXPECT_EQ(staging.allocations, 5);  // input + 4 outputs
  EXPECT_EQ(staging.to_device, 1);
  EXPECT_EQ(staging.to_host, 4);
  const QuantizedBytes ref =
      QuantizeReference(bytes.data(), kernels::InputDType::kFloat32, 5, 300, req.params);
  EXPECT_EQ(res.rowwise_data->inline_data, ref.rowwise_data);
  EXPECT_EQ(res.columnwise_scale_inv->inline_data, ref.columnwise_scale);
}

TEST_F(QuantizeOpTest, TensorModeStagesOneScaleOfShapeOne) {
  StagingDevice staging;
  OpContext ctx = ctx_;
  ctx.device = &staging;
  for (std::vector<int64_t> shape : {std::vector<int64_t>{7, 130}, {0, 130}}) {
    const int64_t count = shape[0] * shape[1];
    const std::string bytes = RandomFloat32(count, 23);
    QuantizeRequestSpec req = InlineRequest(DType::kFloat32, shape, bytes);
    req.params.scaling = kernels::BlockScaling::kTensor;
    req.params.columnwise = true;
    req.params.force_pow2_scales = false;
    QTX_ASSERT_OK_AND_ASSIGN(QuantizeResult res, Quantize(req, ctx));
    const QuantizedBytes ref = QuantizeReference(bytes.data(), kernels::InputDType::kFloat32,
                                                 shape[0], shape[1], req.params);
    EXPECT_EQ(res.rowwise_data->inline_data, ref.rowwise_data);
    EXPECT_EQ(res.columnwise_data->inline_data, ref.columnwise_data);
    EXPECT_THAT(res.rowwise_scale_inv->shape, ::testing::ElementsAre(1));
    EXPECT_THAT(res.columnwise_scale_inv->shape, ::testing::ElementsAre(1));
    EXPECT_EQ(res.rowwise_scale_inv->inline_data, ref.rowwise_scale);
    EXPECT_EQ(res.columnwise_scale_inv->inline_data, ref.columnwise_scale);
    if (count == 0) {  // amax 0: scale_inv 1
      const float one = 1.0f;
      EXPECT_EQ(res.rowwise_scale_inv->inline_data,
                std::string(reinterpret_cast<const char*>(&one), 4));
    }
  }
}

// ---- QuantizeRunsShort / DequantizeRunsShort ----

TEST_F(QuantizeOpTest, RunsShortOnTheCpuDeviceUpToTheHostByteLimit) {
  ctx_.inline_limits.max_host_bytes = 4096;
  const std::string small(1024 * 4, '\0');  // 4096 bytes of FP32: at the limit
  const std::string large(1025 * 4, '\0');
  QuantizeRequestSpec r = InlineRequest(DType::kFloat32, {8, 128}, small);
  r.params.rowwise = true;
  EXPECT_TRUE(QuantizeRunsShort(r, ctx_));
  r = InlineRequest(DType::kFloat32, {1, 1025}, large);
  r.params.rowwise = true;
  EXPECT_FALSE(QuantizeRunsShort(r, ctx_));
  // The same bytes in a shm region count alike (the kernel reads them on the host).
  r.input.data = RegionSliceSpec{"r", 0, 1025 * 4};
  EXPECT_FALSE(QuantizeRunsShort(r, ctx_));
  // A request that fails validation is short: it fails before any work.
  r.input.shape = {-1, 128};
  EXPECT_TRUE(QuantizeRunsShort(r, ctx_));
  r.input.shape = {int64_t{1} << 40, int64_t{1} << 40};
  EXPECT_TRUE(QuantizeRunsShort(r, ctx_));
}

TEST_F(QuantizeOpTest, DequantizeRunsShortCountsTheOutputItWrites) {
  ctx_.inline_limits.max_host_bytes = 4096;
  DequantizeRequestSpec r;
  r.input.shape = {4, 128};  // 512 elements: 2 KiB of FP32 output, 512 B of FP8 input
  r.input.rowwise_data =
      tensor::TensorRefSpec{DType::kFloat8E4M3, {4, 128}, RegionSliceSpec{"r", 0, 512}};
  EXPECT_TRUE(DequantizeRunsShort(r, ctx_));
  r.input.shape = {8, 128};  // 4 KiB of FP32 output + 1 KiB of input
  EXPECT_FALSE(DequantizeRunsShort(r, ctx_));
  r.output_dtype = DType::kBFloat16;  // 2 KiB of output + 1 KiB of input
  EXPECT_TRUE(DequantizeRunsShort(r, ctx_));
}

// A device computing on device memory, for the CUDA rules of *RunsShort
// (nothing runs on it).
class FakeDeviceMemoryDevice final : public backend::Device {
 public:
  std::string name() const override { return "fake-gpu"; }
  tensor::MemoryKind memory_kind() const override { return tensor::MemoryKind::kDevice; }
  absl::StatusOr<backend::DeviceBuffer> Allocate(uint64_t) override { return Unused(); }
  absl::Status CopyFromHost(void*, const void*, uint64_t) override { return Unused(); }
  absl::Status CopyToHost(void*, const void*, uint64_t) override { return Unused(); }
  absl::Status Quantize(const backend::QuantizeArgs&) override { return Unused(); }
  absl::Status Dequantize(const backend::DequantizeArgs&) override { return Unused(); }
  absl::Status ShardBoundaryAmax(const backend::ShardArgs&, float*, float*) override {
    return Unused();
  }
  absl::Status QuantizeShard(const backend::ShardArgs&, const float*, const float*,
                             const kernels::QuantizedBuffers&) override {
    return Unused();
  }
  absl::Status AssembleShards(int, const kernels::ShardGeometry*,
                              const kernels::QuantizedConstBuffers*, const kernels::QuantizeParams&,
                              const kernels::QuantizedBuffers&) override {
    return Unused();
  }

 private:
  static absl::Status Unused() { return absl::UnimplementedError("fake device"); }
};

class RunsShortOnDeviceTest : public ::testing::Test {
 protected:
  static constexpr uint64_t kRegionBytes = uint64_t{1} << 30;
  RunsShortOnDeviceTest() : shm_(1 << 16), regions_(Options()) {}
  static tensor::RegionTableOptions Options() {
    tensor::RegionTableOptions o;
    o.allow_client_shm = true;
    // "Device memory" that is never touched: a fake address range.
    o.cuda_ipc_opener = [](std::string_view, int32_t, uint64_t) {
      tensor::MappedMemory m;
      m.data = reinterpret_cast<std::byte*>(uintptr_t{1} << 40);
      m.release = [] {};
      return absl::StatusOr<tensor::MappedMemory>(std::move(m));
    };
    return o;
  }
  void SetUp() override {
    ASSERT_TRUE(shm_.ok()) << shm_.error();
    QTX_ASSERT_OK(regions_.RegisterShm("host", shm_.name(), 0, shm_.size()));
    QTX_ASSERT_OK(regions_.RegisterCudaIpc("gpu", std::string(64, '\1'), 0, kRegionBytes));
    ctx_.regions = &regions_;
    ctx_.device = &device_;
    ctx_.inline_limits.max_host_bytes = 4096;
    ctx_.inline_limits.max_device_bytes = 1 << 20;
  }
  // BF16 [m, 1024] in the "gpu" region, both copies written to the "gpu" region.
  QuantizeRequestSpec DeviceRequest(int64_t m) {
    QuantizeRequestSpec r;
    r.input.dtype = DType::kBFloat16;
    r.input.shape = {m, 1024};
    r.input.data = RegionSliceSpec{"gpu", 0, static_cast<uint64_t>(m * 1024 * 2)};
    r.params.rowwise = true;
    r.params.columnwise = true;
    r.outputs.rowwise_data = RegionSliceSpec{"gpu", 0, 1};
    r.outputs.rowwise_scale_inv = RegionSliceSpec{"gpu", 0, 1};
    r.outputs.columnwise_data = RegionSliceSpec{"gpu", 0, 1};
    r.outputs.columnwise_scale_inv = RegionSliceSpec{"gpu", 0, 1};
    return r;
  }

  ShmObject shm_;
  tensor::RegionTable regions_;
  FakeDeviceMemoryDevice device_;
  OpContext ctx_;
};

TEST_F(RunsShortOnDeviceTest, DeviceRegionsAreBoundedByTheDeviceByteLimit) {
  EXPECT_TRUE(QuantizeRunsShort(DeviceRequest(512), ctx_));   // 1 MiB: at the limit
  EXPECT_FALSE(QuantizeRunsShort(DeviceRequest(513), ctx_));  // the host would wait longer
}

TEST_F(RunsShortOnDeviceTest, StagingThroughTheHostIsBoundedByTheHostByteLimit) {
  QuantizeRequestSpec r = DeviceRequest(1);  // 2 KiB input, 1 KiB per FP8 copy
  EXPECT_TRUE(QuantizeRunsShort(r, ctx_));
  r.outputs.columnwise_data.reset();                // returned inline: staged to the host
  EXPECT_TRUE(QuantizeRunsShort(r, ctx_));          // 1 KiB staged
  r.input.data = RegionSliceSpec{"host", 0, 2048};  // + 2 KiB staged in
  EXPECT_TRUE(QuantizeRunsShort(r, ctx_));
  r.outputs.rowwise_data.reset();  // + 1 KiB: 4 KiB, at the limit
  EXPECT_TRUE(QuantizeRunsShort(r, ctx_));
  r.outputs.rowwise_scale_inv.reset();  // + the scales: over it
  EXPECT_FALSE(QuantizeRunsShort(r, ctx_));
  // An unknown region counts as host memory (the call fails with NOT_FOUND).
  r = DeviceRequest(2);
  r.input.data = RegionSliceSpec{"nope", 0, 4096};
  EXPECT_TRUE(QuantizeRunsShort(r, ctx_));
  r.input.shape = {3, 1024};  // 6 KiB "staged"
  EXPECT_FALSE(QuantizeRunsShort(r, ctx_));
}

TEST_F(RunsShortOnDeviceTest, AHostWaitOnAClientEventIsNeverShort) {
  QuantizeRequestSpec r = DeviceRequest(1);
  r.events.wait_event = std::string(64, 'w');
  EXPECT_FALSE(QuantizeRunsShort(r, ctx_));  // synchronizes: waits for the client's work
  r.events.signal_event = std::string(64, 's');
  EXPECT_TRUE(QuantizeRunsShort(r, ctx_));  // enqueue only
  r.outputs.rowwise_scale_inv.reset();      // a staged output synchronizes again
  EXPECT_FALSE(QuantizeRunsShort(r, ctx_));
}

TEST_F(RunsShortOnDeviceTest, EnqueueOnlyCallsAreShortAtAnySize) {
  QuantizeRequestSpec r = DeviceRequest(1 << 16);  // 128 MiB
  EXPECT_FALSE(QuantizeRunsShort(r, ctx_));
  r.events.signal_event = std::string(64, 's');
  EXPECT_TRUE(QuantizeRunsShort(r, ctx_));
  DequantizeRequestSpec d;
  d.input.shape = {1 << 16, 1024};
  d.input.rowwise_data =
      tensor::TensorRefSpec{DType::kFloat8E4M3, {1 << 16, 1024}, RegionSliceSpec{"gpu", 0, 1}};
  d.input.rowwise_scale_inv =
      tensor::TensorRefSpec{DType::kFloat32, {1}, RegionSliceSpec{"gpu", 0, 1}};
  d.output = RegionSliceSpec{"gpu", 0, 1};
  EXPECT_FALSE(DequantizeRunsShort(d, ctx_));
  d.events.signal_event = std::string(64, 's');
  EXPECT_TRUE(DequantizeRunsShort(d, ctx_));
}

}  // namespace
}  // namespace qtx::server::ops
