// qtx_bench_inproc: a bench-only Python module (not part of the qtx package)
// that launches qtx's CUDA quantize kernel (kernels/cuda/quantize_block.h)
// in the calling process, on a stream the caller names. It is the fair
// baseline of bench/python_channel_bench.py: the same Python layer chain as
// the qtx.cuda one, with the quantize launched in-process instead of by qtxd.
//
//   quantize(input, dtype, m, n, mode, format, rowwise, columnwise, pow2, eps,
//            rowwise_data, rowwise_scale_inv, columnwise_data,
//            columnwise_scale_inv, stream)
// All pointers and the stream are integers (0 for a copy not requested);
// dtype: qtx.v1 numbers (1 float32, 2 bfloat16, 3 float16); mode 1 = 1-D,
// 2 = 2-D; format 1 = E4M3, 2 = E5M2 (qtx.cuda's numbering). Buffers are laid
// out as qtx.cuda.layout says. Raises RuntimeError on a CUDA error.
#include <cuda_runtime_api.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "kernels/cuda/quantize_block.h"
#include "kernels/quantize_params.h"

namespace py = pybind11;
namespace k = qtx::kernels;

namespace {

void Quantize(uintptr_t input, int dtype, int64_t m, int64_t n, int mode, int format, bool rowwise,
              bool columnwise, bool pow2, float eps, uintptr_t rd, uintptr_t rs, uintptr_t cd,
              uintptr_t cs, uintptr_t stream) {
  k::InputDType in;
  switch (dtype) {
    case 1:
      in = k::InputDType::kFloat32;
      break;
    case 2:
      in = k::InputDType::kBFloat16;
      break;
    case 3:
      in = k::InputDType::kFloat16;
      break;
    default:
      throw std::invalid_argument("dtype: 1 float32, 2 bfloat16, 3 float16");
  }
  k::QuantizeParams p;
  p.scaling = mode == 2 ? k::BlockScaling::kBlock2D : k::BlockScaling::kBlock1D;
  p.format = format == 2 ? k::Fp8Format::kE5M2 : k::Fp8Format::kE4M3;
  p.rowwise = rowwise;
  p.columnwise = columnwise;
  p.force_pow2_scales = pow2;
  p.amax_epsilon = eps;
  k::QuantizedBuffers out;
  out.rowwise_data = reinterpret_cast<uint8_t*>(rd);
  out.rowwise_scale_inv = reinterpret_cast<float*>(rs);
  out.columnwise_data = reinterpret_cast<uint8_t*>(cd);
  out.columnwise_scale_inv = reinterpret_cast<float*>(cs);
  const cudaError_t e = k::cuda::QuantizeBlock(reinterpret_cast<const void*>(input), in, m, n, p,
                                               out, reinterpret_cast<cudaStream_t>(stream));
  if (e != cudaSuccess) {
    throw std::runtime_error(std::string("QuantizeBlock: ") + cudaGetErrorName(e) + " (" +
                             cudaGetErrorString(e) + ")");
  }
}

}  // namespace

PYBIND11_MODULE(qtx_bench_inproc, m) {
  m.doc() = "bench-only: qtx's CUDA quantize kernel launched in-process (see the .cc)";
  m.def("quantize", &Quantize);
}
