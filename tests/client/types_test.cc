#include "qtx/types.h"

#include <cstdint>
#include <limits>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/block_geometry.h"
#include "tests/testing/status_matchers.h"

namespace qtx {
namespace {

using ::qtx::testing::StatusIs;
using ::testing::HasSubstr;

TEST(TypesTest, DTypeSizes) {
  EXPECT_EQ(DTypeSize(DType::kFloat32), 4);
  EXPECT_EQ(DTypeSize(DType::kBFloat16), 2);
  EXPECT_EQ(DTypeSize(DType::kFloat16), 2);
  EXPECT_EQ(DTypeSize(DType::kFloat8E4M3), 1);
  EXPECT_EQ(DTypeSize(DType::kFloat8E5M2), 1);
  EXPECT_EQ(DTypeSize(DType::kUInt8), 1);
  EXPECT_EQ(DTypeSize(DType::kUnspecified), 0);
  EXPECT_STREQ(DTypeName(DType::kBFloat16), "bfloat16");
}

TEST(TypesTest, NumElementsRejectsNegativeAndOverflow) {
  QTX_ASSERT_OK_AND_ASSIGN(int64_t n, NumElements(std::vector<int64_t>{2, 3, 4}));
  EXPECT_EQ(n, 24);
  QTX_ASSERT_OK_AND_ASSIGN(n, NumElements(std::vector<int64_t>{}));
  EXPECT_EQ(n, 1);
  QTX_ASSERT_OK_AND_ASSIGN(n, NumElements(std::vector<int64_t>{5, 0}));
  EXPECT_EQ(n, 0);
  EXPECT_THAT(NumElements(std::vector<int64_t>{4, -1}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("dim 1 is negative")));
  const int64_t big = int64_t{1} << 40;
  EXPECT_THAT(NumElements(std::vector<int64_t>{big, big}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("overflows")));
}

TEST(TypesTest, TensorByteSize) {
  const std::vector<float> v = {1, 2, 3, 4, 5, 6};
  Tensor t = Tensor::FromFloat32({2, 3}, v);
  EXPECT_EQ(t.data.size(), 24u);
  EXPECT_FALSE(t.in_region());
  QTX_ASSERT_OK_AND_ASSIGN(int64_t bytes, t.ByteSize());
  EXPECT_EQ(bytes, 24);
  Tensor r = Tensor::InRegion(DType::kBFloat16, {7, 3}, RegionSlice{"r", 64, 42});
  EXPECT_TRUE(r.in_region());
  QTX_ASSERT_OK_AND_ASSIGN(bytes, r.ByteSize());
  EXPECT_EQ(bytes, 42);
  EXPECT_THAT(Tensor{}.ByteSize(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("unspecified")));
  const int64_t big = int64_t{1} << 31;
  Tensor huge = Tensor::InRegion(DType::kFloat32, {big, big}, {});
  EXPECT_THAT(huge.ByteSize(), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("byte")));
}

// The client's copy of the layout formulas must agree with the kernels' one.
TEST(TypesTest, QuantizedLayoutMatchesKernels) {
  for (ScalingMode mode : {ScalingMode::kBlock1D, ScalingMode::kBlock2D, ScalingMode::kTensor}) {
    for (int64_t m : {0, 1, 3, 127, 128, 129, 200, 256, 130}) {
      for (int64_t n : {1, 4, 128, 130, 300, 1024}) {
        SCOPED_TRACE(::testing::Message()
                     << "mode " << static_cast<int>(mode) << " m " << m << " n " << n);
        QTX_ASSERT_OK_AND_ASSIGN(QuantizedLayout got,
                                 ComputeQuantizedLayout(mode, std::vector<int64_t>{m, n}));
        const kernels::QuantizedLayout want =
            kernels::ComputeLayout(mode == ScalingMode::kBlock1D   ? kernels::BlockScaling::kBlock1D
                                   : mode == ScalingMode::kBlock2D ? kernels::BlockScaling::kBlock2D
                                                                   : kernels::BlockScaling::kTensor,
                                   m, n);
        EXPECT_EQ(got.m, want.m);
        EXPECT_EQ(got.n, want.n);
        EXPECT_EQ(got.rowwise_data_rows, want.rowwise_data_rows);
        EXPECT_EQ(got.rowwise_data_cols, want.rowwise_data_cols);
        EXPECT_EQ(got.rowwise_scale_rows, want.rowwise_scale_rows);
        EXPECT_EQ(got.rowwise_scale_cols, want.rowwise_scale_cols);
        EXPECT_EQ(got.columnwise_data_rows, want.columnwise_data_rows);
        EXPECT_EQ(got.columnwise_data_cols, want.columnwise_data_cols);
        EXPECT_EQ(got.columnwise_scale_rows, want.columnwise_scale_rows);
        EXPECT_EQ(got.columnwise_scale_cols, want.columnwise_scale_cols);
      }
    }
  }
}

TEST(TypesTest, QuantizedLayoutFlattensLeadingDims) {
  QTX_ASSERT_OK_AND_ASSIGN(
      QuantizedLayout l,
      ComputeQuantizedLayout(ScalingMode::kBlock1D, std::vector<int64_t>{2, 100, 300}));
  EXPECT_EQ(l.m, 200);
  EXPECT_EQ(l.n, 300);
  EXPECT_EQ(l.rowwise_scale_rows, 3);
  EXPECT_EQ(l.rowwise_scale_cols, 200);
  EXPECT_EQ(l.columnwise_scale_rows, 2);
  EXPECT_EQ(l.columnwise_scale_cols, 300);
  EXPECT_THAT(ComputeQuantizedLayout(ScalingMode::kBlock1D, std::vector<int64_t>{}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("rank")));
}

}  // namespace
}  // namespace qtx
