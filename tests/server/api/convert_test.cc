// server/api/convert: qtx.v1 messages <-> the plain specs of server/ops, with
// the proto defaults applied and unknown enum values refused.
#include "server/api/convert.h"

#include <string>
#include <string_view>
#include <utility>
#include <variant>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace qtx::server::api {
namespace {

using ::qtx::testing::StatusIs;
using ::testing::HasSubstr;

TEST(ConvertTest, DTypeRoundTripsEveryValue) {
  const v1::DType all[] = {v1::DTYPE_UNSPECIFIED, v1::FLOAT32,     v1::BFLOAT16, v1::FLOAT16,
                           v1::FLOAT8_E4M3,       v1::FLOAT8_E5M2, v1::UINT8};
  for (v1::DType d : all) {
    QTX_ASSERT_OK_AND_ASSIGN(tensor::DType t, DTypeFromProto(d, "x.dtype"));
    EXPECT_EQ(DTypeToProto(t), d) << v1::DType_Name(d);
  }
  QTX_ASSERT_OK_AND_ASSIGN(tensor::DType bf16, DTypeFromProto(v1::BFLOAT16, "x"));
  EXPECT_EQ(bf16, tensor::DType::kBFloat16);
}

TEST(ConvertTest, UnknownDTypeNamesFieldAndValue) {
  EXPECT_THAT(DTypeFromProto(99, "input.dtype"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("input.dtype=99")));
}

TEST(ConvertTest, ParamsDefaultsFollowTheProtoComments) {
  v1::QuantizeConfig empty;
  QTX_ASSERT_OK_AND_ASSIGN(kernels::QuantizeParams p, ParamsFromProto(empty, "config"));
  EXPECT_EQ(p.scaling, kernels::BlockScaling::kBlock1D);
  EXPECT_EQ(p.format, kernels::Fp8Format::kE4M3);
  EXPECT_TRUE(p.rowwise);
  EXPECT_FALSE(p.columnwise);
  EXPECT_TRUE(p.force_pow2_scales);
  EXPECT_EQ(p.amax_epsilon, 0.0f);
}

TEST(ConvertTest, ParamsExplicitValuesWinOverDefaults) {
  v1::QuantizeConfig c;
  c.set_scaling_mode(v1::BLOCK_2D);
  c.set_format(v1::E5M2);
  c.set_rowwise(false);
  c.set_columnwise(true);
  c.set_force_pow2_scales(false);
  c.set_amax_epsilon(0.25f);
  QTX_ASSERT_OK_AND_ASSIGN(kernels::QuantizeParams p, ParamsFromProto(c, "config"));
  EXPECT_EQ(p.scaling, kernels::BlockScaling::kBlock2D);
  EXPECT_EQ(p.format, kernels::Fp8Format::kE5M2);
  EXPECT_FALSE(p.rowwise);
  EXPECT_TRUE(p.columnwise);
  EXPECT_FALSE(p.force_pow2_scales);
  EXPECT_EQ(p.amax_epsilon, 0.25f);

  // And back: every field set explicitly, so the defaults cannot change it.
  v1::QuantizeConfig out;
  ParamsToProto(p, &out);
  EXPECT_EQ(out.scaling_mode(), v1::BLOCK_2D);
  EXPECT_EQ(out.format(), v1::E5M2);
  ASSERT_TRUE(out.has_rowwise());
  EXPECT_FALSE(out.rowwise());
  ASSERT_TRUE(out.has_columnwise());
  EXPECT_TRUE(out.columnwise());
  ASSERT_TRUE(out.has_force_pow2_scales());
  EXPECT_FALSE(out.force_pow2_scales());
  EXPECT_EQ(out.amax_epsilon(), 0.25f);
}

TEST(ConvertTest, UnknownScalingModeAndFormatAreRefused) {
  v1::QuantizeConfig c;
  c.set_scaling_mode(static_cast<v1::ScalingMode>(7));
  EXPECT_THAT(ParamsFromProto(c, "output.fp8"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("output.fp8.scaling_mode=7: unknown ScalingMode")));
  v1::QuantizeConfig f;
  f.set_format(static_cast<v1::Fp8Format>(9));
  EXPECT_THAT(ParamsFromProto(f, "config"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("config.format=9: unknown Fp8Format")));
}

TEST(ConvertTest, TensorRefInlineBorrowsTheMessageBytes) {
  v1::TensorRef ref;
  ref.set_dtype(v1::FLOAT32);
  ref.add_shape(2);
  ref.add_shape(3);
  ref.set_inline_data(std::string(24, 'x'));
  QTX_ASSERT_OK_AND_ASSIGN(tensor::TensorRefSpec spec, TensorRefFromProto(ref, "input"));
  EXPECT_EQ(spec.dtype, tensor::DType::kFloat32);
  EXPECT_EQ(spec.shape, (std::vector<int64_t>{2, 3}));
  const auto* bytes = std::get_if<std::string_view>(&spec.data);
  ASSERT_NE(bytes, nullptr);
  EXPECT_EQ(bytes->data(), ref.inline_data().data());  // no copy
  EXPECT_EQ(bytes->size(), 24u);
}

TEST(ConvertTest, TensorRefRegionSlice) {
  v1::TensorRef ref;
  ref.set_dtype(v1::BFLOAT16);
  ref.add_shape(4);
  ref.mutable_region()->set_region("r");
  ref.mutable_region()->set_offset(64);
  ref.mutable_region()->set_size(8);
  QTX_ASSERT_OK_AND_ASSIGN(tensor::TensorRefSpec spec, TensorRefFromProto(ref, "input"));
  const auto* slice = std::get_if<tensor::RegionSliceSpec>(&spec.data);
  ASSERT_NE(slice, nullptr);
  EXPECT_EQ(slice->region, "r");
  EXPECT_EQ(slice->offset, 64u);
  EXPECT_EQ(slice->size, 8u);
}

TEST(ConvertTest, TensorRefBadDTypeNamesTheNestedField) {
  v1::TensorRef ref;
  ref.set_dtype(static_cast<v1::DType>(42));
  EXPECT_THAT(
      TensorRefFromProto(ref, "input.rowwise_data"),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("input.rowwise_data.dtype=42")));
}

TEST(ConvertTest, QuantizeRequestNeedsAnInput) {
  v1::QuantizeRequest req;
  EXPECT_THAT(QuantizeRequestFromProto(req),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("input: missing")));
}

TEST(ConvertTest, QuantizeRequestCarriesOutputsAndEvents) {
  v1::QuantizeRequest req;
  req.mutable_input()->set_dtype(v1::FLOAT32);
  req.mutable_input()->add_shape(128);
  req.mutable_config()->set_columnwise(true);
  req.mutable_outputs()->mutable_columnwise_data()->set_region("out");
  req.mutable_outputs()->mutable_columnwise_data()->set_size(128);
  req.mutable_cuda_events()->set_wait_event(std::string(64, 'w'));
  QTX_ASSERT_OK_AND_ASSIGN(ops::QuantizeRequestSpec spec, QuantizeRequestFromProto(req));
  EXPECT_TRUE(spec.params.columnwise);
  EXPECT_FALSE(spec.outputs.rowwise_data.has_value());  // unset: inline
  EXPECT_FALSE(spec.outputs.rowwise_scale_inv.has_value());
  ASSERT_TRUE(spec.outputs.columnwise_data.has_value());
  EXPECT_EQ(spec.outputs.columnwise_data->region, "out");
  EXPECT_EQ(spec.outputs.columnwise_data->size, 128u);
  EXPECT_EQ(spec.events.wait_event, std::string(64, 'w'));
  EXPECT_TRUE(spec.events.signal_event.empty());
  EXPECT_EQ(spec.queue, nullptr);
}

TEST(ConvertTest, DequantizeRequestReadsEveryBufferAndTheOutput) {
  v1::DequantizeRequest req;
  v1::QuantizedTensor* q = req.mutable_input();
  q->add_shape(3);
  q->add_shape(5);
  q->mutable_config()->set_scaling_mode(v1::BLOCK_2D);
  q->mutable_config()->set_format(v1::E5M2);
  q->mutable_columnwise_data()->set_dtype(v1::UINT8);
  q->mutable_columnwise_scale_inv()->set_dtype(v1::FLOAT32);
  req.set_output_dtype(v1::BFLOAT16);
  req.mutable_output()->set_region("dst");
  QTX_ASSERT_OK_AND_ASSIGN(ops::DequantizeRequestSpec spec, DequantizeRequestFromProto(req));
  EXPECT_EQ(spec.input.shape, (std::vector<int64_t>{3, 5}));
  EXPECT_EQ(spec.input.scaling, kernels::BlockScaling::kBlock2D);
  EXPECT_EQ(spec.input.format, kernels::Fp8Format::kE5M2);
  EXPECT_FALSE(spec.input.rowwise_data.has_value());
  ASSERT_TRUE(spec.input.columnwise_data.has_value());
  EXPECT_EQ(spec.input.columnwise_data->dtype, tensor::DType::kUInt8);
  ASSERT_TRUE(spec.input.columnwise_scale_inv.has_value());
  EXPECT_EQ(spec.output_dtype, tensor::DType::kBFloat16);
  ASSERT_TRUE(spec.output.has_value());
  EXPECT_EQ(spec.output->region, "dst");
}

TEST(ConvertTest, DequantizeRequestBadFieldsAreNamed) {
  v1::DequantizeRequest missing;
  EXPECT_THAT(DequantizeRequestFromProto(missing),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("input: missing")));
  v1::DequantizeRequest bad_config;
  bad_config.mutable_input()->mutable_config()->set_format(static_cast<v1::Fp8Format>(3));
  EXPECT_THAT(DequantizeRequestFromProto(bad_config),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("input.config.format=3")));
  v1::DequantizeRequest bad_out;
  bad_out.mutable_input();
  bad_out.set_output_dtype(static_cast<v1::DType>(77));
  EXPECT_THAT(DequantizeRequestFromProto(bad_out),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("output_dtype=77")));
}

TEST(ConvertTest, QuantizedTensorToProtoMovesInlineBytesAndKeepsRegions) {
  ops::QuantizeResult r;
  r.shape = {2, 130};
  r.source_dtype = tensor::DType::kBFloat16;
  r.params.columnwise = true;
  r.rowwise_data.emplace();
  r.rowwise_data->dtype = tensor::DType::kFloat8E4M3;
  r.rowwise_data->shape = {2, 130};
  r.rowwise_data->inline_data = std::string(260, '\x7f');
  r.columnwise_data.emplace();
  r.columnwise_data->dtype = tensor::DType::kFloat8E4M3;
  r.columnwise_data->shape = {130, 2};
  r.columnwise_data->region = tensor::RegionSliceSpec{"out", 512, 260};
  v1::QuantizedTensor q;
  QuantizedTensorToProto(std::move(r), &q);
  EXPECT_THAT(q.shape(), ::testing::ElementsAre(2, 130));
  EXPECT_EQ(q.source_dtype(), v1::BFLOAT16);
  EXPECT_TRUE(q.config().columnwise());
  EXPECT_EQ(q.rowwise_data().dtype(), v1::FLOAT8_E4M3);
  EXPECT_EQ(q.rowwise_data().inline_data(), std::string(260, '\x7f'));
  EXPECT_FALSE(q.has_rowwise_scale_inv());
  ASSERT_TRUE(q.columnwise_data().has_region());
  EXPECT_EQ(q.columnwise_data().region().region(), "out");
  EXPECT_EQ(q.columnwise_data().region().offset(), 512u);
  EXPECT_EQ(q.columnwise_data().region().size(), 260u);
  EXPECT_THAT(q.columnwise_data().shape(), ::testing::ElementsAre(130, 2));
  EXPECT_FALSE(q.has_columnwise_scale_inv());
}

TEST(ConvertTest, RegionInfoKinds) {
  tensor::RegionInfo info;
  info.name = "a";
  info.byte_size = 4096;
  info.in_use = 2;
  const std::pair<tensor::RegionKind, std::string_view> kinds[] = {
      {tensor::RegionKind::kShm, "shm"},
      {tensor::RegionKind::kCudaIpc, "cuda_ipc"},
      {tensor::RegionKind::kCudaVmm, "cuda_vmm"}};
  for (const auto& [kind, name] : kinds) {
    info.kind = kind;
    v1::RegionInfo out;
    RegionInfoToProto(info, &out);
    EXPECT_EQ(out.kind(), name);
    EXPECT_EQ(out.name(), "a");
    EXPECT_EQ(out.byte_size(), 4096u);
    EXPECT_EQ(out.in_use(), 2u);
  }
}

}  // namespace
}  // namespace qtx::server::api
