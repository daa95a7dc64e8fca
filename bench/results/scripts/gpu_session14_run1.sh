#!/bin/bash
# Session 14's first GPU run (one H200, no MPS):
#  1. every C++ GPU test binary, whole, without MPS: the first GPU run since
#     tests/testing/subprocess.cc moved from posix_spawn to fork+exec (its
#     children now fork from processes that hold a CUDA context);
#  2. quantize_cuda_bench, L2 flushed, 1-D / 2-D / tensor, row+col and row, the
#     default kernels next to the bench's own copy kernel in six launch shapes
#     (bench/stream_copy.h, variants kcopy_*), two rounds; then Nsight Compute's
#     counters of one launch each at 8192^2;
#  3. host AdamW next to torch's fused CPU AdamW, 8192^2, FP32 gradients, row+col
#     FP8: contiguous unit runs (static) against claimed runs of 4 and 1 units
#     (--claim_units), ROUNDS rounds (default 5), 1..16 threads.
# Bundle: B/bin/{the test binaries, qtxd, quantize_cuda_bench, optimizer_cpu_bench,
# optimizer_vs_torch.py}.   B/gpu_session14_run1.sh OUT
B=$(cd "$(dirname "$0")" && pwd)
. "$B/gpu_env.sh" || exit 2
qtx_run_begin "$B" "${1:?out}"  # O, L, step NAME SECONDS CMD...
nvidia-smi -L >> "$L" 2>&1
for t in cuda_device_test cuda_e2e_test optimizer_cuda_e2e_test optimizer_shard_cuda_e2e_test \
    nccl_communicator_test kernels_cuda_test; do
  step "$t" 240 "$B/bin/$t"
done
for t in cuda_plan_test cuda_allgather_channel_test cuda_channel_test cuda_param_allgather_test \
    cuda_vmm_test; do
  step "$t" 180 "$B/bin/$t" --qtxd="$B/bin/qtxd"
done
pkill -9 -f "$B/bin/qtxd" 2>/dev/null
K=kcopy_t512_c4_u1,kcopy_t512_c4_u4,kcopy_t1024_c2_u4,kcopy_t256_c8_u8,kcopy_t512_c4_u4_plain,kcopy_t256_flat_u4
for r in 1 2; do
  step "bench_round$r" 150 bash -c "\"$B/bin/quantize_cuda_bench\" --iters 100 --l2 flush \
    --modes 1d,2d,tensor --usages row+col,row --variants default,$K \
    --shapes 4096x4096,8192x8192,16384x7168,32768x4096 | \
    sed 's/^{/{\"round\":$r,/' >> \"$O/quantize_cuda_bench.jsonl\""
done
ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
step ncu 150 bash -c "\"$ncu\" --csv --clock-control none -k regex:'QuantizeBlockKernel|StreamCopyKernel' \
  --metrics $QTX_NCU_COUNTERS \"$B/bin/quantize_cuda_bench\" --iters 1 --warmup 0 --l2 flush \
  --modes 2d --usages row+col --variants default,$K --shapes 8192x8192 > \"$O/ncu.csv\""
export OMP_WAIT_POLICY=passive
lscpu | grep -E "Model name|^CPU\(s\)|L2|L3|NUMA node\(s\)" >> "$L" 2>&1
step adamw 420 bash -c "python3 \"$B/bin/optimizer_vs_torch.py\" --bench=static=\"$B/bin/optimizer_cpu_bench\" \
  --bench=claim4=\"$B/bin/optimizer_cpu_bench\" --bench_flag=claim4=--claim_units=4 --bench_flag=static=--triad_mib=512 --bench_flag=claim4=--triad_mib=512 --bench_flag=claim1=--triad_mib=512 \
  --bench=claim1=\"$B/bin/optimizer_cpu_bench\" --bench_flag=claim1=--claim_units=1 \
  --m=8192 --n=8192 --max_threads=16 --reps=5 --rounds=${ROUNDS:-5} --grad=fp32 --torch_impls=fused \
  > \"$O/adamw_vs_torch.jsonl\""
grep adamw_vs_torch "$O/adamw_vs_torch.jsonl" | cut -c1-300 >> "$L"
grep -hE " rc=|^\[  (PASSED|FAILED) |FAILED  \]" "$L" | cut -c1-200 | head -60
