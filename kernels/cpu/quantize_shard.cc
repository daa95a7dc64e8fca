// CPU reference of the exact all-gather's shard steps (docs/numerics.md §5):
// boundary amaxes, their combination, the shard quantizer and the assembly
// of every rank's shard into the GEMM-ready tensor. Shares its workers with
// QuantizeBlock (quantize_workers.h).
#include "kernels/cpu/quantize_shard.h"

#include <algorithm>
#include <cstring>

#include "kernels/cpu/quantize_tensor.h"
#include "kernels/cpu/quantize_workers.h"
#include "kernels/fp8.h"

namespace qtx::kernels::cpu {
namespace {

using internal::BoundaryAmax;
using internal::LocalRows;
using internal::Outputs;
using internal::RowRange;

template <InputDType kT>
void BoundaryAmaxTyped(const void* in, const ShardGeometry& g, BlockScaling s, float* first,
                       float* last) {
  const int64_t len = BoundaryAmaxLength(s, g);
  for (int which = 0; which < 2; ++which) {
    const int64_t k = which == 0 ? g.first_block() : g.last_block();
    float* out = which == 0 ? first : last;
    const RowRange rr = LocalRows(g, k);
    std::fill(out, out + len, 0.0f);
    for (int64_t i = rr.lo; i < rr.hi; ++i) {
      for (int64_t col = 0; col < g.n; ++col) {
        const int64_t idx = s == BlockScaling::kBlock1D ? col : col / kBlockLen;
        out[idx] = AmaxUpdate(out[idx], LoadAs<kT>(in, i * g.n + col));
      }
    }
  }
}

}  // namespace

void ShardBoundaryAmax(const void* input, InputDType dtype, const ShardGeometry& g,
                       BlockScaling scaling, float* first, float* last) {
  if (g.m == 0) return;
  if (scaling == BlockScaling::kTensor) {
    first[0] = last[0] = TensorAmax(input, dtype, g.m * g.n);
    return;
  }
  switch (dtype) {
    case InputDType::kFloat32:
      return BoundaryAmaxTyped<InputDType::kFloat32>(input, g, scaling, first, last);
    case InputDType::kBFloat16:
      return BoundaryAmaxTyped<InputDType::kBFloat16>(input, g, scaling, first, last);
    case InputDType::kFloat16:
      return BoundaryAmaxTyped<InputDType::kFloat16>(input, g, scaling, first, last);
  }
}

void CombineBoundaryAmax(int world_size, const ShardGeometry* geoms, const float* const* firsts,
                         const float* const* lasts, int rank, BlockScaling scaling,
                         float* first_out, float* last_out) {
  const ShardGeometry& me = geoms[rank];
  if (me.m == 0) return;
  if (scaling == BlockScaling::kTensor) {  // one block, shared by every rank
    float amax = 0.0f;
    for (int r = 0; r < world_size; ++r) {
      if (geoms[r].m > 0) amax = std::max(amax, firsts[r][0]);
    }
    first_out[0] = last_out[0] = amax;
    return;
  }
  const int64_t len = BoundaryAmaxLength(scaling, me);
  for (int which = 0; which < 2; ++which) {
    const int64_t k = which == 0 ? me.first_block() : me.last_block();
    float* out = which == 0 ? first_out : last_out;
    std::fill(out, out + len, 0.0f);
    for (int r = 0; r < world_size; ++r) {
      if (geoms[r].m == 0) continue;
      const float* v = nullptr;
      if (geoms[r].first_block() == k)
        v = firsts[r];
      else if (geoms[r].last_block() == k)
        v = lasts[r];
      if (v == nullptr) continue;
      for (int64_t j = 0; j < len; ++j) out[j] = std::max(out[j], v[j]);
    }
  }
}

void QuantizeShard(const void* input, InputDType dtype, const ShardGeometry& g,
                   const QuantizeParams& params, const float* first_amax, const float* last_amax,
                   const ShardBuffers& out) {
  if (params.scaling == BlockScaling::kTensor) {
    const float amax = first_amax != nullptr ? first_amax[0] : TensorAmax(input, dtype, g.m * g.n);
    return QuantizeTensorWithAmax(input, dtype, g.m, g.n, amax, params, out);
  }
  Outputs o;
  const int64_t nb = g.nb();
  if (params.rowwise) {
    o.row_data = out.rowwise_data;
    o.row_scale = out.rowwise_scale_inv;
    o.row_scale_ld = g.m;  // 1-D [nb, m]
    o.row_k_stride = nb;   // 2-D [num_block_rows, nb]
    o.row_j_stride = 1;
  }
  if (params.columnwise) {
    o.col_data = out.columnwise_data;
    o.col_data_ld = g.m;
    o.col_scale = out.columnwise_scale_inv;
    o.col_scale_ld = g.n;  // 1-D [num_block_rows, n]
    o.col_k_stride = nb;   // 2-D [num_block_rows, nb]
    o.col_j_stride = 1;
  }
  internal::QuantizeWorkers(input, dtype, g, params, BoundaryAmax{first_amax, last_amax}, o);
}

void AssembleShards(int world_size, const ShardGeometry* geoms, const ShardConstBuffers* shards,
                    const QuantizeParams& p, const QuantizedBuffers& out) {
  int64_t m = 0;
  for (int r = 0; r < world_size; ++r) m += geoms[r].m;
  const int64_t n = world_size > 0 ? geoms[0].n : 0;
  const int64_t nb = CeilDiv(n, kBlockLen);
  const QuantizedLayout l = ComputeLayout(p.scaling, m, n);
  internal::ZeroScales(p, l, out);
  if (p.scaling == BlockScaling::kTensor) {
    // Every non-empty shard was cast with the same combined amax: its
    // scale_inv is the tensor's. With none, the tensor's amax is 0.
    const ShardConstBuffers* src = nullptr;
    for (int r = 0; r < world_size && src == nullptr; ++r) {
      if (geoms[r].m > 0 && n > 0) src = &shards[r];
    }
    const float empty = ScaleInv(TensorScale(0.0f, p.format, p.force_pow2_scales, p.amax_epsilon));
    if (p.rowwise) out.rowwise_scale_inv[0] = src ? src->rowwise_scale_inv[0] : empty;
    if (p.columnwise) out.columnwise_scale_inv[0] = src ? src->columnwise_scale_inv[0] : empty;
  }
  for (int r = 0; r < world_size; ++r) {
    const ShardGeometry& g = geoms[r];
    const ShardConstBuffers& s = shards[r];
    if (g.m == 0 || n == 0) continue;
    const int64_t o = g.row_offset, k0 = g.first_block(), nk = g.num_block_rows();
    if (p.rowwise) {
      if (out.rowwise_data + o * n != s.rowwise_data) {
        std::memmove(out.rowwise_data + o * n, s.rowwise_data, g.m * n);
      }
      if (p.scaling == BlockScaling::kTensor) {
        // scale_inv[0]: above.
      } else if (p.scaling == BlockScaling::kBlock1D) {
        for (int64_t b = 0; b < nb; ++b) {
          std::memcpy(out.rowwise_scale_inv + b * l.rowwise_scale_cols + o,
                      s.rowwise_scale_inv + b * g.m, sizeof(float) * g.m);
        }
      } else {
        for (int64_t kk = 0; kk < nk; ++kk) {
          std::memcpy(out.rowwise_scale_inv + (k0 + kk) * l.rowwise_scale_cols,
                      s.rowwise_scale_inv + kk * nb, sizeof(float) * nb);
        }
      }
    }
    if (p.columnwise) {
      for (int64_t col = 0; col < n; ++col) {
        std::memcpy(out.columnwise_data + col * m + o, s.columnwise_data + col * g.m, g.m);
      }
      if (p.scaling == BlockScaling::kTensor) {
        // scale_inv[0]: above.
      } else if (p.scaling == BlockScaling::kBlock1D) {
        for (int64_t kk = 0; kk < nk; ++kk) {
          std::memcpy(out.columnwise_scale_inv + (k0 + kk) * l.columnwise_scale_cols,
                      s.columnwise_scale_inv + kk * n, sizeof(float) * n);
        }
      } else {
        for (int64_t kk = 0; kk < nk; ++kk) {
          for (int64_t tj = 0; tj < nb; ++tj) {
            out.columnwise_scale_inv[tj * l.columnwise_scale_cols + k0 + kk] =
                s.columnwise_scale_inv[kk * nb + tj];
          }
        }
      }
    }
  }
}

}  // namespace qtx::kernels::cpu
