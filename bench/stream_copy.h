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
// `bulk_chunk` > 0: the copy is done by the bulk copy engine instead (TMA,
// sm_90): one thread per CTA moves chunks of `bulk_chunk` bytes global ->
// shared -> global with cp.async.bulk, `stages` chunks in flight per CTA
// (`threads`, `unroll` and `streaming` are unused then).
struct StreamCopyShape {
  const char* name;
  int threads;
  int ctas_per_sm;
  int unroll;
  bool streaming;
  int bulk_chunk = 0;
  int stages = 0;
};

// The shapes quantize_cuda_bench times (variants "kcopy_<name>").
inline constexpr StreamCopyShape kStreamCopyShapes[] = {
    {"t512_c4_u1", 512, 4, 1, true},
    {"t512_c4_u4", 512, 4, 4, true},
    {"t1024_c2_u4", 1024, 2, 4, true},
    {"t256_c8_u8", 256, 8, 8, true},
    {"t512_c4_u4_plain", 512, 4, 4, false},
    {"t512_c4_u8_plain", 512, 4, 8, false},
    {"t1024_c2_u4_plain", 1024, 2, 4, false},
    {"t256_flat_u4_plain", 256, 0, 4, false},
    {"t256_c2_u8_plain", 256, 2, 8, false},
    {"t256_c2_u16_plain", 256, 2, 16, false},
    {"t512_c2_u8_plain", 512, 2, 8, false},
    {"t256_flat_u4", 256, 0, 4, true},
    {"bulk_c16k_s4_x2", 32, 2, 0, false, 16 << 10, 4},
    {"bulk_c8k_s6_x4", 32, 4, 0, false, 8 << 10, 6},
};

// Copies `bytes` (a multiple of 16; both pointers 16-byte aligned) from `src`
// to `dst` on `stream` with `shape`. cudaErrorInvalidValue for a size or
// pointer that is not a multiple of 16 or an unknown shape; a bulk shape on a
// device before sm_90 fails at launch (no kernel image).
cudaError_t StreamCopy(const void* src, void* dst, int64_t bytes, const StreamCopyShape& shape,
                       cudaStream_t stream);

// The read-only and write-only halves of the copy, with the same launch
// shapes (bulk shapes are refused: cudaErrorInvalidValue): StreamRead reads
// `bytes` of `src` and folds them into one 16-byte word per CTA, stored to
// `sink` (16 bytes a CTA: at most 16 * SMs * ctas_per_sm, or, for a flat
// grid, bytes / (threads * unroll) rounded up), so the loads cannot be dropped;
// StreamWrite fills `bytes` of `dst` with a word that depends on `seed`.
// quantize_cuda_bench times them to find the device's read and write rates,
// which bound a pass that only reads (an amax) or only writes.
cudaError_t StreamRead(const void* src, int64_t bytes, void* sink, const StreamCopyShape& shape,
                       cudaStream_t stream);
cudaError_t StreamWrite(void* dst, int64_t bytes, uint32_t seed, const StreamCopyShape& shape,
                        cudaStream_t stream);

// Launches, on `stream`, a kernel that holds every SM's thread slots and
// shared memory for `ns` nanoseconds (spinning on the global timer), so that
// no other kernel can start a CTA until it ends: a probe of whether an
// operation (cudaMemcpyAsync) runs on the SMs or on a copy engine.
cudaError_t LaunchSmHog(int64_t ns, cudaStream_t stream);

}  // namespace qtx::bench

#endif  // QTX_BENCH_STREAM_COPY_H_
