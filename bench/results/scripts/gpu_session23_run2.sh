#!/bin/bash
# Session 23's second GPU run, issue 16. Part "cuda": run 1 found 3 stages
# 7 % faster than the default 2 for the 1-D rowwise copy at 4096^2 (3.9 tiles
# per resident CTA) and up to 1 % slower at 8192^2 and 32768x4096. Here: where
# the pipeline depth pays, for 1-D and 2-D, rowwise and row+col, at 2048x4096
# (1.9 tiles per CTA) to 8192^2 (15.5), variants stages2 / stages3 (explicit)
# and half_stages3 (1-D rowwise), L2 flushed, 6 rounds.
# Part "host": the per-tensor host step's cast pass with its master weights
# prefetched 16 rows ahead (the default now) against 0 (session 22's), 8 and
# 32 (builds with QTX_ADAMW_ENCODE_PREFETCH_ROWS), 4 rounds, torch beside.
# Bundle: B/bin/{quantize_cuda_bench,optimizer_cpu_bench_pf{0,8,16,32},
#   optimizer_vs_torch.py}.   B/gpu_session23_run2.sh OUT cuda|host
B=$(cd "$(dirname "$0")" && pwd)
. "$B/gpu_env.sh" || exit 2
qtx_run_begin "$B" "${1:?out}"  # O, L, step NAME SECONDS CMD...
case "${2:?cuda|host}" in
  cuda)
    nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv >> "$L" 2>&1
    for r in $(seq 1 6); do
      step "round$r" 90 bash -c "\"$B/bin/quantize_cuda_bench\" --iters 100 --l2 flush --modes 1d,2d \
        --usages row,row+col --variants stages2,stages3,half_stages3 \
        --shapes 2048x4096,4096x4096,4096x6144,6144x6144,4096x12288,8192x8192 | \
        sed 's/^{/{\"round\":$r,/' >> \"$O/quantize_cuda_bench.jsonl\""
    done
    ;;
  host)
    step tensor_pf 420 bash -c "OMP_WAIT_POLICY=passive python3 \"$B/bin/optimizer_vs_torch.py\" \
      --bench=pf0=\"$B/bin/optimizer_cpu_bench_pf0\" --bench=pf8=\"$B/bin/optimizer_cpu_bench_pf8\" \
      --bench=pf16=\"$B/bin/optimizer_cpu_bench_pf16\" --bench=pf32=\"$B/bin/optimizer_cpu_bench_pf32\" \
      --bench_flag=pf0=--scaling=tensor --bench_flag=pf8=--scaling=tensor \
      --bench_flag=pf16=--scaling=tensor --bench_flag=pf32=--scaling=tensor \
      --m=8192 --n=8192 --max_threads=16 --reps=3 --rounds=4 --grad=fp32 --torch_impls=fused \
      > \"$O/tensor_pf.jsonl\""
    ;;
esac
grep -hE " rc=|^\[  (PASSED|FAILED) |FAILED  \]" "$L" | cut -c1-200 | head -40
