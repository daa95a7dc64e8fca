// A device-to-device copy kernel of the bench's own (bench/stream_copy.cu):
// quantize_cuda_bench times it next to cudaMemcpyAsync to measure how fast a
// kernel can stream the same bytes on the device, the memory system's ceiling
// for the quantize kernels (which read and write as many bytes as the copy).
#ifndef QTX_BENCH_STREAM_COPY_H_
#define QTX_BENCH_STREAM_COPY_H_

#include <cuda_runtime.h>

#include <cstdint>

namespace qtx::bench {

// One launch shape of the copy kernel. Each thread moves `unroll` 16-byte
// words per step (all loads, then all stores); `ctas_per_sm` CTAs of `threads`
// threads per SM stride over the buffer (a persistent grid), or, when
// `ctas_per_sm` is 0, one step per thread over a grid as large as the buffer.
// `streaming`: evict-first loads and stores (ld/st.global.cs), else plain ones.
struct StreamCopyShape {
  const char* name;
  int threads;
  int ctas_per_sm;
  int unroll;
  bool streaming;
};

// The shapes quantize_cuda_bench times (variants "kcopy_<name>").
inline constexpr StreamCopyShape kStreamCopyShapes[] = {
    {"t512_c4_u1", 512, 4, 1, true},        {"t512_c4_u4", 512, 4, 4, true},
    {"t1024_c2_u4", 1024, 2, 4, true},      {"t256_c8_u8", 256, 8, 8, true},
    {"t512_c4_u4_plain", 512, 4, 4, false}, {"t256_flat_u4", 256, 0, 4, true},
};

// Copies `bytes` (a multiple of 16; both pointers 16-byte aligned) from `src`
// to `dst` on `stream` with `shape`. cudaErrorInvalidValue for a size or
// pointer that is not a multiple of 16 or an unknown shape.
cudaError_t StreamCopy(const void* src, void* dst, int64_t bytes, const StreamCopyShape& shape,
                       cudaStream_t stream);

}  // namespace qtx::bench

#endif  // QTX_BENCH_STREAM_COPY_H_
