// The band kernel of AdamWStepFused (see adamw_band.h for why it is compiled
// twice). Work split: every parameter is cut into work units of one 128-row
// band by up to kUnitTiles 128x128 tiles; adamw.cc's threads claim runs of
// units from a shared counter (or each takes one contiguous run: see
// internal::SetUnitClaimChunk). One unit:
//   A. row by row over the band, the AdamW update of the row's contiguous run
//      of up to kUnitTiles * 128 elements (auto-vectorized: vsqrtps/vdivps,
//      512-bit in the AVX-512 build), with the optional BF16 copy, then each
//      tile segment's |p| maximum (from L1) as unsigned compares of the
//      magnitude bits (NaN excluded, as AmaxUpdate does); per-tile, per-row
//      (1-D rowwise) and per-column (1-D columnwise) maxima are kept in the
//      thread's scratch. The lines of the row kPrefetchRows ahead are
//      prefetched: the runs restart at a stride of n elements, and the
//      hardware prefetchers (which stop at 4 KiB pages) lag behind on each
//      restart.
//   B. per tile: scales from the amaxes (kernels::ComputeScale, the
//      QuantizeBlock rule);
//   C. per tile: encode RN(p * scale) (branch-free encoder, AVX2 or AVX-512
//      intrinsics where built with them; the AVX-512 one rounds with one FP32
//      add of a magic number looked up by exponent, EncodeFast16, 11
//      operations per 16 values instead of 17: 0.22 -> 0.14-0.16 ns per value on
//      the GPU machine's host) into the rowwise copy, or a scratch
//      tile when there is none, then the bytes are transposed into the
//      columnwise [N, M] copy (SSE2 16x16 blocks).
// B/C re-read the unit's master weights (deferred: while the next unit is
// updated). Measured on the GPU machine's host at 8192^2, that re-read misses
// the 2 MiB L2 (a 16-tile unit streams 4 MiB in between) and costs DRAM
// bandwidth: at 16 threads the rowwise output minus the encoder's arithmetic
// took what 5 B/param take at the DRAM rate (bench/results/
// optimizer_host_adam16_2026-12-02.md). So a 2-D unit whose tiles' scales of
// the previous step are kept (AdamWParamBuffers::tile_scales; power-of-two
// scales rarely move) is encoded during A instead, row by row from L1 with
// those scales, into the buffer (Deferred::bytes or ::spec) that the pending
// unit does not use; a tile whose scale moved is encoded again after A, and
// the deferred part is then only the stores. Unit width, kUnitTiles = 16 (rows of 2048 elements, 8
// KiB per FP32 stream) instead of 4: the update's row runs restart 4x less often. A/B against
// main's 4-tile kernel on the GPU machine's host (Xeon, 2 MiB L2; bench/README.md, "Host AdamW at
// memory speed"): 8192^2 from DRAM 1.11 / 0.94 / 1.14 / 0.78 / 1.08x at 1 / 2 / 4 / 8 / 16 threads,
// 4096^2 0.93-1.30x; 32 tiles was slower. Cost: about 820 KiB of per-thread scratch (Deferred
// below).
#if defined(QTX_ADAMW_BAND_AVX512)
#if !defined(__AVX512F__) || !defined(__AVX512BW__) || !defined(__AVX512VL__) || \
    !defined(__AVX512DQ__)
#error "adamw_band_avx512.cc must be compiled with -march=x86-64-v4"
#endif
#define QTX_BAND_NS avx512
#else
#define QTX_BAND_NS base
#endif

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstring>
#include <memory>

#if defined(__SSE2__)
#include <immintrin.h>
#endif

#include "kernels/block_geometry.h"
#include "kernels/cpu/adamw_band.h"
#include "kernels/fp8.h"

namespace qtx::kernels::cpu::band::QTX_BAND_NS {
namespace {

template <int E, int M>
inline uint8_t EncodeFast(float x) {
  constexpr int kBias = (1 << (E - 1)) - 1;
  constexpr uint32_t kMaxCode = E == 4 ? 0x7Eu : 0x7Bu;
  constexpr int kDrop = 23 - M;
  // Smallest normal FP8 magnitude 2^(1-bias), as FP32 bits.
  constexpr uint32_t kMinNormalBits = static_cast<uint32_t>(127 + 1 - kBias) << 23;
  // C = 2^(23 + 1 - bias - M): FP32 spacing at C is 2^(1-bias-M), the FP8
  // subnormal step, so RN(|x| + C) rounds |x| (< min normal) onto the FP8
  // subnormal grid with ties to even; the step count is bits(sum) - bits(C).
  constexpr uint32_t kSubMagicBits = static_cast<uint32_t>(127 + 23 + 1 - kBias - M) << 23;
  const uint32_t bits = std::bit_cast<uint32_t>(x);
  const uint32_t sign = (bits >> 24) & 0x80u;
  const uint32_t a = bits & 0x7FFFFFFFu;
  // Normal range: round the FP32 significand to M bits (ties to even); a carry
  // moves into the exponent field. Re-bias the exponent; saturate (Inf too).
  const uint32_t rounded = a + ((1u << (kDrop - 1)) - 1u) + ((a >> kDrop) & 1u);
  uint32_t code_n = (rounded >> kDrop) - (static_cast<uint32_t>(127 - kBias) << M);
  code_n = code_n < kMaxCode ? code_n : kMaxCode;
  const float t = std::bit_cast<float>(a) + std::bit_cast<float>(kSubMagicBits);
  const uint32_t code_s = std::bit_cast<uint32_t>(t) - kSubMagicBits;
  // Selections as bit masks: with trapping math on, GCC will not if-convert a
  // ?: whose arm it sank the float add into, and the loop would stay scalar.
  const uint32_t sub = 0u - static_cast<uint32_t>(a < kMinNormalBits);
  const uint32_t nan = 0u - static_cast<uint32_t>(a > 0x7F800000u);
  const uint32_t code = ((sub & code_s) | (~sub & code_n)) | sign;
  return static_cast<uint8_t>((nan & 0x7Fu) | (~nan & code));
}

// |x| as FP32 bits, NaN mapped to 0: for non-NaN magnitudes the unsigned
// order of the bits is the float order, so a max over these equals the
// AmaxUpdate fold (NaN ignored, start at 0).
inline uint32_t MagnitudeBits(float x) {
  const uint32_t a = std::bit_cast<uint32_t>(x) & 0x7FFFFFFFu;
  return a > 0x7F800000u ? 0u : a;
}

template <MomentDType kM>
using MomentT = std::conditional_t<kM == MomentDType::kFloat32, float, uint16_t>;

template <MomentDType kM>
inline float LoadMoment(const MomentT<kM>* p, int64_t i) {
  if constexpr (kM == MomentDType::kFloat32) {
    return p[i];
  } else {
    return std::bit_cast<float>(static_cast<uint32_t>(p[i]) << 16);
  }
}

// FP32 -> BF16, round to nearest even, NaN kept quiet (= kernels::FloatToBf16,
// written with std::bit_cast so that it vectorizes).
inline uint16_t ToBf16(float f) {
  const uint32_t u = std::bit_cast<uint32_t>(f);
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  const uint32_t nan = (u >> 16) | 0x0040u;
  return static_cast<uint16_t>((u & 0x7FFFFFFFu) > 0x7F800000u ? nan : rounded);
}

template <MomentDType kM>
inline void StoreMoment(MomentT<kM>* p, int64_t i, float v) {
  if constexpr (kM == MomentDType::kFloat32) {
    p[i] = v;
  } else {
    p[i] = ToBf16(v);
  }
}

// The AdamW update of `len` contiguous elements (kernels/adamw.h order), with
// the optional BF16 copy of the updated weights.
template <InputDType kG, MomentDType kM, bool kBf16>
void UpdateSpan(float* __restrict p, MomentT<kM>* __restrict m, MomentT<kM>* __restrict v,
                const void* __restrict g, uint16_t* __restrict bf16, int64_t len,
                const AdamWScalars& s) {
  const AdamWScalars c = s;  // local copy: no aliasing with the stores
  for (int64_t j = 0; j < len; ++j) {
    float pj = p[j];
    float mj = LoadMoment<kM>(m, j);
    float vj = LoadMoment<kM>(v, j);
    AdamWUpdate(pj, mj, vj, LoadAs<kG>(g, j), c);
    p[j] = pj;
    StoreMoment<kM>(m, j, mj);
    StoreMoment<kM>(v, j, vj);
    if constexpr (kBf16) bf16[j] = ToBf16(pj);
  }
}

// max over MagnitudeBits(p[0..len)) (an exact max: the order does not
// matter). AVX2: the magnitude bits as signed 32-bit integers (<= 0x7FFFFFFF),
// NaN (> 0x7F800000) zeroed, unsigned max; otherwise eight independent lanes.
inline uint32_t RowMagnitudeMax(const float* __restrict p, int64_t len) {
  int64_t j = 0;
  uint32_t r = 0;
#if defined(__AVX512BW__)
  // Magnitude bits; lanes above the Inf bits (NaN) are left out of the max.
  const __m512i abs_mask = _mm512_set1_epi32(0x7FFFFFFF);
  const __m512i inf_bits = _mm512_set1_epi32(0x7F800000);
  __m512i acc0 = _mm512_setzero_si512(), acc1 = _mm512_setzero_si512();
  for (; j + 32 <= len; j += 32) {
    const __m512i a0 = _mm512_and_si512(_mm512_loadu_si512(p + j), abs_mask);
    const __m512i a1 = _mm512_and_si512(_mm512_loadu_si512(p + j + 16), abs_mask);
    acc0 = _mm512_mask_max_epu32(acc0, _mm512_cmple_epu32_mask(a0, inf_bits), acc0, a0);
    acc1 = _mm512_mask_max_epu32(acc1, _mm512_cmple_epu32_mask(a1, inf_bits), acc1, a1);
  }
  r = _mm512_reduce_max_epu32(_mm512_max_epu32(acc0, acc1));
#elif defined(__AVX2__)
  const __m256i abs_mask = _mm256_set1_epi32(0x7FFFFFFF);
  const __m256i inf_bits = _mm256_set1_epi32(0x7F800000);
  __m256i acc0 = _mm256_setzero_si256(), acc1 = _mm256_setzero_si256();
  for (; j + 16 <= len; j += 16) {
    const __m256i a0 =
        _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + j)), abs_mask);
    const __m256i a1 =
        _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + j + 8)), abs_mask);
    acc0 = _mm256_max_epu32(acc0, _mm256_andnot_si256(_mm256_cmpgt_epi32(a0, inf_bits), a0));
    acc1 = _mm256_max_epu32(acc1, _mm256_andnot_si256(_mm256_cmpgt_epi32(a1, inf_bits), a1));
  }
  acc0 = _mm256_max_epu32(acc0, acc1);
  __m128i h = _mm_max_epu32(_mm256_castsi256_si128(acc0), _mm256_extracti128_si256(acc0, 1));
  h = _mm_max_epu32(h, _mm_shuffle_epi32(h, 0x4E));
  h = _mm_max_epu32(h, _mm_shuffle_epi32(h, 0xB1));
  r = static_cast<uint32_t>(_mm_cvtsi128_si32(h));
#else
  uint32_t lane[8] = {};
  for (; j + 8 <= len; j += 8) {
    for (int l = 0; l < 8; ++l) lane[l] = std::max(lane[l], MagnitudeBits(p[j + l]));
  }
  for (int l = 0; l < 8; ++l) r = std::max(r, lane[l]);
#endif
  for (; j < len; ++j) r = std::max(r, MagnitudeBits(p[j]));
  return r;
}

#if defined(__AVX2__)
// EncodeFast of eight floats, the same integer and FP32 steps on 32-bit lanes;
// the code is in the low byte of each lane. (GCC's own vectorization of
// EncodeFast spills and costs ~3x this.)
template <int E, int M>
inline __m256i EncodeFast8(__m256 x) {
  constexpr int kBias = (1 << (E - 1)) - 1;
  constexpr int kMaxCode = E == 4 ? 0x7E : 0x7B;
  constexpr int kDrop = 23 - M;
  constexpr int kMinNormalBits = (127 + 1 - kBias) << 23;
  constexpr int kSubMagicBits = (127 + 23 + 1 - kBias - M) << 23;
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i sign = _mm256_and_si256(_mm256_srli_epi32(bits, 24), _mm256_set1_epi32(0x80));
  const __m256i a = _mm256_and_si256(bits, _mm256_set1_epi32(0x7FFFFFFF));
  const __m256i rounded =
      _mm256_add_epi32(_mm256_add_epi32(a, _mm256_set1_epi32((1 << (kDrop - 1)) - 1)),
                       _mm256_and_si256(_mm256_srli_epi32(a, kDrop), _mm256_set1_epi32(1)));
  __m256i code_n =
      _mm256_sub_epi32(_mm256_srli_epi32(rounded, kDrop), _mm256_set1_epi32((127 - kBias) << M));
  code_n = _mm256_min_epu32(code_n, _mm256_set1_epi32(kMaxCode));
  const __m256 t =
      _mm256_add_ps(_mm256_castsi256_ps(a), _mm256_castsi256_ps(_mm256_set1_epi32(kSubMagicBits)));
  const __m256i code_s = _mm256_sub_epi32(_mm256_castps_si256(t), _mm256_set1_epi32(kSubMagicBits));
  // a <= 0x7FFFFFFF: signed compares order the magnitudes.
  const __m256i sub = _mm256_cmpgt_epi32(_mm256_set1_epi32(kMinNormalBits), a);
  const __m256i nan = _mm256_cmpgt_epi32(a, _mm256_set1_epi32(0x7F800000));
  const __m256i code = _mm256_or_si256(_mm256_blendv_epi8(code_n, code_s, sub), sign);
  return _mm256_blendv_epi8(code, _mm256_set1_epi32(0x7F), nan);
}
#endif

#if defined(__AVX512BW__)
// The FP32 bits of the magic addend c(be) of EncodeFast16 for the biased FP32
// exponent be of max(|x|, smallest FP8 normal): c = 2^(be - 127 + 23 - M)
// (its ulp, 2^(be - 127 - M), is the FP8 ulp of |x|'s binade, the FP8
// subnormal step below the normal range) plus (be - be_min) * 2^M ulps (the
// FP8 code of 2^(be - 127), a multiple of 2^M: the parity of c's low bit is 0).
// Entry j is c(be) for the one be of [be_min, be_max] with be mod 2^kIdxBits
// == j (be_max: the exponent of the largest finite FP8 value).
template <int E, int M>
struct EncodeLut {
  static constexpr int kBias = (1 << (E - 1)) - 1;
  static constexpr int kBeMin = 127 + 1 - kBias;
  static constexpr int kBeMax = 127 + (E == 4 ? 8 : 15);  // 448 = 1.75 * 2^8, 57344 = 1.75 * 2^15
  static constexpr int kIdxBits = E == 4 ? 4 : 5;
  static_assert(kBeMax - kBeMin < (1 << kIdxBits), "exponents must not collide");
  static constexpr std::array<uint32_t, 32> Make() {
    std::array<uint32_t, 32> t{};
    for (int be = kBeMin; be <= kBeMax; ++be) {
      t[be & ((1 << kIdxBits) - 1)] =
          (static_cast<uint32_t>(be + 23 - M) << 23) | (static_cast<uint32_t>(be - kBeMin) << M);
    }
    return t;
  }
  static constexpr std::array<uint32_t, 32> kTable = Make();
};

// EncodeFast of sixteen floats; the code is in the low byte of each lane.
// Not EncodeFast's steps: |x| is clamped to the largest finite FP8 value
// (saturation, as EncodeFp8), then one FP32 add t = |x| + c(be) (EncodeLut,
// looked up by exponent with a permute) rounds |x| to the FP8 grid of its
// binade with ties to even, normal and subnormal alike, and leaves the FP8
// code in t's low 7 bits: t = c + k ulps, k = RN(|x| / ulp) <= 2^(M+1), and
// code = (be - be_min) * 2^M + k (k = 2^(M+1) is the carry into the next
// binade). Then the sign into bit 7 and NaN -> 0x7F. 11 vector operations
// per 16 values where EncodeFast's steps take 17.
template <int E, int M>
inline __m512i EncodeFast16(__m512 x, __m512i lut_lo, __m512i lut_hi) {
  using L = EncodeLut<E, M>;
  constexpr int kMaxBits = E == 4 ? 0x43E00000 : 0x47600000;  // 448, 57344
  constexpr int kMinNormalBits = L::kBeMin << 23;
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i a = _mm512_and_si512(bits, _mm512_set1_epi32(0x7FFFFFFF));
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(a, _mm512_set1_epi32(0x7F800000));
  const __m512i ac = _mm512_min_epu32(a, _mm512_set1_epi32(kMaxBits));
  const __m512i be = _mm512_srli_epi32(_mm512_max_epu32(ac, _mm512_set1_epi32(kMinNormalBits)), 23);
  __m512i c;
  if constexpr (L::kIdxBits == 4) {
    c = _mm512_permutexvar_epi32(be, lut_lo);
  } else {
    c = _mm512_permutex2var_epi32(lut_lo, be, lut_hi);
  }
  const __m512i t =
      _mm512_castps_si512(_mm512_add_ps(_mm512_castsi512_ps(ac), _mm512_castsi512_ps(c)));
  // (t & 0x7F) | ((bits >> 24) & ~0x7F): the code and the sign in bit 7.
  const __m512i code =
      _mm512_ternarylogic_epi32(t, _mm512_srli_epi32(bits, 24), _mm512_set1_epi32(0x7F), 0xE4);
  return _mm512_mask_mov_epi32(code, nan, _mm512_set1_epi32(0x7F));
}
#endif

template <int E, int M>
void EncodeSpan(const float* __restrict p, float scale, uint8_t* __restrict out, int64_t len) {
  int64_t j = 0;
#if defined(__AVX512BW__)
  const __m512 sc = _mm512_set1_ps(scale);
  const __m512i lo = _mm512_loadu_si512(EncodeLut<E, M>::kTable.data());
  const __m512i hi = _mm512_loadu_si512(EncodeLut<E, M>::kTable.data() + 16);
  // The packs work per 128-bit lane; the dword permute restores the order.
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  for (; j + 64 <= len; j += 64) {
    const __m512i c0 = EncodeFast16<E, M>(_mm512_mul_ps(_mm512_loadu_ps(p + j), sc), lo, hi);
    const __m512i c1 = EncodeFast16<E, M>(_mm512_mul_ps(_mm512_loadu_ps(p + j + 16), sc), lo, hi);
    const __m512i c2 = EncodeFast16<E, M>(_mm512_mul_ps(_mm512_loadu_ps(p + j + 32), sc), lo, hi);
    const __m512i c3 = EncodeFast16<E, M>(_mm512_mul_ps(_mm512_loadu_ps(p + j + 48), sc), lo, hi);
    const __m512i w = _mm512_packus_epi16(_mm512_packus_epi32(c0, c1), _mm512_packus_epi32(c2, c3));
    _mm512_storeu_si512(out + j, _mm512_permutexvar_epi32(order, w));
  }
  for (; j + 16 <= len; j += 16) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + j),
                     _mm512_cvtepi32_epi8(
                         EncodeFast16<E, M>(_mm512_mul_ps(_mm512_loadu_ps(p + j), sc), lo, hi)));
  }
#elif defined(__AVX2__)
  const __m256 sc = _mm256_set1_ps(scale);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (; j + 32 <= len; j += 32) {
    const __m256i c0 = EncodeFast8<E, M>(_mm256_mul_ps(_mm256_loadu_ps(p + j), sc));
    const __m256i c1 = EncodeFast8<E, M>(_mm256_mul_ps(_mm256_loadu_ps(p + j + 8), sc));
    const __m256i c2 = EncodeFast8<E, M>(_mm256_mul_ps(_mm256_loadu_ps(p + j + 16), sc));
    const __m256i c3 = EncodeFast8<E, M>(_mm256_mul_ps(_mm256_loadu_ps(p + j + 24), sc));
    // Lanes hold values <= 0xFF, so the saturating packs are plain narrowing;
    // the packs interleave 128-bit halves, the permute restores the order.
    const __m256i w = _mm256_packus_epi16(_mm256_packus_epi32(c0, c1), _mm256_packus_epi32(c2, c3));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + j), _mm256_permutevar8x32_epi32(w, order));
  }
#endif
  for (; j < len; ++j) out[j] = EncodeFast<E, M>(p[j] * scale);
}

template <int E, int M>
void EncodeSpanPerColumn(const float* __restrict p, const float* __restrict scale,
                         uint8_t* __restrict out, int64_t len) {
  for (int64_t j = 0; j < len; ++j) out[j] = EncodeFast<E, M>(p[j] * scale[j]);
}

// Not inlined nor cloned: one call per row costs nothing, and with a constant
// `len` GCC warns about the (dead) scalar tail. (clang has no noipa and does
// not warn there: noinline is enough.)
#if defined(__clang__)
__attribute__((noinline))
#else
[[gnu::noipa]]
#endif
void EncodeRow(const float* p, float scale, uint8_t* out, int64_t len, Fp8Format f) {
  if (f == Fp8Format::kE4M3) {
    EncodeSpan<4, 3>(p, scale, out, len);
  } else {
    EncodeSpan<5, 2>(p, scale, out, len);
  }
}

void EncodeRowPerColumn(const float* p, const float* scale, uint8_t* out, int64_t len,
                        Fp8Format f) {
  if (f == Fp8Format::kE4M3) {
    EncodeSpanPerColumn<4, 3>(p, scale, out, len);
  } else {
    EncodeSpanPerColumn<5, 2>(p, scale, out, len);
  }
}

#if defined(__SSE2__)
// out row j (16 bytes at out + j * out_pitch) = column j of the 16x16 byte
// block at in (row pitch in_pitch): four rounds of byte/word/dword/qword
// interleaves.
inline void Transpose16x16(const uint8_t* in, int64_t in_pitch, uint8_t* out, int64_t out_pitch) {
  __m128i r[16];
  for (int i = 0; i < 16; ++i) {
    r[i] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i * in_pitch));
  }
  __m128i t[16];
  for (int i = 0; i < 8; ++i) {  // bytes: rows (2i, 2i+1)
    t[2 * i] = _mm_unpacklo_epi8(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm_unpackhi_epi8(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // words: pairs (4i, 4i+2), (4i+1, 4i+3)
    r[4 * i + 0] = _mm_unpacklo_epi16(t[4 * i + 0], t[4 * i + 2]);
    r[4 * i + 1] = _mm_unpackhi_epi16(t[4 * i + 0], t[4 * i + 2]);
    r[4 * i + 2] = _mm_unpacklo_epi16(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm_unpackhi_epi16(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int i = 0; i < 2; ++i) {  // dwords: quads (8i + q, 8i + 4 + q)
    for (int q = 0; q < 4; ++q) {
      t[8 * i + 2 * q] = _mm_unpacklo_epi32(r[8 * i + q], r[8 * i + 4 + q]);
      t[8 * i + 2 * q + 1] = _mm_unpackhi_epi32(r[8 * i + q], r[8 * i + 4 + q]);
    }
  }
  for (int q = 0; q < 8; ++q) {  // qwords: (q, 8 + q)
    r[2 * q] = _mm_unpacklo_epi64(t[q], t[8 + q]);
    r[2 * q + 1] = _mm_unpackhi_epi64(t[q], t[8 + q]);
  }
  for (int j = 0; j < 16; ++j) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + j * out_pitch), r[j]);
  }
}
#endif

// Writes tile bytes [rows, cols] (row pitch `pitch`) transposed into the
// columnwise copy: col_data[(c0 + j) * m + r0 + i] = tile[i * pitch + j].
void StoreTransposed(const uint8_t* tile, int64_t pitch, int64_t rows, int64_t cols,
                     uint8_t* col_data, int64_t m, int64_t r0, int64_t c0) {
  constexpr int64_t kB = 16;  // 16x16 sub-blocks keep both sides in few cache lines
  for (int64_t jb = 0; jb < cols; jb += kB) {
    const int64_t je = std::min(cols, jb + kB);
    for (int64_t ib = 0; ib < rows; ib += kB) {
      const int64_t ie = std::min(rows, ib + kB);
#if defined(__SSE2__)
      if (je - jb == kB && ie - ib == kB) {
        Transpose16x16(tile + ib * pitch + jb, pitch, col_data + (c0 + jb) * m + r0 + ib, m);
        continue;
      }
#endif
      for (int64_t j = jb; j < je; ++j) {
        uint8_t* dst = col_data + (c0 + j) * m + r0;
        for (int64_t i = ib; i < ie; ++i) dst[i] = tile[i * pitch + j];
      }
    }
  }
}

// b.tile_scales where the kernel uses and keeps them (UsesTileScales), else null.
inline float* KeptTileScales(const AdamWParamBuffers& b) {
  return UsesTileScales(b.quant) ? b.tile_scales : nullptr;
}

// Rows ahead whose lines ProcessUnit prefetches. QTX_ADAMW_PREFETCH_ROWS
// overrides it at compile time, for A/B builds of the benchmark only.
#ifndef QTX_ADAMW_PREFETCH_ROWS
#define QTX_ADAMW_PREFETCH_ROWS 2
#endif
constexpr int64_t kPrefetchRows = QTX_ADAMW_PREFETCH_ROWS;
static_assert(kPrefetchRows >= 1, "QTX_ADAMW_PREFETCH_ROWS must be >= 1");

// Rows ahead whose master weights EncodeTensorUnits' tiles prefetch (0: none).
// Its pass reads the master from DRAM one 128x128 tile at a time, 128 runs of
// 512 bytes at a stride of n floats, which the hardware prefetchers (one
// stream a 4 KiB page) do not follow; row i's encode prefetches row i + this
// of the same tile, or of the next tile along the band.
// QTX_ADAMW_ENCODE_PREFETCH_ROWS overrides it, for A/B builds of the benchmark.
#ifndef QTX_ADAMW_ENCODE_PREFETCH_ROWS
#define QTX_ADAMW_ENCODE_PREFETCH_ROWS 16
#endif
constexpr int64_t kEncodePrefetchRows = QTX_ADAMW_ENCODE_PREFETCH_ROWS;
static_assert(kEncodePrefetchRows >= 0 && kEncodePrefetchRows < 128,
              "QTX_ADAMW_ENCODE_PREFETCH_ROWS must be in [0, 128)");

inline void PrefetchSpan(const void* p, int64_t bytes, bool write) {
  const char* c = static_cast<const char*>(p);
  for (int64_t o = 0; o < bytes; o += 64) {
    if (write) {
      __builtin_prefetch(c + o, 1, 3);
    } else {
      __builtin_prefetch(c + o, 0, 3);
    }
  }
}

// Scratch of one thread: a tile's encoded bytes and the amaxes of a unit (as
// MagnitudeBits).
struct alignas(64) UnitScratch {
  uint8_t bytes[kBlockLen * kBlockLen];
  uint8_t transposed[kBlockLen * kBlockLen];
  uint32_t row_max[kUnitTiles][kBlockLen];   // [tile][row]: 1-D rowwise scales
  uint32_t tile_max[kUnitTiles];             // 2-D scales
  uint32_t col_max[kUnitTiles * kBlockLen];  // [unit column]: 1-D columnwise scales
};

// The encode of a unit of full 2-D tiles, deferred into the next unit's update
// pass: after update row i of the next unit, DeferredRow(i) encodes row i of
// every tile (pipelined: the encode's arithmetic runs while the update's
// streams are in flight, instead of the memory idling through a separate
// encode phase). The bytes are stored to the rowwise copy as they are made and
// kept in `bytes`; each 16-row strip is transposed into `transposed`, which is
// stored to the columnwise copy after row 127.
// A unit encoded during its own update (AdamWParamBuffers::tile_scales) has
// its bytes made in whichever of `bytes` and `spec` the pending unit does not
// use; only the stores are left for DeferredRow.
struct alignas(64) Deferred {
  uint8_t bytes[kUnitTiles][kBlockLen * kBlockLen];
  uint8_t spec[kUnitTiles][kBlockLen * kBlockLen];
  uint8_t transposed[kUnitTiles][kBlockLen * kBlockLen];
  float scale[kUnitTiles];
  uint8_t (*src)[kBlockLen * kBlockLen] = bytes;  // the unit's bytes: bytes or spec
  bool encoded = false;                           // src holds them already
  // An encoded unit's columnwise copy leaves in strips of 16 columns of a
  // tile (16 whole rows of the copy), spread over the 128 deferred rows
  // instead of all at row 127: this is one strip, transposed.
  alignas(64) uint8_t strip[16 * kBlockLen];
  const ParamPlan* plan = nullptr;  // null: nothing deferred
  int64_t k = 0, tj0 = 0, tiles = 0;
  int64_t next_row = 0;  // rows [0, next_row) are done
};

#if defined(__AVX2__)
// Stores the 128 bytes at src (64-byte aligned scratch) to dst: non-temporal
// when dst is 32-byte aligned (the FP8 copies are not read again by this step,
// so they need not be read into the cache first, write-allocate, nor stay
// there), as whole 64-byte lines where the build has AVX-512 and dst is 64-byte
// aligned (one store fills a line's write-combining buffer at once), else as
// 32-byte halves; ordinary stores when dst is not 32-byte aligned.
inline void StoreRow128(const uint8_t* src, uint8_t* dst) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(dst);
#if defined(__AVX512F__)
  if (a % 64 == 0) {
    _mm512_stream_si512(reinterpret_cast<__m512i*>(dst), _mm512_load_si512(src));
    _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + 64), _mm512_load_si512(src + 64));
    return;
  }
#endif
  for (int w = 0; w < static_cast<int>(kBlockLen / 32); ++w) {
    const __m256i x = _mm256_load_si256(reinterpret_cast<const __m256i*>(src) + w);
    if (a % 32 == 0) {
      _mm256_stream_si256(reinterpret_cast<__m256i*>(dst) + w, x);
    } else {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst) + w, x);
    }
  }
}

// Copies `rows` rows of 128 bytes (source pitch kBlockLen) to dst (row pitch
// `pitch`) with StoreRow128.
void StoreTileRows(const uint8_t* src, uint8_t* dst, int64_t pitch, int64_t rows = kBlockLen) {
  for (int64_t i = 0; i < rows; ++i) StoreRow128(src + i * kBlockLen, dst + i * pitch);
}
#endif

// Tile (k, tj) of a parameter: its first row and column, and its extent (an
// edge tile's is partial).
struct TileSpan {
  int64_t r0, c0, rows, cols;
};
inline TileSpan TileAt(const AdamWParamBuffers& b, int64_t k, int64_t tj) {
  const int64_t r0 = k * kBlockLen, c0 = tj * kBlockLen;
  return {r0, c0, std::min(kBlockLen, b.m - r0), std::min(kBlockLen, b.n - c0)};
}

// The FP8 bytes of tile (k, tj) with one `scale` (a 2-D tile's or the whole
// tensor's) from the updated master weights, into each requested copy.
// tile_bytes and transposed: 64-byte aligned [kBlockLen * kBlockLen] scratch.
// `prefetch`: the master is not in cache (the per-tensor cast pass), so each
// row prefetches the one kEncodePrefetchRows ahead (into the next tile, tj + 1).
void EncodeTileBytes(const ParamPlan& plan, int64_t k, int64_t tj, float scale, uint8_t* tile_bytes,
                     uint8_t* transposed, [[maybe_unused]] bool prefetch = false) {
  const AdamWParamBuffers& b = *plan.b;
  const int64_t n = b.n;
  const auto [r0, c0, rows, cols] = TileAt(b, k, tj);
  const QuantizeParams& q = b.quant;
#if defined(__AVX2__)
  if (rows == kBlockLen && cols == kBlockLen) {
    // Full tile: encode and transpose in L1 scratch, then store whole rows.
    const bool next_tile = tj + 1 < plan.nb;
    for (int64_t i = 0; i < rows; ++i) {
      if (kEncodePrefetchRows > 0 && prefetch) {
        const int64_t ahead = i + kEncodePrefetchRows;
        if (ahead < kBlockLen) {
          PrefetchSpan(b.master + (r0 + ahead) * n + c0, kBlockLen * 4, /*write=*/false);
        } else if (next_tile) {  // rows past the band's end are never the next tile's
          PrefetchSpan(b.master + (r0 + ahead - kBlockLen) * n + c0 + kBlockLen, kBlockLen * 4,
                       /*write=*/false);
        }
      }
      EncodeRow(b.master + (r0 + i) * n + c0, scale, tile_bytes + i * kBlockLen, cols, q.format);
    }
    if (q.rowwise) StoreTileRows(tile_bytes, b.fp8.rowwise_data + r0 * n + c0, n);
    if (q.columnwise) {
      StoreTransposed(tile_bytes, kBlockLen, rows, cols, transposed, kBlockLen, 0, 0);
      StoreTileRows(transposed, b.fp8.columnwise_data + c0 * b.m + r0, b.m);
    }
    return;
  }
#endif
  // The bytes go to the rowwise copy when there is one (the columnwise copy
  // is then transposed from it, still in L1/L2), else to the scratch tile.
  uint8_t* const bytes = q.rowwise ? b.fp8.rowwise_data + r0 * n + c0 : tile_bytes;
  const int64_t pitch = q.rowwise ? n : kBlockLen;
  for (int64_t i = 0; i < rows; ++i) {
    EncodeRow(b.master + (r0 + i) * n + c0, scale, bytes + i * pitch, cols, q.format);
  }
  if (q.columnwise) {
    StoreTransposed(bytes, pitch, rows, cols, b.fp8.columnwise_data, b.m, r0, c0);
  }
}

// B and C of one tile (rows x cols at (r0, c0) = tile (k, tj)) whose master
// weights are updated and whose amaxes are in row_max / tile_max / col_max.
// tile_bytes and transposed: 64-byte aligned [kBlockLen * kBlockLen] scratch.
void EncodeTile(const ParamPlan& plan, int64_t k, int64_t tj, const uint32_t* row_max,
                uint32_t tile_max, const uint32_t* col_max, uint8_t* tile_bytes,
                uint8_t* transposed) {
  const AdamWParamBuffers& b = *plan.b;
  const int64_t n = b.n;
  const auto [r0, c0, rows, cols] = TileAt(b, k, tj);
  const QuantizeParams& q = b.quant;
  const float fp8_max = Fp8Max(q.format);
  const float value_for_inf = InputDTypeMax(InputDType::kFloat32);
  auto scale_of = [&](uint32_t amax_bits) {
    return ComputeScale(std::bit_cast<float>(amax_bits), fp8_max, q.force_pow2_scales,
                        q.amax_epsilon, value_for_inf);
  };
  const QuantizedLayout& l = plan.layout;
  if (q.scaling != BlockScaling::kBlock1D) {
    const float scale = scale_of(tile_max);
    const float scale_inv = ScaleInv(scale);
    if (float* const kept = KeptTileScales(b)) kept[k * plan.nb + tj] = scale;
    if (q.rowwise) b.fp8.rowwise_scale_inv[k * l.rowwise_scale_cols + tj] = scale_inv;
    if (q.columnwise) b.fp8.columnwise_scale_inv[tj * l.columnwise_scale_cols + k] = scale_inv;
    EncodeTileBytes(plan, k, tj, scale, tile_bytes, transposed);
    return;
  }
  if (q.rowwise) {
    for (int64_t i = 0; i < rows; ++i) {
      const int64_t off = (r0 + i) * n + c0;
      const float scale = scale_of(row_max[i]);
      b.fp8.rowwise_scale_inv[tj * l.rowwise_scale_cols + r0 + i] = ScaleInv(scale);
      EncodeRow(b.master + off, scale, b.fp8.rowwise_data + off, cols, q.format);
    }
  }
  if (q.columnwise) {
    float col_scale[kBlockLen];
    for (int64_t j = 0; j < cols; ++j) {
      col_scale[j] = scale_of(col_max[j]);
      b.fp8.columnwise_scale_inv[k * l.columnwise_scale_cols + c0 + j] = ScaleInv(col_scale[j]);
    }
    for (int64_t i = 0; i < rows; ++i) {
      EncodeRowPerColumn(b.master + (r0 + i) * n + c0, col_scale, tile_bytes + i * kBlockLen, cols,
                         q.format);
    }
    StoreTransposed(tile_bytes, kBlockLen, rows, cols, b.fp8.columnwise_data, b.m, r0, c0);
  }
}

#if defined(__AVX2__)
// Row i of every tile of the deferred unit (see Deferred). REQUIRES: i ==
// d.next_row < kBlockLen.
void DeferredRow(Deferred& d, int64_t i) {
  const AdamWParamBuffers& b = *d.plan->b;
  const QuantizeParams& q = b.quant;
  const int64_t n = b.n, r = d.k * kBlockLen + i;
  for (int64_t t = 0; t < d.tiles; ++t) {
    const int64_t c0 = (d.tj0 + t) * kBlockLen;
    uint8_t* const bytes = d.src[t] + i * kBlockLen;
    if (!d.encoded) EncodeRow(b.master + r * n + c0, d.scale[t], bytes, kBlockLen, q.format);
    if (q.rowwise) StoreRow128(bytes, b.fp8.rowwise_data + r * n + c0);
    if (q.columnwise && !d.encoded && i % 16 == 15) {
      const int64_t i0 = i - 15;
      for (int64_t jb = 0; jb < kBlockLen; jb += 16) {
        Transpose16x16(d.src[t] + i0 * kBlockLen + jb, kBlockLen,
                       d.transposed[t] + jb * kBlockLen + i0, kBlockLen);
      }
      if (i == kBlockLen - 1) {
        StoreTileRows(d.transposed[t], b.fp8.columnwise_data + c0 * b.m + d.k * kBlockLen, b.m);
      }
    }
  }
  if (q.columnwise && d.encoded) {
    // Strips [i * S / 128, (i + 1) * S / 128) of the unit's S = 8 * tiles.
    const int64_t strips = 8 * d.tiles;
    for (int64_t sp = i * strips / kBlockLen; sp < (i + 1) * strips / kBlockLen; ++sp) {
      const int64_t t = sp / 8, jb = (sp % 8) * 16;
      for (int64_t ib = 0; ib < kBlockLen; ib += 16) {
        Transpose16x16(d.src[t] + ib * kBlockLen + jb, kBlockLen, d.strip + ib, kBlockLen);
      }
      const int64_t c = (d.tj0 + t) * kBlockLen + jb;
      StoreTileRows(d.strip, b.fp8.columnwise_data + c * b.m + d.k * kBlockLen, b.m, 16);
    }
  }
  d.next_row = i + 1;
}

// Runs the deferred rows [d.next_row, end).
void DeferredRows(Deferred& d, int64_t end) {
  if (d.plan == nullptr) return;
  for (int64_t i = d.next_row; i < end; ++i) DeferredRow(d, i);
  if (d.next_row == kBlockLen) d.plan = nullptr;
}

// Whether the encode of unit (k, [tj0, tj1)) can be deferred: full 2-D tiles.
bool Deferrable(const ParamPlan& plan, int64_t k, int64_t tj1) {
  const AdamWParamBuffers& b = *plan.b;
  return b.fp8_output && b.quant.scaling != BlockScaling::kBlock1D && (k + 1) * kBlockLen <= b.m &&
         tj1 * kBlockLen <= b.n;
}
#endif

// One work unit: band k, tiles [tj0, tj1). The previous unit's deferred
// encode (if any) runs interleaved with the update rows and is completed; this
// unit's encode is then deferred into `d` when possible, else done here.
template <InputDType kG, MomentDType kM>
void ProcessUnit(const ParamPlan& plan, int64_t k, int64_t tj0, int64_t tj1, const AdamWScalars& s,
                 UnitScratch& sc, Deferred* d) {
  const AdamWParamBuffers& b = *plan.b;
  const int64_t n = b.n;
  const int64_t r0 = k * kBlockLen;
  const int64_t rows = std::min(kBlockLen, b.m - r0);
  const int64_t c0 = tj0 * kBlockLen, c1 = std::min(n, tj1 * kBlockLen);
  const int64_t tiles = tj1 - tj0;
  auto* mom1 = static_cast<MomentT<kM>*>(b.exp_avg);
  auto* mom2 = static_cast<MomentT<kM>*>(b.exp_avg_sq);
  const auto* grad = static_cast<const char*>(b.grad);
  constexpr int64_t kGSize = kG == InputDType::kFloat32 ? 4 : 2;
  std::atomic<uint32_t>* const tensor_amax = plan.tensor_amax;
  uint32_t unit_amax = 0;  // with tensor_amax
  const bool fp8 = b.fp8_output && tensor_amax == nullptr;
  const bool col1d = fp8 && b.quant.scaling == BlockScaling::kBlock1D && b.quant.columnwise;

#if defined(__AVX2__)
  // A unit of full 2-D tiles whose scales of the last step are all known is
  // encoded as it is updated, with those scales (AdamWParamBuffers::
  // tile_scales): the bytes of a tile whose scale did not move are then made
  // from L1, not from a re-read of the master.
  float* const kept = KeptTileScales(b);
  uint8_t(*spec)[kBlockLen * kBlockLen] = nullptr;
  float spec_scale[kUnitTiles];
  if (d != nullptr && kept != nullptr && Deferrable(plan, k, tj1)) {
    bool known = true;
    for (int64_t t = 0; t < tiles; ++t) {
      spec_scale[t] = kept[k * plan.nb + tj0 + t];
      known = known && spec_scale[t] != 0.0f;
    }
    if (known) spec = (d->plan != nullptr && d->src == d->bytes) ? d->spec : d->bytes;
  }
#endif

  // A. update (+ BF16 copy) row by row over the band, amaxes per tile segment.
  std::fill(sc.tile_max, sc.tile_max + tiles, 0u);
  if (col1d) std::fill(sc.col_max, sc.col_max + (c1 - c0), 0u);
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t row = (r0 + i) * n;
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t off = row + c0 + t * kBlockLen;
      const int64_t len = std::min(kBlockLen, c1 - (c0 + t * kBlockLen));
      if (i + kPrefetchRows < rows) {
        // The unit's rows are runs of <= 4 KiB at a stride of n elements: the
        // hardware prefetchers (which stop at page boundaries) restart on
        // every row, so ask for a later row's lines.
        const int64_t ahead = off + kPrefetchRows * n;
        PrefetchSpan(b.master + ahead, len * 4, /*write=*/true);
        PrefetchSpan(mom1 + ahead, len * sizeof(MomentT<kM>), true);
        PrefetchSpan(mom2 + ahead, len * sizeof(MomentT<kM>), true);
        PrefetchSpan(grad + ahead * kGSize, len * kGSize, false);
      }
      if (b.bf16 != nullptr) {
        UpdateSpan<kG, kM, true>(b.master + off, mom1 + off, mom2 + off, grad + off * kGSize,
                                 b.bf16 + off, len, s);
      } else {
        UpdateSpan<kG, kM, false>(b.master + off, mom1 + off, mom2 + off, grad + off * kGSize,
                                  nullptr, len, s);
      }
      if (tensor_amax != nullptr) {
        unit_amax = std::max(unit_amax, RowMagnitudeMax(b.master + off, len));  // from L1
      }
      if (!fp8) continue;
      // Segment just written: in L1.
      const uint32_t rm = RowMagnitudeMax(b.master + off, len);
      sc.row_max[t][i] = rm;
      sc.tile_max[t] = std::max(sc.tile_max[t], rm);
#if defined(__AVX2__)
      if (spec != nullptr) {
        EncodeRow(b.master + off, spec_scale[t], spec[t] + i * kBlockLen, kBlockLen,
                  b.quant.format);
      }
#endif
    }
#if defined(__AVX2__)
    if (d != nullptr && d->plan != nullptr) DeferredRow(*d, i);
#endif
    if (col1d) {
      const float* __restrict p = b.master + row + c0;
      uint32_t* __restrict cm = sc.col_max;
      for (int64_t j = 0; j < c1 - c0; ++j) cm[j] = std::max(cm[j], MagnitudeBits(p[j]));
    }
  }
#if defined(__AVX2__)
  if (d != nullptr) DeferredRows(*d, kBlockLen);
#endif
  if (tensor_amax != nullptr) {
    uint32_t seen = tensor_amax->load(std::memory_order_relaxed);
    while (unit_amax > seen &&
           !tensor_amax->compare_exchange_weak(seen, unit_amax, std::memory_order_relaxed)) {
    }
  }
  if (!fp8) return;
#if defined(__AVX2__)
  if (d != nullptr && Deferrable(plan, k, tj1)) {
    const float fp8_max = Fp8Max(b.quant.format);
    for (int64_t t = 0; t < tiles; ++t) {
      const float scale =
          ComputeScale(std::bit_cast<float>(sc.tile_max[t]), fp8_max, b.quant.force_pow2_scales,
                       b.quant.amax_epsilon, InputDTypeMax(InputDType::kFloat32));
      const float scale_inv = ScaleInv(scale);
      const QuantizedLayout& l = plan.layout;
      if (b.quant.rowwise) b.fp8.rowwise_scale_inv[k * l.rowwise_scale_cols + tj0 + t] = scale_inv;
      if (b.quant.columnwise) {
        b.fp8.columnwise_scale_inv[(tj0 + t) * l.columnwise_scale_cols + k] = scale_inv;
      }
      if (spec != nullptr && scale != spec_scale[t]) {
        // The scale moved: encode the tile again with the new one.
        const float* const p = b.master + r0 * n + c0 + t * kBlockLen;
        for (int64_t i = 0; i < kBlockLen; ++i) {
          EncodeRow(p + i * n, scale, spec[t] + i * kBlockLen, kBlockLen, b.quant.format);
        }
      }
      if (kept != nullptr) kept[k * plan.nb + tj0 + t] = scale;
      d->scale[t] = scale;
    }
    d->src = spec != nullptr ? spec : d->bytes;
    d->encoded = spec != nullptr;
    d->plan = &plan;
    d->k = k;
    d->tj0 = tj0;
    d->tiles = tiles;
    d->next_row = 0;
    return;
  }
#endif
  // B/C. per tile: scales and bytes, from L2.
  for (int64_t t = 0; t < tiles; ++t) {
    EncodeTile(plan, k, tj0 + t, sc.row_max[t], sc.tile_max[t], sc.col_max + t * kBlockLen,
               sc.bytes, sc.transposed);
  }
}

// The scratch of the calling thread, made at its first step and kept (about
// 820 KiB per thread that ever ran a step: OpenMP's pool threads and callers).
// Heap, not stack: a caller's thread may have a small stack; kept, not made
// per call: a fresh block per call and thread costs page faults (it is larger
// than malloc's mmap threshold until glibc raises it) and its first-touch
// misses in every step.
struct PerThread {
  UnitScratch unit;
  Deferred deferred;
};

PerThread& ThreadScratch() {
  thread_local std::unique_ptr<PerThread> scratch;
  if (scratch == nullptr) scratch = std::make_unique<PerThread>();
  return *scratch;
}

void DispatchUnit(const ParamPlan& plan, int64_t k, int64_t tj0, int64_t tj1,
                  const AdamWScalars& call, UnitScratch& sc, Deferred* d) {
  const AdamWScalars& s = plan.b->scalars != nullptr ? *plan.b->scalars : call;
  const bool bf16_moments = plan.b->moment_dtype == MomentDType::kBFloat16;
  switch (plan.b->grad_dtype) {
    case InputDType::kFloat32:
      return bf16_moments ? ProcessUnit<InputDType::kFloat32, MomentDType::kBFloat16>(plan, k, tj0,
                                                                                      tj1, s, sc, d)
                          : ProcessUnit<InputDType::kFloat32, MomentDType::kFloat32>(plan, k, tj0,
                                                                                     tj1, s, sc, d);
    case InputDType::kBFloat16:
      return bf16_moments ? ProcessUnit<InputDType::kBFloat16, MomentDType::kBFloat16>(
                                plan, k, tj0, tj1, s, sc, d)
                          : ProcessUnit<InputDType::kBFloat16, MomentDType::kFloat32>(
                                plan, k, tj0, tj1, s, sc, d);
    case InputDType::kFloat16:
      return bf16_moments ? ProcessUnit<InputDType::kFloat16, MomentDType::kBFloat16>(plan, k, tj0,
                                                                                      tj1, s, sc, d)
                          : ProcessUnit<InputDType::kFloat16, MomentDType::kFloat32>(plan, k, tj0,
                                                                                     tj1, s, sc, d);
  }
}

// Calls fn(plan, k, tj0, tj1) for the units `range` of the flattened unit list
// of `plans` (first_unit ascending), in ascending order: [u0, u1), or the runs
// the thread claims (UnitRange).
template <typename Fn>
void ForUnits(const ParamPlan* plans, size_t num_plans, const UnitRange& range, Fn&& fn) {
  size_t p = 0;  // units only ascend (claims too): the plan search goes forward
  auto run = [&](int64_t u0, int64_t u1) {
    for (int64_t u = u0; u < u1; ++u) {
      while (p + 1 < num_plans && plans[p + 1].first_unit <= u) ++p;
      const ParamPlan& plan = plans[p];
      const int64_t local = u - plan.first_unit;
      const int64_t chunk = local % plan.chunks;
      // The band's tiles split as evenly as possible over its chunks.
      fn(plan, local / plan.chunks, chunk * plan.nb / plan.chunks,
         (chunk + 1) * plan.nb / plan.chunks);
    }
  };
  if (range.claim == nullptr) {
    run(range.u0, range.u1);
    return;
  }
  for (;;) {
    const int64_t u0 = range.claim->fetch_add(range.chunk, std::memory_order_relaxed);
    if (u0 >= range.u1) break;
    run(u0, std::min(range.u1, u0 + range.chunk));
  }
}

}  // namespace

void RunUnits(const ParamPlan* plans, size_t num_plans, const UnitRange& range,
              const AdamWScalars& s) {
  UnitScratch* const scratch = &ThreadScratch().unit;
  Deferred* deferred = nullptr;
#if defined(__AVX2__)
  deferred = &ThreadScratch().deferred;
  deferred->plan = nullptr;
#endif
  // The pending (deferred) unit carries over from one claimed run to the next.
  ForUnits(plans, num_plans, range,
           [&](const ParamPlan& plan, int64_t k, int64_t tj0, int64_t tj1) {
             DispatchUnit(plan, k, tj0, tj1, s, *scratch, deferred);
           });
#if defined(__AVX2__)
  DeferredRows(*deferred, kBlockLen);
#endif
#if defined(__SSE2__)
  _mm_sfence();  // the non-temporal stores are visible before the caller goes on
#endif
}

void EncodeTensorUnits(const ParamPlan* plans, size_t num_plans, const UnitRange& range) {
  UnitScratch& sc = ThreadScratch().unit;
  ForUnits(plans, num_plans, range,
           [&](const ParamPlan& plan, int64_t k, int64_t tj0, int64_t tj1) {
             if (plan.tensor_amax == nullptr) return;
             for (int64_t tj = tj0; tj < tj1; ++tj) {
               EncodeTileBytes(plan, k, tj, plan.tensor_scale, sc.bytes, sc.transposed,
                               /*prefetch=*/true);
             }
           });
#if defined(__SSE2__)
  _mm_sfence();
#endif
}

uint8_t EncodeFp8Branchless(float x, Fp8Format f) {
  return f == Fp8Format::kE4M3 ? EncodeFast<4, 3>(x) : EncodeFast<5, 2>(x);
}

void EncodeFp8Row(const float* p, float scale, uint8_t* out, int64_t len, Fp8Format f) {
  EncodeRow(p, scale, out, len, f);
}

}  // namespace qtx::kernels::cpu::band::QTX_BAND_NS
