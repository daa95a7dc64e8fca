#include "common/cuda_driver.h"

#include <cuda.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <utility>

namespace qtx::cuda_driver {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

TEST(CudaDriver, LoadSymbolsFindsTheDriversFunctions) {
  CUresult (*version)(int*) = nullptr;
  CUresult (*attribute)(int*, CUdevice_attribute, CUdevice) = nullptr;
  const std::pair<const char*, void**> wanted[] = {
      {"cuDriverGetVersion", reinterpret_cast<void**>(&version)},
      {"cuDeviceGetAttribute", reinterpret_cast<void**>(&attribute)}};
  ASSERT_TRUE(LoadSymbols(wanted, "tests").ok());
  ASSERT_NE(version, nullptr);
  ASSERT_NE(attribute, nullptr);
  // The pointers are the driver's own: they answer as the runtime does.
  int from_driver = 0, from_runtime = 0;
  ASSERT_EQ(version(&from_driver), CUDA_SUCCESS);
  ASSERT_EQ(cudaDriverGetVersion(&from_runtime), cudaSuccess);
  EXPECT_EQ(from_driver, from_runtime);
  EXPECT_GE(from_driver, 12000);
}

TEST(CudaDriver, AMissingFunctionIsAFailedPreconditionNamingItAndItsUsers) {
  void* found = nullptr;
  void* missing = nullptr;
  const std::pair<const char*, void**> wanted[] = {{"cuDriverGetVersion", &found},
                                                   {"cuQtxNoSuchFunction", &missing}};
  const absl::Status s = LoadSymbols(wanted, "the widgets");
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_THAT(s.message(), AllOf(HasSubstr("cuQtxNoSuchFunction"), HasSubstr("the widgets"),
                                 HasSubstr("CUDA 12+")));
  EXPECT_NE(found, nullptr);  // the ones before it were set
  EXPECT_EQ(missing, nullptr);
  // No CUDA error is left behind for the next call to find.
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

TEST(CudaDriver, StreamMemOpsAreFoundOnceAndWork) {
  const absl::StatusOr<StreamMemOps> a = GetStreamMemOps();
  ASSERT_TRUE(a.ok()) << a.status();
  const absl::StatusOr<StreamMemOps> b = GetStreamMemOps();
  ASSERT_TRUE(b.ok()) << b.status();
  ASSERT_NE(a->wait, nullptr);
  ASSERT_NE(a->write, nullptr);
  ASSERT_NE(a->get_attribute, nullptr);
  EXPECT_EQ(a->wait, b->wait);
  EXPECT_EQ(a->write, b->write);

  // A write then a wait on one stream, against device memory: the word ends
  // up holding the written value.
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  int supported = 0;
  ASSERT_EQ(a->get_attribute(&supported, CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS, 0),
            CUDA_SUCCESS);
  ASSERT_NE(supported, 0) << "cuda:0 has no 64-bit stream memory operations (channels need them)";
  void* word = nullptr;
  ASSERT_EQ(cudaMalloc(&word, 8), cudaSuccess);
  ASSERT_EQ(cudaMemset(word, 0, 8), cudaSuccess);
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  const auto dptr = reinterpret_cast<CUdeviceptr>(word);
  EXPECT_EQ(a->write(stream, dptr, 0x1234'5678'9abcULL, CU_STREAM_WRITE_VALUE_DEFAULT),
            CUDA_SUCCESS);
  EXPECT_EQ(a->wait(stream, dptr, 0x1234'5678'9abcULL, CU_STREAM_WAIT_VALUE_GEQ), CUDA_SUCCESS);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  unsigned long long value = 0;
  ASSERT_EQ(cudaMemcpy(&value, word, 8, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(value, 0x1234'5678'9abcULL);
  ASSERT_EQ(cudaStreamDestroy(stream), cudaSuccess);
  ASSERT_EQ(cudaFree(word), cudaSuccess);
}

TEST(CudaDriver, MemoryOpsAreFoundOnceAndWork) {
  const absl::StatusOr<MemoryOps> a = GetMemoryOps();
  ASSERT_TRUE(a.ok()) << a.status();
  const absl::StatusOr<MemoryOps> b = GetMemoryOps();
  ASSERT_TRUE(b.ok()) << b.status();
  for (const void* f :
       {reinterpret_cast<const void*>(a->address_range),
        reinterpret_cast<const void*>(a->pointer_attribute),
        reinterpret_cast<const void*>(a->pointer_attributes),
        reinterpret_cast<const void*>(a->retain), reinterpret_cast<const void*>(a->release),
        reinterpret_cast<const void*>(a->properties),
        reinterpret_cast<const void*>(a->export_handle),
        reinterpret_cast<const void*>(a->import_handle),
        reinterpret_cast<const void*>(a->granularity), reinterpret_cast<const void*>(a->reserve),
        reinterpret_cast<const void*>(a->free_range), reinterpret_cast<const void*>(a->map),
        reinterpret_cast<const void*>(a->unmap), reinterpret_cast<const void*>(a->set_access),
        reinterpret_cast<const void*>(a->error_name)}) {
    EXPECT_NE(f, nullptr);
  }
  EXPECT_EQ(a->map, b->map);

  // The allocation behind a pointer into the middle of a cudaMalloc block.
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  void* block = nullptr;
  ASSERT_EQ(cudaMalloc(&block, 1 << 20), cudaSuccess);
  const auto start = reinterpret_cast<CUdeviceptr>(block);
  CUdeviceptr base = 0;
  size_t size = 0;
  EXPECT_EQ(a->address_range(&base, &size, start + 4096), CUDA_SUCCESS);
  EXPECT_EQ(base, start);
  EXPECT_GE(size, size_t{1} << 20);
  const char* name = nullptr;
  EXPECT_EQ(a->error_name(CUDA_ERROR_INVALID_VALUE, &name), CUDA_SUCCESS);
  EXPECT_STREQ(name, "CUDA_ERROR_INVALID_VALUE");
  ASSERT_EQ(cudaFree(block), cudaSuccess);
}

TEST(CudaDriver, DriverStatusNamesTheCallAndTheResult) {
  EXPECT_TRUE(DriverStatus(CUDA_SUCCESS, "cuX").ok());
  const absl::Status s = DriverStatus(CUDA_ERROR_INVALID_VALUE, "cuStreamWaitValue64(ready)");
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal);
  EXPECT_EQ(s.message(), "cuStreamWaitValue64(ready) failed: CUresult 1");
}

}  // namespace
}  // namespace qtx::cuda_driver
