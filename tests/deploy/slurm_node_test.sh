#!/usr/bin/env bash
# deploy/slurm/qtx_node.sh: the 8-GPU plan of a 2-socket node (test hooks),
# then a real run on this machine with two CPU sidecars: pinned to disjoint
# CPUs, SERVING, forming a group (CLI allgather), stepping an optimizer group,
# checkpointing it at shutdown, and passing the command's exit status on.
#   tests/deploy/slurm_node_test.sh BUILD_DIR
set -euo pipefail
build="$(cd "$1" && pwd)"
here="$(cd "$(dirname "$0")" && pwd)"
launcher="$here/../../deploy/slurm/qtx_node.sh"
qtx="$build/client/cli/qtx"
tmp="$(mktemp -d /tmp/qtx-slurm-test-XXXXXX)"
trap 'rm -rf "$tmp"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }

# 1. The plan for 8 GPUs on 224 CPUs in two NUMA nodes (SMT siblings +112).
plan="$(QTX_NODE_TEST_ALLOWED=0-223 QTX_NODE_TEST_GPU_NUMA="0 0 0 0 1 1 1 1" \
  QTX_NODE_TEST_NUMA0=0-55,112-167 QTX_NODE_TEST_NUMA1=56-111,168-223 \
  "$launcher" --bin="$build" --gpus=8 --cpus-per-qtxd=16 --checkpoint-dir=/ck --dry-run 2>&1)"
echo "$plan"
for want in \
  "qtxd-0 device=cuda:0 cpus=0-15 numa=0 threads=4 optimizer_threads=12" \
  "qtxd-3 device=cuda:3 cpus=48-55,112-119 numa=0 " \
  "qtxd-4 device=cuda:4 cpus=56-71 numa=1 " \
  "qtxd-7 device=cuda:7 cpus=104-111,168-175 numa=1 " \
  "checkpoints=/ck/node-0/gpu-7" \
  "COMMAND cpus=120-167,176-223"; do
  grep -qF -- "$want" <<<"$plan" || fail "plan lacks '$want'"
done

# 2. A real run: two CPU sidecars on this machine.
cat >"$tmp/job.sh" <<'JOB'
#!/usr/bin/env bash
set -euo pipefail
echo "$QTX_SIDECAR_PIDS" >"$OUT/pids"
[[ "$QTX_NUM_SIDECARS" == 2 ]] || { echo "QTX_NUM_SIDECARS=$QTX_NUM_SIDECARS"; exit 10; }
read -ra pids <<<"$QTX_SIDECAR_PIDS"
a0="$(taskset -pc "${pids[0]}" | sed 's/.*: //')"
a1="$(taskset -pc "${pids[1]}" | sed 's/.*: //')"
echo "affinity qtxd-0=$a0 qtxd-1=$a1" >"$OUT/affinity"
if (( $(nproc --all) >= 2 )); then
  [[ "$a0" != "$a1" ]] || { echo "sidecars share CPUs $a0"; exit 11; }
fi
s0="unix://$QTX_SOCKET_DIR/qtxd-0.sock"; s1="unix://$QTX_SOCKET_DIR/qtxd-1.sock"
"$QTX" --target="$s0" health | grep -q SERVING
"$QTX" --target="$s1" health | grep -q SERVING
"$QTX" --target="$s0" allgather --group=tp --world_size=2 --rank=0 --shape=60x256 \
    --usages=rowwise,columnwise >"$OUT/ag0" &
"$QTX" --target="$s1" allgather --group=tp --world_size=2 --rank=1 --shape=100x256 \
    --usages=rowwise,columnwise --coordinator="unix:$QTX_SOCKET_DIR/qtxd-0.sock" >"$OUT/ag1"
wait $!
grep -q "identical to Quantize(concat of the shards)" "$OUT/ag0"
grep -q "identical to Quantize(concat of the shards)" "$OUT/ag1"
"$QTX" --target="$s1" step --group=g --shape=32x300 --steps=2 >"$OUT/step"
exit "${JOB_EXIT:-0}"
JOB
chmod +x "$tmp/job.sh"
export QTX="$qtx" OUT="$tmp"
"$launcher" --bin="$build" --device=cpu --gpus=2 --no-mps --run-dir="$tmp/run" \
    --checkpoint-dir="$tmp/ckpt" -- "$tmp/job.sh" 2>"$tmp/launcher.log" \
  || { cat "$tmp/launcher.log" "$tmp/run/"*.log; fail "launcher exit $?"; }
cat "$tmp/launcher.log" "$tmp/affinity" "$tmp/step"
grep -q "2 qtxd SERVING" "$tmp/launcher.log" || fail "no SERVING line"
grep -q "^step    2: " "$tmp/step" || fail "no step 2"
[[ -f "$tmp/ckpt/node-0/gpu-1/g.qtxopt" ]] || fail "qtxd-1 did not checkpoint group g at shutdown"
[[ ! -e "$tmp/ckpt/node-0/gpu-0/g.qtxopt" ]] || fail "group g checkpointed by qtxd-0"
[[ ! -e "$tmp/run/qtxd-0.sock" && ! -e "$tmp/run/qtxd-1.sock" ]] || fail "sockets left behind"
for pid in $(cat "$tmp/pids"); do
  ! kill -0 "$pid" 2>/dev/null || fail "qtxd $pid still running"
done

# 3. The command's failure is the launcher's status; the sidecars still stop.
set +e
JOB_EXIT=7 "$launcher" --bin="$build" --device=cpu --gpus=2 --no-mps --run-dir="$tmp/run2" \
    -- "$tmp/job.sh" 2>"$tmp/launcher2.log"
rc=$?
set -e
[[ $rc -eq 7 ]] || { cat "$tmp/launcher2.log"; fail "exit $rc, want the command's 7"; }
for pid in $(cat "$tmp/pids"); do
  ! kill -0 "$pid" 2>/dev/null || fail "qtxd $pid still running after a failed command"
done

# 4. Usage errors exit 2.
set +e
"$launcher" --bin="$build" --device=cpu --gpus=0 -- true 2>/dev/null; [[ $? -eq 2 ]] || fail "--gpus=0 not refused"
"$launcher" --bin="$build" --device=cpu --gpus=1 2>/dev/null; [[ $? -eq 2 ]] || fail "no command not refused"
"$launcher" --bin="$build" --frobnicate -- true 2>/dev/null; [[ $? -eq 2 ]] || fail "unknown option not refused"
set -e
echo "slurm node launcher test passed"
