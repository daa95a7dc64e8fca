#!/bin/bash
# Session 16's second GPU run: Nsight Compute's range replay over one
# cudaMemcpyAsync (run 1 showed that it runs on the SMs) and one launch of the
# bench's best copy kernel, both copying the 2-D 8192^2 row+col bytes: the L2
# sectors each sends across the two L2 partitions (ltcfabric), its DRAM and L2
# traffic and time.
# ncu skipped the memcpy's range ("RecordStatusEmpty"), so the probe's
# cudaProfilerStart/Stop ranges were removed after this run (commit 269c146
# has them).
# Bundle: B/bin/quantize_cuda_bench.   B/gpu_session16_run2.sh OUT
B=$(cd "$(dirname "$0")" && pwd)
. "$B/gpu_env.sh" || exit 2
qtx_run_begin "$B" "${1:?out}"  # O, L, step NAME SECONDS CMD...
ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
"$ncu" --version >> "$L" 2>&1
M=gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sectors.sum,\
lts__t_sectors_srcunit_tex.sum,lts__t_sectors_srcunit_ltcfabric.sum,\
lts__throughput.avg.pct_of_peak_sustained_elapsed,sm__cycles_active.avg,sm__cycles_elapsed.avg
step ncu_range 120 bash -c "\"$ncu\" --csv --replay-mode range --metrics $M \
  \"$B/bin/quantize_cuda_bench\" --iters 3 --probe_memcpy 134234112 > \"$O/ncu_range.csv\" 2>&1"
step ncu_range_flush 120 bash -c "\"$ncu\" --csv --replay-mode range --cache-control all --metrics $M \
  \"$B/bin/quantize_cuda_bench\" --iters 3 --probe_memcpy 134234112 > \"$O/ncu_range_flush.csv\" 2>&1"
tail -30 "$O/ncu_range.csv" >> "$L"
grep -hE " rc=" "$L" | cut -c1-200 | head -20
