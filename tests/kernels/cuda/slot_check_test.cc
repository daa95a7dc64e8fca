// kernels::cuda::CheckSlotHeaders (the one-round AllGather's slot check on
// the GPU): every header copied out byte for byte, and the verdict 0 exactly
// when every slot's agreed prefix equals the expected one, its rank word is
// its index and its status word is 0 — for a corruption of each kind in
// each slot, with the expected header and the outputs in mapped host memory
// (as qtxd uses it) and in device memory.
#include "kernels/cuda/slot_check.h"

#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace qtx::kernels::cuda {
namespace {

#define CUDA_OK(x) ASSERT_EQ((x), cudaSuccess) << #x

constexpr uint32_t kHeader = 304, kAgreed = 88, kRankAt = 88, kStatusAt = 104;
constexpr uint64_t kStride = 1024;

struct Slots {
  std::vector<uint8_t> host;  // count * kStride
  std::vector<uint8_t> expected;
};

Slots MakeSlots(int count, uint32_t seed) {
  Slots s;
  s.expected.resize(kHeader);
  std::mt19937 rng(seed);
  for (auto& b : s.expected) b = static_cast<uint8_t>(rng());
  const int32_t zero = 0;
  std::memcpy(s.expected.data() + kStatusAt, &zero, 4);
  s.host.resize(kStride * count);
  for (int r = 0; r < count; ++r) {
    uint8_t* h = s.host.data() + kStride * r;
    std::memcpy(h, s.expected.data(), kHeader);
    // Bytes after the agreed prefix other than rank/status differ per rank
    // (local rows, message): they must not matter.
    for (uint32_t i = kAgreed + 8; i < kStatusAt; ++i) h[i] = static_cast<uint8_t>(rng());
    std::memcpy(h + kRankAt, &r, 4);
    for (uint64_t i = kHeader; i < kStride; ++i) h[i] = static_cast<uint8_t>(rng());
  }
  return s;
}

// Runs the kernel; returns the verdict and checks the copies.
uint32_t RunCheck(const Slots& s, int count, bool mapped) {
  void* slots = nullptr;
  EXPECT_EQ(cudaMalloc(&slots, s.host.size()), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(slots, s.host.data(), s.host.size(), cudaMemcpyHostToDevice), cudaSuccess);
  const uint64_t out_bytes = kHeader * static_cast<uint64_t>(count) + kHeader + 4;
  uint8_t* mem = nullptr;
  if (mapped) {
    EXPECT_EQ(cudaHostAlloc(reinterpret_cast<void**>(&mem), out_bytes, cudaHostAllocMapped),
              cudaSuccess);
    std::memcpy(mem, s.expected.data(), kHeader);
    std::memset(mem + kHeader, 0xAB, out_bytes - kHeader);
  } else {
    EXPECT_EQ(cudaMalloc(reinterpret_cast<void**>(&mem), out_bytes), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(mem, s.expected.data(), kHeader, cudaMemcpyHostToDevice), cudaSuccess);
    EXPECT_EQ(cudaMemset(mem + kHeader, 0xAB, out_bytes - kHeader), cudaSuccess);
  }
  auto* bad = reinterpret_cast<uint32_t*>(mem + kHeader);
  uint8_t* copies = mem + kHeader + 4;
  EXPECT_EQ(CheckSlotHeaders(slots, kStride, count, mem, kHeader, kAgreed, kRankAt, kStatusAt,
                             copies, bad, nullptr),
            cudaSuccess);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  std::vector<uint8_t> out(out_bytes);
  if (mapped) {
    std::memcpy(out.data(), mem, out_bytes);
  } else {
    EXPECT_EQ(cudaMemcpy(out.data(), mem, out_bytes, cudaMemcpyDeviceToHost), cudaSuccess);
  }
  for (int r = 0; r < count; ++r) {
    EXPECT_EQ(
        std::memcmp(out.data() + kHeader + 4 + kHeader * r, s.host.data() + kStride * r, kHeader),
        0)
        << "the copy of slot " << r << " differs";
  }
  uint32_t verdict = 0;
  std::memcpy(&verdict, out.data() + kHeader, 4);
  if (mapped) {
    (void)cudaFreeHost(mem);
  } else {
    (void)cudaFree(mem);
  }
  (void)cudaFree(slots);
  return verdict;
}

TEST(SlotCheckCuda, PassesMatchingSlotsAndCopiesEveryHeader) {
  for (int count : {1, 2, 5, 40}) {
    for (bool mapped : {true, false}) {
      const Slots s = MakeSlots(count, 7 + count);
      EXPECT_EQ(RunCheck(s, count, mapped), 0u) << "count " << count << " mapped " << mapped;
    }
  }
}

TEST(SlotCheckCuda, FailsOnAnyCorruptedAgreedByteRankOrStatus) {
  constexpr int kCount = 5;
  const uint32_t probes[] = {0, 3, 16, 40, 87, kRankAt, kRankAt + 3, kStatusAt, kStatusAt + 2};
  int checked = 0;
  for (int victim = 0; victim < kCount; ++victim) {
    for (uint32_t at : probes) {
      Slots s = MakeSlots(kCount, 100 + victim);
      s.host[kStride * victim + at] ^= 0x10;
      EXPECT_NE(RunCheck(s, kCount, /*mapped=*/true), 0u)
          << "slot " << victim << " byte " << at << " corrupted but passed";
      ++checked;
    }
    // Bytes outside the checked words (local rows, the message) do not count.
    Slots s = MakeSlots(kCount, 200 + victim);
    s.host[kStride * victim + kAgreed + 9] ^= 0x10;
    s.host[kStride * victim + kStatusAt + 10] ^= 0x10;
    EXPECT_EQ(RunCheck(s, kCount, /*mapped=*/true), 0u) << "slot " << victim;
  }
  EXPECT_EQ(checked, kCount * 9);
}

TEST(SlotCheckCuda, RejectsMisalignedArguments) {
  EXPECT_EQ(CheckSlotHeaders(nullptr, kStride, 1, nullptr, 302, kAgreed, kRankAt, kStatusAt,
                             nullptr, nullptr, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(CheckSlotHeaders(nullptr, kStride, 1, nullptr, kHeader, kHeader + 4, kRankAt, kStatusAt,
                             nullptr, nullptr, nullptr),
            cudaErrorInvalidValue);
}

}  // namespace
}  // namespace qtx::kernels::cuda
