// The parameters of the data-parallel sharded optimizer and parameter
// all-gather tests: reproducible FP32 values, a slice of a parameter's
// flattened matrix, the OptimizerParameterInit of a whole parameter or of one
// owner's shard, and the CPU reference's rowwise FP8 of a whole parameter
// (what gathered shards must equal byte for byte).
// Pure functions, safe from any thread.
#ifndef QTX_TESTS_TESTING_SHARDED_PARAMS_H_
#define QTX_TESTS_TESTING_SHARDED_PARAMS_H_

#include <cmath>
#include <cstdint>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "kernels/block_geometry.h"
#include "kernels/cpu/quantize_block.h"
#include "kernels/quantize_params.h"
#include "qtx/optimizer_types.h"
#include "qtx/types.h"

namespace qtx::testing {

// `count` normal values times `scale`, with magnitudes that change along the
// flattened index (2^-4 .. 2^4, in runs of 911), so that tiles get different
// scales and the owners of a cut tile different local amaxes.
inline std::vector<float> SpreadValues(int64_t count, uint32_t seed, float scale) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> v(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) {
    v[i] = d(rng) * scale * std::ldexp(1.0f, static_cast<int>((i / 911) % 9) - 4);
  }
  return v;
}

// Elements [range.begin, range.end) of `full` as a 1-D FP32 tensor.
// REQUIRES: 0 <= range.begin <= range.end <= full.size().
inline Tensor Slice(const std::vector<float>& full, ShardRange range) {
  return Tensor::FromFloat32({range.end - range.begin}, std::span<const float>(full).subspan(
                                                            range.begin, range.end - range.begin));
}
inline Tensor Slice(const std::vector<float>& full, int64_t begin, int64_t end) {
  return Slice(full, ShardRange{begin, end});
}

// A whole parameter `name` of `shape` with master values `master`.
inline OptimizerParameterInit WholeInit(const std::string& name, const std::vector<int64_t>& shape,
                                        const std::vector<float>& master,
                                        std::optional<double> lr_scale = std::nullopt) {
  OptimizerParameterInit p;
  p.name = name;
  p.shape = shape;
  p.master = Tensor::FromFloat32(shape, master);
  p.lr_scale = lr_scale;
  return p;
}

// One owner's shard `range` of parameter `name` of `shape`, whose whole
// master values are `full_master` (the shard's master is that slice).
inline OptimizerParameterInit ShardInit(const std::string& name, const std::vector<int64_t>& shape,
                                        const std::vector<float>& full_master, ShardRange range,
                                        std::optional<double> lr_scale = std::nullopt) {
  OptimizerParameterInit p;
  p.name = name;
  p.shape = shape;
  p.master = Slice(full_master, range);
  p.lr_scale = lr_scale;
  p.shard = range;
  return p;
}

// The FP8 data type of `config`'s format.
inline DType DataDType(const QuantizeConfig& config) {
  return config.format == Fp8Format::kE5M2 ? DType::kFloat8E5M2 : DType::kFloat8E4M3;
}

// A whole [M, N] parameter quantized by the CPU reference: 128x128 blocks
// (BLOCK_2D), rowwise only, with `config`'s format, pow2 and epsilon.
struct QuantizedWhole {
  std::vector<int64_t> shape;
  QuantizeConfig config;
  std::string data;   // [M, N] rowwise FP8
  std::string scale;  // [scale_rows, scale_cols] FP32
  int64_t scale_rows = 0, scale_cols = 0;
  int64_t total() const { return shape[0] * shape[1]; }
};

// kernels::cpu::QuantizeBlock of SpreadValues(m * n, seed, value_scale).
inline QuantizedWhole QuantizeWhole(int64_t m, int64_t n, const QuantizeConfig& config,
                                    uint32_t seed, float value_scale) {
  QuantizedWhole w;
  w.shape = {m, n};
  w.config = config;
  const std::vector<float> x = SpreadValues(m * n, seed, value_scale);
  const kernels::QuantizedLayout layout =
      kernels::ComputeLayout(kernels::BlockScaling::kBlock2D, m, n);
  w.scale_rows = layout.rowwise_scale_rows;
  w.scale_cols = layout.rowwise_scale_cols;
  w.data.assign(static_cast<size_t>(m * n), '\0');
  std::vector<float> scale(static_cast<size_t>(layout.RowwiseScaleCount()), -1.0f);
  kernels::QuantizeParams p;
  p.scaling = kernels::BlockScaling::kBlock2D;
  p.format =
      config.format == Fp8Format::kE5M2 ? kernels::Fp8Format::kE5M2 : kernels::Fp8Format::kE4M3;
  p.rowwise = true;
  p.columnwise = false;
  p.force_pow2_scales = config.force_pow2_scales;
  p.amax_epsilon = config.amax_epsilon;
  kernels::QuantizedBuffers out;
  out.rowwise_data = reinterpret_cast<uint8_t*>(w.data.data());
  out.rowwise_scale_inv = scale.data();
  kernels::cpu::QuantizeBlock(x.data(), kernels::InputDType::kFloat32, m, n, p, out);
  w.scale.assign(reinterpret_cast<const char*>(scale.data()), scale.size() * 4);
  return w;
}

}  // namespace qtx::testing

#endif  // QTX_TESTS_TESTING_SHARDED_PARAMS_H_
