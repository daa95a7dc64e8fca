#!/bin/bash
# The lead's first GPU run of session 10, from a bundle made by
#   QTX_BUNDLE_SKIP='libcublas|libcublasLt' deploy/bundle/make_bundle.sh build B \
#     build/tests/client/cuda_vmm_test build/tests/client/cuda_channel_test \
#     build/tests/kernels/kernels_cuda_test
# with scripts/gpu_env.sh and this script copied into B:
#   B/gpu_session10_run.sh OUT
# 1. CudaVmmTest.KillBusyClientVmm alone at qtxd debug level, with the host's
#    view 10 s after the kill: GPU state, kernel log, every qtxd thread's
#    kernel wait (and kernel stack where readable). Close's stall report
#    (event=channel_close_slow) says what the channel waits on.
# 2. The GPU tests of issue 14 whole: cuda_vmm_test, cuda_channel_test,
#    kernels_cuda_test.
# 3. KillBusyClientVmm under MPS (only when 1 failed).
B=$(cd "$(dirname "$0")" && pwd)
. "$B/gpu_env.sh" || exit 2
qtx_run_begin "$B" "${1:?out}"  # O, L, step NAME SECONDS CMD...
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >> "$L" 2>&1
(dmesg | tail -5) > "$O/dmesg_before.txt" 2>&1

# killbusy NAME: the test alone with a look at the host 10 s after the kill.
killbusy() {
  local name="$1" s=$SECONDS out="$O/$1.txt"
  echo "##### $name" >> "$L"
  QTX_TEST_QTXD_LOG_LEVEL=debug timeout 90 "$B/bin/cuda_vmm_test" --qtxd="$B/bin/qtxd" \
    --gtest_filter='*.KillBusyClientVmm' > "$out" 2>&1 &
  local tp=$! i p t
  for i in $(seq 1 80); do grep -q busy_child "$out" && break; sleep 0.25; done
  sleep 10
  {
    echo "--- host view 10 s after the kill"
    nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv
    nvidia-smi --query-gpu=utilization.gpu,pstate --format=csv
    echo "--- dmesg"; dmesg 2>&1 | tail -15
    for p in $(pgrep -f "$B/bin/qtxd"); do
      echo "=== qtxd $p threads (comm wchan state)"
      for t in /proc/$p/task/*; do
        echo "$(basename "$t") $(cat "$t/comm") $(cat "$t/wchan" 2>/dev/null) $(awk '{print $3}' "$t/stat")"
      done
      for t in /proc/$p/task/*; do
        if grep -qv "^$" "$t/stack" 2>/dev/null; then
          echo "--- kernel stack of $(basename "$t") $(cat "$t/comm")"; head -12 "$t/stack"
        fi
      done
    done
  } >> "$L" 2>&1
  wait $tp
  echo "$name rc=$? $((SECONDS - s))s" | tee -a "$L"
  grep -E "channel_|busy_child|kill_busy|OK \]|FAILED|Failure" "$out" | cut -c1-400 >> "$L"
  grep -q "^\[       OK \]" "$out"
}

killbusy killbusy_nomps; kb=$?
step cuda_vmm_test 200 "$B/bin/cuda_vmm_test" --qtxd="$B/bin/qtxd"
step cuda_channel_test 90 "$B/bin/cuda_channel_test" --qtxd="$B/bin/qtxd"
step kernels_cuda_test 400 "$B/bin/kernels_cuda_test"
if [ "$kb" != 0 ] && qtx_mps_start; then
  killbusy killbusy_mps
  qtx_mps_stop
fi
grep -hE " rc=|^\[  (PASSED|FAILED) |FAILED  \]|channel_close_slow|kill_busy" "$L" | cut -c1-300 | head -60
