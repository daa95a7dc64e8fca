#!/usr/bin/env bash
# qtx on one GPU node without Kubernetes: the layout of deploy/k8s/node.yaml.
# Run once per node (srun --ntasks-per-node=1, see qtx_job.sbatch); it
#   1. starts the CUDA MPS control daemon (the stream-ordered path needs it),
#   2. starts one qtxd per GPU: qtxd-i on --device=cuda:i, bound with taskset
#      to its own CPUs (taken from GPU i's NUMA node when the machine says
#      which one, and the memory bound there too when numactl is installed),
#      --threads + --optimizer_threads = its CPU count, socket
#      $RUN_DIR/qtxd-i.sock, checkpoints in $CHECKPOINT_DIR/node-<node>/gpu-i,
#   3. waits until every qtxd is SERVING,
#   4. runs COMMAND (e.g. torchrun --nproc-per-node=8 ...) on the remaining
#      CPUs, with QTX_SOCKET_DIR / QTX_NUM_SIDECARS / QTX_SIDECAR_PIDS set:
#      local rank i uses unix://$QTX_SOCKET_DIR/qtxd-i.sock,
#   5. when COMMAND ends (or the job is cancelled: SIGTERM), stops every qtxd
#      with SIGTERM (each checkpoints its optimizer state) and MPS, and exits
#      with COMMAND's status (1 if a qtxd had died or did not stop cleanly).
#
#   qtx_node.sh [options] -- COMMAND [ARGS...]
#     --gpus=N              sidecars (default: GPUs nvidia-smi lists)
#     --cpus-per-qtxd=N     CPUs per sidecar (default: half the allowed CPUs / N)
#     --device=cuda|cpu     qtxd --device=cuda:i (default) or --device=cpu (tests)
#     --bin=DIR             folder with qtxd and qtx (default: next to this script's
#                           bundle, ../../build/{server,client/cli}, or $PATH)
#     --run-dir=DIR         sockets, logs, MPS pipes (default: /tmp/qtx-$SLURM_JOB_ID)
#     --checkpoint-dir=DIR  persistent, shared folder for optimizer checkpoints
#                           (default: none: optimizer state dies with qtxd)
#     --no-mps              do not start MPS
#     --qtxd-arg=ARG        extra qtxd flag (repeatable); {i} becomes the GPU index,
#                           {port} 50051+i, {host} this node's name, e.g.
#                           --qtxd-arg=--listen_tcp=0.0.0.0:{port} --qtxd-arg=--peer_host={host}
#     --dry-run             print the plan and exit
set -euo pipefail

die() { echo "qtx_node: $*" >&2; exit 2; }
log() { echo "qtx_node: $*" >&2; }

gpus=""
cpus_per=""
device=cuda
bin=""
run_dir=""
ckpt_dir=""
mps=1
dry=0
extra=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --gpus=*) gpus="${1#*=}" ;;
    --cpus-per-qtxd=*) cpus_per="${1#*=}" ;;
    --device=*) device="${1#*=}" ;;
    --bin=*) bin="${1#*=}" ;;
    --run-dir=*) run_dir="${1#*=}" ;;
    --checkpoint-dir=*) ckpt_dir="${1#*=}" ;;
    --no-mps) mps=0 ;;
    --qtxd-arg=*) extra+=("${1#*=}") ;;
    --dry-run) dry=1 ;;
    --) shift; break ;;
    *) die "unknown option '$1' (see the comment at the top of $0)" ;;
  esac
  shift
done
[[ $# -gt 0 || $dry -eq 1 ]] || die "no COMMAND after --"
[[ "$device" == cuda || "$device" == cpu ]] || die "--device=$device: must be cuda or cpu"

here="$(cd "$(dirname "$0")" && pwd)"
if [[ -z "$bin" ]]; then
  if [[ -x "$here/../../build/server/qtxd" ]]; then
    bin="$here/../../build"
  else
    bin="$(dirname "$(command -v qtxd || echo /nonexistent/qtxd)")"
  fi
fi
# A build folder (server/qtxd, client/cli/qtx) or a flat bin folder.
qtxd="$bin/server/qtxd"; [[ -x "$qtxd" ]] || qtxd="$bin/qtxd"
qtx="$bin/client/cli/qtx"; [[ -x "$qtx" ]] || qtx="$bin/qtx"
[[ -x "$qtxd" && -x "$qtx" ]] || die "no qtxd/qtx under --bin=$bin"

if [[ -z "$gpus" ]]; then
  if [[ "$device" == cpu ]]; then gpus=1
  else gpus="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)"; fi
fi
[[ "$gpus" =~ ^[0-9]+$ && "$gpus" -ge 1 ]] || die "--gpus=$gpus: need at least one GPU"

# The CPUs this task may use, as a list.
expand() {  # "0-3,8,10-11" -> "0 1 2 3 8 10 11"
  local part out=()
  IFS=, read -ra parts <<<"$1"
  for part in "${parts[@]}"; do
    if [[ "$part" == *-* ]]; then out+=($(seq "${part%-*}" "${part#*-}")); else out+=("$part"); fi
  done
  echo "${out[@]}"
}
compress() {  # "0 1 2 3 8 10 11" -> "0-3,8,10-11" (input in the order to keep)
  local out="" start="" prev="" c
  for c in "$@" ""; do
    if [[ -n "$prev" && "$c" == "$((prev + 1))" ]]; then prev="$c"; continue; fi
    if [[ -n "$start" ]]; then
      [[ "$start" == "$prev" ]] && out+=",$start" || out+=",$start-$prev"
    fi
    start="$c"; prev="$c"
  done
  echo "${out#,}"
}
# Test hooks (tests/deploy/slurm_node_test.sh plans an 8-GPU, 2-socket node on
# any machine): QTX_NODE_TEST_ALLOWED (CPU list), QTX_NODE_TEST_GPU_NUMA (one
# NUMA node per GPU), QTX_NODE_TEST_NUMA<n> (CPU list of NUMA node n).
cpus_of_node() {
  local v="QTX_NODE_TEST_NUMA$1"
  if [[ -n "${!v:-}" ]]; then echo "${!v}"; else cat "/sys/devices/system/node/node$1/cpulist"; fi
}
read -ra allowed <<<"$(expand "${QTX_NODE_TEST_ALLOWED:-$(awk '/^Cpus_allowed_list/ {print $2}' /proc/self/status)}")"
if [[ -z "$cpus_per" ]]; then
  cpus_per=$(( ${#allowed[@]} / (2 * gpus) ))
  (( cpus_per >= 1 )) || cpus_per=1
fi
[[ "$cpus_per" =~ ^[0-9]+$ && "$cpus_per" -ge 1 ]] || die "--cpus-per-qtxd=$cpus_per: must be >= 1"
threads=$(( cpus_per / 4 )); (( threads >= 1 )) || threads=1; (( threads <= 4 )) || threads=4
opt_threads=$(( cpus_per - threads )); (( opt_threads >= 1 )) || opt_threads=1

# GPU i's NUMA node (-1: unknown), from its PCI address, in PCI bus order
# (CUDA_DEVICE_ORDER=PCI_BUS_ID below makes cuda:i the same GPU).
numa_of_gpu=()
if [[ -n "${QTX_NODE_TEST_GPU_NUMA:-}" ]]; then
  read -ra numa_of_gpu <<<"$QTX_NODE_TEST_GPU_NUMA"
elif [[ "$device" == cuda ]] && command -v nvidia-smi >/dev/null; then
  while read -r bus; do
    bus="${bus,,}"; domain="${bus%%:*}"  # 00000000:18:00.0 -> sysfs 0000:18:00.0
    sysfs="/sys/bus/pci/devices/${domain: -4}:${bus#*:}/numa_node"
    numa_of_gpu+=("$(cat "$sysfs" 2>/dev/null || echo -1)")
  done < <(nvidia-smi --query-gpu=pci.bus_id --format=csv,noheader | sort)
fi

# Hand out CPUs: GPU i first from its NUMA node, then from anywhere.
declare -A taken=()
cpu_sets=()
for ((i = 0; i < gpus; ++i)); do
  node="${numa_of_gpu[$i]:--1}"
  pool=()
  if [[ "$node" -ge 0 ]] && cpus_of_node "$node" >/dev/null 2>&1; then
    read -ra pool <<<"$(expand "$(cpus_of_node "$node")")"
  fi
  pool+=("${allowed[@]}")
  mine=()
  for c in "${pool[@]}"; do
    (( ${#mine[@]} < cpus_per )) || break
    [[ " ${allowed[*]} " == *" $c "* && -z "${taken[$c]:-}" ]] || continue
    taken[$c]=1; mine+=("$c")
  done
  if (( ${#mine[@]} < cpus_per )); then
    log "only ${#allowed[@]} CPUs allowed: qtxd-$i shares CPUs"
    mine=("${allowed[@]:$(( (i * cpus_per) % ${#allowed[@]} )):$cpus_per}")
    (( ${#mine[@]} > 0 )) || mine=("${allowed[0]}")
  fi
  cpu_sets+=("$(compress "${mine[@]}")")
done
rest=()
for c in "${allowed[@]}"; do [[ -n "${taken[$c]:-}" ]] || rest+=("$c"); done
if (( ${#rest[@]} == 0 )); then
  log "no CPU left for COMMAND: it shares the sidecars' CPUs"
  rest=("${allowed[@]}")
fi
trainer_cpus="$(compress "${rest[@]}")"

node_rank="${SLURM_NODEID:-0}"
run_dir="${run_dir:-/tmp/qtx-${SLURM_JOB_ID:-$$}}"
for ((i = 0; i < gpus; ++i)); do
  dev="cpu"; [[ "$device" == cpu ]] || dev="cuda:$i"
  ck="-"; [[ -z "$ckpt_dir" ]] || ck="$ckpt_dir/node-$node_rank/gpu-$i"
  log "qtxd-$i device=$dev cpus=${cpu_sets[$i]} numa=${numa_of_gpu[$i]:--1} threads=$threads" \
      "optimizer_threads=$opt_threads socket=$run_dir/qtxd-$i.sock checkpoints=$ck"
done
log "COMMAND cpus=$trainer_cpus"
(( dry == 0 )) || exit 0

mkdir -p "$run_dir"
export CUDA_DEVICE_ORDER=PCI_BUS_ID
if (( mps == 1 )) && [[ "$device" == cuda ]]; then
  export CUDA_MPS_PIPE_DIRECTORY="$run_dir/mps/pipe" CUDA_MPS_LOG_DIRECTORY="$run_dir/mps/log"
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  nvidia-cuda-mps-control -d || die "nvidia-cuda-mps-control -d failed"
  mps_started=1
fi

pids=()
command_pid=""
stop_all() {
  local status=0 i
  [[ -z "$command_pid" ]] || kill -TERM "$command_pid" 2>/dev/null || true
  for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for i in "${!pids[@]}"; do
    if wait "${pids[$i]}"; then :; else
      log "qtxd-$i exited with status $? (log: $run_dir/qtxd-$i.log)"; status=1
    fi
  done
  if [[ -n "${mps_started:-}" ]]; then echo quit | nvidia-cuda-mps-control || true; fi
  return $status
}
on_signal() { log "signal: stopping"; stop_all || true; exit 143; }
trap on_signal TERM INT

numactl_ok=0; command -v numactl >/dev/null && numactl_ok=1
host="$(hostname -f 2>/dev/null || hostname)"
for ((i = 0; i < gpus; ++i)); do
  dev="cpu"; [[ "$device" == cpu ]] || dev="cuda:$i"
  args=(--socket="$run_dir/qtxd-$i.sock" --device="$dev" --allow_client_shm
        --threads="$threads" --optimizer_threads="$opt_threads")
  if [[ -n "$ckpt_dir" ]]; then
    mkdir -p "$ckpt_dir/node-$node_rank/gpu-$i"
    args+=(--checkpoint_dir="$ckpt_dir/node-$node_rank/gpu-$i")
  fi
  for a in "${extra[@]}"; do
    a="${a//\{i\}/$i}"; a="${a//\{host\}/$host}"; args+=("${a//\{port\}/$((50051 + i))}")
  done
  bind=(taskset -c "${cpu_sets[$i]}")
  node="${numa_of_gpu[$i]:--1}"
  if (( numactl_ok == 1 )) && [[ "$node" -ge 0 ]]; then
    bind=(numactl --physcpubind="${cpu_sets[$i]}" --membind="$node")
  fi
  "${bind[@]}" "$qtxd" "${args[@]}" >"$run_dir/qtxd-$i.log" 2>&1 &
  pids+=("$!")
done

deadline=$(( SECONDS + 120 ))
for ((i = 0; i < gpus; ++i)); do
  until "$qtx" --target="unix://$run_dir/qtxd-$i.sock" --timeout=2s health >/dev/null 2>&1; do
    if ! kill -0 "${pids[$i]}" 2>/dev/null; then
      log "qtxd-$i died at start:"; tail -n 20 "$run_dir/qtxd-$i.log" >&2 || true
      stop_all || true; exit 1
    fi
    if (( SECONDS > deadline )); then
      log "qtxd-$i not SERVING after 120 s"; stop_all || true; exit 1
    fi
    sleep 0.2
  done
done
log "$gpus qtxd SERVING"

export QTX_SOCKET_DIR="$run_dir" QTX_NUM_SIDECARS="$gpus" QTX_SIDECAR_PIDS="${pids[*]}"
export CUDA_MODULE_LOADING=EAGER
taskset -c "$trainer_cpus" "$@" &
command_pid=$!
set +e
wait "$command_pid"
status=$?
set -e
command_pid=""
log "COMMAND exited with status $status; stopping the sidecars"
if ! stop_all; then (( status != 0 )) || status=1; fi
exit "$status"
