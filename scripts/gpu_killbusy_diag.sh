#!/bin/bash
# Run A of bench/results/gpu_session9_h200_2026-12-02.txt, from a bundle with qtxd and
# cuda_vmm_test (deploy/bundle/make_bundle.sh build B build/tests/client/cuda_vmm_test):
#   B/gpu_killbusy_diag.sh OUT
# Diagnose CudaVmmTest.KillBusyClient*: info-level qtxd logs, and stacks of
# every process 12 s after the kill if gdb exists.
B=$(cd "$(dirname "$0")" && pwd); O=${1:?out}; mkdir -p "$O"; L=$O/log.txt
# shellcheck source=scripts/gpu_env.sh
. "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh" 2>/dev/null || . scripts/gpu_env.sh || exit 2
qtx_gpu_env "$B/lib"
export QTX_TEST_QTXD_LOG_LEVEL=info
nvidia-smi -L >> "$L"; which gdb eu-stack >> "$L" 2>&1
for t in KillBusyClientVmm KillBusyClientIpc; do
  echo "##### $t" >> "$L"; s=$SECONDS
  timeout 100 "$B/bin/cuda_vmm_test" --qtxd="$B/bin/qtxd" --gtest_filter="*.$t" > "$O/$t.txt" 2>&1 &
  tp=$!
  for i in $(seq 1 60); do grep -q busy_child "$O/$t.txt" && break; sleep 0.5; done
  sleep 12
  echo "--- at $((SECONDS-s))s" >> "$L"
  nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv >> "$L" 2>&1
  nvidia-smi --query-gpu=utilization.gpu --format=csv >> "$L" 2>&1
  if which gdb >/dev/null 2>&1; then
    for p in $(pgrep -f "$B/bin/"); do echo "=== stacks of $p $(tr '\0' ' ' < /proc/$p/cmdline | cut -c1-150)" >> "$L";
      timeout 30 gdb -batch -p $p -ex "thread apply all bt 12" 2>/dev/null | grep -E "^Thread|^#" | grep -v "^#[0-9]* *0x0000" >> "$L"; done
  else
    for p in $(pgrep -f "$B/bin/"); do echo "=== $p $(tr '\0' ' ' < /proc/$p/cmdline | cut -c1-120)" >> "$L"; for t in /proc/$p/task/*; do echo "$(cat $t/comm) $(cat $t/wchan 2>/dev/null)" ; done | sort | uniq -c >> "$L"; done
  fi
  wait $tp; echo "$t rc=$? $((SECONDS-s))s" | tee -a "$L"
done
echo "##### whole" >> "$L"; s=$SECONDS
timeout 150 "$B/bin/cuda_vmm_test" --qtxd="$B/bin/qtxd" > "$O/whole.txt" 2>&1; echo "whole rc=$? $((SECONDS-s))s" | tee -a "$L"
grep -hE '^\{|^\[  (PASSED|FAILED|      OK) |FAILED  \]|Failure' "$O"/*.txt | head -60
