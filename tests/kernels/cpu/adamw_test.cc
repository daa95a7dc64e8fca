// The fused host AdamW step against the scalar reference (bit for bit), its
// FP8 output against QuantizeBlock(master) (byte for byte), the branch-free
// FP8 encoder against kernels::EncodeFp8, and the gradient-norm reduction.
#include "kernels/cpu/adamw.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <new>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/block_geometry.h"
#include "kernels/cpu/adamw_band.h"
#include "kernels/cpu/quantize_block.h"
#include "kernels/fp8.h"

namespace qtx::kernels::cpu {
namespace {

// ---- the branch-free encoder ----------------------------------------------

TEST(EncodeFp8Branchless, EqualsEncodeFp8OnTiesAndSamples) {
  // Every sign/exponent/top-mantissa pattern (high 16 bits) with low halves
  // that produce exact ties, near-ties and extremes for both formats, then a
  // strided sweep over all 2^32 patterns.
  const uint32_t lows[] = {0x0000u, 0x0001u, 0x7FFFu, 0x8000u, 0x8001u, 0xFFFFu, 0x1234u, 0xC000u};
  int64_t mismatches = 0;
  for (uint32_t hi = 0; hi < 0x10000u; ++hi) {
    for (uint32_t lo : lows) {
      const float x = BitsToFloat((hi << 16) | lo);
      for (Fp8Format f : {Fp8Format::kE4M3, Fp8Format::kE5M2}) {
        if (internal::EncodeFp8Branchless(x, f) != EncodeFp8(x, f)) ++mismatches;
      }
    }
  }
  for (uint64_t u = 0; u < (uint64_t{1} << 32); u += 257) {
    const float x = BitsToFloat(static_cast<uint32_t>(u));
    for (Fp8Format f : {Fp8Format::kE4M3, Fp8Format::kE5M2}) {
      if (internal::EncodeFp8Branchless(x, f) != EncodeFp8(x, f)) ++mismatches;
    }
  }
  EXPECT_EQ(mismatches, 0);
}

// The vector row encoder (AVX2 blocks of 32 + scalar tail) on the same
// patterns, in rows of odd length (so every block position and the tail are
// hit), with scale 1 and with scales that move values across the subnormal,
// normal and saturation ranges.
TEST(EncodeFp8Row, EqualsEncodeFp8OnTiesAndSamples) {
  std::vector<float> xs;
  const uint32_t lows[] = {0x0000u, 0x0001u, 0x7FFFu, 0x8000u, 0x8001u, 0xFFFFu, 0x1234u, 0xC000u};
  for (uint32_t hi = 0; hi < 0x10000u; ++hi) {
    for (uint32_t lo : lows) xs.push_back(BitsToFloat((hi << 16) | lo));
  }
  for (uint64_t u = 0; u < (uint64_t{1} << 32); u += 4099) {
    xs.push_back(BitsToFloat(static_cast<uint32_t>(u)));
  }
  constexpr int64_t kRow = 1000 + 37;
  std::vector<uint8_t> out(kRow);
  int64_t mismatches = 0;
  for (float scale : {1.0f, 0.5f, 3.0f, 1.0f / 1024, 65536.0f}) {
    for (Fp8Format f : {Fp8Format::kE4M3, Fp8Format::kE5M2}) {
      for (size_t r = 0; r < xs.size(); r += kRow) {
        const int64_t len = std::min<int64_t>(kRow, static_cast<int64_t>(xs.size() - r));
        internal::EncodeFp8Row(xs.data() + r, scale, out.data(), len, f);
        for (int64_t j = 0; j < len; ++j) {
          if (out[j] != EncodeFp8(xs[r + j] * scale, f)) ++mismatches;
        }
      }
    }
  }
  EXPECT_EQ(mismatches, 0);
}

// ---- fused step vs reference ----------------------------------------------

// One parameter's state plus its output buffers, owned.
// FP8 output bytes that start `skew` bytes past a 64-byte boundary. The kernel
// stores a row of an FP8 copy by its alignment (non-temporal whole 64-byte
// lines in the AVX-512 build, 32-byte halves, or ordinary stores); in a
// std::vector (16 bytes past a boundary here) which rows took which path
// depended on the shape. Skew 0 (the default) aligns every row whose offset
// allows it; AdamWStepFused.EqualsReferenceAtEveryOutputAlignment tries others.
class OutBytes {
 public:
  void assign(size_t n, uint8_t v) {
    size_ = n;
    buf_.reset(static_cast<uint8_t*>(::operator new (n + skew_ + 1, std::align_val_t{64})));
    std::memset(buf_.get(), v, n + skew_ + 1);
  }
  OutBytes() = default;
  OutBytes(const OutBytes& o) { *this = o; }
  OutBytes& operator=(const OutBytes& o) {
    if (this == &o) return *this;
    skew_ = o.skew_;
    assign(o.size_, 0);
    std::memcpy(data(), o.data(), size_);
    return *this;
  }
  void set_skew(size_t skew) {  // the bytes are then all 0
    skew_ = skew;
    assign(size_, 0);
  }
  uint8_t* data() { return buf_.get() + skew_; }
  const uint8_t* data() const { return buf_.get() + skew_; }
  size_t size() const { return size_; }
  bool operator==(const OutBytes& o) const {
    return size_ == o.size_ && std::memcmp(data(), o.data(), size_) == 0;
  }

 private:
  struct Free {
    void operator()(uint8_t* p) const { ::operator delete (p, std::align_val_t{64}); }
  };
  size_t skew_ = 0, size_ = 0;
  std::unique_ptr<uint8_t, Free> buf_;
};

struct ParamState {
  int64_t m = 0, n = 0;
  MomentDType moment_dtype = MomentDType::kFloat32;
  InputDType grad_dtype = InputDType::kFloat32;
  QuantizeParams quant;
  bool fp8 = true;
  bool bf16 = false;
  std::vector<float> master;
  std::vector<uint8_t> m1, m2;  // moment bytes
  std::vector<uint8_t> grad;    // gradient bytes
  OutBytes row_data, col_data;
  std::vector<float> row_scale, col_scale;
  std::vector<uint16_t> bf16_out;
  // AdamWParamBuffers::tile_scales, kept from step to step when set.
  bool keep_tile_scales = false;
  std::vector<float> tile_scales;

  void FillOutputs(uint8_t sentinel) {
    const QuantizedLayout l = ComputeLayout(quant.scaling, m, n);
    row_data.assign(l.RowwiseDataBytes(), sentinel);
    col_data.assign(l.ColumnwiseDataBytes(), sentinel);
    row_scale.assign(l.RowwiseScaleCount(), BitsToFloat(0x7FC00000u | sentinel));
    col_scale.assign(l.ColumnwiseScaleCount(), BitsToFloat(0x7FC00000u | sentinel));
    bf16_out.assign(bf16 ? m * n : 0, static_cast<uint16_t>(sentinel * 257));
  }

  AdamWParamBuffers Buffers() {
    AdamWParamBuffers b;
    b.m = m;
    b.n = n;
    b.master = master.data();
    b.exp_avg = m1.data();
    b.exp_avg_sq = m2.data();
    b.moment_dtype = moment_dtype;
    b.grad = grad.data();
    b.grad_dtype = grad_dtype;
    b.fp8_output = fp8;
    b.quant = quant;
    b.fp8 = {quant.rowwise ? row_data.data() : nullptr, quant.rowwise ? row_scale.data() : nullptr,
             quant.columnwise ? col_data.data() : nullptr,
             quant.columnwise ? col_scale.data() : nullptr};
    b.bf16 = bf16 ? bf16_out.data() : nullptr;
    if (keep_tile_scales) {
      tile_scales.resize(static_cast<size_t>(CeilDiv(m, kBlockLen) * CeilDiv(n, kBlockLen)));
      b.tile_scales = tile_scales.data();
    }
    return b;
  }
};

size_t MomentBytes(MomentDType t) { return t == MomentDType::kFloat32 ? 4 : 2; }
size_t GradBytes(InputDType t) { return t == InputDType::kFloat32 ? 4 : 2; }

void StoreGrad(ParamState& s, int64_t i, float g) {
  switch (s.grad_dtype) {
    case InputDType::kFloat32:
      std::memcpy(s.grad.data() + 4 * i, &g, 4);
      break;
    case InputDType::kBFloat16: {
      const uint16_t h = FloatToBf16(g);
      std::memcpy(s.grad.data() + 2 * i, &h, 2);
      break;
    }
    case InputDType::kFloat16: {
      const uint16_t h = FloatToHalf(g);
      std::memcpy(s.grad.data() + 2 * i, &h, 2);
      break;
    }
  }
}

void StoreMomentValue(std::vector<uint8_t>& buf, MomentDType t, int64_t i, float v) {
  if (t == MomentDType::kFloat32) {
    std::memcpy(buf.data() + 4 * i, &v, 4);
  } else {
    const uint16_t h = FloatToBf16(v);
    std::memcpy(buf.data() + 2 * i, &h, 2);
  }
}

enum class Pattern { kRandom, kZeroGrad, kHugeGrad, kTinyGrad, kZeroMaster, kSpecials };

ParamState MakeParam(int64_t m, int64_t n, MomentDType md, InputDType gd, QuantizeParams q,
                     bool bf16, Pattern pat, uint32_t seed) {
  ParamState s;
  s.m = m;
  s.n = n;
  s.moment_dtype = md;
  s.grad_dtype = gd;
  s.quant = q;
  s.bf16 = bf16;
  const int64_t count = m * n;
  s.master.resize(count);
  s.m1.assign(count * MomentBytes(md), 0);
  s.m2.assign(count * MomentBytes(md), 0);
  s.grad.assign(count * GradBytes(gd), 0);
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> uni(0.0f, 1.0f);
  for (int64_t i = 0; i < count; ++i) {
    float w = normal(rng) * 0.05f;
    float g = normal(rng) * 1e-2f;
    float m1 = normal(rng) * 1e-3f;
    float m2 = uni(rng) * 1e-5f;
    switch (pat) {
      case Pattern::kRandom:
        break;
      case Pattern::kZeroGrad:
        g = 0.0f;
        break;
      case Pattern::kHugeGrad:
        g = (i % 3 == 0 ? 1e30f : (i % 3 == 1 ? -3e38f : 6e19f));
        break;
      case Pattern::kTinyGrad:
        g = normal(rng) * 1e-40f;  // FP32 subnormal
        m1 = 0.0f;
        m2 = 0.0f;
        break;
      case Pattern::kZeroMaster:
        w = (i % 7 == 0) ? -0.0f : 0.0f;
        break;
      case Pattern::kSpecials: {
        const float specials[] = {std::numeric_limits<float>::infinity(),
                                  -std::numeric_limits<float>::infinity(),
                                  std::numeric_limits<float>::quiet_NaN(),
                                  FLT_MAX,
                                  -FLT_MAX,
                                  1e-45f,
                                  448.0f,
                                  -0.0f};
        if (i % 5 == 0) w = specials[(i / 5) % 8];
        if (i % 11 == 0) g = specials[(i / 11) % 8];
        break;
      }
    }
    s.master[i] = w;
    StoreGrad(s, i, g);
    StoreMomentValue(s.m1, md, i, m1);
    StoreMomentValue(s.m2, md, i, m2);
  }
  return s;
}

// Compares two states byte for byte; returns a description of the first
// difference, or "" when identical.
std::string FirstDifference(const ParamState& a, const ParamState& b) {
  auto cmp = [](const void* x, const void* y, size_t bytes, size_t elem, const char* what) {
    const auto* p = static_cast<const uint8_t*>(x);
    const auto* q = static_cast<const uint8_t*>(y);
    for (size_t i = 0; i < bytes; ++i) {
      if (p[i] != q[i]) return std::string(what) + " element " + std::to_string(i / elem);
    }
    return std::string();
  };
  std::string d;
  if (!(d = cmp(a.master.data(), b.master.data(), a.master.size() * 4, 4, "master")).empty()) {
    return d;
  }
  const size_t mb = MomentBytes(a.moment_dtype);
  if (!(d = cmp(a.m1.data(), b.m1.data(), a.m1.size(), mb, "exp_avg")).empty()) return d;
  if (!(d = cmp(a.m2.data(), b.m2.data(), a.m2.size(), mb, "exp_avg_sq")).empty()) return d;
  if (a.fp8) {
    if (a.quant.rowwise) {
      if (!(d = cmp(a.row_data.data(), b.row_data.data(), a.row_data.size(), 1, "rowwise_data"))
               .empty()) {
        return d;
      }
      if (!(d = cmp(a.row_scale.data(), b.row_scale.data(), a.row_scale.size() * 4, 4,
                    "rowwise_scale_inv"))
               .empty()) {
        return d;
      }
    }
    if (a.quant.columnwise) {
      if (!(d = cmp(a.col_data.data(), b.col_data.data(), a.col_data.size(), 1, "columnwise_data"))
               .empty()) {
        return d;
      }
      if (!(d = cmp(a.col_scale.data(), b.col_scale.data(), a.col_scale.size() * 4, 4,
                    "columnwise_scale_inv"))
               .empty()) {
        return d;
      }
    }
  }
  if (a.bf16) {
    if (!(d = cmp(a.bf16_out.data(), b.bf16_out.data(), a.bf16_out.size() * 2, 2, "bf16"))
             .empty()) {
      return d;
    }
  }
  return "";
}

// Runs `steps` steps on copies of `init` with the fused kernel (at
// `threads`), once keeping no tile scales and once keeping them from step to
// step (as qtxd's optimizer does: AdamWParamBuffers::tile_scales), and with
// the reference; expects identical state and outputs after every step.
void ExpectFusedEqualsReference(const ParamState& init, const AdamWHyperParams& h, int steps,
                                int threads, double grad_scale, const std::string& label) {
  ParamState fused = init, kept = init, ref = init;
  kept.keep_tile_scales = true;
  for (int t = 1; t <= steps; ++t) {
    fused.FillOutputs(0xAA);
    kept.FillOutputs(0x77);
    ref.FillOutputs(0x55);
    const AdamWScalars s = MakeAdamWScalars(h, t, grad_scale);
    AdamWParamBuffers fb = fused.Buffers(), kb = kept.Buffers(), rb = ref.Buffers();
    AdamWStepFused({&fb, 1}, s, threads);
    AdamWStepFused({&kb, 1}, s, threads);
    AdamWReference({&rb, 1}, s);
    ASSERT_EQ(FirstDifference(fused, ref), "") << label << " step " << t;
    ASSERT_EQ(FirstDifference(kept, ref), "") << label << " step " << t << " (tile scales kept)";
  }
}

struct Shape {
  int64_t m, n;
};
const Shape kShapes[] = {{1, 1},   {3, 5},   {128, 128}, {130, 130}, {200, 300},
                         {1, 129}, {129, 1}, {256, 384}, {0, 7},     {7, 0}};

std::string Label(const Shape& sh, MomentDType md, InputDType gd, const QuantizeParams& q,
                  bool bf16, bool fp8) {
  return std::to_string(sh.m) + "x" + std::to_string(sh.n) +
         (md == MomentDType::kFloat32 ? " m=f32" : " m=bf16") +
         (gd == InputDType::kFloat32    ? " g=f32"
          : gd == InputDType::kBFloat16 ? " g=bf16"
                                        : " g=f16") +
         (fp8 ? (q.scaling == BlockScaling::kBlock1D   ? " 1D"
                 : q.scaling == BlockScaling::kBlock2D ? " 2D"
                                                       : " TENSOR")
              : " noFP8") +
         (q.format == Fp8Format::kE4M3 ? " e4m3" : " e5m2") + (q.rowwise ? " row" : "") +
         (q.columnwise ? " col" : "") + (bf16 ? " +bf16" : "");
}

TEST(AdamWStepFused, EqualsReferenceAcrossShapesDtypesAndLayouts) {
  AdamWHyperParams h;
  h.lr = 1e-3;
  h.weight_decay = 0.1;
  uint32_t seed = 1;
  for (const Shape& sh : kShapes) {
    for (MomentDType md : {MomentDType::kFloat32, MomentDType::kBFloat16}) {
      for (InputDType gd : {InputDType::kFloat32, InputDType::kBFloat16, InputDType::kFloat16}) {
        for (BlockScaling sc :
             {BlockScaling::kBlock2D, BlockScaling::kBlock1D, BlockScaling::kTensor}) {
          for (int usage = 1; usage <= 3; ++usage) {
            QuantizeParams q;
            q.scaling = sc;
            q.rowwise = usage & 1;
            q.columnwise = usage & 2;
            q.format = (seed % 4 == 0) ? Fp8Format::kE5M2 : Fp8Format::kE4M3;
            q.force_pow2_scales = (seed % 5 != 0);
            const bool bf16 = seed % 2 == 0;
            ParamState p = MakeParam(sh.m, sh.n, md, gd, q, bf16, Pattern::kRandom, seed++);
            ExpectFusedEqualsReference(p, h, 3, 2, 1.0, Label(sh, md, gd, q, bf16, true));
          }
        }
      }
    }
  }
}

// Parameters wider than one work unit (a 128-row band by up to
// band::kUnitTiles tiles): the band is split into several units (unevenly
// when the tile count does not divide), with partial edge tiles, at several
// thread counts; the widths follow kUnitTiles.
TEST(AdamWStepFused, EqualsReferenceOnWideBandsSplitIntoUnits) {
  constexpr int64_t kUnitCols = band::kUnitTiles * kBlockLen;
  const Shape shapes[] = {{130, 1100},
                          {260, 641},
                          {1, 2049},
                          {129, 1024},
                          {256, 2 * kUnitCols + 128},
                          {130, kUnitCols + 77},
                          {1, 3 * kUnitCols + 1}};
  uint32_t seed = 500;
  for (const Shape& sh : shapes) {
    for (BlockScaling sc : {BlockScaling::kBlock2D, BlockScaling::kBlock1D}) {
      for (int usage = 1; usage <= 3; ++usage) {
        QuantizeParams q;
        q.scaling = sc;
        q.rowwise = usage & 1;
        q.columnwise = usage & 2;
        q.format = seed % 2 ? Fp8Format::kE5M2 : Fp8Format::kE4M3;
        const bool bf16 = seed % 3 == 0;
        const MomentDType md = seed % 4 == 0 ? MomentDType::kBFloat16 : MomentDType::kFloat32;
        const InputDType gd = seed % 2 ? InputDType::kBFloat16 : InputDType::kFloat32;
        ParamState p = MakeParam(sh.m, sh.n, md, gd, q, bf16, Pattern::kRandom, seed++);
        for (int threads : {1, 3}) {
          ExpectFusedEqualsReference(
              p, AdamWHyperParams{}, 2, threads, 1.0,
              Label(sh, md, gd, q, bf16, true) + " threads " + std::to_string(threads));
        }
      }
    }
  }
}

// The FP8 copies' rows are stored differently by alignment (non-temporal
// 64-byte lines, 32-byte halves, or ordinary stores): the bytes are the same
// at every output alignment, with row pitches (n and m) that make rows of one
// copy alternate between 64- and 32-byte aligned.
TEST(AdamWStepFused, EqualsReferenceAtEveryOutputAlignment) {
  constexpr int64_t kUnitCols = band::kUnitTiles * kBlockLen;
  const Shape shapes[] = {{160, kUnitCols + 160}, {256, kUnitCols}};
  uint32_t seed = 4000;
  for (size_t skew : {0, 32, 16, 1}) {
    for (const Shape& sh : shapes) {
      QuantizeParams q;
      q.scaling = BlockScaling::kBlock2D;
      q.columnwise = true;
      ParamState p = MakeParam(sh.m, sh.n, MomentDType::kFloat32, InputDType::kFloat32, q, false,
                               Pattern::kRandom, seed++);
      p.row_data.set_skew(skew);
      p.col_data.set_skew(skew);
      ExpectFusedEqualsReference(p, AdamWHyperParams{}, 3, 2, 1.0,
                                 Label(sh, p.moment_dtype, p.grad_dtype, q, false, true) +
                                     " skew " + std::to_string(skew));
    }
  }
}

// Per-tensor scaling: the step folds the updated weights' max |p| unit by
// unit and casts once. One weight far larger than the rest sits at each
// corner of the tensor, of a work unit and of an edge tile in turn, so a
// fold that missed any element would compute another scale (not a power of
// two: every amax gives its own) and other bytes.
TEST(AdamWStepFused, TensorScalingAmaxSeesEveryElement) {
  constexpr int64_t kUnitCols = band::kUnitTiles * kBlockLen;
  const Shape shapes[] = {{260, 300}, {256, kUnitCols + 130}};
  uint32_t seed = 5000;
  for (const Shape& sh : shapes) {
    const int64_t m = sh.m, n = sh.n;
    const std::pair<int64_t, int64_t> spots[] = {{0, 0},
                                                 {0, n - 1},
                                                 {m - 1, 0},
                                                 {m - 1, n - 1},
                                                 {127, 127},
                                                 {128, 128},
                                                 {m / 2, n / 2},
                                                 {129, n - 2},
                                                 {0, kBlockLen - 1},
                                                 {m - 1, std::min<int64_t>(n - 1, kUnitCols - 1)}};
    for (const auto& [r, c] : spots) {
      QuantizeParams q;
      q.scaling = BlockScaling::kTensor;
      q.columnwise = true;
      q.force_pow2_scales = false;
      ParamState p = MakeParam(m, n, MomentDType::kFloat32, InputDType::kFloat32, q, false,
                               Pattern::kRandom, seed++);
      p.master[r * n + c] = (seed % 2 ? 1000.0f : -1000.0f);
      for (int threads : {1, 3}) {
        ExpectFusedEqualsReference(p, AdamWHyperParams{}, 1, threads, 1.0,
                                   std::to_string(m) + "x" + std::to_string(n) + " large at (" +
                                       std::to_string(r) + ", " + std::to_string(c) + ") threads " +
                                       std::to_string(threads));
      }
    }
  }
}

TEST(AdamWStepFused, EqualsReferenceWithoutFp8Output) {
  AdamWHyperParams h;
  for (MomentDType md : {MomentDType::kFloat32, MomentDType::kBFloat16}) {
    ParamState p = MakeParam(200, 300, md, InputDType::kBFloat16, QuantizeParams{}, true,
                             Pattern::kRandom, 77);
    p.fp8 = false;
    ExpectFusedEqualsReference(p, h, 2, 2, 1.0, "bf16 only");
  }
}

TEST(AdamWStepFused, EqualsReferenceOnAdversarialInputs) {
  const Pattern patterns[] = {Pattern::kZeroGrad, Pattern::kHugeGrad, Pattern::kTinyGrad,
                              Pattern::kZeroMaster, Pattern::kSpecials};
  uint32_t seed = 1000;
  for (Pattern pat : patterns) {
    for (double wd : {0.0, 0.01}) {
      for (bool bias_correction : {true, false}) {
        for (double eps : {1e-8, 0.0}) {
          for (MomentDType md : {MomentDType::kFloat32, MomentDType::kBFloat16}) {
            for (BlockScaling sc :
                 {BlockScaling::kBlock2D, BlockScaling::kBlock1D, BlockScaling::kTensor}) {
              AdamWHyperParams h;
              h.weight_decay = wd;
              h.bias_correction = bias_correction;
              h.eps = eps;
              QuantizeParams q;
              q.scaling = sc;
              q.columnwise = true;
              ParamState p = MakeParam(130, 257, md, InputDType::kFloat32, q, true, pat, seed++);
              const std::string label =
                  "pattern " + std::to_string(static_cast<int>(pat)) + " wd=" + std::to_string(wd) +
                  (bias_correction ? " bc" : " nobc") + " eps=" + std::to_string(eps) +
                  Label({130, 257}, md, InputDType::kFloat32, q, true, true);
              ExpectFusedEqualsReference(p, h, 2, 2, 1.0, label);
            }
          }
        }
      }
    }
  }
}

TEST(AdamWStepFused, EqualsReferenceWithGradScaleAndOddHyperParams) {
  AdamWHyperParams h;
  h.lr = 0.37;
  h.beta1 = 0.5;
  h.beta2 = 0.75;
  h.eps = 1e-3;
  h.weight_decay = 0.9;
  QuantizeParams q;
  q.scaling = BlockScaling::kBlock2D;
  q.columnwise = true;
  q.amax_epsilon = 1e-2f;
  ParamState p = MakeParam(300, 200, MomentDType::kFloat32, InputDType::kFloat32, q, false,
                           Pattern::kRandom, 5);
  ExpectFusedEqualsReference(p, h, 4, 2, 0.3125, "grad_scale");
}

TEST(AdamWStepFused, ResultIndependentOfThreadCount) {
  QuantizeParams q;
  q.scaling = BlockScaling::kBlock2D;
  q.columnwise = true;
  const ParamState init = MakeParam(520, 390, MomentDType::kBFloat16, InputDType::kBFloat16, q,
                                    true, Pattern::kRandom, 9);
  AdamWHyperParams h;
  ParamState one = init, many = init;
  one.FillOutputs(0x11);
  many.FillOutputs(0x22);
  const AdamWScalars s = MakeAdamWScalars(h, 1, 1.0);
  AdamWParamBuffers b1 = one.Buffers(), b2 = many.Buffers();
  AdamWStepFused({&b1, 1}, s, 1);
  AdamWStepFused({&b2, 1}, s, 7);
  EXPECT_EQ(FirstDifference(one, many), "");
}

// One step of every parameter of `fused` in one AdamWStepFused call (with
// `threads`) and of `ref` by AdamWReference (outputs pre-filled with
// different bytes); expects identical state and outputs, parameter by parameter.
void StepManyAndExpectEqual(std::vector<ParamState>& fused, std::vector<ParamState>& ref,
                            const AdamWScalars& s, int threads, const std::string& label) {
  std::vector<AdamWParamBuffers> fb, rb;
  for (auto& p : fused) {
    p.FillOutputs(0x01);
    fb.push_back(p.Buffers());
  }
  for (auto& p : ref) {
    p.FillOutputs(0x02);
    rb.push_back(p.Buffers());
  }
  AdamWStepFused(fb, s, threads);
  AdamWReference(rb, s);
  for (size_t i = 0; i < fused.size(); ++i) {
    EXPECT_EQ(FirstDifference(fused[i], ref[i]), "") << label << " param " << i;
  }
}

// Threads that claim runs of units from a shared counter (SetUnitClaimChunk)
// instead of one contiguous run each: the same bytes as the reference, for
// one wide parameter split into units and for several parameters in one call
// (a claimed run may cross from one parameter to the next), at run lengths
// that divide the unit count and that do not.
TEST(AdamWStepFused, ClaimedUnitRunsEqualReference) {
  const int64_t default_chunk = internal::UnitClaimChunk();
  EXPECT_EQ(default_chunk, 4);
  struct ClaimGuard {
    int64_t chunk;
    ~ClaimGuard() { internal::SetUnitClaimChunk(chunk); }
  } guard{default_chunk};
  EXPECT_FALSE(internal::SetUnitClaimChunk(-1));
  EXPECT_EQ(internal::UnitClaimChunk(), default_chunk);
  // Runs shorten so that every thread has about four to claim.
  EXPECT_EQ(internal::ClaimRunLength(256, 16), 4);
  EXPECT_EQ(internal::ClaimRunLength(1000, 16), 4);
  EXPECT_EQ(internal::ClaimRunLength(128, 16), 2);
  EXPECT_EQ(internal::ClaimRunLength(8, 8), 1);
  EXPECT_EQ(internal::ClaimRunLength(1, 1), 1);
  constexpr int64_t kUnitCols = band::kUnitTiles * kBlockLen;
  QuantizeParams q;
  q.scaling = BlockScaling::kBlock2D;
  q.columnwise = true;
  const ParamState wide = MakeParam(3 * kBlockLen + 5, 2 * kUnitCols + 300, MomentDType::kFloat32,
                                    InputDType::kBFloat16, q, true, Pattern::kRandom, 41);
  // 81 units of one band each: enough per thread for whole runs of 5 (a call
  // with fewer units per thread shortens its runs).
  const ParamState tall = MakeParam(80 * kBlockLen + 3, 200, MomentDType::kFloat32,
                                    InputDType::kFloat32, q, false, Pattern::kRandom, 43);
  std::vector<ParamState> several;
  uint32_t seed = 60;
  for (const Shape& sh : {Shape{129, 130}, Shape{1, 1}, Shape{260, kUnitCols + 9}, Shape{64, 7}}) {
    QuantizeParams qp;
    qp.scaling = seed % 2 ? BlockScaling::kBlock1D : BlockScaling::kBlock2D;
    qp.columnwise = true;
    several.push_back(MakeParam(sh.m, sh.n, MomentDType::kFloat32, InputDType::kFloat32, qp, false,
                                Pattern::kRandom, seed++));
  }
  for (int64_t chunk : {0, 1, 2, 5}) {  // 0: contiguous runs
    ASSERT_TRUE(internal::SetUnitClaimChunk(chunk));
    ASSERT_EQ(internal::UnitClaimChunk(), chunk);
    ASSERT_EQ(internal::ClaimRunLength(81, 4), chunk);  // the tall parameter's runs are whole
    for (int threads : {2, 4}) {
      const std::string label =
          "claim " + std::to_string(chunk) + " threads " + std::to_string(threads);
      ExpectFusedEqualsReference(wide, AdamWHyperParams{}, 2, threads, 1.0, label);
      ExpectFusedEqualsReference(tall, AdamWHyperParams{}, 1, threads, 1.0, label + " tall");
      std::vector<ParamState> fused = several, ref = several;
      StepManyAndExpectEqual(fused, ref, MakeAdamWScalars(AdamWHyperParams{}, 1, 1.0), threads,
                             label);
    }
  }
}

TEST(AdamWStepFused, ManyParametersInOneCallEqualReference) {
  std::vector<ParamState> fused, ref;
  uint32_t seed = 300;
  const Shape shapes[] = {{0, 3}, {1, 1}, {129, 130}, {5, 0}, {64, 1000}, {300, 2}};
  for (const Shape& sh : shapes) {
    QuantizeParams q;
    q.scaling = seed % 2 ? BlockScaling::kBlock1D : BlockScaling::kBlock2D;
    q.columnwise = true;
    ParamState p = MakeParam(sh.m, sh.n, seed % 3 ? MomentDType::kFloat32 : MomentDType::kBFloat16,
                             seed % 2 ? InputDType::kBFloat16 : InputDType::kFloat32, q,
                             seed % 2 == 0, Pattern::kRandom, seed);
    ++seed;
    fused.push_back(p);
    ref.push_back(p);
  }
  AdamWHyperParams h;
  for (int t = 1; t <= 3; ++t) {
    StepManyAndExpectEqual(fused, ref, MakeAdamWScalars(h, t, 1.0), 2, "step " + std::to_string(t));
  }
}

// Per-parameter constants (a group whose parameters have their own weight
// decay or learning rate): one fused call equals every parameter stepped
// alone with its own constants, and the call's constants apply where a
// parameter has none.
TEST(AdamWStepFused, PerParameterScalarsEqualEachParameterSteppedAlone) {
  const Shape shapes[] = {{130, 200}, {1, 77}, {256, 128}, {3, 5}};
  AdamWHyperParams group;
  group.lr = 1e-2;
  group.weight_decay = 0.1;
  // Parameter k: (weight_decay, lr_scale), or none (the group's).
  const double own[][2] = {{0.0, 1.0}, {-1, -1}, {0.3, 0.25}, {0.1, 2.0}};
  std::vector<ParamState> fused, alone, ref_field;
  for (size_t k = 0; k < std::size(shapes); ++k) {
    QuantizeParams q;
    q.scaling = BlockScaling::kBlock2D;
    q.columnwise = true;
    ParamState p = MakeParam(shapes[k].m, shapes[k].n, MomentDType::kFloat32, InputDType::kBFloat16,
                             q, true, Pattern::kRandom, 700 + k);
    fused.push_back(p);
    alone.push_back(p);
    ref_field.push_back(p);
  }
  for (int t = 1; t <= 3; ++t) {
    const AdamWScalars call = MakeAdamWScalars(group, t, 0.75);
    std::vector<AdamWScalars> scalars(std::size(shapes));
    std::vector<AdamWParamBuffers> fb, rb;
    for (size_t k = 0; k < std::size(shapes); ++k) {
      AdamWHyperParams h = group;
      if (own[k][0] >= 0) {
        h.weight_decay = own[k][0];
        h.lr = group.lr * own[k][1];
      }
      scalars[k] = MakeAdamWScalars(h, t, 0.75);
      fused[k].FillOutputs(0x11);
      ref_field[k].FillOutputs(0x22);
      alone[k].FillOutputs(0x33);
      fb.push_back(fused[k].Buffers());
      rb.push_back(ref_field[k].Buffers());
      if (own[k][0] >= 0) {
        fb.back().scalars = &scalars[k];
        rb.back().scalars = &scalars[k];
      }
      AdamWParamBuffers ab = alone[k].Buffers();
      AdamWReference({&ab, 1}, scalars[k]);
    }
    AdamWStepFused(fb, call, 2);
    AdamWReference(rb, call);
    for (size_t k = 0; k < std::size(shapes); ++k) {
      EXPECT_EQ(FirstDifference(fused[k], alone[k]), "") << "param " << k << " step " << t;
      EXPECT_EQ(FirstDifference(ref_field[k], alone[k]), "") << "param " << k << " step " << t;
    }
    // Different constants did give different weights.
    ASSERT_NE(scalars[0].decay, scalars[1].decay);
  }
}

// ---- instruction sets of the band kernel ----------------------------------
// CTest runs this binary twice: as is (the band kernel picks AVX-512 where the
// CPU has it) and with QTX_ADAMW_ISA=baseline (the AVX2 build), so every test
// here covers the ISA that BandIsa.ActiveIsa reports (and skips, saying so,
// when AVX-512 could not be exercised).

bool BaselineRequested() {
  const char* env = std::getenv("QTX_ADAMW_ISA");
  return env != nullptr && std::string(env) == "baseline";
}

TEST(BandIsa, ActiveIsa) {
  if (BaselineRequested()) {
    EXPECT_EQ(internal::ActiveBandIsa(), internal::BandIsa::kBaseline);
    return;
  }
  if (!internal::BandIsaAvailable(internal::BandIsa::kAvx512)) {
    EXPECT_EQ(internal::ActiveBandIsa(), internal::BandIsa::kBaseline);
    GTEST_SKIP() << "AVX-512 band kernel NOT exercised: not compiled in, or this CPU lacks "
                    "AVX-512 F/BW/VL/DQ/CD; only the baseline (AVX2) kernel was tested";
  }
  EXPECT_EQ(internal::ActiveBandIsa(), internal::BandIsa::kAvx512);
}

// Every available ISA in one process, each against the reference: one call
// over parameters whose units mix deferred encodes (full 2-D tiles, encoded
// while the next unit updates, also across parameters and into a partial
// band) with immediate ones (partial tiles, 1-D), at 1 and 3 threads; and the
// row encoder on every 2^32/65537-th bit pattern at odd lengths.
TEST(BandIsa, EveryAvailableIsaEqualsReference) {
  const internal::BandIsa initial = internal::ActiveBandIsa();
  bool avx512_tested = false;
  for (internal::BandIsa isa : {internal::BandIsa::kBaseline, internal::BandIsa::kAvx512}) {
    if (!internal::SetBandIsa(isa)) continue;
    avx512_tested |= isa == internal::BandIsa::kAvx512;
    const std::string name = isa == internal::BandIsa::kAvx512 ? "avx512" : "baseline";
    for (int threads : {1, 3}) {
      std::vector<ParamState> fused, ref;
      const Shape shapes[] = {{256, 640}, {200, 1024}, {128, 384}, {384, 515}, {130, 256}};
      uint32_t seed = 900;
      for (const Shape& sh : shapes) {
        QuantizeParams q;
        q.scaling = seed % 5 == 3 ? BlockScaling::kBlock1D : BlockScaling::kBlock2D;
        q.rowwise = seed % 3 != 1;
        q.columnwise = seed % 3 != 2;
        q.format = seed % 2 ? Fp8Format::kE5M2 : Fp8Format::kE4M3;
        ParamState p = MakeParam(sh.m, sh.n, MomentDType::kFloat32,
                                 seed % 2 ? InputDType::kBFloat16 : InputDType::kFloat32, q,
                                 seed % 4 == 0, Pattern::kRandom, seed);
        ++seed;
        fused.push_back(p);
        ref.push_back(p);
      }
      for (int t = 1; t <= 2; ++t) {
        StepManyAndExpectEqual(
            fused, ref, MakeAdamWScalars(AdamWHyperParams{}, t, 1.0), threads,
            name + " threads " + std::to_string(threads) + " step " + std::to_string(t));
      }
    }
    std::vector<float> xs;
    for (uint64_t u = 0; u < (uint64_t{1} << 32); u += 65537) {
      xs.push_back(BitsToFloat(static_cast<uint32_t>(u)));
    }
    std::vector<uint8_t> out(xs.size());
    int64_t mismatches = 0;
    for (int64_t len : {int64_t{1}, int64_t{15}, int64_t{16}, int64_t{63}, int64_t{64},
                        int64_t{129}, static_cast<int64_t>(xs.size())}) {
      for (Fp8Format f : {Fp8Format::kE4M3, Fp8Format::kE5M2}) {
        internal::EncodeFp8Row(xs.data(), 0.25f, out.data(), len, f);
        for (int64_t j = 0; j < len; ++j) {
          if (out[j] != EncodeFp8(xs[j] * 0.25f, f)) ++mismatches;
        }
      }
    }
    EXPECT_EQ(mismatches, 0) << name;
  }
  ASSERT_TRUE(internal::SetBandIsa(initial));
  if (!avx512_tested) {
    GTEST_SKIP() << "AVX-512 band kernel NOT exercised (not compiled in, or this CPU lacks "
                    "AVX-512); the baseline kernel passed";
  }
}

// Kept tile scales (AdamWParamBuffers::tile_scales) never change the result:
// a step stores every tile's scale there (BLOCK_2D, power-of-two scales), and
// a kept scale that is wrong (here every other tile's doubled) only means
// that tile is encoded again, and an unknown one (0) that its unit is
// encoded after its update; with non-power-of-two scales they are
// neither used nor written. Shapes of several full units (the only ones
// encoded during the update) and units with edge tiles, at 1 and 3 threads.
TEST(AdamWStepFused, KeptTileScalesAreStoredAndNeverChangeTheResult) {
  constexpr int64_t kUnitCols = band::kUnitTiles * kBlockLen;
  const Shape shapes[] = {{256, 2 * kUnitCols}, {384, kUnitCols + 256}, {260, kUnitCols + 77}};
  uint32_t seed = 900;
  for (const Shape& sh : shapes) {
    for (bool pow2 : {true, false}) {
      for (int threads : {1, 3}) {
        QuantizeParams q;
        q.scaling = BlockScaling::kBlock2D;
        q.force_pow2_scales = pow2;
        ParamState kept = MakeParam(sh.m, sh.n, MomentDType::kFloat32, InputDType::kFloat32, q,
                                    false, Pattern::kRandom, seed++);
        kept.keep_tile_scales = true;
        ParamState ref = kept;
        const std::string label = std::to_string(sh.m) + "x" + std::to_string(sh.n) +
                                  (pow2 ? " pow2" : " not pow2") + " threads " +
                                  std::to_string(threads);
        for (int t = 1; t <= 3; ++t) {
          kept.FillOutputs(0x77);
          ref.FillOutputs(0x55);
          const AdamWScalars s = MakeAdamWScalars(AdamWHyperParams{}, t, 1.0);
          AdamWParamBuffers kb = kept.Buffers(), rb = ref.Buffers();
          AdamWStepFused({&kb, 1}, s, threads);
          AdamWReference({&rb, 1}, s);
          ASSERT_EQ(FirstDifference(kept, ref), "") << label << " step " << t;
          const QuantizedLayout l = ComputeLayout(q.scaling, sh.m, sh.n);
          const int64_t nb = CeilDiv(sh.n, kBlockLen);
          for (int64_t i = 0; i < static_cast<int64_t>(kept.tile_scales.size()); ++i) {
            const int64_t k = i / nb, tj = i % nb;
            if (!pow2) {
              ASSERT_EQ(kept.tile_scales[i], 0.0f) << label << ": written without pow2";
            } else {
              // The scale of a power-of-two scale_inv is its exact reciprocal.
              ASSERT_EQ(kept.tile_scales[i] * kept.row_scale[k * l.rowwise_scale_cols + tj], 1.0f)
                  << label << " step " << t << " tile " << i;
            }
            // Wrong for the next step: every other tile doubled; the last band's
            // tiles unknown (its units are then encoded after their update).
            if (i % 2 == 1) kept.tile_scales[i] *= 2.0f;
            if (k == CeilDiv(sh.m, kBlockLen) - 1) kept.tile_scales[i] = 0.0f;
          }
        }
      }
    }
  }
}

// The FP8 copies are QuantizeBlock of the updated FP32 master, byte for byte
// (checked directly, not only through the reference).
TEST(AdamWStepFused, Fp8OutputEqualsQuantizeBlockOfMaster) {
  for (BlockScaling sc : {BlockScaling::kBlock2D, BlockScaling::kBlock1D}) {
    QuantizeParams q;
    q.scaling = sc;
    q.rowwise = true;
    q.columnwise = true;
    ParamState p = MakeParam(333, 257, MomentDType::kFloat32, InputDType::kBFloat16, q, false,
                             Pattern::kRandom, 42);
    p.FillOutputs(0xEE);
    AdamWParamBuffers b = p.Buffers();
    AdamWStepFused({&b, 1}, MakeAdamWScalars(AdamWHyperParams{}, 1, 1.0), 2);
    ParamState expect = p;
    expect.FillOutputs(0x33);
    QuantizeBlock(expect.master.data(), InputDType::kFloat32, p.m, p.n, q,
                  {expect.row_data.data(), expect.row_scale.data(), expect.col_data.data(),
                   expect.col_scale.data()});
    EXPECT_EQ(p.row_data, expect.row_data);
    EXPECT_EQ(p.col_data, expect.col_data);
    EXPECT_EQ(0, std::memcmp(p.row_scale.data(), expect.row_scale.data(), p.row_scale.size() * 4));
    EXPECT_EQ(0, std::memcmp(p.col_scale.data(), expect.col_scale.data(), p.col_scale.size() * 4));
  }
}

// The documented order, checked on one element by hand arithmetic in double
// rounded at each step (guards against the reference and the fused kernel
// drifting together).
TEST(AdamWReference, FollowsDocumentedOrderOnOneElement) {
  AdamWHyperParams h;
  h.lr = 0.01;
  h.beta1 = 0.9;
  h.beta2 = 0.99;
  h.eps = 1e-6;
  h.weight_decay = 0.5;
  const int64_t t = 3;
  float p = 0.75f, m = 0.125f, v = 0.0625f;
  const float g = -0.3f;
  const AdamWScalars s = MakeAdamWScalars(h, t, 1.0);
  EXPECT_EQ(s.decay, static_cast<float>(1.0 - 0.01 * 0.5));
  EXPECT_EQ(s.step_size, static_cast<float>(0.01 / (1.0 - std::pow(0.9, 3))));
  EXPECT_EQ(s.bc2_sqrt, static_cast<float>(std::sqrt(1.0 - std::pow(0.99, 3))));
  const float pe = static_cast<float>(p) * s.decay;
  const float me = static_cast<float>(static_cast<float>(s.beta1 * m) +
                                      static_cast<float>(s.one_minus_beta1 * g));
  const float ve = static_cast<float>(s.beta2 * v) +
                   static_cast<float>(static_cast<float>(s.one_minus_beta2 * g) * g);
  const float denom = static_cast<float>(std::sqrt(ve) / s.bc2_sqrt) + s.eps;
  const float expect = pe - static_cast<float>(static_cast<float>(s.step_size * me) / denom);

  ParamState st;
  st.m = 1;
  st.n = 1;
  st.fp8 = false;
  st.master = {p};
  st.m1.resize(4);
  st.m2.resize(4);
  std::memcpy(st.m1.data(), &m, 4);
  std::memcpy(st.m2.data(), &v, 4);
  st.grad.resize(4);
  std::memcpy(st.grad.data(), &g, 4);
  AdamWParamBuffers b = st.Buffers();
  AdamWReference({&b, 1}, s);
  EXPECT_EQ(FloatBits(st.master[0]), FloatBits(expect));
  float m_out;
  std::memcpy(&m_out, st.m1.data(), 4);
  EXPECT_EQ(FloatBits(m_out), FloatBits(me));
  // Sanity against the textbook formula in double.
  const double md = 0.9 * 0.125 + 0.1 * -0.3;
  const double vd = 0.99 * 0.0625 + 0.01 * 0.09;
  const double pd =
      0.75 * (1 - 0.005) - 0.01 / (1 - std::pow(0.9, 3)) * md /
                               (std::sqrt(vd) / std::sqrt(1 - std::pow(0.99, 3)) + 1e-6);
  EXPECT_NEAR(st.master[0], pd, 1e-6);
}

// ---- gradient norm -----------------------------------------------------------

TEST(GradSumSquares, MatchesDoubleSumAndIsThreadIndependent) {
  std::vector<ParamState> ps;
  ps.push_back(MakeParam(300, 70, MomentDType::kFloat32, InputDType::kFloat32, {}, false,
                         Pattern::kRandom, 1));
  ps.push_back(MakeParam(17, 9, MomentDType::kFloat32, InputDType::kBFloat16, {}, false,
                         Pattern::kRandom, 2));
  std::vector<AdamWParamBuffers> bs;
  double expect = 0.0;
  for (auto& p : ps) {
    bs.push_back(p.Buffers());
    for (int64_t i = 0; i < p.m * p.n; ++i) {
      const double g = LoadAsFloat(p.grad.data(), p.grad_dtype, i);
      expect += g * g;
    }
  }
  const GradNormResult one = GradSumSquares(bs, 1);
  const GradNormResult two = GradSumSquares(bs, 2);
  EXPECT_TRUE(one.all_finite);
  EXPECT_EQ(one.sum_squares, two.sum_squares);
  EXPECT_NEAR(one.sum_squares, expect, expect * 1e-12);
}

TEST(GradSumSquares, DetectsNonFinite) {
  for (float bad :
       {std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()}) {
    ParamState p = MakeParam(10, 10, MomentDType::kFloat32, InputDType::kFloat32, {}, false,
                             Pattern::kRandom, 3);
    StoreGrad(p, 57, bad);
    AdamWParamBuffers b = p.Buffers();
    EXPECT_FALSE(GradSumSquares({&b, 1}, 2).all_finite);
  }
}

}  // namespace
}  // namespace qtx::kernels::cpu
