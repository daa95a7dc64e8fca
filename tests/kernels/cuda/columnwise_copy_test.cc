// kernels/cuda ColumnwiseFromRowwise vs the CPU reference
// kernels/cpu/columnwise_copy, bit for bit (data and scale_inv, padding
// included), with sentinel-filled outputs on both sides; and vs the columnwise
// copy written by the CUDA quantizer itself (QuantizeBlock BLOCK_2D). Shapes
// that take the 16-byte vector path (m, n multiples of 16) and the checked
// path (any other shape, or a data pointer off 16-byte alignment), tiles cut
// at both edges, one row, one column, empty; BLOCK_2D and TENSOR.
#include "kernels/cuda/columnwise_copy.h"

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/block_geometry.h"
#include "kernels/cpu/columnwise_copy.h"
#include "kernels/cpu/quantize_block.h"
#include "kernels/cuda/quantize_block.h"

namespace qtx::kernels::cuda {
namespace {

#define CUDA_OK(expr)                                                      \
  do {                                                                     \
    const cudaError_t e_ = (expr);                                         \
    ASSERT_EQ(e_, cudaSuccess) << #expr << ": " << cudaGetErrorString(e_); \
  } while (0)

struct CudaFree {
  void operator()(void* p) const { cudaFree(p); }
};
using DevicePtr = std::unique_ptr<uint8_t, CudaFree>;

DevicePtr Alloc(size_t bytes) {
  void* p = nullptr;
  if (cudaMalloc(&p, bytes + 64) != cudaSuccess) return nullptr;
  return DevicePtr(static_cast<uint8_t*>(p));
}

struct Case {
  BlockScaling scaling;
  int64_t m, n;
  int misalign;  // bytes added to the data pointers (forces the checked path when odd)
};

std::string Label(const Case& c) {
  return std::string(c.scaling == BlockScaling::kTensor ? "TENSOR " : "2D ") + std::to_string(c.m) +
         "x" + std::to_string(c.n) + " +" + std::to_string(c.misalign);
}

// Random rowwise bytes and positive scales (any bytes are a valid input: the
// copy moves them without decoding).
void RunCase(const Case& c) {
  const QuantizedLayout l = ComputeLayout(c.scaling, c.m, c.n);
  std::mt19937 rng(static_cast<uint32_t>(c.m * 131 + c.n));
  std::vector<uint8_t> qr(l.RowwiseDataBytes());
  for (auto& b : qr) b = static_cast<uint8_t>(rng());
  std::vector<float> sr(l.RowwiseScaleCount());
  for (auto& s : sr) s = std::ldexp(1.0f, static_cast<int>(rng() % 40) - 20);

  // CPU reference into sentinel-filled buffers.
  std::vector<uint8_t> want_q(l.ColumnwiseDataBytes(), 0xAA);
  std::vector<float> want_s(l.ColumnwiseScaleCount(), -3.0f);
  ASSERT_TRUE(cpu::ColumnwiseFromRowwise(c.scaling, {qr.data(), sr.data()}, c.m, c.n,
                                         {nullptr, nullptr, want_q.data(), want_s.data()}))
      << Label(c);

  DevicePtr d_qr = Alloc(qr.size()), d_qc = Alloc(want_q.size());
  DevicePtr d_sr = Alloc(sr.size() * 4), d_sc = Alloc(want_s.size() * 4);
  ASSERT_TRUE(d_qr && d_qc && d_sr && d_sc);
  uint8_t* qr_ptr = d_qr.get() + c.misalign;
  uint8_t* qc_ptr = d_qc.get() + c.misalign;
  CUDA_OK(cudaMemcpy(qr_ptr, qr.data(), qr.size(), cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(d_sr.get(), sr.data(), sr.size() * 4, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemset(qc_ptr, 0x55, want_q.size()));
  CUDA_OK(cudaMemset(d_sc.get(), 0x7F, want_s.size() * 4));
  QuantizedConstBuffers in{qr_ptr, reinterpret_cast<const float*>(d_sr.get())};
  QuantizedBuffers out{nullptr, nullptr, qc_ptr, reinterpret_cast<float*>(d_sc.get())};
  CUDA_OK(ColumnwiseFromRowwise(c.scaling, in, c.m, c.n, out, nullptr));
  CUDA_OK(cudaDeviceSynchronize());
  std::vector<uint8_t> got_q(want_q.size());
  std::vector<float> got_s(want_s.size());
  CUDA_OK(cudaMemcpy(got_q.data(), qc_ptr, got_q.size(), cudaMemcpyDeviceToHost));
  CUDA_OK(cudaMemcpy(got_s.data(), d_sc.get(), got_s.size() * 4, cudaMemcpyDeviceToHost));
  for (size_t i = 0; i < want_q.size(); ++i) {
    ASSERT_EQ(got_q[i], want_q[i]) << Label(c) << " columnwise byte " << i;
  }
  ASSERT_EQ(std::memcmp(got_s.data(), want_s.data(), want_s.size() * 4), 0)
      << Label(c) << " columnwise scale_inv";
}

TEST(ColumnwiseFromRowwiseCuda, EqualsCpuReferenceBitForBit) {
  const int64_t shapes[][2] = {{128, 128}, {256, 384}, {16, 16},     {16, 4096},
                               {4096, 16}, {144, 272}, {1024, 8192}, {8192, 1040},
                               {130, 130}, {200, 300}, {1, 1},       {1, 129},
                               {129, 1},   {3, 5},     {0, 7},       {7, 0}};
  for (BlockScaling s : {BlockScaling::kBlock2D, BlockScaling::kTensor}) {
    for (const auto& sh : shapes) {
      for (int misalign : {0, 1}) {
        RunCase({s, sh[0], sh[1], misalign});
        if (HasFatalFailure()) return;
      }
    }
  }
}

// The copy made on the GPU from the CUDA quantizer's rowwise output equals the
// columnwise output the same quantizer wrote.
TEST(ColumnwiseFromRowwiseCuda, EqualsTheCudaQuantizersColumnwiseCopy) {
  for (const auto& sh : {std::pair<int64_t, int64_t>{4096, 4096}, {1000, 3000}, {384, 130}}) {
    const int64_t m = sh.first, n = sh.second;
    const QuantizedLayout l = ComputeLayout(BlockScaling::kBlock2D, m, n);
    std::mt19937 rng(5);
    std::normal_distribution<float> normal(0.0f, 3.0f);
    std::vector<float> x(m * n);
    for (auto& v : x) v = normal(rng);
    DevicePtr d_x = Alloc(x.size() * 4), d_qr = Alloc(l.RowwiseDataBytes()),
              d_qc = Alloc(l.ColumnwiseDataBytes()), d_qc2 = Alloc(l.ColumnwiseDataBytes()),
              d_sr = Alloc(l.RowwiseScaleCount() * 4), d_sc = Alloc(l.ColumnwiseScaleCount() * 4),
              d_sc2 = Alloc(l.ColumnwiseScaleCount() * 4);
    CUDA_OK(cudaMemcpy(d_x.get(), x.data(), x.size() * 4, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemset(d_qc2.get(), 0x55, l.ColumnwiseDataBytes()));
    CUDA_OK(cudaMemset(d_sc2.get(), 0x7F, l.ColumnwiseScaleCount() * 4));
    QuantizeParams p;
    p.scaling = BlockScaling::kBlock2D;
    p.rowwise = p.columnwise = true;
    QuantizedBuffers q{d_qr.get(), reinterpret_cast<float*>(d_sr.get()), d_qc.get(),
                       reinterpret_cast<float*>(d_sc.get())};
    CUDA_OK(QuantizeBlock(d_x.get(), InputDType::kFloat32, m, n, p, q, nullptr));
    CUDA_OK(ColumnwiseFromRowwise(
        BlockScaling::kBlock2D, {q.rowwise_data, q.rowwise_scale_inv}, m, n,
        {nullptr, nullptr, d_qc2.get(), reinterpret_cast<float*>(d_sc2.get())}, nullptr));
    CUDA_OK(cudaDeviceSynchronize());
    std::vector<uint8_t> a(l.ColumnwiseDataBytes()), b(a.size());
    std::vector<uint32_t> sa(l.ColumnwiseScaleCount()), sb(sa.size());
    CUDA_OK(cudaMemcpy(a.data(), d_qc.get(), a.size(), cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(b.data(), d_qc2.get(), b.size(), cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(sa.data(), d_sc.get(), sa.size() * 4, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(sb.data(), d_sc2.get(), sb.size() * 4, cudaMemcpyDeviceToHost));
    EXPECT_EQ(a, b) << m << "x" << n << " data";
    EXPECT_EQ(sa, sb) << m << "x" << n << " scale_inv";
  }
}

TEST(ColumnwiseFromRowwiseCuda, RefusesBlock1DAndBadArguments) {
  uint8_t* p = reinterpret_cast<uint8_t*>(16);
  float* s = reinterpret_cast<float*>(16);
  EXPECT_EQ(ColumnwiseFromRowwise(BlockScaling::kBlock1D, {p, s}, 4, 4, {nullptr, nullptr, p, s},
                                  nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(ColumnwiseFromRowwise(BlockScaling::kBlock2D, {p, s}, -1, 4, {nullptr, nullptr, p, s},
                                  nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(ColumnwiseFromRowwise(BlockScaling::kBlock2D, {nullptr, s}, 4, 4,
                                  {nullptr, nullptr, p, s}, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(ColumnwiseFromRowwise(BlockScaling::kTensor, {p, nullptr}, 4, 4,
                                  {nullptr, nullptr, p, s}, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(ColumnwiseFromRowwise(BlockScaling::kBlock2D, {p, s}, INT64_MAX / 2, 4,
                                  {nullptr, nullptr, p, s}, nullptr),
            cudaErrorInvalidValue);
}

}  // namespace
}  // namespace qtx::kernels::cuda
