# shellcheck shell=bash
# The environment of the GPU scripts (scripts/gpu_*.sh) in one place: each
# sources this file from its own folder, which is scripts/ when it runs from
# the repository and the bundle folder when it was copied into a bundle (copy
# gpu_env.sh along with it: scripts/make_gpu_python_bundle.sh does), with the
# repository's copy as the fallback when the working folder is its root:
#   . "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh" 2>/dev/null || . scripts/gpu_env.sh || exit 2
# Only defines functions; safe under `set -euo pipefail`.

# qtx_gpu_env LIB_DIR: LD_LIBRARY_PATH = LIB_DIR (a bundle's lib/), the
# host's NCCL ($QTX_NCCL_LIB, else the lib folder of the nvidia.nccl wheel of
# the host's python3), the host's CUDA 13 libraries (cuBLAS: the nvidia cu13
# wheel next to PyTorch, when there), then what was set before.
# CUDA_MODULE_LOADING=EAGER: the tests and benches park streams on qtxd, and a
# module loaded lazily while a stream is parked would wait behind it.
# NCCL_NVLS_ENABLE=0: no NVLink multicast on the lent GPU hosts.
qtx_gpu_env() {
  local lib="${1:?usage: qtx_gpu_env LIB_DIR}" nccl cu13
  nccl="${QTX_NCCL_LIB:-$(python3 -c "import nvidia.nccl,os;print(os.path.join(list(nvidia.nccl.__path__)[0],'lib'))" 2>/dev/null || true)}"
  cu13="$(python3 -c "import sysconfig,os;print(os.path.join(sysconfig.get_paths()['purelib'],'nvidia','cu13','lib'))" 2>/dev/null || true)"
  [ -d "$cu13" ] || cu13=""
  export LD_LIBRARY_PATH="$lib${nccl:+:$nccl}${cu13:+:$cu13}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export CUDA_MODULE_LOADING=EAGER NCCL_NVLS_ENABLE=0
}

# qtx_host_cxx_runtime LIB_DIR: removes a bundle's libstdc++ and libgcc_s
# (Debian 12's) so that qtxd and qtx._native load the host's newer ones, which
# PyTorch needs in the same process. For bundles whose tests import torch.
qtx_host_cxx_runtime() {
  rm -f "${1:?usage: qtx_host_cxx_runtime LIB_DIR}/libstdc++.so.6" "$1/libgcc_s.so.1"
}

# qtx_mps_start: starts a CUDA MPS control daemon with writable pipe and log
# folders ($CUDA_MPS_PIPE_DIRECTORY and $CUDA_MPS_LOG_DIRECTORY, exported;
# default /tmp/qtx-mps-pipe and /tmp/qtx-mps-log). Processes started after it
# run through MPS. Returns the daemon's status: non-zero means no MPS.
qtx_mps_start() {
  export CUDA_MPS_PIPE_DIRECTORY="${CUDA_MPS_PIPE_DIRECTORY:-/tmp/qtx-mps-pipe}"
  export CUDA_MPS_LOG_DIRECTORY="${CUDA_MPS_LOG_DIRECTORY:-/tmp/qtx-mps-log}"
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  nvidia-cuda-mps-control -d
}

# qtx_mps_stop: asks the daemon to quit and waits up to 15 s for the MPS
# server and control processes to be gone.
qtx_mps_stop() {
  echo quit | timeout 10 nvidia-cuda-mps-control || true
  local _
  for _ in $(seq 30); do
    pgrep -f "nvidia-cuda-mps-(server|control)" > /dev/null || return 0
    sleep 0.5
  done
}

# qtx_step LOG NAME SECONDS CMD...: runs CMD under `timeout SECONDS`,
# appending "##### NAME" and its output to LOG, then prints (and appends)
# "NAME rc=RC Ns". The step of the one-log run scripts (scripts/gpu_*_run.sh).
qtx_step() {
  local log="$1" n="$2" t="$3" s=$SECONDS
  shift 3
  echo "##### $n" >> "$log"
  timeout "$t" "$@" >> "$log" 2>&1
  echo "$n rc=$? $((SECONDS - s))s" | tee -a "$log"
}

# qtx_run_begin BUNDLE OUT: the start of a one-log run script from a bundle:
# O=OUT (made), L=OUT/log.txt, the bundle's environment (qtx_gpu_env
# BUNDLE/lib), QTXD=BUNDLE/bin/qtxd when the bundle has one (the tests built
# with a qtxd path, e.g. cuda_e2e_test, start $QTXD instead: they take no
# --qtxd flag), unbuffered Python, and `step NAME SECONDS CMD...` (qtx_step
# into L).
qtx_run_begin() {
  O="${2:?usage: qtx_run_begin BUNDLE OUT}"
  L="$O/log.txt"
  mkdir -p "$O"
  qtx_gpu_env "${1:?usage: qtx_run_begin BUNDLE OUT}/lib"
  if [ -x "$1/bin/qtxd" ]; then export QTXD="$1/bin/qtxd"; fi
  export PYTHONUNBUFFERED=1
  step() { qtx_step "$L" "$@"; }
}

# The quantize kernel experiments' steps (bench/results/scripts/gpu_session11_run*.sh), for
# run scripts that called qtx_run_begin (they use `step`, B/bin/quantize_cuda_bench
# and write under O):
# qtx_quantize_round N VARIANTS [SHAPES]: round N of quantize_cuda_bench (both
# L2 methods, 1-D and 2-D, row+col and row, 100 launches each) over VARIANTS,
# appended to O/quantize_cuda_bench.jsonl with "round":N.
qtx_quantize_round() {
  local n="$1" v="$2" sh="${3:-4096x4096,8192x8192,16384x7168,32768x4096}"
  step "bench_round$n" 120 bash -c "\"$B/bin/quantize_cuda_bench\" --iters 100 --l2 both \
    --modes 1d,2d --usages row+col,row --variants $v --shapes $sh | \
    sed 's/^{/{\"round\":$n,/' >> \"$O/quantize_cuda_bench.jsonl\""
}

# qtx_quantize_rounds L2 USAGES VARIANTS: three rounds of quantize_cuda_bench
# (100 launches each, 1-D and 2-D, the four shapes of issue 16) with --l2 L2
# (flush, rotate or both) over USAGES and VARIANTS, appended to
# O/quantize_cuda_bench.jsonl with "round":1..3 (session 19's runs).
qtx_quantize_rounds() {
  local r
  for r in 1 2 3; do
    step "bench_round$r" 200 bash -c "\"$B/bin/quantize_cuda_bench\" --iters 100 --l2 $1 \
      --modes 1d,2d --usages $2 --variants $3 \
      --shapes 4096x4096,8192x8192,16384x7168,32768x4096 | \
      sed 's/^{/{\"round\":$r,/' >> \"$O/quantize_cuda_bench.jsonl\""
  done
}

# qtx_quantize_ncu NAME VARIANTS METRICS: Nsight Compute's METRICS (a comma
# list, or regex:...) of one launch of each variant at 8192^2 (1-D and 2-D,
# row+col and row, L2 flushed by ncu), as CSV in O/NAME.csv.
qtx_quantize_ncu() {
  local ncu
  ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
  step "$1" 120 bash -c 'o=$1; shift; "$@" > "$o"' _ "$O/$1.csv" "$ncu" --csv \
    --clock-control none -k regex:QuantizeBlockKernel --metrics "$3" \
    "$B/bin/quantize_cuda_bench" --iters 1 --warmup 0 --l2 flush --modes 1d,2d \
    --usages row+col,row --variants "$2" --shapes 8192x8192
}

# The counters of qtx_quantize_ncu that the session 11 runs collected: time,
# SM activity (the tail), DRAM and L2 traffic and throughput, launch shape.
QTX_NCU_COUNTERS=gpu__time_duration.sum,sm__cycles_active.avg,sm__cycles_active.min,\
sm__cycles_active.max,sm__cycles_elapsed.avg,dram__bytes_read.sum,dram__bytes_write.sum,\
lts__t_bytes.sum,lts__t_sectors_op_read.sum,lts__t_sectors_op_write.sum,\
lts__t_sectors_srcunit_tex_op_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,\
lts__throughput.avg.pct_of_peak_sustained_elapsed,launch__registers_per_thread,launch__grid_size
# ... and the warp stall reasons per issued instruction with the instruction counts.
QTX_NCU_STALLS='regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio',\
smsp__inst_executed.sum,smsp__issue_active.avg.pct_of_peak_sustained_active,\
sm__warps_active.avg.per_cycle_active

# qtx_ab_summary FILE: the summary of an interleaved A/B of
# optimizer_cpu_bench (scripts/gpu_adam17_ab.sh, gpu_session13_run1.sh): per
# (threads, label), the best and median step time over the rounds, then each
# round's, from FILE's "adamw_cpu" JSON lines.
qtx_ab_summary() {
  python3 - "${1:?usage: qtx_ab_summary FILE}" <<'PY'
import json, sys, collections
t = collections.defaultdict(list)
for line in open(sys.argv[1]):
    r = json.loads(line)
    t[(r["threads"], r["label"])].append(r["time_ms"])
for k in sorted(t):
    v = sorted(t[k])
    print(k, "best %.1f median %.1f" % (v[0], v[len(v) // 2]), [round(x, 1) for x in t[k]])
PY
}
