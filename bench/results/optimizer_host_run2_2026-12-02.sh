#!/bin/bash
# Device run 2 (issue 16, host AdamW at memory speed): the final A/B. From the
# repo root: bash bundle-adamw/run2.sh (results under $OUT).
#   before: main's kernel (4-tile units, per-call scratch), after: this branch
#   (16-tile units, per-thread scratch), t32: after with 32-tile units, pf1: after prefetching 1 row ahead (not 2).
#   4096^2: 3 rounds next to torch's fused CPU AdamW (the working set, 288 MiB,
#   is about the size of this host's 300 MiB L3); 8192^2 (4.5 GiB: DRAM):
#   2 rounds, phases in round 0, triad bound.
B=bundle-adamw
export LD_LIBRARY_PATH=$PWD/$B/lib OMP_WAIT_POLICY=passive PYTHONUNBUFFERED=1
{ date -u; grep -m1 'model name' /proc/cpuinfo; nproc
  timeout 120 $B/bin/kernels_cpu_adamw_test; echo "rc(as is)=$?"
  QTX_ADAMW_ISA=baseline timeout 120 $B/bin/kernels_cpu_adamw_test; echo "rc(baseline)=$?"
} > $OUT/tests2.txt 2>&1
grep -E 'PASSED|FAILED|rc\(' $OUT/tests2.txt
ab="--bench=before=$B/bin/optimizer_cpu_bench_before --bench=after=$B/bin/optimizer_cpu_bench_after"
timeout 190 python3 $B/optimizer_vs_torch.py $ab --bench=t32=$B/bin/optimizer_cpu_bench_t32 --bench=pf1=$B/bin/optimizer_cpu_bench_pf1 \
  --m=4096 --n=4096 --max_threads=16 --reps=7 --rounds=3 --grad=fp32 --torch_impls=fused \
  > $OUT/ab_4096.jsonl 2> $OUT/ab.err; echo "4096 rc=$?"
timeout 150 python3 $B/optimizer_vs_torch.py $ab \
  --m=8192 --n=8192 --max_threads=16 --reps=5 --rounds=2 --grad=fp32 --torch_impls=fused \
  --phases > $OUT/ab_8192.jsonl 2>> $OUT/ab.err; echo "8192 rc=$?"
grep -h adamw_vs_torch $OUT/ab_4096.jsonl $OUT/ab_8192.jsonl | cut -c1-300
