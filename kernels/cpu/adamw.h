// Host AdamW fused with the parameter output (kernels/adamw.h defines the
// arithmetic): one pass over each 128x128 tile of a parameter updates the FP32
// master weights and both moments, reduces the tile's amaxes, computes the
// scales and writes the FP8 copies (and optionally a BF16 copy) while the tile
// is still in cache. The FP8 bytes and scales are exactly those of
// QuantizeBlock(updated master, FP32 input) — docs/numerics.md §2-§4 — for both
// BLOCK_2D and BLOCK_1D (a 1x128 row block and a 128x1 column block each lie
// inside one 128x128 tile). A TENSOR (per-tensor scaling) parameter needs its
// whole amax first: the update pass folds it, then a second pass over its
// tiles casts them; the bytes are QuantizeTensor(updated master)'s.
//
// AdamWReference is the plain scalar definition (element loop in the order of
// kernels/adamw.h, then QuantizeBlock); AdamWStepFused must equal it bit for bit.
//
// Functions are reentrant; OpenMP parallelism is internal (tiles are
// independent, so results do not depend on the thread count). Buffers of one
// call must not overlap each other. Every thread that runs part of an
// AdamWStepFused keeps about 820 KiB of scratch until it exits (made at its
// first step; kernels/cpu/adamw_band.cc).
#ifndef QTX_KERNELS_CPU_ADAMW_H_
#define QTX_KERNELS_CPU_ADAMW_H_

#include <cstdint>
#include <span>
#include <vector>

#include "kernels/adamw.h"
#include "kernels/quantize_params.h"

namespace qtx::kernels::cpu {

// One parameter's state, gradient and outputs for one step. Shapes are the
// row-major [m, n] matrix of the parameter (leading dims flattened).
struct AdamWParamBuffers {
  int64_t m = 0;
  int64_t n = 0;
  float* master = nullptr;     // [m, n] FP32, updated in place
  void* exp_avg = nullptr;     // [m, n] of moment_dtype, updated in place
  void* exp_avg_sq = nullptr;  // [m, n] of moment_dtype, updated in place
  MomentDType moment_dtype = MomentDType::kFloat32;
  const void* grad = nullptr;  // [m, n] of grad_dtype
  InputDType grad_dtype = InputDType::kFloat32;
  // FP8 output (quant.rowwise / quant.columnwise select the copies; buffers per
  // ComputeLayout(quant.scaling, m, n); scale padding written as 0).
  bool fp8_output = true;
  QuantizeParams quant;
  QuantizedBuffers fp8;
  uint16_t* bf16 = nullptr;  // optional [m, n] BF16 (RNE) copy of the updated master
  // This parameter's own step constants (its own weight decay or learning
  // rate within a group); null: the call's. Must outlive the call.
  const AdamWScalars* scalars = nullptr;
  // Optional, where UsesTileScales(quant) (ignored otherwise):
  // [ceil(m/128) * ceil(n/128)] floats, row-major over the tiles, read and
  // written: each tile's FP8 scale of the previous step (0: unknown). The
  // fused kernel encodes a tile while updating it with that scale, and keeps
  // the bytes when the tile's new scale equals it (a power-of-two scale
  // rarely moves between steps), instead of re-reading the updated master to
  // encode it afterwards; it then stores the new scales. Never changes the
  // results: a tile whose scale moved is encoded again with its new scale.
  float* tile_scales = nullptr;
};

// Whether the fused step reads and keeps AdamWParamBuffers::tile_scales for
// output `quant`: BLOCK_2D with power-of-two scales.
inline bool UsesTileScales(const QuantizeParams& quant) {
  return quant.scaling == BlockScaling::kBlock2D && quant.force_pow2_scales;
}

// Applies one AdamW step to every parameter and writes its outputs, with
// the constants `s`, or params[i].scalars where set. `num_threads` <= 0 uses
// the OpenMP default.
// REQUIRES: every buffer non-null and sized as described (exp_avg/exp_avg_sq
// may alias nothing else); quant valid (at least one copy, finite eps >= 0).
void AdamWStepFused(std::span<const AdamWParamBuffers> params, const AdamWScalars& s,
                    int num_threads = 0);

// The scalar reference: for each parameter, a plain element loop in the
// documented order, then QuantizeBlock(master) and the BF16 narrowing.
void AdamWReference(std::span<const AdamWParamBuffers> params, const AdamWScalars& s);

// Sum of squares of every gradient element, in double, plus whether every
// element is finite. Deterministic: fixed 4096-element chunks summed in order,
// independent of the thread count. REQUIRES: grad buffers as above.
struct GradNormResult {
  double sum_squares = 0.0;
  bool all_finite = true;
};
GradNormResult GradSumSquares(std::span<const AdamWParamBuffers> params, int num_threads = 0);

// The chunk sums GradSumSquares adds up, for one parameter: element c is the
// sum of squares of gradient elements [4096c, min(m*n, 4096(c+1))). Adding, in
// double and starting from 0, every element of the result for params[0], then
// params[1], ... in order gives exactly GradSumSquares(params).sum_squares —
// for a caller that receives the gradients one parameter at a time.
std::vector<double> GradChunkSumSquares(const AdamWParamBuffers& param, int num_threads = 0);

namespace internal {
// Instruction set of the band kernel (the update + FP8 output loop) that
// AdamWStepFused runs. Both give the same bytes; kAvx512 exists where the
// library was built for x86-64 with a compiler that knows -march=x86-64-v4.
enum class BandIsa : int { kBaseline = 0, kAvx512 = 1 };
// Whether `isa` is compiled in and this CPU can run it (kBaseline: always).
bool BandIsaAvailable(BandIsa isa);
// The ISA in use: the best available one, unless the environment variable
// QTX_ADAMW_ISA=baseline (read once, at first use) or SetBandIsa chose another.
BandIsa ActiveBandIsa();
// Selects `isa` for later calls (tests, benchmarks); false (and no change)
// when it is not available. Not to be called while a step runs.
bool SetBandIsa(BandIsa isa);

// How AdamWStepFused shares its work units (one 128-row band by up to 16
// tiles of one parameter) among its threads: N > 0 (default 4), each thread
// claims runs of N units from a shared counter until none are left, so that
// threads on less busy cores take more (runs are shortened, down to one unit,
// where a call has fewer than 4 N units per thread: ClaimRunLength); 0, each
// thread one contiguous run of as many units as the others. Both give the
// same bytes. For benchmarks and tests; false (and no change) for N < 0. Not
// to be called while a step runs.
int64_t UnitClaimChunk();
bool SetUnitClaimChunk(int64_t units);
// The run length that a call of `units` work units on `threads` threads
// claims: 0 for contiguous runs, else UnitClaimChunk() shortened to
// units / (4 threads), at least 1.
int64_t ClaimRunLength(int64_t units, int threads);

// The branch-free (vectorizable) FP32 -> FP8 encoder used by the fused kernel
// (of the active ISA); equals kernels::EncodeFp8 for every input. Exposed for
// its test.
uint8_t EncodeFp8Branchless(float x, Fp8Format f);
// The fused kernel's row encoder (of the active ISA): out[j] =
// EncodeFp8Branchless(p[j] * scale, f) for j < len (AVX2 blocks of 32 or
// AVX-512 blocks of 64 elements where built so, then a scalar tail). Exposed
// for its test.
void EncodeFp8Row(const float* p, float scale, uint8_t* out, int64_t len, Fp8Format f);
}  // namespace internal

}  // namespace qtx::kernels::cpu

#endif  // QTX_KERNELS_CPU_ADAMW_H_
