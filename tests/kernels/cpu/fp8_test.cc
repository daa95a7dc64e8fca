// Tests of the shared FP8/BF16/FP16 arithmetic in kernels/fp8.h (docs/numerics.md §1-§2).
#include "kernels/fp8.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace qtx::kernels {
namespace {

// An independent, branchy FP32 -> FP8 encoder written straight from the
// definition (RNE on the FP8 grid, satfinite, NaN -> 0x7F), used as an oracle
// for the branch-free EncodeFp8 over every FP32 bit pattern.
template <int E, int M>
uint8_t OracleEncode(float x) {
  const int bias = (1 << (E - 1)) - 1;
  const double max = E == 4 ? 448.0 : 57344.0;
  const uint8_t max_code = E == 4 ? 0x7E : 0x7B;
  if (std::isnan(x)) return 0x7F;
  const uint8_t sign = std::signbit(x) ? 0x80 : 0x00;
  const double a = std::fabs(static_cast<double>(x));
  if (a >= max) return sign | max_code;
  // Grid spacing at |x|: 2^(max(floor(log2 a), 1 - bias) - M).
  int e = a == 0 ? 1 - bias : std::ilogb(a);
  if (e < 1 - bias) e = 1 - bias;
  const double step = std::ldexp(1.0, e - M);
  const double q = a / step;  // exact: a power-of-two division
  double r = std::floor(q);
  const double frac = q - r;
  if (frac > 0.5 || (frac == 0.5 && std::fmod(r, 2.0) == 1.0)) r += 1;
  const double v = r * step;
  if (v > max) return sign | max_code;
  // Encode v exactly.
  if (v == 0) return sign;
  int ve = std::ilogb(v);
  if (ve < 1 - bias) return sign | static_cast<uint8_t>(v / std::ldexp(1.0, 1 - bias - M));
  const int mant = static_cast<int>((v / std::ldexp(1.0, ve) - 1.0) * (1 << M));
  return sign | static_cast<uint8_t>(((ve + bias) << M) | mant);
}

TEST(Fp8, BranchFreeEncoderMatchesOracleOnEveryFloat) {
  int64_t mismatches = 0;
#pragma omp parallel for reduction(+ : mismatches) schedule(static)
  for (int64_t hi = 0; hi < (1 << 16); ++hi) {
    for (uint32_t lo = 0; lo < (1u << 16); ++lo) {
      const float x = BitsToFloat(static_cast<uint32_t>(hi) << 16 | lo);
      mismatches += EncodeE4M3(x) != OracleEncode<4, 3>(x);
      mismatches += EncodeE5M2(x) != OracleEncode<5, 2>(x);
    }
  }
  EXPECT_EQ(mismatches, 0);
}

TEST(Fp8, KnownEncodings) {
  EXPECT_EQ(EncodeE4M3(1.0f), 0x38);
  EXPECT_EQ(EncodeE5M2(1.0f), 0x3C);
  EXPECT_EQ(EncodeE4M3(448.0f), 0x7E);
  EXPECT_EQ(EncodeE5M2(57344.0f), 0x7B);
  EXPECT_EQ(EncodeE4M3(-0.0f), 0x80);
  EXPECT_EQ(EncodeE5M2(-0.0f), 0x80);
  EXPECT_EQ(EncodeE4M3(0.0f), 0x00);
  EXPECT_EQ(EncodeE4M3(std::ldexp(1.0f, -9)), 0x01);  // smallest subnormal
  EXPECT_EQ(EncodeE4M3(std::ldexp(1.0f, -6)), 0x08);  // smallest normal
  EXPECT_EQ(EncodeE5M2(std::ldexp(1.0f, -16)), 0x01);
  EXPECT_EQ(EncodeE5M2(std::ldexp(1.0f, -14)), 0x04);
}

TEST(Fp8, SaturatesAndKeepsNan) {
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(EncodeE4M3(inf), 0x7E);
  EXPECT_EQ(EncodeE4M3(-inf), 0xFE);
  EXPECT_EQ(EncodeE5M2(inf), 0x7B);
  EXPECT_EQ(EncodeE5M2(-inf), 0xFB);
  EXPECT_EQ(EncodeE4M3(1e30f), 0x7E);
  EXPECT_EQ(EncodeE4M3(470.0f), 0x7E);  // beyond max, would round to 480: saturate
  EXPECT_EQ(EncodeE4M3(-3.4e38f), 0xFE);
  EXPECT_EQ(EncodeE5M2(61000.0f), 0x7B);
  const float qnan = std::numeric_limits<float>::quiet_NaN();
  EXPECT_EQ(EncodeE4M3(qnan), 0x7F);
  EXPECT_EQ(EncodeE4M3(-qnan), 0x7F);  // sign dropped, like the GPU
  EXPECT_EQ(EncodeE5M2(-qnan), 0x7F);
  EXPECT_EQ(EncodeE4M3(BitsToFloat(0xFF800001u)), 0x7F);  // signalling payload
}

// Every finite FP8 value round-trips; midpoints between neighbours tie to even.
void CheckGrid(Fp8Format f) {
  for (int b = 0; b < 256; ++b) {
    const uint8_t v = static_cast<uint8_t>(b);
    const float x = DecodeFp8(v, f);
    if (std::isnan(x) || std::isinf(x)) continue;
    EXPECT_EQ(EncodeFp8(x, f), v) << "byte " << b;
    // Next larger magnitude with the same sign.
    const uint8_t next = static_cast<uint8_t>(v + 1);
    if ((next & 0x7F) == 0 || (v & 0x7F) == ((f == Fp8Format::kE4M3) ? 0x7E : 0x7B)) continue;
    const float y = DecodeFp8(next, f);
    const double mid = (static_cast<double>(x) + y) / 2;
    const float midf = static_cast<float>(mid);
    ASSERT_EQ(static_cast<double>(midf), mid) << "midpoint not exact in FP32";
    const uint8_t even = (v & 1) ? next : v;
    EXPECT_EQ(EncodeFp8(midf, f), even) << "tie between bytes " << b << " and " << int(next);
    // Just above / below the midpoint round away from the tie.
    EXPECT_EQ(EncodeFp8(std::nextafter(midf, 2 * y), f), next);
    EXPECT_EQ(EncodeFp8(std::nextafter(midf, 0.0f), f), v);
  }
}

TEST(Fp8, E4M3GridRoundTripAndTies) { CheckGrid(Fp8Format::kE4M3); }
TEST(Fp8, E5M2GridRoundTripAndTies) { CheckGrid(Fp8Format::kE5M2); }

TEST(Fp8, DecodeSpecials) {
  EXPECT_TRUE(std::isnan(DecodeE4M3(0x7F)));
  EXPECT_TRUE(std::isnan(DecodeE4M3(0xFF)));
  EXPECT_EQ(DecodeE4M3(0x7E), 448.0f);
  EXPECT_EQ(DecodeE5M2(0x7C), std::numeric_limits<float>::infinity());
  EXPECT_EQ(DecodeE5M2(0xFC), -std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::isnan(DecodeE5M2(0x7D)));
  EXPECT_EQ(DecodeE4M3(0x01), std::ldexp(1.0f, -9));
  EXPECT_EQ(DecodeE5M2(0x01), std::ldexp(1.0f, -16));
}

TEST(Bf16, RoundTripAndRounding) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float f = Bf16ToFloat(static_cast<uint16_t>(h));
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(Bf16ToFloat(FloatToBf16(f))));
      continue;
    }
    EXPECT_EQ(FloatToBf16(f), h);
  }
  EXPECT_EQ(FloatToBf16(BitsToFloat(0x3F808000u)), 0x3F80);  // tie to even (down)
  EXPECT_EQ(FloatToBf16(BitsToFloat(0x3F818000u)), 0x3F82);  // tie to even (up)
  EXPECT_EQ(FloatToBf16(0.1f), 0x3DCD);
}

TEST(Half, RoundTripAndRounding) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float f = HalfToFloat(static_cast<uint16_t>(h));
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(HalfToFloat(FloatToHalf(f))));
      continue;
    }
    EXPECT_EQ(FloatToHalf(f), h) << h;
  }
  EXPECT_EQ(FloatToHalf(65504.0f), 0x7BFF);
  EXPECT_EQ(FloatToHalf(65519.0f), 0x7BFF);
  EXPECT_EQ(FloatToHalf(65520.0f), 0x7C00);
  EXPECT_EQ(FloatToHalf(std::ldexp(1.0f, -25)), 0x0000);  // tie to even -> 0
  EXPECT_EQ(FloatToHalf(std::ldexp(1.5f, -25)), 0x0001);
  EXPECT_EQ(FloatToHalf(1.0f + std::ldexp(1.0f, -11)), 0x3C00);  // tie to even
  EXPECT_EQ(FloatToHalf(0.1f), 0x2E66);
}

TEST(ComputeScale, SpecialAmaxValues) {
  const float inf = std::numeric_limits<float>::infinity();
  const float flt_max = std::numeric_limits<float>::max();
  EXPECT_EQ(ComputeScale(0.0f, 448, true, 0, flt_max), 1.0f);
  EXPECT_EQ(ComputeScale(inf, 448, true, 0, flt_max), 1.0f);
  EXPECT_EQ(ComputeScale(std::nanf(""), 448, true, 0, flt_max), 1.0f);
  EXPECT_EQ(ComputeScale(100.0f, 448, true, 0, flt_max), 4.0f);
  EXPECT_EQ(FloatBits(ComputeScale(100.0f, 448, false, 0, flt_max)), FloatBits(4.48f));
  EXPECT_EQ(ComputeScale(0.0f, 448, true, 1e-4f, flt_max), std::ldexp(1.0f, 22));
  EXPECT_EQ(ComputeScale(1e-40f, 448, true, 0, flt_max), std::ldexp(1.0f, 127));
  EXPECT_EQ(ComputeScale(1e-40f, 448, false, 0, flt_max), flt_max);
  EXPECT_EQ(ComputeScale(448.0f * 8, 448, true, 0, flt_max), 0.125f);  // docs/numerics.md §2
}

// ComputeScalePow2 / ScaleInvPow2 (the GPU kernels' pow2 scales without a division) give the
// bits of ComputeScale(force_pow2) / ScaleInv: over every sign and exponent, the mantissas at
// and around both FP8 maxima's (1.75: the rounding boundary of the proof in kernels/fp8.h), the
// ends of the range and random ones, with several epsilons and overflow values. The GPU test
// (tests/kernels/cuda/fp8_cast_test.cc) checks every FP32 pattern on the device.
TEST(ComputeScale, Pow2WithoutDivisionMatchesEverySignExponentAndBoundaryMantissa) {
  const float flt_max = std::numeric_limits<float>::max();
  std::vector<uint32_t> mantissas = {0, 1, 2, 3, 0x7FFFFD, 0x7FFFFE, 0x7FFFFF, 0x400000};
  for (const float fmax : {448.0f, 57344.0f}) {
    const int64_t mf = FloatBits(fmax) & 0x7FFFFF;
    for (int64_t d = -3; d <= 3; ++d) mantissas.push_back(static_cast<uint32_t>(mf + d));
  }
  std::mt19937 rng(7);
  for (int i = 0; i < 256; ++i) mantissas.push_back(rng() & 0x7FFFFF);
  int64_t checked = 0, bad = 0;
  for (const float fmax : {448.0f, 57344.0f, 3.0f, 1.0f}) {
    for (const float eps : {0.0f, 1e-4f, 1e-30f, 3.5f, std::ldexp(1.0f, -140)}) {
      for (const float vinf : {flt_max, 65504.0f, BitsToFloat(0x7F7F0000u), 448.0f}) {
        for (uint32_t se = 0; se < 512; ++se) {
          for (const uint32_t m : mantissas) {
            const float amax = BitsToFloat(se << 23 | m);
            const float want = ComputeScale(amax, fmax, true, eps, vinf);
            const float got = ComputeScalePow2(amax, fmax, eps, vinf);
            ++checked;
            if (FloatBits(got) != FloatBits(want) && ++bad <= 5) {
              ADD_FAILURE() << "amax bits 0x" << std::hex << FloatBits(amax) << " fp8_max " << fmax
                            << " eps " << eps << " value_for_inf " << vinf << ": 0x"
                            << FloatBits(got) << " instead of 0x" << FloatBits(want);
            }
          }
        }
      }
    }
  }
  EXPECT_EQ(bad, 0) << "of " << checked;
  EXPECT_GT(checked, 5'000'000);
  for (uint32_t se = 0; se < 512; ++se) {
    for (const uint32_t m : mantissas) {
      const float s = BitsToFloat(se << 23 | m);
      EXPECT_EQ(FloatBits(ScaleInvPow2(s)), FloatBits(ScaleInv(s))) << std::hex << FloatBits(s);
    }
  }
  // The branches themselves: the rounding boundary, the overflow and the fallbacks.
  EXPECT_EQ(ComputeScalePow2(1.75f, 448, 0, flt_max), 256.0f);  // ma == mf
  EXPECT_EQ(ComputeScalePow2(std::nextafter(1.75f, 2.0f), 448, 0, flt_max), 128.0f);
  EXPECT_EQ(ComputeScalePow2(1.2e-37f, 448, 0, flt_max), std::ldexp(1.0f, 127));  // overflow
  EXPECT_EQ(ComputeScalePow2(0.0f, 448, 0, flt_max), 1.0f);
  EXPECT_EQ(ScaleInvPow2(std::ldexp(1.0f, 127)), std::ldexp(1.0f, -127));  // subnormal result
  EXPECT_EQ(ScaleInvPow2(std::ldexp(1.0f, -126)), std::ldexp(1.0f, 126));
}

TEST(Amax, IgnoresNanAndSign) {
  float a = 0.0f;
  a = AmaxUpdate(a, -3.0f);
  a = AmaxUpdate(a, std::nanf(""));
  a = AmaxUpdate(a, 2.0f);
  EXPECT_EQ(a, 3.0f);
  EXPECT_EQ(AmaxUpdate(0.0f, -std::numeric_limits<float>::infinity()),
            std::numeric_limits<float>::infinity());
}

}  // namespace
}  // namespace qtx::kernels
