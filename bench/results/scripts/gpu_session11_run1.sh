#!/bin/bash
# The lead's first GPU run of session 11, from one bundle (B/bin: qtxd and the
# binaries below; B/py: the qtx package, B/tests: tests/python/gpu_test_optimizer.py):
#   B/gpu_session11_run1.sh OUT
# It ran on the binaries of commit 409d2d0: its variants exist in that tree only
# (bench/results/quantize_cuda_h200_session11_2026-12-02.md).
# 1) issue 16's kernel experiments (balanced grid, bulk-copy-engine loads):
#    their bit-exactness tests, quantize_cuda_bench round 1, ncu of one
#    launch per variant at 8192^2, round 2;
# 2) the SASS load/store opcodes of every QuantizeBlockKernel instantiation;
# 3) the channel tests on c000c6c's CUDA queue, and the optimizer's GPU tests
#    on the kept tile scales (session 10's unrun fourth run).
B=$(cd "$(dirname "$0")" && pwd)
. "$B/gpu_env.sh" || exit 2
qtx_run_begin "$B" "${1:?out}"  # O, L, step NAME SECONDS CMD...
export QTXD="$B/bin/qtxd"
V=${VARIANTS:-default,balanced,bulk,bulk_balanced}
SH=${SHAPES:-4096x4096,8192x8192,16384x7168,32768x4096}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv >> "$L" 2>&1
step tuned_exact 200 "$B/bin/kernels_cuda_test" \
  --gtest_filter='QuantizeBlockCuda.Tuned*:QuantizeBlockCuda.Dynamic*'
qtx_quantize_round 1 "$V" "$SH"
qtx_quantize_ncu ncu "$V" "$QTX_NCU_COUNTERS"
qtx_quantize_round 2 "$V" "$SH"
if command -v cuobjdump > /dev/null; then
  # Per QuantizeBlockKernel instantiation: its name, then each memory opcode and its count.
  cuobjdump -sass "$B/bin/quantize_cuda_bench" 2> /dev/null | awk '
    /Function : / { if (f) { print f; for (k in c) print "  " c[k], k; delete c }
                    f = ($0 ~ /QuantizeBlockKernel/) ? $3 : "" ; next }
    f && match($0, /(LDGSTS|UBLKCP|UTMALDG|SYNCS|STG|LDG|ST\.|LDS|STS)[A-Z0-9_.]*/) {
      c[substr($0, RSTART, RLENGTH)]++ }
    END { if (f) { print f; for (k in c) print "  " c[k], k } }' > "$O/quantize_block_sass_ops.txt"
  echo "sass ops lines $(wc -l < "$O/quantize_block_sass_ops.txt")" >> "$L"
fi
for t in cuda_channel_test cuda_vmm_test; do
  step "$t" 200 "$B/bin/$t" --qtxd="$B/bin/qtxd"
done
step optimizer_cuda_e2e_test 100 "$B/bin/optimizer_cuda_e2e_test"
step optimizer_shard_cuda_e2e_test 100 "$B/bin/optimizer_shard_cuda_e2e_test"
qtx_host_cxx_runtime "$B/lib"
cp -f "$B"/bin/_native*.so "$B/py/qtx/"
step gpu_test_optimizer 100 python3 "$B/tests/gpu_test_optimizer.py" --qtxd="$B/bin/qtxd" \
  --python_dir="$B/py"
grep -hE " rc=|^\[  (PASSED|FAILED) |FAILED  \]|^(OK|FAILED)|Ran |sass" "$L" | cut -c1-200 | head -40
