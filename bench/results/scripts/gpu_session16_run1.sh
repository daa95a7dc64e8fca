#!/bin/bash
# Session 16's first GPU run (one H200, no MPS): is cudaMemcpyAsync's
# device-to-device copy, faster than every SM copy kernel of the bench, done by
# a copy engine, and can a bulk-copy-engine (TMA) kernel launched from the SMs
# reach it?
#  1. quantize_cuda_bench --probe_memcpy: the copy of the 2-D 8192^2 row+col
#     bytes alone and beside a kernel that holds every SM for 2 ms, for
#     cudaMemcpyAsync and the bench's best copy kernel (the control);
#  2. quantize_cuda_bench, both L2 methods, 1-D and 2-D row+col, three rounds:
#     qtx's default kernel, the best SM copy kernel and four bulk copy shapes
#     (kcopy_bulk_*: chunk size, stages, CTAs per SM);
#  3. Nsight Compute's counters of one launch each at 8192^2, and the L2
#     sectors that crossed between the two L2 partitions (ltcfabric).
# Bundle: B/bin/quantize_cuda_bench.   B/gpu_session16_run1.sh OUT
B=$(cd "$(dirname "$0")" && pwd)
. "$B/gpu_env.sh" || exit 2
qtx_run_begin "$B" "${1:?out}"  # O, L, step NAME SECONDS CMD...
nvidia-smi -L >> "$L" 2>&1
step probe 60 bash -c "\"$B/bin/quantize_cuda_bench\" --iters 21 --probe_memcpy 134234112 \
  > \"$O/memcpy_probe.jsonl\""
cat "$O/memcpy_probe.jsonl" >> "$L"
V=default,kcopy_t512_c4_u4_plain,kcopy_bulk_c16k_s4_x2,kcopy_bulk_c32k_s3_x2,kcopy_bulk_c8k_s6_x4,kcopy_bulk_c64k_s3_x1
for r in 1 2 3; do
  step "bench_round$r" 120 bash -c "\"$B/bin/quantize_cuda_bench\" --iters 100 --l2 both \
    --modes 1d,2d --usages row+col --variants $V \
    --shapes 4096x4096,8192x8192,16384x7168,32768x4096 | \
    sed 's/^{/{\"round\":$r,/' >> \"$O/quantize_cuda_bench.jsonl\""
done
ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
step ncu 120 bash -c "\"$ncu\" --csv --clock-control none \
  -k regex:'QuantizeBlockKernel|StreamCopyKernel|BulkCopyKernel' \
  --metrics $QTX_NCU_COUNTERS \"$B/bin/quantize_cuda_bench\" --iters 1 --warmup 0 --l2 flush \
  --modes 2d --usages row+col --variants $V --shapes 8192x8192 > \"$O/ncu.csv\""
step ncu_fabric 120 bash -c "\"$ncu\" --csv --clock-control none \
  -k regex:'QuantizeBlockKernel|StreamCopyKernel|BulkCopyKernel' \
  --metrics gpu__time_duration.sum,lts__t_sectors.sum,lts__t_sectors_srcunit_tex.sum,lts__t_sectors_srcunit_ltcfabric.sum,lts__t_sectors_srcunit_tex_op_write.sum \
  \"$B/bin/quantize_cuda_bench\" --iters 1 --warmup 0 --l2 flush \
  --modes 2d --usages row+col --variants $V --shapes 8192x8192 > \"$O/ncu_fabric.csv\""
tail -5 "$O/ncu_fabric.csv" >> "$L"
grep -hE " rc=" "$L" | cut -c1-200 | head -20
