#!/bin/bash
# Session 13's one GPU-host run (CPU only; no GPU work): the host AdamW step's
# work unit width, an interleaved A/B of three builds of optimizer_cpu_bench
# that differ only in QTX_ADAMW_UNIT_TILES (kernels/cpu/adamw_band.h): 16 (the
# default), 32, 64 (a full-width band at n = 8192: each thread's part of every
# array is then one flat stream, as torch's fused AdamW reads it). Since the
# kept tile scales (AdamWParamBuffers::tile_scales) removed the deferred
# re-read of the master weights that made wider units lose in session 10, the
# width is measured again. 8192^2, FP32 gradients, row+col FP8, best of 5 steps
# at 1 and 16 threads, ROUNDS rounds (default 4), order reversed in odd rounds.
# Bundle: B/bin/optimizer_cpu_bench_u{16,32,64}.   B/gpu_session13_run1.sh OUT
B=$(cd "$(dirname "$0")" && pwd)
. "$B/gpu_env.sh" || exit 2
qtx_run_begin "$B" "${1:?out}"  # O, L, step NAME SECONDS CMD...
export OMP_WAIT_POLICY=passive
lscpu | grep -E "Model name|^CPU\(s\)|L2|L3|NUMA node\(s\)" >> "$L" 2>&1
V=(u16 u32 u64)
for r in $(seq 0 $(( ${ROUNDS:-4} - 1 ))); do
  order=("${V[@]}")
  if (( r % 2 )); then order=(u64 u32 u16); fi
  for v in "${order[@]}"; do
    timeout 60 "$B/bin/optimizer_cpu_bench_$v" 8192 8192 16 5 fp32 --threads=1,16 \
      --triad_mib=64 --label="$v" 2>> "$L" | grep adamw_cpu |
      sed "s/}\$/,\"round\":$r}/" >> "$O/ab.jsonl"
  done
done
qtx_ab_summary "$O/ab.jsonl" | tee -a "$L"
