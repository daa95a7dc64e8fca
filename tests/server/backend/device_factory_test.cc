// --device parsing and device creation. Runs everywhere: on a host without a
// GPU, "auto" must pick cpu; with one (CUDA build), cuda:0.
#include "server/backend/device_factory.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_format.h"
#include "tests/testing/status_matchers.h"
#if defined(QTX_HAVE_CUDA_DEVICE)
#include "server/backend/cuda_device.h"
#endif

namespace qtx::server::backend {
namespace {

using ::qtx::testing::StatusIs;
using ::testing::HasSubstr;

TEST(ParseDeviceSpec, AcceptsTheDocumentedForms) {
  QTX_ASSERT_OK_AND_ASSIGN(DeviceSpec a, ParseDeviceSpec("auto"));
  EXPECT_EQ(a.kind, DeviceSpec::Kind::kAuto);
  QTX_ASSERT_OK_AND_ASSIGN(DeviceSpec c, ParseDeviceSpec("cpu"));
  EXPECT_EQ(c.kind, DeviceSpec::Kind::kCpu);
  QTX_ASSERT_OK_AND_ASSIGN(DeviceSpec g, ParseDeviceSpec("cuda"));
  EXPECT_EQ(g.kind, DeviceSpec::Kind::kCuda);
  EXPECT_EQ(g.ordinal, 0);
  QTX_ASSERT_OK_AND_ASSIGN(DeviceSpec g7, ParseDeviceSpec("cuda:7"));
  EXPECT_EQ(g7.kind, DeviceSpec::Kind::kCuda);
  EXPECT_EQ(g7.ordinal, 7);
  QTX_ASSERT_OK_AND_ASSIGN(DeviceSpec g12, ParseDeviceSpec("cuda:12"));
  EXPECT_EQ(g12.ordinal, 12);
}

TEST(ParseDeviceSpec, RejectsMalformedOrdinals) {
  for (const char* bad : {"cuda:", "cuda:-1", "cuda:+1", "cuda:1x", "cuda: 1", "cuda:0x1",
                          "cuda:99999999999", "cuda:1.0"}) {
    EXPECT_THAT(ParseDeviceSpec(bad),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("decimal integer")))
        << bad;
  }
}

TEST(ParseDeviceSpec, RejectsOtherNamesListingTheAcceptedOnes) {
  for (const char* bad : {"", "gpu", "CPU", "cuda0", "rocm:0", "auto "}) {
    EXPECT_THAT(ParseDeviceSpec(bad), StatusIs(absl::StatusCode::kInvalidArgument,
                                               HasSubstr("auto, cpu, cuda or cuda:N")))
        << bad;
  }
}

TEST(CreateDevice, CpuIsAlwaysAvailable) {
  QTX_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Device> d, CreateDevice("cpu"));
  EXPECT_EQ(d->name(), "cpu");
  EXPECT_EQ(d->memory_kind(), tensor::MemoryKind::kHost);
  EXPECT_EQ(d->cuda_ipc_opener(), nullptr);
}

TEST(CreateDevice, BadSpecIsInvalidArgument) {
  EXPECT_THAT(CreateDevice("cuda:x"), StatusIs(absl::StatusCode::kInvalidArgument, ::testing::_));
  EXPECT_THAT(CreateDevice("tpu"), StatusIs(absl::StatusCode::kInvalidArgument, ::testing::_));
}

#if defined(QTX_HAVE_CUDA_DEVICE)
TEST(CreateDevice, AutoPicksCuda0ExactlyWhenAGpuIsVisible) {
  QTX_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Device> d, CreateDevice("auto"));
  if (VisibleCudaDevices() > 0) {
    EXPECT_EQ(d->name(), "cuda:0");
    EXPECT_EQ(d->memory_kind(), tensor::MemoryKind::kDevice);
    EXPECT_NE(d->cuda_ipc_opener(), nullptr);
  } else {
    EXPECT_EQ(d->name(), "cpu");
  }
}

TEST(CreateDevice, MissingGpuOrdinalFailsNamingTheCount) {
  const int visible = VisibleCudaDevices();
  auto d = CreateDevice(absl::StrFormat("cuda:%d", visible));
  ASSERT_FALSE(d.ok());
  if (visible > 0) {
    EXPECT_THAT(d.status(), StatusIs(absl::StatusCode::kNotFound, HasSubstr("device(s)")));
  } else {
    // No driver or no GPU: cudaGetDeviceCount itself fails.
    EXPECT_THAT(d.status(), StatusIs(absl::StatusCode::kFailedPrecondition,
                                     HasSubstr("no usable CUDA device")));
  }
}
#else
TEST(CreateDevice, CudaInACpuOnlyBuildIsFailedPrecondition) {
  EXPECT_THAT(CreateDevice("cuda:0"),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("not built with CUDA")));
  QTX_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Device> d, CreateDevice("auto"));
  EXPECT_EQ(d->name(), "cpu");
}
#endif

}  // namespace
}  // namespace qtx::server::backend
