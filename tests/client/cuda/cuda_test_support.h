// What the GPU tests of the client share: a gtest assertion for CUDA runtime
// calls and a registered device arena carved into slices.
#ifndef QTX_TESTS_CLIENT_CUDA_CUDA_TEST_SUPPORT_H_
#define QTX_TESTS_CLIENT_CUDA_CUDA_TEST_SUPPORT_H_

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

#include "gtest/gtest.h"
#include "qtx/types.h"

// ASSERTs that a CUDA runtime call succeeded, naming the call and the error.
#define CUDA_OK(expr)                                                      \
  do {                                                                     \
    const cudaError_t e_ = (expr);                                         \
    ASSERT_EQ(e_, cudaSuccess) << #expr << ": " << cudaGetErrorString(e_); \
  } while (0)

namespace qtx::testing {

// One device allocation registered as a CUDA IPC region (by the test), carved
// by a bump allocator into 256-byte aligned slices.
struct DeviceArena {
  void* base = nullptr;
  uint64_t size = 0;
  uint64_t used = 0;
  std::string name;
  RegionSlice Take(uint64_t bytes) {
    RegionSlice s{name, used, bytes};
    used += (bytes + 255) / 256 * 256;
    EXPECT_LE(used, size);
    return s;
  }
  void* At(const RegionSlice& s) const { return static_cast<char*>(base) + s.offset; }
};

}  // namespace qtx::testing

#endif  // QTX_TESTS_CLIENT_CUDA_CUDA_TEST_SUPPORT_H_
