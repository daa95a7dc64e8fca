#include "client/proto_convert.h"

#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace qtx::client_internal {
namespace {

using ::qtx::testing::StatusIs;

TEST(ProtoConvertTest, GrpcStatusKeepsCodeAndMessage) {
  EXPECT_TRUE(FromGrpcStatus(grpc::Status::OK).ok());
  const struct {
    grpc::StatusCode grpc;
    absl::StatusCode absl;
  } cases[] = {
      {grpc::StatusCode::INVALID_ARGUMENT, absl::StatusCode::kInvalidArgument},
      {grpc::StatusCode::NOT_FOUND, absl::StatusCode::kNotFound},
      {grpc::StatusCode::ALREADY_EXISTS, absl::StatusCode::kAlreadyExists},
      {grpc::StatusCode::RESOURCE_EXHAUSTED, absl::StatusCode::kResourceExhausted},
      {grpc::StatusCode::FAILED_PRECONDITION, absl::StatusCode::kFailedPrecondition},
      {grpc::StatusCode::DEADLINE_EXCEEDED, absl::StatusCode::kDeadlineExceeded},
      {grpc::StatusCode::UNAVAILABLE, absl::StatusCode::kUnavailable},
      {grpc::StatusCode::PERMISSION_DENIED, absl::StatusCode::kPermissionDenied},
      {grpc::StatusCode::UNAUTHENTICATED, absl::StatusCode::kUnauthenticated},
  };
  for (const auto& c : cases) {
    EXPECT_THAT(FromGrpcStatus(grpc::Status(c.grpc, "region 'x': not found")),
                StatusIs(c.absl, "region 'x': not found"));
  }
}

TEST(ProtoConvertTest, ConfigAlwaysSetsOptionalFields) {
  QuantizeConfig c;  // defaults
  v1::QuantizeConfig p;
  ToProto(c, &p);
  EXPECT_EQ(p.scaling_mode(), v1::BLOCK_1D);
  EXPECT_EQ(p.format(), v1::E4M3);
  ASSERT_TRUE(p.has_rowwise() && p.has_columnwise() && p.has_force_pow2_scales());
  EXPECT_TRUE(p.rowwise());
  EXPECT_FALSE(p.columnwise());
  EXPECT_TRUE(p.force_pow2_scales());

  c.scaling_mode = ScalingMode::kBlock2D;
  c.format = Fp8Format::kE5M2;
  c.rowwise = false;
  c.columnwise = true;
  c.force_pow2_scales = false;
  c.amax_epsilon = 1e-6f;
  ToProto(c, &p);
  EXPECT_EQ(FromProto(p), c);
}

TEST(ProtoConvertTest, UnsetConfigGetsDocumentedDefaults) {
  const QuantizeConfig c = FromProto(v1::QuantizeConfig());
  EXPECT_EQ(c, QuantizeConfig());
}

TEST(ProtoConvertTest, TensorRoundTripsInlineAndRegion) {
  const Tensor in =
      Tensor::Inline(DType::kBFloat16, {2, 2}, std::string("\x01\x02\x03\x04\x05\x06\x07\x08", 8));
  v1::TensorRef p;
  ToProto(in, &p);
  EXPECT_EQ(p.dtype(), v1::BFLOAT16);
  EXPECT_EQ(p.data_case(), v1::TensorRef::kInlineData);
  Tensor out = FromProto(std::move(p));
  EXPECT_EQ(out.dtype, in.dtype);
  EXPECT_EQ(out.shape, in.shape);
  EXPECT_EQ(out.data, in.data);
  EXPECT_FALSE(out.in_region());

  const Tensor r = Tensor::InRegion(DType::kFloat32, {3, 5, 7}, RegionSlice{"reg", 128, 420});
  v1::TensorRef pr;
  ToProto(r, &pr);
  EXPECT_EQ(pr.data_case(), v1::TensorRef::kRegion);
  EXPECT_EQ(pr.region().region(), "reg");
  Tensor rout = FromProto(std::move(pr));
  ASSERT_TRUE(rout.in_region());
  EXPECT_EQ(*rout.region, *r.region);
  EXPECT_EQ(rout.shape, r.shape);
}

TEST(ProtoConvertTest, QuantizedTensorKeepsPresentCopiesOnly) {
  QuantizedTensor q;
  q.shape = {4, 256};
  q.source_dtype = DType::kFloat16;
  q.config.columnwise = true;
  q.config.rowwise = false;
  q.columnwise_data = Tensor::Inline(DType::kFloat8E4M3, {256, 4}, std::string(1024, 'x'));
  q.columnwise_scale_inv = Tensor::InRegion(DType::kFloat32, {1, 256}, RegionSlice{"s", 0, 1024});
  v1::QuantizedTensor p;
  ToProto(q, &p);
  EXPECT_FALSE(p.has_rowwise_data());
  EXPECT_FALSE(p.has_rowwise_scale_inv());
  EXPECT_TRUE(p.has_columnwise_data());
  const QuantizedTensor back = FromProto(std::move(p));
  EXPECT_EQ(back.shape, q.shape);
  EXPECT_EQ(back.source_dtype, DType::kFloat16);
  EXPECT_EQ(back.config, q.config);
  EXPECT_FALSE(back.rowwise_data.has_value());
  ASSERT_TRUE(back.columnwise_data.has_value());
  EXPECT_EQ(back.columnwise_data->data, q.columnwise_data->data);
  ASSERT_TRUE(back.columnwise_scale_inv && back.columnwise_scale_inv->in_region());
  EXPECT_EQ(*back.columnwise_scale_inv->region, *q.columnwise_scale_inv->region);
}

TEST(ProtoConvertTest, OutputsAndRegionInfo) {
  QuantizeOutputs o;
  o.rowwise_scale_inv = RegionSlice{"r", 64, 16};
  v1::QuantizeOutputs p;
  ToProto(o, &p);
  EXPECT_FALSE(p.has_rowwise_data());
  ASSERT_TRUE(p.has_rowwise_scale_inv());
  EXPECT_EQ(p.rowwise_scale_inv().offset(), 64u);

  v1::RegionInfo info;
  info.set_name("n");
  info.set_kind("shm");
  info.set_byte_size(4096);
  info.set_shm_name("/s");
  info.set_in_use(2);
  const RegionInfo r = FromProto(info);
  EXPECT_EQ(r.name, "n");
  EXPECT_EQ(r.kind, "shm");
  EXPECT_EQ(r.byte_size, 4096u);
  EXPECT_EQ(r.shm_name, "/s");
  EXPECT_EQ(r.in_use, 2u);
}

TEST(ProtoConvertTest, ShardRangeRoundTrips) {
  v1::ShardRange p;
  ToProto(ShardRange{12345, 1 << 20}, &p);
  EXPECT_EQ(p.begin(), 12345);
  EXPECT_EQ(p.end(), 1 << 20);
  EXPECT_EQ(FromProto(p), (ShardRange{12345, 1 << 20}));
  p.set_begin(7);
  p.set_end(7);  // empty ranges are ranges too
  EXPECT_EQ(FromProto(p), (ShardRange{7, 7}));
}

TEST(ProtoConvertTest, CollectiveGroupConfigToProto) {
  CollectiveGroupConfig c;
  c.name = "tp";
  c.rank = 2;
  c.world_size = 3;
  c.coordinator = "unix:/tmp/r0.sock";
  c.backend = CommBackend::kGloo;
  c.timeout = absl::Milliseconds(1500) + absl::Microseconds(1);  // rounded up
  v1::CreateGroupRequest p;
  ASSERT_TRUE(ToProto(c, &p).ok());
  EXPECT_EQ(p.name(), "tp");
  EXPECT_EQ(p.rank(), 2);
  EXPECT_EQ(p.world_size(), 3);
  EXPECT_EQ(p.coordinator(), "unix:/tmp/r0.sock");
  EXPECT_EQ(p.backend(), v1::GLOO);
  EXPECT_EQ(p.timeout_ms(), 1501u);

  c.backend = CommBackend::kNccl;
  c.timeout = absl::Nanoseconds(1);  // positive: never 0 (= the server default)
  ASSERT_TRUE(ToProto(c, &p).ok());
  EXPECT_EQ(p.backend(), v1::NCCL);
  EXPECT_EQ(p.timeout_ms(), 1u);

  c.backend = CommBackend::kUnspecified;
  c.timeout = absl::ZeroDuration();
  ASSERT_TRUE(ToProto(c, &p).ok());
  EXPECT_EQ(p.backend(), v1::COMM_BACKEND_UNSPECIFIED);
  EXPECT_EQ(p.timeout_ms(), 0u);

  for (absl::Duration bad :
       {absl::Milliseconds(-1), absl::Hours(24 * 50), absl::InfiniteDuration()}) {
    EXPECT_THAT(ToProto(CollectiveGroupConfig{.timeout = bad}, &p),
                StatusIs(absl::StatusCode::kInvalidArgument, ::testing::HasSubstr("timeout=")));
  }
}

TEST(ProtoConvertTest, GroupInfoFromProto) {
  v1::GroupInfo g;
  g.set_name("tp");
  g.set_rank(1);
  g.set_world_size(4);
  g.set_backend(v1::GLOO);
  g.set_state(v1::BROKEN);
  g.set_next_sequence(7);
  g.set_error("rank 3 died");
  const CollectiveGroupInfo i = FromProto(g);
  EXPECT_EQ(i.name, "tp");
  EXPECT_EQ(i.rank, 1);
  EXPECT_EQ(i.world_size, 4);
  EXPECT_EQ(i.backend, CommBackend::kGloo);
  EXPECT_EQ(i.state, GroupState::kBroken);
  EXPECT_EQ(i.next_sequence, 7u);
  EXPECT_EQ(i.error, "rank 3 died");
  EXPECT_STREQ(CommBackendName(i.backend), "gloo");
  EXPECT_STREQ(GroupStateName(i.state), "broken");
  EXPECT_STREQ(GroupStateName(FromProto(v1::GroupInfo()).state), "unspecified");
  EXPECT_STREQ(CommBackendName(static_cast<CommBackend>(9)), "unknown");
  EXPECT_STREQ(AllGatherModeName(AllGatherMode::kGatherHighPrecision), "gather_high_precision");
  // The client enums carry the proto numbers.
  EXPECT_EQ(static_cast<int>(AllGatherMode::kExactFp8), v1::EXACT_FP8);
  EXPECT_EQ(static_cast<int>(AllGatherMode::kGatherHighPrecision), v1::GATHER_HIGH_PRECISION);
  EXPECT_EQ(static_cast<int>(GroupState::kReady), v1::READY);
  EXPECT_EQ(static_cast<int>(CommBackend::kNccl), v1::NCCL);
}

}  // namespace
}  // namespace qtx::client_internal
