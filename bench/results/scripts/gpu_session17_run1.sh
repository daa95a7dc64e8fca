#!/bin/bash
# Session 17's first GPU run (one H200, no MPS):
#  1. kernels_cuda_test's QuantizeTensorCuda.* and shard tests: TensorAmax now
#     reduces a count of at most 8192 in one CTA, straight into the amax;
#  2. quantize_cuda_bench, 2-D and 1-D row+col, L2 flushed, three rounds: does
#     a copy whose CTAs each stream one contiguous range (kcopy_*_seq) come
#     closer to cudaMemcpyAsync than the grid-stride copies?
#  3. the host: is there a PMU in this VM (perf stat), and where one thread of
#     the AdamW + FP8 step spends its cycles (perf record, per symbol).
# Bundle: B/bin/{kernels_cuda_test, quantize_cuda_bench, optimizer_cpu_bench,
#   perf}.   B/gpu_session17_run1.sh OUT
B=$(cd "$(dirname "$0")" && pwd)
. "$B/gpu_env.sh" || exit 2
qtx_run_begin "$B" "${1:?out}"  # O, L, step NAME SECONDS CMD...
step kernels_cuda_tensor 150 "$B/bin/kernels_cuda_test" --gtest_filter='QuantizeTensorCuda.*:*Shard*'
V=default,kcopy_t512_c4_u4_plain,kcopy_t512_c4_u4_plain_seq,kcopy_bulk_c16k_s4_x2,kcopy_bulk_c16k_s4_x2_seq,kcopy_bulk_c8k_s6_x4,kcopy_bulk_c8k_s6_x4_seq
for r in 1 2 3; do
  step "bench_round$r" 120 bash -c "\"$B/bin/quantize_cuda_bench\" --iters 100 --l2 flush \
    --modes 1d,2d --usages row+col --variants $V \
    --shapes 4096x4096,8192x8192,16384x7168,32768x4096 | \
    sed 's/^{/{\"round\":$r,/' >> \"$O/quantize_cuda_bench.jsonl\""
done
P="$B/bin/perf"
step perf_stat 30 "$P" stat -e cycles,instructions,cache-misses -- sleep 0.2
step perf_record 200 "$P" record -e cycles:u -F 4000 -o "$O/perf.data" -- \
  "$B/bin/optimizer_cpu_bench" 8192 8192 1 20 fp32 --threads=1 --triad_mib=256
step perf_record_clock 200 "$P" record -e cpu-clock -F 4000 -o "$O/perf_clock.data" -- \
  "$B/bin/optimizer_cpu_bench" 8192 8192 1 20 fp32 --threads=1 --triad_mib=256
for f in perf perf_clock; do
  [ -s "$O/$f.data" ] && "$P" report -i "$O/$f.data" --no-children --sort symbol --stdio \
    2>/dev/null | grep -v '^#' | grep '%' | head -30 > "$O/$f.txt"
done
step perf_stat_step 200 "$P" stat -e cycles:u,instructions:u,L1-dcache-load-misses:u,LLC-load-misses:u \
  -- "$B/bin/optimizer_cpu_bench" 8192 8192 1 20 fp32 --threads=1 --triad_mib=256
grep -hE " rc=|^\[  (PASSED|FAILED) |FAILED  \]" "$L" | cut -c1-220 | head -40
