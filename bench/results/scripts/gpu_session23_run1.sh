#!/bin/bash
# Session 23's GPU run (one H200 machine), issue 16. Part "cuda":
#   the block kernel's GPU tests (every QuantizeBlockCuda test, the new half
#   tiles included: bit-exact with the CPU reference), then 8 rounds of the
#   1-D rowwise-only kernel with the L2 flushed before each launch, variants
#   default (128x128 tiles, 256-thread CTAs), stages3, half (64x128 units,
#   128-thread CTAs, 4 per SM) and half_stages3, at the four shapes of the issue.
# Part "host" (the machine's 16-core AVX-512 Xeon): the band kernel's tests with
#   both instruction sets (the per-tensor step's AVX-512 build had not run),
#   then an A/B of the per-tensor (TENSOR) host step before/after session 22's
#   change, with the 2-D step and torch's fused AdamW beside them, 4 rounds.
# Bundle: B/bin/{kernels_cuda_test,quantize_cuda_bench,kernels_cpu_adamw_test,
#   optimizer_cpu_bench_{before,after},optimizer_vs_torch.py}.
#   B/gpu_session23_run1.sh OUT cuda|host
B=$(cd "$(dirname "$0")" && pwd)
. "$B/gpu_env.sh" || exit 2
qtx_run_begin "$B" "${1:?out}"  # O, L, step NAME SECONDS CMD...
case "${2:?cuda|host}" in
  cuda)
    nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv >> "$L" 2>&1
    step block_tests 330 "$B/bin/kernels_cuda_test" --gtest_filter='*QuantizeBlockCuda*'
    for r in $(seq 1 8); do
      step "round$r" 60 bash -c "\"$B/bin/quantize_cuda_bench\" --iters 100 --l2 flush --modes 1d \
        --usages row --variants default,stages3,half,half_stages3 \
        --shapes 4096x4096,8192x8192,16384x7168,32768x4096 | \
        sed 's/^{/{\"round\":$r,/' >> \"$O/quantize_cuda_bench.jsonl\""
    done
    ;;
  host)
    { lscpu | grep -E 'Model name|^CPU\(s\)|L2|L3' | cut -c1-200; } >> "$L" 2>&1
    step adamw_test 150 "$B/bin/kernels_cpu_adamw_test"
    step adamw_test_baseline 150 env QTX_ADAMW_ISA=baseline "$B/bin/kernels_cpu_adamw_test"
    step tensor_ab 420 bash -c "OMP_WAIT_POLICY=passive python3 \"$B/bin/optimizer_vs_torch.py\" \
      --bench=before=\"$B/bin/optimizer_cpu_bench_before\" \
      --bench=after=\"$B/bin/optimizer_cpu_bench_after\" \
      --bench=block2d=\"$B/bin/optimizer_cpu_bench_after\" \
      --bench_flag=before=--scaling=tensor --bench_flag=after=--scaling=tensor \
      --m=8192 --n=8192 --max_threads=16 --reps=3 --rounds=4 --grad=fp32 --torch_impls=fused \
      > \"$O/tensor_ab.jsonl\""
    ;;
esac
grep -hE " rc=|^\[  (PASSED|FAILED) |FAILED  \]" "$L" | cut -c1-200 | head -40
