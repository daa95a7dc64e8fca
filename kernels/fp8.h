// FP8 (E4M3 "fn" and E5M2), BF16 and FP16 conversions and the block-scale
// computation of docs/numerics.md §1-§2, bit-exact, shared by kernels/cpu (the
// reference) and kernels/cuda. Every function is pure and thread-safe.
//
// FP32 -> FP8 follows CUDA's __nv_cvt_float_to_fp8(x, __NV_SATFINITE, fmt):
// round to nearest even, subnormals kept, finite overflow and +-Inf saturate
// to +-max, every NaN becomes 0x7F (sign dropped), -0.0 becomes 0x80.
#ifndef QTX_KERNELS_FP8_H_
#define QTX_KERNELS_FP8_H_

#include <cstdint>
#include <cstring>

#include "kernels/host_device.h"
#include "kernels/quantize_params.h"

namespace qtx::kernels {

QTX_HD uint32_t FloatBits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
#endif
}

QTX_HD float BitsToFloat(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
#endif
}

QTX_HD bool IsNan(float f) { return (FloatBits(f) & 0x7FFFFFFFu) > 0x7F800000u; }
QTX_HD bool IsInf(float f) { return (FloatBits(f) & 0x7FFFFFFFu) == 0x7F800000u; }

// Largest finite value of each FP8 format (docs/numerics.md §1).
constexpr float kE4M3Max = 448.0f;
constexpr float kE5M2Max = 57344.0f;

QTX_HD float Fp8Max(Fp8Format f) { return f == Fp8Format::kE4M3 ? kE4M3Max : kE5M2Max; }

// Largest finite value of the *input* dtype: the scale used when fp8_max/amax
// overflows FP32 (docs/numerics.md §2 step 5).
QTX_HD float InputDTypeMax(InputDType t) {
  switch (t) {
    case InputDType::kBFloat16:
      return BitsToFloat(0x7F7F0000u);  // 0x1.FEp127
    case InputDType::kFloat16:
      return 65504.0f;
    case InputDType::kFloat32:
    default:
      return BitsToFloat(0x7F7FFFFFu);  // FLT_MAX
  }
}

// IEEE round-to-nearest multiply and add that the compiler may not contract
// into an FMA (nvcc contracts by default; the host build uses -ffp-contract=off).
QTX_HD float MulRn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
QTX_HD float AddRn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

// FP32 -> FP8 with exponent bits E, mantissa bits M (see file comment).
// Branch-free so that loops over it vectorize:
// * |x| is clamped to the largest finite FP8 value first (saturation; NaN is
//   patched at the end);
// * normal range: round-to-nearest-even on the FP32 bits (add half an FP8 ulp
//   minus one, plus the lowest kept bit), then drop 23 - M bits; a mantissa
//   carry rolls into the exponent by itself;
// * subnormal range: adding the magic float 2^(24 - bias - M), whose ulp is
//   the smallest FP8 subnormal, makes the FPU round |x| (RNE) onto the
//   subnormal grid; its low bits are then the code (a carry gives the
//   smallest normal, whose code is the next integer).
template <int E, int M>
QTX_HD uint8_t EncodeFp8Generic(float x) {
  constexpr int kBias = (1 << (E - 1)) - 1;
  constexpr uint32_t kMaxCode = (E == 4) ? 0x7Eu : 0x7Bu;              // largest finite code
  constexpr uint32_t kMaxBits = (E == 4) ? 0x43E00000u : 0x47600000u;  // 448, 57344
  constexpr uint32_t kMinNormalBits = static_cast<uint32_t>(127 + 1 - kBias) << 23;
  constexpr uint32_t kMagicBits = static_cast<uint32_t>(127 - kBias + 23 - M + 1) << 23;
  constexpr uint32_t kRebias = static_cast<uint32_t>(127 - kBias) << 23;
  const uint32_t u = FloatBits(x);
  const uint32_t sign = (u >> 24) & 0x80u;
  uint32_t a = u & 0x7FFFFFFFu;
  const bool nan = a > 0x7F800000u;
  a = a < kMaxBits ? a : kMaxBits;  // saturate (Inf and NaN too; NaN fixed below)
  const uint32_t sub = FloatBits(AddRn(BitsToFloat(a), BitsToFloat(kMagicBits))) - kMagicBits;
  const uint32_t norm =
      (a - kRebias + ((1u << (22 - M)) - 1u) + ((a >> (23 - M)) & 1u)) >> (23 - M);
  uint32_t code = a < kMinNormalBits ? sub : norm;
  code = code < kMaxCode ? code : kMaxCode;
  return static_cast<uint8_t>(nan ? 0x7Fu : (sign | code));
}

QTX_HD uint8_t EncodeE4M3(float x) { return EncodeFp8Generic<4, 3>(x); }
QTX_HD uint8_t EncodeE5M2(float x) { return EncodeFp8Generic<5, 2>(x); }

QTX_HD uint8_t EncodeFp8(float x, Fp8Format f) {
  return f == Fp8Format::kE4M3 ? EncodeE4M3(x) : EncodeE5M2(x);
}
// EncodeFp8 with the format fixed at compile time (the CPU reference's loops).
template <Fp8Format kF>
QTX_HD uint8_t EncodeFp8As(float x) {
  if constexpr (kF == Fp8Format::kE4M3) {
    return EncodeE4M3(x);
  } else {
    return EncodeE5M2(x);
  }
}

// FP8 -> FP32 (exact).
template <int E, int M>
QTX_HD float DecodeFp8Generic(uint8_t v) {
  constexpr int kBias = (1 << (E - 1)) - 1;
  const uint32_t sign = static_cast<uint32_t>(v & 0x80u) << 24;
  const uint32_t exp = (v >> M) & ((1u << E) - 1u);
  const uint32_t man = v & ((1u << M) - 1u);
  if (E == 4) {
    if ((v & 0x7Fu) == 0x7Fu) return BitsToFloat(sign | 0x7FC00000u);  // NaN
  } else if (exp == 31) {
    if (man == 0) return BitsToFloat(sign | 0x7F800000u);  // Inf
    return BitsToFloat(sign | 0x7FC00000u);                // NaN
  }
  if (exp == 0) {
    if (man == 0) return BitsToFloat(sign);
    // Subnormal: man * 2^(1 - bias - M), exact in FP32.
    float mag =
        static_cast<float>(man) * BitsToFloat(static_cast<uint32_t>(127 + 1 - kBias - M) << 23);
    return BitsToFloat(sign | FloatBits(mag));
  }
  const uint32_t f32_exp = exp - kBias + 127;
  return BitsToFloat(sign | (f32_exp << 23) | (man << (23 - M)));
}

QTX_HD float DecodeE4M3(uint8_t v) { return DecodeFp8Generic<4, 3>(v); }
QTX_HD float DecodeE5M2(uint8_t v) { return DecodeFp8Generic<5, 2>(v); }
QTX_HD float DecodeFp8(uint8_t v, Fp8Format f) {
  return f == Fp8Format::kE4M3 ? DecodeE4M3(v) : DecodeE5M2(v);
}

// BF16 <-> FP32. Widening is exact; narrowing rounds to nearest even and keeps
// NaN a (quiet) NaN of the same sign.
QTX_HD float Bf16ToFloat(uint16_t h) { return BitsToFloat(static_cast<uint32_t>(h) << 16); }
QTX_HD uint16_t FloatToBf16(float f) {
  const uint32_t u = FloatBits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);
  const uint32_t rounding = 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>((u + rounding) >> 16);
}

// IEEE half <-> FP32. Widening is exact; narrowing rounds to nearest even,
// overflows to Inf, keeps NaN (quiet, same sign).
QTX_HD float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu;
  const uint32_t man = h & 0x3FFu;
  if (exp == 0x1F) return BitsToFloat(sign | 0x7F800000u | (man << 13));
  if (exp == 0) {
    if (man == 0) return BitsToFloat(sign);
    const float mag = static_cast<float>(man) * BitsToFloat(103u << 23);  // man * 2^-24
    return BitsToFloat(sign | FloatBits(mag));
  }
  return BitsToFloat(sign | ((exp + 112u) << 23) | (man << 13));
}
QTX_HD uint16_t FloatToHalf(float f) {
  const uint32_t u = FloatBits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return static_cast<uint16_t>(sign | 0x7E00u | ((a >> 13) & 0x3FFu));
  if (a >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);  // rounds to >= 65520: Inf
  int exp = static_cast<int>(a >> 23) - 127;
  uint32_t sig = (a & 0x7FFFFFu) | (exp == -127 ? 0u : 0x800000u);
  if (exp == -127) exp = -126;
  int shift = 13;
  if (exp < -14) shift += -14 - exp;
  if (shift >= 32) return sign;
  uint32_t q = sig >> shift;
  const uint32_t rem = sig & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1);
  if (rem > half || (rem == half && (q & 1u))) ++q;
  if (exp < -14) return static_cast<uint16_t>(sign | q);  // subnormal (carry -> min normal)
  // q in [2^10, 2^11]; adding the biased exponent lets a carry roll over.
  return static_cast<uint16_t>(sign | ((static_cast<uint32_t>(exp + 14) << 10) + q));
}

// Reads element i of a high-precision input as FP32 (exact).
QTX_HD float LoadAsFloat(const void* data, InputDType t, int64_t i) {
  switch (t) {
    case InputDType::kBFloat16:
      return Bf16ToFloat(static_cast<const uint16_t*>(data)[i]);
    case InputDType::kFloat16:
      return HalfToFloat(static_cast<const uint16_t*>(data)[i]);
    case InputDType::kFloat32:
    default:
      return static_cast<const float*>(data)[i];
  }
}
// LoadAsFloat with the type fixed at compile time (the CPU reference's loops).
template <InputDType kT>
QTX_HD float LoadAs(const void* data, int64_t i) {
  if constexpr (kT == InputDType::kFloat32) {
    return static_cast<const float*>(data)[i];
  } else if constexpr (kT == InputDType::kBFloat16) {
    return Bf16ToFloat(static_cast<const uint16_t*>(data)[i]);
  } else {
    return HalfToFloat(static_cast<const uint16_t*>(data)[i]);
  }
}

// Writes v as element i of a high-precision output (FloatToBf16 /
// FloatToHalf rounding; FP32 as is): a dequantized value.
QTX_HD void StoreFromFloat(void* data, InputDType t, int64_t i, float v) {
  switch (t) {
    case InputDType::kBFloat16:
      static_cast<uint16_t*>(data)[i] = FloatToBf16(v);
      break;
    case InputDType::kFloat16:
      static_cast<uint16_t*>(data)[i] = FloatToHalf(v);
      break;
    case InputDType::kFloat32:
    default:
      static_cast<float*>(data)[i] = v;
      break;
  }
}

// The scale of a block from its amax: TE's compute_scale_from_amax
// (docs/numerics.md §2 steps 2-6). IEEE division, never fast-math.
QTX_HD float ComputeScale(float amax, float fp8_max, bool force_pow2, float eps,
                          float value_for_inf) {
  if (amax < eps) amax = eps;                                   // NaN stays NaN
  if (IsInf(amax) || amax == 0.0f || IsNan(amax)) return 1.0f;  // amax >= 0 here
#if defined(__CUDA_ARCH__)
  float scale = __fdiv_rn(fp8_max, amax);
#else
  float scale = fp8_max / amax;
#endif
  if (IsInf(scale)) scale = value_for_inf;
  if (force_pow2) scale = BitsToFloat(FloatBits(scale) & 0xFF800000u);
  return scale;
}

// The scale of per-tensor current scaling (BlockScaling::kTensor) from the
// tensor's amax: ComputeScale with FLT_MAX as the overflow value for every
// input dtype, as TransformerEngine's Float8CurrentScaling does
// (docs/numerics.md, "Per-tensor current scaling").
QTX_HD float TensorScale(float amax, Fp8Format f, bool force_pow2, float eps) {
  return ComputeScale(amax, Fp8Max(f), force_pow2, eps, BitsToFloat(0x7F7FFFFFu));
}

// The stored dequantization multiplier: RN_fp32(1 / scale).
QTX_HD float ScaleInv(float scale) {
#if defined(__CUDA_ARCH__)
  return __frcp_rn(scale);
#else
  return 1.0f / scale;
#endif
}

// ComputeScale(amax, fp8_max, /*force_pow2=*/true, eps, value_for_inf), bit for bit for every
// input, without the division: the GPU kernels' scale when pow2 scales are asked for. For a
// normal amax = ma * 2^ea and fp8_max = mf * 2^ef (ma, mf in [1, 2)), fp8_max / amax =
// (mf / ma) * 2^(ef - ea). If ma <= mf, mf / ma lies in [1, mf] and its rounding stays below 2
// (mf <= 2 - 2^-23), so the power of two is 2^(ef - ea). If ma > mf, then ma >= mf + 2^-23 (both
// on the 2^-23 grid), so mf / ma < 1 - 2^-24 rounds below 1 and the power is 2^(ef - ea - 1).
// An exponent past 127 is the overflow to Inf, which ComputeScale replaces with value_for_inf
// (truncated to a power of two). Zero, subnormal, Inf and NaN amaxes, a subnormal scale and an
// unusual fp8_max take ComputeScale itself. tests/kernels/cpu/fp8_test.cc and the GPU cast test
// compare the two over every FP32 amax.
QTX_HD float ComputeScalePow2(float amax, float fp8_max, float eps, float value_for_inf) {
  if (amax < eps) amax = eps;  // NaN stays NaN
  const uint32_t a = FloatBits(amax), f = FloatBits(fp8_max);
  const uint32_t ea = a >> 23, ef = f >> 23;  // with the sign bit: negatives fall back too
  if (ea - 1u >= 254u || ef - 1u >= 254u) {   // 0, subnormal, Inf, NaN or negative
    return ComputeScale(amax, fp8_max, true, eps, value_for_inf);
  }
  const int e = static_cast<int>(ef) - static_cast<int>(ea) -
                ((a & 0x7FFFFFu) > (f & 0x7FFFFFu) ? 1 : 0);  // the scale's unbiased exponent
  if (e > 127) return BitsToFloat(FloatBits(value_for_inf) & 0xFF800000u);
  if (e < -126) return ComputeScale(amax, fp8_max, true, eps, value_for_inf);
  return BitsToFloat(static_cast<uint32_t>(e + 127) << 23);
}

// ScaleInv(scale), bit for bit for every input: 2^-e for a power of two 2^e with e in
// [-126, 126] (exact, no rounding), ScaleInv itself for anything else.
QTX_HD float ScaleInvPow2(float scale) {
  const uint32_t s = FloatBits(scale);
  if ((s & 0x807FFFFFu) == 0 && s - (1u << 23) < (253u << 23)) {
    return BitsToFloat((254u << 23) - s);
  }
  return ScaleInv(scale);
}

// Running amax step: NaN elements are ignored (CUDA fmaxf semantics), the
// result never decreases. Order-independent.
QTX_HD float AmaxUpdate(float amax, float x) {
  const float a = BitsToFloat(FloatBits(x) & 0x7FFFFFFFu);
  return a > amax ? a : amax;
}

// The same running amax kept as FP32 bits: for non-negative floats the bit
// patterns order like the values, so an integer max (which vectorizes without
// -ffinite-math-only) gives identical results. NaN contributes 0.
QTX_HD uint32_t AmaxBitsUpdate(uint32_t amax_bits, float x) {
  uint32_t b = FloatBits(x) & 0x7FFFFFFFu;
  b &= 0u - static_cast<uint32_t>(b <= 0x7F800000u);  // NaN -> 0, branch-free
  return b > amax_bits ? b : amax_bits;
}

}  // namespace qtx::kernels

#endif  // QTX_KERNELS_FP8_H_
