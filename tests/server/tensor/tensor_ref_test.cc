#include "server/tensor/tensor_ref.h"

#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/server/testing/shm_object.h"
#include "tests/testing/status_matchers.h"

namespace qtx::server::tensor {
namespace {

using ::qtx::testing::ShmObject;
using ::qtx::testing::StatusIs;
using ::testing::HasSubstr;

class TensorRefTest : public ::testing::Test {
 protected:
  TensorRefTest() : shm_(1 << 16), table_(Options()) {}
  static RegionTableOptions Options() {
    RegionTableOptions o;
    o.allow_client_shm = true;
    return o;
  }
  void SetUp() override {
    ASSERT_TRUE(shm_.ok()) << shm_.error();
    QTX_ASSERT_OK(table_.RegisterShm("r", shm_.name(), 0, shm_.size()));
  }
  TensorRefSpec Inline(DType dtype, std::vector<int64_t> shape, const std::string& bytes) {
    TensorRefSpec s;
    s.dtype = dtype;
    s.shape = std::move(shape);
    s.data = std::string_view(bytes);
    return s;
  }
  TensorRefSpec Slice(DType dtype, std::vector<int64_t> shape, uint64_t offset, uint64_t size,
                      std::string region = "r") {
    TensorRefSpec s;
    s.dtype = dtype;
    s.shape = std::move(shape);
    s.data = RegionSliceSpec{std::move(region), offset, size};
    return s;
  }

  ShmObject shm_;
  RegionTable table_;
  ShapeLimits limits_;
};

TEST_F(TensorRefTest, InlineInputResolves) {
  const std::string bytes(24, '\x01');
  QTX_ASSERT_OK_AND_ASSIGN(
      TensorView v, ResolveInput(Inline(DType::kFloat32, {2, 3}, bytes), "input", table_, limits_));
  EXPECT_EQ(v.elements, 6);
  EXPECT_EQ(v.byte_size, 24u);
  EXPECT_EQ(v.memory, MemoryKind::kHost);
  EXPECT_EQ(v.pin, nullptr);
  EXPECT_EQ(std::memcmp(v.data, bytes.data(), 24), 0);
}

TEST_F(TensorRefTest, ShapeErrorsNameTheFieldAndValue) {
  const std::string bytes(24, '\0');
  EXPECT_THAT(ResolveInput(Inline(DType::kFloat32, {2, -3}, bytes), "input", table_, limits_),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("input.shape[1]=-3: dims must be >= 0")));
  EXPECT_THAT(ResolveInput(Inline(DType::kFloat32, {}, bytes), "input", table_, limits_),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("rank 0, must be 1..8")));
  EXPECT_THAT(ResolveInput(Inline(DType::kFloat32, {1, 1, 1, 1, 1, 1, 1, 1, 1}, bytes), "input",
                           table_, limits_),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("rank 9, must be 1..8")));
  const int64_t big = int64_t{1} << 33;
  EXPECT_THAT(
      ResolveInput(Inline(DType::kFloat32, {big, big, big}, bytes), "input", table_, limits_),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("more than 2^63")));
  EXPECT_THAT(ResolveInput(Inline(DType::kFloat32, {big, 4}, bytes), "input", table_, limits_),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("34359738368 elements, the limit is 17179869184")));
  EXPECT_THAT(ResolveInput(Inline(DType::kFloat32, {std::numeric_limits<int64_t>::max(), 0}, bytes),
                           "input", table_, limits_),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("input.shape[0]=")));
}

TEST_F(TensorRefTest, DtypeAndDataMustBeSet) {
  TensorRefSpec s = Inline(DType::kUnspecified, {1}, "abcd");
  EXPECT_THAT(
      ResolveInput(s, "input", table_, limits_),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("input.dtype=DTYPE_UNSPECIFIED")));
  s.dtype = DType::kFloat32;
  s.data = std::monostate{};
  EXPECT_THAT(ResolveInput(s, "input", table_, limits_),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("input: no data")));
}

TEST_F(TensorRefTest, InlineByteCountMustMatch) {
  const std::string bytes(23, '\0');
  EXPECT_THAT(
      ResolveInput(Inline(DType::kFloat32, {2, 3}, bytes), "input", table_, limits_),
      StatusIs(absl::StatusCode::kInvalidArgument,
               HasSubstr("input.inline_data: 23 bytes, expected 24 (6 elements of FLOAT32)")));
}

TEST_F(TensorRefTest, MisalignedInlineBytesAreCopiedToAlignedMemory) {
  std::string storage(17, '\0');
  for (int i = 0; i < 17; ++i) storage[i] = static_cast<char>(i);
  TensorRefSpec s;
  s.dtype = DType::kFloat32;
  s.shape = {4};
  s.data = std::string_view(storage.data() + 1, 16);
  ASSERT_NE(reinterpret_cast<uintptr_t>(storage.data() + 1) % 4, 0u);
  QTX_ASSERT_OK_AND_ASSIGN(TensorView v, ResolveInput(s, "input", table_, limits_));
  EXPECT_EQ(reinterpret_cast<uintptr_t>(v.data) % 4, 0u);
  EXPECT_NE(v.owned, nullptr);
  EXPECT_EQ(std::memcmp(v.data, storage.data() + 1, 16), 0);
}

TEST_F(TensorRefTest, EmptyTensorResolves) {
  QTX_ASSERT_OK_AND_ASSIGN(
      TensorView v, ResolveInput(Inline(DType::kBFloat16, {0, 7}, ""), "input", table_, limits_));
  EXPECT_EQ(v.elements, 0);
  EXPECT_EQ(v.byte_size, 0u);
}

TEST_F(TensorRefTest, RegionSliceResolvesAndPins) {
  std::memset(shm_.data() + 64, 0x5A, 32);
  QTX_ASSERT_OK_AND_ASSIGN(TensorView v, ResolveInput(Slice(DType::kBFloat16, {4, 4}, 64, 32),
                                                      "input", table_, limits_));
  EXPECT_NE(v.pin, nullptr);
  EXPECT_EQ(v.pin->in_use(), 1u);
  EXPECT_EQ(v.data, shm_.data() == nullptr ? nullptr : v.pin->data() + 64);
  EXPECT_EQ(std::memcmp(v.data, shm_.data() + 64, 32), 0);
}

TEST_F(TensorRefTest, RegionSliceErrors) {
  EXPECT_THAT(
      ResolveInput(Slice(DType::kFloat32, {4}, 0, 15), "input", table_, limits_),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("input.region.size=15: expected 16")));
  EXPECT_THAT(ResolveInput(Slice(DType::kFloat32, {4}, 0, 16, "missing"), "input", table_, limits_),
              StatusIs(absl::StatusCode::kNotFound,
                       HasSubstr("input.region: region 'missing' is not registered")));
  EXPECT_THAT(
      ResolveInput(Slice(DType::kFloat32, {4}, (1 << 16) - 8, 16), "input", table_, limits_),
      StatusIs(absl::StatusCode::kInvalidArgument,
               HasSubstr("offset 65528 + size 16 exceeds region size 65536")));
  EXPECT_THAT(
      ResolveInput(Slice(DType::kFloat32, {4}, std::numeric_limits<uint64_t>::max() - 3, 16),
                   "input", table_, limits_),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("exceeds region size")));
  EXPECT_THAT(ResolveInput(Slice(DType::kFloat32, {4}, 2, 16), "input", table_, limits_),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("offset 2 is not aligned to the 4-byte element size")));
}

TEST_F(TensorRefTest, OutputSliceMustHaveTheExactSize) {
  RegionSliceSpec s{"r", 128, 100};
  EXPECT_THAT(ResolveOutputSlice(s, 96, 4, "outputs.rowwise_scale_inv", table_),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("outputs.rowwise_scale_inv.size=100: expected 96")));
  s.size = 96;
  QTX_ASSERT_OK_AND_ASSIGN(OutputSlice out,
                           ResolveOutputSlice(s, 96, 4, "outputs.rowwise_scale_inv", table_));
  EXPECT_EQ(out.data, out.pin->data() + 128);
  EXPECT_EQ(out.byte_size, 96u);
}

TEST(RangesOverlap, DetectsSharedBytesOnly) {
  char buf[32] = {};
  EXPECT_TRUE(RangesOverlap(buf, 16, buf + 15, 4));
  EXPECT_FALSE(RangesOverlap(buf, 16, buf + 16, 4));
  EXPECT_FALSE(RangesOverlap(buf, 0, buf, 4));
}

}  // namespace
}  // namespace qtx::server::tensor
