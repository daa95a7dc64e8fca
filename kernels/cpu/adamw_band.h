// Internal to kernels/cpu/adamw.cc: the band kernel of AdamWStepFused, compiled
// once per instruction set (adamw_band.cc with the library's -march, and
// adamw_band_avx512.cc = the same source with -march=x86-64-v4 where the
// compiler supports it); adamw.cc picks one at run time (BandIsa).
//
// Both translation units define everything in a namespace of their own
// (band::base, band::avx512) or an anonymous one, and use from headers only
// functions that inline completely: an out-of-line copy of a shared inline
// function compiled with AVX-512 could otherwise be the one the linker keeps
// and run on a CPU without it. Check after changing adamw_band.cc: `nm -C
// --defined-only adamw_band_avx512.cc.o | grep -v ' [trdb] '` lists only
// band::avx512 functions.
#ifndef QTX_KERNELS_CPU_ADAMW_BAND_H_
#define QTX_KERNELS_CPU_ADAMW_BAND_H_

#include <atomic>
#include <cstddef>
#include <cstdint>

#include "kernels/adamw.h"
#include "kernels/block_geometry.h"
#include "kernels/cpu/adamw.h"

namespace qtx::kernels::cpu::band {

// Tiles per work unit (one 128-row band by up to this many tiles): see
// adamw_band.cc. QTX_ADAMW_UNIT_TILES overrides it at compile time, for A/B
// builds of the benchmark only (bench/README.md, "Host AdamW at memory speed").
#ifndef QTX_ADAMW_UNIT_TILES
#define QTX_ADAMW_UNIT_TILES 16
#endif
constexpr int64_t kUnitTiles = QTX_ADAMW_UNIT_TILES;
static_assert(kUnitTiles >= 1 && kUnitTiles <= 256, "QTX_ADAMW_UNIT_TILES out of range");

// One non-empty parameter of a call.
struct ParamPlan {
  const AdamWParamBuffers* b = nullptr;
  QuantizedLayout layout;
  int64_t mb = 0, nb = 0;
  int64_t chunks = 0;      // work units per band: ceil(nb / kUnitTiles)
  int64_t first_unit = 0;  // index of unit (0, 0) in the flattened unit list
  // Per-tensor scaling (BlockScaling::kTensor): the units write no FP8 bytes
  // but fold max |p| of the updated weights (as MagnitudeBits: NaN ignored)
  // into *tensor_amax; the caller casts the tensor once every unit is done.
  std::atomic<uint32_t>* tensor_amax = nullptr;
  float tensor_scale = 0.0f;  // EncodeTensorUnits: the scale of that cast
};

// Which units of the flattened unit list a thread runs: [u0, u1) when
// `claim` is null; else runs of `chunk` units that the thread claims from
// `*claim` (fetch_add) until a claim reaches u1, so that a thread that runs
// faster (its core less busy with other work) takes more units.
struct UnitRange {
  int64_t u0 = 0, u1 = 0;
  std::atomic<int64_t>* claim = nullptr;
  int64_t chunk = 1;
};

// RunUnits: the units `range` of the flattened unit list of `plans`
// (first_unit ascending), in ascending order, with scratch of the calling
// thread. Ends with a store fence (the FP8 copies may be written with
// non-temporal stores). EncodeTensorUnits: the FP8 copies of the units in
// `range` that belong to per-tensor plans (tensor_amax set), every tile cast
// with the plan's tensor_scale; the other units are skipped. Also ends with a
// store fence.
#define QTX_ADAMW_BAND_DECLS                                                                \
  void RunUnits(const ParamPlan* plans, size_t num_plans, const UnitRange& range,           \
                const AdamWScalars& s);                                                     \
  void EncodeTensorUnits(const ParamPlan* plans, size_t num_plans, const UnitRange& range); \
  uint8_t EncodeFp8Branchless(float x, Fp8Format f);                                        \
  void EncodeFp8Row(const float* p, float scale, uint8_t* out, int64_t len, Fp8Format f);

namespace base {
QTX_ADAMW_BAND_DECLS
}  // namespace base
namespace avx512 {  // defined only where QTX_ADAMW_HAVE_AVX512 is set
QTX_ADAMW_BAND_DECLS
}  // namespace avx512

#undef QTX_ADAMW_BAND_DECLS

}  // namespace qtx::kernels::cpu::band

#endif  // QTX_KERNELS_CPU_ADAMW_BAND_H_
