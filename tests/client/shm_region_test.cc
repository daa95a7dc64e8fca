#include "qtx/shm_region.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace qtx {
namespace {

using ::qtx::testing::StatusIs;
using ::testing::HasSubstr;

bool ShmExists(const std::string& name) {
  const int fd = shm_open(name.c_str(), O_RDONLY, 0);
  if (fd < 0) return false;
  close(fd);
  return true;
}

TEST(ShmRegionTest, CreatesMapsAndUnlinks) {
  std::string shm_name;
  {
    QTX_ASSERT_OK_AND_ASSIGN(std::unique_ptr<ShmRegion> r, ShmRegion::Create("test-region", 4096));
    EXPECT_EQ(r->name(), "test-region");
    EXPECT_EQ(r->size(), 4096u);
    EXPECT_EQ(r->shm_name().front(), '/');
    shm_name = r->shm_name();
    EXPECT_TRUE(ShmExists(shm_name));
    // Zero-filled, writable, and visible through a second mapping.
    EXPECT_EQ(r->data()[100], std::byte{0});
    r->data()[100] = std::byte{0x5A};
    const int fd = shm_open(shm_name.c_str(), O_RDONLY, 0);
    ASSERT_GE(fd, 0);
    void* p = mmap(nullptr, 4096, PROT_READ, MAP_SHARED, fd, 0);
    ASSERT_NE(p, MAP_FAILED);
    EXPECT_EQ(static_cast<const unsigned char*>(p)[100], 0x5A);
    munmap(p, 4096);
    close(fd);
  }
  EXPECT_FALSE(ShmExists(shm_name));
}

TEST(ShmRegionTest, ExplicitNameIsExclusive) {
  const std::string name = "/qtx-test-excl-" + std::to_string(getpid());
  QTX_ASSERT_OK_AND_ASSIGN(std::unique_ptr<ShmRegion> a, ShmRegion::Create("a", 64, name));
  EXPECT_EQ(a->shm_name(), name);
  EXPECT_THAT(ShmRegion::Create("b", 64, name),
              StatusIs(absl::StatusCode::kAlreadyExists, HasSubstr(name)));
}

TEST(ShmRegionTest, RejectsBadArguments) {
  EXPECT_THAT(ShmRegion::Create("", 64),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("region name")));
  EXPECT_THAT(ShmRegion::Create("bad name!", 64),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("bad name!")));
  EXPECT_THAT(ShmRegion::Create(std::string(129, 'a'), 64),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("1..128")));
  EXPECT_THAT(ShmRegion::Create("r", 0),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("byte_size")));
  EXPECT_THAT(ShmRegion::Create("r", 64, "no-slash"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("no-slash")));
  EXPECT_THAT(ShmRegion::Create("r", 64, "/a/b"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("/a/b")));
}

TEST(ShmRegionTest, AllocateAlignsAndRunsOut) {
  QTX_ASSERT_OK_AND_ASSIGN(std::unique_ptr<ShmRegion> r, ShmRegion::Create("alloc", 256));
  QTX_ASSERT_OK_AND_ASSIGN(RegionSlice a, r->Allocate(10));
  EXPECT_EQ(a, (RegionSlice{"alloc", 0, 10}));
  QTX_ASSERT_OK_AND_ASSIGN(RegionSlice b, r->Allocate(20, 16));
  EXPECT_EQ(b, (RegionSlice{"alloc", 16, 20}));
  QTX_ASSERT_OK_AND_ASSIGN(RegionSlice c, r->Allocate(100));
  EXPECT_EQ(c.offset, 64u);
  EXPECT_EQ(r->used(), 164u);
  EXPECT_THAT(r->Allocate(100),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("region 'alloc'")));
  EXPECT_EQ(r->used(), 164u);  // unchanged by the failure
  EXPECT_THAT(r->Allocate(1, 3),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("power of two")));
  EXPECT_THAT(r->Allocate(~uint64_t{0}),
              StatusIs(absl::StatusCode::kResourceExhausted, ::testing::_));
  QTX_ASSERT_OK_AND_ASSIGN(RegionSlice d, r->Allocate(64, 64));  // exactly fills [192, 256)
  EXPECT_EQ(d.offset, 192u);
  r->Reset();
  EXPECT_EQ(r->used(), 0u);
}

TEST(ShmRegionTest, PlaceViewAndToInline) {
  QTX_ASSERT_OK_AND_ASSIGN(std::unique_ptr<ShmRegion> r, ShmRegion::Create("place", 1024));
  const std::vector<float> v = {1.5f, -2.0f, 3.25f, 0.0f, 7.0f, -8.5f};
  const Tensor src = Tensor::FromFloat32({2, 3}, v);
  QTX_ASSERT_OK_AND_ASSIGN(Tensor placed, r->Place(src));
  ASSERT_TRUE(placed.in_region());
  EXPECT_EQ(placed.region->region, "place");
  EXPECT_EQ(placed.region->size, 24u);
  EXPECT_EQ(placed.shape, src.shape);
  EXPECT_EQ(std::memcmp(r->data() + placed.region->offset, v.data(), 24), 0);
  QTX_ASSERT_OK_AND_ASSIGN(Tensor back, r->ToInline(placed));
  EXPECT_FALSE(back.in_region());
  EXPECT_EQ(back.data, src.data);
  EXPECT_EQ(back.dtype, DType::kFloat32);

  EXPECT_THAT(r->Place(placed),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("already in a region")));
  Tensor short_data = src;
  short_data.data.pop_back();
  EXPECT_THAT(r->Place(short_data),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("23 bytes")));
  EXPECT_THAT(r->View(RegionSlice{"other", 0, 4}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("'other'")));
  EXPECT_THAT(r->View(RegionSlice{"place", 1000, 25}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("exceeds region size")));
  EXPECT_THAT(r->View(RegionSlice{"place", ~uint64_t{0}, 2}),
              StatusIs(absl::StatusCode::kInvalidArgument, ::testing::_));
}

TEST(ShmRegionTest, AllocateQuantizeOutputsSizesEveryBuffer) {
  QTX_ASSERT_OK_AND_ASSIGN(std::unique_ptr<ShmRegion> r, ShmRegion::Create("outs", 1 << 20));
  QuantizeConfig c;
  c.scaling_mode = ScalingMode::kBlock2D;
  c.rowwise = true;
  c.columnwise = true;
  const std::vector<int64_t> shape = {200, 300};
  QTX_ASSERT_OK_AND_ASSIGN(QuantizeOutputs o, r->AllocateQuantizeOutputs(shape, c));
  ASSERT_TRUE(o.rowwise_data && o.rowwise_scale_inv && o.columnwise_data && o.columnwise_scale_inv);
  EXPECT_EQ(o.rowwise_data->size, 60000u);
  EXPECT_EQ(o.rowwise_scale_inv->size, 2u * 4 * 4);  // [2, pad4(3)] f32
  EXPECT_EQ(o.columnwise_data->size, 60000u);
  EXPECT_EQ(o.columnwise_scale_inv->size, 3u * 4 * 4);  // [3, pad4(2)] f32
  c.columnwise = false;
  QTX_ASSERT_OK_AND_ASSIGN(QuantizeOutputs o2, r->AllocateQuantizeOutputs(shape, c));
  EXPECT_TRUE(o2.rowwise_data.has_value());
  EXPECT_FALSE(o2.columnwise_data.has_value());
  // All or nothing when the region is too small.
  QTX_ASSERT_OK_AND_ASSIGN(std::unique_ptr<ShmRegion> small, ShmRegion::Create("small", 60100));
  c.columnwise = true;
  EXPECT_THAT(small->AllocateQuantizeOutputs(shape, c),
              StatusIs(absl::StatusCode::kResourceExhausted, ::testing::_));
  EXPECT_EQ(small->used(), 0u);
}

}  // namespace
}  // namespace qtx
