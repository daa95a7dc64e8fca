// AdamW as torch.optim.AdamW defines it (decoupled weight decay), reduced to
// FP32 per-element arithmetic with one fixed operation order. Shared by
// kernels/cpu (fused host step and the scalar reference) and, later,
// kernels/cuda, so every backend rounds identically.
//
// Operation order (the definition; every implementation must follow it):
//
// Per-step scalars, computed in double from the group's hyper-parameters and
// the 1-based step number t, each rounded to FP32 exactly once
// (MakeAdamWScalars):
//   decay      = f32(1 - lr * weight_decay)
//   beta1      = f32(beta1)            one_minus_beta1 = f32(1 - beta1)
//   beta2      = f32(beta2)            one_minus_beta2 = f32(1 - beta2)
//   bc1        = 1 - beta1^t, bc2 = 1 - beta2^t   (both 1 without bias correction)
//   step_size  = f32(lr / bc1)
//   bc2_sqrt   = f32(sqrt(bc2))
//   eps        = f32(eps)
//   grad_scale = f32(clip coefficient), 1 when no clipping applies
//
// Per element, every operation in FP32 with round-to-nearest-even and no
// fused multiply-add (the build uses -ffp-contract=off), in this order:
//   g  = f32(grad) * grad_scale
//   p  = p * decay                                   (torch: param.mul_(1 - lr*wd))
//   m  = (beta1 * m) + (one_minus_beta1 * g)         (torch 1.13: mul_(b1).add_(g, alpha=1-b1);
//                                                     torch >= 2.0 writes lerp_, same value
//                                                     up to rounding)
//   v  = (beta2 * v) + ((one_minus_beta2 * g) * g)   (torch: mul_(b2).addcmul_(g, g, value=1-b2))
//   denom = (sqrt(v) / bc2_sqrt) + eps               (torch: (v.sqrt() / bc2_sqrt).add_(eps))
//   p  = p - ((step_size * m) / denom)               (torch: addcdiv_(m, denom, value=-step_size))
// Moments stored as BF16 are widened exactly, updated as above in FP32, the
// FP32 m and v feed the parameter update, and they are stored rounded to BF16
// (round to nearest even). The master weights are always FP32.
//
// Differences from torch.optim.AdamW are rounding only: torch's vectorized
// CPU kernels fuse some multiply-adds, and it rounds scalars at other points.
#ifndef QTX_KERNELS_ADAMW_H_
#define QTX_KERNELS_ADAMW_H_

#include <cmath>
#include <cstdint>

#include "kernels/host_device.h"

namespace qtx::kernels {

// Storage type of the moments exp_avg (m) and exp_avg_sq (v).
enum class MomentDType : int32_t { kFloat32 = 0, kBFloat16 = 1 };

// A parameter group's hyper-parameters, as torch.optim.AdamW takes them.
struct AdamWHyperParams {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 1e-2;
  bool bias_correction = true;
};

// The FP32 constants of one step (see the file comment).
struct AdamWScalars {
  float decay = 1.0f;
  float beta1 = 0.9f;
  float one_minus_beta1 = 0.1f;
  float beta2 = 0.999f;
  float one_minus_beta2 = 0.001f;
  float step_size = 1e-3f;
  float bc2_sqrt = 1.0f;
  float eps = 1e-8f;
  float grad_scale = 1.0f;
};

// Host only. REQUIRES: step >= 1 (the step being applied, 1-based).
inline AdamWScalars MakeAdamWScalars(const AdamWHyperParams& h, int64_t step, double grad_scale) {
  AdamWScalars s;
  s.decay = static_cast<float>(1.0 - h.lr * h.weight_decay);
  s.beta1 = static_cast<float>(h.beta1);
  s.one_minus_beta1 = static_cast<float>(1.0 - h.beta1);
  s.beta2 = static_cast<float>(h.beta2);
  s.one_minus_beta2 = static_cast<float>(1.0 - h.beta2);
  double bc1 = 1.0, bc2 = 1.0;
  if (h.bias_correction) {
    bc1 = 1.0 - std::pow(h.beta1, static_cast<double>(step));
    bc2 = 1.0 - std::pow(h.beta2, static_cast<double>(step));
  }
  s.step_size = static_cast<float>(h.lr / bc1);
  s.bc2_sqrt = static_cast<float>(std::sqrt(bc2));
  s.eps = static_cast<float>(h.eps);
  s.grad_scale = static_cast<float>(grad_scale);
  return s;
}

// One element's update in the documented order. `p`, `m`, `v` are FP32
// values (moments already widened); `g` is the raw gradient widened to FP32.
// Uses std::sqrt, which is an exact IEEE operation (vectorizes to sqrtps when
// math-errno is off).
QTX_HD void AdamWUpdate(float& p, float& m, float& v, float g, const AdamWScalars& s) {
#if defined(__CUDA_ARCH__)
  // nvcc contracts a*b+c into an FMA by default: spell every rounding out.
  g = __fmul_rn(g, s.grad_scale);
  p = __fmul_rn(p, s.decay);
  m = __fadd_rn(__fmul_rn(s.beta1, m), __fmul_rn(s.one_minus_beta1, g));
  v = __fadd_rn(__fmul_rn(s.beta2, v), __fmul_rn(__fmul_rn(s.one_minus_beta2, g), g));
  const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(v), s.bc2_sqrt), s.eps);
  p = __fsub_rn(p, __fdiv_rn(__fmul_rn(s.step_size, m), denom));
#else
  g = g * s.grad_scale;
  p = p * s.decay;
  m = (s.beta1 * m) + (s.one_minus_beta1 * g);
  v = (s.beta2 * v) + ((s.one_minus_beta2 * g) * g);
  const float denom = (std::sqrt(v) / s.bc2_sqrt) + s.eps;
  p = p - ((s.step_size * m) / denom);
#endif
}

}  // namespace qtx::kernels

#endif  // QTX_KERNELS_ADAMW_H_
