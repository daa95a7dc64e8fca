// The hardware FP32 -> FP8 cast used by kernels/cuda (cvt.rn.satfinite) equals
// kernels/fp8.h EncodeFp8 bit for bit: exhaustively over all 2^32 FP32
// patterns on the device, and against the host-compiled EncodeFp8 over every
// BF16 pattern and a large sample of FP32 patterns.
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/fp8.h"
#include "tests/kernels/cuda/fp8_cast_check.h"
#include "tests/kernels/cuda/kernel_test_util.h"

namespace qtx::kernels::cuda {
namespace {

const char* Name(Fp8Format f) { return f == Fp8Format::kE4M3 ? "E4M3" : "E5M2"; }

// Zeroes a mismatch count and first-pattern word on the device, runs `launch`
// (a Count*Mismatches call over them, on the default stream) and returns "" when
// nothing mismatched, else the count and the first mismatching FP32 pattern.
std::string DeviceMismatches(
    const std::function<cudaError_t(unsigned long long*, unsigned int*)>& launch) {
  unsigned long long* d_count = nullptr;  // then the first-pattern word
  if (cudaMalloc(&d_count, 2 * sizeof(*d_count)) != cudaSuccess) return "cudaMalloc failed";
  auto* d_first = reinterpret_cast<unsigned int*>(d_count + 1);
  unsigned long long count = 0;
  unsigned int first = 0;
  const bool ok =
      cudaMemset(d_count, 0, sizeof(*d_count)) == cudaSuccess &&
      cudaMemset(d_first, 0xFF, sizeof(*d_first)) == cudaSuccess &&
      launch(d_count, d_first) == cudaSuccess && cudaDeviceSynchronize() == cudaSuccess &&
      cudaMemcpy(&count, d_count, sizeof(count), cudaMemcpyDeviceToHost) == cudaSuccess &&
      cudaMemcpy(&first, d_first, sizeof(first), cudaMemcpyDeviceToHost) == cudaSuccess;
  cudaFree(d_count);
  if (!ok) return std::string("CUDA error: ") + cudaGetErrorString(cudaGetLastError());
  if (count == 0) return "";
  char text[96];
  std::snprintf(text, sizeof(text), "%llu mismatches, the first FP32 pattern 0x%08x", count, first);
  return text;
}

TEST(Fp8HardwareCast, DeviceEncodeMatchesHardwareOnAllFp32Patterns) {
  for (Fp8Format f : {Fp8Format::kE4M3, Fp8Format::kE5M2}) {
    EXPECT_EQ(DeviceMismatches([f](unsigned long long* count, unsigned int* first) {
                return testing::CountCastMismatches(0, uint64_t{1} << 32, f, count, first, nullptr);
              }),
              "")
        << Name(f);
  }
}

// The kernels' pow2 scales without a division (kernels/fp8.h ComputeScalePow2,
// ScaleInvPow2) equal ComputeScale's and ScaleInv's on the device for every FP32
// pattern as the amax (and as the scale), for both FP8 maxima, with and without
// an epsilon, and with the overflow values of FP32 and BF16 inputs.
TEST(Fp8HardwareCast, Pow2ScalesWithoutDivisionMatchOnAllFp32Patterns) {
  struct Case {
    float fp8_max, eps, value_for_inf;
  };
  for (const Case c : {Case{448.0f, 0.0f, InputDTypeMax(InputDType::kFloat32)},
                       Case{57344.0f, 0.0f, InputDTypeMax(InputDType::kBFloat16)},
                       Case{448.0f, 1e-4f, InputDTypeMax(InputDType::kFloat16)}}) {
    EXPECT_EQ(DeviceMismatches([c](unsigned long long* count, unsigned int* first) {
                return testing::CountPow2ScaleMismatches(0, uint64_t{1} << 32, c.fp8_max, c.eps,
                                                         c.value_for_inf, count, first, nullptr);
              }),
              "")
        << "fp8_max " << c.fp8_max << " eps " << c.eps;
  }
}

// Hardware cast on the device of `bits`, compared with the host EncodeFp8.
void CompareWithHost(const std::vector<uint32_t>& bits, Fp8Format f) {
  const int64_t n = static_cast<int64_t>(bits.size());
  float* d_in = nullptr;
  uint8_t* d_out = nullptr;
  QTX_CUDA_ASSERT(cudaMalloc(&d_in, n * sizeof(float)));
  QTX_CUDA_ASSERT(cudaMalloc(&d_out, n));
  QTX_CUDA_ASSERT(cudaMemcpy(d_in, bits.data(), n * sizeof(float), cudaMemcpyHostToDevice));
  QTX_CUDA_ASSERT(testing::HardwareCastFp8(d_in, n, f, d_out, nullptr));
  std::vector<uint8_t> hw(n);
  QTX_CUDA_ASSERT(cudaMemcpy(hw.data(), d_out, n, cudaMemcpyDeviceToHost));
  cudaFree(d_in);
  cudaFree(d_out);
  int64_t bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    const uint8_t sw = EncodeFp8(BitsToFloat(bits[i]), f);
    if (sw != hw[i] && ++bad <= 5) {
      ADD_FAILURE() << Name(f) << " bits 0x" << std::hex << bits[i] << ": hardware 0x" << int{hw[i]}
                    << ", EncodeFp8 0x" << int{sw};
    }
  }
  EXPECT_EQ(bad, 0) << Name(f);
}

TEST(Fp8HardwareCast, HostEncodeMatchesHardwareOnAllBf16Patterns) {
  std::vector<uint32_t> bits(1 << 16);
  for (uint32_t h = 0; h < (1u << 16); ++h) bits[h] = h << 16;
  CompareWithHost(bits, Fp8Format::kE4M3);
  CompareWithHost(bits, Fp8Format::kE5M2);
}

TEST(Fp8HardwareCast, HostEncodeMatchesHardwareOnSampledFp32Patterns) {
  std::mt19937_64 rng(20261130);
  std::vector<uint32_t> bits;
  bits.reserve(1 << 25);
  // Uniform over all patterns.
  for (int i = 0; i < (1 << 24); ++i) bits.push_back(static_cast<uint32_t>(rng()));
  // Dense in the exponents where FP8 rounding, subnormals and saturation
  // happen (2^-30 .. 2^20), random mantissas and signs, plus every
  // round-half boundary pattern (low mantissa bits 0 except the half bit).
  for (uint32_t e = 127 - 30; e <= 127 + 20; ++e) {
    for (int i = 0; i < (1 << 17); ++i) {
      const uint32_t r = static_cast<uint32_t>(rng());
      bits.push_back((r & 0x80000000u) | (e << 23) | (r & 0x7FFFFFu));
    }
    for (uint32_t man = 0; man < (1u << 10); ++man) {
      for (uint32_t low : {0u, 1u, 0x3FFFu}) {
        bits.push_back((e << 23) | (man << 13) | (low << 0) | 0x1000u);
        bits.push_back(0x80000000u | (e << 23) | (man << 13) | 0x0800u | (low & 1u));
        bits.push_back((e << 23) | (man << 13) | 0x40000u | (low & 1u));
        bits.push_back((e << 23) | (man << 14) | 0x200000u | (low & 1u));
      }
    }
  }
  // NaN payloads of both signs, infinities, zeros, FP32 subnormals.
  for (uint32_t p : {0x7F800001u, 0x7FC00000u, 0x7FFFFFFFu, 0xFF800001u, 0xFFC00000u, 0xFFFFFFFFu,
                     0x7F800000u, 0xFF800000u, 0u, 0x80000000u, 1u, 0x807FFFFFu}) {
    bits.push_back(p);
  }
  CompareWithHost(bits, Fp8Format::kE4M3);
  CompareWithHost(bits, Fp8Format::kE5M2);
}

TEST(Fp8HardwareCast, EveryNanEncodesTo0x7F) {
  std::vector<uint32_t> bits;
  for (uint32_t p = 1; p < (1u << 23); p += 9973) {
    bits.push_back(0x7F800000u | p);
    bits.push_back(0xFF800000u | p);
  }
  const int64_t n = static_cast<int64_t>(bits.size());
  float* d_in = nullptr;
  uint8_t* d_out = nullptr;
  QTX_CUDA_ASSERT(cudaMalloc(&d_in, n * sizeof(float)));
  QTX_CUDA_ASSERT(cudaMalloc(&d_out, n));
  QTX_CUDA_ASSERT(cudaMemcpy(d_in, bits.data(), n * sizeof(float), cudaMemcpyHostToDevice));
  for (Fp8Format f : {Fp8Format::kE4M3, Fp8Format::kE5M2}) {
    QTX_CUDA_ASSERT(testing::HardwareCastFp8(d_in, n, f, d_out, nullptr));
    std::vector<uint8_t> hw(n);
    QTX_CUDA_ASSERT(cudaMemcpy(hw.data(), d_out, n, cudaMemcpyDeviceToHost));
    for (int64_t i = 0; i < n; ++i) {
      ASSERT_EQ(hw[i], 0x7F) << Name(f) << " bits 0x" << std::hex << bits[i];
    }
  }
  cudaFree(d_in);
  cudaFree(d_out);
}

}  // namespace
}  // namespace qtx::kernels::cuda
