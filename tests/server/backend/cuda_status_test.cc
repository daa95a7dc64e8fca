// CUDA error -> absl::Status mapping. Needs the CUDA runtime, not a GPU.
#include "server/backend/cuda_status.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "tests/testing/status_matchers.h"

namespace qtx::server::backend {
namespace {

using ::qtx::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;

absl::Status Fails(cudaError_t err, bool* reached_end) {
  QTX_CUDA_RETURN_IF_ERROR(err);
  *reached_end = true;
  return absl::OkStatus();
}

TEST(CudaStatus, SuccessIsOkAndContinues) {
  bool reached = false;
  QTX_EXPECT_OK(Fails(cudaSuccess, &reached));
  EXPECT_TRUE(reached);
  QTX_EXPECT_OK(CudaErrorToStatus(cudaSuccess, "x", "f.cc", 1));
}

TEST(CudaStatus, ErrorIsInternalWithNameStringExpressionAndLocation) {
  bool reached = false;
  const absl::Status s = Fails(cudaErrorInvalidValue, &reached);
  EXPECT_FALSE(reached);
  EXPECT_THAT(s, StatusIs(absl::StatusCode::kInternal,
                          AllOf(HasSubstr("cudaErrorInvalidValue"),
                                HasSubstr(cudaGetErrorString(cudaErrorInvalidValue)),
                                HasSubstr("in err at cuda_status_test.cc:"))));
}

TEST(CudaStatus, OutOfMemoryIsResourceExhausted) {
  EXPECT_THAT(
      CudaErrorToStatus(cudaErrorMemoryAllocation, "cudaMallocAsync(&p, n, s)",
                        "/a/b/cuda_device.cc", 42),
      StatusIs(absl::StatusCode::kResourceExhausted,
               AllOf(HasSubstr("cudaErrorMemoryAllocation"), HasSubstr("cudaMallocAsync(&p, n, s)"),
                     HasSubstr("cuda_device.cc:42"))));
}

}  // namespace
}  // namespace qtx::server::backend
