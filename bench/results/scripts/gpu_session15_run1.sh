#!/bin/bash
# Session 15's first GPU run (one H200, no MPS):
#  1. the block quantize kernel's bit-exactness tests, now with the L2
#     prefetch size hints of the tile loads (LaunchTuning::l2_prefetch);
#  2. quantize_cuda_bench, both L2 methods, 1-D and 2-D, row+col and row:
#     default against l2pf128 / l2pf256 (cp.async ... .L2::128B / ::256B), and
#     the bench's best copy kernel shape with plain loads against the same
#     shape with ld.global.nc.L2::128B / ::256B loads, three rounds; then Nsight
#     Compute's counters of one launch each at 8192^2;
#  3. host AdamW next to torch's fused CPU AdamW, 8192^2, FP32 gradients, row+col:
#     the default build (2 rows of prefetch) against the 1-row build
#     (QTX_ADAMW_PREFETCH_ROWS=1), ROUNDS rounds (default 8).
# Bundle: B/bin/{kernels_cuda_test, quantize_cuda_bench, optimizer_cpu_bench,
# optimizer_cpu_bench_pf1, optimizer_vs_torch.py}, built at commit 79b79c9 (the l2pf* and
# kcopy_*_pf* variants were removed after this run).   B/gpu_session15_run1.sh OUT
B=$(cd "$(dirname "$0")" && pwd)
. "$B/gpu_env.sh" || exit 2
qtx_run_begin "$B" "${1:?out}"  # O, L, step NAME SECONDS CMD...
nvidia-smi -L >> "$L" 2>&1
step tests 240 "$B/bin/kernels_cuda_test" --gtest_filter='QuantizeBlockCuda.*:Shapes/QuantizeBlockCudaSmall.*:*/4096x4096:*/8208x4096:ColumnwiseFromRowwiseCuda.*'
V=default,l2pf128,l2pf256,kcopy_t512_c4_u4_plain,kcopy_t512_c4_u4_pf128,kcopy_t512_c4_u4_pf256
for r in 1 2 3; do
  step "bench_round$r" 150 bash -c "\"$B/bin/quantize_cuda_bench\" --iters 100 --l2 both \
    --modes 1d,2d --usages row+col,row --variants $V \
    --shapes 4096x4096,8192x8192,16384x7168,32768x4096 | \
    sed 's/^{/{\"round\":$r,/' >> \"$O/quantize_cuda_bench.jsonl\""
done
ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
step ncu 150 bash -c "\"$ncu\" --csv --clock-control none -k regex:'QuantizeBlockKernel|StreamCopyKernel' \
  --metrics $QTX_NCU_COUNTERS \"$B/bin/quantize_cuda_bench\" --iters 1 --warmup 0 --l2 flush \
  --modes 1d,2d --usages row+col --variants $V --shapes 8192x8192 > \"$O/ncu.csv\""
command -v nsys >> "$L" 2>&1
export OMP_WAIT_POLICY=passive
lscpu | grep -E "Model name|^CPU\(s\)|L2|L3|NUMA node\(s\)" >> "$L" 2>&1
step adamw 330 bash -c "python3 \"$B/bin/optimizer_vs_torch.py\" --bench=pf2=\"$B/bin/optimizer_cpu_bench\" \
  --bench=pf1=\"$B/bin/optimizer_cpu_bench_pf1\" \
  --bench_flag=pf2=--triad_mib=512 --bench_flag=pf1=--triad_mib=512 \
  --m=8192 --n=8192 --max_threads=16 --reps=5 --rounds=${ROUNDS:-8} --grad=fp32 --torch_impls=fused \
  > \"$O/adamw_vs_torch.jsonl\""
grep adamw_vs_torch "$O/adamw_vs_torch.jsonl" | cut -c1-300 >> "$L"
grep -hE " rc=|^\[  (PASSED|FAILED) |FAILED  \]" "$L" | cut -c1-200 | head -60
