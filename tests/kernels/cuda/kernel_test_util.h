// Helpers shared by the CUDA kernel tests (kernels_cuda_test): the CUDA
// status assertion, output sentinels, input encoding, a fast generator for
// large inputs, and the byte-exact comparison that names the first mismatches.
#ifndef QTX_TESTS_KERNELS_CUDA_KERNEL_TEST_UTIL_H_
#define QTX_TESTS_KERNELS_CUDA_KERNEL_TEST_UTIL_H_

#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/fp8.h"

// ASSERT_EQ(expr, cudaSuccess) with the error's name.
#define QTX_CUDA_ASSERT(expr)                                                          \
  do {                                                                                 \
    const cudaError_t qtx_err_ = (expr);                                               \
    ASSERT_EQ(qtx_err_, cudaSuccess) << #expr << ": " << cudaGetErrorString(qtx_err_); \
  } while (0)

namespace qtx::kernels::cuda::test_util {

// What unwritten outputs hold on both sides of a comparison.
inline constexpr uint8_t kDataSentinel = 0xAA;
inline constexpr uint32_t kScaleSentinel = 0xFFFFFFFFu;  // a NaN: never a valid scale_inv

inline int ElemBytes(InputDType t) { return t == InputDType::kFloat32 ? 4 : 2; }

inline const char* Name(InputDType t) {
  switch (t) {
    case InputDType::kBFloat16:
      return "bf16";
    case InputDType::kFloat16:
      return "fp16";
    default:
      return "fp32";
  }
}

// Element i of buf, as `t`'s bit pattern of x (round to nearest even).
inline void Store(std::vector<uint8_t>& buf, InputDType t, int64_t i, float x) {
  StoreFromFloat(buf.data(), t, i, x);
}

// splitmix64: fast enough to fill 10^8-element inputs.
struct FastRng {
  uint64_t s;
  uint64_t Next() {
    uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  float Uniform() { return static_cast<float>((Next() >> 40) + 1) * 0x1p-24f; }  // (0, 1]
};

// "" when want and got are equal bit for bit, else a description of the
// first mismatches.
template <typename T>
std::string Diff(const char* what, const std::vector<T>& want, const std::vector<T>& got) {
  if (want.size() != got.size()) return std::string(what) + ": size differs";
  std::ostringstream os;
  int64_t bad = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    uint32_t w = 0, g = 0;
    std::memcpy(&w, &want[i], sizeof(T));
    std::memcpy(&g, &got[i], sizeof(T));
    if (w != g) {
      if (bad < 4) os << " [" << i << "] want 0x" << std::hex << w << " got 0x" << g << std::dec;
      ++bad;
    }
  }
  if (bad == 0) return "";
  std::ostringstream head;
  head << what << ": " << bad << " of " << want.size() << " differ:" << os.str();
  return head.str();
}

}  // namespace qtx::kernels::cuda::test_util

#endif  // QTX_TESTS_KERNELS_CUDA_KERNEL_TEST_UTIL_H_
