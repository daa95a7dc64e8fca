// Host AdamW fused with the block-scaled FP8 parameter output. See adamw.h and
// kernels/adamw.h (operation order), NUMERICS.md §2 (scales), §4 (layouts).
//
// Work split: every parameter is cut into 128x128 tiles; one OpenMP loop runs
// over the tiles of all parameters of the call (static schedule). One tile:
//   A. for each of its rows: the AdamW update of the row's <=128 contiguous
//      elements (vectorized: sqrtps/divps), then the row's |p| maximum (and
//      per-column maxima for 1-D columnwise) as unsigned compares of the
//      magnitude bits (NaN excluded, as AmaxUpdate does);
//   B. scales from the amaxes (kernels::ComputeScale, the QuantizeBlock rule);
//   C. for each row: encode RN(p * scale) with a branch-free encoder into a
//      128x128 byte tile (rowwise bytes go straight to the output), then the
//      tile is transposed into the columnwise [N, M] copy.
// The tile's master weights are re-read in B/C from L1/L2, never from memory.
#include "kernels/cpu/adamw.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <vector>

#include <omp.h>
#if defined(__SSE2__)
#include <immintrin.h>
#endif

#include "kernels/block_geometry.h"
#include "kernels/cpu/quantize_block.h"
#include "kernels/fp8.h"

namespace qtx::kernels::cpu {
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

template <InputDType kT>
inline float LoadGrad(const void* g, int64_t i) {
  if constexpr (kT == InputDType::kFloat32) {
    return static_cast<const float*>(g)[i];
  } else if constexpr (kT == InputDType::kBFloat16) {
    return std::bit_cast<float>(static_cast<uint32_t>(static_cast<const uint16_t*>(g)[i]) << 16);
  } else {
    return HalfToFloat(static_cast<const uint16_t*>(g)[i]);
  }
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

// The AdamW update of `len` contiguous elements (kernels/adamw.h order).
template <InputDType kG, MomentDType kM>
void UpdateSpan(float* __restrict p, MomentT<kM>* __restrict m, MomentT<kM>* __restrict v,
                const void* __restrict g, int64_t len, const AdamWScalars& s) {
  const AdamWScalars c = s;  // local copy: no aliasing with the stores
  for (int64_t j = 0; j < len; ++j) {
    float pj = p[j];
    float mj = LoadMoment<kM>(m, j);
    float vj = LoadMoment<kM>(v, j);
    AdamWUpdate(pj, mj, vj, LoadGrad<kG>(g, j), c);
    p[j] = pj;
    StoreMoment<kM>(m, j, mj);
    StoreMoment<kM>(v, j, vj);
  }
}

template <int E, int M>
void EncodeSpan(const float* __restrict p, float scale, uint8_t* __restrict out, int64_t len) {
  for (int64_t j = 0; j < len; ++j) out[j] = EncodeFast<E, M>(p[j] * scale);
}

template <int E, int M>
void EncodeSpanPerColumn(const float* __restrict p, const float* __restrict scale,
                         uint8_t* __restrict out, int64_t len) {
  for (int64_t j = 0; j < len; ++j) out[j] = EncodeFast<E, M>(p[j] * scale[j]);
}

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
// block at in (row pitch kBlockLen): four rounds of byte/word/dword/qword
// interleaves.
inline void Transpose16x16(const uint8_t* in, uint8_t* out, int64_t out_pitch) {
  __m128i r[16];
  for (int i = 0; i < 16; ++i) {
    r[i] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i * kBlockLen));
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

// Writes tile bytes [rows, cols] (row pitch kBlockLen) transposed into the
// columnwise copy: col_data[(c0 + j) * m + r0 + i] = tile[i][j].
void StoreTransposed(const uint8_t* tile, int64_t rows, int64_t cols, uint8_t* col_data,
                     int64_t m, int64_t r0, int64_t c0) {
  constexpr int64_t kB = 16;  // 16x16 sub-blocks keep both sides in few cache lines
  for (int64_t jb = 0; jb < cols; jb += kB) {
    const int64_t je = std::min(cols, jb + kB);
    for (int64_t ib = 0; ib < rows; ib += kB) {
      const int64_t ie = std::min(rows, ib + kB);
#if defined(__SSE2__)
      if (je - jb == kB && ie - ib == kB) {
        Transpose16x16(tile + ib * kBlockLen + jb, col_data + (c0 + jb) * m + r0 + ib, m);
        continue;
      }
#endif
      for (int64_t j = jb; j < je; ++j) {
        uint8_t* dst = col_data + (c0 + j) * m + r0;
        for (int64_t i = ib; i < ie; ++i) dst[i] = tile[i * kBlockLen + j];
      }
    }
  }
}

// max over MagnitudeBits(p[0..len)) in eight independent lanes, so that the
// compiler vectorizes it (an exact max: the order does not matter).
inline uint32_t RowMagnitudeMax(const float* __restrict p, int64_t len) {
  uint32_t lane[8] = {};
  int64_t j = 0;
  for (; j + 8 <= len; j += 8) {
    for (int l = 0; l < 8; ++l) lane[l] = std::max(lane[l], MagnitudeBits(p[j + l]));
  }
  for (; j < len; ++j) lane[0] = std::max(lane[0], MagnitudeBits(p[j]));
  uint32_t r = 0;
  for (int l = 0; l < 8; ++l) r = std::max(r, lane[l]);
  return r;
}

// Rows ahead whose lines ProcessTile prefetches.
constexpr int64_t kPrefetchRows = 4;

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

struct ParamPlan {
  const AdamWParamBuffers* b = nullptr;
  QuantizedLayout layout;
  int64_t mb = 0, nb = 0;
  int64_t first_tile = 0;  // index of tile (0, 0) in the flattened tile list
};

// Scratch of one thread: the tile's encoded bytes.
struct alignas(64) TileScratch {
  uint8_t bytes[kBlockLen * kBlockLen];
};

template <InputDType kG, MomentDType kM>
void ProcessTile(const ParamPlan& plan, int64_t k, int64_t tj, const AdamWScalars& s,
                 TileScratch& scratch) {
  const AdamWParamBuffers& b = *plan.b;
  const int64_t n = b.n;
  const int64_t r0 = k * kBlockLen, c0 = tj * kBlockLen;
  const int64_t rows = std::min(kBlockLen, b.m - r0);
  const int64_t cols = std::min(kBlockLen, n - c0);
  auto* mom1 = static_cast<MomentT<kM>*>(b.exp_avg);
  auto* mom2 = static_cast<MomentT<kM>*>(b.exp_avg_sq);
  const int64_t gsize = kG == InputDType::kFloat32 ? 4 : 2;
  const bool fp8 = b.fp8_output;
  const bool one_d = b.quant.scaling == BlockScaling::kBlock1D;
  const bool col1d = fp8 && one_d && b.quant.columnwise;

  // A. update, BF16 copy, amaxes.
  uint32_t row_max[kBlockLen];
  uint32_t col_max[kBlockLen];
  uint32_t tile_max = 0;
  if (col1d) std::fill(col_max, col_max + cols, 0u);
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t off = (r0 + i) * n + c0;
    float* p = b.master + off;
    if (i + kPrefetchRows < rows) {
      // The tile's rows are short runs at a stride of n elements: the hardware
      // prefetchers do not see them coming, so ask for a later row's lines.
      const int64_t ahead = off + kPrefetchRows * n;
      PrefetchSpan(b.master + ahead, cols * 4, /*write=*/true);
      PrefetchSpan(mom1 + ahead, cols * sizeof(MomentT<kM>), true);
      PrefetchSpan(mom2 + ahead, cols * sizeof(MomentT<kM>), true);
      PrefetchSpan(static_cast<const char*>(b.grad) + ahead * gsize, cols * gsize, false);
    }
    UpdateSpan<kG, kM>(p, mom1 + off, mom2 + off,
                       static_cast<const char*>(b.grad) + off * gsize, cols, s);
    if (b.bf16 != nullptr) {
      uint16_t* __restrict o = b.bf16 + off;
      for (int64_t j = 0; j < cols; ++j) o[j] = ToBf16(p[j]);
    }
    if (!fp8) continue;
    const uint32_t rm = RowMagnitudeMax(p, cols);
    if (col1d) {
      for (int64_t j = 0; j < cols; ++j) col_max[j] = std::max(col_max[j], MagnitudeBits(p[j]));
    }
    row_max[i] = rm;
    tile_max = std::max(tile_max, rm);
  }
  if (!fp8) return;

  // B/C. scales and bytes.
  const QuantizeParams& q = b.quant;
  const float fp8_max = Fp8Max(q.format);
  const float value_for_inf = InputDTypeMax(InputDType::kFloat32);
  auto scale_of = [&](uint32_t amax_bits) {
    return ComputeScale(std::bit_cast<float>(amax_bits), fp8_max, q.force_pow2_scales,
                        q.amax_epsilon, value_for_inf);
  };
  const QuantizedLayout& l = plan.layout;
  if (!one_d) {
    const float scale = scale_of(tile_max);
    const float scale_inv = ScaleInv(scale);
    if (q.rowwise) b.fp8.rowwise_scale_inv[k * l.rowwise_scale_cols + tj] = scale_inv;
    if (q.columnwise) b.fp8.columnwise_scale_inv[tj * l.columnwise_scale_cols + k] = scale_inv;
    for (int64_t i = 0; i < rows; ++i) {
      const int64_t off = (r0 + i) * n + c0;
      uint8_t* dst = q.columnwise ? scratch.bytes + i * kBlockLen : b.fp8.rowwise_data + off;
      EncodeRow(b.master + off, scale, dst, cols, q.format);
      if (q.columnwise && q.rowwise) std::memcpy(b.fp8.rowwise_data + off, dst, cols);
    }
    if (q.columnwise) StoreTransposed(scratch.bytes, rows, cols, b.fp8.columnwise_data, b.m, r0, c0);
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
      EncodeRowPerColumn(b.master + (r0 + i) * n + c0, col_scale, scratch.bytes + i * kBlockLen,
                         cols, q.format);
    }
    StoreTransposed(scratch.bytes, rows, cols, b.fp8.columnwise_data, b.m, r0, c0);
  }
}

void DispatchTile(const ParamPlan& plan, int64_t k, int64_t tj, const AdamWScalars& s,
                  TileScratch& scratch) {
  const bool bf16_moments = plan.b->moment_dtype == MomentDType::kBFloat16;
  switch (plan.b->grad_dtype) {
    case InputDType::kFloat32:
      return bf16_moments
                 ? ProcessTile<InputDType::kFloat32, MomentDType::kBFloat16>(plan, k, tj, s, scratch)
                 : ProcessTile<InputDType::kFloat32, MomentDType::kFloat32>(plan, k, tj, s, scratch);
    case InputDType::kBFloat16:
      return bf16_moments
                 ? ProcessTile<InputDType::kBFloat16, MomentDType::kBFloat16>(plan, k, tj, s,
                                                                               scratch)
                 : ProcessTile<InputDType::kBFloat16, MomentDType::kFloat32>(plan, k, tj, s,
                                                                              scratch);
    case InputDType::kFloat16:
      return bf16_moments
                 ? ProcessTile<InputDType::kFloat16, MomentDType::kBFloat16>(plan, k, tj, s, scratch)
                 : ProcessTile<InputDType::kFloat16, MomentDType::kFloat32>(plan, k, tj, s, scratch);
  }
}

void ZeroScales(const AdamWParamBuffers& b, const QuantizedLayout& l) {
  if (!b.fp8_output) return;
  if (b.quant.rowwise && l.RowwiseScaleCount() > 0) {
    std::memset(b.fp8.rowwise_scale_inv, 0, sizeof(float) * l.RowwiseScaleCount());
  }
  if (b.quant.columnwise && l.ColumnwiseScaleCount() > 0) {
    std::memset(b.fp8.columnwise_scale_inv, 0, sizeof(float) * l.ColumnwiseScaleCount());
  }
}

constexpr int64_t kNormChunk = 4096;

template <InputDType kG>
double ChunkSumSquares(const void* g, int64_t begin, int64_t end) {
  // Eight independent lanes (vectorizable without reassociating a single
  // sum), folded in a fixed order: the result depends only on the data.
  double lane[8] = {};
  int64_t i = begin;
  for (; i + 8 <= end; i += 8) {
    for (int l = 0; l < 8; ++l) {
      const double x = LoadGrad<kG>(g, i + l);
      lane[l] += x * x;
    }
  }
  for (int l = 0; i < end; ++i, ++l) {
    const double x = LoadGrad<kG>(g, i);
    lane[l] += x * x;
  }
  return ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
}

double ChunkSumSquaresDispatch(const void* g, InputDType t, int64_t begin, int64_t end) {
  switch (t) {
    case InputDType::kFloat32:
      return ChunkSumSquares<InputDType::kFloat32>(g, begin, end);
    case InputDType::kBFloat16:
      return ChunkSumSquares<InputDType::kBFloat16>(g, begin, end);
    case InputDType::kFloat16:
      return ChunkSumSquares<InputDType::kFloat16>(g, begin, end);
  }
  return 0.0;
}

}  // namespace

void AdamWStepFused(std::span<const AdamWParamBuffers> params, const AdamWScalars& s,
                    int num_threads) {
  std::vector<ParamPlan> plans;  // non-empty parameters only
  std::vector<int64_t> first_tiles;
  plans.reserve(params.size());
  int64_t tiles = 0;
  for (const AdamWParamBuffers& b : params) {
    ParamPlan plan;
    plan.b = &b;
    plan.layout = ComputeLayout(b.quant.scaling, b.m, b.n);
    ZeroScales(b, plan.layout);  // padding entries stay 0, as QuantizeBlock writes them
    if (b.m == 0 || b.n == 0) continue;
    plan.mb = CeilDiv(b.m, kBlockLen);
    plan.nb = CeilDiv(b.n, kBlockLen);
    plan.first_tile = tiles;
    tiles += plan.mb * plan.nb;
    plans.push_back(plan);
    first_tiles.push_back(plan.first_tile);
  }
  if (tiles == 0) return;
  const int threads = num_threads > 0 ? num_threads : omp_get_max_threads();
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    TileScratch scratch;
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tiles; ++t) {
      const size_t p =
          std::upper_bound(first_tiles.begin(), first_tiles.end(), t) - first_tiles.begin() - 1;
      const ParamPlan& plan = plans[p];
      const int64_t local = t - plan.first_tile;
      DispatchTile(plan, local / plan.nb, local % plan.nb, s, scratch);
    }
  }
}

void AdamWReference(std::span<const AdamWParamBuffers> params, const AdamWScalars& s) {
  for (const AdamWParamBuffers& b : params) {
    const int64_t count = b.m * b.n;
    for (int64_t i = 0; i < count; ++i) {
      float g = LoadAsFloat(b.grad, b.grad_dtype, i);
      float p = b.master[i];
      float m, v;
      if (b.moment_dtype == MomentDType::kFloat32) {
        m = static_cast<const float*>(b.exp_avg)[i];
        v = static_cast<const float*>(b.exp_avg_sq)[i];
      } else {
        m = Bf16ToFloat(static_cast<const uint16_t*>(b.exp_avg)[i]);
        v = Bf16ToFloat(static_cast<const uint16_t*>(b.exp_avg_sq)[i]);
      }
      g = g * s.grad_scale;
      p = p * s.decay;
      m = s.beta1 * m;
      m = m + s.one_minus_beta1 * g;
      float gg = s.one_minus_beta2 * g;
      gg = gg * g;
      v = s.beta2 * v;
      v = v + gg;
      float denom = std::sqrt(v);
      denom = denom / s.bc2_sqrt;
      denom = denom + s.eps;
      float update = s.step_size * m;
      update = update / denom;
      p = p - update;
      b.master[i] = p;
      if (b.moment_dtype == MomentDType::kFloat32) {
        static_cast<float*>(b.exp_avg)[i] = m;
        static_cast<float*>(b.exp_avg_sq)[i] = v;
      } else {
        static_cast<uint16_t*>(b.exp_avg)[i] = FloatToBf16(m);
        static_cast<uint16_t*>(b.exp_avg_sq)[i] = FloatToBf16(v);
      }
    }
    if (b.fp8_output) QuantizeBlock(b.master, InputDType::kFloat32, b.m, b.n, b.quant, b.fp8);
    if (b.bf16 != nullptr) {
      for (int64_t i = 0; i < count; ++i) b.bf16[i] = FloatToBf16(b.master[i]);
    }
  }
}

GradNormResult GradSumSquares(std::span<const AdamWParamBuffers> params, int num_threads) {
  struct Chunk {
    const AdamWParamBuffers* b;
    int64_t begin, end;
  };
  std::vector<Chunk> chunks;
  for (const AdamWParamBuffers& b : params) {
    const int64_t count = b.m * b.n;
    for (int64_t i = 0; i < count; i += kNormChunk) {
      chunks.push_back({&b, i, std::min(count, i + kNormChunk)});
    }
  }
  std::vector<double> partial(chunks.size());
  const int threads = num_threads > 0 ? num_threads : omp_get_max_threads();
  const int64_t nchunks = static_cast<int64_t>(chunks.size());
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (int64_t c = 0; c < nchunks; ++c) {
    partial[c] = ChunkSumSquaresDispatch(chunks[c].b->grad, chunks[c].b->grad_dtype,
                                         chunks[c].begin, chunks[c].end);
  }
  GradNormResult r;
  for (double x : partial) r.sum_squares += x;
  r.all_finite = std::isfinite(r.sum_squares);
  return r;
}

std::vector<double> GradChunkSumSquares(const AdamWParamBuffers& b, int num_threads) {
  const int64_t count = b.m * b.n;
  const int64_t nchunks = (count + kNormChunk - 1) / kNormChunk;
  std::vector<double> partial(nchunks);
  const int threads = num_threads > 0 ? num_threads : omp_get_max_threads();
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (int64_t c = 0; c < nchunks; ++c) {
    partial[c] = ChunkSumSquaresDispatch(b.grad, b.grad_dtype, c * kNormChunk,
                                         std::min(count, (c + 1) * kNormChunk));
  }
  return partial;
}

namespace internal {
uint8_t EncodeFp8Branchless(float x, Fp8Format f) {
  return f == Fp8Format::kE4M3 ? EncodeFast<4, 3>(x) : EncodeFast<5, 2>(x);
}
}  // namespace internal

}  // namespace qtx::kernels::cpu
