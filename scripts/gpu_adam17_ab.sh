#!/bin/bash
# Interleaved A/B of host AdamW binaries on the GPU machine's host (issue 16):
# ROUNDS rounds (default 6), each running every variant once in turn (order
# reversed in odd rounds), optimizer_cpu_bench 8192^2, FP32 gradients, at 1
# and 16 threads, best of 5 steps; a small triad (64 MiB) per call. From
# bundle-adam17 with bin/optimizer_cpu_bench_{before,nostrip,after}:
#   bash B/gpu_adam17_ab.sh OUT
# Variants: before (2ed3236), nostrip (ac57f19: kept tile scales, columnwise
# copy at the last deferred row), after (2b69205: + columnwise strips),
# nokeep (after with --no_tile_scales). One JSON line per call.
B=$(cd "$(dirname "$0")" && pwd)
. "$B/gpu_env.sh" || exit 2
O=${1:?out}; mkdir -p "$O"
export LD_LIBRARY_PATH=$B/lib OMP_WAIT_POLICY=passive
V=(before nostrip after nokeep)
for r in $(seq 0 $(( ${ROUNDS:-6} - 1 ))); do
  order=("${V[@]}")
  if (( r % 2 )); then order=(nokeep after nostrip before); fi
  for v in "${order[@]}"; do
    case $v in
      nokeep) cmd=("$B/bin/optimizer_cpu_bench_after" --no_tile_scales) ;;
      *) cmd=("$B/bin/optimizer_cpu_bench_$v") ;;
    esac
    timeout 60 "${cmd[@]}" 8192 8192 16 5 fp32 --threads=1,16 --triad_mib=64 --label="$v" |
      grep adamw_cpu | sed "s/}\$/,\"round\":$r}/" >> "$O/ab.jsonl"
  done
done
qtx_ab_summary "$O/ab.jsonl"
